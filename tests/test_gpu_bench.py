"""The arithmetic bench/gpu.py reads a GPU timeline with: checked here, since the bench
itself runs only on a GPU machine."""
import importlib.util
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location(
    "gpu_bench", Path(__file__).parents[1] / "bench" / "gpu.py")
gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu)
Span = gpu.Span


def test_interval_union_and_overlap():
    assert gpu.merged([(5, 8), (0, 3), (2, 4), (8, 9)]) == [[0, 4], [5, 9]]
    assert gpu.covered([(0, 10), (5, 15), (20, 21)]) == 16
    assert gpu.overlap([(0, 10), (20, 30)], [(5, 25), (8, 9)]) == 10
    assert gpu.overlap([(0, 1)], []) == 0


def three_steps(*copies):
    """Steps end at 10, 20, 30 ns: compute [10k+2, 10k+8], then AdamW [10k+8, 10k+10]."""
    spans = []
    for k in range(3):
        spans += [Span("kernel", "conv", 10 * k + 2, 10 * k + 8, 0),
                  Span("kernel", "FusedAdamMathFunctor", 10 * k + 8, 10 * k + 10, 0)]
    return spans + list(copies)


def test_timeline_of_the_steady_steps():
    mib2 = 2 * 2**20
    spans = three_steps(
        Span("copy", "Memcpy HtoD (Pinned -> Device)", 15, 19, mib2),   # before the window
        Span("copy", "Memcpy HtoD (Pinned -> Device)", 20, 24, mib2),   # half under a kernel
        Span("copy", "Memcpy HtoD (Pinned -> Device)", 25, 29, mib2),   # wholly under one
        Span("copy", "Memcpy HtoD (Pinned -> Device)", 21, 22, 64),     # targets: too small
        Span("copy", "Memcpy DtoH (Device -> Pinned)", 21, 29, mib2))   # not a batch copy
    t = gpu.timeline(spans, skip=1)            # window: end of step 1 to end of step 2
    assert t["step_ms"] == pytest.approx(10 / 1e6)
    assert t["idle"] == pytest.approx(0.2)     # kernels cover [22, 30] of [20, 30]
    assert t["copy_gib_s"] == pytest.approx(2 * mib2 / 8e-9 / 2**30)
    assert t["copy_overlap"] == pytest.approx(6 / 8)


def test_timeline_without_copies_or_optimizer_kernels():
    t = gpu.timeline([Span("kernel", "gemm", 0, 6, 0), Span("memset", "Memset", 8, 10, 0)])
    assert t["idle"] == pytest.approx(0.2) and t["step_ms"] == pytest.approx(10 / 1e6)
    assert t["copy_gib_s"] is None and t["copy_overlap"] is None


def test_device_spans_reads_a_real_profile():
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert gpu.device_spans(prof) == []   # host ops are not GPU spans


# -- the checks bench/gpu.sh collects into its one table ---------------------------------------
def test_checks_are_collected_into_one_table(monkeypatch, tmp_path, capsys):
    path = tmp_path / "checks.jsonl"
    monkeypatch.setenv("NBTRAIN_BENCH_CHECKS", str(path))
    gpu.check("GPU idle with the prefetcher", "3.0%", "<= 5%", True)
    gpu.check("syncs per step, default path", "1.00", "<= 0.2", False)
    gpu.check("amp bf16 over tf32", "2.10x", "NVIDIA: 2.63x", None)
    assert "GPU idle with the prefetcher: 3.0% (target: <= 5%): met" in capsys.readouterr().out
    table = gpu.summary(str(path)).splitlines()
    assert table[:2] == ["| check | value | target | verdict |", "|---|---|---|---|"]
    assert table[2] == "| GPU idle with the prefetcher | 3.0% | <= 5% | met |"
    assert table[3].endswith("| MISSED |") and table[4].endswith("| - |")
    assert table[-1] == "3 checks, 1 missed"


def test_own_split_reads_the_records_after_the_warm_up():
    from types import SimpleNamespace
    records = [dict(data_wait_frac=0.9, copy_frac=0.9, host_fetch_s=0.9, step_time_s=1.0, mfu=0.1),
               dict(data_wait_frac=0.1, copy_frac=0.2, host_fetch_s=0.3, step_time_s=1.0, mfu=0.4,
                    diagnosis="copy-bound: 20%")]
    split = gpu.own_split(SimpleNamespace(records=lambda kind: records))
    assert split == {"data_wait": 0.1, "copy": 0.2, "host_fetch": 0.3, "mfu": 0.4,
                     "diagnosis": "copy-bound: 20%"}


def load_bench(name, monkeypatch):
    bench = Path(__file__).parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))   # as when run as a script: `from gpu import check`
    spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fp32_math_of_a_precision_case_is_put_back(monkeypatch):
    mfu = load_bench("gpu_mfu", monkeypatch)
    from nbtrain.auto.flops import _fp32_runs_tf32
    before = (_fp32_runs_tf32("matmul"), _fp32_runs_tf32("conv"))
    with mfu.fp32_math(True):
        assert _fp32_runs_tf32("matmul") and _fp32_runs_tf32("conv")
    with mfu.fp32_math(False):
        assert not _fp32_runs_tf32("matmul") and not _fp32_runs_tf32("conv")
    assert (_fp32_runs_tf32("matmul"), _fp32_runs_tf32("conv")) == before


def test_the_own_loop_bench_refuses_cuda_without_a_gpu(monkeypatch):
    own_loop = load_bench("own_loop", monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        own_loop.main(["--device", "cuda"])



def test_trace_spans_reads_kinetos_categories_and_bytes():
    """What the profiler's exported trace holds of a GPU step (Kineto's own names)."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 5.0},
        {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 10.5, "dur": 2.25},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 20.0,
         "dur": 100.0, "args": {"bytes": 6291456, "memory bandwidth (GB/s)": 62.9}},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 30.0, "dur": 1.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "Optimizer.step#AdamW.step",
         "ts": 40.0, "dur": 9.0},
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 10.5}]
    assert gpu.trace_spans(events) == [
        Span("kernel", "sm90_gemm", 10500, 12750, 0),
        Span("copy", "Memcpy HtoD (Pinned -> Device)", 20000, 120000, 6291456),
        Span("memset", "Memset (Device)", 30000, 31000, 0)]


# -- F4: the prefetcher's copies against a plain-torch side-stream reference -------------------
MIB2 = 2 * 2**20
PINNED, PAGEABLE = "Memcpy HtoD (Pinned -> Device)", "Memcpy HtoD (Pageable -> Device)"


def test_batch_copies_split_into_those_under_a_kernel_and_those_alone():
    # the window [20, 30]: kernels cover [22, 30]; [20, 22] is idle
    spans = three_steps(Span("copy", PINNED, 20, 22, MIB2),    # alone: ends as a kernel starts
                        Span("copy", PINNED, 23, 27, MIB2),    # under a kernel
                        Span("copy", PINNED, 21, 25, MIB2))    # partly under one: under
    under, alone = gpu.split_by_overlap(spans[-3:], [(22, 30)])
    assert under == spans[-2:] and alone == spans[-3:-2]
    t = gpu.timeline(spans, skip=1)
    assert t["copy_gib_s_alone"] == pytest.approx(MIB2 / 2e-9 / 2**30)
    assert t["copy_gib_s_under_kernel"] == pytest.approx(2 * MIB2 / 8e-9 / 2**30)
    assert t["copy_gib_s"] == pytest.approx(3 * MIB2 / 10e-9 / 2**30)
    assert (t["copies_under_kernel"], t["copies_alone"]) == (2, 1)
    assert gpu.gib_s([]) is None


def test_host_to_device_copies_are_counted_by_kinetos_name():
    spans = three_steps(Span("copy", PINNED, 20, 24, MIB2), Span("copy", PINNED, 25, 29, MIB2),
                        Span("copy", PAGEABLE, 22, 26, MIB2),    # a pageable batch copy
                        Span("copy", PAGEABLE, 21, 22, 4096),    # the targets, pageable
                        Span("copy", PINNED, 11, 19, MIB2),      # before the window
                        Span("copy", "Memcpy DtoH (Device -> Pinned)", 21, 29, MIB2))
    t = gpu.timeline(spans, skip=1)
    assert t["batch_copy_names"] == {PINNED: 2, PAGEABLE: 1}
    assert t["small_copy_names"] == {PAGEABLE: 1}
    assert gpu.names_text(t["batch_copy_names"]) == "Pinned -> Device x2, Pageable -> Device x1"
    assert gpu.names_text(gpu.Counter()) == "-"
    none = gpu.timeline(three_steps(), skip=1)
    assert none["copy_gib_s_alone"] is None and not none["batch_copy_names"]


def test_the_prefetchers_copies_are_checked_against_the_side_stream_reference(monkeypatch,
                                                                               tmp_path):
    monkeypatch.setenv("NBTRAIN_BENCH_CHECKS", str(tmp_path / "checks.jsonl"))
    row = gpu.prefetch_vs_reference({"copy_gib_s": 20.0}, {"copy_gib_s": 25.0})
    assert row["verdict"] == "met" and row["value"].startswith("80% (21.5 vs 26.8 GB/s)")
    row = gpu.prefetch_vs_reference({"copy_gib_s": 19.9}, {"copy_gib_s": 25.0})
    assert row["verdict"] == "MISSED"
    for ahead, reference in (({"copy_gib_s": None}, {"copy_gib_s": 25.0}),
                             ({"copy_gib_s": 20.0}, {"copy_gib_s": None})):
        row = gpu.prefetch_vs_reference(ahead, reference)
        assert (row["value"], row["verdict"]) == ("-", "MISSED")
    assert gpu.copy_share({"copy_gib_s": 10.0}, {"copy_gib_s": 40.0}) == 0.25


def test_the_copy_table_and_the_data_path_checks_read_made_up_timelines(monkeypatch, tmp_path,
                                                                          capsys):
    """What bench/gpu.py prints of its data paths, without a GPU: every field it reads."""
    path = tmp_path / "checks.jsonl"
    monkeypatch.setenv("NBTRAIN_BENCH_CHECKS", str(path))
    own = dict(data_wait=0.01, copy=0.02, host_fetch=0.3, mfu=0.1, diagnosis="fine")
    ahead = {**gpu.timeline(three_steps(Span("copy", PINNED, 23, 27, MIB2)), skip=1), **own}
    reference = gpu.timeline(three_steps(Span("copy", PINNED, 23, 25, MIB2)), skip=1)
    plain = gpu.timeline(three_steps(Span("copy", PAGEABLE, 20, 22, MIB2)), skip=1)
    results = {"plain loop: DataLoader, .cuda()": plain, gpu.PREFETCH: ahead,
               gpu.REFERENCE: reference, "nbtrain, data_on_device": {**gpu.timeline(three_steps(),
                                                                                   skip=1), **own}}
    pinned_gb_s = 1.0 * 2**20 / 1e-9 / 1e9   # 1 MiB a ns, idle
    gpu.copy_table(results, pinned_gb_s)
    gpu.data_path_checks(results, pinned_gb_s)
    out = capsys.readouterr().out
    # 2 MiB in 4 ns (prefetch), in 2 ns (the reference, and the plain loop's alone): GB/s
    assert (f"| {gpu.PREFETCH} | 524288.0 | 524288.0 (1) | - (0) | 50% | 50% | "
            "Pinned -> Device x1 | - |") in out
    assert ("| plain loop: DataLoader, .cuda() | 1048576.0 | - (0) | 1048576.0 (1) | 100% | 100% | "
            "Pageable -> Device x1 | - |") in out
    assert "| nbtrain, data_on_device | - | - (0) | - (0) | - | - | - | - |" in out
    rows = {r["check"]: r for r in map(__import__("json").loads, path.read_text().splitlines())}
    assert rows["prefetched batch copies, share of the side-stream reference's bandwidth"][
        "verdict"] == "MISSED"
    assert rows["batch copies, share of an idle GPU's 256 MiB pinned copy: prefetch / reference"][
        "value"] == "50% / 100%"


def test_the_reference_copies_each_batch_on_a_side_stream_as_torchs_docs_have_it(monkeypatch):
    """The plain-torch reference's stream calls, step by step, on a CPU-only build: the copy
    on the side stream, the compute stream waits for it, the copy recorded on that stream."""
    from conftest import FakeStreams
    streams = FakeStreams(monkeypatch, describe=lambda t: "the batch")
    to = torch.Tensor.to

    def copied(t, *args, **kwargs):
        if args[:1] == ("cuda",):
            streams.log.append(f"copy on {streams.active}, non_blocking={kwargs['non_blocking']}")
            return t.clone()
        return to(t, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "to", copied)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda t: t)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda m: m)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(gpu, "BATCH", 4)
    monkeypatch.setattr(gpu, "PROFILED_STEPS", 3)
    x, y = torch.randint(0, 256, (8, 3, 8, 8), dtype=torch.uint8), torch.randint(0, 10, (8,))
    _, profile_run = gpu.side_stream_path(2, x, y)
    profile_run()
    assert streams.log == ["copy on side, non_blocking=True", "main waits for side",
                           "the batch used on main"] * 3


# -- F6: host syncs counted between one run's first and last step -------------------------------
SYNC = "called a synchronizing CUDA operation"   # c10's warn_or_error_on_sync


@pytest.fixture
def sync_debug_mode(monkeypatch):
    """torch.cuda.set_sync_debug_mode on a CPU-only build (where it raises): the modes set,
    in order; the last is the one in force."""
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    return modes


def syncing_loss(modes):
    """cross_entropy that warns as a sync does while the mode is "warn": one sync a step."""
    import warnings
    from torch.nn import functional as F

    def loss(out, y):
        if modes[-1:] == ["warn"]:
            warnings.warn(SYNC)   # each step's sync
        return F.cross_entropy(out, y)
    return loss


def fitting(loss, data, short_by=0):
    import warnings
    import nbtrain as nt
    from conftest import mlp, quick

    def train(steps):
        def call():
            warnings.warn(SYNC)   # a sync before the run: the setup's, never counted
            nt.fit(mlp(), data, loss, config=quick(max_steps=steps - short_by), progress=False)
        return call
    return train


def test_syncs_are_counted_from_the_first_steps_start_to_the_last_steps_end(sync_debug_mode,
                                                                           blobs):
    import linecache
    from nbtrain.tools.profiling import step_syncs
    found = step_syncs(fitting(syncing_loss(sync_debug_mode), blobs), steps=6)
    assert (found.per_step, found.steps) == (1.0, 6)
    (where, n), = found.sources.items()
    assert n == 6 and "each step's sync" in linecache.getline(*where)
    assert sync_debug_mode == ["warn", "default"]
    later = step_syncs(fitting(syncing_loss(sync_debug_mode), blobs), steps=6, warmup=2)
    assert (later.per_step, later.steps, sum(later.sources.values())) == (1.0, 4, 4)


def test_a_run_that_ends_early_gives_no_syncs_per_step(sync_debug_mode, blobs):
    from nbtrain.tools.profiling import step_syncs
    with pytest.raises(AssertionError, match="did 4 of its 6 steps"):
        step_syncs(fitting(syncing_loss(sync_debug_mode), blobs, short_by=2), steps=6)
    assert sync_debug_mode == ["warn", "default"]   # put back where the run ended
    with pytest.raises(ValueError):
        step_syncs(fitting(syncing_loss(sync_debug_mode), blobs), steps=6, warmup=6)


def test_host_syncs_per_step_keeps_its_float_and_says_where_they_came_from(sync_debug_mode,
                                                                          blobs, capsys):
    from nbtrain.tools.profiling import host_syncs_per_step
    assert host_syncs_per_step(fitting(syncing_loss(sync_debug_mode), blobs), steps=5) == 1.0
    out = capsys.readouterr().out
    assert "1.00 host syncs per step over 5 steps, from tests/test_gpu_bench.py:" in out


def test_the_syncs_of_a_watched_loops_steps_are_counted_too(sync_debug_mode):
    import nbtrain as nt
    from nbtrain.tools.profiling import step_syncs
    loss = syncing_loss(sync_debug_mode)

    def train(steps):
        def call():
            model = torch.nn.Linear(8, 3)
            opt = torch.optim.SGD(model.parameters(), 0.1)
            x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
            with nt.watch(progress=False, optimize=False):
                for _ in range(steps):
                    opt.zero_grad()
                    loss(model(x), y).backward()
                    opt.step()
        return call
    found = step_syncs(train, steps=7)
    assert (found.per_step, sum(found.sources.values())) == (1.0, 7)
