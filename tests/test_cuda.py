"""What the GPU toggles really do on a CUDA device. Skipped without one; bench/gpu.sh runs
them on the GPU machine."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.config import TrainConfig
from nbtrain.data import make_batches
from nbtrain.tools.profiling import host_syncs_per_step

from conftest import mlp, quick

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def nothing_of_cuda_left_to_the_exit():
    """Each test's CUDA objects freed after it, not at the interpreter's exit, where torch's
    CUDA sanitizer (bench/gpu.sh runs these tests under it) may be half torn down."""
    yield
    import gc
    gc.collect()
    torch.cuda.synchronize()


def gpu(**overrides) -> nt.TrainConfig:
    return quick(**{"device": "cuda", "batch_size": 64, **overrides})


class Rows(torch.utils.data.Dataset):   # per-sample: goes through a DataLoader
    def __len__(self):
        return 256

    def __getitem__(self, i):
        return torch.full((8,), float(i)), i % 3


@pytest.mark.parametrize("pin", [True, False])
def test_loader_batches_are_pinned_only_when_asked(pin):
    cfg = TrainConfig(pin_memory=pin, num_workers=0, batched_fetch=False, batch_size=32)
    source = make_batches(Rows(), cfg, torch.device("cuda"), {})
    inputs, _ = next(iter(source.epoch(0)))
    assert inputs.is_pinned() is pin


@pytest.mark.parametrize("shuffle", [True, False])
def test_batched_fetch_gathers_into_pinned_memory(blobs, shuffle):
    resolved = {}
    cfg = TrainConfig(pin_memory="auto", data_on_device=False, shuffle=shuffle, batch_size=64)
    source = make_batches(blobs, cfg, torch.device("cuda"), resolved)
    assert resolved["pin_memory"][0] is True and resolved["batched_fetch"][0] is True
    pinned = next(iter(source.epoch(0)))
    source.pin = False
    plain = next(iter(source.epoch(0)))
    assert all(t.is_pinned() for t in pinned) and not any(t.is_pinned() for t in plain)
    assert all(torch.equal(a, b) for a, b in zip(pinned, plain))


def host_to_device_copies(train) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "Memcpy HtoD" in e.key)


def test_data_on_device_copies_the_data_once_not_every_step(blobs):
    def train(**settings):
        return lambda: nt.fit(mlp(), blobs, F.cross_entropy, progress=False,
                              config=gpu(max_steps=40, **settings))
    resident = host_to_device_copies(train(data_on_device=True))
    per_step = host_to_device_copies(train(data_on_device=False, pin_memory=True))
    assert per_step >= 2 * 40                 # inputs and targets, every step
    assert resident < 20                      # the data and the model, once


def test_prefetched_training_takes_the_same_steps(blobs):
    def weights(prefetch):
        model = mlp()
        nt.fit(model, blobs, F.cross_entropy, progress=False,
               config=gpu(max_steps=30, data_on_device=False, pin_memory=True,
                          prefetch_to_device=prefetch))
        return torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.allclose(weights(True), weights(False), atol=1e-6)


@pytest.mark.parametrize("train_on_device", [True, False])
def test_validation_data_is_moved_by_its_own_settings(blobs, train_on_device):
    # train batches arrive on the GPU already (resident, or prefetched) while validation
    # batches come from a per-sample Dataset in host memory
    run = nt.fit(mlp(), blobs, F.cross_entropy, progress=False, val_data=Rows(),
                 config=gpu(max_steps=16, data_on_device=train_on_device, pin_memory=True,
                            prefetch_to_device=not train_on_device))
    assert run.state == "finished" and len(run.records("val")) == 2


def test_tensors_already_on_the_gpu_are_used_in_place(blobs):
    x, y = (t.cuda() for t in blobs)
    run = nt.fit(mlp(), (x, y), F.cross_entropy, progress=False,
                 config=gpu(max_steps=8, data_on_device=False))
    assert run.resolved["data_on_device"][0] is True and run.resolved["pin_memory"][0] is False


def test_fp16_autocast_runs_in_half_precision_with_a_loss_scaler(blobs):
    model, seen = mlp(), set()
    model[0].register_forward_hook(lambda mod, inp, out: seen.add(out.dtype))
    run = nt.fit(model, blobs, F.cross_entropy, progress=False, config=gpu(amp="fp16", max_steps=5))
    assert seen == {torch.float16} and run.scaler.is_enabled()
    assert model[0].weight.dtype == torch.float32


def test_records_time_the_copy_and_read_the_allocator(blobs):
    run = nt.fit(nn.Linear(8, 3), blobs, F.cross_entropy, progress=False,
                 config=gpu(max_steps=20, data_on_device=False, pin_memory=True,
                            prefetch_to_device=False))
    last = run.records("train")[-1]
    assert last["copy_s"] > 0 and last["compute_s"] > 0
    assert last["cuda_allocated_mb"] > 0 and last["cuda_peak_allocated_mb"] >= last["cuda_allocated_mb"]
    assert run.summary()["settings"]["device"].startswith("cuda")


def test_nvml_reads_the_gpu_this_process_uses():
    pytest.importorskip("pynvml")
    from nbtrain.telemetry import sampling, timers as telemetry
    device = torch.device("cuda", torch.cuda.current_device())
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)   # 256 MiB held here
    fields = sampling.nvml_fields(device)
    assert fields["nvml_used_mb"] >= torch.cuda.memory_reserved(device) / 2**20
    assert fields["nvml_total_mb"] * 2**20 == pytest.approx(
        torch.cuda.get_device_properties(device).total_memory, rel=0.05)
    del block


# -- issue 28: the GPU paths against PyTorch's semantics ---------------------------------------
def cuda_records(run):
    """The train records after the first (which holds the warm-up)."""
    records = run.records("train")
    return records[1:] if len(records) > 1 else records


def test_prefetched_runs_count_their_flops_and_read_an_mfu(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, progress=False,
                 config=gpu(max_steps=20, data_on_device=False, pin_memory=True))
    assert run.resolved["prefetch_to_device"][0] is True
    assert run.resolved["flops_per_step"][0], run.resolved["flops_per_step"][1]
    assert "mfu" in run.records("train")[-1]


def test_prefetched_records_split_the_gpus_time(blobs):
    """Copy-bound and input-bound cases with timings are bench/gpu.py's (timings under the
    sanitizer mean nothing): here the record's shape. On CUDA the data wait is the GPU's
    idle part of the host's fetch."""
    run = nt.fit(mlp(), blobs, F.cross_entropy, progress=False,
                 config=gpu(max_steps=20, data_on_device=False, pin_memory=True))
    for record in cuda_records(run):
        assert 0 <= record["data_wait_s"] <= record["host_fetch_s"] + 1e-9
        assert record["copy_s"] >= 0 and record["compute_s"] > 0


def conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
                         nn.ReLU(), nn.Conv2d(64, 10, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())


def test_a_conv_nets_peak_at_amp_off_is_its_convolutions_tf32():
    x, y = torch.randn(2048, 3, 32, 32), torch.randint(0, 10, (2048,))
    run = nt.fit(conv_net(), (x, y), F.cross_entropy, progress=False,
                 config=gpu(max_steps=20, amp="off", batch_size=256))
    assert "tf32" in run.resolved["peak_tflops"][1]
    assert all(r["mfu"] < 1.0 for r in run.records("train"))


class Batch:
    """A batch that moves itself, its to() taking non_blocking as PyG's Data does."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def to(self, device, non_blocking=False):
        return Batch(self.x.to(device, non_blocking=non_blocking),
                     self.y.to(device, non_blocking=non_blocking))

    def pin_memory(self):   # the DataLoader's pin_memory calls it
        return Batch(self.x.pin_memory(), self.y.pin_memory())

    def __len__(self):   # its samples, for the records
        return len(self.x)


class BatchModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, batch):
        return F.cross_entropy(self.body(batch.x), batch.y)


def test_batches_that_move_themselves_train_the_same_prefetched(blobs):
    x, y = blobs

    def weights(prefetch):
        torch.manual_seed(0)
        model = BatchModel()
        loader = torch.utils.data.DataLoader(
            [Batch(x[i:i + 64], y[i:i + 64]) for i in range(0, 512, 64)], batch_size=None,
            pin_memory=True)
        nt.fit(model, loader, progress=False,
               config=gpu(max_steps=24, prefetch_to_device=prefetch, shuffle=False))
        return torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.allclose(weights(True), weights(False), atol=1e-6)


def test_resident_images_are_channels_last_as_they_arrive():
    images, labels = torch.randn(64, 3, 8, 8), torch.randint(0, 3, (64,))
    cfg = TrainConfig(data_on_device=True, channels_last=True, batch_size=16)
    source = make_batches((images, labels), cfg, torch.device("cuda"), {})
    batch = next(iter(source.epoch(0)))
    assert batch[0].is_cuda and batch[0].is_contiguous(memory_format=torch.channels_last)


def syncs_per_step(blobs, **settings) -> float:
    """Syncs of the steps alone: those of a longer run less those of a shorter one (the
    setup's count and probes are the same in both)."""
    def fit(steps):
        return lambda: nt.fit(mlp(), blobs, F.cross_entropy, progress=False,
                              config=gpu(max_steps=steps, log_every=10, **settings))
    return host_syncs_per_step(fit)


def test_the_default_path_does_not_sync_per_step_and_fp16_unfused_does(blobs):
    assert syncs_per_step(blobs, amp="bf16" if torch.cuda.is_bf16_supported() else "fp16",
                          optimizer="adamw", optimizer_impl="fused") < 0.5
    assert syncs_per_step(blobs, amp="fp16", optimizer="radam") >= 1


def test_release_frees_the_memory_of_the_runs_device(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, progress=False, config=gpu(max_steps=5))
    freed = run.release()
    assert freed["cuda_reserved_freed_mb"] >= 0 and not run.optimizer.state


def test_max_batch_size_keeps_room_for_the_optimizers_state():
    from nbtrain.auto.memory import room_to_keep
    model, data = nn.Linear(1024, 1024), (torch.randn(64, 1024), torch.randint(0, 1024, (64,)))
    cfg = gpu(data_on_device=False)
    assert room_to_keep(model.cuda(), cfg, data, torch.device("cuda", 0)) == 2 * 4 * (1024 * 1024 + 1024)
    assert nt.max_batch_size(model, data, F.cross_entropy, config=cfg, limit=256) == 256


def test_auto_processes_with_one_gpu_named_is_one_process():
    from nbtrain.parallel import processes as distributed
    from nbtrain.run import Run
    run = Run(TrainConfig(processes="auto", device="cuda:0"))
    assert distributed.resolve_processes(run) == 1


def test_the_watch_times_a_loop_on_the_gpu_with_one_event_at_each_steps_start():
    """nt.watch on CUDA: the step's start is one event (no copy span to time), the records
    split the GPU's time, and the loop's own loss reads are counted."""
    model = torch.nn.Linear(16, 4).cuda()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    x, y = torch.randn(64, 16, device="cuda"), torch.randint(0, 4, (64,), device="cuda")
    with nt.watch(progress=False, log_every=5) as run:
        for _ in range(20):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            loss.item()
    records = run.records("train")
    assert run.step == 20 and len(records) == 4
    assert all(r["compute_s"] > 0 and r["copy_s"] == 0 for r in records)
    assert records[-1]["host_reads_per_step"] >= 0.8


# -- nt.watch on CUDA: your loop's copies of its batch, learned over step 1 -----------------
def moving_loop(model, opt, loader, seen, keep_targets_on_cpu=False):
    """The tutorial loop with its own .to(device); notes each batch as the loop gets it;
    with `keep_targets_on_cpu` it also scores against the CPU labels."""
    for xb, yb in loader:
        seen.append((xb, yb))
        out = model(xb.to("cuda", non_blocking=True))
        if keep_targets_on_cpu:
            (out.argmax(1).cpu() == yb).float().mean()   # yb must still be on the CPU
        loss = F.cross_entropy(out, yb.to("cuda"))
        opt.zero_grad()
        loss.backward()
        opt.step()


def cuda_loop_parts(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).cuda()
    opt = torch.optim.AdamW(model.parameters(), 1e-2, foreach=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 8, generator=g), torch.randint(0, 3, (256,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32,
                                         shuffle=True, generator=torch.Generator().manual_seed(2))
    return model, opt, loader


@pytest.mark.parametrize("keep_targets_on_cpu", [False, True])
def test_the_watch_copies_a_loops_batches_ahead_and_its_own_to_gets_them(monkeypatch,
                                                                         keep_targets_on_cpu):
    from nbtrain.data import moves
    handed = []
    take = moves.AheadCopies.take
    monkeypatch.setattr(moves.AheadCopies, "take",
                        lambda self, tensor, *asked: _noting(handed, take, self, tensor, asked))
    originals = (torch.Tensor.to, torch.Tensor.cuda)
    model, opt, loader = cuda_loop_parts()
    seen = []
    with nt.watch(progress=False, amp="off", optimizer_impl="foreach", count_flops=False) as run:
        for _ in range(2):
            moving_loop(model, opt, loader, seen, keep_targets_on_cpu)
    assert run.resolved["prefetch_to_device"][0] is True, run.resolved["prefetch_to_device"]
    assert run.resolved["pin_memory"][0] is True
    # the loop gets its loader's CPU batches, pinned from the third (the batched fetch)
    assert all(xb.device.type == yb.device.type == "cpu" for xb, yb in seen)
    assert all(xb.is_pinned() and yb.is_pinned() for xb, yb in seen[2:])
    # from the third batch each of the loop's .to found the copy made ahead
    found = {key for key, copied in handed if copied}
    assert all(id(xb) in found and id(yb) in found for xb, yb in seen[2:])
    assert not found & {id(t) for pair in seen[:2] for t in pair}
    assert (torch.Tensor.to, torch.Tensor.cuda) == originals
    # the same batches, the same numbers: the weights of the loop unwatched
    plain, plain_opt, plain_loader = cuda_loop_parts()
    for _ in range(2):
        moving_loop(plain, plain_opt, plain_loader, [], keep_targets_on_cpu)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def _noting(handed, take, self, tensor, asked):
    copy = take(self, tensor, *asked)
    handed.append((id(tensor), copy is not None))
    return copy


def test_the_watchs_fp16_with_a_fused_optimizer_does_not_sync_per_step_and_unfused_does():
    """nt.watch(amp='fp16'): the fused AdamW takes the scale and the inf flag in its kernel
    (no found_inf.item()); a foreach one reads the inf check back every step."""
    def watched(impl):
        def train(steps):
            def call():
                model, opt, loader = cuda_loop_parts()
                batches = [(x.cuda(), y.cuda()) for x, y in loader][:8]
                with nt.watch(progress=False, amp="fp16", optimizer_impl=impl,
                              count_flops=False, log_every=10):
                    for step in range(steps):
                        xb, yb = batches[step % len(batches)]
                        opt.zero_grad()
                        F.cross_entropy(model(xb), yb).backward()
                        opt.step()
            return call
        return host_syncs_per_step(train)
    assert watched("fused") < 0.5
    assert watched("foreach") >= 1


@pytest.fixture
def nothing_measured(monkeypatch, tmp_path):
    """No bf16 gain known: none in this process, none on a disk cache of the test's own."""
    from nbtrain.auto import precision
    from nbtrain.machine import gpu_has_bf16
    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(precision, "_BF16_GAINS", {})
    if not gpu_has_bf16(torch.device("cuda")):
        pytest.skip("needs a GPU with native bf16")


def test_amp_auto_measures_bf16_on_the_gpu_too(blobs, nothing_measured):
    """A small model's step is launch-bound on a GPU and autocast's casts are kernels of
    their own: 'auto' is what this model's steps measured (the demo's CNN: 0.80x)."""
    run = nt.fit(mlp(), blobs, F.cross_entropy, progress=False,
                 config=gpu(amp="auto", max_steps=400, data_on_device=True))
    amp, why = run.resolved["amp"]
    assert amp in ("bf16", "off") and "has bf16 units" in why and "measured" in why, why
    assert "not measured" not in why and "earlier" not in why, why


def test_the_watch_measures_bf16_on_the_gpu_on_the_loops_own_steps(nothing_measured):
    """nt.watch on a GPU with bf16 units: 'auto' is the trial's, not bf16 unmeasured (the
    digits CNN ran 1.07-1.23x slower in bf16 on an H200)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)).cuda()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    x, y = torch.randn(2048, 64), torch.randint(0, 4, (2048,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    with nt.watch(progress=False, store=False, count_flops=False) as run:
        for _ in range(200):
            for xb, yb in loader:
                opt.zero_grad()
                F.cross_entropy(model(xb.cuda()), yb.cuda()).backward()
                opt.step()
            if "fp32 until then" not in run.resolved["amp"][1]:
                break
    amp, why = run.resolved["amp"]
    assert "has bf16 units" in why and "measured on your loop's own steps" in why, why
