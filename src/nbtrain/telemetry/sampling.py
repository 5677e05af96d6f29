"""Memory readings for a record: the process's RSS, the CUDA allocator, NVML."""
from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time

import torch

_kept: dict = {}   # /proc/self's files kept open, by name: fds of the process `_kept_by`
_kept_by = None   # the pid that opened them (a forked child opens its own)
_nvml_handles: dict = {}   # CUDA device index -> NVML handle, or None where NVML is absent


@functools.lru_cache(maxsize=1)
def _process():
    import psutil
    return psutil.Process()


def _proc_self(name: str) -> bytes:
    """/proc/self/`name`, one pread of the file kept open (psutil opens and parses the
    file each call, many times the cost); OSError where there is no /proc."""
    if _kept_by != os.getpid():   # first call, or a forked child: its own files
        _forget_the_parents()
    if name not in _kept:
        _kept[name] = os.open(f"/proc/self/{name}", os.O_RDONLY)
    return os.pread(_kept[name], 4096, 0)


def _forget_the_parents() -> None:
    """A forked child's copies of its parent's /proc/self files (they read the parent's)
    closed, and this process's to be opened."""
    global _kept_by
    inherited = list(_kept.values())
    _kept.clear()
    _kept_by = os.getpid()
    for fd in inherited:
        with contextlib.suppress(OSError):
            os.close(fd)


def peak_rss_mb() -> float:
    """The process's peak resident memory, MiB: Linux's VmHWM from /proc/self/status
    (getrusage's `resource` module is a shared library to load, ~0.5 ms of a short
    watch), else ru_maxrss."""
    try:
        return int(_proc_self("status").split(b"VmHWM:")[1].split()[0]) / 2**10   # kB
    except (OSError, IndexError, ValueError):   # no /proc (macOS, Windows)
        pass
    try:
        import resource
    except ImportError:   # Windows
        return math.nan
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10   # bytes vs KiB


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident memory of this process: on Linux from /proc/self/statm."""
    try:
        return int(_proc_self("statm").split()[1]) * _PAGE
    except OSError:   # no /proc (macOS, Windows)
        return _process().memory_info().rss


def process_memory_fields() -> dict:
    rss = rss_bytes() / 2**20
    return {"rss_mb": rss, "peak_rss_mb": max(rss, peak_rss_mb())}   # ru_maxrss lags


def allocator_fields(device: torch.device) -> dict:
    """The CUDA caching allocator's counters: host-side, no sync. Empty off CUDA."""
    if device.type != "cuda":
        return {}
    # one memory_stats: memory_allocated, memory_reserved and max_memory_allocated each
    # build this whole dictionary to read one entry of it (torch/cuda/memory.py)
    stats = torch.cuda.memory_stats(device)
    return {"cuda_allocated_mb": stats.get("allocated_bytes.all.current", 0) / 2**20,
            "cuda_reserved_mb": stats.get("reserved_bytes.all.current", 0) / 2**20,
            "cuda_peak_allocated_mb": stats.get("allocated_bytes.all.peak", 0) / 2**20}


class MemorySampler:
    """Memory readings for each record: the allocator's counters every time (they are
    plain reads), process and NVML figures at most every `every_s` seconds.

    Memory moves slowly next to a step, and those readings each cost a syscall (NVML: a
    driver call): a record every few steps would pay it every few steps.
    """

    def __init__(self, device: torch.device, every_s: float = 0.25):
        self.device, self.every_s = device, every_s
        self.last, self.fields = -math.inf, {}
        self._cuda = device.type == "cuda"

    def read(self) -> dict:
        """The fields for a record (not to be changed: off CUDA, the same dict until the
        next reading)."""
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.fields = {**process_memory_fields(), **nvml_fields(self.device)}
            self.last = now
        return {**self.fields, **allocator_fields(self.device)} if self._cuda else self.fields


def _nvml_handle(device: torch.device):
    """The NVML handle of `device`, or None where NVML or the GPU is absent (asked once).

    NVML numbers GPUs as the machine does; CUDA_VISIBLE_DEVICES renumbers them for CUDA.
    The GPU's UUID is what both agree on.
    """
    if device.index not in _nvml_handles:
        try:
            import pynvml
            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            _nvml_handles[device.index] = _handle_by_uuid(pynvml, uuid)
        except Exception:   # no driver, no package, no GPU: the fields are simply absent
            _nvml_handles[device.index] = None
    return _nvml_handles[device.index]


def _handle_by_uuid(pynvml, uuid: str):
    """The NVML handle for torch's UUID of a device, which comes without NVML's prefix:
    'GPU-' for a whole GPU, 'MIG-' for a MIG instance (CUDA_VISIBLE_DEVICES=MIG-...).
    Each is tried; None when neither names a device."""
    names = [uuid] if uuid.startswith(("GPU-", "MIG-")) else ["GPU-" + uuid, "MIG-" + uuid]
    for name in names:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(name)
        except Exception:   # NVMLError_NotFound: the other prefix, then nothing
            continue
    return None


def _nvml_memory(nvml, handle) -> dict:
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    return {"nvml_used_mb": mem.used / 2**20, "nvml_total_mb": mem.total / 2**20}


def _nvml_utilisation(nvml, handle) -> dict:
    return {"gpu_util_pct": float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)}


def _nvml_power(nvml, handle) -> dict:
    return {"power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0}


# each read alone: a MIG instance reports its memory but not utilisation or power
# (NVML_ERROR_NOT_SUPPORTED), and some boards do not report power
_NVML_READS = (_nvml_memory, _nvml_utilisation, _nvml_power)


def nvml_fields(device: torch.device) -> dict:
    handle = _nvml_handle(device) if device.type == "cuda" else None
    if handle is None:
        return {}
    import pynvml
    fields = {}
    for read in _NVML_READS:
        try:
            fields.update(read(pynvml, handle))
        except Exception:   # not supported on this device: that field is absent
            pass
    return fields


