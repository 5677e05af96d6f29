"""What the GPU toggles really do on a CUDA device. Skipped without one; bench/gpu.sh runs
them on the GPU machine."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.config import TrainConfig
from nbtrain.data import make_batches

from conftest import mlp, quick

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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
    from nbtrain import telemetry
    device = torch.device("cuda", torch.cuda.current_device())
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)   # 256 MiB held here
    fields = telemetry.nvml_fields(device)
    assert fields["nvml_used_mb"] >= torch.cuda.memory_reserved(device) / 2**20
    assert fields["nvml_total_mb"] * 2**20 == pytest.approx(
        torch.cuda.get_device_properties(device).total_memory, rel=0.05)
    del block
