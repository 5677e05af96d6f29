"""TrainConfig(processes=2): data-parallel training on torch.distributed (gloo, CPU).

Each launch starts two spawned interpreters (seconds on 2 cores), so each test trains
once or twice and checks several things of the same run.
"""
import threading

import psutil
import pytest
import torch
from torch import nn

import nbtrain as nt
from nbtrain.config import ConfigError

# what a CPU with avx512_bf16 does, on any CPU (conftest.bf16_cpu)
pytestmark = pytest.mark.usefixtures("bf16_cpu")


def own_children() -> set:
    """This process's child processes, but multiprocessing's helpers, each started once
    and kept for the life of the process: the resource tracker and the fork server."""
    return {p.pid for p in psutil.Process().children()
            if not any(helper in " ".join(_cmdline(p))
                       for helper in ("resource_tracker", "forkserver"))}


def _cmdline(proc) -> list:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


@pytest.fixture
def no_child_left():
    before = own_children()
    yield
    assert own_children() <= before


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))


def digits_like(n=256):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def sgd(**more):
    return nt.TrainConfig(optimizer="sgd", lr=0.05, momentum=0.9, max_steps=24, log_every=4,
                          **more)


@pytest.mark.parametrize("accum", [1, 2])
def test_two_processes_equal_one_with_twice_the_batch(accum, no_child_left):
    data, loss = digits_like(), nn.functional.cross_entropy
    val = digits_like(101)   # odd: the ranks validate 51 and 50 samples
    one, two = mlp(), mlp()
    # fp32: bf16's rounding differs with how a batch is split, and the point is the split
    alone = nt.fit(one, data, loss, val_data=val, progress=False,
                   config=sgd(batch_size=32, grad_accum_steps=accum, amp="off"))
    run = nt.fit(two, data, loss, val_data=val, progress=False,
                 config=sgd(batch_size=16, grad_accum_steps=accum, processes=2, amp="off"))
    assert run.state == "finished" and run.step == 24
    assert len(run.records("val")) == len(alone.records("val")) == 24 // (8 // accum)
    for val_one, val_two in zip(alone.records("val"), run.records("val")):   # every sample once
        assert val_two["val_loss"] == pytest.approx(val_one["val_loss"], rel=1e-5)
        assert val_two["val_acc"] == val_one["val_acc"]
    for a, b in zip(one.parameters(), two.parameters()):   # the notebook's model object
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert run.optimizer.state_dict()["state"], "the optimizer state came back for resume"
    train = run.records("train")
    assert [r["step"] for r in train] == [4, 8, 12, 16, 20, 24]
    assert train[-1]["samples"] == 4 * 32 * accum   # both ranks' samples
    assert train[-1]["slowest_rank"] in (0, 1)
    assert run.resolved["processes"] == (2, "asked for")
    assert run.resolved["global_batch_size"][0] == 32
    assert run.resolved["backend"][0] == "gloo"


MAGIC_CELL = """%%fasttrain --processes 2 --max-steps 6 --batch-size 8 --log-every 2 --optimizer sgd
class Ramp(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.full((4,), i / 64)
        return x, x.sum(0, keepdim=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x):
        return self.layer(x)


model = Net()
before = model.layer.weight.detach().clone()
train_data = Ramp()
loss_fn = nn.functional.mse_loss
"""


def test_fasttrain_trains_classes_defined_in_a_cell_with_two_processes(no_child_left):
    from IPython.core.interactiveshell import InteractiveShell

    from nbtrain.ui import magic
    ip = InteractiveShell.instance()
    ip.push({"torch": torch, "nn": nn})
    magic.load_ipython_extension(ip)
    try:
        result = ip.run_cell(MAGIC_CELL)
        assert result.error_in_exec is None, result.error_in_exec
        run, model = ip.user_ns["run"], ip.user_ns["model"]
        assert run.state == "finished" and run.step == 6
        assert type(model).__module__ == "__main__"   # a class of the cell, not a module's
        assert not torch.equal(model.layer.weight, ip.user_ns["before"])
        assert run.resolved["batched_fetch"][0] is False   # per-sample Dataset, sharded sampler
    finally:
        magic.unload_ipython_extension(ip)
        for name in ("run", "model", "before", "train_data", "loss_fn", "Ramp", "Net"):
            ip.user_ns.pop(name, None)


def test_set_lr_reaches_the_ranks_and_stop_ends_both_at_the_same_step(no_child_left):
    model = mlp()
    cfg = nt.TrainConfig(processes=2, batch_size=8, max_steps=10**6, log_every=5)
    run = nt.fit(model, digits_like(), nn.functional.cross_entropy, config=cfg,
                 background=True, progress=False)
    first = threading.Event()
    run.subscribe(lambda r: first.set() if r["kind"] == "train" else None)
    assert first.wait(180), "no record from the ranks"
    assert run.step >= 5, "the notebook's Run follows the ranks' step while they train"
    new_lr = threading.Event()
    run.subscribe(lambda r: new_lr.set() if r.get("lr") == pytest.approx(0.0123) else None)
    run.set_lr(0.0123)   # reaches the ranks at their next interval boundary
    assert new_lr.wait(180), "the ranks did not take the new LR"
    threading.Thread(target=run.stop).start()
    run.wait(180)
    assert run.state == "stopped", run.error   # a rank at another step would fail the run
    assert run.step % 5 == 0 and 0 < run.step < 10**6
    assert run.records("train")[-1]["step"] <= run.step


def poisoned():
    """A dataset whose sample 37 raises; defined in a function, so cloudpickle sends the
    class by value (as one defined in a notebook cell) to ranks that cannot import tests."""
    class Poisoned(torch.utils.data.Dataset):
        def __len__(self):
            return 128

        def __getitem__(self, i):
            if i == 37:
                raise ValueError("unreadable record")
            return torch.randn(8), i % 3

    return Poisoned()


def test_a_rank_that_raises_names_rank_batch_and_sample(no_child_left):
    cfg = nt.TrainConfig(processes=2, batch_size=8, epochs=1, num_workers=0, log_every=1)
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(nt.TrainingError) as info:
        nt.fit(model, poisoned(), nn.functional.cross_entropy, config=cfg, progress=False)
    text = str(info.value)
    assert "rank " in text and " of 2" in text, text
    assert "sample 37 raised ValueError: unreadable record" in text, text
    assert "loading batch" in text, text
    run = info.value.run
    assert run.state == "failed"
    # the model kept its weights, so the Run keeps its position: a resume repeats nothing
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert (run.step, run.epoch, run.batch_in_epoch) == (0, 0, 0)


def test_the_relay_sends_an_lr_set_before_it_started():
    from nbtrain.parallel import processes as distributed
    from nbtrain.run import Run
    from nbtrain.train.schedule import Schedule

    class Requests:
        def __init__(self):
            self.sent = []

        def stop(self):
            self.sent.append("stop")

        def set_lr(self, lr):
            self.sent.append(lr)

    run, requests = Run(nt.TrainConfig(lr=0.1)), Requests()
    run.schedule = Schedule(run.config, 100)
    run.set_lr(0.05)   # e.g. Panel.resume, right after fit(background=True) returned
    relay = distributed._Relay(run, requests)
    relay()
    relay()
    run.set_lr(0.02)
    run.stop()
    relay()
    relay()
    assert requests.sent == [0.05, "stop", 0.02]


def test_own_dataloader_is_refused_before_any_process_starts():
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*digits_like()))
    with pytest.raises(ConfigError, match="loader.dataset"):
        nt.fit(mlp(), loader, nn.functional.cross_entropy,
               config=nt.TrainConfig(processes=2), progress=False)


def test_auto_is_one_process_on_a_cpu_with_the_reason():
    run = nt.fit(mlp(), digits_like(64), nn.functional.cross_entropy,
                 config=nt.TrainConfig(processes="auto", max_steps=2), progress=False)
    value, why = run.resolved["processes"]
    assert value == 1 and "cpu" in why and run.state == "finished"


def test_shards_are_disjoint_equal_and_together_the_one_process_batch():
    from nbtrain.data.batches import EpochBatchSampler
    one = EpochBatchSampler(100, 8, True, False, seed=3)
    ranks = [EpochBatchSampler(100, 4, True, False, seed=3) for _ in range(2)]
    for rank, sampler in enumerate(ranks):
        sampler.shard(rank, 2)
        sampler.epoch = 1
    one.epoch = 1
    mine = [list(s) for s in ranks]
    assert len(mine[0]) == len(mine[1]) == 13
    assert not set(sum(mine[0], [])) & set(sum(mine[1], []))
    for k, batch in enumerate(list(one)[:12]):
        assert sorted(batch) == sorted(mine[0][k] + mine[1][k])


def test_a_rank_that_dies_is_named_and_the_other_is_not_waited_for(no_child_left):
    class Deadly(torch.utils.data.Dataset):
        def __len__(self):
            return 128

        def __getitem__(self, i):
            if i == 5:
                import os
                os._exit(3)   # as a crash in native code would: no exception, no message
            return torch.randn(8), i % 3

    cfg = nt.TrainConfig(processes=2, batch_size=8, epochs=1, num_workers=0, shuffle=False,
                         count_flops=False)   # the count would read sample 5 on rank 0 first
    with pytest.raises(nt.TrainingError, match=r"rank 1 of 2 exited with code 3"):
        nt.fit(mlp(), Deadly(), nn.functional.cross_entropy, config=cfg, progress=False)


def test_a_rank_that_hangs_is_caught_by_the_timeout(monkeypatch, no_child_left):
    from nbtrain.parallel import processes as distributed
    # rank 0 gives up waiting for rank 1 after 5 s; the notebook waits 10 s for any word:
    # rank 0's start, its probes and its 5 s wait fit in that on a loaded 2-core machine
    monkeypatch.setattr(distributed, "RANK_TIMEOUT_S", 5.0)

    class Stuck(torch.utils.data.Dataset):
        def __len__(self):
            return 128

        def __getitem__(self, i):
            if i == 5:
                import time
                time.sleep(3600)
            return torch.randn(8), i % 3

    cfg = nt.TrainConfig(processes=2, batch_size=8, epochs=1, num_workers=0, shuffle=False,
                         count_flops=False)
    with pytest.raises(nt.TrainingError) as info:
        nt.fit(mlp(), Stuck(), nn.functional.cross_entropy, config=cfg, progress=False)
    assert "rank(s) [1] sent nothing and are still running: they hang" in str(info.value)


def test_resume_with_the_same_count_is_bit_for_bit_and_another_count_says_so(no_child_left):
    data, loss = digits_like(), nn.functional.cross_entropy
    straight = mlp()
    nt.fit(straight, data, loss, config=sgd(batch_size=16, processes=2), progress=False)
    halves = mlp()
    first = nt.fit(halves, data, loss, progress=False,
                   config=sgd(batch_size=16, processes=2).replace(max_steps=12))
    run = nt.fit(halves, data, loss, config=sgd(batch_size=16, processes=2), resume=first,
                 progress=False)
    assert run.step == 24
    for a, b in zip(straight.parameters(), halves.parameters()):
        assert torch.equal(a, b)
    other = nt.fit(mlp(), data, loss, config=sgd(batch_size=16), resume=first, progress=False)
    assert other.step == 24 and other.state == "finished"
    assert "resumed a run of 2 process(es) with 1: the epoch continues at sample 128" \
        in other.notes[0]


def test_without_ray_cluster_ray_says_how_to_install_when_the_run_starts(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` fails, as without Ray
    cfg = nt.TrainConfig(cluster="ray", processes=2)   # a valid config without Ray
    with pytest.raises(ConfigError, match=r'pip install "nbtrain\[ray\]"'):
        nt.fit(mlp(), digits_like(64), nn.functional.cross_entropy, config=cfg, progress=False)


def test_the_notebook_run_keeps_rank_0s_loss_scale_for_checkpoints_and_resume():
    """fp16 runs on CUDA only; the notebook's side of it is tested here without a GPU."""
    from nbtrain.parallel import processes as distributed
    from nbtrain.run import Run
    run = Run(nt.TrainConfig(processes=2, batch_size=8, epochs=1))
    distributed._prepare_here(run, mlp(), digits_like(), None, 2)
    state = run.state_dict()
    assert state["scaler"] == {}   # no rank has trained yet
    scale = {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5,
             "growth_interval": 2000, "_growth_tracker": 7}
    distributed._load_state(run, dict(state, scaler=scale))   # what rank 0 sends at the end
    assert run.state_dict()["scaler"] == scale
    resumed = Run(nt.TrainConfig(processes=2, batch_size=8, epochs=2))
    distributed._prepare_here(resumed, mlp(), digits_like(), run.state_dict(), 2)
    assert resumed.state_dict()["scaler"] == scale   # and on to the ranks in the payload's state
