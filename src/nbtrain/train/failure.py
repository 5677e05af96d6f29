"""A failed run's error, explained: which batch or step failed and why (the sample that
raised, the shapes that do not fit), so the user can fix it and resume."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import checkpoint as ckpt
from ..auto.devices import autocast_context
from ..data import describe_bad_sample
from ..data.batches import describe_batch, length_of, shortened, source_of
from ..data.culprit import worker_died
from ..run import Run, TrainingError
from .prepare import Setup


def failure(exc: Exception, run: Run, setup: Setup) -> TrainingError:
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
    if run.phase == "validate":
        return f"validation on val_data after epoch {run.epoch} (step {run.step}) failed: {error}"
    if run.phase == "checkpoint":
        return (f"writing the checkpoint {ckpt.path_in(run.config.checkpoint_dir)} at step "
                f"{run.step} failed: {error}. Free space or fix the folder's permissions, or "
                "set another checkpoint_dir; resume from the run (resume=run).")
    where = f"batch {run.batch_in_epoch} of epoch {run.epoch} (step {run.step})"
    if run.phase == "load" or worker_died(exc):   # a worker's death can land mid-step
        batch, culprit = _load_culprit(exc, run, setup.batches)
        if batch is None and run.config.grad_accum_steps > 1:
            where = f"the batches of step {run.step} (epoch {run.epoch}, from batch {run.batch_in_epoch})"
        elif batch is not None:
            where = f"batch {batch} of epoch {run.epoch} (step {run.step})"
        return f"loading {where} failed: {error}" + (f"\n  {culprit}" if culprit else "")
    text = f"the training step failed on {where}: {error}"
    return text + "".join(f"\n  {line}" for line in _step_shapes(setup))


def _step_shapes(setup: Setup) -> list:
    """What the failed step was given and what the model made of it: most step failures
    are shapes that do not fit (model output vs targets, a layer's input size)."""
    if not setup.position.window:
        return []
    batch = setup.position.window[0]
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


def _load_culprit(exc: Exception, run: Run, batches) -> Tuple[Optional[int], Optional[str]]:
    """The batch and sample behind a failed load, (None, None) when not found: re-read here
    after an exception, but after a worker died only in a separate process, since
    re-reading it here could kill the kernel."""
    source = source_of(batches)   # under a CudaPrefetcher
    if worker_died(exc):
        if not hasattr(source, "find_crashing_sample"):
            return None, None
        try:   # the search must not replace the error it explains (a fork can fail too)
            return None, source.find_crashing_sample(run.epoch, run.batch_in_epoch,
                                                     run.config.grad_accum_steps)
        except Exception:
            return None, None
    dataset = getattr(source, "dataset", None)
    if dataset is None or not hasattr(source, "sample_indices"):
        return None, None
    # with gradient accumulation the loop was loading a window of batches from this one
    last = run.batch_in_epoch + run.config.grad_accum_steps
    length = length_of(source)   # None: an iterable without a length
    for batch in range(run.batch_in_epoch, last if length is None else min(last, length)):
        indices = source.sample_indices(run.epoch, batch)
        culprit = describe_bad_sample(dataset, indices) if indices else None
        if culprit:
            return batch, culprit
    return None, None
