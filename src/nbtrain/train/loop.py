"""The training loop: a step per window of batches, read top to bottom like nanoGPT's.

train_safely (whatever ends the run) -> _train (the loop) -> _step (set the LR, forward,
backward, update) -> _advance (past the step). prepare.py builds the Setup it reads.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Mapping

import torch

from .. import checkpoint as ckpt
from ..auto.devices import autocast_context, intra_op_threads
from ..auto.losses import outputs_and_loss
from ..data.batches import length_of
from ..data.nested import batch_len
from ..data.prefetch import closed_at_end, mark_waits
from ..run import Run
from ..telemetry.modules import FitWindow
from ..telemetry.timers import Interval
from .emit import flush_interval, log_interval
from .failure import failure
from .prepare import Setup


def train_safely(run: Run, setup: Setup) -> None:
    """Run the loop; whatever ends it, the Run keeps its model, optimizer and history."""
    start = time.perf_counter()
    run.start()
    state, error = None, None
    mid_step = False   # ended inside a step: resume from its boundary, RNG included
    try:
        with _current_device(setup.device), intra_op_threads(run.resolved["num_threads"][0]):
            _train(run, setup)
        state = "interrupted" if run.interrupted else (
            "stopped" if run.stop_requested or run.message else "finished")
    except KeyboardInterrupt:
        run.optimizer.zero_grad(set_to_none=True)   # drop the half-done step's gradients
        state, mid_step = "interrupted", True
    except Exception as exc:
        run.optimizer.zero_grad(set_to_none=True)
        state, mid_step = "failed", True
        error = failure(exc, run, setup)
    finally:
        boundary_rng = setup.position.boundary_rng
        rewind = mid_step and boundary_rng is not None
        run.finish(state, read_rng=(lambda: boundary_rng) if rewind
                   else lambda: ckpt.rng_state(setup.device),
                   elapsed_s=time.perf_counter() - start, error=error)


def _current_device(device: torch.device):
    """Make `device` this thread's current CUDA device: a background thread starts on
    device 0, and streams, events and kernels without a device go to the current one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _train(run: Run, setup: Setup) -> None:
    """The loop: a step per window of batches until total_steps or a stop, a record every
    `log_every` steps, validation at each epoch's end, then the checkpoint."""
    cfg, opt = run.config, run.optimizer
    interval = Interval(setup.device, run.step, cfg.telemetry)
    mark_waits(setup.batches, interval)   # a prefetcher's wait for its copy is copy time
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(setup.device)   # peak of this run, not the kernel's
    # modules: one window of steps timed module by module (run.modules(), run.peak())
    with _last_record_on_error(run, setup, interval), FitWindow(run) as modules:
        run.model.train()
        run.enter("load")
        # A run that fails or is interrupted mid-step resumes from the last step boundary:
        # keep the RNG there (a 1 us copy per step), not as the half-done step left it.
        setup.position.boundary_rng = ckpt.rng_state(setup.device)
        while run.step < run.total_steps and not run.stop_requested and _epochs_left(run):
            windows = _windows(setup.batches.epoch(run.epoch, run.batch_in_epoch),
                               cfg.grad_accum_steps)
            ran_out, starting = False, True
            try:
                while run.step < run.total_steps:
                    # --- next batch(es): time spent here is the data wait (on CUDA the
                    # Interval keeps the part of it the GPU sat idle: see CudaTimer)
                    t = time.perf_counter()
                    window = next(windows, None)
                    waited = time.perf_counter() - t
                    interval.data_wait_s += waited
                    if starting:   # the epoch's loader starting (its workers): a gap
                        run.between.add("loader start", waited)
                        starting = False
                    if window is None:
                        ran_out = True
                        break
                    # --- the step: set the LR, forward, backward, update; then past it
                    run.enter("step")
                    setup.position.window = window
                    modules.before(run.step)
                    lr = _step(run, setup, window, interval)
                    _advance(run, setup, interval)
                    modules.after(run.step)
                    # --- log: the previous interval's one host read happens in interval.close
                    if interval.steps == cfg.log_every:
                        log_interval(run, interval, lr)
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
                    log_interval(run, interval, _applied_lr(opt))
                if setup.val_batches is not None:
                    flush_interval(run, interval)   # validation reads the device anyway
                    _validate(run, setup)
                    interval.reset(run.step)   # validation time is no interval's training time
                run.next_epoch()
        if interval.steps:
            log_interval(run, interval, _applied_lr(opt))
    flush_interval(run, interval)
    _save_checkpoint(run)


def _epochs_left(run: Run) -> bool:
    """Whether epochs remain: a run without max_steps trains `epochs` of them, even when
    a loader that yields fewer batches than its length makes them shorter than counted."""
    return run.config.max_steps is not None or run.epoch < run.config.epochs


def _epoch_ended(run: Run, batches, ran_out: bool) -> bool:
    """Whether the epoch's batches are all used: the source ran out (the only end an
    iterable without a length has), or the loop reached total_steps at its last batch."""
    length = length_of(batches)
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


def _note(run: Run, text: str) -> None:
    """Warn about something the run worked around, once, and keep it in run.notes."""
    if text not in run.notes:
        run.notes.append(text)
        warnings.warn(text)


def _step(run: Run, setup: Setup, window, interval: Interval) -> float:
    """One optimizer step on a window of micro-batches (gradient accumulation); returns its LR."""
    cfg, opt, scaler = run.config, run.optimizer, run.scaler
    scaled = scaler.is_enabled()   # fp16; otherwise its calls are skipped, not made as no-ops
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
        loss = _forward_loss(setup, batch)
        losses.append(loss.detach())
        interval.add(losses[-1], batch_len(batch))
        if len(window) > 1:
            loss = loss / len(window)
        (scaler.scale(loss) if scaled else loss).backward()
    # --- update
    if cfg.on_nan == "skip" and not _all_finite(losses):   # a host sync, skip mode only
        opt.zero_grad(set_to_none=True)
        interval.skipped += 1
        return lr
    if cfg.clip_grad_norm is not None:
        scaler.unscale_(opt)   # clip the true gradients, not the fp16-scaled ones
        torch.nn.utils.clip_grad_norm_(setup.params, cfg.clip_grad_norm)
    run.enter("update")   # until _advance: a second Ctrl-C waits (see entry.ctrl_c_stops)
    if scaled:
        scaler.step(opt)
    else:
        opt.step()
    setup.position.updated = True
    if scaled:
        scaler.update()
    opt.zero_grad(set_to_none=True)
    return lr


def _forward_loss(setup: Setup, batch) -> torch.Tensor:
    """The micro-batch's loss, under autocast where the run has it."""
    if setup.amp == "off":
        return outputs_and_loss(setup.forward, setup.loss_fn, batch)[1]
    with autocast_context(setup.amp, setup.device):
        return outputs_and_loss(setup.forward, setup.loss_fn, batch)[1]


def _advance(run: Run, setup: Setup, interval: Interval) -> None:
    """Past the step: count it, move the position, keep the RNG of the new boundary.

    With the update these are one unit, or a resume would apply the update twice: a second
    Ctrl-C waits until they are done, and a run that ends after the update (an error, a
    KeyboardInterrupt) still counts its step (see _last_record_on_error).
    """
    position = setup.position
    run.advance(len(position.window))
    position.updated = False   # counted: an error from here on must not count it again
    interval.end_step()
    position.boundary_rng = ckpt.rng_state(setup.device)
    run.enter("load")


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
            if setup.position.updated:
                _advance(run, setup, interval)
            interval.drop_unfinished_step()
            if interval.steps:
                log_interval(run, interval, _applied_lr(run.optimizer))
            flush_interval(run, interval)
        raise


def _checkpoint_now(run: Run, interval: Interval, lr: float) -> None:
    """A checkpoint mid-run. Every step's loss is read first (closing the open interval):
    weights from a step whose loss was not yet seen finite are never saved."""
    if interval.steps:
        log_interval(run, interval, lr)
    flush_interval(run, interval)   # also makes the checkpoint's history complete to its step
    _save_checkpoint(run)


def _save_checkpoint(run: Run) -> None:
    """Write the run's checkpoint, unless its weights may be non-finite: the last good
    checkpoint stays the one to resume from."""
    if run.config.checkpoint_dir and not run.diverged:
        run.enter("checkpoint")
        started = time.perf_counter()
        run.save(ckpt.path_in(run.config.checkpoint_dir))
        run.between.add("saving", time.perf_counter() - started)
        run.enter("load")


def _windows(batches, size: int):
    """Group micro-batches for gradient accumulation; the last group may be shorter.
    Closing it closes the epoch's batches (a prefetcher, workers)."""
    with closed_at_end(batches):
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


# -- validation ---------------------------------------------------------------------------------
def _validate(run: Run, setup: Setup) -> None:
    if setup.val_batches is None:
        return
    run.enter("validate")
    started = time.perf_counter()
    record = evaluate(run, setup)
    run.between.add("evaluation", time.perf_counter() - started)
    run.enter("load")
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
