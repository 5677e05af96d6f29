"""Resolve "auto" device and precision settings to concrete values, each with a reason."""
from __future__ import annotations

import contextlib
from typing import Tuple

import torch

from ..kinds import Resolved
from ..machine import available_cores


def resolve_device(requested: str) -> Tuple[torch.device, str]:
    if requested != "auto":
        return _indexed(_checked_device(requested)), "asked for"
    if torch.cuda.is_available():
        device = _indexed(torch.device("cuda"))
        return device, f"CUDA available: {torch.cuda.get_device_name(device)}"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps"), "Apple MPS available"
    return torch.device("cpu"), "no CUDA or MPS device found"


def resolve_device_type(requested: str) -> str:
    """The type of device resolve_device(requested) gives ('cuda', 'mps', 'cpu'), without
    choosing a GPU: a rank sets its own (torch.cuda.set_device) before anything asks for
    the current one, which would open a context on GPU 0."""
    if requested != "auto":
        return torch.device(requested).type
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _indexed(device: torch.device) -> torch.device:
    """'cuda' as 'cuda:N': the current device is per thread, and a background run's thread
    starts on device 0 whatever the notebook's thread chose with torch.cuda.set_device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device




def _checked_device(name: str) -> torch.device:
    from ..config import ConfigError
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"TrainConfig.device={name!r} is not available: this PyTorch "
                          "sees no CUDA device. Use device='auto' or 'cpu'.", field="device")
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise ConfigError(f"TrainConfig.device={name!r} is not available: only "
                          f"{torch.cuda.device_count()} CUDA device(s). Use 'cuda:0'.", field="device")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None)
                                     and torch.backends.mps.is_available()):
        raise ConfigError(f"TrainConfig.device={name!r} is not available on this machine. "
                          "Use device='auto' or 'cpu'.", field="device")
    return device






def seed_all(seed: int) -> None:
    """torch.manual_seed(seed), without its cost on a machine with only a CPU: there it also
    queues a seed for each absent accelerator with a formatted stack trace (lazy init),
    half a millisecond a call, which a short fit in a re-run cell pays every time."""
    xpu = getattr(torch, "xpu", None)
    if torch.cuda.is_available() or torch.backends.mps.is_available() or \
            (xpu is not None and xpu.is_available()):
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


_NO_AUTOCAST = contextlib.nullcontext()   # reusable: nothing to set up per step


def autocast_context(amp: str, device: torch.device):
    """A context manager for one forward pass: a fresh autocast, or nothing at all."""
    if amp == "off":
        return _NO_AUTOCAST
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)










@contextlib.contextmanager
def intra_op_threads(threads: int):
    """torch's thread count for the run, then the notebook's again (it is process-wide)."""
    before = torch.get_num_threads()
    if threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)








def resolve_threads(requested, device: torch.device, workers: int) -> Resolved:
    """Intra-op threads for the run. Worker processes load on the same cores as a CPU
    run's matmuls: both at full width oversubscribe them (bench/threads.py measures it)."""
    current = torch.get_num_threads()
    if requested != "auto":
        return requested, "asked for"
    if device.type != "cpu" or workers == 0:
        return current, "torch's setting: no worker process shares the cores with training"
    cores = available_cores()
    threads = max(1, min(current, cores - workers))
    return threads, (f"{workers} worker process(es) load on the other cores: training keeps "
                     f"{threads} of {cores}")
