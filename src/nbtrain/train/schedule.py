"""Learning-rate schedules as pure functions of the step.

The loop sets `group["lr"] = schedule.lr(step)` before each optimizer step, so
`schedule_preview` can return exactly the rates a run will apply, and resuming needs
nothing but the step (plus the plateau state, the one schedule that reads metrics).
"""
from __future__ import annotations

import math
from typing import List

from ..config import TrainConfig


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


def lr_at(cfg: TrainConfig, step: int, total_steps: int, base_lr: float,
          shape=None) -> float:
    """The LR for optimizer step `step` (0-based): linear warmup, then the schedule
    (`shape`, for a scheduler factory: see `_torch_shape`)."""
    if step < cfg.warmup_steps:
        return base_lr * (step + 1) / cfg.warmup_steps
    after = step - cfg.warmup_steps
    remaining = max(1, total_steps - cfg.warmup_steps)
    return (shape or SHAPES[cfg.scheduler])(cfg, after, remaining, base_lr)


def _torch_shape(cfg: TrainConfig, total_steps: int):
    """A shape for `lr_at` from the user's scheduler factory (optimizer -> torch scheduler).

    The rates are found once, by stepping the scheduler once per optimizer step on a
    throwaway optimizer like the run's (over one dummy parameter): the run's optimizer is
    never touched, so the LR stays a pure function of the step (preview, resume, set_lr
    work as for the named schedules). Only the LR is taken: a scheduler that also cycles
    momentum (OneCycleLR, CyclicLR) has its momentum left alone.
    """
    steps = max(1, total_steps - cfg.warmup_steps)
    rates = _stepped_rates(cfg, steps)

    def shape(cfg, t, n, base):
        return rates[min(t, len(rates) - 1)] * base / cfg.lr   # set_lr scales the whole curve
    return shape


def _stepped_rates(cfg: TrainConfig, steps: int) -> List[float]:
    import torch

    from ..config import ConfigError
    from .optim import build_optimizer
    optimizer = build_optimizer(torch.nn.Linear(1, 1), cfg.replace(optimizer_impl="auto"),
                                "for-loop")
    try:
        scheduler = cfg.scheduler(optimizer)
    except Exception as exc:
        raise ConfigError(f"TrainConfig.scheduler={cfg.scheduler!r} failed on a "
                          f"{type(optimizer).__name__} ({type(exc).__name__}: {exc}). It is "
                          "given the run's optimizer: fit it to that optimizer.",
                          field="scheduler") from exc
    if not callable(getattr(scheduler, "get_last_lr", None)) \
            or isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError(f"TrainConfig.scheduler={cfg.scheduler!r} made a "
                          f"{type(scheduler).__name__}, not a step-driven torch LR scheduler: "
                          "use scheduler='plateau' for ReduceLROnPlateau, or return a "
                          "torch.optim.lr_scheduler.LRScheduler.", field="scheduler")
    rates = []
    try:
        for _ in range(steps):
            rates.append(scheduler.get_last_lr()[0])
            optimizer.step()   # no gradients: a no-op, but schedulers warn when it is skipped
            scheduler.step()
    except Exception as exc:
        raise ConfigError(f"TrainConfig.scheduler={cfg.scheduler!r} failed at step "
                          f"{len(rates)} of {steps} ({type(exc).__name__}: {exc}). It is "
                          "stepped once per optimizer step: size it for the run's steps.",
                          field="scheduler") from exc
    return rates


class Schedule:
    """The LR of a run: `lr_at` times the plateau factor; `base_lr` may change live."""

    def __init__(self, cfg: TrainConfig, total_steps: int):
        self.cfg = cfg
        self.total_steps = total_steps
        self.base_lr = cfg.lr
        self.plateau_scale = 1.0
        self.best = math.inf
        self.bad_epochs = 0
        self.shape = _torch_shape(cfg, total_steps) if callable(cfg.scheduler) else None

    def lr(self, step: int) -> float:
        return lr_at(self.cfg, step, self.total_steps, self.base_lr,
                     self.shape) * self.plateau_scale

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
