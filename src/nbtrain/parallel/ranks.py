"""One rank of processes=N (and of Ray Train's workers): the payload unpacked, the process group\njoined, the same setup and loop as one process, DistributedDataParallel, the records sent\nback to the notebook."""
from __future__ import annotations

import io
import os
import signal
from datetime import timedelta
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import checkpoint as ckpt
from ..auto.devices import resolve_device, resolve_device_type, seed_all
from ..config import ConfigError, TrainConfig
from ..data.batches import source_of
from ..machine import available_cores
from ..run import Run
from ..train.loop import train_safely
from ..train.prepare import prepare as prepare_setup


def pack(payload: dict) -> bytes:
    """cloudpickle sends classes defined in a notebook cell by value; torch.save's format
    puts every tensor on the CPU when it is read back (map_location), whatever its device."""
    import cloudpickle
    buffer = io.BytesIO()
    torch.save(payload, buffer, pickle_module=cloudpickle)
    return buffer.getvalue()


def unpack(blob: bytes):
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)


class RankEnd(NamedTuple):
    """A rank's last message when it ran to its end (finished, stopped, diverged): the
    step it ended at and how. Rank 0's `blob` carries what the notebook takes back (fit's:
    the rank's Run.state_dict(); a cell's: the objects it made and trained)."""
    step: int
    state: str
    message: str = ""
    diverged: bool = False
    blob: Optional[bytes] = None


class RankFailure(NamedTuple):
    """A rank's last message when it failed: `text`, its error (a cell's: the formatted
    traceback); `exception`, the error itself, packed, where it was raised while preparing
    (`before_start`), for the notebook to raise as one process would. `interrupted`: the
    notebook's own end, a second Ctrl-C, which is no rank's error."""
    text: str
    before_start: bool = False
    exception: Optional[bytes] = None
    interrupted: bool = False


class KeptScalerState:
    """The notebook Run's stand-in for the ranks' GradScaler: it scales nothing (the
    notebook steps no optimizer) and keeps rank 0's state, fp16's loss scale, for the
    Run's checkpoints and a resume (a disabled GradScaler would drop it)."""

    def __init__(self):
        self.state: dict = {}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


# -- a rank's side ------------------------------------------------------------------------------
class RankRun(Run):
    """A rank's Run: records go to the notebook too; the notebook's Stop and set_lr are
    agreed by every rank at interval boundaries (one all_reduce every log_every steps, on
    a gloo group: no GPU sync); only rank 0 writes checkpoints."""

    def __init__(self, config: TrainConfig, rank: int, world: int, messages, requests,
                 control):
        super().__init__(config)
        self.rank, self.world, self.messages = rank, world, messages
        self.resolved["processes"] = (world, "asked for")   # for a resume's position
        self._requests, self._control = requests, control
        self._agreed, self._agreed_at = False, None

    def emit(self, record: dict, keep: bool = True) -> None:
        super().emit(record, keep)
        self.messages.put(("record", self.rank, record))

    @property
    def stop_requested(self) -> bool:
        """Every rank asks at the same steps (the loop is the same, the data as long), so
        every rank takes part in each agreement and all stop at the same step."""
        if self._agreed or self.step == self._agreed_at or self.step % self.config.log_every:
            return self._agreed
        self._agreed_at = self.step
        stop, lr = self._requests.read()
        # rank 0's reading of the LR counts: the notebook may change it between two reads
        asked = torch.tensor([float(stop or self._stop.is_set()), lr if self.rank == 0 else 0.0],
                             dtype=torch.float64)
        dist.all_reduce(asked, op=dist.ReduceOp.SUM, group=self._control)
        stop, lr = asked.tolist()   # a CPU tensor, every log_every steps: no device sync
        self._agreed = stop > 0
        if lr > 0 and hasattr(self.schedule, "base_lr"):
            self.schedule.base_lr = lr
        return self._agreed

    def stop_check(self):
        """stop_requested as a function (nt.watch asks at every step boundary; the ranks
        agree every log_every steps)."""
        return lambda: self.stop_requested

    def save(self, path) -> str:
        return super().save(path) if self.rank == 0 else str(path)


class SyncLast:
    """The DDP model's forward: gradients are all-reduced on the last micro-batch of a
    window only (`no_sync()` on the others; DDP reads the flag in forward). Without
    gradients (validation, an error's shape probe) the plain model runs: no collective that
    the other ranks would not join."""

    def __init__(self, ddp, forward, position):
        self.ddp, self.forward, self.position = ddp, forward, position
        self.window, self.seen = None, 0

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.ddp.module(*args, **kwargs)
        if self.position.window is not self.window:
            self.window, self.seen = self.position.window, 0
        self.seen += 1
        if self.seen < len(self.window):
            with self.ddp.no_sync():
                return self.forward(*args, **kwargs)
        return self.forward(*args, **kwargs)


def rank_main(rank: int, world: int, port: int, blob: bytes, messages, requests) -> None:
    """One local rank process: ignore Ctrl-C, run the rank, flush its messages."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the notebook relays Ctrl-C as a Stop

    def join(cfg: TrainConfig, device: torch.device, timeout_s: float) -> str:
        if device.type == "cuda":
            torch.cuda.set_device(rank)   # 'cuda' resolves to this rank's GPU
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        return backend

    try:
        run_rank(rank, world, blob, messages, requests, join,
                 leave=dist.destroy_process_group)
    finally:
        messages.close()
        messages.join_thread()   # the message is in the pipe before the process exits


def run_rank(rank: int, world: int, blob: bytes, messages, requests, join, leave=None,
             make_run=None) -> Optional[BaseException]:
    """One rank: join the group (`join(cfg, device, timeout_s)` -> backend), prepare as one
    process would, shard, wrap, train, tell `messages` how it went. Returns the exception
    it sent, if any (parallel/ray_train.py re-raises it so Ray ends the other workers)."""
    started = False
    try:
        payload = unpack(blob)
        os.environ.update(payload.get("env", {}))   # a forkserver's child has the server's
        cfg: TrainConfig = payload["config"]
        share = _share_cores(cfg, world)
        # join sets this rank's GPU: only then may the device be resolved ("auto" and
        # "cuda" are the current GPU, and asking for it before opens a context on GPU 0)
        backend = join(cfg, torch.device(resolve_device_type(cfg.device)), payload["timeout_s"])
        _refuse_a_shared_gpu(resolve_device(cfg.device)[0], rank, world)
        control = control_group(backend, payload["timeout_s"])
        run = (make_run or RankRun)(cfg, rank, world, messages, requests, control)
        setup = _prepare_rank(run, payload, backend, share)
        messages.put(("ready", rank, {"resolved": dict(run.resolved),
                                      "total_steps": run.total_steps}))
        started = True
        train_safely(run, setup)
        failed = run.error if run.state == "failed" else None
        messages.put(("failed", rank, RankFailure(str(run.error))) if failed is not None
                     else ("end", rank, _rank_end(run)))
        if leave is not None:
            leave()
        return failed
    except BaseException as exc:
        messages.put(("failed", rank, RankFailure(f"{type(exc).__name__}: {exc}",
                                                  before_start=not started,
                                                  exception=_packed_error(exc))))
        return exc


def control_group(backend: str, timeout_s: float):
    """The group Stop and set_lr are agreed on: gloo, a CPU tensor, no GPU sync. Beside
    NCCL a gloo group of its own, with the ranks' timeout (new_group's default is
    torch's 30 minutes, not the one init_process_group was given)."""
    if backend != "nccl":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _refuse_a_shared_gpu(device: torch.device, rank: int, world: int) -> None:
    """Each rank trains on the GPU join gave it: a device that names another (cuda:N) would
    put two ranks on one GPU, which NCCL refuses with an unclear error."""
    if world > 1 and device.type == "cuda" and device.index != torch.cuda.current_device():
        raise ConfigError(f"rank {rank} of {world} would train on {device}, not on its own GPU "
                          f"cuda:{torch.cuda.current_device()}: every rank would share it. Use "
                          "device='cuda' or 'auto' with several processes.", field="device")


def _share_cores(cfg: TrainConfig, world: int) -> int:
    """This rank's cores: intra-op threads, loader workers and threads resolve within them
    (available_cores reads LOKY_MAX_CPU_COUNT, as joblib does)."""
    share = max(1, available_cores() // world)
    os.environ["LOKY_MAX_CPU_COUNT"] = str(share)
    torch.set_num_threads(share if cfg.num_threads == "auto" else cfg.num_threads)
    return share


def _prepare_rank(run: RankRun, payload: dict, backend: str, share: int):
    cfg, state = run.config, payload["state"]
    model = payload["model"]
    def shard(batches):   # this rank's share of every epoch, before a probe reads a sample
        _plan(source_of(batches)).shard(run.rank, run.world)
        return batches
    setup = prepare_setup(run, model, payload["train_data"], payload["loss_fn"],
                          payload["val_data"], state, shard)   # a resume keeps its timed choices
    run.resolved["backend"] = (backend, "CUDA: one GPU per process" if backend == "nccl"
                               else f"CPU: {share} intra-op thread(s) per process")
    if cfg.num_threads == "auto" and setup.device.type == "cpu":
        run.resolved["num_threads"] = (share, f"{share * run.world} cores split between {run.world} processes")
    _agree_on_amp(run, setup)
    _shard_validation(run, setup)
    ddp = DistributedDataParallel(model, device_ids=[setup.device.index]
                                  if setup.device.type == "cuda" else None)
    setup.forward = SyncLast(ddp, torch.compile(ddp) if cfg.compile else ddp, setup.position)
    if state is not None:
        ckpt.restore(run, state)
    else:
        seed_all(cfg.seed)   # the same on every rank: resumes restore rank 0's RNG
    if payload["schedule"] is not None:
        run.equip(schedule=payload["schedule"](run.schedule))
    return setup


def _plan(batches):
    """The EpochPlan that orders `batches`: a loader's sampler, or tensor batches themselves."""
    return getattr(batches, "sampler", batches)


def _shard_validation(run: RankRun, setup) -> None:
    """Each rank validates its share of val_data (every sample, once over the ranks) and
    loop.evaluate sums the shares' totals. Your own DataLoader cannot be split: every rank
    validates all of it, and the sums over the ranks still give its mean."""
    if setup.val_batches is None:
        return
    plan = _plan(setup.val_batches)
    if hasattr(plan, "shard"):
        plan.shard(run.rank, run.world, every_sample=True)

    def sum_ranks(totals: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(totals)
        return totals
    setup.sum_ranks = sum_ranks


def _agree_on_amp(run: RankRun, setup) -> None:
    """amp='auto' on a CPU is measured per process: rank 0's choice holds for all."""
    choice = [run.resolved["amp"]]
    dist.broadcast_object_list(choice, src=0)
    run.resolved["amp"] = choice[0]
    setup.amp = choice[0][0]


def _rank_end(run: RankRun) -> RankEnd:
    """This rank's end; rank 0's carries its Run's state for the notebook's Run."""
    blob = None
    if run.rank == 0:
        buffer = io.BytesIO()
        torch.save(run.state_dict(), buffer)
        blob = buffer.getvalue()
    return RankEnd(step=run.step, state=run.state, message=run.message,
                   diverged=run.diverged, blob=blob)


def _packed_error(exc: BaseException) -> Optional[bytes]:
    try:
        return pack(exc)
    except Exception:
        return None
