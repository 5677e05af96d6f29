"""Exact resume on every data path after every way a run can end, a property test over
random settings, and checkpoints that survive SIGKILL mid-write."""
import functools
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

import nbtrain as nt
from nbtrain import checkpoint as ckpt
from nbtrain.train import prepare
from nbtrain.config import FIELD_NAMES, SETTINGS
from nbtrain.data import loader_batches
from nbtrain.data.batches import LoaderBatches

from conftest import EndsOnce, Samples, mlp, quick, same_state

# what a CPU with avx512_bf16 does, on any CPU (conftest.bf16_cpu)
pytestmark = pytest.mark.usefixtures("bf16_cpu")

STEPS, CUT = 24, 11   # a run of 24 steps (16 batches an epoch), ended at step 11


def _data(blobs, path):
    return blobs if path == "tensors" else Samples(*blobs)


def _cfg(path, **more):
    workers = {"tensors": 0, "dataset, 0 workers": 0, "dataset, 2 workers": 2}[path]
    return quick(**{"max_steps": STEPS, "num_workers": workers, **more})


def _model(**kwargs):
    torch.manual_seed(7)
    return EndsOnce(**kwargs)


def _ended(path, ending, data, tmp_path):
    """A run of `path` ended at step CUT by `ending`; returns what to resume from."""
    if ending == "stop":
        stop_at = lambda run: run.subscribe(  # noqa: E731
            lambda r: run.stop() if r.get("step") == 10 else None)
        run = nt.fit(_model(), data, F.cross_entropy, config=_cfg(path, log_every=5),
                     progress=False, on_start=stop_at)
        return run
    if ending in ("interrupt", "failure"):
        error = KeyboardInterrupt if ending == "interrupt" else RuntimeError
        try:
            run = nt.fit(_model(error=error, at=CUT + 1), data, F.cross_entropy,
                         config=_cfg(path), progress=False)
        except nt.TrainingError as err:
            run = err.run
        assert run.state == ("interrupted" if ending == "interrupt" else "failed")
        assert run.step == CUT
        return run
    nt.fit(_model(), data, F.cross_entropy, progress=False,
           config=_cfg(path, max_steps=CUT, checkpoint_dir=str(tmp_path)))
    return ckpt.path_in(tmp_path)


@pytest.mark.parametrize("ending", ["stop", "interrupt", "failure", "checkpoint"])
@pytest.mark.parametrize("path", ["tensors", "dataset, 0 workers", "dataset, 2 workers"])
def test_resume_is_exact(blobs, tmp_path, path, ending):
    data = _data(blobs, path)
    straight = nt.fit(_model(), data, F.cross_entropy, config=_cfg(path), progress=False)
    source = _ended(path, ending, data, tmp_path)
    torch.manual_seed(999)   # what the notebook did in between must not matter
    resumed = nt.fit(_model(), data, F.cross_entropy, config=_cfg(path), resume=source,
                     progress=False)
    assert resumed.step == STEPS
    same_state(straight, resumed)


class AdamWThatIsInterrupted(torch.optim.AdamW):
    """AdamW that, right after its update number `at`, meets `what`: two Ctrl-C presses
    (SIGINT) inside its step, or an exception from the zero_grad that follows the update."""

    def __init__(self, params, lr, at=None, what=None):
        super().__init__(params, lr=lr)
        self.at, self.what, self.updates = at, what, 0

    def step(self, closure=None):
        loss = super().step(closure)
        self.updates += 1
        if self.updates == self.at and self.what == "Ctrl-C twice":
            os.kill(os.getpid(), signal.SIGINT)   # the first press: stop at the boundary
            os.kill(os.getpid(), signal.SIGINT)   # the second, with the update already in
        return loss

    def zero_grad(self, set_to_none=True):
        if self.updates == self.at and isinstance(self.what, type):
            self.at = None
            raise self.what("injected after the update")
        super().zero_grad(set_to_none)


@pytest.mark.parametrize("what", ["Ctrl-C twice", KeyboardInterrupt, RuntimeError])
def test_an_end_right_after_the_update_counts_that_step_and_resumes_exactly(blobs, what):
    def fit(resume=None, **ending):
        optimizer = functools.partial(AdamWThatIsInterrupted, lr=1e-2, **ending)
        try:
            return nt.fit(_model(), blobs, F.cross_entropy, resume=resume, progress=False,
                          config=quick(max_steps=8, optimizer=optimizer))
        except nt.TrainingError as err:
            return err.run
    straight = fit()
    ended = fit(at=3, what=what)
    assert ended.state in ("interrupted", "failed") and ended.step == 3
    assert sum(r["steps"] for r in ended.records("train")) == 3   # its record is kept too
    resumed = fit(resume=ended)
    assert resumed.step == 8
    same_state(straight, resumed)


def _measured_here(monkeypatch, workers: int, threads: int, amp: str) -> None:
    """What this kernel's timed probes pick: `workers` loader workers (for a per-sample
    dataset), `threads` training threads, `amp`."""
    def settle(run, setup, model, key):
        run.resolved["num_threads"] = (threads, f"measured {threads} thread(s) fastest")
        if isinstance(setup.batches, LoaderBatches):
            run.resolved["num_workers"] = (workers, f"measured {workers} worker(s) fastest")
            return loader_batches(setup.batches.dataset, run.config, workers)
        return setup.batches
    monkeypatch.setattr(prepare, "settle_workers_and_threads", settle)
    monkeypatch.setattr(prepare, "resolve_amp", lambda requested, device: (amp, "CPU has amx_bf16"))
    monkeypatch.setattr(prepare, "bf16_choice", lambda step, key, may_measure="", device=None: (amp, f"measured {amp}"))


@pytest.mark.parametrize("path", ["tensors", "dataset"])
def test_a_resume_keeps_the_timed_choices_of_the_run_it_resumes(blobs, tmp_path, monkeypatch,
                                                                 path):
    data = _data(blobs, path)
    cfg = quick(max_steps=4, amp="auto", num_threads="auto", num_workers="auto",
                count_flops=False, checkpoint_dir=str(tmp_path))
    _measured_here(monkeypatch, 0, 2, "bf16")
    first = nt.fit(mlp(), data, F.cross_entropy, config=cfg, progress=False)
    _measured_here(monkeypatch, 1, 1, "off")   # a new kernel on a busier machine picks others
    more = cfg.replace(max_steps=6, checkpoint_dir=None)
    kept = "kept from the run being resumed"
    for source in (first, ckpt.path_in(tmp_path)):
        threads = set()
        resumed = nt.fit(mlp(), data, F.cross_entropy, config=more,
                         resume=source, progress=False, on_start=lambda run: run.subscribe(
                             lambda record: record["kind"] == "train"
                             and threads.add(torch.get_num_threads())))
        assert resumed.resolved["num_threads"] == (2, f"{kept} (measured 2 thread(s) fastest)")
        assert resumed.resolved["amp"] == ("bf16", f"{kept} (measured bf16)")
        assert threads == {2}
        if path != "tensors":
            assert resumed.resolved["num_workers"] == (0, f"{kept} (measured 0 worker(s) fastest)")
    # a checkpoint written before the choices were kept still loads; it measures again
    state = ckpt.load(ckpt.path_in(tmp_path))
    del state["resolved"]
    ckpt.save(state, tmp_path / "old.pt")
    resumed = nt.fit(mlp(), data, F.cross_entropy, config=more,
                     resume=tmp_path / "old.pt", progress=False)
    assert resumed.step == 6 and resumed.resolved["num_threads"][0] == 1
    assert resumed.resolved["amp"][0] == "off"


# -- random settings: a clear ConfigError, or a run that trains ----------------------------------
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 3000), st.integers(2**63, 2**70),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from(["auto", "cpu", "cuda", "cuda:3", "mps", "off", "fp16", "bf16", "sgd",
                     "adamw", "AdamW", "radam", "cosine", "onecycle", "plateau", "fork", "skip",
                     "fused", "foreach", "for-loop", "x", ""]),
    st.tuples(st.floats(0, 1.2), st.floats(0, 1.2)),
)
# Not drawn: compile (torch.compile takes seconds a config), workers (processes), files.
DRAWN = [n for n in FIELD_NAMES if n not in ("compile", "num_workers", "persistent_workers",
                                             "prefetch_factor", "multiprocessing_context",
                                             "checkpoint_dir", "checkpoint_every",
                                             "store", "report_dir",   # files in the cwd
                                             "max_steps", "epochs")]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(DRAWN), ANY_VALUE, min_size=1, max_size=4))
def test_random_settings_raise_a_named_config_error_or_train(values):
    small = (torch.randn(64, 8), torch.randint(0, 3, (64,)))
    try:
        cfg = nt.TrainConfig(**{"device": "cpu", "max_steps": 3, **values})
    except nt.ConfigError as err:
        assert err.field in SETTINGS, (values, str(err))
        assert f"TrainConfig.{err.field}=" in str(err)
        return
    try:
        run = nt.fit(mlp(), small, F.cross_entropy, config=cfg, progress=False)
    except nt.ConfigError as err:   # what only the engine can check (no GPU, no fused kernel)
        assert err.field in SETTINGS, (values, str(err))
        return
    assert run.state in ("finished", "stopped"), (values, run.state, run.message)


# -- SIGKILL while checkpointing ------------------------------------------------------------------
TRAIN = """
import sys, torch
torch.set_num_threads(1)
sys.path.insert(0, {tests!r})
import nbtrain as nt
from torch.nn import functional as F
from conftest import Samples, mlp, quick
gen = torch.Generator().manual_seed(0)
x, y = torch.randn(256, 8, generator=gen), torch.randint(0, 3, (256,), generator=gen)
torch.manual_seed(0)
nt.fit(mlp(), (x, y), F.cross_entropy, progress=False,
       config=quick(max_steps={steps}, checkpoint_every=1, checkpoint_dir={folder!r}))
"""


def _straight(steps):
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 8, generator=gen), torch.randint(0, 3, (256,), generator=gen)
    torch.manual_seed(0)
    run = nt.fit(mlp(), (x, y), F.cross_entropy, progress=False, config=quick(max_steps=steps))
    return run, (x, y)


def test_a_checkpoint_killed_mid_write_still_loads_and_resumes_exactly(tmp_path):
    steps = 3000
    reference, data = _straight(steps)
    rng = random.Random(0)
    tests = str(Path(__file__).parent)
    for attempt in range(3):
        folder = tmp_path / f"kill{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", TRAIN.format(
            tests=tests, steps=steps, folder=str(folder))])
        deadline = time.monotonic() + 60
        while not (folder / "last.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.05, 0.5))   # at a random moment, most likely mid-write
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        state = ckpt.load(folder / "last.pt")   # loads, and passes its CRC check
        assert 0 < state["position"]["step"] < steps
        resumed = nt.fit(mlp(), data, F.cross_entropy, progress=False,
                         resume=folder / "last.pt", config=quick(max_steps=steps))
        for name, value in reference.model.state_dict().items():
            assert torch.equal(value, resumed.model.state_dict()[name]), (attempt, name)


# -- resuming with another batch size or accumulation ---------------------------------------------
class Sees(torch.nn.Module):
    """An MLP that keeps the id (first feature) of every sample it trains on."""

    def __init__(self):
        super().__init__()
        self.body, self.seen = mlp(), []

    def forward(self, x):
        if self.training:
            self.seen += x[:, 0].int().tolist()
        return self.body(x)


def _numbered(blobs):
    x, y = blobs
    x = x.clone()
    x[:, 0] = torch.arange(len(x))   # each sample's id
    return x, y


def _stopped_at(data, batches, batch_size):
    model = Sees()
    first = nt.fit(model, data, F.cross_entropy, progress=False,
                   config=quick(batch_size=batch_size, max_steps=batches, count_flops=False))
    assert (first.epoch, first.batch_in_epoch) == (0, batches)
    return model, first


@pytest.mark.parametrize("changes, start", [(dict(batch_size=16), 2),
                                            (dict(batch_size=4), 8),
                                            (dict(grad_accum_steps=2), 4)])
def test_resume_with_another_batch_size_continues_at_the_same_sample(blobs, changes, start):
    data = _numbered(blobs)
    model, first = _stopped_at(data, 4, 8)   # 32 samples of epoch 0 done
    run = nt.fit(model, data, F.cross_entropy, progress=False, resume=first,
                 config=quick(**{"batch_size": 8, "epochs": 2, "count_flops": False, **changes}))
    assert sorted(model.seen[:512]) == list(range(512))   # epoch 0: each sample once
    assert f"the epoch continues at sample 32 (batch {start})" in run.notes[0]


def test_a_sample_inside_a_new_batch_says_which_samples_are_trained_again(blobs):
    data = _numbered(blobs)
    model, first = _stopped_at(data, 3, 8)   # 24 samples: inside the second batch of 16
    run = nt.fit(model, data, F.cross_entropy, progress=False, resume=first,
                 config=quick(batch_size=16, epochs=2, count_flops=False))
    epoch0 = model.seen[:24 + 512 - 16]
    assert sorted(set(epoch0)) == list(range(512))
    assert len(epoch0) - 512 == 8   # samples 16 to 23 of epoch 0's order, twice
    assert ("batch_size=8 with batch_size=16: the epoch continues at sample 24 (batch 1); "
            "batch 1 starts at sample 16, so samples 16 to 23 (8) are trained on again") \
        in run.notes[0]


def test_your_own_dataloaders_batch_size_is_not_converted(blobs):
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_numbered(blobs)),
                                         batch_size=8)
    model = Sees()
    first = nt.fit(model, loader, F.cross_entropy, progress=False,
                   config=quick(max_steps=4, count_flops=False))
    nt.fit(model, loader, F.cross_entropy, progress=False, resume=first,
           config=quick(batch_size=16, epochs=1, count_flops=False))   # batch_size: not its
    assert model.seen[:512] == list(range(512))
