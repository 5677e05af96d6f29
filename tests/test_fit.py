"""The loop: precision, optimizers, schedules, the step, validation and records."""
import itertools
import json
import math
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain import machine
from nbtrain.train.optim import param_groups

from conftest import mlp, quick


def test_trains_and_validates(blobs):
    x, y = blobs
    run = nt.fit(mlp(), (x, y), F.cross_entropy, config=quick(epochs=3), val_data=(x, y),
                 progress=False)
    assert run.state == "finished" and run.step == run.total_steps == 3 * 16
    s = run.summary()
    assert s["val_acc"] > 0.9 and s["final_loss"] < 0.5
    train = run.records("train")
    for key in ("step", "epoch", "loss", "lr", "samples_per_s", "step_time_s", "data_wait_s",
                "rss_mb"):
        assert key in train[0]
    assert [r["epoch"] for r in run.records("val")] == [0, 1, 2]


@pytest.mark.parametrize("amp, dtype", [("bf16", torch.bfloat16), ("off", torch.float32)])
def test_autocast_really_runs_matmuls_in_the_asked_precision(blobs, amp, dtype):
    model = mlp()
    seen = set()
    model[0].register_forward_hook(lambda mod, inp, out: seen.add(out.dtype))
    run = nt.fit(model, blobs, F.cross_entropy, config=quick(amp=amp, max_steps=3), progress=False)
    assert seen == {dtype}
    assert run.resolved["amp"][0] == amp
    assert model[0].weight.dtype == torch.float32   # master weights stay fp32


def test_amp_auto_measures_bf16_on_a_cpu_that_has_it():
    from nbtrain.machine import cpu_bf16_feature
    model = nn.Sequential(nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 3))
    run = nt.fit(model, (torch.randn(64, 8), torch.randint(0, 3, (64,))), F.cross_entropy,
                 config=quick(amp="auto", max_steps=1, seed=7), progress=False)
    value, why = run.resolved["amp"]
    if not cpu_bf16_feature():
        assert value == "off" and "no bf16" in why
        return
    assert value in ("bf16", "off") and f"CPU has {cpu_bf16_feature()}" in why
    assert "measured" in why, why   # a real measurement, not "could not measure"


def test_the_bf16_measurement_leaves_no_trace():
    from nbtrain.train.prepare import Setup, probe_step
    from nbtrain.data.batches import TensorBatches
    torch.manual_seed(0)
    model = nn.Sequential(nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 3))
    x, y = torch.randn(64, 8) + 3, torch.randint(0, 3, (64,))
    setup = Setup(torch.device("cpu"), "off", TensorBatches((x, y), 32, True, False, 0), None,
                  lambda b: b, model, F.cross_entropy, list(model.parameters()))
    rng, stats = torch.get_rng_state(), model[1].running_mean.clone()
    probe_step(model, setup, "bf16")
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model[1].running_mean, stats)
    assert all(p.grad is None for p in model.parameters())


class TimedSteps:
    """A probe's `step(amp)` on a clock of its own: each call advances it by the next of
    that precision's step times (round again after the last), so a test's timings do not
    depend on this machine."""

    def __init__(self, monkeypatch, fp32_s, bf16_s):
        from nbtrain.auto import precision
        self.now, self.calls = 0.0, 0
        self.times = {"off": itertools.cycle(fp32_s), "bf16": itertools.cycle(bf16_s)}
        monkeypatch.setattr(precision, "time", self)   # measure_bf16_speedup's perf_counter

    def perf_counter(self) -> float:
        return self.now

    def __call__(self, amp: str) -> None:
        self.now += next(self.times[amp])
        self.calls += 1


# a warm-up step, then 8 blocks of a step each precision; two of each swap places: bf16
# 2x faster by the medians, but faster in only 36 of the 64 pairs of blocks
MIXED = ([4e-3] * 5 + [1e-3] * 2 + [4e-3] * 2, [2e-3] * 5 + [5e-3] * 2 + [2e-3] * 2)
# one slow bf16 block of 8: faster still in 56 of the 64 pairs, beyond chance
ONE_SLOW = ([3e-3] * 9, [2e-3] * 8 + [3.5e-3])


@pytest.fixture
def bf16_measured(bf16_cpu, monkeypatch, tmp_path):
    """A CPU with bf16 units whose gain is measured (not given), nothing remembered yet,
    on a disk cache of the test's own, at load 0.5."""
    from nbtrain.auto import precision
    monkeypatch.delenv("NBTRAIN_BF16_GAIN")
    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(precision, "_BF16_GAINS", {})
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    return tmp_path


@pytest.mark.parametrize("fp32, bf16, decisive, faster", [
    ([4e-3], [2e-3], True, True),                        # 2x, every block
    ([2e-3], [3e-3], True, False),                       # slower, every block
    (*MIXED, False, True),
    (*ONE_SLOW, True, True),
])
def test_the_bf16_probe_decides_only_beyond_the_noise_of_its_blocks(
        monkeypatch, fp32, bf16, decisive, faster):
    from nbtrain.auto.precision import measure_bf16_speedup
    from nbtrain.train.prepare import BF16_PROBE_STEPS
    step = TimedSteps(monkeypatch, fp32, bf16)
    verdict = measure_bf16_speedup(step)
    assert verdict.decisive is decisive and (verdict.gain > 1) is faster
    # prepare lets it run where its steps are at most 5% of the run: the demo's 368 steps
    assert step.calls == BF16_PROBE_STEPS <= 0.05 * 368


def test_an_undecided_bf16_gain_keeps_fp32_and_is_measured_again(bf16_measured, monkeypatch):
    from nbtrain.auto.precision import bf16_choice, known_bf16_gain
    step = TimedSteps(monkeypatch, *MIXED)
    amp, why = bf16_choice(step, key="mlp")
    assert amp == "off" and "bf16 against fp32 on this model: no difference beyond the " \
        "noise: fp32 steps took " in why and why.endswith(" ms: fp32 (measured again next run)"), why
    assert "x of fp32" not in why   # undecided: no ratio, which would read like a result
    assert known_bf16_gain("mlp") == (None, "") and not list(bf16_measured.rglob("*.json"))
    bf16_choice(step, key="mlp")
    assert step.calls == 2 * 18   # the second run measured again


def test_a_decided_bf16_gain_is_kept_with_the_load_it_was_measured_under(bf16_measured,
                                                                          monkeypatch):
    from nbtrain.auto import precision
    step = TimedSteps(monkeypatch, [4e-3], [2e-3])
    assert precision.bf16_choice(step, key="cnn") == (
        "bf16", "CPU has avx512_bf16; measured 2.00x faster than fp32 on this model")
    [kept] = bf16_measured.rglob("*.json")
    assert json.loads(kept.read_text())["load"] == 0.5
    monkeypatch.setattr(precision, "_BF16_GAINS", {})   # another process: from the disk
    amp, why = precision.bf16_choice(step, key="cnn")
    assert amp == "bf16" and "measured (earlier, on this machine) 2.00x" in why
    assert step.calls == 18
    monkeypatch.setattr(machine, "load_change_that_counts", lambda: 1.0)   # as on 2 cores
    monkeypatch.setattr(os, "getloadavg", lambda: (1.6, 1.6, 1.6))   # a busier machine now
    assert precision.known_bf16_gain("cnn") == (None, "")
    precision.bf16_choice(step, key="cnn")
    assert step.calls == 2 * 18


def test_a_bf16_gain_kept_without_its_load_is_measured_again(bf16_measured):
    from nbtrain.auto import precision
    kept = precision._gain_file("cnn")   # as written before gains carried their load
    kept.parent.mkdir(parents=True)
    kept.write_text(json.dumps({"gain": 0.52, "key": "'cnn'"}))
    assert precision.known_bf16_gain("cnn") == (None, "")


def test_fp16_uses_a_grad_scaler(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(amp="fp16", max_steps=4),
                 progress=False)
    assert run.scaler.is_enabled() and run.scaler.get_scale() > 0
    assert run.state == "finished"


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "radam", "nadam", "rmsprop", "adagrad"])
def test_every_optimizer_trains(blobs, name):
    model = mlp()
    extra = {"nesterov": True} if name == "sgd" else {}
    run = nt.fit(model, blobs, F.cross_entropy,
                 config=quick(optimizer=name, epochs=2, weight_decay=0.01, **extra), progress=False)
    first, last = run.records("train")[0]["loss"], run.records("train")[-1]["loss"]
    assert last < first
    assert type(run.optimizer).__name__.lower() == name


def test_fused_kernel_where_the_device_has_one(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(optimizer="adamw", max_steps=1),
                 progress=False)
    assert run.resolved["optimizer_impl"][0] == "fused"
    assert run.optimizer.defaults["fused"] is True


def test_no_weight_decay_on_biases_and_norm_weights():
    model = mlp()
    groups = param_groups(model, nt.TrainConfig(weight_decay=0.1))
    decayed = {id(p) for p in groups[0]["params"]}
    assert decayed == {id(model[0].weight), id(model[4].weight)}
    assert groups[1]["weight_decay"] == 0.0
    assert id(model[1].weight) in {id(p) for p in groups[1]["params"]}   # LayerNorm scale
    everything = param_groups(model, nt.TrainConfig(weight_decay=0.1, decay_norm_and_bias=True))
    assert len(everything) == 1


@pytest.mark.parametrize("scheduler", ["constant", "linear", "cosine", "step", "exponential",
                                       "onecycle", "cyclic", "plateau"])
def test_preview_is_exactly_what_the_run_applies(blobs, scheduler):
    cfg = quick(max_steps=40, scheduler=scheduler, warmup_steps=5, log_every=1, lr=0.05,
                min_lr=0.001, step_size=10, gamma=0.9, cycle_steps=12)
    val_data = blobs if scheduler == "plateau" else None   # plateau needs it
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=cfg, val_data=val_data, progress=False,
                 background=True)
    run.wait()
    applied = [r["lr"] for r in run.records("train")]
    assert applied == nt.schedule_preview(cfg, 40)


def test_schedule_shapes():
    cfg = nt.TrainConfig(lr=1.0, scheduler="cosine", warmup_steps=10, min_lr=0.1)
    lrs = nt.schedule_preview(cfg, 110)
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)   # warmup
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))                 # cosine falls
    cyc = nt.schedule_preview(nt.TrainConfig(lr=1.0, scheduler="cyclic", cycle_steps=10), 20)
    assert cyc[5] == pytest.approx(1.0) and cyc[10] == pytest.approx(0.0)
    one = nt.schedule_preview(nt.TrainConfig(lr=1.0, scheduler="onecycle"), 100)
    assert one[0] == pytest.approx(1 / 25) and max(one) == pytest.approx(1.0)
    assert one[-1] == pytest.approx(1 / 25 / 1e4)


def test_plateau_cuts_lr_when_validation_stalls(blobs):
    x, y = blobs
    cfg = quick(epochs=6, scheduler="plateau", plateau_patience=0, plateau_factor=0.5, lr=1e-6)
    run = nt.fit(mlp(), (x, y), F.cross_entropy, config=cfg, val_data=(x[:64] * 0, y[:64]),
                 progress=False)
    assert run.schedule.plateau_scale < 1.0


def test_plateau_without_validation_data_is_refused_before_training(blobs):
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(nt.ConfigError, match="scheduler='plateau' .* no val_data") as err:
        nt.fit(model, blobs, F.cross_entropy, config=quick(epochs=2, scheduler="plateau"),
               progress=False)
    assert err.value.field == "scheduler"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_grad_accumulation_matches_the_big_batch(blobs):
    def train(batch_size, accum):
        torch.manual_seed(0)
        model = nn.Linear(8, 3)
        cfg = quick(batch_size=batch_size, grad_accum_steps=accum, optimizer="sgd",
                    momentum=0.0, shuffle=False, max_steps=8)
        nt.fit(model, blobs, F.cross_entropy, config=cfg, progress=False)
        return model.weight.detach()
    torch.testing.assert_close(train(64, 1), train(16, 4), rtol=1e-5, atol=1e-6)


def test_clip_grad_norm_bounds_the_update(blobs):
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = quick(optimizer="sgd", momentum=0.0, lr=1.0, clip_grad_norm=0.01, max_steps=1)
    nt.fit(model, blobs, F.cross_entropy, config=cfg, progress=False)
    moved = torch.sqrt(sum(((p - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert moved.item() == pytest.approx(0.01, rel=1e-3)


def test_channels_last(blobs):
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    seen = []
    model[0].register_forward_pre_hook(lambda m, inp: seen.append(
        inp[0].is_contiguous(memory_format=torch.channels_last)))
    x = torch.randn(64, 1, 8, 8)
    y = torch.randint(0, 3, (64,))
    nt.fit(model, (x, y), F.cross_entropy, config=quick(channels_last=True, max_steps=2),
           progress=False)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert seen and all(seen)


def test_model_returning_its_own_loss(blobs):
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, batch):
            x, y = batch
            return {"loss": F.cross_entropy(self.net(x), y)}
    run = nt.fit(WithLoss(), blobs, None, config=quick(epochs=2), progress=False)
    assert run.records("train")[-1]["loss"] < run.records("train")[0]["loss"]


def test_accepts_dataset_and_dataloader(blobs):
    x, y = blobs
    ds = torch.utils.data.TensorDataset(x, y)
    run = nt.fit(mlp(), ds, F.cross_entropy, config=quick(max_steps=3), progress=False)
    assert run.resolved["batched_fetch"][0] is True
    loader = torch.utils.data.DataLoader(ds, batch_size=16)
    run = nt.fit(mlp(), loader, F.cross_entropy, config=quick(epochs=1), progress=False)
    assert run.total_steps == 32
    assert "your DataLoader" in run.resolved["num_workers"][1]


def test_history_fields_are_plain_numbers(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=10), progress=False)
    for record in run.history:
        for value in record.values():
            assert isinstance(value, (int, float, str)), record


def test_compile_when_asked():
    pytest.importorskip("torch._dynamo")
    model = nn.Linear(8, 3)
    run = nt.fit(model, (torch.randn(32, 8), torch.randint(0, 3, (32,))), F.cross_entropy,
                 config=quick(compile=True, max_steps=2, log_every=1), progress=False)
    assert run.state == "finished"
    assert math.isfinite(run.records("train")[-1]["loss"])
    assert run.resolved["compiles"][0] >= 1   # torch._dynamo's own count, read at the end
    assert "compile_warmup_s" in run.summary() and "warm-up" in run.summary_text()
    # the first compile happens in the setup, timed: step 1 does not wait for it
    assert run.resolved["compile_warmup_s"][0] > 0
    assert "compile and its check" in run.resolved["setup_s"][1]
    # 2 steps do not pay for timing compiled against eager: said, not measured
    assert "not timed against eager" in run.resolved["compile"][1]


def test_validation_runs_the_model_once_per_batch_without_a_loss_fn(blobs):
    class CountsCalls(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.calls = mlp(), 0

        def forward(self, batch):
            self.calls += 1
            x, y = batch
            return F.cross_entropy(self.net(x), y)
    model = CountsCalls()
    run = nt.fit(model, blobs, None, config=quick(epochs=1), val_data=blobs, progress=False)
    # 16 train steps + 16 validation batches + the FLOP count's one forward before step 1
    assert model.calls == run.step + 512 // 32 + 1


@pytest.mark.parametrize("capability, auto", [((7, 5), "fp16"), ((8, 0), "bf16")])
def test_gpu_amp_counts_only_native_bf16(monkeypatch, capability, auto):
    # torch.cuda.is_bf16_supported() says yes on a T4 (7.5), where bf16 is emulated and slow
    from nbtrain.auto.precision import resolve_amp
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    cuda = torch.device("cuda", 0)
    assert resolve_amp("auto", cuda)[0] == auto
    if auto == "fp16":   # asked for, emulated bf16 runs, and says so; with no bf16 at all, no
        assert resolve_amp("bf16", cuda) == ("bf16", "asked for (emulated on this GPU: "
                                                     "usually slower than fp16)")
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
        with pytest.raises(nt.ConfigError, match="amp='bf16' is not supported by this GPU"):
            resolve_amp("bf16", cuda)


@pytest.mark.parametrize("version, impl", [("2.6.0+cu124", "foreach"), ("2.11.0+cu130", "fused")])
def test_fused_adagrad_on_cuda_only_where_torch_has_the_kernel(monkeypatch, version, impl):
    from nbtrain.train.optim import resolve_impl
    monkeypatch.setattr(torch, "__version__", version)
    assert resolve_impl(nt.TrainConfig(optimizer="adagrad"), torch.device("cuda", 0))[0] == impl


def test_the_rank_test_counts_every_order_of_the_blocks():
    from nbtrain.auto.precision import _u_counts, blocks_decisive
    assert _u_counts(3, 3) == (1, 1, 2, 3, 3, 3, 3, 2, 1, 1)      # 20 orders
    assert sum(_u_counts(8, 8)) == 12870                          # C(16, 8)
    fp32 = [1.0] * 8
    assert blocks_decisive(fp32, [0.8] * 7 + [1.1]) is True       # 56 of 64 pairs: p 0.2%
    assert blocks_decisive(fp32, [0.8] * 6 + [1.1] * 2) is False  # 48 of 64: p 5.2%
    assert blocks_decisive(fp32, [1.2] * 7 + [0.9]) is True       # slower, as surely
    assert blocks_decisive([1.0, 1.02, 0.98], [0.8, 0.82, 1.1]) is False   # 3 each: all or none
    assert blocks_decisive([1.0, 1.02, 0.98], [0.8, 0.82, 0.79]) is True    # ... all: 1 of 20
    for n in (3, 4, 8):   # a tie is evidence neither way (a coarse clock ticks alike)
        assert blocks_decisive([1.0] * n, [1.0] * n) is False
    assert blocks_decisive([1, 1, 1, 1], [1, 1, 1, 0.5]) is False
    assert blocks_decisive([1, 1, 1, 0.5], [1, 1, 1, 1]) is False


def test_a_gpu_keeps_bf16_unless_it_measured_slower(bf16_measured, monkeypatch):
    """On a GPU bf16 is the device's default (tensor cores, half the activations' memory):
    a run too short to measure, or a measurement within the noise, keeps it; a decided
    loss turns it off."""
    from nbtrain.auto import precision
    monkeypatch.setattr(precision, "bf16_units", lambda device: "GPU X has bf16 units")
    gpu = torch.device("cuda")
    assert precision.bf16_choice(None, key="a", may_measure="run too short", device=gpu)[0] == "bf16"
    assert precision.bf16_choice(TimedSteps(monkeypatch, *MIXED), key="b", device=gpu)[0] == "bf16"
    assert precision.bf16_choice(TimedSteps(monkeypatch, [2e-3], [2.1e-3]), key="c",
                               device=gpu) == ("off", "GPU X has bf16 units, but bf16 measured "
                                               "0.95x of fp32 speed on this model (slower)")
    assert precision.bf16_choice(TimedSteps(monkeypatch, [2.1e-3], [2e-3]), key="d",
                               device=gpu)[0] == "bf16"   # 1.05x: on a CPU, too small
    assert precision.bf16_choice(TimedSteps(monkeypatch, [2.1e-3], [2e-3]), key="e")[0] == "off"
