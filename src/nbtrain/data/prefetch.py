"""Copy the next batch to the GPU on a side stream while the current step computes."""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from .nested import tensors


def _record_stream(batch, stream) -> None:
    """Tell the caching allocator `batch` is used on `stream`: without this, memory
    allocated on the side stream could be reused while the main stream still reads it."""
    for tensor in tensors(batch):
        tensor.record_stream(stream)


class CudaPrefetcher:
    """Wraps a batch source; its epochs yield batches already on the device.

    While the loop runs step k on the default stream, batch k+1 is copied (from pinned
    memory, non_blocking) on `self.stream`, so copy and compute overlap.
    """

    def __init__(self, source, move: Callable, device: torch.device):
        self.source, self.move, self.device = source, move, device
        self.stream = torch.cuda.Stream(device)

    def __len__(self) -> int:
        return len(self.source)

    def _copy_ahead(self, batches: Iterator):
        batch = next(batches, None)
        if batch is None:
            return None
        with torch.cuda.stream(self.stream):
            return self.move(batch)

    def epoch(self, epoch: int, start: int = 0) -> Iterator:
        batches = iter(self.source.epoch(epoch, start))
        ahead = self._copy_ahead(batches)
        while ahead is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)   # GPU-side wait: the host does not block
            batch = ahead
            _record_stream(batch, current)
            try:
                ahead = self._copy_ahead(batches)
            except Exception:
                # batch k+1 failed to load: batch k still trains, and the error surfaces
                # when the loop asks for k+1, so it names the batch that failed
                yield batch
                raise
            yield batch
