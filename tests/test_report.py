"""run.report(path) and Comparison.report(path): one self-contained HTML file to share."""
from __future__ import annotations

import html
import json

import pytest
from torch.nn import functional as F

import nbtrain as nt

from conftest import mlp, quick

pytest.importorskip("plotly")
pytest.importorskip("anywidget")


def _plotly_js_embedded(text: str) -> bool:
    """The plotly.js bundle itself (its licence header, megabytes), not a CDN link."""
    return "plotly.js v" in text and len(text) > 3_000_000 and 'src="https://cdn' not in text


def test_run_report_holds_charts_points_summary_and_why_auto_chose(blobs, tmp_path):
    run = nt.fit(mlp(), blobs, F.cross_entropy, val_data=blobs, progress=False,
                 config=quick(epochs=2, num_workers="auto", pin_memory="auto"))
    path = run.report(tmp_path / "run.html")
    text = open(path, encoding="utf-8").read()
    assert path == str(tmp_path / "run.html") and text.startswith("<!doctype html>")
    assert _plotly_js_embedded(text)   # readable offline
    for record in run.records():       # every point of the loss chart, as numbers
        assert json.dumps(record["loss"]) in text and json.dumps(record["samples_per_s"]) in text
    assert '"meta":"val_loss"' in text and "nbtrain-runs" in text
    assert html.escape(run.summary_text()) in text
    from nbtrain.tables import setting   # each figure with its unit
    for name, (value, why) in run.resolved.items():
        assert f"<td>{html.escape(name)}</td><td>{html.escape(setting(name, value))}</td>" \
               f"<td class=why>{html.escape(why)}</td>" in text
    assert "<td>warmup_steps</td>" in text   # every config field
    evaluation = next(r for r in run.gaps() if r["part"] == "evaluation")   # validation
    assert f"<td>evaluation</td><td>{evaluation['seconds']:.3f} s</td>" in text
    assert html.escape(run.host_reads().note) in text   # fit's: why it has no table


def test_comparison_report_holds_each_configs_curves_and_settings(blobs, tmp_path):
    cmp = nt.compare(mlp, blobs, F.cross_entropy, base=quick(max_steps=10), progress=False,
                     configs={"sgd": {"optimizer": "sgd", "lr": 0.1}, "adamw": {}})
    text = open(cmp.report(tmp_path / "cmp.html"), encoding="utf-8").read()
    assert _plotly_js_embedded(text)
    assert "<h2>sgd</h2>" in text and "<h2>adamw</h2>" in text
    for runs in cmp.runs.values():
        assert all(json.dumps(r["loss"]) in text for r in runs[0].records())
    assert cmp._repr_html_() in text   # the results table
