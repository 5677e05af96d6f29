"""`import nbtrain` loads nothing but the package: every public name loads its module on
first use (nbtrain/__init__.py), so a script or a watch pays only for what it touches.
Each check runs in a fresh interpreter, where sys.modules shows what an import loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import nbtrain as nt

HEAVY = ["nbtrain.entry", "nbtrain.train.loop", "nbtrain.tools.autotune", "nbtrain.tools.compare",
         "nbtrain.runstore.read", "nbtrain.data", "nbtrain.config", "ipywidgets", "plotly",
         "IPython", "sqlite3", "statistics", "fractions", "html"]


def _fresh(code: str, *argv: str) -> dict:
    """What `code` prints as JSON, run in a new interpreter that imports this nbtrain
    (`argv`: its sys.argv[1:])."""
    src = os.path.dirname(os.path.dirname(nt.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True,
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
    (the FLOP counter, statistics), N processes or the store's writer thread need; nor
    what only some settings use: fit's data path and the packed formats, the trackers of
    report_to, fp16's loss scaling, the progress bar, the copies ahead to a GPU; nor
    getrusage's shared library where /proc tells the peak memory."""
    not_needed = ["nbtrain.train.loop", "nbtrain.train.prepare", "nbtrain.train.failure",
                  "nbtrain.auto.workers", "nbtrain.tools.autotune", "nbtrain.tools.compare",
                  "nbtrain.runstore.read", "nbtrain.views.dashboard", "nbtrain.ui.magic",
                  "joblib", "ipywidgets", "plotly", "IPython", "html",
                  "nbtrain.auto.flops", "nbtrain.telemetry.modules", "statistics", "fractions",
                  "nbtrain.watcher.data_parallel",
                  "sqlite3", "secrets",
                  "nbtrain.data.sources", "nbtrain.data.lmdb", "nbtrain.data.tfrecord",
                  "nbtrain.runstore.trackers", "nbtrain.watcher.fp16", "nbtrain.views.progress",
                  "nbtrain.data.moves", "nbtrain.data.prefetch"]
    if os.path.exists("/proc/self/status"):
        not_needed.append("resource")
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


def test_a_short_loop_pays_no_first_flop_count_which_a_process_that_counted_pays_in_steps():
    """The FLOP count's first use in a process loads torch's FLOP formulas (~5 ms): a
    loop too short for that within the measuring budget never loads them; the same loop
    in a process that has them counts (its steps alone are the cost)."""
    loop = ("model = torch.nn.Linear(4, 1)\n"
            "with nt.watch(optimize=False, progress=False, store=False) as run:\n"
            "    for _ in range(int(sys.argv[1])):\n"
            "        model.zero_grad(); model(torch.randn(8, 4)).pow(2).mean().backward()\n"
            "        with torch.no_grad():\n"
            "            for p in model.parameters(): p -= 0.1 * p.grad\n"
            "print(json.dumps([run.resolved['flops_per_step'][0], "
            "'torch.utils.flop_counter' in sys.modules]))")
    head = "import json, sys, torch, nbtrain as nt\n"
    # a count of 3 steps fits 5% from about step 60 on; its loading alone needs a run of
    # 100 ms, and 150 steps take about 10 ms
    assert _fresh(head + loop, "150") == [None, False]
    # the formulas loaded, and a watch before that counted the engine's loading (below)
    counted_before = ("import torch.utils.flop_counter, warnings\n"
                      "warnings.simplefilter('ignore')\n"
                      "with nt.watch(optimize=False, progress=False, store=False): pass\n")
    flops, _ = _fresh(head + counted_before + loop, "300")
    assert flops == 2 * (2 * 8 * 4)   # the forward, and the weight's gradient (x needs none)


def test_the_first_watch_counts_the_engines_loading_as_spent():
    """A process's first watch loads nbtrain's engine (nt.watch: ~50 modules, 15-20 ms)
    while the program waits: its measuring counts that as spent, so a loop short enough
    for a count on its own counts nothing, and says why; the next watch counts it."""
    code = ("import json, sys, torch, nbtrain as nt, torch.utils.flop_counter\n"
            "from nbtrain.auto import budget\n"
            "def watched():\n"
            "    model = torch.nn.Linear(4, 1)\n"
            "    with nt.watch(optimize=False, progress=False, store=False) as run:\n"
            "        for _ in range(300):\n"
            "            model.zero_grad(); model(torch.randn(8, 4)).pow(2).mean().backward()\n"
            "            with torch.no_grad():\n"
            "                for p in model.parameters(): p -= 0.1 * p.grad\n"
            "    return run\n"
            "nt.watch\n"
            "loading = budget._unpaid['loading_s']\n"
            "budget._unpaid['loading_s'] = 10.0   # the engine's loading, made long\n"
            "first, second = watched(), watched()\n"
            "print(json.dumps([loading, first.resolved['flops_per_step'], "
            "second.resolved['flops_per_step'][0], budget._unpaid['loading_s']]))")
    loading, (flops, why), flops_then, unpaid = _fresh(code)
    assert loading > 0 and unpaid == 0.0
    assert flops is None and "with the 10000 ms nbtrain took to load" in why
    assert flops_then == 2 * (2 * 8 * 4)


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


# -- the first watch's loads, and its steps, cost the program nothing it would not pay ------------
def test_nbtrain_loads_its_modules_without_a_collection_of_the_program():
    """The ~50 modules a watch's first use loads are made with the collector paused (each
    700 of their objects would be one young collection of the program's, and every ~100
    of those a full one): one collection at most, whichever the program's schedule has
    come to, where there were ~8; and the collector is left as the program had it."""
    def first_watch(collector: str) -> list:
        """[whether the collector runs after, the collections while nt.watch loads]."""
        return _fresh("import gc, json, torch\n"
                      f"gc.{collector}()\n"
                      "seen = []\n"
                      "gc.callbacks.append(lambda phase, info: seen.append(phase))\n"
                      "import nbtrain as nt\n"
                      "nt.watch   # its first use: entry, the watcher, the Run, the config\n"
                      "made = [[] for _ in range(10)]   # the first objects after it\n"
                      "print(json.dumps([gc.isenabled(), seen.count('start')]))")
    assert first_watch("disable") == [False, 0]   # the program's collector off: left off
    on, collections = first_watch("enable")
    assert on is True and collections <= 1


def test_the_loaded_engine_goes_to_the_oldest_generation_untraversed():
    """Loaded, the engine's classes and functions are in the collector's oldest
    generation, so the program's next young and middle collections do not traverse them
    (~5 ms on regression_poly); a program's own frozen objects stay frozen."""
    def after_first_watch(freeze: bool) -> dict:
        return _fresh("import gc, json, torch\n"
                      f"if {freeze}: gc.freeze()\n"
                      "frozen = gc.get_freeze_count()\n"
                      "import nbtrain as nt\n"
                      "nt.watch\n"
                      "young = {id(o) for o in gc.get_objects(0) + gc.get_objects(1)}\n"
                      "print(json.dumps({'young': id(nt.watch) in young,\n"
                      "                  'oldest': id(nt.watch) in map(id, gc.get_objects(2)),\n"
                      "                  'frozen kept': gc.get_freeze_count() >= frozen > 0}))")
    assert after_first_watch(False) == {"young": False, "oldest": True, "frozen kept": False}
    assert after_first_watch(True) == {"young": True, "oldest": False, "frozen kept": True}


def _direct_loop(steps: int, at=None):
    """A DQN's shape of step: a tiny model, batches the loop slices itself (no DataLoader);
    `at(i)` before each step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    data = torch.randn(steps, 16, 4)
    for i in range(steps):
        if at:
            at(i)
        opt.zero_grad()
        model(data[i]).pow(2).mean().backward()
        opt.step()


def test_a_watched_step_reads_no_file_while_the_peak_probe_waits(monkeypatch, tmp_path):
    """On a machine whose peak is not known yet (no cache file), the probe (1 s) waits for
    20 s of the run: whether it is known is asked once a watch, and no step's end looks
    for the file (it did, every step: 40 µs of a DQN's 0.5 ms step)."""
    import builtins
    import io
    import os
    import threading

    from nbtrain.auto import flops
    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "_PROBED", {})
    asked, touched, window = [], [], {"open": False}
    known = flops.peak_known
    monkeypatch.setattr(flops, "peak_known", lambda *a: asked.append(a) or known(*a))
    main = threading.main_thread()

    def counting(name, fn):
        def call(*args, **kwargs):
            if window["open"] and threading.current_thread() is main:
                touched.append((name, args[:1]))
            return fn(*args, **kwargs)
        return call
    for module, name in ((builtins, "open"), (io, "open"), (os, "stat"), (os, "listdir"),
                         (os, "scandir")):
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))

    def at(i):   # the 100 steps after the peak was looked up (once the FLOPs are counted)
        window["open"] = bool(asked)
        if asked and window.setdefault("from", i) + 100 == i:
            run.stop()
    with nt.watch(optimize=False, progress=False, store=False) as run:
        _direct_loop(20_000, at)   # the FLOP count comes when affordable: a slow machine's later
    window["open"] = False
    assert run.state == "stopped" and run.resolved["flops_per_step"][0]
    assert len(asked) == 1 and touched == []
    peak, why = run.resolved["peak_tflops"]
    assert peak is None and why.startswith("not measured: your loop ended")


def test_a_watch_that_measures_nothing_never_writes_out_its_model(monkeypatch):
    """The model's key for a known bf16 gain or FLOP count (its repr, ~1 ms on a small
    ViT) is made where one is looked up, not at the model's first forward; a FLOP count
    kept in the process for it is still found."""
    from nbtrain.watcher import measure

    class Counted(torch.nn.Linear):
        written = 0

        def __repr__(self):
            Counted.written += 1
            return super().__repr__()

    def loop():
        torch.manual_seed(0)
        model = Counted(4, 1)
        opt = torch.optim.SGD(model.parameters(), 0.1)
        for x in torch.randn(5, 16, 4):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    monkeypatch.setattr(measure, "_COUNTED", {})
    for count_flops in (False, True):   # True: nothing counted in this process yet
        with nt.watch(optimize=False, progress=False, store=False, count_flops=count_flops):
            loop()
    assert Counted.written == 0
    measure._COUNTED["other model"] = (1, 0.0)
    with nt.watch(optimize=False, progress=False, store=False) as run:
        loop()
    assert Counted.written == 1 and run.step == 5


def test_the_peak_probe_still_runs_once_it_is_affordable(monkeypatch, tmp_path):
    """The steps that wait for the probe's budget do not look, yet it runs at the first
    step's end that may afford it (a probe of 0.1 ms here: within a short loop)."""
    from nbtrain.auto import flops
    from nbtrain.watcher import measure
    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "_PROBED", {})
    monkeypatch.setattr(measure, "PEAK_PROBE_S", 1e-4)
    monkeypatch.setattr(flops, "probe_gemm", lambda device, dtype: (0.25, 512))
    asked = []
    known = flops.peak_known
    monkeypatch.setattr(flops, "peak_known", lambda *a: asked.append(a) or known(*a))
    with nt.watch(optimize=False, progress=False, store=False) as run:
        _direct_loop(300)
    assert run.resolved["peak_tflops"][0] == 0.25 and len(asked) == 1


def test_a_watchs_import_compiles_no_generated_methods():
    """The modules a watch loads come compiled (their .pyc, or their source once), and
    generate no methods from text at import: a dataclass's __init__, __repr__ and __eq__
    are compiled anew at every import (TrainConfig's 58 fields: ~1.5 ms of a short
    program's). What is compiled from text is small: a named tuple's __new__ (a lambda)
    and its annotations (typing's ForwardRef)."""
    generated = _fresh(
        "import json, sys, torch\n"
        "texts = []\n"
        "def audit(event, args):\n"
        "    if event == 'compile' and not str(args[1]).endswith('.py'):\n"
        "        texts.append(str(args[0]))\n"
        "sys.addaudithook(audit)\n"
        "import nbtrain as nt\n"
        "nt.watch\n"
        "print(json.dumps(texts))")
    assert any("lambda _cls" in text for text in generated)   # the audit hook saw them
    assert not [text for text in generated if "def " in text]
