"""What nt.watch adds to a step, in microseconds: a loop whose step is almost nothing.

    python bench/watch_cost.py [--repeats 21] [--steps 1000]

The step is a 4-weight linear over a DataLoader of 64-row batches (backward, SGD), so
what a watch adds is not hidden in the model's work. Each call times the steps after
the first 200 (a watch's steady state: host reads and kept losses are looked for over
its first 30), with the CPU time of the thread (torch on 1 thread), which a preempted
call does not charge; the ways are interleaved, the order rotating (bench/rounds.py).
Printed: the median µs a step of each way, and the median of the per-round differences
to the loop as written, with their quartiles; then the Python bytecodes a watch adds to a
step, counted (the same on every run), and where they run.

Why microseconds and not a ratio: bench/instructions.py counts the watch's instructions
(1-1.5% of an MLP's step), but they are the interpreter's, which run at a fraction of the
instructions per cycle of torch's vectorised kernels, so their share of the time is
several times their share of the instructions. Divided by a step's time, these
microseconds are what the watch costs that step.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from nbtrain.machine import machine_line
from rounds import interleaved   # bench/rounds.py


def the_loop(loader, weight, opt, skip: int) -> float:
    """CPU seconds a step after the first `skip` steps."""
    start = None
    for i, (xb,) in enumerate(loader):
        if i == skip:
            start = time.thread_time()
        opt.zero_grad()
        loss = (weight * xb).sum()
        loss.backward()
        opt.step()
    return (time.thread_time() - start) / (len(loader) - skip)


WAYS = {
    "as written": None,
    "nt.watch(optimize=False)": dict(log_every=10),
    "nt.watch(optimize=False, log_every=1000000)": dict(log_every=10 ** 6),
}


def bytecodes_a_step(loader, weight, opt, watched: bool, steps=(200, 400)) -> collections.Counter:
    """{(file, function): Python bytecodes a step} over `steps` of the loop, counted by an
    opcode trace: the Python a watch adds, which no noise blurs (its time is what the
    table measures)."""
    counts = collections.Counter()

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            counts[code.co_filename.rsplit("/", 1)[-1], code.co_name] += 1
        return trace

    def loop():
        for i, (xb,) in enumerate(loader):
            if i == steps[0]:
                sys.settrace(trace)
            opt.zero_grad()
            loss = (weight * xb).sum()
            loss.backward()
            opt.step()
            if i == steps[1] - 1:
                sys.settrace(None)
    if watched:
        with nt.watch(optimize=False, progress=False, count_flops=False, log_every=10):
            loop()
    else:
        loop()
    n = steps[1] - steps[0]
    return collections.Counter({key: c / n for key, c in counts.items()})


def print_bytecodes(loader, weight, opt) -> None:
    plain = bytecodes_a_step(loader, weight, opt, watched=False)
    watched = bytecodes_a_step(loader, weight, opt, watched=True)
    added = watched.copy()
    added.subtract(plain)
    print(f"\nPython bytecodes a step (opcode trace, steps 200-400): as written "
          f"{sum(plain.values()):.0f}, watched {sum(watched.values()):.0f} "
          f"({sum(added.values()):+.0f}); the most added:")
    for (file, function), n in added.most_common(8):
        print(f"  {n:+6.1f}  {file}:{function}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    weight = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([weight], 0.1)
    loader = DataLoader(TensorDataset(torch.randn(64 * args.steps, 4)), batch_size=64)

    def measure_one(name) -> float:
        settings = WAYS[name]
        if settings is None:
            return the_loop(loader, weight, opt, 200)
        with nt.watch(optimize=False, progress=False, count_flops=False, **settings):
            return the_loop(loader, weight, opt, 200)
    for name in WAYS:   # warm-up
        measure_one(name)
    times = interleaved(list(WAYS), args.repeats, measure_one)
    print(f"{machine_line()}\nmedian of {args.repeats} interleaved calls, CPU time of steps "
          f"200-{args.steps} (torch on 1 thread)\n")
    print("| way | µs/step | added µs/step | quartiles |\n|---|---:|---:|---:|")
    base = times["as written"]
    for name, values in times.items():
        added = [a - b for a, b in zip(values, base)]
        q1, _, q3 = statistics.quantiles(added, n=4)
        extra = "" if name == "as written" else \
            f"{statistics.median(added) * 1e6:+.1f} | {q1 * 1e6:+.1f} to {q3 * 1e6:+.1f}"
        print(f"| {name} | {statistics.median(values) * 1e6:.1f} | {extra or ' | '} |")
    print_bytecodes(loader, weight, opt)


if __name__ == "__main__":
    main()
