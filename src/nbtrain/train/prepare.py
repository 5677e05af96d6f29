"""Setup: every "auto" resolved and every part of a run built, before its first step.
Raises before anything is changed (a bad setting, empty data); the model is moved and
the optimizer built only once every check has passed.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Callable, Optional

import torch

from .. import checkpoint as ckpt
from ..auto import budget, flops
from ..auto.compiling import COMPILE_CHECK_STEPS, compile_check, count_compiles
from ..auto.devices import (
    autocast_context,
    intra_op_threads,
    resolve_device,
    resolve_threads,
)
from ..auto.losses import outputs_and_loss
from ..auto.memory import checkpointed_forward, leaves_no_trace
from ..auto.precision import bf16_choice, bf16_key, model_inputs, resolve_amp
from ..auto.workers import settle_workers_and_threads
from ..config import ConfigError, TrainConfig
from ..data import (
    first_batch,
    loader_batches,
    make_batches,
    make_mover,
    prefetch_to_device,
    resolve_prefetch,
    source_mover,
)
from ..data.batches import (
    LoaderBatches,
    as_tensors,
    batch_count,
    length_of,
    signature_of,
    source_of,
)
from ..machine import model_key
from ..run import Run
from .optim import build_optimizer, resolve_impl
from .schedule import Schedule


@dataclass
class Position:
    """Where the loop is inside a step, for a failure's report and a resume from mid-step
    (the loop writes it; the run's step/epoch/batch are the Run's own)."""
    boundary_rng: Optional[dict] = None   # the RNG at the last step boundary (see loop._train)
    window: tuple = ()                    # the batches of the step in progress
    updated: bool = False                 # its update is in the weights (see loop._advance)


@dataclass
class Setup:
    """What the loop reads, built by `prepare` before the first step (parallel/ranks.py wraps
    `forward` in DDP and sets `sum_ranks` while preparing a rank)."""
    device: torch.device
    amp: str
    batches: object
    val_batches: object
    move: Callable
    forward: Callable            # the model, compiled when asked
    loss_fn: Optional[Callable]
    params: list
    val_move: Optional[Callable] = None   # validation data is resolved (pinned, resident) apart
    sum_ranks: Callable = torch.clone   # the validation sums of every process (parallel/ranks.py)
    position: Position = field(default_factory=Position)


def prepare(run: Run, model, train_data, loss_fn, val_data, state=None,
            shard: Callable = lambda batches: batches) -> Setup:
    """Resolve `run`'s settings into run.resolved and build its parts; returns the Setup.
    `state`: the checkpoint being resumed, whose timed choices are kept (kept_choices).
    `shard(batches)`: a rank's share of the data (parallel/ranks.py), taken before anything
    reads a sample, so that the probes read only this rank's samples: a bad sample is
    named with the rank that owns it."""
    cfg = run.config
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}.")
    device, why = resolve_device(cfg.device)
    run.resolved["device"] = (str(device), why)
    kept = kept_choices(run, state)
    run.resolved["amp"] = kept.get("amp") or resolve_amp(cfg.amp, device)
    run.resolved["optimizer_impl"] = resolve_impl(cfg, device)
    batches = shard(make_batches(train_data, cfg, device, run.resolved))
    if "num_workers" in kept:
        batches = shard(_keep_workers(run, batches, kept["num_workers"]))
    run.resolved["num_threads"] = kept.get("num_threads") or resolve_threads(
        cfg.num_threads, device, run.resolved["num_workers"][0])
    val_batches, val_resolved = None, {}
    if val_data is not None:
        # data_on_device=True is about the training data: validation data that cannot live
        # on the device (a per-sample Dataset) is copied batch by batch instead
        on_device = "auto" if cfg.data_on_device is True else cfg.data_on_device
        val_cfg = cfg.replace(shuffle=False, drop_last=False, data_on_device=on_device)
        val_batches = make_batches(val_data, val_cfg, device, val_resolved, "val_data")
        _refuse_empty(val_batches, val_cfg, "val_data")
    _refuse_empty(batches, cfg, "train_data")   # else max_steps would loop over no batches
    total_steps = count_steps(cfg, batches)
    run.equip(total_steps=total_steps)
    if cfg.warmup_steps >= total_steps > 0:
        warnings.warn(f"TrainConfig.warmup_steps={cfg.warmup_steps} is not shorter than the run "
                      f"({total_steps} steps): the LR never reaches lr={cfg.lr:g}. Lower "
                      "warmup_steps, or train longer.", stacklevel=3)
    forward = model
    if cfg.activation_checkpointing is not False:
        forward = checkpointed_forward(model, cfg.activation_checkpointing)
    # --- nothing above changed the model; from here on it is built for this run
    model.to(device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
        run.resolved["channels_last"] = (True, "asked for")   # the diagnosis reads what is on
    batches, move = _data_path(run, batches, device)
    params = [p for p in model.parameters() if p.requires_grad]
    setup = Setup(device, run.resolved["amp"][0], batches, val_batches, move, forward,
                  loss_fn, params)
    if val_batches is not None:
        setup.val_move = make_mover(device, val_resolved["pin_memory"][0],
                                    val_resolved["data_on_device"][0], cfg.channels_last)
    _measure(run, setup, model, kept, shard)
    run.equip(model=model,
              optimizer=build_optimizer(model, cfg, run.resolved["optimizer_impl"][0]),
              schedule=Schedule(cfg, total_steps),
              scaler=torch.amp.GradScaler(device.type, enabled=setup.amp == "fp16"))
    return setup

# -- the timed "auto" choices: a small share of the run they serve -----------------------------
# auto.precision.measure_bf16_speedup: a warm-up step per precision, then 16 blocks of a step
BF16_PROBE_STEPS = 18


def _measure(run: Run, setup: Setup, model, kept: dict, shard: Callable) -> None:
    """bf16, then workers and threads, then the FLOP count and the peak (after both: the
    peak is the run's precision's and cores'); what each took, and how often it called
    your model (a loss or model that counts its calls sees these), in
    run.resolved["setup_s"]."""
    parts, calls = {}, {}   # part -> seconds; part -> forward calls of your model

    def count_call(module, args) -> None:   # a call of your model that is not a step
        if parts:
            running = next(reversed(parts))   # the part _timed is in
            calls[running] = calls.get(running, 0) + 1
    counting = model.register_forward_pre_hook(count_call)
    try:
        _measure_parts(run, setup, model, kept, shard, parts)
    finally:
        counting.remove()
    if run.config.compile:   # after the hook is gone: removed later, it would recompile
        # at the run's thread count: inductor's CPU kernels are OpenMP loops, and one
        # timed at more threads than the run will use reads nothing like its steps
        with _timed(run, parts, "compile and its check", "compiled against eager"), \
                intra_op_threads(run.resolved["num_threads"][0]):
            calls["compile and its check"] = _compile(run, setup, model)
    total = sum(parts.values())
    spent = ", ".join(f"{name} {seconds:.2f} s" + (f" ({calls[name]} forward calls)"
                                                    if calls.get(name) else "")
                      for name, seconds in parts.items() if seconds >= 0.005 or calls.get(name))
    run.resolved["setup_s"] = (round(total, 3), "measuring before step 1: " + (
        spent or "nothing measured (cached, asked for, or the run too short to pay for it)"))


def _measure_parts(run: Run, setup: Setup, model, kept: dict, shard: Callable,
                   parts: dict) -> None:
    cfg, device = run.config, setup.device
    # what all three measurements are kept by; reading it may read a sample: once, when asked
    key = functools.lru_cache(maxsize=1)(lambda: architecture(model, setup.batches))
    with _timed(run, parts, "bf16 probe", "bf16 against fp32"):
        if cfg.amp == "auto" and "amp" not in kept and setup.amp == "bf16" \
                and device.type in ("cpu", "cuda"):
            run.resolved["amp"] = bf16_choice(
                lambda amp: probe_step(model, setup, amp, forward=model),
                key=bf16_key(model, device, batch_inputs(setup.batches, setup.loss_fn)),
                device=device,
                may_measure=_pays_for(run, BF16_PROBE_STEPS))
            setup.amp = run.resolved["amp"][0]
    with _timed(run, parts, "workers/threads probe", "threads and workers"):
        if not kept.keys() & {"num_workers", "num_threads"}:   # a new worker count: same key
            setup.batches = shard(settle_workers_and_threads(run, setup, model, key=key))
    with _timed(run, parts, "FLOP count and peak", "FLOPs and the peak FLOP/s"):
        if cfg.count_flops:
            run.resolved.update(flops.resolve(
                model, setup.loss_fn, lambda: load_first_batch(setup), setup.amp, device,
                cfg.grad_accum_steps, run.resolved["num_threads"][0], key=key()))


def _compile(run: Run, setup: Setup, model) -> int:
    """Compile the model for the run, after the probes (which time the eager forward: a
    compiled one would compile again for each precision and thread count they try);
    compile now, and time it against eager (compiling.compile_check). Returns the
    forward calls this made."""
    eager, passes = setup.forward, []
    setup.forward = torch.compile(model)
    count_compiles(run)

    def step(kind: str) -> None:
        passes.append(kind)
        probe_step(model, setup, setup.amp, forward=eager if kind == "eager" else None)
    run.resolved.update(compile_check(
        step, planned=run.total_steps * run.config.grad_accum_steps,
        may_measure=_pays_for(run, COMPILE_CHECK_STEPS)))
    return len(passes)


def _pays_for(run: Run, steps: int) -> str:
    """'' when measuring for about `steps` steps costs at most budget.SHARE of the
    run; else why not ("run too short to measure ...")."""
    planned = run.total_steps * run.config.grad_accum_steps
    if budget.affordable(steps, 0, planned):
        return ""
    return f"run too short to measure: {planned} steps"


@contextlib.contextmanager
def _timed(run: Run, parts: dict, name: str, what: str):
    """Time the block into parts[name]; the last key of `parts` is the part running, and
    `what` it measures is the run's (progress.setup_line shows it)."""
    parts[name] = 0.0
    run.set_measuring(what)
    start = time.perf_counter()
    try:
        yield
    finally:
        parts[name] = time.perf_counter() - start
        run.set_measuring("")


KEPT_WHY = "kept from the run being resumed"


def kept_choices(run: Run, state) -> dict:
    """The timed "auto" choices (amp, num_threads, num_workers) of the run being resumed,
    for the fields still "auto": measured again they may come out otherwise (a busier
    machine, a new kernel), and a CPU's sums differ with its thread count, so the resume
    would not continue bit for bit. None when it trained on another device or process
    count, or its checkpoint is older than these choices."""
    saved = (state or {}).get("resolved") or {}
    processes = run.resolved.get("processes", (1, ""))[0]
    if saved.get("device", ("",))[0] != run.resolved["device"][0] \
            or saved.get("processes", (1, ""))[0] != processes:
        return {}
    return {name: (value, why if why.startswith(KEPT_WHY) else f"{KEPT_WHY} ({why})")
            for name, (value, why) in saved.items()
            if name in ckpt.KEPT_CHOICES and getattr(run.config, name) == "auto"}


def _keep_workers(run: Run, batches, choice: tuple):
    """nbtrain's loader with the resumed run's worker count (your DataLoader keeps its own)."""
    if not isinstance(batches, LoaderBatches):
        return batches
    run.resolved["num_workers"] = choice
    if choice[0] == batches.loader.num_workers:
        return batches
    return loader_batches(batches.dataset, run.config, choice[0], run.resolved["pin_memory"][0])


def _data_path(run: Run, batches, device):
    """The batch source and the function that puts a batch on the device."""
    resident, _ = run.resolved["data_on_device"]
    pinned, _ = run.resolved["pin_memory"]
    move = make_mover(device, pinned, resident, run.config.channels_last)
    run.resolved["prefetch_to_device"] = resolve_prefetch(run.config, device, resident, pinned)
    if run.resolved["prefetch_to_device"][0]:
        # batches arrive on the device: the step's own move has nothing left to do
        return prefetch_to_device(batches, move, device), make_mover(device, pinned, True, False)
    return batches, move


def architecture(model, batches) -> tuple:
    """What the bf16 measurement depends on: the model's key and the batch shapes."""
    return model_key(model), input_shapes(batches)


def batch_inputs(batches, loss_fn) -> tuple:
    """The tensors the model's forward takes positionally in a full batch, as shapes and
    dtypes (auto.precision.model_inputs), from one sample: what a watch of the same loop
    reads off the model's first forward, so that both find one bf16 gain. () where no
    sample can be read, or a mapping goes to the model as keywords."""
    batches = source_of(batches)
    holder = getattr(batches, "sampler", None) or getattr(batches, "loader", None)
    try:
        if hasattr(batches, "tensors"):
            sample, size = tuple(t[0] for t in batches.tensors), batches.batch_size
        else:
            sample, size = batches.dataset[0], getattr(holder, "batch_size", None)
    except Exception:
        return ()
    if isinstance(sample, Mapping) or size is None:
        return ()
    split = loss_fn is not None and isinstance(sample, (tuple, list))
    args = tuple(sample[:-1]) if split else (sample,)
    return tuple(((size, *shape), dtype) for shape, dtype in model_inputs(args))


def input_shapes(batches):
    """The shapes of one sample (of each tensor in it, a mapping's by key) and the batch
    size; the number of batches when no sample can be read without loading a batch."""
    batches = source_of(batches)   # a CudaPrefetcher's source: the FLOP count's key too
    if hasattr(batches, "tensors"):
        return tuple((tuple(t.shape[1:]), t.dtype) for t in batches.tensors), batches.batch_size
    # nbtrain's loader batches by its sampler; a DataLoader of yours by its batch_size
    holder = getattr(batches, "sampler", None) or getattr(batches, "loader", None)
    try:   # one sample, read in this process: cheaper than a batch, and starts no worker
        return signature_of(batches.dataset[0]), getattr(holder, "batch_size", None)
    except Exception:
        return length_of(batches)


def load_first_batch(setup: Setup):
    """The first batch of epoch 0, on the device as the step gets it (for the probes and
    the FLOP count; read in this process). first_batch reads it from the source, under a
    prefetcher too: the source's mover puts it on the device, not the step's (the
    identity when the prefetcher has copied the batch already)."""
    return source_mover(setup.batches, setup.move)(first_batch(setup.batches))


def probe_step(model, setup: Setup, amp: str, forward: Optional[Callable] = None) -> None:
    """One forward+backward of the first batch, leaving no trace on `model`. `forward`:
    the model eager (the bf16 probe: a compiled one would compile once per precision),
    by default the run's forward (compiled when asked)."""
    with leaves_no_trace(model):
        batch = load_first_batch(setup)
        with autocast_context(amp, setup.device):
            _, loss = outputs_and_loss(forward or setup.forward, setup.loss_fn, batch)
        loss.backward()
        if setup.device.type == "cuda":   # timed by the caller: the kernels, not their launch
            torch.cuda.synchronize(setup.device)


def _refuse_empty(batches, cfg: TrainConfig, what: str) -> None:
    """Data that yields no batch: nothing to train on, however many steps are asked for."""
    if length_of(batches) != 0:   # some batches, or an IterableDataset: no length to check
        return
    samples = _sample_count(batches)
    if not samples:
        raise ConfigError(f"{what} is empty: it has no samples. Pass data with at least "
                          "one sample.", field=None)
    raise ConfigError(f"TrainConfig.batch_size={cfg.batch_size} with drop_last=True leaves no "
                      f"batch: {what} has {samples} sample(s). Lower batch_size to at most "
                      f"{samples}, or set drop_last=False.", field="batch_size")


def _sample_count(batches) -> Optional[int]:
    plan = getattr(batches, "sampler", batches)   # a LoaderBatches plans with its sampler
    if hasattr(plan, "n"):
        return plan.n
    return length_of(getattr(batches, "dataset", None))


# -- the steps a run plans: its LR schedule's length, the progress bar's total -----------------
def count_steps(cfg: TrainConfig, batches) -> int:
    """Optimizer steps of a run: max_steps when set, else every epoch's (accumulated) steps.

    `batches`: one epoch's batches, or their number (None: unknown; see batches_per_epoch).
    Raises ConfigError when they have no length, or there are none.
    """
    if cfg.max_steps is not None:
        return cfg.max_steps
    per_epoch = batches if batches is None or isinstance(batches, int) else length_of(batches)
    if per_epoch is None:
        raise ConfigError("TrainConfig.max_steps=None needs data with a length; this "
                          "data has none (an IterableDataset?). Set max_steps.",
                          field="max_steps")
    if per_epoch == 0:
        raise ConfigError(f"TrainConfig.batch_size={cfg.batch_size} with drop_last="
                          f"{cfg.drop_last} leaves no batch in an epoch: lower batch_size.",
                          field="batch_size")
    return cfg.epochs * math.ceil(per_epoch / cfg.grad_accum_steps)


def batches_per_epoch(cfg: TrainConfig, train_data, world: int = 1) -> Optional[int]:
    """One process's batches in an epoch of `train_data` as the user gave it (tensors, a
    Dataset, a DataLoader), from its length, without building or moving it; None without
    a length. With `world` processes each takes every world-th sample."""
    from torch.utils.data import DataLoader
    if isinstance(train_data, DataLoader):
        return length_of(train_data)
    n = dataset_length(train_data)
    return None if n is None else batch_count(n // world, cfg.batch_size, cfg.drop_last)


def dataset_length(train_data) -> Optional[int]:
    """The number of samples of tensors or a Dataset; None without a length."""
    tensors = as_tensors(train_data)
    return len(tensors[0]) if tensors is not None else length_of(train_data)
