"""Command line: `nbtrain demo`."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from . import __version__
    parser = argparse.ArgumentParser(prog="nbtrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"nbtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the digits CNN plainly, then with nbtrain's auto settings",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_argument("--epochs", type=int, default=8, help="passes over the digits data, each run")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo
        runs = run_demo(epochs=args.epochs, progress=not args.no_progress)
        return 0 if all(r.state == "finished" for r in runs.values()) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
