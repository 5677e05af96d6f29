"""Training threads and loader workers on the same CPU cores, measured in one run.

    python bench/threads.py [--repeats 5]

A per-sample dataset (the digits images, with some per-sample work standing in for
decoding) loaded by one worker process while a small CNN trains on the CPU. A plain
PyTorch loop keeps torch's default thread count, one per core, so the worker and the
training threads oversubscribe the cores. nbtrain's num_threads='auto' leaves the
worker's core to it. Prints samples/s (median of interleaved epochs) and ratios.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import nbtrain as nt
from nbtrain.machine import machine_line
from nbtrain.data import available_cores

WORKERS, BATCH, EPOCHS = 1, 64, 2


class DecodedDigits(Dataset):
    """Each sample costs a little CPU work, as decoding an image would."""

    def __init__(self):
        self.x, self.y = nt.datasets.digits("all")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        for _ in range(20):
            x = (x * 1.0001).clamp(0, 1)
        return x, self.y[i]


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def plain_loop(data) -> float:
    model = cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=WORKERS)
    start, seen = time.perf_counter(), 0
    for _ in range(EPOCHS):
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            seen += len(x)
    return seen / (time.perf_counter() - start)


def nbtrain_loop(data, threads) -> float:
    cfg = nt.TrainConfig(device="cpu", amp="off", epochs=EPOCHS, batch_size=BATCH,
                         num_workers=WORKERS, num_threads=threads)
    start = time.perf_counter()
    run = nt.fit(cnn(), data, F.cross_entropy, config=cfg, progress=False)
    return run.summary()["samples"] / (time.perf_counter() - start)


def main():
    print(machine_line())   # the caption: which CPU, its bf16 units, the load
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    data, cores = DecodedDigits(), available_cores()
    torch.set_num_threads(cores)   # torch's default: a thread per core
    ways = {"plain loop (torch default threads)": lambda: plain_loop(data),
            f"nbtrain num_threads={cores} (same threads)": lambda: nbtrain_loop(data, cores),
            "nbtrain num_threads='auto'": lambda: nbtrain_loop(data, "auto")}
    rates = {name: [] for name in ways}
    for _ in range(args.repeats):   # interleaved: drift on a shared machine hits all alike
        for name, way in ways.items():
            rates[name].append(way())
    print(f"torch {torch.__version__}, {cores} cores, {WORKERS} worker, median of "
          f"{args.repeats} runs of {EPOCHS} epochs\n")
    print("| way | samples/s | vs plain |\n|---|---:|---:|")
    plain = statistics.median(rates["plain loop (torch default threads)"])
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"| {name} | {rate:,.0f} | {rate / plain:.2f}x |")


if __name__ == "__main__":
    main()
