"""One process with every core against one process per core (TrainConfig(processes=N)).

    python bench/processes.py [--repeats 5] [--epochs 2]

On the CPU: 1 process x 2 intra-op threads against 2 processes x 1 thread each (gloo
all-reduce of the gradients), the same global batch, on the digits CNN (in-memory
tensors) and an MLP. On a machine with several GPUs: 1, 2, ... processes, one GPU each,
batch_size per process fixed (weak scaling). Interleaved runs, medians.

Two figures per way: `samples/s` is training throughput as the Run reports it (summed
over ranks, start-up excluded); `wall` is the whole fit call, process start included.
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
from nbtrain.machine import available_cores


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def one_fit(make_model, data, cfg) -> tuple:
    start = time.perf_counter()
    run = nt.fit(make_model(), data, F.cross_entropy, config=cfg, progress=False)
    return run.summary()["samples_per_s"], time.perf_counter() - start


def table(title: str, ways: dict, repeats: int) -> None:
    results = {name: [] for name in ways}
    for _ in range(repeats):   # interleaved: drift on a shared machine hits all alike
        for name, way in ways.items():
            results[name].append(way())
    first = statistics.median(r for r, _ in results[next(iter(ways))])
    print(f"\n{title}\n\n| way | samples/s | vs first | wall s |\n|---|---:|---:|---:|")
    for name, values in results.items():
        rate = statistics.median(r for r, _ in values)
        wall = statistics.median(w for _, w in values)
        print(f"| {name} | {rate:,.0f} | {rate / first:.2f}x | {wall:.1f} |")


def cpu_tables(repeats: int, epochs: int) -> None:
    cores = available_cores()
    x, y = nt.datasets.digits("all")
    flat = (x.flatten(1), y)
    for label, make, data, batch in (("digits CNN, 1797x1x8x8", cnn, (x, y), 64),
                                     ("MLP 64-512-512-10, 1797x64", mlp, flat, 64)):
        base = dict(device="cpu", amp="off", epochs=epochs, log_every=5)
        ways = {f"1 process x {cores} threads, batch {2 * batch}":
                lambda: one_fit(make, data, nt.TrainConfig(batch_size=2 * batch,
                                                            num_threads=cores, **base)),
                f"2 processes x {max(1, cores // 2)} thread(s), batch {batch} each":
                lambda: one_fit(make, data, nt.TrainConfig(batch_size=batch, processes=2,
                                                           **base))}
        table(f"{label}, global batch {2 * batch}, {epochs} epochs", ways, repeats)


def gpu_table(repeats: int, epochs: int) -> None:
    gpus = torch.cuda.device_count()
    x, y = torch.randn(65536, 1, 28, 28), torch.randint(0, 10, (65536,))
    ways = {}
    for n in sorted({1, 2, gpus}):
        cfg = nt.TrainConfig(device="cuda", epochs=epochs, batch_size=256, processes=n)
        ways[f"{n} process(es), one GPU each, batch 256 each"] = \
            lambda cfg=cfg: one_fit(cnn, (x, y), cfg)
    table(f"digits-sized CNN on 65536 random 28x28 images, {gpus} GPUs", ways, repeats)


def main():
    print(machine_line())   # the caption: which CPU, its bf16 units, the load
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {available_cores()} cores, median of {args.repeats} "
          "interleaved runs")
    if torch.cuda.device_count() > 1:
        gpu_table(args.repeats, args.epochs)
    else:
        cpu_tables(args.repeats, args.epochs)


if __name__ == "__main__":
    main()
