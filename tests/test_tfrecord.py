"""TFRecord: pack and read back, files from the `tfrecord` package, both CRCs checked, the
cached index, and training from TFRecord in worker processes (fork and spawn)."""
import os
import pickle

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.data import tfrecord as tfr
from nbtrain.data.tfrecord import CorruptRecordError, TFRecordDataset, pack_tfrecord

from conftest import mlp, quick


class Mixed(torch.utils.data.Dataset):
    def __len__(self):
        return 30

    def __getitem__(self, i):
        return (torch.full((2, 3), i / 4), np.arange(i % 4, dtype=np.int16), i, i / 2,
                bytes([i]) * 3, f"s{i}")


MIXED = {"0": ("float", (2, 3)), "1": ("int", (-1,), np.int16), "2": ("int", (), int),
         "3": ("float", (), float), "4": "bytes", "5": ("bytes", (), str)}


def assert_mixed_equal(got, want):
    assert torch.equal(got[0], want[0]) and got[0].dtype == torch.float32
    assert np.array_equal(got[1], want[1]) and got[1].dtype == np.int16
    assert got[2:] == want[2:] and type(got[2]) is int and type(got[5]) is str


@pytest.mark.parametrize("shards, compression", [(1, None), (4, None), (3, "gzip")])
def test_round_trip(tmp_path, shards, compression):
    paths = pack_tfrecord(Mixed(), tmp_path / "mixed.tfrecord", shards=shards,
                          compression=compression, progress=False)
    assert len(paths) == shards
    ds = nt.data.TFRecordDataset(str(tmp_path / "mixed.tfrecord*"), features=MIXED,
                                 compression=compression, cache_dir=tmp_path / "cache")
    assert len(ds) == 30
    for i in range(30):
        assert_mixed_equal(ds[i], Mixed()[i])
    scalar = TFRecordDataset(paths, features={"2": ("int", ())}, compression=compression,
                             cache_dir=tmp_path / "cache", transform=lambda n: n * 2)
    assert torch.equal(scalar[7], torch.tensor(14))


def test_mapping_samples_that_are_not_dicts_are_packed_by_key(tmp_path):
    from conftest import Encoding   # a tokenizer's BatchEncoding: a Mapping, not a dict
    samples = [Encoding(input_ids=torch.tensor([i, i + 1]), label=i % 2) for i in range(4)]
    paths = pack_tfrecord(samples, tmp_path / "enc.tfrecord", progress=False)
    ds = TFRecordDataset(paths, features={"input_ids": ("int", (2,)), "label": ("int", ())},
                         cache_dir=tmp_path / "cache")
    ids, label = ds[3]   # in the order of `features`
    assert torch.equal(ids, torch.tensor([3, 4])) and int(label) == 1


def test_gzip_is_read_from_one_decompressed_copy_in_the_cache(tmp_path):
    pack_tfrecord(Mixed(), tmp_path / "mixed.tfrecord.gz", compression="gzip", progress=False)
    ds = TFRecordDataset(tmp_path / "mixed.tfrecord.gz", features=MIXED, cache_dir=tmp_path / "c")
    cached = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert len(cached) == 2 and cached[1] == cached[0] + ".nbtrain-index"
    assert_mixed_equal(ds[29], Mixed()[29])


def test_pickles_without_its_index_and_reloads_it_where_it_lands(tmp_path):
    paths = pack_tfrecord(list(range(5000)), tmp_path / "n.tfrecord", shards=2, progress=False)
    ds = TFRecordDataset(paths, features={"0": ("int", (), int)})
    blob = pickle.dumps(ds)
    assert len(blob) < 2000   # 5,000 record offsets stay behind: a spawn worker reads them
    assert pickle.loads(blob)[4321] == 4321


def test_every_feature_as_stored_without_a_spec(tmp_path):
    pack_tfrecord(Mixed(), tmp_path / "m.tfrecord", progress=False,
                  names=("x", "ints", "n", "half", "raw", "text"))
    sample = TFRecordDataset(tmp_path / "m.tfrecord")[5]
    assert sorted(sample) == ["half", "ints", "n", "raw", "text", "x"]
    assert torch.equal(sample["x"], torch.full((6,), 1.25)) and sample["ints"].dtype == torch.int64
    assert sample["raw"] == [b"\x05" * 3] and sample["text"] == [b"s5"]


def test_reads_files_the_tfrecord_package_wrote_and_it_reads_ours(tmp_path):
    from tfrecord import TFRecordWriter
    from tfrecord.reader import tfrecord_loader
    path = str(tmp_path / "theirs.tfrecord")
    writer = TFRecordWriter(path)
    for i in range(20):
        writer.write({"image": (bytes(range(i, i + 8)), "byte"), "label": (i % 10, "int"),
                      "box": ([i, i + 0.5, 2.0, 3.0], "float")})
    writer.close()
    ds = TFRecordDataset(path, features={"image": "bytes", "label": ("int", ()),
                                         "box": ("float", (2, 2))})
    image, label, box = ds[13]
    assert image == bytes(range(13, 21)) and label.item() == 3
    assert torch.equal(box, torch.tensor([[13, 13.5], [2, 3]]))

    ours = pack_tfrecord(Mixed(), tmp_path / "ours.tfrecord", progress=False)[0]
    read = list(tfrecord_loader(ours, None, {"0": "float", "2": "int", "4": "byte"}))
    assert len(read) == 30 and read[9]["2"][0] == 9 and bytes(read[9]["4"]) == b"\x09" * 3
    assert np.array_equal(read[9]["0"], np.full(6, 9 / 4, dtype=np.float32))


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def record_offset(path, number):
    return int(tfr.scan(str(path), str(path))[number][0])


def test_a_flipped_data_byte_raises_the_named_error_never_wrong_data(tmp_path):
    path = tmp_path / "m.tfrecord"
    pack_tfrecord(Mixed(), path, progress=False)
    offset = record_offset(path, 3)
    flip_byte(path, offset + tfr.HEADER + 20)
    ds = TFRecordDataset(path, features=MIXED)   # indexing reads headers only
    with pytest.raises(CorruptRecordError, match=f"{path}: record 3 at byte offset {offset} is "
                                                 "corrupt: the CRC of its data does not match"):
        ds[3]
    assert_mixed_equal(ds[4], Mixed()[4])


def test_a_flipped_length_byte_raises_when_indexing_and_when_reading(tmp_path):
    path = tmp_path / "m.tfrecord"
    pack_tfrecord(Mixed(), path, progress=False)
    offset = record_offset(path, 3)
    ds = TFRecordDataset(path, features=MIXED)
    before = os.stat(path)
    flip_byte(path, offset + 1)
    message = f"{path}: record 3 at byte offset {offset} is corrupt: the CRC of its length"
    with pytest.raises(CorruptRecordError, match=message):
        TFRecordDataset(path, features=MIXED)    # the file changed: indexed again
    # the same damage behind a current-looking index (size and time put back) is caught on read
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(CorruptRecordError, match=message):
        TFRecordDataset(path, features=MIXED)[3]
    assert_mixed_equal(ds[2], Mixed()[2])


def test_the_index_is_cached_and_rebuilt_when_a_file_changes(tmp_path, monkeypatch):
    path = tmp_path / "m.tfrecord"
    pack_tfrecord(Mixed(), path, progress=False)
    scans = []
    real_scan = tfr.scan
    monkeypatch.setattr(tfr, "scan", lambda *a: scans.append(a) or real_scan(*a))
    TFRecordDataset(path, features=MIXED)
    TFRecordDataset(path, features=MIXED)
    assert len(scans) == 1 and (tmp_path / "m.tfrecord.nbtrain-index").exists()

    class Shifted(Mixed):   # the same sizes, other values
        def __getitem__(self, i):
            return tuple(v + 100 if isinstance(v, int) else v for v in super().__getitem__(i))
    pack_tfrecord(Shifted(), path, progress=False)
    os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 1))   # coarse clocks: make it differ
    ds = TFRecordDataset(path, features=MIXED)
    assert len(scans) == 2 and ds[5][2] == 105


def test_the_index_goes_to_the_cache_folder_when_the_data_folder_is_read_only(tmp_path,
                                                                              monkeypatch):
    path = tmp_path / "m.tfrecord"
    pack_tfrecord(Mixed(), path, progress=False)
    monkeypatch.setattr(tfr.os, "access", lambda *a: False)
    ds = TFRecordDataset(path, features=MIXED, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "m.tfrecord.nbtrain-index").exists()
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".nbtrain-index"]
    assert_mixed_equal(ds[8], Mixed()[8])


def test_errors_say_what_is_wrong_and_how_to_fix_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no TFRecord files match .*nope-\\*"):
        TFRecordDataset(str(tmp_path / "nope-*"))
    with pytest.raises(ValueError, match="features\\['x'\\] = 'double' is not understood"):
        TFRecordDataset(tmp_path, features={"x": "double"})
    path = pack_tfrecord(Mixed(), tmp_path / "m.tfrecord", progress=False)[0]
    with pytest.raises(ValueError, match="record 2: feature '2' holds int values, not float"):
        TFRecordDataset(path, features={"2": "float"})[2]
    with pytest.raises(ValueError, match="record 2: feature '0' holds 6 values, which do not fit"):
        TFRecordDataset(path, features={"0": ("float", (4,))})[2]
    with pytest.raises(ValueError, match="record 2: has no feature 'label'"):
        TFRecordDataset(path, features={"label": "int"})[2]
    gz = pack_tfrecord(Mixed(), tmp_path / "z.tfrecord", compression="gzip", progress=False)[0]
    with pytest.raises(CorruptRecordError, match="pass compression='gzip'"):
        TFRecordDataset(gz)
    with pytest.raises(TypeError, match="pack_tfrecord cannot store a complex"):
        pack_tfrecord([(1j,)], tmp_path / "c.tfrecord", progress=False)


def test_a_corrupt_record_is_named_by_fit(tmp_path):
    path = tmp_path / "blobs.tfrecord"
    x = torch.randn(64, 8)
    pack_tfrecord(list(zip(x, torch.arange(64) % 3)), path, progress=False)
    flip_byte(path, record_offset(path, 13) + tfr.HEADER + 5)
    ds = TFRecordDataset(path, features={"0": ("float", (8,)), "1": ("int", ())})
    with pytest.raises(nt.TrainingError, match=f"sample 13 raised CorruptRecordError: {path}: "
                                               "record 13 at byte offset"):
        nt.fit(mlp(), ds, F.cross_entropy, progress=False,
               config=quick(max_steps=4, batch_size=16, shuffle=False, num_workers=0))


@pytest.fixture
def blob_records(blobs, tmp_path):
    x, y = blobs
    paths = pack_tfrecord(list(zip(x, y)), tmp_path / "blobs.tfrecord", shards=2, progress=False)
    return paths, {"0": ("float", (8,)), "1": ("int", ())}


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_shuffled_training_in_workers_is_deterministic_and_resumes_exactly(blob_records,
                                                                           tmp_path, method):
    paths, features = blob_records
    data = TFRecordDataset(paths, features=features)
    cfg = quick(max_steps=24, batch_size=48, log_every=1, seed=3, num_workers=2,
                persistent_workers=True, multiprocessing_context=method,
                checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=10)   # 11 steps an epoch

    def new_model():
        torch.manual_seed(1)
        return mlp()
    straight = new_model()
    nt.fit(straight, data, F.cross_entropy, config=cfg, progress=False)

    first = nt.fit(new_model(), data, F.cross_entropy, config=cfg.replace(max_steps=10),
                   progress=False)
    assert first.step == 10
    resumed = new_model()
    nt.fit(resumed, data, F.cross_entropy, config=cfg, progress=False,
           resume=str(tmp_path / "ckpt" / "last.pt"))
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_another_seed_gives_another_order(blob_records):
    paths, features = blob_records
    data = TFRecordDataset(paths, features=features)

    def train(seed):
        torch.manual_seed(1)
        model = mlp()
        nt.fit(model, data, F.cross_entropy, progress=False,
               config=quick(max_steps=5, seed=seed, num_workers=0))
        return model[0].weight
    assert torch.equal(train(3), train(3)) and not torch.equal(train(3), train(4))


def test_fasttrain_data_and_autotune_take_a_tfrecord_dataset(blob_records):
    from IPython.core.interactiveshell import InteractiveShell
    from nbtrain.ui import magic
    paths, features = blob_records
    ip = InteractiveShell.instance()
    magic.load_ipython_extension(ip)
    try:
        ip.push({"records": TFRecordDataset(paths, features=features), "mlp": mlp, "F": F})
        result = ip.run_cell("%%fasttrain --data records --max-steps 3 --device cpu "
                             "--workers 1\nmodel = mlp()\nloss_fn = F.cross_entropy")
        assert result.error_in_exec is None and ip.user_ns["run"].step == 3
    finally:
        magic.unload_ipython_extension(ip)
        for name in ("records", "mlp", "F", "model", "loss_fn", "run"):
            ip.user_ns.pop(name, None)
    tuning = nt.autotune(mlp, TFRecordDataset(paths, features=features), F.cross_entropy,
                         budget_s=2, cache=False, config=nt.TrainConfig(device="cpu"),
                         space={"amp": ["off"], "batch_size": [32], "num_workers": [0, 1],
                                "prefetch_factor": [None], "persistent_workers": [False]})
    assert tuning.settings["num_workers"] in (0, 1) and len(tuning.trials) >= 2
