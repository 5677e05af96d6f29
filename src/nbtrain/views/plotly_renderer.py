"""How to draw a Dashboard's charts: one Plotly FigureWidget (or a static figure), its traces
updated in place from the Slots' series."""
from __future__ import annotations

import copy
import html
import textwrap
from typing import TYPE_CHECKING, Dict, List, Tuple

import numpy as np

from .series import (
    Stack,
    linear_axis,
    log_axis,
)

if TYPE_CHECKING:
    from .dashboard import Slot

# The charts, in the order of the grid: name -> (row, col, title). The bars of a run's
# tables stand beside the chart they explain: the wall time beside the step's time, the
# peak's parts beside the memory, the modules beside the loss.
CHARTS = {
    "throughput": (1, 1, "Throughput (samples/s)"),
    "split": (1, 2, "Step time (s): data wait / copy / compute, stacked"),
    "gaps": (1, 3, "Wall time (s): steps, between them"),
    "lr": (2, 1, "Learning rate: planned dashed, actual solid"),
    "memory": (2, 2, "Memory (MB): RSS solid, CUDA alloc dash / reserved dot, NVML dashdot"),
    "peak": (2, 3, "Memory peak (MB): its parts"),
    "loss": (3, 1, "Loss: train line, validation markers"),
    "modules": (3, 2, "Modules (ms a step): the top 8, forward dark, backward light"),
}
GRID = dict(rows=3, cols=3, column_widths=[0.4, 0.4, 0.2],
            specs=[[{}, {}, {}], [{}, {}, {}], [{}, {"colspan": 2}, None]])
# What is drawn for each run: (buffer, column, chart, label, style). A series whose
# record field never arrives (e.g. CUDA memory on a CPU run) gets no trace at all.
SERIES = (
    ("planned", "lr", "lr", "planned LR", dict(line=dict(dash="dash", width=1.2))),
    ("train", "samples_per_s", "throughput", "samples/s", {}),
    ("train", "data_wait_s", "split", "data wait", dict(stackgroup="split", fill_alpha=0.9)),
    ("train", "copy_s", "split", "copy", dict(stackgroup="split", fill_alpha=0.55)),
    ("train", "compute_s", "split", "compute", dict(stackgroup="split", fill_alpha=0.25)),
    ("train", "rss_mb", "memory", "process RSS", {}),
    ("train", "cuda_allocated_mb", "memory", "CUDA allocated", dict(line=dict(dash="dash"))),
    ("train", "cuda_reserved_mb", "memory", "CUDA reserved", dict(line=dict(dash="dot"))),
    ("train", "nvml_used_mb", "memory", "NVML used", dict(line=dict(dash="dashdot"))),
    ("train", "lr", "lr", "actual LR", {}),
    ("train", "loss", "loss", "train loss", {}),
    ("val", "val_loss", "loss", "validation loss", dict(mode="lines+markers",
                                                        line=dict(dash="dot"))),
)
# The bar charts of a run's tables (series.Stack): how the bars stand, the unit of their
# length, where a run's bars go, and the corner of a note beside bars. The modules' bars
# of each run stand side by side (offsetgroup: the run); the wall time and the peak are
# one bar a run (one offsetgroup, so a run's bar is not squeezed beside the others' empty
# places). A note goes where the bars leave room: below the smallest modules, above a bar.
BARS = {
    "modules": dict(orientation="h", unit="ms a step", by_run=True,
                    corner=dict(x=1, y=0, xanchor="right", yanchor="bottom"), note_width=100),
    "gaps": dict(orientation="v", unit="s", by_run=False,
                 corner=dict(x=1, y=1, xanchor="right", yanchor="top"), note_width=30),
    "peak": dict(orientation="v", unit="MB", by_run=False,
                 corner=dict(x=1, y=1, xanchor="right", yanchor="top"), note_width=30),
}
CENTER = dict(x=0.5, y=0.5, xanchor="center", yanchor="middle")   # a note in an empty chart
# How dark a segment is, in its run's color (as the step time's parts): the largest kinds
# dark, the small ones light; segments of one kind are parted by white lines.
SHADES = {"forward": 0.85, "backward": 0.4,
          "steps": 0.85, "evaluation": 0.6, "saving": 0.45, "loader start": 0.3, "your code": 0.15,
          "activations": 0.8, "parameters": 0.55, "gradients": 0.4, "optimizer state": 0.28,
          "other": 0.15}
SHORT_NAME = 16   # characters of a module's name on the axis (the hover has all of it)

# -- how to draw ------------------------------------------------------------------------------
UNCHANGED = object()   # draw(preview=UNCHANGED): leave the preview line as it is
def require_plotly_widgets():
    """plotly's FigureWidget (anywidget-based from plotly 6) and ipywidgets, or a clear fix."""
    try:
        import ipywidgets
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
        go.FigureWidget   # plotly >= 6 raises here when anywidget is missing
    except ImportError as exc:
        raise ImportError(f"nbtrain's live dashboard needs plotly, anywidget and ipywidgets "
                          f"({exc}). Install them with: pip install 'nbtrain[notebook]' "
                          "(or: pip install 'plotly>=6' anywidget 'ipywidgets>=8').") from None
    return ipywidgets, go, make_subplots




def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def _short(name: str) -> str:
    """A module's name that fits the axis: its end, where the layer is named."""
    return name if len(name) <= SHORT_NAME else "\u2026" + name[-(SHORT_NAME - 1):]


def _layers(stack: Stack) -> List[List[int]]:
    """The segments' indices by layer: each bar's first segment, then each one's second, ..."""
    layers: List[List[int]] = []
    counts: Dict[str, int] = {}
    for i, bar in enumerate(stack.bar):
        j = counts[bar] = counts.get(bar, -1) + 1
        if j == len(layers):
            layers.append([])
        layers[j].append(i)
    return layers


def _segment_name(stack: Stack, i: int, spec: dict) -> str:
    """What a segment is: "blocks.3.attn forward", "saving", "0 activations"."""
    part, kind = stack.part[i], stack.kind[i]
    if spec["by_run"]:
        return f"{stack.bar[i]} {part}"
    return part if part == kind or kind == "other" else f"{part} {kind}"


def _segment_words(stack: Stack, i: int, spec: dict) -> str:
    """A segment in the hover: "blocks.3.attn forward: 1.2 ms a step", "saving: 0.4 s"."""
    return f"{html.escape(_segment_name(stack, i, spec))}: {stack.size[i]:.3g} {spec['unit']}"


class PlotlyRenderer:
    """How to draw: one figure with eight charts, a trace per (run, series) and a bar
    trace per (run, table).

    A trace is made the first time its series has data; after that each draw only sets
    x and y of the traces of runs that changed, in one `batch_update` (one message).
    `widget=False`: a plain Figure with lists for x and y, to be shown as Plotly JSON
    (numpy arrays would be written as base64 that older plotly.js cannot read).
    """

    def __init__(self, height: int = 760, widget: bool = True):
        _, go, make_subplots = require_plotly_widgets()
        self.widget = widget
        self._go = go
        grid = make_subplots(**GRID, subplot_titles=[title for _, _, title in CHARTS.values()],
                             vertical_spacing=0.1, horizontal_spacing=0.07)
        grid.update_layout(height=height, autosize=True, margin=dict(l=50, r=20, t=40, b=40),
                           template="plotly_white", hovermode="x unified",
                           legend=dict(orientation="h", y=-0.06), uirevision="nbtrain",
                           uniformtext=dict(minsize=8, mode="hide"))   # no text past a segment
        grid.update_annotations(font_size=11)
        grid.update_yaxes(type="log", row=3, col=1)   # losses span decades: see log_axis
        grid.update_xaxes(title_text="step", row=3, col=1)
        self.notes = {chart: self._add_bar_chart(grid, chart) for chart in BARS}
        self.figure = go.FigureWidget(grid) if widget else go.Figure(grid)
        self.traces: Dict[Tuple[str, str, str], object] = {}   # (label, buffer, column) -> trace
        self.bars: Dict[Tuple[str, str], list] = {}       # (label, chart) -> its bar traces
        self.drawn: Dict[Tuple[str, str], Stack] = {}     # (label, chart) -> the Stack drawn
        self.axes: Dict[str, dict] = {}   # chart -> the y axis last fitted to its values

    @staticmethod
    def _add_bar_chart(grid, chart: str) -> int:
        """The axes of a bar chart (the bars' names on a category axis, the first at the
        top), and its note, empty until a run has no bars to show; returns the note's index."""
        row, col, _ = CHARTS[chart]
        names = dict(type="category", tickfont_size=9)
        if BARS[chart]["orientation"] == "h":
            grid.update_yaxes(names, autorange="reversed", row=row, col=col)
        else:
            grid.update_xaxes(names, row=row, col=col)
        grid.add_annotation(text="", xref="x domain", yref="y domain", showarrow=False,
                            font=dict(size=10, color="#888888"), align="left",
                            bgcolor="rgba(255,255,255,0.85)", row=row, col=col, **CENTER)
        return len(grid.layout.annotations) - 1

    def draw(self, slots: List[Slot], preview=UNCHANGED) -> None:
        """Redraw the series of `slots` and those of their bars whose table changed;
        `preview`: the next Train's (x, y) LR, or None to hide."""
        updates = []
        for slot in slots:
            for key, (x, y) in slot.arrays().items():
                updates.append((self._trace(slot, key), x, y))
        bars = self._changed_bars(slots)
        preview_trace = self._preview_trace() if preview is not UNCHANGED else None
        with self.figure.batch_update():
            for trace, x, y in updates:
                trace.x, trace.y = self._values(x), self._values(y)
            if preview_trace is not None:
                x, y = preview if preview is not None else (np.empty(0), np.empty(0))
                preview_trace.x, preview_trace.y = self._values(x), self._values(y)
                preview_trace.visible = preview is not None
            for slot, chart, stack in bars:
                self._draw_bar(slot, chart, stack)
            if bars:
                self._write_notes()
                self._name_modules()
        self._fit_axes()   # after the batch: inside it the traces read their old data
        if self.widget:
            self._keep_state_for_reload()

    def _values(self, column: np.ndarray):
        return column if self.widget else np.asarray(column).tolist()

    def _fit_axes(self) -> None:
        """Fit the loss axis (log) and the LR axis (linear, readable small numbers) to
        every run's values: plotly's autorange puts a constant LR of 1e-3 on a -1..1 axis
        labelled "0". A relayout only when an axis changes."""
        for chart, columns, fit in (("loss", ("loss", "val_loss"), log_axis),
                                    ("lr", ("lr",), linear_axis)):
            values = [t.y for key, t in self.traces.items()
                      if (key == "next" and chart == "lr") or (key != "next" and key[2] in columns)]
            values = [np.asarray(v, dtype=np.float64) for v in values if v is not None and len(v)]
            axis = fit(np.concatenate(values)) if values else None
            if axis is not None and axis != self.axes.get(chart):
                self.axes[chart] = axis
                row, col, _ = CHARTS[chart]
                self.figure.update_yaxes(axis, row=row, col=col)

    # -- the bars of a run's tables ------------------------------------------------------------
    def _changed_bars(self, slots: List[Slot]) -> List[Tuple[Slot, str, Stack]]:
        """The Stacks of `slots` that differ from the ones drawn: only their bars are sent."""
        changed = []
        for slot in slots:
            for chart, stack in slot.stacks().items():
                if self.drawn.get((slot.label, chart)) != stack:
                    self.drawn[(slot.label, chart)] = stack
                    changed.append((slot, chart, stack))
        return changed

    def _draw_bar(self, slot: Slot, chart: str, stack: Stack) -> None:
        """A trace a layer of the run's bars (its bars' first segments, their second, ...:
        the hover of a bar then lists all of its segments), a point a segment: from its
        base on, shaded by its kind, named in the hover and inside the upright bars."""
        layers = _layers(stack)
        traces = self.bars.setdefault((slot.label, chart), [])
        while len(traces) < len(layers):
            traces.append(self._add_bar(slot, chart))
        spec = BARS[chart]
        for j, trace in enumerate(traces):   # a layer no longer there: emptied
            picks = layers[j] if j < len(layers) else []
            size, bar = [stack.size[i] for i in picks], [stack.bar[i] for i in picks]
            trace.x, trace.y = (size, bar) if spec["orientation"] == "h" else (bar, size)
            trace.base = [stack.base[i] for i in picks]
            trace.marker.color = [_rgba(slot.color, SHADES.get(stack.kind[i], 0.5))
                                  for i in picks]
            trace.text = None if spec["by_run"] else [_segment_name(stack, i, spec) for i in picks]
            trace.hovertext = [_segment_words(stack, i, spec) for i in picks]

    def _add_bar(self, slot: Slot, chart: str):
        spec = BARS[chart]
        trace = self._go.Bar(   # meta: the chart, as a line's is its record field
            x=[], y=[], name=slot.label, legendgroup=slot.label, showlegend=False, meta=chart,
            orientation=spec["orientation"], offsetgroup=slot.label if spec["by_run"] else chart,
            marker=dict(line=dict(color="white", width=1)),
            textposition="none" if spec["by_run"] else "inside", insidetextanchor="middle",
            hovertemplate=f"%{{hovertext}}<extra>{html.escape(slot.label)}</extra>")
        row, col, _ = CHARTS[chart]
        self.figure.add_trace(trace, row=row, col=col)
        return self.figure.data[-1]

    def _write_notes(self) -> None:
        """Each bar chart's note, a line for each run without bars there: the whole note in
        an empty chart ("run 2: not measured: the run made 30 steps; ..."), wrapped to its
        width; beside other runs' bars only its first clause ("run 2: not measured yet"),
        in the chart's corner. Empty once every run has bars."""
        for chart, index in self.notes.items():
            spec = BARS[chart]
            drawn = [(label, stack) for (label, c), stack in self.drawn.items() if c == chart]
            crowded = any(stack.size for _, stack in drawn)
            lines = [f"{label}: {stack.note.split(': ', 1)[0] if crowded else stack.note}"
                     for label, stack in drawn if stack.note]
            text = "<br>".join(textwrap.fill(html.escape(line), spec["note_width"])
                               for line in lines).replace("\n", "<br>")
            note = dict(text=text, **(spec["corner"] if crowded else CENTER))
            shown = self.figure.layout.annotations[index]
            if any(shown[key] != value for key, value in note.items()):
                shown.update(note)

    def _name_modules(self) -> None:
        """The modules' axis names each module short (its last characters), as the
        hover names it in full; set when the modules drawn change."""
        names = list(dict.fromkeys(
            name for (_, chart), stack in self.drawn.items() if chart == "modules"
            for name in stack.bar))
        axis = dict(tickmode="array", tickvals=names, ticktext=[_short(n) for n in names])
        if axis != self.axes.get("modules"):
            self.axes["modules"] = axis
            row, col, _ = CHARTS["modules"]
            self.figure.update_yaxes(axis, row=row, col=col)

    def _keep_state_for_reload(self) -> None:
        """Keep the state the kernel would send a reloaded page current, without sending it.

        plotly's FigureWidget syncs its `_widget_data`/`_widget_layout` only when shown;
        later edits travel as one-shot restyle messages that the page applies to its own
        copy. A page reloaded while the kernel lives asks the kernel for the state and got
        the figure as first shown: empty charts, and every later restyle of a trace added
        since failed ("trace index (11) is not a number or is out of bounds"). Writing
        traitlets' value store changes what `get_state()` answers and sends nothing: the
        page shown now has these edits already. One assignment each, so a state request
        from the kernel's thread reads the old or the new copy, never half of one.
        """
        values = self.figure._trait_values
        values["_widget_data"] = copy.deepcopy(self.figure._data)
        values["_widget_layout"] = copy.deepcopy(self.figure._layout_obj._props)

    def _trace(self, slot: Slot, key: Tuple[str, str]):
        if (slot.label,) + key not in self.traces:
            self._add_trace(slot, key)
        return self.traces[(slot.label,) + key]

    def _add_trace(self, slot: Slot, key: Tuple[str, str]) -> None:
        buffer, column, chart, label, style = next(s for s in SERIES if s[:2] == key)
        style = dict(style)
        alpha = style.pop("fill_alpha", None)
        if "stackgroup" in style:   # each run stacks on itself, never on another run
            style["stackgroup"] = f"{slot.label} {style['stackgroup']}"
        line = {"color": slot.color, "width": 1.5, **style.pop("line", {})}
        first = column == "samples_per_s"   # one legend entry per run: its throughput line
        trace = self._go.Scatter(   # meta: the record field, so a page script can find it
            x=[], y=[], name=slot.label, legendgroup=slot.label, showlegend=first, meta=column,
            mode=style.pop("mode", "lines"), line=line,
            fillcolor=_rgba(slot.color, alpha) if alpha else None,
            hovertemplate=f"{label}: %{{y:.4g}}<extra>{html.escape(slot.label)}</extra>", **style)
        row, col, _ = CHARTS[chart]
        self.figure.add_trace(trace, row=row, col=col)
        self.traces[(slot.label, buffer, column)] = self.figure.data[-1]

    def _preview_trace(self):
        if "next" not in self.traces:
            row, col, _ = CHARTS["lr"]
            self.figure.add_trace(self._go.Scatter(
                x=[], y=[], name="planned: next Train", mode="lines", meta="next",
                line=dict(color="#888888", dash="dash", width=1.5),
                hovertemplate="next Train: %{y:.4g}<extra></extra>"), row=row, col=col)
            self.traces["next"] = self.figure.data[-1]
        return self.traces["next"]
