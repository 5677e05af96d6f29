"""The CUDA paths' logic, on any machine (issue 28): a fake CUDA device count, fake streams
and events whose timestamps the test sets (a GPU timeline written out), a prefetcher
whose mover is the identity, the peak chosen for a conv net under TF32. tests/test_cuda.py
runs the same paths on a real GPU (bench/gpu.sh)."""
import contextlib
import sys
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.auto import diagnosis, flops, memory
from nbtrain.parallel import processes as distributed
from nbtrain.parallel import ranks
from nbtrain.train import prepare
from nbtrain.telemetry import sampling, timers as telemetry
from nbtrain.config import TrainConfig
from nbtrain.data import first_batch, make_batches, make_mover
from nbtrain.data.batches import TensorBatches
from nbtrain.data.prefetch import CudaPrefetcher
from nbtrain.run import Run

from conftest import FakeStreams, mlp, quick


# -- stand-ins for torch.cuda on a CPU-only build ----------------------------------------------
class Gpu:
    """A GPU timeline written out by the test: an event records the time the test set for
    it (`at`), as a real one records when its stream reaches it; the host has its clock."""

    def __init__(self, monkeypatch):
        self.t, self.host = 0.0, 0.0   # milliseconds, seconds
        self.events = 0                 # Event objects made
        gpu = self

        class Event:
            def __init__(self, enable_timing=False, **kwargs):
                self.t = None
                gpu.events += 1

            def record(self, stream=None):
                self.t = gpu.t

            def elapsed_time(self, end):
                return end.t - self.t

            def synchronize(self):
                pass
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
        monkeypatch.setattr(telemetry, "time", SimpleNamespace(perf_counter=lambda: self.host))
        monkeypatch.setattr(sampling, "time", SimpleNamespace(perf_counter=lambda: self.host))
        monkeypatch.setattr(sampling, "allocator_fields", lambda device: {})
        monkeypatch.setattr(sampling, "nvml_fields", lambda device: {})

    def at(self, ms: float) -> None:
        self.t = ms


def step(interval, gpu, t0, fetch_s, idle_ms=0.0, copy_wait_ms=None, compute_ms=10.0):
    """One step as the loop times it, the GPU's previous step ending at t0 ms: the host is
    in next() for `fetch_s` (a prefetcher's wait for the copy queued in it, when
    `copy_wait_ms`), then the step's copy markers (around the identity mover) and its
    compute; the GPU idles `idle_ms` before the step's work reaches it. Returns its end."""
    start = t0 + idle_ms
    if copy_wait_ms is not None:
        gpu.at(start)
        interval.wait_started()
        gpu.at(start + copy_wait_ms)
        interval.wait_done()
        start += copy_wait_ms
    interval.data_wait_s += fetch_s
    gpu.at(start)
    interval.copy_started()
    interval.copy_done()
    end = start + compute_ms
    gpu.at(end)
    gpu.host += (end - t0) / 1000
    interval.end_step()
    return end


def record_of(interval):
    interval.close(step=interval.start_step + interval.steps, epoch=0, lr=0.1)
    return interval.flush()


def steady(monkeypatch):
    """A GPU timeline and an Interval past its first step (whose gap no step before
    bounds: its whole fetch counts, as the GPU had nothing queued)."""
    gpu = Gpu(monkeypatch)
    interval = telemetry.Interval(torch.device("cuda", 0), 0)
    end = step(interval, gpu, 0.0, fetch_s=0.001)
    interval.close(step=1, epoch=0, lr=0.1)
    return gpu, interval, end


# -- bug 3: on CUDA the data wait is the GPU's idle time, not the host's -------------------
def test_a_fetch_hidden_behind_queued_work_is_no_data_wait(monkeypatch):
    gpu, interval, end = steady(monkeypatch)
    for _ in range(5):   # the host gathers each batch (4 ms) while the GPU is busy: no gap
        end = step(interval, gpu, end, fetch_s=0.004)
    record = record_of(interval)
    assert record["step_time_s"] == pytest.approx(0.010)
    assert record["data_wait_frac"] == 0.0 and record["host_fetch_s"] == pytest.approx(0.004)
    advice = diagnosis.diagnose(record, {"device": ("cuda:0", ""), "amp": ("bf16", "")})
    assert not advice.startswith("input-bound"), advice


def test_a_gpu_that_idles_while_the_host_fetches_is_input_bound(monkeypatch):
    gpu, interval, end = steady(monkeypatch)
    for _ in range(5):   # a 4 ms fetch the GPU waits for, idle, every step
        end = step(interval, gpu, end, fetch_s=0.004, idle_ms=4.0, compute_ms=6.0)
    record = record_of(interval)
    assert record["data_wait_frac"] == pytest.approx(0.4)
    advice = diagnosis.diagnose(record, {"device": ("cuda:0", ""), "amp": ("bf16", "")})
    assert advice.startswith("input-bound: the GPU sat idle 40% of each step waiting for data")


def test_idle_time_longer_than_the_fetch_is_not_the_datas(monkeypatch):
    """A checkpoint or a record between steps idles the GPU too: only the part of the gap
    the host spent in next() is the data's, and the next interval measures its first gap
    from the last step of the one before."""
    gpu, interval, end = steady(monkeypatch)
    end = step(interval, gpu, end, fetch_s=0.001, idle_ms=20.0)   # 20 ms gap, 1 ms fetch
    record = record_of(interval)
    assert record["data_wait_s"] == pytest.approx(0.001)


def test_timing_events_are_reused_once_read(monkeypatch):
    """CUDA events are made once and recorded again after their interval is read (torch
    pools its own: an event's create and destroy each cost a driver call), and the
    figures stay each interval's own."""
    gpu, interval, end = steady(monkeypatch)
    records = []
    for _ in range(30):   # 30 records of 5 steps: a 3 ms gap, 1 ms of it the fetch
        for _ in range(5):
            end = step(interval, gpu, end, fetch_s=0.001, idle_ms=3.0, compute_ms=7.0)
        records.append(record_of(interval))
    assert gpu.events <= 4 * 5 * 2 + 2, gpu.events   # two intervals' worth, not 600
    assert all(r["data_wait_s"] == pytest.approx(0.001) for r in records)
    assert all(r["compute_s"] == pytest.approx(0.007) for r in records)


# -- bug 2: with prefetch the wait for the copy is copy time --------------------------------
def test_a_prefetched_copy_the_step_waits_for_is_copy_time(monkeypatch):
    gpu, interval, end = steady(monkeypatch)
    for _ in range(5):   # the copy takes 6 ms longer than the 4 ms of compute it overlaps
        end = step(interval, gpu, end, fetch_s=0.0005, copy_wait_ms=6.0, compute_ms=4.0)
    record = record_of(interval)
    assert record["copy_frac"] == pytest.approx(0.6) and record["compute_frac"] == pytest.approx(0.4)
    assert record["data_wait_frac"] == pytest.approx(0.0)   # the GPU waited for the copy, not data
    advice = diagnosis.diagnose(record, {"device": ("cuda:0", ""), "amp": ("bf16", "")})
    assert advice.startswith("copy-bound: 60%"), advice


def test_the_prefetcher_times_its_wait_for_each_copy(monkeypatch):
    streams = FakeStreams(monkeypatch)

    class Markers:
        def wait_started(self):
            streams.log.append("wait started")

        def wait_done(self):
            streams.log.append("wait done")
    x = torch.arange(3)
    prefetcher = CudaPrefetcher(TensorBatches((x,), 1, False, False, 0), lambda b: b,
                                torch.device("cuda"))
    prefetcher.markers = Markers()   # as mark_waits gives it the loop's Interval
    for batch in prefetcher.epoch(0, start=1):
        streams.log.append(f"step on {batch[0].tolist()}")
    assert streams.log == [
        "wait started", "main waits for side", "wait done", "[1] used on main", "step on [1]",
        "wait started", "main waits for side", "wait done", "[2] used on main", "step on [2]"]


def test_the_loop_times_a_prefetchers_waits_and_counts_flops(monkeypatch, blobs):
    """fit with the prefetcher (a CPU run: its mover is the identity here): every batch's
    wait is marked on the loop's Interval, and the FLOP count gets its batch."""
    FakeStreams(monkeypatch)
    monkeypatch.setattr(prepare, "resolve_prefetch", lambda *a: (True, "a test"))
    waits = []
    monkeypatch.setattr(telemetry.HostTimer, "wait_started", lambda self: waits.append(1))
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=6), progress=False)
    assert run.state == "finished" and len(waits) == 6
    assert run.resolved["flops_per_step"][0] > 0


# -- bug 1: the FLOP count and the bf16 probe get the batch on the device --------------------
def test_the_flop_count_gets_the_batch_the_prefetcher_copies(monkeypatch, blobs):
    """The meta device stands in for the GPU: a model there refuses CPU inputs, as a CUDA
    model does."""
    FakeStreams(monkeypatch)
    monkeypatch.setattr(prepare, "resolve_prefetch", lambda *a: (True, "a test"))
    monkeypatch.setattr(flops, "peak_tflops", lambda *a: (1.0, "a test"))
    meta = torch.device("meta")
    run = Run(quick())
    run.resolved.update(data_on_device=(False, ""), pin_memory=(True, ""))
    batches, move = prepare._data_path(run, TensorBatches(blobs, 32, True, False, 0), meta)
    assert isinstance(batches, CudaPrefetcher) and move(blobs) is blobs   # the step's: identity
    model = mlp().to(meta)
    setup = prepare.Setup(meta, "off", batches, None, move, model, F.cross_entropy, [])
    inputs, _ = prepare.load_first_batch(setup)
    assert inputs.is_meta
    counted = flops.resolve(model, F.cross_entropy, lambda: prepare.load_first_batch(setup),
                            "off", meta, 1, 1)
    assert counted["flops_per_step"][0] == flops.flops_per_batch(
        mlp(), F.cross_entropy, (blobs[0][:32], blobs[1][:32]), "off", torch.device("cpu"))


# -- bug 4: a conv net's peak at amp="off" is cuDNN's TF32 -------------------------------------
def conv_net(head: bool = False) -> nn.Module:
    layers = [nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 10, 3, padding=1),
              nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers, *([nn.Linear(10, 10)] if head else []))


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flops, "_COUNTED_BEFORE", {})


def peak_for(model, amp="off", samples=4):
    """flops.resolve for a CUDA run, counted on the CPU (amp="off" needs no CUDA autocast)."""
    batch = (torch.randn(samples, 3, 8, 8), torch.randint(0, 10, (samples,)))
    return flops.resolve(model, F.cross_entropy, lambda: batch, amp, torch.device("cuda", 0), 1, 1)


def test_a_conv_nets_peak_at_amp_off_is_tf32(h200):
    assert peak_for(conv_net())["peak_tflops"][0] == 494.5   # H200 TF32 dense, not FP32's 67
    assert peak_for(mlp_on_images())["peak_tflops"][0] == 67.0   # matmuls: fp32 ('highest')
    assert flops.run_peak(torch.device("cuda", 0), "bf16", 1, 1.0)[0] == 989.5


def mlp_on_images() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))


def test_a_mixed_net_gets_the_peak_its_flops_would_run_at(h200):
    model = conv_net(head=True)
    batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))
    flops.flops_per_batch(model, F.cross_entropy, batch, "off", torch.device("cpu"))
    share = flops.conv_share(model, F.cross_entropy, batch, "off")
    assert 0.9 < share < 1.0
    value, why = peak_for(model)["peak_tflops"]
    assert value == pytest.approx(1 / (share / 494.5 + (1 - share) / 67.0))
    assert "convolutions at tf32" in why and "fp32" in why


def test_cudnn_set_to_full_fp32_gives_the_fp32_peak(h200):
    if not hasattr(torch.backends.cudnn, "conv"):
        pytest.skip("torch < 2.9: no per-op fp32_precision")
    conv = torch.backends.cudnn.conv
    before, conv.fp32_precision = conv.fp32_precision, "ieee"
    try:
        assert peak_for(conv_net())["peak_tflops"][0] == 67.0
    finally:
        conv.fp32_precision = before


# -- bug 5: processes="auto" with device="cuda:N" ------------------------------------------------
@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_auto_processes_with_one_gpu_named_is_one_process_on_it(four_gpus):
    run = Run(TrainConfig(processes="auto", device="cuda:2"))
    assert distributed.resolve_processes(run) == 1
    assert "names one GPU" in run.resolved["processes"][1]
    assert distributed.resolve_processes(Run(TrainConfig(processes="auto", device="cuda"))) == 4


def test_fasttrain_processes_auto_is_every_gpu_as_fits(four_gpus):
    from nbtrain.cell_ranks import processes_for
    assert processes_for("auto") == 4 and processes_for("2") == 2


class Joined(Exception):
    """Ends run_rank right after the step a test watches."""


def rank_until(monkeypatch, log, cfg, join=None, new_group=None):
    monkeypatch.setattr(ranks, "resolve_device",
                        lambda requested: log.append("resolve_device") or (torch.device("cuda", 1), ""))
    monkeypatch.setattr(ranks, "_share_cores", lambda cfg, world: 1)
    if new_group is not None:
        monkeypatch.setattr(ranks.dist, "new_group", new_group)
    blob = ranks.pack(dict(config=cfg, timeout_s=42.0, env={}))
    messages = SimpleNamespace(put=lambda message: log.append(message[0]))
    return ranks.run_rank(1, 2, blob, messages, None, join)


def test_a_rank_sets_its_gpu_before_it_resolves_the_device(four_gpus, monkeypatch):
    log = []

    def join(cfg, device, timeout_s):
        log.append(f"join {device.type}")
        raise Joined()
    assert isinstance(rank_until(monkeypatch, log, TrainConfig(device="auto"), join), Joined)
    assert log == ["join cuda", "failed"]   # nothing asked for the current GPU before


def test_the_stop_groups_timeout_is_the_ranks(four_gpus, monkeypatch):
    log, asked = [], {}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)

    def new_group(**kwargs):
        asked.update(kwargs)
        raise Joined()
    rank_until(monkeypatch, log, TrainConfig(device="cuda"), lambda *a: "nccl", new_group)
    assert asked == {"backend": "gloo", "timeout": timedelta(seconds=42.0)}


def test_a_rank_refuses_a_gpu_that_is_not_its_own(four_gpus, monkeypatch):
    log = []   # cuda:1 resolved, while set_device gave this rank GPU 0
    error = rank_until(monkeypatch, log, TrainConfig(device="cuda"), lambda *a: "nccl")
    assert isinstance(error, nt.ConfigError) and "not on its own GPU cuda:0" in str(error)


# -- bug 6: batch objects that move themselves, on the side stream ----------------------------
class Graph:
    """A batch class that moves itself, as PyG's Data does (its tensors in a mapping)."""
    calls = []

    def __init__(self, x, edges):
        self.store = {"x": x, "edges": edges}

    def to(self, device, non_blocking=False):
        Graph.calls.append(non_blocking)
        return Graph(*(t.to(device, non_blocking=non_blocking) for t in self.store.values()))


class GraphBatches:
    def __len__(self):
        return 2

    def epoch(self, epoch, start=0):   # sizes 1, 2, 3: the graph's x and edges, the label
        for k in range(start, 2):
            yield Graph(torch.zeros(1), torch.zeros(2)), torch.zeros(3)


def test_objects_that_move_themselves_are_copied_non_blocking_and_marked_used(monkeypatch):
    """The meta device stands in for the GPU: record_stream takes device tensors only."""
    streams = FakeStreams(monkeypatch)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, s: streams.log.append(f"{t.device.type} {len(t)} used on {s.name}"))
    Graph.calls.clear()
    move = make_mover(torch.device("meta"), pinned=True, resident=False, channels_last=False)
    batches = list(CudaPrefetcher(GraphBatches(), move, torch.device("cuda")).epoch(0))
    assert len(batches) == 2 and Graph.calls == [True, True]
    used = [line for line in streams.log if "used on main" in line]
    assert used == ["meta 1 used on main", "meta 2 used on main", "meta 3 used on main"] * 2


def test_a_to_without_non_blocking_is_called_without_it():
    class Plain:
        def to(self, device):
            return "moved"
    move = make_mover(torch.device("meta"), pinned=True, resident=False, channels_last=False)
    assert move((Plain(), "label")) == ("moved", "label")


def test_a_cpu_run_does_not_walk_its_batches():
    """A CPU run's batches are on the CPU already: the step's mover returns them as they
    are (the same objects), with no per-step walk; channels_last still converts."""
    batch = (torch.zeros(2, 3), {"y": torch.zeros(2)})
    assert make_mover(torch.device("cpu"), False, False, False)(batch) is batch
    image = torch.zeros(2, 3, 4, 4)
    moved = make_mover(torch.device("cpu"), False, False, True)((image,))[0]
    assert moved.is_contiguous(memory_format=torch.channels_last)


@dataclass
class Pair:
    a: torch.Tensor
    b: list


class Slotted:
    __slots__ = ("t", "me")

    def __init__(self, t):
        self.t, self.me = t, self   # a cycle: visited once


def test_held_tensors_finds_device_tensors_inside_objects_once():
    from nbtrain.data.nested import held_tensors
    x, y, z = (torch.empty(n, device="meta") for n in (1, 2, 3))
    host = torch.zeros(4)   # kept on the host by its object: no stream's
    found = held_tensors({"pair": Pair(x, [y, "text", 3, host]), "slots": Slotted(z), "n": None,
                          "plain": torch.zeros(5)})
    assert [len(t) for t in found] == [1, 2, 3, 5]


# -- resident channels_last images: laid out once, not every step ------------------------------
@pytest.mark.parametrize("shuffle", [True, False])
def test_resident_images_are_laid_out_channels_last_once(shuffle):
    images, labels = torch.randn(16, 3, 4, 4), torch.randint(0, 3, (16,))
    cfg = TrainConfig(data_on_device=True, channels_last=True, shuffle=shuffle, batch_size=4)
    resolved, meta = {}, torch.device("meta")   # meta: a device the data is copied to
    source = make_batches((images, labels), cfg, meta, resolved)
    assert resolved["data_on_device"][0] is True
    batch = next(iter(source.epoch(0)))
    assert batch[0].is_meta and batch[0].is_contiguous(memory_format=torch.channels_last)
    move = make_mover(meta, pinned=False, resident=True, channels_last=True)
    assert move(batch)[0] is batch[0]   # nothing left to convert in the step


# -- memory: the allocator read once, the run's own device, room for the optimizer -------------
def test_allocator_fields_read_the_stats_once(monkeypatch):
    calls = []
    stats = {"allocated_bytes.all.current": 2**20, "reserved_bytes.all.current": 3 * 2**20,
             "allocated_bytes.all.peak": 4 * 2**20}

    def memory_stats(device=None):
        calls.append(device)
        return stats
    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    monkeypatch.setattr(torch.cuda.memory, "memory_stats", memory_stats)
    fields = sampling.allocator_fields(torch.device("cuda", 0))
    assert fields == {"cuda_allocated_mb": 1.0, "cuda_reserved_mb": 3.0, "cuda_peak_allocated_mb": 4.0}
    assert len(calls) == 1


def test_nvml_finds_a_mig_instance_and_keeps_the_fields_it_reports(monkeypatch):
    class NotSupported(Exception):
        pass

    def by_uuid(name):
        if name != "MIG-0b1c":
            raise NotSupported(name)
        return "the MIG handle"

    def unsupported(handle):
        raise NotSupported("not on a MIG instance")
    fake = SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByUUID=by_uuid,
                           nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=2**20, total=2**30),
                           nvmlDeviceGetUtilizationRates=unsupported, nvmlDeviceGetPowerUsage=unsupported)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(sampling, "_nvml_handles", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid="0b1c"))
    fields = sampling.nvml_fields(torch.device("cuda", 0))
    assert fields == {"nvml_used_mb": 1.0, "nvml_total_mb": 1024.0}


def test_release_reads_the_memory_of_the_runs_device(monkeypatch, blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=2), progress=False)
    run.resolved["device"] = ("cuda:1", "as if it had trained there")
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: asked.append(device) or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    run.release()
    assert asked == [torch.device("cuda", 1)] * 2


def test_max_batch_size_leaves_room_for_the_optimizers_state(monkeypatch):
    held = [0]

    @contextlib.contextmanager
    def hold(device, nbytes):   # on a GPU: that much memory taken during the trials
        held[0] = nbytes
        try:
            yield
        finally:
            held[0] = 0
    monkeypatch.setattr(memory, "_held", hold, raising=False)

    class RunsOut(nn.Linear):
        """A device of 1000 bytes, a sample costing 1 byte."""

        def forward(self, x):
            if x.shape[0] + held[0] > 1000:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return super().forward(x)
    data = (torch.randn(100, 8), torch.randint(0, 3, (100,)))
    adamw = 2 * (8 * 3 + 3) * 4   # exp_avg and exp_avg_sq of the weights, fp32
    assert nt.max_batch_size(RunsOut(8, 3), data, F.cross_entropy, config=quick()) == 1000 - adamw


def test_room_to_keep_counts_state_by_optimizer_and_the_data_the_run_copies():
    model, data = nn.Linear(8, 3), (torch.randn(100, 8), torch.zeros(100, dtype=torch.long))
    weights, data_bytes = (8 * 3 + 3) * 4, 100 * 8 * 4 + 100 * 8
    meta = torch.device("meta")

    def room(**settings):
        return memory.room_to_keep(model, TrainConfig(**settings), data, meta)
    assert room(optimizer="adamw", data_on_device=False) == 2 * weights
    assert room(optimizer="sgd", momentum=0.0, data_on_device=False) == 0
    assert room(optimizer="sgd", data_on_device=False) == weights
    assert room(optimizer="adamw", data_on_device=True) == 2 * weights + data_bytes


# -- the fp16 note ---------------------------------------------------------------------------
COMPUTE_BOUND = {"data_wait_frac": 0.01, "copy_frac": 0.01, "compute_frac": 0.98}


@pytest.mark.parametrize("device, impl, noted", [
    ("cuda:0", "foreach", True), ("cuda:0", "its own", True), ("cuda:0", "fused", False),
    ("cpu", "for-loop", False)])
@pytest.mark.parametrize("loop", ["fit", "your own"])
def test_fp16_without_a_fused_optimizer_is_a_host_read_per_step(monkeypatch, device, impl,
                                                                  noted, loop):
    monkeypatch.setattr(diagnosis, "gpu_has_bf16", lambda device: True)
    advice = diagnosis.diagnose(COMPUTE_BOUND, {"device": (device, ""), "amp": ("fp16", ""),
                                                "optimizer_impl": (impl, ""), "loop": (loop, "")})
    assert ("inf check back to the host every step" in advice) is noted
    if noted:
        assert "optimizer_impl='fused'" in advice and "amp='bf16'" in advice


def test_first_batch_under_a_prefetcher_is_the_sources(monkeypatch, blobs):
    FakeStreams(monkeypatch)
    source = TensorBatches(blobs, 8, False, False, 0)
    prefetcher = CudaPrefetcher(source, lambda batch: "moved", torch.device("cuda"))
    assert torch.equal(first_batch(prefetcher)[0], blobs[0][:8])


def test_the_flop_counts_key_under_a_prefetcher_is_its_sources_shapes(monkeypatch, blobs):
    """A count is kept per model and batch shape: under the prefetcher the shapes are its
    source's, not only how many batches it has (two shapes must not share one count)."""
    FakeStreams(monkeypatch)
    source = TensorBatches(blobs, 32, True, False, 0)
    prefetcher = CudaPrefetcher(source, lambda batch: batch, torch.device("cuda"))
    assert prepare.input_shapes(prefetcher) == prepare.input_shapes(source) != len(source)
