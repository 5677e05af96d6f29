"""Nothing lost, nothing silent: exact resume on every data path, no endless loops, one
run per model, checkpoints that are checked, bounded history."""
import contextlib
import gc
import threading
import weakref
import zipfile

import psutil
import pytest
import torch
from torch.nn import functional as F

import nbtrain as nt
from nbtrain import checkpoint as ckpt
from nbtrain.train import failure

from conftest import EndsOnce, Samples, mlp, quick, same_state


def _fit(data, resume=None, **cfg):
    torch.manual_seed(123)   # the model's own init: the same for every run of a test
    return nt.fit(mlp(dropout=0.3), data, F.cross_entropy, resume=resume, progress=False,
                  config=quick(**cfg))


@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_resume_is_exact_with_dropout(blobs, workers):
    data = Samples(*blobs)
    extra = dict(num_workers=workers, epochs=2)
    straight = _fit(data, **extra)
    first = _fit(data, max_steps=11, **extra)   # stops mid-epoch (16 batches an epoch)
    model = mlp(dropout=0.3)
    resumed = nt.fit(model, data, F.cross_entropy, resume=first, progress=False,
                     config=quick(**extra))
    same_state(straight, resumed)


def test_resume_after_a_failure_mid_epoch_is_exact(blobs):
    data = Samples(*blobs)
    straight = _fit(data, epochs=1)
    data.bad = 200                       # batch 6 fails to load
    with pytest.raises(nt.TrainingError) as err:
        _fit(data, epochs=1)
    assert "sample 200 raised ValueError: corrupt record" in str(err.value)
    data.bad = None
    resumed = nt.fit(mlp(dropout=0.3), data, F.cross_entropy, resume=err.value.run,
                     progress=False, config=quick(epochs=1))
    same_state(straight, resumed)


def test_a_failed_load_names_the_sample_in_any_batch_of_an_accumulation_window(blobs):
    data = Samples(*blobs)
    data.bad = 3 * 32 + 5                # in the second batch of the window at batch 2
    with pytest.raises(nt.TrainingError) as err:
        _fit(data, epochs=1, grad_accum_steps=2, shuffle=False)
    first, rest = str(err.value).split("\n", 1)
    assert first.startswith("loading batch 3 of epoch 0 (step 1) failed")   # the batch that failed
    assert rest.startswith("  sample 101 raised ValueError")   # the culprit, on its own line


def test_nan_is_seen_before_a_checkpoint_holds_its_weights(blobs, tmp_path):
    class Explodes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = mlp()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            out = self.body(x)
            return out * float("nan") if self.calls >= 7 else out   # step 7 on: non-finite

    run = nt.fit(Explodes(), blobs, F.cross_entropy, progress=False,
                 config=quick(max_steps=30, log_every=10, checkpoint_every=3,
                              checkpoint_dir=str(tmp_path), count_flops=False))
    assert run.diverged and "non-finite at step 7" in run.message
    saved = ckpt.load(ckpt.path_in(tmp_path))
    assert saved["position"]["step"] == 6   # the last checkpoint whose steps were all read
    assert all(torch.isfinite(t).all() for t in saved["model"].values())


@pytest.mark.parametrize("data, advice", [
    ((torch.zeros(0, 8), torch.zeros(0, dtype=torch.long)), "train_data is empty"),
    (Samples(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long)), "train_data is empty"),
])
def test_empty_data_is_refused_before_training_even_with_max_steps(data, advice):
    with pytest.raises(nt.ConfigError, match=advice):
        _fit(data, max_steps=5)


def test_a_batch_larger_than_the_data_with_drop_last_says_so(blobs):
    with pytest.raises(nt.ConfigError, match="train_data has 512 sample.*at most 512"):
        _fit(blobs, max_steps=5, batch_size=1000, drop_last=True)


def test_empty_validation_data_is_named(blobs):
    empty = (torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    with pytest.raises(nt.ConfigError, match="val_data is empty"):
        nt.fit(mlp(), blobs, F.cross_entropy, val_data=empty, progress=False,
               config=quick(max_steps=2))


def test_a_second_run_on_a_model_in_training_is_refused(blobs):
    model = mlp()
    gate = threading.Event()
    first = nt.fit(model, blobs, F.cross_entropy, background=True, progress=False,
                   config=quick(max_steps=10_000), on_start=lambda run: run.subscribe(
                       lambda record: gate.set()))
    try:
        assert gate.wait(30)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match="already being trained by .*Stop that run"):
            nt.fit(model, blobs, F.cross_entropy, progress=False, config=quick(max_steps=2),
                   resume=None)
        assert first.state == "running"
    finally:
        first.stop()
        first.wait(30)
    assert len(before) == len(list(model.parameters()))
    again = nt.fit(model, blobs, F.cross_entropy, progress=False, config=quick(max_steps=2))
    assert again.state == "finished"   # once stopped, the model is free


def test_history_stays_bounded_with_validation_every_epoch(blobs):
    small = (blobs[0][:64], blobs[1][:64])   # 2 batches an epoch: a val record every 2 steps
    run = nt.fit(mlp(), small, F.cross_entropy, val_data=small, progress=False,
                 config=quick(epochs=150, history_limit=50, log_every=5))
    assert len(run.history) <= 50
    assert run.records("val")[-1]["epoch"] == 149   # the newest records are kept
    steps = sum(r["steps"] for r in run.records("train"))
    assert steps == run.step                        # merged, not dropped


def _flip_byte(path, member_suffix, at=40):
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(member_suffix))
    blob = bytearray(path.read_bytes())
    local = info.header_offset   # the local header's own name and extra lengths
    name_len, extra_len = (int.from_bytes(blob[local + i:local + i + 2], "little") for i in (26, 28))
    start = local + 30 + name_len + extra_len
    blob[start + at] ^= 0x10
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize("member", ["data/0", "data.pkl"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(blobs, tmp_path, member):
    run = _fit(blobs, max_steps=3, checkpoint_dir=str(tmp_path))
    path = tmp_path / "last.pt"
    _flip_byte(path, member, at=10)
    with pytest.raises(ValueError, match=f"last.pt is damaged: its part '.*{member}' fails "
                                         "its CRC check"):
        ckpt.load(path)
    assert run.step == 3


def test_a_checkpoint_of_another_model_changes_nothing(blobs, tmp_path):
    _fit(blobs, max_steps=3, checkpoint_dir=str(tmp_path))
    other = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                                torch.nn.Dropout(0.0), torch.nn.Linear(32, 5))   # 5 classes
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=r"does not fit this model \(nothing was loaded\): "
                                         r"shape changed: 4.weight \(3, 32\) -> \(5, 32\)"):
        nt.fit(other, blobs, F.cross_entropy, resume=tmp_path / "last.pt", progress=False,
               config=quick(max_steps=5))
    for key, value in other.state_dict().items():
        assert torch.equal(value, before[key]), key   # layer 0 matched, and is untouched


def test_resuming_with_another_weight_decay_names_it(blobs):
    first = _fit(blobs, max_steps=3)
    with pytest.raises(ValueError, match="weight_decay changed from 0.0 to 0.01"):
        nt.fit(mlp(dropout=0.3), blobs, F.cross_entropy, resume=first, progress=False,
               config=quick(max_steps=5, weight_decay=0.01))


def test_a_write_killed_mid_way_leaves_no_temp_file_after_the_next_save(blobs, tmp_path):
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f".last.pt.{dead}.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    mine = tmp_path / ".last.pt.1.live.tmp"   # pid 1 is alive: its write may be in progress
    mine.write_bytes(b"")
    _fit(blobs, max_steps=2, checkpoint_dir=str(tmp_path))
    assert not stale.exists() and mine.exists()


def test_numpy_arrays_train_as_tensors_and_lists_are_refused(blobs):
    x, y = (t.numpy() for t in blobs)
    run = nt.fit(mlp(), (x, y), F.cross_entropy, progress=False, config=quick(max_steps=3))
    assert run.state == "finished" and run.resolved["batched_fetch"][0] is True
    with pytest.raises(TypeError, match="tuple of Python lists: pass tensors or numpy arrays"):
        nt.fit(mlp(), (x.tolist(), y.tolist()), F.cross_entropy, progress=False,
               config=quick(max_steps=3))


def test_mismatched_validation_tensors_are_named_as_val_data(blobs):
    with pytest.raises(ValueError, match="^val_data tensors must have the same length"):
        nt.fit(mlp(), blobs, F.cross_entropy, val_data=(blobs[0][:5], blobs[1][:4]),
               progress=False, config=quick(max_steps=2))


@pytest.mark.parametrize("model, loss_fn, said", [
    (torch.nn.Linear(8, 2), F.cross_entropy, "the model's output: a tensor of shape (32, 2)"),
    (torch.nn.Linear(7, 3), F.cross_entropy, "the model's forward fails on these inputs"),
    (torch.nn.Linear(8, 3), None, "no loss_fn was given: pass one"),
])
def test_a_failed_step_names_the_shapes(blobs, model, loss_fn, said):
    with pytest.raises(nt.TrainingError) as err:
        nt.fit(model, blobs, loss_fn, progress=False, config=quick(max_steps=2))
    text = str(err.value)
    assert "the batch: (a tensor of shape (32, 8) (float32), a tensor of shape (32,) (int64))" \
        in text and said in text


def test_error_text_quoting_a_huge_sample_is_cut(blobs):
    class Loud(Samples):
        def __getitem__(self, i):
            raise ValueError("x" * 100_000)

    with pytest.raises(nt.TrainingError) as err:
        _fit(Loud(*blobs), max_steps=2)
    assert len(str(err.value)) < 2_000 and "(100,000 characters)" in str(err.value)


def test_a_warmup_as_long_as_the_run_is_warned_about(blobs):
    with pytest.warns(UserWarning, match="warmup_steps=10 is not shorter than the run"):
        _fit(blobs, max_steps=10, warmup_steps=10)


# -- every completed step is in the history -------------------------------------------------
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failure_or_second_ctrl_c_keeps_the_records_of_every_completed_step(blobs, error):
    # step 13's second micro-batch raises: its first one's loss and samples are no step's
    model = EndsOnce(error, at=2 * 12 + 2)
    try:
        run = nt.fit(model, blobs, F.cross_entropy, progress=False,
                     config=quick(max_steps=30, grad_accum_steps=2, count_flops=False))
    except nt.TrainingError as err:
        run = err.run
    assert run.step == 12
    records = run.records("train")
    assert records[-1]["step"] == 12 and sum(r["steps"] for r in records) == 12
    assert records[-1]["samples"] == 4 * 2 * 32   # steps 9-12, two batches of 32 each


# -- a batch source that runs out ends its epoch --------------------------------------------
class Stream(torch.utils.data.IterableDataset):
    """(input, target) pairs, a new pass each iter(); `length` is what __len__ claims."""

    def __init__(self, x, y, length=None):
        self.x, self.y, self.length = x, y, length

    def __iter__(self):
        return zip(self.x, self.y)

    def __len__(self):
        if self.length is None:
            raise TypeError("a stream has no length")
        return self.length


def _fit_in_background(data, **cfg):
    """fit, which must end by itself within a minute (a loop that spins is stopped)."""
    run = nt.fit(mlp(), data, F.cross_entropy, progress=False, background=True,
                 config=quick(**cfg))
    run.wait(60)
    if run.running:
        run.stop()
        run.wait(30)
        pytest.fail(f"the run did not end by itself: {run!r}")
    return run


def test_an_iterable_without_a_length_trains_epoch_after_epoch_up_to_max_steps(blobs):
    x, y = blobs
    loader = torch.utils.data.DataLoader(Stream(x[:96], y[:96]), batch_size=32)   # 3 a pass
    run = _fit_in_background(loader, max_steps=7)
    assert (run.state, run.error, run.step, run.epoch) == ("finished", None, 7, 2)


def test_a_loader_that_yields_fewer_batches_than_its_length_ends_the_epoch(blobs):
    x, y = blobs
    loader = torch.utils.data.DataLoader(Stream(x[:96], y[:96], length=160), batch_size=32)
    with pytest.warns(UserWarning, match="len.* is 5 batches, but an epoch yielded 3"):
        run = _fit_in_background(loader, epochs=2)
    assert (run.state, run.step, run.epoch) == ("finished", 6, 2)   # the epochs asked for
    assert any("yielded 3" in note for note in run.notes)


def test_an_iterable_that_yields_nothing_in_an_epoch_fails_naming_it(blobs):
    x, y = blobs
    once = iter(list(zip(x[:96], y[:96])))   # a one-pass stream: empty from epoch 1 on

    class OnePass(torch.utils.data.IterableDataset):
        def __iter__(self):
            return once
    loader = torch.utils.data.DataLoader(OnePass(), batch_size=32)
    run = _fit_in_background(loader, max_steps=7, count_flops=False)   # no batch read ahead
    assert run.state == "failed" and run.step == 3
    assert "train_data yielded no batch in epoch 1" in str(run.error)


def test_a_failure_to_explain_a_failure_still_reports_it(blobs, monkeypatch):
    def broken(*args):
        raise TypeError("the explanation broke")
    monkeypatch.setattr(failure, "_load_culprit", broken)
    with pytest.raises(nt.TrainingError, match="ValueError: corrupt record") as err:
        _fit(Samples(*blobs, bad=200), epochs=1, num_workers=0)
    assert err.value.run.state == "failed" and err.value.run.error is err.value


# -- failures outside the step say where they happened -------------------------------------
def test_a_validation_failure_names_val_data_and_leaves_the_model_training(blobs):
    model = mlp()
    narrow = (blobs[0][:64, :7], blobs[1][:64])   # 7 features: the model takes 8
    with pytest.raises(nt.TrainingError) as err:
        nt.fit(model, blobs, F.cross_entropy, val_data=narrow, progress=False,
               config=quick(epochs=1))
    assert str(err.value).startswith("validation on val_data after epoch 0 (step 16) failed: "
                                     "RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert model.training


def test_a_failed_checkpoint_write_names_the_file(blobs, tmp_path, monkeypatch):
    def disk_full(state, path):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt, "save", disk_full)
    with pytest.raises(nt.TrainingError) as err:
        _fit(blobs, max_steps=6, checkpoint_every=3, checkpoint_dir=str(tmp_path))
    assert str(err.value).startswith(f"writing the checkpoint {tmp_path / 'last.pt'} at step 3 "
                                     "failed: OSError: [Errno 28] No space left on device")
    assert err.value.run.step == 3


# -- a failed or finished run holds no process or memory ------------------------------------
def _live_children() -> set:
    alive = set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):   # one that exits meanwhile
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.add(child.pid)
    return alive


def test_a_failed_run_leaves_no_loader_worker_behind(blobs):
    before = _live_children()
    with pytest.raises(nt.TrainingError) as err:   # keeps the traceback, as a notebook does
        _fit(Samples(*blobs, bad=200), epochs=1, num_workers=1)
    assert not _live_children() - before and err.value.run.state == "failed"


def test_a_finished_run_is_freed_once_dropped_while_its_model_lives(blobs):
    model = mlp()
    run = nt.fit(model, blobs, F.cross_entropy, progress=False, config=quick(max_steps=2))
    dropped = weakref.ref(run)
    del run
    gc.collect()   # a Run holds cycles of its own (its error's run); the model stays
    assert dropped() is None
