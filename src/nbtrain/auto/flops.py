"""How close a run comes to the hardware: FLOPs per step, the device's peak, and MFU.

MFU (model FLOPs utilisation, PaLM, Chowdhery et al. 2022, appendix B) is the FLOP/s a
run achieves divided by the peak FLOP/s of the device at the run's precision. Both
sides are measured here, once per run, before step 1:

- FLOPs per step: one forward and backward on the run's first batch under
  `torch.utils.flop_counter.FlopCounterMode`, at the run's precision, leaving no trace
  (no gradients, buffers and RNG as they were). Cached per architecture and batch shape,
  so re-running a cell costs nothing.
  Counted: matrix multiplies (Linear, matmul, bmm, einsum that lowers to them),
  convolutions and their transposes, and attention through
  `F.scaled_dot_product_attention` (its matmuls, forward and backward). A multiply-add
  is 2 FLOPs. Not counted: elementwise ops (activations, residual adds, bias adds),
  norms, softmax outside SDPA, embeddings (a gather), the loss, the optimizer's update,
  and the forward that `activation_checkpointing` recomputes (model FLOPs, not hardware
  FLOPs, as MFU is defined). These cost memory bandwidth rather than FLOPs, so a run
  dominated by them reads a low MFU, which is what MFU is for.
- Peak FLOP/s: for GPUs nbtrain knows (`GPU_PEAKS`, each figure from its vendor's
  datasheet), the dense tensor-core figure at the run's precision; for CPUs and other
  GPUs, a short GEMM probe at the run's dtype (a few large matmuls, the best), cached
  per machine under `files.cache_dir()` and measured again when the machine has become
  much quieter than it was then. At amp="off" on CUDA, cuDNN runs convolutions in TF32
  by default while matmuls stay fp32 (unless `torch.set_float32_matmul_precision` says
  otherwise): the peak is then the two weighted by the counted FLOPs (`run_peak`).

Both land in `run.resolved` with where they came from; each train record then carries
`tflops` (achieved) and `mfu` (rates.py's `rate_fields`).
"""
from __future__ import annotations

import contextlib
import functools
import json
import re
import time
from typing import NamedTuple, Optional

import torch

from ..data.nested import structure
from ..files import atomic_write, cache_dir
from ..machine import (
    cache_key,
    cpu_bf16_feature,
    device_name,
    load_change_that_counts,
    load_now,
    model_key,
)
from .devices import autocast_context, intra_op_threads

COUNTED = "matmuls, convolutions and SDPA attention, forward and backward"


# -- FLOPs per step ---------------------------------------------------------------------------
_COUNTS: dict = {}   # (architecture, batch shapes, precision) -> Counted: one forward+backward


class Counted(NamedTuple):
    """FLOPs of one forward and backward, and how many of them are convolutions (cuDNN
    runs those at another fp32 precision than matmuls: see `conv_precision`)."""
    total: int
    conv: int


def flops_per_batch(model: torch.nn.Module, loss_fn, batch, amp: str, device: torch.device) -> int:
    """FLOPs of one forward and backward of `model` on `batch` (see the module's note)."""
    key = _count_key(model, loss_fn, batch, amp)
    if key not in _COUNTS:
        # a fit's count only (a watch counts its loop's own steps): a watch never loads these
        from torch.utils.flop_counter import FlopCounterMode

        from .losses import outputs_and_loss
        from .memory import leaves_no_trace
        with leaves_no_trace(model), FlopCounterMode(display=False) as counter:
            with autocast_context(amp, device):
                _, loss = outputs_and_loss(model, loss_fn, batch)
            loss.backward()
        per_op = counter.get_flop_counts().get("Global", {})
        conv = sum(n for op, n in per_op.items() if "convolution" in str(op))
        _COUNTS[key] = Counted(counter.get_total_flops(), conv)
    return _COUNTS[key].total


def conv_share(model: torch.nn.Module, loss_fn, batch, amp: str) -> float:
    """The share of convolutions in the FLOPs flops_per_batch counted (0 if it did not)."""
    counted = _COUNTS.get(_count_key(model, loss_fn, batch, amp))
    return counted.conv / counted.total if counted and counted.total else 0.0


def _count_key(model, loss_fn, batch, amp: str) -> tuple:
    return (model_key(model), structure(batch, _shape),
            getattr(loss_fn, "__qualname__", repr(loss_fn)), amp)


def _shape(leaf):
    return (tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else type(leaf)


# -- the peak of the device -------------------------------------------------------------------
class Peak(NamedTuple):
    """Dense peak TFLOP/s of a GPU at each precision (None: no such units, probe instead)."""
    pattern: str         # a regex on torch.cuda.get_device_name
    capability: tuple
    bf16: Optional[float]
    fp16: Optional[float]
    tf32: Optional[float]
    fp32: float
    source: str


# Dense figures: datasheets print the tensor-core ones "with sparsity" (marked *), twice the
# dense rate; those are halved here. More specific names come first ("H100 NVL" before
# "H100", "L40S" before "L4").
GPU_PEAKS = (
    # NVIDIA H200 Tensor Core GPU datasheet (2024), H200 NVL column: BF16/FP16 1,671*, TF32 835*, FP32 60
    Peak(r"H200 NVL", (9, 0), 835.5, 835.5, 417.5, 60.0, "NVIDIA H200 datasheet, H200 NVL"),
    # same datasheet, H200 SXM column ("NVIDIA H200"): BF16/FP16 1,979*, TF32 989*, FP32 67
    Peak(r"H200", (9, 0), 989.5, 989.5, 494.5, 67.0, "NVIDIA H200 datasheet, H200 SXM"),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), H100 NVL column: BF16/FP16 1,671*, TF32 835*, FP32 60
    Peak(r"H100 NVL", (9, 0), 835.5, 835.5, 417.5, 60.0, "NVIDIA H100 datasheet, H100 NVL"),
    # same datasheet, H100 PCIe column: BF16/FP16 1,513*, TF32 756*, FP32 51
    Peak(r"H100 PCIe", (9, 0), 756.5, 756.5, 378.0, 51.0, "NVIDIA H100 datasheet, H100 PCIe"),
    # same datasheet, H100 SXM column ("NVIDIA H100 80GB HBM3"): BF16/FP16 1,979*, TF32 989*, FP32 67
    Peak(r"H100", (9, 0), 989.5, 989.5, 494.5, 67.0, "NVIDIA H100 datasheet, H100 SXM"),
    # NVIDIA A100 Tensor Core GPU datasheet (2021): SXM and PCIe alike, BF16/FP16 312, TF32 156, FP32 19.5
    Peak(r"A100", (8, 0), 312.0, 312.0, 156.0, 19.5, "NVIDIA A100 datasheet"),
    # NVIDIA L40S datasheet (2023): BF16/FP16 362.05 (733*), TF32 183 (366*), FP32 91.6
    Peak(r"L40S", (8, 9), 362.05, 362.05, 183.0, 91.6, "NVIDIA L40S datasheet"),
    # NVIDIA L4 datasheet (2023): BF16/FP16 242*, TF32 120*, FP32 30.3
    Peak(r"\bL4\b", (8, 9), 121.0, 121.0, 60.0, 30.3, "NVIDIA L4 datasheet"),
    # NVIDIA Ada GPU architecture whitepaper v2.1, appendix A (RTX 4090): FP16/BF16 tensor with
    # FP32 accumulate (what torch uses) 165.2, TF32 82.6, FP32 82.6
    Peak(r"RTX 4090", (8, 9), 165.2, 165.2, 82.6, 82.6, "NVIDIA Ada architecture whitepaper, RTX 4090"),
    # NVIDIA T4 datasheet: FP16 (mixed) 65, FP32 8.1; no bf16 units, no TF32 (fp32 runs at 8.1)
    Peak(r"\bT4\b", (7, 5), None, 65.0, 8.1, 8.1, "NVIDIA T4 datasheet"),
    # NVIDIA V100 datasheet (2020), V100S PCIe column: tensor 130, FP32 16.4; no bf16, no TF32
    Peak(r"V100S", (7, 0), None, 130.0, 16.4, 16.4, "NVIDIA V100 datasheet, V100S PCIe"),
    # same datasheet, V100 PCIe column: tensor 112, FP32 14
    Peak(r"V100-PCIE", (7, 0), None, 112.0, 14.0, 14.0, "NVIDIA V100 datasheet, V100 PCIe"),
    # same datasheet, V100 SXM2 column: tensor 125, FP32 15.7
    Peak(r"V100", (7, 0), None, 125.0, 15.7, 15.7, "NVIDIA V100 datasheet, V100 SXM2"),
)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32,
           "fp32": torch.float32}


def precision(amp: str, device: torch.device) -> str:
    """The precision of the run's matmuls: autocast's, else TF32 where CUDA uses it for fp32
    (off by default: torch.get_float32_matmul_precision() is 'highest'), or bf16 where a
    CPU with bf16 units runs fp32 matmuls in it ('medium': oneDNN computes them in bf16)."""
    if amp in ("bf16", "fp16"):
        return amp
    if device.type == "cuda" and _fp32_runs_tf32("matmul"):
        return "tf32"
    if device.type == "cpu" and torch.get_float32_matmul_precision() == "medium" \
            and cpu_bf16_feature():
        return "bf16"
    return "fp32"


def conv_precision(amp: str, device: torch.device) -> str:
    """The precision of the run's convolutions: autocast's, else TF32 where cuDNN uses it
    for fp32, which it does by default (torch.backends.cudnn.allow_tf32 is True, unlike
    matmuls: PyTorch's CUDA semantics notes, "TensorFloat-32 (TF32) on Ampere (and later)
    devices")."""
    if amp in ("bf16", "fp16"):
        return amp
    if device.type == "cuda" and _fp32_runs_tf32("conv"):
        return "tf32"
    return "fp32"


def _fp32_runs_tf32(op: str) -> bool:
    """Whether CUDA runs fp32 `op`s ("matmul": cuBLAS, "conv": cuDNN) in TF32. torch 2.9+
    keeps one setting per op, "none" deferring to the backend's and then the global one
    (torch.backends.cuda.matmul / cudnn.conv .fp32_precision: "tf32", "ieee" or "none");
    after a mix of those and the legacy flags the legacy getters raise, so the new ones
    are read where torch has them."""
    backends = torch.backends
    leaf = backends.cuda.matmul if op == "matmul" else getattr(backends.cudnn, "conv", None)
    if getattr(leaf, "fp32_precision", None) is None:   # before torch 2.9: the legacy flags
        if op == "matmul":
            return torch.get_float32_matmul_precision() != "highest"
        return bool(torch.backends.cudnn.allow_tf32)
    for level in (leaf, backends.cudnn, backends):   # the op's, CUDA's ("cuda", "all"), torch's
        setting = getattr(level, "fp32_precision", "none")
        if setting != "none":
            return setting == "tf32"
    return False


def table_peak(name: str, capability: tuple, prec: str) -> Optional[tuple]:
    """(TFLOP/s, source) of a GPU from `GPU_PEAKS`, or None when it is not there."""
    for peak in GPU_PEAKS:
        if re.search(peak.pattern, name) and capability == peak.capability:
            value = getattr(peak, prec)
            return (value, f"{name} {prec} dense, {peak.source}") if value else None
    return None


def peak_tflops(device: torch.device, prec: str, threads: int) -> tuple:
    """(peak TFLOP/s at `prec`, where the figure comes from) for `device`."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = table_peak(name, torch.cuda.get_device_capability(device), prec)
        if known:
            return known
    return probed_peak(device, prec, threads)


_PROBED: dict = {}   # this process's probes, by cache key


@functools.lru_cache(maxsize=None)
def _peak_key(device: torch.device, prec: str, threads: int) -> tuple:
    """(what the probe's figure depends on, its cache key): asked again at every run's
    start (a re-run cell), and the same in one process."""
    machine = {"machine": device_name(device), "precision": prec, "threads": threads}
    return machine, cache_key({"peak": prec, "threads": threads}, device)


def probed_peak(device: torch.device, prec: str, threads: int) -> tuple:
    """The GEMM probe's figure for this machine, measured once and cached on disk; measured
    again when the machine has become much quieter than it was then (see `_stale`)."""
    machine, key = _peak_key(device, prec, threads)
    path = cache_dir() / "peak" / f"{key}.json"
    if key not in _PROBED:
        try:
            _PROBED[key] = json.loads(path.read_text())
        except (OSError, ValueError):   # never probed here, or damaged: measure
            _PROBED[key] = None
    entry = _PROBED[key]
    if entry is None or _stale(entry, device):
        entry = _PROBED[key] = _probe_again(machine, entry, device, prec, threads)
        with atomic_write(path, "w", durable=False) as f:
            json.dump(entry, f, indent=1)
    where = (f", {threads} threads, load {entry['load']:.1f}" if device.type == "cpu"
             and "load" in entry else "")   # GPU entries (and old files) have no load
    return entry["tflops"], (f"{entry['machine']} {prec}: measured, best of {REPS} "
                             f"{entry['n']}x{entry['n']} matmuls{where} (cached in {path})")


def peak_known(device: torch.device, amp: str) -> bool:
    """Whether run_peak for a run at `amp` needs no probe: from the table (a known GPU), or
    probed before on this machine (this process, or its file) and not stale. Where it
    is not, it reads the cache's file: a watch asks once (watcher/measure.py), not a step."""
    precs = {precision(amp, device), conv_precision(amp, device)}
    return all(_peak_cached(device, prec, torch.get_num_threads()) for prec in precs)


def _peak_cached(device: torch.device, prec: str, threads: int) -> bool:
    if device.type == "cuda" and table_peak(torch.cuda.get_device_name(device),
                                            torch.cuda.get_device_capability(device), prec):
        return True
    _, key = _peak_key(device, prec, threads)
    entry = _PROBED.get(key)
    if entry is None:
        try:
            entry = json.loads((cache_dir() / "peak" / f"{key}.json").read_text())
        except (OSError, ValueError):   # not probed yet: looked for again by the next ask
            return False
        _PROBED[key] = entry   # read once a process, as probed_peak reads it
    return not _stale(entry, device)


def _stale(entry: dict, device: torch.device) -> bool:
    """Other processes on the CPU only ever slow the probe down, so a figure measured under
    load reads low (and MFU high). Measure again once the load has fallen by more than half
    the cores (at least 1) since then: machine.load_change_that_counts, which the timed
    workers and threads (workers.py) use too, the load read by machine.load_now."""
    if device.type != "cpu":
        return False
    return entry.get("load", float("inf")) - load_now() > load_change_that_counts()


def _probe_again(machine: dict, old: Optional[dict], device, prec: str, threads: int) -> dict:
    """A new probe; the higher of it and the old figure, since load only lowers it."""
    load = load_now() if device.type == "cpu" else 0.0
    with intra_op_threads(threads), _matmuls_at(prec, device):
        tflops, n = probe_gemm(device, _DTYPES[prec])
    if old and old.get("tflops", 0) > tflops:
        tflops, n = old["tflops"], old["n"]
    return {**machine, "tflops": tflops, "n": n, "load": load}


@contextlib.contextmanager
def _matmuls_at(prec: str, device: torch.device):
    """fp32 matmuls in TF32 while probing the "tf32" peak (a conv net's, whose matmuls may
    run in full fp32), then the setting as it was."""
    matmul = torch.backends.cuda.matmul
    if prec != "tf32" or device.type != "cuda" or getattr(matmul, "fp32_precision", None) is None:
        yield
        return
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = before


REPS = 5
MIN_TIMED_S = 0.02   # long enough that timer and launch costs vanish, short enough for 2 cores


def probe_gemm(device: torch.device, dtype: torch.dtype, largest: int = 8192) -> tuple:
    """(TFLOP/s, n): square matmuls at `dtype`, n doubled from 512 until one takes
    MIN_TIMED_S (or n reaches `largest`); the best of REPS timings at that size. The best,
    not the median: a peak is what the hardware can do, and sharing the cores with other
    processes (or a GPU's clock ramping up) only ever makes a timing slower."""
    n = 512
    generator = torch.Generator(device=device).manual_seed(0)   # not the user's RNG
    while True:
        a, b = (torch.randn(n, n, device=device, generator=generator).to(dtype)
                for _ in range(2))
        seconds = min(_matmul_seconds(a, b) for _ in range(2))   # the first is the warm-up
        if seconds >= MIN_TIMED_S or n >= largest:
            break
        n *= 2
    seconds = min(_matmul_seconds(a, b) for _ in range(REPS))
    return 2 * n**3 / seconds / 1e12, n


def _matmul_seconds(a: torch.Tensor, b: torch.Tensor, calls: int = 4) -> float:
    """Seconds per matmul, over `calls` of them (a GPU runs them queued, as in a step)."""
    sync = functools.partial(torch.cuda.synchronize, a.device) if a.is_cuda else (lambda: None)
    out = torch.empty_like(a)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        torch.mm(a, b, out=out)
    sync()
    return (time.perf_counter() - start) / calls






# -- what the loop asks for ------------------------------------------------------------------
_COUNTED_BEFORE: dict = {}   # (FLOPs per batch, conv share), by what they depend on (resolve's key)


def resolve(model, loss_fn, load_batch, amp: str, device: torch.device, accum: int,
            threads: int, key=None) -> dict:
    """run.resolved's "flops_per_step" and "peak_tflops", each (value, why). Neither may
    stop a run: a batch that cannot load, or a model the counter cannot run, fails
    properly (with its culprit) at the first step. `load_batch()`: the first batch, moved.
    `key`: what the count depends on (layers, parameter and batch shapes); a run with a
    key counted before in this process (a re-run cell) is not counted again."""
    resolved, share = {}, 0.0   # share: of convolutions in the FLOPs
    try:
        cache_key = None if key is None else (key, _name_of(loss_fn), amp, str(device))
        counted = _COUNTED_BEFORE.get(cache_key) if cache_key is not None else None
        per_batch, share = counted or _counted(model, loss_fn, load_batch(), amp, device)
        if cache_key is not None:
            _COUNTED_BEFORE[cache_key] = (per_batch, share)
        flops = per_batch * accum
        how = "counted before in this process for this model and batch shape" if counted \
            else "counted on one batch"
        resolved["flops_per_step"] = (flops, f"{flops / 1e9:.4g} GFLOP: {COUNTED}, {how} "
                                             f"x {accum} (FlopCounterMode)")
    except Exception as exc:
        resolved["flops_per_step"] = (None, f"not counted ({type(exc).__name__}: {exc})")
    try:
        resolved["peak_tflops"] = run_peak(device, amp, threads, share)
    except Exception as exc:
        resolved["peak_tflops"] = (None, f"not measured ({type(exc).__name__}: {exc})")
    return resolved


def _counted(model, loss_fn, batch, amp: str, device: torch.device) -> tuple:
    """(FLOPs per batch, the share of convolutions in them)."""
    return (flops_per_batch(model, loss_fn, batch, amp, device),
            conv_share(model, loss_fn, batch, amp))


def run_peak(device: torch.device, amp: str, threads: int, conv_fraction: float) -> tuple:
    """(peak TFLOP/s, where it comes from) of a run whose FLOPs are `conv_fraction`
    convolutions, the rest matmuls: where the two run at different precisions (fp32 on
    CUDA: cuDNN's TF32 by default, cuBLAS's full fp32), the peak at which the step's FLOPs
    would take the time they take at each one's own peak (a FLOP-weighted harmonic mean)."""
    matmuls, convs = precision(amp, device), conv_precision(amp, device)
    if matmuls == convs or conv_fraction <= 0.0:
        return peak_tflops(device, matmuls, threads)
    if conv_fraction >= 1.0:
        return peak_tflops(device, convs, threads)
    (mm_peak, _), (conv_peak, conv_source) = (peak_tflops(device, matmuls, threads),
                                              peak_tflops(device, convs, threads))
    value = 1.0 / (conv_fraction / conv_peak + (1.0 - conv_fraction) / mm_peak)
    return value, (f"{conv_fraction:.0%} of the FLOPs in convolutions at {convs} "
                   f"({conv_peak:g}), the rest at {matmuls} ({mm_peak:g}): {conv_source}")


def _name_of(fn) -> str:
    return "" if fn is None else getattr(fn, "__qualname__", type(fn).__qualname__)


