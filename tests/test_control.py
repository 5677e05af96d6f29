"""Stopping, interrupts, failures, non-finite losses, checkpoints and host syncs."""
import contextlib
import os
import signal
import threading
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt

from conftest import mlp, quick


def test_stop_from_another_thread_keeps_state(blobs):
    started = threading.Event()
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=100_000, log_every=1),
                 background=True, progress=False)
    run.subscribe(lambda r: started.set())
    assert started.wait(30)
    threading.Thread(target=run.stop).start()
    run.wait(30)
    assert run.state == "stopped" and 0 < run.step < 100_000
    assert run.history and run.optimizer.state   # kept, ready to resume


def press_ctrl_c_at(monkeypatch, step: int) -> None:
    """A SIGINT, as the notebook's stop button sends, once the train record of `step` is out."""
    original = nt.Run.emit

    def emit_then_press_ctrl_c(self, record, keep=True):
        original(self, record, keep)
        if record.get("kind") == "train" and record["step"] == step:
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(nt.Run, "emit", emit_then_press_ctrl_c)


@contextlib.contextmanager
def sigint_interrupts():
    """Python's own SIGINT handler while the block runs, the one before it afterwards: the
    tests may start with SIGINT ignored (a background job, nohup), and a press must reach
    the code under test."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_stops_at_the_step_boundary(blobs, monkeypatch):
    """A kernel interrupt is a SIGINT: the step in flight finishes, then the run ends."""
    press_ctrl_c_at(monkeypatch, 7)
    with sigint_interrupts():
        run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=50, log_every=1),
                     progress=False)
        restored = signal.getsignal(signal.SIGINT)
    # records arrive an interval late: step 7's is emitted as step 8 closes its interval
    assert run.state == "interrupted" and run.step == 8
    assert restored is signal.default_int_handler   # the handler before the fit, again


def test_keyboard_interrupt_inside_a_step_returns_an_interrupted_run(blobs):
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.calls = mlp(), 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 6:
                raise KeyboardInterrupt
            return self.net(x)
    run = nt.fit(Breaks(), blobs, F.cross_entropy, config=quick(max_steps=20, count_flops=False), progress=False)
    assert run.state == "interrupted" and run.step == 5
    assert all(p.grad is None for p in run.model.parameters())


def _train_straight_and_resumed(blobs, tmp_path, via):
    cfg = quick(max_steps=50, optimizer="adamw", scheduler="cosine", warmup_steps=5,
                batch_size=48, log_every=1, checkpoint_dir=str(tmp_path), checkpoint_every=27)

    def new_model():
        torch.manual_seed(1)
        return mlp(dropout=0.3)
    straight = new_model()
    nt.fit(straight, blobs, F.cross_entropy, config=cfg, progress=False)

    first = new_model()
    run = nt.fit(first, blobs, F.cross_entropy, config=cfg, background=True, progress=False)
    run.subscribe(lambda r: r.get("step") == 27 and run.stop())
    run.wait()
    torch.rand(100)   # the user does random things between runs: must not matter
    assert run.state == "stopped" and run.step in (27, 28)
    source = run if via == "run" else os.path.join(tmp_path, "last.pt")
    resumed_model = new_model()
    torch.nn.init.zeros_(resumed_model[0].weight)   # a different object, different weights
    resumed = nt.fit(resumed_model, blobs, F.cross_entropy, config=cfg, resume=source,
                     progress=False)
    return straight, resumed_model, resumed


def test_resume_from_a_run_is_bit_identical(blobs, tmp_path):
    straight, resumed_model, resumed = _train_straight_and_resumed(blobs, tmp_path, "run")
    assert resumed.step == 50
    for a, b in zip(straight.state_dict().values(), resumed_model.state_dict().values()):
        assert torch.equal(a, b)
    assert [r["step"] for r in resumed.records("train")] == list(range(1, 51))


def test_resume_from_a_checkpoint_file_is_bit_identical(blobs, tmp_path):
    straight, resumed_model, resumed = _train_straight_and_resumed(blobs, tmp_path, "path")
    for a, b in zip(straight.state_dict().values(), resumed_model.state_dict().values()):
        assert torch.equal(a, b)


def test_checkpoint_is_atomic_and_weights_only(blobs, tmp_path):
    run = nt.fit(mlp(), blobs, F.cross_entropy,
                 config=quick(max_steps=6, checkpoint_dir=str(tmp_path), checkpoint_every=2),
                 progress=False)
    assert os.listdir(tmp_path) == ["last.pt"]          # no temp files left behind
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    assert state["position"]["step"] == 6
    assert nt.TrainConfig.from_dict(state["config"]) == run.config
    assert {"model", "optimizer", "schedule", "scaler", "rng", "history"} <= set(state)


def test_bad_checkpoint_path_says_which(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        nt.fit(mlp(), (torch.randn(8, 8), torch.zeros(8, dtype=torch.long)), F.cross_entropy,
               resume=str(tmp_path / "missing.pt"), progress=False)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pt is not a readable nbtrain checkpoint"):
        nt.fit(mlp(), (torch.randn(8, 8), torch.zeros(8, dtype=torch.long)), F.cross_entropy,
               resume=str(junk), progress=False)


class NaNAfter(nn.Module):
    """Returns a non-finite output from its `bad`-th call on."""

    def __init__(self, bad):
        super().__init__()
        self.net, self.calls, self.bad = nn.Linear(8, 3), 0, bad

    def forward(self, x):
        self.calls += 1
        out = self.net(x)
        return out * float("nan") if self.calls == self.bad else out


def test_non_finite_loss_stops_and_names_the_step(blobs):
    run = nt.fit(NaNAfter(13), blobs, F.cross_entropy, config=quick(max_steps=100, log_every=5, count_flops=False),
                 progress=False)
    # found when the interval of steps 11-15 is read, as the epoch's last one (16) closes
    assert run.state == "stopped" and run.step == 16
    assert "non-finite at step 13" in run.message
    assert "non-finite at step 13" in run.summary_text()


def test_non_finite_loss_skip_skips_the_update(blobs):
    model = NaNAfter(3)
    run = nt.fit(model, blobs, F.cross_entropy,
                 config=quick(max_steps=10, on_nan="skip", optimizer="sgd"), progress=False)
    assert run.state == "finished"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sum(r.get("skipped_steps", 0) for r in run.records("train")) == 1


def test_skip_checks_every_micro_batch_of_an_accumulated_step(blobs):
    model = NaNAfter(3)   # calls 3 and 4 make step 2: the first of them is non-finite
    run = nt.fit(model, blobs, F.cross_entropy, progress=False,
                 config=quick(max_steps=5, on_nan="skip", grad_accum_steps=2, optimizer="sgd"))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sum(r.get("skipped_steps", 0) for r in run.records("train")) == 1


def test_a_batch_the_model_cannot_take(blobs):
    model = nn.Linear(5, 3)   # the data has 8 features
    with pytest.raises(nt.TrainingError) as err:
        nt.fit(model, blobs, F.cross_entropy, config=quick(max_steps=5), progress=False)
    text = str(err.value)
    assert "batch 0 of epoch 0" in text and "mat1 and mat2" in text
    assert err.value.run.state == "failed" and err.value.run.model is model


def test_a_loss_that_is_not_a_scalar(blobs):
    def per_sample(out, y):
        return F.cross_entropy(out, y, reduction="none")
    with pytest.raises(nt.TrainingError, match=r"scalar tensor; got a tensor of shape \(32,\)"):
        nt.fit(mlp(), blobs, per_sample, config=quick(max_steps=5), progress=False)


def test_a_dataset_with_mismatched_items_names_the_sample():
    class Ragged(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return torch.randn(7 if i == 23 else 8), 0
    with pytest.raises(nt.TrainingError) as err:
        nt.fit(mlp(), Ragged(), F.cross_entropy,
               config=quick(max_steps=5, num_workers=0, shuffle=False), progress=False)
    text = str(err.value)
    assert "loading batch 0 of epoch 0" in text
    assert "sample 23 has (a tensor of shape (7,)" in text


def test_wrong_train_data_type():
    with pytest.raises(TypeError, match="train_data must be a map-style Dataset"):
        nt.fit(mlp(), 42, F.cross_entropy, progress=False)
    with pytest.raises(ValueError, match="same length"):
        nt.fit(mlp(), (torch.randn(10, 8), torch.zeros(9)), F.cross_entropy, progress=False)


def test_the_loop_reads_the_host_once_per_interval(blobs, monkeypatch):
    reads = {"n": 0}
    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _original=original, **k):
            reads["n"] += 1
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counting)
    run = nt.fit(mlp(), blobs, F.cross_entropy,
                 config=quick(max_steps=500, log_every=50, shuffle=False), progress=False)
    monkeypatch.undo()
    assert run.step == 500
    intervals = len(run.records("train"))
    assert intervals >= 10
    assert intervals <= reads["n"] <= 2 * intervals, f"{reads['n']} reads, {intervals} intervals"


def test_resume_with_a_new_lr_uses_it(blobs):
    cfg = quick(max_steps=10, log_every=1)
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=cfg.replace(max_steps=4), progress=False)
    resumed = nt.fit(mlp(), blobs, F.cross_entropy, config=cfg.replace(lr=0.5), resume=run,
                     progress=False)
    assert resumed.records("train")[-1]["lr"] == 0.5


def test_resume_refuses_another_optimizer(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=2), progress=False)
    with pytest.raises(nt.ConfigError, match="optimizer='sgd' cannot resume a run trained with 'adamw'"):
        nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=4, optimizer="sgd"),
               resume=run, progress=False)


def test_background_run_reports_running_at_once(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=200), progress=False,
                 background=True)
    assert run.state == "running"
    run.wait()
    assert run.state == "finished"


def test_an_interval_is_read_only_after_the_next_one_is_queued(blobs, monkeypatch):
    """On a GPU, reading a loss waits for the queue to drain: reading interval i once the
    steps of i+1 are queued keeps the GPU busy while the host waits."""
    model, reads = NaNAfter(bad=-1), []   # counts forward calls, never goes non-finite
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda self: reads.append(model.calls) or original(self))
    run = nt.fit(model, blobs, F.cross_entropy, progress=False,
                 config=quick(max_steps=15, log_every=5, shuffle=False))
    monkeypatch.undo()
    assert reads == [10, 15, 15]   # steps 1-5 read after step 10; the last at the end
    assert [r["step"] for r in run.records("train")] == [5, 10, 15]


def test_a_non_finite_stop_keeps_the_last_good_checkpoint(blobs, tmp_path):
    from nbtrain import checkpoint as ckpt
    run = nt.fit(NaNAfter(13), blobs, F.cross_entropy, progress=False,
                 config=quick(max_steps=100, log_every=5, checkpoint_dir=str(tmp_path),
                              checkpoint_every=10))
    assert run.state == "stopped" and "non-finite at step 13" in run.message
    saved = ckpt.load(ckpt.path_in(tmp_path))
    assert saved["position"]["step"] == 10
    assert all(torch.isfinite(t).all() for t in saved["model"].values())


def test_the_non_finite_message_survives_a_subscriber_that_stops_the_run(blobs):
    run = nt.fit(NaNAfter(3), blobs, F.cross_entropy, progress=lambda r: r.subscribe(
        lambda rec: rec.get("first_nonfinite_step") and r.stop()),
        config=quick(max_steps=50, log_every=2))
    assert "loss became non-finite at step 3" in run.message


def test_a_record_shows_the_lr_its_steps_ran_with(blobs):
    runs, calls = [], {"n": 0}

    def loss_that_changes_the_lr(out, y):   # during step 16, the epoch's last
        calls["n"] += 1
        if calls["n"] == 16:
            runs[0].set_lr(0.5)
        return F.cross_entropy(out, y)
    run = nt.fit(mlp(), blobs, loss_that_changes_the_lr, progress=runs.append,
                 config=quick(max_steps=20, log_every=5, scheduler="constant", warmup_steps=0,
                              count_flops=False))
    lrs = {r["step"]: r["lr"] for r in run.records("train")}
    assert lrs[16] == 0.01 and lrs[20] == 0.5


def test_ctrl_c_while_fit_measures_its_settings_returns_an_interrupted_run(blobs, monkeypatch):
    """The first fit on a machine measures for seconds before step 1 (threads, workers,
    bf16, FLOPs): a press then ends it as one during training does, nothing trained."""
    from nbtrain.train import prepare

    def press_while_measuring(run, setup, model, key):
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the press did not arrive")
    monkeypatch.setattr(prepare, "settle_workers_and_threads", press_while_measuring)
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with sigint_interrupts():
        run = nt.fit(model, blobs, F.cross_entropy, progress=False,
                     config=quick(max_steps=50, num_threads="auto", count_flops=False))
    assert run.state == "interrupted" and run.step == 0 and run.model is model
    assert "interrupted before step 1" in run.message
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    monkeypatch.undo()
    again = nt.fit(model, blobs, F.cross_entropy, progress=False, resume=run,
                   config=quick(max_steps=5, count_flops=False))   # fit again: a fresh start
    assert again.state == "finished" and again.step == 5


@pytest.mark.parametrize("tool", ["lr_find", "profile"])
def test_ctrl_c_in_a_tool_ends_it_with_what_it_has(tool, blobs, monkeypatch):
    press_ctrl_c_at(monkeypatch, 5)
    with sigint_interrupts():
        if tool == "lr_find":
            result = nt.lr_find(mlp, blobs, F.cross_entropy, config=quick(), num_steps=40)
        else:
            result = nt.profile(mlp, blobs, F.cross_entropy, config=quick(log_every=1),
                                steps=30, warmup=2)
    assert result.run.state == "interrupted" and result.run.step < 30


def test_a_setup_that_takes_a_second_says_what_it_measures(blobs, monkeypatch, capsys):
    """fit(progress=True): after a second of setup a line names what is measured (tqdm
    writes it to stderr outside a notebook); it is gone when training starts."""
    from nbtrain.train import prepare
    from nbtrain.views import progress
    monkeypatch.setattr(progress, "SETUP_LINE_EVERY_S", 0.05)
    settle = prepare.settle_workers_and_threads

    def slow_probe(run, setup, model, key):
        time.sleep(1.4)
        return settle(run, setup, model, key)
    monkeypatch.setattr(prepare, "settle_workers_and_threads", slow_probe)
    run = nt.fit(mlp(), blobs, F.cross_entropy, progress=True,
                 config=quick(max_steps=5, count_flops=False))
    err = capsys.readouterr().err
    assert run.state == "finished" and "nbtrain: measuring threads and workers ..." in err, err
    assert run.measuring == "" and not any(t.name == "nbtrain-setup-line"
                                           for t in threading.enumerate())


def test_the_setup_line_ends_with_a_ctrl_c_during_setup(blobs, monkeypatch):
    from nbtrain.train import prepare

    def press_while_measuring(run, setup, model, key):
        time.sleep(1.2)   # the line is up
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the press did not arrive")
    monkeypatch.setattr(prepare, "settle_workers_and_threads", press_while_measuring)
    with sigint_interrupts():
        run = nt.fit(mlp(), blobs, F.cross_entropy, progress=True,
                     config=quick(max_steps=50, count_flops=False))
    assert run.state == "interrupted" and run.measuring == ""
    assert not any(t.name == "nbtrain-setup-line" for t in threading.enumerate())
