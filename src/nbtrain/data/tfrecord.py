"""Read TFRecord files (TensorFlow's packed format) without TensorFlow, and write them.

A TFRecord file is a sequence of records, each framed as

    uint64 length | uint32 masked_crc32c(length) | data[length] | uint32 masked_crc32c(data)

(https://www.tensorflow.org/tutorials/load_data/tfrecord#tfrecords_format_details), where
`data` is usually a serialized `tf.train.Example`: a map from feature names to a list of
int64s, floats or byte strings. The format has no index, so random access, which shuffling,
resume and worker processes need, comes from an index of record offsets that
`TFRecordDataset` builds on first use and caches.

Both checksums of a record are verified on every read: a damaged record raises
`CorruptRecordError` naming the file, the byte offset and the record number, never
returns wrong data.
"""
from __future__ import annotations

import bisect
import functools
import glob
import gzip
import hashlib
import os
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from .errors import CorruptRecordError

INDEX_FORMAT = 1
INDEX_SUFFIX = ".nbtrain-index"
HEADER = 12   # uint64 length + uint32 masked CRC of the length
FOOTER = 4    # uint32 masked CRC of the data
KINDS = {"int": "int64_list", "int64": "int64_list", "float": "float_list",
         "bytes": "bytes_list", "byte": "bytes_list"}


@functools.lru_cache(maxsize=None)
def protos():
    """tf.train.Example's message classes, from the tfrecord package (no TensorFlow):
    imported once, on first use, since an import in the per-sample path costs microseconds."""
    from tfrecord import example_pb2
    return example_pb2


# -- framing --------------------------------------------------------------------------------
def masked_crc(data) -> int:
    """TFRecord's masked CRC32C: a CRC of data that holds CRCs is itself a weak check, so
    TensorFlow rotates it and adds a constant (tensorflow/core/lib/hash/crc32c.h)."""
    import crc32c
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc(length)) + data
            + struct.pack("<I", masked_crc(data)))


# -- writing --------------------------------------------------------------------------------
def _feature(item):
    pb = protos()
    if isinstance(item, (bytes, bytearray, memoryview)):
        return pb.Feature(bytes_list=pb.BytesList(value=[bytes(item)]))
    if isinstance(item, str):
        return pb.Feature(bytes_list=pb.BytesList(value=[item.encode()]))
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu()
        item = (item.float() if item.dtype == torch.bfloat16 else item).numpy()
    array = np.asarray(item)
    if array.dtype.kind in "biu":
        return pb.Feature(int64_list=pb.Int64List(value=array.reshape(-1).astype(np.int64)))
    if array.dtype.kind == "f":   # TFRecord's float list holds float32: float64 is rounded
        return pb.Feature(float_list=pb.FloatList(value=array.reshape(-1).astype(np.float32)))
    raise TypeError(f"pack_tfrecord cannot store a {type(item).__name__} "
                    f"(dtype {array.dtype}): samples may hold tensors, numpy arrays, numbers, "
                    "strings and bytes (e.g. PNG data).")


def encode_example(sample, names=None) -> bytes:
    """One sample (a dict, a tuple or a single item) as a serialized tf.train.Example."""
    pb = protos()
    if isinstance(sample, Mapping):   # a dict, or a tokenizer's BatchEncoding
        items = {str(k): v for k, v in sample.items()}
    else:
        values = tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)
        keys = list(names) if names is not None else [str(i) for i in range(len(values))]
        if len(keys) != len(values):
            raise ValueError(f"pack_tfrecord got names={tuple(keys)} for samples of "
                             f"{len(values)} items: give one name per item.")
        items = dict(zip(keys, values))
    features = {name: _feature(value) for name, value in items.items()}
    return pb.Example(features=pb.Features(feature=features)).SerializeToString()


def shard_paths(path, shards: int) -> List[str]:
    """TensorFlow's naming for a sharded file: data.tfrecord-00000-of-00004."""
    path = os.fspath(path)
    if shards == 1:
        return [path]
    return [f"{path}-{i:05d}-of-{shards:05d}" for i in range(shards)]


def pack_tfrecord(dataset, path, *, shards: int = 1, compression: Optional[str] = None,
                  names=None, progress: bool = True) -> List[str]:
    """Write every sample of a map-style `dataset` as tf.train.Examples into TFRecord
    file(s); returns their paths. Samples are dicts (keys name the features) or tuples
    (features "0", "1", ... unless `names` are given). Integers become int64 lists, floats
    float32 lists, strings and bytes byte lists; shapes are not stored, so the reader says
    them in `features`. Shards hold consecutive samples, so reading them in order gives
    the dataset's order; `compression="gzip"` as TensorFlow writes it
    (TFRecordOptions(compression_type="GZIP")).

    >>> paths = nt.data.pack_tfrecord(png_dataset, "digits.tfrecord", shards=4,
    ...                               names=("png", "label"))
    >>> ds = nt.data.TFRecordDataset(paths, features={"png": "bytes", "label": ("int", ())})
    """
    from tqdm.auto import tqdm
    if compression not in (None, "gzip"):
        raise ValueError(f"pack_tfrecord got compression={compression!r}: use None or 'gzip'.")
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"pack_tfrecord got shards={shards!r}: give a whole number >= 1.")
    n = len(dataset)
    if n == 0:
        raise ValueError("pack_tfrecord got an empty dataset: nothing to write.")
    paths = shard_paths(path, shards)
    opener = gzip.open if compression == "gzip" else open
    bar = tqdm(total=n, desc=f"packing {Path(path).name}", disable=not progress, unit="sample")
    try:
        for k, shard in enumerate(paths):   # contiguous: the shards in order are the dataset
            with opener(shard, "wb") as f:
                for i in range(k * n // shards, (k + 1) * n // shards):
                    f.write(frame(encode_example(dataset[i], names)))
                    bar.update()
    finally:
        bar.close()
    return paths


# -- finding and indexing the files ---------------------------------------------------------
def expand_paths(paths) -> List[str]:
    """A file, a glob pattern or a list of either, as sorted absolute paths."""
    given = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    found = []
    for p in map(os.fspath, given):
        matches = sorted(glob.glob(p)) if glob.has_magic(p) else [p]
        if not matches:
            raise FileNotFoundError(f"no TFRecord files match {p!r}: check the pattern, or "
                                    "write some with nt.data.pack_tfrecord(dataset, path).")
        found += matches
    if not found:
        raise ValueError("TFRecordDataset got an empty list of paths.")
    for p in found:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"no TFRecord file at {p}: write one with "
                                    "nt.data.pack_tfrecord(dataset, path) first.")
    return [os.path.abspath(p) for p in found]


def is_gzip(path: str, compression: Optional[str]) -> bool:
    if compression == "auto":   # by name: a plain file can start with gzip's magic bytes
        return path.endswith((".gz", ".gzip"))
    if compression not in (None, "gzip"):
        raise ValueError(f"TFRecordDataset got compression={compression!r}: use 'auto' "
                         "(gzip when the name ends in .gz), None or 'gzip'.")
    return compression == "gzip"


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nbtrain", "tfrecord")


def stamp(path: str) -> np.ndarray:
    """What says a file changed: its size and modification time (ns)."""
    st = os.stat(path)
    return np.array([INDEX_FORMAT, st.st_size, st.st_mtime_ns], dtype=np.int64)


def cached_name(path: str, suffix: str) -> str:
    """A file name in the cache folder unique to `path`."""
    digest = hashlib.sha1(path.encode()).hexdigest()[:16]
    return f"{Path(path).name}-{digest}{suffix}"


class Shard(NamedTuple):
    source: str      # the file given
    readable: str    # the file records are read from: the source, or its decompressed copy
    index: str       # where its index is cached
    count: int
    version: tuple   # the source's stamp when indexed: a rewritten file gets a new descriptor


def index_location(path: str, gz: bool, cache_dir: str) -> tuple:
    """(the file to read records from, the index file): beside the data when that folder
    is writable; a gzip file is decompressed into the cache folder (see _decompress)."""
    if gz:
        readable = os.path.join(cache_dir, cached_name(path, ".tfrecord"))
        return readable, readable + INDEX_SUFFIX
    beside = path + INDEX_SUFFIX
    if os.access(os.path.dirname(path), os.W_OK) or os.path.exists(beside):
        return path, beside
    return path, os.path.join(cache_dir, cached_name(path, INDEX_SUFFIX))


def load_index(index_path: str, source: str) -> Optional[np.ndarray]:
    """The cached (offset, length) rows for `source`, or None when missing or stale."""
    try:
        with np.load(index_path, allow_pickle=False) as saved:
            if np.array_equal(saved["stamp"], stamp(source)):
                return saved["records"]
    except (OSError, ValueError, KeyError, EOFError):   # missing, partial or foreign: rebuild
        pass
    return None


def save_index(index_path: str, source: str, records: np.ndarray) -> str:
    """Write atomically (rename), so workers and other notebooks never read half a file;
    falls back to the cache folder when the place beside the data is not writable."""
    os.makedirs(os.path.dirname(index_path), exist_ok=True)
    tmp = f"{index_path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, stamp=stamp(source), records=records)
    os.replace(tmp, index_path)
    return index_path


def scan(path: str, shown: str) -> np.ndarray:
    """(offset, length) of every record in `path`, reading only the 12-byte headers and
    checking each length's CRC; the data's CRC is checked when a record is read."""
    rows, offset, size = [], 0, os.path.getsize(path)
    with open(path, "rb") as f:
        while offset < size:
            header = f.read(HEADER)
            length = check_header(header, shown, offset, len(rows), size)
            rows.append((offset, length))
            offset += HEADER + length + FOOTER
            f.seek(offset)
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


def check_header(header: bytes, shown: str, offset: int, number: int, size: int) -> int:
    """The record's length, once its CRC and the file's size agree with it."""
    where = f"{shown}: record {number} at byte offset {offset}"
    if len(header) < HEADER:
        raise CorruptRecordError(f"{where} is cut short ({len(header)} of {HEADER} header "
                                 "bytes): the file is truncated; write it again.")
    (length,), (crc,) = struct.unpack_from("<Q", header), struct.unpack_from("<I", header, 8)
    if masked_crc(header[:8]) != crc:
        raise CorruptRecordError(f"{where} is corrupt: the CRC of its length does not match. "
                                 "The file is damaged, or not a TFRecord file (a gzip file? "
                                 "pass compression='gzip').")
    if offset + HEADER + length + FOOTER > size:
        raise CorruptRecordError(f"{where} is cut short: it needs {length} data bytes, the "
                                 "file ends first. The file is truncated; write it again.")
    return length


def _decompress(source: str, target: str) -> None:
    """A gzip stream cannot seek: random access into it would decompress from the start on
    every read. One decompressed copy in the cache folder turns each read into a pread."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.{os.getpid()}.tmp"
    with gzip.open(source, "rb") as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(tmp, target)


def index_file(path: str, gz: bool, cache_dir: str) -> tuple:
    """(Shard, records) for one file: the cached index when it is current, else a new one."""
    readable, index_path = index_location(path, gz, cache_dir)
    records = load_index(index_path, path)
    if records is None or (gz and not os.path.exists(readable)):
        if gz:
            _decompress(path, readable)
        records = scan(readable, path)
        try:
            save_index(index_path, path, records)
        except OSError:   # beside the data was not writable after all
            index_path = save_index(os.path.join(cache_dir, cached_name(path, INDEX_SUFFIX)),
                                    path, records)
    return Shard(path, readable, index_path, len(records), tuple(stamp(path).tolist())), records


# -- reading --------------------------------------------------------------------------------
# One file descriptor per file version and process, opened on first read: a descriptor
# inherited through fork() would work with pread (no shared file position), but a child
# forgets its parent's and opens its own, so that none depends on what its parent had
# open; a file written again is opened again, never read through the old file's descriptor.
_FILES = {}
os.register_at_fork(after_in_child=_FILES.clear)


def _descriptor(shard: Shard) -> int:
    key = (shard.readable, shard.version)
    fd = _FILES.get(key)
    if fd is None:
        fd = _FILES[key] = os.open(shard.readable, os.O_RDONLY)
    return fd


def read_record(shard: Shard, offset: int, length: int, number: int) -> bytes:
    """The data of one record, after checking both of its CRCs."""
    blob = os.pread(_descriptor(shard), HEADER + length + FOOTER, offset)
    end = offset + len(blob)
    if check_header(blob[:HEADER], shard.source, offset, number, end) != length:
        raise CorruptRecordError(f"{shard.source}: record {number} at byte offset {offset} "
                                 "does not match its index: the file changed while in use.")
    data = memoryview(blob)[HEADER:HEADER + length]
    (crc,) = struct.unpack_from("<I", blob, HEADER + length)
    if masked_crc(data) != crc:
        raise CorruptRecordError(f"{shard.source}: record {number} at byte offset {offset} is "
                                 "corrupt: the CRC of its data does not match. The file is "
                                 "damaged; restore or write it again.")
    return data


# -- tf.train.Example -> tensors ------------------------------------------------------------
class Feature(NamedTuple):
    kind: str             # "int64_list", "float_list" or "bytes_list"
    shape: Optional[tuple]
    dtype: object         # a torch dtype, a numpy dtype, int/float/str, or None: the default


def parse_feature(name: str, spec) -> Feature:
    """ "int" | "float" | "bytes", or (kind, shape) or (kind, shape, dtype)."""
    parts = spec if isinstance(spec, tuple) else (spec,)
    if not 1 <= len(parts) <= 3 or parts[0] not in KINDS:
        raise ValueError(f"features[{name!r}] = {spec!r} is not understood: give 'int', "
                         "'float' or 'bytes', or (kind, shape) such as ('float', (1, 8, 8)), "
                         "or (kind, shape, dtype) such as ('int', (), int) or "
                         "('float', (3,), np.float32).")
    shape = parts[1] if len(parts) > 1 else None
    shape = (shape,) if isinstance(shape, int) else (tuple(shape) if shape is not None else None)
    dtype = parts[2] if len(parts) > 2 else None
    if dtype is not None and not isinstance(dtype, torch.dtype) and dtype not in (int, float, str):
        dtype = np.dtype(dtype)
    return Feature(KINDS[parts[0]], shape, dtype)


def convert(stored_list, feature: Feature):
    """A feature's Int64List, FloatList or BytesList as its spec asks: a tensor (the
    default), a numpy array, Python scalars, or bytes/str for byte lists."""
    values = stored_list.value
    if feature.kind == "bytes_list":
        items = [v.decode() for v in values] if feature.dtype is str else list(values)
        if feature.shape is None or feature.shape == ():
            if len(items) != 1:
                raise ValueError(f"holds {len(items)} byte strings, not 1: give the shape, "
                                 "e.g. ('bytes', (-1,)), to read a list")
            return items[0]
        return items
    if feature.shape == () and feature.dtype in (int, float) and len(values) == 1:
        return feature.dtype(values[0])   # a label: no array on the way
    array = np.array(values, dtype=np.int64 if feature.kind == "int64_list" else np.float32)
    if feature.shape is not None:
        try:
            array = array.reshape(feature.shape)
        except ValueError:
            raise ValueError(f"holds {array.size} values, which do not fit the shape "
                             f"{feature.shape}") from None
    if feature.dtype in (int, float):
        return array.item() if array.ndim == 0 else array.astype(feature.dtype).tolist()
    if isinstance(feature.dtype, np.dtype):
        return array.astype(feature.dtype)
    tensor = torch.from_numpy(array)
    return tensor.to(feature.dtype) if isinstance(feature.dtype, torch.dtype) else tensor


def decode_example(data, features: Optional[dict]):
    """The features of one serialized tf.train.Example: a tuple in the order of
    `features` (one feature: the value alone), or with features=None a dict of every
    feature as stored (1-D tensors, bytes)."""
    try:
        stored = protos().Example.FromString(bytes(data)).features.feature
    except Exception as exc:   # google.protobuf's DecodeError
        raise ValueError(f"is not a tf.train.Example ({exc})") from None
    if features is None:
        return {name: _as_stored(f) for name, f in stored.items()}
    out = []
    for name, feature in features.items():
        if name not in stored:
            raise ValueError(f"has no feature {name!r}; it has {sorted(stored)}")
        try:
            out.append(convert(_values(stored[name], feature.kind), feature))
        except ValueError as exc:
            raise ValueError(f"feature {name!r} {exc}") from None
    return tuple(out) if len(out) > 1 else out[0]


def _as_stored(stored):
    kind = stored.WhichOneof("kind") or "int64_list"
    shape = (-1,) if kind == "bytes_list" else None   # a list of byte strings
    return convert(_values(stored, kind), Feature(kind, shape, None))


def _values(stored, kind: str):
    found = stored.WhichOneof("kind")
    if found not in (None, kind):
        named = {"int64_list": "int", "float_list": "float", "bytes_list": "bytes"}
        raise ValueError(f"holds {named[found]} values, not {named[kind]}: say "
                         f"'{named[found]}' in features")
    return getattr(stored, kind)


class TFRecordDataset(Dataset):
    packed_format = "TFRecord"   # the diagnosis does not advise packing what is packed
    """Map-style dataset over TFRecord files of tf.train.Examples, read without TensorFlow.

    `paths`: a file, a glob pattern ("data/train-*.tfrecord") or a list of either; files
    named *.gz / *.gzip are read as gzip (or say `compression="gzip"`). `features` maps each
    feature to read to "int", "float" or "bytes", or (kind, shape[, dtype]): a sample is the
    tuple of them in that order, the value alone for one feature, or with features=None a
    dict of every feature as stored.

    >>> ds = nt.data.TFRecordDataset("digits-*.tfrecord", transform=decode_sample,
    ...                              features={"png": "bytes", "label": ("int", ())})
    >>> png, label = ds.example(0)   # before the transform

    The index of record offsets is built on first use (headers only) and saved beside each
    file as <file>.nbtrain-index, or in `cache_dir` when that folder is not writable; a
    file whose size or modification time changed is indexed again. A gzip file is
    decompressed once into `cache_dir` (default ~/.cache/nbtrain/tfrecord), so that a
    sample is one read at any position. Files open lazily in each process, so the dataset
    pickles small and works in fork, spawn and forkserver workers alike.
    """

    def __init__(self, paths, features: Optional[dict] = None,
                 transform: Optional[Callable] = None, *, compression: Optional[str] = "auto",
                 cache_dir=None):
        self.cache_dir = os.path.abspath(os.fspath(cache_dir or default_cache_dir()))
        self.features = (None if features is None else
                         {str(name): parse_feature(name, spec) for name, spec in features.items()})
        if self.features == {}:
            raise ValueError("TFRecordDataset got features={}: name at least one feature, "
                             "or pass features=None to read them all.")
        self.transform = transform
        self.compression = compression
        self.shards, self._records = [], []
        for path in expand_paths(paths):
            shard, records = index_file(path, is_gzip(path, compression), self.cache_dir)
            self.shards.append(shard)
            self._records.append(records)
        self.starts = [0]   # sample number of each shard's first record, and the total
        for shard in self.shards:
            self.starts.append(self.starts[-1] + shard.count)

    def __getstate__(self):
        # Workers get paths and counts only; each reloads the (possibly large) record
        # offsets from the index files, instead of receiving them pickled.
        state = dict(self.__dict__)
        state["_records"] = None
        return state

    def _records_of(self, k: int) -> np.ndarray:
        if self._records is None:
            self._records = [self._reload(shard) for shard in self.shards]
        return self._records[k]

    def _reload(self, shard: Shard) -> np.ndarray:
        records = load_index(shard.index, shard.source)
        if records is None or len(records) != shard.count:
            raise RuntimeError(f"{shard.source} changed after this TFRecordDataset indexed it "
                               f"({shard.count} records then): create the dataset again.")
        return records

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, index: int) -> tuple:
        """(shard number, record number in that shard) of sample `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        k = bisect.bisect_right(self.starts, index) - 1
        return k, index - self.starts[k]

    def raw_record(self, index: int):
        """The bytes of sample `index` (a serialized Example), checksums verified."""
        k, number = self.locate(index)
        offset, length = self._records_of(k)[number]
        return self.shards[k], number, read_record(self.shards[k], int(offset), int(length), number)

    def example(self, index: int):
        """Sample `index` decoded from its Example, before the transform."""
        shard, number, data = self.raw_record(index)
        try:
            return decode_example(data, self.features)
        except ValueError as exc:
            raise ValueError(f"{shard.source}: record {number}: {exc}") from None

    def __getitem__(self, index: int):
        sample = self.example(index)
        return self.transform(sample) if self.transform else sample
