"""Interval statistics of the loop, gathered without a host sync per step."""
from __future__ import annotations

import bisect
import functools
import math
import sys
import time

import torch


class Interval:
    """Loss, samples and time of the steps since the last record.

    Losses stay on the device in a preallocated buffer; `close` reads them with one
    `.tolist()` per interval (the only host sync of a normal interval), which also gives
    the exact step of a first non-finite loss.
    """

    def __init__(self, device: torch.device, log_every: int, start_step: int,
                 micro_per_step: int = 1):
        self.device = device
        self.losses = torch.zeros(log_every * micro_per_step, device=device)
        self.t_start = time.perf_counter()
        self.reset(start_step)

    def reset(self, start_step: int) -> None:
        self.start_step = start_step
        self.steps = self.micro = self.samples = self.skipped = 0
        self.micro_ends = []          # micro-batch count after each step of the interval
        self.data_wait_s = 0.0
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor, samples: int) -> None:
        self.losses[self.micro].copy_(loss)
        self.micro += 1
        self.samples += samples

    def end_step(self) -> None:
        self.steps += 1
        self.micro_ends.append(self.micro)

    def close(self, step: int, epoch: int, lr: float) -> dict:
        values = self.losses[:self.micro].tolist()   # host sync: once per interval
        now = time.perf_counter()
        elapsed = max(now - self.t0, 1e-9)
        finite = [v for v in values if math.isfinite(v)]
        record = {
            "kind": "train", "step": step, "epoch": epoch,
            "loss": sum(finite) / len(finite) if finite else math.nan,
            "lr": lr, "samples": self.samples, "steps": self.steps,
            "samples_per_s": self.samples / elapsed, "steps_per_s": self.steps / elapsed,
            "step_time_s": elapsed / max(self.steps, 1),
            "data_wait_s": self.data_wait_s / max(self.steps, 1),
            "data_wait_frac": min(self.data_wait_s / elapsed, 1.0),
            "interval_s": elapsed, "time_s": now - self.t_start,
        }
        if self.skipped:
            record["skipped_steps"] = self.skipped
        bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
        if bad is not None:   # 1-based number of the step that held micro-batch `bad`
            record["first_nonfinite_step"] = self.start_step + bisect.bisect_right(
                self.micro_ends, bad) + 1
        return record


@functools.lru_cache(maxsize=1)
def _process():
    import psutil
    return psutil.Process()


def peak_rss_mb() -> float:
    try:
        import resource
    except ImportError:   # Windows
        return math.nan
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10   # bytes vs KiB


def memory_fields(device: torch.device) -> dict:
    """Process memory everywhere; allocator figures on CUDA. Cheap: once per interval."""
    rss = _process().memory_info().rss / 2**20
    fields = {"rss_mb": rss, "peak_rss_mb": max(rss, peak_rss_mb())}   # ru_maxrss lags
    if device.type == "cuda":
        fields["cuda_allocated_mb"] = torch.cuda.memory_allocated(device) / 2**20
        fields["cuda_reserved_mb"] = torch.cuda.memory_reserved(device) / 2**20
        fields["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return fields
