"""What a short program pays for being watched, in wall time, each run a fresh process.

    python bench/short_program_cost.py [--rounds 21] [--program PATH] [--before DIR]
                                       [--shift 0,4000] [--gc-sweep]

A short program (tests/corpus/programs/regression_poly.py by default: pytorch/examples'
regression, ~7 ms of training, an update by hand) run whole in a new interpreter three
ways: as written, inside `with nt.watch(optimize=False):` and inside `with nt.watch():`;
and `import nbtrain as nt; nt.watch` alone (what the watch's first use loads: its
modules). `--before DIR` (a
checkout of an older nbtrain, e.g. `git worktree add /tmp/before HEAD`) adds the same
watched and import ways run by DIR/src's nbtrain, in the same rounds.

Each process imports torch before the clock; on the clock: `import nbtrain` and the
watch where the way has one, and the program (`runpy`, its prints to a buffer). Also
timed: the whole process, from its start to its exit (the interpreter's start, torch's
import and the interpreter's end included). Collections are counted on the clock by a
`gc.callbacks` entry, per generation, with the time they took. Python writes .pyc files
(PYTHONDONTWRITEBYTECODE unset) and nbtrain's home and cache are new folders kept for
the whole bench, so a first uncounted round leaves them as a user's second run finds them.
Then `--rounds` interleaved rounds, the order rotated each round (bench/rounds.py).

`--shift K`: before the clock, the process makes K small objects that it keeps (what a
program may build before its loop: a dataset's Python rows, a library's import), which
moves where in the collector's schedule the watch starts; a full collection (~70 ms over
torch's ~170k objects on a 2-core host) falls where the counts of young collections
reach it. `--gc-sweep` runs one process per way for K = 0 to 12,000 in steps of 500
and prints which spans ran a full collection (how many of the schedule's positions the
watch turns into one), and where the clock and `--then` more objects made after it ran
more full collections than the program as written (a collection moved past the clock,
not saved, would show there).

Printed: per way, the median ms on the clock and of the whole process, the median of
the per-round ratios to the program as written and of the per-round differences (ms
added), with their min-max spread, and the collections on the clock.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
PROGRAM = ROOT / "tests" / "corpus" / "programs" / "regression_poly.py"
MARK = "SHORT_PROGRAM_COST "

WRITTEN, WATCHED, DEFAULTS, IMPORT = ("as written", "nt.watch(optimize=False)", "nt.watch()",
                                      "import nbtrain; nt.watch")
BEFORE = " (before)"   # a way's name + this: run by --before DIR's nbtrain


# -- inside: one fresh process ------------------------------------------------------------------
def inside(way: str, program: str, shift: int, then: int = 0) -> None:
    import contextlib
    import gc
    import io
    import runpy

    import torch   # before the clock, as everywhere

    torch.manual_seed(0)   # the program draws its data: as many steps each run
    kept = [[] for _ in range(shift)]   # the program's own objects, kept
    collections, in_gc, began = [0, 0, 0], [0.0], [0.0]

    def counted(phase, info):
        if phase == "start":
            collections[info["generation"]] += 1
            began[0] = time.perf_counter()
        else:
            in_gc[0] += time.perf_counter() - began[0]

    gc.callbacks.append(counted)
    start = time.perf_counter()
    if way == IMPORT:
        import nbtrain as nt
        nt.watch   # its first use loads it
    else:
        with contextlib.redirect_stdout(io.StringIO()):
            if way == WRITTEN:
                runpy.run_path(program, run_name="__main__")
            else:
                import nbtrain as nt
                with nt.watch(optimize=way == DEFAULTS):
                    runpy.run_path(program, run_name="__main__")
    seconds = time.perf_counter() - start
    on_clock, collections[:] = list(collections), [0, 0, 0]
    kept += [[] for _ in range(then)]   # what the program goes on to make, off the clock
    gc.callbacks.remove(counted)
    print(MARK + json.dumps({"s": seconds, "collections": on_clock, "gc_s": in_gc[0],
                             "after": collections}), flush=True)


# -- outside: fresh processes, interleaved ------------------------------------------------------
def environment(home: str) -> dict:
    """A user's `python`: it writes .pyc files; nbtrain's home and cache this bench's own."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(NBTRAIN_HOME=os.path.join(home, "home"),
               NBTRAIN_CACHE_DIR=os.path.join(home, "cache"))
    return env


def one_run(way: str, program: str, shift: int, home: str, before: str = "",
            then: int = 0) -> dict:
    """{'s': on the clock, 'process_s': the whole process, 'collections' and 'gc_s' on
    the clock, 'after': the collections while `then` more objects are made after it}."""
    env = environment(home)
    if way.endswith(BEFORE):
        way = way[:-len(BEFORE)]
        env["PYTHONPATH"] = os.pathsep.join(
            part for part in (str(Path(before, "src")), env.get("PYTHONPATH", "")) if part)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(HERE), "--inside", way, program, str(shift),
                           str(then)],
                          capture_output=True, text=True, timeout=600, env=env)
    process_s = time.perf_counter() - started
    found = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode or not found:
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
        raise RuntimeError(f"{way}: {lines[-1][:200]}")
    return {**json.loads(found[-1][len(MARK):]), "process_s": process_s}


def ways_of(before: str) -> list:
    ways = [WRITTEN, WATCHED, DEFAULTS, IMPORT]
    return ways + [WATCHED + BEFORE, IMPORT + BEFORE] if before else ways


def spread(values) -> str:
    return f"{min(values):.3g}-{max(values):.3g}"


def table(runs: dict, rounds: int, shift: int) -> None:
    base = runs[WRITTEN]
    print(f"\nshift {shift}: median of {rounds} interleaved rounds, fresh processes\n")
    print("| way | ms on the clock (spread) | x as written (spread) | ms added (spread) "
          "| whole process ms | added (spread) | full collections on the clock | ms in gc |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for way, values in runs.items():
        ms = [1e3 * v["s"] for v in values]
        whole = [1e3 * v["process_s"] for v in values]
        full = sum(v["collections"][2] for v in values)
        gc_ms = statistics.median(1e3 * v["gc_s"] for v in values)
        cells = [f"{statistics.median(ms):.1f} ({spread(ms)})"]
        if way.startswith(IMPORT):
            cells += ["", "", f"{statistics.median(whole):.0f}", ""]
        else:
            ratios = [a["s"] / b["s"] for a, b in zip(values, base)]
            added = [1e3 * (a["s"] - b["s"]) for a, b in zip(values, base)]
            added_whole = [1e3 * (a["process_s"] - b["process_s"]) for a, b in zip(values, base)]
            cells += ["" if way == WRITTEN else
                      f"{statistics.median(ratios):.2f}x ({spread(ratios)})",
                      "" if way == WRITTEN else
                      f"{statistics.median(added):+.1f} ({spread(added)})",
                      f"{statistics.median(whole):.0f}",
                      "" if way == WRITTEN else
                      f"{statistics.median(added_whole):+.0f} ({spread(added_whole)})"]
        cells += [f"{full} in {len(values)} runs", f"{gc_ms:.1f}"]
        print(f"| {way} | " + " | ".join(cells) + " |")


def sweep(program: str, home: str, before: str, then: int) -> None:
    """Which positions of the collector's schedule the watch turns into a full collection,
    and whether it only moves one: the full collections on the clock, and on the clock
    and over `then` more objects made after it, against the program as written."""
    ways = [w for w in ways_of(before) if not w.startswith(IMPORT)]
    shifts = range(0, 12001, 500)
    on_clock = {way: [] for way in ways}
    more = {way: [] for way in ways}   # positions: more full collections in all than as written
    for shift in shifts:
        runs = {way: one_run(way, program, shift, home, before, then) for way in ways}
        whole = {way: r["collections"][2] + r["after"][2] for way, r in runs.items()}
        for way, r in runs.items():
            if r["collections"][2]:
                on_clock[way].append(shift)
            if whole[way] > whole[WRITTEN]:
                more[way].append(shift)
    print(f"\nfull collections, K = 0 to 12,000 by 500 ({len(shifts)} positions); then "
          f"{then:,} objects made after the clock\n")
    print("| way | positions with one on the clock | at K = | positions with more than as "
          "written, clock and after | at K = |\n|---|---:|---|---:|---|")
    for way in ways:
        print(f"| {way} | {len(on_clock[way])} of {len(shifts)} | "
              f"{', '.join(map(str, on_clock[way])) or '-'} | {len(more[way])} of {len(shifts)} "
              f"| {', '.join(map(str, more[way])) or '-'} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--program", default=str(PROGRAM))
    parser.add_argument("--before", default="", metavar="DIR",
                        help="another checkout: its watch too, in the same rounds")
    parser.add_argument("--shift", default="0", help="K objects kept before the clock (a,b,c)")
    parser.add_argument("--gc-sweep", action="store_true")
    parser.add_argument("--then", type=int, default=30000,
                        help="--gc-sweep: objects made after the clock (the program going on)")
    parser.add_argument("--inside", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        inside(args.inside[0], args.inside[1], int(args.inside[2]), int(args.inside[3]))
        return
    sys.path.insert(0, str(HERE.parent))
    from rounds import interleaved   # bench/rounds.py

    sys.path.insert(0, str(ROOT / "src"))
    from nbtrain.machine import machine_line
    print(f"{machine_line()}\nprogram: {os.path.relpath(args.program, ROOT)}")
    home = tempfile.mkdtemp(prefix="short_program_cost_")
    ways = ways_of(args.before)
    for way in ways:   # the uncounted round: .pyc files, nbtrain's store and caches
        one_run(way, args.program, 0, home, args.before)
    if args.gc_sweep:
        sweep(args.program, home, args.before, args.then)
        return
    for shift in (int(k) for k in args.shift.split(",")):
        runs = interleaved(ways, args.rounds,
                           lambda way: one_run(way, args.program, shift, home, args.before))
        table(runs, args.rounds, shift)


if __name__ == "__main__":
    main()
