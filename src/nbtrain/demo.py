"""`nbtrain demo`: the digits CNN trained as a plain loop would, then with nbtrain's "auto"."""
from __future__ import annotations

import torch
from torch import nn

from . import datasets
from .config import TrainConfig
from .loop import fit

# Everything a hand-written loop leaves at PyTorch's defaults: fp32, per-sample
# DataLoader with no workers and no pinning, the for-loop optimizer.
PLAIN = dict(amp="off", batched_fetch=False, num_workers=0, pin_memory=False,
             data_on_device=False, optimizer_impl="for-loop")


def digits_cnn() -> nn.Module:
    return nn.Sequential(                                        # (N, 1, 8, 8)
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),                                         # (N, 64, 4, 4)
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(),
        nn.Linear(128, 10))


def run_demo(epochs: int = 8, progress: bool = True) -> dict:
    x, y = datasets.digits("train")
    xv, yv = datasets.digits("val")
    base = TrainConfig(epochs=epochs, batch_size=64, optimizer="adamw", lr=3e-3,
                       scheduler="onecycle", seed=0)
    runs = {}
    for name, cfg in (("plain loop", base.replace(**PLAIN)), ("nbtrain auto", base)):
        torch.manual_seed(0)
        print(f"\n== {name}")
        runs[name] = fit(digits_cnn(), (x, y), nn.functional.cross_entropy, config=cfg,
                         val_data=(xv, yv), progress=progress)
    print("\n" + comparison_table(runs))
    return runs


def comparison_table(runs: dict) -> str:
    summaries = {name: run.summary() for name, run in runs.items()}
    plain = next(iter(summaries.values()))
    lines = [f"{'':<14}{'samples/s':>12}{'wall s':>9}{'val acc':>9}{'speed-up':>10}"]
    for name, s in summaries.items():
        lines.append(f"{name:<14}{s['samples_per_s']:>12,.0f}{s['wall_s']:>9.2f}"
                     f"{s.get('val_acc', float('nan')):>9.1%}"
                     f"{s['samples_per_s'] / plain['samples_per_s']:>9.2f}x")
    auto = list(runs.values())[-1]
    lines += ["", "what 'auto' chose, and why:"]
    width = max(len(k) for k in auto.resolved) + 2
    lines += [f"  {k:<{width}}{str(v):<7}{why}" for k, (v, why) in auto.resolved.items()]
    return "\n".join(lines)
