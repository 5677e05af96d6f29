"""run.gaps(): the run's wall time as its steps and what took the time between them
(evaluation, saving, the loader's start, the loop's own code), adding up to run.wall_s.
On a clock that only the loop moves, so that every part is known exactly."""
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt

from conftest import Clock

STEP_S, OWN_S, EVAL_S, SAVE_S = 0.001, 0.003, 0.010, 0.020


class Timed(nn.Module):
    """A linear layer whose forward takes STEP_S on the clock."""

    def __init__(self, clock):
        super().__init__()
        self.lin, self.clock = nn.Linear(8, 3), clock

    def forward(self, x):
        self.clock.now += STEP_S
        return self.lin(x)


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


def watched_loop(clock, monkeypatch, epochs=2):
    """Per epoch: 4 training steps, each followed by OWN_S of the loop's own code; an
    evaluation pass of 2 batches (a forward and EVAL_S each); a torch.save of SAVE_S."""
    def save(*args, **kwargs):   # the watch wraps whatever torch.save is
        clock.now += SAVE_S
    monkeypatch.setattr(torch, "save", save)
    torch.manual_seed(0)
    model = Timed(clock)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    train = DataLoader(TensorDataset(x, y), batch_size=8)
    val = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8)
    seen = []
    with nt.watch(progress=False, store=False, count_flops=False) as run:
        for _ in range(epochs):
            for xb, yb in train:
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
                clock.now += OWN_S
            seen.append((run.gaps(), clock.now))   # live, between two epochs
            with torch.no_grad():
                for xb, _ in val:
                    model(xb)
                    clock.now += EVAL_S
            torch.save(model.state_dict(), "unused.pt")
    return run, seen


def seconds(rows) -> dict:
    return {row["part"]: row["seconds"] for row in rows}


def test_each_part_between_steps_is_named_and_they_add_up_to_the_wall_time(clock, monkeypatch):
    run, _ = watched_loop(clock, monkeypatch)
    parts = seconds(run.gaps())
    assert list(parts) == ["steps", "evaluation", "saving", "loader start", "your code"]
    assert parts["evaluation"] == pytest.approx(2 * 2 * (STEP_S + EVAL_S))
    assert parts["saving"] == pytest.approx(2 * SAVE_S)
    assert parts["your code"] == pytest.approx(2 * 4 * OWN_S)
    assert parts["steps"] == pytest.approx(2 * 4 * STEP_S)
    assert sum(parts.values()) == pytest.approx(run.wall_s)
    assert sum(row["share"] for row in run.gaps()) == pytest.approx(1.0)


def test_the_gaps_are_live_while_the_loop_trains(clock, monkeypatch):
    _, seen = watched_loop(clock, monkeypatch)
    (first, first_at), (second, second_at) = [(seconds(rows), at) for rows, at in seen]
    assert first["evaluation"] == 0 and second["evaluation"] == pytest.approx(2 * (STEP_S + EVAL_S))
    # a gap counts once it ends (the next step starts): the one in progress is not yet in
    assert first["your code"] == pytest.approx(3 * OWN_S)
    assert second["your code"] == pytest.approx(7 * OWN_S)
    assert sum(first.values()) == pytest.approx(first_at)
    assert sum(second.values()) == pytest.approx(second_at)


def test_fit_names_validation_and_checkpoints_and_a_stored_run_keeps_its_gaps(tmp_path):
    x, y = torch.randn(256, 8), torch.randint(0, 3, (256,))
    cfg = nt.TrainConfig(epochs=2, batch_size=32, checkpoint_dir=str(tmp_path / "ck"),
                         store=str(tmp_path / "runs.sqlite"), count_flops=False)
    run = nt.fit(nn.Linear(8, 3), (x, y), F.cross_entropy, config=cfg, val_data=(x, y))
    parts = seconds(run.gaps())
    assert parts["evaluation"] > 0 and parts["saving"] > 0 and parts["your code"] == 0
    assert sum(parts.values()) == pytest.approx(run.wall_s, rel=0.03)
    loaded = nt.load_run(run.id, store=str(tmp_path / "runs.sqlite"))
    assert seconds(loaded.gaps()) == pytest.approx(parts)


def test_the_dashboards_table_shows_what_took_the_time_between_steps(clock, monkeypatch):
    from nbtrain.views import dashboard
    run, _ = watched_loop(clock, monkeypatch)
    text = dashboard._between_text(run)
    assert text.startswith("evaluation ") and "saving" in text and "your code" in text
    assert text.split(", ")[0] == f"evaluation {seconds(run.gaps())['evaluation'] / run.wall_s:.0%}"
