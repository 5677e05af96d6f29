"""What the charts hold: bounded series of a run's records, the planned LR curve, the
stacked bars of its tables (run.modules(), run.gaps(), run.peak()), and axes fitted to the
values. Plain numpy: no plotly here, so tests and the HTML report use them without a widget."""
from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

MAX_POINTS = 400          # per trace: enough for a smooth curve, small enough to send 4x/s
PREVIEW_EXACT_LIMIT = 200_000   # schedule_preview lists every step; past this we sample

# Tick steps of a log axis, coarsest first: decades, then 1-2-5, then every digit.
LOG_MANTISSAS = ((1,), (1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9))
MIN_LOG_SPAN = 0.7   # decades: 1-2-5 ticks are at most 0.4 apart, so two always fit

# Columns kept from each train record; "compute_s" may be derived (see `train_row`).
TRAIN_FIELDS = ("step", "samples_per_s", "data_wait_s", "copy_s", "compute_s", "rss_mb",
                "cuda_allocated_mb", "cuda_reserved_mb", "nvml_used_mb", "lr", "loss")
VAL_FIELDS = ("step", "val_loss")

TOP_MODULES = 8   # bars of the modules chart: the layers that take the step, each readable
TOP_PARTS = 7     # segments of the peak's bar; the parts after them are one, "the rest"
MB = 2 ** 20      # as the records' *_mb fields (telemetry/sampling.py)


def number(value) -> float:
    """A record value as a float; anything missing or not a number becomes NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


# -- bounded buffers --------------------------------------------------------------------------
class Decimated:
    """Rows of floats, never more than `max_points`, evenly spaced over the whole run.

    When full, every other row is dropped and from then on only every `stride`-th new
    row is kept: O(1) per row, bounded memory, and the spacing stays even. The newest
    row is kept apart, so a chart always ends where training is.

    >>> buf = Decimated(("step", "loss"), max_points=4)
    >>> for s in range(1, 11): buf.add((s, 1.0 / s))
    >>> buf.columns()["step"].tolist()
    [1.0, 5.0, 9.0, 10.0]
    """

    def __init__(self, fields: Tuple[str, ...], max_points: int = MAX_POINTS):
        if max_points < 2:
            raise ValueError(f"max_points must be >= 2 (a line needs two points); got {max_points}.")
        self.fields = fields
        self.max_points = max_points
        self.rows: List[tuple] = []
        self.stride = 1
        self.seen = 0
        self.last: Optional[tuple] = None

    def add(self, row: tuple) -> None:
        if self.seen % self.stride == 0:
            self.rows.append(row)
            if len(self.rows) >= self.max_points:   # leave room for the newest row
                self.rows = self.rows[::2]
                self.stride *= 2
        self.seen += 1
        self.last = row

    def columns(self) -> Dict[str, np.ndarray]:
        rows = self.rows if not self.rows or self.rows[-1] is self.last else self.rows + [self.last]
        table = np.array(rows, dtype=np.float64).reshape(len(rows), len(self.fields))
        return {name: table[:, i] for i, name in enumerate(self.fields)}

    def __len__(self) -> int:
        return len(self.rows) + (self.last is not None and (not self.rows or self.rows[-1] is not self.last))


def train_row(record: dict) -> tuple:
    values = {name: number(record.get(name)) for name in TRAIN_FIELDS}
    if math.isnan(values["compute_s"]) and not math.isnan(number(record.get("step_time_s"))):
        # Engines before the copy/compute split: the rest of the step is compute (+ copy).
        copy = 0.0 if math.isnan(values["copy_s"]) else values["copy_s"]
        wait = 0.0 if math.isnan(values["data_wait_s"]) else values["data_wait_s"]
        values["compute_s"] = max(record["step_time_s"] - wait - copy, 0.0)
    return tuple(values[name] for name in TRAIN_FIELDS)


# -- stacked bars of a run's tables ---------------------------------------------------------------
class Stack(NamedTuple):
    """Stacked bars, segment by segment: segment i is `size[i]` long from `base[i]` on the
    bar named `bar[i]`; it is `part[i]` and is shaded as a `kind[i]`. No segments: `note`
    says why (the table's note).

    >>> bars = gap_stack([{"part": "steps", "seconds": 3.0}, {"part": "saving", "seconds": 1.0}],
    ...                  "run 1")
    >>> bars.bar, bars.part, bars.base
    (('run 1', 'run 1'), ('steps', 'saving'), (0.0, 3.0))
    """
    bar: Tuple[str, ...] = ()
    part: Tuple[str, ...] = ()
    kind: Tuple[str, ...] = ()
    size: Tuple[float, ...] = ()
    base: Tuple[float, ...] = ()
    note: str = ""


def _stacked(bar: str, parts: List[Tuple[str, str, float]]) -> Stack:
    """One bar of (part, kind, size) segments, each on the ones before it."""
    sizes = [size for _, _, size in parts]
    bases = np.concatenate([[0.0], np.cumsum(sizes)[:-1]]) if parts else ()
    return Stack((bar,) * len(parts), tuple(p for p, _, _ in parts), tuple(k for _, k, _ in parts),
                 tuple(sizes), tuple(float(b) for b in bases))


def module_stack(table) -> Stack:
    """run.modules()' top rows: a bar per module (as named_modules() names it; the model
    itself "(the model)"), its forward in ms a step, its backward stacked on it."""
    rows = list(table)[:TOP_MODULES]
    names = tuple(row.name or "(the model)" for row in rows)
    forward = tuple(row.forward_s * 1e3 for row in rows)
    n = len(rows)
    return Stack(names * 2, ("forward",) * n + ("backward",) * n,
                 ("forward",) * n + ("backward",) * n,
                 forward + tuple(row.backward_s * 1e3 for row in rows), (0.0,) * n + forward,
                 "" if rows else table.note)


def gap_stack(rows: List[dict], bar: str) -> Stack:
    """run.gaps() as one bar, in seconds: the steps, then each part between them."""
    return _stacked(bar, [(row["part"], row["part"], row["seconds"]) for row in rows])


def peak_stack(peak, bar: str) -> Stack:
    """run.peak() as one bar, in MB: its largest parts (a module's saved activations
    named by the module), the others summed as "the rest"; parts of no bytes left out."""
    parts = [(p.part or "(the model)", p.kind, p.bytes / MB) for p in peak.parts if p.bytes]
    rest = sum(size for _, _, size in parts[TOP_PARTS:])
    parts = parts[:TOP_PARTS] + ([("the rest", "other", rest)] if rest else [])
    return _stacked(bar, parts)._replace(note="" if parts else peak.parts.note)


def planned_lr(config, total_steps: int, max_points: int = MAX_POINTS,
               schedule=None, from_step: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """(steps, lrs): the LR each optimizer step applies, at most about `max_points` of them.

    Steps are counted like records' `step` (1 after the first step), so planned and
    actual LR line up. `schedule` (a run's live Schedule) gives the LR after a live
    `set_lr`; without it, `schedule_preview` plans from the config alone.
    """
    from ..train.schedule import schedule_preview
    if total_steps <= from_step:
        return np.empty(0), np.empty(0)
    picks = np.unique(np.linspace(from_step, total_steps - 1, max_points).round().astype(np.int64))
    if schedule is not None:
        lrs = [schedule.lr(int(i)) for i in picks]
    elif total_steps <= PREVIEW_EXACT_LIMIT:
        lrs = np.asarray(schedule_preview(config, total_steps), dtype=np.float64)[picks]
    else:   # a million-step preview is a second of pure Python: sample the same curve
        from ..train.schedule import Schedule
        lrs = [Schedule(config, total_steps).lr(int(i)) for i in picks]
    return picks.astype(np.float64) + 1.0, np.asarray(lrs, dtype=np.float64)


def log_axis(values) -> Optional[dict]:
    """A log axis fitted to `values` (their positive, finite part), with clean ticks.

    Plotly's own log ticks on a short axis label every digit ("5 2 1 0.5 ...") and a
    fixed tick list stretches the axis past the data; this gives the range in log10
    units, a little padded, and the coarsest ticks that put two or more labels on it:
    decades (0.01, 0.1, 1) where the data spans them, else 1-2-5 steps.

    >>> log_axis([0.02, 2.3])["ticktext"]
    ['0.1', '1']
    """
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v) & (v > 0)]
    if not v.size:
        return None
    lo, hi = math.log10(v.min()), math.log10(v.max())
    pad = max(0.05 * (hi - lo), (MIN_LOG_SPAN - (hi - lo)) / 2, 0.0)
    lo, hi = lo - pad, hi + pad
    for mantissas in LOG_MANTISSAS:
        ticks = [m * 10.0 ** e for e in range(math.floor(lo), math.ceil(hi) + 1)
                 for m in mantissas if lo <= math.log10(m) + e <= hi]
        if len(ticks) >= 2:
            break
    return dict(type="log", range=[lo, hi], autorange=False, tickmode="array",
                tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])


def linear_axis(values) -> Optional[dict]:
    """A linear axis fitted to `values` (their finite part), padded by a tenth of their
    span, or of their size when they are all one value (a constant LR), with tick labels
    that keep small numbers readable (1e-3, not 0).

    >>> linear_axis([1e-3, 1e-3])["range"]
    [0.0009, 0.0011]
    """
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if not v.size:
        return None
    lo, hi = float(v.min()), float(v.max())
    pad = 0.1 * ((hi - lo) or abs(hi) or 1.0)
    return dict(type="linear", range=[round(lo - pad, 15), round(hi + pad, 15)],
                autorange=False, tickformat="~g", exponentformat="e")
