"""The data path: batched fetch, loader settings, workers under every start method, LMDB."""
import collections
import os
import signal
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.config import TrainConfig
from nbtrain.data import available_cores, make_batches, make_mover, _resolve_on_device, _resolve_pin
from nbtrain.data.batches import TensorBatches, epoch_order
from nbtrain.data.lmdb import LMDBDataset, pack_lmdb

from conftest import FakeStreams, quick


def test_batched_fetch_serves_every_sample_once_in_a_seeded_order():
    x = torch.arange(100).float().unsqueeze(1)
    source = TensorBatches((x, x.long().squeeze(1)), batch_size=32, shuffle=True,
                           drop_last=False, seed=3)
    epoch0 = torch.cat([b[1] for b in source.epoch(0)])
    assert sorted(epoch0.tolist()) == list(range(100))
    assert torch.equal(epoch0, epoch_order(100, True, 3, 0))
    assert not torch.equal(epoch0, torch.cat([b[1] for b in source.epoch(1)]))
    resumed = torch.cat([b[1] for b in source.epoch(0, start=2)])   # resume mid-epoch
    assert torch.equal(resumed, epoch0[64:])
    for size in (100, 1000, 2**63):   # a batch of the whole epoch, however large the size
        whole = TensorBatches((x,), batch_size=size, shuffle=True, drop_last=False, seed=3)
        assert [len(b[0]) for b in whole.epoch(0)] == [100]
        dropped = TensorBatches((x,), batch_size=size, shuffle=True, drop_last=True, seed=3)
        assert [len(b[0]) for b in dropped.epoch(0)] == ([100] if size == 100 else [])


def test_loader_path_resumes_mid_epoch_in_the_same_order():
    ds = torch.utils.data.TensorDataset(torch.arange(50))
    resolved = {}
    source = make_batches(ds, TrainConfig(batch_size=8, batched_fetch=False, num_workers=0),
                          torch.device("cpu"), resolved)
    full = torch.cat([b[0] for b in source.epoch(2)])
    tail = torch.cat([b[0] for b in source.epoch(2, start=3)])
    assert torch.equal(tail, full[24:]) and resolved["batched_fetch"][0] is False


def test_loader_builder_honours_every_setting():
    ds = torch.utils.data.TensorDataset(torch.randn(40, 3))
    cfg = TrainConfig(batch_size=8, batched_fetch=False, num_workers=2, prefetch_factor=3,
                      persistent_workers=True, multiprocessing_context="spawn")
    resolved = {}
    loader = make_batches(ds, cfg, torch.device("cpu"), resolved).loader
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (2, 3, True)
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert loader.pin_memory is False and "device is cpu" in resolved["pin_memory"][1]


def test_auto_settings_by_data_kind():
    tensors, per_sample = {}, {}
    make_batches((torch.randn(10, 2), torch.zeros(10)), TrainConfig(), torch.device("cpu"), tensors)
    assert tensors["num_workers"][0] == 0 and tensors["batched_fetch"][0] is True
    assert "batched fetch" in tensors["num_workers"][1]
    make_batches(Squares(), TrainConfig(), torch.device("cpu"), per_sample)
    assert per_sample["num_workers"][0] == min(8, available_cores() - 1)
    assert "per-sample" in per_sample["num_workers"][1]


@pytest.mark.parametrize("files, cores", [
    ({"cpu.max": "150000 100000\n"}, 2),             # cgroup v2: 1.5 CPUs, rounded up
    ({"cpu.max": "max 100000\n"}, 16),               # v2, no quota
    ({"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"}, 3),   # v1
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, 16),      # v1, none
    ({}, 16),                                         # no cgroup files (not Linux)
])
def test_a_cgroup_quota_is_read_as_joblib_reads_it(tmp_path, files, cores):
    from nbtrain.machine import cgroup_cores
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cores(16, root=str(tmp_path)) == cores


def test_auto_workers_follow_the_cpu_limit_not_the_machine(monkeypatch):
    # LOKY_MAX_CPU_COUNT stands in for a container's cgroup quota: both cap the count
    monkeypatch.setenv("LOKY_MAX_CPU_COUNT", "1")
    assert available_cores() == 1
    resolved = {}
    make_batches(Squares(), TrainConfig(), torch.device("cpu"), resolved)
    assert resolved["num_workers"] == (0, "per-sample loading on 1 core: a worker would take "
                                          "turns with training for it")


def test_auto_on_a_gpu_pins_and_keeps_small_data_on_the_device(monkeypatch):
    cuda = torch.device("cuda")
    assert _resolve_pin(TrainConfig(), cuda, on_device=False)[0] is True
    assert _resolve_pin(TrainConfig(), cuda, on_device=True)[0] is False
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * 2**30, 16 * 2**30))
    small, big = [torch.zeros(1000, 10)], [torch.zeros(2**30, dtype=torch.uint8)] * 3
    assert _resolve_on_device(small, TrainConfig(), cuda)[0] is True
    on, why = _resolve_on_device(big, TrainConfig(), cuda)
    assert on is False and "quarter of free device memory" in why


def test_tensors_already_on_the_device_stay_there():
    meta = torch.device("meta")   # stands in for a GPU: tensors live there, not in host memory
    tensors = [torch.zeros(10, 2, device=meta), torch.zeros(10, device=meta)]
    for setting in ("auto", False):
        on, why = _resolve_on_device(tensors, TrainConfig(data_on_device=setting), meta)
        assert on is True and why == "the tensors are already on meta"
    assert _resolve_on_device([torch.zeros(3)], TrainConfig(), meta)[0] is not True


def test_batched_fetch_with_workers_is_refused():
    with pytest.raises(nt.ConfigError, match="batched_fetch=True with num_workers=2"):
        make_batches((torch.randn(10, 2),), TrainConfig(batched_fetch=True, num_workers=2),
                     torch.device("cpu"), {})


def test_data_on_device_with_workers_is_refused_naming_both():
    with pytest.raises(nt.ConfigError, match="data_on_device=True with num_workers=2") as info:
        make_batches((torch.randn(10, 2),), TrainConfig(data_on_device=True, num_workers=2),
                     torch.device("meta"), {})
    assert info.value.field == "data_on_device" and "got TensorDataset" not in str(info.value)


def test_a_batch_of_strings_counts_its_samples_not_characters():
    from nbtrain.data.nested import batch_len
    texts = ["hello world", "a", "bc"]
    assert batch_len((texts, torch.tensor([0, 1, 1]))) == 3
    assert batch_len({"text": texts, "label": torch.tensor([0, 1, 1])}) == 3
    assert batch_len([[torch.zeros(3, 2)], torch.zeros(3)]) == 3   # tensors still lead


def test_a_dataset_sent_by_value_keeps_its_batched_fetch():
    import pickle

    from nbtrain.data.batches import ByValue

    class Rows(torch.utils.data.Dataset):   # defined here: workers cannot import it
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return ("one", i)

        def __getitems__(self, indices):
            return [("many", i) for i in indices]

    wrapped = pickle.loads(pickle.dumps(ByValue(Rows())))   # as a spawned worker gets it
    assert wrapped.__getitems__([1, 2]) == [("many", 1), ("many", 2)]
    plain = ByValue(torch.utils.data.TensorDataset(torch.arange(4)))
    assert [int(row[0]) for row in plain.__getitems__([3, 0])] == [3, 0]


def test_the_first_batch_under_a_prefetcher_starts_no_worker():
    from types import SimpleNamespace

    from nbtrain.data import first_batch

    class Pids(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return torch.tensor(os.getpid())
    batches = make_batches(Pids(), TrainConfig(batch_size=4, num_workers=1), torch.device("cpu"), {})
    prefetcher = SimpleNamespace(source=batches, epoch=lambda *a: pytest.fail("loaded ahead"))
    assert first_batch(prefetcher).tolist() == [os.getpid()] * 4


def test_nested_batches_move_as_a_whole():
    move = make_mover(torch.device("meta"), pinned=False, resident=False, channels_last=False)
    batch = {"x": torch.randn(2, 3), "pair": (torch.zeros(2), [torch.ones(2)]), "n": 3}
    moved = move(batch)
    assert moved["x"].is_meta and moved["pair"][0].is_meta and moved["pair"][1][0].is_meta
    assert moved["n"] == 3 and isinstance(moved["pair"], tuple)
    Pair = collections.namedtuple("Pair", "x y")   # what default_collate makes of namedtuples
    moved = move(Pair(torch.zeros(2), torch.ones(2)))
    assert type(moved) is Pair and moved.x.is_meta and moved.y.is_meta


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor([float(i * i)])


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_load_in_other_processes_under_every_start_method(method):
    """A Dataset class from a notebook cell cannot be imported by spawn/forkserver workers."""
    class NotebookDataset(torch.utils.data.Dataset):   # not importable by a fresh process
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return torch.randn(8), torch.tensor(os.getpid())
    pids = []

    def loss(out, pid):
        pids.extend(pid.tolist())
        return out.sum() * 0
    run = nt.fit(nn.Linear(8, 3), NotebookDataset(), loss, progress=False,
                 config=quick(max_steps=2, num_workers=1, multiprocessing_context=method,
                              count_flops=False))   # the count loads a batch here
    assert run.state == "finished" and pids and os.getpid() not in pids


def test_without_cloudpickle_the_error_says_what_to_do(monkeypatch):
    class NotebookDataset(Squares):
        pass
    monkeypatch.setitem(sys.modules, "cloudpickle", None)
    with pytest.raises(nt.ConfigError, match="pip install cloudpickle, move the class into a .py"):
        nt.fit(nn.Linear(1, 1), NotebookDataset(), F.mse_loss, progress=False,
               config=quick(max_steps=1, num_workers=1, multiprocessing_context="spawn"))


class BadSample(Squares):
    def __getitem__(self, i):
        if i == 13:
            raise ValueError("corrupt record")
        return super().__getitem__(i)


def test_a_worker_that_raises_names_the_sample():
    model = nn.Linear(1, 1)
    with pytest.raises(nt.TrainingError) as err:
        nt.fit(model, BadSample(), F.mse_loss, progress=False,
               config=quick(max_steps=4, num_workers=1, shuffle=False, batch_size=8))
    text = str(err.value)
    assert "loading batch 1 of epoch 0" in text
    assert "sample 13 raised ValueError: corrupt record" in text
    assert err.value.run.step == 1 and err.value.run.model is model   # state kept


class Crashes(torch.utils.data.Dataset):
    """Sample 13 ends the process that loads it without raising, as a segfault would."""

    def __init__(self, death):
        self.death, self.notebook_pid = death, os.getpid()   # travels to spawned workers

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 13:
            if os.getpid() == self.notebook_pid:
                raise AssertionError("sample 13 was loaded in the notebook's own process")
            os.kill(os.getpid(), signal.SIGKILL) if self.death == "SIGKILL" else os._exit(3)
        return torch.tensor([float(i)]), torch.tensor([float(i)])


@pytest.mark.parametrize("death, method, reason", [
    ("exit", "fork", "exit code 3"),
    ("SIGKILL", "spawn", "SIGKILL, most often the out-of-memory killer")])
def test_a_worker_that_dies_names_the_sample_without_loading_it_here(death, method, reason):
    model = nn.Linear(1, 1)
    with pytest.raises(nt.TrainingError) as err:
        nt.fit(model, Crashes(death), F.mse_loss, progress=False,
               config=quick(max_steps=4, num_workers=1, shuffle=False, batch_size=8,
                            multiprocessing_context=method))
    text = str(err.value)
    assert "DataLoader worker (pid" in text
    assert f"sample 13 kills the process that loads it ({reason})" in text
    assert err.value.run.model is model and err.value.run.state == "failed"


class HangsAt(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 2:
            time.sleep(30)
        return i


def test_the_crash_probe_names_a_sample_that_hangs_and_leaves_no_process():
    import multiprocessing
    from nbtrain.data.culprit import crashing_sample
    before = set(multiprocessing.active_children())   # other tests' loader workers, if any
    assert crashing_sample(HangsAt(), [0, 1, 2, 3], timeout_s=1) == \
        "sample 2 did not finish loading within 1 s"
    assert crashing_sample(HangsAt(), [0, 1, 3]) is None   # no crash to find
    assert set(multiprocessing.active_children()) <= before


def test_a_failed_crash_search_keeps_the_error_it_explains(monkeypatch):
    import nbtrain.data.culprit as culprit

    def cannot_fork(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(culprit, "crashing_sample", cannot_fork)
    with pytest.raises(nt.TrainingError, match=r"DataLoader worker \(pid") as err:
        nt.fit(nn.Linear(1, 1), Crashes("exit"), F.mse_loss, progress=False,
               config=quick(max_steps=4, num_workers=1, shuffle=False, batch_size=8))
    assert "kills the process" not in str(err.value) and err.value.run.state == "failed"


def test_the_crash_search_covers_an_accumulation_window():
    # sample 13 is in batch 3: the loop waits for the window of batches 0-3 at batch 0
    model = nn.Linear(1, 1)
    with pytest.raises(nt.TrainingError, match="sample 13 kills the process"):
        nt.fit(model, Crashes("exit"), F.mse_loss, progress=False,
               config=quick(max_steps=2, num_workers=1, prefetch_factor=1, shuffle=False,
                            batch_size=4, grad_accum_steps=4))


class Mixed(torch.utils.data.Dataset):
    def __len__(self):
        return 30

    def __getitem__(self, i):
        return (torch.full((2, 3), float(i)), np.arange(i % 4, dtype=np.int16), i, i / 2,
                bytes([i]) * 3, f"s{i}")


def test_lmdb_round_trip(tmp_path):
    path = pack_lmdb(Mixed(), tmp_path / "mixed.lmdb", progress=False, commit_every=7)
    ds = nt.data.LMDBDataset(path)
    assert len(ds) == 30
    for i in (0, 17, 29):
        want, got = Mixed()[i], ds[i]
        assert torch.equal(got[0], want[0]) and got[0].dtype == torch.float32
        assert np.array_equal(got[1], want[1]) and got[1].dtype == np.int16
        assert got[2:] == want[2:]
    doubled = LMDBDataset(path, transform=lambda s: s[2] * 2)
    assert doubled[5] == 10


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_lmdb_dataset_in_workers(tmp_path, method):
    path = pack_lmdb(Squares(), tmp_path / "sq.lmdb", progress=False)
    run = nt.fit(nn.Linear(1, 1), LMDBDataset(path), F.mse_loss, progress=False,
                 config=quick(epochs=1, num_workers=1, multiprocessing_context=method, lr=1e-4))
    assert run.state == "finished" and run.step == 2


def test_lmdb_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no LMDB database at {tmp_path / 'nope'}"):
        LMDBDataset(tmp_path / "nope")
    broken = tmp_path / "broken.lmdb"
    broken.mkdir()
    (broken / "data.mdb").write_bytes(b"\0garbage" * 100)
    with pytest.raises(ValueError, match="broken.lmdb is not a readable LMDB database"):
        LMDBDataset(broken)
    import lmdb
    foreign = tmp_path / "foreign.lmdb"
    with lmdb.open(str(foreign)) as env, env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    with pytest.raises(ValueError, match="not one written by nt.data.pack_lmdb"):
        LMDBDataset(foreign)


def test_prefetcher_only_where_there_is_a_copy_to_hide(blobs):
    run = nt.fit(nn.Linear(8, 3), blobs, F.cross_entropy, config=quick(max_steps=1),
                 progress=False)
    assert run.resolved["prefetch_to_device"] == (False, "device is cpu: no host-to-GPU copy to overlap")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefetcher_yields_batches_on_the_device(blobs):
    from nbtrain.data.prefetch import CudaPrefetcher
    source = TensorBatches(blobs, 64, True, False, 0, pin=True)
    move = make_mover(torch.device("cuda"), True, False, False)
    batches = list(CudaPrefetcher(source, move, torch.device("cuda")).epoch(0))
    assert len(batches) == len(source) and all(b[0].is_cuda for b in batches)


def test_prefetcher_copies_the_next_batch_on_the_side_stream_before_yielding(monkeypatch):
    from nbtrain.data.prefetch import CudaPrefetcher
    streams = FakeStreams(monkeypatch, describe=lambda t: f"batch {int(t[0])}")
    x = torch.arange(4).repeat_interleave(2)          # batch k holds samples [k, k]
    source = TensorBatches((x, x), 2, False, False, 0)
    prefetcher = CudaPrefetcher(source, streams.move, torch.device("cuda"))
    for batch in prefetcher.epoch(0, start=1):
        streams.log.append(f"step on batch {int(batch[0][0])}")
    assert streams.log == [
        "copy batch 1 on side",
        "main waits for side", "batch 1 used on main", "batch 1 used on main",
        "copy batch 2 on side", "step on batch 1",      # batch 2 is copied during step 1
        "main waits for side", "batch 2 used on main", "batch 2 used on main",
        "copy batch 3 on side", "step on batch 2",
        "main waits for side", "batch 3 used on main", "batch 3 used on main",
        "step on batch 3"]


class HeldElsewhere:
    """A batch source whose epoch generators a test keeps a reference to, as a traceback
    may: closing what reads them must close them, not a finalizer at some later time."""

    def __init__(self):
        self.closed, self.epochs = 0, []

    def __len__(self):
        return 4

    def epoch(self, epoch, start=0):
        self.epochs.append(self._batches(start))
        return self.epochs[-1]

    def _batches(self, start):
        try:
            for k in range(start, 4):
                yield (torch.tensor([k, k]),)
        finally:
            self.closed += 1


def test_closing_a_prefetcher_or_a_loops_windows_closes_the_epoch_they_read(monkeypatch):
    """Workers stop and a copied-ahead batch is freed when the loop ends, never in a
    generator's finalizer (where torch's CUDA sanitizer once crashed)."""
    from nbtrain.data.prefetch import CudaPrefetcher
    from nbtrain.train.loop import _windows
    streams = FakeStreams(monkeypatch, describe=lambda t: f"batch {int(t[0])}")
    source = HeldElsewhere()
    batches = CudaPrefetcher(source, streams.move, torch.device("cuda")).epoch(0)
    next(batches)
    batches.close()
    assert source.closed == 1
    for size in (1, 2):
        windows = _windows(source.epoch(0), size)
        next(windows)
        windows.close()
    assert source.closed == 3


def test_closing_a_loops_windows_stops_the_workers_of_your_loader_at_once(monkeypatch):
    """A run that stops mid-epoch (Stop, steps=, an error) stops the workers of the user's
    DataLoader then, resumed epochs skipping what was trained on."""
    from torch.utils.data import DataLoader
    from nbtrain.data import batches as batches_module
    from nbtrain.train.loop import _windows
    stopped = []
    monkeypatch.setattr(batches_module, "stop_workers", lambda it, loader: stopped.append(loader))
    loader = DataLoader(torch.arange(8), batch_size=2)
    windows = _windows(batches_module.GivenLoader(loader).epoch(0, start=1), 1)
    assert next(windows)[0].tolist() == [2, 3]
    windows.close()
    assert stopped == [loader]


class FailsAt:
    """A batch source whose batch `bad` fails to load."""

    def __init__(self, bad):
        self.bad = bad

    def __len__(self):
        return 4

    def epoch(self, epoch, start=0):
        for k in range(start, 4):
            if k == self.bad:
                raise ValueError(f"batch {k} is corrupt")
            yield (torch.tensor([k]),)


def test_prefetcher_raises_a_load_error_at_the_batch_that_failed(monkeypatch):
    from nbtrain.data.prefetch import CudaPrefetcher
    streams = FakeStreams(monkeypatch, describe=lambda t: f"batch {int(t[0])}")
    batches = CudaPrefetcher(FailsAt(bad=2), streams.move, torch.device("cuda")).epoch(0)
    assert [int(next(batches)[0]) for _ in range(2)] == [0, 1]   # batch 1 still trains
    with pytest.raises(ValueError, match="batch 2 is corrupt"):
        next(batches)


class ThreadsSeen(nn.Linear):
    """Records torch's intra-op thread count while it trains."""

    def __init__(self):
        super().__init__(1, 1)
        self.threads = set()

    def forward(self, x):
        self.threads.add(torch.get_num_threads())
        return super().forward(x)


@pytest.mark.parametrize("torch_threads", [3], indirect=True)
@pytest.mark.parametrize("workers, asked, during", [(2, "auto", 2), (0, "auto", 3), (0, 2, 2)])
def test_training_threads_leave_the_cores_to_workers(monkeypatch, torch_threads,
                                                     workers, asked, during):
    monkeypatch.setattr("nbtrain.auto.devices.available_cores", lambda: 4)
    model = ThreadsSeen()
    run = nt.fit(model, Squares(), F.mse_loss, progress=False,
                 config=quick(max_steps=3, num_workers=workers, num_threads=asked,
                              count_flops=False))   # the count runs before training
    assert model.threads == {during} and run.resolved["num_threads"][0] == during
    assert torch.get_num_threads() == 3   # the notebook's setting is back
    if workers:
        assert run.resolved["num_threads"][1] == \
            "2 worker process(es) load on the other cores: training keeps 2 of 4"


class FreezeSeen(torch.utils.data.Dataset):
    """Each sample: how many objects the worker that loads it found frozen."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import gc
        return torch.tensor(gc.get_freeze_count())


@pytest.mark.parametrize("watched", [False, True])
def test_loader_workers_never_collect_the_parents_garbage(watched):
    """A forked worker's collector could free a CUDA tensor that was garbage in the parent
    (and one used on the prefetcher's stream calls CUDA as it is freed: the worker
    aborts). The workers nbtrain starts freeze what they inherit; the parent's collector
    is left as it was."""
    import gc
    from torch.utils.data import DataLoader
    from nbtrain.data.batches import stopping_workers
    loader = DataLoader(FreezeSeen(), batch_size=2, num_workers=1,
                        multiprocessing_context="fork")
    before = gc.get_freeze_count()   # not always 0: torch 2.11's CUDA build froze 375
    if watched:
        with nt.watch(progress=False, store=False, optimize=False):
            frozen = [int(b.min()) for b in loader]
    else:
        frozen = [int(b.min()) for b in stopping_workers(loader)]
    assert min(frozen) > before + 1000 and gc.get_freeze_count() == before
    assert [int(b.min()) for b in loader] == [before] * 2   # a loader nbtrain does not start


def _abort_as_the_worker_exits(worker_id):
    import multiprocessing.util   # a finalizer runs as the process ends, after its last batch
    multiprocessing.util.Finalize(None, os._exit, args=(3,), exitpriority=0)


def test_a_worker_dying_as_it_is_stopped_leaves_a_finished_run_finished():
    """torch raises from its SIGCHLD handler when a worker dies while being stopped (seen
    in CI: a spawned worker aborted on its way out); the batches were used, the run is done."""
    x = torch.randn(64, 4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1)),
                                         batch_size=8, num_workers=1, prefetch_factor=2,
                                         multiprocessing_context="fork",
                                         worker_init_fn=_abort_as_the_worker_exits)
    model = nn.Linear(4, 1)
    with pytest.warns(RuntimeWarning, match=r"DataLoader worker .* exited unexpectedly.*the run is unaffected"):
        run = nt.fit(model, loader, lambda out, y: F.mse_loss(out.squeeze(1), y),
                     config=quick(max_steps=3), progress=False)   # stopped mid-epoch
    assert run.state == "finished" and run.step == 3
