"""`nbtrain demo`: the digits CNN trained as a plain loop would, then with nbtrain's toggles
added one at a time, so each row says what that toggle brought.

Short runs on a shared machine are noisy (one run can be off by 15% or more): the cases
are interleaved and repeated, and the table gives medians with their spread.
"""
from __future__ import annotations

import os
import statistics

import torch
from torch import nn

from . import datasets
from .config import TrainConfig
from .devices import available_cores
from .entry import fit

# Everything a hand-written loop leaves at PyTorch's defaults: fp32, per-sample
# DataLoader with no workers and no pinning, the for-loop optimizer.
PLAIN = dict(amp="off", batched_fetch=False, num_workers=0, pin_memory=False,
             data_on_device=False, optimizer_impl="for-loop")

# The toggles, in the order that explains the difference: each row keeps the ones above.
STEPS = (
    ("+ batched fetch", ("batched_fetch", "num_workers", "pin_memory", "data_on_device")),
    ("+ measured threads", ("num_threads",)),
    ("+ fused optimizer", ("optimizer_impl",)),
    ("+ mixed precision", ("amp",)),
)


def digits_cnn() -> nn.Module:
    return nn.Sequential(                                        # (N, 1, 8, 8)
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),                                         # (N, 64, 4, 4)
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(),
        nn.Linear(128, 10))


def demo_configs(base: TrainConfig) -> dict:
    """'plain loop', then one toggle more per row, ending at `base` ("auto" everywhere)."""
    plain = dict(PLAIN, num_threads=torch.get_num_threads())   # a plain loop keeps torch's
    configs = {"plain loop": base.replace(**plain)}
    for name, fields in STEPS:
        for field in fields:
            plain.pop(field)
        configs[name] = base.replace(**plain)
    return configs


def run_demo(epochs: int = 4, repeats: int = 3, progress: bool = False) -> dict:
    """Train every case `repeats` times, interleaved; print the table; return the runs."""
    x, y = datasets.digits("train")
    xv, yv = datasets.digits("val")
    base = TrainConfig(epochs=epochs, batch_size=64, optimizer="adamw", lr=3e-3,
                       scheduler="onecycle", seed=0)
    busy = busy_note()
    if busy:
        print(busy)
    runs = {name: [] for name in demo_configs(base)}
    for repeat in range(repeats):
        for name, cfg in demo_configs(base).items():
            print(f"repeat {repeat + 1}/{repeats}: {name}", flush=True)
            torch.manual_seed(0)
            runs[name].append(fit(digits_cnn(), (x, y), nn.functional.cross_entropy,
                                  config=cfg, val_data=(xv, yv), progress=progress))
    print("\n" + comparison_table(runs) + ("\n\n" + busy if busy else ""))
    return runs


def busy_note() -> str:
    """A warning when other processes load the machine: the figures will be low and noisy."""
    load, cores = os.getloadavg()[0], available_cores()
    if load <= cores:
        return ""
    return (f"note: the machine is busy (load {load:.1f} on {cores} core(s)): other processes "
            "take CPU time from these runs, so rates are lower and noisier than on an idle "
            "machine.")


def comparison_table(runs: dict) -> str:
    """One row per case: median samples/s with its spread, the ratio to the plain loop,
    validation accuracy; then what "auto" chose and why."""
    rates = {name: [r.summary()["samples_per_s"] for r in rs] for name, rs in runs.items()}
    plain = statistics.median(next(iter(rates.values())))
    lines = [f"{'':<20}{'samples/s':>11}{'spread':>9}{'vs plain':>10}{'val acc':>9}",
             f"{'':<20}{'(median)':>11}{'(min-max)':>9}"]
    for name, values in rates.items():
        median = statistics.median(values)
        spread = (max(values) - min(values)) / median if median else 0.0
        acc = statistics.median(r.summary().get("val_acc", float("nan")) for r in runs[name])
        lines.append(f"{name:<20}{median:>11,.0f}{spread:>8.0%} {median / plain:>9.2f}x"
                     f"{acc:>9.1%}")
    auto = list(runs.values())[-1][-1]
    lines += ["", f"median of {len(next(iter(rates.values())))} interleaved runs each; each row "
              "adds one toggle to the rows above it, and the last is nbtrain's defaults", "",
              "what 'auto' chose, and why:"]
    width = max(len(k) for k in auto.resolved) + 2
    values = {k: f"{v:.4g}" if isinstance(v, float) else str(v)
              for k, (v, _) in auto.resolved.items()}
    shown = max(map(len, values.values())) + 2
    lines += [f"  {k:<{width}}{values[k]:<{shown}}{why}" for k, (_, why) in auto.resolved.items()]
    return "\n".join(lines)
