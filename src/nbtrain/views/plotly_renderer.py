"""How to draw a Dashboard's charts: one Plotly FigureWidget (or a static figure), its traces
updated in place from the Slots' series."""
from __future__ import annotations

import copy
import html
from typing import TYPE_CHECKING, Dict, List, Tuple

import numpy as np

from .series import (
    linear_axis,
    log_axis,
)

if TYPE_CHECKING:
    from .dashboard import Slot

# The charts, in the order of the grid: name -> (row, col, title).
CHARTS = {
    "throughput": (1, 1, "Throughput (samples/s)"),
    "split": (1, 2, "Step time (s): data wait / copy / compute, stacked"),
    "memory": (2, 1, "Memory (MB): RSS solid, CUDA alloc dash / reserved dot, NVML dashdot"),
    "lr": (2, 2, "Learning rate: planned dashed, actual solid"),
    "loss": (3, 1, "Loss: train line, validation markers"),
}
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


class PlotlyRenderer:
    """How to draw: one figure with five charts, a trace per (run, series).

    A trace is made the first time its series has data; after that each draw only sets
    x and y of the traces of runs that changed, in one `batch_update` (one message).
    `widget=False`: a plain Figure with lists for x and y, to be shown as Plotly JSON
    (numpy arrays would be written as base64 that older plotly.js cannot read).
    """

    def __init__(self, height: int = 760, widget: bool = True):
        _, go, make_subplots = require_plotly_widgets()
        self.widget = widget
        self._go = go
        grid = make_subplots(rows=3, cols=2, specs=[[{}, {}], [{}, {}], [{"colspan": 2}, None]],
                             subplot_titles=[title for _, _, title in CHARTS.values()],
                             vertical_spacing=0.1, horizontal_spacing=0.08)
        grid.update_layout(height=height, autosize=True, margin=dict(l=50, r=20, t=40, b=40),
                           template="plotly_white", hovermode="x unified",
                           legend=dict(orientation="h", y=-0.06), uirevision="nbtrain")
        grid.update_annotations(font_size=11)
        grid.update_yaxes(type="log", row=3, col=1)   # losses span decades: see log_axis
        grid.update_xaxes(title_text="step", row=3, col=1)
        self.figure = go.FigureWidget(grid) if widget else go.Figure(grid)
        self.traces: Dict[Tuple[str, str, str], object] = {}   # (label, buffer, column) -> trace
        self.axes: Dict[str, dict] = {}   # chart -> the y axis last fitted to its values

    def draw(self, slots: List[Slot], preview=UNCHANGED) -> None:
        """Redraw the series of `slots`; `preview`: the next Train's (x, y) LR, or None to hide."""
        updates = []
        for slot in slots:
            for key, (x, y) in slot.arrays().items():
                updates.append((self._trace(slot, key), x, y))
        preview_trace = self._preview_trace() if preview is not UNCHANGED else None
        with self.figure.batch_update():
            for trace, x, y in updates:
                trace.x, trace.y = self._values(x), self._values(y)
            if preview_trace is not None:
                x, y = preview if preview is not None else (np.empty(0), np.empty(0))
                preview_trace.x, preview_trace.y = self._values(x), self._values(y)
                preview_trace.visible = preview is not None
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
