"""Interleaved rounds for the benches that compare ways of training side by side.

Each round runs every way once. The order rotates from round to round, so that each way
runs in each position equally often. On a shared machine a slow spell can last longer
than a round, and a fixed order would then charge it to whichever way runs in the same
place each time.
"""
from __future__ import annotations

import statistics
from typing import Callable, Dict, Hashable, List


def rotated(names: list, round_index: int) -> list:
    """`names` starting at position `round_index` (mod their number), wrapping around."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def interleaved(names: list, repeats: int, measure_one: Callable[[Hashable], float]
                ) -> Dict[Hashable, List[float]]:
    """{name: [measure_one(name) of each round]}, the order rotated round by round."""
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in rotated(list(names), r):
            times[name].append(measure_one(name))
    return times


def paired(times: Dict[Hashable, List[float]], name, base) -> tuple:
    """(median, min, max) of the per-round ratios `name` / `base`: each pair ran in the
    same round, so a slow spell hits both of them."""
    ratios = sorted(a / b for a, b in zip(times[name], times[base]))
    return statistics.median(ratios), ratios[0], ratios[-1]
