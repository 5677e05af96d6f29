"""Memory tools: free a finished run, checkpoint activations, find the largest batch."""
from __future__ import annotations

import contextlib
import gc
import itertools
import math
import traceback
from typing import Callable, Optional

import torch

from .config import ConfigError, TrainConfig
from .losses import outputs_and_loss


def _mb(nbytes: float) -> float:
    return nbytes / 2**20


def optimizer_state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


def release(run) -> dict:
    """Drop `run`'s optimizer state and gradients, collect garbage, empty the CUDA cache.

    The model and history stay; resuming afterwards restarts the optimizer's moments.
    A failed run's error keeps its message and traceback, but not the variables of the
    failed step's frames (loss graph, batch): `%debug` on it shows no locals afterwards.
    """
    from .telemetry import rss_bytes
    if run.running:
        raise RuntimeError("the run is still training: call run.stop() and run.wait() first.")
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    rss_before = rss_bytes()
    reserved_before = torch.cuda.memory_reserved() if cuda else 0
    state_bytes = optimizer_state_bytes(run.optimizer) if run.optimizer is not None else 0
    if run.optimizer is not None:
        run.optimizer.state.clear()
    if run.model is not None:
        for p in run.model.parameters():
            p.grad = None
    if run.error is not None:
        _clear_frames(run.error)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()   # give cached blocks back so other processes/runs see them
    return {"optimizer_state_mb": _mb(state_bytes),
            "rss_freed_mb": _mb(max(rss_before - rss_bytes(), 0)),
            "cuda_reserved_freed_mb": _mb(reserved_before - (torch.cuda.memory_reserved()
                                                             if cuda else 0))}


def _clear_frames(error: BaseException) -> None:
    """Drop the locals of every frame in the tracebacks of `error` and its causes: a
    failed step's frames hold its loss graph and batch, which gc.collect cannot free
    while the run keeps the error. Frames still executing are skipped."""
    pending, seen = [error], set()
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:   # a __context__ chain can loop back
            continue
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        pending += [exc.__cause__, exc.__context__]


def checkpointed_forward(model: torch.nn.Module, setting) -> Callable:
    """Forward of a Sequential that keeps only segment boundaries for backward.

    Activations inside a segment are recomputed during backward: less memory, about
    one extra forward of compute (torch.utils.checkpoint, non-reentrant).
    """
    if not isinstance(model, torch.nn.Sequential):
        raise ConfigError(f"TrainConfig.activation_checkpointing={setting!r} needs an "
                          f"nn.Sequential model; got {type(model).__name__}. Wrap the "
                          "layers in nn.Sequential, or checkpoint inside your forward.",
                          field="activation_checkpointing")
    from torch.utils.checkpoint import checkpoint_sequential
    segments = setting if not isinstance(setting, bool) else max(1, round(math.sqrt(len(model))))
    segments = min(segments, len(model))

    def forward(x):
        if not (model.training and torch.is_grad_enabled()):
            return model(x)
        return checkpoint_sequential(model, segments, x, use_reentrant=False)
    return forward


def saved_for_backward_bytes(forward: Callable, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward in one `forward(x).sum().backward()`: the
    activation memory, exactly (`saved_tensors_hooks` sees every saved tensor) and the
    same on any device."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(x).sum().backward()
    return total


# A batch too big for the device shows up as more than the allocator's OutOfMemoryError:
# cuBLAS/cuDNN failing to get workspace, or a kernel past its 32-bit index limit. (Not
# errors that bugs raise as often, such as CUDNN_STATUS_NOT_SUPPORTED: those propagate.)
_TOO_BIG = ("out of memory", "can't allocate memory", "CUBLAS_STATUS_ALLOC_FAILED",
            "CUDNN_STATUS_ALLOC_FAILED", "canUse32BitIndexMath")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says the batch was too big for the device (rather than a bug)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(sign in str(exc) for sign in _TOO_BIG)


def max_batch_size(model: torch.nn.Module, train_data, loss_fn: Optional[Callable] = None, *,
                   config: Optional[TrainConfig] = None, start: int = 8,
                   limit: int = 2**16) -> int:
    """The largest batch whose forward and backward fit in memory, found without crashing.

    >>> nt.max_batch_size(model, (x, y), F.cross_entropy, config=cfg)   # e.g. 1792

    Doubles from `start` until a step runs out of memory (or `limit`), then bisects.
    The model is left as it was: no gradients, same buffers, same RNG state.
    """
    from .data.batches import as_tensors
    from .devices import autocast_context, resolve_amp, resolve_device
    cfg = config or TrainConfig()
    device, _ = resolve_device(cfg.device)
    amp, _ = resolve_amp(cfg.amp, device)
    model.to(device)
    tensors = as_tensors(train_data)
    if tensors is None:
        raise TypeError("max_batch_size needs in-memory data: an (inputs, targets) pair of "
                        f"tensors or a TensorDataset; got {type(train_data).__name__}.")

    def fits(size: int) -> bool:
        idx = torch.arange(size) % len(tensors[0])   # repeat samples past the data's length
        batch = loss = None
        try:
            batch = tuple(t[idx].to(device) for t in tensors)   # copying may run out too
            with leaves_no_trace(model):   # backward inside: no gradients left behind
                with autocast_context(amp, device):
                    _, loss = outputs_and_loss(model, loss_fn, batch)
                loss.backward()
            return True
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            return False
        finally:
            batch = loss = None   # freed before the cache is emptied
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    if not fits(1):
        raise RuntimeError("even a batch of 1 does not fit in memory on "
                           f"{device}: use a smaller model, amp='bf16', or activation_checkpointing.")
    good, bad = 1, max(2, start)
    while bad <= limit and fits(bad):
        good, bad = bad, bad * 2
    bad = min(bad, limit + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


@contextlib.contextmanager
def leaves_no_trace(model: torch.nn.Module):
    """A trial forward/backward that changes nothing: gradients, buffers (e.g. BatchNorm
    statistics) and the RNG (dropout) as they were."""
    buffers = [b.detach().clone() for b in model.buffers()]
    # gradients already there (a backward the caller ran) are set aside, not added to:
    # backward accumulates into an existing .grad in place
    params = list(model.parameters())
    grads = [p.grad for p in params]
    model.zero_grad(set_to_none=True)
    # dropout on a GPU draws from that GPU's generator; devices=[] forks only the CPU's
    # (and never initializes CUDA for a CPU model)
    cuda = sorted({t.device.index for t in itertools.chain(model.parameters(), model.buffers())
                   if t.device.type == "cuda"})
    mps = any(t.device.type == "mps" for t in itertools.chain(model.parameters(), model.buffers()))
    mps_rng = torch.mps.get_rng_state() if mps else None   # fork_rng forks one device type
    try:
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            yield
    finally:
        if mps_rng is not None:
            torch.mps.set_rng_state(mps_rng)
        for p, grad in zip(params, grads):
            p.grad = grad
        with torch.no_grad():
            for saved, buf in zip(buffers, model.buffers()):
                buf.copy_(saved)
