"""Command line: `nbtrain demo`, `nbtrain run --processes N script.py [args]`."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from ..tools.demo import (
        BUDGET_S,
        EPOCHS,
        MAX_ROUNDS,
        MIN_ROUNDS,
        TARGET_RATIO_SPREAD,
        TARGET_SPREAD,
    )
    from ..version import __version__
    parser = argparse.ArgumentParser(prog="nbtrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"nbtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the digits CNN plainly, then with nbtrain's "
                          "toggles one at a time, then as your own loop under nt.watch",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_argument("--epochs", type=int, default=EPOCHS,
                      help="passes over the digits data in each row's full run, the one "
                      "where every auto measures (fewer than 15: too short for the threads "
                      "probe to measure)")
    demo.add_argument("--max-rounds", type=int, default=MAX_ROUNDS,
                      help="timing rounds at most, one short run of each row a round, the "
                      f"order alternating (at least {MIN_ROUNDS} unless they would take over "
                      f"{2 * BUDGET_S:.0f} s; fewer once every row's rate has a 95%% "
                      f"interval at most {TARGET_SPREAD * 100:.0f}%% wide and every ratio "
                      f"{TARGET_RATIO_SPREAD * 100:.0f}%%, or {BUDGET_S:.0f} s into the "
                      "demo); the table gives their median")
    demo.add_argument("--progress", action="store_true", help="show a progress bar per full run")
    run = sub.add_parser("run", help="run a training script as written in N processes, "
                         "data-parallel (torchrun's job, without the script's changes)")
    run.add_argument("--processes", default="auto",
                     help="processes: a number, or auto (every GPU; 1 on a CPU)")
    run.add_argument("script", help="the training script, as you run it with python")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = parser.parse_args(argv)
    if args.command == "run":
        from ..cell_ranks import run_script
        return run_script(args.script, args.args, args.processes)
    if args.command == "demo":
        from ..tools.demo import run_demo
        demo_ = run_demo(epochs=args.epochs, max_rounds=args.max_rounds, progress=args.progress)
        return 0 if demo_.finished else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
