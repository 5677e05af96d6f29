"""Live charts of training runs: throughput, step-time split, memory, LR and loss, and
beside them bars of where the time and memory go (run.gaps(), run.peak(), run.modules()).

    run = nt.fit(model, (x, y), loss_fn, config=cfg, background=True)
    nt.Dashboard(run)          # in a notebook: eight live charts and a runs table

Three parts, so that a slow chart can never slow the loop:

- the training thread only appends each record to an inbox (a deque: no lock, no wait);
- `RedrawThrottle` decides *when* to redraw: at most every `interval` seconds while records
  arrive, and at once when a run ends, so its final state is always drawn;
- `PlotlyRenderer` decides *how*: one FigureWidget, every change in one `batch_update`.

The drawing thread drains the inbox into `Decimated` buffers (a fixed number of points
per run, however long it trains) under the one lock that also guards the figure, and reads
each changed run's tables once (`Slot.read_tables`) for its bars and its row of the table.
"""
from __future__ import annotations

import html
import importlib.util
import json
import math
import os
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..auto import frameworks
from ..kinds import text_of
from ..tables import formatted
from ..telemetry.gaps import between_words
from .plotly_renderer import (
    UNCHANGED,
    PlotlyRenderer,
    require_plotly_widgets,
)
from .series import (
    MAX_POINTS,
    TRAIN_FIELDS,
    VAL_FIELDS,
    Decimated,
    Stack,
    gap_stack,
    module_stack,
    number,
    peak_stack,
    planned_lr,
    train_row,
)
from .throttle import INTERVAL_S, RedrawThrottle

# Fail at import, cheaply (no plotly import yet), when a package is missing: callers such
# as `%%fasttrain --dashboard` then fall back to the progress bar on ImportError.
_MISSING = [name for name in ("plotly", "anywidget", "ipywidgets")
            if importlib.util.find_spec(name) is None]
if _MISSING:
    raise ImportError(f"nbtrain's live dashboard needs {', '.join(_MISSING)}: "
                      "pip install 'nbtrain[notebook]' (or: pip install 'plotly>=6' anywidget "
                      "'ipywidgets>=8').")

STATIC_INTERVAL_S = 2.0   # live="static" resends the whole figure (~300 kB at 400 points/trace)
LIVE_MODES = ("auto", "widget", "static")

# Colors of runs 1, 2, 3, ... (plotly's default qualitative palette).
PALETTE = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692",
           "#b6e880", "#ff97ff", "#fecb52")




# -- one run on the charts --------------------------------------------------------------------
@dataclass
class Slot:
    """A run on the charts: its buffers, its color, and the totals of the runs table."""
    label: str
    color: str
    run: object
    train: Decimated
    val: Decimated
    planned: Tuple[np.ndarray, np.ndarray] = (np.empty(0), np.empty(0))
    last_step: Dict[str, int] = field(default_factory=lambda: {"train": -1, "val": -1})
    subscriber: Optional[Callable] = None
    ended: bool = False
    dirty: bool = True                 # something to redraw
    planned_dirty: bool = True         # the planned LR too (it changes rarely)
    samples: float = 0.0
    busy_s: float = 0.0
    peak_rss_mb: float = math.nan
    peak_cuda_mb: float = math.nan
    last_train: Optional[dict] = None
    last_val: Optional[dict] = None
    window_due: bool = True            # run.modules() and run.peak() to read again
    modules: Optional[object] = None   # the tables as last read (read_tables)
    peak: Optional[object] = None
    gaps: List[dict] = field(default_factory=list)

    def take(self, record: dict) -> None:
        """Fold one record in; records already seen (a resumed run's copied history) are skipped."""
        kind = record.get("kind")
        if kind == "modules":   # a window measured (or failed): run.modules() and peak() changed
            self.window_due = self.dirty = True
            return
        if kind == "end":   # the tables' note ("not measured yet") changes with it too
            self.ended = self.window_due = self.dirty = True
            return
        if kind not in self.last_step or record.get("step", -1) <= self.last_step[kind]:
            return
        self.last_step[kind] = record["step"]
        self.dirty = True
        if kind == "val":
            self.val.add((number(record["step"]), number(record.get("val_loss"))))
            self.last_val = record
            return
        self.train.add(train_row(record))
        self.last_train = record
        self.samples += number(record.get("samples", 0))
        self.busy_s += number(record.get("interval_s", 0))
        self.peak_rss_mb = np.fmax(self.peak_rss_mb, number(record.get("peak_rss_mb")))
        self.peak_cuda_mb = np.fmax(self.peak_cuda_mb, number(record.get("cuda_peak_allocated_mb")))

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.busy_s if self.busy_s > 0 else math.nan

    def arrays(self) -> Dict[Tuple[str, str], Tuple[np.ndarray, np.ndarray]]:
        """(buffer, column) -> (x, y) of every series to redraw that has a real value."""
        out = {("planned", "lr"): self.planned} if self.planned_dirty else {}
        for name, buf in (("train", self.train), ("val", self.val)):
            if not len(buf):
                continue
            cols = buf.columns()
            for column in buf.fields[1:]:
                y = cols[column]
                if np.isfinite(y).any():
                    out[(name, column)] = (cols["step"], y)
        return out

    def read_tables(self) -> None:
        """Read the run's tables, each once: run.gaps() at every redraw of the run (its
        clock runs), run.modules() and run.peak() only when a window's record or the end
        came (nothing else changes them; they scan the history). The bars and the runs
        table draw from what was read. A Run from elsewhere may have none of them."""
        run = self.run
        if self.window_due and hasattr(run, "modules"):
            self.modules, self.peak = run.modules(), run.peak()
        self.window_due = False
        gaps = getattr(run, "gaps", None)
        self.gaps = gaps() if gaps else []

    def stacks(self) -> Dict[str, Stack]:
        """The bars of the tables read: chart -> Stack."""
        out = {"gaps": gap_stack(self.gaps, self.label)} if self.gaps else {}
        if self.modules is not None:
            out["modules"] = module_stack(self.modules)
            out["peak"] = peak_stack(self.peak, self.label)
        return out


# -- the dashboard --------------------------------------------------------------------------
class Dashboard:
    """Live charts of one or more Runs and a table with a row per run.

    >>> run = nt.fit(model, (x, y), loss_fn, config=cfg, background=True)
    >>> dash = nt.Dashboard(run)        # shows itself in a notebook, as a tqdm bar does
    >>> dash.add(other_run)             # a second run, side by side

    Also `nt.fit(..., progress=nt.Dashboard)`: the charts of a blocking fit.
    Beside the step time, the memory and the loss stand bars of each run's tables: its
    wall time by part (run.gaps()), its memory peak's parts (run.peak()) and its top
    modules' forward and backward (run.modules()), or a note of why there are none yet.
    Updates are throttled (`interval` seconds), batched, and bounded (`max_points` per
    trace); training never waits for a chart. In a script nothing is shown and nothing
    waits; the text repr is stable.

    `live`: "widget", a FigureWidget updated in place (JupyterLab, Notebook, VS Code);
    "static", a plain Plotly figure and table re-shown through display handles every
    `interval` (2 s) and at the end, so the notebook file holds the last picture and any
    front end that renders Plotly shows it (nbconvert, nbviewer, Colab); "auto" picks
    static where no widget front end can be assumed (see `auto_live`).
    """

    def __init__(self, *runs, max_points: int = MAX_POINTS, interval: Optional[float] = None,
                 height: int = 760, show: bool = True, live: str = "auto",
                 stop_button: bool = True):
        ipywidgets, _, _ = require_plotly_widgets()
        self.live = _checked_live(live)
        self.max_points = max_points
        self.renderer = PlotlyRenderer(height, widget=self.live == "widget")
        self.table = ipywidgets.HTML(value=_table_html([]))
        self.stop_button = None
        self.widget = None
        if self.live == "widget":
            parts = [self.renderer.figure, self.table]
            if stop_button:   # a Panel has its own
                from .stop_button import StopButton
                self.stop_button = StopButton(self.stop)
                parts.insert(0, self.stop_button)
            self.widget = ipywidgets.VBox(parts)
        self.handles = None   # live="static": the display handles of the figure and the table
        if interval is None:
            interval = INTERVAL_S if self.live == "widget" else STATIC_INTERVAL_S
        self.slots: List[Slot] = []
        self._inbox: deque = deque()
        self._preview = UNCHANGED   # the next Train's planned LR, until drawn
        self._after_draw: List[Callable[[], None]] = []
        self._shown = False
        self.reporter = RedrawThrottle(self._draw, self._active, interval)
        for run in runs:
            self.add(run)
        if runs and show:
            self._show_in_notebook()

    # -- public ------------------------------------------------------------------------------
    @property
    def figure(self):
        """The plotly FigureWidget (traces are named by run; see `trace`)."""
        return self.renderer.figure

    @property
    def lock(self) -> threading.RLock:
        return self.reporter.lock

    def add(self, run, label: Optional[str] = None, continues=None) -> Slot:
        """Chart `run` from now on (and what it already recorded); returns its Slot.

        `continues`: a Run that `run` resumes; it keeps that run's line, color and row.
        """
        with self.lock:
            slot = self._slot_for(run, label, continues)
            slot.subscriber = run.subscribe(partial(self._receive, slot, run))
            # Subscribed first, then the history: a record in both is dropped by step.
            for record in list(run.history):
                slot.take(record)
            slot.planned, slot.planned_dirty = self._planned_of(run), True
            if run.state not in ("created", "running"):   # ended before we subscribed
                self._receive(slot, run, {"kind": "end", "state": run.state})
            self.reporter.watch()
        self.flush()
        return slot

    def preview(self, config, total_steps: Optional[int]) -> None:
        """Show the LR a run with `config` would follow (None hides it); drawn at once."""
        with self.lock:
            self._preview = planned_lr(config, total_steps, self.max_points) if total_steps \
                else None
            self.flush()

    def replan(self, run) -> None:
        """After `run.set_lr`: the planned LR from the run's next step on follows the new LR."""
        with self.lock:
            slot = self.slot_of(run)
            if slot is None or run.schedule is None:
                return
            x, y = slot.planned
            keep = x <= run.step
            new_x, new_y = planned_lr(run.config, run.total_steps, self.max_points,
                                      schedule=run.schedule, from_step=run.step)
            slot.planned = (np.concatenate([x[keep], new_x]), np.concatenate([y[keep], new_y]))
            slot.dirty = slot.planned_dirty = True
            self.flush()

    def stop(self) -> None:
        """Stop every run it shows that is running, at its next step boundary."""
        for slot in self.slots:
            if slot.run.running:
                slot.run.stop()

    def flush(self) -> None:
        """Draw everything received so far, now, in this thread."""
        self.reporter.flush()

    def after_draw(self, fn: Callable[[], None]) -> None:
        """Call `fn()` after each draw (in the drawing thread, holding the lock)."""
        self._after_draw.append(fn)

    def slot_of(self, run) -> Optional[Slot]:
        return next((s for s in self.slots if s.run is run), None)

    def trace(self, label: str, column: str, buffer: str = "train"):
        """The trace of `column` (e.g. "samples_per_s", "rss_mb", "lr") for run `label`."""
        return self.renderer.traces.get((label, buffer, column))

    def close(self) -> None:
        """Stop listening to every run and end the drawing thread."""
        with self.lock:
            for slot in self.slots:
                if slot.subscriber is not None:
                    slot.run.unsubscribe(slot.subscriber)
        self.reporter.close()

    def text(self) -> str:
        """A stable description (no ids, no timings), used as the text repr for nbval."""
        lines = [f"nbtrain.Dashboard: {len(self.slots)} run(s)"]
        lines += [f"  {s.label}: {_settings_text(s.run)}" for s in self.slots]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_mimebundle_(self, include=None, exclude=None):
        if self._shown or self.widget is None:   # shown already, or shown through handles
            return {"text/plain": self.text()}
        bundle = self.widget._repr_mimebundle_(include=include, exclude=exclude) or {}
        bundle["text/plain"] = self.text()
        return bundle

    # -- inside ------------------------------------------------------------------------------
    def _receive(self, slot: Slot, run, record: dict) -> None:
        """In the training thread: append and poke, nothing else (no lock, no drawing)."""
        self._inbox.append((slot, run, record))
        end = record.get("kind") == "end"
        if end and self.stop_button is not None and not any(
                s.run.running for s in self.slots if s.run is not run):
            self.stop_button.ended()
        if end and self.handles is not None:
            # The last picture before fit returns: a headless executor (nbconvert) stops
            # listening when the cell ends, and the notebook must keep the final charts.
            self.flush()
        self.reporter.poke(urgent=end)

    def _slot_for(self, run, label, continues) -> Slot:
        old = self.slot_of(continues) if continues is not None else None
        if old is not None:
            if old.subscriber is not None:
                old.run.unsubscribe(old.subscriber)
            old.run, old.ended, old.dirty, old.window_due = run, False, True, True
            return old
        n = len(self.slots)
        slot = Slot(label or f"run {n + 1}", PALETTE[n % len(PALETTE)], run,
                    Decimated(TRAIN_FIELDS, self.max_points), Decimated(VAL_FIELDS, self.max_points))
        self.slots.append(slot)
        return slot

    def _planned_of(self, run) -> Tuple[np.ndarray, np.ndarray]:
        if not run.total_steps:
            return np.empty(0), np.empty(0)
        schedule = run.schedule if run.schedule is not None and \
            run.schedule.base_lr != run.config.lr else None
        return planned_lr(run.config, run.total_steps, self.max_points, schedule=schedule)

    def _active(self) -> bool:
        return any(not s.ended for s in self.slots) or bool(self._inbox)

    def _draw(self) -> None:
        """Drain the inbox, then redraw the runs that changed (called holding the lock)."""
        while self._inbox:
            slot, run, record = self._inbox.popleft()
            if slot.run is run:   # not the late "end" of a run that was since resumed
                slot.take(record)
        changed = [s for s in self.slots if s.dirty]
        for slot in changed:
            slot.read_tables()
        self.renderer.draw(changed, self._preview)
        self._preview = UNCHANGED
        if changed:
            self.table.value = _table_html(self.slots)
            self._update_handles()
        for slot in changed:
            slot.dirty = slot.planned_dirty = False
        if self.stop_button is not None:
            self.stop_button.update(s.run for s in self.slots)
        for fn in self._after_draw:
            fn()

    def _show_in_notebook(self) -> None:
        """Display once, as a tqdm bar does, so `progress=nt.Dashboard` shows up in a blocking fit."""
        if not _in_kernel():
            return
        from IPython.display import display
        if self.live == "static":
            self.handles = (display(self._figure_bundle(), raw=True, display_id=True),
                            display(self._table_bundle(), raw=True, display_id=True))
        else:
            display(self)
        self._shown = True

    # -- inside: live="static" -------------------------------------------------------------------
    def _figure_bundle(self) -> dict:
        """The figure as Plotly JSON (JupyterLab, nbviewer, VS Code render it) and as HTML
        that loads plotly.js from its CDN (Colab, front ends without the Plotly renderer)."""
        import plotly.io as pio
        figure = self.renderer.figure
        return {"application/vnd.plotly.v1+json": json.loads(pio.to_json(figure, validate=False)),
                "text/html": pio.to_html(figure, include_plotlyjs="cdn", full_html=False),
                "text/plain": self.text()}

    def _table_bundle(self) -> dict:
        return {"text/html": self.table.value, "text/plain": self.text()}

    def _update_handles(self) -> None:
        if self.handles is not None:
            figure, table = self.handles
            figure.update(self._figure_bundle(), raw=True)
            table.update(self._table_bundle(), raw=True)


# -- which live mode ---------------------------------------------------------------------------
def _checked_live(live: str) -> str:
    if live not in LIVE_MODES:
        raise ValueError(f"Dashboard(live={live!r}): expected one of {', '.join(LIVE_MODES)}.")
    return auto_live() if live == "auto" else live


def _in_kernel() -> bool:
    """In a notebook kernel (not a script, not a terminal IPython)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return hasattr(get_ipython(), "kernel")


def auto_live() -> str:
    """"static" where no front end that renders live widgets can be assumed, else "widget".

    Jupyter Server (JupyterLab, Notebook 7) starts each session's kernel with
    JPY_SESSION_NAME in its environment (jupyter_server/services/sessions/sessionmanager.py)
    and VS Code's kernels inherit VSCODE_PID; nbconvert, nbclient, nbval and papermill start
    theirs with neither, and there a widget is saved as a reference to state that no
    reader has. Colab draws widgets only after `output.enable_custom_widget_manager()`,
    which a kernel cannot see. Outside a kernel (a script) nothing is shown: "widget".
    """
    if not _in_kernel():
        return "widget"
    if "google.colab" in sys.modules:
        return "static"
    return "widget" if {"JPY_SESSION_NAME", "VSCODE_PID"} & set(os.environ) else "static"


# -- the runs table -------------------------------------------------------------------------
def _settings_text(run) -> str:
    """The settings that matter for speed, as resolved when known, else as configured."""
    cfg = run.config
    got = {name: value for name, (value, _) in getattr(run, "resolved", {}).items()}

    def pick(name):
        return got.get(name, getattr(cfg, name))

    if frameworks.watched(getattr(run, "resolved", {})):
        # nt.watch: batch, optimizer and LR are the loop's (the user's, a framework's)
        opt = getattr(run, "optimizer", None)
        lr = f" lr={opt.param_groups[0]['lr']:g}" if opt is not None else ""
        loop = "your loop" if got["loop"] == frameworks.OWN else got["loop"]
        return (f"{loop}: amp={pick('amp')} batched_fetch={pick('batched_fetch')} "
                f"{type(opt).__name__ if opt is not None else ''}{lr} "
                f"{pick('optimizer_impl') if 'optimizer_impl' in got else ''}").rstrip()
    sched = text_of(cfg.scheduler) + (f"+warmup {cfg.warmup_steps}" if cfg.warmup_steps else "")
    return (f"amp={pick('amp')} workers={pick('num_workers')} pin={pick('pin_memory')} "
            f"on_device={pick('data_on_device')} batch={cfg.batch_size} "
            f"{text_of(cfg.optimizer)} lr={cfg.lr:g} {sched}")


def _table_row(slot: Slot) -> List[str]:
    run = slot.run
    total = run.total_steps if run.total_steps is not None else "?"
    cuda = math.isfinite(slot.peak_cuda_mb)
    peak = formatted(slot.peak_cuda_mb if cuda else slot.peak_rss_mb, ",.0f")
    peak += " (CUDA)" if cuda else (" (RSS)" if peak != "-" else "")
    last, val = slot.last_train or {}, slot.last_val or {}
    return [f'<span style="color:{slot.color}">&#9632;</span>&nbsp;{html.escape(slot.label)}',
            html.escape(_settings_text(run)), html.escape(run.state), f"{run.step}/{total}",
            formatted(slot.samples_per_s, ",.0f"), formatted(last.get("mfu"), ".1%"),   # flops.py
            peak, formatted(last.get("loss"), ".4g"),
            formatted(val.get("val_loss"), ".4g"), formatted(val.get("val_acc"), ".1%"),
            html.escape(_between_words(run, slot.gaps)),
            html.escape(_where_words(slot.modules, slot.peak))]


TABLE_HEAD = ("run", "settings", "state", "steps", "samples/s", "MFU", "peak memory MB",
              "final loss", "val loss", "val acc", "between steps", "slowest layer, peak")


def _between_text(run) -> str:
    """run.gaps() in a cell, read now ("-" for a Run from elsewhere, which may have none)."""
    gaps = getattr(run, "gaps", None)
    return _between_words(run, gaps()) if gaps else "-"


def _between_words(run, rows: List[dict]) -> str:
    """The gaps' `rows` of `run` in words: the parts between steps, largest first."""
    if not rows:
        return "-"
    framework = frameworks.framework_of(getattr(run, "resolved", {}))
    return between_words(rows, framework.name if framework else "")


def _where_text(run) -> str:
    """run.modules() and run.peak() in a cell, read now ("-" for a Run from elsewhere)."""
    if not hasattr(run, "modules"):
        return "-"
    return _where_words(run.modules(), run.peak())


def _where_words(modules, peak) -> str:
    """The slowest layer and the peak's largest part, once a window measured them; "-"
    before (or with no tables read)."""
    if not modules:
        return "-"
    rows = list(modules)
    top = peak.parts[0] if peak.parts else None
    held = f"; peak {top.part}'s {top.kind} {top.bytes / 2**20:.1f} MiB" \
        if top is not None and top.kind == "activations" else \
        (f"; peak {top.kind} {top.bytes / 2**20:.1f} MiB" if top is not None else "")
    return f"layer {rows[0].name or '(the model)'} {rows[0].share:.0%} of the modules' time{held}"


def _table_html(slots: List[Slot]) -> str:
    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{h}</th>" for h in TABLE_HEAD)
    cell = "<td style='padding:2px 8px;white-space:nowrap'>{}</td>"
    wrap = "<td style='padding:2px 8px;max-width:26em'>{}</td>"   # the settings column
    rows = "".join("<tr>" + "".join((wrap if i == 1 else cell).format(c)
                                    for i, c in enumerate(_table_row(s))) + "</tr>" for s in slots)
    body = rows or f"<tr><td colspan={len(TABLE_HEAD)} style='padding:2px 8px;color:#888'>" \
                   "no runs yet</td></tr>"
    return (f"<table class='nbtrain-runs' style='border-collapse:collapse;font-size:12px'>"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
