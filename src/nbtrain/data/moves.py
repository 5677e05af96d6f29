"""Your loop's copies of its batches to the GPU, learned and then made ahead (nt.watch).

A loop of your own moves each batch itself (`xb, yb = xb.to(device), yb.to(device)`).
Over its first step the watch notes which of the batch's tensors it copied to a CUDA
device (`MoveLog`). Where it copied every one to the same device, the watch hands it the
next batches already there, copied from pinned memory on a side stream one step ahead
(prefetch.copied_ahead); the loop's own `.to(device)` then returns the tensor it is
given, as torch's `Tensor.to` does for a tensor already on that device. A loop that
keeps a tensor on the CPU (labels for a metric, an index) gets its batches as before.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from .nested import map_tensors, tensors


# What reads a tensor's metadata only: the same answer on the GPU (shape, dtype, len)
_METADATA = frozenset({"__get__", "__len__", "size", "dim", "numel", "is_pinned",
                       "element_size", "stride", "is_contiguous"})


class MoveLog(TorchFunctionMode):
    """What the loop does with one batch's tensors until the next batch arrives: which it
    copies to a CUDA device (`Tensor.to`, `Tensor.cuda`) and which it also uses where
    they are (an op on the CPU tensor: a metric against CPU labels, `.numpy()`, a
    print). Active (a torch function mode, so every torch call passes through it) over
    the loop's first step only."""

    def __init__(self, batch):
        super().__init__()
        self.tensors = tensors(batch)   # kept alive until the verdict: their ids name them
        self._positions = {id(t): i for i, t in enumerate(self.tensors)}
        self.moved = {}                 # position in the batch -> the device it went to
        self.used = set()               # positions used by another op, where they were

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name not in _METADATA:
            self._note(name, args, kwargs or {}, result)
        return result

    def _note(self, name: str, args, kwargs, result) -> None:
        first = args[0] if args else None
        if name in ("to", "cuda") and id(first) in self._positions and \
                isinstance(result, torch.Tensor) and result.is_cuda:
            self.moved[self._positions[id(first)]] = result.device
            return
        self.note_uses((*args, *kwargs.values()))

    def note_uses(self, values) -> None:
        """`values` (arguments, and the items of list and tuple ones) were used as they are."""
        for value in values:
            for item in (value if isinstance(value, (list, tuple)) else (value,)):
                position = self._positions.get(id(item))
                if position is not None:
                    self.used.add(position)

    def target(self) -> Optional[torch.device]:
        """The CUDA device the loop copied its whole batch to and used it on only; None
        if it kept or used a tensor where it was, or sent them to several devices."""
        devices = set(self.moved.values())
        if not self.tensors or len(self.moved) != len(self.tensors) or self.used \
                or len(devices) != 1:
            return None
        return devices.pop()

    def kept(self) -> str:
        """What the loop did instead of moving its whole batch, for the reason text."""
        n = len(self.tensors)
        if not n:
            return "your loader's batches hold no tensor"
        if self.used:
            return (f"your loop uses {len(self.used)} of its batch's {n} tensors on the CPU "
                    "(only a batch that goes to the GPU whole and is used there is copied "
                    "ahead)")
        if not self.moved:
            return "your loop copied none of its batch's tensors to a GPU in its first step"
        if len(set(self.moved.values())) > 1:
            return "your loop copies its batch's tensors to several GPUs"
        return (f"your loop keeps {n - len(self.moved)} of its batch's {n} tensors on the "
                "CPU (only a batch moved whole is copied ahead)")


def resolve_copies(pin_memory, prefetch, log: Optional[MoveLog], loader_pins: bool,
                   batched: bool) -> Tuple[Tuple[bool, str], Tuple[bool, str]]:
    """((pin, why), (prefetch, why)) for a watched loop on CUDA, after its first step.
    `pin_memory`, `prefetch`: the settings (True, False or "auto"); `loader_pins`: the
    loop's DataLoader pins already; `batched`: the watch fetches its batches with one
    index op (which can write into pinned memory at no extra cost)."""
    target = log.target() if log is not None else None
    why_not = log.kept() if log is not None else "your loop iterates no DataLoader"
    if prefetch is False:
        ahead = False, "asked for"
    elif target is None:
        ahead = False, ("not possible: " if prefetch is True else "") + why_not
    else:
        ahead = True, (f"your loop copies its whole batch to {target}: batch k+1 is copied "
                       "there from pinned memory on a side stream while step k computes, and "
                       "your .to(device) finds it there")
    asked = "asked for: " if pin_memory is True else ""
    if loader_pins:
        pin = True, "your loop's own (DataLoader(pin_memory=True))"
    elif pin_memory is False:
        pin = False, "asked for"
    elif ahead[0]:
        pin = True, asked + "the copies ahead are made from pinned memory (only those overlap)"
    elif batched and log is not None and log.moved:
        pin = True, asked + ("the batched fetch writes each batch into pinned memory: your "
                             "loop's copy to the GPU is faster, and asynchronous where it "
                             "passes non_blocking=True")
    else:
        pin = False, "nothing to pin: " + (why_not if prefetch is not False
                                           else "no copies ahead (prefetch_to_device=False)")
    return pin, ahead


def pinned_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`tensor.index_select(0, index)` written straight into pinned memory: no second
    copy, as `.pin_memory()` after it would make."""
    out = torch.empty((len(index), *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=True)
    return torch.index_select(tensor, 0, index, out=out)


def ahead_mover(device: torch.device) -> Callable:
    """What copies a batch ahead: each tensor pinned (if it is not yet) and copied
    non_blocking, so the copy overlaps the step on the compute stream."""
    def to_device(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu":
            return tensor.to(device, non_blocking=True)
        pinned = tensor if tensor.is_pinned() else tensor.pin_memory()
        return pinned.to(device, non_blocking=True)

    def move(batch):
        return map_tensors(to_device, batch)
    return move
