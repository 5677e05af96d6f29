"""'auto' workers and threads on CPU are measured, not guessed: the probe's choice, its
cache, and a re-measure when the machine's load changes. No test asserts a speed."""
import time

import pytest
import torch
from torch.nn import functional as F

import nbtrain as nt
from nbtrain import probe

from conftest import mlp, quick


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
    """No measurement from another test; count the probes."""
    monkeypatch.setattr(probe, "_MEASURED", {})
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
    # 8 x 2 ms of waiting per batch: two workers wait side by side, the step is tiny
    resolved = probed(mlp(), Rows(4000, sleep_s=0.002), batch_size=8)
    workers, why = resolved["num_workers"]
    assert workers > 0, why
    assert why.startswith("measured ms/step by workers 0: ") and " ms, 1: " in why
    assert "a worker start (" in why and "spread over 500 batches" in why
    assert resolved["num_threads"][1].startswith(f"measured ms/step by threads with {workers} worker")


def test_a_cheap_dataset_keeps_loading_in_the_training_process():
    # 8 batches an epoch: starting workers costs more than they could save
    workers, why = probed(mlp(), Rows(256), batch_size=32)["num_workers"]
    assert workers == 0 and why.startswith("measured ms/step by workers 0: ")


def test_the_measurement_is_reused_until_the_load_changes_a_lot(monkeypatch, fresh_probe):
    load = [0.5]
    monkeypatch.setattr(probe.os, "getloadavg", lambda: (load[0], load[0], load[0]))
    model, data = mlp(), Rows(256)
    first = probed(model, data, batch_size=32)
    again = probed(model, data, batch_size=32)
    assert len(fresh_probe) == 1 and "measured earlier in this session" in again["num_workers"][1]
    assert again["num_workers"][0] == first["num_workers"][0]
    load[0] = 0.9   # a small change: still measured earlier
    probed(model, data, batch_size=32)
    assert len(fresh_probe) == 1
    load[0] = 4.0   # others now busy on the cores: measured again
    busy = probed(model, data, batch_size=32)
    assert len(fresh_probe) == 2 and "load 4.0 on" in busy["num_workers"][1]
    assert "measured earlier" not in busy["num_workers"][1]
    probed(model, Rows(256), batch_size=32)   # another dataset: its own measurement
    assert len(fresh_probe) == 3


def test_the_probe_leaves_no_trace(fresh_probe):
    model, data = mlp(dropout=0.5), Rows(256)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    draws = []
    for _ in range(2):   # measured, then taken from the cache: the same run either way
        torch.manual_seed(5)
        probed(model, data, batch_size=32)
        draws.append(torch.rand(1))
    assert len(fresh_probe) == 1 and torch.equal(*draws)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("torch_threads", [2], indirect=True)
def test_tensors_keep_batched_fetch_and_measure_only_threads(torch_threads, blobs, fresh_probe):
    resolved = probed(mlp(), blobs)
    assert resolved["num_workers"][0] == 0 and "batched fetch" in resolved["num_workers"][1]
    threads, why = resolved["num_threads"]
    assert threads in (1, 2) and why.startswith("measured ms/step by threads with 0 worker(s) 2: ")
    assert torch.get_num_threads() == 2   # the notebook's count is back


def test_asked_settings_are_not_measured(fresh_probe):
    resolved = probed(mlp(), Rows(256), batch_size=32, num_workers=0)
    assert resolved["num_workers"] == (0, "asked for") and not fresh_probe
