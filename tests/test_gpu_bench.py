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
