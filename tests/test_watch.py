"""nt.watch: a loop the user wrote, watched from outside, made faster, and left as it was."""
from __future__ import annotations

import collections
import importlib
import signal
import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from nbtrain.data.moves import MoveLog, resolve_copies
from nbtrain.config import ConfigError
from nbtrain.watcher import Watcher


def data(n=256, features=16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, features, generator=g), torch.randint(0, 4, (n,), generator=g)


def net(dropout=0.2):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 4))


def train(model, opt, loader, epochs=2, every_step=None, losses=None):
    """The tutorial loop, as written; returns its losses (loss.item() every step)."""
    losses = [] if losses is None else losses
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if every_step:
                every_step(len(losses))
    return losses


def loader_of(x, y, seed=1, batch_size=32):
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def same_weights(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


QUIET = dict(progress=False, count_flops=False)


# -- watching only: the loop runs exactly as written -----------------------------------------
def test_optimize_false_changes_nothing_the_loop_computes():
    x, y = data()
    plain, watched = net(), net()
    opt_a, opt_b = torch.optim.Adam(plain.parameters(), 1e-2), torch.optim.Adam(watched.parameters(), 1e-2)
    torch.manual_seed(5)
    expected = train(plain, opt_a, loader_of(x, y))
    rng_after = torch.get_rng_state()
    torch.manual_seed(5)
    with nt.watch(optimize=False, progress=False) as run:   # FLOPs counted: no trace left
        got = train(watched, opt_b, loader_of(x, y))
    assert got == expected and same_weights(plain, watched)
    assert torch.equal(torch.get_rng_state(), rng_after)
    assert run.state == "finished" and run.step == 16 and run.epoch == 1
    assert run.model is watched and run.optimizer is opt_b


def test_the_records_hold_the_loops_own_losses_and_samples():
    x, y = data()
    model = net(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with nt.watch(optimize=False, log_every=4, **QUIET) as run:
        losses = train(model, opt, loader_of(x, y), epochs=1)
    records = run.records("train")
    assert [r["step"] for r in records] == [4, 8]
    for k, record in enumerate(records):
        assert record["loss"] == pytest.approx(sum(losses[4 * k:4 * k + 4]) / 4, rel=1e-6)
        assert record["samples"] == 4 * 32 and record["lr"] == 0.1
    assert run.summary()["samples"] == 256


def test_a_loss_on_another_device_than_the_models_is_kept_there_not_read_each_step(
        monkeypatch):
    # a CPU model whose loss is computed elsewhere (a CPU embedding in front of a GPU net;
    # "meta" stands in for the GPU): a read at each backward would be a sync every step
    from nbtrain.telemetry import timers as telemetry
    added = []
    add = telemetry.Interval.add
    monkeypatch.setattr(telemetry.Interval, "add",
                        lambda self, loss, samples: (added.append(loss), add(self, loss, samples)))
    model = nn.Linear(4, 2)
    with pytest.raises(NotImplementedError):   # meta's backward cannot reach the CPU weights
        with nt.watch(optimize=False, **QUIET):
            model(torch.randn(8, 4)).to("meta").sum().backward()
    assert len(added) == 1 and isinstance(added[0], torch.Tensor) and added[0].is_meta


def test_samples_come_from_the_loaders_batches_and_the_model_keeps_its_fast_path():
    """No hook on the model ever (it would travel with a pickle or a deepcopy); the global
    forward hooks only until the model is found; where the forward still needs watching
    (here: autocast) the model's own calls go through its class's __call__, and its
    layers keep nn.Module's fast path."""
    from torch.nn.modules import module as modules
    x, y = data()
    model = net(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    hooks, dtypes = [], []
    probe = model[0].register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))

    def check_and_evaluate(_steps):
        hooks.append((len(model._forward_pre_hooks) + len(model._forward_hooks),
                      len(modules._global_forward_pre_hooks) + len(modules._global_forward_hooks),
                      type(model).__call__ is not nn.Module.__call__))
        with torch.no_grad():   # an evaluation forward between steps: no training samples
            model(x[:100])
    with nt.watch(optimize=False, log_every=4, **QUIET) as run:
        train(model, opt, loader_of(x, y), epochs=1, every_step=check_and_evaluate)
    assert hooks == [(0, 0, False)] * 8   # no hook: each forward takes nn.Module's fast path
    assert [r["samples"] for r in run.records("train")] == [4 * 32, 4 * 32]
    dtypes.clear()
    with nt.watch(amp="bf16", log_every=4, **QUIET) as run:   # autocast: the call is watched
        train(model, opt, loader_of(x, y), epochs=1, every_step=check_and_evaluate)
    probe.remove()
    assert hooks[8:] == [(0, 0, True)] * 8
    assert dtypes[2::2] == [torch.bfloat16] * 7   # each step's forward after the first
    assert [r["samples"] for r in run.records("train")] == [4 * 32, 4 * 32]   # not the 100s
    assert type(model).__call__ is nn.Module.__call__ and "__call__" not in vars(type(model))


# -- what it changes ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [250, 256, 20])   # a shorter last batch, none, all in one
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("sampling", ["shuffle, own generator", "shuffle, global RNG",
                                      "in order", "its own sampler"])
@pytest.mark.parametrize("stop_after", [None, 3, 7])   # the whole epoch, or a loop that breaks
def test_batched_fetch_gives_the_loaders_batches_and_leaves_its_rng_as_the_loader_would(
        n, drop_last, sampling, stop_after):
    x, y = data(n)

    def loader():
        kwargs = dict(batch_size=32, drop_last=drop_last)
        if sampling == "its own sampler":   # a sampler torch's shortcut does not know
            kwargs["sampler"] = list(reversed(range(n)))
        else:
            kwargs["shuffle"] = sampling != "in order"
        if sampling == "shuffle, own generator":
            kwargs["generator"] = torch.Generator().manual_seed(3)
        return DataLoader(TensorDataset(x, y), **kwargs)

    def two_epochs(made):
        batches = []
        for _ in range(2):
            for i, batch in enumerate(made):
                batches.append(batch)
                if i == stop_after:
                    break
        return batches, made.generator.get_state() if made.generator is not None else None
    torch.manual_seed(11)
    plain, plain_generator = two_epochs(loader())
    plain_rng = torch.get_rng_state()
    torch.manual_seed(11)
    with nt.watch(**QUIET) as run:
        watched, watched_generator = two_epochs(loader())
    assert run.resolved["batched_fetch"][0] is True
    assert len(watched) == len(plain)
    for (a, b), (c, d) in zip(plain, watched):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert torch.equal(torch.get_rng_state(), plain_rng)
    if plain_generator is not None:
        assert torch.equal(watched_generator, plain_generator)


def test_batched_fetch_gives_the_loaders_own_batches_in_its_order():
    x, y = data(250)   # a last, shorter batch
    seen = []

    def model(xb):
        seen.append(xb.clone())
        return xb
    plain = [b for b in loader_of(x, y, seed=3)]
    generator_after = loader_of(x, y, seed=3)
    list(generator_after)
    with nt.watch(**QUIET) as run:
        loader = loader_of(x, y, seed=3)
        watched = [b for b in loader]
    assert run.resolved["batched_fetch"][0] is True
    assert len(watched) == len(plain) == 8
    for (a, b), (c, d) in zip(plain, watched):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert torch.equal(loader.generator.get_state(), generator_after.generator.get_state())


def test_bf16_autocast_really_runs_the_forward_in_bf16_and_gives_the_loss_fp32():
    dtypes = []

    class Probe(nn.Module):
        def forward(self, h):
            dtypes.append(h.dtype)
            return h
    x, y = data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), Probe(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    outputs = []
    with nt.watch(amp="bf16", **QUIET) as run:
        for xb, yb in loader_of(x, y):
            out = model(xb)
            outputs.append(out.dtype)
            F.cross_entropy(out, yb).backward()
            opt.step()
            opt.zero_grad()
    assert run.resolved["amp"] == ("bf16", "asked for")
    assert dtypes[0] == torch.float32 and set(dtypes[1:]) == {torch.bfloat16}   # found at call 1
    assert set(outputs) == {torch.float32}
    assert not torch.is_autocast_enabled("cpu")


def test_the_fused_kernel_is_the_optimizers_for_the_watch_only():
    x, y = data()
    model = net()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    flags = {k: opt.param_groups[0].get(k) for k in ("fused", "foreach")}
    during = []
    with nt.watch(**QUIET) as run:
        train(model, opt, loader_of(x, y), epochs=1,
              every_step=lambda n: during.append(opt.param_groups[0]["fused"]))
    assert run.resolved["optimizer_impl"][0] == "fused" and set(during) == {True}
    assert {k: opt.param_groups[0].get(k) for k in ("fused", "foreach")} == flags


# -- what it sees ------------------------------------------------------------------------------
def test_gradient_accumulation_and_two_optimizers_count_one_step_each_time():
    x, y = data()
    model = net()
    head, body = list(model[3].parameters()), list(model[0].parameters())
    opts = [torch.optim.SGD(head, 0.1), torch.optim.SGD(body, 0.1)]
    with nt.watch(optimize=False, log_every=2, **QUIET) as run:
        for i, (xb, yb) in enumerate(loader_of(x, y, batch_size=16)):
            F.cross_entropy(model(xb), yb).backward()
            if i % 2 == 1:   # two micro-batches per step
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
    assert run.step == 8 and run.batch_in_epoch == 16
    assert [r["samples"] for r in run.records()] == [64] * 4


def test_a_hugging_face_style_loop_with_dict_batches():
    class Output(dict):
        @property
        def loss(self):
            return self["loss"]

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(50, 8), nn.Linear(8, 2)

        def forward(self, input_ids, labels):
            logits = self.head(self.embed(input_ids).mean(1))
            return Output(loss=F.cross_entropy(logits, labels), logits=logits)
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    batches = [{"input_ids": torch.randint(0, 50, (8, 5)), "labels": torch.randint(0, 2, (8,))}
               for _ in range(6)]
    # amp="off": where the CPU has bf16 its trial comes first, and the count after it; torch's
    # FLOP formulas loaded, as after a process's first count: the count costs its steps alone
    importlib.import_module("torch.utils.flop_counter")
    with nt.watch(log_every=3, amp="off", progress=False) as run:   # FLOPs of keyword inputs
        for batch in batches * 40:   # a list, not a DataLoader; long enough to count
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
    assert run.step == 240 and [r["samples"] for r in run.records()] == [24] * 80
    assert run.resolved["flops_per_step"][0] > 0, run.resolved["flops_per_step"]


def test_an_evaluation_loop_without_backward_makes_no_step():
    x, y = data()
    model = net()
    with nt.watch(**QUIET) as run, torch.no_grad():
        for xb, _ in loader_of(x, y):
            model(xb)
    assert run.state == "finished" and run.step == 0 and run.records() == []


def test_the_diagnosis_names_a_host_read_every_step_and_kept_losses():
    x, y = data()
    model = net()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    kept = []
    with nt.watch(optimize=False, log_every=4, **QUIET) as run:
        train(model, opt, loader_of(x, y), epochs=1,
              every_step=lambda n: kept.append(F.cross_entropy(model(x[:4]), y[:4])))
    summary = run.summary()
    # each step's read follows its optimizer step: the last one's too is counted as its
    assert summary["host_reads_per_step"] == 1
    assert "reads tensors back to the host 1x per step" in summary["diagnosis"]
    assert "collates in-memory tensors sample by sample" in summary["diagnosis"]
    with nt.watch(optimize=False, log_every=4, **QUIET) as run:
        for xb, yb in loader_of(x, y):
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            kept.append(loss)   # the graph of every step, kept
    assert "keeps each step's loss with its graph" in run.summary()["diagnosis"]
    with nt.watch(optimize=False, log_every=4, **QUIET) as run:
        last = None
        for xb, yb in loader_of(x, y):
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            last = loss   # skorch's shape: the last step's result held until the next's
    assert "keeps each step's loss" not in run.summary()["diagnosis"]


def test_host_reads_are_counted_over_the_first_steps_then_torchs_methods_are_back():
    from nbtrain.watcher import READS_COUNTED_FOR
    x, y = data(2048)
    model = net()
    opt = torch.optim.Adam(model.parameters(), 1e-3)   # its own step counts call item() too
    patched = []
    with nt.watch(optimize=False, log_every=10, **QUIET) as run:
        train(model, opt, loader_of(x, y, batch_size=8), epochs=1,   # 256 steps
              every_step=lambda n: patched.append("item" in torch.Tensor.__dict__))
    assert patched[:READS_COUNTED_FOR - 1] == [True] * (READS_COUNTED_FOR - 1)
    assert patched[READS_COUNTED_FOR:] == [False] * (256 - READS_COUNTED_FOR)
    reads = [r["host_reads_per_step"] for r in run.records("train")]
    assert reads[1:] == [1.0] * (len(reads) - 1)   # loss.item(), and only that, every step
    assert run.summary()["host_reads_per_step"] == pytest.approx(1.0, abs=0.01)


def test_the_default_records_come_at_least_record_every_s_apart_once_reads_are_counted(monkeypatch):
    from nbtrain.watcher import settings
    monkeypatch.setattr(settings, "RECORD_EVERY_S", 3600.0)   # no record is due in this test
    x, y = data(2048)
    model = net()
    with nt.watch(optimize=False, **QUIET) as run:
        losses = train(model, torch.optim.SGD(model.parameters(), 0.1),
                       loader_of(x, y, batch_size=8), epochs=1)   # 256 steps
    records = run.records("train")
    # every 10 steps while host reads are counted (they are counted per record), then, the
    # steps never 3600 s apart, one every RECORDS_MERGED x 10 steps, and the last at the end
    assert [r["step"] for r in records] == [10, 20, 30, 130, 230, 256]
    assert [r["steps"] for r in records[3:]] == [100, 100, 26]
    assert records[3]["samples"] == 100 * 8
    assert records[3]["loss"] == pytest.approx(sum(losses[30:130]) / 100, rel=1e-5)
    assert records[3]["host_reads_per_step"] == pytest.approx(1.0)
    every, why = run.resolved["log_every"]
    assert every == 10 and "at least 3600000 ms and at most 100 steps apart" in why
    assert "log_every=10" in why


class NaNFrom(nn.Module):
    """net() whose output is NaN from its `bad`-th call on."""

    def __init__(self, bad: int):
        super().__init__()
        self.net, self.bad, self.calls = net(dropout=0.0), bad, 0

    def forward(self, x):
        self.calls += 1
        out = self.net(x)
        return out * float("nan") if self.calls >= self.bad else out


def test_a_non_finite_loss_stops_the_loop_as_soon_as_without_the_record_floor(monkeypatch):
    from nbtrain.watcher import settings
    monkeypatch.setattr(settings, "RECORD_EVERY_S", 3600.0)
    x, y = data(2048)
    model = NaNFrom(bad=57)
    with nt.watch(optimize=False, **QUIET) as run:
        train(model, torch.optim.SGD(model.parameters(), 0.1), loader_of(x, y, batch_size=8),
              epochs=1)
    # looked at every 10 steps: the interval from step 31 holds it at step 60, and is
    # recorded then, not at step 130 (its records merged) or at the end
    assert run.state == "stopped" and run.diverged and run.step == 60
    assert "non-finite at step 57" in run.message


def test_a_non_finite_loss_in_the_last_steps_ends_the_watch_stopped_not_finished():
    x, y = data(200)
    model = NaNFrom(bad=24)
    with nt.watch(optimize=False, log_every=10, **QUIET) as run:   # 25 steps: records at 10,
        train(model, torch.optim.SGD(model.parameters(), 0.1), loader_of(x, y, batch_size=8),
              epochs=1)                                         # 20, then 25 at the end
    assert run.step == 25 and run.diverged
    assert run.state == "stopped" and "non-finite at step 24" in run.message


def test_a_log_every_the_user_sets_is_kept_exactly(monkeypatch):
    from nbtrain.watcher import settings
    monkeypatch.setattr(settings, "RECORD_EVERY_S", 3600.0)
    x, y = data(2048)
    for settings in (dict(log_every=10), dict(config=nt.TrainConfig(log_every=20))):
        model = net()
        with nt.watch(optimize=False, **QUIET, **settings) as run:
            train(model, torch.optim.SGD(model.parameters(), 0.1), loader_of(x, y, batch_size=8),
                  epochs=1)
        every = settings.get("log_every") or settings["config"].log_every
        steps = [r["step"] for r in run.records("train")]
        assert steps == list(range(every, 256, every)) + [256]
        assert run.resolved["log_every"] == (every, f"asked for: a record every {every} step(s)")


# -- how it ends: Stop, the loop's error, Ctrl-C -------------------------------------------------
def test_stop_from_another_thread_ends_the_loop_at_a_step_boundary():
    x, y = data(2048)
    model, reference = net(dropout=0.0), net(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    started = threading.Event()

    def stop_soon():
        started.wait(10)
        run.stop()
    losses = []
    with nt.watch(optimize=False, **QUIET) as run:
        threading.Thread(target=stop_soon).start()
        train(model, opt, loader_of(x, y), epochs=50, every_step=lambda n: started.set(),
              losses=losses)
    assert run.state == "stopped" and 1 <= run.step < 50 * 64
    assert len(losses) == run.step   # the loop's own line after opt.step() ran for each step
    ref_opt = torch.optim.SGD(reference.parameters(), 0.1)
    steps, loader = iter(range(run.step)), loader_of(x, y)
    for xb, yb in (b for _ in range(50) for b in loader):
        if next(steps, None) is None:
            break
        ref_opt.zero_grad()
        F.cross_entropy(reference(xb), yb).backward()
        ref_opt.step()
    assert same_weights(model, reference)   # as after the last finished step


def test_the_loops_exception_comes_out_unchanged_and_the_run_keeps_its_records():
    x, y = data()
    model = net()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    boom = ValueError("my loop broke")

    def fail(n):
        if n == 6:
            raise boom
    with pytest.raises(ValueError) as info:
        with nt.watch(log_every=2, **QUIET) as run:
            train(model, opt, loader_of(x, y), every_step=fail)
    assert info.value is boom and "fail" in str(info.traceback[-1])
    assert run.state == "failed" and run.error is boom and run.step == 6
    assert [r["step"] for r in run.records()] == [2, 4, 6]
    assert_left_as_found()


def test_ctrl_c_interrupts_at_the_step_boundary_and_restores_the_handler():
    x, y = data()
    model = net()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    before = signal.getsignal(signal.SIGINT)

    def press(n):
        if n == 3:
            signal.raise_signal(signal.SIGINT)
    with nt.watch(**QUIET) as run:
        train(model, opt, loader_of(x, y), every_step=press)
    assert run.state == "interrupted" and run.step == 3
    assert signal.getsignal(signal.SIGINT) is before


# -- left as found --------------------------------------------------------------------------------
ORIGINALS = {name: getattr(torch.Tensor, name) for name in ("backward", "item", "tolist", "cpu",
                                                             "numpy", "to", "cuda")}
ITER = DataLoader.__iter__


CLIPS = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_)


def assert_left_as_found():
    from torch.nn.modules import module
    from torch.optim import optimizer
    for name, original in ORIGINALS.items():
        assert getattr(torch.Tensor, name) is original, name
    assert DataLoader.__iter__ is ITER
    assert (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_) == CLIPS
    assert not module._global_forward_pre_hooks and not module._global_forward_hooks
    assert not optimizer._global_optimizer_pre_hooks and not optimizer._global_optimizer_post_hooks
    assert Watcher.active is None and not torch.is_autocast_enabled("cpu")


def test_every_hook_and_patch_is_undone_and_the_users_objects_keep_their_settings():
    x, y = data()
    model = net()
    opt = torch.optim.AdamW(model.parameters(), 1e-3, foreach=False)
    loader = loader_of(x, y)
    groups = [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
    settings = (loader.batch_size, loader.num_workers, loader.pin_memory, loader.generator)
    with nt.watch(amp="bf16", **QUIET):
        train(model, opt, loader, epochs=1)
    assert_left_as_found()
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups] == groups
    assert (loader.batch_size, loader.num_workers, loader.pin_memory, loader.generator) == settings
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_watch_inside_a_watch_and_fit_inside_a_watch_are_clear_errors():
    x, y = data()
    with nt.watch(**QUIET):
        with pytest.raises(RuntimeError, match="already watching a loop"):
            with nt.watch(**QUIET):
                pass
        with pytest.raises(RuntimeError, match="nt.fit was called inside"):
            nt.fit(net(), (x, y), F.cross_entropy, progress=False)
    assert_left_as_found()


def test_a_setting_the_loop_decides_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="TrainConfig.lr belongs to your loop") as err:
        nt.watch(lr=1e-3)
    assert err.value.field == "lr"
    with pytest.raises(ConfigError, match="TrainConfig.epochs belongs to your loop"):
        nt.watch(nt.TrainConfig(epochs=3))
    with pytest.raises(ConfigError, match="amp"):
        nt.watch(amp="fp8")
    assert_left_as_found()


class SlowRows(torch.utils.data.Dataset):
    """A per-sample dataset that waits on each read, as one over files does (`in_worker`
    times as long in a worker process); it notes which process read each sample."""

    def __init__(self, n=256, sleep_s=0.002, in_worker=1.0):
        self.x, self.y = data(n)
        self.sleep_s, self.in_worker = sleep_s, in_worker

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        import os
        import time
        info = torch.utils.data.get_worker_info()
        time.sleep(self.sleep_s * (self.in_worker if info else 1.0))
        return self.x[i], self.y[i], torch.tensor(os.getpid() if info else 0)


def loaded_by_in_a_watch(dataset, epochs=3):
    """Train 3 epochs on `dataset` under a watch: (the run, the loader, the set of pids
    that loaded each batch); the batches checked equal, in order, to the loader's own."""
    model = net(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    unwatched = DataLoader(dataset, batch_size=32, shuffle=True,
                           generator=torch.Generator().manual_seed(4))
    plain = [b for _ in range(epochs) for b in unwatched]
    seen = []
    with nt.watch(amp="off", **QUIET) as run:   # a bf16 CPU's trial would come first
        loader = DataLoader(dataset, batch_size=32, shuffle=True,
                            generator=torch.Generator().manual_seed(4))
        for epoch in range(epochs):
            for xb, yb, pids in loader:
                seen.append((xb, yb, pids))
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
                opt.zero_grad()
    assert len(seen) == len(plain) == 8 * epochs
    for (a, b, _), (c, d, _) in zip(plain, seen):   # the same batches, in the same order
        assert torch.equal(a, c) and torch.equal(b, d)
    assert loader.num_workers == 0 and loader._iterator is None   # your loader as it was
    return run, loader, [set(p.tolist()) for _, _, p in seen]


def assert_no_worker_left(loaded_by):
    import psutil
    worker_pids = set().union(*loaded_by) - {0}
    alive = [p for p in worker_pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive
    assert_left_as_found()


def test_workers_tried_for_an_epoch_and_kept_where_its_batches_came_faster(monkeypatch):
    monkeypatch.setattr("nbtrain.watcher.loader.available_cores", lambda: 3)   # 2 workers
    monkeypatch.setattr("nbtrain.auto.budget.SHARE", 1.0)   # a trial at once
    monkeypatch.setattr("nbtrain.auto.workers.WORKER_START_S", 0.0)
    run, loader, loaded_by = loaded_by_in_a_watch(SlowRows())
    assert all(s == {0} for s in loaded_by[:8])               # epoch 1: in this process
    assert all(0 not in s for s in loaded_by[8:])            # then: worker processes
    workers, why = run.resolved["num_workers"]
    assert workers == 2 and "tried in epoch 2" in why and "kept" in why, why
    assert_no_worker_left(loaded_by)


def test_workers_that_lost_their_trial_epoch_are_stopped(monkeypatch):
    monkeypatch.setattr("nbtrain.watcher.loader.available_cores", lambda: 2)   # 1 worker
    monkeypatch.setattr("nbtrain.auto.budget.SHARE", 1.0)
    monkeypatch.setattr("nbtrain.auto.workers.WORKER_START_S", 0.0)
    run, loader, loaded_by = loaded_by_in_a_watch(SlowRows(in_worker=3.0))
    assert all(0 not in s for s in loaded_by[8:16])          # epoch 2: the trial
    assert all(s == {0} for s in loaded_by[16:])              # epoch 3: this process again
    workers, why = run.resolved["num_workers"]
    assert workers == 0 and "tried in epoch 2" in why and "again from epoch 3" in why, why
    assert_no_worker_left(loaded_by)


def test_workers_wait_until_a_lost_trial_would_cost_at_most_the_budget(monkeypatch):
    """A loop of 3 short epochs: a trial that lost would cost it ~its data wait, far more
    than 5% of the time run so far: no workers, and the reason."""
    monkeypatch.setattr("nbtrain.watcher.loader.available_cores", lambda: 3)
    run, loader, loaded_by = loaded_by_in_a_watch(SlowRows())
    assert all(s == {0} for s in loaded_by)
    workers, why = run.resolved["num_workers"]
    assert workers == 0 and "at most 5% of the time run so far" in why, why
    assert_left_as_found()


def test_a_worker_trial_counts_the_workers_start_in_what_it_could_cost(monkeypatch):
    """A budget that would take the epoch's data wait (SHARE 1.0) but not the start of
    the workers too (skorch's README program: a fork and the worker's first batch, ~40 ms,
    in a 1 s program): no trial, and the reason says what it counted."""
    monkeypatch.setattr("nbtrain.watcher.loader.available_cores", lambda: 3)
    monkeypatch.setattr("nbtrain.auto.budget.SHARE", 1.0)
    monkeypatch.setattr("nbtrain.auto.workers.WORKER_START_S", 600.0)
    run, loader, loaded_by = loaded_by_in_a_watch(SlowRows())
    assert all(s == {0} for s in loaded_by)
    workers, why = run.resolved["num_workers"]
    assert workers == 0 and "the workers' start" in why, why
    assert_left_as_found()


def test_a_setting_the_watch_does_not_apply_is_refused_not_ignored():
    with pytest.raises(ConfigError, match="TrainConfig.persistent_workers is not applied to a "
                                          "loop of your own"):
        nt.watch(persistent_workers=True)
    with pytest.raises(ConfigError, match="on_nan='skip' would skip your loop's update"):
        nt.watch(on_nan="skip")


def test_copies_to_the_gpu_resolve_off_on_the_cpu_with_the_reason():
    x, y = data()
    model = net()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with nt.watch(pin_memory=True, prefetch_to_device=True, **QUIET) as run:
        train(model, opt, loader_of(x, y), epochs=1)
    assert run.resolved["pin_memory"] == (False, "asked for, but there is no CUDA device: "
                                                 "nothing to pin for")
    ahead, why = run.resolved["prefetch_to_device"]
    assert ahead is False and "no CUDA device" in why, why


def test_the_loops_copies_decide_what_is_copied_ahead():
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)   # no GPU needed
    xb, yb = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)

    def log_of(*moves):
        log = MoveLog([xb, yb])
        log.moved = dict(moves)
        return log

    whole, part = log_of((0, cuda0), (1, cuda0)), log_of((0, cuda0))
    (pin, _), (ahead, why) = resolve_copies("auto", "auto", whole, False, True)
    assert pin and ahead and "copies 2 of its batch's 2 tensors to cuda:0" in why, why
    (pin, _), (ahead, why) = resolve_copies("auto", "auto", part, False, True)
    assert pin and ahead and "copies 1 of its batch's 2 tensors" in why   # yb stays the loop's
    (pin, why_pin), (ahead, why) = resolve_copies("auto", "auto", whole, False, False)
    assert (pin, ahead) == (False, False) and "overlaps little" in why and "type of their own" in why
    (pin, _), (ahead, why) = resolve_copies("auto", True, whole, False, False)
    assert (pin, ahead) == (False, True) and "from pageable memory" in why   # asked for: done
    (pin, _), (ahead, why) = resolve_copies("auto", True, log_of((0, cuda0), (1, cuda1)),
                                            False, True)
    assert (pin, ahead) == (False, False) and why.startswith("not possible: ") and "several" in why
    (pin, why_pin), (ahead, why) = resolve_copies("auto", "auto", log_of(), False, True)
    assert (pin, ahead) == (False, False) and "copied none" in why and "no copies ahead" in why_pin
    assert resolve_copies(False, "auto", whole, False, True)[0] == (False, "asked for")
    assert resolve_copies("auto", False, whole, True, False) == (
        (True, "your loop's own (DataLoader(pin_memory=True))"), (False, "asked for"))
    on_gpu = MoveLog([torch.zeros(2, device="meta")])
    assert "on the GPU already" in on_gpu.why_none()


def test_the_move_log_notes_cpu_tensors_the_loop_copies_to_the_gpu(monkeypatch):
    from nbtrain.data import moves
    monkeypatch.setattr(moves, "GPU", "meta")   # stands in for CUDA on a CPU
    xb, yb = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    log = MoveLog([xb, yb])
    log.note(xb, xb.to("meta"), None, None)
    log.note(torch.zeros(1), torch.zeros(1, device="meta"), None, None)   # not the batch's
    log.note(yb, yb.float(), torch.float32, None)                        # a copy on the CPU
    log.note(yb, yb.to("meta", torch.float16), torch.float16, None)     # converts: no copy ahead
    assert log.moved == {0: torch.device("meta")} and log.target() == torch.device("meta")
    assert moves.plain([xb, {"a": yb, "b": [xb]}, "name", 3])
    assert not moves.plain(collections.namedtuple("Batch", "x y")(xb, yb))
    assert not moves.plain(collections.UserDict(a=xb))


def test_num_threads_applies_for_the_watch_only():
    x, y = data()
    model = net()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    before, during = torch.get_num_threads(), []
    with nt.watch(num_threads=1, **QUIET) as run:
        train(model, opt, loader_of(x, y), epochs=1,
              every_step=lambda n: during.append(torch.get_num_threads()))
    assert set(during) == {1} and torch.get_num_threads() == before
    assert run.resolved["num_threads"] == (1, "asked for (for the watch only)")


# -- fp16: a GradScaler through the hooks (CPU autocast runs float16 too) ----------------------
def fp16_recipe(model, opt, batches, clip=None, poison=None):
    """torch's own recipe (the AMP docs): autocast the forward, scale the loss, unscale_
    before a clip, scaler.step, scaler.update. Returns the clip norms. The first forward
    stays float32: the watch finds the model there, and autocasts from the next one."""
    scaler, norms = torch.amp.GradScaler("cpu"), []
    for step, (xb, yb) in enumerate(batches):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=step > 0):
            out = model(xb)
        loss = F.cross_entropy(out.float(), yb)
        scaler.scale(loss).backward()
        if poison is not None and step == poison:
            model[0].weight.grad.fill_(float("inf"))
        if clip is not None:
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        scaler.step(opt)
        scaler.update()
    return norms, scaler


def plain_loop(model, opt, batches, clip=None, poison=None, grads_after=None):
    """The loop as written, without a scaler."""
    norms = []
    for step, (xb, yb) in enumerate(batches):
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        if poison is not None and step == poison:
            model[0].weight.grad.fill_(float("inf"))
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if grads_after is not None:
            grads_after.append(model[0].weight.grad is not None)
    return norms


def fp16_batches():
    x, y = data()
    return [(x[i:i + 32], y[i:i + 32]) for i in range(0, 256, 32)]


def test_amp_fp16_applies_autocast_and_a_grad_scaler_through_the_hooks():
    """The loop as written under nt.watch(amp='fp16') computes what torch's GradScaler
    recipe computes, bit for bit: the forward in float16, the scaled loss, the update."""
    batches = fp16_batches()
    reference, watched = net(dropout=0.0), net(dropout=0.0)
    opt_a = torch.optim.Adam(reference.parameters(), 1e-2, foreach=False)
    opt_b = torch.optim.Adam(watched.parameters(), 1e-2, foreach=False)
    _, scaler = fp16_recipe(reference, opt_a, batches)
    dtypes = []
    probe = watched[0].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    with nt.watch(amp="fp16", optimizer_impl="for-loop", **QUIET) as run:
        plain_loop(watched, opt_b, batches)
    probe.remove()
    assert run.resolved["amp"][0] == "fp16"
    assert dtypes == [torch.float32] + [torch.float16] * 7   # found at the first forward
    assert same_weights(reference, watched)
    assert run.scaler.get_scale() == scaler.get_scale()
    assert_left_as_found()


def test_amp_fp16_skips_a_step_whose_gradients_overflow_and_lowers_the_scale():
    batches = fp16_batches()
    reference, watched = net(dropout=0.0), net(dropout=0.0)
    opt_a = torch.optim.Adam(reference.parameters(), 1e-2, foreach=False)
    opt_b = torch.optim.Adam(watched.parameters(), 1e-2, foreach=False)
    _, scaler = fp16_recipe(reference, opt_a, batches, poison=3)
    grads_after = []
    with nt.watch(amp="fp16", optimizer_impl="for-loop", **QUIET) as run:
        plain_loop(watched, opt_b, batches, poison=3, grads_after=grads_after)
    assert same_weights(reference, watched) and run.step == 8
    assert grads_after == [True] * 8   # the skipped step's gradients are the loop's again
    assert run.scaler.get_scale() == scaler.get_scale() == 2.0 ** 15   # halved once
    assert opt_b.state[watched[0].weight]["step"] == 7   # the skipped step left Adam's state


@pytest.mark.parametrize("impl", ["for-loop", "fused"])
def test_amp_fp16_clips_the_true_gradients_where_the_loop_clips(impl):
    """clip_grad_norm_ in the loop sees the scaled gradients; the watch scales the limit
    along and returns the true norm, as scaler.unscale_ before the clip does (with a fused
    optimizer the limit is scaled on the device and the kernel unscales)."""
    batches = fp16_batches()
    reference, watched = net(dropout=0.0), net(dropout=0.0)
    opt_a = torch.optim.SGD(reference.parameters(), 0.5)
    opt_b = torch.optim.SGD(watched.parameters(), 0.5)
    expected, _ = fp16_recipe(reference, opt_a, batches, clip=0.1)
    with nt.watch(amp="fp16", optimizer_impl=impl, **QUIET):
        got = plain_loop(watched, opt_b, batches, clip=0.1)
    assert got == pytest.approx(expected, rel=1e-4) and max(got) < 10
    for a, b in zip(reference.parameters(), watched.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert_left_as_found()


def test_amp_fp16_clip_by_keyword_reads_no_tensor_on_the_host(monkeypatch):
    """clip_grad_norm_(params, max_norm=...) under an fp16 watch with a fused optimizer: the
    true norm, and no float() of a tensor (torch's clip reads a tensor limit so: a GPU sync
    every step)."""
    batches = fp16_batches()
    reference, watched = net(dropout=0.0), net(dropout=0.0)
    opt_a = torch.optim.SGD(reference.parameters(), 0.5)
    opt_b = torch.optim.SGD(watched.parameters(), 0.5)
    expected, _ = fp16_recipe(reference, opt_a, batches, clip=0.1)
    reads, norms, to_float = [], [], torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append(1) or to_float(t))
    with nt.watch(amp="fp16", optimizer_impl="fused", **QUIET):
        for xb, yb in batches:
            opt_b.zero_grad()
            F.cross_entropy(watched(xb), yb).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(watched.parameters(), max_norm=0.1))
            opt_b.step()
    assert reads == []
    monkeypatch.undo()
    assert [float(n) for n in norms] == pytest.approx(expected, rel=1e-4)
    for a, b in zip(reference.parameters(), watched.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert_left_as_found()


def test_amp_fp16_clip_without_its_limit_is_torchs_own_error():
    batches = fp16_batches()
    model = net(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), 0.5)
    with pytest.raises(TypeError, match="max_norm"), \
            nt.watch(amp="fp16", optimizer_impl="fused", **QUIET):
        xb, yb = batches[0]
        F.cross_entropy(model(xb), yb).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters())
    assert_left_as_found()


# -- channels_last (opt-in) --------------------------------------------------------------------
def conv_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 4))


def test_channels_last_lays_out_the_weights_and_inputs_in_nhwc_for_the_watch_only():
    x = torch.randn(64, 2, 8, 8, generator=torch.Generator().manual_seed(0))   # C > 1: NHWC differs
    y = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(1))
    reference, watched = conv_net(), conv_net()
    params = list(watched.parameters())
    seen = []
    probe = watched[0].register_forward_pre_hook(
        lambda m, args: seen.append((args[0].is_contiguous(memory_format=torch.channels_last),
                                     m.weight.is_contiguous(memory_format=torch.channels_last))))
    opt_a = torch.optim.SGD(reference.parameters(), 0.1)
    opt_b = torch.optim.SGD(watched.parameters(), 0.1)
    expected = train(reference, opt_a, loader_of(x, y, batch_size=16), epochs=1)
    with nt.watch(channels_last=True, amp="off", **QUIET) as run:
        got = train(watched, opt_b, loader_of(x, y, batch_size=16), epochs=1)
    probe.remove()
    # the first forward (where the watch finds the model) as written, then NHWC
    assert seen[0] == (False, False) and seen[1:] == [(True, True)] * 3
    assert run.resolved["channels_last"][0] is True
    assert got == pytest.approx(expected, rel=1e-4)
    assert list(watched.parameters()) == params and all(
        p.is_contiguous() for p in watched.parameters())   # laid out as before, same objects
    for a, b in zip(reference.parameters(), watched.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert_left_as_found()


def test_a_copy_ahead_goes_only_to_a_plain_move_of_the_tensor_as_it_was_copied(monkeypatch):
    from nbtrain.data import moves
    monkeypatch.setattr(moves, "GPU", "meta")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    meta = torch.device("meta")
    ahead = moves.AheadCopies({0, 1}, meta, pin=False)
    Pair = collections.namedtuple("Pair", "x y")   # default_collate keeps namedtuples
    batch, copies = ahead._copy(Pair(torch.zeros(4, 3), torch.zeros(4)))
    assert type(batch) is Pair and set(copies) == {id(batch.x), id(batch.y)}
    ahead.ready = dict(copies)
    x, y = batch
    assert ahead.take(x, None, torch.float16, None) is None   # x.to(float16): no GPU asked
    assert ahead.take(x, meta, torch.float16, None) is None   # to the GPU, converting
    ahead.ready = dict(copies)
    assert ahead.take(x, meta, None, None) is copies[id(x)][1]   # x.to(device): the copy
    assert ahead.take(x, meta, None, None) is None               # once
    y.add_(1)   # changed in place after its copy was made: the loop copies it itself
    assert ahead.take(y, meta, None, None) is None
    ahead.clear()
    assert ahead.ready == {}


def test_the_copies_ahead_reach_the_loops_own_to_with_meta_standing_in_for_cuda(monkeypatch):
    """The CUDA-only path on the CPU: the meta device stands in for a GPU (the loop trains
    there), torch.cuda's stream calls are stood in for. The loop copies xb and yb; from
    its third batch each `.to("meta")` gets the copy made one batch ahead, while the loop
    is handed its loader's own CPU batches, in the loader's order."""
    import contextlib
    from nbtrain.watcher import loader as watcher_module
    from nbtrain.data import moves

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(moves, "GPU", "meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream())
    monkeypatch.setattr(moves, "_record_copies", lambda moved, stream: None)
    pinned = []
    monkeypatch.setattr(watcher_module, "pinned_rows",   # pinning needs CUDA: noted instead
                        lambda t, index: pinned.append(1) or t.index_select(0, index))
    handed = []
    take = moves.AheadCopies.take
    monkeypatch.setattr(moves.AheadCopies, "take", lambda self, tensor, *asked: handed.append(
        tensor) or take(self, tensor, *asked))

    x, y = data()
    torch.manual_seed(0)
    model = nn.Linear(16, 4).to("meta")
    opt = torch.optim.SGD(model.parameters(), 0.1)
    given, copies = [], []
    loader = loader_of(x, y)
    with nt.watch(amp="off", optimizer_impl="for-loop", **QUIET) as run:
        for _ in range(2):
            for xb, yb in loader:
                given.append((xb, yb))
                xm, ym = xb.to("meta", non_blocking=True), yb.to("meta")
                copies.append(xm)
                opt.zero_grad()
                F.cross_entropy(model(xm), ym).backward()
                opt.step()
    assert run.resolved["prefetch_to_device"][0] is True, run.resolved["prefetch_to_device"]
    assert run.resolved["pin_memory"][0] is True and len(pinned) == 2 * (6 + 8)
    plain = loader_of(x, y)
    order = [b for _ in range(2) for b in plain]
    assert len(given) == len(order) == run.step == 16
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(given, order))
    assert all(xb.device.type == "cpu" for xb, _ in given)   # the loop's batches as they were
    # from the third batch each .to found a copy of the very tensor it was called on
    assert [t for t in handed] == [t for pair in given[2:] for t in pair]
    assert all(c.device.type == "meta" for c in copies)
    assert_left_as_found()


def test_a_loop_on_the_cpu_of_a_cuda_machine_copies_nothing_and_gets_torchs_to_back(
        monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    x, y = data()
    model = net()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    to_at_step = []
    with nt.watch(amp="off", **QUIET) as run:
        train(model, opt, loader_of(x, y), epochs=1,
              every_step=lambda n: to_at_step.append(torch.Tensor.to is ORIGINALS["to"]))
    ahead, why = run.resolved["prefetch_to_device"]
    assert ahead is False and "copied none of its batch's tensors to a GPU" in why, why
    assert run.resolved["pin_memory"][0] is False
    assert to_at_step[:2] == [False, True] and all(to_at_step[1:])   # undone at batch 2
    assert_left_as_found()



@pytest.mark.parametrize("poison", [None, 3])
def test_amp_fp16_hands_the_scale_to_a_fused_kernel_with_no_host_read(poison):
    """A fused optimizer (here on the CPU) unscales and skips on inf in its kernel, as
    GradScaler.step arranges it: the watch's inf check then reads nothing back, and the
    weights are the recipe's, a skipped step too."""
    batches = fp16_batches()
    reference, watched = net(dropout=0.0), net(dropout=0.0)
    opt_a = torch.optim.AdamW(reference.parameters(), 1e-2, fused=True)
    opt_b = torch.optim.AdamW(watched.parameters(), 1e-2)
    _, scaler = fp16_recipe(reference, opt_a, batches, poison=poison)
    reads = []
    with nt.watch(amp="fp16", optimizer_impl="fused", **QUIET) as run:
        item = torch.Tensor.item   # the watch's counting wrapper, over its first steps
        torch.Tensor.item = lambda t: reads.append(t.requires_grad) or item(t)
        try:
            plain_loop(watched, opt_b, batches, poison=poison)
        finally:
            torch.Tensor.item = item
    assert run.resolved["optimizer_impl"][0] == "fused"
    assert same_weights(reference, watched)
    assert run.scaler.get_scale() == scaler.get_scale()
    assert reads == []   # no found_inf.item(): the inf check stayed with the kernel
    assert not hasattr(opt_b, "grad_scale") and not hasattr(opt_b, "found_inf")
    assert "fused" not in opt_b.param_groups[0] or opt_b.param_groups[0]["fused"] is None
    assert_left_as_found()


def test_amp_fp16_with_fused_sgd_momentum_skips_a_first_step_without_a_garbage_buffer():
    """Fused SGD makes its momentum buffers on the first step even when the kernel skips it
    on inf; until every buffer exists the watch unscales and skips itself, so the first
    step's overflow leaves no buffer and the run follows the recipe."""
    batches = fp16_batches()
    reference, watched = net(dropout=0.0), net(dropout=0.0)
    opt_a = torch.optim.SGD(reference.parameters(), 0.1, momentum=0.9)
    opt_b = torch.optim.SGD(watched.parameters(), 0.1, momentum=0.9)
    fp16_recipe(reference, opt_a, batches, poison=0)
    with nt.watch(amp="fp16", optimizer_impl="fused", **QUIET) as run:
        plain_loop(watched, opt_b, batches, poison=0)
    assert run.resolved["optimizer_impl"][0] == "fused" and run.step == 8
    for a, b in zip(reference.parameters(), watched.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert_left_as_found()


@pytest.mark.parametrize("body, seen", [
    (lambda model, x: None, "no forward of a module with trainable parameters"),
    (lambda model, x: model(x), "the forward of your Linear, but no backward()"),
])
def test_a_watch_that_saw_no_training_step_says_so_and_what_it_saw(body, seen):
    model, x = nn.Linear(4, 2), torch.randn(8, 4)
    with pytest.warns(UserWarning, match="nt.watch saw no training step") as caught:
        with nt.watch(**QUIET) as run:
            body(model, x)
    assert run.state == "finished" and run.step == 0
    assert run.message == str(caught[0].message) and seen in run.message, run.message
