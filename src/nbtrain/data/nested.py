"""Walking a nested batch: a tensor, or tuples, lists and mappings of them, nested.

Every place that looks inside a batch (moving it to the device, marking it used on a
CUDA stream, describing a bad sample, counting a batch's samples) goes through here,
so they all agree on what a batch may hold. Any `collections.abc.Mapping` counts as a
mapping (a dict, transformers' BatchEncoding). Anything else in a batch (a string, a
number, None) is a leaf, passed on as it is.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, List

import torch


def _rebuild(batch, leaf: Callable, sequence: Callable, mapping: Callable):
    """The one recursion: `leaf(x)` for each leaf, then `sequence(original, parts)` puts a
    tuple's or list's parts back together and `mapping(pairs)` a mapping's (key, part)s."""
    if isinstance(batch, (tuple, list)):
        return sequence(batch, [_rebuild(b, leaf, sequence, mapping) for b in batch])
    if isinstance(batch, Mapping):
        return mapping([(k, _rebuild(v, leaf, sequence, mapping)) for k, v in batch.items()])
    return leaf(batch)


def map_tensors(fn: Callable, batch):
    """`batch` with `fn(t)` for each tensor `t`: tuples and lists keep their type, a
    mapping becomes a plain dict, other leaves stay as they are.

    >>> map_tensors(lambda t: t.to("cuda"), {"x": x, "y": [y, "label"]})
    """
    return map_leaves(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, batch)


def map_leaves(fn: Callable, batch):
    """`batch` with `fn(x)` for every leaf `x`, tensor or not, rebuilt as map_tensors does."""
    return _rebuild(batch, fn, _same_kind, dict)


def _same_kind(seq, parts):
    """`parts` as a sequence of `seq`'s type: a namedtuple (default_collate keeps them)
    takes its fields as arguments, a tuple or list the parts as one iterable."""
    return type(seq)(*parts) if hasattr(seq, "_fields") else type(seq)(parts)


def tensors(batch) -> List[torch.Tensor]:
    """Every tensor in `batch`, in order."""
    found: List[torch.Tensor] = []
    map_tensors(found.append, batch)   # the rebuilt copy is dropped: only the visit counts
    return found


_PLAIN = (str, bytes, int, float, complex, bool, type(None))


def held_tensors(batch, depth: int = 4) -> List[torch.Tensor]:
    """Every tensor in `batch`, and the device tensors held inside its other leaves: the
    attributes of an object that moves itself (a PyG graph keeps its tensors in a mapping
    attribute, a user's batch class or a dataclass in plain ones), `depth` objects deep,
    each object visited once; host tensors an object keeps of its own are left out. What
    a CUDA stream must be told a batch holds (Tensor.record_stream, which host tensors do
    not take): a tensor missed here could have its memory handed out again while still
    in use."""
    found: List[torch.Tensor] = []
    seen = set()

    def visit(item, depth: int, inside: bool) -> None:
        if isinstance(item, torch.Tensor):
            if not (inside and item.is_cpu):
                found.append(item)
            return
        if isinstance(item, _PLAIN) or id(item) in seen:
            return
        seen.add(id(item))
        if isinstance(item, (tuple, list)):
            parts = item
        elif isinstance(item, Mapping):
            parts = item.values()
        elif depth > 0:
            parts, depth, inside = _attributes(item), depth - 1, True
        else:
            return
        for part in parts:
            visit(part, depth, inside)
    visit(batch, depth, inside=False)
    return found


def _attributes(obj) -> list:
    """An object's attribute values: its __dict__'s and its __slots__'."""
    values = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    for cls in type(obj).__mro__:
        slots = getattr(cls, "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                values.append(getattr(obj, name))
    return values


def structure(batch, leaf: Callable):
    """A comparable summary of `batch`: `leaf(x)` for each leaf, a tuple for a tuple or a
    list alike, a mapping as its (key, summary) pairs sorted by key (so key order does not
    count)."""
    return _rebuild(batch, leaf, lambda _, parts: tuple(parts), lambda pairs: tuple(sorted(pairs)))


def batch_len(batch) -> int:
    """Samples in a batch: the length of its first tensor (the first element of tuples and
    lists, the first value of a mapping, as deep as they nest), or of its first list of
    plain items: collate keeps strings as a list with one per sample."""
    # tuples and tensors are asked first: isinstance against Mapping (an ABC) is slower,
    # and this runs once per micro-batch
    while not hasattr(batch, "shape"):
        if isinstance(batch, (tuple, list)):
            if not _holds_samples(batch[0]):
                return len(batch)   # ["a text", "another"]: not the first string's characters
            batch = batch[0]
        elif isinstance(batch, Mapping):
            batch = next(iter(batch.values()))
        else:
            break
    shape = getattr(batch, "shape", None)
    return shape[0] if shape else len(batch)   # a tensor's len() is a Python call too


def _holds_samples(item) -> bool:
    return hasattr(item, "shape") or isinstance(item, (tuple, list, Mapping))


def tensors_in(value, depth: int = 2) -> list:
    """The tensors of a forward's arguments or output, two levels down (an LSTM's
    `(out, (h, c))`)."""
    if isinstance(value, torch.Tensor):
        return [value]
    found = []
    if depth and isinstance(value, (tuple, list)):
        for item in value:   # a call only for an item that is no tensor (it runs every forward)
            if isinstance(item, torch.Tensor):
                found.append(item)
            else:
                found.extend(tensors_in(item, depth - 1))
    return found
