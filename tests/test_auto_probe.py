"""'auto' workers and threads on CPU are measured, not guessed: the probe's choice, its
cache, and a re-measure when the machine's load changes. No test asserts a speed."""
import time

import pytest
import torch
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.auto import workers as probe

from conftest import mlp, quick

# what a CPU with avx512_bf16 does, on any CPU (conftest.bf16_cpu)
pytestmark = pytest.mark.usefixtures("bf16_cpu")


class Rows(torch.utils.data.Dataset):
    """A per-sample dataset whose __getitem__ waits `sleep_s`, as a read from disk would."""

    def __init__(self, n, sleep_s=0.0):
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=gen), torch.randint(0, 3, (n,), generator=gen)
        self.sleep_s = sleep_s

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.x[i], self.y[i]


@pytest.fixture(autouse=True)
def fresh_probe(monkeypatch):
    """No measurement from another test; count the probes. The load average held still:
    the suite's other processes move it by a core, which measures again (a test of that
    rule moves it itself)."""
    monkeypatch.setattr(probe, "_MEASURED", {})
    monkeypatch.setattr(probe.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    calls = []
    measure = probe.measure

    def counted(*args, **kwargs):
        calls.append(1)
        return measure(*args, **kwargs)
    monkeypatch.setattr(probe, "measure", counted)
    return calls


def probed(model, data, **cfg):
    """A run's resolved settings, the run stopped before its first step."""
    run = nt.fit(model, data, F.cross_entropy, progress=False, config=quick(**cfg),
                 on_start=lambda r: r.stop())
    return run.resolved


def test_a_dataset_that_waits_on_io_gets_workers_and_the_reasons_give_the_rates():
    # 8 x 2 ms of waiting per batch: two workers wait side by side, the step is tiny; a
    # run of 10 epochs (5,000 steps) pays for measuring them
    resolved = probed(mlp(), Rows(4000, sleep_s=0.002), batch_size=8, epochs=10)
    workers, why = resolved["num_workers"]
    assert workers > 0, why
    assert why.startswith("measured ms/step by workers 0: ") and " ms, 1: " in why
    assert "a worker start (" in why and "spread over 500 batches" in why
    assert resolved["num_threads"][1].startswith(f"measured ms/step by threads with {workers} worker")


def test_a_cheap_dataset_keeps_loading_in_the_training_process(fresh_probe):
    # a short run, or loading a batch takes a small share of a step: no worker is started
    # to find out, and the loading stays the plain loop's
    for epochs in (1, 1000):
        workers, why = probed(mlp(), Rows(256), batch_size=32, epochs=epochs)["num_workers"]
        assert workers == 0 and why.startswith("the plain loop's: loading in this process ("), why


@pytest.mark.parametrize("torch_threads", [2], indirect=True)
def test_a_run_too_short_to_pay_for_measuring_keeps_the_rules_and_says_so(torch_threads, blobs):
    resolved = probed(mlp(), blobs, epochs=1)   # 16 steps of well under a millisecond
    threads, why = resolved["num_threads"]
    assert threads == 2 and "run too short to measure: 16 steps" in why, why


def test_the_same_data_in_a_new_object_is_not_measured_again(fresh_probe):
    model = mlp()
    first = probed(model, Rows(256, sleep_s=0.001), batch_size=32, epochs=1000)
    again = probed(model, Rows(256, sleep_s=0.001), batch_size=32, epochs=1000)   # a re-run cell
    assert len(fresh_probe) == 1 and "measured earlier in this session" in again["num_workers"][1]
    probed(model, Rows(300, sleep_s=0.001), batch_size=32, epochs=1000)   # other data
    assert len(fresh_probe) == 2 and first["num_workers"][0] == again["num_workers"][0]


@pytest.mark.parametrize("torch_threads", [2], indirect=True)
def test_a_measurement_that_could_not_afford_worker_counts_does_not_serve_a_longer_run(
        torch_threads, fresh_probe):
    """A run long enough to time thread counts but not to start workers says so; a longer
    run of the same model and data (in the same session) times the workers too."""
    model, data = mlp(), Rows(256, sleep_s=0.001)   # loading waits: workers are candidates
    # 400 steps of 30-100 ms: 5% pays for the 2 thread counts, not for 2 worker starts too
    short = probed(model, data, batch_size=32, epochs=50)
    assert "worker counts not timed: timing them would cost more than 5%" in \
        short["num_workers"][1], short["num_workers"][1]
    long = probed(model, data, batch_size=32, epochs=2000)
    assert len(fresh_probe) == 2 and "measured earlier" not in long["num_workers"][1]
    assert ", 1: " in long["num_workers"][1] and "not timed" not in long["num_workers"][1]


def test_the_measurement_is_reused_until_the_load_changes_a_lot(monkeypatch, fresh_probe):
    load = [0.5]
    monkeypatch.setattr(probe.os, "getloadavg", lambda: (load[0], load[0], load[0]))
    model, data = mlp(), Rows(256, sleep_s=0.001)
    first = probed(model, data, batch_size=32, epochs=1000)
    again = probed(model, data, batch_size=32, epochs=1000)
    assert len(fresh_probe) == 1 and "measured earlier in this session" in again["num_workers"][1]
    assert again["num_workers"][0] == first["num_workers"][0]
    load[0] = 0.9   # a small change: still measured earlier
    probed(model, data, batch_size=32, epochs=1000)
    assert len(fresh_probe) == 1
    load[0] = 4.0   # others now busy on the cores: measured again
    busy = probed(model, data, batch_size=32, epochs=1000)
    assert len(fresh_probe) == 2 and "load 4.0 on" in busy["num_workers"][1]
    assert "measured earlier" not in busy["num_workers"][1]


def test_the_probe_leaves_no_trace(fresh_probe):
    model, data = mlp(dropout=0.5), Rows(256, sleep_s=0.001)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    draws = []
    for _ in range(2):   # measured, then taken from the cache: the same run either way
        torch.manual_seed(5)
        probed(model, data, batch_size=32, epochs=1000)
        draws.append(torch.rand(1))
    assert len(fresh_probe) == 1 and torch.equal(*draws)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("torch_threads", [2], indirect=True)
def test_tensors_keep_batched_fetch_and_measure_only_threads(torch_threads, blobs, fresh_probe):
    resolved = probed(mlp(), blobs, epochs=1000)
    assert resolved["num_workers"][0] == 0 and "batched fetch" in resolved["num_workers"][1]
    threads, why = resolved["num_threads"]
    assert threads in (1, 2) and why.startswith("measured ms/step by threads with 0 worker(s) 2: ")
    assert torch.get_num_threads() == 2   # the notebook's count is back


def test_asked_settings_are_not_measured(fresh_probe):
    resolved = probed(mlp(), Rows(256), batch_size=32, num_workers=0)
    assert resolved["num_workers"] == (0, "asked for") and not fresh_probe


def test_another_pair_is_chosen_only_if_it_won_every_round():
    """A median of 3 rounds can lie after one slow spell; every round rarely does (a demo's
    probe read 2 threads 25 ms a step against 10.6 with 1, and 1 thread then ran slower)."""
    pairs = [(0, 2), (0, 1)]
    spell = probe.Measured({(0, 2): 0.025, (0, 1): 0.0106}, {0: 0.0}, load=1.7,
                           rounds={(0, 2): [0.025, 0.006, 0.026], (0, 1): [0.0106] * 3})
    (workers, threads), why = probe.choose(spell, pairs, batches_per_start=100)
    assert (workers, threads) == (0, 2)
    assert "1 thread(s) with 0 worker(s), fastest by the median, beat the plain loop's by " \
        "1.05x in only 2 of 3 rounds: the plain loop's stay" in why["num_threads"]
    busy = probe.Measured({(0, 2): 0.025, (0, 1): 0.0106}, {0: 0.0}, load=3.0,
                          rounds={(0, 2): [0.025, 0.020, 0.026], (0, 1): [0.0106] * 3})
    assert probe.choose(busy, pairs, batches_per_start=100)[0] == (0, 1)
    assert "only" not in probe.choose(busy, pairs, batches_per_start=100)[1]["num_threads"]
