"""nt.Dashboard(live="static"): a plain Plotly figure kept current through display handles,
so a notebook executed headless (nbconvert, nbval, papermill) saves its final charts."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("plotly")
pytest.importorskip("anywidget")

from nbtrain.views import dashboard  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"

CELLS = [
    "import json, torch\nimport nbtrain as nt\nfrom torch import nn\nfrom torch.nn import functional as F\n"
    "torch.manual_seed(0)\ntorch.set_num_threads(1)\nx, y = nt.datasets.digits('train', images=False)\n"
    "model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))",
    "config = nt.TrainConfig(device='cpu', amp='off', max_steps=60, log_every=2, num_workers=0)\n"
    "run = nt.fit(model, (x, y), F.cross_entropy, config=config, progress=nt.Dashboard)",
    "print(json.dumps([r['step'] for r in run.records()]))",
]


def _execute_headless(tmp_path: Path):
    """Run CELLS in a fresh kernel as nbconvert does, save the notebook, read it back."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    env = {k: v for k, v in os.environ.items() if k not in ("JPY_SESSION_NAME", "VSCODE_PID")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC)] + [p for p in [env.get("PYTHONPATH")] if p])
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)
    path = tmp_path / "executed.ipynb"
    nbformat.write(nb, path)
    return json.loads(path.read_text())


def test_headless_notebook_saves_the_final_charts_as_plotly_json_with_every_point(tmp_path):
    nb = _execute_headless(tmp_path)
    fit_cell, steps_cell = nb["cells"][1], nb["cells"][2]
    steps = json.loads("".join(steps_cell["outputs"][0]["text"]))
    figures = [o["data"]["application/vnd.plotly.v1+json"] for o in fit_cell["outputs"]
               if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(figures) == 1, [list(o.get("data", {})) for o in fit_cell["outputs"]]
    traces = {t.get("meta"): t for t in figures[0]["data"] if t.get("meta")}
    for field in ("samples_per_s", "loss", "rss_mb"):   # every record's point, as numbers
        assert traces[field]["x"] == steps, (field, traces[field]["x"], steps)
        assert len(traces[field]["y"]) == len(steps) and all(
            isinstance(v, float) for v in traces[field]["y"])
    html = ["".join(o.get("data", {}).get("text/html", "")) for o in fit_cell["outputs"]]
    tables = [h for h in html if "nbtrain-runs" in h]
    assert len(tables) == 1 and "finished" in tables[0] and "60/60" in tables[0]
    assert not any("application/vnd.jupyter.widget-view+json" in o.get("data", {})
                   for o in fit_cell["outputs"])


def test_auto_picks_static_where_no_widget_front_end_can_be_assumed(monkeypatch):
    assert dashboard.auto_live() == "widget"   # a script (pytest): nothing is shown anyway
    monkeypatch.setattr(dashboard, "_in_kernel", lambda: True)
    for name in ("JPY_SESSION_NAME", "VSCODE_PID"):
        monkeypatch.delenv(name, raising=False)
    assert dashboard.auto_live() == "static"    # nbconvert, nbclient, nbval, papermill
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/train.ipynb")
    assert dashboard.auto_live() == "widget"    # a kernel of JupyterLab / Notebook
    monkeypatch.setitem(sys.modules, "google.colab", object())
    assert dashboard.auto_live() == "static"    # Colab without the custom widget manager


def test_live_must_be_one_of_the_modes():
    with pytest.raises(ValueError, match=r"live='web'.*auto, widget, static"):
        dashboard.Dashboard(live="web")
