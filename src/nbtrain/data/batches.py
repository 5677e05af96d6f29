"""Where batches come from: whole-batch indexing of tensors, or a DataLoader.

Every source yields the batches of one epoch from a given position, in an order fixed
by (seed, epoch), so a resumed run sees exactly the batches it would have seen.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import os
import threading
import warnings
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from .nested import structure


def batch_chunks(order: torch.Tensor, batch_size: int) -> tuple:
    """`order` cut into batches of `batch_size` (the last one may be shorter): views made
    by one split, not a slice per batch. A batch size beyond the epoch is one batch (and
    one beyond int64, which a config or a batch sampler takes, would overflow split)."""
    return order.split(min(batch_size, max(len(order), 1)))


def pinned_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`tensor.index_select(0, index)`, a CPU tensor's written straight into page-locked
    memory: one pass over the batch, not a gather then a pin."""
    if not tensor.is_cpu:
        return tensor.index_select(0, index)
    out = torch.empty((len(index), *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=True)
    return torch.index_select(tensor, 0, index, out=out)


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """Sample order of one epoch; its own generator leaves the global RNG alone."""
    if not shuffle:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen)


def length_of(obj) -> Optional[int]:
    """len(obj), or None for what has no length (an IterableDataset, a generator)."""
    try:
        return len(obj)
    except TypeError:
        return None


def source_of(batches):
    """The batch source a CudaPrefetcher wraps, or `batches` itself."""
    return getattr(batches, "source", batches)


def batch_count(n: int, batch_size: int, drop_last: bool) -> int:
    return n // batch_size if drop_last else math.ceil(n / batch_size)


class EpochPlan:
    """Which samples each batch of an epoch holds, fixed by (seed, epoch): resumable.

    With several processes (`shard`) each holds every world-th sample of the epoch's
    order from its rank on: disjoint, equal lengths, and batch k of the ranks together is
    batch k of one process with a world times larger batch.
    """
    rank, world = 0, 1

    def __init__(self, n: int, batch_size: int, shuffle: bool, drop_last: bool, seed: int):
        self.n, self.batch_size, self.shuffle, self.drop_last, self.seed = \
            n, batch_size, shuffle, drop_last, seed
        self.total = n   # samples of the whole data; n: this rank's share

    def shard(self, rank: int, world: int, every_sample: bool = False) -> None:
        """Serve this rank's share of each epoch. For training the last total % world
        samples of an epoch's order are left out, so every rank steps as often;
        `every_sample` (validation, which steps no optimizer) keeps them: the first ranks
        then hold one sample more."""
        self.rank, self.world = rank, world
        self.n = len(range(rank, self.total, world)) if every_sample else self.total // world

    def order(self, epoch: int) -> torch.Tensor:
        """This rank's samples of `epoch`, in order."""
        order = epoch_order(self.total, self.shuffle, self.seed, epoch)
        return order if self.world == 1 else order[self.rank::self.world][:self.n]

    def __len__(self) -> int:
        return batch_count(self.n, self.batch_size, self.drop_last)

    def bounds(self, start: int = 0) -> Iterator[Tuple[int, int]]:
        """(first, end) positions in the epoch's order of each batch from `start` on."""
        bs = self.batch_size
        for b in range(start, len(self)):
            yield b * bs, (b + 1) * bs

    def sample_indices(self, epoch: int, batch: int) -> List[int]:
        first = batch * self.batch_size
        return self.order(epoch)[first:first + self.batch_size].tolist()


class TensorBatches(EpochPlan):
    """In-memory tensors served a batch at a time: one `index_select` per tensor.

    A DataLoader over the same tensors calls `__getitem__` per sample and stacks the
    results (pytorch/pytorch#10260), which costs more than a small model's step.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], batch_size: int, shuffle: bool,
                 drop_last: bool, seed: int, pin: bool = False):
        self.tensors = tuple(tensors)
        self.pin = pin   # batches in page-locked memory, for asynchronous copies to the GPU
        super().__init__(len(self.tensors[0]), batch_size, shuffle, drop_last, seed)

    def to(self, device: torch.device) -> "TensorBatches":
        self.tensors = tuple(t.to(device) for t in self.tensors)
        self.pin = False
        return self

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple]:
        if not self.shuffle and self.world == 1:   # contiguous slices are views: no copy
            for first, end in self.bounds(start):
                yield tuple(t[first:end].pin_memory() if self.pin else t[first:end]
                            for t in self.tensors)
            return
        order = self.order(epoch).to(self.tensors[0].device)
        for idx in itertools.islice(batch_chunks(order, self.batch_size), start, len(self)):
            yield tuple([self._gather(t, idx) for t in self.tensors])

    def _gather(self, tensor: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return pinned_rows(tensor, idx) if self.pin else tensor.index_select(0, idx)


class EpochBatchSampler(EpochPlan):
    """Batches of indices for the epoch and start position set before each `iter()`.

    The sampler runs in the main process even with workers, so setting `epoch` and
    `start` before iterating works with persistent workers too.
    """

    def __init__(self, n: int, batch_size: int, shuffle: bool, drop_last: bool, seed: int):
        super().__init__(n, batch_size, shuffle, drop_last, seed)
        self.epoch, self.start = 0, 0

    def __iter__(self) -> Iterator[List[int]]:
        order = self.order(self.epoch).tolist()   # once an epoch: a list slice per batch
        for first, end in self.bounds(self.start):
            yield order[first:end]


class LoaderBatches:
    """A map-style dataset through a DataLoader that nbtrain builds and configures."""

    def __init__(self, dataset: Dataset, sampler: EpochBatchSampler, **loader_kwargs):
        self.dataset = dataset
        self.sampler = sampler
        # Each iter(loader) draws its workers' base seed from `generator`, or without one
        # from the global RNG: a resumed run's extra iterator would shift every later
        # dropout mask. Its own generator, seeded per epoch, leaves the global RNG alone.
        self.loader = DataLoader(dataset, batch_sampler=sampler, generator=torch.Generator(),
                                 **loader_kwargs)

    def __len__(self) -> int:
        return len(self.sampler)

    def epoch(self, epoch: int, start: int = 0) -> Iterator:
        self.sampler.epoch, self.sampler.start = epoch, start
        self.loader.generator.manual_seed(self.sampler.seed * 1_000_003 + epoch)
        return stopping_workers(self.loader)

    def sample_indices(self, epoch: int, batch: int) -> List[int]:
        return self.sampler.sample_indices(epoch, batch)

    def find_crashing_sample(self, epoch: int, batch: int, window: int = 1) -> Optional[str]:
        """After a worker died while the loop waited for the `window` batches from `batch`
        on: the sample that kills a loading process, among the batches the workers may
        have been loading (up to prefetch_factor each)."""
        from .culprit import crashing_sample
        loader = self.loader
        ahead = max(1, loader.num_workers) * (loader.prefetch_factor or 1) + window - 1
        batches = range(batch, min(batch + ahead, len(self)))
        indices = [i for b in batches for i in self.sampler.sample_indices(epoch, b)]
        return crashing_sample(self.dataset, indices, loader.multiprocessing_context)


class GivenLoader:
    """The user's own DataLoader: its order and settings are its own."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self.dataset = getattr(loader, "dataset", None)

    def __len__(self) -> int:
        return len(self.loader)

    def epoch(self, epoch: int, start: int = 0) -> Iterator:
        # Best effort on resume: skip what was consumed (its own sampler may reshuffle).
        return stopping_workers(self.loader, skip=start)

    def sample_indices(self, epoch: int, batch: int) -> Optional[List[int]]:
        return None


def stopping_workers(loader: DataLoader, skip: int = 0) -> Iterator:
    """The batches of one iter(loader) after its first `skip`, its worker processes stopped
    as soon as the epoch ends early (an error, the loop closing it): a failed run's
    traceback keeps the iterator, which would keep the workers alive as long as the
    notebook keeps the error."""
    with workers_collect_none_of_ours():
        batches = iter(loader)   # now, not at the first next(): the sampler's epoch is set

    def until_done():
        finished = False
        try:
            yield from itertools.islice(batches, skip, None)
            finished = True   # run out: the iterator stopped its workers (or keeps them, persistent)
        finally:
            if not finished:
                stop_workers(batches, loader)
    return until_done()


@contextlib.contextmanager
def workers_collect_none_of_ours():
    """Worker processes forked inside never collect this process's garbage: each freezes
    what it inherited as it starts (gc.freeze, in the child only: this process's
    collector is left as it is). Without it a worker's first collection can free a CUDA
    tensor that was garbage here in a reference cycle; one used on a second stream (the
    prefetcher's batches: Tensor.record_stream) records a CUDA event as it is freed, CUDA
    cannot run in a forked child, and the worker aborts ("CUDA error: initialization
    error")."""
    _register_fork_hook()
    with _freezing_lock:
        _freezing[0] += 1
    try:
        yield
    finally:
        with _freezing_lock:
            _freezing[0] -= 1


_freezing = [0]   # the workers_collect_none_of_ours() blocks running, in any thread
_freezing_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _register_fork_hook() -> None:
    """Once a process (a hook cannot be taken back): it acts only inside the block."""
    os.register_at_fork(after_in_child=_freeze_if_asked)


def _freeze_if_asked() -> None:
    if _freezing[0]:
        gc.freeze()


def stop_workers(batches, loader: Optional[DataLoader] = None) -> None:
    """Stop the worker processes of `batches`, an iterator of `loader` (none without workers)."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is None:
        return
    try:
        shutdown()
    except RuntimeError as error:   # torch's SIGCHLD handler, as a worker dies on its way out
        if "DataLoader worker" not in str(error):
            raise
        # Every batch it delivered was used: its end changes nothing of the run, so a run that
        # finished stays finished (seen in CI: a spawned worker aborted as it exited).
        warnings.warn(f"{error} as the loader's workers were being stopped; the batches it "
                      "delivered were used, the run is unaffected", RuntimeWarning, stacklevel=2)
    if getattr(loader, "_iterator", None) is batches:   # persistent workers: the next
        loader._iterator = None                         # iter() starts new ones


def as_tensors(data, what: str = "train_data") -> Optional[tuple]:
    """The tensors behind `data` when it is in-memory tensor or numpy data, else None.

    numpy arrays become tensors sharing their memory (no copy). A tuple of Python lists
    is refused: as a Dataset it would be "two samples", each a whole column.
    """
    if isinstance(data, TensorDataset):
        return tuple(data.tensors)
    if not isinstance(data, (tuple, list)) or not data:
        return None
    if isinstance(data, tuple) and all(isinstance(t, list) for t in data):
        raise TypeError(f"{what} is a tuple of Python lists: pass tensors or numpy arrays, "
                        f"e.g. (torch.tensor(inputs), torch.tensor(targets)), or a Dataset.")
    if not all(isinstance(t, torch.Tensor) or _is_array(t) for t in data):
        return None
    tensors = tuple(t if isinstance(t, torch.Tensor) else torch.from_numpy(t) for t in data)
    if len({len(t) for t in tensors}) != 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ValueError(f"{what} tensors must have the same length (first dimension); "
                         f"got shapes {shapes}. Pass (inputs, targets) with one row per sample.")
    return tensors


def _is_array(value) -> bool:
    """A numpy array, without importing numpy for data that has none."""
    return type(value).__module__ == "numpy" and hasattr(value, "__array_interface__")


def describe_bad_sample(dataset, indices: List[int]) -> Optional[str]:
    """Name the first sample of a failed batch that raises, or whose structure or shapes
    differ from the batch's first. Runs only after a failure: costs nothing otherwise."""
    if isinstance(dataset, ByValue):
        dataset = dataset.dataset
    signatures = {}
    for i in indices:
        try:
            signatures[i] = signature_of(dataset[i])
        except Exception as exc:
            return f"sample {i} raised {type(exc).__name__}: {shortened(str(exc))}"
    first = signatures[indices[0]]
    for i, sig in signatures.items():
        if sig != first:
            return f"sample {i} has {_describe(sig)} but sample {indices[0]} has {_describe(first)}"
    return None


def signature_of(sample):
    """A comparable summary of a sample: each tensor's shape and dtype, other leaves' types."""
    return structure(sample, _leaf_signature)


def _leaf_signature(leaf):
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype)
    return type(leaf).__name__


def describe_batch(batch) -> str:
    """A batch's structure and shapes, e.g. '(a tensor of shape (32, 8) (float32), ...)'."""
    return _describe(signature_of(batch))


def _describe(sig) -> str:
    if isinstance(sig, tuple) and sig and sig[0] == "tensor":
        return f"a tensor of shape {sig[1]} ({str(sig[2]).replace('torch.', '')})"
    if isinstance(sig, tuple):
        return "(" + ", ".join(_describe(s) for s in sig) + ")"
    return str(sig)


class ByValue(Dataset):
    """A dataset that travels to worker processes by value (cloudpickle), for classes that
    a fresh interpreter cannot import (defined in a notebook cell or a function)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, indices):
        """The dataset's own batched fetch when it has one (the loader looks for it)."""
        if hasattr(self.dataset, "__getitems__"):
            return self.dataset.__getitems__(indices)
        return [self.dataset[i] for i in indices]

    def __reduce__(self):
        import cloudpickle
        return (_rebuild, (cloudpickle.dumps(self.dataset),))


def _rebuild(blob: bytes) -> ByValue:
    import cloudpickle
    return ByValue(cloudpickle.loads(blob))


def shortened(text: str, limit: int = 400) -> str:
    """At most `limit` characters of an error's text: a message quoting a whole sample
    (a collate error over a huge list) must stay readable."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
