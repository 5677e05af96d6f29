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

The browser test needs /usr/bin/chromium (`.ci/install-browser`), playwright, jupyterlab
and anywidget, and is skipped with the reason where one is missing.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).parent
HEADLESS_NOTEBOOK = HERE / "browser" / "panel_headless.ipynb"
NOTEBOOK = HERE / "browser" / "panel_digits.ipynb"
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


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving a copy of the notebook, on 127.0.0.1 with a token; always shut down."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
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
        yield base, token
    finally:
        _shut_down(server, base, token)
        log.close()


# How many points each trace of a run holds, read from plotly's gd.data in the page.
COUNT_POINTS = """(label) => {
  const out = {};
  for (const gd of document.querySelectorAll('.nbtrain-panel .js-plotly-plot')) {
    for (const t of gd.data || []) {
      if (t.legendgroup === label && t.x) out[t.meta] = t.x.length;
    }
  }
  return out;
}"""

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


def _enough(counts: dict) -> bool:
    return all(counts.get(name, 0) >= 5 for name in CHARTS)


def _points(page, label: str = "run 1") -> dict:
    return page.evaluate(COUNT_POINTS, label)


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


@needs_browser
def test_panel_trains_and_stops_in_jupyterlab(lab):
    from playwright.sync_api import sync_playwright
    base, token = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1500})
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}")
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                   " && window.jupyterapp.shell.currentWidget.context", timeout=90_000)
            page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
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
        finally:
            browser.close()
    if os.environ.get("NBTRAIN_README_SHOT"):   # refresh docs/panel.png only when asked
        README_SHOT.parent.mkdir(exist_ok=True)
        shutil.copy(SHOTS / "panel_stopped.png", README_SHOT)
