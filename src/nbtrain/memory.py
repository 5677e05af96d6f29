"""Memory tools: free a finished run, checkpoint activations, find the largest batch."""
from __future__ import annotations

import contextlib
import gc
import math
from typing import Callable, Optional

import torch

from .config import ConfigError, TrainConfig


def _mb(nbytes: float) -> float:
    return nbytes / 2**20


def optimizer_state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


def release(run) -> dict:
    """Drop `run`'s optimizer state and gradients, collect garbage, empty the CUDA cache.

    The model and history stay; resuming afterwards restarts the optimizer's moments.
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
    run.released = True
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()   # give cached blocks back so other processes/runs see them
    return {"optimizer_state_mb": _mb(state_bytes),
            "rss_freed_mb": _mb(max(rss_before - rss_bytes(), 0)),
            "cuda_reserved_freed_mb": _mb(reserved_before - (torch.cuda.memory_reserved()
                                                             if cuda else 0))}


def checkpointed_forward(model: torch.nn.Module, setting) -> Callable:
    """Forward of a Sequential that keeps only segment boundaries for backward.

    Activations inside a segment are recomputed during backward: less memory, about
    one extra forward of compute (torch.utils.checkpoint, non-reentrant).
    """
    if not isinstance(model, torch.nn.Sequential):
        raise ConfigError(f"TrainConfig.activation_checkpointing={setting!r} needs an "
                          f"nn.Sequential model; got {type(model).__name__}. Wrap the "
                          "layers in nn.Sequential, or checkpoint inside your forward.")
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


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text
                                              or "can't allocate memory" in text)


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
    from .loop import outputs_and_loss   # here: loop imports this module
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
        batch = tuple(t[idx].to(device) for t in tensors)
        try:
            with leaves_no_trace(model), autocast_context(amp, device):
                _, loss = outputs_and_loss(model, loss_fn, batch)
            loss.backward()
            return True
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            return False
        finally:
            del batch
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
    """A trial forward/backward that changes nothing: no gradients left, buffers (e.g.
    BatchNorm statistics) and the RNG (dropout) as they were."""
    buffers = [b.detach().clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for saved, buf in zip(buffers, model.buffers()):
                buf.copy_(saved)
        torch.set_rng_state(rng)
