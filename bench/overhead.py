"""nbtrain's overhead against a hand-written PyTorch loop, measured in the same process.

    python bench/overhead.py [--repeats 15] [--epochs 3] [--threads N]

Each round trains `--epochs` epochs four ways, interleaved so machine noise hits all alike:
- the plain loop: what most tutorials write (a per-sample DataLoader, the textbook step);
- an expert's loop: a seeded permutation sliced into batches, fused AdamW;
- `nt.fit` with every toggle off and torch's own thread count (the plain loop's settings);
- `nt.fit` with its defaults.
Reported per case and way: the median seconds per step (the whole call, setup included,
over its steps) and the median of the per-round ratios (each round's pair measured side
by side; the order of the ways rotates from round to round, bench/rounds.py) with their
min-max spread. Targets (issue 25): toggles off <= 1.02x the plain
loop, defaults <= 1.03x the expert's loop.
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
from nbtrain.machine import machine_line
from nbtrain.tools.demo import PLAIN, digits_cnn
from rounds import interleaved, paired   # bench/rounds.py: the order rotates each round


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


def expert_epoch(model, x, y, batch_size, lr, gen) -> int:
    """What an expert writes for in-memory tensors: one index op per batch, fused AdamW
    (nbtrain's weight decay: 0)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)
    order = torch.randperm(len(x), generator=gen)
    steps = 0
    for first in range(0, len(x), batch_size):
        idx = order[first:first + batch_size]
        xb, yb = x[idx], y[idx]
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
    return steps


def nbtrain_run(model, x, y, batch_size, lr, epochs, overrides) -> int:
    cfg = nt.TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, optimizer="adamw",
                         log_every=50, **overrides)
    return nt.fit(model, (x, y), F.cross_entropy, config=cfg, progress=False).step


def epochs_of(epoch_fn, epochs: int):
    """The hand-written loops, `epochs` times over one model (one optimizer per epoch is
    how these loops are written in a cell; AdamW's state restarting costs nothing here)."""
    def run(model):
        return sum(epoch_fn(model) for _ in range(epochs))
    return run


def cases():
    gen = torch.Generator().manual_seed(0)
    mlp_x = torch.randn(8192, 64, generator=gen)
    mlp_y = torch.randint(0, 10, (8192,), generator=gen)
    dx, dy = nt.datasets.digits("train")
    yield "MLP 64-128-10, 8192x64, batch 64", \
        lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), mlp_x, mlp_y
    yield "digits CNN, 1438x1x8x8, batch 64", digits_cnn, dx, dy


# each nbtrain way is compared with the hand-written loop a user would otherwise run
BASELINE = {"nbtrain, toggles off": "plain loop", "nbtrain, defaults": "expert's loop"}


def ways(x, y, epochs: int, batch_size=64, lr=1e-3) -> dict:
    gen = torch.Generator()
    toggles_off = dict(PLAIN, num_threads=torch.get_num_threads())   # a plain loop keeps torch's
    return {
        "plain loop": epochs_of(lambda m: plain_epoch(m, x, y, batch_size, lr), epochs),
        "expert's loop": epochs_of(lambda m: expert_epoch(m, x, y, batch_size, lr, gen), epochs),
        "nbtrain, toggles off": lambda m: nbtrain_run(m, x, y, batch_size, lr, epochs,
                                                      toggles_off),
        "nbtrain, defaults": lambda m: nbtrain_run(m, x, y, batch_size, lr, epochs, {}),
    }


def measure(make_model, x, y, repeats: int, epochs: int) -> dict:
    """{way: [seconds per step, one per round]}, the ways interleaved round by round."""
    todo = ways(x, y, epochs)
    for way in todo.values():   # warm-up: allocator, kernels, thread pools, "auto"'s cache
        way(make_model())

    def measure_one(name) -> float:
        torch.manual_seed(0)
        model = make_model()
        start = time.perf_counter()
        steps = todo[name](model)
        return (time.perf_counter() - start) / steps
    return interleaved(list(todo), repeats, measure_one)


def rows(times: dict):
    """(way, median ms/step, baseline name, median paired ratio, min ratio, max ratio)."""
    for name, per_step in times.items():
        base = BASELINE.get(name, "plain loop")
        yield (name, statistics.median(per_step) * 1e3, base, *paired(times, name, base))


def main(argv=None):
    print(machine_line())   # the caption: which CPU, its bf16 units, the load
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per call")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.epochs} epochs "
          f"a call, medians of {args.repeats} interleaved rounds\n")
    print("| case | way | ms/step | ratio | to | spread |\n|---|---|---:|---:|---|---|")
    for label, make_model, x, y in cases():
        for name, ms, base, ratio, low, high in rows(measure(make_model, x, y, args.repeats,
                                                             args.epochs)):
            ratio_text = "" if name == base else f"{ratio:.3f}x"
            spread = "" if name == base else f"{low:.3f}-{high:.3f}"
            to = "" if name == base else base
            print(f"| {label} | {name} | {ms:.3f} | {ratio_text} | {to} | {spread} |",
                  flush=True)


if __name__ == "__main__":
    main()
