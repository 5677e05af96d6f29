"""A hand-written loop cell on N processes (%%fasttrain --processes N) against the same
cell in one process under nt.watch.

    python bench/cell_processes.py [--processes auto] [--repeats 3] [--epochs 2]

The cell is the loop people write: a CNN, a DataLoader over in-memory uint8 images, SGD,
`.to(device)` on each batch. One process runs it inside `nt.watch()`; N processes run it
through cell_ranks.py's `train_cell` (what the magic calls), each rank on its shard with the
gradients averaged. `--processes auto` is every GPU of the machine (on a CPU it asks for
2, one core each: on 2 cores that makes nothing faster). Interleaved repeats, medians.

Printed: samples/s as the Run reports them (summed over the ranks; the processes' start
is not in it) and the whole call's wall time (process start included), each way, and
the ratio of N processes to one.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import nbtrain as nt
from nbtrain.machine import machine_line
from nbtrain.cell_ranks import processes_for, train_cell

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(0)
images = torch.randint(0, 256, (N_SAMPLES, 3, 32, 32), dtype=torch.uint8, generator=gen)
labels = torch.randint(0, 10, (N_SAMPLES,), generator=gen)
"""

CELL = """
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(64, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loader = DataLoader(TensorDataset(images, labels), batch_size=BATCH)
for epoch in range(EPOCHS):
    for xb, yb in loader:
        xb, yb = xb.to(device).float().div_(255), yb.to(device)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
"""


def namespace(samples: int, batch: int, epochs: int) -> dict:
    ns = {"N_SAMPLES": samples, "BATCH": batch, "EPOCHS": epochs}
    exec(SETUP, ns)
    return {k: v for k, v in ns.items() if not k.startswith("__")}


def one_process(ns: dict) -> tuple:
    start = time.perf_counter()
    with nt.watch(progress=False, store=False) as run:
        exec(CELL, dict(ns))
    return run.summary()["samples_per_s"], time.perf_counter() - start


def n_processes(ns: dict, world: int) -> tuple:
    start = time.perf_counter()
    run = train_cell(CELL, dict(ns), world, {"store": False})
    if run.state != "finished":
        raise SystemExit(f"the cell on {world} processes ended {run.state}: {run.error}")
    return run.summary()["samples_per_s"], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=128, help="per process")
    args = parser.parse_args()
    world = processes_for(args.processes)
    if world < 2:
        world = 2   # a CPU: two processes, to show the path works (not that it pays)
    ns = namespace(args.samples, args.batch, args.epochs)
    print(machine_line())
    print(f"cell: CNN on {args.samples} uint8 32x32 images, batch {args.batch} per process, "
          f"{args.epochs} epochs; {world} processes against 1\n")
    one, many = [], []
    for _ in range(args.repeats):   # interleaved: a drift of the machine weighs on both
        one.append(one_process(ns))
        many.append(n_processes(ns, world))
    rate1, wall1 = (statistics.median(v) for v in zip(*one))
    rate_n, wall_n = (statistics.median(v) for v in zip(*many))
    print("| way | samples/s | wall s |")
    print("|---|---:|---:|")
    print(f"| 1 process (nt.watch) | {rate1:,.0f} | {wall1:.2f} |")
    print(f"| {world} processes (--processes {world}) | {rate_n:,.0f} | {wall_n:.2f} |")
    print(f"\nsamples/s, {world} processes against 1: {rate_n / rate1:.2f}x "
          f"(wall: {wall1 / wall_n:.2f}x)")


if __name__ == "__main__":
    main()
