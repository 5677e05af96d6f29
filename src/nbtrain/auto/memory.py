"""Memory tools: free a finished run, checkpoint activations, find the largest batch."""
from __future__ import annotations

import contextlib
import gc
import itertools
import math
import traceback
from typing import Callable, Optional

import torch

from ..config import ConfigError, TrainConfig
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
    from ..telemetry.sampling import rss_bytes
    if run.running:
        raise RuntimeError("the run is still training: call run.stop() and run.wait() first.")
    device = _cuda_device_of(run)
    rss_before = rss_bytes()
    reserved_before = torch.cuda.memory_reserved(device) if device is not None else 0
    state_bytes = optimizer_state_bytes(run.optimizer) if run.optimizer is not None else 0
    if run.optimizer is not None:
        run.optimizer.state.clear()
    if run.model is not None:
        for p in run.model.parameters():
            p.grad = None
    if run.error is not None:
        _clear_frames(run.error)
    gc.collect()
    if device is not None:
        torch.cuda.empty_cache()   # give cached blocks back so other processes/runs see them
    return {"optimizer_state_mb": _mb(state_bytes),
            "rss_freed_mb": _mb(max(rss_before - rss_bytes(), 0)),
            "cuda_reserved_freed_mb": _mb(reserved_before - (torch.cuda.memory_reserved(device)
                                                             if device is not None else 0))}


def _cuda_device_of(run) -> Optional[torch.device]:
    """The CUDA device `run` trained on (not the current device: a run on cuda:1 frees
    cuda:1's memory), or None off CUDA or before CUDA started."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    name = str(run.resolved.get("device", ("cuda", ""))[0])
    device = torch.device(name)
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


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
    On a GPU each trial step runs beside what the run will hold and one step does not:
    the optimizer's state (AdamW: two copies of the weights) and the training data when
    it will live on the device (`room_to_keep`).
    The model is left as it was: no gradients, same buffers, same RNG state.
    """
    from ..data.batches import as_tensors
    from .devices import resolve_device
    from .precision import resolve_amp
    cfg = config or TrainConfig()
    device, _ = resolve_device(cfg.device)
    amp, _ = resolve_amp(cfg.amp, device)
    model.to(device)
    tensors = as_tensors(train_data)
    if tensors is None:
        raise TypeError("max_batch_size needs in-memory data: an (inputs, targets) pair of "
                        f"tensors or a TensorDataset; got {type(train_data).__name__}.")
    with _held(device, room_to_keep(model, cfg, tensors, device)):
        return _largest_fitting(model, tensors, loss_fn, device, amp, start, limit)


# Tensors of optimizer state per parameter tensor, by optimizer (torch.optim's state):
# Adam/AdamW exp_avg and exp_avg_sq, NAdam and RAdam the same two, Adagrad its sum,
# RMSprop square_avg (and momentum_buffer with momentum), SGD momentum_buffer.
_STATE_COPIES = {"adam": 2, "adamw": 2, "nadam": 2, "radam": 2, "adagrad": 1}


def room_to_keep(model: torch.nn.Module, cfg: TrainConfig, tensors, device) -> int:
    """Bytes the run holds on `device` that a trial step does not: the optimizer's state
    (your own optimizer counted as AdamW, two copies) and the training data when it will
    live on the device but is not there yet."""
    from ..data import stays_on_device
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    data = 0
    if stays_on_device(tensors, cfg, device) and any(t.device != device for t in tensors):
        data = sum(t.numel() * t.element_size() for t in tensors)
    return _state_copies(cfg) * weights + data


def _state_copies(cfg: TrainConfig) -> int:
    if callable(cfg.optimizer):
        return 2
    if cfg.optimizer in ("sgd", "rmsprop"):
        return (cfg.optimizer == "rmsprop") + (cfg.momentum > 0)
    return _STATE_COPIES[cfg.optimizer]


@contextlib.contextmanager
def _held(device: torch.device, nbytes: int):
    """`nbytes` of `device`'s memory kept taken meanwhile (on CUDA: elsewhere an
    allocation takes no memory until it is written, and nothing runs out the same way)."""
    block = None
    if device.type == "cuda" and nbytes:
        try:
            block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            raise RuntimeError(f"the optimizer's state and the resident training data alone "
                               f"({_mb(nbytes) / 1024:.2f} GiB) do not fit on {device}: use "
                               "data_on_device=False, a smaller model, or an optimizer with "
                               "less state (sgd).") from None
    try:
        yield
    finally:
        del block
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _largest_fitting(model, tensors, loss_fn, device, amp: str, start: int, limit: int) -> int:
    from .devices import autocast_context

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
