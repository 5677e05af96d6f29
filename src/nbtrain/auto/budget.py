"""The one measuring budget. Whatever nbtrain measures for a run (nt.fit's probes before
step 1, the watch's trials on the loop's own steps) costs at most SHARE of that run's own
time, so that measuring never makes a short run slow; a run too short for a measurement
keeps the safe choice and says so. A process's first watch loads nbtrain's engine during the
program, which waits for it as for measuring: the watch counts that loading as spent."""
from __future__ import annotations

import sys

SHARE = 0.05
_unpaid = {"loading_s": 0.0}   # the engine's loading (nbtrain/__init__.py), until a watch takes it


def affordable(cost_s: float, spent_s: float, run_s: float) -> bool:
    """Whether measuring `cost_s` more, after `spent_s` already, stays within SHARE of a run
    of `run_s` (the time run so far, or planned)."""
    return spent_s + cost_s <= SHARE * run_s


def first_use_s(module: str, seconds: float) -> float:
    """What a measurement's first use in a process costs beyond its steps: `seconds`
    (loading `module` and what it imports) where `module` is not loaded yet, else 0."""
    return 0.0 if module in sys.modules else seconds


def loaded(seconds: float) -> None:
    """nbtrain's engine (nbtrain.entry and what it imports) took `seconds` to load."""
    _unpaid["loading_s"] += seconds


def take_loading_s() -> float:
    """The engine's loading that no watch has counted yet, now counted by the one asking."""
    seconds, _unpaid["loading_s"] = _unpaid["loading_s"], 0.0
    return seconds


def words() -> str:
    """The budget as a message says it: '5%'."""
    return f"{SHARE:.0%}"
