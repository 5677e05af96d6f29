"""torch.compile seen from a run: the graphs it built and the time the first steps waited.

A compiled run's first steps wait for the compiler (seconds on a CPU), and a batch of a
new shape (an epoch's last, shorter batch) compiles again: the run's mean throughput
then reads as if compile made it slower. So the summary reports the warm-up apart, and
the steady throughput of the intervals after it.
"""
from __future__ import annotations

import statistics

SLOW = 2.0   # an interval whose steps took this many times the median waited for a compile


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
    median = statistics.median(r["step_time_s"] for r in train)
    slow = [r for r in train if r["step_time_s"] > SLOW * median]
    steady = [r for r in train if r["step_time_s"] <= SLOW * median]
    waited = sum(r["interval_s"] - r["steps"] * median for r in slow)
    seconds = sum(r["interval_s"] for r in steady)
    return {"compile_warmup_s": waited,
            "steady_samples_per_s": sum(r["samples"] for r in steady) / seconds if seconds else 0.0}
