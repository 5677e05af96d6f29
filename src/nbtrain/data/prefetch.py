"""Copy the next batch to the GPU on a side stream while the current step computes."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from .nested import held_tensors


def _record_stream(batch, stream) -> None:
    """Tell the caching allocator `batch` is used on `stream`: its memory was allocated on
    the side stream, and without this it could be handed out again (to a later batch's
    copy) while `stream` still reads it (Tensor.record_stream). Every tensor counts, those
    inside an object that moved itself (a graph, a batch class) too."""
    for tensor in held_tensors(batch):
        tensor.record_stream(stream)


class Unmarked:
    """No timer: the wait for a copy is not timed (telemetry off, no loop attached, or a
    watched loop's copies: data/moves.py)."""

    def wait_started(self) -> None:
        pass

    wait_done = wait_started


class CudaPrefetcher:
    """Wraps a batch source; its epochs yield batches already on the device.

    While the loop runs step k on the default stream, batch k+1 is copied (from pinned
    memory, non_blocking) on `self.stream`, so copy and compute overlap. `move` is the
    mover that copies (the step's own is the identity); `markers` time the compute
    stream's wait for each copy (`mark_waits`: the loop's Interval), so that a copy the
    step had to wait for counts as copy time.
    """

    def __init__(self, source, move: Callable, device: torch.device):
        self.source, self.move, self.device = source, move, device
        self.stream = torch.cuda.Stream(device)
        self.markers = Unmarked()

    def __len__(self) -> int:
        return len(self.source)

    def epoch(self, epoch: int, start: int = 0) -> Iterator:
        with closed_at_end(iter(self.source.epoch(epoch, start))) as batches:
            yield from copied_ahead(batches, self.move, self.stream, self.device, self.markers)


@contextlib.contextmanager
def closed_at_end(batches: Iterator):
    """`batches`, closed (a generator's `finally`: its workers stopped, its copy freed) as
    its reader ends, not in a finalizer at some later time, where torch's CUDA sanitizer
    once crashed."""
    try:
        yield batches
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def copied_ahead(batches: Iterator, move: Callable, stream, device: torch.device,
                 markers=Unmarked(), record: Callable = _record_stream) -> Iterator:
    """`batches` moved by `move` on the side `stream`, one batch ahead of the one yielded:
    batch k+1's copy is queued before batch k is handed out, and the compute stream
    waits for a copy on the GPU (the host does not block); `record(moved, stream)` tells
    the allocator the compute stream uses it. fit's CudaPrefetcher and nt.watch's copies
    of your loader's batches (data/moves.py) both come through here."""
    def copy_ahead():
        batch = next(batches, None)
        if batch is None:
            return None
        with torch.cuda.stream(stream):
            return move(batch)

    ahead = copy_ahead()
    while ahead is not None:
        batch = ahead
        # before batch k+1 is queued on the side stream: a wait queued after it would
        # wait for that copy too (wait_stream waits for all the stream's work so far)
        current = torch.cuda.current_stream(device)
        markers.wait_started()
        current.wait_stream(stream)
        markers.wait_done()
        record(batch, current)
        try:
            ahead = copy_ahead()
        except Exception:
            # batch k+1 failed to load: batch k still trains, and the error surfaces
            # when the loop asks for k+1, so it names the batch that failed
            yield batch
            raise
        yield batch


def mark_waits(batches, markers) -> None:
    """Time a CudaPrefetcher's waits for its copies with `markers` (`wait_started`,
    `wait_done`: the loop's Interval); other batch sources copy in the step, where its
    own copy markers time them."""
    if isinstance(batches, CudaPrefetcher):
        batches.markers = markers
