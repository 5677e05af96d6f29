"""What nbtrain adds to a step, counted in instructions, which a shared machine cannot
blur.

    python bench/instructions.py [--steps 60] [--case "own loop"]

A ratio of two loops' times on a shared machine drifts by 5-15% from one minute to the
next (bench/rounds.py), so time alone cannot show whether nbtrain adds 1% or 5% to a
sub-millisecond step. The instructions a step executes do not drift: this script counts
them under valgrind's callgrind. It needs valgrind, its headers and a C compiler
(`apt-get install valgrind gcc`). It re-runs itself under callgrind, with counting
switched on only around each measured call.

Each way runs twice, at 110 and at 110 + `--steps` steps (fresh objects each time). The
difference gives the instructions per step in the steady state, without the call's fixed
part; that fixed part (setup, the first 110 steps' extra, finish) is printed apart. Python's garbage
collector is off during each counted call (a collection would land in one call or the
other, and the counts drift by millions); its work is not counted. The ways are compared over the same work:
- your own loop (a per-sample DataLoader, AdamW, loss.item() every step): as written,
  and inside nt.watch(optimize=False);
- the plain loop against nt.fit with its toggles off (a DataLoader, the for-loop AdamW);
- an expert's loop (a permutation sliced into batches, fused AdamW) against nt.fit with
  the expert's choices (batched fetch, fused AdamW, fp32). Telemetry, FLOP counting and
  records every 10 steps stay on, as by default.
Not counted: what is not an instruction (cache misses, waits). Under valgrind torch runs
its AVX2 kernels (valgrind has no AVX-512), so a step's own count is not this CPU's;
nbtrain's share of it is Python and is the same.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile

MARKS_C = r"""
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""
# steps of the short call: its count is the fixed part plus these steps; past the first
# 30 steps of a watch, which counts the loop's host reads only there (watcher/records.py)
SHORT = 110


# -- the ways, as the time benches write them ----------------------------------------------------
def ways(steps: int) -> dict:
    """{(case, way): make(): a function that trains `steps` steps}, each from fresh
    objects (made before the counting starts)."""
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import nbtrain as nt
    from nbtrain.tools.demo import PLAIN

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from overhead import expert_epoch, plain_epoch
    from own_loop import the_loop

    def data():
        gen = torch.Generator().manual_seed(0)
        return torch.randn(64 * steps, 64, generator=gen), \
            torch.randint(0, 10, (64 * steps,), generator=gen)

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def own(**watch):
        def make():
            model, (x, y) = mlp(), data()
            loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True,
                                generator=torch.Generator().manual_seed(1))
            if not watch:
                return lambda: the_loop(model, loader, 1)

            def call():
                with nt.watch(optimize=False, progress=False, **watch):
                    return the_loop(model, loader, 1)
            return call
        return make

    def hand(epoch_fn):
        def make():
            model, (x, y) = mlp(), data()
            return lambda: epoch_fn(model, x, y)
        return make

    def fitted(**settings):
        def make():
            model, (x, y) = mlp(), data()
            cfg = nt.TrainConfig(epochs=1, batch_size=64, lr=1e-3, optimizer="adamw",
                                 num_threads=1, **settings)
            return lambda: nt.fit(model, (x, y), F.cross_entropy, config=cfg,
                                  progress=False).step
        return make

    gen = torch.Generator()
    return {
        ("your own loop", "as written"): own(),
        ("your own loop", "nt.watch(optimize=False)"): own(log_every=10),
        # what the records cost: one every 10 steps (the default), or almost none
        ("your own loop", "nt.watch(optimize=False, log_every=1000)"): own(log_every=1000),
        ("nt.fit, toggles off", "plain loop"): hand(
            lambda m, x, y: plain_epoch(m, x, y, 64, 1e-3)),
        ("nt.fit, toggles off", "nbtrain"): fitted(**PLAIN),
        ("nt.fit, expert's choices", "expert's loop"): hand(
            lambda m, x, y: expert_epoch(m, x, y, 64, 1e-3, gen)),
        ("nt.fit, expert's choices", "nbtrain"): fitted(
            amp="off", batched_fetch=True, optimizer_impl="fused", num_workers=0,
            pin_memory=False, data_on_device=False),
    }


def inside(marks_path: str, steps: int, only: str) -> None:
    """Under callgrind: each way at two lengths, each call counted on its own."""
    import gc

    import torch
    torch.set_num_threads(1)   # valgrind runs one thread at a time anyway
    marks = ctypes.CDLL(marks_path)
    for length in (SHORT, SHORT + steps):
        made = ways(length)
        for (case, way), make in made.items():
            if only not in case:
                continue
            if length == SHORT:
                make()()   # warm: lazy imports, "auto"'s caches, the allocator
            call = make()
            gc.collect()
            gc.disable()   # a collection lands in one call or another: the counts would drift
            marks.start()
            call()
            marks.dump(f"{case}|{way}|{length}".encode())
            gc.enable()


# -- outside: compile the marks, run under callgrind, read the counts -----------------------------
def counts(folder: str) -> dict:
    """{(case, way, length): instructions} from callgrind's dumps in `folder`."""
    found = {}   # in the order of the dumps: the ways as ways() lists them
    paths = glob.glob(os.path.join(folder, "callgrind.out.*.*"))
    for path in sorted(paths, key=lambda p: int(p.rsplit(".", 1)[1])):
        text = open(path).read(4096)
        name = re.search(r"^desc: Trigger: Client Request: (.+)$", text, re.M)
        total = re.search(r"^summary: (\d+)$", text, re.M)
        if name and total:
            case, way, length = name.group(1).split("|")
            found[case, way, int(length)] = int(total.group(1))
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--case", default="", help="only the cases whose name holds this")
    parser.add_argument("--inside", help=argparse.SUPPRESS)   # the marks library, under valgrind
    args = parser.parse_args(argv)
    if args.inside:
        return inside(args.inside, args.steps, args.case)
    with tempfile.TemporaryDirectory() as folder:
        marks = os.path.join(folder, "marks.so")
        source = os.path.join(folder, "marks.c")
        with open(source, "w") as f:
            f.write(MARKS_C)
        try:
            subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", marks, source], check=True)
        except (OSError, subprocess.CalledProcessError) as err:
            sys.exit(f"bench/instructions.py needs gcc and valgrind's headers "
                     f"(apt-get install valgrind gcc): {err}")
        subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                        f"--callgrind-out-file={folder}/callgrind.out.%p", sys.executable,
                        os.path.abspath(__file__), "--inside", marks, "--steps",
                        str(args.steps), "--case", args.case],
                       check=True, stderr=subprocess.DEVNULL)
        report(counts(folder), args.steps)


def report(found: dict, steps: int) -> None:
    from nbtrain.machine import machine_line
    print(f"{machine_line()}\ninstructions counted by callgrind, torch on 1 thread; per step "
          f"= (a call of {SHORT + steps} steps - one of {SHORT}) / {steps}\n")
    print("| case | way | instructions/step | vs the hand-written | fixed part of a call |\n"
          "|---|---|---:|---:|---:|")
    cases = {}
    for case, way, _ in found:
        cases.setdefault(case, [])
        if way not in cases[case]:
            cases[case].append(way)
    for case, names in cases.items():
        base = None
        for way in names:
            short, long = found[case, way, SHORT], found[case, way, SHORT + steps]
            per_step = (long - short) / steps
            fixed = short - SHORT * per_step
            base = base or per_step   # the hand-written way comes first in ways()
            more = (per_step - base) / 1e3
            ratio = "" if per_step == base else f"{per_step / base:.4f}x ({more:+.1f}k)"
            print(f"| {case} | {way} | {per_step / 1e3:,.1f}k | {ratio} | {fixed / 1e6:,.1f}M |")


if __name__ == "__main__":
    main()
