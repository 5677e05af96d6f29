"""A short loop re-run as a cell: the watch's bf16 trial measures the blocks each run can
afford and the next run of the same model goes on from them, until they decide. On a
clock that only the model's forward moves, so no choice depends on this machine."""
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain import machine
from nbtrain.auto import budget
from nbtrain.auto import precision as ladder

from conftest import Clock

STEPS = 50   # a run: 50 ms of 1 ms fp32 steps, 5% of it 2.5 ms


class Timed(nn.Module):
    """A linear layer whose forward takes `fp32_s`, or `bf16_s` under bf16 autocast, on the
    clock."""

    def __init__(self, clock, fp32_s, bf16_s):
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.clock, self.fp32_s, self.bf16_s = clock, fp32_s, bf16_s

    def forward(self, x):
        out = self.lin(x)
        self.clock.now += self.bf16_s if out.dtype == torch.bfloat16 else self.fp32_s
        return out


@pytest.fixture
def clock(monkeypatch, tmp_path):
    """A CPU with bf16 units, nothing measured yet (a disk cache of the test's own, load
    0.5, a load change of 1 counting), on the model's clock."""
    monkeypatch.setenv("NBTRAIN_CPU_BF16", "avx512_bf16")
    monkeypatch.delenv("NBTRAIN_BF16_GAIN", raising=False)
    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ladder, "_BF16_GAINS", {})
    monkeypatch.setattr(ladder, "_BF16_BLOCKS", {}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    monkeypatch.setattr(machine, "load_change_that_counts", lambda: 1.0)
    machine.cpu_bf16_feature.cache_clear()
    fake = Clock()
    monkeypatch.setattr(time, "perf_counter", fake)
    yield fake
    machine.cpu_bf16_feature.cache_clear()


def run_loop(clock, fp32_s=1e-3, bf16_s=2e-3, steps=STEPS):
    """One run of the cell: a new model, `steps` steps under nt.watch(). Returns (the run,
    its length on the clock, the model's key)."""
    torch.manual_seed(0)
    model = Timed(clock, fp32_s, bf16_s)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    started = clock.now
    with nt.watch(progress=False, count_flops=False, store=False) as run:
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return run, clock.now - started, watch_key(model, x)


def watch_key(model, x):
    """The bf16 key of `model` fed `x`: what the watch reads off its first forward."""
    return ladder.bf16_key(model, torch.device("cpu"), ladder.model_inputs((x,)))


def fit_once(clock, fp32_s=1e-3, bf16_s=2e-3):
    """nt.fit of the same model on the same batch as run_loop, amp="auto" (its probe
    measures bf16 where no gain is known); returns the run."""
    torch.manual_seed(0)
    model = Timed(clock, fp32_s, bf16_s)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    cfg = nt.TrainConfig(max_steps=400, batch_size=16, amp="auto", optimizer="sgd", lr=0.1,
                         count_flops=False, num_workers=0, num_threads=1, store=False)
    return nt.fit(model, (x, y), F.cross_entropy, config=cfg)


def blocks_kept(key):
    """The trial's blocks kept for `key`, as another process would find them (the disk)."""
    ladder._BF16_BLOCKS.clear()
    return ladder.bf16_blocks(key)


def test_a_short_runs_blocks_are_kept_and_the_next_run_goes_on_from_them(clock):
    first, _, key = run_loop(clock)   # 30 ms blocks: none within 2.5 ms
    assert "before measuring would have cost at most 5%" in first.resolved["amp"][1]
    second = run_loop(clock)[0]   # blocks of a step, sized by the first run's length
    amp, why = second.resolved["amp"]
    assert amp == "off" and "bf16 trial: 2 of 6 blocks measured over 1 run" in why, why
    kept = blocks_kept(key)
    assert kept["off"] == [pytest.approx(1e-3)] and kept["bf16"] == [pytest.approx(2e-3)]
    third = run_loop(clock)[0]   # from the disk, as in another process
    assert "bf16 trial: 4 of 6 blocks measured over 2 runs" in third.resolved["amp"][1]
    assert len(blocks_kept(key)["off"]) == 2


def test_the_runs_blocks_decide_once_all_are_in_and_are_then_dropped(clock, tmp_path):
    runs = [run_loop(clock)[0] for _ in range(4)]   # nothing, then a pair each run
    amp, why = runs[-1].resolved["amp"]
    assert amp == "off" and "bf16 0.50x of fp32 (slower)" in why, why
    assert "and 4 blocks of the 2 runs before" in why, why
    key = run_loop(clock)[2]   # the next run takes the remembered gain, measuring nothing
    assert ladder.known_bf16_gain(key)[0] == pytest.approx(0.5)
    assert blocks_kept(key) is None and not list(tmp_path.rglob("*.blocks.json"))


def test_each_run_measures_within_its_own_budget(clock):
    """bf16 2x slower: each bf16 step costs what it was estimated at, and each run's
    measuring stays within 5% of it, the runs that measure included."""
    spent = []
    for _ in range(4):
        run, ran, _ = run_loop(clock)
        spent.append(run.resolved["measuring_s"][0])
        assert spent[-1] <= budget.SHARE * ran + 1e-12, run.resolved["measuring_s"]
    assert spent[0] == 0 and all(s > 0 for s in spent[1:]), spent


def test_blocks_within_the_noise_keep_fp32_and_the_next_run_measures_anew(clock):
    """bf16 as fast as fp32: its blocks cost nothing, so a run measures them all; the
    trial is within the noise, its blocks are dropped (a trial's at most are kept), and the
    next run measures anew, with blocks sized by the last run's length."""
    run_loop(clock, bf16_s=1e-3)
    run, _, key = run_loop(clock, bf16_s=1e-3)
    amp, why = run.resolved["amp"]
    assert amp == "off" and "bf16 against fp32: no difference beyond the noise: fp32 steps took" in why, why
    kept = blocks_kept(key)
    assert kept["off"] == kept["bf16"] == [] and kept["run_s"] > 0
    again = run_loop(clock, bf16_s=1e-3)[0]
    assert "no difference beyond the noise" in again.resolved["amp"][1]
    assert "blocks of the" not in again.resolved["amp"][1]   # none of the run before


def test_a_bf16_slower_than_the_estimate_stops_the_next_runs_blocks(clock):
    """bf16 4x slower: the first bf16 block costs more than the half speed it was
    estimated at; from then on the blocks are estimated at the pace measured, and a run
    too short for them measures nothing."""
    run_loop(clock, bf16_s=4e-3)
    measured = run_loop(clock, bf16_s=4e-3)[0].resolved["measuring_s"][0]
    assert measured == pytest.approx(3e-3)   # a warm-up step, 3 ms beyond fp32's
    for _ in range(2):
        run, ran, key = run_loop(clock, bf16_s=4e-3)
        assert run.resolved["measuring_s"][0] == 0.0
    assert blocks_kept(key)["extras"] == [pytest.approx(3e-3)]


def test_a_bf16_block_slower_than_its_estimate_ends_at_its_allowance(clock):
    """bf16 4x slower on a first run long enough for the warm-up: its block of 30 steps was
    allowed 30 ms beyond fp32 (half speed) and would take 90 ms; it ends once it has cost
    that, and the run's measuring stays within 5% of it."""
    run, ran, _ = run_loop(clock, bf16_s=4e-3, steps=700)
    spent = run.resolved["measuring_s"][0]
    assert spent == pytest.approx(30e-3)   # 10 bf16 steps, 3 ms beyond fp32 each
    assert spent <= budget.SHARE * ran


def test_blocks_measured_under_another_load_are_dropped(clock, monkeypatch):
    run_loop(clock)
    key = run_loop(clock)[2]
    assert len(blocks_kept(key)["off"]) == 1
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 3.0, 3.0))   # others busy now
    assert blocks_kept(key) is None
    third = run_loop(clock)[0]   # anew: nothing kept, its blocks as long as a first run's
    assert "before measuring would have cost at most 5%" in third.resolved["amp"][1]
    fourth = run_loop(clock)[0]
    assert "bf16 trial: 2 of 6 blocks measured over 1 run" in fourth.resolved["amp"][1]
    assert blocks_kept(key)["load"] == 3.0


def test_a_gain_fit_measured_is_the_watchs_and_the_watchs_is_fits(clock):
    """One bf16 key for nt.fit and the watch: fit's probe measures bf16 2x faster, and the
    watch of the same model on the same batch takes bf16 at once, measuring nothing; then,
    with bf16 2x slower, the watch's trial decides and fit finds its verdict."""
    fitted = fit_once(clock, bf16_s=0.5e-3)
    assert fitted.resolved["amp"][0] == "bf16", fitted.resolved["amp"]
    watched = run_loop(clock, bf16_s=0.5e-3)[0]
    assert watched.resolved["amp"][0] == "bf16"
    assert "2.00x faster than fp32" in watched.resolved["amp"][1]

    ladder._BF16_GAINS.clear()
    for path in clock_cache(clock):
        path.unlink()
    for _ in range(6):   # short runs: the trial goes on over re-runs until it decides
        run = run_loop(clock, bf16_s=2e-3)[0]
        if "slower" in run.resolved["amp"][1]:
            break
    assert "bf16 0.50x of fp32 (slower)" in run.resolved["amp"][1], run.resolved["amp"]
    fitted = fit_once(clock, bf16_s=2e-3)
    assert fitted.resolved["amp"] == ("off", fitted.resolved["amp"][1])
    assert "0.50x of fp32 speed" in fitted.resolved["amp"][1]
    assert fitted.resolved["setup_s"][1].find("bf16 probe") < 0   # nothing measured again


def clock_cache(clock):
    """The gains kept on disk (the fixture's cache folder)."""
    return list(Path(os.environ["NBTRAIN_CACHE_DIR"]).rglob("*.json"))
