"""What a fresh process's first `nt.watch()` costs around a short loop, beyond the loop.

    python bench/first_watch.py [--rounds 7] [--steps 50]

Each round starts new interpreters, one per way (watched only: optimize=False; the
defaults), in turn. Each imports torch and nbtrain, runs the loop (a linear model, SGD,
`--steps` steps) once to warm it, times it as written, then times it inside its first
`nt.watch()`. Printed: per way, the median and spread of (watched - as written) in ms:
the watch's setup, hooks and end, with the imports its first use makes. `import nbtrain`
itself is not on this clock (see `python -X importtime -c "import torch, nbtrain"`).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CHILD = """
import sys, time, torch
from torch import nn
import nbtrain as nt

def loop(steps):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

steps, optimize = int(sys.argv[1]), sys.argv[2] == "defaults"
loop(steps)
start = time.perf_counter(); loop(steps); plain = time.perf_counter() - start
start = time.perf_counter()
with nt.watch(progress=False, optimize=optimize):
    loop(steps)
print((time.perf_counter() - start - plain) * 1e3)
"""

WAYS = ("watched only", "defaults")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    costs = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.steps), way],
                                 capture_output=True, text=True, check=True).stdout
            costs[way].append(float(out.split()[-1]))
    print(f"| way | first watch beyond the loop, ms (median of {args.rounds}) | spread |")
    print("|---|---:|---:|")
    for way, ms in costs.items():
        print(f"| {way} | {statistics.median(ms):.1f} | {min(ms):.1f}-{max(ms):.1f} |")


if __name__ == "__main__":
    main()
