"""How the machine's speed wanders: why `nbtrain demo` times many short runs, not a few
long ones (issue 40).

    python bench/machine_noise.py [--seconds 60] [--threads 2]

Trains the demo's CNN on one fixed batch for `--seconds`, timing every 10 steps, then
cuts the timeline into windows of 0.25-6 s and compares each window with the next: the
same code, seconds apart. If the machine's noise were only fast jitter, longer windows
would average it away and neighbours would agree better; if its speed wanders over
seconds, they do not, and what narrows a comparison is the number of pairs of windows.
Prints, per window length, the middle half (IQR over the median) of the neighbours'
ratios and of the windows' own times.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn


def timeline(seconds: float, record_steps: int = 10) -> list:
    """Seconds per `record_steps` steps of the demo's CNN, for `seconds`."""
    from nbtrain.data import datasets
    from nbtrain.tools.demo import BATCH_SIZE, demo_cnn
    x, y = datasets.digits("train")
    xb, yb = x[:BATCH_SIZE], y[:BATCH_SIZE]
    model = demo_cnn()
    opt = torch.optim.AdamW(model.parameters(), 3e-3, foreach=False)
    times, end = [], time.time() + seconds
    while time.time() < end:
        start = time.perf_counter()
        for _ in range(record_steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        times.append(time.perf_counter() - start)
    return times


def middle_half(values) -> float:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / statistics.median(values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from nbtrain.machine import machine_line
    print(machine_line())
    times = timeline(args.seconds)
    record = statistics.median(times)
    print(f"{len(times)} records of 10 steps, median {record * 1e3:.1f} ms\n")
    print("| window | windows | neighbours' ratio, middle half | windows, middle half |")
    print("|---:|---:|---:|---:|")
    for length in (0.25, 0.5, 1, 2, 3, 6):
        n = max(1, round(length / record))
        windows = [sum(times[i:i + n]) for i in range(0, len(times) - n + 1, n)]
        if len(windows) < 5:
            continue
        ratios = [b / a for a, b in zip(windows, windows[1:])]
        print(f"| {length:g} s | {len(windows)} | {middle_half(ratios):.1%} | "
              f"{middle_half(windows):.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
