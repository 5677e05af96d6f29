"""This machine's facts, read where the platform keeps them: its CPU and bf16 units, the
cores this process may use, the load, and the names its measurements are cached by."""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
from typing import Optional

import torch


def gpu_has_bf16(device: torch.device) -> bool:
    """Native bf16 (compute capability 8.0, Ampere, and later). torch.cuda.is_bf16_supported()
    also counts emulated bf16 (T4, V100), which is slower than fp16 there."""
    return torch.cuda.get_device_capability(device)[0] >= 8


@functools.lru_cache(maxsize=None)
def cpuinfo(field: str) -> Optional[str]:
    """The value of /proc/cpuinfo's first `field` line ("flags", "model name"); None where
    there is no /proc (macOS, Windows) or no such line."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(field)), None)
    except OSError:
        return None
    return line.split(":", 1)[1].strip() if line else None


@functools.lru_cache(maxsize=None)
def cpu_bf16_feature() -> str:
    """The CPU flag that makes bf16 matmuls fast here ('' when there is none; without
    /proc: macOS, where Apple silicon's bf16 autocast is slow, and Windows).
    $NBTRAIN_CPU_BF16 names one instead: the tests make any CPU take the bf16 path (CPU
    autocast runs bf16 everywhere, only slower without the instructions)."""
    if os.environ.get("NBTRAIN_CPU_BF16") is not None:
        return os.environ["NBTRAIN_CPU_BF16"]
    flags = (cpuinfo("flags") or "").split()
    for flag in ("amx_bf16", "avx512_bf16"):
        if flag in flags:
            return flag
    return ""


def device_name(device: torch.device) -> str:
    """Which device a measurement was made on, in words and in every cache key: a GPU by its
    name, a CPU by its model (a GPU's gain is not its host CPU's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"CPU {cpu_model()}"
    return device.type


def facts(device: Optional[torch.device] = None) -> dict:
    """What a measurement on this machine depends on besides what was measured: the host,
    its CPU and the cores this process may use, torch's version, the device."""
    return {"host": platform.node(), "cpu": cpu_model(), "cores": available_cores(),
            "torch": torch.__version__, "device": None if device is None else device_name(device)}


def cache_key(what, device: Optional[torch.device] = None) -> str:
    """The one key of every measurement nbtrain caches on disk (the bf16 gain, the peak,
    autotune's trials): `what` was measured (anything with a stable repr) on this machine."""
    text = json.dumps({"what": what, **facts(device)}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def model_key(model: torch.nn.Module) -> tuple:
    """What a model's measurements depend on, by what it is rather than which object holds
    it (a re-run cell's new model is the same): its layers, and each parameter's shape,
    dtype and whether it trains (a frozen layer has no weight gradient to compute)."""
    return repr(model), tuple((tuple(p.shape), p.dtype, p.requires_grad)
                              for p in model.parameters())


def load_now(unknown: float = 0.0) -> float:
    """The 1-minute load average; `unknown` where the platform keeps none (Windows). 0 by
    default, so that a timing's load and the load now compare there as never moved; a
    caption passes math.nan, to say it is unknown."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else unknown


def load_moved(load: float) -> bool:
    """Whether the load has moved since a timing taken under `load`, by more than
    load_change_that_counts(): other processes on the cores change what a step costs, so
    such a timing (the bf16 gain, the workers and threads of auto/workers.py) is not this machine's
    now."""
    return abs(load_now() - load) > load_change_that_counts()


def available_cores() -> int:
    """CPUs this process may use: its affinity mask and any cgroup CPU quota (Docker,
    Kubernetes, Binder), which `os.cpu_count()` ignores, as joblib counts them (its
    LOKY_MAX_CPU_COUNT caps it by hand) without importing joblib into the user's program.
    The diagnosis asks once per record: the answer is kept until the cap or the affinity
    mask changes."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return _cores(os.environ.get("LOKY_MAX_CPU_COUNT"), frozenset(affinity or ()))


@functools.lru_cache(maxsize=8)
def _cores(cap, affinity) -> int:
    total = os.cpu_count() or 1
    counts = [len(affinity) or total, cgroup_cores(total)] + ([int(cap)] if cap else [])
    return max(1, min(counts))


def cgroup_cores(total: int, root: str = "/sys/fs/cgroup") -> int:
    """The cgroup's CPU quota in cores, rounded up (v2's cpu.max, else v1's CFS files);
    `total` where there is none ("max", a negative quota, no cgroup files)."""
    parts = (_read(f"{root}/cpu.max") or "").split()
    if len(parts) != 2:
        parts = [_read(f"{root}/cpu/cpu.cfs_quota_us"), _read(f"{root}/cpu/cpu.cfs_period_us")]
    try:
        quota, period = int(parts[0]), int(parts[1])
    except (TypeError, ValueError):   # "max", or no files
        return total
    return -(-quota // period) if quota > 0 and period > 0 else total


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def load_change_that_counts() -> float:
    """How far the 1-minute load average must move before a timing taken under the old load
    is measured again (auto/workers.py's workers and threads, auto/flops.py's peak): half the cores,
    at least 1, since the load of a busy machine wanders by about one core anyway."""
    return max(1.0, available_cores() / 2)




@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    return cpuinfo("model name") or platform.processor() or platform.machine()


def machine_line() -> str:
    """The machine a measurement ran on, for the caption of a bench's table: the CPU, its
    cores and bf16 units, torch's version and threads, the 1-minute load average (a
    figure measured under load says so next to it)."""
    load = load_now(unknown=math.nan)   # printed as nan: no load average here
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (f"Machine: CPU {cpu_model()} ({available_cores()} cores, "
            f"{cpu_bf16_feature() or 'no bf16 units'}){gpu}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, load average {load:.1f}")


