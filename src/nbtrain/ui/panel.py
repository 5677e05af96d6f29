"""nt.Panel: a control for every TrainConfig toggle, Train / Stop / Resume, live charts.

    panel = nt.Panel(model, nt.datasets.digits("train"), F.cross_entropy,
                     config=nt.TrainConfig(epochs=5, scheduler="onecycle"))
    panel        # set toggles, press Train, change one, Train again: the runs side by side

The controls only write a TrainConfig (the loop only reads it); training runs in a
background thread (`fit(background=True)`), so Stop and live LR changes work while the
kernel stays free.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from ..config import GROUPS, ConfigError, Setting, TrainConfig, rejection, settings_in
from ..kinds import Choice, Flag, Number, OrNone, Pair, Whole, text_of
from ..tables import setting
from ..views.dashboard import Dashboard, require_plotly_widgets

LIVE_FIELDS = ("lr",)   # applied to a running run; every other field needs the next Train
ERROR_STYLE = "color:#b00020;font-size:12px"


# -- one control per TrainConfig field --------------------------------------------------------
@dataclass
class Control:
    """A widget that edits one TrainConfig field, with the place its errors are shown."""
    field: str
    widget: Any                          # what is laid out (a box for the two betas)
    read: Callable[[], Any]              # widget -> field value (may raise ConfigError)
    write: Callable[[Any], None]         # field value -> widget
    error: Any                           # an HTML widget beside it, empty when all is well
    row: Any                             # widget + error, what is laid out and hidden
    shown: Callable[[dict], bool]        # given the raw values of all controls
    inputs: tuple                        # the widgets whose "value" changes are edits

    def on_edit(self, fn: Callable[[dict], None]) -> None:
        for widget in self.inputs:
            widget.observe(fn, names="value")

    def show_error(self, text: str) -> None:
        self.error.value = f"<span style='{ERROR_STYLE}'>{html.escape(text, quote=False)}</span>" \
            if text else ""


def _always(values: dict) -> bool:
    return True


def _when(name: str, *choices) -> Callable[[dict], bool]:
    return lambda values: values.get(name) in choices


class _Builder:
    """Makes each field's Control from its declaration (config.SETTINGS), with one look:
    a description column, the widget, its error."""

    def __init__(self, widgets, config: TrainConfig):
        self.w, self.config = widgets, config
        self.style = {"description_width": "11em"}
        self.layout = widgets.Layout(width="21em")

    def control_for(self, meta: Setting) -> Control:
        """The widget that fits the field's kind of value."""
        kind = meta.kind
        if meta.options or isinstance(kind, Choice):
            return self.choice(meta, meta.options or kind.options)
        from ..kinds import takes_factories
        if takes_factories(kind):   # the names, plus your own class or factory when set
            names = next(k.options for k in kind.kinds if isinstance(k, Choice))
            current = getattr(self.config, meta.name)
            own = ((text_of(current), current),) if callable(current) else ()
            return self.choice(meta, names + own)
        if isinstance(kind, Flag):
            return self.flag(meta)
        if isinstance(kind, (Whole, Number)):
            return self.number(meta, self.w.IntText if isinstance(kind, Whole) else self.w.FloatText)
        if isinstance(kind, Pair):
            return self.pair(meta)
        return self.text(meta)   # optional values and paths: empty means None

    def _control(self, meta: Setting, widget, read, write, inputs=None) -> Control:
        error = self.w.HTML(value="")
        row = self.w.HBox([widget, error])
        write(getattr(self.config, meta.name))
        shown = _when(meta.when[0], *meta.when[1]) if meta.when else _always
        return Control(meta.name, widget, read, write, error, row, shown, inputs or (widget,))

    def choice(self, meta: Setting, options) -> Control:
        options = [o if isinstance(o, tuple) else ("default" if o is None else str(o), o)
                   for o in options]
        current = getattr(self.config, meta.name)
        if all(value != current or type(value) is not type(current) for _, value in options):
            options.append((str(current), current))   # a value the list lacks, e.g. 12 workers
        w = self.w.Dropdown(options=options, description=meta.label, style=self.style,
                            layout=self.layout)
        return self._control(meta, w, lambda: w.value, _setter(w))

    def number(self, meta: Setting, widget_type) -> Control:
        w = widget_type(description=meta.label, style=self.style, layout=self.layout)
        return self._control(meta, w, lambda: w.value, _setter(w))

    def flag(self, meta: Setting) -> Control:
        w = self.w.Checkbox(description=meta.label, style=self.style, layout=self.layout,
                            indent=True)
        return self._control(meta, w, lambda: w.value, _setter(w))

    def text(self, meta: Setting) -> Control:
        """A Text box: empty means None, else the value as the kind reads text
        (TrainConfig checks the range)."""
        kind = meta.kind.kind if isinstance(meta.kind, OrNone) else meta.kind
        w = self.w.Text(description=meta.label, placeholder=meta.placeholder, style=self.style,
                        layout=self.layout, continuous_update=False)

        def read():
            text = w.value.strip()
            if not text and isinstance(meta.kind, OrNone):
                return None
            try:
                return kind.parse(text)
            except ValueError:
                raise rejection(meta.name, text, f"{kind.allowed}, or empty ({meta.placeholder})"
                                if meta.placeholder else "") from None

        def write(value):
            w.value = "" if value is None else text_of(value)
        return self._control(meta, w, read, write)

    def pair(self, meta: Setting) -> Control:
        """Two number boxes, one field (Adam's beta1, beta2)."""
        first = self.w.FloatText(description=meta.label, style=self.style, layout=self.layout)
        second = self.w.FloatText(layout=self.w.Layout(width="7em"))

        def write(value):
            first.value, second.value = value
        return self._control(meta, self.w.HBox([first, second]),
                             lambda: (first.value, second.value), write, inputs=(first, second))


def _setter(widget) -> Callable[[Any], None]:
    def write(value):
        widget.value = value
    return write


def build_controls(widgets, config: TrainConfig) -> Dict[str, List[Control]]:
    """A control for every TrainConfig field, a tab per group of settings."""
    builder = _Builder(widgets, config)
    return {tab: [builder.control_for(meta) for meta in settings_in(group)]
            for group, (_title, tab) in GROUPS.items()}


def planned_total_steps(config: TrainConfig, train_data) -> Optional[int]:
    """The steps a run will take, before it starts (for the LR preview); None if unknown.

    The engine's own count, from the data's length, without building (or moving) the data.
    """
    from ..train.prepare import batches_per_epoch, count_steps
    try:
        return count_steps(config, batches_per_epoch(config, train_data))
    except (TypeError, ConfigError):   # an IterableDataset: no length until it runs; no batch
        return None


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    minutes, s = divmod(int(round(seconds)), 60)
    h, m = divmod(minutes, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


# -- the panel --------------------------------------------------------------------------------
class Panel:
    """Controls for every toggle, Train / Stop / Resume, a status line and live charts.

    >>> panel = nt.Panel(model, (x, y), F.cross_entropy, config=nt.TrainConfig(epochs=3))
    >>> panel.controls["amp"].widget.value = "bf16"   # what a click in the notebook does
    >>> panel.train_button.click()                    # trains in a background thread
    >>> panel.run.wait().summary()["samples_per_s"]

    Each Train starts from the model's initial weights (`reset_weights=True`), so runs
    with different toggles compare fairly; Resume continues the last stopped run.
    """

    def __init__(self, model, train_data, loss_fn=None, config: Optional[TrainConfig] = None,
                 val_data=None, *, reset_weights: bool = True, max_points: int = 400,
                 interval: float = 0.25, height: int = 760):
        widgets, _, _ = require_plotly_widgets()
        if config is not None and not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig; got {type(config).__name__}. "
                            "Use nt.TrainConfig(...) or TrainConfig.from_dict(d).")
        self.model, self.train_data, self.loss_fn, self.val_data = model, train_data, loss_fn, val_data
        self.config = config if config is not None else TrainConfig()
        self.error = ""                  # the ConfigError text while the controls are invalid
        self._note = ""                  # why a button did nothing (shown until the next edit)
        self._stopping = None            # the run that Stop was pressed for
        self._report = ""                # the report file written last (linked until a Train)
        self._compared = ((), "")        # (the two runs' ids, their nt.diff as HTML)
        self.run = None                  # the latest Run (Stop and Resume act on it)
        self.runs: List[Any] = []        # one per line on the charts (a resume replaces its run)
        self._initial = _weights_of(model) if reset_weights else None
        self.groups = build_controls(widgets, self.config)
        self.controls = {c.field: c for group in self.groups.values() for c in group}
        self.dashboard = Dashboard(max_points=max_points, interval=interval, height=height,
                                   show=False, live="widget",
                                   stop_button=False)   # the Panel's own Stop
        self._build_layout(widgets)
        for control in self.controls.values():   # after the builder wrote the config's values
            control.on_edit(self._on_change_of(control.field))
        self.dashboard.after_draw(self._refresh)
        self._apply(changed=None)

    # -- buttons ------------------------------------------------------------------------------
    def train(self, _button=None):
        """Start a new run with the current settings; returns it (None if it cannot start)."""
        if self.running or self.error:
            return None
        if self.run is not None and hasattr(self.run, "release"):
            # Its weights are about to be reset, so it can no longer resume: free its
            # optimizer state and the CUDA cache before the next run allocates its own.
            self.run.release()
        if self._initial is not None:
            self.model.load_state_dict(self._initial)
        run = self._start(config=self.config)
        if run is not None:
            self.runs.append(run)
            self.dashboard.add(run, label=f"run {len(self.runs)}")
            self.dashboard.preview(self.config, None)   # the run's own planned line replaces it
        return run

    def stop(self, _button=None) -> None:
        """Stop the running run at its next step."""
        if self.running:
            self.run.stop()
            self._stopping = self.run
            self.dashboard.flush()

    def resume(self, _button=None):
        """Continue the last stopped run (same line and row); returns the new Run."""
        old = self.run
        if self.running or self.error or old is None or old.state not in ("stopped", "interrupted"):
            return None
        if self.config.optimizer != old.config.optimizer:
            self._note = (f"Resume keeps the optimizer of the stopped run ({old.config.optimizer}):"
                          f" set optimizer back, or press Train for a new run with "
                          f"{self.config.optimizer}.")
            self.dashboard.flush()
            return None
        run = self._start(config=self.config, resume=old)
        if run is None:
            return None
        if run.schedule is not None and run.schedule.base_lr != self.config.lr:
            run.set_lr(self.config.lr)   # the checkpoint brought the old run's LR
        self.runs[self.runs.index(old)] = run
        self.dashboard.add(run, continues=old)
        return run

    def report(self, _button=None) -> Optional[str]:
        """Write the last ended run's report (`run.report`) to the notebook's folder, as
        nbtrain-run-N.html; the message links to it. Returns the path."""
        if self.run is None or self.running:
            return None
        label = self.dashboard.slot_of(self.run).label
        self._report = self.run.report(f"nbtrain-{label.replace(' ', '-')}.html")
        self.dashboard.flush()
        return self._report

    def profile(self, _button=None, steps: int = 10):
        """Profile `steps` steps of the current settings on a copy of the model
        (`nt.profile`); the top operators and where the time goes show under the buttons.
        Blocks the kernel for those steps. Returns the Profile (None if it cannot start)."""
        if self.running or self.error:
            return None
        from ..tools.profiling import profile
        try:
            result = profile(self.model, self.train_data, self.loss_fn, config=self.config,
                             steps=steps)
        except (ConfigError, ValueError, TypeError, RuntimeError) as exc:
            self._note = f"could not profile: {exc}"
            self.dashboard.flush()
            return None
        self.profiled.value = f"<div style='font-size:11px'>{result._repr_html_()}</div>"
        return result

    @property
    def running(self) -> bool:
        return self.run is not None and self.run.state in ("created", "running")

    # -- display ------------------------------------------------------------------------------
    def text(self) -> str:
        """A stable description (no ids, no timings), used as the text repr for nbval."""
        what = "ready" if self.run is None else \
            f"{self.dashboard.slot_of(self.run).label} {self.run.state}"
        return f"nbtrain.Panel: {what}\n  settings: {_config_text(self.config)}"

    def __repr__(self) -> str:
        return self.text()

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = self.widget._repr_mimebundle_(include=include, exclude=exclude) or {}
        bundle["text/plain"] = self.text()
        return bundle

    # -- inside: layout -----------------------------------------------------------------------
    def _build_layout(self, widgets) -> None:
        tabs = widgets.Tab(children=[widgets.VBox([c.row for c in group])
                                     for group in self.groups.values()],
                           layout=widgets.Layout(width="56%"))   # seven tabs in one row
        for i, name in enumerate(self.groups):
            tabs.set_title(i, name)
        self.train_button = widgets.Button(description="Train", button_style="success", icon="play")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop")
        self.resume_button = widgets.Button(description="Resume", icon="forward")
        self.report_button = widgets.Button(description="Report", icon="file",
                                            tooltip="the last run as one HTML file, to share")
        self.train_button.on_click(self.train)
        self.stop_button.on_click(self.stop)
        self.resume_button.on_click(self.resume)
        self.report_button.on_click(self.report)
        self.profile_button = widgets.Button(description="Profile", icon="search",
                                             tooltip="10 steps of these settings under "
                                                     "torch.profiler, on a copy of the model")
        self.profile_button.on_click(self.profile)
        self.profiled = widgets.HTML(value="")   # the last profile's operators and shares
        self.status = widgets.HTML(value="")     # state, step/total, samples/s, ETA
        self.message = widgets.HTML(value="")    # why a button did nothing, pending settings
        self.settings = widgets.HTML(value="")   # what "auto" became, and why (run.resolved)
        self.compared = widgets.HTML(value="")   # the last two runs: nt.diff's text
        buttons = widgets.HBox([self.train_button, self.stop_button, self.resume_button,
                                self.report_button, self.profile_button])
        side = widgets.VBox([buttons, self.status, self.message, self.compared, self.settings,
                             self.profiled],
                            layout=widgets.Layout(padding="0 0 0 1em", width="44%"))
        self.widget = widgets.VBox([widgets.HBox([tabs, side]), self.dashboard.widget])
        self.widget.add_class("nbtrain-panel")

    # -- inside: controls -> config -----------------------------------------------------------
    def _on_change_of(self, field: str):
        def on_change(_change):
            self._apply(changed=field)
        return on_change

    def _apply(self, changed: Optional[str]) -> None:
        """Controls -> a new TrainConfig, or the ConfigError beside the control it names."""
        raw = {}
        try:
            for name, control in self.controls.items():
                raw[name] = control.read()
            config = self.config.replace(**raw)
        except ConfigError as exc:
            self._show_config_error(exc, changed, raw)
            return
        self._show_visible(raw)
        for control in self.controls.values():
            control.show_error("")
        previous, self.config, self.error = self.config, config, ""
        self._config_changed(previous, config)

    def _show_config_error(self, exc: ConfigError, changed: Optional[str], raw: dict) -> None:
        self.error = str(exc)
        self._show_visible(raw)
        named = self.controls.get(getattr(exc, "field", None))
        target = named if named is not None and named.row.layout.display != "none" \
            else self.controls.get(changed)
        for control in self.controls.values():
            control.show_error(self.error if control is target else "")
        self._note = "" if target is not None else self.error
        self.dashboard.flush()

    def _show_visible(self, raw: dict) -> None:
        values = {name: (raw[name] if name in raw else getattr(self.config, name))
                  for name in self.controls}
        for control in self.controls.values():
            control.row.layout.display = "" if control.shown(values) else "none"

    def _config_changed(self, previous: TrainConfig, config: TrainConfig) -> None:
        if self.running and config.lr != previous.lr:
            self.run.set_lr(config.lr)            # applies from the next step
            self.dashboard.replan(self.run)
        last = self.runs[-1].config if self.runs else None
        total = planned_total_steps(config, self.train_data)
        self._note = ""
        self.dashboard.preview(config, None if _same_but_lr(last, config, self.running) else total)

    def _pending_text(self) -> str:
        if not self.running:
            return ""
        changed = [f for f in self.controls if f not in LIVE_FIELDS
                   and getattr(self.config, f) != getattr(self.run.config, f)]
        return f"applies at the next Train: {', '.join(changed)}" if changed else ""

    # -- inside: runs -------------------------------------------------------------------------
    def _start(self, **kwargs):
        from ..entry import fit
        try:
            run = fit(self.model, self.train_data, self.loss_fn, val_data=self.val_data,
                      background=True, progress=False, **kwargs)
        except (ConfigError, ValueError, TypeError, RuntimeError) as exc:
            # Settings only the engine can check (no GPU for cuda, bf16 on an old GPU, ...)
            named = self.controls.get(getattr(exc, "field", None))
            if named is not None:
                named.show_error(str(exc))
            self._note = f"could not start: {exc}"
            self.dashboard.flush()
            return None
        self.run, self._note, self._report = run, "", ""
        return run

    def _refresh(self) -> None:
        """After each draw (drawing thread, under the dashboard's lock): every text and button.

        Button handlers change state and call `dashboard.flush()`, so the drawing thread
        and the kernel's thread never write these widgets at the same time.
        """
        self.status.value = f"<span class='nbtrain-status'>{html.escape(self.status_text())}</span>"
        self.settings.value = _resolved_html(self.run)
        self.compared.value = self._compared_html()
        self.message.value = self._message_html()
        self._refresh_buttons()

    def _message_html(self) -> str:
        if self._note:
            return f"<span style='{ERROR_STYLE}'>{html.escape(self._note, quote=False)}</span>"
        if self._report and not self.running:
            path = html.escape(self._report)
            return (f"<span style='font-size:12px'>report: <a href='{path}' target='_blank'>"
                    f"{path}</a></span>")
        stopping = self.running and self._stopping is self.run
        text = "stopping at the next step..." if stopping else self._pending_text()
        return f"<span style='color:#555;font-size:12px'>{html.escape(text)}</span>" if text else ""

    def _compared_html(self) -> str:
        """The last two runs compared per step (nt.diff), once both have ended: an ended
        run's records no longer change, so each pair is compared once."""
        pair = self.runs[-2:]
        if len(pair) < 2 or any(run.state in ("created", "running") for run in pair):
            return ""
        key = tuple(id(run) for run in pair)
        if self._compared[0] != key:
            self._compared = key, _diff_html(*pair, labels=[self.dashboard.slot_of(run).label
                                                            for run in pair])
        return self._compared[1]

    def _refresh_buttons(self) -> None:
        self.train_button.disabled = self.running or bool(self.error)
        self.stop_button.disabled = not self.running
        self.resume_button.disabled = self.running or bool(self.error) or self.run is None \
            or self.run.state not in ("stopped", "interrupted")
        self.report_button.disabled = self.running or self.run is None
        self.profile_button.disabled = self.running or bool(self.error)

    def status_text(self) -> str:
        """e.g. 'running · step 120/1,000 · 5,321 samples/s · ETA 0:12'."""
        run = self.run
        if run is None:
            return "ready · press Train"
        total = f"{run.total_steps:,}" if run.total_steps else "?"
        parts = [run.state, f"step {run.step:,}/{total}"]
        last = next((r for r in reversed(run.history) if r.get("kind") == "train"), None)
        if last is not None:
            parts.append(f"{self._rate(run, last):,.0f} samples/s")
            if run.state == "running" and run.total_steps and last.get("steps_per_s"):
                parts.append(f"ETA {_duration((run.total_steps - run.step) / last['steps_per_s'])}")
        if run.state == "failed" and run.error is not None:
            parts.append(str(run.error).splitlines()[0])
        elif run.message:
            parts.append(run.message)
        return " · ".join(parts)

    def _rate(self, run, last: dict) -> float:
        """Live: the last interval's rate (what the toggles do now). Ended: the whole run's,
        as its row in the runs table says (the last interval may be a short tail)."""
        slot = self.dashboard.slot_of(run)
        return last["samples_per_s"] if run.state == "running" or slot is None \
            else slot.samples_per_s


# -- helpers ----------------------------------------------------------------------------------
def _weights_of(model) -> dict:
    """A CPU copy of the initial weights, so every Train starts from the same point."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _same_but_lr(last: Optional[TrainConfig], config: TrainConfig, running: bool) -> bool:
    """True when the next Train would repeat the last run, whose own planned line is shown."""
    if last is None:
        return False
    mine = config.to_dict()
    if running:   # a live LR change is not a new run
        mine["lr"] = last.lr
    return mine == last.to_dict()


def _config_text(config: TrainConfig) -> str:
    return (f"amp={config.amp} pin_memory={config.pin_memory} num_workers={config.num_workers} "
            f"data_on_device={config.data_on_device} batch_size={config.batch_size} "
            f"epochs={config.epochs} max_steps={config.max_steps} "
            f"optimizer={text_of(config.optimizer)} lr={config.lr:g} "
            f"scheduler={text_of(config.scheduler)}")


def _diff_html(a, b, labels) -> str:
    """nt.diff(a, b)'s text, its first line in bold; empty where a run has no step records."""
    from ..tools.diff import diff
    try:
        first, *rest = diff(a, b, labels=tuple(labels)).text().splitlines()
    except ValueError:   # a run stopped before its first record: nothing to compare
        return ""
    details = html.escape("\n".join(rest))
    return (f"<div style='font-size:11px;line-height:1.35;margin:4px 0'>"
            f"{html.escape(labels[1])} against {html.escape(labels[0])} (nt.diff):<br>"
            f"<b>{html.escape(first)}</b><pre style='font-size:11px;margin:2px 0;"
            f"white-space:pre-wrap'>{details}</pre></div>")


def _resolved_html(run) -> str:
    if run is None or not run.resolved:
        return ""
    rows = "".join(f"<tr><td style='padding:0 6px 0 0'><b>{html.escape(name)}</b></td>"
                   f"<td style='padding:0 6px 0 0'>{html.escape(setting(name, value))}</td>"
                   f"<td style='color:#666;white-space:normal;overflow-wrap:anywhere' "
                   f"title='{html.escape(why, quote=True)}'>{html.escape(why)}</td></tr>"
                   for name, (value, why) in run.resolved.items())
    return (f"<div style='font-size:11px;line-height:1.35'>settings of the {html.escape(run.state)}"
            f" run, with why \"auto\" chose them:<table style='border-collapse:collapse;"
            f"table-layout:auto;width:100%'>{rows}"
            f"</table></div>")


__all__ = ["Panel", "Dashboard", "build_controls", "planned_total_steps"]
