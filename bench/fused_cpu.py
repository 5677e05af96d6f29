"""The fused optimizer kernels against each optimizer's own update on a CPU, per step.

    python bench/fused_cpu.py [--threads 2] [--rounds 7] [--busy]

For parameter sets from a tiny MLP (skorch's README shape, 300 elements) to 4M elements,
and SGD, SGD with momentum, Adam and AdamW: the time of one `optimizer.step()` with the
class's default (for-loop) update and with `fused=True`, the two interleaved in each of
`--rounds` rounds (the gradients random, the same every step). Printed: the median time a
step of each, and the median of the rounds' ratios (own / fused, above 1: fused is
faster) with their min-max spread. `--busy` runs a process that keeps one core busy
throughout, as another user's job on a shared machine does: torch's intra-op threads then
wait on each other at every parallel region (what decides `optimizer_impl="auto"` for
plain SGD on a CPU: nbtrain/train/optim.py, docs/guide/measured.md).
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import statistics
import time

import torch
from torch import nn

SHAPES = {
    "MLP 20-10-10-2 (0.3k)": [(10, 20), (10,), (10, 10), (10,), (2, 10), (2,)],
    "digits CNN (140k)": [(32, 1, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 1024), (128,),
                          (10, 128), (10,)],
    "MLP 784-512-512-10 (670k)": [(512, 784), (512,), (512, 512), (512,), (10, 512), (10,)],
    "4 x 1M": [(1000, 1000)] * 4,
}
OPTIMIZERS = {
    "SGD": (torch.optim.SGD, dict(lr=0.01)),
    "SGD momentum": (torch.optim.SGD, dict(lr=0.01, momentum=0.9)),
    "Adam": (torch.optim.Adam, dict(lr=1e-3)),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-3)),
}


def step_us(shapes, optimizer: str, fused: bool) -> float:
    """Microseconds a step, over enough steps for ~0.3M elements updated (5 to 400)."""
    cls, kwargs = OPTIMIZERS[optimizer]
    params = [nn.Parameter(torch.randn(shape)) for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = cls(params, fused=True, **kwargs) if fused else cls(params, **kwargs)
    steps = min(400, max(5, int(3e5 / sum(p.numel() for p in params)) + 20))
    for _ in range(5):
        opt.step()
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - start) / steps * 1e6


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@contextlib.contextmanager
def one_core_busy(busy: bool):
    if not busy:
        yield
        return
    hog = multiprocessing.get_context("spawn").Process(target=_spin, args=(3600.0,))
    hog.start()
    try:
        yield
    finally:
        hog.terminate()
        hog.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--busy", action="store_true", help="another process keeps a core busy")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), "
          f"{'one core kept busy by another process' if args.busy else 'nothing else run'}")
    print("\n| parameters | optimizer | own us | fused us | fused speed-up (spread) |")
    print("|---|---|---:|---:|---:|")
    with one_core_busy(args.busy):
        for shape_name, shapes in SHAPES.items():
            for optimizer in OPTIMIZERS:
                own, fused = [], []
                for _ in range(args.rounds):
                    own.append(step_us(shapes, optimizer, fused=False))
                    fused.append(step_us(shapes, optimizer, fused=True))
                ratios = [a / b for a, b in zip(own, fused)]
                print(f"| {shape_name} | {optimizer} | {statistics.median(own):.1f} | "
                      f"{statistics.median(fused):.1f} | {statistics.median(ratios):.2f}x "
                      f"({min(ratios):.2f}-{max(ratios):.2f}) |", flush=True)


if __name__ == "__main__":
    main()
