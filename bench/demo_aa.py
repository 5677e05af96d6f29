"""An A/A check of `nbtrain demo`'s timing: does the pairing lean either way (issue 40)?

    python bench/demo_aa.py [--seconds 60]

Runs the demo's rows in full as the demo does, then times them the demo's way (one short
run of each row a round, the order alternating) with two rows twice: the plain loop and
the defaults each followed by a copy of itself. A copy's ratio to its original should be
1 within its 95% interval; how far its median sits from 1 is what the pairing leans.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    import nbtrain as nt
    from nbtrain.tools import demo
    from nbtrain.machine import machine_line
    print(machine_line())
    x, y = nt.datasets.digits("train")
    base = nt.TrainConfig(epochs=demo.EPOCHS, batch_size=demo.BATCH_SIZE, optimizer="adamw",
                          lr=3e-3, scheduler="onecycle", seed=0, store=False,
                          count_flops=False)   # as the demo's
    configs = demo.demo_configs(base)

    def train(config, **val):
        torch.manual_seed(0)
        return nt.fit(demo.demo_cnn(), (x, y), nn.functional.cross_entropy, config=config,
                      progress=False, **val)
    rows = []
    for label in ("plain loop", "+ batched fetch", "+ mixed precision", "+ fused optimizer"):
        row = demo.Row(label, None, train(configs[label], val_data=nt.datasets.digits("val")))
        rows.append(row)
        if label in ("plain loop", "+ fused optimizer"):
            rows.append(demo.Row(label + " (again)", None, row.first))
    start = time.perf_counter()
    rounds = demo.time_in_rounds(rows, lambda row: train(demo.timing_config(
        base, row)), start, print, max_rounds=10**6,
        budget_s=args.seconds)
    print(f"\n{rounds} rounds in {time.perf_counter() - start:.0f} s\n")
    print("| row | samples/s | spread | vs the row above | 95% interval |")
    print("|---|---:|---:|---:|---|")
    for above, row in zip([None] + rows, rows):
        ratios = demo.per_round_ratios(row.rates, above.rates) if above else []
        low, high = demo.median_interval(ratios) if ratios else (float("nan"),) * 2
        print(f"| {row.label} | {statistics.median(row.rates):,.0f} | "
              f"{demo.spread(row.rates):.0%} | "
              + (f"{statistics.median(ratios):.3f}x | {low:.3f}-{high:.3f} |" if ratios
                 else " | |"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
