"""fit(): the training loop. Settings are resolved once, then the loop reads top to bottom.

fit -> _train_safely (whatever ends the run) -> _train (the loop) -> _step (set the LR,
forward, backward, update).
"""
from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import checkpoint as ckpt
from . import flops
from .config import ConfigError, TrainConfig, as_config
from .data import (describe_bad_sample, first_batch, loader_batches, make_batches, make_mover,
                   prefetch_to_device, resolve_prefetch)
from .data.batches import LoaderBatches, describe_batch, shortened, signature_of
from .data.culprit import worker_died
from .data.nested import batch_len
from .devices import (autocast_context, cpu_bf16_choice, intra_op_threads, resolve_amp,
                      resolve_device, resolve_threads)
from .losses import outputs_and_loss
from .memory import checkpointed_forward, leaves_no_trace, release
from .optim import build_optimizer, resolve_impl
from .probe import settle_workers_and_threads
from .run import Run, TrainingError
from .schedule import Schedule
from .telemetry import Interval, diagnose


@dataclass
class Setup:
    """What the loop reads, built once by `_prepare` before the first step."""
    device: torch.device
    amp: str
    batches: object
    val_batches: object
    move: Callable
    forward: Callable            # the model, compiled when asked
    loss_fn: Optional[Callable]
    params: list
    val_move: Optional[Callable] = None   # validation data is resolved (pinned, resident) apart
    sum_ranks: Callable = torch.clone   # the validation sums of every process (distributed.py)
    # where the loop is, for a failure's report and a resume from mid-step:
    boundary_rng: Optional[dict] = None   # the RNG at the last step boundary (see _train)
    window: tuple = ()                    # the batches of the step in progress
    updated: bool = False                 # its update is in the weights (see _advance)


def fit(model: torch.nn.Module, train_data, loss_fn: Optional[Callable] = None, *,
        config: Optional[TrainConfig] = None, val_data=None, resume=None,
        background: bool = False, progress="auto",
        schedule: Optional[Callable[[Schedule], Schedule]] = None,
        on_start: Optional[Callable[[Run], None]] = None) -> Run:
    """Train `model` on `train_data` with the settings of `config`; returns the Run.

    >>> run = nt.fit(model, (x, y), torch.nn.functional.cross_entropy,
    ...              config=nt.TrainConfig(epochs=3, amp="bf16", scheduler="cosine"))

    `loss_fn=None`: the model returns the loss (or an output with `loss`). A mapping batch
    is passed as keywords, `model(**batch)` (Hugging Face models), unless the forward
    takes one positional argument named after none of its keys: then `model(batch)`.
    `resume`: a Run or a checkpoint path; training continues where it stopped.
    `background=True` returns at once and trains in a thread (`run.stop()`, `run.wait()`).
    `progress`: True/"auto" for a progress bar, False for none, or a callable given the Run
    before the first step (`progress=nt.Dashboard` shows the live charts).
    `schedule`: a function given the Schedule built from `config`, returning the one to
    use (`nt.lr_find` returns its exponential sweep).
    `on_start`: a function given the Run before the first step, for code that steers the
    run rather than shows it: it may subscribe and call `run.stop()` (lr_find stops once
    the loss diverges, autotune once a trial has been timed).
    """
    if resume is not None and not isinstance(resume, Run):   # a Ray Result or Checkpoint
        from .ray_cluster import checkpoint_path
        resume = checkpoint_path(resume) or resume
    state = ckpt.load(resume) if isinstance(resume, (str, bytes)) or hasattr(resume, "__fspath__") \
        else (resume.checkpoint() if isinstance(resume, Run) else None)
    cfg = _config_from(config, state, resume)
    _refuse_plateau_without_validation(cfg, val_data)
    _refuse_busy(model)   # before anything touches the model
    if cfg.release_previous:
        release_previous_run()
    run = Run(cfg)
    _remember(run)
    if cfg.cluster == "ray":   # ray_cluster.py runs this same loop in Ray Train's workers
        from . import ray_cluster
        return ray_cluster.fit(run, model, train_data, loss_fn, val_data, state,
                               background=background, progress=progress, schedule=schedule,
                               on_start=on_start)
    if cfg.processes != 1:   # data-parallel: distributed.py runs this same loop in N processes
        from . import distributed
        if distributed.resolve_processes(run) > 1:
            return distributed.fit(run, model, train_data, loss_fn, val_data, state,
                                   background=background, progress=progress,
                                   schedule=schedule, on_start=on_start)
    setup = _prepare(run, model, train_data, loss_fn, val_data, state)
    if state is not None:
        ckpt.restore(run, state)
    else:
        torch.manual_seed(cfg.seed)   # dropout and friends repeat; data order has its own RNG
    attach_hooks(run, schedule, on_start, progress)
    _claim(model, run)
    if background:
        run.start(threading.Thread(target=_train_safely, args=(run, setup),
                                   name="nbtrain-fit", daemon=True))
        return run
    with _ctrl_c_stops(run):
        _train_safely(run, setup)
    if run.state == "failed":
        raise run.error
    return run


_last_run = {"ref": None}   # weak: a finished run is freed when the user drops it


def _remember(run: Run) -> None:
    _last_run["ref"] = weakref.ref(run)


def release_previous_run() -> Optional[dict]:
    """Release the last run of this process, if it is still alive and done."""
    previous = _last_run["ref"]() if _last_run["ref"] else None
    if previous is None or previous.running:
        return None
    return release(previous)


def attach_hooks(run: Run, schedule, on_start, progress) -> None:
    """fit's hooks, before step 1: the schedule swap, then code that steers the run, then
    the viewer (e.g. nt.Dashboard, which subscribes), or the progress bar."""
    if schedule is not None:
        run.schedule = schedule(run.schedule)
    if on_start is not None:
        on_start(run)
    if callable(progress):
        progress(run)
    elif progress:
        from .progress import attach_progress
        attach_progress(run)


# Which Run trains each model: two runs stepping two optimizers over the same parameters
# would race (torch raises deep inside the optimizer, or the weights are silently wrong).
# Weak both ways: a Run refers to its model, so a Run held here would live as long as it.
_training: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
_training_lock = threading.Lock()


class ModelBusyError(RuntimeError):
    """The model is being trained by another Run of this process."""


def _refuse_busy(model) -> None:
    held = _training.get(model) if isinstance(model, torch.nn.Module) else None
    other = held() if held is not None else None
    if other is not None and other.state in ("created", "running"):
        raise ModelBusyError(
            f"this model is already being trained by {other!r} (a background fit, a Panel "
            "or %%fasttrain --background). Stop that run first (run.stop(); run.wait(), or "
            "the panel's Stop), or train a copy of the model (copy.deepcopy(model)).")


def _claim(model, run: Run) -> None:
    """Mark `run` as the one training `model`; the check and the mark are one step, so two
    fits starting at once cannot both pass."""
    with _training_lock:
        _refuse_busy(model)
        run.state = "running"
        _training[model] = weakref.ref(run)


def _refuse_plateau_without_validation(cfg: TrainConfig, val_data) -> None:
    """plateau cuts the LR when the validation loss stalls: without val_data it never would."""
    if cfg.scheduler == "plateau" and val_data is None:
        raise ConfigError("TrainConfig.scheduler='plateau' cuts the LR when the validation loss "
                          "stops improving, but no val_data was given: the LR would never "
                          "change. Pass val_data=..., or pick another scheduler (e.g. 'cosine').",
                          field="scheduler")


def without_validation(cfg: TrainConfig) -> TrainConfig:
    """`cfg` for a tool's run that validates nothing (a warm-up, a timed trial, a profile):
    plateau, which acts on validation only, is the constant LR it is until then."""
    return cfg.replace(scheduler="constant") if cfg.scheduler == "plateau" else cfg


def _config_from(config, state, resume=None) -> TrainConfig:
    """The given config; without one, a resumed run's own, else the defaults."""
    if config is None and isinstance(resume, Run):   # its own optimizer and scheduler too
        return resume.config.replace()
    if config is None and state:
        return TrainConfig.from_dict(state["config"])
    return as_config(config)


# -- setup: resolve every "auto", build every part; raises before anything is changed --------
def _prepare(run: Run, model, train_data, loss_fn, val_data, state=None) -> Setup:
    """`state`: the checkpoint being resumed, whose timed choices are kept (see _kept)."""
    cfg = run.config
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}.")
    device, why = resolve_device(cfg.device)
    run.resolved["device"] = (str(device), why)
    kept = _kept(run, state)
    run.resolved["amp"] = kept.get("amp") or resolve_amp(cfg.amp, device)
    run.resolved["optimizer_impl"] = resolve_impl(cfg, device)
    batches = make_batches(train_data, cfg, device, run.resolved)
    if "num_workers" in kept:
        batches = _keep_workers(run, batches, kept["num_workers"])
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
    run.total_steps = count_steps(cfg, batches)
    if cfg.warmup_steps >= run.total_steps > 0:
        warnings.warn(f"TrainConfig.warmup_steps={cfg.warmup_steps} is not shorter than the run "
                      f"({run.total_steps} steps): the LR never reaches lr={cfg.lr:g}. Lower "
                      "warmup_steps, or train longer.", stacklevel=3)
    forward = model
    if cfg.activation_checkpointing is not False:
        forward = checkpointed_forward(model, cfg.activation_checkpointing)
    # --- nothing above changed the model; from here on it is built for this run
    model.to(device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    if cfg.compile:
        forward = torch.compile(model)
    batches, move = _data_path(run, batches, device)
    params = [p for p in model.parameters() if p.requires_grad]
    setup = Setup(device, run.resolved["amp"][0], batches, val_batches, move, forward,
                  loss_fn, params)
    if val_batches is not None:
        setup.val_move = make_mover(device, val_resolved["pin_memory"][0],
                                    val_resolved["data_on_device"][0], cfg.channels_last)
    if cfg.amp == "auto" and "amp" not in kept and setup.amp == "bf16" and device.type == "cpu":
        run.resolved["amp"] = cpu_bf16_choice(lambda amp: _probe_step(model, setup, amp),
                                              key=_architecture(model, batches))
        setup.amp = run.resolved["amp"][0]
    if not kept.keys() & {"num_workers", "num_threads"}:
        settle_workers_and_threads(run, setup, model, key=lambda: _architecture(model, batches))
    if cfg.count_flops:   # after amp and threads: the peak is the run's precision's and cores'
        run.resolved.update(flops.resolve(
            model, loss_fn, lambda: setup.move(first_batch(setup.batches)), setup.amp, device,
            cfg.grad_accum_steps, run.resolved["num_threads"][0]))
    run.model = model
    run.optimizer = build_optimizer(model, cfg, run.resolved["optimizer_impl"][0])
    run.schedule = Schedule(cfg, run.total_steps)
    run.scaler = torch.amp.GradScaler(device.type, enabled=setup.amp == "fp16")
    return setup


KEPT_WHY = "kept from the run being resumed"


def _kept(run: Run, state) -> dict:
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


def _architecture(model, batches) -> tuple:
    """What the bf16 measurement depends on: layers, parameter shapes, batch shapes."""
    shapes = tuple((tuple(p.shape), p.dtype) for p in model.parameters())
    return (repr(model), shapes, _input_shapes(batches))


def _input_shapes(batches):
    """The shapes of one sample (of each tensor in it, a mapping's by key) and the batch
    size; the number of batches when no sample can be read without loading a batch."""
    if hasattr(batches, "tensors"):
        return tuple((tuple(t.shape[1:]), t.dtype) for t in batches.tensors), batches.batch_size
    # nbtrain's loader batches by its sampler; a DataLoader of yours by its batch_size
    holder = getattr(batches, "sampler", None) or getattr(batches, "loader", None)
    try:   # one sample, read in this process: cheaper than a batch, and starts no worker
        return signature_of(batches.dataset[0]), getattr(holder, "batch_size", None)
    except Exception:
        return _length(batches)


def _probe_step(model, setup: Setup, amp: str) -> None:
    with leaves_no_trace(model):
        batch = setup.move(first_batch(setup.batches))
        with autocast_context(amp, setup.device):
            _, loss = outputs_and_loss(setup.forward, setup.loss_fn, batch)
        loss.backward()


def _refuse_empty(batches, cfg: TrainConfig, what: str) -> None:
    """Data that yields no batch: nothing to train on, however many steps are asked for."""
    try:
        if len(batches):
            return
    except TypeError:   # an IterableDataset: no length to check
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
    dataset = getattr(batches, "dataset", None)
    return len(dataset) if hasattr(dataset, "__len__") else None


def count_steps(cfg: TrainConfig, batches) -> int:
    """Optimizer steps of a run: max_steps when set, else every epoch's (accumulated) steps.

    `batches`: one epoch's batches, or their number (the Panel counts them without
    building the data). Raises ConfigError when they have no length, or there are none.
    """
    if cfg.max_steps is not None:
        return cfg.max_steps
    try:
        per_epoch = batches if isinstance(batches, int) else len(batches)
    except TypeError:
        raise ConfigError("TrainConfig.max_steps=None needs data with a length; this "
                          "DataLoader has none (an IterableDataset?). Set max_steps.",
                          field="max_steps") from None
    if per_epoch == 0:
        raise ConfigError(f"TrainConfig.batch_size={cfg.batch_size} with drop_last="
                          f"{cfg.drop_last} leaves no batch in an epoch: lower batch_size.",
                          field="batch_size")
    return cfg.epochs * math.ceil(per_epoch / cfg.grad_accum_steps)


# -- the loop -----------------------------------------------------------------------------------
def _train_safely(run: Run, setup: Setup) -> None:
    """Run the loop; whatever ends it, the Run keeps its model, optimizer and history."""
    start = time.perf_counter()
    run.state = "running"
    mid_step = False   # ended inside a step: resume from its boundary, RNG included
    try:
        with _current_device(setup.device), intra_op_threads(run.resolved["num_threads"][0]):
            _train(run, setup)
        run.state = "interrupted" if run.interrupted else (
            "stopped" if run.stop_requested or run.message else "finished")
    except KeyboardInterrupt:
        run.optimizer.zero_grad(set_to_none=True)   # drop the half-done step's gradients
        run.state, mid_step = "interrupted", True
    except Exception as exc:
        run.optimizer.zero_grad(set_to_none=True)
        run.state, mid_step = "failed", True
        run.error = _failure(exc, run, setup)
    finally:
        run.wall_s += time.perf_counter() - start
        rewind = mid_step and setup.boundary_rng is not None
        run.finish(read_rng=(lambda: setup.boundary_rng) if rewind
                   else lambda: ckpt.rng_state(setup.device))


def _current_device(device: torch.device):
    """Make `device` this thread's current CUDA device: a background thread starts on
    device 0, and streams, events and kernels without a device go to the current one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _train(run: Run, setup: Setup) -> None:
    """The loop: a step per window of batches until total_steps or a stop, a record every
    `log_every` steps, validation at each epoch's end, then the checkpoint."""
    cfg, opt = run.config, run.optimizer
    interval = Interval(setup.device, run.step, cfg.telemetry)
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(setup.device)   # peak of this run, not the kernel's
    with _last_record_on_error(run, setup, interval):
        run.model.train()
        run.stage = "load"
        # A run that fails or is interrupted mid-step resumes from the last step boundary:
        # keep the RNG there (a 1 us copy per step), not as the half-done step left it.
        setup.boundary_rng = ckpt.rng_state(setup.device)
        while run.step < run.total_steps and not run.stop_requested and _epochs_left(run):
            windows = _windows(setup.batches.epoch(run.epoch, run.batch_in_epoch),
                               cfg.grad_accum_steps)
            ran_out = False
            try:
                while run.step < run.total_steps:
                    # --- next batch(es): time spent here is time the model waited for data
                    t = time.perf_counter()
                    window = next(windows, None)
                    interval.data_wait_s += time.perf_counter() - t
                    if window is None:
                        ran_out = True
                        break
                    # --- the step: set the LR, forward, backward, update; then past it
                    run.stage, setup.window = "step", window
                    lr = _step(run, setup, window, interval)
                    _advance(run, setup, interval)
                    # --- log: the previous interval's one host read happens in interval.close
                    if interval.steps == cfg.log_every:
                        _log(run, interval, lr)
                    if cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0:
                        _checkpoint_now(run, interval, lr)
                    # --- termination
                    if run.stop_requested:
                        break
            finally:   # a failed run's traceback keeps this frame: stop the loader's workers now
                windows.close()
            if run.stop_requested:
                break
            # --- the epoch ran to its end: validate
            if _epoch_ended(run, setup.batches, ran_out):
                if interval.steps:   # close the epoch's last, shorter interval before validating
                    _log(run, interval, _applied_lr(opt))
                if setup.val_batches is not None:
                    _flush(run, interval)   # validation reads the device anyway
                    _validate(run, setup)
                    interval.reset(run.step)   # validation time is no interval's training time
                run.epoch, run.batch_in_epoch = run.epoch + 1, 0
        if interval.steps:
            _log(run, interval, _applied_lr(opt))
    _flush(run, interval)
    _save_checkpoint(run)


def _epochs_left(run: Run) -> bool:
    """Whether epochs remain: a run without max_steps trains `epochs` of them, even when
    a loader that yields fewer batches than its length makes them shorter than counted."""
    return run.config.max_steps is not None or run.epoch < run.config.epochs


def _epoch_ended(run: Run, batches, ran_out: bool) -> bool:
    """Whether the epoch's batches are all used: the source ran out (the only end an
    iterable without a length has), or the loop reached total_steps at its last batch."""
    length = _length(batches)
    if not ran_out:
        return length is not None and run.batch_in_epoch >= length
    if run.batch_in_epoch == 0:   # epoch after epoch of nothing would never reach max_steps
        raise ValueError(f"train_data yielded no batch in epoch {run.epoch}: an iterable that "
                         "is used up after one pass (a generator?). Make its __iter__ start a "
                         "new pass each time, or set max_steps within the first pass.")
    if length is not None and run.batch_in_epoch < length:
        _note(run, f"train_data's len() is {length} batches, but an epoch yielded "
                   f"{run.batch_in_epoch}: each epoch ends where its batches run out, and the "
                   f"{run.total_steps} steps planned (the LR schedule, the progress) counted "
                   "len(). Fix its __len__, or set max_steps.")
    return True


def _length(batches) -> Optional[int]:
    """len(batches), or None for an iterable without a length."""
    try:
        return len(batches)
    except TypeError:
        return None


def _note(run: Run, text: str) -> None:
    """Warn about something the run worked around, once, and keep it in run.notes."""
    if text not in run.notes:
        run.notes.append(text)
        warnings.warn(text)


def _step(run: Run, setup: Setup, window, interval: Interval) -> float:
    """One optimizer step on a window of micro-batches (gradient accumulation); returns its LR."""
    cfg, opt, scaler = run.config, run.optimizer, run.scaler
    # --- set the LR for this step (a pure function of the step: see schedule.py)
    lr = run.schedule.lr(run.step)
    for group in opt.param_groups:
        group["lr"] = lr
    # --- forward, backward; the losses stay on the device (interval reads them once per record)
    losses = []
    for batch in window:
        interval.copy_started()
        batch = setup.move(batch)
        interval.copy_done()
        with autocast_context(setup.amp, setup.device):
            _, loss = outputs_and_loss(setup.forward, setup.loss_fn, batch)
        losses.append(loss.detach())
        interval.add(losses[-1], batch_len(batch))
        if len(window) > 1:
            loss = loss / len(window)
        scaler.scale(loss).backward()
    # --- update
    if cfg.on_nan == "skip" and not _all_finite(losses):   # a host sync, skip mode only
        opt.zero_grad(set_to_none=True)
        interval.skipped += 1
        return lr
    if cfg.clip_grad_norm is not None:
        scaler.unscale_(opt)   # clip the true gradients, not the fp16-scaled ones
        torch.nn.utils.clip_grad_norm_(setup.params, cfg.clip_grad_norm)
    run.stage = "update"   # until _advance: a second Ctrl-C waits (see _ctrl_c_stops)
    scaler.step(opt)
    setup.updated = True
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return lr


def _advance(run: Run, setup: Setup, interval: Interval) -> None:
    """Past the step: count it, move the position, keep the RNG of the new boundary.

    With the update these are one unit, or a resume would apply the update twice: a second
    Ctrl-C waits until they are done, and a run that ends after the update (an error, a
    KeyboardInterrupt) still counts its step (see _last_record_on_error).
    """
    run.step += 1
    run.batch_in_epoch += len(setup.window)
    setup.updated = False   # counted: an error from here on must not count it again
    interval.end_step()
    setup.boundary_rng = ckpt.rng_state(setup.device)
    run.stage = "load"


@contextlib.contextmanager
def _last_record_on_error(run: Run, setup: Setup, interval: Interval):
    """When an error ends the loop: a step whose update is in counts as done; then the
    history gets every completed step (the open interval closed at the last of them),
    unless the device cannot be read any more: the error that ended the run is the one
    to report."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            if setup.updated:
                _advance(run, setup, interval)
            interval.drop_unfinished_step()
            if interval.steps:
                _log(run, interval, _applied_lr(run.optimizer))
            _flush(run, interval)
        raise


def _checkpoint_now(run: Run, interval: Interval, lr: float) -> None:
    """A checkpoint mid-run. Every step's loss is read first (closing the open interval):
    weights from a step whose loss was not yet seen finite are never saved."""
    if interval.steps:
        _log(run, interval, lr)
    _flush(run, interval)   # also makes the checkpoint's history complete to its step
    _save_checkpoint(run)


def _save_checkpoint(run: Run) -> None:
    """Write the run's checkpoint, unless its weights may be non-finite: the last good
    checkpoint stays the one to resume from."""
    if run.config.checkpoint_dir and not run.diverged:
        run.stage = "checkpoint"
        run.save(ckpt.path_in(run.config.checkpoint_dir))
        run.stage = "load"


def _windows(batches, size: int):
    """Group micro-batches for gradient accumulation; the last group may be shorter."""
    if size == 1:
        for batch in batches:
            yield (batch,)
        return
    window = []
    for batch in batches:
        window.append(batch)
        if len(window) == size:
            yield tuple(window)
            window = []
    if window:
        yield tuple(window)


def _all_finite(losses) -> bool:
    """Whether every micro-batch's loss is finite: one bad one spoils the summed gradient."""
    return bool(torch.isfinite(torch.stack(losses)).all())


def _applied_lr(opt) -> float:
    """The LR the last step ran with (the schedule may have changed since: set_lr)."""
    return opt.param_groups[0]["lr"]


def _log(run: Run, interval: Interval, lr: float) -> None:
    """Close the interval and emit the one before it (see Interval)."""
    _emit_train(run, interval.close(run.step, run.epoch, lr), interval.timed)


def _flush(run: Run, interval: Interval) -> None:
    """Emit the last closed interval's record now (it waits for the device)."""
    _emit_train(run, interval.flush(), interval.timed)


def _emit_train(run: Run, record: Optional[dict], timed: bool) -> None:
    if record is None:
        return
    record.update(flops.rate_fields(record, run.resolved))
    if timed:
        record["diagnosis"] = diagnose(record, run.resolved)
    run.emit(record)
    if record.get("first_nonfinite_step") is None or run.config.on_nan != "stop" \
            or run.diverged:   # the first non-finite step is the one to name
        return
    run.diverge(f"loss became non-finite at step {record['first_nonfinite_step']}; "
                f"training stopped at step {run.step}. Lower lr, set clip_grad_norm, "
                "or use on_nan='skip' to skip such steps.")


# -- validation ---------------------------------------------------------------------------------
def _validate(run: Run, setup: Setup) -> None:
    if setup.val_batches is None:
        return
    run.stage = "validate"
    record = evaluate(run, setup)
    run.stage = "load"
    run.schedule.on_validation(record["val_loss"])
    run.emit(record)


@torch.no_grad()
def evaluate(run: Run, setup: Setup) -> dict:
    """Mean loss (and accuracy for class-index targets) over the validation data."""
    loss_sum = torch.zeros((), device=setup.device)
    correct = torch.zeros((), device=setup.device, dtype=torch.long)
    count, classified = 0, True
    run.model.eval()
    try:
        for batch in setup.val_batches.epoch(0):
            batch = setup.val_move(batch)
            with autocast_context(setup.amp, setup.device):   # one forward, even without loss_fn
                out, loss = outputs_and_loss(setup.forward, setup.loss_fn, batch)
            n = batch_len(batch)
            loss_sum += loss.float() * n
            count += n
            scores, target = _scores_and_target(out, batch, setup.loss_fn)
            if classified and _is_classification(scores, target):
                correct += (scores.argmax(-1) == target).sum()
            else:
                classified = False
    finally:   # a failed validation leaves a model that trains on (dropout, batch norm)
        run.model.train()
    # one host read per validation; with several processes, the sums of all their shards
    wide = torch.float32 if setup.device.type == "mps" else torch.float64   # MPS has no float64
    totals = setup.sum_ranks(torch.stack([
        loss_sum.to(wide), correct.to(wide),
        torch.tensor(count, dtype=wide, device=setup.device),
        torch.tensor(float(not classified), dtype=wide, device=setup.device)]))
    loss_sum, correct, count, unclassified = totals.tolist()
    record = {"kind": "val", "step": run.step, "epoch": run.epoch,
              "val_loss": loss_sum / max(count, 1)}
    if not unclassified and count:
        record["val_acc"] = correct / count
    return record


def _scores_and_target(out, batch, loss_fn):
    """What accuracy compares: the output and the batch's last element with a loss_fn;
    without one, a Hugging Face-style output's `logits` and a mapping batch's `labels`."""
    if loss_fn is not None:
        return out, batch[-1]
    if isinstance(batch, Mapping):
        logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
        return logits, batch.get("labels")
    return None, None


def _is_classification(out, target) -> bool:
    return (isinstance(target, torch.Tensor) and isinstance(out, torch.Tensor)
            and not target.is_floating_point() and target.dim() == 1 and out.dim() == 2)


# -- errors and Ctrl-C ------------------------------------------------------------------------
def _failure(exc: Exception, run: Run, setup: Setup) -> TrainingError:
    """The TrainingError for `exc`: explained, or as it is when explaining it fails too (a
    failed run always has its error)."""
    try:
        text = _explain(exc, run, setup)
    except Exception as inner:
        text = (f"training failed at step {run.step}: {type(exc).__name__}: "
                f"{shortened(str(exc))}\n  (explaining it failed: {type(inner).__name__}: "
                f"{shortened(str(inner), 200)})")
    error = TrainingError(text, run)
    error.__cause__ = exc
    return error


def _explain(exc: Exception, run: Run, setup: Setup) -> str:
    error = f"{type(exc).__name__}: {shortened(str(exc))}"
    if run.stage == "validate":
        return f"validation on val_data after epoch {run.epoch} (step {run.step}) failed: {error}"
    if run.stage == "checkpoint":
        return (f"writing the checkpoint {ckpt.path_in(run.config.checkpoint_dir)} at step "
                f"{run.step} failed: {error}. Free space or fix the folder's permissions, or "
                "set another checkpoint_dir; resume from the run (resume=run).")
    where = f"batch {run.batch_in_epoch} of epoch {run.epoch} (step {run.step})"
    if run.stage == "load" or worker_died(exc):   # a worker's death can land mid-step
        culprit = _load_culprit(exc, run, setup.batches)
        return f"loading {where} failed: {error}" + (f"\n  {culprit}" if culprit else "")
    text = f"the training step failed on {where}: {error}"
    return text + "".join(f"\n  {line}" for line in _step_shapes(setup))


def _step_shapes(setup: Setup) -> list:
    """What the failed step was given and what the model made of it: most step failures
    are shapes that do not fit (model output vs targets, a layer's input size)."""
    if not setup.window:
        return []
    batch = setup.window[0]
    lines = [f"the batch: {describe_batch(batch)}"]
    pair = isinstance(batch, (tuple, list)) and len(batch) >= 2
    if setup.loss_fn is None and pair:
        lines.append("the batches are (inputs, targets) but no loss_fn was given: pass one "
                     "(e.g. torch.nn.functional.cross_entropy), or make the model take the "
                     "whole batch and return the loss.")
    elif setup.loss_fn is not None and pair:
        try:
            with torch.no_grad(), autocast_context(setup.amp, setup.device):
                out = setup.forward(*setup.move(batch)[:-1])
            lines.append(f"the model's output: {describe_batch(out)}; the targets: "
                         f"{describe_batch(batch[-1])}")
        except Exception as exc:
            lines.append(f"the model's forward fails on these inputs: {type(exc).__name__}: "
                         f"{shortened(str(exc), 200)}")
    return lines


def _load_culprit(exc: Exception, run: Run, batches) -> Optional[str]:
    """The sample behind a failed load: re-read here after an exception, but after a worker
    died only in a separate process, since re-reading it here could kill the kernel."""
    source = getattr(batches, "source", batches)   # under a CudaPrefetcher
    if worker_died(exc):
        if not hasattr(source, "find_crashing_sample"):
            return None
        try:   # the search must not replace the error it explains (a fork can fail too)
            return source.find_crashing_sample(run.epoch, run.batch_in_epoch,
                                               run.config.grad_accum_steps)
        except Exception:
            return None
    dataset = getattr(source, "dataset", None)
    if dataset is None or not hasattr(source, "sample_indices"):
        return None
    # with gradient accumulation the loop was loading a window of batches from this one
    last = run.batch_in_epoch + run.config.grad_accum_steps
    length = _length(source)   # None: an iterable without a length
    for batch in range(run.batch_in_epoch, last if length is None else min(last, length)):
        indices = source.sample_indices(run.epoch, batch)
        culprit = describe_bad_sample(dataset, indices) if indices else None
        if culprit:
            return culprit if batch == run.batch_in_epoch else f"in batch {batch}: {culprit}"
    return None


@contextlib.contextmanager
def _ctrl_c_stops(run: Run):
    """In the main thread, Ctrl-C (a kernel interrupt) ends the run at the step boundary.

    A second Ctrl-C interrupts at once, for a step that never ends; during the update
    (see _advance) it ends the run at the boundary right after it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum, frame):
        # the second press: the step in flight may never end; but an update always does,
        # and cut off after it the weights would hold a step that the position does not
        if run.interrupted and run.stage != "update":
            raise KeyboardInterrupt
        run.interrupt()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
