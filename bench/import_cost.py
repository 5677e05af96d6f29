"""What `import nbtrain` and the first `with nt.watch()` load, and how long they take.

    python bench/import_cost.py [--repeats 7]

Each repeat is a fresh interpreter that imports torch and runs a tiny loop (a linear
model, SGD, 5 steps) as written first, so that what torch loads on a first optimizer
step is not charged to nbtrain; then it times `import nbtrain`, and the same loop inside
`with nt.watch()` (its defaults: the progress bar, the run store). Printed: the median
milliseconds of each, and the modules each added to sys.modules (nbtrain's own apart).
A first untimed process writes the .pyc files, so the figures are those of a hot cache,
as an installed package has. The time includes the watch's own work, not only imports;
`python -X importtime` names the modules' own shares.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time, torch
from torch import nn
model = nn.Linear(8, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 8), torch.randn(32, 1)

def loop():
    for _ in range(5):
        opt.zero_grad(); nn.functional.mse_loss(model(x), y).backward(); opt.step()

loop()
base = set(sys.modules)
t0 = time.perf_counter()
import nbtrain as nt
t1 = time.perf_counter()
imported = set(sys.modules)
with nt.watch():
    loop()
t2 = time.perf_counter()
print(json.dumps({"import_ms": 1e3 * (t1 - t0), "watch_ms": 1e3 * (t2 - t1),
                  "import": sorted(imported - base), "watch": sorted(set(sys.modules) - imported)}))
"""


def one(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.splitlines()[-1])


def counted(modules: list) -> str:
    own = sum(m.startswith("nbtrain") for m in modules)
    return f"{len(modules)} ({own} nbtrain)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    one(env)   # writes the .pyc files
    runs = [one(env) for _ in range(args.repeats)]
    from nbtrain.machine import machine_line
    print(machine_line())
    print(f"median of {args.repeats} fresh processes, hot .pyc cache\n")
    print("| span | ms | modules added |\n|---|---:|---:|")
    for key, name in (("import", "`import nbtrain`"), ("watch", "first `with nt.watch()`, 5 steps")):
        ms = statistics.median(run[f"{key}_ms"] for run in runs)
        print(f"| {name} | {ms:.1f} | {counted(runs[-1][key])} |")
    print("\nadded by the watch, not nbtrain's:",
          " ".join(m for m in runs[-1]["watch"] if not m.startswith("nbtrain")) or "none")


if __name__ == "__main__":
    main()
