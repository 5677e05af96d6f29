"""One self-contained HTML file of a run or a comparison, for sharing.

    run.report("run.html")          # charts, summary, settings and why "auto" chose them
    nt.compare(...).report("cmp.html")

plotly.js is embedded (`include_plotlyjs=True`, about 4.6 MB), so the file reads offline
and in a mail attachment; the charts are the dashboard's, drawn from the run's history.
"""
from __future__ import annotations

import datetime
import html
from typing import List

from ..tables import setting

STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{padding:2px 10px 2px 0;text-align:left;
vertical-align:top}pre{font-size:12px;background:#f6f6f6;padding:.6em;overflow-x:auto}
.why{color:#666}h2{margin-top:1.6em;border-bottom:1px solid #ddd}"""


def run_report(run, path, label: str = "run 1") -> str:
    """Write `run`'s report to `path`; returns the path."""
    from .dashboard import Dashboard
    dash = Dashboard(show=False, live="static")   # the five charts, drawn once, no thread left
    dash.add(run, label=label)
    dash.close()
    return _write(path, f"nbtrain {label}: {run.state}",
                  [_figure_html(dash.figure), dash.table.value, _run_section(label, run)])


def comparison_report(comparison, path) -> str:
    """Write an `nt.compare` result's report: its charts and table, then each config's run."""
    first = {name: runs[0] for name, runs in comparison.runs.items() if runs}
    return _write(path, f"nbtrain comparison: {', '.join(first)}",
                  [_figure_html(comparison.figure()), comparison._repr_html_()]
                  + [_run_section(name, run) for name, run in first.items()])


def _figure_html(figure) -> str:
    import plotly.io as pio
    return pio.to_html(figure, include_plotlyjs=True, full_html=False)


def _run_section(label: str, run) -> str:
    """The summary as `print(run.summary_text())` gives it, the resolved settings with
    their reasons, and every config field."""
    resolved = _resolved_table(run)
    config = _table(sorted(run.config.to_dict().items()), ("field", "value"))
    return (f"<h2>{html.escape(label)}</h2><pre>{html.escape(run.summary_text())}</pre>"
            f"{_where_the_time_goes(run)}"
            f"<h3>settings used</h3>{resolved}<h3>configuration</h3>{config}")


def _resolved_table(run) -> str:
    """The resolved settings, each figure with its unit (tables.setting), and why."""
    return _table([(name, setting(name, value), why)
                   for name, (value, why) in run.resolved.items()],
                  ("setting", "used", 'why ("auto" resolved it so, or it was asked for)'))


def _where_the_time_goes(run) -> str:
    """run.gaps() and run.host_reads() as tables (a Run from elsewhere may have neither)."""
    parts = []
    if hasattr(run, "gaps"):
        rows = [(r["part"], f"{r['seconds']:.3f} s", f"{r['share']:.1%}") for r in run.gaps()]
        parts.append("<h3>where the wall time went (run.gaps())</h3>"
                     + _table(rows, ("part", "seconds", "share")))
    if hasattr(run, "host_reads"):
        reads = run.host_reads()
        rows = [(r.where, f"{r.per_step:.3g}", r.code) for r in reads]
        parts.append("<h3>lines that read the host (run.host_reads())</h3>"
                     + (_table(rows, ("where", "per step", "code")) if rows else "")
                     + f"<p class=why>{html.escape(reads.note)}</p>")
    return "".join(parts)


def _table(rows: List[tuple], head: tuple) -> str:
    cells = "".join("<tr>" + "".join(f"<td{' class=why' if i == 2 else ''}>"
                                      f"{html.escape(str(v))}</td>" for i, v in enumerate(row))
                    + "</tr>" for row in rows)
    return "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + \
        f"</tr>{cells}</table>"


def _write(path, title: str, sections: List[str]) -> str:
    from ..version import __version__
    made = datetime.datetime.now().isoformat(timespec="seconds")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p class=why>nbtrain {__version__}, written {made}</p>{''.join(sections)}"
            "</body></html>")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return str(path)

