"""nt.Panel and nt.Dashboard driven from Python: set controls, press buttons, read the charts.

Everything runs on the CPU with a small MLP on the digits data, in this process; the
notebook kernel (nbval) and the real browser are in test_browser.py.
"""
from __future__ import annotations

import html
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt

pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")
pytest.importorskip("plotly")

from nbtrain.config import FIELD_NAMES, GROUPS, SETTINGS  # noqa: E402
from nbtrain.views.dashboard import Dashboard  # noqa: E402
from nbtrain.views.plotly_renderer import CHARTS  # noqa: E402
from nbtrain.views.series import Decimated, log_axis, planned_lr  # noqa: E402
from nbtrain.ui.panel import Panel  # noqa: E402

LONG = 1_000_000   # max_steps of runs that the test stops


@pytest.fixture(scope="module")
def digits():
    return nt.datasets.digits("train", images=False), nt.datasets.digits("val", images=False)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def cfg(**overrides) -> nt.TrainConfig:
    base = dict(device="cpu", amp="off", batch_size=64, lr=3e-3, log_every=5, max_steps=50,
                num_workers=0)
    base.update(overrides)
    return nt.TrainConfig(**base)


@pytest.fixture
def make_panel(digits):
    made = []

    def make(config=None, **kwargs):
        (x, y), val = digits
        panel = Panel(mlp(), (x, y), F.cross_entropy, config=config or cfg(), **kwargs)
        made.append(panel)
        return panel
    yield make
    for panel in made:   # no run outlives its test
        if panel.run is not None:
            panel.run.stop()
            panel.run.wait(10)
        panel.dashboard.close()


def wait_until(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def finish(panel):
    """Wait for the run and for the drawing thread's last (end) draw."""
    panel.run.wait(30)
    assert panel.dashboard.reporter.join(5)


def set_value(panel, field, value):
    panel.controls[field].widget.value = value


# -- controls -> TrainConfig ------------------------------------------------------------------
def test_every_toggle_of_the_issue_has_a_control(make_panel):
    panel = make_panel()
    wanted = {"amp", "pin_memory", "num_workers", "prefetch_factor", "persistent_workers",
              "data_on_device", "batch_size", "epochs", "optimizer", "lr", "weight_decay",
              "momentum", "betas", "scheduler", "warmup_steps", "min_lr", "cycle_steps",
              "step_size", "gamma", "pct_start", "div_factor", "final_div_factor"}
    assert wanted <= set(panel.controls)


def test_every_config_field_has_a_control_on_its_groups_tab(make_panel):
    panel = make_panel()
    assert set(panel.controls) == set(FIELD_NAMES)
    for tab, controls in panel.groups.items():
        assert {GROUPS[SETTINGS[c.field].group][1] for c in controls} == {tab}


def test_text_boxes_read_empty_as_none_and_name_a_bad_value(make_panel):
    panel = make_panel()
    set_value(panel, "checkpoint_dir", "ckpts")
    set_value(panel, "clip_grad_norm", "0.5")
    assert (panel.config.checkpoint_dir, panel.config.clip_grad_norm) == ("ckpts", 0.5)
    set_value(panel, "clip_grad_norm", "")
    assert panel.config.clip_grad_norm is None
    set_value(panel, "clip_grad_norm", "high")
    assert "TrainConfig.clip_grad_norm='high' is not allowed: expected a number &gt; 0, or " \
        "empty" in panel.controls["clip_grad_norm"].error.value
    assert panel.config.clip_grad_norm is None   # the last valid settings stay


def test_controls_write_the_config(make_panel):
    panel = make_panel()
    for field, value in [("amp", "bf16"), ("pin_memory", True), ("num_workers", 2),
                         ("num_threads", 1), ("prefetch_factor", 4), ("persistent_workers", True),
                         ("data_on_device", False), ("batch_size", 128), ("epochs", 3),
                         ("max_steps", ""), ("optimizer", "sgd"), ("lr", 0.05),
                         ("weight_decay", 1e-4), ("momentum", 0.8), ("nesterov", True),
                         ("scheduler", "cyclic"), ("warmup_steps", 10), ("min_lr", 1e-4),
                         ("cycle_steps", 40)]:
        set_value(panel, field, value)
        assert panel.error == "", (field, panel.error)
    c = panel.config
    assert (c.amp, c.pin_memory, c.num_workers, c.prefetch_factor, c.persistent_workers) == \
        ("bf16", True, 2, 4, True) and c.num_threads == 1
    assert (c.data_on_device, c.batch_size, c.epochs, c.max_steps) == (False, 128, 3, None)
    assert (c.optimizer, c.lr, c.weight_decay, c.momentum, c.nesterov) == ("sgd", 0.05, 1e-4, 0.8, True)
    assert (c.scheduler, c.warmup_steps, c.min_lr, c.cycle_steps) == ("cyclic", 10, 1e-4, 40)


def test_adam_betas_and_onecycle_parameters(make_panel):
    panel = make_panel()
    set_value(panel, "optimizer", "adam")
    b1, b2 = panel.controls["betas"].inputs
    b1.value, b2.value = 0.85, 0.99
    set_value(panel, "scheduler", "onecycle")
    set_value(panel, "pct_start", 0.25)
    set_value(panel, "div_factor", 10.0)
    assert panel.config.betas == (0.85, 0.99)
    assert (panel.config.pct_start, panel.config.div_factor) == (0.25, 10.0)


def test_only_the_chosen_optimizer_and_schedule_parameters_are_shown(make_panel):
    panel = make_panel()
    shown = lambda field: panel.controls[field].row.layout.display != "none"  # noqa: E731
    set_value(panel, "optimizer", "sgd")
    set_value(panel, "scheduler", "step")
    assert shown("momentum") and shown("nesterov") and not shown("betas")
    assert shown("step_size") and shown("gamma") and not shown("cycle_steps")
    set_value(panel, "optimizer", "adamw")
    set_value(panel, "scheduler", "cyclic")
    assert shown("betas") and not shown("momentum")
    assert shown("cycle_steps") and shown("min_lr") and not shown("step_size")


def test_invalid_combination_shows_the_config_error_beside_the_control(make_panel):
    panel = make_panel()
    before = panel.config
    set_value(panel, "num_workers", 0)
    set_value(panel, "persistent_workers", True)
    error = panel.controls["persistent_workers"].error.value
    assert "TrainConfig.persistent_workers=True is not allowed" in error
    assert "num_workers=0" in error and "Traceback" not in error
    assert panel.config == before.replace(num_workers=0)   # the last valid settings stay
    assert panel.train_button.disabled
    assert panel.train() is None and panel.run is None
    set_value(panel, "persistent_workers", False)
    assert panel.error == "" and panel.controls["persistent_workers"].error.value == ""
    assert not panel.train_button.disabled


def test_bad_value_error_names_field_value_and_what_is_allowed(make_panel):
    panel = make_panel()
    set_value(panel, "lr", -1.0)
    assert "TrainConfig.lr=-1.0 is not allowed: expected a number &gt; 0" in \
        panel.controls["lr"].error.value
    set_value(panel, "max_steps", "lots")
    assert "TrainConfig.max_steps='lots'" in panel.controls["max_steps"].error.value


def test_error_of_a_hidden_setting_shows_at_the_control_just_changed(make_panel):
    panel = make_panel()
    set_value(panel, "optimizer", "sgd")
    set_value(panel, "nesterov", True)
    set_value(panel, "optimizer", "adamw")   # nesterov is now hidden, and invalid
    assert "TrainConfig.nesterov=True" in panel.controls["optimizer"].error.value
    assert panel.controls["nesterov"].error.value == ""


# -- the LR preview ---------------------------------------------------------------------------
def test_lr_chart_previews_the_schedule_before_training(make_panel):
    panel = make_panel(cfg(max_steps=300, scheduler="cosine", warmup_steps=30))
    preview = panel.dashboard.renderer.traces["next"]
    expected = nt.schedule_preview(panel.config, 300)
    assert preview.visible and len(preview.x) == 300
    assert np.allclose(preview.y, expected) and preview.x[0] == 1 and preview.x[-1] == 300
    set_value(panel, "scheduler", "step")   # redrawn at once, no training needed
    set_value(panel, "step_size", 100)
    set_value(panel, "gamma", 0.5)
    assert np.allclose(preview.y, nt.schedule_preview(panel.config, 300))
    assert preview.y[-1] == pytest.approx(3e-3 * 0.25)
    assert panel.run is None


def test_preview_counts_steps_from_epochs_and_batch_size(make_panel, digits):
    panel = make_panel(cfg(max_steps=None, epochs=2, batch_size=100))
    n = len(digits[0][0])
    assert panel.dashboard.renderer.traces["next"].x[-1] == 2 * -(-n // 100)


# -- Train, Stop, Resume ------------------------------------------------------------------------
def test_train_stop_resume(make_panel):
    panel = make_panel(cfg(max_steps=LONG))
    assert panel.stop_button.disabled and panel.resume_button.disabled
    panel.train_button.click()
    run = panel.run
    wait_until(lambda: len(run.records()) >= 3, what="3 records")
    assert panel.train_button.disabled and not panel.stop_button.disabled
    panel.stop_button.click()
    finish(panel)
    assert run.state == "stopped" and 0 < run.step < LONG
    assert panel.status_text().startswith(f"stopped · step {run.step:,}/{LONG:,}")
    assert "stopped" in panel.status.value and not panel.resume_button.disabled

    panel.resume_button.click()
    resumed = panel.run
    assert resumed is not run and panel.runs == [resumed]
    wait_until(lambda: resumed.step > run.step + 10, what="the resumed run to go on")
    panel.stop_button.click()
    finish(panel)
    assert len(panel.dashboard.slots) == 1   # the same line and row as before
    steps = panel.dashboard.trace("run 1", "samples_per_s").x
    assert steps[-1] == resumed.step and np.all(np.diff(steps) > 0)


def test_status_of_an_ended_run_shows_the_runs_rate_as_the_table_does(make_panel):
    panel = make_panel(cfg(max_steps=LONG))
    panel.train_button.click()
    run = panel.run
    wait_until(lambda: len(run.records()) >= 3, what="3 records")
    panel.stop_button.click()
    finish(panel)
    rate = f"{run.summary()['samples_per_s']:,.0f} samples/s"
    assert rate in panel.status_text(), (rate, panel.status_text())
    assert f"<td style='padding:2px 8px;white-space:nowrap'>{rate[:-10]}</td>" \
        in panel.dashboard.table.value


def test_report_button_writes_the_last_runs_report_and_links_it(make_panel, tmp_path,
                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)   # the report lands beside the notebook: the kernel's folder
    panel = make_panel(cfg(max_steps=20))
    assert panel.report_button.disabled
    panel.train_button.click()
    finish(panel)
    assert not panel.report_button.disabled
    panel.report_button.click()
    text = (tmp_path / "nbtrain-run-1.html").read_text()
    assert "plotly.js v" in text and "settings used" in text
    assert "href='nbtrain-run-1.html'" in panel.message.value
    panel.train_button.click()   # a new run: the old report's link goes
    assert "nbtrain-run-1.html" not in panel.message.value
    finish(panel)


def test_each_train_adds_a_line_and_a_table_row_from_the_same_start(make_panel):
    panel = make_panel(cfg(max_steps=20))   # inside the first epoch: a record every 5 steps
    panel.train_button.click()
    finish(panel)
    set_value(panel, "batch_size", 32)
    panel.train_button.click()
    finish(panel)
    set_value(panel, "batch_size", 64)
    panel.train_button.click()
    finish(panel)
    first, second, third = panel.runs
    assert not first.optimizer.state and not second.optimizer.state   # released for the next
    assert third.optimizer.state
    assert [s.label for s in panel.dashboard.slots] == ["run 1", "run 2", "run 3"]
    table = panel.dashboard.table.value
    assert table.count("<tr>") == 4 and "batch=32" in table and "finished" in table
    for label in ("run 1", "run 2", "run 3"):
        assert len(panel.dashboard.trace(label, "samples_per_s").x) == 4
    # Every Train starts from the initial weights: same settings, same losses.
    assert [r["loss"] for r in first.records()] == [r["loss"] for r in third.records()]
    assert first.records()[0]["loss"] != second.records()[0]["loss"]


def test_the_last_two_runs_are_compared_per_step_once_both_ended(make_panel):
    panel = make_panel(cfg(max_steps=20))   # 4 records: 3 after the warm-up one
    panel.train_button.click()
    finish(panel)
    assert panel.compared.value == ""   # one run: nothing to compare
    set_value(panel, "batch_size", 32)
    panel.train_button.click()
    finish(panel)
    first, second = panel.runs
    expected = nt.diff(first, second, labels=("run 1", "run 2")).text().splitlines()
    shown = panel.compared.value
    assert "run 2 against run 1 (nt.diff):<br><b>" in shown
    assert f"<b>{html.escape(expected[0])}</b>" in shown
    assert "batch_size 64 -&gt; 32" in shown and "time split: " in shown


def test_status_shows_progress_eta_and_what_auto_resolved(make_panel):
    panel = make_panel(cfg(max_steps=LONG, num_workers="auto", pin_memory="auto"))
    panel.train_button.click()
    wait_until(lambda: "ETA" in panel.status.value, what="the ETA")
    text = panel.status_text()
    assert re.match(r"running · step [\d,]+/1,000,000 · [\d,]+ samples/s · ETA \d+:\d\d", text), text
    resolved = panel.settings.value
    assert "num_workers" in resolved and "batched fetch beats worker processes" in resolved
    assert "pin_memory" in resolved and "no host-to-GPU copy" in resolved


def test_live_lr_change_applies_at_the_next_step_and_shows_on_the_lr_chart(make_panel):
    panel = make_panel(cfg(max_steps=LONG, log_every=2))
    panel.train_button.click()
    run = panel.run
    wait_until(lambda: len(run.records()) >= 2, what="records")
    at = run.step   # every step counted here had started, with the old LR, before the change
    set_value(panel, "lr", 0.0123)
    assert run.schedule.base_lr == 0.0123
    wait_until(lambda: any(r["lr"] == 0.0123 for r in run.records()), what="the new lr")
    assert all(r["lr"] == 3e-3 for r in run.records() if r["step"] <= at)
    wait_until(lambda: 0.0123 in panel.dashboard.trace("run 1", "lr").y, what="the chart")
    planned = panel.dashboard.trace("run 1", "lr", buffer="planned")
    assert planned.y[0] == 3e-3 and planned.y[-1] == 0.0123


def test_rebuild_settings_wait_for_the_next_train(make_panel):
    panel = make_panel(cfg(max_steps=LONG))
    panel.train_button.click()
    run = panel.run
    set_value(panel, "amp", "bf16")
    set_value(panel, "batch_size", 32)
    assert run.config.amp == "off" and run.config.batch_size == 64
    wait_until(lambda: "applies at the next Train: batch_size, amp" in panel.message.value
               or "applies at the next Train: amp, batch_size" in panel.message.value,
               what="the pending-settings note")
    panel.stop_button.click()
    finish(panel)
    assert panel.train().config.amp == "bf16"


def test_settings_only_the_engine_can_check_show_as_text(make_panel):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    panel = make_panel()
    set_value(panel, "device", "cuda")
    panel.train_button.click()   # raises nothing
    assert panel.run is None
    assert "TrainConfig.device='cuda' is not available" in panel.controls["device"].error.value
    assert "could not start" in panel.message.value


def test_resume_refuses_another_optimizer_with_a_fix(make_panel):
    panel = make_panel(cfg(max_steps=LONG))
    panel.train_button.click()
    wait_until(lambda: panel.run.step > 5)
    panel.stop_button.click()
    finish(panel)
    set_value(panel, "optimizer", "sgd")
    assert panel.resume() is None
    assert "Resume keeps the optimizer of the stopped run (adamw)" in panel.message.value


# -- the dashboard --------------------------------------------------------------------------
def background_fit(digits, **overrides):
    (x, y), val = digits
    return nt.fit(mlp(), (x, y), F.cross_entropy, config=cfg(**overrides), val_data=val,
                  background=True, progress=False)


def test_charts_are_bounded_numpy_and_end_where_training_ended(digits):
    run = background_fit(digits, max_steps=1500, log_every=1)
    dash = Dashboard(run, max_points=100)
    run.wait(30)
    assert dash.reporter.join(5)   # no flush() by the test: the "end" record drew it
    for key, trace in dash.renderer.traces.items():
        assert len(trace.x) <= 101, key
        assert isinstance(trace.y, np.ndarray) and trace.y.dtype == np.float64
    throughput = dash.trace("run 1", "samples_per_s")
    assert throughput.x[-1] == 1500 and len(throughput.x) >= 50
    assert "finished" in dash.table.value and "1500/1500" in dash.table.value


def test_series_without_data_get_no_trace(digits):
    run = background_fit(digits, max_steps=30, telemetry=False)   # an epoch ends: validation
    dash = Dashboard(run)
    run.wait(30)
    dash.reporter.join(5)
    columns = {key[2] for key in dash.renderer.traces if key != "next"}
    assert {"samples_per_s", "loss", "lr", "val_loss"} <= columns
    assert not columns & {"cuda_allocated_mb", "cuda_reserved_mb", "nvml_used_mb", "rss_mb"}


def test_redraws_are_throttled(digits):
    run = background_fit(digits, max_steps=LONG, log_every=1)
    dash = Dashboard(run, interval=0.1)
    start = time.monotonic()
    time.sleep(1.0)
    run.stop()
    run.wait(10)
    dash.reporter.join(5)
    elapsed = time.monotonic() - start
    assert len(run.records()) > 100                       # many records...
    assert dash.reporter.draws <= elapsed / 0.1 + 3       # ...few redraws


def test_a_stuck_chart_never_blocks_training(digits):
    run = background_fit(digits, max_steps=LONG)
    dash = Dashboard(run)
    with dash.lock:   # the drawing side is stuck for as long as we hold this
        steps = run.step
        wait_until(lambda: run.step > steps + 200, what="training to go on without the chart")
        run.stop()
        assert run.wait(10).state == "stopped"
    assert dash.reporter.join(5)
    assert dash.trace("run 1", "loss").x[-1] == run.step


def test_dashboard_as_the_progress_of_a_blocking_fit(digits):
    (x, y), _ = digits
    shown = []
    run = nt.fit(mlp(), (x, y), F.cross_entropy, config=cfg(max_steps=20),
                 progress=lambda r: shown.append(Dashboard(r)))
    shown[0].reporter.join(5)
    assert shown[0].trace("run 1", "loss").x[-1] == run.step == 20


# -- the dashboard's Stop button --------------------------------------------------------------
def click_stop(button) -> None:
    """What a click sends when the kernel is free: the comm message the widget's JS sends."""
    button._handle_msg({"content": {"data": {"method": "custom", "content": {"event": "stop"}}},
                        "buffers": []})


def test_the_stop_button_stops_a_background_run_by_message(digits):
    run = background_fit(digits, max_steps=LONG)
    dash = Dashboard(run)
    wait_until(lambda: dash.stop_button.running, what="the Stop button to be enabled")
    assert not dash.stop_button.interrupts   # the kernel is free: the click is a message
    click_stop(dash.stop_button)
    assert run.wait(10).state == "stopped" and 0 < run.step < LONG
    dash.reporter.join(5)
    assert not dash.stop_button.running


def test_the_stop_button_interrupts_for_a_run_that_keeps_the_kernel_busy(digits):
    (x, y), _ = digits
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with nt.watch(optimize=False, progress=False, log_every=1) as run:
        dash = Dashboard(run)
        for i in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x[:32]), y[:32]).backward()
            opt.step()
        dash.flush()
        during = dash.stop_button.running, dash.stop_button.interrupts
    ended = dash.stop_button.running   # at the run's end, before any draw: no late interrupt
    dash.flush()
    assert during == (True, True)   # the browser interrupts the kernel: no message
    assert ended is False and run.state == "finished" and not dash.stop_button.running


def test_a_blocking_fit_outside_the_main_thread_is_stopped_by_message(digits):
    (x, y), _ = digits
    shown = []
    thread = threading.Thread(target=lambda: nt.fit(
        mlp(), (x, y), F.cross_entropy, config=cfg(max_steps=LONG),
        progress=lambda r: shown.append(Dashboard(r))))
    thread.start()
    wait_until(lambda: shown and shown[0].stop_button.running, what="the fit to start")
    assert not shown[0].stop_button.interrupts   # interrupting the main thread would miss it
    click_stop(shown[0].stop_button)
    thread.join(10)
    assert shown[0].slots[0].run.state == "stopped"


def test_the_kernel_id_comes_from_the_connection_file(monkeypatch):
    from ipykernel import connect
    from nbtrain.views.stop_button import kernel_id
    monkeypatch.setattr(connect, "get_connection_file",
                        lambda: "/run/jupyter/kernel-1d2c-44ab.json")
    assert kernel_id() == "1d2c-44ab"
    monkeypatch.setattr(connect, "get_connection_file", lambda: "/tmp/other.json")
    assert kernel_id() == ""


def test_a_panel_dashboard_has_no_second_stop_button(make_panel):
    panel = make_panel()
    assert panel.dashboard.stop_button is None
    assert Dashboard(show=False).stop_button is not None


def test_loss_axis_has_decade_ticks_and_fits_the_data():
    axis = log_axis([2.3, 1.1, 0.4, 0.05, 0.012, np.nan, 0.0])   # NaN and 0: not on a log axis
    assert axis["ticktext"] == ["0.01", "0.1", "1"]              # decades, full labels
    lo, hi = axis["range"]                                       # log10 units, just past the data
    assert lo <= np.log10(0.012) and hi >= np.log10(2.3)
    assert lo > np.log10(0.005) and hi < np.log10(5)
    narrow = log_axis([0.61, 0.58, 0.55])   # less than a decade: 1-2-5 steps, still 2+ labels
    assert len(narrow["tickvals"]) >= 2 and set(narrow["ticktext"]) <= {"0.2", "0.5", "1", "2"}
    assert log_axis([np.nan, -1.0]) is None


def loss_axis(dash):
    """The loss chart's y axis, wherever the grid puts the chart."""
    row, col, _ = CHARTS["loss"]
    return dash.figure.get_subplot(row, col).yaxis


def test_loss_chart_fits_the_losses_of_every_run(digits):
    run = background_fit(digits, max_steps=60)
    dash = Dashboard(run)
    run.wait(30)
    assert dash.reporter.join(5)
    axis = loss_axis(dash)
    losses = np.concatenate([dash.trace("run 1", "loss").y,
                             dash.trace("run 1", "val_loss", "val").y])
    assert axis.type == "log" and len(axis.tickvals) >= 2
    assert axis.range[0] <= np.log10(losses.min()) and axis.range[1] >= np.log10(losses.max())
    assert list(axis.ticktext) == [f"{v:g}" for v in axis.tickvals]


def test_a_reloaded_page_gets_every_point_from_the_kernel(digits):
    """A reloaded page asks the kernel for the figure's state (ipywidgets' request_state):
    it must hold every trace and point drawn since the figure was shown, and keeping it
    current must not send the data a second time to the page shown now."""
    run = background_fit(digits, max_steps=60)
    dash = Dashboard(run)
    sent = []
    dash.figure.observe(sent.append, names=["_widget_data", "_widget_layout"])
    run.wait(30)
    assert dash.reporter.join(5)
    state = dash.figure._widget_data   # what get_state() serializes for the page
    assert len(state) == len(dash.figure.data) > 5
    for trace, kept in zip(dash.figure.data, state):
        assert np.array_equal(trace.x, kept["x"]) and np.array_equal(trace.y, kept["y"])
    axis = loss_axis(dash)
    assert dash.figure._widget_layout[axis.plotly_name]["tickvals"] == list(axis.tickvals)
    assert not sent


def test_decimated_keeps_even_spacing_and_the_newest_row():
    buf = Decimated(("step", "v"), max_points=8)
    for step in range(1, 1001):
        buf.add((step, step * 2.0))
        assert len(buf) <= 8
    steps = buf.columns()["step"]
    assert steps[-1] == 1000 and steps[0] == 1
    assert len(set(np.diff(steps[:-1]))) == 1   # evenly spaced apart from the newest


def test_planned_lr_is_schedule_preview_decimated():
    config = nt.TrainConfig(lr=0.1, scheduler="cosine", warmup_steps=10)
    x, y = planned_lr(config, 1000, max_points=50)
    full = nt.schedule_preview(config, 1000)
    assert len(x) == 50 and x[0] == 1 and x[-1] == 1000
    assert np.allclose(y, [full[int(s) - 1] for s in x])


# -- text repr, no browser ----------------------------------------------------------------------
def test_text_repr_is_stable_and_has_no_ids(make_panel):
    a, b = make_panel(), make_panel()
    assert a.text() == b.text() == repr(a)
    bundle = a._repr_mimebundle_()
    assert bundle["text/plain"] == a.text()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert not re.search(r"[0-9a-f]{16,}", a.text() + a.dashboard.text())


def test_nt_panel_and_dashboard_load_the_ui_only_when_used():
    code = ("import sys, nbtrain as nt\n"
            "ui = lambda: {'plotly', 'ipywidgets', 'anywidget'} & set(sys.modules)\n"
            "assert not ui(), f'import nbtrain loaded {ui()}'\n"
            "assert nt.Panel.__module__ == 'nbtrain.ui.panel'\n"
            "assert nt.Dashboard.__module__ == 'nbtrain.views.dashboard'\n"
            "assert not ui(), f'nt.Panel loaded {ui()} before a Panel was made'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_profile_button_profiles_a_copy_and_shows_the_top_operators(make_panel):
    panel = make_panel()
    before = [p.detach().clone() for p in panel.model.parameters()]
    result = panel.profile(steps=3)
    assert result is not None and result.operators
    assert result.operators[0]["name"] in panel.profiled.value
    assert all(torch.equal(a, b) for a, b in zip(before, panel.model.parameters()))
    assert panel.run is None   # a profile is not a run on the charts
