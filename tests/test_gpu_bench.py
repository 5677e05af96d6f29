"""The arithmetic bench/gpu.py reads a GPU timeline with: checked here, since the bench
itself runs only on a GPU machine."""
import importlib.util
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location(
    "gpu_bench", Path(__file__).parents[1] / "bench" / "gpu.py")
gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu)
Span = gpu.Span


def test_interval_union_and_overlap():
    assert gpu.merged([(5, 8), (0, 3), (2, 4), (8, 9)]) == [[0, 4], [5, 9]]
    assert gpu.covered([(0, 10), (5, 15), (20, 21)]) == 16
    assert gpu.overlap([(0, 10), (20, 30)], [(5, 25), (8, 9)]) == 10
    assert gpu.overlap([(0, 1)], []) == 0


def three_steps(*copies):
    """Steps end at 10, 20, 30 ns: compute [10k+2, 10k+8], then AdamW [10k+8, 10k+10]."""
    spans = []
    for k in range(3):
        spans += [Span("kernel", "conv", 10 * k + 2, 10 * k + 8, 0),
                  Span("kernel", "FusedAdamMathFunctor", 10 * k + 8, 10 * k + 10, 0)]
    return spans + list(copies)


def test_timeline_of_the_steady_steps():
    mib2 = 2 * 2**20
    spans = three_steps(
        Span("copy", "Memcpy HtoD (Pinned -> Device)", 15, 19, mib2),   # before the window
        Span("copy", "Memcpy HtoD (Pinned -> Device)", 20, 24, mib2),   # half under a kernel
        Span("copy", "Memcpy HtoD (Pinned -> Device)", 25, 29, mib2),   # wholly under one
        Span("copy", "Memcpy HtoD (Pinned -> Device)", 21, 22, 64),     # targets: too small
        Span("copy", "Memcpy DtoH (Device -> Pinned)", 21, 29, mib2))   # not a batch copy
    t = gpu.timeline(spans, skip=1)            # window: end of step 1 to end of step 2
    assert t["step_ms"] == pytest.approx(10 / 1e6)
    assert t["idle"] == pytest.approx(0.2)     # kernels cover [22, 30] of [20, 30]
    assert t["copy_gib_s"] == pytest.approx(2 * mib2 / 8e-9 / 2**30)
    assert t["copy_overlap"] == pytest.approx(6 / 8)


def test_timeline_without_copies_or_optimizer_kernels():
    t = gpu.timeline([Span("kernel", "gemm", 0, 6, 0), Span("memset", "Memset", 8, 10, 0)])
    assert t["idle"] == pytest.approx(0.2) and t["step_ms"] == pytest.approx(10 / 1e6)
    assert t["copy_gib_s"] is None and t["copy_overlap"] is None


def test_device_spans_reads_a_real_profile():
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert gpu.device_spans(prof) == []   # host ops are not GPU spans


# -- the checks bench/gpu.sh collects into its one table ---------------------------------------
def test_checks_are_collected_into_one_table(monkeypatch, tmp_path, capsys):
    path = tmp_path / "checks.jsonl"
    monkeypatch.setenv("NBTRAIN_BENCH_CHECKS", str(path))
    gpu.check("GPU idle with the prefetcher", "3.0%", "<= 5%", True)
    gpu.check("syncs per step, default path", "1.00", "<= 0.2", False)
    gpu.check("amp bf16 over tf32", "2.10x", "NVIDIA: 2.63x", None)
    assert "GPU idle with the prefetcher: 3.0% (target: <= 5%): met" in capsys.readouterr().out
    table = gpu.summary(str(path)).splitlines()
    assert table[:2] == ["| check | value | target | verdict |", "|---|---|---|---|"]
    assert table[2] == "| GPU idle with the prefetcher | 3.0% | <= 5% | met |"
    assert table[3].endswith("| MISSED |") and table[4].endswith("| - |")
    assert table[-1] == "3 checks, 1 missed"


def test_own_split_reads_the_records_after_the_warm_up():
    from types import SimpleNamespace
    records = [dict(data_wait_frac=0.9, copy_frac=0.9, host_fetch_s=0.9, step_time_s=1.0, mfu=0.1),
               dict(data_wait_frac=0.1, copy_frac=0.2, host_fetch_s=0.3, step_time_s=1.0, mfu=0.4,
                    diagnosis="copy-bound: 20%")]
    split = gpu.own_split(SimpleNamespace(records=lambda kind: records))
    assert split == {"data_wait": 0.1, "copy": 0.2, "host_fetch": 0.3, "mfu": 0.4,
                     "diagnosis": "copy-bound: 20%"}


def load_bench(name, monkeypatch):
    bench = Path(__file__).parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))   # as when run as a script: `from gpu import check`
    spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fp32_math_of_a_precision_case_is_put_back(monkeypatch):
    mfu = load_bench("gpu_mfu", monkeypatch)
    from nbtrain.auto.flops import _fp32_runs_tf32
    before = (_fp32_runs_tf32("matmul"), _fp32_runs_tf32("conv"))
    with mfu.fp32_math(True):
        assert _fp32_runs_tf32("matmul") and _fp32_runs_tf32("conv")
    with mfu.fp32_math(False):
        assert not _fp32_runs_tf32("matmul") and not _fp32_runs_tf32("conv")
    assert (_fp32_runs_tf32("matmul"), _fp32_runs_tf32("conv")) == before


def test_the_own_loop_bench_refuses_cuda_without_a_gpu(monkeypatch):
    own_loop = load_bench("own_loop", monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        own_loop.main(["--device", "cuda"])



def test_trace_spans_reads_kinetos_categories_and_bytes():
    """What the profiler's exported trace holds of a GPU step (Kineto's own names)."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 5.0},
        {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 10.5, "dur": 2.25},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 20.0,
         "dur": 100.0, "args": {"bytes": 6291456, "memory bandwidth (GB/s)": 62.9}},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 30.0, "dur": 1.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "Optimizer.step#AdamW.step",
         "ts": 40.0, "dur": 9.0},
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 10.5}]
    assert gpu.trace_spans(events) == [
        Span("kernel", "sm90_gemm", 10500, 12750, 0),
        Span("copy", "Memcpy HtoD (Pinned -> Device)", 20000, 120000, 6291456),
        Span("memset", "Memset (Device)", 30000, 31000, 0)]
