"""What the loop does between its steps, timed for run.gaps(): an evaluation pass (a
DataLoader other than the training one, iterated between steps), `torch.save` (the loop's
checkpoints, a framework's), the training loader's start each epoch (its iterator and
workers, up to its first batch), and the rest, the loop's own code: from a step's end to
the next step's start, less what the others took. Host clocks only, at a step's edges:
an evaluation or a save inside a step is the step's.

`torch.save` is wrapped for the watch only (install); the steps part tells `step_ended`,
the loader and forward parts tell `step_starts` and the rest."""
from __future__ import annotations

import functools
import time

import torch


class Between:
    """The watch's part that times the gaps between steps into the Run's Gaps."""

    def __init__(self, edge):
        self.edge = edge
        self._gaps = edge.run.between
        self._ended_at = edge.started   # the last step's end (the watch's start before one)
        self.last_end = None            # the last step's end, kept after the next one starts

    def install(self) -> None:
        self.edge.patches.patch(torch, "save", self._wrap_save)

    def step_ended(self) -> None:
        self._ended_at = self.last_end = time.perf_counter()

    def step_starts(self, now: float) -> None:
        """A step's first batch is fetched, or its first forward runs, at `now`: the time
        since the last step's end that nothing named was the loop's own code. Only the
        first call after a step's end counts (a GAN's second batch is the same step's)."""
        ended = self._ended_at
        if ended is not None:   # added to in place, as the data wait to its Interval: a
            self._gaps.between_s += now - ended   # step's start is on the loop's path
            self._ended_at = None

    def epoch_started(self, at: float, seconds: float) -> None:
        """The training loader's pass began at `at` (a step's start) and took `seconds` to
        its first batch: its iterator, its workers' start."""
        self.step_starts(at)
        self._gaps.add("loader start", seconds)

    def timed_evaluation(self, batches):
        """The batches of a pass over another loader between steps, its time (the loop's
        work on each batch included) an evaluation's, however the pass ends."""
        start = time.perf_counter()
        try:
            yield from batches
        finally:
            self._named_as("evaluation", time.perf_counter() - start)

    def end(self) -> None:
        """The watch ends: the time since the last step's end, as step_starts counts it."""
        self.step_starts(time.perf_counter())

    def _named_as(self, part: str, seconds: float) -> None:
        """Between steps, not the loop's own code."""
        self._gaps.add(part, seconds, between=self._ended_at is not None)

    def _wrap_save(self, original):
        part, edge = self, self.edge

        @functools.wraps(original)
        def save(*args, **kwargs):
            if edge.inside:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                part._named_as("saving", time.perf_counter() - start)
        return save
