"""The Dashboard's bars of where a run's time and memory go, live: run.modules() as a bar per
module (its forward, its backward stacked on it), run.gaps() as a stacked bar beside the
step time, run.peak()'s parts as a stacked bar beside the memory; each read from the
figure's data (what a notebook holds or saves), under nt.fit and nt.watch, as a widget and
as a static figure."""
from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from nbtrain.auto import budget
from nbtrain.tables import Table
from nbtrain.telemetry.modules import ModuleTime, Peak, PeakPart

pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")
pytest.importorskip("plotly")

from nbtrain.views.dashboard import Dashboard  # noqa: E402
from nbtrain.views.series import MB, TOP_MODULES, TOP_PARTS, module_stack, peak_stack  # noqa: E402

LONG = 1_000_000   # max_steps of runs that the test stops


@pytest.fixture(scope="module")
def digits():
    return nt.datasets.digits("train", images=False)


@pytest.fixture
def generous(monkeypatch):
    """The whole run's time as the measuring budget: a watch's window opens within a few steps."""
    monkeypatch.setattr(budget, "SHARE", 1.0)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(embed=nn.Linear(64, 48), act=nn.ReLU(),
                                     head=nn.Linear(48, 10)))


def cfg(**overrides) -> nt.TrainConfig:
    base = dict(device="cpu", amp="off", batch_size=64, lr=3e-3, log_every=5, max_steps=LONG,
                num_workers=0, store=False, count_flops=False)
    return nt.TrainConfig(**{**base, **overrides})


def wait_until(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# -- reading the figure ---------------------------------------------------------------------
def figure_data(dash) -> list:
    """The traces as the notebook gets them: the Plotly JSON a static figure is shown (and
    saved) as, or the widget's figure."""
    with dash.lock:
        if dash.live == "static":
            return dash._figure_bundle()["application/vnd.plotly.v1+json"]["data"]
        return dash.figure.to_dict()["data"]


def bar_traces(data: list, chart: str, label: str = "run 1") -> list:
    return [t for t in data if t.get("type") == "bar" and t.get("meta") == chart
            and t.get("name") == label]


def module_bars(data: list, label: str = "run 1") -> dict:
    """The modules chart: module name -> (forward, backward) in ms a step."""
    out = {}
    for trace in bar_traces(data, "modules", label):
        for name, size, text in zip(trace["y"], trace["x"], trace["hovertext"]):
            forward, backward = out.get(name, (None, None))
            out[name] = (size, backward) if " forward: " in text else (forward, size)
    return out


def segments(data: list, chart: str, label: str = "run 1") -> list:
    """The run's one stacked bar in `chart`, bottom up: (the segment's name, its size)."""
    points = [(base, layer, text, size)
              for layer, trace in enumerate(bar_traces(data, chart, label))
              for base, text, size in zip(trace["base"], trace["text"], trace["y"])]
    return [(text, size) for _, _, text, size in sorted(points)]


def note(dash, chart: str) -> str:
    """A bar chart's note as one line (the figure wraps it with <br>)."""
    with dash.lock:
        text = dash.figure.layout.annotations[dash.renderer.notes[chart]].text
    return text.replace("<br>", " ")


def peak_parts(peak) -> list:
    """run.peak()'s parts as the bar names them: a module's activations by the module."""
    return [(p.part if p.kind in (p.part, "other") else f"{p.part} {p.kind}", p.bytes / MB)
            for p in peak.parts if p.bytes]


def assert_bars_show_the_tables(data: list, run) -> None:
    rows = run.modules()
    assert rows, rows.note
    bars = module_bars(data)
    assert list(bars) == [row.name for row in rows[:TOP_MODULES]]   # the largest share first
    for row in rows[:TOP_MODULES]:
        assert bars[row.name] == pytest.approx((row.forward_s * 1e3, row.backward_s * 1e3))
    gaps = run.gaps()
    assert segments(data, "gaps") == [(row["part"], pytest.approx(row["seconds"]))
                                      for row in gaps]
    peak = run.peak()
    assert segments(data, "peak") == [(name, pytest.approx(size))
                                      for name, size in peak_parts(peak)]
    assert sum(size for _, size in segments(data, "peak")) == pytest.approx(peak.bytes / MB)


# -- nt.fit -------------------------------------------------------------------------------------
@pytest.mark.parametrize("live", ["widget", "static"])
def test_a_fits_bars_show_its_modules_gaps_and_peak_while_it_trains(digits, live):
    run = nt.fit(mlp(), digits, F.cross_entropy, config=cfg(), background=True, progress=False)
    dash = Dashboard(run, show=False, live=live, interval=0.05)
    try:
        wait_until(lambda: module_bars(figure_data(dash)), what="the modules' bars")
        training = run.running
        during = figure_data(dash)
        wait_until(lambda: segments(figure_data(dash), "gaps")[0][1]
                   > segments(during, "gaps")[0][1], what="the wall time's bar to grow")
    finally:
        run.stop()
        run.wait(30)
    assert dash.reporter.join(5)   # the end drawn, by the drawing thread
    assert training, "the bars came only after the run ended"
    assert set(module_bars(during)) == {"embed", "act", "head"}
    data = figure_data(dash)
    assert_bars_show_the_tables(data, run)
    assert [name for name, _ in segments(data, "gaps")] == [
        "steps", "evaluation", "saving", "loader start", "your code"]
    assert {"embed activations", "parameters", "gradients", "optimizer state"} <= {
        name for name, _ in segments(data, "peak")}
    assert note(dash, "modules") == note(dash, "peak") == ""
    dash.close()


def test_a_run_without_a_window_says_why_in_its_modules_and_peak_charts(digits):
    made = []
    short = nt.fit(mlp(), digits, F.cross_entropy, config=cfg(max_steps=30),
                   progress=lambda run: made.append(Dashboard(run, show=False, live="static")))
    (dash,) = made
    dash.flush()
    data = figure_data(dash)
    assert not module_bars(data) and not segments(data, "peak")
    assert note(dash, "modules") == f"run 1: {short.modules().note}"
    assert note(dash, "peak") == f"run 1: {short.peak().parts.note}"
    assert short.modules().note.startswith("not measured: the run made 30 steps")
    assert [name for name, _ in segments(data, "gaps")][0] == "steps"

    # Beside a run that has bars, the note keeps its first clause.
    measured = nt.fit(mlp(), digits, F.cross_entropy, config=cfg(max_steps=100), progress=False)
    dash.add(measured)
    data = figure_data(dash)
    assert set(module_bars(data, "run 2")) == {"embed", "act", "head"}
    assert note(dash, "modules") == note(dash, "peak") == "run 1: not measured"
    dash.close()


def test_each_table_is_read_once_a_redraw_at_most_and_an_unchanged_one_is_not_redrawn(digits):
    run = nt.fit(mlp(), digits, F.cross_entropy, config=cfg(log_every=1), background=True,
                 progress=False)
    inside, per_draw, redrawn = threading.local(), [], Counter()
    for name in ("modules", "peak", "gaps"):
        read = getattr(run, name)

        def counted(read=read, name=name):
            if getattr(inside, "draw", False):
                per_draw[-1][name] += 1
            return read()
        setattr(run, name, counted)   # this Run only
    dash = Dashboard(show=False, live="widget", interval=0.02)
    draw, draw_bar = dash.reporter.draw, dash.renderer._draw_bar

    def counted_draw():
        per_draw.append(Counter())
        inside.draw = True
        try:
            draw()
        finally:
            inside.draw = False

    def counted_bar(slot, chart, stack):
        redrawn[chart] += 1
        draw_bar(slot, chart, stack)
    dash.reporter.draw, dash.renderer._draw_bar = counted_draw, counted_bar
    dash.add(run)
    try:
        wait_until(lambda: run.records("modules") and module_bars(figure_data(dash)),
                   what="the modules' bars")
        measured_at = len(per_draw)
        wait_until(lambda: len(per_draw) >= measured_at + 10, what="10 more draws")
    finally:
        run.stop()
        run.wait(30)
    assert dash.reporter.join(5)
    assert all(max(reads.values(), default=0) <= 1 for reads in per_draw), per_draw
    reads = sum(per_draw, Counter())
    # modules and peak: on the first draw, after the window's record and at the end
    assert reads["modules"] == reads["peak"] <= 3, reads
    assert reads["gaps"] > reads["modules"] + 5   # the wall time runs: read each redraw
    # drawn when their table changed: not measured yet (the note), then measured; not again
    # at the end, whose table is the same
    assert 1 <= redrawn["modules"] == redrawn["peak"] <= 2, redrawn
    assert redrawn["gaps"] > 5
    dash.close()


# -- nt.watch ---------------------------------------------------------------------------------
def test_a_watched_loop_draws_its_bars_live(generous, digits, tmp_path):
    x, y = digits
    train = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    val = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=128)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    made, seen = [], []
    with nt.watch(progress=lambda run: made.append(Dashboard(run, show=False)),
                  optimize=False, store=False, count_flops=False) as run:
        for epoch in range(3):
            for xb, yb in train:
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
            with torch.no_grad():   # an evaluation pass: another loader, between steps
                for xb, _ in val:
                    model(xb)
            torch.save(model.state_dict(), tmp_path / "digits.pt")   # saving
            made[0].flush()   # what the charts show now, while the loop trains
            seen.append((run.state, module_bars(figure_data(made[0]))))
    (dash,) = made
    dash.reporter.join(5)
    dash.flush()
    assert any(state == "running" and set(bars) == {"embed", "act", "head"}
               for state, bars in seen), seen
    data = figure_data(dash)
    assert_bars_show_the_tables(data, run)
    gaps = dict(segments(data, "gaps"))
    assert gaps["evaluation"] > 0 and gaps["saving"] > 0 and gaps["your code"] > 0
    assert "embed activations" in dict(segments(data, "peak"))
    assert note(dash, "modules") == ""
    dash.close()


# -- what the bars hold -------------------------------------------------------------------------
def test_the_modules_chart_keeps_the_top_rows_and_the_peak_sums_the_rest():
    rows = Table([ModuleTime(f"layer{i}", 0.001 * (12 - i), 0.002, 0.0, 1.0) for i in range(12)],
                 "over steps 21-23")
    stack = module_stack(rows)
    assert stack.bar == tuple(f"layer{i}" for i in range(TOP_MODULES)) * 2
    assert stack.base[TOP_MODULES:] == stack.size[:TOP_MODULES]   # backward on forward
    parts = [PeakPart(f"layer{i}", "activations", (20 - i) * MB) for i in range(10)]
    peak = Peak(sum(p.bytes for p in parts), Table(parts + [PeakPart("other", "other", 0)], ""))
    stack = peak_stack(peak, "run 1")
    assert stack.part[-1] == "the rest" and len(stack.part) == TOP_PARTS + 1
    assert stack.base[-1] + stack.size[-1] == pytest.approx(peak.bytes / MB)   # all of it
