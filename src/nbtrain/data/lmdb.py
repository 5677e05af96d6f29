"""Pack a dataset into one LMDB file and read it back: one memory-mapped file instead of
thousands of small ones, so loading costs a page lookup rather than an open() per sample.

Samples are stored in a small, pickle-free format (a JSON header + raw bytes), so reading
a database never runs code from it.

A damaged database is detected, never read as data, and never kills the process:

- every value, the __nbtrain__ record included, is stored behind the CRC-32 of its key
  and bytes (format 2), checked on every read;
- the first time a database is opened in a process (and again when its size or
  modification time changes), every key and every value is read once in a throwaway
  process. LMDB reads through a memory map: a damaged page can send a read past the end
  of the file, where it kills the reader with SIGBUS, or fail one of LMDB's assertions
  (SIGABRT); in a notebook with num_workers=0 the reader is the kernel. The verdict is
  cached for that version of the file, in the process and in a small file in the cache
  folder; workers get it with the dataset. The walk reads the file once at the disk's
  speed (bench/data_path.py times it).

Every failure is a CorruptRecordError naming the file and the sample. A database packed
before the checksums (format 1) still reads, with a warning that it cannot be checked.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import signal
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from .errors import CorruptRecordError

META_KEY = b"__nbtrain__"
FORMAT = 2             # 1: values as encoded, no checksums (nbtrain before #29)
CHECKSUM = "crc32"     # zlib.crc32(value, zlib.crc32(key)), 4 bytes little-endian first
VERDICT_FORMAT = 1     # of the cached "this version of the file was walked: sound" files
REPACK = "pack it again with nt.data.pack_lmdb"


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
    if offset != len(blob):   # the header's sizes must account for every byte, no more
        raise ValueError(f"its header accounts for {offset} bytes, it has {len(blob)}")
    return tuple(items) if head["tuple"] else items[0]


# -- checksums ------------------------------------------------------------------------------
# zlib's CRC-32, which every Python has (CRC-32C, as TFRecord uses, would need the crc32c
# package, which is not a dependency). It covers the key too: a damaged page that serves
# another sample's value under this key fails the check as well.
def checksum(key: bytes, payload) -> int:
    return zlib.crc32(payload, zlib.crc32(key))


def frame(key: bytes, payload: bytes) -> bytes:
    return struct.pack("<I", checksum(key, payload)) + payload


def unframe(key: bytes, value):
    """The payload behind `value`'s checksum, or None when the checksum does not match."""
    if len(value) < 4:
        return None
    payload = value[4:]
    return payload if checksum(key, payload) == struct.unpack_from("<I", value)[0] else None


# -- writing --------------------------------------------------------------------------------
def pack_lmdb(dataset, path, *, progress: bool = True, commit_every: int = 1000) -> str:
    """Write every sample of a map-style `dataset` into the LMDB database at `path`,
    replacing what it held; each sample is stored with a checksum of its bytes.

    >>> nt.data.pack_lmdb(png_files_dataset, "digits.lmdb")
    >>> ds = nt.data.LMDBDataset("digits.lmdb", transform=decode_png)
    """
    import lmdb
    from tqdm.auto import tqdm
    path = Path(path)
    n = len(dataset)
    if n == 0:
        raise ValueError("pack_lmdb got an empty dataset: nothing to write.")
    map_size = max((len(encode(dataset[0])) + 4) * n * 2, 1 << 24)   # doubled below if too small
    _forget(os.path.abspath(path))
    env = lmdb.open(str(path), map_size=map_size, subdir=True, meminit=False)
    bar = tqdm(total=n, desc=f"packing {path.name}", disable=not progress, unit="sample")
    try:
        _empty(env)   # samples left from an earlier, longer pack would read as damage
        for start in range(0, n, commit_every):
            chunk = [(_key(i), frame(_key(i), encode(dataset[i])))
                     for i in range(start, min(start + commit_every, n))]
            _write(env, chunk)
            bar.update(len(chunk))
        meta = json.dumps({"format": FORMAT, "length": n, "checksum": CHECKSUM}).encode()
        _write(env, [(META_KEY, frame(META_KEY, meta))])   # last: its presence says "complete"
        env.sync()
    finally:
        bar.close()
        env.close()
    return str(path)


def _key(i: int) -> bytes:
    return b"%010d" % i


def _empty(env) -> None:
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(), delete=False)


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


# -- the walk: every page read once, in a process that may die ------------------------------
def walk_database(path: str) -> dict:
    """What reading every key and every byte of every value of the database at `path`
    finds, as a dict:

    samples     keys other than __nbtrain__
    numbered    those of them shaped like a sample's key
    meta        the __nbtrain__ record (hex), or None
    stray       [position, key (hex)] of the first key out of sequence, or None
    bad         the first key (hex) whose value fails its checksum, or None
    error       [samples read before it (None: reading __nbtrain__), LMDB's error], or None
    unreadable  LMDB's error on opening the file, or None

    Runs in a throwaway process (see walk_in_subprocess), sent as source: it uses only
    the standard library, lmdb and the functions sent with it.
    """
    import lmdb
    facts = {"samples": 0, "numbered": 0, "meta": None, "stray": None, "bad": None,
             "error": None, "unreadable": None}
    try:   # readahead: this reader goes through the whole file, unlike a dataset's
        env = lmdb.open(path, readonly=True, lock=False, readahead=True, meminit=False,
                        subdir=os.path.isdir(path))
    except lmdb.Error as exc:
        facts["unreadable"] = f"{type(exc).__name__}: {exc}"
        return facts
    position = None
    try:
        with env.begin(buffers=True) as txn:
            meta = txn.get(META_KEY)
            checked = meta is not None and unframe(META_KEY, meta) is not None
            facts["meta"] = None if meta is None else bytes(meta).hex()
            position = 0
            for key, value in txn.cursor():
                key = bytes(key)
                if key == META_KEY:
                    continue
                if facts["stray"] is None and key != _key(position):
                    facts["stray"] = [position, key.hex()]
                facts["numbered"] += len(key) == 10 and key.isdigit()
                # the CRC reads every byte, so every page of the value is touched
                sound = unframe(key, value) is not None if checked else zlib.crc32(value) >= 0
                if not sound and facts["bad"] is None:
                    facts["bad"] = key.hex()
                facts["samples"] = position = position + 1
    except lmdb.Error as exc:
        facts["error"] = [position, f"{type(exc).__name__}: {exc}"]
    finally:
        env.close()
    return facts


def _walk_script() -> str:
    """walk_database as a script for `python -c`: sent as source, the child imports lmdb
    but not nbtrain, whose torch import would add a second or more to every check."""
    try:
        functions = [inspect.getsource(f) for f in (_key, checksum, unframe, walk_database)]
    except OSError:   # installed without source files: import it, torch and all
        functions = ["from nbtrain.data.lmdb import META_KEY, walk_database"]
    return "\n".join(["from __future__ import annotations", "import json, os, struct, sys, zlib",
                      f"META_KEY = {META_KEY!r}", *functions,
                      "print(json.dumps(walk_database(sys.argv[1])))"])


# Taken at import: inspect reads the file when asked, and a source file edited since the
# import (a git pull under a running kernel) would give lines that no longer match.
WALK_SCRIPT = _walk_script()


def _walk_command(path: str) -> list:
    return [sys.executable, "-c", WALK_SCRIPT, path]


def walk_in_subprocess(path: str) -> dict:
    """walk_database(path), run in a throwaway process: what it found, or a
    CorruptRecordError when reading the file killed that process."""
    done = subprocess.run(_walk_command(path), capture_output=True, text=True, errors="replace")
    if done.returncode < 0:
        raise CorruptRecordError(f"{path} crashes the process that reads it "
                                 f"({_signal_name(-done.returncode)}): {REPACK}. (A damaged "
                                 "page sends LMDB's reads past the end of the file, or fails "
                                 "one of its assertions; nbtrain read the file in a separate "
                                 "process, so that only that one died.)")
    if done.returncode != 0:   # the check itself failed: not a verdict on the file
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise RuntimeError(f"checking {path} in a separate process failed before it could "
                           f"read the database (exit {done.returncode}): {last}")
    return json.loads(done.stdout)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# -- the walk's findings -> a verdict -------------------------------------------------------
def judge(path: str, facts: dict) -> dict:
    """{"format", "length"} of a sound database, from what walk_database found in it;
    raises CorruptRecordError saying what is damaged otherwise."""
    if facts["unreadable"]:
        raise CorruptRecordError(f"{path} is not a readable LMDB database "
                                 f"({facts['unreadable']}): it is damaged, or not a "
                                 f"database; {REPACK}.")
    if facts["error"]:
        position, error = facts["error"]
        what = "its __nbtrain__ record" if position is None else f"sample {position}"
        raise CorruptRecordError(f"{path}: LMDB fails reading {what} ({error}): the database "
                                 f"is damaged; {REPACK}.")
    meta = read_meta(path, facts)
    if facts["stray"]:
        position, key = facts["stray"]
        raise CorruptRecordError(f"{path} has no sample {position}: the key "
                                 f"{bytes.fromhex(key)!r} stands where {_key(position)!r} "
                                 f"belongs; the database is damaged; {REPACK}.")
    if facts["bad"]:
        raise CorruptRecordError(f"{path}: {_describe(bytes.fromhex(facts['bad']))} is damaged: "
                                 f"its checksum does not match its bytes; {REPACK}.")
    if facts["samples"] != meta["length"]:
        raise CorruptRecordError(f"{path} holds {facts['samples']} samples, but its "
                                 f"__nbtrain__ record says {meta['length']}: the database is "
                                 f"damaged or incomplete; {REPACK}.")
    return {"format": meta["format"], "length": meta["length"]}


def _describe(key: bytes) -> str:
    return f"sample {int(key)}" if len(key) == 10 and key.isdigit() else f"the record {key!r}"


def read_meta(path: str, facts: dict) -> dict:
    """The __nbtrain__ record: {"format": 2, "length": n, ...} behind its checksum, or a
    plain {"format": 1, "length": n} written before checksums."""
    if facts["meta"] is None:
        if facts["numbered"] == 0:
            raise ValueError(f"{path} is an LMDB database but not one written by "
                             "nt.data.pack_lmdb (no __nbtrain__ record).")
        raise CorruptRecordError(f"{path} has no __nbtrain__ record, which nt.data.pack_lmdb "
                                 "writes last: the database is damaged, or packing stopped "
                                 f"before the end; {REPACK}.")
    raw = bytes.fromhex(facts["meta"])
    payload = unframe(META_KEY, raw)
    meta = _parsed(payload if payload is not None else raw)
    if payload is None and _is_format1(meta):
        return meta
    if payload is None or not _is_counted(meta) or meta["format"] < FORMAT:
        raise CorruptRecordError(f"{path}: its __nbtrain__ record (format and sample count) "
                                 f"is damaged: its checksum does not match; {REPACK}.")
    if meta["format"] > FORMAT:
        raise ValueError(f"{path} was written in format {meta['format']} by a newer nbtrain; "
                         f"this one reads formats 1 to {FORMAT}: upgrade nbtrain.")
    return meta


def _parsed(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:   # not JSON, or not UTF-8
        return None


def _is_counted(meta) -> bool:
    return (isinstance(meta, dict) and type(meta.get("format")) is int
            and type(meta.get("length")) is int and meta["length"] > 0)


def _is_format1(meta) -> bool:
    """Format 1's record is exactly {"format": 1, "length": n}: anything more (a checksum
    name) is a damaged format 2 record, which must not pass as unchecked format 1."""
    return _is_counted(meta) and meta["format"] == 1 and set(meta) == {"format", "length"}


# -- verdicts, cached per version of the file -----------------------------------------------
_VERDICTS = {}         # (path, size, mtime_ns) -> {"format", "length"}, sound ones only
_WARNED_UNCHECKED = set()


def data_file(path: str) -> str:
    return os.path.join(path, "data.mdb") if os.path.isdir(path) else path


def stamp(path: str) -> tuple:
    """What says the database changed: its data file's size and modification time (ns)."""
    try:
        st = os.stat(data_file(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"no LMDB database at {path}: write one with "
                                "nt.data.pack_lmdb(dataset, path) first.") from None
    return st.st_size, st.st_mtime_ns


def check_readable(path: str) -> None:
    """A file this process may not read would fail the walk like a damaged one: say so."""
    if not os.access(data_file(path), os.R_OK):
        raise PermissionError(f"{data_file(path)} is not readable by this process: give "
                              "it read permission (e.g. chmod a+r).")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nbtrain", "lmdb")


def verdict_file(cache_dir: str, path: str) -> str:
    digest = hashlib.sha1(path.encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"{Path(path).name}-{digest}.json")


def verified(path: str, version: tuple, cache_dir: str) -> dict:
    """{"format", "length"} of the database at `path` in this version (size, mtime): walked
    in a throwaway process the first time, then from the cache."""
    key = (path, *version)
    verdict = _VERDICTS.get(key) or load_verdict(verdict_file(cache_dir, path), path, version)
    if verdict is None:
        verdict = judge(path, walk_in_subprocess(path))
        save_verdict(verdict_file(cache_dir, path), path, version, verdict)
    _VERDICTS[key] = verdict
    return verdict


def load_verdict(file: str, path: str, version: tuple) -> Optional[dict]:
    try:
        with open(file) as f:
            saved = json.load(f)
        if saved["verdict_format"] == VERDICT_FORMAT and saved["path"] == path \
                and tuple(saved["version"]) == version:
            return {"format": int(saved["format"]), "length": int(saved["length"])}
    except (OSError, ValueError, KeyError, TypeError):   # missing, partial or foreign: walk
        pass
    return None


def save_verdict(file: str, path: str, version: tuple, verdict: dict) -> None:
    """Written atomically (rename); a cache only, so a folder that is not writable means
    the walk runs again in the next process, nothing worse."""
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        tmp = f"{file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"verdict_format": VERDICT_FORMAT, "path": path,
                       "version": list(version), **verdict}, f)
        os.replace(tmp, file)
    except OSError:
        pass


def warn_unchecked(path: str) -> None:
    if path in _WARNED_UNCHECKED:
        return
    _WARNED_UNCHECKED.add(path)
    warnings.warn(f"{path} was packed by an earlier nbtrain (format 1), without checksums: "
                  "a damaged sample in it may read as wrong data and cannot be detected. "
                  f"To have every read checked, {REPACK}.", stacklevel=3)


# -- reading --------------------------------------------------------------------------------
# One environment per path and process: py-lmdb refuses a second open of the same path,
# and an environment must not be used after fork() (LMDB docs), so a worker opens its own.
_ENVS = {}   # path -> (pid, version of the file it was opened on, environment)


def _environment(path: str, version: tuple):
    entry = _ENVS.get(path)
    if entry is not None and entry[:2] == (os.getpid(), version):
        return entry[2]
    if entry is not None:   # inherited through fork, or opened on another version: reopen
        _close_reader(path)
    if stamp(path) != version:   # only the version that was walked is safe to map
        raise RuntimeError(f"{path} changed after this LMDBDataset checked it: create the "
                           "dataset again (nt.data.LMDBDataset(path)).")
    env = _open(path)
    _ENVS[path] = (os.getpid(), version, env)
    return env


def _forget(path: str) -> None:
    """Before packing `path` again: close this process's reader on it (py-lmdb refuses to
    open a path twice) and drop its verdicts, since a new pack may leave the file's size,
    and within the clock's resolution its modification time, as they were."""
    _close_reader(path)
    for key in [key for key in _VERDICTS if key[0] == path]:
        del _VERDICTS[key]
    try:
        os.remove(verdict_file(default_cache_dir(), path))
    except OSError:   # none cached
        pass


def _close_reader(path: str) -> None:
    """Close this process's environment on `path`: a dataset still using it opens the
    file again on its next read, and finds it changed."""
    entry = _ENVS.pop(path, None)
    if entry is not None:
        entry[2].close()


def _open(path: str):
    import lmdb
    try:
        return lmdb.open(path, readonly=True, lock=False, readahead=False, meminit=False,
                         subdir=os.path.isdir(path))
    except lmdb.Error as exc:
        raise CorruptRecordError(f"{path} is not a readable LMDB database ({exc}): {REPACK}.") \
            from exc


class LMDBDataset(Dataset):
    packed_format = "LMDB"   # the diagnosis does not advise packing what is packed
    """Map-style dataset over a database written by `pack_lmdb`.

    Every read is checked against the sample's checksum; the first time a version of the
    database is opened, it is read once, whole, in a throwaway process (see the module's
    docstring), and the verdict is cached in the process and in `cache_dir` (default
    ~/.cache/nbtrain/lmdb). A damaged database raises CorruptRecordError naming the file
    and the sample.

    The LMDB environment opens lazily in each process that reads (read-only, no lock),
    so the dataset can be sent to fork, spawn and forkserver workers alike; the verdict
    travels with it, so workers do not check the file again.
    """

    def __init__(self, path, transform: Optional[Callable] = None, *, cache_dir=None):
        self.path = os.path.abspath(os.fspath(path))
        self.transform = transform
        self.version = stamp(self.path)
        check_readable(self.path)
        cache_dir = os.path.abspath(os.fspath(cache_dir or default_cache_dir()))
        verdict = verified(self.path, self.version, cache_dir)
        self.format, self.length = verdict["format"], verdict["length"]
        if self.format == 1:
            warn_unchecked(self.path)

    def _environment(self):
        return _environment(self.path, self.version)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        sample = self.read(index)
        return self.transform(sample) if self.transform else sample

    def read(self, index: int):
        """Sample `index` as it was packed, before the transform: the bytes checked, never
        wrong data; a damaged sample raises CorruptRecordError."""
        import lmdb
        key = _key(index)
        try:
            with self._environment().begin(buffers=True) as txn:
                value = txn.get(key)
                if value is None:
                    raise self._damaged(index, "is missing: the database is damaged or "
                                               "incomplete")
                return self._decoded(index, self._payload(index, key, value))
        except lmdb.Error as exc:
            raise self._damaged(index, f"cannot be read ({type(exc).__name__}: {exc}): the "
                                       "database is damaged") from exc

    def _payload(self, index: int, key: bytes, value):
        if self.format == 1:   # no checksum to check: warned about in __init__
            return value
        payload = unframe(key, value)
        if payload is None:
            raise self._damaged(index, "is damaged: its checksum does not match its bytes")
        return payload

    def _decoded(self, index: int, payload):
        try:
            return decode(payload)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, struct.error) as exc:
            raise self._damaged(index, f"cannot be decoded ({type(exc).__name__}: {exc}): "
                                       "the database is damaged") from None

    def _damaged(self, index: int, what: str) -> CorruptRecordError:
        return CorruptRecordError(f"{self.path}: sample {index} {what}; {REPACK}.")
