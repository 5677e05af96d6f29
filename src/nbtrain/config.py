"""TrainConfig: every training setting, each declared once.

Each field carries its whole description: default, the values it accepts (a kind from
kinds.py), a one-line help, its group, whether it changes the speed of a step, its
`%%fasttrain` flag and its panel label. The validation, the magic's options, the panel's
controls and autotune's search space are generated from these declarations
(`SETTINGS`), so a new setting is one entry here plus its effect in the loop.

The loop only reads a TrainConfig; widgets, the magic and the CLI only write it.
`to_dict()` goes into every checkpoint, so a run can always say how it was trained.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

from .kinds import (
    AUTO_FLAG,
    CUSTOM,
    FALSE_WORDS,
    TRUE_WORDS,
    AnyOf,
    AutoOr,
    Choice,
    Device,
    Factory,
    Flag,
    Kind,
    Number,
    OrNone,
    Pair,
    Path,
    Several,
    Text,
    Whole,
    custom_name,
    takes_factories,
)

OPTIMIZERS = ("sgd", "adam", "adamw", "radam", "nadam", "rmsprop", "adagrad")
ADAM_FAMILY = ("adam", "adamw", "radam", "nadam")
SCHEDULERS = ("constant", "linear", "cosine", "step", "exponential", "onecycle",
              "cyclic", "plateau")
AMP_MODES = ("off", "fp16", "bf16", "auto")
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for-loop")
ON_NAN = ("stop", "skip")
MP_CONTEXTS = (None, "fork", "spawn", "forkserver")
REPORTERS = ("tensorboard", "mlflow")   # report_to: Hugging Face's name for the same setting

# The groups, in the order the magic's help and the panel's tabs show them:
# key -> (heading in `%%fasttrain?`, the panel's tab; short, as seven tabs share a row).
GROUPS = {"length": ("Length", "Length"), "device": ("Device and precision", "Device"),
          "data path": ("Data path", "Data"), "optimizer": ("Optimizer", "Optimizer"),
          "schedule": ("LR schedule", "Schedule"), "step": ("Step", "Step"),
          "bookkeeping": ("Bookkeeping", "Logging")}


class ConfigError(ValueError):
    """A setting that cannot be used: names the field, the value given and what is allowed.

    `.field` is the TrainConfig field at fault (None when no single field is).
    """

    def __init__(self, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Setting:
    """Everything nbtrain knows about one TrainConfig field besides its default."""
    kind: Kind
    group: str                 # a key of GROUPS
    help: str                  # one line, for `%%fasttrain?` and the docs
    speed: Union[bool, str]    # "tuned": autotune searches it; True: changes a step's speed
    flag: str = ""             # the %%fasttrain option; "" means --field-name
    label: str = ""            # the panel control's description; "" means "field name"
    when: Tuple[str, tuple] = ()   # (field, values): only used then (the panel hides it otherwise)
    options: tuple = ()        # the panel's dropdown, where the kind alone cannot list values
    placeholder: str = ""      # the panel's hint for an empty (None) text box
    watch: str = "loop"        # under nt.watch: WATCH_ROLES, or WATCH_REFUSES + why
    name: str = ""             # filled in from the field


# What nt.watch does with a field, declared on it: "changes" the loop with it (optimize=True),
# "observes" the loop by it (records, telemetry), "keeps" the run by it (name, store), or
# leaves it to the "loop" (its DataLoader, optimizer, epochs: a ConfigError names the field);
# WATCH_REFUSES + why: a field the watch cannot apply, refused rather than ignored.
WATCH_ROLES = ("changes", "observes", "keeps", "loop")
WATCH_REFUSES = "refuses: "


def setting(default, kind: Kind, group: str, help: str, speed: Union[bool, str] = True, **more):
    """A dataclass field declared with its Setting (see `SETTINGS`)."""
    meta = Setting(kind, group, help, speed, **more)
    return dataclasses.field(default=default, metadata={"setting": meta})


WHEN_SGD_LIKE = ("optimizer", ("sgd", "rmsprop"))
WHEN_ONECYCLE = ("scheduler", ("onecycle",))
WHEN_PLATEAU = ("scheduler", ("plateau",))
AUTO_ON_OFF = (("auto", "auto"), ("on", True), ("off", False))
# Each epoch's shuffle seeds torch with seed * SEED_STRIDE + epoch (data/batches.py's
# epoch_order), and torch's manual_seed takes -2**63 .. 2**64 - 1: the seed's range keeps
# that sum inside for EPOCH_ROOM epochs (an epoch is a step or more: beyond any run).
SEED_STRIDE, EPOCH_ROOM = 1_000_003, 2**40
SEEDS = Whole(-(2**63 // SEED_STRIDE), (2**64 - 1 - EPOCH_ROOM) // SEED_STRIDE)


@dataclass
class TrainConfig:
    """Every setting of a training run.

    >>> cfg = TrainConfig(epochs=3, amp="bf16", optimizer="adamw", scheduler="cosine")
    >>> cfg.replace(lr=1e-3).lr
    0.001
    """

    # --- length -------------------------------------------------------------------
    epochs: int = setting(1, Whole(1), "length", "passes over the data", speed=False)
    max_steps: Optional[int] = setting(
        None, OrNone(Whole(1)), "length", "optimizer steps; overrides epochs when set",
        speed=False, label="max steps", placeholder="empty: epochs decide")
    batch_size: int = setting(64, Whole(1), "length", "samples per batch", speed="tuned",
                              label="batch size")
    drop_last: bool = setting(False, Flag(), "length", "drop each epoch's last, shorter batch",
                              label="drop last batch")
    shuffle: bool = setting(True, Flag(), "length", "a new seeded sample order every epoch")
    # --- where it runs and at what precision ---------------------------------------
    device: str = setting("auto", Device(), "device", "auto, cpu, cuda, cuda:N or mps",
                          options=("auto", "cpu", "cuda", "mps"))
    amp: str = setting("auto", Choice(*AMP_MODES), "device",
                       "mixed precision (autocast; fp16 adds a GradScaler)", speed="tuned",
                       label="mixed precision", watch="changes")
    channels_last: bool = setting(False, Flag(), "device",
                                  "channels-last memory format for conv nets", speed="tuned",
                                  label="channels last", watch="changes")
    compile: bool = setting(False, Flag(), "device", "torch.compile the model",
                            label="torch.compile")
    processes: Union[int, str] = setting(
        1, AutoOr(Whole(1, 1024)), "device",
        "local processes training data-parallel on torch.distributed (batch_size is per "
        "process); auto: one per visible GPU", label="processes", options=("auto", 1, 2, 4, 8))
    cluster: Optional[str] = setting(
        None, Choice(None, "ray"), "device",
        "None: this machine; 'ray': the same loop in `processes` Ray Train workers on the "
        "cluster ray.init() finds (RAY_ADDRESS, or a local one)", speed=False)
    gpus_per_worker: Union[float, str] = setting(
        "auto", AutoOr(Number(0)), "device",
        "cluster='ray': GPUs each worker asks Ray for (0: CPU workers, gloo); auto: 1 when "
        "the cluster has a GPU per worker and device is not 'cpu', else 0", speed=False,
        label="GPUs per worker", when=("cluster", ("ray",)), options=("auto", 0, 1))
    activation_checkpointing: Union[bool, int] = setting(
        False, AnyOf(Flag(), Whole(1), allowed="True, False or a number of segments >= 1"),
        "device", "recompute an nn.Sequential's activations in backward (True or N segments)",
        label="activation checkpointing",
        options=(("off", False), ("on", True), 2, 4, 8))
    # --- data path (fewer, larger, pinned, asynchronous copies) ---------------------
    pin_memory: Union[bool, str] = setting(
        "auto", AUTO_FLAG, "data path",
        "pinned host memory, so copies to the GPU can be non-blocking", speed="tuned",
        flag="--pin", options=AUTO_ON_OFF, watch="changes")
    num_workers: Union[int, str] = setting(
        "auto", AutoOr(Whole(0)), "data path", "DataLoader worker processes", speed="tuned",
        flag="--workers", label="loader workers", options=("auto", 0, 1, 2, 4, 8),
        watch="changes")
    num_threads: Union[int, str] = setting(
        "auto", AutoOr(Whole(1, 1024)), "data path",
        "CPU threads for training, leaving cores to the workers", flag="--threads",
        label="CPU threads", options=("auto", 1, 2, 4, 8), watch="changes")
    prefetch_factor: Optional[int] = setting(
        None, OrNone(Whole(1)), "data path", "batches each worker loads ahead (workers > 0)",
        speed="tuned", flag="--prefetch", options=(None, 1, 2, 4, 8))
    persistent_workers: bool = setting(False, Flag(), "data path",
                                       "keep workers alive between epochs", speed="tuned",
                                       flag="--persistent",
                                      watch=WATCH_REFUSES + "the workers nt.watch starts are kept "
                                      "across epochs already")
    multiprocessing_context: Optional[str] = setting(
        None, Choice(*MP_CONTEXTS), "data path",
        "how worker processes start (None: the platform's default)",
        label="worker start method")
    data_on_device: Union[bool, str] = setting(
        "auto", AUTO_FLAG, "data path", "keep the whole dataset on the device", speed="tuned",
        flag="--on-device", options=AUTO_ON_OFF)
    batched_fetch: Union[bool, str] = setting(
        "auto", AUTO_FLAG, "data path",
        "index tensor data a whole batch at a time, not per sample", speed="tuned",
        options=AUTO_ON_OFF, watch="changes")
    prefetch_to_device: Union[bool, str] = setting(
        "auto", AUTO_FLAG, "data path", "CUDA: copy the next batch on a side stream",
        label="prefetch to GPU", options=AUTO_ON_OFF, watch="changes")
    # --- optimizer ------------------------------------------------------------------
    optimizer: Union[str, Callable] = setting(
        "adamw", AnyOf(Choice(*OPTIMIZERS), Factory("a torch.optim.Optimizer subclass or a "
                                                    "function params -> optimizer")),
        "optimizer", "the optimizer: a name, or your own class or factory (params -> optimizer)")
    lr: float = setting(1e-3, Number(0, low_open=True, example="1e-3"), "optimizer",
                        "base learning rate", speed=False, label="learning rate")
    weight_decay: float = setting(0.0, Number(0), "optimizer", "weight decay", flag="--wd")
    decay_norm_and_bias: bool = setting(False, Flag(), "optimizer",
                                        "weight decay also on biases and norm weights",
                                        label="decay norms and biases")
    momentum: float = setting(0.9, Number(0), "optimizer", "momentum for sgd and rmsprop",
                              when=WHEN_SGD_LIKE)
    nesterov: bool = setting(False, Flag(), "optimizer",
                             "Nesterov momentum (sgd with momentum > 0)",
                             label="Nesterov", when=("optimizer", ("sgd",)))
    betas: Tuple[float, float] = setting(
        (0.9, 0.999), Pair(Number(0, 1, high_open=True), (0.9, 0.999)), "optimizer",
        "Adam-family betas", label="beta1, beta2", when=("optimizer", ADAM_FAMILY))
    eps: float = setting(1e-8, Number(0), "optimizer", "the optimizer's epsilon (not sgd)",
                         when=("optimizer", tuple(o for o in OPTIMIZERS if o != "sgd")))
    optimizer_impl: str = setting("auto", Choice(*OPTIMIZER_IMPLS), "optimizer",
                                  "kernel: fused, foreach or a for-loop over parameters",
                                  label="implementation", watch="changes")
    # --- LR schedule ----------------------------------------------------------------
    scheduler: Union[str, Callable] = setting(
        "constant", AnyOf(Choice(*SCHEDULERS), Factory("a function optimizer -> torch LR "
                                                       "scheduler")),
        "schedule", "the LR schedule: a name, or your own factory (optimizer -> scheduler)",
        speed=False, label="schedule")
    warmup_steps: int = setting(0, Whole(0), "schedule",
                                "linear warmup steps from 0, before any schedule",
                                speed=False, flag="--warmup", label="warmup steps")
    min_lr: float = setting(0.0, Number(0), "schedule", "LR floor of linear, cosine and cyclic",
                            speed=False, label="min lr",
                            when=("scheduler", ("linear", "cosine", "cyclic")))
    step_size: int = setting(1000, Whole(1), "schedule", "step: decay every N steps",
                             speed=False, label="step size", when=("scheduler", ("step",)))
    gamma: float = setting(0.1, Number(0, 1, low_open=True), "schedule",
                           "step: factor per step_size; exponential: factor per step",
                           speed=False, when=("scheduler", ("step", "exponential")))
    cycle_steps: int = setting(2000, Whole(1), "schedule",
                               "cyclic: steps in one full up-and-down cycle", speed=False,
                               label="cycle length (steps)", when=("scheduler", ("cyclic",)))
    pct_start: float = setting(0.3, Number(0, 1, low_open=True, high_open=True), "schedule",
                               "onecycle: fraction of the steps spent rising", speed=False,
                               label="rising fraction", when=WHEN_ONECYCLE)
    div_factor: float = setting(25.0, Number(1), "schedule",
                                "onecycle: start LR = lr / div_factor", speed=False,
                                label="start = lr /", when=WHEN_ONECYCLE)
    final_div_factor: float = setting(1e4, Number(1), "schedule",
                                      "onecycle: end LR = start LR / final_div_factor",
                                      speed=False, label="end = start /", when=WHEN_ONECYCLE)
    plateau_patience: int = setting(2, Whole(0), "schedule",
                                    "plateau: epochs without a better val loss before a cut",
                                    speed=False, label="patience (epochs)",
                                    when=WHEN_PLATEAU)
    plateau_factor: float = setting(0.1, Number(0, 1, low_open=True), "schedule",
                                    "plateau: factor applied when patience runs out",
                                    speed=False, label="factor", when=WHEN_PLATEAU)
    # --- the step -------------------------------------------------------------------
    grad_accum_steps: int = setting(1, Whole(1), "step",
                                    "batches per optimizer step (gradient accumulation)",
                                    flag="--accum", label="accumulate batches")
    clip_grad_norm: Optional[float] = setting(
        None, OrNone(Number(0, low_open=True)), "step", "clip the gradient norm to this value",
        flag="--clip", label="clip grad norm", placeholder="empty: no clipping")
    on_nan: str = setting("stop", Choice(*ON_NAN), "step",
                          "a non-finite loss stops the run, or its update is skipped",
                          label="non-finite loss", watch="observes")
    # --- bookkeeping ----------------------------------------------------------------
    log_every: int = setting(10, Whole(1), "bookkeeping",
                             "steps between loss readings (each one is a host sync)",
                             speed=False, label="log every (steps)", watch="observes")
    telemetry: bool = setting(True, Flag(), "bookkeeping",
                              "time split, memory and diagnosis in each record",
                              watch="observes")
    count_flops: bool = setting(True, Flag(), "bookkeeping",
                                "FLOPs per step and the device's peak, for TFLOP/s and MFU",
                                speed=False, label="count FLOPs (MFU)", watch="observes")
    history_limit: int = setting(5000, Whole(10), "bookkeeping",
                                 "records kept; older ones are merged beyond this many",
                                 label="history limit", watch="observes")
    release_previous: bool = setting(False, Flag(), "bookkeeping",
                                     "free the previous run's optimizer state and cache first",
                                     label="release previous run")
    seed: int = setting(0, SEEDS, "bookkeeping",
                        "random seed (each epoch's shuffle seeds torch with seed x 1,000,003 "
                        "+ epoch, which must fit its 64 bits)", speed=False)
    checkpoint_dir: Optional[str] = setting(None, OrNone(Path()), "bookkeeping",
                                            "folder for checkpoints (None: none written)",
                                            speed=False, label="checkpoint folder",
                                            placeholder="empty: no checkpoints")
    checkpoint_every: Optional[int] = setting(
        None, OrNone(Whole(1)), "bookkeeping", "steps between checkpoints (None: at the end)",
        speed=False, label="checkpoint every", placeholder="empty: at the end only")
    # --- keeping the run: the local store (runstore/write.py), TensorBoard, MLflow (trackers.py)
    name: Optional[str] = setting(None, OrNone(Text()), "bookkeeping",
                                  "the run's name in nt.runs(), TensorBoard and MLflow",
                                  speed=False, label="run name", placeholder="empty: unnamed",
                                  watch="keeps")
    store: Union[bool, str] = setting(
        True, AnyOf(Flag(), Path(), allowed="True (the run store, $NBTRAIN_HOME/runs.sqlite, "
                                            "~/.nbtrain by default), False (not stored) or "
                                            "the path of a .sqlite file"),
        "bookkeeping", "keep the run in the local run store (nt.runs(), nt.load_run(id)): "
        "True, False or a .sqlite file", speed=False, label="store the run", watch="keeps")
    report_to: Union[str, Tuple[str, ...]] = setting(
        "none", Several(*REPORTERS), "bookkeeping",
        "also send the records to TensorBoard and/or MLflow (pip install "
        "nbtrain[tensorboard] / nbtrain[mlflow])", speed=False, label="report to",
        options=("none",) + REPORTERS + (("both", REPORTERS),), watch="keeps")
    report_dir: str = setting("runs", Path(), "bookkeeping",
                              "report_to='tensorboard': a log dir per run inside this folder",
                              speed=False, label="report folder",
                              when=("report_to", ("tensorboard", REPORTERS)), watch="keeps")

    def __new__(cls, *args, **kwargs):
        _reject_unknown(kwargs)   # TrainConfig(epoch=3) suggests epochs, as replace() does
        return super().__new__(cls)

    def __setattr__(self, name: str, value: Any) -> None:
        """Each field is checked as it is set, in the constructor and after it
        (`cfg.lr = -1` fails here, not deep inside torch)."""
        meta = SETTINGS.get(name)
        if meta is not None:
            value = meta.kind.normalise(value)
            if not meta.kind.accepts(value):
                _fail(name, value)
        object.__setattr__(self, name, value)

    def __post_init__(self):
        self.validate()

    def validate(self) -> "TrainConfig":
        """Check every field and the rules between fields (fit calls it again, since fields
        set one by one after construction are only checked alone)."""
        for name, meta in SETTINGS.items():
            if not meta.kind.accepts(getattr(self, name)):
                _fail(name, getattr(self, name))
        for rule in _RULES:
            rule(self)
        return self

    # -- copies and round trips --------------------------------------------------------
    def replace(self, **changes: Any) -> "TrainConfig":
        """A new config with `changes` applied; unknown names raise ConfigError. Only the
        changed fields are checked again, then the rules between fields: the others were
        checked when they were set (a re-run cell's nt.watch or fit builds one config,
        and checking every field twice, as a construction does, is time it waits for)."""
        _reject_unknown(changes)
        new = copy.copy(self)   # the fields as they are, not set (and checked) one by one
        for name, value in changes.items():
            setattr(new, name, value)   # checked as it is set (__setattr__)
        for rule in _RULES:
            rule(new)
        return new

    def to_dict(self) -> dict:
        """The fields as plain values; your own optimizer or scheduler as its name
        ("custom:Adadelta"), since a checkpoint holds data, not code."""
        values = dataclasses.asdict(self)
        for name in FACTORY_FIELDS:
            if callable(values[name]):
                values[name] = custom_name(values[name])
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        for name in FACTORY_FIELDS:
            _refuse_custom_name(name, values.get(name))
        return cls(**values)


def _declared_settings() -> Dict[str, Setting]:
    table = {}
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata["setting"]
        if meta.watch not in WATCH_ROLES and not meta.watch.startswith(WATCH_REFUSES):
            raise TypeError(f"TrainConfig.{f.name}: watch={meta.watch!r} is none of "
                            f"{WATCH_ROLES} nor WATCH_REFUSES + why")
        table[f.name] = dataclasses.replace(
            meta, name=f.name, flag=meta.flag or "--" + f.name.replace("_", "-"),
            label=meta.label or f.name.replace("_", " "))
    return table


SETTINGS: Dict[str, Setting] = _declared_settings()
FIELD_NAMES = tuple(SETTINGS)
FACTORY_FIELDS = tuple(name for name, meta in SETTINGS.items() if takes_factories(meta.kind))


def watched_as(role: str) -> tuple:
    """The fields nt.watch treats as `role` (Setting.watch), in declaration order."""
    return tuple(name for name, meta in SETTINGS.items() if meta.watch == role)


def watch_refusal(name: str) -> str:
    """Why nt.watch refuses field `name`; '' for a field it does not refuse."""
    watch = SETTINGS[name].watch
    return watch[len(WATCH_REFUSES):] if watch.startswith(WATCH_REFUSES) else ""


def _refuse_custom_name(name: str, value) -> None:
    """A saved config names the user's own optimizer or scheduler; the code must come again."""
    if isinstance(value, str) and value.startswith(CUSTOM):
        raise ConfigError(
            f"TrainConfig.{name}={value!r} was your own {name} (a class or factory) when this "
            f"config was saved; a checkpoint keeps only its name. Pass it again to resume: "
            f"fit(..., config=TrainConfig({name}=<the same class or factory>, ...), "
            f"resume=...), or %%fasttrain --resume ... --{name} NAME.", field=name)


def settings_in(group: str) -> list:
    """The Settings of one group, in declaration order."""
    return [s for s in SETTINGS.values() if s.group == group]


def as_config(config) -> TrainConfig:
    """A TrainConfig from None (the defaults), a TrainConfig or a dict of its fields."""
    if config is None:
        return TrainConfig()
    if isinstance(config, dict):
        return TrainConfig.from_dict(config)
    if isinstance(config, TrainConfig):
        return config.validate()   # fields set one by one since construction
    raise TypeError(f"config must be a TrainConfig or a dict of its fields; "
                    f"got {type(config).__name__}.")


def _reject_unknown(names) -> None:
    for name in names:
        if name not in SETTINGS:
            close = difflib.get_close_matches(name, FIELD_NAMES, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"TrainConfig has no setting '{name}'.{hint}", field=name)


def rejection(name: str, value: Any, allowed: str = "") -> ConfigError:
    """The error for `value` in field `name`: what was given and what is allowed."""
    allowed = allowed or SETTINGS[name].kind.describe(value)
    return ConfigError(f"TrainConfig.{name}={value!r} is not allowed: expected {allowed}.",
                       field=name)


def _fail(name: str, value: Any, allowed: str = "") -> None:
    raise rejection(name, value, allowed)


# -- rules between fields (each field's own values are checked by its kind) ---------------
def _check_lr_floor(cfg: TrainConfig) -> None:
    if cfg.min_lr > cfg.lr:
        _fail("min_lr", cfg.min_lr, f"a number <= lr ({cfg.lr})")


def _check_nesterov(cfg: TrainConfig) -> None:
    if cfg.nesterov and (cfg.optimizer != "sgd" or cfg.momentum == 0):
        _fail("nesterov", cfg.nesterov, "False unless optimizer='sgd' with momentum > 0")


def _check_worker_options(cfg: TrainConfig) -> None:
    if cfg.num_workers == 0 and cfg.persistent_workers:
        _fail("persistent_workers", True, "False when num_workers=0 (there are no workers to keep)")
    if cfg.num_workers == 0 and cfg.prefetch_factor is not None:
        _fail("prefetch_factor", cfg.prefetch_factor,
              "None when num_workers=0 (only workers prefetch)")


def _check_checkpoint_folder(cfg: TrainConfig) -> None:
    if cfg.checkpoint_every is not None and cfg.checkpoint_dir is None:
        _fail("checkpoint_every", cfg.checkpoint_every,
              "None unless checkpoint_dir is set (where would the checkpoints go?)")


def _check_checkpointing(cfg: TrainConfig) -> None:
    if cfg.activation_checkpointing is not False and cfg.compile:
        _fail("activation_checkpointing", cfg.activation_checkpointing,
              "False when compile=True (pick one)")


def _check_custom_optimizer(cfg: TrainConfig) -> None:
    if callable(cfg.optimizer) and cfg.optimizer_impl != "auto":
        _fail("optimizer_impl", cfg.optimizer_impl,
              "'auto' with your own optimizer (choose its kernel in your factory, e.g. "
              "foreach=True)")


def _check_cluster(cfg: TrainConfig) -> None:
    if cfg.cluster != "ray":
        return   # whether Ray is installed is the machine's question, asked by fit
    if cfg.device == "mps" or cfg.device.startswith("cuda:"):
        _fail("device", cfg.device, "'auto', 'cpu' or 'cuda' when cluster='ray' (Ray gives "
              "each worker its GPU)")
    if cfg.activation_checkpointing is not False:
        _fail("activation_checkpointing", cfg.activation_checkpointing,
              "False when cluster='ray' (not supported with several processes yet)")


def _check_processes(cfg: TrainConfig) -> None:
    if cfg.processes in (1, "auto"):
        return
    if cfg.device == "mps" or cfg.device.startswith("cuda:"):
        _fail("device", cfg.device, f"'auto', 'cpu' or 'cuda' when processes={cfg.processes} "
              "(each process takes its own device: rank r trains on cuda:r)")
    if cfg.activation_checkpointing is not False:
        _fail("activation_checkpointing", cfg.activation_checkpointing,
              f"False when processes={cfg.processes} (not supported with several processes yet)")


def _check_keeping(cfg: TrainConfig) -> None:
    if cfg.name is not None and not cfg.name.strip():
        _fail("name", cfg.name, "a name with a letter in it, or None (unnamed)")
    if isinstance(cfg.store, bool):
        pass
    elif not str(cfg.store).strip():
        _fail("store", cfg.store, "True, False or the path of a .sqlite file (not empty)")
    elif str(cfg.store).strip().lower() in TRUE_WORDS + FALSE_WORDS:
        _fail("store", cfg.store, f"True or False (the bool, not the text {cfg.store!r}), "
              "or the path of a .sqlite file")
    if not str(cfg.report_dir).strip():
        _fail("report_dir", cfg.report_dir, "a folder path (not empty), such as 'runs'")


_RULES = (_check_custom_optimizer, _check_cluster, _check_processes, _check_lr_floor, _check_nesterov,
          _check_worker_options, _check_checkpointing,
          _check_checkpoint_folder, _check_keeping)
