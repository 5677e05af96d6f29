"""Checkpoint RNG state per run device, and resuming twice from one Run."""
import pytest
import torch
from torch.nn import functional as F

import nbtrain as nt
from nbtrain import checkpoint as ckpt

from conftest import mlp, quick


def _forbid_cuda_rng(monkeypatch):
    """CUDA looks present and initialised, but any CUDA RNG call fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a CPU run touched the CUDA RNG")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    for name in ("get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, refuse)


def _record_cuda_rng(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda device="cuda": calls.append(("get", str(device))) or torch.ones(4))
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device="cuda": calls.append(("set", str(device), state)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: calls.append(("get_all",)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: calls.append(("set_all",)))
    return calls


def _cpu_run(blobs, **overrides):
    return nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=4, **overrides),
                  progress=False)


def test_cpu_run_saves_and_resumes_without_touching_cuda(blobs, tmp_path, monkeypatch):
    _forbid_cuda_rng(monkeypatch)
    run = _cpu_run(blobs, checkpoint_dir=str(tmp_path))
    assert "cuda" not in run.state_dict()["rng"]
    assert "cuda" not in ckpt.load(ckpt.path_in(tmp_path))["rng"]
    for source in (run, ckpt.path_in(tmp_path)):
        resumed = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=6),
                         resume=source, progress=False)
        assert resumed.step == 6


def test_cuda_state_of_a_checkpoint_is_skipped_on_a_cpu_resume(blobs, monkeypatch):
    state = _cpu_run(blobs).state_dict()
    state["rng"]["cuda"] = torch.ones(4, dtype=torch.uint8)
    target = _cpu_run(blobs)
    _forbid_cuda_rng(monkeypatch)
    ckpt.restore(target, state)   # would raise if it touched torch.cuda
    assert target.step == 4


def test_saves_only_the_run_devices_cuda_state(blobs, monkeypatch):
    run = _cpu_run(blobs)
    run.resolved["device"] = ("cuda:1", "asked for")   # as if it had trained on the second GPU
    run._rng_at_end = None                               # read the RNG live
    calls = _record_cuda_rng(monkeypatch)
    state = run.state_dict()
    assert calls == [("get", "cuda:1")]
    assert torch.equal(state["rng"]["cuda"], torch.ones(4))


def test_restores_the_cuda_state_onto_the_resumed_runs_device(blobs, monkeypatch):
    state = _cpu_run(blobs).state_dict()
    saved = torch.full((4,), 7, dtype=torch.uint8)
    state["rng"]["cuda"] = saved   # trained on some GPU, whichever index it had
    target = _cpu_run(blobs)
    target.resolved["device"] = ("cuda:1", "asked for")   # resumed on another GPU index
    calls = _record_cuda_rng(monkeypatch)
    ckpt.restore(target, state)
    assert [c[:2] for c in calls] == [("set", "cuda:1")]
    assert torch.equal(calls[0][2], saved)


@pytest.mark.parametrize("device, restored", [("cuda:0", True), ("cuda:1", False)])
def test_older_checkpoints_with_every_devices_state_still_load(blobs, monkeypatch, device,
                                                               restored):
    state = _cpu_run(blobs).state_dict()
    state["rng"]["cuda"] = [torch.full((4,), 3, dtype=torch.uint8)]   # one GPU was visible
    target = _cpu_run(blobs)
    target.resolved["device"] = (device, "asked for")
    calls = _record_cuda_rng(monkeypatch)
    ckpt.restore(target, state)   # no IndexError when fewer GPUs than the index
    assert [c[:2] for c in calls] == ([("set", device)] if restored else [])


def test_two_runs_resumed_from_one_run_do_not_share_its_state(blobs):
    cfg = quick(optimizer="adamw", max_steps=10, log_every=1)
    torch.manual_seed(1)
    source = nt.fit(mlp(dropout=0.3), blobs, F.cross_entropy, config=cfg, progress=False)
    before = {i: {k: v.clone() for k, v in s.items()} for i, s in source.optimizer.state.items()}
    weights_before = {k: v.clone() for k, v in source.model.state_dict().items()}

    def branch():
        model = mlp(dropout=0.3)
        nt.fit(model, blobs, F.cross_entropy, config=cfg.replace(max_steps=20), resume=source,
               progress=False)
        return model.state_dict()
    first, second = branch(), branch()
    for a, b in zip(first.values(), second.values()):
        assert torch.equal(a, b)
    for i, s in source.optimizer.state.items():
        for k, v in s.items():
            assert torch.equal(v, before[i][k]), (i, k)
    for k, v in source.model.state_dict().items():
        assert torch.equal(v, weights_before[k])


def test_a_failed_save_keeps_the_old_checkpoint_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "last.pt"
    ckpt.save({"step": 1}, path)
    with pytest.raises(Exception):   # a lambda cannot be pickled: torch.save fails mid-write
        ckpt.save({"step": 2, "bad": lambda: None}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    assert torch.load(path, weights_only=True) == {"step": 1}
