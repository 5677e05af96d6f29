"""The corpus's training programs (tests/corpus/programs/) timed whole, three ways.

    python bench/real_programs.py [--rounds 5] [--program nanogpt]

Each program runs as its author would run it (tests/corpus/harness.py): as written;
inside `nt.watch(optimize=False)` (watched only); inside `nt.watch()` (the defaults).
One warm-up round is not counted (imports, the watch's cached probes, torch.compile's
caches); then interleaved rounds, the order of the ways rotated from round to round
(bench/rounds.py), each run timed whole, the watch's setup and end included. Printed: the
CPU, then per program the median seconds as written and the median of the per-round
ratios of each watch to the run as written, with their min-max spread. A way that
raises is shown as its error, and the program's other ways still run.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "corpus"
sys.path[:0] = [str(CORPUS), str(CORPUS / "programs")]   # the harness and the programs' classes

from harness import CORPUS as PROGRAMS, WAYS, run_program   # noqa: E402  (tests/corpus/)
from rounds import interleaved, paired   # noqa: E402  (bench/rounds.py)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, and how many logical CPUs it lists."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU (no /proc/cpuinfo)"
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0]} x {len(names)}" if names else "unknown CPU"


def seconds_of(program, way: str) -> float:
    """One whole run's seconds (its prints kept out of the table); a run that raises is
    an error the table shows."""
    with contextlib.redirect_stdout(io.StringIO()):
        return run_program(program, way).seconds


def measure(program, rounds: int) -> dict:
    """{way: [seconds per round]}, or {way: error text} for a way that failed."""
    failed = {}
    for way in WAYS:   # warm-up, not counted
        try:
            seconds_of(program, way)
        except Exception as error:   # shown in the table, instead of the ratio
            failed[way] = f"{type(error).__name__}: {str(error)[:80]}"
    ways = [way for way in WAYS if way not in failed]
    times = interleaved(ways, rounds, lambda way: seconds_of(program, way)) if "as written" in ways else {}
    return {**times, **failed}


def ratio_cell(times: dict, way: str) -> str:
    if isinstance(times.get(way), str):
        return f"failed: {times[way]}"
    median, low, high = paired(times, way, "as written")
    return f"{median:.3f}x ({low:.2f}-{high:.2f})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--program", default="", help="only the programs whose name holds this")
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_model()}\nmedian of {args.rounds} interleaved rounds, each run timed whole\n")
    print("| program | as written s | watched / as written (spread) | defaults / as written (spread) |\n"
          "|---|---:|---:|---:|")
    for program in PROGRAMS:
        if args.program not in program.name:
            continue
        times = measure(program, args.rounds)
        written = times.get("as written")
        base = f"{statistics.median(written):.3f}" if isinstance(written, list) else f"failed: {written}"
        cells = [ratio_cell(times, way) if isinstance(written, list) else "-" for way in ("watched", "defaults")]
        print(f"| {program.name} | {base} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
