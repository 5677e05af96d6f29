"""FLOPs per step, the device's peak and MFU (flops.py), and where they show up."""
import json
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.auto import flops
from nbtrain.auto.diagnosis import diagnose
from nbtrain.auto.rates import percent
from nbtrain.run import merge

from conftest import mlp, quick


def linear_stack(widths, bias=True):
    layers = [nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:])]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())][:-1])


@pytest.mark.parametrize("widths, bias", [((8, 32, 3), True), ((16, 64, 64, 5), False)])
def test_linear_stack_counts_exactly_the_analytic_flops(widths, bias):
    """2 x batch x weights forward, twice that backward (input and weight gradients), less
    the first layer's input gradient: autograd does not compute it for the data."""
    batch = 24
    model = linear_stack(widths, bias)
    x, y = torch.randn(batch, widths[0]), torch.randint(0, widths[-1], (batch,))
    weights = [a * b for a, b in zip(widths, widths[1:])]
    forward = 2 * batch * sum(weights)
    expected = forward + 2 * forward - 2 * batch * weights[0]
    assert flops.flops_per_batch(model, F.cross_entropy, (x, y), "off", torch.device("cpu")) == expected


def test_counting_leaves_no_trace_and_is_cached(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(16, 8), torch.randint(0, 3, (16,)))
    model[0].weight.grad = torch.ones_like(model[0].weight)   # a backward the user ran
    rng = torch.get_rng_state()
    first = flops.flops_per_batch(model, F.cross_entropy, batch, "off", torch.device("cpu"))
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert all(p.grad is None for p in model.parameters() if p is not model[0].weight)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    monkeypatch.setattr("nbtrain.auto.memory.leaves_no_trace", None)   # a second count would fail
    assert flops.flops_per_batch(model, F.cross_entropy, batch, "off", torch.device("cpu")) == first


def test_frozen_layers_have_no_gradients_to_count():
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    model = linear_stack((8, 16, 3))
    full = flops.flops_per_batch(model, F.cross_entropy, (x, y), "off", torch.device("cpu"))
    model[0].requires_grad_(False)
    assert flops.flops_per_batch(model, F.cross_entropy, (x, y), "off", torch.device("cpu")) \
        == full - 2 * 4 * 8 * 16 - 2 * 4 * 16 * 3   # nor an input gradient for the layer after


@pytest.mark.parametrize("name, capability, prec, expected", [
    ("NVIDIA H200", (9, 0), "bf16", 989.5),          # the name the driver reports
    ("NVIDIA H200 NVL", (9, 0), "bf16", 835.5),
    ("NVIDIA H100 80GB HBM3", (9, 0), "tf32", 494.5),
    ("NVIDIA H100 PCIe", (9, 0), "fp16", 756.5),
    ("NVIDIA H100 NVL", (9, 0), "fp32", 60.0),
    ("NVIDIA A100-SXM4-80GB", (8, 0), "bf16", 312.0),
    ("NVIDIA A100 80GB PCIe", (8, 0), "tf32", 156.0),
    ("NVIDIA L4", (8, 9), "bf16", 121.0),
    ("NVIDIA L40S", (8, 9), "bf16", 362.05),
    ("NVIDIA GeForce RTX 4090", (8, 9), "bf16", 165.2),
    ("Tesla T4", (7, 5), "fp16", 65.0),
    ("Tesla V100-SXM2-16GB", (7, 0), "fp16", 125.0),
    ("Tesla V100-PCIE-32GB", (7, 0), "fp32", 14.0),
])
def test_known_gpus_come_from_the_table_with_their_source(name, capability, prec, expected):
    value, source = flops.table_peak(name, capability, prec)
    assert value == expected
    assert name in source and prec in source and "datasheet" in source or "whitepaper" in source


@pytest.mark.parametrize("name, capability, prec", [
    ("Tesla T4", (7, 5), "bf16"),                 # no bf16 units: probe what it does
    ("NVIDIA H200", (8, 0), "bf16"),               # name and capability disagree
    ("NVIDIA GeForce RTX 3060", (8, 6), "bf16"),   # not in the table
])
def test_other_gpus_are_probed(name, capability, prec):
    assert flops.table_peak(name, capability, prec) is None


def test_the_cpu_probe_is_cached_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "_PROBED", {})
    calls = []
    monkeypatch.setattr(flops, "probe_gemm", lambda device, dtype: calls.append(dtype) or (0.5, 1024))
    value, source = flops.probed_peak(torch.device("cpu"), "fp32", 1)
    assert value == 0.5 and "measured" in source and str(tmp_path) in source
    [entry] = [json.loads(p.read_text()) for p in (tmp_path / "peak").iterdir()]
    assert entry["tflops"] == 0.5 and entry["threads"] == 1
    monkeypatch.setattr(flops, "_PROBED", {})   # a new process reads the file
    assert flops.probed_peak(torch.device("cpu"), "fp32", 1)[0] == 0.5
    assert calls == [torch.float32]
    flops.probed_peak(torch.device("cpu"), "bf16", 1)   # another precision: its own probe
    assert calls == [torch.float32, torch.bfloat16]


def test_a_peak_probed_under_load_is_probed_again_when_the_machine_is_quieter(monkeypatch, tmp_path):
    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "_PROBED", {})
    monkeypatch.setattr(flops, "load_change_that_counts", lambda: 1.0)   # as on 2 cores
    figures = iter([(0.01, 512), (0.08, 1024), (0.05, 1024)])
    monkeypatch.setattr(flops, "probe_gemm", lambda device, dtype: next(figures))
    cpu = torch.device("cpu")
    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 0, 0))   # others hold the cores
    assert flops.probed_peak(cpu, "fp32", 2)[0] == 0.01
    monkeypatch.setattr(os, "getloadavg", lambda: (5.5, 0, 0))   # about as busy: cached
    assert flops.probed_peak(cpu, "fp32", 2)[0] == 0.01
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0, 0))   # quiet now: measured again
    value, source = flops.probed_peak(cpu, "fp32", 2)
    assert value == 0.08 and "load 0.5" in source
    monkeypatch.setattr(flops, "_PROBED", {})   # a new process reads the new figure
    assert flops.probed_peak(cpu, "fp32", 2)[0] == 0.08
    flops._PROBED[next(iter(flops._PROBED))]["load"] = 9.0   # a lower new figure never wins
    assert flops.probed_peak(cpu, "fp32", 2)[0] == 0.08


def test_a_platform_without_a_load_average_probes_the_peak_once(monkeypatch, tmp_path):
    """Windows keeps no load average: machine.load_now's 0 stands in for it, when the
    probe is taken and when its staleness is judged, so the figure is measured once."""
    from nbtrain.machine import machine_line
    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "_PROBED", {})
    monkeypatch.delattr(os, "getloadavg")
    calls = []
    monkeypatch.setattr(flops, "probe_gemm", lambda device, dtype: calls.append(dtype) or (0.5, 1024))
    cpu = torch.device("cpu")
    assert flops.probed_peak(cpu, "fp32", 1)[0] == 0.5
    monkeypatch.setattr(flops, "_PROBED", {})   # a new process reads the file: not stale
    assert flops.probed_peak(cpu, "fp32", 1)[0] == 0.5 and len(calls) == 1
    assert machine_line().endswith("load average nan")   # unknown, not a quiet 0


def test_probe_gemm_measures_something_sensible():
    tflops, n = flops.probe_gemm(torch.device("cpu"), torch.float32, largest=256)
    assert n == 256 or n == 512 and 0 < tflops < 100


def test_records_and_summary_carry_tflops_and_mfu(blobs, monkeypatch):
    monkeypatch.setattr(flops, "peak_tflops", lambda device, prec, threads: (1e-3, "a test peak"))
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(epochs=1), progress=False)
    per_step, why = run.resolved["flops_per_step"]
    assert per_step == flops.flops_per_batch(mlp(), F.cross_entropy, (blobs[0][:32], blobs[1][:32]),
                                         "off", torch.device("cpu"))
    assert "FlopCounterMode" in why
    assert run.resolved["peak_tflops"] == (1e-3, "a test peak")
    for r in run.records("train"):
        assert r["tflops"] == pytest.approx(per_step * r["steps"] / r["interval_s"] / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops"] / 1e-3)
    summary = run.summary()
    assert summary["tflops"] > 0 and summary["mfu"] == pytest.approx(summary["tflops"] / 1e-3)
    # the summary's own row, whatever the diagnosis reads (input-bound on a loaded machine)
    rate = f"{summary['tflops']:.3g} TFLOP/s, {percent(summary['mfu'])} MFU"
    assert any(line.startswith("compute rate") and line.endswith(rate)
               for line in run.summary_text().splitlines()), run.summary_text()


def test_count_flops_false_counts_nothing(blobs, monkeypatch):
    monkeypatch.setattr(flops, "flops_per_batch", None)   # would fail if called
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=10, count_flops=False),
                 progress=False)
    assert "flops_per_step" not in run.resolved and "peak_tflops" not in run.resolved
    assert all("tflops" not in r and "mfu" not in r for r in run.history)
    assert "MFU" not in run.summary()["diagnosis"] and "compute rate" not in run.summary_text()


def test_a_model_the_counter_cannot_run_still_trains(blobs, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no FLOPs here")
    monkeypatch.setattr(flops, "flops_per_batch", broken)
    monkeypatch.setattr(flops, "_COUNTED_BEFORE", {})   # nothing counted before
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=10), progress=False)
    assert run.state == "finished"
    assert run.resolved["flops_per_step"][0] is None
    assert "no FLOPs here" in run.resolved["flops_per_step"][1]
    assert all("tflops" not in r for r in run.history)


@pytest.mark.parametrize("mfu, words", [
    (0.12, "compute-bound at 12% MFU: the step is overhead-bound"),
    (0.004, "compute-bound at 0.4% MFU: the step is overhead-bound"),
    (0.35, "compute-bound at 35% MFU - try"),
    (0.7, "compute-bound at 70% MFU: near the hardware"),
])
def test_diagnosis_reads_mfu_when_compute_bound(mfu, words):
    resolved = {"amp": ("bf16", "asked for")}
    text = diagnose({"data_wait_frac": 0.01, "copy_frac": 0.0, "compute_frac": 0.9, "mfu": mfu},
                    resolved)
    assert text.startswith(words)
    if mfu < 0.2:
        assert "batch_size" in text and "compile=True" in text
    # waiting for data comes first, whatever the MFU
    assert diagnose({"data_wait_frac": 0.5, "mfu": mfu}, resolved).startswith("input-bound")


def test_merged_records_keep_the_flops_rate_of_their_time():
    a = {"kind": "train", "steps": 10, "samples": 10, "interval_s": 1.0, "tflops": 2.0, "mfu": 0.2}
    b = {"kind": "train", "steps": 10, "samples": 10, "interval_s": 3.0, "tflops": 6.0, "mfu": 0.6}
    merged = merge(a, b)
    assert merged["tflops"] == pytest.approx((2.0 * 1 + 6.0 * 3) / 4)
    assert merged["mfu"] == pytest.approx((0.2 * 1 + 0.6 * 3) / 4)


def test_the_dashboard_table_shows_the_last_mfu(blobs, monkeypatch):
    pytest.importorskip("plotly")
    from nbtrain.views import dashboard
    monkeypatch.setattr(flops, "peak_tflops", lambda device, prec, threads: (1e-3, "a test peak"))
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=10), progress=False)
    slot = dashboard.Slot("a", "#000", run, dashboard.Decimated(dashboard.TRAIN_FIELDS),
                          dashboard.Decimated(dashboard.VAL_FIELDS))
    for record in run.history:
        slot.take(record)
    row = dict(zip(dashboard.TABLE_HEAD, dashboard._table_row(slot)))
    assert row["MFU"] == f"{run.records('train')[-1]['mfu']:.1%}"


def test_a_rerun_with_the_same_model_and_batch_shape_is_not_counted_again(blobs, monkeypatch):
    monkeypatch.setattr(flops, "_COUNTED_BEFORE", {})
    calls = []
    real = flops.flops_per_batch
    monkeypatch.setattr(flops, "flops_per_batch", lambda *a: calls.append(1) or real(*a))
    first = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=2), progress=False)
    again = nt.fit(mlp(), (blobs[0].clone(), blobs[1].clone()), F.cross_entropy,   # new objects
                   config=quick(max_steps=2), progress=False)
    assert len(calls) == 1
    assert again.resolved["flops_per_step"][0] == first.resolved["flops_per_step"][0]
    assert "counted before in this process" in again.resolved["flops_per_step"][1]


def test_a_cpu_running_fp32_matmuls_in_bf16_is_measured_against_its_bf16_peak(monkeypatch):
    """set_float32_matmul_precision('medium') makes oneDNN compute fp32 matmuls in bf16 on
    a CPU with bf16 units: MFU is then read against the bf16 peak."""
    from nbtrain.auto import flops
    cpu = torch.device("cpu")
    monkeypatch.setattr(flops, "cpu_bf16_feature", lambda: "avx512_bf16")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert flops.precision("off", cpu) == "bf16"
        monkeypatch.setattr(flops, "cpu_bf16_feature", lambda: "")
        assert flops.precision("off", cpu) == "fp32"
    finally:
        torch.set_float32_matmul_precision(before)
    assert flops.precision("off", cpu) == "fp32"


def test_a_gpu_step_far_below_the_peak_is_launch_bound_and_a_cpu_one_overhead_bound():
    fractions = {"data_wait_frac": 0.01, "copy_frac": 0.0, "compute_frac": 0.9, "mfu": 0.05}
    assert "launch-bound (too little work per kernel)" in diagnose(
        fractions, {"device": ("cuda:0", ""), "amp": ("bf16", "")})
    assert "overhead-bound" in diagnose(fractions, {"device": ("cpu", ""), "amp": ("bf16", "")})
