"""nbtrain: fast PyTorch training loops you can switch, see and measure from a notebook.

>>> import nbtrain as nt
>>> run = nt.fit(model, (x, y), loss_fn, config=nt.TrainConfig(epochs=3, amp="bf16"))
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import sys
import time
import types
from typing import TYPE_CHECKING

from .version import __version__

if TYPE_CHECKING:   # what static readers see (IDEs, the API reference); loaded on first use
    from . import data
    from .auto.memory import max_batch_size
    from .config import ConfigError, TrainConfig
    from .data import datasets
    from .entry import fit, watch
    from .run import Run, TrainingError
    from .runstore.read import delete_runs, load_run, runs
    from .tools.autotune import autotune
    from .tools.compare import compare
    from .tools.diff import Diff, diff
    from .tools.lr_find import lr_find
    from .tools.profiling import profile
    from .train.schedule import schedule_preview
    from .ui.panel import Panel
    from .views.dashboard import Dashboard

__all__ = ["TrainConfig", "ConfigError", "fit", "watch", "Run", "TrainingError", "schedule_preview",
           "max_batch_size", "compare", "diff", "Diff", "lr_find", "autotune", "profile",
           "runs", "load_run", "delete_runs",
           "datasets", "data", "load_ipython_extension", "unload_ipython_extension",
           "Panel", "Dashboard"]

# Every public name loads its module on first use, so that `import nbtrain` costs a script
# (and a watch) only what it touches: name -> the module that defines it.
_LAZY = {"TrainConfig": "config", "ConfigError": "config",
         "fit": "entry", "watch": "entry",
         "Run": "run", "TrainingError": "run",
         "schedule_preview": "train.schedule", "max_batch_size": "auto.memory",
         "compare": "tools.compare", "diff": "tools.diff", "Diff": "tools.diff",
         "lr_find": "tools.lr_find",
         "autotune": "tools.autotune", "profile": "tools.profiling",
         "runs": "runstore.read", "load_run": "runstore.read", "delete_runs": "runstore.read",
         "Panel": "ui.panel", "Dashboard": "views.dashboard"}
_SUBMODULES = {"data": "data", "datasets": "data.datasets"}   # names that are modules


def __getattr__(name):
    if name in _SUBMODULES:
        with _collector_paused():
            value = importlib.import_module(f".{_SUBMODULES[name]}", __name__)
    elif name in _LAZY:
        start = time.perf_counter()
        with _collector_paused():
            value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        if _LAZY[name] == "entry":   # a watch's measuring counts its engine's loading as spent
            from .auto import budget
            budget.loaded(time.perf_counter() - start)
    else:
        raise AttributeError(f"module 'nbtrain' has no attribute {name!r}")
    globals()[name] = value   # the next lookup is an ordinary one
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


@contextlib.contextmanager
def _collector_paused():
    """nbtrain's modules load with the garbage collector paused, then it runs as it did
    (left off where the program turned it off). A watch's first use loads ~50 of them:
    ~5,000 objects that all live on (classes, functions, their dicts), so a collection
    while they load frees nothing, yet each 700 of them is one young collection of the
    program's, and every ~100 of those a full one (~70 ms over torch's ~170k objects on a
    2-core host), which a short program as written may never reach. Paused, and then
    moved to the oldest generation, they cost it no collection: its full collections come
    where its own objects bring them (docs/guide/measured.md)."""
    collecting, loaded = gc.isenabled(), len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > loaded:
            _to_the_oldest_generation()
        if collecting:
            gc.enable()


def _to_the_oldest_generation() -> None:
    """The objects just loaded move to the collector's oldest generation untraversed
    (gc.freeze, then gc.unfreeze): otherwise the program's next young collection and the
    next of the middle generation each traverse all ~5,000 of them, ~1.5 and ~3 ms that a
    short program as written never pays. The program's own young objects of that moment
    move with them (freeze takes every generation): a cycle among them that is garbage
    is freed by the next full collection instead of a young one. A program that froze
    objects itself keeps them frozen: then nothing moves."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


def _hand_in_progress(entry) -> None:
    """fit(progress=True)'s bar: a view, handed down to the entry, which imports no view;
    loaded where a run shows it, not with the entry (a watch in a script shows none)."""
    entry.show_progress_with(_attach_progress, _setup_line)


def _attach_progress(run) -> None:
    from .views.progress import attach_progress
    attach_progress(run)


def _setup_line(run):
    from .views.progress import setup_line
    return setup_line(run)


class _Package(types.ModuleType):
    # The import system binds each submodule to its package once loaded: the entry gets
    # the bar then, however it was first imported (nt.fit, a tool, `from nbtrain import entry`).
    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "entry" and isinstance(value, types.ModuleType):
            _hand_in_progress(value)


sys.modules[__name__].__class__ = _Package


def load_ipython_extension(ipython) -> None:
    """`%load_ext nbtrain`: registers the %%fasttrain cell magic."""
    with _collector_paused():
        from .ui.magic import load_ipython_extension as load
    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from .ui.magic import unload_ipython_extension as unload
    unload(ipython)
