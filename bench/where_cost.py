"""What the module window (run.modules(), run.peak()) costs a run: the same run with the
window taken and with it off, each in a fresh process, interleaved rounds; and counted.

    python bench/where_cost.py [--rounds 6] [--steps 100,300,1000] [--engine fit,watch]
                               [--threads 1] [--no-instructions]
                               [--instr-steps fit=100,watch=300]

The cases: (a) nt.fit on the digits CNN (nbtrain.tools.demo.digits_cnn, the digits
training split, batch 64, AdamW 3e-3, seed 0, `store=False`, every other setting its
default: "auto" as a run finds it) for `--steps` steps (max_steps); its window is steps
21-23 of a run of 100 steps or more (telemetry/modules.py, FitWindow). (b) The same model
in a plain loop of one's own (a shuffled DataLoader over the same tensors, AdamW 3e-3,
`loss.item()` every step, epochs until `--steps` steps) inside
`nt.watch(optimize=False, progress=False, store=False)`; its window opens once it costs at
most the measuring budget (watcher/modules.py, watcher/measure.py).

The window off. No setting turns it off (telemetry=False and count_flops=False leave it
on), so the "off" way patches nbtrain in the benchmark's own process only: for nt.fit
`nbtrain.telemetry.modules.FIT_MIN_STEPS` is set past any run's length (FitWindow then
never falls due: what a run shorter than 100 steps gets); for a watch
`nbtrain.watcher.modules.Modules.plan` says no window is due (what a compiled model
gets). Nothing else changes: the FLOP count and the peak are measured either way, and a
watch's measuring part ends as soon as nothing is left to measure (with the window off it
may end earlier, and its forward hooks go then: that is part of what the window costs).

Times. Every call is a new interpreter (`--inside`, this file re-invoked). Before the
clock: `import torch`, `import nbtrain`, the data and the model. On the clock: the
nt.fit call, or the watch's `with` block around the loop (its setup, the loop, its end).
nbtrain's cache is a copy of this machine's (NBTRAIN_CACHE_DIR), so every process finds
the same cached decisions (bf16, the peak); one round of every case first is not counted
(the disk caches warm, as a user's second run). Then `--rounds` rounds; each round runs
every case, the cases in an order rotated from round to round and, within a case, on and
off in an order that alternates (bench/rounds.py: an even number of rounds puts each
first equally often). Printed: the median seconds of each way, the median of the
per-round ratios on/off with their min-max spread and the median difference (ms added):
these whole calls are what a user waits for, and on a shared machine two processes of
the same way differ by up to 10-20% (6-round spreads of the on/off ratio: 0.93-1.09 on a
quiet spell, 0.76-1.23 under load). So each process also times the window's span alone,
with the main thread's CPU time (which a preempted process is not charged): nt.fit's
steps 21-23 from before the first to after the record, the window on or off; a watch's
from the window's opening (at a step's end) to its record, and with it off the same
steps (the step it opened at in the case's last run with it on), marked by the loop
after `opt.step()`. The span's ms added, over the whole call's median with the window
off, is the window's share of the run; where the window was taken (its last step) is
printed too. Not in the span: a watch's lazy import of telemetry/modules.py (as it first
looks whether a window is affordable), and the measuring part's per-step look, which
with the window off ends once the FLOPs and the peak are done and with it on at the
window (watch_cost.py's µs a step: the watch's parts).

Threads: torch runs `--threads` threads (OMP_NUM_THREADS, default 1) in every process.
On 2 shared cores, 2 threads stall at every parallel region whenever another process holds
a core (a 300-step run took 4.5 s or 39 s, on 1 thread 2.8-2.9 s), which no number of
rounds averages out. On 1 thread a step takes longer, so the same ms added are a
smaller share here than of a run on 2 idle threads; the ms added are the window's own
(Python, one thread).

Instructions (where valgrind and gcc are found; `--no-instructions` skips them,
`--rounds 0` counts only): one fresh process per engine and way under valgrind's
callgrind, torch on 1 thread, counting switched on by client requests (as
bench/instructions.py builds them) over the window's steps only: nt.fit's steps 21-23
(its ModuleWindow made, its hooks, its record), with the window on and, over the same
steps, off; a watch's from the window's opening to its record (the step it opened at
found by the run with it on) and the same steps of a run with it off. A whole run under
callgrind would take too long (a 100-step nt.fit, counted whole: 16 minutes on 2 busy
cores, 12.2G instructions), and the run's other steps are the same either way. nt.fit
runs with amp="off" there: its bf16 (cached as this CPU's choice) runs in software under
valgrind, 15 minutes for 100 steps even uncounted. The
added count is then put against N steps of the run (the off count / 3 a step), the
setup left out (the share reads high for that). Under valgrind torch runs its AVX2
kernels (no AVX-512 or AMX), so a step's own count is not this CPU's; the window's
added count is Python and is the same.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
from rounds import paired, rotated   # noqa: E402  bench/rounds.py

MARK = "where_cost:"
ON, OFF = "window on", "window off"
MARKS_C = r"""
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); CALLGRIND_STOP_INSTRUMENTATION; }
"""


# -- inside: one engine, one length, one way, in this fresh process ----------------------------
class Span:
    """The window's span (count_the_window): its wall and thread CPU seconds, and under
    callgrind its instructions (the client requests)."""

    def __init__(self, marks=None):
        self.marks, self.wall, self.cpu, self._at = marks, None, None, None

    def start(self) -> None:
        if self.marks:
            self.marks.start()
        self._at = (time.perf_counter(), time.thread_time())

    def dump(self, label: bytes) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        if self.marks:
            self.marks.dump(label)
        self.wall, self.cpu = wall - self._at[0], cpu - self._at[1]


def window_off(engine: str) -> None:
    """The module window never opens: patched in this process only (see the docstring)."""
    if engine == "fit":
        from nbtrain.telemetry import modules
        modules.FIT_MIN_STEPS = 10 ** 12
    else:
        from nbtrain.watcher import modules

        def plan(self, compiled: bool) -> bool:
            self._why_not = "switched off by bench/where_cost.py"
            self.due = False
            return False
        modules.Modules.plan = plan


def inside(engine: str, steps: int, way: str, marks_path: str = "", at: int = 0) -> None:
    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import nbtrain as nt
    from nbtrain.tools.demo import digits_cnn

    marks = ctypes.CDLL(marks_path) if marks_path else None
    counting = []   # the step after which counting started (a watch's window: as it opened)
    if marks:
        torch.set_num_threads(1)   # valgrind runs one thread at a time anyway
    span = Span(marks)
    count_the_window(engine, way, span, counting)
    if way == OFF:
        window_off(engine)
    x, y = nt.datasets.digits("train")
    torch.manual_seed(0)
    model = digits_cnn()
    if engine == "fit":
        epochs = -(-steps // -(-len(x) // 64))
        # under valgrind fp32 (bf16 there runs in software: 15 minutes for 100 steps)
        cfg = nt.TrainConfig(epochs=epochs, max_steps=steps, batch_size=64, optimizer="adamw",
                             lr=3e-3, seed=0, store=False, **(dict(amp="off") if marks else {}))

        def call():
            return nt.fit(model, (x, y), F.cross_entropy, config=cfg, progress=False)
    else:
        loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True,
                            generator=torch.Generator().manual_seed(1))
        # the window off: the span of the steps the window took with it on (`--at`)
        # (telemetry.modules imported here only then: a watch imports it as it looks
        # whether a window is affordable, on the clock)
        mark = (at, at + _window_steps()) if at and way == OFF else (-1, -1)

        def call():
            with nt.watch(optimize=False, progress=False, store=False) as run:
                opt = torch.optim.AdamW(model.parameters(), 3e-3)
                done, losses = 0, []
                while done < steps:
                    for xb, yb in loader:
                        opt.zero_grad()
                        loss = F.cross_entropy(model(xb), yb)
                        loss.backward()
                        opt.step()
                        done += 1
                        if done == mark[0]:
                            counting.append(done)
                            span.start()
                        elif done == mark[1]:
                            span.dump(f"{engine}|{way}".encode())
                        losses.append(loss.item())
                        if done == steps:
                            break
            return run
    start = time.perf_counter()
    run = call()
    seconds = time.perf_counter() - start
    records = run.records("modules")
    record = records[-1] if records else {}
    print(MARK, json.dumps({"seconds": seconds, "steps": run.step,
                            "window_step": record.get("step") if record.get("rows") else None,
                            "counted_after": counting[0] if counting else None,
                            "span_wall": span.wall, "span_cpu": span.cpu,
                            "note": record.get("note", "")}), flush=True)


def _window_steps() -> int:
    from nbtrain.telemetry.modules import WINDOW_STEPS
    return WINDOW_STEPS


def count_the_window(engine: str, way: str, marks, counting: list) -> None:
    """The span of the window's steps, timed (and under callgrind counted) alone. nt.fit:
    from before step 21 to after step 23 (its record emitted), window on or off. A watch
    with the window on: from its opening (at a step's end) to its closing (its record
    emitted); off: the same steps, marked by the loop (`--at`). Python's garbage
    collector stays on: a collection the window's objects bring on is the window's."""
    label = f"{engine}|{way}".encode()
    if engine == "fit":
        from nbtrain.telemetry import modules
        first, last = modules.FIT_AT_STEP, modules.FIT_AT_STEP + modules.WINDOW_STEPS
        before, after = modules.FitWindow.before, modules.FitWindow.after

        def counted_before(self, step):
            if step == first:
                counting.append(step)
                marks.start()
            before(self, step)

        def counted_after(self, step):
            after(self, step)
            if step == last:
                marks.dump(label)
        modules.FitWindow.before, modules.FitWindow.after = counted_before, counted_after
    elif way == ON:
        from nbtrain.watcher import modules
        opened, step_done = modules.Modules.open, modules.Modules.step_done

        def counted_open(self, now, step_s):
            counting.append(self.edge.run.step)
            marks.start()
            opened(self, now, step_s)

        def counted_step_done(self, now):
            spent = step_done(self, now)
            if self.window is None:
                marks.dump(label)
            return spent
        modules.Modules.open, modules.Modules.step_done = counted_open, counted_step_done


# -- outside ------------------------------------------------------------------------------------
def one_process(engine: str, steps: int, way: str, env: dict, at: int = 0) -> dict:
    out = subprocess.run([sys.executable, str(HERE), "--inside", engine, str(steps), way,
                          "--at", str(at)],
                         env=env, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"{engine} {steps} {way} failed:\n{out.stderr[-3000:]}")


def timed(cases: list, rounds: int, env: dict) -> dict:
    """{(engine, steps, way): [result of each round]}: one uncounted round first; the
    cases' order rotated round by round, on/off alternating within each case."""
    results = {(e, s, w): [] for e, s in cases for w in (ON, OFF)}
    opened = {}   # a watch's: the step its window opened after, in the case's last on run
    for r in range(-1, rounds) if rounds else ():
        for engine, steps in rotated(list(cases), max(r, 0)):
            # on first in even rounds, off first in odd ones: an even --rounds balances them
            for way in (OFF, ON) if r % 2 else (ON, OFF):
                got = one_process(engine, steps, way, env, opened.get((engine, steps), 0))
                if way == ON and got["counted_after"]:
                    opened[engine, steps] = got["counted_after"]
                if r >= 0:
                    results[engine, steps, way].append(got)
        print(f"  round {r + 1 if r >= 0 else 'warm-up'} done, load {os.getloadavg()[0]:.2f}",
              file=sys.stderr, flush=True)
    return results


def counted(engines: list, steps: dict, env: dict) -> dict:
    """{(engine, way): (instructions of the window's steps, the step after which counting
    started)}, one fresh valgrind process each (count_the_window); a watch's window on
    first, its off run then counting the same steps."""
    found = {}
    with tempfile.TemporaryDirectory() as folder:
        marks, source = os.path.join(folder, "marks.so"), os.path.join(folder, "marks.c")
        Path(source).write_text(MARKS_C)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", marks, source], check=True)
        for engine in engines:
            at = 0
            for way in (ON, OFF):
                out = os.path.join(folder, f"callgrind.{engine}.{way.split()[1]}")
                began = time.perf_counter()
                ran = subprocess.run(
                    ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                     f"--callgrind-out-file={out}.%p", sys.executable, str(HERE), "--inside",
                     engine, str(steps[engine]), way, "--marks", marks, "--at", str(at)],
                    env=env, capture_output=True, text=True)
                result = next((json.loads(line[len(MARK):]) for line in ran.stdout.splitlines()
                               if line.startswith(MARK)), None)
                if result is None or result["counted_after"] is None:
                    print(f"  callgrind {engine} {way}: nothing counted "
                          f"{ran.stderr[-500:]}", file=sys.stderr)
                    break
                at = result["counted_after"]
                for path in glob.glob(out + ".*"):
                    text = open(path).read(4096)
                    total = re.search(r"^summary: (\d+)$", text, re.M)
                    if re.search(r"^desc: Trigger: Client Request: ", text, re.M) and total:
                        found[engine, way] = (int(total.group(1)), at)
                print(f"  callgrind {engine} {way}: {time.perf_counter() - began:.0f} s",
                      file=sys.stderr, flush=True)
    return found


def cpu_model() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--save", help="write every process's result here (JSON)")
    parser.add_argument("--steps", default="100,300,1000")
    parser.add_argument("--engine", default="fit,watch")
    parser.add_argument("--no-instructions", action="store_true")
    parser.add_argument("--instr-steps", default="fit=100,watch=300",
                        help="each engine's run length under callgrind")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's threads in every process (OMP_NUM_THREADS)")
    parser.add_argument("--inside", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--marks", default="", help=argparse.SUPPRESS)
    parser.add_argument("--at", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        engine, steps, way = args.inside
        return inside(engine, int(steps), way, args.marks, args.at)

    engines = args.engine.split(",")
    cases = [(e, int(s)) for e in engines for s in args.steps.split(",")]
    cache = tempfile.mkdtemp(prefix="where_cost_")
    mine = Path(os.environ.get("NBTRAIN_CACHE_DIR") or Path.home() / ".cache" / "nbtrain")
    if mine.is_dir():
        shutil.copytree(mine, cache, dirs_exist_ok=True)
    env = dict(os.environ, NBTRAIN_CACHE_DIR=cache, PYTHONHASHSEED="0",
               OMP_NUM_THREADS=str(args.threads))
    load_before = os.getloadavg()
    began = time.perf_counter()
    try:
        results = timed(cases, args.rounds, env)
        instructions = {}
        if not args.no_instructions and shutil.which("valgrind") and shutil.which("gcc"):
            lengths = dict(pair.split("=") for pair in args.instr_steps.split(","))
            instructions = counted(engines, {e: int(n) for e, n in lengths.items()}, env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    load_after = os.getloadavg()
    if args.save:
        Path(args.save).write_text(json.dumps(
            [{"engine": e, "steps": n, "way": w, "round": i, **r}
             for (e, n, w), rs in results.items() for i, r in enumerate(rs)], indent=1))

    print(f"CPU {cpu_model()}, {os.cpu_count()} cores; load average (1, 5, 15 min) "
          f"{'/'.join(f'{v:.2f}' for v in load_before)} before, "
          f"{'/'.join(f'{v:.2f}' for v in load_after)} after; "
          f"{(time.perf_counter() - began) / 60:.1f} min in all")
    if args.rounds:
        print_times(cases, results, args.rounds)
    if instructions:
        print_instructions(engines, instructions, args.instr_steps, args.steps)
    elif not args.no_instructions:
        print("\ninstructions: not counted (valgrind or gcc not found)")


def print_times(cases: list, results: dict, rounds: int) -> None:
    print(f"each call a fresh process, median of {rounds} interleaved rounds "
          f"(+1 warm-up not counted); per-round pairs on - off: median and min to max\n")
    print("whole call: wall seconds of the nt.fit call / the watch's with-block; window span: "
          "the window's steps and its record alone (nt.fit steps 21-23; a watch's from its "
          "opening to its record, and the same steps with it off), main thread CPU ms; "
          "share = span CPU ms added / the whole call's median with the window off\n")
    print("| engine | steps | off s | on s | whole call on/off | spread | ms added | "
          "span CPU ms off | span ms added | spread | share of the run | window at step | "
          "<= 2% |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for engine, steps in cases:
        on, off = results[engine, steps, ON], results[engine, steps, OFF]
        times = {ON: [r["seconds"] for r in on], OFF: [r["seconds"] for r in off]}
        ratio, low, high = paired(times, ON, OFF)
        whole = statistics.median(a - b for a, b in zip(times[ON], times[OFF])) * 1e3
        at = sorted({r["window_step"] for r in on}, key=lambda v: (v is None, v))
        off_at = {r["window_step"] for r in off} - {None}
        where = ",".join("none" if v is None else str(v) for v in at) + \
            (f" (off: {off_at}!)" if off_at else "")
        label = "nt.fit" if engine == "fit" else "nt.watch(optimize=False)"
        pairs = [(a["span_cpu"], b["span_cpu"]) for a, b in zip(on, off)
                 if a["span_cpu"] is not None and b["span_cpu"] is not None]
        if pairs:
            added = sorted((a - b) * 1e3 for a, b in pairs)
            share = statistics.median(added) / 1e3 / statistics.median(times[OFF])
            span = (f"{statistics.median(b for _, b in pairs) * 1e3:.1f} | "
                    f"{statistics.median(added):+.2f} | {added[0]:+.2f} to {added[-1]:+.2f} | "
                    f"{share:.2%}")
            verdict = "yes" if share <= 0.02 else "NO"
        else:
            span, verdict = "no window | | |", "(nothing added)"
        print(f"| {label} | {steps} | {statistics.median(times[OFF]):.3f} | "
              f"{statistics.median(times[ON]):.3f} | {ratio:.4f} | {low:.3f}-{high:.3f} | "
              f"{whole:+.0f} | {span} | {where} | {verdict} |")
    notes = {r["note"] for rs in results.values() for r in rs if not r["window_step"]}
    if notes - {""}:
        print("\nruns without a window said: " + " / ".join(sorted(notes - {""})))


def print_instructions(engines: list, found: dict, lengths: str, steps: str) -> None:
    from nbtrain.telemetry.modules import WINDOW_STEPS
    print(f"\ninstructions (callgrind, torch on 1 thread, one fresh process a way, runs of "
          f"{lengths} steps): counted over the window's {WINDOW_STEPS} steps only, and over "
          f"the same steps with it off; 'of N steps' = added / (off / {WINDOW_STEPS} x N), "
          f"the share of N steps' instructions (setup left out: an upper bound)\n")
    ns = [int(n) for n in steps.split(",")]
    print("| engine | steps counted | off | on | added | " +
          " | ".join(f"of {n} steps" for n in ns) + " |\n|---|---|---:|---:|---:|" +
          "---:|" * len(ns))
    for engine in engines:
        if (engine, ON) not in found or (engine, OFF) not in found:
            print(f"| {engine} | not counted |")
            continue
        (a, at), (b, _) = found[engine, ON], found[engine, OFF]
        per_step = b / WINDOW_STEPS
        shares = " | ".join(f"{(a - b) / (per_step * n):.2%}" for n in ns)
        print(f"| {engine} | {at + 1}-{at + WINDOW_STEPS} | {b / 1e6:,.1f}M | {a / 1e6:,.1f}M | "
              f"{(a - b) / 1e6:+,.2f}M | {shares} |")

if __name__ == "__main__":
    main()
