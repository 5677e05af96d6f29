"""What nt.watch adds to a step, in microseconds: a loop whose step is almost nothing.

    python bench/watch_cost.py [--repeats 21] [--steps 1000] [--case loader|direct]

Two loops whose step is almost nothing, so that what a watch adds is not hidden in the
model's work: "loader", a 4-weight linear over a DataLoader of 64-row batches (backward,
SGD); "direct", a 4-to-1 `nn.Linear` whose 64-row batches the loop slices from a tensor
itself (no DataLoader: a step found by the model's forward, as in a DQN's replay step).
Each call times the steps after the first 200 (a watch's steady state: host reads and
kept losses are looked for over its first 30), with the CPU time of the thread (torch on
1 thread), which a preempted call does not charge; the ways are interleaved, the order
rotating (bench/rounds.py). nbtrain's cache is a new empty folder (NBTRAIN_CACHE_DIR), as
on a machine's first runs: the watch's defaults count the FLOPs of a step and leave the
peak's probe pending (1 s of GEMMs, affordable only after 20 s of a run), so
"nt.watch(optimize=False)" is what a user's short loop pays until the peak is known;
the `count_flops=False` rows leave both out.
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
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from nbtrain.machine import machine_line
from rounds import interleaved   # bench/rounds.py

SKIP = 200   # the steps not timed: a watch's first ones


class LoaderLoop:
    """A 4-weight linear over a DataLoader."""
    name = "loader"

    def __init__(self, steps: int):
        self.weight = torch.zeros(4, requires_grad=True)
        self.opt = torch.optim.SGD([self.weight], 0.1)
        self.loader = DataLoader(TensorDataset(torch.randn(64 * steps, 4)), batch_size=64)

    def steps(self, trace=None):
        """Run the loop; CPU seconds a step after the first SKIP (`trace`: (first, last,
        on, off), the tracer switched on at step `first` and off after step `last`)."""
        weight, opt, start, n = self.weight, self.opt, None, len(self.loader)
        for i, (xb,) in enumerate(self.loader):
            if i == SKIP:
                start = time.thread_time()
            if trace and i == trace[0]:
                trace[2]()
            opt.zero_grad()
            loss = (weight * xb).sum()
            loss.backward()
            opt.step()
            if trace and i == trace[1] - 1:
                trace[3]()
        return (time.thread_time() - start) / (n - SKIP)


class DirectLoop:
    """A 4-to-1 nn.Linear, its batches sliced from a tensor by the loop (no DataLoader)."""
    name = "direct"

    def __init__(self, steps: int):
        self.model = torch.nn.Linear(4, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), 0.1)
        self.data = torch.randn(steps, 64, 4)

    def steps(self, trace=None):
        model, opt, data, start = self.model, self.opt, self.data, None
        for i in range(len(data)):
            if i == SKIP:
                start = time.thread_time()
            if trace and i == trace[0]:
                trace[2]()
            xb = data[i]
            opt.zero_grad()
            loss = model(xb).sum()
            loss.backward()
            opt.step()
            if trace and i == trace[1] - 1:
                trace[3]()
        return (time.thread_time() - start) / (len(data) - SKIP)


LOOPS = {"loader": LoaderLoop, "direct": DirectLoop}
# per case: way -> the watch's settings (None: as written)
WAYS = {
    "loader": {
        "as written": None,
        "nt.watch(optimize=False)": dict(log_every=10),
        "nt.watch(optimize=False, count_flops=False)": dict(log_every=10, count_flops=False),
        "nt.watch(optimize=False, count_flops=False, log_every=1000000)":
            dict(log_every=10 ** 6, count_flops=False),
    },
    "direct": {
        "as written": None,
        "nt.watch(optimize=False)": dict(log_every=10),
        "nt.watch(optimize=False, count_flops=False)": dict(log_every=10, count_flops=False),
    },
}


def watched(settings):
    return nt.watch(optimize=False, progress=False, **settings)


def bytecodes_a_step(loop, settings, steps=(SKIP, 2 * SKIP)) -> collections.Counter:
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

    switches = (steps[0], steps[1], lambda: sys.settrace(trace), lambda: sys.settrace(None))
    if settings is None:
        loop.steps(switches)
    else:
        with watched(settings):
            loop.steps(switches)
    n = steps[1] - steps[0]
    return collections.Counter({key: c / n for key, c in counts.items()})


def print_bytecodes(loop, settings, way: str) -> None:
    plain = bytecodes_a_step(loop, None)
    seen = bytecodes_a_step(loop, settings)
    added = seen.copy()
    added.subtract(plain)
    print(f"\n{loop.name}, {way}: Python bytecodes a step (opcode trace, steps "
          f"{SKIP}-{2 * SKIP}): as written {sum(plain.values()):.0f}, watched "
          f"{sum(seen.values()):.0f} ({sum(added.values()):+.0f}); the most added:")
    for (file, function), n in added.most_common(8):
        print(f"  {n:+6.1f}  {file}:{function}")


def run_case(case: str, steps: int, repeats: int) -> None:
    loop, ways = LOOPS[case](steps), WAYS[case]

    def measure_one(name) -> float:
        settings = ways[name]
        if settings is None:
            return loop.steps()
        with watched(settings):
            return loop.steps()
    for name in ways:   # warm-up
        measure_one(name)
    times = interleaved(list(ways), repeats, measure_one)
    print(f"\n{case}: median of {repeats} interleaved calls, CPU time of steps "
          f"{SKIP}-{steps} (torch on 1 thread)\n")
    print("| way | µs/step | added µs/step | quartiles |\n|---|---:|---:|---:|")
    base = times["as written"]
    for name, values in times.items():
        added = [a - b for a, b in zip(values, base)]
        q1, _, q3 = statistics.quantiles(added, n=4)
        extra = "" if name == "as written" else \
            f"{statistics.median(added) * 1e6:+.1f} | {q1 * 1e6:+.1f} to {q3 * 1e6:+.1f}"
        print(f"| {name} | {statistics.median(values) * 1e6:.1f} | {extra or ' | '} |")
    for way in ("nt.watch(optimize=False, count_flops=False)", "nt.watch(optimize=False)"):
        print_bytecodes(loop, ways[way], way)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--case", choices=sorted(LOOPS), action="append",
                        help="the loop(s) to time (default: both)")
    args = parser.parse_args(argv)
    os.environ["NBTRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="watch_cost_")   # no peak known
    torch.set_num_threads(1)
    print(machine_line())
    for case in args.case or list(LOOPS):
        run_case(case, args.steps, args.repeats)


if __name__ == "__main__":
    main()
