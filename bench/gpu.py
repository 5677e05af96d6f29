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
   copies, and the share of copy time spent under a kernel. A plain-torch reference runs
   the same step with its batch copied on a side stream as torch's docs have it: the
   prefetcher's copies are checked against its bandwidth (the 256 MiB copy on an idle GPU
   is printed too), each path's copies split into those under a kernel and those alone,
   and its host-to-device copies counted by Kineto's name (Pinned or Pageable -> Device).
4. A copy-bound case: one big pinned batch served as it is (no host work, only the copy),
   prefetched: the diagnosis must say copy-bound (issue 28, bug 2).
5. Host syncs per step, counted under torch.cuda.set_sync_debug_mode("warn") from the
   first step's start to the last step's end of one run, with the lines they came from:
   the default path, fp16 with the fused AdamW, fp16 with RAdam (GradScaler's inf check).

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
from collections import Counter
from typing import List, NamedTuple, Optional

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from nbtrain.data.batches import TensorBatches
from nbtrain.auto.rates import percent as mfu_percent
from nbtrain.tools.profiling import sources_text, step_syncs

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


def host_to_device(spans: List[Span], lo: int, hi: int) -> List[Span]:
    """The host-to-device copies that start in [lo, hi)."""
    return [s for s in spans if s.kind == "copy" and "htod" in s.name.lower()
            and lo <= s.start < hi]


def gib_s(copies: List[Span]) -> Optional[float]:
    """The copies' bytes over their summed time, in GiB/s (None: no copy)."""
    ns = sum(s.end - s.start for s in copies)
    return sum(s.nbytes for s in copies) / ns * 1e9 / 2**30 if ns else None


def split_by_overlap(copies: List[Span], compute):
    """(the copies with any of their time under `compute`, those with none of it)."""
    under, alone = [], []
    for s in copies:
        (under if overlap([(s.start, s.end)], compute) else alone).append(s)
    return under, alone


def copy_names(copies: List[Span]) -> Counter:
    """How many copies of each name: Kineto names the host memory of a copy, as in
    'Memcpy HtoD (Pinned -> Device)' or 'Memcpy HtoD (Pageable -> Device)'."""
    return Counter(s.name for s in copies)


def timeline(spans: List[Span], skip: int = SKIP) -> dict:
    """GPU idle share of a step; the batch copies' (1 MiB or more) bandwidth, under a
    kernel and alone, and their overlap with kernels; the host-to-device copies' names."""
    lo, hi, steps = steady_window(spans, skip)

    def inside(kinds):
        return [(max(s.start, lo), min(s.end, hi)) for s in spans
                if s.kind in kinds and s.end > lo and s.start < hi]
    compute = inside(("kernel", "memset"))
    htod = host_to_device(spans, lo, hi)
    batch_copies = [s for s in htod if s.nbytes >= 2**20]
    under, alone = split_by_overlap(batch_copies, compute)
    copies = [(s.start, s.end) for s in batch_copies]
    return {"step_ms": (hi - lo) / steps / 1e6,
            "idle": 1 - covered(compute) / (hi - lo),
            "copy_gib_s": gib_s(batch_copies),
            "copy_gib_s_under_kernel": gib_s(under), "copies_under_kernel": len(under),
            "copy_gib_s_alone": gib_s(alone), "copies_alone": len(alone),
            "copy_overlap": overlap(copies, compute) / covered(copies) if copies else None,
            "batch_copy_names": copy_names(batch_copies),
            "small_copy_names": copy_names([s for s in htod if s.nbytes < 2**20])}


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


def rate_of(train):
    """samples/s of `train(STEPS, timed_from=10)`, which returns when its timing started."""
    def rate():
        start = train(STEPS, timed_from=10)
        return (STEPS - 10) * BATCH / (time.perf_counter() - start), {}
    return rate


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
    return rate_of(train), lambda: train(PROFILED_STEPS)


def side_stream_path(width, x, y):
    """The prefetcher's reference, plain torch: the same net and fused AdamW, and a pinned
    batch of the same size copied every step on a side stream, as torch's docs have it
    (the copy allocated on the side stream, the compute stream waits for it, the tensor
    recorded on the compute stream). The targets stay on the device: 4 KiB, no batch copy."""
    host, yb = x[:BATCH].pin_memory(), y[:BATCH].cuda()

    def train(steps, timed_from=None):
        model = convnet(width).cuda()
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        side, current = torch.cuda.Stream(), torch.cuda.current_stream()
        start = None
        for done in range(steps):
            if done == timed_from:
                torch.cuda.synchronize()
                start = time.perf_counter()
            with torch.cuda.stream(side):
                xb = host.to("cuda", non_blocking=True)
            current.wait_stream(side)
            xb.record_stream(current)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
        torch.cuda.synchronize()
        return start
    return rate_of(train), lambda: train(PROFILED_STEPS)


PREFETCH = "nbtrain, pinned + side-stream prefetch"
REFERENCE = "plain torch: pinned batch, side-stream copy"
PATHS = [
    ("plain loop: DataLoader, .cuda()", plain_path, {}),
    ("nbtrain, pageable copy", nbtrain_path,
     dict(pin_memory=False, data_on_device=False, prefetch_to_device=False)),
    ("nbtrain, pinned + non_blocking", nbtrain_path,
     dict(pin_memory=True, data_on_device=False, prefetch_to_device=False)),
    (PREFETCH, nbtrain_path, dict(pin_memory=True, data_on_device=False, prefetch_to_device=True)),
    (REFERENCE, side_stream_path, {}),
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


def gb_s(gib) -> Optional[float]:
    """GiB/s (the timeline's) in GB/s (the bandwidth's)."""
    return None if gib is None else gib * 2**30 / GB


def names_text(names: Counter) -> str:
    """'Pinned -> Device x35, Pageable -> Device x1' from Kineto's copy names."""
    return ", ".join(f"{name.split('(')[-1].rstrip(')')} x{n}"
                     for name, n in names.most_common()) or "-"


def copy_share(t: dict, reference: dict) -> Optional[float]:
    """The batch copies' bandwidth in timeline `t` as a share of `reference`'s (None:
    either has no batch copy)."""
    if not t.get("copy_gib_s") or not reference.get("copy_gib_s"):
        return None
    return t["copy_gib_s"] / reference["copy_gib_s"]


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


def copy_table(results, pinned_gb_s) -> None:
    """Each path's batch copies: GB/s under a kernel and alone, against the idle 256 MiB
    copy and the side-stream reference; the host-to-device copies by Kineto's name."""
    print("\n| data path | batch copy GB/s | under a kernel GB/s (copies) | alone GB/s (copies) | "
          "% of idle pinned | % of reference | batch copies | smaller host-to-device copies |"
          "\n|---|---:|---:|---:|---:|---:|---|---|")
    reference = results[REFERENCE]

    def figure(gib, count=None):
        text = "-" if gib is None else f"{gb_s(gib):.1f}"
        return text if count is None else f"{text} ({count})"
    for name, t in results.items():
        gb = gb_s(t["copy_gib_s"])
        print(f"| {name} | {figure(t['copy_gib_s'])} | "
              f"{figure(t['copy_gib_s_under_kernel'], t['copies_under_kernel'])} | "
              f"{figure(t['copy_gib_s_alone'], t['copies_alone'])} | "
              f"{percent(None if gb is None else gb / pinned_gb_s)} | "
              f"{percent(copy_share(t, reference))} | {names_text(t['batch_copy_names'])} | "
              f"{names_text(t['small_copy_names'])} |", flush=True)


def prefetch_vs_reference(ahead: dict, reference: dict) -> dict:
    """The check (F4): the prefetcher's batch copies reach >= 80% of the bandwidth of the
    same copies made on a side stream by plain torch under the same step."""
    share = copy_share(ahead, reference)
    value = "-" if share is None else (f"{share:.0%} ({gb_s(ahead['copy_gib_s']):.1f} vs "
                                       f"{gb_s(reference['copy_gib_s']):.1f} GB/s)")
    return check("prefetched batch copies, share of the side-stream reference's bandwidth",
                 value, ">= 80%", share is not None and share >= 0.8)


def data_path_checks(results, pinned_gb_s) -> None:
    ahead, reference = results[PREFETCH], results[REFERENCE]
    shares = [percent(None if t["copy_gib_s"] is None else gb_s(t["copy_gib_s"]) / pinned_gb_s)
              for t in (ahead, reference)]
    check("batch copies, share of an idle GPU's 256 MiB pinned copy: prefetch / reference",
          " / ".join(shares), "a figure", None)
    prefetch_vs_reference(ahead, reference)
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


def syncs_per_step(x, y, **settings):
    """The syncs of one 40-step run's steps alone, from the first step's start to the last
    step's end (an AssertionError if it stopped early), and the lines they came from."""
    def fit(steps):
        cfg = nt.TrainConfig(max_steps=steps, batch_size=256, log_every=10, **settings)
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 64 * 64, 256), nn.ReLU(), nn.Linear(256, 10))
        # pixels in [0, 1]: on raw 0..255, fp16 RAdam diverged and on_nan='stop' cut the
        # 40-step run short, so the syncs were divided by steps that never ran
        return lambda: nt.fit(model, (x.float() / 255, y), F.cross_entropy, config=cfg,
                              progress=False)
    return step_syncs(fit, steps=40)


def sync_checks(x, y) -> None:
    """Section 5: the loop's one read per record; fp16 without a fused optimizer, one more
    per step (GradScaler._maybe_opt_step's found_inf.item())."""
    x, y = x[:4096], y[:4096]
    counted = {name: syncs_per_step(x, y, **settings) for name, settings in SYNC_CASES}
    print("| path | syncs per step | steps counted | from (file:line x syncs) |\n"
          "|---|---:|---:|---|")
    for name, c in counted.items():
        print(f"| {name} | {c.per_step:.2f} | {c.steps} | {sources_text(c.sources) or '-'} |")
    print()
    found = {name: c.per_step for name, c in counted.items()}
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
    copy_table(results, pinned)
    print()
    data_path_checks(results, pinned)
    copy_bound()
    sync_checks(x, y)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--summary":
        print(summary(sys.argv[2]))
    else:
        main()
