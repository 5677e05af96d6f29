"""The shapes the frameworks' loops share, written in plain torch so that they run without
the frameworks (tests/corpus runs the frameworks' own programs): a loader that fetches a
batch ahead (Accelerate's prepared loader, Lightning's fetcher, timm's prefetcher), the
last micro-batch run inside `optimizer.step(closure)` (Lightning's accumulation), a
scheduler stepped after the last step, and work after the last step."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt

QUIET = dict(progress=False, optimize=False)


def fetching_ahead(loader):
    """The shape of accelerate.data_loader.DataLoaderShard.__iter__: the next batch is read
    before the current one is handed over, so that the last one is known as the last."""
    batches = iter(loader)
    current = next(batches)
    for following in batches:
        yield current
        current = following
    yield current


def regression(n=64, batch=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch)


def train(loader, *, epochs=3, accumulate=1, ahead=True, closure_last=False, after=None):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    for _ in range(epochs):
        for i, (x, y) in enumerate(fetching_ahead(loader) if ahead else loader):
            def micro():
                loss = F.mse_loss(model(x), y) / accumulate   # the frameworks divide
                loss.backward()
                return loss
            if (i + 1) % accumulate:
                micro()
                continue
            if closure_last:   # Lightning: the last micro-batch inside the step
                opt.step(micro)
            else:
                micro()
                opt.step()
            opt.zero_grad()
            sched.step()
    if after is not None:
        after()
    return model, opt


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_loader_fetching_ahead_gives_each_step_its_own_batches(accumulate):
    loader = regression()
    with nt.watch(log_every=1, **QUIET) as run:
        train(loader, accumulate=accumulate)
    steps = 3 * 8 // accumulate
    assert run.step == steps and run.summary()["samples"] == 3 * 64   # not one more an epoch
    assert [r["samples"] for r in run.records("train")] == [8 * accumulate] * steps


def test_a_step_reading_its_micro_batches_first_from_a_loader_fetching_ahead():
    """Hugging Face Trainer's shape: get_batch_samples reads a step's micro-batches before
    the first backward, from Accelerate's loader, which reads one more ahead."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nt.watch(log_every=1, **QUIET) as run:
        for _ in range(2):
            batches = fetching_ahead(regression())
            for window in zip(batches, batches):
                for x, y in window:
                    (F.mse_loss(model(x), y) / 2).backward()
                opt.step()
                opt.zero_grad()
    assert run.step == 8 and [r["samples"] for r in run.records("train")] == [16] * 8


def test_a_loop_drawing_two_batches_a_step_is_not_taken_for_one_fetching_ahead():
    loader = regression()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nt.watch(log_every=1, **QUIET) as run:
        batches = iter(loader)
        for (x1, y1), (x2, y2) in zip(batches, batches):
            F.mse_loss(model(torch.cat([x1, x2])), torch.cat([y1, y2])).backward()
            opt.step()
            opt.zero_grad()
    assert [r["samples"] for r in run.records("train")] == [16] * 4


@pytest.mark.parametrize("ahead", [False, True])
def test_the_last_micro_batch_inside_the_steps_closure_is_counted(ahead):
    with nt.watch(log_every=1, **QUIET) as run:
        train(regression(), accumulate=2, closure_last=True, ahead=ahead)
    assert run.step == 12 and run.summary()["samples"] == 3 * 64
    assert [r["samples"] for r in run.records("train")] == [16] * 12


def test_an_lbfgs_closures_evaluations_are_still_one_step():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=5)
    with nt.watch(log_every=1, **QUIET) as run:
        for x, y in regression():
            def closure():
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss
            opt.step(closure)
    assert run.step == 8 and [r["samples"] for r in run.records("train")] == [8] * 8


def test_each_record_has_the_lr_its_steps_ran_with_the_last_one_too():
    lrs = []
    with nt.watch(log_every=5, **QUIET) as run:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=12)
        for x, y in regression(n=96):
            F.mse_loss(model(x), y).backward()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            opt.zero_grad()
            sched.step()
    assert opt.param_groups[0]["lr"] == 0.0   # the scheduler stepped past the last step
    assert [r["lr"] for r in run.records("train")] == [lrs[4], lrs[9], lrs[11]]
    assert lrs[11] > 0


def test_what_the_loop_does_after_its_last_step_is_no_steps_time():
    with nt.watch(log_every=1000, **QUIET) as run:
        train(regression(), epochs=1, ahead=False, after=lambda: time.sleep(0.5))
    (record,) = run.records("train")
    assert record["interval_s"] < 0.4, record["interval_s"]   # the steps take milliseconds
    your_code = {row["part"]: row["seconds"] for row in run.gaps()}["your code"]
    assert your_code >= 0.5   # run.gaps() has it


def test_reads_after_the_optimizers_step_are_counted_for_the_step_that_made_them():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nt.watch(log_every=5, **QUIET) as run:
        for x, y in regression(n=8 * 15):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"{loss.item():.3f} {loss.item():.3f}", end="\r")   # two reads after the step
    assert run.step == 15 and run.summary()["host_reads_per_step"] == 2
