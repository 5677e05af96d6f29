"""autotune against an exhaustive grid over the same settings, measured in the same run.

    python bench/autotune.py [--budget 15] [--grid-trial 2] [--repeats 3]

Case 1, a map-style dataset whose __getitem__ busy-works ~1 ms per sample (decoding,
augmenting): every candidate autotune would consider is measured for --grid-trial
seconds (the grid); then autotune runs with --budget. The grid's best and autotune's
pick are re-measured --repeats times, interleaved, at the grid's trial length (the
grid's own best figure is the maximum of many noisy numbers, so it flatters the grid).
Targets (issue 7): pick >= 90% of the grid best's samples/s; tuning <= 25% of grid time.

Case 2, in-memory tensors (digits): autotune must never pick loader workers where
batched fetch is faster; batched fetch's and the best worker setting's speeds are shown.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import nbtrain as nt
from nbtrain.machine import machine_line
from nbtrain.tools.autotune import Trials, autotune, candidate_settings, data_kind, search_space
from nbtrain.data import available_cores
from nbtrain.auto.devices import resolve_device


class BusyDataset(Dataset):
    """Digits rows, each costing ~`ms` of CPU work in __getitem__ (like a JPEG decode)."""

    def __init__(self, x, y, ms: float = 1.0):
        self.x, self.y, self.seconds = x, y, ms / 1000

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:   # busy, holding the GIL: real CPU work
            pass
        return self.x[i], self.y[i]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def grid(data, base, trial_s: float):
    """Every candidate, each timed for `trial_s`: [(settings, samples/s)], seconds."""
    device, _ = resolve_device(base.device)
    kind = data_kind(data)
    candidates = candidate_settings(kind, search_space(kind, data, base, device, None))
    measure = Trials(mlp, data, F.cross_entropy, base, device)
    measure.tuned_keys = sorted({k for c in candidates for k in c})
    start = time.perf_counter()
    results = [(c, measure(c, trial_s)["samples_per_s"]) for c in candidates]
    return results, time.perf_counter() - start


def remeasure(data, base, settings_by_name: dict, trial_s: float, repeats: int) -> dict:
    """Median samples/s per named setting, the trials interleaved so noise hits all alike."""
    device, _ = resolve_device(base.device)
    measure = Trials(mlp, data, F.cross_entropy, base, device)
    seen = {name: [] for name in settings_by_name}
    for _ in range(repeats):
        for name, settings in settings_by_name.items():
            seen[name].append(measure(settings, trial_s)["samples_per_s"])
    return {name: statistics.median(v) for name, v in seen.items()}


def load() -> str:
    return f"[load {os.getloadavg()[0]:.1f}]"


def short(settings: dict) -> str:
    keys = ("num_workers", "prefetch_factor", "persistent_workers", "batched_fetch", "amp",
            "batch_size")
    return ", ".join(f"{k}={settings[k]}" for k in keys if k in settings)


def busy_case(args) -> None:
    x, y = nt.datasets.digits("train", images=False)
    data = BusyDataset(x, y, ms=1.0)
    base = nt.TrainConfig(device="cpu", batch_size=64)
    print(f"== case 1: map-style dataset, ~1 ms of CPU work per sample, {len(data)} samples")
    results, grid_s = grid(data, base, args.grid_trial)
    best_settings, best_sps = max(results, key=lambda r: r[1])
    print(f"grid: {len(results)} configs x {args.grid_trial:g} s timed: {grid_s:.1f} s; "
          f"best {best_sps:,.0f} samples/s ({short(best_settings)}) {load()}")
    tuning = autotune(mlp, data, F.cross_entropy, config=base, budget_s=args.budget, cache=False)
    stages = [sum(t["stage"] == s for t in tuning.trials) for s in (1, 2)]
    print(f"autotune: {len(tuning.trials)} trials ({stages[0]} + {stages[1]} by stage) in "
          f"{tuning.cost_s:.1f} s (budget {args.budget:g} s); picked {short(tuning.settings)} "
          f"{load()}")
    for note in tuning.notes:
        print(f"  note: {note}")
    again = remeasure(data, base, {"grid best": best_settings, "autotune": tuning.settings},
                      args.grid_trial, args.repeats)
    ratio = again["autotune"] / again["grid best"]
    cost = tuning.cost_s / grid_s
    print(f"re-measured (median of {args.repeats}): grid best {again['grid best']:,.0f}, "
          f"autotune {again['autotune']:,.0f} samples/s")
    print(f"  throughput of pick / grid best: {ratio:6.1%}   (target >= 90%)  "
          f"{'ok' if ratio >= 0.9 else 'MISSED'}")
    print(f"  tuning time / grid time:        {cost:6.1%}   (target <= 25%)  "
          f"{'ok' if cost <= 0.25 else 'MISSED'}")


def tensor_case(args) -> None:
    x, y = nt.datasets.digits("train", images=False)
    base = nt.TrainConfig(device="cpu", batch_size=64)
    print("\n== case 2: in-memory tensors (digits 1438x64)")
    results, grid_s = grid((x, y), base, args.grid_trial / 2)
    batched = max(s for c, s in results if c.get("batched_fetch"))
    workers = max(s for c, s in results if not c.get("batched_fetch"))
    print(f"grid ({grid_s:.1f} s): best batched fetch {batched:,.0f}, best with workers "
          f"{workers:,.0f} samples/s")
    picks = []
    for _ in range(args.repeats):
        tuning = autotune(mlp, (x, y), F.cross_entropy, config=base,
                          budget_s=args.budget / 3, cache=False)
        picks.append(tuning.settings)
        print(f"autotune ({tuning.cost_s:.1f} s): {short(tuning.settings)}")
    wrong = [p for p in picks if p.get("num_workers")] if batched > workers else []
    print(f"  picked workers where batched fetch is faster: {len(wrong)} of {len(picks)}  "
          f"{'ok' if not wrong else 'MISSED'}")


def main() -> None:
    print(machine_line())   # the caption: which CPU, its bf16 units, the load
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=15.0, help="autotune budget, seconds")
    parser.add_argument("--grid-trial", type=float, default=2.0,
                        help="timed seconds per grid config")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{available_cores()} cores, load average {os.getloadavg()[0]:.1f} "
          "(other processes' load makes every figure noisy)")
    busy_case(args)
    tensor_case(args)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
