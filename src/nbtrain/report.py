"""Summaries of a Run: a dict for code, a text table for people (and nbval)."""
from __future__ import annotations

import math

from .compiling import warmup_split
from .flops import percent, rate_fields
from .tables import plain


def summarize(run) -> dict:
    train = run.records("train")
    val = run.records("val")
    samples = sum(r["samples"] for r in train)
    busy = sum(r["interval_s"] for r in train)
    waited = sum(r["data_wait_s"] * r["steps"] for r in train)
    copied = sum(r.get("copy_s", 0.0) * r["steps"] for r in train)
    computed = sum(r.get("compute_s", 0.0) * r["steps"] for r in train)
    out = {
        "state": run.state, "message": run.message,
        "steps": run.step, "total_steps": run.total_steps, "epochs": run.epoch,
        "samples": samples,
        "samples_per_s": samples / busy if busy else math.nan,
        "step_time_s": busy / run.step if run.step and busy else math.nan,
        "data_wait_frac": waited / busy if busy else math.nan,
        "copy_frac": copied / busy if busy else math.nan,
        "compute_frac": computed / busy if busy else math.nan,
        "wall_s": run.wall_s,
        "final_loss": train[-1]["loss"] if train else math.nan,
        # the highest RSS sampled during this run (ru_maxrss is the whole process's peak)
        "peak_rss_mb": max((r["rss_mb"] for r in train if "rss_mb" in r), default=math.nan),
        "settings": {name: value for name, (value, _) in run.resolved.items()},
        "reasons": {name: why for name, (_, why) in run.resolved.items()},
    }
    if busy:   # the run's whole FLOPs over its whole time (empty when not counted)
        out.update(rate_fields({"steps": sum(r["steps"] for r in train), "interval_s": busy},
                               run.resolved))
    for name in ("host_reads_per_step", "kept_losses_per_step", "collated_samples_per_step"):
        if any(name in r for r in train):   # nt.watch's counters, over the whole run
            out[name] = sum(r.get(name, 0.0) * r["steps"] for r in train) / max(run.step, 1)
    if run.config.compile:   # the compiler's warm-up apart from the steady throughput
        split = warmup_split(train)   # the recompiles during training (a new batch shape)
        first = run.resolved.get("compile_warmup_s", (0.0, ""))[0]   # the setup's compile
        out["compile_warmup_s"] = first + split.get("compile_warmup_s", 0.0)
        out["steady_samples_per_s"] = split.get("steady_samples_per_s", out["samples_per_s"])
    if train and "copy_s" in train[-1]:
        from .diagnosis import diagnose
        out["diagnosis"] = diagnose(out, run.resolved)
    if any("cuda_peak_allocated_mb" in r for r in train):
        out["peak_cuda_mb"] = max(r.get("cuda_peak_allocated_mb", 0.0) for r in train)
    if val:
        out["val_loss"] = val[-1]["val_loss"]
        if "val_acc" in val[-1]:
            out["val_acc"] = val[-1]["val_acc"]
    return out


def summary_table(run) -> str:
    """Two blocks: results, then each resolved setting with its reason."""
    s = summarize(run)
    total = f"/{s['total_steps']}" if s["total_steps"] is not None else ""   # own loop: unknown
    rows = [("state", s["state"]), ("steps", f"{s['steps']}{total}"),
            ("samples/s", f"{s['samples_per_s']:,.0f}" if s["samples"] else "-"),
            ("wall time", f"{s['wall_s']:.2f} s"), ("final loss", plain(s["final_loss"]))]
    for key, label in (("val_loss", "val loss"), ("val_acc", "val accuracy")):
        if key in s:
            rows.append((label, plain(s[key])))
    if "compile_warmup_s" in s:
        compiles = s["settings"].get("compiles")
        rows.append(("compile", f"warm-up {s['compile_warmup_s']:.2f} s"
                     + (f" ({compiles} graph(s))" if compiles is not None else "")
                     + f", then {s['steady_samples_per_s']:,.0f} samples/s"))
    if "tflops" in s:
        rows.append(("compute rate", f"{s['tflops']:.3g} TFLOP/s" + (
            f", {percent(s['mfu'])} MFU" if "mfu" in s else "")))
    if "diagnosis" in s:
        rows.append(("time split", f"data wait {s['data_wait_frac']:.0%}, copy "
                                   f"{s['copy_frac']:.0%}, compute {s['compute_frac']:.0%}"))
        rows.append(("diagnosis", s["diagnosis"]))
    if s["message"]:
        rows.append(("note", s["message"]))
    width = max(len(name) for name in [k for k, _ in rows] + list(s["settings"])) + 2
    lines = [f"{k:<{width}}{v}" for k, v in rows]
    lines.append("")
    # a value wider than its column keeps a space before its reason
    lines += [f"{name:<{width}}{plain(value):<10} {s['reasons'][name]}"
              for name, value in s["settings"].items()]
    return "\n".join(lines)
