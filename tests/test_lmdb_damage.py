"""LMDB data that is damaged (#29): detected, named, and never a dead process or wrong
samples. Random damage to a packed database, each copy read whole in a separate process;
the checksum, format 1 databases, the walk in a throwaway process and its cached verdict."""
import json
import os
import pickle
import signal
import subprocess
import sys
import warnings

import lmdb
import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from nbtrain.data import lmdb as nlmdb
from nbtrain.data.errors import CorruptRecordError
from nbtrain.data.lmdb import LMDBDataset, encode, pack_lmdb
from nbtrain.data.datasets import digits

SEED = 29
COPIES = {"flip": 60, "truncate": 30, "zero": 30}   # 120 damaged copies, as in the issue


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Verdicts cached under the test's folder, never in ~/.cache (reader processes inherit it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


class Marked(torch.utils.data.Dataset):
    """Samples whose bytes can be found in data.mdb: the marker says which sample it is."""

    def __len__(self):
        return 30

    def __getitem__(self, i):
        return (f"marker-{i:04d}".encode() * 3, torch.full((2, 3), float(i)),
                np.arange(i % 4, dtype=np.int16), i, i / 2, f"s{i}")


def assert_same(got, want):
    assert got[0] == want[0] and torch.equal(got[1], want[1]) and got[1].dtype == want[1].dtype
    assert np.array_equal(got[2], want[2]) and got[2].dtype == want[2].dtype
    assert got[3:] == want[3:]


def data_mdb(path) -> str:
    return os.path.join(path, "data.mdb")


# -- random damage, each copy read whole in another process ---------------------------------
def damage(data: bytearray, kind: str, rng) -> str:
    """Damage `data` in place; returns what was done, for the failure message."""
    if kind == "flip":   # 1 to 32 bytes, each XORed with a non-zero byte
        offsets = rng.choice(len(data), size=int(rng.integers(1, 33)), replace=False)
        for offset in offsets:
            data[offset] ^= int(rng.integers(1, 256))
        return f"{len(offsets)} bytes flipped at {sorted(offsets.tolist())}"
    if kind == "truncate":
        size = int(rng.integers(0, len(data)))
        del data[size:]
        return f"truncated to {size} bytes"
    start, length = int(rng.integers(0, len(data))), int(rng.integers(1, 4097))
    data[start:start + length] = bytes(len(data[start:start + length]))
    return f"{length} bytes zeroed from {start}"


def damaged_copies(packed: str, folder) -> dict:
    """{path of a damaged copy: what was done to it}, from a fixed seed."""
    rng, clean = np.random.default_rng(SEED), open(data_mdb(packed), "rb").read()
    copies = {}
    for kind, count in COPIES.items():
        for k in range(count):
            path = folder / f"{kind}-{k:03d}.lmdb"
            path.mkdir()
            data = bytearray(clean)
            copies[str(path)] = f"{kind}: {damage(data, kind, rng)}"
            (path / "data.mdb").write_bytes(bytes(data))
    return copies


READER = r"""
import json, sys, warnings
import torch
from nbtrain.data.errors import CorruptRecordError
from nbtrain.data.lmdb import LMDBDataset

x, y = torch.load(sys.argv[1])
for path in sys.argv[2:]:
    print(json.dumps({"start": path}), flush=True)
    try:
        ds = LMDBDataset(path)
        got = [ds[i] for i in range(len(ds))]
        same = len(got) == len(x) and all(torch.equal(a, x[i]) and torch.equal(b, y[i])
                                          for i, (a, b) in enumerate(got))
        outcome = "same" if same else "differs"
    except CorruptRecordError as exc:
        outcome = "corrupt: " + str(exc)
    except BaseException as exc:
        outcome = f"other: {type(exc).__name__}: {exc}"
    print(json.dumps({"path": path, "outcome": outcome}), flush=True)
"""


def read_in_processes(expected: str, paths: list, processes: int = 2) -> tuple:
    """Every copy read whole, the copies shared among `processes` reader processes (the
    machine's 2 cores): ({path: outcome}, [(exit status, the copy it was reading), ...])."""
    readers = [subprocess.Popen([sys.executable, "-c", READER, expected, *paths[k::processes]],
                                stdout=subprocess.PIPE, text=True) for k in range(processes)]
    outcomes, deaths = {}, []
    for reader in readers:
        out, _ = reader.communicate(timeout=300)
        reading = None
        for line in map(json.loads, out.splitlines()):
            if "start" in line:
                reading = line["start"]
            else:
                outcomes[line["path"]], reading = line["outcome"], None
        if reader.returncode != 0:
            deaths.append((reader.returncode, reading))
    return outcomes, deaths


def test_random_damage_is_named_never_wrong_data_nor_a_dead_process(tmp_path):
    x, y = digits("all")
    x, y = x[:200], y[:200]
    packed = pack_lmdb(TensorDataset(x, y), tmp_path / "digits.lmdb", progress=False)
    torch.save((x, y), tmp_path / "expected.pt")
    copies = damaged_copies(packed, tmp_path)
    outcomes, deaths = read_in_processes(str(tmp_path / "expected.pt"), list(copies))

    assert not deaths, [(status, path, copies.get(path)) for status, path in deaths]
    assert set(outcomes) == set(copies)
    wrong = {p: copies[p] for p, o in outcomes.items() if o == "differs"}
    assert not wrong, f"read without error, but not the samples packed: {wrong}"
    other = {p: (copies[p], o) for p, o in outcomes.items() if o.startswith("other")}
    assert not other, f"raised something other than CorruptRecordError: {other}"
    corrupt = {p: o for p, o in outcomes.items() if o.startswith("corrupt")}
    for path, outcome in corrupt.items():
        assert path in outcome and "pack it again" in outcome, outcome
    assert len(corrupt) >= len(copies) // 4   # the damage did reach the data


# -- the checksum ---------------------------------------------------------------------------
def test_a_clean_database_reads_the_samples_packed(tmp_path):
    path = pack_lmdb(Marked(), tmp_path / "marked.lmdb", progress=False, commit_every=7)
    ds = LMDBDataset(path)
    assert (len(ds), ds.format) == (30, 2)
    for i in range(30):
        assert_same(ds[i], Marked()[i])
    with ds._environment().begin() as txn:
        stored = txn.get(b"0000000003")   # the sample's bytes, behind their checksum
    assert stored[4:] == encode(Marked()[3]) and nlmdb.unframe(b"0000000003", stored)


def flip_a_byte_of(path: str, marker: bytes, keep_version: bool) -> None:
    """Flip one byte in the stored bytes of the sample holding `marker`; with
    `keep_version` the file keeps its size and modification time, as if damaged in place."""
    file, before = data_mdb(path), os.stat(data_mdb(path))
    data = bytearray(open(file, "rb").read())
    data[data.index(marker) + 2] ^= 0x01
    open(file, "wb").write(bytes(data))
    if keep_version:
        os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_the_checksum_catches_a_flipped_byte_in_a_value(tmp_path):
    path = pack_lmdb(Marked(), tmp_path / "marked.lmdb", progress=False)
    ds = LMDBDataset(path)
    flip_a_byte_of(path, b"marker-0007", keep_version=True)   # after the walk: the read sees it
    with pytest.raises(CorruptRecordError, match=f"{path}: sample 7 is damaged: its checksum "
                                                 "does not match its bytes.*pack it again"):
        ds[7]
    assert_same(ds[8], Marked()[8])   # the others still read
    flip_a_byte_of(path, b"marker-0011", keep_version=False)   # a new version: walked again
    with pytest.raises(CorruptRecordError, match=f"{path}: sample 7 is damaged"):
        LMDBDataset(path)


def test_a_wrong_value_served_under_another_key_fails_its_checksum(tmp_path):
    path = pack_lmdb(Marked(), tmp_path / "marked.lmdb", progress=False)
    with lmdb.open(path) as env, env.begin(write=True) as txn:
        txn.put(b"0000000004", txn.get(b"0000000005"))   # a whole, valid value: sample 5's
    with pytest.raises(CorruptRecordError, match="sample 4 is damaged"):
        LMDBDataset(path)


# -- what the walk finds --------------------------------------------------------------------
def test_a_missing_sample_a_wrong_count_and_a_damaged_meta_record_are_named(tmp_path):
    def packed(name):
        return pack_lmdb(Marked(), tmp_path / name, progress=False)

    def rewrite(path, change):
        with lmdb.open(path) as env, env.begin(write=True) as txn:
            change(txn)

    gap, short, meta, no_meta = packed("gap"), packed("short"), packed("meta"), packed("no_meta")
    rewrite(gap, lambda txn: txn.delete(b"0000000005"))
    rewrite(short, lambda txn: txn.delete(b"0000000029"))
    rewrite(meta, lambda txn: txn.put(b"__nbtrain__",
                                      txn.get(b"__nbtrain__").replace(b"30", b"31")))
    rewrite(no_meta, lambda txn: txn.delete(b"__nbtrain__"))
    for path, message in ((gap, "has no sample 5: the key b'0000000006' stands where"),
                          (short, "holds 29 samples, but its __nbtrain__ record says 30"),
                          (meta, r"its __nbtrain__ record \(format and sample count\) is damaged"),
                          (no_meta, "has no __nbtrain__ record, which nt.data.pack_lmdb writes")):
        with pytest.raises(CorruptRecordError, match=f"{path}.*{message}.*pack it again"):
            LMDBDataset(path)


def test_a_crash_in_the_walk_is_reported_as_corrupt(tmp_path, monkeypatch):
    path = pack_lmdb(Marked(), tmp_path / "marked.lmdb", progress=False)
    monkeypatch.setattr(nlmdb, "_walk_command", lambda p: [
        sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGBUS)"])
    with pytest.raises(CorruptRecordError, match=f"{path} crashes the process that reads it "
                                                 r"\(SIGBUS\): pack it again"):
        LMDBDataset(path)


@pytest.mark.skipif(sys.platform != "linux", reason="SIGBUS past the end of a mapped file")
def test_a_file_that_kills_its_reader_is_named_and_this_process_lives(tmp_path):
    path = pack_lmdb(Marked(), tmp_path / "marked.lmdb", progress=False)
    os.truncate(data_mdb(path), 2 * 4096)   # the meta pages only: the tree lies past the end
    plain_read = ("import lmdb, sys\nenv = lmdb.open(sys.argv[1], readonly=True, lock=False)\n"
                  "with env.begin() as txn:\n    [bytes(v) for k, v in txn.cursor()]")
    plain = subprocess.run([sys.executable, "-c", plain_read, path], capture_output=True)
    assert plain.returncode == -signal.SIGBUS   # what a notebook reading it would die of
    with pytest.raises(CorruptRecordError, match=f"{path} crashes the process that reads it "
                                                 r"\(SIGBUS\): pack it again"):
        LMDBDataset(path)


def test_the_verdict_is_cached_per_version_and_travels_with_the_dataset(tmp_path, monkeypatch):
    path = pack_lmdb(Marked(), tmp_path / "marked.lmdb", progress=False)
    walks = []
    real_walk = nlmdb.walk_in_subprocess
    monkeypatch.setattr(nlmdb, "walk_in_subprocess", lambda p: walks.append(p) or real_walk(p))
    ds = LMDBDataset(path)
    LMDBDataset(path)                       # cached in this process
    nlmdb._VERDICTS.clear()
    LMDBDataset(path)                       # cached in the cache folder
    assert walks == [path]
    shipped = pickle.loads(pickle.dumps(ds))   # what a spawn worker gets: no walk there
    assert_same(shipped[3], Marked()[3]) and walks == [path]

    later = os.stat(data_mdb(path)).st_mtime_ns + 10**9
    os.utime(data_mdb(path), ns=(later, later))   # a new version of the file
    nlmdb._ENVS.pop(path)[2].close()   # as in a worker process, which opens its own
    with pytest.raises(RuntimeError, match=f"{path} changed after this LMDBDataset checked it"):
        shipped[3]                     # not mapped unchecked
    LMDBDataset(path)
    assert walks == [path, path]


def test_a_failing_lmdb_read_is_named(tmp_path, monkeypatch):
    path = pack_lmdb(Marked(), tmp_path / "marked.lmdb", progress=False)
    ds = LMDBDataset(path)

    class Damaged:
        def begin(self, **kwargs):
            raise lmdb.PageNotFoundError("mdb_get: MDB_PAGE_NOTFOUND: Requested page not found")
    monkeypatch.setattr(ds, "_environment", lambda: Damaged())
    with pytest.raises(CorruptRecordError, match=f"{path}: sample 2 cannot be read "
                                                 r"\(PageNotFoundError.*pack it again"):
        ds[2]


# -- databases packed before the checksums --------------------------------------------------
def pack_format1(samples, path) -> str:
    """A database as nbtrain wrote it before #29: values as encoded, no checksums."""
    with lmdb.open(str(path), map_size=1 << 24) as env, env.begin(write=True) as txn:
        for i, value in enumerate(samples):
            txn.put(b"%010d" % i, value)
        txn.put(b"__nbtrain__", json.dumps({"format": 1, "length": len(samples)}).encode())
    return str(path)


def test_a_format1_database_still_reads_and_warns_once(tmp_path):
    path = pack_format1([encode(Marked()[i]) for i in range(30)], tmp_path / "old.lmdb")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = LMDBDataset(path)
        LMDBDataset(path)
    assert [str(w.message) for w in caught] == [
        f"{path} was packed by an earlier nbtrain (format 1), without checksums: a damaged "
        "sample in it may read as wrong data and cannot be detected. To have every read "
        "checked, pack it again with nt.data.pack_lmdb."]
    assert ds.format == 1
    for i in range(30):
        assert_same(ds[i], Marked()[i])


def test_a_format1_sample_that_does_not_decode_is_named(tmp_path):
    values = [encode(Marked()[i]) for i in range(5)]
    values[3] = values[3][:6] + b"\xff" + values[3][7:]   # inside the JSON header: not UTF-8
    path = pack_format1(values, tmp_path / "old.lmdb")
    with pytest.warns(UserWarning, match="format 1"):
        ds = LMDBDataset(path)
    with pytest.raises(CorruptRecordError, match=f"{path}: sample 3 cannot be decoded "
                                                 r"\(UnicodeDecodeError.*pack it again"):
        ds[3]


def test_packing_again_in_the_same_process_replaces_the_database(tmp_path):
    path = pack_lmdb(Marked(), tmp_path / "marked.lmdb", progress=False)
    before = LMDBDataset(path)
    assert_same(before[20], Marked()[20])   # its environment is open in this process
    pack_lmdb(TensorDataset(torch.arange(10.0)), path, progress=False)   # fewer samples
    after = LMDBDataset(path)
    assert len(after) == 10 and [after[i][0].item() for i in range(10)] == list(range(10))
    later = before.version[1] + 10**9   # the clock may not have moved on: make sure it did
    os.utime(data_mdb(path), ns=(later, later))
    with pytest.raises(RuntimeError, match="changed after this LMDBDataset checked it"):
        before[0]
