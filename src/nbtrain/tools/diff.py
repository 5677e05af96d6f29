"""nt.diff(a, b): what changed between two runs, per step, and the settings that explain it.

    >>> d = nt.diff(nt.load_run(old_id), run)
    >>> print(d.text())
    b is 2.3x slower a step: data wait 2% -> 61% of the step (0.1 ms -> 24 ms), with ...

Each run's typical step is the median of its train records after the first (the first
record's steps allocate the optimizer's state and warm the kernels up, as
tools/demo.py's steady_rate leaves it out too); medians, because a shared machine's slow
spell skews a mean. Whether b differs from a at all is read from the spread of each
run's per-record step times (`beyond_noise`), never from the medians' ratio alone.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

from ..config import FIELD_NAMES, SETTINGS
from ..run import Run
from ..tables import plain

# The time split of a step, as each record carries it per step (telemetry/timers.py's
# EndedInterval): record key -> its name in words. "rest" is the step less the others.
PARTS = {"data_wait_s": "data wait", "copy_s": "copy", "compute_s": "compute",
         "rest": "the rest of the step"}
# The groups of settings (config.GROUPS) that act on each part of the step.
CAUSE_GROUPS = {"data wait": ("data path",), "copy": ("data path", "device"),
                "compute": ("device", "optimizer", "length", "step")}
# run.gaps()'s row of the steps themselves: their time is the step compared above
NOT_GAPS = ("steps",)
FEWEST_RECORDS = 3   # per run, after the first: fewer have no spread to judge noise by
SHOWN = 3            # modules and gaps listed at most, the largest moves first


class Change(NamedTuple):
    """A setting that differs: its value in a and in b, and b's reason where resolved."""
    name: str
    a: object
    b: object
    resolved: bool    # True: run.resolved's value (what ran); False: the config as given
    why: str = ""


class Moved(NamedTuple):
    """A module's or a gap's time in a and in b (seconds, as the Run's method gives them)."""
    name: str
    a_s: float
    b_s: float


class Step(NamedTuple):
    """A run's typical step: medians over its steady records."""
    seconds: float
    parts_s: Dict[str, float]     # PARTS key -> seconds a step
    shares: Dict[str, float]      # PARTS key -> share of the step
    per_record_s: List[float]     # each steady record's time a step (the spread)


@dataclass
class Diff:
    """Two runs compared per step (nt.diff): b against a.

    `ratio` is b's time a step over a's (2.0: b takes twice as long); `decisive` says
    whether the runs' per-record step times put them apart beyond their noise (else
    `noise` says so in words and the ratio means nothing); `cause` is the part of the
    step whose time moved most that way; `split` each part's share of the step in a and
    b; `settings` what differs, resolved first; `modules` and `gaps` what moved, None
    where a run did not measure them.
    """
    ratio: float
    decisive: bool
    cause: str                                   # a PARTS name in words; "" when not decisive
    step_s: Tuple[float, float]
    split: Dict[str, Tuple[float, float]]        # part name -> (share in a, share in b)
    part_s: Dict[str, Tuple[float, float]]       # part name -> (seconds a step in a, in b)
    settings: List[Change]
    modules: Optional[List[Moved]]
    gaps: Optional[List[Moved]]
    records: Tuple[int, int]                     # steady records of a and b
    noise: str = ""
    labels: Tuple[str, str] = ("a", "b")

    @property
    def headline(self) -> str:
        """The first line of text(): the cause in words, or the noise."""
        return _headline(self)

    def text(self) -> str:
        """The cause in words on the first line, then the split, settings, modules, gaps."""
        lines = [self.headline,
                 f"time a step: {_time(self.step_s[0])} -> {_time(self.step_s[1])} "
                 f"(median of {self.records[0]} and {self.records[1]} records after the first)",
                 "time split: " + ", ".join(f"{name} {sa:.0%} -> {sb:.0%}"
                                            for name, (sa, sb) in self.split.items())]
        lines += _settings_lines(self.settings)
        lines.append(_moved_line("modules whose time moved", self.modules))
        lines.append(_moved_line("gaps that grew", self.gaps))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The fields as plain values (lists and dicts), and the headline, for JSON or a table."""
        return {**asdict(self), "headline": self.headline}

    def __repr__(self) -> str:
        return f"<nbtrain.Diff: {self.headline}>"


def diff(a: Run, b: Run, labels: Tuple[str, str] = ("a", "b")) -> Diff:
    """Compare two runs (live, or `nt.load_run(id)`) per step: how much slower or faster
    b is, the part of the step that explains it, and the settings, modules and gaps
    that moved. `labels`: what the text calls the two runs.

    >>> d = nt.diff(run_a, run_b)
    >>> d.ratio          # b's time a step over a's
    >>> print(d.text())  # first line, the cause: "b is 2.3x slower a step: data wait ..."
    """
    step_a, step_b = typical_step(a, labels[0]), typical_step(b, labels[1])
    ratio = step_b.seconds / step_a.seconds if step_a.seconds else float("nan")
    decisive, noise = beyond_noise(step_a.per_record_s, step_b.per_record_s, labels)
    cause = biggest_move(step_a, step_b, ratio) if decisive else ""
    parts = [key for key in PARTS if key in step_a.parts_s and key in step_b.parts_s]
    return Diff(
        ratio=ratio, decisive=decisive, cause=PARTS.get(cause, ""),
        step_s=(step_a.seconds, step_b.seconds),
        split={PARTS[k]: (step_a.shares[k], step_b.shares[k]) for k in parts},
        part_s={PARTS[k]: (step_a.parts_s[k], step_b.parts_s[k]) for k in parts},
        settings=setting_changes(a, b),
        modules=moved(_measured(a, "modules"), _measured(b, "modules")),
        gaps=grew(_measured(a, "gaps"), _measured(b, "gaps")),
        records=(len(step_a.per_record_s), len(step_b.per_record_s)), noise=noise,
        labels=tuple(labels))


# -- a run's typical step ----------------------------------------------------------------------
def steady_records(run, label: str) -> List[dict]:
    """The run's train records after the first (warm-up), or the only one there is."""
    if not isinstance(run, Run):
        raise TypeError(f"nt.diff: {label} must be a Run (what nt.fit or nt.watch returns, or "
                        f"nt.load_run(id) for a stored one); got {type(run).__name__}")
    records = [r for r in run.records("train") if r.get("steps")]
    if not records:
        raise ValueError(f"nt.diff: run {label} ({run.id or run.state}) has no step records "
                         f"to compare: it ended before its first log_every steps - train it "
                         f"longer, or lower TrainConfig.log_every")
    return records[1:] if len(records) > 1 else records


def typical_step(run, label: str = "a") -> Step:
    """Medians over the steady records: the time a step, each part's and its share."""
    records = steady_records(run, label)
    per_record = [r["step_time_s"] for r in records]
    timed = [key for key in PARTS if all(key in r for r in records)]
    parts_s = {key: statistics.median(r[key] for r in records) for key in timed}
    parts_s["rest"] = statistics.median(_rest(r, timed) for r in records)
    shares = {key: statistics.median(r[key] / r["step_time_s"] if r["step_time_s"] else 0.0
                                     for r in records) for key in timed}
    shares["rest"] = statistics.median(
        _rest(r, timed) / r["step_time_s"] if r["step_time_s"] else 0.0 for r in records)
    return Step(statistics.median(per_record), parts_s, shares, per_record)


def _rest(record: dict, timed: List[str]) -> float:
    return max(record["step_time_s"] - sum(record[key] for key in timed), 0.0)


def beyond_noise(a_s: List[float], b_s: List[float], labels=("a", "b")) -> Tuple[bool, str]:
    """Whether b's step times sit apart from a's: the middle halves of their per-record
    times do not overlap (a distribution-free rule: a shared machine's noise is not
    normal). Else the words that say so, with each run's range and no ratio, which
    would read like a result."""
    if min(len(a_s), len(b_s)) < FEWEST_RECORDS:
        return False, (f"too few records to tell {labels[0]} and {labels[1]} apart "
                       f"({len(a_s)} and {len(b_s)} after the first, {FEWEST_RECORDS} each "
                       f"needed): train longer or lower log_every")
    (a_low, a_high), (b_low, b_high) = _middle_half(a_s), _middle_half(b_s)
    if b_low > a_high or b_high < a_low:
        return True, ""
    return False, (f"{labels[1]} and {labels[0]} take the same time a step within the noise: "
                   f"the middle half of {labels[0]}'s records took {_time_range(a_low, a_high)} "
                   f"a step, {labels[1]}'s {_time_range(b_low, b_high)}")


def _middle_half(values: List[float]) -> Tuple[float, float]:
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return quartiles[0], quartiles[2]


def biggest_move(a: Step, b: Step, ratio: float) -> str:
    """The part whose seconds a step moved most the way the whole step moved (grew for a
    slower b, shrank for a faster one): in seconds, since shares trade against each
    other (one part's growth shrinks every other's share)."""
    sign = 1.0 if ratio >= 1 else -1.0
    common = [key for key in a.parts_s if key in b.parts_s]
    return max(common, key=lambda key: sign * (b.parts_s[key] - a.parts_s[key]))


# -- settings, modules, gaps --------------------------------------------------------------------
def setting_changes(a: Run, b: Run) -> List[Change]:
    """The settings whose values differ: those the runs resolved first (what ran), then
    the config fields as given, the ones that change a step's speed before the others."""
    changes = [Change(name, va, vb, True, why) for name, (va, vb, why) in _resolved_pairs(a, b)
               if _plain(va) != _plain(vb)]
    seen = {c.name for c in changes}
    given_a, given_b = a.config.to_dict(), b.config.to_dict()
    given = [Change(name, given_a[name], given_b[name], False) for name in FIELD_NAMES
             if name not in seen and _plain(given_a[name]) != _plain(given_b[name])]
    given.sort(key=lambda c: SETTINGS[c.name].speed is False)   # stable: speed ones first
    return changes + given


def _resolved_pairs(a: Run, b: Run):
    """(name, a's value, b's value, b's reason) of every resolved setting (not the
    measurements that run.resolved also holds, such as peak_tflops)."""
    for name in SETTINGS:
        if name in a.resolved or name in b.resolved:
            va, _ = a.resolved.get(name, (None, ""))
            vb, why = b.resolved.get(name, (None, ""))
            yield name, (va, vb, why)


def _plain(value):
    """A value as a stored run gives it back (JSON: tuples as lists), so a live run and a
    stored one compare equal where they ran the same."""
    return json.loads(json.dumps(value, default=str))


def _measured(run: Run, method: str) -> Optional[Dict[str, float]]:
    """`run.modules()` or `run.gaps()` as {name: seconds}; None where the run has no such
    method or it measured nothing (no rows, or every one zero: a run made of records
    before the method existed), which is not the same as zero."""
    read = getattr(run, method, None)
    rows = read() if callable(read) else None
    if not rows:
        return None
    if not hasattr(rows, "items"):   # a table: rows that name themselves
        rows = {_name_of(row): row for row in rows}
    seconds = {str(name): _seconds(row) for name, row in rows.items() if name not in NOT_GAPS}
    return seconds if any(seconds.values()) else None


def _name_of(row) -> str:
    """A table row's name: run.gaps()'s rows have `part`, run.modules()'s `module` or `name`."""
    names = (_field(row, key) for key in ("part", "module", "name"))
    return next((name for name in names if name is not None), str(row))


def _seconds(row) -> float:
    """A row's time: a number, or a row with `seconds`, or a module's forward_s + backward_s."""
    if isinstance(row, (int, float)):
        return float(row)
    seconds = _field(row, "seconds")
    if seconds is not None:
        return float(seconds)
    return float(_field(row, "forward_s") or 0.0) + float(_field(row, "backward_s") or 0.0)


def _field(row, name: str):
    return row.get(name) if hasattr(row, "get") else getattr(row, name, None)


def moved(a: Optional[dict], b: Optional[dict]) -> Optional[List[Moved]]:
    """The names in both whose time changed, the largest change first; None where either
    run did not measure them."""
    if a is None or b is None:
        return None
    rows = [Moved(name, a[name], b[name]) for name in a if name in b and a[name] != b[name]]
    return sorted(rows, key=lambda m: -abs(m.b_s - m.a_s))[:SHOWN]


def grew(a: Optional[dict], b: Optional[dict]) -> Optional[List[Moved]]:
    """The gaps longer in b (a gap a did not have counts from zero), the most grown first."""
    if a is None or b is None:
        return None
    rows = [Moved(name, a.get(name, 0.0), b[name]) for name in b if b[name] > a.get(name, 0.0)]
    return sorted(rows, key=lambda m: m.a_s - m.b_s)[:SHOWN]


# -- in words ----------------------------------------------------------------------------------
def _headline(d: Diff) -> str:
    """e.g. "b is 2.3x slower a step: data wait 2% -> 61% of the step (0.1 ms -> 24 ms),
    with num_workers 4 -> 0"; within the noise, the words that say so."""
    if not d.decisive:
        return d.noise
    b = d.labels[1]
    factor, how = (d.ratio, "slower") if d.ratio >= 1 else (1 / d.ratio, "faster")
    name = d.cause
    share_a, share_b = d.split[name]
    seconds_a, seconds_b = d.part_s[name]
    line = (f"{b} is {_factor(factor)}x {how} a step: {name} {share_a:.0%} -> {share_b:.0%} "
            f"of the step ({_time(seconds_a)} -> {_time(seconds_b)})")
    telling = _telling_change(d.settings, name)
    return line + (f", with {_change_text(telling)}" if telling else "")


def _telling_change(changes: List[Change], cause: str) -> Optional[Change]:
    """The setting to name beside the cause: the first that differs in the cause's
    groups of settings (the data path's for a data wait), else the first that differs;
    only one that changes a step's speed (a run's name or seed explains no time)."""
    speed = [c for c in changes if SETTINGS[c.name].speed is not False]
    near = [c for c in speed if SETTINGS[c.name].group in CAUSE_GROUPS.get(cause, ())]
    return (near or speed or [None])[0]


def _factor(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


def _time(seconds: float) -> str:
    """Two significant digits, whole milliseconds from 10 ms, seconds from 1 s."""
    ms = seconds * 1e3
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if ms >= 10:
        return f"{ms:.0f} ms"
    return f"{ms:.2g} ms" if ms >= 0.001 else "0 ms"


def _time_range(low: float, high: float) -> str:
    """e.g. "10-12 ms": the unit once where both ends share it."""
    low_text, high_text = _time(low), _time(high)
    unit = " " + high_text.split()[-1]
    return f"{low_text.removesuffix(unit)}-{high_text}"


def _change_text(change: Change) -> str:
    return f"{change.name} {plain(change.a)} -> {plain(change.b)}"


def _settings_lines(changes: List[Change]) -> List[str]:
    if not changes:
        return ["settings: the same"]
    return ["settings that differ (as resolved, then as given):"] + [
        f"  {_change_text(c)}" + (f" ({c.why})" if c.why else "") for c in changes]


def _moved_line(title: str, rows: Optional[List[Moved]]) -> str:
    if rows is None:
        return f"{title}: not measured"
    if not rows:
        return f"{title}: none"
    return f"{title}: " + ", ".join(f"{m.name} {_time(m.a_s)} -> {_time(m.b_s)}" for m in rows)


__all__ = ["diff", "Diff", "Change", "Moved"]
