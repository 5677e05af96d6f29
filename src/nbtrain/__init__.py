"""nbtrain: fast PyTorch training loops you can switch, see and measure from a notebook.

>>> import nbtrain as nt
>>> run = nt.fit(model, (x, y), loss_fn, config=nt.TrainConfig(epochs=3, amp="bf16"))
"""
from __future__ import annotations

from .data import datasets
from .tools.autotune import autotune
from .tools.compare import compare
from .config import ConfigError, TrainConfig
from .entry import fit, show_progress_with, watch
from .tools.lr_find import lr_find
from .auto.memory import max_batch_size
from .tools.profiling import profile
from .views.progress import attach_progress, setup_line
from .run import Run, TrainingError
from .train.schedule import schedule_preview
from .runstore.read import delete_runs, load_run, runs
from .version import __version__

# fit(progress=True)'s bar: a view, handed down to the entry, which imports no view
show_progress_with(attach_progress, setup_line)
del attach_progress, setup_line, show_progress_with

__all__ = ["TrainConfig", "ConfigError", "fit", "watch", "Run", "TrainingError", "schedule_preview",
           "max_batch_size", "compare", "lr_find", "autotune", "profile",
           "runs", "load_run", "delete_runs",
           "datasets", "data", "load_ipython_extension", "unload_ipython_extension",
           "Panel", "Dashboard"]

_LAZY = {"Panel": "ui.panel", "Dashboard": "views.dashboard"}   # they load ipywidgets/plotly: on first use


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'nbtrain' has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:
    """`%load_ext nbtrain`: registers the %%fasttrain cell magic."""
    from .ui.magic import load_ipython_extension as load
    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from .ui.magic import unload_ipython_extension as unload
    unload(ipython)
