"""The watch's window over the model's leaf modules (run.modules(), run.peak()): a few of
the loop's steps timed module by module, once the measuring part finds it affordable
(measure.py), then every hook removed. The hooks themselves are telemetry/modules.py's,
loaded only when a window opens: a watch that never opens one pays nothing for it."""
from __future__ import annotations

from ..auto import budget
from ..telemetry import WINDOW_STEPS, not_measured

WINDOW_COST = 2.0   # a step under the window's hooks takes up to ~this many steps (Python per leaf)
WINDOW_LOAD_S = 0.001   # a process's first window loads telemetry/modules.py


class Modules:
    """The watch's part that times the leaf modules over one window of steps: Measure
    opens it (`open`) and tells it each step's end (`step_done`); `finish` says why there
    is no table where none was measured. Its hooks are in the Patches from `open` on, so
    every way out removes them."""

    def __init__(self, edge):
        self.edge = edge
        self.window = None     # the ModuleWindow while it runs
        self.due = False       # a window is still to be run on this model
        self._why_not = None   # why none will be
        self._opened_at = self._step_s = 0.0

    def plan(self, compiled: bool) -> bool:
        """At the model's first forward: whether a window is due on it."""
        if compiled:   # its leaves run inside a compiled graph: no hook sees them
            self._why_not = "a torch.compile'd model (its leaves run inside a graph)"
        self.due = not compiled
        return self.due

    @property
    def running(self) -> bool:
        return self.window is not None

    def cost_s(self, step_s: float) -> float:
        """Its steps under the hooks, and its module's loading where not loaded yet (asking
        loads nothing: a loop too short for a window never loads it)."""
        loading = budget.first_use_s("nbtrain.telemetry.modules", WINDOW_LOAD_S)
        return WINDOW_STEPS * WINDOW_COST * step_s + loading

    def open(self, now: float, step_s: float) -> None:
        from ..telemetry.modules import ModuleWindow
        edge = self.edge
        self.window = ModuleWindow(edge.model, edge.device, edge.run.optimizer)
        self.window.open()
        edge.patches.keep(self.window.close)
        self.due, self._opened_at, self._step_s = False, now, step_s

    def step_done(self, now: float) -> float:
        """A step of the window ended at `now`: the window's extra cost once it is full
        (its record emitted), else 0."""
        window = self.window
        if not window.step_done():
            return 0.0
        self.window = None
        self.edge.run.emit(window.record(self.edge.run.step))
        return now - self._opened_at - window.done * self._step_s

    def finish(self, exc, too_short: str) -> None:
        """The watch ends (its hooks already removed): a window still open is discarded,
        and a run without a table says why (`too_short`: the loop ended before a window
        was affordable)."""
        run, window = self.edge.run, self.window
        if window is not None:
            self.window = None
            why = f"{type(exc).__name__} in step {run.step + 1}" \
                if isinstance(exc, Exception) else f"your loop ended at step {run.step}"
            run.emit(not_measured(run.step, f"{why}, inside the window: its {window.done} "
                                  "step(s) discarded"))
        elif not run.records("modules") and self.edge.model is not None:
            run.emit(not_measured(run.step, self._why_not or too_short))
