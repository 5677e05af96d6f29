"""TrainConfig(cluster="ray"): the per-rank loop inside Ray Train, on a local Ray instance
limited to this machine (2 workers, CPU, gloo).

Slow: starting Ray takes ~20 s and each Ray Train job ~40 s on 2 shared cores, so each
test trains once and checks several things of the same run. Skipped where Ray is missing.
"""
import os
import threading

import psutil
import pytest
import torch
from torch import nn

import nbtrain as nt
from nbtrain import checkpoint as ckpt
from nbtrain.config import ConfigError
from test_processes import digits_like, mlp, poisoned, sgd   # the local 2-process tests'

# what a CPU with avx512_bf16 does, on any CPU (conftest.bf16_cpu)
pytestmark = pytest.mark.usefixtures("bf16_cpu")

ray = pytest.importorskip("ray", reason='Ray is not installed: pip install "nbtrain[ray]"')
pytest.importorskip("ray.train.torch", reason='Ray Train is not installed: pip install "nbtrain[ray]"')


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module: 2 CPUs, no dashboard; shut down after, and
    none of the processes it started (GCS, raylet, workers: our descendants) outlives it."""
    assert not ray.is_initialized()
    os.environ.pop("RAY_ADDRESS", None)
    # a loaded 2-core machine can take more than Ray's default 30 s to start a raylet
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "180")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    yield
    ray.shutdown()
    gone, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, f"Ray processes outlived ray.shutdown(): {alive}"


def test_ray_equals_two_local_processes_and_records_arrive_live(local_ray, tmp_path):
    data, loss = digits_like(), nn.functional.cross_entropy
    local, on_ray = mlp(), mlp()
    nt.fit(local, data, loss, config=sgd(batch_size=16, processes=2), progress=False)
    seen_while_running = []
    run = nt.fit(on_ray, data, loss, progress=False, background=True,
                 config=sgd(batch_size=16, processes=2, cluster="ray",
                            checkpoint_dir=str(tmp_path)))
    run.subscribe(lambda r: seen_while_running.append(r["step"])
                  if r["kind"] == "train" and run.running else None)
    run.wait(600)
    assert run.state == "finished", run.error
    assert len(seen_while_running) >= 2, seen_while_running   # live, not at the end
    for a, b in zip(local.parameters(), on_ray.parameters()):   # the notebook's model object
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [r["step"] for r in run.records("train")] == [4, 8, 12, 16, 20, 24]
    assert run.resolved["processes"] == (2, "asked for")
    assert run.resolved["gpus_per_worker"][0] == 0
    assert run.resolved["backend"][0] == "gloo"
    assert run.resolved["cluster"][0] == "ray"
    # Ray's checkpoint of the end: resume= takes the run's storage folder
    storage = run.resolved["storage_path"][0]
    assert storage.startswith(str(tmp_path))
    state = torch.load(ckpt.checkpoint_path(storage), weights_only=True)
    assert state["position"]["step"] == 24
    again = nt.fit(mlp(), data, loss, config=sgd(batch_size=16).replace(max_steps=28),
                   resume=storage, progress=False)   # here, in one process
    assert again.state == "finished" and again.step == 28
    assert any("resumed a run of 2 process(es) with 1" in note for note in again.notes)


def test_set_lr_reaches_the_workers_and_stop_ends_the_run_at_a_step_boundary(local_ray):
    cfg = nt.TrainConfig(processes=2, cluster="ray", batch_size=8, max_steps=10**6,
                         log_every=5)
    run = nt.fit(mlp(), digits_like(), nn.functional.cross_entropy, config=cfg,
                 background=True, progress=False)
    first = threading.Event()
    run.subscribe(lambda r: first.set() if r["kind"] == "train" else None)
    assert first.wait(300), "no record from the workers"
    new_lr = threading.Event()
    run.subscribe(lambda r: new_lr.set() if r.get("lr") == pytest.approx(0.0123) else None)
    run.set_lr(0.0123)   # reaches the workers at their next interval boundary
    assert new_lr.wait(300), "the workers did not take the new LR"
    run.stop()
    run.wait(300)
    assert run.state == "stopped", run.error
    assert run.step % 5 == 0 and 0 < run.step < 10**6


def test_a_worker_that_raises_is_named_with_its_node(local_ray):
    cfg = nt.TrainConfig(processes=2, cluster="ray", batch_size=8, epochs=1, num_workers=0)
    with pytest.raises(nt.TrainingError) as info:
        nt.fit(mlp(), poisoned(), nn.functional.cross_entropy, config=cfg, progress=False)
    text = str(info.value)
    assert "rank " in text and " of 2" in text and "node 0 (" in text, text
    assert "sample 37 raised ValueError: unreadable record" in text, text
    assert info.value.run.state == "failed"


