"""The corpus's training programs run whole in fresh processes, three ways, and counted.

The programs of tests/corpus/programs/, each run a new Python process, timed as written,
watched only and with the watch's defaults; and the instructions the watch adds to each.

    python bench/real_programs.py [--rounds 5] [--program mnist_cnn] [--no-instructions]
    python bench/real_programs.py --rounds 0 --program gcn,quickstart   # instructions only
    python bench/real_programs.py --program reinforce --before ../old   # another checkout too

Each program runs as its author would run it (tests/corpus/harness.py, run_program): as
written; inside `nt.watch(optimize=False)` (watched only); inside `nt.watch()` (the
defaults). The programs are the harness's CORPUS as this script finds it. Without the
tests' checks (run_program's checked=False): no trace function keeping main()'s locals,
which every Python call of the program and of the watch would pay, and no global
optimizer hook counting the steps as written.

Times. Every run is a new interpreter (`--inside NAME WAY`, this file re-invoked), so a
program pays its first use as a user's fresh `python train.py` does. Before the clock:
the interpreter's start, `import torch`, the harness and its imports (numpy, the
torchvision ops it declares), and the harness's setup of the run (its data stand-ins
written to a new directory, torch's surface taken). On the clock: `import nbtrain`
(where the way uses it: the as-written process never imports it) plus run_program's own
seconds, which start just after the seeds are set and end after the watch's exit: the
program's imports beyond those above (torchvision, transformers, ...), its whole run,
and the watch's setup, hooks and end. The program's prints go to a buffer, not the
pipe; the run's directory is removed after the clock. One round of every way first is not counted: it leaves the disk caches as a
user's second run finds them (Python's .pyc files, torch.compile's inductor cache, the
caches of nbtrain's probes, the OS's file cache). Then `--rounds` interleaved rounds,
the order of the ways rotated from round to round (bench/rounds.py). Printed: the
median seconds as written, and the median of the per-round ratios of each watch to the
run as written with their min-max spread (a ratio of one round's pair, which ran
minutes apart at most), and the median of the per-round differences (ms added). A way
that fails is shown as its error, and the program's other ways still run. `--before
DIR` (another checkout of nbtrain, e.g. a git worktree of an older commit) adds a fourth
way to every round: watched only by DIR/src's nbtrain (on PYTHONPATH; the corpus and
harness stay this checkout's), printed against the run as written and as this code's
watched time over it, per round: a change measured in the same rounds, where a shared
machine's drift between two passes would be larger than it.

Instructions (where `valgrind` and gcc are found; `--no-instructions` skips them): after
a run of each way outside valgrind (the disk caches warm, as for the times), one fresh
process per way, as written and watched only, under valgrind's callgrind with counting
off at its start and switched on by client requests (a small C library built here, as
bench/instructions.py does) around exactly the span timed above: `import nbtrain`, then
run_program from its seeds set to its end (the harness's seed_all and its second
torch_surface mark the span). The rest of the process, the interpreter's start and
`import torch` included, is never counted, so no imports-only baseline process has to be
subtracted (that difference of two whole processes would carry both starts' variation).
Threads the watch starts are counted (valgrind runs one thread at a time); torch runs
1 thread (OMP_NUM_THREADS=1: its idle threads' spinning would vary), hashing is seeded
(PYTHONHASHSEED=0). Not counted: DataLoader worker processes (cifar10_tutorial,
hopenet; the same work either way) and programs exec'd (inductor's compiler). Under
valgrind torch runs its AVX2 kernels; the watch's share is Python and is the same.
Printed: the ratio, the instructions added of those as written, and the import's share;
then the garbage collections' instructions in the span as written -> watched (the inclusive
count of CPython's gc_collect_main, by callgrind_annotate) and the ratio of the rest. A
full collection of a torch program's heap costs ~100 ms, and a watch moves where the
collector's schedule puts one (before the clock, on it, or after it): the rest is the
watch's own cost, untouched by that.
`--no-measuring` sets the watch's measuring budget (nbtrain.auto.budget.SHARE) to
nothing in the counted processes: under valgrind a run is so much longer that the watch
would measure (a FLOP count, a trial) where at full speed it measures nothing.
Valgrind runs programs 20-100x slower: minutes per program (quickstart: ~10 minutes
for its two runs on 2 busy cores).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import importlib
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve()
CORPUS = HERE.parents[1] / "tests" / "corpus"
MARK = "real_programs seconds:"   # the line a run prints last, whatever the program printed
WRITTEN, WATCHED, DEFAULTS = "as written", "watched", "defaults"   # harness.WAYS's names
COLLECTOR = "collections"   # the garbage collector's share of a span's instructions
BEFORE = "watched, before"   # WATCHED by another checkout's nbtrain (--before)

MARKS_C = r"""
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); CALLGRIND_STOP_INSTRUMENTATION; }
"""


# -- inside: one program, one way, in this fresh process ---------------------------------------
def inside(name: str, way: str, marks_path: str = "", measuring: bool = True) -> None:
    """Run program `name` one `way` and print its seconds on the clock (see the module's
    docstring); under callgrind, `marks_path` counts that same span. Without `measuring`,
    the watch's measuring budget is nothing (see --no-measuring)."""
    import torch   # noqa: F401  (before the clock, as everywhere)

    sys.path[:0] = [str(CORPUS), str(CORPUS / "programs")]   # as tests/corpus/conftest.py
    marks = ctypes.CDLL(marks_path) if marks_path else None
    # the harness imports nbtrain; the as-written process must not, so it gets a stand-in
    # while the harness loads, and a watch's import of the real one is timed below
    sys.modules["nbtrain"] = types.ModuleType("nbtrain")
    harness = importlib.import_module("harness")
    del sys.modules["nbtrain"]
    if marks:
        count_the_run(harness, marks)

    imported = 0.0
    if harness.WAYS[way] is not None:
        if marks:
            marks.start()
        start = time.perf_counter()
        harness.nt = importlib.import_module("nbtrain")
        if not measuring:
            importlib.import_module("nbtrain.auto.budget").SHARE = 1e-9
        imported = time.perf_counter() - start
        if marks:
            marks.dump(b"import nbtrain")
    made, mkdtemp = [], tempfile.mkdtemp

    def kept_mkdtemp(*args, **kwargs):   # to remove run_program's directory, which it keeps
        made.append(mkdtemp(*args, **kwargs))
        return made[-1]

    tempfile.mkdtemp = kept_mkdtemp
    with contextlib.redirect_stdout(io.StringIO()):
        result = harness.run_program(harness.BY_NAME[name], way, checked=False)
    print(f"{MARK} {imported + result.seconds!r}", flush=True)
    shutil.rmtree(made[0], ignore_errors=True)   # after the clock; the first is the harness's


def count_the_run(harness, marks) -> None:
    """Counting on from the seeds set (just before run_program's clock starts) to its
    second torch_surface (just after the clock stops)."""
    seed_all, surface, started = harness.seed_all, harness.torch_surface, []

    def seeded(*args, **kwargs):
        seed_all(*args, **kwargs)
        started.append(True)
        marks.start()

    def surface_after(*args, **kwargs):
        if started:
            marks.dump(b"run")
            started.clear()
        return surface(*args, **kwargs)

    harness.seed_all, harness.torch_surface = seeded, surface_after


# -- outside: fresh processes, timed and counted -------------------------------------------------
def as_a_users_python() -> dict:
    """The environment of a user's `python train.py`: one that writes .pyc files, so the
    uncounted first round leaves them as a user's second run finds them (a host may set
    PYTHONDONTWRITEBYTECODE, and every module would be compiled on every run)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def one_run(name: str, way: str, before: str = "") -> float:
    """One fresh process's seconds on the clock; a failed run raises its last error line.
    BEFORE runs WATCHED with the nbtrain of the checkout `before`."""
    env = as_a_users_python()
    if way == BEFORE:
        way = WATCHED
        env["PYTHONPATH"] = os.pathsep.join(
            part for part in (str(Path(before, "src")), env.get("PYTHONPATH", "")) if part)
    done = subprocess.run([sys.executable, str(HERE), "--inside", name, way],
                          capture_output=True, text=True, timeout=1800, env=env)
    found = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode or not found:
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
        raise RuntimeError(lines[-1][:100])
    return float(found[-1][len(MARK):])


def measure(name: str, rounds: int, before: str = "") -> dict:
    """{way: [seconds per round]}, or {way: error text} for a way that failed."""
    from rounds import interleaved   # bench/rounds.py

    failed, every_way = {}, (WRITTEN, WATCHED, DEFAULTS) + ((BEFORE,) if before else ())
    for way in every_way:   # the warm-up round, not counted
        try:
            one_run(name, way, before)
        except Exception as error:   # shown in the table, instead of the ratio
            failed[way] = f"{type(error).__name__}: {error}"
    ways = [way for way in every_way if way not in failed]
    if WRITTEN not in ways or rounds < 1:
        return failed
    try:
        return {**interleaved(ways, rounds, lambda way: one_run(name, way, before)), **failed}
    except Exception as error:   # a run that failed in a counted round only
        return {WRITTEN: f"a counted round failed: {error}"}


def build_marks(folder: str) -> str:
    """The client requests' library, built by gcc; '' where valgrind or gcc is missing."""
    if not (shutil.which("valgrind") and shutil.which("gcc")):
        return ""
    source, marks = os.path.join(folder, "marks.c"), os.path.join(folder, "marks.so")
    Path(source).write_text(MARKS_C)
    built = subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", marks, source],
                           capture_output=True, text=True)
    return marks if built.returncode == 0 else ""   # no valgrind/callgrind.h: no counts


def instructions(name: str, way: str, marks: str, folder: str, measuring: bool) -> dict:
    """{'import nbtrain': n, 'run': n, COLLECTOR: n}: the instructions of the timed span
    of one fresh process under callgrind (no import where the way has none), and of the
    garbage collections within it."""
    out = os.path.join(folder, f"{name}.{way.replace(' ', '_')}")
    env = {**as_a_users_python(), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={out}.%p", sys.executable, str(HERE),
               "--inside", name, way, "--marks", marks,
               *([] if measuring else ["--no-measuring"])]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as process:   # valgrind runs the program in its own pid
        stdout, stderr = process.communicate(timeout=7200)
    if process.returncode or MARK not in stdout:
        lines = [line for line in stderr.strip().splitlines() if not line.startswith("==")]
        raise RuntimeError((lines or [f"exit {process.returncode}"])[-1][:100])
    found = {}   # the process's own dumps, not its forked DataLoader workers' (other pids)
    for path in glob.glob(f"{out}.{process.pid}.*"):
        text = Path(path).read_text(errors="replace")[:4096]
        span = re.search(r"^desc: Trigger: Client Request: (run|import nbtrain)$", text, re.M)
        if span:
            found[span.group(1)] = int(re.search(r"^summary: (\d+)$", text, re.M).group(1))
            found[COLLECTOR] = found.get(COLLECTOR, 0) + collectors_instructions(path)
    return found


def collectors_instructions(path: str) -> int:
    """The instructions of Python's garbage collections in one callgrind dump (0 where
    callgrind_annotate or the interpreter's symbols are missing)."""
    try:
        annotated = subprocess.run(["callgrind_annotate", "--inclusive=yes", path],
                                   capture_output=True, text=True, timeout=600).stdout
    except OSError:
        return 0
    found = re.search(r"^\s*([\d,]+) .*:gc_collect_main ", annotated, re.M)
    return int(found.group(1).replace(",", "")) if found else 0


# -- the table ------------------------------------------------------------------------------------
def ratio_cell(times: dict, way: str, base: str = WRITTEN) -> str:
    from rounds import paired   # bench/rounds.py

    if isinstance(times.get(way), str):
        return f"failed: {times[way]}"
    if not isinstance(times.get(base), list) or way not in times:
        return "-"
    median, low, high = paired(times, way, base)
    added = statistics.median(a - b for a, b in zip(times[way], times[base]))
    return f"{median:.3f}x ({low:.2f}-{high:.2f}), {added * 1e3:+.0f} ms"


def instructions_cell(name: str, marks: str, folder: str, measuring: bool) -> str:
    if not marks:
        return "-"
    try:
        for way in (WRITTEN, WATCHED):   # the disk caches warm, as for the times (--rounds 0)
            one_run(name, way)
        written, watched = (instructions(name, way, marks, folder, measuring)
                            for way in (WRITTEN, WATCHED))
    except Exception as error:   # shown in its cell, the row's times kept
        return f"failed: {type(error).__name__}: {error}"
    collected = [counts.pop(COLLECTOR, 0) for counts in (written, watched)]
    base, total = sum(written.values()), sum(watched.values())
    cell = (f"{total / base:.3f}x ({millions(total - base, '+')} of {millions(base)}; "
            f"import {millions(watched.get('import nbtrain', 0))})")
    if not any(collected):   # none on the clock, or not counted
        return cell
    outside = (total - collected[1]) / (base - collected[0])
    return (f"{cell}; collections {millions(collected[0])} -> {millions(collected[1])}, "
            f"the rest {outside:.3f}x")


def millions(count: int, sign: str = "") -> str:
    return f"{count / 1e6:{sign},.0f}M"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds; 0: no times")
    parser.add_argument("--program", default="",
                        help="only the programs whose name holds this (or one of a,b,c)")
    parser.add_argument("--no-instructions", action="store_true", help="skip callgrind")
    parser.add_argument("--before", default="", metavar="DIR",
                        help="another checkout: its watched time too, in the same rounds")
    parser.add_argument("--no-measuring", action="store_true",
                        help="counted runs: the watch's measuring budget set to nothing")
    parser.add_argument("--inside", nargs=2, metavar=("NAME", "WAY"), help=argparse.SUPPRESS)
    parser.add_argument("--marks", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        return inside(*args.inside, args.marks, not args.no_measuring)
    if args.before:   # its path as the children's PYTHONPATH: absolute, and a checkout
        args.before = str(Path(args.before).resolve())
        if not Path(args.before, "src", "nbtrain").is_dir():
            parser.error(f"--before {args.before}: no src/nbtrain there; give a checkout of "
                         "nbtrain, e.g. `git worktree add ../before <commit>`")

    sys.path[:0] = [str(HERE.parent), str(CORPUS), str(CORPUS / "programs")]
    from harness import CORPUS as PROGRAMS   # read now: the corpus grows
    from nbtrain.machine import machine_line
    names = [program.name for program in PROGRAMS
             if any(part in program.name for part in args.program.split(","))]
    with tempfile.TemporaryDirectory() as folder:
        marks = "" if args.no_instructions else build_marks(folder)
        counted = ("instructions: callgrind, the timed span, torch on 1 thread" if marks else
                   "instructions: not counted (" + ("--no-instructions" if args.no_instructions
                                                    else "no valgrind, gcc or callgrind.h") + ")")
        timed = (f"times: each run a fresh process, median of {args.rounds} interleaved rounds "
                 "after one warm-up round" if args.rounds > 0 else "times: not measured (--rounds 0)")
        print(f"{machine_line()}\n{len(names)} programs; {timed}; {counted}\n")
        before = (" watched by --before / as written | watched now / by --before |"
                  if args.before else "")
        print("| program | as written s | watched / as written (spread), ms added | defaults "
              f"/ as written (spread), ms added |{before} instructions watched / as written |\n"
              f"|---|---:|---:|---:|{'---:|---:|' if args.before else ''}---:|", flush=True)
        for name in names:
            times = measure(name, args.rounds, args.before) if args.rounds > 0 else {}
            written = times.get(WRITTEN)
            base = (f"{statistics.median(written):.3f}" if isinstance(written, list) else
                    f"failed: {written}" if written else "-")
            against = (f" {ratio_cell(times, BEFORE)} | {ratio_cell(times, WATCHED, BEFORE)} |"
                       if args.before else "")
            print(f"| {name} | {base} | {ratio_cell(times, WATCHED)} | "
                  f"{ratio_cell(times, DEFAULTS)} |{against} "
                  f"{instructions_cell(name, marks, folder, not args.no_measuring)} |",
                  flush=True)
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
