"""The ways in: fit() and watch().

fit resolves the config (a resume's included), refuses what cannot run, hands the run to
one engine (this process, N processes, or Ray), then starts it and waits: the same tail
for every engine.

    fit -> prepare (prepare.py: every "auto" resolved, every part built)
        -> loop.train_safely (this process) | distributed's ranks | Ray Train's workers

watch wraps a loop the user wrote: the own-loop engine (the watcher package) feeds the same Run.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import signal
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Callable, Optional

import torch

from . import checkpoint as ckpt
from .config import DEFAULTS, ConfigError, TrainConfig, as_config, reporters, watched_as
from .run import Run
from .runstore import write
from .watcher import Watcher, own_loop_config, record_floor_s

if TYPE_CHECKING:
    from .train.schedule import Schedule


def fit(model: torch.nn.Module, train_data, loss_fn: Optional[Callable] = None, *,
        config: Optional[TrainConfig] = None, val_data=None, resume=None,
        background: bool = False, progress="auto",
        schedule: Optional[Callable[[Schedule], Schedule]] = None,
        on_start: Optional[Callable[[Run], None]] = None) -> Run:
    """Train `model` on `train_data` with the settings of `config`; returns the Run.

    >>> run = nt.fit(model, (x, y), torch.nn.functional.cross_entropy,
    ...              config=nt.TrainConfig(epochs=3, amp="bf16", scheduler="cosine"))

    `loss_fn=None`: the model returns the loss (or an output with `loss`). A mapping batch
    is passed as keywords, `model(**batch)` (Hugging Face models), unless the forward
    takes one positional argument named after none of its keys: then `model(batch)`.
    `resume`: a Run or a checkpoint path; training continues where it stopped.
    `background=True` returns at once and trains in a thread (`run.stop()`, `run.wait()`).
    `progress`: True/"auto" for a progress bar, False for none, or a callable given the Run
    before the first step (`progress=nt.Dashboard` shows the live charts).
    `schedule`: a function given the Schedule built from `config`, returning the one to
    use (`nt.lr_find` returns its exponential sweep).
    `on_start`: a function given the Run before the first step, for code that steers the
    run rather than shows it: it may subscribe and call `run.stop()` (lr_find stops once
    the loss diverges, autotune once a trial has been timed).
    """
    _refuse_inside_a_watch()
    state = ckpt.state_to_resume(resume)
    cfg = _config_from(config, state, resume)
    _refuse_plateau_without_validation(cfg, val_data)
    check_trackers(cfg)   # report_to's library missing: said before anything runs
    refuse_busy(model)   # before anything touches the model
    if cfg.release_previous:
        release_previous_run()
    run = Run(cfg)
    remember(run)
    try:
        with _setup_line(run, progress):
            begin = _engine(run, model, train_data, loss_fn, val_data, state, schedule)
    except KeyboardInterrupt:   # Ctrl-C while measuring: a run that never started
        return _interrupted_before_step_1(run, model)
    keep(run, _kind.get())
    attach_hooks(run, schedule, on_start, progress)
    _claim(model, run)
    train = begin()
    if background:
        run.start(threading.Thread(target=train, name="nbtrain-fit", daemon=True))
        return run
    with ctrl_c_stops(run):
        train()
    if run.state == "failed":
        raise run.error
    return run


class watch:
    """Watch a training loop you wrote, unchanged, and make it faster; the `with` gives
    an ordinary Run (history, summary(), report(), stop(), nt.Dashboard(run)).

    >>> with nt.watch() as run:
    ...     for xb, yb in loader:
    ...         opt.zero_grad(); loss = F.cross_entropy(model(xb), yb)
    ...         loss.backward(); opt.step()
    >>> print(run.summary_text())

    `settings`: the TrainConfig fields that apply to someone else's loop (watcher/settings.py's
    OWN_LOOP_FIELDS: amp, batched_fetch, pin_memory, prefetch_to_device, optimizer_impl,
    log_every, count_flops, ...); one the loop decides (epochs, lr, optimizer, ...) is a
    ConfigError. `optimize=False` only watches: the loop runs exactly as written.
    `progress` as in fit. A record comes every `log_every` steps; left at its default, at
    least 50 ms and at most 10 x log_every steps apart from step 30 on
    (`run.resolved["log_every"]`). `run.stop()`, the Dashboard's Stop button, the
    notebook's interrupt or Ctrl-C end the loop at the next step boundary without an
    error; an exception of the loop comes out unchanged, the Run marked failed. Every hook
    and patch is undone on the way out.
    """

    def __init__(self, config: Optional[TrainConfig] = None, *, optimize: bool = True,
                 progress="auto", _rank: Optional[tuple] = None, **settings):
        cfg, settings = watch_config(config, settings)
        # _rank (cell_ranks.py): (rank, world, make_run), this process one of N; its records
        # come every log_every steps on every rank alike, so that they can be merged
        self.run = Run(cfg) if _rank is None else _rank[2](cfg)
        check_trackers(self.run.config)
        floor = record_floor_s(self.run.config, settings) if _rank is None else 0.0
        self._watcher = Watcher(self.run, optimize, floor,
                                ranks=None if _rank is None else _rank[:2])
        self._progress = progress
        self._ctrl_c = None

    def __enter__(self) -> Run:
        self._watcher.install()
        try:
            attach_hooks(self.run, None, None, self._progress)
            self._ctrl_c = ctrl_c_stops(self.run)
            self._ctrl_c.__enter__()
        except BaseException:
            self._watcher.remove()
            raise
        remember(self.run)
        keep(self.run, ("watch", None))
        self.run.start()
        return self.run

    @property
    def trained(self) -> bool:
        """Whether the watched code ran a backward (%%fasttrain: the cell trained itself)."""
        return self._watcher.trained

    def __exit__(self, kind, exc, traceback) -> bool:
        try:   # the run ends under the watch's handler: a Ctrl-C now stops, not raises
            swallowed = self._watcher.finish(exc)
        finally:
            self._ctrl_c.__exit__(None, None, None)   # the handler before the watch, again
        if self.warns_untrained and self.run.state == "finished" and self.run.step == 0:
            warnings.warn(self.run.message, UserWarning, stacklevel=2)
        return swallowed

    # %%fasttrain sets it off: a cell that trains nothing is forgotten, not warned about
    warns_untrained = True


# -- keeping the run: the run store and the trackers (runstore/write.py, trackers.py) ---------
KEEPING_FIELDS = watched_as("keeps")   # any run's, a watch's too (config.py declares them)
# (kind, the name of an unnamed run) of the fits in this context: see `trials`
_kind: contextvars.ContextVar = contextvars.ContextVar("nbtrain_run_kind", default=("fit", None))


def keep(run: Run, kind: tuple) -> None:
    """Store `run` as it goes (unless store=False) and start its trackers (report_to);
    `kind`: ("fit", "watch" or "trial", the stored name when the config has none)."""
    write.keep(run, *kind)
    if reporters(run.config):
        from .runstore import trackers
        trackers.attach(run)


def check_trackers(cfg: TrainConfig) -> None:
    """report_to's libraries, checked before the run; trackers.py (its TensorBoard and
    MLflow sinks) is loaded only where report_to names one."""
    if reporters(cfg):
        from .runstore import trackers
        trackers.check(cfg)


@contextlib.contextmanager
def trials(name: Optional[str] = None):
    """The fits inside are a tool's trials (nt.compare's, nt.autotune's, nt.lr_find's,
    nt.profile's): stored with kind="trial" (nt.runs(kind="fit") lists the user's own),
    named `name` when their config names them not."""
    token = _kind.set(("trial", name))
    try:
        yield
    finally:
        _kind.reset(token)


def watch_config(config: Optional[TrainConfig], settings: dict):
    """(A watch's TrainConfig, the settings a loop of one's own takes): own_loop_config's
    fields, and those that keep any run (its name, the store, report_to)."""
    config, settings, keeping = _keeping_apart(config, dict(settings))
    cfg = own_loop_config(config, settings)
    return (cfg.replace(**keeping) if keeping else cfg), settings


def _keeping_apart(config, settings: dict):
    """(config, settings) without the fields that keep the run, and those fields: any run
    may be named, stored and reported, a watch's too (watcher.own_loop_config refuses
    the fields it does not list)."""
    keeping = {name: settings.pop(name) for name in KEEPING_FIELDS if name in settings}
    if config is not None:
        config = as_config(config)
        own = {name: getattr(config, name) for name in KEEPING_FIELDS
               if getattr(config, name) != DEFAULTS[name]}
        if own:
            config = config.replace(**{name: DEFAULTS[name] for name in own})
            keeping = {**own, **keeping}
    return config, settings, keeping


def _refuse_inside_a_watch() -> None:
    if Watcher.active is not None:
        raise RuntimeError("nt.fit was called inside `with nt.watch()`: the watch would count "
                           "fit's steps as your loop's. Call fit outside the watch, or train "
                           "with your own loop inside it.")


def _engine(run: Run, model, train_data, loss_fn, val_data, state, schedule) -> Callable:
    """Prepare the engine that trains `run`; returns `begin()`, called once the run is
    claimed, which starts what must start (the ranks) and returns the function that trains."""
    if run.config.cluster == "ray":   # parallel/ray_train.py runs this loop in Ray Train's workers
        from .parallel import ray_train
        return ray_train.prepare(run, model, train_data, loss_fn, val_data, state, schedule)
    if run.config.processes != 1:   # data-parallel: parallel/processes.py runs it in N processes
        from .parallel import processes
        if processes.resolve_processes(run) > 1:
            return processes.prepare(run, model, train_data, loss_fn, val_data, state, schedule)
    # this process's loop: loaded by a fit only, never by a watch
    from .auto.devices import seed_all
    from .train import loop
    from .train.prepare import prepare
    setup = prepare(run, model, train_data, loss_fn, val_data, state)
    if state is not None:
        ckpt.restore(run, state)
    else:
        seed_all(run.config.seed)   # dropout and friends repeat; data order has its own RNG
    return lambda: functools.partial(loop.train_safely, run, setup)


def _interrupted_before_step_1(run: Run, model) -> Run:
    """The Run of a fit interrupted during its setup (the probes take seconds on a first
    fit): "interrupted" at step 0, as one interrupted during training is, the model's
    weights untouched (the probes restore what they change: memory.leaves_no_trace)."""
    run.equip(model=model)
    run.finish("interrupted", read_rng=lambda: ckpt.rng_state(),
               message="interrupted before step 1, while resolving the settings; "
                       "nothing was trained: fit again to start")
    return run


def _config_from(config, state, resume=None) -> TrainConfig:
    """The given config; without one, a resumed run's own, else the defaults."""
    if config is None and isinstance(resume, Run):   # its own optimizer and scheduler too
        return resume.config.replace()
    if config is None and state:
        return TrainConfig.from_dict(state["config"])
    return as_config(config)


def _refuse_plateau_without_validation(cfg: TrainConfig, val_data) -> None:
    """plateau cuts the LR when the validation loss stalls: without val_data it never would."""
    if cfg.scheduler == "plateau" and val_data is None:
        raise ConfigError("TrainConfig.scheduler='plateau' cuts the LR when the validation loss "
                          "stops improving, but no val_data was given: the LR would never "
                          "change. Pass val_data=..., or pick another scheduler (e.g. 'cosine').",
                          field="scheduler")


def without_validation(cfg: TrainConfig) -> TrainConfig:
    """`cfg` for a tool's run that validates nothing (a warm-up, a timed trial, a profile):
    plateau, which acts on validation only, is the constant LR it is until then."""
    return cfg.replace(scheduler="constant") if cfg.scheduler == "plateau" else cfg


# -- the progress bar, a view: handed in from above ------------------------------------------------
# The bar (progress.py) sits above this layer, so the entry never imports it: the package
# (nbtrain/__init__.py) hands it in once with show_progress_with, and `progress=True` /
# "auto" means that bar. With none handed in, True shows nothing.
_progress_bar = {"attach": None, "setup_line": None}


def show_progress_with(attach: Optional[Callable[[Run], None]],
                       setup_line: Optional[Callable[[Run], "contextlib.AbstractContextManager"]]
                       = None) -> None:
    """The bar `progress=True` shows: `attach(run)` before the first step (it subscribes
    to the records), `setup_line(run)` a context manager around the setup (a line saying
    what the setup measures). nbtrain/__init__.py passes progress.py's."""
    _progress_bar.update(attach=attach, setup_line=setup_line)


def _setup_line(run: Run, progress):
    """With a progress bar: a line saying what the setup measures, once it takes a second."""
    if callable(progress) or not progress or _progress_bar["setup_line"] is None:
        return contextlib.nullcontext()
    return _progress_bar["setup_line"](run)


def attach_hooks(run: Run, schedule, on_start, progress) -> None:
    """fit's hooks, before step 1: the schedule swap, then code that steers the run, then
    the viewer (e.g. nt.Dashboard, which subscribes), or the progress bar."""
    if schedule is not None:
        run.equip(schedule=schedule(run.schedule))
    if on_start is not None:
        on_start(run)
    if callable(progress):
        progress(run)
    elif progress and _progress_bar["attach"] is not None:   # the bar handed in from above
        _progress_bar["attach"](run)


# -- the last run, released by the next one (release_previous) -----------------------------------
_last_run = {"ref": None}   # weak: a finished run is freed when the user drops it


def remember(run: Run) -> None:
    _last_run["ref"] = weakref.ref(run)


def release_previous_run() -> Optional[dict]:
    """Release the last run of this process, if it is still alive and done."""
    previous = _last_run["ref"]() if _last_run["ref"] else None
    if previous is None or previous.running:
        return None
    return previous.release()


# -- which Run trains each model -----------------------------------------------------------------
# Two runs stepping two optimizers over the same parameters would race (torch raises deep
# inside the optimizer, or the weights are silently wrong).
# Weak both ways: a Run refers to its model, so a Run held here would live as long as it.
_training: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
_training_lock = threading.Lock()


class ModelBusyError(RuntimeError):
    """The model is being trained by another Run of this process."""


def refuse_busy(model) -> None:
    held = _training.get(model) if isinstance(model, torch.nn.Module) else None
    other = held() if held is not None else None
    if other is not None and other.state in ("created", "running"):
        raise ModelBusyError(
            f"this model is already being trained by {other!r} (a background fit, a Panel "
            "or %%fasttrain --background). Stop that run first (run.stop(); run.wait(), or "
            "the panel's Stop), or train a copy of the model (copy.deepcopy(model)).")


def _claim(model, run: Run) -> None:
    """Mark `run` as the one training `model`; the check and the mark are one step, so two
    fits starting at once cannot both pass."""
    with _training_lock:
        refuse_busy(model)
        run.start()
        _training[model] = weakref.ref(run)


# -- Ctrl-C ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def ctrl_c_stops(run: Run):
    """In the main thread, Ctrl-C (a kernel interrupt) ends the run at the step boundary.

    A second Ctrl-C interrupts at once, for a step that never ends; during the update
    (see loop._advance) it ends the run at the boundary right after it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum, frame):
        # the second press: the step in flight may never end; but an update always does,
        # and cut off after it the weights would hold a step that the position does not
        if run.interrupted and run.phase != "update":
            raise KeyboardInterrupt
        run.interrupt()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
