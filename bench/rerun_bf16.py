"""A short loop cell re-run again and again under nt.watch(): when does its bf16 trial
decide, and is each run as fast as the loop as written from then on?

    python bench/rerun_bf16.py [--runs 12] [--epochs 2]

The tutorial's digits CNN loop (bench/own_loop.py's `the_loop`, 2 epochs: about 0.3 s
on a 2-core CPU) run `--runs` times as a notebook re-runs its cell: a new model each run,
as written and under `nt.watch()` (the defaults) in turn, the order swapped each run. The
measurements nbtrain keeps go to a new cache folder, so run 1 finds no evidence, as on a
new machine. Printed per run: the seconds per step each way (the whole call over its
steps), their ratio, and what the watch's amp setting says (the trial's standing, or its
decision). On a CPU without bf16 units the
trial never starts and every run says so.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
os.environ["NBTRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="nbtrain-rerun-")   # no evidence yet

from nbtrain.machine import machine_line   # noqa: E402
from own_loop import WAYS, cases, one_call   # noqa: E402  (bench/own_loop.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    name, make_model, make_data = next(iter(cases()))   # the digits CNN over a TensorDataset
    print(machine_line())
    print(f"{name}, {args.epochs} epochs, each run a new model (a re-run cell)\n")
    print("| run | as written, s/step | nt.watch(), s/step | ratio | amp |")
    print("|---:|---:|---:|---:|---|")
    ways = [("as written", None), ("defaults", WAYS["nt.watch() defaults"])]
    for i in range(1, args.runs + 1):
        seconds = {}
        for label, way in (ways if i % 2 else ways[::-1]):
            per_step, run = one_call(make_model, make_data, way, args.epochs)
            seconds[label] = (per_step, run)
        plain, (watched, run) = seconds["as written"][0], seconds["defaults"]
        amp, why = run.resolved.get("amp", ("?", ""))
        print(f"| {i} | {plain:.4f} | {watched:.4f} | {watched / plain:.3f}x | {amp}: {why} |")


if __name__ == "__main__":
    main()
