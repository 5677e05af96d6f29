"""What the watch's parts share: the step's edge (Edge) and the undo list of every hook
and patch (Patches). Each part keeps the rest of its state to itself."""
from __future__ import annotations

import time


class Patches:
    """Every hook and patch of one watch, each with the call that undoes it."""

    def __init__(self):
        self._undo = []

    def keep(self, undo) -> None:
        self._undo.append(undo)

    def patch(self, owner, name: str, make):
        """Replace `owner.name` with `make(original)` until undo_all(); an inherited one (a
        C method of TensorBase) is removed again rather than set, so that lookup finds the
        very object it found before. Returns the function that undoes it."""
        own = name in owner.__dict__
        original = owner.__dict__[name] if own else getattr(owner, name)
        setattr(owner, name, make(getattr(owner, name)))
        undone = []

        def undo() -> None:   # once: some patches are undone early (host reads, copies)
            if not undone:
                undone.append(True)
                setattr(owner, name, original) if own else delattr(owner, name)
        self._undo.append(undo)
        return undo

    def undo_all(self) -> None:
        """Undo every one, last first, whatever else fails."""
        while self._undo:
            try:
                self._undo.pop()()
            except Exception:   # the next undo still runs
                pass


class Edge:
    """Where a step of the loop stands, as every part sees it: the Run and its interval,
    the model and its device, the backward calls and training batches since the last step,
    and whether nbtrain's own code runs now (its calls are not the loop's)."""

    __slots__ = ("run", "optimize", "patches", "model", "device", "interval", "inside",
                 "samples", "backwards", "batches", "trained", "at_boundary", "started",
                 "stop_asked", "marks_steps", "waited_s")

    def __init__(self, run, optimize: bool):
        self.run, self.optimize, self.patches = run, optimize, Patches()
        self.model = self.device = self.interval = None
        self.inside = False        # nbtrain's own code runs: its calls are not the loop's
        self.samples = 0           # samples of the step's batches not yet added to a loss
        self.backwards = 0         # backward() calls since the last step
        self.batches = 0           # training batches since the last step
        self.trained = False       # the loop's first backward has run
        self.at_boundary = True    # between two steps: where Stop ends the loop
        self.started = time.perf_counter()
        self.stop_asked = run.stop_check()
        self.marks_steps = False   # the interval's timer marks each step's start
        self.waited_s = 0.0        # the whole watch's data wait (the bf16 trial's blocks)

    def stop_if_asked(self) -> None:
        """End the loop at the step boundary: after a finished step, before the next one
        has changed anything (its batch may be loaded; its forward has not run). Called
        only at a boundary: the callers, which run every step, check `at_boundary` first."""
        if self.stop_asked():   # Run.stop_requested, one call where the property makes two
            raise StopWatching()


class StopWatching(BaseException):
    """Raised into the user's loop at a step boundary after Stop or Ctrl-C; the watch
    swallows it. A BaseException, as KeyboardInterrupt, so `except Exception` in the loop
    does not catch it (nor does `except KeyboardInterrupt`)."""
