"""autotune's cache: a search's result kept on disk by what it was made of (the model, the data's\nshape, the machine and the settings), so that a re-run cell measures nothing again."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Optional

import torch

from .. import machine
from ..config import SETTINGS, TrainConfig
from ..data.batches import as_tensors
from ..files import atomic_write, cache_dir

NOT_SPEED = {name for name, meta in SETTINGS.items() if meta.speed is not True}


CACHE_VERSION = 1


def first_input(data, kind: str):
    """(inputs of one sample or batch, True when it is a whole batch), or (None, False)."""
    try:
        if kind == "tensors":
            return as_tensors(data)[0], True
        dataset = data.dataset if kind == "loader" else data
        sample = dataset[0]
    except Exception:   # an unindexable dataset: channels_last is simply not tried
        return None, False
    while isinstance(sample, (tuple, list)) and sample:
        sample = sample[0]
    return (sample, False) if isinstance(sample, torch.Tensor) else (None, False)


# -- the cache ---------------------------------------------------------------------------------
def cache_key(model: torch.nn.Module, data, kind: str, base: TrainConfig,
              device: torch.device, space) -> tuple:
    """(key, what it was made of): the same model, data shape, machine and settings."""
    about = {
        "model": {"class": type(model).__name__,
                  "params": sum(p.numel() for p in model.parameters()),
                  "shapes": hashlib.sha256(repr(machine.model_key(model)).encode()).hexdigest()[:16]},
        "data": _data_signature(data, kind),
        "machine": machine.facts(device),
        "config": {k: v for k, v in dataclasses.asdict(base).items() if k not in NOT_SPEED},
        "space": space or {},
    }
    text = json.dumps(about, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20], json.loads(text)


def _data_signature(data, kind: str) -> dict:
    sig = {"kind": kind, "type": type(data).__name__}
    if kind == "loader":
        sig.update(batch_size=data.batch_size, workers=data.num_workers)
        data = data.dataset
        sig["dataset"] = type(data).__name__
    tensors = as_tensors(data)
    try:   # samples, not the 2 of an (inputs, targets) pair
        sig["len"] = len(tensors[0]) if tensors is not None else len(data)
    except TypeError:
        pass
    x, batched = first_input(data, "tensors" if tensors is not None else "dataset")
    if x is not None:
        sig["input"] = [list(x.shape[1:] if batched else x.shape), str(x.dtype)]
    return sig


def _cache_file(key: str) -> Path:
    return cache_dir() / "autotune" / f"{key}.json"


def load_cached(key: str) -> Optional[dict]:
    try:
        entry = json.loads(_cache_file(key).read_text())
    except (OSError, ValueError):   # missing or damaged: measure again
        return None
    return entry if entry.get("version") == CACHE_VERSION else None


def save_cached(key: str, entry: dict) -> None:
    """Write atomically: a second notebook reading the cache never sees half a file."""
    with atomic_write(_cache_file(key), "w", durable=False) as f:
        json.dump(entry, f, indent=1, default=str)
