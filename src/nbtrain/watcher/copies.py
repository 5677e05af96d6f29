"""CUDA only (optimize=True): the batch tensors the loop copies to the GPU, learned over
its first step (a MoveLog fed by the watch's Tensor.to and .cuda), then copied one batch
ahead from pinned memory, the loop's own `.to(device)` handed the copy made for it
(data/moves.py). Where nothing is copied ahead, torch's Tensor.to and .cuda are back
after step 1."""
from __future__ import annotations

import torch
from torch.compiler import is_compiling

from .settings import AS_WRITTEN


class Copies:
    """The watch's part that copies the training loader's batches ahead (CUDA)."""

    def __init__(self, edge):
        self.edge = edge
        self.pending = False       # CUDA: the loop's copies of its batch are being learned
        self.ahead = None          # AheadCopies: the batches' copies made one batch ahead
        self.pin = False           # the batched fetch writes into pinned memory
        self._moves = None         # the first batch's MoveLog, until the next batch
        self._copy_patches = []    # undo Tensor.to / Tensor.cuda's (_copying)

    def install(self) -> None:
        edge = self.edge
        self.pending = edge.plan.may("prefetch_to_device") and torch.cuda.is_available()
        if self.pending:
            self._copy_patches = [edge.patches.patch(torch.Tensor, name, self._copying(name))
                                  for name in ("to", "cuda")]

    def forget(self) -> None:
        """A batch and its copies on the GPU, not kept past the watch."""
        self._moves = None
        if self.ahead is not None:
            self.ahead.clear()

    def finish(self, has_loader: bool) -> None:
        if self.pending and has_loader:
            self.none("your loop took no second batch from its loader: nothing to copy ahead")

    def follow(self, batch, batches, loader, batched: bool):
        """At the training loader's first batch: note what the loop copies to a GPU until
        the next one. At the next: resolve pin_memory and prefetch_to_device on what it
        copied, and from the batch after it copy those tensors ahead. Returns the batches
        to go on with."""
        # loaded here, on a GPU's first batches: a watch on the CPU never needs them
        from ..data.moves import AheadCopies, MoveLog, plain, resolve_copies
        if self._moves is None:
            self._moves = MoveLog(batch)
            return batches
        log, self._moves, self.pending = self._moves, None, False
        cfg, resolved = self.edge.run.config, self.edge.run.resolved
        # Tensor.pin_memory() in the loop's thread is a blocking host copy on the step's
        # path (PyTorch's pin_memory/non_blocking guide): "auto" pins only where it is free,
        # in the rows the batched fetch writes; a per-sample loader's batches are pinned
        # only when asked
        can_pin = batched or (cfg.pin_memory is True and plain(batch))
        (pin, why_pin), (ahead, why_ahead) = resolve_copies(
            cfg.pin_memory, cfg.prefetch_to_device, log, loader.pin_memory, can_pin=can_pin)
        resolved["pin_memory"], resolved["prefetch_to_device"] = (pin, why_pin), (ahead, why_ahead)
        if not ahead:
            self.none(why_ahead)
            return batches
        self.pin = pin and batched   # the batched fetch writes pinned rows itself
        self.ahead = AheadCopies(log.moved, log.target(),
                                 pin=pin and not batched and not loader.pin_memory)
        return self.copied_ahead(batches)

    def none(self, why: str) -> None:
        """Nothing will be copied ahead: torch's own Tensor.to and .cuda again."""
        self.pending, self._moves = False, None
        for undo in self._copy_patches:
            undo()
        self.edge.run.resolved["prefetch_to_device"] = (False, why)

    def copied_ahead(self, batches):
        interval = self.edge.interval
        markers = {} if interval is None else {"markers": interval}   # times the waits
        return self.ahead.batches(batches, **markers)

    def _copying(self, name: str):
        """Tensor.to / Tensor.cuda for a watch on CUDA: over step 1 they note what the loop
        copies (MoveLog); once copies are made ahead, the loop's call on a tensor of its
        batch returns the copy made for it, where it asks for just that copy."""
        part, edge = self, self.edge

        def wrap(original):
            def moved(tensor, *args, **kwargs):
                if edge.inside or is_compiling():   # traced code: torch's own, as it is
                    return original(tensor, *args, **kwargs)
                ahead = part.ahead
                if ahead is not None and ahead.ready:
                    copy = ahead.take(tensor, *_move_request(name, args, kwargs))
                    if copy is not None:
                        return copy
                result = original(tensor, *args, **kwargs)
                if part._moves is not None:
                    part._moves.note(tensor, result, *_move_request(name, args, kwargs)[1:])
                return result
            return moved
        return wrap

    def describe(self, loader) -> None:
        """A new training loader: pin_memory and prefetch_to_device as they stand before
        step 1 shows what the loop copies (follow), or for good."""
        resolved = self.edge.run.resolved
        resolved["pin_memory"] = self._pin_as_found(loader)
        resolved["prefetch_to_device"] = (False, self._why_none_ahead())

    def _pin_as_found(self, loader) -> tuple:
        """pin_memory until step 1 shows what the loop copies (follow), or for good."""
        if loader.pin_memory or self.edge.run.config.pin_memory is not True or self.pending:
            return loader.pin_memory, AS_WRITTEN
        if not torch.cuda.is_available():
            return False, "asked for, but there is no CUDA device: nothing to pin for"
        return False, ("asked for, but the watch pins only what it copies ahead (here "
                       "prefetch_to_device=False): DataLoader(pin_memory=True) pins your "
                       "loader's batches")

    def _why_none_ahead(self) -> str:
        """Until step 1 shows what the loop copies (follow), or for good."""
        if self.pending:
            return "decided after your loop's first step, on what it copies to the GPU"
        if not self.edge.plan.may("prefetch_to_device"):
            return self.edge.plan.why_not("prefetch_to_device")
        return "no CUDA device: your loop's batches need no copy to a GPU"


def _move_request(name: str, args, kwargs):
    """(device, dtype, memory_format) that a call `tensor.to(*args, **kwargs)` (or
    `.cuda(...)`) asks for; Nones where it cannot be read (torch's own call then says why)."""
    try:
        if name == "to":
            if kwargs.get("copy"):
                return None, None, None
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
            return device, dtype, memory_format
        device = args[0] if args else kwargs.get("device")
        memory_format = args[2] if len(args) > 2 else kwargs.get("memory_format")
        if device is None or isinstance(device, int):
            device = torch.device("cuda", device)
        return torch.device(device), None, memory_format
    except Exception:
        return None, None, None
