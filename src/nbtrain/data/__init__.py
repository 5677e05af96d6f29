"""The data path: a run's batch source (sources.py), its batches, their copies and the
packed formats (LMDB, TFRecord).

Every name loads its module on first use, as nbtrain's own do: a watch, which needs only
batches.py and nested.py, pays for neither nt.fit's data path nor a packed format.

>>> ds = nt.data.LMDBDataset("digits.lmdb")
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # what static readers see (IDEs, the API reference); loaded on first use
    from .errors import CorruptRecordError
    from .lmdb import LMDBDataset, pack_lmdb
    from .prefetch import mark_waits
    from .sources import (TensorBatches, describe_bad_sample, first_batch, make_batches,
                          make_mover, prefetch_to_device, source_mover, stays_on_device)
    from .tfrecord import TFRecordDataset, pack_tfrecord

__all__ = ["make_batches", "make_mover", "first_batch", "describe_bad_sample", "TensorBatches",
           "pack_lmdb", "LMDBDataset", "pack_tfrecord", "TFRecordDataset", "CorruptRecordError",
           "prefetch_to_device", "mark_waits", "source_mover", "stays_on_device"]

# name -> the module that holds it, where that is not sources.py
_ELSEWHERE = {"pack_lmdb": "lmdb", "LMDBDataset": "lmdb",
              "pack_tfrecord": "tfrecord", "TFRecordDataset": "tfrecord"}


def __getattr__(name):
    if name.startswith("__"):   # the import system's own questions (__path__ is set)
        raise AttributeError(f"module 'nbtrain.data' has no attribute {name!r}")
    module = importlib.import_module(f".{_ELSEWHERE.get(name, 'sources')}", __name__)
    try:
        value = getattr(module, name)
    except AttributeError:   # a submodule (`from nbtrain.data import lmdb`) is imported next
        raise AttributeError(f"module 'nbtrain.data' has no attribute {name!r}") from None
    globals()[name] = value   # the next lookup is an ordinary one
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
