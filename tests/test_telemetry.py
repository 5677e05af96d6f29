"""Time split, diagnosis, memory fields and hygiene, bounded history, exports."""
import gc
import json
import os
import time
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.auto import diagnosis
from nbtrain.telemetry import sampling, timers as telemetry

from conftest import mlp, quick


def test_records_split_each_step(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=20), progress=False)
    for r in run.records("train"):
        assert r["copy_s"] >= 0 and r["compute_s"] > 0 and r["data_wait_s"] >= 0
        assert r["data_wait_frac"] + r["copy_frac"] + r["compute_frac"] <= 1.0 + 1e-6
        assert r["rss_mb"] > 0 and r["peak_rss_mb"] >= r["rss_mb"] * 0.99
    s = run.summary()
    assert 0 < s["compute_frac"] <= 1 and "diagnosis" in s


class SlowSamples(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.randn(8), i % 3


def test_slow_dataset_is_diagnosed_input_bound():
    run = nt.fit(nn.Linear(8, 3), SlowSamples(), F.cross_entropy,
                 config=quick(max_steps=6, num_workers=0, log_every=3), progress=False)
    assert run.summary()["diagnosis"].startswith("input-bound")
    assert "num_workers=" in run.summary()["diagnosis"]
    assert run.records("train")[-1]["diagnosis"].startswith("input-bound")


def test_heavy_model_is_diagnosed_compute_bound():
    model = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                          nn.Linear(2048, 3))
    x, y = torch.randn(512, 256), torch.randint(0, 3, (512,))
    run = nt.fit(model, (x, y), F.cross_entropy, config=quick(max_steps=6, log_every=3),
                 progress=False)
    assert run.summary()["diagnosis"].startswith("compute-bound")


def test_telemetry_off_keeps_only_the_basics(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=10, telemetry=False),
                 progress=False)
    record = run.records("train")[-1]
    assert "loss" in record and "samples_per_s" in record
    assert "copy_s" not in record and "rss_mb" not in record


def test_logged_losses_do_not_keep_the_graph_alive(blobs):
    refs = []

    def loss_fn(out, y):
        loss = F.cross_entropy(out, y)
        refs.append(weakref.ref(loss))
        return loss
    run = nt.fit(mlp(), blobs, loss_fn, config=quick(max_steps=10), progress=False)
    gc.collect()
    assert run.history and refs
    assert all(ref() is None for ref in refs)


def test_release_frees_optimizer_state(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=3, optimizer="adam"),
                 progress=False)
    params = sum(p.numel() for p in run.model.parameters())
    freed = run.release()
    assert freed["optimizer_state_mb"] == pytest.approx(2 * params * 4 / 2**20, rel=0.05)
    assert not run.optimizer.state and run.released
    assert {"rss_freed_mb", "cuda_reserved_freed_mb"} <= set(freed)


def test_new_run_releases_the_previous_when_asked(blobs):
    first = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=3), progress=False)
    assert first.optimizer.state
    nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=3, release_previous=True),
           progress=False)
    assert not first.optimizer.state


def deep_mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 3))


def test_activation_checkpointing_saves_memory_and_keeps_the_math():
    from nbtrain.auto.memory import checkpointed_forward, saved_for_backward_bytes as saved_bytes
    x, y = torch.randn(256, 64), torch.randint(0, 3, (256,))
    plain, ckpt = deep_mlp(), deep_mlp()
    assert saved_bytes(checkpointed_forward(ckpt, True), x) < saved_bytes(plain, x) / 2
    for model, setting in ((plain, False), (ckpt, True)):
        nt.fit(model, (x, y), F.cross_entropy, progress=False,
               config=quick(max_steps=5, activation_checkpointing=setting, shuffle=False))
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(a, b)


def test_activation_checkpointing_needs_a_sequential(blobs):
    class NotSequential(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 3)

        def forward(self, x):
            return self.lin(x)
    with pytest.raises(nt.ConfigError, match="needs an nn.Sequential model; got NotSequential"):
        nt.fit(NotSequential(), blobs, F.cross_entropy,
               config=quick(activation_checkpointing=True), progress=False)


def test_max_batch_size_finds_the_limit_without_crashing():
    class RunsOutAbove(nn.Module):
        """Simulates a device that holds at most 300 samples' activations."""

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 3)

        def forward(self, x):
            if x.shape[0] > 300:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return self.lin(x)
    model = RunsOutAbove()
    data = (torch.randn(100, 8), torch.randint(0, 3, (100,)))
    assert nt.max_batch_size(model, data, F.cross_entropy, config=quick()) == 300
    assert all(p.grad is None for p in model.parameters())
    assert nt.max_batch_size(model, data, F.cross_entropy, config=quick(), limit=64) == 64


def test_max_batch_size_reraises_other_errors():
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        nt.max_batch_size(nn.Linear(5, 3), (torch.randn(10, 8), torch.zeros(10).long()),
                          F.cross_entropy, config=quick())


def test_history_stays_bounded_and_keeps_totals():
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    run = nt.fit(nn.Linear(8, 3), (x, y), F.cross_entropy, progress=False,
                 config=quick(max_steps=3000, batch_size=4, log_every=1, history_limit=100))
    train = run.records("train")
    assert len(run.history) <= 100
    assert sum(r["steps"] for r in train) == 3000 and sum(r["samples"] for r in train) == 12000
    assert train[-1]["steps"] == 1 and train[0]["steps"] > 1   # recent intervals stay fine
    assert [r["step"] for r in train] == sorted(r["step"] for r in train)


def test_exports(blobs, tmp_path):
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=10), val_data=blobs,
                 progress=False)
    text = (tmp_path / "h.csv")
    run.to_csv(text)
    lines = text.read_text().splitlines()
    assert lines[0].startswith("kind,step,epoch,loss,lr") and len(lines) == 3
    data = json.loads((tmp_path / "h.json").read_text() if run.to_json(tmp_path / "h.json") else "")
    assert data["history"] == run.history and data["config"]["max_steps"] == 10
    pd = pytest.importorskip("pandas")
    assert isinstance(run.to_pandas(), pd.DataFrame) and len(run.to_pandas()) == 2


def test_nvml_fields_absent_without_a_gpu(monkeypatch):
    monkeypatch.setattr(sampling, "_nvml_handles", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sampling.nvml_fields(torch.device("cpu")) == {}
        fields = sampling.nvml_fields(torch.device("cuda"))   # no driver here: just empty
    assert fields == {} or "nvml_used_mb" in fields


@pytest.mark.skipif(not (hasattr(os, "fork") and os.path.exists("/proc/self/statm")),
                    reason="reads /proc/self of a forked child (Linux)")
def test_a_forked_child_reads_its_own_memory_and_closes_its_parents_files():
    """The kept /proc/self files are the parent's in a forked child (they would read the
    parent's memory): the child closes its copies and opens its own."""
    sampling.rss_bytes()   # the parent's statm, kept open
    parents = sampling._kept["statm"]
    read, write = os.pipe()
    child = os.fork()
    if child == 0:   # the child: report what it reads, and exit without pytest's cleanup
        try:
            sampling.rss_bytes()
            closed = not _is_open(parents) or sampling._kept["statm"] == parents
            opened = os.readlink(f"/proc/self/fd/{sampling._kept['statm']}")
            os.write(write, f"{closed} {opened}".encode())
        finally:
            os._exit(0)
    os.close(write)
    closed, opened = os.read(read, 4096).decode().split()
    os.close(read)
    os.waitpid(child, 0)
    assert closed == "True" and opened == f"/proc/{child}/statm"
    assert _is_open(parents) and sampling._kept_by == os.getpid()   # the parent's kept


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class SlowRows(torch.utils.data.Dataset):
    """Validation data that takes 0.3 s to read."""

    def __len__(self):
        return 30

    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.zeros(8), 0


def test_validation_time_is_not_counted_as_training_time(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, val_data=SlowRows(), progress=False,
                 config=quick(max_steps=21, log_every=5, num_workers=0))
    after_validation = run.records("train")[-1]    # steps 17-21, just after epoch 0's validation
    assert after_validation["step"] == 21 and after_validation["steps"] == 5
    assert after_validation["interval_s"] < 0.15   # the 0.3 s of validation is not in it


def test_the_wait_for_the_device_is_counted_in_the_intervals(blobs, monkeypatch):
    """On a GPU the host queues steps ahead and waits when it reads them: that wait is
    the device's time on those steps, so the records' time must add up to the run's."""
    def gpu_like_wait(self):   # the device still has 50 ms of this interval's work
        if not getattr(self, "waited", False):
            time.sleep(0.05)
            self.waited = True
    monkeypatch.setattr(telemetry.EndedInterval, "wait", gpu_like_wait)
    run = nt.fit(mlp(), blobs, F.cross_entropy, progress=False,
                 config=quick(max_steps=20, log_every=2))
    counted = sum(r["interval_s"] for r in run.records("train"))
    assert run.wall_s > 0.5 and counted == pytest.approx(run.wall_s, rel=0.1)


# -- the diagnosis agrees with what "auto" found about the machine -----------------------------
COMPUTE_BOUND = {"data_wait_frac": 0.01, "copy_frac": 0.01, "compute_frac": 0.98}


def _advice(monkeypatch, device, amp, bf16_cpu="", bf16_gpu=False):
    monkeypatch.setattr(diagnosis, "cpu_bf16_feature", lambda: bf16_cpu)
    monkeypatch.setattr(diagnosis, "gpu_has_bf16", lambda device: bf16_gpu)
    return diagnosis.diagnose(COMPUTE_BOUND, {"device": (device, ""), "amp": amp})


def test_diagnosis_never_advises_bf16_where_auto_found_no_bf16_units(monkeypatch):
    from nbtrain.auto.precision import resolve_amp
    monkeypatch.setattr("nbtrain.auto.precision.cpu_bf16_feature", lambda: "")
    found = resolve_amp("auto", torch.device("cpu"))
    assert found[0] == "off" and "no bf16" in found[1]
    advice = _advice(monkeypatch, "cpu", found)
    assert advice.startswith("compute-bound") and "amp=" not in advice
    assert "amp=" not in _advice(monkeypatch, "cpu", ("off", "asked for"))
    assert "amp=" not in _advice(monkeypatch, "mps", ("off", "autocast on MPS rarely pays off"))


def test_diagnosis_advises_the_amp_this_machine_runs_fast(monkeypatch):
    assert "try amp=bf16" in _advice(monkeypatch, "cpu", ("off", "asked for"),
                                     bf16_cpu="avx512_bf16")
    assert "amp=" not in _advice(monkeypatch, "cpu", ("off", "CPU has avx512_bf16, but bf16 "
                                                      "measured 0.61x of fp32 speed"),
                                 bf16_cpu="avx512_bf16")
    assert "try amp=fp16" in _advice(monkeypatch, "cuda:0", ("off", "asked for"))
    assert "try amp=bf16" in _advice(monkeypatch, "cuda:0", ("off", "asked for"), bf16_gpu=True)
    assert "amp=" not in _advice(monkeypatch, "cuda:0", ("bf16", "GPU supports bf16"),
                                 bf16_gpu=True)


def test_the_diagnosis_never_advises_a_setting_the_run_already_has():
    on = {"device": ("cpu", ""), "amp": ("off", "asked for"), "compile": (True, "asked for"),
          "channels_last": (True, "asked for")}
    for fractions in (COMPUTE_BOUND, dict(COMPUTE_BOUND, mfu=0.05), dict(COMPUTE_BOUND, mfu=0.3)):
        text = diagnosis.diagnose(fractions, on)
        assert "compile=True" not in text and "channels_last=True" not in text, text
    assert "compile=True" in diagnosis.diagnose(dict(COMPUTE_BOUND, mfu=0.05), {"device": ("cpu", "")})


def test_a_compiled_runs_summary_reports_the_warm_up_apart():
    from nbtrain.auto.compiling import warmup_split
    steady = dict(kind="train", steps=10, samples=640, interval_s=0.1, step_time_s=0.01)
    first = dict(steady, interval_s=3.1, step_time_s=0.31)   # waited 3 s for the compiler
    split = warmup_split([first, steady, steady, steady])
    assert split["compile_warmup_s"] == pytest.approx(3.0)
    assert split["steady_samples_per_s"] == pytest.approx(6400)


def test_compile_check_times_compiled_against_eager_and_says_when_it_does_not_pay():
    from nbtrain.auto.compiling import compile_check
    import time as _time

    def step(seconds):
        def run(kind):
            _time.sleep(seconds[kind] + (0.05 if kind == "compiled" and not seconds.get("warm") else 0))
            seconds["warm"] = True
        return run
    fast = compile_check(step({"compiled": 0.002, "eager": 0.006}), planned=1000)
    assert fast["compile_gain"][0] > 2 and fast["compile_pays"][0] is True
    assert fast["compile_warmup_s"][0] >= 0.05 and "compiled against" in fast["compile"][1]
    same = compile_check(step({"compiled": 0.004, "eager": 0.004}), planned=1000)
    assert same["compile_pays"] == (False, same["compile_pays"][1])
    assert "did not pay on this model" in same["compile_pays"][1]
    short = compile_check(step({"compiled": 0.002, "eager": 0.006}), planned=3)
    assert short["compile_pays"][0] is False and "this run's length" in short["compile_pays"][1]
    unmeasured = compile_check(step({"compiled": 0.0, "eager": 0.0}), planned=3,
                               may_measure="run too short to measure: 3 steps")
    assert "compile_gain" not in unmeasured and "not timed against eager" in unmeasured["compile"][1]


def test_the_diagnosis_says_when_compile_did_not_pay():
    resolved = {"device": ("cpu", ""), "compile": (True, "asked for"),
                "compile_pays": (False, "did not pay on this model: forward+backward 1.01x eager "
                                        "(measured before step 1) - leave compile off")}
    text = diagnosis.diagnose(COMPUTE_BOUND, resolved)
    assert "compile did not pay on this model" in text, text
    resolved["compile_pays"] = (True, "1.30x eager")
    assert "did not pay" not in diagnosis.diagnose(COMPUTE_BOUND, resolved)


def test_copy_bound_advice_leaves_out_what_the_run_already_has():
    copy_bound = {"data_wait_frac": 0.0, "copy_frac": 0.6, "compute_frac": 0.4}
    pinned = {"device": ("cuda:0", ""), "pin_memory": (True, ""), "data_on_device": (False, "")}
    text = diagnosis.diagnose(copy_bound, pinned)
    assert text.startswith("copy-bound: 60%") and "pin_memory=True" not in text
    assert "data_on_device=True" in text


def test_records_a_few_milliseconds_apart_share_a_diagnosis_and_the_last_has_its_own(blobs, monkeypatch):
    """The diagnosis is derived again at most every DIAGNOSE_EVERY_S: a record every few
    steps of a millisecond would pay for one each time. The run's last record gets its own."""
    from nbtrain.train import emit
    calls = []
    diagnose = emit.diagnose
    monkeypatch.setattr(emit, "diagnose", lambda record, resolved: calls.append(record["step"])
                        or diagnose(record, resolved))
    monkeypatch.setattr(emit, "DIAGNOSE_EVERY_S", 3600.0)
    run = nt.fit(mlp(), blobs, F.cross_entropy, progress=False,
                 config=quick(max_steps=40, log_every=2, count_flops=False))
    train = run.records("train")
    assert len(train) == 20 and calls[0] == train[0]["step"] and calls[-1] == train[-1]["step"]
    assert len(calls) == 2, calls   # the first record and the last one
    assert all(r["diagnosis"] == train[0]["diagnosis"] for r in train[:-1])


def test_input_bound_advice_names_only_what_would_change_something():
    """batched_fetch=True only for tensors loaded per sample (a Dataset without
    __getitems__ cannot batch), a packed format only for data not packed already."""
    slow = {"data_wait_frac": 0.6, "copy_frac": 0.0, "compute_frac": 0.4}
    per_sample = {"device": ("cpu", ""), "num_workers": (0, ""), "data_on_device": (True, ""),
                  "batched_fetch": (False, "per-sample dataset")}
    text = diagnosis.diagnose(slow, per_sample)
    assert "batched_fetch=True" not in text and "num_workers=" in text and "pack_lmdb" in text
    tensors_off = dict(per_sample, batched_fetch=(False, "batched_fetch off: per-sample "
                                                         "__getitem__ + collate"))
    assert "batched_fetch=True" in diagnosis.diagnose(slow, tensors_off)
    packed = dict(per_sample, batched_fetch=(False, "per-sample dataset (packed LMDB records)"))
    assert "pack_lmdb" not in diagnosis.diagnose(slow, packed)


def test_batched_fetch_asked_for_a_dataset_that_cannot_batch_says_so():
    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.zeros(8), torch.tensor(i % 3)
    with pytest.warns(UserWarning, match="Rows has no __getitems__"):
        run = nt.fit(mlp(), Rows(), F.cross_entropy, progress=False,
                     config=quick(max_steps=2, batched_fetch=True, count_flops=False))
    value, why = run.resolved["batched_fetch"]
    assert value is False and why.startswith("asked for, but Rows has no __getitems__")


def test_a_step_start_without_a_copy_is_marked_once():
    from nbtrain.telemetry.timers import HostTimer
    timer = HostTimer()
    timer.step_starts()
    first = timer._step_start
    timer.step_starts()   # a second forward of the same step (accumulation)
    assert timer._step_start == first
    time.sleep(0.01)
    timer.step_done()
    copy, compute, _ = timer.totals()
    assert copy == 0 and compute >= 0.01 and timer._step_start is None
