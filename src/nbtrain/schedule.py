"""Learning-rate schedules as pure functions of the step.

The loop sets `group["lr"] = schedule.lr(step)` before each optimizer step, so
`schedule_preview` can return exactly the rates a run will apply, and resuming needs
nothing but the step (plus the plateau state, the one schedule that reads metrics).
"""
from __future__ import annotations

import math
from typing import List

from .config import TrainConfig


def _constant(cfg, t, n, base):
    return base


def _linear(cfg, t, n, base):
    return base + (cfg.min_lr - base) * min(t / n, 1.0)


def _cosine(cfg, t, n, base):
    return cfg.min_lr + 0.5 * (base - cfg.min_lr) * (1 + math.cos(math.pi * min(t / n, 1.0)))


def _step_decay(cfg, t, n, base):
    return base * cfg.gamma ** (t // cfg.step_size)


def _exponential(cfg, t, n, base):
    return base * cfg.gamma ** t


def _onecycle(cfg, t, n, base):
    # Same shape as torch's OneCycleLR(anneal_strategy="cos"): rise to base, then fall.
    start = base / cfg.div_factor
    end = start / cfg.final_div_factor
    rise = max(1.0, cfg.pct_start * n - 1)
    if t <= rise:
        return _cos_between(start, base, t / rise)
    return _cos_between(base, end, min((t - rise) / max(1.0, n - 1 - rise), 1.0))


def _cos_between(a, b, frac):
    return b + (a - b) * 0.5 * (1 + math.cos(math.pi * frac))


def _cyclic(cfg, t, n, base):
    half = cfg.cycle_steps / 2
    pos = t % cfg.cycle_steps
    frac = pos / half if pos < half else (cfg.cycle_steps - pos) / half
    return cfg.min_lr + (base - cfg.min_lr) * frac


SHAPES = {"constant": _constant, "linear": _linear, "cosine": _cosine, "step": _step_decay,
          "exponential": _exponential, "onecycle": _onecycle, "cyclic": _cyclic,
          "plateau": _constant}


def lr_at(cfg: TrainConfig, step: int, total_steps: int, base_lr: float) -> float:
    """The LR for optimizer step `step` (0-based): linear warmup, then the schedule."""
    if step < cfg.warmup_steps:
        return base_lr * (step + 1) / cfg.warmup_steps
    after = step - cfg.warmup_steps
    remaining = max(1, total_steps - cfg.warmup_steps)
    return SHAPES[cfg.scheduler](cfg, after, remaining, base_lr)


class Schedule:
    """The LR of a run: `lr_at` times the plateau factor; `base_lr` may change live."""

    def __init__(self, cfg: TrainConfig, total_steps: int):
        self.cfg = cfg
        self.total_steps = total_steps
        self.base_lr = cfg.lr
        self.plateau_scale = 1.0
        self.best = math.inf
        self.bad_epochs = 0

    def lr(self, step: int) -> float:
        return lr_at(self.cfg, step, self.total_steps, self.base_lr) * self.plateau_scale

    def on_validation(self, val_loss: float) -> None:
        """Plateau only: cut the LR after `plateau_patience` epochs without improvement."""
        if self.cfg.scheduler != "plateau":
            return
        if val_loss < self.best * (1 - 1e-4):
            self.best, self.bad_epochs = val_loss, 0
            return
        self.bad_epochs += 1
        if self.bad_epochs > self.cfg.plateau_patience:
            self.plateau_scale *= self.cfg.plateau_factor
            self.bad_epochs = 0

    def state_dict(self) -> dict:
        return {"base_lr": self.base_lr, "plateau_scale": self.plateau_scale,
                "best": self.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict) -> None:
        self.base_lr = state["base_lr"]
        self.plateau_scale = state["plateau_scale"]
        self.best = state["best"]
        self.bad_epochs = state["bad_epochs"]


def schedule_preview(config: TrainConfig, total_steps: int) -> List[float]:
    """The LR that a run with `config` applies at each of its `total_steps` steps.

    >>> cfg = TrainConfig(lr=0.1, scheduler="cosine", warmup_steps=2)
    >>> [round(x, 3) for x in schedule_preview(cfg, 5)]
    [0.05, 0.1, 0.1, 0.075, 0.025]
    """
    schedule = Schedule(config, total_steps)
    return [schedule.lr(step) for step in range(total_steps)]
