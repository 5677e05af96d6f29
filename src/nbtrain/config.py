"""TrainConfig: every training setting in one validated dataclass.

The loop only reads it; widgets, the magic and the CLI only write it. `to_dict()` goes
into every checkpoint, so a run can always say exactly how it was trained.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

OPTIMIZERS = ("sgd", "adam", "adamw", "radam", "nadam", "rmsprop", "adagrad")
SCHEDULERS = ("constant", "linear", "cosine", "step", "exponential", "onecycle",
              "cyclic", "plateau")
AMP_MODES = ("off", "fp16", "bf16", "auto")
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for-loop")
ON_NAN = ("stop", "skip")
MP_CONTEXTS = (None, "fork", "spawn", "forkserver")


class ConfigError(ValueError):
    """A setting that cannot be used: names the field, the value given and what is allowed."""


@dataclass
class TrainConfig:
    """Every setting of a training run.

    >>> cfg = TrainConfig(epochs=3, amp="bf16", optimizer="adamw", scheduler="cosine")
    >>> cfg.replace(lr=1e-3).lr
    0.001
    """

    # --- length -------------------------------------------------------------------
    epochs: int = 1
    max_steps: Optional[int] = None       # optimizer steps; when set, overrides epochs
    batch_size: int = 64
    drop_last: bool = False
    shuffle: bool = True
    # --- where it runs and at what precision ---------------------------------------
    device: str = "auto"                  # auto | cpu | cuda | cuda:N | mps
    amp: str = "auto"                     # off | fp16 | bf16 | auto
    channels_last: bool = False
    compile: bool = False
    activation_checkpointing: Union[bool, int] = False  # Sequential models: True or N segments
    # --- data path (fewer, larger, pinned, asynchronous copies) ---------------------
    pin_memory: Union[bool, str] = "auto"
    num_workers: Union[int, str] = "auto"
    num_threads: Union[int, str] = "auto"  # CPU threads for training; workers share the cores
    prefetch_factor: Optional[int] = None  # batches each worker loads ahead (workers > 0)
    persistent_workers: bool = False
    multiprocessing_context: Optional[str] = None  # fork | spawn | forkserver
    data_on_device: Union[bool, str] = "auto"
    batched_fetch: Union[bool, str] = "auto"  # index tensor data by whole batches
    prefetch_to_device: Union[bool, str] = "auto"  # CUDA: copy the next batch on a side stream
    # --- optimizer ------------------------------------------------------------------
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    decay_norm_and_bias: bool = False     # weight decay also on biases and norm weights
    momentum: float = 0.9                 # sgd, rmsprop
    nesterov: bool = False                # sgd
    betas: Tuple[float, float] = (0.9, 0.999)  # adam, adamw, radam, nadam
    eps: float = 1e-8
    optimizer_impl: str = "auto"          # auto | fused | foreach | for-loop
    # --- LR schedule ----------------------------------------------------------------
    scheduler: str = "constant"
    warmup_steps: int = 0                 # linear warmup from 0, composes with every schedule
    min_lr: float = 0.0                   # floor of linear, cosine, cyclic
    step_size: int = 1000                 # step: decay every step_size steps
    gamma: float = 0.1                    # step: factor per step_size; exponential: per step
    cycle_steps: int = 2000               # cyclic: steps in one full up-and-down cycle
    pct_start: float = 0.3                # onecycle: fraction of steps spent rising
    div_factor: float = 25.0              # onecycle: start lr = lr / div_factor
    final_div_factor: float = 1e4         # onecycle: end lr = start lr / final_div_factor
    plateau_patience: int = 2             # plateau: epochs without val improvement
    plateau_factor: float = 0.1           # plateau: factor applied after patience runs out
    # --- the step -------------------------------------------------------------------
    grad_accum_steps: int = 1
    clip_grad_norm: Optional[float] = None
    on_nan: str = "stop"                  # stop | skip
    # --- bookkeeping ----------------------------------------------------------------
    log_every: int = 10
    telemetry: bool = True                # time split, memory and diagnosis in each record
    history_limit: int = 5000             # older records are merged beyond this many
    release_previous: bool = False        # free the previous run's optimizer state and cache
    seed: int = 0
    checkpoint_dir: Optional[str] = None
    checkpoint_every: Optional[int] = None  # steps; None: only at the end of the run

    def __post_init__(self):
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        for check in _CHECKS:
            check(self)

    # -- copies and round trips --------------------------------------------------------
    def replace(self, **changes: Any) -> "TrainConfig":
        """A new config with `changes` applied; unknown names raise ConfigError."""
        _reject_unknown(changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        _reject_unknown(values)
        return cls(**values)


def as_config(config) -> TrainConfig:
    """A TrainConfig from None (the defaults), a TrainConfig or a dict of its fields."""
    if config is None:
        return TrainConfig()
    if isinstance(config, dict):
        return TrainConfig.from_dict(config)
    if isinstance(config, TrainConfig):
        return config
    raise TypeError(f"config must be a TrainConfig or a dict of its fields; "
                    f"got {type(config).__name__}.")


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(TrainConfig))


def _reject_unknown(names) -> None:
    for name in names:
        if name not in FIELD_NAMES:
            close = difflib.get_close_matches(name, FIELD_NAMES, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"TrainConfig has no setting '{name}'.{hint}")


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"TrainConfig.{name}={value!r} is not allowed: expected {allowed}.")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_choices(cfg: TrainConfig) -> None:
    for name, choices in (("amp", AMP_MODES), ("optimizer", OPTIMIZERS),
                          ("scheduler", SCHEDULERS), ("optimizer_impl", OPTIMIZER_IMPLS),
                          ("on_nan", ON_NAN), ("multiprocessing_context", MP_CONTEXTS)):
        value = getattr(cfg, name)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            _fail(name, value, "one of " + ", ".join(repr(c) for c in choices) + hint)


def _check_device(cfg: TrainConfig) -> None:
    dev = cfg.device
    ok = isinstance(dev, str) and (
        dev in ("auto", "cpu", "cuda", "mps")
        or (dev.startswith("cuda:") and dev[5:].isdigit()))
    if not ok:
        _fail("device", dev, "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'")


def _check_counts(cfg: TrainConfig) -> None:
    positive = ("epochs", "batch_size", "grad_accum_steps", "log_every", "step_size",
                "history_limit",
                "cycle_steps")
    for name in positive:
        value = getattr(cfg, name)
        if not _is_int(value) or value < 1:
            _fail(name, value, "a whole number >= 1")
    for name in ("max_steps", "checkpoint_every", "prefetch_factor"):
        value = getattr(cfg, name)
        if value is not None and (not _is_int(value) or value < 1):
            _fail(name, value, "None or a whole number >= 1")
    for name in ("warmup_steps", "plateau_patience"):
        value = getattr(cfg, name)
        if not _is_int(value) or value < 0:
            _fail(name, value, "a whole number >= 0")
    if not _is_int(cfg.seed):
        _fail("seed", cfg.seed, "a whole number")


def _check_rates(cfg: TrainConfig) -> None:
    if not _is_number(cfg.lr) or not cfg.lr > 0:
        _fail("lr", cfg.lr, "a number > 0 (for example 1e-3)")
    for name in ("weight_decay", "min_lr", "momentum", "eps"):
        value = getattr(cfg, name)
        if not _is_number(value) or value < 0:
            _fail(name, value, "a number >= 0")
    if cfg.min_lr > cfg.lr:
        _fail("min_lr", cfg.min_lr, f"a number <= lr ({cfg.lr})")
    if cfg.nesterov and (cfg.optimizer != "sgd" or cfg.momentum == 0):
        _fail("nesterov", cfg.nesterov, "False unless optimizer='sgd' with momentum > 0")
    betas = cfg.betas
    if not (isinstance(betas, tuple) and len(betas) == 2
            and all(_is_number(b) and 0 <= b < 1 for b in betas)):
        _fail("betas", betas, "two numbers in [0, 1), for example (0.9, 0.999)")
    for name in ("gamma", "plateau_factor"):
        value = getattr(cfg, name)
        if not _is_number(value) or not 0 < value <= 1:
            _fail(name, value, "a number in (0, 1]")
    if not _is_number(cfg.pct_start) or not 0 < cfg.pct_start < 1:
        _fail("pct_start", cfg.pct_start, "a number in (0, 1)")
    for name in ("div_factor", "final_div_factor"):
        value = getattr(cfg, name)
        if not _is_number(value) or value < 1:
            _fail(name, value, "a number >= 1")
    clip = cfg.clip_grad_norm
    if clip is not None and (not _is_number(clip) or clip <= 0):
        _fail("clip_grad_norm", clip, "None or a number > 0")


def _check_data_path(cfg: TrainConfig) -> None:
    for name in ("pin_memory", "data_on_device", "batched_fetch", "prefetch_to_device"):
        value = getattr(cfg, name)
        if not (isinstance(value, bool) or value == "auto"):
            _fail(name, value, "True, False or 'auto'")
    workers = cfg.num_workers
    if not (workers == "auto" or (_is_int(workers) and workers >= 0)):
        _fail("num_workers", workers, "'auto' or a whole number >= 0")
    threads = cfg.num_threads
    if not (threads == "auto" or (_is_int(threads) and threads >= 1)):
        _fail("num_threads", threads, "'auto' or a whole number >= 1")
    if workers == 0 and cfg.persistent_workers:
        _fail("persistent_workers", True, "False when num_workers=0 (there are no workers to keep)")
    if workers == 0 and cfg.prefetch_factor is not None:
        _fail("prefetch_factor", cfg.prefetch_factor,
              "None when num_workers=0 (only workers prefetch)")
    for name in ("drop_last", "shuffle", "channels_last", "compile", "nesterov",
                 "persistent_workers", "decay_norm_and_bias", "telemetry", "release_previous"):
        if not isinstance(getattr(cfg, name), bool):
            _fail(name, getattr(cfg, name), "True or False")


def _check_memory(cfg: TrainConfig) -> None:
    ac = cfg.activation_checkpointing
    if not (isinstance(ac, bool) or (_is_int(ac) and ac >= 1)):
        _fail("activation_checkpointing", ac, "True, False or a number of segments >= 1")
    if ac is not False and cfg.compile:
        _fail("activation_checkpointing", ac, "False when compile=True (pick one)")
    if cfg.history_limit < 10:
        _fail("history_limit", cfg.history_limit, "a whole number >= 10")


_CHECKS = (_check_memory, _check_choices, _check_device, _check_counts, _check_rates, _check_data_path)
