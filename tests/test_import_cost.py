"""`import nbtrain` loads nothing but the package: every public name loads its module on
first use (nbtrain/__init__.py), so a script or a watch pays only for what it touches.
Each check runs in a fresh interpreter, where sys.modules shows what an import loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import nbtrain as nt

HEAVY = ["nbtrain.entry", "nbtrain.train.loop", "nbtrain.tools.autotune", "nbtrain.tools.compare",
         "nbtrain.runstore.read", "nbtrain.data", "nbtrain.config", "ipywidgets", "plotly",
         "IPython", "sqlite3", "statistics", "fractions", "html"]


def _fresh(code: str) -> dict:
    """What `code` prints as JSON, run in a new interpreter that imports this nbtrain."""
    src = os.path.dirname(os.path.dirname(nt.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout.splitlines()[-1])


def test_import_nbtrain_loads_none_of_the_heavy_modules():
    loaded = _fresh(f"import json, sys, torch\n"
                    f"before = set(sys.modules)\n"
                    f"import nbtrain\n"
                    f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules and m not in before]))")
    assert loaded == []


def test_a_watch_loads_neither_the_fit_loop_nor_the_tools_nor_what_measuring_needs():
    """The first `with nt.watch()` around a tiny loop loads the watcher and what it
    shares, none of what only fit, the tools or a notebook need, nor what only measuring
    (the FLOP counter, statistics), N processes or the store's writer thread need."""
    not_needed = ["nbtrain.train.loop", "nbtrain.train.prepare", "nbtrain.train.failure",
                  "nbtrain.auto.workers", "nbtrain.tools.autotune", "nbtrain.tools.compare",
                  "nbtrain.runstore.read", "nbtrain.views.dashboard", "nbtrain.ui.magic",
                  "joblib", "ipywidgets", "plotly", "IPython", "html",
                  "nbtrain.auto.flops", "statistics", "fractions", "nbtrain.watcher.data_parallel",
                  "sqlite3", "secrets"]
    # updates by hand: a torch.optim optimizer would load statistics itself (torch._dynamo)
    loaded = _fresh(
        "import json, sys, torch\n"
        "model = torch.nn.Linear(4, 1)\n"
        "before = set(sys.modules)\n"
        "import nbtrain as nt\n"
        "with nt.watch(progress=False, store=False) as run:\n"
        "    for _ in range(3):\n"
        "        model.zero_grad(); model(torch.randn(8, 4)).pow(2).mean().backward()\n"
        "        with torch.no_grad():\n"
        "            for p in model.parameters(): p -= 0.1 * p.grad\n"
        f"print(json.dumps([run.step] + [m for m in {not_needed!r} "
        f"if m in sys.modules and m not in before]))")
    assert loaded == [3]


def test_every_public_name_resolves_and_dir_lists_it():
    missing = _fresh("import json, nbtrain\n"
                     "print(json.dumps([n for n in nbtrain.__all__ if getattr(nbtrain, n, None) is None"
                     " or n not in dir(nbtrain)]))")
    assert missing == []


def test_the_progress_bar_reaches_the_entry_however_it_is_imported():
    """The package hands the bar (a view) to the entry when the entry loads: through
    nt.fit, or a module that imports the entry itself."""
    for first in ("import nbtrain; nbtrain.fit", "from nbtrain.tools import compare",
                  "from nbtrain import entry"):
        handed = _fresh(f"import json\n{first}\nfrom nbtrain import entry\n"
                        f"print(json.dumps(entry._progress_bar['attach'] is not None))")
        assert handed, first
