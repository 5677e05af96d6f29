"""What telemetry costs: nt.fit with telemetry on and off, interleaved, same process.

    python bench/telemetry.py [--repeats 21]

The MLP case of bench/overhead.py (64-128-10, 8,192x64, batch 64, one epoch); with
log_every=10 (the default) and log_every=1 (a record every step, the worst case).
Target (issue 4): telemetry on costs at most 2% more time per step; issue 17: still so with
count_flops on (its FLOP count and peak run once per fit, cached; each record adds tflops/mfu).
The baseline has both off.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.machine import machine_line


def epoch_time(x, y, **overrides) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    cfg = nt.TrainConfig(epochs=1, batch_size=64, optimizer="adamw", **overrides)
    start = time.perf_counter()
    run = nt.fit(model, (x, y), F.cross_entropy, config=cfg, progress=False)
    return (time.perf_counter() - start) / run.step


def main(argv=None):
    print(machine_line())   # the caption: which CPU, its bf16 units, the load
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8192, 64, generator=gen), torch.randint(0, 10, (8192,), generator=gen)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} interleaved epochs\n")
    arms = {"off": dict(telemetry=False, count_flops=False),
            "on": dict(telemetry=True, count_flops=False),
            "on + count_flops": dict(telemetry=True, count_flops=True)}
    print("| log_every | off ms/step | on ms/step | on / off | on + count_flops ms/step | "
          "/ off |\n|---:|---:|---:|---:|---:|---:|")
    for log_every in (10, 1):
        times = {name: [] for name in arms}
        for settings in arms.values():
            epoch_time(x, y, log_every=log_every, **settings)   # warm-up (and the FLOP count)
        for _ in range(args.repeats):
            for name, settings in arms.items():
                times[name].append(epoch_time(x, y, log_every=log_every, **settings))
        off, on, flops = (statistics.median(times[name]) for name in arms)
        print(f"| {log_every} | {off * 1e3:.3f} | {on * 1e3:.3f} | {on / off:.3f}x | "
              f"{flops * 1e3:.3f} | {flops / off:.3f}x |", flush=True)

if __name__ == "__main__":
    main()
