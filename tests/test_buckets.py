"""The ranks' gradient average overlaps the backward (watcher/buckets.py): checked in this
process on a process group of one (gloo), where the average is the gradient itself, so
what is checked is when each bucket is sent and what the hooks leave behind."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from nbtrain.run import Run
from nbtrain.watcher import buckets


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def train(model, events=None):
    """Two steps of SGD; `events` logs each all_reduce and the backward reaching the first
    layer's output (after every later layer's gradients, before the first layer's)."""
    gen = torch.Generator().manual_seed(1)
    loader = DataLoader(TensorDataset(torch.randn(32, 4, generator=gen),
                                      torch.randn(32, 1, generator=gen)), batch_size=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if events is not None:
        def mark(module, args, out) -> None:
            out.register_hook(lambda grad: events.append("first layer"))
        model[0].register_forward_hook(mark)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def test_buckets_are_sent_while_the_backward_runs_in_its_order(group, monkeypatch):
    monkeypatch.setattr(buckets, "FIRST_BUCKET_BYTES", 1)
    monkeypatch.setattr(buckets, "BUCKET_BYTES", 32 * 32 * 4)
    events, all_reduce = [], dist.all_reduce

    def logged(tensor, *args, **kwargs):
        events.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)
    monkeypatch.setattr(dist, "all_reduce", logged)
    model = net()
    with nt.watch(_rank=(0, 1, Run), progress=False):
        train(model, events)
    # per step, a flag per parameter before its values: the last layer's bias alone, its
    # weight with the middle layer's bias, the middle layer's weight (the cap), all sent
    # before the backward reaches the first layer; the first layer's two at the end
    step = [1 + 1, 2 + 32 + 32, 1 + 32 * 32, "first layer", 2 + 32 + 4 * 32]
    assert events == step + step


def test_the_average_of_one_rank_is_the_plain_update_and_the_hooks_go(group, monkeypatch):
    monkeypatch.setattr(buckets, "FIRST_BUCKET_BYTES", 1)
    monkeypatch.setattr(buckets, "BUCKET_BYTES", 1)
    model = net()
    tables = [p._post_accumulate_grad_hooks for p in model.parameters()]
    with nt.watch(_rank=(0, 1, Run), progress=False) as run:
        train(model)
    assert run.state == "finished"
    plain = train(net())
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), plain.parameters()))
    assert [p._post_accumulate_grad_hooks for p in model.parameters()] == tables == [None] * 6


def test_split_keeps_the_backward_order_and_the_caps(monkeypatch):
    monkeypatch.setattr(buckets, "FIRST_BUCKET_BYTES", 8)
    monkeypatch.setattr(buckets, "BUCKET_BYTES", 40)
    sizes = [1, 1, 1, 4, 4, 20]
    groups = buckets._split([torch.zeros(n) for n in sizes])
    assert [[p.numel() for p in g] for g in groups] == [[1, 1], [1, 4, 4], [20]]
