"""Showing a result object in a notebook: its chart (Plotly), then its table.

Plotly is imported only here and only when a chart is shown, so `import nbtrain` in a
script stays light, and a missing plotly costs the chart, never the table.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

_warned_plotly = False


def display_with_figure(obj, make_figure: Optional[Callable] = None) -> None:
    """In a notebook: the Plotly figure (if any), then `obj`'s table (text and HTML)."""
    from IPython.display import display
    fig = _figure_to_show(make_figure)
    if fig is not None:
        display(fig)
    display({"text/plain": repr(obj), "text/html": obj._repr_html_()}, raw=True)


def _figure_to_show(make_figure: Optional[Callable]):
    """The figure, or None: no chart asked for, no plotly (a one-time warning says how
    to get it), or no renderer (a terminal IPython, where plotly would print the
    figure's whole JSON)."""
    global _warned_plotly
    if make_figure is None:
        return None
    try:
        import plotly.io as pio
    except ImportError:
        if not _warned_plotly:
            _warned_plotly = True
            warnings.warn("nbtrain: charts need plotly: pip install 'nbtrain[notebook]' "
                          "(or pip install plotly). Showing the table only.")
        return None
    return make_figure() if pio.renderers.default else None
