"""Pack a dataset into one LMDB file and read it back: one memory-mapped file instead of
thousands of small ones, so loading costs a page lookup rather than an open() per sample.

Samples are stored in a small, pickle-free format (a JSON header + raw bytes), so reading
a database never runs code from it.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

META_KEY = b"__nbtrain__"
FORMAT = 1


# -- one sample <-> bytes -------------------------------------------------------------------
def _encode_item(item, header: list, chunks: list) -> None:
    if isinstance(item, torch.Tensor):
        array = item.detach().cpu().contiguous().numpy()
        header.append(["t", array.dtype.str, list(array.shape)])
        chunks.append(array.tobytes())
    elif isinstance(item, np.ndarray):
        header.append(["n", item.dtype.str, list(item.shape)])
        chunks.append(np.ascontiguousarray(item).tobytes())
    elif isinstance(item, (bytes, bytearray, memoryview)):
        header.append(["b"])
        chunks.append(bytes(item))
    elif isinstance(item, (bool, int, float, str)) or isinstance(item, np.generic):
        header.append(["v", item.item() if isinstance(item, np.generic) else item])
        chunks.append(b"")
    else:
        raise TypeError(f"pack_lmdb cannot store a {type(item).__name__}: samples may hold "
                        "tensors, numpy arrays, numbers, strings and bytes (e.g. PNG data).")


def encode(sample) -> bytes:
    is_tuple = isinstance(sample, (tuple, list))
    header, chunks = [], []
    for item in (sample if is_tuple else (sample,)):
        _encode_item(item, header, chunks)
    head = json.dumps({"tuple": is_tuple, "items": header,
                       "sizes": [len(c) for c in chunks]}).encode()
    return struct.pack("<I", len(head)) + head + b"".join(chunks)


def decode(blob: bytes):
    (head_len,) = struct.unpack_from("<I", blob)
    head = json.loads(bytes(blob[4:4 + head_len]))
    offset, items = 4 + head_len, []
    for spec, size in zip(head["items"], head["sizes"]):
        raw = blob[offset:offset + size]
        offset += size
        kind = spec[0]
        if kind in ("t", "n"):   # copy: LMDB's buffer is read-only and gone after the txn
            array = np.frombuffer(raw, dtype=np.dtype(spec[1])).reshape(spec[2]).copy()
            items.append(torch.from_numpy(array) if kind == "t" else array)
        elif kind == "b":
            items.append(bytes(raw))
        else:
            items.append(spec[1])
    return tuple(items) if head["tuple"] else items[0]


# -- writing --------------------------------------------------------------------------------
def pack_lmdb(dataset, path, *, progress: bool = True, commit_every: int = 1000) -> str:
    """Write every sample of a map-style `dataset` into the LMDB database at `path`.

    >>> nt.data.pack_lmdb(png_files_dataset, "digits.lmdb")
    >>> ds = nt.data.LMDBDataset("digits.lmdb", transform=decode_png)
    """
    import lmdb
    from tqdm.auto import tqdm
    path = Path(path)
    n = len(dataset)
    if n == 0:
        raise ValueError("pack_lmdb got an empty dataset: nothing to write.")
    map_size = max(len(encode(dataset[0])) * n * 2, 1 << 24)   # doubled below if too small
    env = lmdb.open(str(path), map_size=map_size, subdir=True, meminit=False)
    bar = tqdm(total=n, desc=f"packing {path.name}", disable=not progress, unit="sample")
    try:
        for start in range(0, n, commit_every):
            chunk = [(_key(i), encode(dataset[i])) for i in range(start, min(start + commit_every, n))]
            _write(env, chunk)
            bar.update(len(chunk))
        _write(env, [(META_KEY, json.dumps({"format": FORMAT, "length": n}).encode())])
        env.sync()
    finally:
        bar.close()
        env.close()
    return str(path)


def _key(i: int) -> bytes:
    return b"%010d" % i


def _write(env, items) -> None:
    """Write `items` in one transaction, doubling the map when LMDB says it is full."""
    import lmdb
    while True:
        try:
            with env.begin(write=True) as txn:
                for key, value in items:
                    txn.put(key, value)
            return
        except lmdb.MapFullError:   # the transaction was aborted: grow and write it again
            env.set_mapsize(env.info()["map_size"] * 2)


# -- reading --------------------------------------------------------------------------------
# One environment per path and process: py-lmdb refuses a second open of the same path,
# and an environment must not be used after fork() (LMDB docs), so a worker opens its own.
_ENVS = {}


def _environment(path: str):
    entry = _ENVS.get(path)
    if entry is not None and entry[0] == os.getpid():
        return entry[1]
    if entry is not None:   # inherited through fork: close the child's copy, then reopen
        entry[1].close()
    env = _open(path)
    _ENVS[path] = (os.getpid(), env)
    return env


def _open(path: str):
    import lmdb
    if not Path(path).exists():
        raise FileNotFoundError(f"no LMDB database at {path}: write one with "
                                "nt.data.pack_lmdb(dataset, path) first.")
    try:
        return lmdb.open(path, readonly=True, lock=False, readahead=False, meminit=False,
                         subdir=os.path.isdir(path))
    except lmdb.Error as exc:
        raise ValueError(f"{path} is not a readable LMDB database: {exc}") from exc


class LMDBDataset(Dataset):
    """Map-style dataset over a database written by `pack_lmdb`.

    The LMDB environment opens lazily in each process that reads (read-only, no lock),
    so the dataset can be sent to fork, spawn and forkserver workers alike.
    """

    def __init__(self, path, transform: Optional[Callable] = None):
        self.path = os.path.abspath(os.fspath(path))
        self.transform = transform
        self.length = self._read_meta()["length"]

    def _environment(self):
        return _environment(self.path)

    def _read_meta(self) -> dict:
        with self._environment().begin(buffers=False) as txn:
            raw = txn.get(META_KEY)
        if raw is None:
            raise ValueError(f"{self.path} is an LMDB database but not one written by "
                             "nt.data.pack_lmdb (no __nbtrain__ record).")
        meta = json.loads(raw)
        if meta.get("format") != FORMAT:
            raise ValueError(f"{self.path} was written in format {meta.get('format')}; "
                             f"this nbtrain reads format {FORMAT}.")
        return meta

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        with self._environment().begin(buffers=True) as txn:
            blob = txn.get(_key(index))
            if blob is None:
                raise ValueError(f"{self.path} has no sample {index}: the database is "
                                 "incomplete; pack it again.")
            sample = decode(blob)
        return self.transform(sample) if self.transform else sample
