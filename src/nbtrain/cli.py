"""Command line: `nbtrain demo`."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from .version import __version__
    parser = argparse.ArgumentParser(prog="nbtrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"nbtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the digits CNN plainly, then with nbtrain's auto settings",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_argument("--epochs", type=int, default=4, help="passes over the digits data, each run")
    demo.add_argument("--repeats", type=int, default=3,
                      help="runs of each case, interleaved; the table gives their median")
    demo.add_argument("--progress", action="store_true", help="show a progress bar per run")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo
        runs = run_demo(epochs=args.epochs, repeats=args.repeats, progress=args.progress)
        return 0 if all(r.state == "finished" for rs in runs.values() for r in rs) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
