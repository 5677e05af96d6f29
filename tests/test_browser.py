"""The Panel in real kernels: one that no browser watches (nbval), and JupyterLab in Chromium.

- nbval runs tests/browser/panel_headless.ipynb: creating the panel, pressing Train and
  drawing must neither fail nor hang without a browser, and the text outputs must
  compare equal to the stored ones.
- The browser test serves tests/browser/panel_digits.ipynb from JupyterLab on 127.0.0.1,
  runs it in Debian's Chromium through Playwright, presses Train, waits until the
  throughput, memory and LR charts hold points (read from plotly's `gd.data` in the
  page), presses Stop, and checks that the status reads "stopped" and the charts stop
  growing. Screenshots go to tests/browser/screenshots/; with NBTRAIN_README_SHOT=1 the
  last one also replaces docs/panel.png (the README's picture).
- The same panel, training, survives a page reload: the notebook is saved, the page
  reloaded, and the charts must come back from the kernel with their points (no
  "trace index ... out of bounds" in the console) and go on growing.
- `nt.Dashboard(run, live="static")` in a blocking fit: the saved notebook, reopened, shows
  the plain Plotly figure (JupyterLab's own Plotly renderer, no widget) ending at the run's
  last step.
- tests/browser/fasttrain_panel.ipynb runs `%%fasttrain --dashboard` in the same way: the
  dashboard's throughput, memory and LR charts must fill while the blocking cell still
  runs, and the cell's output must end with the summary table of a finished run.
- tests/browser/own_loop_dashboard.ipynb runs `%%fasttrain --dashboard` on a cell with a
  loop of its own: the charts fill while the cell runs; the dashboard's Stop button, which
  interrupts the busy kernel through the server's REST API, ends the loop at a step
  boundary, with no error shown, and the next cell sees an interrupted Run that counted
  every step the loop made.
- notebooks/00_quickstart.ipynb (outputs stripped) is run with "Run All Cells": every code
  cell must get an execution count, in order, and no output may be an error, a traceback
  on stderr or a widget that failed to display.

One JupyterLab server and one Chromium serve all browser tests of this module; each test
gets its own page and workspace, and its kernels are shut down when it ends.

The browser tests need /usr/bin/chromium (`.ci/install-browser`), playwright, jupyterlab
and anywidget, and are skipped with the reason where one is missing.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest

HERE = Path(__file__).parent
HEADLESS_NOTEBOOK = HERE / "browser" / "panel_headless.ipynb"
NOTEBOOK = HERE / "browser" / "panel_digits.ipynb"
FASTTRAIN_NOTEBOOK = HERE / "browser" / "fasttrain_panel.ipynb"
OWN_LOOP_NOTEBOOK = HERE / "browser" / "own_loop_dashboard.ipynb"
QUICKSTART = HERE.parent / "notebooks" / "00_quickstart.ipynb"
SHOTS = HERE / "browser" / "screenshots"
README_SHOT = HERE.parent / "docs" / "panel.png"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
CHARTS = ("samples_per_s", "rss_mb", "lr")   # throughput, memory and LR: "actual" traces


def _missing() -> str:
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} not found: run .ci/install-browser (apt-get install chromium)"
    for module, package in (("playwright.sync_api", "playwright"), ("jupyterlab", "jupyterlab"),
                            ("anywidget", "anywidget"), ("plotly", "plotly")):
        try:
            __import__(module)
        except ImportError:
            return f"{package} is not installed: pip install -e '.[test]'"
    return ""


needs_browser = pytest.mark.skipif(bool(_missing()), reason=_missing() or "-")


def test_panel_trains_headless_and_nbval_compares_its_outputs(tmp_path):
    pytest.importorskip("nbval")
    pytest.importorskip("anywidget")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval", str(HEADLESS_NOTEBOOK), "-q",
         "-o", "addopts=-ra",   # strict: the project's --nbval-lax would check nothing here
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path)],
        capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_server(url: str, server: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with code {server.returncode}:\n"
                               f"{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"jupyter lab did not answer {url} within {timeout:.0f} s")


def _shut_down(server: subprocess.Popen, base: str, token: str) -> None:
    """Ask politely (kernels are shut down too), then end the whole process group."""
    try:
        request = urllib.request.Request(f"{base}/api/shutdown", method="POST",
                                         headers={"Authorization": f"token {token}"})
        urllib.request.urlopen(request, timeout=5).close()
        server.wait(timeout=15)
    except Exception:
        pass
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


class Lab(NamedTuple):
    base: str    # http://127.0.0.1:PORT
    token: str
    root: Path   # the server's root_dir: notebooks copied here can be opened


def _api(lab: Lab, path: str, method: str = "GET"):
    request = urllib.request.Request(f"{lab.base}{path}", method=method,
                                     headers={"Authorization": f"token {lab.token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        body = answer.read()
    return json.loads(body) if body else None


def _shut_down_kernels(lab: Lab) -> None:
    """End every session and kernel, so the next test has the CPUs to itself."""
    for session in _api(lab, "/api/sessions"):
        _api(lab, f"/api/sessions/{session['id']}", "DELETE")
    for kernel in _api(lab, "/api/kernels"):
        _api(lab, f"/api/kernels/{kernel['id']}", "DELETE")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on 127.0.0.1 with a token, once for the module; always shut down."""
    tmp_path = tmp_path_factory.mktemp("lab")
    root = tmp_path / "root"
    root.mkdir()
    for notebook in (NOTEBOOK, FASTTRAIN_NOTEBOOK, OWN_LOOP_NOTEBOOK):
        shutil.copy(notebook, root / notebook.name)
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               PYTHONUNBUFFERED="1")
    # No "official Jupyter news?" toast over the charts (and no fetch for it).
    labconfig = tmp_path / "config" / "labconfig"
    labconfig.mkdir(parents=True)
    (labconfig / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    log = open(tmp_path / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False",
         "--ServerApp.port_retries=0", "--allow-root"],   # CI runs as root
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for_server(f"{base}/api/status?token={token}", server, tmp_path / "lab.log", 60)
        yield Lab(base, token, root)
    finally:
        _shut_down(server, base, token)
        log.close()


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium, headless, once for the module."""
    from playwright.sync_api import sync_playwright
    playwright = sync_playwright().start()
    try:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                              args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()
    finally:
        playwright.stop()


@pytest.fixture
def page(lab, browser):
    """A fresh page (own browser context); afterwards it is closed and every kernel ended."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1300, "height": 1500})
    try:
        page = context.new_page()
        page.set_default_timeout(60_000)
        yield page
    finally:
        context.close()
        _shut_down_kernels(lab)


def _open(page, lab: Lab, path: str) -> None:
    """Open `path` (relative to the server root) in a workspace of its own, file browser closed.

    A fresh workspace per test: JupyterLab would otherwise restore the tabs of the last
    test's workspace and start their kernels too.
    """
    workspace = "t-" + "".join(c if c.isalnum() else "-" for c in path)
    page.goto(f"{lab.base}/lab/workspaces/{workspace}/tree/{path}?token={lab.token}")
    page.wait_for_function("(path) => { const w = window.jupyterapp && window.jupyterapp.shell"
                           ".currentWidget; return !!(w && w.context && w.context.path === path"
                           " && w.context.isReady); }",
                           arg=path, timeout=90_000)
    page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")


# How many points each trace of a run holds, read from plotly's gd.data in the page: the
# charts under `root` (a CSS selector), by record field (trace meta). The planned-LR line
# (meta "lr" too, full length before the first step) is left out: only measured series.
COUNT_POINTS = """({root, label}) => {
  const out = {};
  for (const gd of document.querySelectorAll(root + ' .js-plotly-plot')) {
    for (const t of gd.data || []) {
      if (t.legendgroup === label && t.x && !String(t.hovertemplate).startsWith('planned'))
        out[t.meta] = t.x.length;
    }
  }
  return out;
}"""

# The last step (x) each of those traces reaches.
LAST_STEPS = COUNT_POINTS.replace("t.x.length", "t.x[t.x.length - 1]")

# Runs every cell once the kernel is up; gives up after 90 s (page.evaluate has no timeout).
RUN_ALL = """async () => {
  const app = window.jupyterapp;
  const panel = app.shell.currentWidget;
  const run = (async () => {
    await panel.context.sessionContext.ready;
    await app.commands.execute('notebook:run-all-cells');
    return 'ok';
  })();
  const late = new Promise((resolve) => setTimeout(() => resolve('timed out'), 90000));
  return Promise.race([run, late]);
}"""

# Starts "Run All Cells" once the kernel is up and returns at once (window.__runAll says
# how it went), so the test can watch the cells while they run.
START_RUN_ALL = """async () => {
  const app = window.jupyterapp;
  const panel = app.shell.currentWidget;
  const ready = panel.context.sessionContext.ready.then(() => 'ok');
  const late = new Promise((resolve) => setTimeout(() => resolve('timed out'), 90000));
  if (await Promise.race([ready, late]) !== 'ok') return 'the kernel did not start within 90 s';
  window.__runAll = 'running';
  app.commands.execute('notebook:run-all-cells').then(
    () => { window.__runAll = 'done'; }, (err) => { window.__runAll = 'failed: ' + err; });
  return 'started';
}"""

# The notebook as its model holds it: kernel status, and per code cell its execution
# count and outputs (type; stream name and start of text; error name and value).
NOTEBOOK_STATE = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const session = panel.sessionContext.session;
  const cells = [];
  const list = panel.content.model.cells;
  for (let i = 0; i < list.length; i++) {
    const cell = list.get(i);
    if (cell.type !== 'code') continue;
    const outputs = [];
    for (let j = 0; j < cell.outputs.length; j++) {
      const o = cell.outputs.get(j).toJSON();
      outputs.push({type: o.output_type, name: o.name || '',
                    text: [].concat(o.text || []).join('').slice(0, 4000),
                    error: o.output_type === 'error' ? `${o.ename}: ${o.evalue}` : ''});
    }
    cells.push({index: i, count: cell.executionCount, outputs});
  }
  return {runAll: window.__runAll || '', kernel: session && session.kernel
          ? session.kernel.status : 'none', cells};
}"""

# Errors as the page shows them, over the whole notebook.
PAGE_ERRORS = """() => {
  const found = [];
  for (const el of document.querySelectorAll(
      '.jp-Notebook [data-mime-type="application/vnd.jupyter.error"]'))
    found.push('error output: ' + el.innerText.slice(0, 1500));
  for (const el of document.querySelectorAll(
      '.jp-Notebook .jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]'))
    if (el.innerText.includes('Traceback')) found.push('stderr: ' + el.innerText.slice(0, 1500));
  for (const el of document.querySelectorAll('.jp-Notebook .jp-OutputArea-output'))
    if (el.innerText.includes('Error displaying widget'))
      found.push('widget: ' + el.innerText.slice(0, 500));
  return found;
}"""


def _enough(counts: dict) -> bool:
    return all(counts.get(name, 0) >= 5 for name in CHARTS)


def _points(page, label: str = "run 1", root: str = ".nbtrain-panel") -> dict:
    return page.evaluate(COUNT_POINTS, {"root": root, "label": label})


def _status_starts(page, word: str) -> None:
    page.wait_for_function(
        "(word) => (document.querySelector('.nbtrain-panel .nbtrain-status') || {})"
        ".textContent?.startsWith(word)", arg=word, timeout=30_000)


def _poll(page, predicate, timeout: float, what: str, label: str = "run 1"):
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = _points(page, label)
        if predicate(value):
            return value
        page.wait_for_timeout(250)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {value}")


def _finished(state: dict) -> bool:
    return state["runAll"] != "running" and state["kernel"] == "idle"


def _wait_run_all(page, timeout: float, each=None) -> dict:
    """Poll the notebook (calling `each(state)` every time) until Run All ended, kernel idle."""
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        state = page.evaluate(NOTEBOOK_STATE)
        if each is not None:
            each(state)
        if _finished(state):
            return state
        page.wait_for_timeout(250)
    raise AssertionError(f"Run All did not end within {timeout:.0f} s; last state: "
                         f"{json.dumps(state)[:3000]}")


def _check_ran_cleanly(page, state: dict) -> None:
    """Run All succeeded: every code cell has a count, in cell order, and nothing errs."""
    assert state["runAll"] == "done", state["runAll"]
    counts = [cell["count"] for cell in state["cells"]]
    assert all(isinstance(c, int) for c in counts), f"cells left unrun: {counts}"
    assert counts == sorted(set(counts)), f"cells did not run once each, in order: {counts}"
    errors = [f"cell {cell['index']}: {o['error'] or o['text'][-1500:]}"
              for cell in state["cells"] for o in cell["outputs"]
              if o["type"] == "error" or (o["name"] == "stderr" and "Traceback" in o["text"])]
    assert not errors, "\n".join(errors)
    shown = page.evaluate(PAGE_ERRORS)
    assert not shown, "\n".join(shown)


@needs_browser
def test_panel_trains_and_stops_in_jupyterlab(lab, page):
    _open(page, lab, NOTEBOOK.name)
    assert page.evaluate(RUN_ALL) == "ok", "the kernel did not start within 90 s"

    # The panel rendered: its Train button and the (empty) plotly charts.
    train = page.locator(".nbtrain-panel button", has_text="Train")
    train.wait_for(state="visible", timeout=90_000)
    page.locator(".nbtrain-panel .js-plotly-plot").first.wait_for(state="visible")
    page.wait_for_function("() => !document.querySelector('.nbtrain-panel button')"
                           ".disabled")
    panel = page.locator(".nbtrain-panel")
    panel.screenshot(path=str(SHOTS / "panel_ready.png"))

    train.click()
    counts = _poll(page, _enough, 90, "5 points on the throughput, memory and LR charts")
    status = page.locator(".nbtrain-panel .nbtrain-status")
    assert "running" in status.inner_text(), status.inner_text()
    panel.screenshot(path=str(SHOTS / "panel_running.png"))

    stop = page.locator(".nbtrain-panel button", has_text="Stop")
    stop.click()
    _status_starts(page, "stopped")
    page.wait_for_timeout(600)   # the end flush has been drawn
    stopped = _points(page)
    page.wait_for_timeout(2000)
    later = _points(page)
    assert later == stopped, f"charts still grew after Stop: {stopped} -> {later}"
    assert _enough(stopped) and stopped["samples_per_s"] >= counts["samples_per_s"]

    # One toggle changed, Train again: a second run beside the first.
    batch = page.locator(".nbtrain-panel .widget-inline-hbox", has_text="batch size")
    batch.locator("input").fill("256")
    batch.locator("input").press("Enter")
    page.wait_for_timeout(300)
    train.click()
    _poll(page, _enough, 90, "points of run 2", label="run 2")
    page.wait_for_timeout(1500)
    stop.click()
    _status_starts(page, "stopped")
    page.wait_for_timeout(600)
    rows = page.locator(".nbtrain-panel table.nbtrain-runs tbody tr")
    assert rows.count() == 2 and "batch=256" in rows.nth(1).inner_text()
    assert _points(page) == stopped   # run 1 untouched by run 2
    panel.screenshot(path=str(SHOTS / "panel_stopped.png"))
    page.screenshot(path=str(SHOTS / "lab_stopped.png"))
    errors = page.locator("[data-mime-type='application/vnd.jupyter.error']")
    assert errors.count() == 0, errors.first.inner_text()
    if os.environ.get("NBTRAIN_README_SHOT"):   # refresh docs/panel.png only when asked
        README_SHOT.parent.mkdir(exist_ok=True)
        shutil.copy(SHOTS / "panel_stopped.png", README_SHOT)


def _trains_until_stopped(notebook: Path, into: Path, more: str = "") -> None:
    """A copy of `notebook` whose run goes on until Stop (max_steps far away), with the
    TrainConfig arguments `more` ("processes=2, ") added."""
    nb = json.loads(notebook.read_text())
    for cell in nb["cells"]:
        cell["source"] = re.sub(r"max_steps=[\d_]+,", f"max_steps=1_000_000, {more}",
                                "".join(cell["source"]))
    into.write_text(json.dumps(nb))


def _open_and_train(page, lab: Lab, name: str, timeout: float) -> None:
    """Open notebook `name`, run all its cells, press the panel's Train and wait until
    every chart holds 5 points."""
    _open(page, lab, name)
    assert page.evaluate(RUN_ALL) == "ok", "the kernel did not start within 90 s"
    train = page.locator(".nbtrain-panel button", has_text="Train")
    train.wait_for(state="visible", timeout=90_000)
    page.wait_for_function("() => !document.querySelector('.nbtrain-panel button').disabled")
    train.click()
    _poll(page, _enough, timeout, "5 points on the throughput, memory and LR charts")


def _grown(before: dict):
    """A predicate: every chart holds 5 points and reaches past the steps in `before`."""
    def grown(page) -> bool:
        ends = page.evaluate(LAST_STEPS, {"root": ".nbtrain-panel", "label": "run 1"})
        return _enough(_points(page)) and all(ends.get(n, 0) > before[n] for n in CHARTS)
    return grown


@needs_browser
def test_panel_charts_come_back_after_a_page_reload_and_keep_growing(lab, page):
    name = "panel_reload.ipynb"
    _trains_until_stopped(NOTEBOOK, lab.root / name)
    errors = []
    page.on("console", lambda m: errors.append(m.text) if "out of bounds" in m.text else None)
    _open_and_train(page, lab, name, timeout=90)

    # Reload the page while the kernel trains: the saved notebook holds the widget's view,
    # and the widget's state comes from the kernel.
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_timeout(1000)
    before = page.evaluate(LAST_STEPS, {"root": ".nbtrain-panel", "label": "run 1"})
    page.reload()
    page.locator(".nbtrain-panel .js-plotly-plot").first.wait_for(state="visible", timeout=90_000)
    _poll(page, _enough, 60, "the charts back with their points")
    deadline = time.monotonic() + 60
    while not _grown(before)(page):
        assert time.monotonic() < deadline, ("the charts did not grow after the reload: "
                                             f"{before} -> {_points(page)}")
        page.wait_for_timeout(250)
    page.locator(".nbtrain-panel").screenshot(path=str(SHOTS / "panel_reloaded.png"))
    assert not errors, errors[:3]
    page.locator(".nbtrain-panel button", has_text="Stop").click()
    _status_starts(page, "stopped")


def _rank_processes() -> list:
    """Children of the kernel's multiprocessing fork server (the ranks it started), found
    from this test's process tree: the lab server, its kernels, their fork servers."""
    servers = [p for p in psutil.Process().children(recursive=True)
               if "forkserver" in " ".join(_cmdline(p))]
    return [child for server in servers for child in _children(server)]


def _cmdline(proc) -> list:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _children(proc) -> list:
    try:
        return proc.children()
    except psutil.Error:
        return []


@needs_browser
def test_panel_with_two_processes_draws_live_and_stop_ends_every_rank(lab, page):
    name = "panel_processes.ipynb"
    _trains_until_stopped(NOTEBOOK, lab.root / name, more="processes=2, ")
    assert "processes=2" in (lab.root / name).read_text()
    _open_and_train(page, lab, name, timeout=180)   # the ranks start first
    assert len(_rank_processes()) == 2, "two rank processes train"
    status = page.locator(".nbtrain-panel .nbtrain-status")
    assert "running" in status.inner_text(), status.inner_text()
    page.locator(".nbtrain-panel").screenshot(path=str(SHOTS / "panel_processes.png"))

    page.locator(".nbtrain-panel button", has_text="Stop").click()
    _status_starts(page, "stopped")
    page.wait_for_timeout(600)
    stopped = _points(page)
    page.wait_for_timeout(2000)
    assert _points(page) == stopped, "charts still grew after Stop"
    assert _rank_processes() == [], "a rank process outlived Stop"
    errors = page.locator("[data-mime-type='application/vnd.jupyter.error']")
    assert errors.count() == 0, errors.first.inner_text()


STATIC_CELLS = [
    "import torch\nimport nbtrain as nt\nfrom nbtrain.tools.demo import digits_cnn\n"
    "torch.set_num_threads(1)\nx, y = nt.datasets.digits('train')",
    "config = nt.TrainConfig(device='cpu', amp='off', max_steps=60, log_every=2, batch_size=64)\n"
    "run = nt.fit(digits_cnn(), (x, y), torch.nn.functional.cross_entropy, config=config,\n"
    "             progress=lambda r: nt.Dashboard(r, live='static'))",
]


@needs_browser
def test_static_dashboard_renders_its_final_charts_in_jupyterlab(lab, page):
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": c, "outputs": [],
                     "execution_count": None} for c in STATIC_CELLS],
          "metadata": json.loads(NOTEBOOK.read_text())["metadata"], "nbformat": 4,
          "nbformat_minor": 5}
    (lab.root / "static.ipynb").write_text(json.dumps(nb))
    _open(page, lab, "static.ipynb")
    _start_run_all(page)
    _check_ran_cleanly(page, _wait_run_all(page, 120))
    root = ".jp-Notebook"
    assert "finished" in page.locator(root + " table.nbtrain-runs").inner_text()
    # JupyterLab's Plotly renderer draws a figure once and ignores later updates of its
    # output (jupyterlab-plotly 7.1 renderModel: `if (this.hasGraphElement()) return`), so
    # the final picture shows where it matters, in the saved notebook reopened.
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_timeout(1000)
    page.reload()
    page.locator(root + " .js-plotly-plot").first.wait_for(state="visible", timeout=90_000)
    assert _enough(_points(page, root=root)), _points(page, root=root)
    ends = page.evaluate(LAST_STEPS, {"root": root, "label": "run 1"})
    assert all(ends.get(name) == 60 for name in CHARTS), ends
    page.screenshot(path=str(SHOTS / "dashboard_static.png"))


def _start_run_all(page) -> None:
    assert page.evaluate(START_RUN_ALL) == "started", "the kernel did not start within 90 s"


MAGIC_OUTPUT = "[data-nbtrain-test] .jp-OutputArea"   # the %%fasttrain cell's output


def _run_magic_notebook(page, lab, name: str) -> int:
    """Open notebook `name`, mark its %%fasttrain cell and run all its cells; returns the
    magic cell's index (its output is MAGIC_OUTPUT)."""
    _open(page, lab, name)
    magic_cell = _mark_magic_cell(page)
    _start_run_all(page)
    return magic_cell


def _grow_live(page, state: dict, magic_cell: int, live: dict) -> bool:
    """While the magic cell still runs: the most points seen on each of its charts, into
    `live`; whether it still runs."""
    cell = next(c for c in state["cells"] if c["index"] == magic_cell)
    if state["runAll"] != "running" or cell["count"] is not None:
        return False
    counts = _points(page, root=MAGIC_OUTPUT)
    for name in CHARTS:
        live[name] = max(live.get(name, 0), counts.get(name, 0))
    return True


def _mark_magic_cell(page) -> int:
    """Mark the notebook's %%fasttrain cell (`[data-nbtrain-test]`), so its charts and
    output can be found in the page; returns its index."""
    page.wait_for_function("""() => {
      const cells = window.jupyterapp.shell.currentWidget.content.widgets;
      const i = cells.findIndex((c) => c.model.sharedModel.getSource().startsWith('%%fasttrain'));
      if (i >= 0) cells[i].node.setAttribute('data-nbtrain-test', String(i));
      return i >= 0;
    }""", timeout=30_000)
    return int(page.get_attribute("[data-nbtrain-test]", "data-nbtrain-test"))


@needs_browser
def test_fasttrain_panel_magic_draws_live_then_prints_the_summary(lab, page):
    magic_cell = _run_magic_notebook(page, lab, FASTTRAIN_NOTEBOOK.name)
    root = MAGIC_OUTPUT

    live = {}   # the most points seen on the charts while the cell was still running

    def watch(state: dict) -> None:
        _grow_live(page, state, magic_cell, live)

    state = _wait_run_all(page, 90, watch)
    _check_ran_cleanly(page, state)
    assert _enough(live), ("the dashboard did not draw 5 points on the throughput, memory and "
                           f"LR charts while the fit ran: {live}")

    # After the fit: the summary table ends the output, and the charts end at its last step.
    cell = next(c for c in state["cells"] if c["index"] == magic_cell)
    kinds = [o["type"] for o in cell["outputs"]]
    assert "display_data" in kinds, f"the dashboard was not displayed: {kinds}"
    last = cell["outputs"][-1]
    assert last["type"] == "stream" and last["name"] == "stdout", cell["outputs"]
    assert re.match(r"state\s+finished\n", last["text"]), last["text"]
    steps = re.search(r"^steps\s+(\d+)/\1$", last["text"], re.M)
    assert steps, last["text"]
    final = _points(page, root=root)
    assert _enough(final), final
    ends = page.evaluate(LAST_STEPS, {"root": root, "label": "run 1"})
    assert all(ends.get(name) == int(steps[1]) for name in CHARTS), (ends, steps[0])
    shown = page.locator(root + " .jp-OutputArea-child").last
    assert re.match(r"state\s+finished", shown.inner_text()), shown.inner_text()
    page.locator(root + " .js-plotly-plot").first.scroll_into_view_if_needed()
    page.locator("[data-nbtrain-test]").screenshot(
        path=str(SHOTS / "fasttrain_panel.png"))


@needs_browser
def test_quickstart_runs_all_cells_in_jupyterlab(lab, page):
    # The quickstart as a reader gets it, without its stored outputs, beside the picture it
    # shows (../docs/panel.png).
    notebook = json.loads(QUICKSTART.read_text())
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    (lab.root / "notebooks").mkdir(exist_ok=True)
    (lab.root / "notebooks" / QUICKSTART.name).write_text(json.dumps(notebook))
    if README_SHOT.exists():
        (lab.root / "docs").mkdir(exist_ok=True)
        shutil.copy(README_SHOT, lab.root / "docs" / README_SHOT.name)
    code_cells = sum(cell["cell_type"] == "code" for cell in notebook["cells"])

    _open(page, lab, f"notebooks/{QUICKSTART.name}")
    try:
        _start_run_all(page)
        state = _wait_run_all(page, 100)
        assert len(state["cells"]) == code_cells, (len(state["cells"]), code_cells)
        _check_ran_cleanly(page, state)
    finally:   # the end of the notebook as it was left, also when a cell failed
        page.screenshot(path=str(SHOTS / "quickstart.png"))


@needs_browser
def test_an_own_loop_under_fasttrain_draws_live_and_the_stop_button_ends_it(lab, page):
    magic_cell = _run_magic_notebook(page, lab, OWN_LOOP_NOTEBOOK.name)
    live, pressed = {}, []

    def watch(state: dict) -> None:
        if _grow_live(page, state, magic_cell, live):
            if _enough(live) and not pressed:   # the charts grow: press the stop button
                page.locator(MAGIC_OUTPUT + " .nbtrain-stop button").click()
                pressed.append(time.monotonic())
    state = _wait_run_all(page, 120, watch)
    assert pressed, f"the charts did not fill while the loop ran: {live}"
    _check_ran_cleanly(page, state)
    cells = {c["index"]: c for c in state["cells"]}
    texts = [o.get("text", "") for o in cells[magic_cell]["outputs"] if o["type"] == "stream"]
    assert any(re.match(r"state\s+interrupted\n", t) for t in texts), texts
    last = cells[magic_cell + 1]["outputs"][-1]
    assert last.get("text", "").strip() == "interrupted True True", last
    assert page.locator(MAGIC_OUTPUT + " .nbtrain-stop button").is_disabled()
    page.locator("[data-nbtrain-test]").screenshot(path=str(SHOTS / "own_loop_dashboard.png"))
