"""Every GPU check of the data path in one run (two to three minutes on one GPU).

    python bench/gpu.py        # markdown tables, then each target of issue 3 met or missed
    bash bench/gpu.sh          # the same plus the CUDA-only tests: the device machine's script

1. Host-to-device bandwidth, pinned against pageable memory (256 MiB copies).
2. An input-heavy case: uint8 images 3x64x64 at batch 512 (6 MiB a batch) and a conv
   net whose width is chosen here so that one step computes for about twice as long as
   the host takes to fetch a batch and the link takes to copy it: a copy worth hiding,
   and one a good data path can hide whole.
3. Each data path on that case, nbtrain and a plain loop: samples/s from an unprofiled
   run, then the GPU's own timeline from a profiled run (torch.profiler, CUPTI): the
   share of the step with no kernel running, the bandwidth of the batch copies, and the
   share of copy time spent under a kernel.

Targets (issue 3): with the prefetcher, batch copies reach >= 80% of pinned bandwidth
and the GPU idles <= 5% of a step. Never run by the tests (tests/test_gpu_bench.py
checks the timeline arithmetic on CPU).
"""
from __future__ import annotations

import re
import time
from typing import List, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from nbtrain.data.batches import TensorBatches

BATCH, SAMPLES = 512, 16_384
STEPS = 100          # unprofiled run: samples/s over steps 11..STEPS
PROFILED_STEPS = 40  # profiled run: timeline over steps 6..PROFILED_STEPS
SKIP = 5


# --- the GPU timeline ------------------------------------------------------------------

class Span(NamedTuple):
    kind: str        # "kernel", "memset" or "copy"
    name: str
    start: int       # ns
    end: int
    nbytes: int      # copies only


_KINDS = {"kernel": "kernel", "gpu_memset": "memset", "gpu_memcpy": "copy"}


def device_spans(prof) -> List[Span]:
    """The kernels, memsets and copies the GPU ran while `prof` recorded."""
    spans = []
    for e in prof.profiler.kineto_results.events():
        kind = _KINDS.get(e.activity_type())
        if kind and e.device_type() != torch.autograd.DeviceType.CPU:
            spans.append(Span(kind, e.name(), e.start_ns(), e.end_ns(), _copied_bytes(e)))
    return spans


def _copied_bytes(event) -> int:
    # CUPTI puts a copy's size in the event's metadata, e.g. '"bytes": 6291456'; older
    # torch builds lack one accessor or the other
    meta = getattr(event, "metadata_json", lambda: "")() or ""
    found = re.search(r'"bytes":\s*(\d+)', meta)
    return int(found.group(1)) if found else int(getattr(event, "nbytes", lambda: 0)() or 0)


def merged(intervals):
    """Sorted, non-overlapping intervals covering the same time as `intervals`."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def covered(intervals) -> int:
    return sum(end - start for start, end in merged(intervals))


def overlap(a, b) -> int:
    """Time covered by both `a` and `b`."""
    a, b = merged(a), merged(b)
    i = j = total = 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def steady_window(spans: List[Span], skip: int = SKIP):
    """(start, end, steps) after the first `skip` steps, a step ending with its AdamW
    kernel; without those, the whole span of kernels and memsets as one step."""
    ends = sorted(s.end for s in spans if s.kind == "kernel" and "adam" in s.name.lower())
    if len(ends) > skip + 1:
        return ends[skip], ends[-1], len(ends) - 1 - skip
    work = [s for s in spans if s.kind != "copy"]
    return min(s.start for s in work), max(s.end for s in work), 1


def timeline(spans: List[Span], skip: int = SKIP) -> dict:
    """GPU idle share of a step and the batch copies' bandwidth and overlap with kernels."""
    lo, hi, steps = steady_window(spans, skip)

    def inside(kinds):
        return [(max(s.start, lo), min(s.end, hi)) for s in spans
                if s.kind in kinds and s.end > lo and s.start < hi]
    compute = inside(("kernel", "memset"))
    batch_copies = [s for s in spans if s.kind == "copy" and "htod" in s.name.lower()
                    and s.nbytes >= 2**20 and lo <= s.start < hi]
    copy_ns = sum(s.end - s.start for s in batch_copies)
    copies = [(s.start, s.end) for s in batch_copies]
    return {"step_ms": (hi - lo) / steps / 1e6,
            "idle": 1 - covered(compute) / (hi - lo),
            "copy_gib_s": sum(s.nbytes for s in batch_copies) / copy_ns * 1e9 / 2**30
            if copy_ns else None,
            "copy_overlap": overlap(copies, compute) / covered(copies) if copies else None}


def profiled(fn) -> dict:
    """The timeline of what `fn()` makes the GPU do; the host's ops are not traced, so
    the host runs at its normal speed."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return timeline(device_spans(prof))


# --- the input-heavy case -----------------------------------------------------------------

class Scale(nn.Module):
    """uint8 pixels to floats in [0, 1], on the GPU: the copy stays 1 byte a value."""

    def forward(self, x):
        return x.float().div_(255)


def convnet(width: int) -> nn.Module:
    return nn.Sequential(Scale(), nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def images():
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, 256, (SAMPLES, 3, 64, 64), dtype=torch.uint8, generator=gen),
            torch.randint(0, 10, (SAMPLES,), generator=gen))


def cuda_ms(fn, repeats: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def host_ms(fn, repeats: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def step_ms(width: int, x, y) -> float:
    model = convnet(width).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    xb, yb = x[:BATCH].cuda(), y[:BATCH].cuda()

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    return cuda_ms(step)


def choose_width(x, y):
    """The narrowest net whose step computes >= 2x the batch's host fetch and copy."""
    batches = iter(TensorBatches((x, y), BATCH, True, False, 0, pin=True).epoch(0))
    fetch = host_ms(lambda: next(batches), repeats=10)
    pinned = x[:BATCH].pin_memory()
    copy = cuda_ms(lambda: pinned.to("cuda", non_blocking=True))
    for width in (16, 32, 64, 128, 256):
        compute = step_ms(width, x, y)
        if compute >= 2 * max(fetch, copy):
            break
    return width, {"host fetch into pinned ms": fetch, "copy ms": copy, "step compute ms": compute}


# --- the data paths -----------------------------------------------------------------------

def nbtrain_path(width, x, y, **settings):
    def train(steps):
        # log_every stays at its default: each interval's one host read is part of the cost
        cfg = nt.TrainConfig(max_steps=steps, batch_size=BATCH, amp="off", optimizer="adamw",
                             optimizer_impl="fused", **settings)
        return nt.fit(convnet(width), (x, y), F.cross_entropy, config=cfg, progress=False)

    def rate():
        run = train(STEPS)
        records = run.records("train")[1:]
        chosen = {k: v for k, (v, _) in run.resolved.items()
                  if k in ("pin_memory", "data_on_device", "prefetch_to_device")}
        return sum(r["samples"] for r in records) / sum(r["interval_s"] for r in records), chosen
    return rate, lambda: train(PROFILED_STEPS)


def plain_path(width, x, y):
    """The textbook loop: DataLoader over a TensorDataset, .cuda() per batch."""
    def train(steps, timed_from=None):
        model = convnet(width).cuda()
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
        done, start = 0, None
        while done < steps:
            for xb, yb in loader:
                if done == timed_from:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                xb, yb = xb.cuda(), yb.cuda()
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
                done += 1
                if done == steps:
                    break
        torch.cuda.synchronize()
        return start

    def rate():
        start = train(STEPS, timed_from=10)
        return (STEPS - 10) * BATCH / (time.perf_counter() - start), {}
    return rate, lambda: train(PROFILED_STEPS)


PATHS = [
    ("plain loop: DataLoader, .cuda()", plain_path, {}),
    ("nbtrain, pageable copy", nbtrain_path,
     dict(pin_memory=False, data_on_device=False, prefetch_to_device=False)),
    ("nbtrain, pinned + non_blocking", nbtrain_path,
     dict(pin_memory=True, data_on_device=False, prefetch_to_device=False)),
    ("nbtrain, pinned + side-stream prefetch", nbtrain_path,
     dict(pin_memory=True, data_on_device=False, prefetch_to_device=True)),
    ("nbtrain, data_on_device", nbtrain_path, dict(data_on_device=True)),
    ("nbtrain, auto", nbtrain_path, {}),
]


def bandwidth(pinned: bool, mib: int = 256) -> float:
    host = torch.empty(mib * 2**20, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty_like(host, device="cuda")
    return mib / 1024 / cuda_ms(lambda: dev.copy_(host, non_blocking=pinned), repeats=10) * 1e3


def percent(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def main():
    assert torch.cuda.is_available(), "bench/gpu.py needs a CUDA device"
    torch.backends.cudnn.benchmark = True   # fixed shapes: both loops get the tuned kernels
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    pinned, pageable = bandwidth(True), bandwidth(False)
    print(f"| host-to-device copy, 256 MiB | GiB/s |\n|---|---:|\n| pinned | {pinned:.1f} |\n"
          f"| pageable | {pageable:.1f} |\n", flush=True)

    x, y = images()
    width, costs = choose_width(x, y)
    print(f"input-heavy case: {SAMPLES} uint8 images 3x64x64, batch {BATCH}, conv width "
          f"{width}; " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()) + "\n", flush=True)

    print("| data path | samples/s | vs plain | GPU idle | batch copy GiB/s | % of pinned | "
          "copy under a kernel | settings |\n|---|---:|---:|---:|---:|---:|---:|---|")
    results, plain = {}, None
    for name, path, settings in PATHS:
        rate, profile_run = path(width, x, y, **settings)
        samples_s, chosen = rate()
        plain = plain or samples_s
        t = results[name] = profiled(profile_run)
        gib = t["copy_gib_s"]
        print(f"| {name} | {samples_s:,.0f} | {samples_s / plain:.2f}x | {t['idle']:.1%} | "
              f"{'-' if gib is None else f'{gib:.1f}'} | "
              f"{'-' if gib is None else f'{gib / pinned:.0%}'} | "
              f"{percent(t['copy_overlap'])} | {chosen or ''} |", flush=True)

    ahead = results["nbtrain, pinned + side-stream prefetch"]
    print("\ntargets:")
    print(f"- prefetched copies at {(ahead['copy_gib_s'] or 0) / pinned:.0%} of pinned "
          f"bandwidth (>= 80%): {'met' if (ahead['copy_gib_s'] or 0) >= 0.8 * pinned else 'MISSED'}")
    print(f"- GPU idle {ahead['idle']:.1%} of a step with the prefetcher (<= 5%): "
          f"{'met' if ahead['idle'] <= 0.05 else 'MISSED'}")


if __name__ == "__main__":
    main()
