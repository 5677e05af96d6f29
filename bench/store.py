"""What the run store costs: runs with the store on against store=False, in the same process.

    python bench/store.py [--repeats 21] [--epochs 3] [--runs 10000]

Each round runs four ways, interleaved so machine noise hits all alike (the order rotates
from round to round: bench/rounds.py): a 3-epoch `nt.fit` of the MLP (64-128-10 on
8192x64, batch 64, the defaults: a record every 10 steps) with the store on and with
`store=False`, and `nt.watch` around a hand-written loop of the same MLP (a DataLoader,
AdamW, the defaults: records at least 50 ms apart), on and off. Each call is timed
whole, its setup and the end's wait for the last commit included. Printed: the median
seconds per call and the median of the per-round ratios on/off with their min-max
spread; then the bytes the database takes per stored record, and the time `nt.runs()`
takes over a store of `--runs` runs. Targets (issue 39): on/off <= 1.02x for both;
<= ~1 KB a record; nt.runs() < 0.5 s with 10,000 runs.

The store goes to a temporary $NBTRAIN_HOME, removed at the end: ~/.nbtrain is untouched.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import tempfile
import time
import uuid

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from nbtrain.runstore import write as store
from nbtrain.machine import machine_line
from rounds import interleaved, paired   # bench/rounds.py: the order rotates each round


def make_mlp():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def fit_call(x, y, epochs: int, kept: bool) -> int:
    cfg = nt.TrainConfig(epochs=epochs, batch_size=64, lr=1e-3, store=kept)
    return nt.fit(make_mlp(), (x, y), F.cross_entropy, config=cfg, progress=False).step


def watch_call(x, y, epochs: int, kept: bool) -> int:
    """The tutorial loop, under nt.watch with its defaults."""
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    with nt.watch(store=kept, progress=False) as run:
        for _ in range(epochs):
            for xb, yb in loader:
                opt.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                opt.step()
    return run.step


def measure(repeats: int, epochs: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8192, 64, generator=gen), torch.randint(0, 10, (8192,), generator=gen)
    todo = {"nt.fit, store on": lambda: fit_call(x, y, epochs, True),
            "nt.fit, store=False": lambda: fit_call(x, y, epochs, False),
            "nt.watch, store on": lambda: watch_call(x, y, epochs, True),
            "nt.watch, store=False": lambda: watch_call(x, y, epochs, False)}
    for way in todo.values():   # warm-up: "auto"'s probes cached, the writer thread started
        way()

    def measure_one(name) -> float:
        torch.manual_seed(0)
        start = time.perf_counter()
        todo[name]()
        return time.perf_counter() - start
    return interleaved(list(todo), repeats, measure_one)


def thread_costs(epochs: int, calls: int = 5) -> dict:
    """{case: (training thread's ms in the store per call, the writer thread's CPU ms per
    call, records per call, ms per call)}: the store's own work, timed where it runs, as
    a figure the machine's noise does not move as much as it moves whole calls."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8192, 64, generator=gen), torch.randint(0, 10, (8192,), generator=gen)
    spent = [0.0]
    originals = {name: getattr(store.StoredRun, name) for name in ("begin", "__call__", "_end")}

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return wrapper
    out = {}
    try:
        for name, fn in originals.items():
            setattr(store.StoredRun, name, timed(fn))
        for case, call in (("nt.fit", fit_call), ("nt.watch", watch_call)):
            writer = store.writer_for(store.path_of(True))
            spent[0], busy, records, wall = 0.0, writer.busy_s, 0, 0.0
            for _ in range(calls):
                before = _records(store.path_of(True))
                start = time.perf_counter()
                call(x, y, epochs, True)
                wall += time.perf_counter() - start
                store.flush_all()
                records += _records(store.path_of(True)) - before
            out[case] = (spent[0] / calls * 1e3, (writer.busy_s - busy) / calls * 1e3,
                         records / calls, wall / calls * 1e3)
    finally:
        for name, fn in originals.items():
            setattr(store.StoredRun, name, fn)
    return out


def _records(path) -> int:
    store.flush_all()
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]


def bytes_per_record(path) -> tuple:
    """(bytes of the database per stored record, records, runs), after a checkpoint."""
    store.flush_all()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (records,) = conn.execute("SELECT COUNT(*) FROM records").fetchone()
        (runs,) = conn.execute("SELECT COUNT(*) FROM runs").fetchone()
        pages = conn.execute("PRAGMA page_count").fetchone()[0] - \
            conn.execute("PRAGMA freelist_count").fetchone()[0]
        size = pages * conn.execute("PRAGMA page_size").fetchone()[0]
    return size / max(records, 1), records, runs


def many_runs(path, n: int) -> None:
    """`n` runs in the store at `path`: copies of its first run's row and records, each
    with an id of its own (the listing reads only the runs table)."""
    with sqlite3.connect(path) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(runs)")]
        template = conn.execute("SELECT * FROM runs LIMIT 1").fetchone()
        records = conn.execute("SELECT seq, t, record FROM records WHERE run_id = ?",
                               (template[0],)).fetchall()
        have = conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
        rows, kept = [], []
        for i in range(max(n - have, 0)):
            run_id = f"bench-{uuid.uuid4().hex[:12]}"
            rows.append((run_id, *template[1:3], template[3] - i, *template[4:]))
            kept.extend((run_id, *record) for record in records)
        conn.executemany(f"INSERT INTO runs ({', '.join(columns)}) VALUES "
                         f"({', '.join('?' * len(columns))})", rows)
        conn.executemany("INSERT INTO records VALUES (?, ?, ?, ?)", kept)


def listing_s(path, repeats: int = 7) -> tuple:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        table = nt.runs(store=path)
        times.append(time.perf_counter() - start)
        table._repr_html_()
    return statistics.median(times), len(table)


def main(argv=None):
    print(machine_line())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--runs", type=int, default=10_000, help="runs in the listing's store")
    args = parser.parse_args(argv)
    home = tempfile.mkdtemp(prefix="nbtrain-bench-store-")
    os.environ["NBTRAIN_HOME"] = home
    try:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.epochs} "
              f"epochs a call, medians of {args.repeats} interleaved rounds\n")
        times = measure(args.repeats, args.epochs)
        print("| case | store on, s/call | store=False, s/call | ratio on/off | spread |\n"
              "|---|---:|---:|---:|---|")
        for case in ("nt.fit", "nt.watch"):
            on, off = f"{case}, store on", f"{case}, store=False"
            ratio, low, high = paired(times, on, off)
            print(f"| {case} (MLP, {args.epochs} epochs) | {statistics.median(times[on]):.4f} | "
                  f"{statistics.median(times[off]):.4f} | {ratio:.3f}x | {low:.3f}-{high:.3f} |")
        print("\n| case | training thread in the store, ms/call | writer thread CPU, ms/call "
              "| records/call | ms/call | both threads' share |\n|---|---:|---:|---:|---:|---:|")
        for case, (ms, writer_ms, records, wall_ms) in thread_costs(args.epochs).items():
            print(f"| {case} | {ms:.3f} | {writer_ms:.2f} | {records:.0f} | {wall_ms:.0f} | "
                  f"{(ms + writer_ms) / wall_ms:.2%} |")
        path = store.path_of(True)
        per_record, records, runs = bytes_per_record(path)
        print(f"\nstore: {per_record:,.0f} bytes per record ({records:,} records of {runs} runs, "
              f"the file after a checkpoint, indexes included)")
        many_runs(path, args.runs)
        seconds, listed = listing_s(path)
        print(f"nt.runs() over {listed:,} stored runs: {seconds * 1e3:.0f} ms (median of 7)")
    finally:
        store.flush_all()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
