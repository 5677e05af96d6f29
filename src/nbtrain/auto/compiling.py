"""torch.compile seen from a run: the graphs it built and the time the first steps waited.

A compiled run waits for the compiler (seconds on a CPU) before its first step, and a
batch of a new shape (an epoch's last, shorter batch) compiles again: the run's mean
throughput then reads as if compile made it slower. So the first compile happens in the
setup, where it is timed, followed by a few compiled and eager forward+backward passes
(compile_check): whether compile pays on this model, and after how many steps its
warm-up is paid back. The summary reports the warm-up apart, and the steady throughput
of the intervals after a recompile.
"""
from __future__ import annotations

import math
import time
from typing import Callable

from .precision import median

SLOW = 2.0   # an interval whose steps took this many times the median waited for a compile
COMPILE_CHECK_STEPS = 8   # compile_check: an eager warm-up, then 3 timed passes of each
PAYS = 1.05   # a compiled pass at least this much faster than eager: compile pays


def compile_check(step: Callable[[str], None], planned: int, may_measure: str = "") -> dict:
    """run.resolved's entries for a compiled run: the first compile's time, and unless
    `may_measure` says why not (a run too short), the eager / compiled time of a
    forward+backward and after how many passes the warm-up is paid back (of `planned`).
    `step(kind)` runs one pass, kind "compiled" or "eager", and returns once it is done."""
    start = time.perf_counter()
    step("compiled")   # the compile: the run's first step would wait for it
    warmup = time.perf_counter() - start
    out = {"compile_warmup_s": (round(warmup, 3), "the first compile, timed before step 1")}
    if may_measure:
        out["compile"] = (True, f"asked for; not timed against eager: {may_measure}")
        return out
    step("eager")   # the eager pass's own warm-up
    best = {"compiled": math.inf, "eager": math.inf}
    for _ in range(3):   # interleaved: a busy moment slows both alike
        for kind in best:
            start = time.perf_counter()
            step(kind)
            best[kind] = min(best[kind], time.perf_counter() - start)
    gain = best["eager"] / best["compiled"]
    saved = best["eager"] - best["compiled"]
    payback = math.ceil(warmup / saved) if saved > 0 else math.inf
    out["compile"] = (True, f"asked for; forward+backward {best['compiled'] * 1e3:.2f} ms "
                            f"compiled against {best['eager'] * 1e3:.2f} ms eager "
                            f"({gain:.2f}x), after a {warmup:.1f} s compile")
    out["compile_gain"] = (round(gain, 3), "eager / compiled forward+backward time of the "
                                           "first batch, measured before step 1")
    out["compile_pays"] = _verdict(gain, warmup, payback, planned)
    return out


def _verdict(gain: float, warmup: float, payback: float, planned: int) -> tuple:
    """(whether compile pays for this run, why): the diagnosis says the why when not."""
    if gain < PAYS:
        return False, (f"did not pay on this model: forward+backward {gain:.2f}x eager "
                       "(measured before step 1) - leave compile off")
    if payback > planned:
        return False, (f"did not pay for this run's length: its {warmup:.1f} s warm-up is "
                       f"paid back after about {payback} forward+backward passes, and the run "
                       f"has {planned} - leave compile off for runs this short")
    return True, (f"{gain:.2f}x eager; its {warmup:.1f} s warm-up paid back after about "
                  f"{payback} of the {planned} passes")


def compile_findings(resolved: dict) -> list:
    """The diagnosis when compile did not pay: on this model, or for this run's length."""
    pays, why = resolved.get("compile_pays", (None, ""))
    return [f"compile {why}"] if pays is False else []


def count_compiles(run) -> None:
    """Put the number of graphs torch.compile built during `run` in run.resolved
    ("compiles"), read from torch._dynamo's counters when the run ends."""
    from torch._dynamo.utils import counters
    before = counters["stats"]["unique_graphs"]

    def on_end(record: dict) -> None:
        if record["kind"] != "end":
            return
        built = counters["stats"]["unique_graphs"] - before
        why = "graphs torch.compile built during the run (torch._dynamo's counters)"
        if built > 1 and not run.config.drop_last:
            why += ("; a batch of another shape (an epoch's last, shorter one) compiles "
                    "again: drop_last=True compiles once")
        run.resolved["compiles"] = (built, why)
        run.unsubscribe(on_end)
    run.subscribe(on_end)


def warmup_split(train: list) -> dict:
    """{"compile_warmup_s", "steady_samples_per_s"} from a compiled run's train records:
    the intervals whose steps took SLOW x the median waited for the compiler; their time
    beyond the median is the warm-up, the others give the steady throughput."""
    if len(train) < 2:
        return {}
    typical = median([r["step_time_s"] for r in train])
    slow = [r for r in train if r["step_time_s"] > SLOW * typical]
    steady = [r for r in train if r["step_time_s"] <= SLOW * typical]
    waited = sum(r["interval_s"] - r["steps"] * typical for r in slow)
    seconds = sum(r["interval_s"] for r in steady)
    return {"compile_warmup_s": waited,
            "steady_samples_per_s": sum(r["samples"] for r in steady) / seconds if seconds else 0.0}
