"""The same run on a Ray cluster: TrainConfig(cluster="ray", processes=N).

nbtrain schedules nothing itself: it hands processes.py's per-rank function
(`ranks.run_rank`: prepare as one process would, shard, DDP, train, send back) to
`ray.train.torch.TorchTrainer` with `ScalingConfig(num_workers=N, use_gpu=...)`, on
whatever cluster `ray.init()` finds (RAY_ADDRESS, or a local instance it starts). Ray
joins the workers into one torch.distributed group (gloo on CPU, nccl on GPU). The
workers' messages come back through a `ray.util.queue.Queue` (an actor), so the
notebook's side is processes.py's own: records merged into the notebook's one Run,
Stop and set_lr agreed by the workers at interval boundaries (an actor they read), rank
0's weights loaded into the user's model. Checkpoints go through Ray's checkpointing to
`checkpoint_dir` (Ray's `storage_path`); `resume=` takes the Result, a Checkpoint or its
folder.
"""
from __future__ import annotations

import os
import queue as queue_module
import tempfile
import threading
import time
from typing import Optional

import torch

from .. import checkpoint as ckpt
from ..config import ConfigError
from ..run import Run
from . import processes, ranks

INSTALL = 'pip install "nbtrain[ray]"'


def _ray():
    try:
        import ray
        import ray.train.torch  # noqa: F401  (TorchTrainer, with ray[train]'s extras)
        from ray.util.queue import Queue  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"TrainConfig.cluster='ray' needs Ray Train ({exc}): {INSTALL}",
                          field="cluster") from None
    return ray


def connect(run: Run):
    """ray.init() once per kernel: RAY_ADDRESS's cluster, or a local instance (kept for the
    next run: starting one takes seconds). Records what it found in run.resolved."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, log_to_driver=False)
    where = os.environ.get("RAY_ADDRESS") or "the Ray instance of this kernel"
    resources = ray.cluster_resources()
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    run.resolved["cluster"] = ("ray", f"{where}: {nodes} node(s), "
                               f"{resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs")
    return resources, nodes


def resolve_workers(run: Run, resources: dict, nodes: int) -> tuple:
    """(workers, GPUs per worker) from processes and gpus_per_worker, with the reasons."""
    cfg = run.config
    gpus = resources.get("GPU", 0)
    if cfg.processes != "auto":
        workers = (cfg.processes, "asked for")
    elif gpus >= 1 and cfg.device != "cpu":
        workers = (int(gpus), f"{gpus:g} GPUs in the cluster: one worker each")
    else:
        workers = (max(1, nodes), f"no GPU asked for: one worker per node ({nodes})")
    if cfg.gpus_per_worker != "auto":
        per = (cfg.gpus_per_worker, "asked for")
    elif cfg.device != "cpu" and gpus >= workers[0]:
        per = (1, f"the cluster has {gpus:g} GPUs for {workers[0]} worker(s)")
    else:
        per = (0, "device='cpu'" if cfg.device == "cpu"
               else f"the cluster has {gpus:g} GPUs for {workers[0]} worker(s): CPU workers")
    if per[0] and cfg.device == "cpu":
        raise ConfigError(f"TrainConfig.gpus_per_worker={cfg.gpus_per_worker} asks for GPUs, "
                          "but device='cpu'. Use device='auto' or 'cuda', or gpus_per_worker=0.",
                          field="gpus_per_worker")
    run.resolved["processes"] = workers
    run.resolved["gpus_per_worker"] = per
    return workers[0], per[0]


def prepare(run: Run, model, train_data, loss_fn, val_data, state, schedule):
    """The engine for cluster='ray' (see entry._engine): processes.prepare's notebook
    side with Ray's workers as the ranks."""
    resources, nodes = connect(run)   # without Ray: a ConfigError saying how to install it
    world, gpus = resolve_workers(run, resources, nodes)
    if gpus and resources.get("GPU", 0) < world * gpus:
        raise ConfigError(f"TrainConfig.processes={world} workers x gpus_per_worker={gpus} "
                          f"need {world * gpus:g} GPUs; the cluster has "
                          f"{resources.get('GPU', 0):g}. Lower processes or gpus_per_worker.",
                          field="processes")
    return processes.prepare(run, model, train_data, loss_fn, val_data, state, schedule,
                               start=lambda payload: Workers(run, world, gpus, payload))


class _Requests:
    """The notebook's Stop and set_lr as the workers see them (processes.Requests's
    interface): an actor they ask once per interval."""

    def __init__(self, ray):
        @ray.remote(num_cpus=0)
        class Requests:
            def __init__(self):
                self.stopped, self.lr = False, 0.0

            def stop(self):
                self.stopped = True

            def set_lr(self, lr):
                self.lr = lr

            def read(self):
                return self.stopped, self.lr

        self.actor = Requests.remote()

    def stop(self) -> None:
        self.actor.stop.remote()

    def set_lr(self, lr: float) -> None:
        self.actor.set_lr.remote(lr)


class _RemoteRequests:
    """What a worker holds: read() asks the actor."""

    def __init__(self, actor):
        self.actor = actor

    def read(self) -> tuple:
        import ray
        return ray.get(self.actor.read.remote())


class _Messages:
    """The Ray queue as processes.supervise reads a multiprocessing queue."""

    def __init__(self, ray):
        from ray.util.queue import Queue
        self.ray_queue = Queue(actor_options={"num_cpus": 0})

    def get(self, timeout: float):
        from ray.util.queue import Empty
        try:
            return self.ray_queue.get(timeout=timeout)
        except Empty:
            raise queue_module.Empty from None


class Workers:
    """One run's Ray Train job, with processes.Ranks's interface for supervise: the
    message queue, the notebook's requests, who is still running, why one is gone, the end."""

    def __init__(self, run: Run, world: int, gpus: float, payload: dict):
        ray = _ray()
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
        cfg = run.config
        self.world, self.queue, self.requests = world, _Messages(ray), _Requests(ray)
        self.result, self.error = None, None
        storage = (cfg.checkpoint_dir if "://" in cfg.checkpoint_dir   # s3://, gs://...
                   else os.path.abspath(cfg.checkpoint_dir)) if cfg.checkpoint_dir \
            else tempfile.mkdtemp(prefix="nbtrain-ray-")
        name = f"nbtrain-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        run.resolved["storage_path"] = (os.path.join(storage, name),
                                        "checkpoint_dir" if cfg.checkpoint_dir
                                        else "a temporary folder (set checkpoint_dir)")
        self.trainer = TorchTrainer(
            _worker_main,
            train_loop_config={"blob": ranks.pack(payload),
                               "queue": self.queue.ray_queue, "requests": self.requests.actor},
            scaling_config=ScalingConfig(num_workers=world, use_gpu=bool(gpus),
                                         resources_per_worker={"GPU": gpus} if gpus else None),
            torch_config=TorchConfig(backend="nccl" if gpus else "gloo",
                                     timeout_s=int(processes.RANK_TIMEOUT_S)),
            run_config=RunConfig(storage_path=storage, name=name,
                                 failure_config=FailureConfig(max_failures=0)))
        self.thread = threading.Thread(target=self._fit, name="nbtrain-ray", daemon=True)
        self.thread.start()

    def _fit(self) -> None:
        try:
            self.result = self.trainer.fit()
        except BaseException as exc:   # a worker's error, or Ray's: silent() says it
            self.error = exc

    def running(self, exclude: set) -> list:
        return [r for r in range(self.world) if r not in exclude] if self.thread.is_alive() \
            else []

    def silent(self, done: set) -> Optional[str]:
        if self.thread.is_alive() or len(done) >= self.world \
                or not self.queue.ray_queue.empty():   # their last words are still queued
            return None
        missing = [r for r in range(self.world) if r not in done]
        why = f"{type(self.error).__name__}: {self.error}" if self.error is not None \
            else "the Ray job ended"
        return (f"worker(s) {missing} of {self.world} ended without a word ({why}); "
                "the others were stopped")

    def end(self, patience_s: float) -> None:
        """Wait `patience_s` for Ray's job to end (a failed worker ends it: Ray stops the
        others), then free the queue and flag actors."""
        self.thread.join(max(patience_s, 60))
        ray = _ray()
        for actor in (self.queue.ray_queue.actor, self.requests.actor):
            ray.kill(actor)


def _worker_main(config: dict) -> None:
    """A Ray Train worker: ranks.run_rank in the process group Ray set up."""
    import ray
    import ray.train
    import torch.distributed as dist
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    where = f"node {context.get_node_rank()} ({ray.util.get_node_ip_address()}), "

    def join(cfg, device, timeout_s):
        if device.type == "cuda":
            import ray.train.torch
            torch.cuda.set_device(ray.train.torch.get_device())
        return dist.get_backend()

    def make_run(*args):
        return RayRankRun(*args)

    messages = _Named(config["queue"], where)
    failed = ranks.run_rank(rank, world, config["blob"], messages,
                                  _RemoteRequests(config["requests"]), join,
                                  make_run=make_run)
    if failed is not None:   # Ray ends the other workers and the job
        raise RuntimeError(f"rank {rank}: {where}{failed}")


class _Named:
    """The worker's side of the queue: a failure's text names the node first."""

    def __init__(self, ray_queue, where: str):
        self.ray_queue, self.where = ray_queue, where

    def put(self, message) -> None:
        kind, rank, body = message
        if kind == "failed":
            body = body._replace(text=self.where + body.text)
        self.ray_queue.put((kind, rank, body))


class RayRankRun(ranks.RankRun):
    """A worker's Run: checkpoints through Ray (`ray.train.report`, every worker at the
    same step; rank 0's carries nbtrain's checkpoint file)."""

    def save(self, path) -> str:
        import ray.train
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = None
            if self.rank == 0:
                ckpt.save(self.state_dict(), os.path.join(folder, ckpt.CHECKPOINT_FILE))
                checkpoint = ray.train.Checkpoint.from_directory(folder)
            ray.train.report({"step": self.step, "epoch": self.epoch}, checkpoint=checkpoint)
        return str(path)
