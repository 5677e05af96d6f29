"""lr_find(): the learning-rate range test (L. Smith, "Cyclical Learning Rates for Training
Neural Networks", 2017, sec. 3.3): raise the LR exponentially, one step at a time, from a
rate too small to matter to one that makes the loss diverge, and read a good LR off the
loss curve.

The sweep is a real nbtrain run (same data path, precision, optimizer and device as
training) whose schedule is the sweep's exponential one, a function of the step like
every nbtrain schedule: the loop never waits for a loss to set the next LR. A
subscriber reads the losses and stops the run once they diverge.
"""
from __future__ import annotations

import math
import statistics
from typing import Callable, List, Optional, Tuple

from ..config import as_config
from ..entry import fit, trials
from ..run import Run
from ..train.schedule import Schedule
from ..views.display import display_with_figure
from .models import fresh_model

SMOOTHING = 0.9          # EMA factor of the divergence check: ~10 steps of memory
MIN_STEPS = 10           # never call divergence before this many steps
BELOW_MINIMUM = 10.0     # the suggestion is this factor below the minimum-loss LR


def lr_find(make_model, train_data, loss_fn: Optional[Callable] = None, *, config=None,
            start_lr: float = 1e-7, end_lr: float = 10.0, num_steps: int = 100,
            diverge: float = 4.0) -> "LRFind":
    """Sweep the LR from `start_lr` to `end_lr` over `num_steps` steps; suggest one.

    >>> found = nt.lr_find(make_mlp, (x, y), F.cross_entropy,
    ...                    config=nt.TrainConfig(optimizer="adamw", batch_size=64))
    >>> run = nt.fit(make_mlp(), (x, y), F.cross_entropy, config=found.config)

    `make_model`: a function returning a fresh model, or a model (it is copied: the
    sweep never trains your model). The sweep stops early once the smoothed loss
    exceeds `diverge` times its lowest value, or is no longer finite.
    """
    _check_range(start_lr, end_lr, num_steps, diverge)
    base = as_config(config)
    cfg = base.replace(lr=start_lr, min_lr=0.0, scheduler="constant", warmup_steps=0,
                       max_steps=num_steps, log_every=1, on_nan="stop", checkpoint_dir=None,
                       checkpoint_every=None)
    sweep = Sweep(start_lr, (end_lr / start_lr) ** (1 / (num_steps - 1)), diverge)
    # log_every=1: a record (the loss) per step for the curve; `on_start=sweep.attach`
    # subscribes before the first step.
    with trials("lr_find"):
        run = fit(fresh_model(make_model), train_data, loss_fn, config=cfg, progress=False,
                  schedule=sweep.schedule, on_start=sweep.attach)
    return LRFind(sweep.lrs, sweep.losses, sweep.diverged, run, base, (start_lr, end_lr))


def _check_range(start_lr, end_lr, num_steps, diverge) -> None:
    if not (isinstance(start_lr, (int, float)) and isinstance(end_lr, (int, float))
            and 0 < start_lr < end_lr):
        raise ValueError(f"lr_find needs 0 < start_lr < end_lr; got start_lr={start_lr!r}, "
                         f"end_lr={end_lr!r}. The defaults are 1e-7 and 10.")
    if not isinstance(num_steps, int) or num_steps < 2 * MIN_STEPS:
        raise ValueError(f"lr_find needs num_steps >= {2 * MIN_STEPS} to see the loss fall "
                         f"and rise; got {num_steps!r}. 100 is usual.")
    if not diverge > 1:
        raise ValueError(f"diverge must be > 1 (the loss growth that ends the sweep); "
                         f"got {diverge!r}. 4 is usual.")


class Sweep:
    """The subscriber that drives the sweep: records, raises the LR, stops on divergence."""

    def __init__(self, start_lr: float, factor: float, diverge: float):
        self.start_lr, self.factor, self.diverge = start_lr, factor, diverge
        self.lrs: List[float] = []
        self.losses: List[float] = []
        self.diverged = False
        self.run: Optional[Run] = None
        self._avg, self._best = 0.0, math.inf

    def schedule(self, default: Schedule) -> Schedule:
        """The sweep's schedule in place of the run's own (fit's `schedule=`)."""
        return ExponentialSweep(default, self.start_lr, self.factor)

    def attach(self, run: Run) -> None:
        self.run = run
        run.subscribe(self.on_record)

    def on_record(self, record: dict) -> None:
        if record["kind"] != "train":
            return
        loss = record["loss"]
        self.lrs.append(record["lr"])
        self.losses.append(loss)
        # Bias-corrected EMA (Adam's correction): the first steps are not pulled to 0.
        self._avg = SMOOTHING * self._avg + (1 - SMOOTHING) * loss
        smooth = self._avg / (1 - SMOOTHING ** len(self.losses))
        self._best = min(self._best, smooth)
        if not math.isfinite(smooth) or (len(self.losses) >= MIN_STEPS
                                         and smooth > self.diverge * self._best):
            self.diverged = True
            self.run.stop()


class ExponentialSweep(Schedule):
    """LR `start_lr * factor**step`: it grows, which no training schedule does."""

    def __init__(self, schedule: Schedule, start_lr: float, factor: float):
        super().__init__(schedule.cfg, schedule.total_steps)
        self.start_lr, self.factor = start_lr, factor

    def lr(self, step: int) -> float:
        return self.start_lr * self.factor ** step


# -- reading the curve -------------------------------------------------------------------------
def smooth_curve(losses: List[float]) -> List[float]:
    """A centred running median, then a centred running mean, over ~a tenth of the sweep.

    Centred, so the curve does not lag: an EMA (the usual choice) shifts the curve
    right, towards larger LRs, by ~1/(1-beta) steps. The median first removes single
    spiky batches that a mean would smear over the window.
    """
    window = max(3, len(losses) // 10) | 1   # odd
    return _running(_running(losses, window, statistics.median), window, statistics.fmean)


def _running(values: List[float], window: int, reduce) -> List[float]:
    half = window // 2
    return [reduce(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def suggest_lr(lrs: List[float], losses: List[float]) -> Tuple[float, int, List[float]]:
    """(suggested LR, index of the smoothed minimum, smoothed losses).

    The suggestion is the LR a fixed factor (10x) below where the *smoothed* loss is
    lowest. Why not the steepest point of the curve: a derivative amplifies noise, and
    with a batch-to-batch noisy loss the raw steepest drop lands wherever two noisy
    batches happen to differ most (often very early or right at the blow-up). The
    minimum of a smoothed curve is a level, not a slope: noise moves it little. At the
    minimum the LR is already so high that the loss stops improving, so it is the edge
    of stability; a decade below sits inside the region where the loss fell fastest
    (Smith 2017; fastai's `minimum/10`) with room for the noise of a long run.
    """
    n = next((i for i, v in enumerate(losses) if not math.isfinite(v)), len(losses))
    if n < 3:
        raise ValueError(f"lr_find: the loss was not finite after {n} step(s), too few to "
                         "read a curve. Lower start_lr, or check the data and loss_fn.")
    smoothed = smooth_curve(losses[:n])
    i_min = min(range(n), key=smoothed.__getitem__)
    return max(lrs[i_min] / BELOW_MINIMUM, lrs[0]), i_min, smoothed


class LRFind:
    """The result of `lr_find`: `.suggestion`, `.lrs`, `.losses`, `.figure()`, `.config`."""

    def __init__(self, lrs, losses, diverged: bool, run: Run, base, lr_range):
        self.lrs, self.losses, self.diverged, self.run = list(lrs), list(losses), diverged, run
        self.suggestion, self.min_index, self.smoothed = suggest_lr(self.lrs, self.losses)
        self.lr_at_min = self.lrs[self.min_index]
        # the given config at the suggested LR (a floor above it would be invalid)
        self.config = base.replace(lr=self.suggestion, min_lr=min(base.min_lr, self.suggestion))
        self.range = lr_range
        self.notes = self._notes()

    def _notes(self) -> List[str]:
        notes = []
        if self.min_index < len(self.smoothed) // 10:
            notes.append("the loss never fell much: start_lr may already be too high "
                         "(lower it), or the model cannot learn this data as set up")
        if not self.diverged:
            notes.append("the loss had not diverged by end_lr: the best LR may lie above "
                         "it; raise end_lr to see the whole curve")
        return notes

    def figure(self):
        """Loss against LR (log axis): raw steps, the smoothed curve, the suggestion."""
        import plotly.graph_objects as go
        fig = go.Figure()
        fig.add_trace(go.Scatter(x=self.lrs, y=self.losses, mode="markers", name="loss per step",
                                 marker=dict(size=4, opacity=0.35)))
        fig.add_trace(go.Scatter(x=self.lrs[:len(self.smoothed)], y=self.smoothed, mode="lines",
                                 name="smoothed"))
        fig.add_trace(go.Scatter(x=[self.lr_at_min], y=[self.smoothed[self.min_index]],
                                 mode="markers", name="lowest loss",
                                 marker=dict(size=10, symbol="x")))
        head = self.smoothed[:self.min_index + 1]   # clip the divergence tail off the y range
        low, high = min(self.smoothed + self.losses[:len(self.smoothed)]), max(head)
        pad = 0.1 * (high - low or abs(high) or 1.0)
        # A trace, not add_vline: on a log axis a shape's x is the value but its
        # annotation's x is the log10 of it (plotly/plotly.py#2580).
        fig.add_trace(go.Scatter(x=[self.suggestion] * 2, y=[low - pad, high + pad],
                                 mode="lines", line=dict(dash="dash"),
                                 name=f"suggested lr {self.suggestion:.2g}"))
        fig.update_layout(xaxis=dict(type="log", title="learning rate"),
                          yaxis=dict(title="loss", range=[low - pad, high + pad]),
                          height=360, margin=dict(t=30, b=40, l=50, r=20))
        return fig

    def __repr__(self) -> str:
        end = "stopped when the loss diverged" if self.diverged else "reached end_lr"
        lines = [f"LR range test: {len(self.lrs)} steps from {self.lrs[0]:.3g} to "
                 f"{self.lrs[-1]:.3g} ({end})",
                 f"suggested lr {self.suggestion:.3g} (1/{BELOW_MINIMUM:g} of {self.lr_at_min:.3g}, "
                 "where the smoothed loss was lowest)"]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html
        return "<pre>" + html.escape(repr(self)) + "</pre>"

    def _ipython_display_(self) -> None:
        display_with_figure(self, self.figure)
