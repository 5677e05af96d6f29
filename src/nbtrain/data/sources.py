"""nt.fit's data path: build the batch source for a run and resolve its "auto" settings."""
from __future__ import annotations

import functools
import inspect
import warnings
from typing import Callable, Tuple

import torch
from torch.utils.data import DataLoader, Dataset

from ..config import ConfigError, TrainConfig
from ..kinds import ResolvedSettings
from ..machine import available_cores
from .batches import (ByValue, EpochBatchSampler, GivenLoader, LoaderBatches, TensorBatches,
                      as_tensors, describe_bad_sample, length_of, source_of)
from .errors import CorruptRecordError
from .nested import map_leaves
from .prefetch import CudaPrefetcher, mark_waits


def make_batches(data, cfg: TrainConfig, device: torch.device, resolved: ResolvedSettings,
                 what: str = "train_data"):
    """The batch source for `data`, recording each data-path choice in `resolved`;
    `what` names the data in errors (train_data, val_data)."""
    if isinstance(data, DataLoader):
        return _given_loader(data, cfg, resolved)
    tensors = as_tensors(data, what)
    if tensors is not None:
        return _tensor_source(tensors, cfg, device, resolved)
    if isinstance(data, Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        return _dataset_source(data, cfg, device, resolved)
    raise TypeError(f"{what} must be a map-style Dataset, an (inputs, targets) pair of "
                    f"tensors or numpy arrays, or a DataLoader; got {type(data).__name__}.")


def _given_loader(loader: DataLoader, cfg: TrainConfig, resolved: ResolvedSettings):
    why = "from your DataLoader (nbtrain's loader settings do not apply to it)"
    resolved["num_workers"] = (loader.num_workers, why)
    resolved["pin_memory"] = (loader.pin_memory, why)
    resolved["batch_size"] = (loader.batch_size, why)
    resolved["batched_fetch"] = (False, why)
    resolved["data_on_device"] = (False, why)
    return GivenLoader(loader)


def _tensor_source(tensors, cfg: TrainConfig, device, resolved: ResolvedSettings):
    workers = cfg.num_workers
    if cfg.data_on_device is True and workers not in ("auto", 0) and device.type != "cpu":
        raise ConfigError(f"TrainConfig.data_on_device=True with num_workers={workers} is not "
                          "allowed: workers load per sample on the CPU, while data_on_device "
                          "keeps the tensors on the device. Set num_workers=0 (or 'auto'), "
                          "or data_on_device='auto'.", field="data_on_device")
    if cfg.batched_fetch is True and workers not in ("auto", 0):
        raise ConfigError(f"TrainConfig.batched_fetch=True with num_workers={workers} is not "
                          "allowed: batched fetch serves tensors from the main process. "
                          "Set num_workers=0, or batched_fetch=False to load per sample in workers.",
                          field="batched_fetch")
    batched = cfg.batched_fetch if cfg.batched_fetch != "auto" else workers in ("auto", 0)
    if not batched:
        return _dataset_source(torch.utils.data.TensorDataset(*tensors), cfg, device, resolved,
                               why_per_sample="batched_fetch off: per-sample __getitem__ + collate")
    resolved["batched_fetch"] = (True, "in-memory tensors: one index op per batch instead of "
                                       "a __getitem__ per sample and a collate")
    resolved["num_workers"] = (0, "in-memory tensors: batched fetch beats worker processes")
    on_device, why = _resolve_on_device(tensors, cfg, device)
    resolved["data_on_device"] = (on_device, why)
    copied = on_device and not all(_already_on(t, device) for t in tensors)
    if copied and cfg.channels_last:   # laid out once, as they are copied: not every step
        source = KeptLayoutBatches(tensors, cfg.batch_size, cfg.shuffle, cfg.drop_last, cfg.seed)
        source.tensors = tuple(_channels_last(t, device) for t in tensors)
    else:
        source = TensorBatches(tensors, cfg.batch_size, cfg.shuffle, cfg.drop_last, cfg.seed)
        if on_device:
            source.to(device)
    resolved["pin_memory"] = _resolve_pin(cfg, device, on_device)
    source.pin = resolved["pin_memory"][0]
    return source


def stays_on_device(tensors, cfg: TrainConfig, device) -> bool:
    """Whether `tensors` will live on `device` for the run (data_on_device resolved)."""
    return _resolve_on_device(tensors, cfg, device)[0]


def _channels_last(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device`, an image batch (4-D) in channels_last: one copy does both."""
    if tensor.dim() != 4:
        return tensor.to(device)
    return tensor.to(device, memory_format=torch.channels_last)


class KeptLayoutBatches(TensorBatches):
    """Resident channels_last images whose batches stay channels_last: a shuffled batch is
    gathered by indexing, which keeps the source's strides, where index_select returns a
    contiguous (NCHW) tensor that the mover would convert again every step."""

    def _gather(self, tensor: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return tensor[idx] if tensor.dim() == 4 else super()._gather(tensor, idx)


def _resolve_on_device(tensors, cfg: TrainConfig, device) -> Tuple[bool, str]:
    if device.type != "cpu" and all(_already_on(t, device) for t in tensors):
        return True, f"the tensors are already on {device}"   # nothing to pin or copy
    if device.type == "cpu":
        if cfg.data_on_device is False:
            return False, "asked for (the data is in CPU memory either way)"
        return True, "device is the CPU: the data already lives in its memory"
    if cfg.data_on_device != "auto":
        return cfg.data_on_device, "asked for"
    size = sum(t.numel() * t.element_size() for t in tensors)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if size < free // 4:
            return True, (f"{size / 2**20:.0f} MiB of tensors fit easily in "
                          f"{free / 2**30:.1f} GiB free: one copy instead of one per step")
        return False, f"{size / 2**20:.0f} MiB is over a quarter of free device memory"
    return False, f"free memory on {device.type} cannot be queried"


def _already_on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)


def _resolve_pin(cfg: TrainConfig, device, on_device: bool) -> Tuple[bool, str]:
    if device.type != "cuda":
        if cfg.pin_memory is True:
            return False, f"ignored: pinning speeds host-to-GPU copies; device is {device.type}"
        return False, f"device is {device.type}: no host-to-GPU copy to speed up"
    if on_device:
        return False, "data lives on the GPU: nothing to copy per step"
    if cfg.pin_memory == "auto":
        return True, "pinned pages copy to the GPU faster and allow non_blocking copies"
    return cfg.pin_memory, "asked for"


def _dataset_source(dataset, cfg: TrainConfig, device, resolved: ResolvedSettings,
                    why_per_sample: str = "per-sample dataset"):
    if cfg.data_on_device is True and device.type != "cpu":
        raise ConfigError("TrainConfig.data_on_device=True needs in-memory tensor data "
                          f"(an (inputs, targets) pair or a TensorDataset); got "
                          f"{type(dataset).__name__}. Use data_on_device='auto' or False.",
                          field="data_on_device")
    has_getitems = hasattr(dataset, "__getitems__")
    packed = getattr(dataset, "packed_format", None)
    if packed:
        why_per_sample = f"{why_per_sample} (packed {packed} records)"
    if cfg.batched_fetch is True and not has_getitems:
        why_per_sample = (f"asked for, but {type(dataset).__name__} has no __getitems__: each "
                          "sample is read by __getitem__ and collated. Give it a "
                          "__getitems__(indices), or pass in-memory tensors")
        warnings.warn(f"TrainConfig.batched_fetch=True: {why_per_sample}.", stacklevel=4)
    resolved["batched_fetch"] = (has_getitems, "dataset has __getitems__" if has_getitems
                                 else why_per_sample)
    resolved["data_on_device"] = (device.type == "cpu", "device is the CPU: batches are loaded "
                                  "into its memory" if device.type == "cpu" else
                                  "per-sample dataset: batches are copied as they are loaded")
    workers, why = _resolve_workers(cfg)
    resolved["num_workers"] = (workers, why)
    pin, why = _resolve_pin(cfg, device, on_device=False)
    resolved["pin_memory"] = (pin, why)
    return loader_batches(dataset, cfg, workers, pin)


def loader_batches(dataset, cfg: TrainConfig, workers: int, pin: bool = False) -> LoaderBatches:
    """nbtrain's loader over a per-sample `dataset` with `workers` processes (the probe
    rebuilds it with the count it measured best)."""
    dataset = unwrapped(dataset)
    sampler = EpochBatchSampler(len(dataset), cfg.batch_size, cfg.shuffle, cfg.drop_last, cfg.seed)
    if workers > 0:
        dataset = shippable(dataset, cfg.multiprocessing_context)
    return LoaderBatches(dataset, sampler, num_workers=workers, pin_memory=pin,
                         **worker_settings(cfg, workers))


def worker_settings(cfg: TrainConfig, workers: int) -> dict:
    """The DataLoader arguments that apply only with worker processes."""
    if workers == 0:
        return {}
    return dict(prefetch_factor=cfg.prefetch_factor, persistent_workers=cfg.persistent_workers,
                multiprocessing_context=cfg.multiprocessing_context)


def unwrapped(dataset):
    """The user's dataset behind nbtrain's ByValue wrapper."""
    return dataset.dataset if isinstance(dataset, ByValue) else dataset


def _start_method(context) -> str:
    import multiprocessing
    return context or multiprocessing.get_start_method(allow_none=False)


def _defined_in_a_notebook(obj) -> bool:
    cls = type(obj)
    return cls.__module__ == "__main__" or "<locals>" in cls.__qualname__


def shippable(dataset, context=None):
    """`dataset`, made sendable to spawn/forkserver workers when plain pickle cannot.

    Those workers start a fresh interpreter and unpickle the dataset by importing its
    class; a class defined in a notebook cell (module __main__) or inside a function
    cannot be imported there. cloudpickle sends the class itself, by value.
    """
    if _start_method(context) == "fork" or not _defined_in_a_notebook(dataset):
        return dataset
    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{type(dataset).__name__} is defined in the notebook (or inside a function), so "
            f"'{_start_method(context)}' workers cannot import it. pip install cloudpickle, "
            "move the class into a .py file, or set num_workers=0.", field="num_workers") from None
    return ByValue(dataset)


def _resolve_workers(cfg: TrainConfig) -> Tuple[int, str]:
    if cfg.num_workers != "auto":
        return cfg.num_workers, "asked for"
    cores = available_cores()
    if cores == 1:
        return 0, "per-sample loading on 1 core: a worker would take turns with training for it"
    workers = min(8, cores - 1)
    return workers, (f"per-sample loading: {workers} worker(s) load ahead while the main "
                     f"process trains ({cores} cores)")


def first_batch(source):
    """The first batch of epoch 0, loaded in this process (no workers started)."""
    source = source_of(source)   # under a CudaPrefetcher
    if isinstance(source, LoaderBatches):
        from torch.utils.data import default_collate
        indices = source.sample_indices(0, 0)
        dataset = unwrapped(source.dataset)
        if hasattr(dataset, "__getitems__"):
            return default_collate(dataset.__getitems__(indices))
        return default_collate([dataset[i] for i in indices])
    return next(iter(source.epoch(0)))


def make_mover(device: torch.device, pinned: bool, resident: bool,
               channels_last: bool) -> Callable:
    """The function that puts a batch on `device`: identity when it is already there. A
    resident channels_last batch is already laid out so (KeptLayoutBatches), and the
    mover's `contiguous` returns it as it is (a stride check, no copy)."""
    if (resident or device.type == "cpu") and not channels_last:
        return _identity   # a CPU run's batches are on the CPU already: no walk per step
    non_blocking = pinned   # only a copy from pinned memory can be asynchronous

    def to_device(leaf):
        if not isinstance(leaf, torch.Tensor):
            # an object that moves itself (a graph, a user's batch class); strings and
            # numbers stay as they are
            return _moved_object(leaf, device, non_blocking)
        leaf = leaf.to(device, non_blocking=non_blocking)
        if channels_last and leaf.dim() == 4:
            leaf = leaf.contiguous(memory_format=torch.channels_last)
        return leaf

    def move(batch):
        return map_leaves(to_device, batch)
    return move


def _moved_object(leaf, device: torch.device, non_blocking: bool):
    """`leaf.to(device)`, non_blocking where its `to` takes it (PyG's Data, DGL's graphs
    do): without it a copy from pinned memory blocks the host, and on the prefetcher's
    side stream the compute it was to overlap."""
    to = getattr(leaf, "to", None)
    if not callable(to):
        return leaf
    if non_blocking and _takes_non_blocking(type(leaf)):
        return to(device, non_blocking=True)
    return to(device)


@functools.lru_cache(maxsize=128)
def _takes_non_blocking(cls) -> bool:
    """Whether `cls.to` accepts non_blocking=... (by name, or through **kwargs); asked
    once per class, not per batch."""
    try:
        parameters = inspect.signature(cls.to).parameters.values()
    except (TypeError, ValueError):   # a builtin without a signature
        return False
    return any(p.name == "non_blocking" or p.kind is p.VAR_KEYWORD for p in parameters)


def _identity(batch):
    return batch


def source_mover(batches, move: Callable) -> Callable:
    """What puts a batch of `batches`' source on the device: under a CudaPrefetcher the
    step's `move` is the identity (its batches arrive on the device), and the
    prefetcher's own mover copies; else `move`."""
    return batches.move if isinstance(batches, CudaPrefetcher) else move


def resolve_prefetch(cfg: TrainConfig, device, resident: bool, pinned: bool):
    """Whether to copy batches ahead on a CUDA side stream, with the reason."""
    if device.type != "cuda":
        return False, f"device is {device.type}: no host-to-GPU copy to overlap"
    if resident:
        return False, "data lives on the GPU: nothing to copy"
    if cfg.prefetch_to_device == "auto":
        if not pinned:
            return False, "pageable memory cannot be copied asynchronously (pin_memory off)"
        return True, "copy batch k+1 on a side stream while step k computes"
    if cfg.prefetch_to_device and not pinned:
        return True, "asked for; with pin_memory off each copy blocks the host, so little overlaps"
    return cfg.prefetch_to_device, "asked for"


def prefetch_to_device(source, move, device):
    return CudaPrefetcher(source, move, device)
