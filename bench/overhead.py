"""nbtrain's overhead against a hand-written PyTorch loop, measured in the same process.

    python bench/overhead.py [--repeats 15] [--threads N]

Each repeat trains one epoch three ways, interleaved so machine noise hits all alike:
the plain loop below, `nt.fit` with every toggle off, and `nt.fit` with its defaults.
Reported: median seconds per step (whole epoch incl. setup / steps) and the ratio to the
plain loop. Targets (issue 2): toggles off <= 1.03x, defaults <= 1.00x.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from nbtrain.flops import machine_line
from nbtrain.demo import PLAIN, digits_cnn


def plain_epoch(model, x, y, batch_size, lr) -> int:
    """What most tutorials write: a per-sample DataLoader and the textbook step."""
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    steps = 0
    for xb, yb in loader:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        steps += 1
    return steps


def nbtrain_epoch(model, x, y, batch_size, lr, overrides) -> int:
    cfg = nt.TrainConfig(epochs=1, batch_size=batch_size, lr=lr, optimizer="adamw",
                         log_every=50, **overrides)
    return nt.fit(model, (x, y), F.cross_entropy, config=cfg, progress=False).step


def cases():
    gen = torch.Generator().manual_seed(0)
    mlp_x = torch.randn(8192, 64, generator=gen)
    mlp_y = torch.randint(0, 10, (8192,), generator=gen)
    dx, dy = nt.datasets.digits("train")
    yield "MLP 64-128-10, 8192x64, batch 64", \
        lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), mlp_x, mlp_y
    yield "digits CNN, 1438x1x8x8, batch 64", digits_cnn, dx, dy


def measure(make_model, x, y, repeats: int, batch_size=64, lr=1e-3) -> dict:
    ways = {"plain loop": lambda m: plain_epoch(m, x, y, batch_size, lr),
            "nbtrain, toggles off": lambda m: nbtrain_epoch(m, x, y, batch_size, lr, PLAIN),
            "nbtrain, defaults": lambda m: nbtrain_epoch(m, x, y, batch_size, lr, {})}
    times = {name: [] for name in ways}
    for name, way in ways.items():   # warm-up: allocator, kernels, thread pools
        way(make_model())
    for _ in range(repeats):
        for name, way in ways.items():
            torch.manual_seed(0)
            model = make_model()
            start = time.perf_counter()
            steps = way(model)
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
    print(machine_line())   # the caption: which CPU, its bf16 units, the load
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} interleaved epochs\n")
    print("| case | way | ms/step | vs plain |\n|---|---|---:|---:|")
    for label, make_model, x, y in cases():
        result = measure(make_model, x, y, args.repeats)
        plain = result["plain loop"]
        for name, per_step in result.items():
            print(f"| {label} | {name} | {per_step * 1e3:.3f} | {per_step / plain:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
