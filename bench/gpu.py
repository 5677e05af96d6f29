"""Every GPU check of the data path in one run (about two minutes on one H200), run by
bench/gpu.sh.

    python bench/gpu.py                  # markdown tables, then each check met or missed
    python bench/gpu.py --summary FILE   # the one table of every check bench/gpu.sh collected

1. Host-to-device bandwidth, pinned against pageable memory (256 MiB copies), in GB/s.
2. An input-heavy case: uint8 images 3x64x64 at batch 512 (6 MiB a batch) and a conv
   net whose width is chosen here so that one step computes for about twice as long as
   the host takes to fetch a batch and the link takes to copy it: a copy worth hiding,
   and one a good data path can hide whole.
3. Each data path on that case, nbtrain and a plain loop: samples/s from an unprofiled
   run with nbtrain's own split of it (the data wait: the GPU's idle time while the host
   fetched; the copy, with the prefetcher's wait for it; the host's own fetch time), its
   MFU and diagnosis; then the GPU's own timeline from a profiled run (torch.profiler,
   CUPTI): the share of the step with no kernel running, the bandwidth of the batch
   copies, and the share of copy time spent under a kernel.
4. A copy-bound case: one big pinned batch served as it is (no host work, only the copy),
   prefetched: the diagnosis must say copy-bound (issue 28, bug 2).
5. Host syncs per step, counted under torch.cuda.set_sync_debug_mode("warn"): the
   default path, fp16 with the fused AdamW, fp16 with RAdam (GradScaler's inf check).

cuDNN's benchmark mode stays as torch leaves it (off): the figures are the ones a user
gets. Targets (issues 3 and 28) are printed as checks and, under bench/gpu.sh, collected
into one table. Never run by the tests (tests/test_gpu_bench.py checks the timeline
arithmetic and the table on CPU).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import List, NamedTuple, Optional

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from nbtrain.data.batches import TensorBatches
from nbtrain.auto.flops import percent as mfu_percent
from nbtrain.tools.profiling import host_syncs_per_step

BATCH, SAMPLES = 512, 16_384
STEPS = 100          # unprofiled run: samples/s over steps 11..STEPS
PROFILED_STEPS = 40  # profiled run: timeline over steps 6..PROFILED_STEPS
SKIP = 5
GB = 1e9


# --- the checks bench/gpu.sh collects into one table -------------------------------------

def check(name: str, value: str, target: str, ok: Optional[bool]) -> dict:
    """One check: printed now, and appended to $NBTRAIN_BENCH_CHECKS (a JSON line) for the
    closing table. `ok` None: a figure to read, with no target to meet."""
    row = {"check": name, "value": value, "target": target,
           "verdict": "-" if ok is None else ("met" if ok else "MISSED")}
    print(f"- {name}: {value} (target: {target}): {row['verdict']}", flush=True)
    path = os.environ.get("NBTRAIN_BENCH_CHECKS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def summary(path: str) -> str:
    """The markdown table of every check in `path` (JSON lines), and how many missed."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    missed = sum(r["verdict"] == "MISSED" for r in rows)
    lines = ["| check | value | target | verdict |", "|---|---|---|---|"]
    lines += [f"| {r['check']} | {r['value']} | {r['target']} | {r['verdict']} |" for r in rows]
    lines.append(f"\n{len(rows)} checks, {missed} missed")
    return "\n".join(lines)


# --- the GPU timeline ------------------------------------------------------------------

class Span(NamedTuple):
    kind: str        # "kernel", "memset" or "copy"
    name: str
    start: int       # ns
    end: int
    nbytes: int      # copies only


_KINDS = {"kernel": "kernel", "gpu_memset": "memset", "gpu_memcpy": "copy"}


def device_spans(prof) -> List[Span]:
    """The kernels, memsets and copies the GPU ran while `prof` recorded, read from the
    trace the profiler exports: Kineto writes each GPU activity's category and a copy's
    bytes there on every torch version, where the Python bindings of its events differ
    (torch 2.11, the GPU machine's, binds no activity_type(), and no copy's size)."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return trace_spans(json.load(f)["traceEvents"])


def trace_spans(events) -> List[Span]:
    """The GPU's spans among a Chrome trace's events (times in us there, ns here)."""
    spans = []
    for e in events:
        kind = _KINDS.get(e.get("cat"))
        if kind and e.get("ph") == "X":
            start = round(float(e["ts"]) * 1000)
            spans.append(Span(kind, e.get("name", ""), start,
                              start + round(float(e.get("dur", 0)) * 1000),
                              int(e.get("args", {}).get("bytes", 0))))
    return spans


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
        return sum(r["samples"] for r in records) / sum(r["interval_s"] for r in records), \
            {"chosen": chosen, **own_split(run)}
    return rate, lambda: train(PROFILED_STEPS)


def own_split(run) -> dict:
    """What nbtrain's records say of a run: the medians of its split after the first
    record (the warm-up), its MFU, the last diagnosis."""
    records = run.records("train")[1:] or run.records("train")

    def median(field):
        values = [r[field] for r in records if r.get(field) is not None]
        return statistics.median(values) if values else None
    fetch = [r["host_fetch_s"] / r["step_time_s"] for r in records if "host_fetch_s" in r]
    return {"data_wait": median("data_wait_frac"), "copy": median("copy_frac"),
            "host_fetch": statistics.median(fetch) if fetch else None, "mfu": median("mfu"),
            "diagnosis": records[-1].get("diagnosis", "") if records else ""}


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
    """GB/s of one host-to-device copy of `mib` MiB."""
    host = torch.empty(mib * 2**20, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty_like(host, device="cuda")
    return mib * 2**20 / GB / cuda_ms(lambda: dev.copy_(host, non_blocking=pinned), repeats=10) * 1e3


def percent(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def data_paths(x, y, width, pinned_gb_s):
    """Section 3: one row per data path; the checks on the prefetcher's and on nbtrain's
    own split against the profiler's timeline."""
    print("| data path | samples/s | vs plain | GPU idle | nbtrain data wait | nbtrain copy | "
          "host fetch | MFU | batch copy GB/s | % of pinned | copy under a kernel | "
          "diagnosis | settings |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    results, plain = {}, None
    for name, path, settings in PATHS:
        rate, profile_run = path(width, x, y, **settings)
        samples_s, own = rate()
        plain = plain or samples_s
        t = results[name] = {**profiled(profile_run), **own}
        gb = None if t["copy_gib_s"] is None else t["copy_gib_s"] * 2**30 / GB
        mfu = t.get("mfu")
        print(f"| {name} | {samples_s:,.0f} | {samples_s / plain:.2f}x | {t['idle']:.1%} | "
              f"{percent(t.get('data_wait'))} | {percent(t.get('copy'))} | "
              f"{percent(t.get('host_fetch'))} | {'-' if mfu is None else mfu_percent(mfu)} | "
              f"{'-' if gb is None else f'{gb:.1f}'} | "
              f"{'-' if gb is None else f'{gb / pinned_gb_s:.0%}'} | "
              f"{percent(t['copy_overlap'])} | {t.get('diagnosis', '')} | "
              f"{t.get('chosen') or ''} |", flush=True)
    return results


def data_path_checks(results, pinned_gb_s) -> None:
    ahead = results["nbtrain, pinned + side-stream prefetch"]
    copy_gb_s = (ahead["copy_gib_s"] or 0) * 2**30 / GB
    check("prefetched batch copies, share of pinned bandwidth", f"{copy_gb_s / pinned_gb_s:.0%}",
          ">= 80%", copy_gb_s >= 0.8 * pinned_gb_s)
    check("GPU idle with the prefetcher (profiler)", f"{ahead['idle']:.1%}", "<= 5%",
          ahead["idle"] <= 0.05)
    check("MFU counted with the prefetcher (bug 1)", "-" if ahead.get("mfu") is None
          else mfu_percent(ahead["mfu"]), "a figure", ahead.get("mfu") is not None)
    for name, t in results.items():
        if t.get("data_wait") is None:
            continue   # the plain loop: no nbtrain record
        # the data wait is GPU idle time while the host fetched: never more than the GPU's
        # idle time in all (bug 3: host time read 25-50% while the GPU was busy)
        check(f"{name}: nbtrain's data wait within the GPU's idle time", f"{t['data_wait']:.1%} "
              f"vs {t['idle']:.1%} (host fetch {percent(t['host_fetch'])})", "<= idle + 5 points",
              t["data_wait"] <= t["idle"] + 0.05)


# --- a copy-bound case ----------------------------------------------------------------------

class SamePinnedBatch(torch.utils.data.IterableDataset):
    """One big pinned batch served again and again: no host work, only the copy (a
    pinned tensor is pinned again as it is: Tensor.pin_memory returns it)."""

    def __init__(self, batches: int):
        self.batches = batches
        self.x = torch.randn(1024, 3, 128, 128).pin_memory()   # 192 MiB
        self.y = torch.zeros(1024, dtype=torch.long).pin_memory()

    def __iter__(self):
        return iter([(self.x, self.y)] * self.batches)

    def __len__(self):
        return self.batches


def copy_bound() -> None:
    """Section 4: a step that waits for its copy reads copy-bound (bug 2: with prefetch the
    copy read about zero)."""
    def train(steps):
        loader = DataLoader(SamePinnedBatch(steps), batch_size=None, pin_memory=True)
        model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 10))
        cfg = nt.TrainConfig(max_steps=steps, amp="off", log_every=10)
        return nt.fit(model, loader, F.cross_entropy, config=cfg, progress=False)
    run = train(40)
    own, t = own_split(run), profiled(lambda: train(20))
    print(f"\ncopy-bound case (192 MiB pinned batches, a pooling model, prefetch "
          f"{run.resolved['prefetch_to_device'][0]}): nbtrain copy {percent(own['copy'])}, data "
          f"wait {percent(own['data_wait'])}; profiler: GPU idle {t['idle']:.0%} (kernels "
          f"only), batch copies {percent(t['copy_overlap'])} under a kernel; "
          f"{own['diagnosis']}\n", flush=True)
    check("copy-bound case with the prefetcher reads copy-bound (bug 2)",
          f"copy {percent(own['copy'])}: {own['diagnosis'].split(' - ')[0]}", "copy-bound",
          own["diagnosis"].startswith("copy-bound"))


# --- host syncs per step --------------------------------------------------------------------

SYNC_CASES = [
    ("default (auto: bf16, fused AdamW, prefetch)", dict(data_on_device=False)),
    ("fp16, fused AdamW", dict(amp="fp16", optimizer="adamw", optimizer_impl="fused")),
    ("fp16, RAdam (foreach)", dict(amp="fp16", optimizer="radam")),
]


def syncs_per_step(x, y, **settings) -> float:
    """The steps' syncs alone: a 40-step run's less a 20-step run's (the setup's are alike)."""
    def fit(steps):
        cfg = nt.TrainConfig(max_steps=steps, batch_size=256, log_every=10, **settings)
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 64 * 64, 256), nn.ReLU(), nn.Linear(256, 10))
        # pixels in [0, 1]: on raw 0..255, fp16 RAdam diverged and on_nan='stop' cut the
        # 40-step run short, so the syncs were divided by steps that never ran
        return lambda: nt.fit(model, (x.float() / 255, y), F.cross_entropy, config=cfg,
                              progress=False)
    return host_syncs_per_step(fit)


def sync_checks(x, y) -> None:
    """Section 5: the loop's one read per record; fp16 without a fused optimizer, one more
    per step (GradScaler._maybe_opt_step's found_inf.item())."""
    x, y = x[:4096], y[:4096]
    found = {name: syncs_per_step(x, y, **settings) for name, settings in SYNC_CASES}
    print("| path | syncs per step |\n|---|---:|")
    for name, value in found.items():
        print(f"| {name} | {value:.2f} |")
    print()
    check("syncs per step, default path", f"{found[SYNC_CASES[0][0]]:.2f}", "<= 0.2 (a read per record)",
          found[SYNC_CASES[0][0]] <= 0.2)
    check("syncs per step, fp16 with the fused AdamW", f"{found[SYNC_CASES[1][0]]:.2f}", "<= 0.2",
          found[SYNC_CASES[1][0]] <= 0.2)
    check("syncs per step, fp16 with RAdam (the diagnosis's note)", f"{found[SYNC_CASES[2][0]]:.2f}",
          ">= 1 (GradScaler's inf check)", found[SYNC_CASES[2][0]] >= 1)


def main():
    assert torch.cuda.is_available(), "bench/gpu.py needs a CUDA device"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn.benchmark "
          f"{torch.backends.cudnn.benchmark} (torch's default)\n")
    pinned, pageable = bandwidth(True), bandwidth(False)
    print(f"| host-to-device copy, 256 MiB | GB/s |\n|---|---:|\n| pinned | {pinned:.1f} |\n"
          f"| pageable | {pageable:.1f} |\n", flush=True)
    check("host-to-device GB/s, pinned vs pageable", f"{pinned:.1f} vs {pageable:.1f}",
          "pinned faster", pinned > pageable)

    x, y = images()
    width, costs = choose_width(x, y)
    print(f"input-heavy case: {SAMPLES} uint8 images 3x64x64, batch {BATCH}, conv width "
          f"{width}; " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()) + "\n", flush=True)
    results = data_paths(x, y, width, pinned)
    print()
    data_path_checks(results, pinned)
    copy_bound()
    sync_checks(x, y)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--summary":
        print(summary(sys.argv[2]))
    else:
        main()
