"""Your loop's copies of its batches to the GPU, learned and then made ahead (nt.watch).

A loop of your own copies each batch itself (`xb, yb = xb.to(device), yb.to(device)`).
Over its first step the watch notes which of the batch's CPU tensors the loop copies to
a CUDA device (`MoveLog`, fed by the watch's `Tensor.to` / `Tensor.cuda`). From the
third batch on (`AheadCopies`) those tensors are copied to that device one batch ahead,
on a side stream while the step before computes, and the loop's own `.to(device)` on a
tensor of the batch it was given returns the copy made for it instead of copying then.
The loop still gets its loader's own batches, on the CPU: a tensor it also uses there (a
metric against CPU labels, `.numpy()`, a print), in any step, is the tensor it always was.
"""
from __future__ import annotations

import itertools
from typing import Dict, Optional, Tuple

import torch

from .nested import map_tensors, tensors
from .prefetch import Unmarked, copied_ahead

GPU = "cuda"   # the device type copied to (a test stands in "meta" for it on a CPU)


class MoveLog:
    """Which CPU tensors of one batch the loop copied to a CUDA device (`.to`, `.cuda`)
    before the next batch arrived."""

    def __init__(self, batch):
        self.tensors = tensors(batch)   # kept alive until the verdict: their ids name them
        self._positions = {id(t): i for i, t in enumerate(self.tensors)}
        self.moved: Dict[int, torch.device] = {}   # position in the batch -> where it went

    def note(self, tensor, result, dtype, memory_format) -> None:
        """`tensor.to(...)` (or `.cuda(...)`) returned `result`; `dtype`, `memory_format`:
        what the call asked for besides the device. Only a plain copy counts: a copy ahead
        could not serve one that also converts (AheadCopies.take)."""
        position = self._positions.get(id(tensor))
        if position is not None and tensor.is_cpu and isinstance(result, torch.Tensor) \
                and result.device.type == GPU and _just_moved(tensor, dtype, memory_format):
            self.moved[position] = result.device

    def target(self) -> Optional[torch.device]:
        """The one CUDA device the loop copied its batch's tensors to; None if it copied
        none, or to several devices."""
        devices = set(self.moved.values())
        return devices.pop() if len(devices) == 1 else None

    def why_none(self) -> str:
        if not self.tensors:
            return "your loader's batches hold no tensor"
        if self.moved:
            return "your loop copies its batch's tensors to several GPUs"
        if not any(t.is_cpu for t in self.tensors):
            return "your loader's batches are on the GPU already"
        return ("your loop copied none of its batch's tensors to a GPU as they are (a copy "
                "that also converts dtype or layout is left to it) in its first step")


def resolve_copies(pin_memory, prefetch, log: Optional[MoveLog], loader_pins: bool,
                   can_pin: bool) -> Tuple[Tuple[bool, str], Tuple[bool, str]]:
    """((pin, why), (prefetch, why)) for a watched loop on CUDA, after its first step.
    `pin_memory`, `prefetch`: the settings (True, False or "auto"); `loader_pins`: the
    loop's DataLoader pins already; `can_pin`: the watch can give the batches in pinned
    memory (its batched fetch, a plain list, tuple or dict batch, or its workers)."""
    target = log.target() if log is not None else None
    pinned = loader_pins or (pin_memory is not False and can_pin)
    why_pageable = ("pin_memory=False" if pin_memory is False else
                    "with pin_memory='auto' the watch pins only the rows its batched fetch "
                    "writes (pinning in the loop's thread costs more than a copy ahead "
                    "saves), and batches of a type of their own never; "
                    "DataLoader(pin_memory=True) pins in a thread of its own")
    if prefetch is False:
        ahead = False, "asked for"
    elif target is None:
        ahead = False, ("not possible: " if prefetch is True else "") + (
            log.why_none() if log is not None else "your loop iterates no DataLoader")
    elif not pinned and prefetch == "auto":
        ahead = False, "from pageable memory a copy ahead overlaps little: " + why_pageable
    else:
        ahead = True, (f"your loop copies {len(log.moved)} of its batch's {len(log.tensors)} "
                       f"tensors to {target}: each is copied there one batch ahead on a side "
                       "stream while the step before computes, and your .to(device) returns "
                       "that copy" + ("" if pinned else f" (from pageable memory: {why_pageable})"))
    if loader_pins:
        pin = True, "your loop's own (DataLoader(pin_memory=True))"
    elif pin_memory is False:
        pin = False, "asked for"
    elif not ahead[0]:
        pin = False, "no copies ahead to pin for"
    elif not can_pin:
        pin = False, why_pageable
    else:
        pin = True, ("asked for: " if pin_memory is True else "") + (
            "the tensors copied ahead are in pinned memory, where a copy overlaps the step")
    return pin, ahead


class AheadCopies:
    """The batch tensors at `positions` copied to `device` one batch ahead on `stream`,
    and handed to the loop's `.to(device)` for the batch it was given last."""

    def __init__(self, positions, device: torch.device, pin: bool):
        self.positions, self.device, self.pin = frozenset(positions), device, pin
        self.stream = torch.cuda.Stream(device)
        # id(cpu tensor) -> (it, its copy, its version when copied), for the last batch out
        self.ready: Dict[int, Tuple[torch.Tensor, torch.Tensor, int]] = {}

    def batches(self, batches, markers=Unmarked()):
        """`batches` as they come (the tensors copied pinned, where `pin`), each one's
        copies queued on the side stream before the one before it is handed out
        (prefetch.copied_ahead)."""
        for batch, copies in copied_ahead(batches, self._copy, self.stream, self.device,
                                          markers, record=_record_copies):
            self.ready = copies
            yield batch
        self.ready = {}

    def _copy(self, batch):
        """(the batch, {id(cpu tensor): (it, its copy, its version)}), the copies queued on
        the side stream (copied_ahead calls this inside it). With `pin`, the tensors it
        copies are pinned first, in the batch the loop gets (one walk of it)."""
        copies, position = {}, itertools.count()

        def copy_ahead(tensor):
            if next(position) in self.positions and tensor.is_cpu:
                if self.pin and not tensor.is_pinned():
                    tensor = tensor.pin_memory()
                copies[id(tensor)] = (tensor, tensor.to(self.device, non_blocking=True),
                                      tensor._version)
            return tensor
        rebuilt = map_tensors(copy_ahead, batch)
        return (rebuilt if self.pin else batch), copies   # without pin: as it came

    def take(self, tensor, device, dtype, memory_format) -> Optional[torch.Tensor]:
        """The copy made ahead of `tensor`, once, where the loop's call asks for just that:
        the same device, dtype and layout, and the tensor unchanged since it was copied
        (an in-place edit, `xb.sub_(mean)`, bumps its version). Anything else the loop
        copies itself; a call to no GPU leaves the copy for a later one."""
        if device is None or device.type != GPU:
            return None
        found = self.ready.pop(id(tensor), None)
        if found is None or found[0] is not tensor:
            return None
        _, copy, version = found
        if _same_device(device, copy.device) and _just_moved(tensor, dtype, memory_format) \
                and tensor._version == version:
            return copy
        return None

    def clear(self) -> None:
        self.ready = {}


def _just_moved(tensor: torch.Tensor, dtype, memory_format) -> bool:
    return dtype in (None, tensor.dtype) and memory_format in (None, torch.preserve_format)


def _same_device(asked: Optional[torch.device], copy: torch.device) -> bool:
    """Whether `.to(asked)` means `copy`'s device ("cuda" alone: the current one)."""
    if asked is None or asked.type != copy.type:
        return False
    if asked.index is not None:
        return asked.index == copy.index
    return copy.index is None or copy.index == torch.cuda.current_device()


def _record_copies(moved, stream) -> None:
    """The copies were allocated on the side stream and are used on `stream`
    (Tensor.record_stream), so their memory is not handed out again while it reads them."""
    for _, copy, _ in moved[1].values():
        copy.record_stream(stream)


def plain(batch, depth: int = 4) -> bool:
    """A batch of lists, tuples and dicts of tensors (default_collate's kinds): rebuilt
    with pinned tensors it is the same kind of object (a BatchEncoding, a namedtuple or a
    batch class would not be)."""
    if isinstance(batch, torch.Tensor) or batch is None or isinstance(batch, (str, int, float)):
        return True
    if depth == 0 or type(batch) not in (list, tuple, dict):
        return False
    values = batch.values() if type(batch) is dict else batch
    return all(plain(v, depth - 1) for v in values)

