"""The data path against plain PyTorch, measured in one run.

    python bench/data_path.py [--repeats 7]

1. In-memory tensors, 10,000 x 5 at batch 256 (the setup of pytorch/pytorch#10260):
   iterating one epoch, and one fit epoch of a linear model, against
   DataLoader(TensorDataset, num_workers=0) and the textbook loop. Targets: >= 10x, >= 3x.
2. Files on disk: the digits images as PNG files decoded with Pillow, against the same
   PNG bytes packed into one LMDB file or one TFRecord file, and LMDB / TFRecord holding
   the decoded tensors; 0, 1, 2 workers, and the cost of one __getitem__ (read + decode).
3. LMDB integrity: what checking a database at open costs (every key and value read once
   in a throwaway process, see nbtrain/data/lmdb.py), by size, with the file in the page
   cache (just packed) and evicted from it (posix_fadvise DONTNEED, Linux: on a VM the
   host's cache may still serve it), and what checking the checksum adds to one read.
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import nbtrain as nt
from nbtrain.machine import machine_line
from nbtrain.config import TrainConfig
from nbtrain.data import make_batches


def median_time(fn, repeats: int) -> float:
    fn()   # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- 1. in-memory tensors ---------------------------------------------------------------------
def in_memory(repeats: int) -> list:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(10_000, 5, generator=gen), torch.randn(10_000, 1, generator=gen)

    def plain_iterate():
        for _ in DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True):
            pass

    def nbtrain_iterate():
        for _ in make_batches((x, y), TrainConfig(batch_size=256), torch.device("cpu"), {}).epoch(0):
            pass

    def plain_fit():
        model = nn.Linear(5, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for xb, yb in DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(xb), yb).backward()
            opt.step()

    def nbtrain_fit():
        cfg = TrainConfig(epochs=1, batch_size=256, optimizer="sgd", momentum=0.0, lr=0.01)
        nt.fit(nn.Linear(5, 1), (x, y), F.mse_loss, config=cfg, progress=False)

    rows = []
    for label, plain, ours in (("iterate one epoch", plain_iterate, nbtrain_iterate),
                               ("fit one epoch, linear model", plain_fit, nbtrain_fit)):
        a, b = median_time(plain, repeats), median_time(ours, repeats)
        rows.append((label, a * 1e3, b * 1e3, a / b))
    return rows


# -- 2. files on disk -------------------------------------------------------------------------
def decode_png(data: bytes) -> torch.Tensor:
    from PIL import Image
    image = np.asarray(Image.open(io.BytesIO(data)), dtype=np.float32) / 255.0
    return torch.from_numpy(image).unsqueeze(0)             # (8, 8) -> (1, 8, 8)


class PngFiles(Dataset):
    """One PNG file per sample, opened and decoded on every access."""

    def __init__(self, folder: Path, labels):
        self.paths = sorted(folder.glob("*.png"))
        self.labels = labels

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return decode_png(self.paths[i].read_bytes()), int(self.labels[i])


class PngBytes(Dataset):
    """The raw file bytes, for packing: LMDB then holds the same encoded images."""

    def __init__(self, files: PngFiles):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.files.paths[i].read_bytes(), int(self.files.labels[i])


def decode_sample(sample):
    data, label = sample
    return decode_png(data), label


def write_pngs(folder: Path):
    from PIL import Image
    x, y = nt.datasets.digits("all")
    for i, image in enumerate((x[:, 0] * 255).to(torch.uint8).numpy()):
        Image.fromarray(image).save(folder / f"{i:05d}.png")
    return y


def on_disk(repeats: int) -> list:
    folder = Path(tempfile.mkdtemp(prefix="nbtrain-bench-"))
    (folder / "png").mkdir()
    labels = write_pngs(folder / "png")
    files = PngFiles(folder / "png", labels)
    nt.data.pack_lmdb(PngBytes(files), folder / "png.lmdb", progress=False)
    nt.data.pack_lmdb(files, folder / "tensors.lmdb", progress=False)
    nt.data.pack_tfrecord(PngBytes(files), folder / "png.tfrecord", progress=False)
    nt.data.pack_tfrecord(files, folder / "tensors.tfrecord", progress=False)
    sources = {"PNG files + Pillow": files,
               "LMDB of PNG bytes + Pillow": nt.data.LMDBDataset(folder / "png.lmdb",
                                                                  transform=decode_sample),
               "LMDB of decoded tensors": nt.data.LMDBDataset(folder / "tensors.lmdb"),
               "TFRecord of PNG bytes + Pillow": nt.data.TFRecordDataset(
                   folder / "png.tfrecord", features={"0": "bytes", "1": ("int", (), int)},
                   transform=decode_sample),
               "TFRecord of decoded tensors": nt.data.TFRecordDataset(
                   folder / "tensors.tfrecord",
                   features={"0": ("float", (1, 8, 8)), "1": ("int", (), int)})}
    return interleaved(sources, repeats)


def interleaved(sources: dict, repeats: int) -> list:
    """Per source: samples/s with 0, 1, 2 workers and the µs one __getitem__ costs in this
    process. Each repeat times every case once, in turn, so that the 2 shared cores' slow
    spells fall on all of them alike; medians over the repeats."""
    cases = {}
    for label, dataset in sources.items():
        cases[label, "read"] = lambda d=dataset: [d[i] for i in range(len(d))]
        for workers in (0, 1, 2):
            extra = dict(persistent_workers=True) if workers else {}
            cfg = TrainConfig(batch_size=64, num_workers=workers, **extra)
            source = make_batches(dataset, cfg, torch.device("cpu"), {})
            cases[label, workers] = lambda s=source: [None for _ in s.epoch(0)]
    times = {key: [] for key in cases}
    for run in range(repeats + 1):   # the first round warms up (starts the workers)
        for key, fn in cases.items():
            start = time.perf_counter()
            fn()
            if run:
                times[key].append(time.perf_counter() - start)
    rows = []
    for label, dataset in sources.items():
        rates = [len(dataset) / statistics.median(times[label, w]) for w in (0, 1, 2)]
        read_us = statistics.median(times[label, "read"]) / len(dataset) * 1e6
        rows.append((label, *rates, read_us))
    return rows


# -- 3. LMDB integrity ----------------------------------------------------------------------
class Repeated(Dataset):
    """`n` samples shaped like `sample`, each with its own values."""

    def __init__(self, n: int, make):
        self.n, self.make = n, make

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.make(i)


def small_image(i):   # a digits-sized sample: an 8x8 float image and its label
    return torch.full((1, 8, 8), i / 7.0), i % 10


def large_image(i):   # an ImageNet-sized one: 3x224x224 bytes and its label
    return torch.full((3, 224, 224), i % 251, dtype=torch.uint8), i % 1000


def lmdb_integrity(repeats: int) -> list:
    """Per database: its size (MB), the walk's seconds with the file in the page cache and
    evicted from it (the cached verdict bypassed), µs per read (get + checksum + decode)
    and µs of it checking the checksum; medians."""
    from nbtrain.data import lmdb as nlmdb
    folder = Path(tempfile.mkdtemp(prefix="nbtrain-bench-"))
    try:
        return [integrity_row(nlmdb, folder, *case, repeats) for case in (
            ("digits-sized, 1,797", 1_797, small_image),
            ("digits-sized, 100,000", 100_000, small_image),
            ("3x224x224 uint8, 2,000", 2_000, large_image))]
    finally:   # 350 MB of databases
        shutil.rmtree(folder, ignore_errors=True)


def integrity_row(nlmdb, folder: Path, label: str, n: int, make, repeats: int) -> tuple:
    path = nt.data.pack_lmdb(Repeated(n, make), folder / f"{n}-{make.__name__}.lmdb",
                             progress=False)
    megabytes = Path(nlmdb.data_file(path)).stat().st_size / 1e6
    walk_s = median_time(lambda: nlmdb.judge(path, nlmdb.walk_in_subprocess(path)), repeats)
    evicted_s = median_time(lambda: evict(nlmdb.data_file(path))
                            or nlmdb.judge(path, nlmdb.walk_in_subprocess(path)), repeats)
    ds = nt.data.LMDBDataset(path)
    picked = range(0, n, max(1, n // 2_000))   # 2,000 reads, spread over the file
    read_us = median_time(lambda: [ds.read(i) for i in picked], repeats) / len(picked) * 1e6
    with ds._environment().begin() as txn:   # as stored, sliced without a copy as a read does
        values = [(nlmdb._key(i), memoryview(txn.get(nlmdb._key(i)))) for i in picked]
    crc_us = median_time(lambda: [nlmdb.unframe(k, v) for k, v in values],
                         repeats) / len(picked) * 1e6
    return label, megabytes, walk_s, evicted_s, read_us, crc_us


def evict(file: str) -> None:
    """Drop `file` from the page cache, so that the next read goes to the disk."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv=None):
    print(machine_line())   # the caption: which CPU, its bf16 units, the load
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}\n")
    print("| in-memory 10,000 x 5, batch 256 | plain ms | nbtrain ms | speed-up |")
    print("|---|---:|---:|---:|")
    for label, a, b, ratio in in_memory(args.repeats):
        print(f"| {label} | {a:.1f} | {b:.2f} | {ratio:.1f}x |", flush=True)
    print("\n| digits 1,797 images, batch 64: samples/s | 0 workers | 1 worker | 2 workers "
          "| µs to read one sample |")
    print("|---|---:|---:|---:|---:|")
    for label, *rates, read_us in on_disk(args.repeats):
        print(f"| {label} | " + " | ".join(f"{r:,.0f}" for r in rates) + f" | {read_us:.1f} |",
              flush=True)
    print("\n| LMDB database | MB | walk at open, s | MB/s | evicted: s | µs per read "
          "| of it, checksum |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, megabytes, walk_s, evicted_s, read_us, crc_us in lmdb_integrity(args.repeats):
        print(f"| {label} | {megabytes:,.1f} | {walk_s:.3f} | {megabytes / walk_s:,.0f} "
              f"| {evicted_s:.3f} | {read_us:.1f} | {crc_us:.2f} ({crc_us / read_us:.0%}) |",
              flush=True)


if __name__ == "__main__":
    main()
