"""Re-run the tutorial notebooks and store them with their outputs, ready to commit.

    .venv/bin/python notebooks/refresh.py                 # every notebook
    .venv/bin/python notebooks/refresh.py 03_mixed_precision.ipynb
    .venv/bin/python notebooks/refresh.py --png-only          # chart images, nothing run

For each notebook: execute it top to bottom in a fresh kernel (cwd = notebooks/), then
- strip widget state (`metadata.widgets` and the widget-view part of each output; the
  text/plain fallback stays), so files stay small and GitHub shows text, not errors;
- add a PNG beside each Plotly chart when kaleido can render one (pip install kaleido;
  it needs Chrome or Chromium: BROWSER_PATH=/usr/bin/chromium for Debian's), so the charts
  also show on GitHub. JupyterLab still
  draws the interactive chart; nbval ignores images;
- print the wall time and the file size (the tests want < 60 s on 2 cores and < 1 MB);
- write the machine into the notebook's metadata (`metadata.nbtrain`: CPU, its bf16 units,
  torch's version, the load), so a reader of the stored timings knows where they came from.

Stored timings are what readers see first, so it refuses to save under load: when the
1-minute load average is above half the cores as it starts, or when the CPUs are more
than half busy in the seconds before a notebook starts (nothing of ours runs then; that
notebook and the rest are left as they were). `--allow-load` saves anyway, for a draft.
The metadata says how busy it was: `others_busy` is the share of the CPUs that processes
other than this script and the kernels it reaped used while the notebook ran (an upper
bound: it includes what a notebook started and left running, Ray's daemons say).

Outputs that nbval checks (`# NBVAL_CHECK_OUTPUT` cells) must stay the same from run to
run: `pytest --nbval-lax notebooks/` after a refresh shows whether they do.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
PLOTLY = "application/vnd.plotly.v1+json"
MAX_BYTES = 1_000_000


def strip_widgets(nb) -> int:
    """Drop widget state and widget views; returns the number of outputs changed.

    A progress bar's text fallback was taken when it was displayed, at 0%; it is rewritten
    from the bar's final state first, so the stored notebook shows where it ended.
    """
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    nb.metadata.pop("widgets", None)
    changed = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW in data:
                final = progress_text(state, data[WIDGET_VIEW].get("model_id"))
                if final:
                    data["text/plain"] = final
                del data[WIDGET_VIEW]
                changed += 1
                if not data:   # a view with no fallback: nothing readable is left
                    continue
            kept.append(out)
        cell.outputs = kept
    return changed


def progress_text(state: dict, model_id) -> str:
    """'desc: 100%|##########| 230/230 [...]' for a tqdm bar's HBox(HTML, FloatProgress, HTML)."""
    import html
    box = state.get(model_id, {})
    if box.get("model_name") != "HBoxModel":
        return ""
    parts = [state.get(ref.replace("IPY_MODEL_", ""), {}) for ref in box["state"].get("children", [])]
    if [p.get("model_name") for p in parts] != ["HTMLModel", "FloatProgressModel", "HTMLModel"]:
        return ""
    left, bar, right = (p.get("state", {}) for p in parts)
    filled = int(10 * bar.get("value", 0) / (bar.get("max") or 1))
    return (f"{html.unescape(left.get('value', ''))}|{'█' * filled}{' ' * (10 - filled)}| "
            f"{html.unescape(right.get('value', ''))}").replace("\xa0", " ")


def png_renderer():
    """A function chart-json -> PNG bytes, or None where kaleido cannot render."""
    try:
        import plotly.io as pio
        import kaleido  # noqa: F401
    except ImportError:
        return None

    def render(figure: dict) -> bytes:
        fig = pio.from_json(json.dumps(figure))
        height = fig.layout.height or 450
        return smaller_png(fig.to_image(format="png", width=900, height=height, scale=1))
    return render


def smaller_png(data: bytes) -> bytes:
    """The same chart in a 256-colour palette: about a third of the bytes, looks the same."""
    try:
        import io
        from PIL import Image
    except ImportError:
        return data
    image = Image.open(io.BytesIO(data)).convert("RGB").quantize(colors=256)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue() if out.tell() < len(data) else data


def add_pngs(nb, render) -> int:
    import base64
    added = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY in data and "image/png" not in data:
                data["image/png"] = base64.b64encode(render(data[PLOTLY])).decode()
                added += 1
    return added


BUSY_LIMIT = 0.5   # of the cores, taken by other processes


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def load_refusal() -> str:
    """Why the machine is too busy to start, or ''."""
    load = os.getloadavg()[0]
    if load <= BUSY_LIMIT * cores():
        return ""
    return (f"load average {load:.1f} on {cores()} cores (above half of them): other work "
            "would slow the stored timings. Wait for an idle machine, or pass --allow-load "
            "for a draft.")


class CpuShare:
    """The share of all cores that processes other than this script and the kernels it
    started (reaped, so counted in os.times' children) used between start and stop."""

    def __enter__(self):
        import psutil
        self._busy0, self._ours0, self._t0 = self._busy(psutil), self._ours(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        import psutil
        wall = time.perf_counter() - self._t0
        others = (self._busy(psutil) - self._busy0) - (self._ours() - self._ours0)
        self.others = max(0.0, others / (wall * cores())) if wall > 0 else 0.0

    @staticmethod
    def _busy(psutil) -> float:
        t = psutil.cpu_times()
        return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))

    @staticmethod
    def _ours() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system


def machine_metadata(load: float, others: float) -> dict:
    import torch
    from nbtrain.machine import cpu_bf16_feature
    from nbtrain.machine import cpu_model
    return {"cpu": cpu_model(), "cores": cores(), "bf16": cpu_bf16_feature() or "none",
            "torch": torch.__version__, "load_average": round(load, 2),
            "others_busy": round(others, 2),
            "saved": datetime.date.today().isoformat()}


def busy_before() -> float:
    """The share of the CPUs in use over 2 s while nothing of ours runs."""
    import psutil
    return psutil.cpu_percent(interval=2.0) / 100


def refresh(path: Path, timeout: int, render, allow_load: bool) -> tuple:
    """Execute and store one notebook; returns (seconds, bytes, pngs, others' share)."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with CpuShare() as share:
        client.execute()
    seconds = time.perf_counter() - start
    strip_widgets(nb)
    pngs = add_pngs(nb, render) if render else 0
    nb.metadata["nbtrain"] = machine_metadata(load, share.others)
    nbformat.write(nb, path)
    return seconds, path.stat().st_size, pngs, share.others


def add_pngs_only(paths) -> int:
    render = png_renderer()
    if render is None:
        print("kaleido is not installed, or finds no browser: pip install kaleido, and "
              "BROWSER_PATH=/usr/bin/chromium")
        return 1
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        added = add_pngs(nb, render)
        nbformat.write(nb, path)
        print(f"{path.name:<34}{added} chart image(s), {path.stat().st_size / 1024:.0f} KiB")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="file names in notebooks/ (default: all)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    parser.add_argument("--no-png", action="store_true", help="do not add chart images")
    parser.add_argument("--allow-load", action="store_true",
                        help="save even when other processes load the machine (a draft)")
    parser.add_argument("--png-only", action="store_true",
                        help="only add chart images to the stored outputs; run nothing")
    args = parser.parse_args(argv)
    if args.png_only:
        return add_pngs_only([HERE / n for n in args.notebooks]
                             or sorted(HERE.glob("[0-9][0-9]_*.ipynb")))
    refusal = "" if args.allow_load else load_refusal()
    if refusal:
        print(f"refusing to save: {refusal}")
        return 2
    paths = [HERE / n for n in args.notebooks] or sorted(HERE.glob("[0-9][0-9]_*.ipynb"))
    render = None if args.no_png else png_renderer()
    if render is None and not args.no_png:
        print("kaleido is not installed: charts get no PNG (pip install kaleido)")
    failed = False
    for path in paths:
        busy = busy_before()
        if busy > BUSY_LIMIT and not args.allow_load:
            print(f"{path.name:<34}NOT RUN: the CPUs were {busy:.0%} busy before it started; "
                  "it and the rest are left as they were", flush=True)
            return 2
        seconds, size, pngs, others = refresh(path, args.timeout, render, args.allow_load)
        flag = "" if seconds < 60 and size < MAX_BYTES else "   <-- over 60 s or 1 MB"
        failed |= bool(flag)
        print(f"{path.name:<34}{seconds:6.1f} s {size / 1024:7.0f} KiB  {pngs} chart image(s)"
              f"  others {others:.0%}{flag}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
