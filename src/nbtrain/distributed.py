"""Data-parallel training in local processes on torch.distributed: TrainConfig(processes=N).

`fit` hands a run with processes > 1 here. This, the notebook's process, starts N rank
processes; each runs the same per-rank loop as a one-process fit (prepare.prepare,
loop.train_safely) on its share of each epoch's samples, with the model wrapped in
DistributedDataParallel: gradients travel only through torch.distributed (gloo on CPU,
nccl on CUDA, one GPU per rank). The ranks' records stream back through a queue into the
notebook's one Run, so the Panel, Dashboard and progress bar work unchanged; Stop is
agreed by all ranks at interval boundaries; at the end the user's model object holds rank
0's weights and run.optimizer its state.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import queue as queue_module
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from . import checkpoint as ckpt
from .config import ConfigError, TrainConfig
from .data.batches import source_of
from .devices import available_cores, resolve_device, resolve_device_type, seed_all
from .optim import build_optimizer, resolve_impl
from .loop import train_safely
from .prepare import batches_per_epoch, count_steps, samples_in
from .prepare import prepare as prepare_setup
from .run import Run, TrainingError
from .schedule import Schedule


def resolve_processes(run) -> int:
    """How many processes train the run; records the choice in run.resolved["processes"]."""
    requested = run.config.processes
    if requested != "auto":
        run.resolved["processes"] = (requested, "asked for")
        return requested
    device, _ = resolve_device(run.config.device) if run.config.device != "cpu" \
        else (torch.device("cpu"), "")
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus > 1 and run.config.device.startswith("cuda:"):
        # one GPU named: ranks on every GPU would each resolve it to that one (NCCL
        # refuses a GPU shared by two ranks)
        choice = (1, f"device={run.config.device!r} names one GPU: one process on it "
                     "(device='cuda' or 'auto' trains on every visible GPU)")
    elif gpus > 1:
        choice = (gpus, f"{gpus} visible GPUs: one process each")
    elif gpus == 1:
        choice = (1, "one visible GPU: one process")
    else:
        choice = (1, f"device is {device.type}: one process uses every core (processes=N "
                     "splits them between N processes)")
    run.resolved["processes"] = choice
    return choice[0]


# -- the notebook's side ------------------------------------------------------------------------
START_METHOD = "forkserver"
START_WHY = ("forked from a fresh server process that imported torch once (a spawn imports "
             "it again per rank: seconds), never from this kernel: safe when it has already "
             "initialised CUDA (a forked CUDA context is unusable); the model, data and loss "
             "travel with cloudpickle, so classes defined in a notebook cell work")
# A rank that waits this long in a collective for the others gives up (a rank that hangs
# or died); the notebook gives up on ranks it has not heard from for twice as long.
RANK_TIMEOUT_S = float(os.environ.get("NBTRAIN_RANK_TIMEOUT_S", 300))


def prepare(run: Run, model, train_data, loss_fn, val_data, state, schedule,
            start=None):
    """The engine for processes > 1 (see entry._engine): the notebook's Run prepared as
    one process's would be, without touching a GPU; returns `begin()`, which starts the
    ranks and returns the function that supervises them. Raises before any process
    starts for data that cannot be split. `start(payload)`: ranks elsewhere
    (ray_cluster.Workers), not local processes."""
    cfg, world = run.config, run.resolved["processes"][0]
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}.")
    if isinstance(train_data, DataLoader):
        raise ConfigError(
            f"TrainConfig.processes={cfg.processes} cannot split your own DataLoader between "
            "processes (its sampler is its own). Pass its dataset instead (train_data="
            "loader.dataset) and set batch_size (per process) and num_workers in TrainConfig; "
            "nbtrain then gives each process its share of every epoch.", field="processes")
    gpus = torch.cuda.device_count() if cfg.device != "cpu" and start is None else 0
    if gpus and world > gpus:
        raise ConfigError(f"TrainConfig.processes={cfg.processes} needs a GPU per process; "
                          f"this machine has {gpus}. Use processes<={gpus} (or 'auto'), or "
                          "device='cpu'.", field="processes")
    _prepare_here(run, model, train_data, state, world)
    payload = dict(model=model, train_data=train_data, loss_fn=loss_fn, val_data=val_data,
                   config=cfg, state=state, schedule=schedule, timeout_s=RANK_TIMEOUT_S,
                   env=nbtrain_environment())

    def begin():
        ranks = Ranks(world, payload) if start is None else start(payload)
        return functools.partial(_supervise, run, ranks)
    return begin


def _prepare_here(run: Run, model, train_data, state, world: int) -> None:
    """The notebook's Run as one process would have it before step 1 (steps, schedule,
    an optimizer over the notebook's model for the state that comes back), without
    moving the model or touching a GPU: the ranks resolve the rest and report it."""
    cfg = run.config
    _refuse_fewer_samples_than_processes(train_data, cfg, world)
    total_steps = count_steps(cfg, batches_per_epoch(cfg, train_data, world))
    device = next(model.parameters(), torch.empty(0)).device
    run.resolved["optimizer_impl"] = resolve_impl(cfg, device)
    run.resolved["global_batch_size"] = (
        cfg.batch_size * world, f"batch_size {cfg.batch_size} per process x {world} processes"
        + (f"; {cfg.batch_size * world * cfg.grad_accum_steps} samples per step with "
           f"grad_accum_steps={cfg.grad_accum_steps}" if cfg.grad_accum_steps > 1 else ""))
    if run.config.cluster is None:
        run.resolved["start_method"] = (START_METHOD, START_WHY)
    run.equip(model=model, total_steps=total_steps,
              optimizer=build_optimizer(model, cfg, run.resolved["optimizer_impl"][0]),
              schedule=Schedule(cfg, total_steps), scaler=KeptScalerState())
    if state is not None:
        ckpt.restore(run, state)


def _refuse_fewer_samples_than_processes(train_data, cfg: TrainConfig, world: int) -> None:
    n = samples_in(train_data)   # None: an IterableDataset, count_steps asks for max_steps
    if n is not None and n < world:
        raise ConfigError(f"TrainConfig.processes={cfg.processes} is more than train_data's "
                          f"{n} sample(s): each process needs at least one. Lower processes.",
                          field="processes")


class Requests:
    """What the notebook asks of running ranks: Stop, and a new base LR (`run.set_lr`).
    The ranks read both at interval boundaries and agree on them (RankRun.stop_requested)."""

    def __init__(self, ctx):
        self._stop, self._lr = ctx.Event(), ctx.Value("d", 0.0)

    def stop(self) -> None:
        self._stop.set()

    def set_lr(self, lr: float) -> None:
        self._lr.value = lr

    def read(self) -> Tuple[bool, float]:
        """(Stop asked, the base LR asked for or 0.0)."""
        return self._stop.is_set(), self._lr.value


class Ranks:
    """The rank processes of one run, their queue of messages and the notebook's requests."""

    def __init__(self, world: int, payload: dict):
        ctx = mp.get_context(START_METHOD)
        ctx.set_forkserver_preload(["torch", "torch.distributed", "nbtrain.distributed"])
        self.world = world
        self.queue = ctx.Queue()
        self.requests = Requests(ctx)
        blob = pack(payload)
        port = _free_port()
        self.procs = [ctx.Process(target=_rank_main, name=f"nbtrain-rank{rank}",
                                  args=(rank, world, port, blob, self.queue, self.requests))
                      for rank in range(world)]
        with _main_module_not_rerun():
            for proc in self.procs:
                proc.start()

    def end(self, patience_s: float) -> None:
        """No process is left: wait `patience_s` for each to exit, then terminate, then kill."""
        deadline = time.monotonic() + patience_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.queue.cancel_join_thread()
        self.queue.close()

    def running(self, exclude: set) -> list:
        """The ranks still running, but those in `exclude`."""
        return [r for r, proc in enumerate(self.procs) if proc.is_alive() and r not in exclude]

    def silent(self, done: set) -> Optional[str]:
        """Why a rank that has not reported its end is gone, if one is."""
        for rank, proc in enumerate(self.procs):
            if rank not in done and proc.exitcode is not None:
                how = f"was killed by signal {-proc.exitcode}" if proc.exitcode < 0 \
                    else f"exited with code {proc.exitcode}"
                return (f"rank {rank} of {self.world} {how} without a word (out of memory? "
                        "a crash in native code?); the other ranks were stopped")
        return None


def nbtrain_environment() -> dict:
    """The notebook's NBTRAIN_* variables (the cache folder, the tests' bf16 settings),
    for the ranks: forkserver children and Ray's workers start with another environment."""
    return {name: value for name, value in os.environ.items() if name.startswith("NBTRAIN_")}


@contextlib.contextmanager
def _main_module_not_rerun():
    """spawn runs the parent's main script again in each child, unless it is guarded by
    `if __name__ == "__main__"`: a script calling fit would train again in every rank.
    The ranks need nothing from it (cloudpickle sends what it defines by value), so hide
    the script from spawn while the ranks start."""
    main = sys.modules.get("__main__")
    hidden = {name: getattr(main, name) for name in ("__file__", "__spec__")
              if main is not None and getattr(main, name, None) is not None}
    for name in hidden:
        setattr(main, name, None)
    try:
        yield
    finally:
        for name, value in hidden.items():
            setattr(main, name, value)


def pack(payload: dict) -> bytes:
    """cloudpickle sends classes defined in a notebook cell by value; torch.save's format
    puts every tensor on the CPU when it is read back (map_location), whatever its device."""
    import cloudpickle
    buffer = io.BytesIO()
    torch.save(payload, buffer, pickle_module=cloudpickle)
    return buffer.getvalue()


def unpack(blob: bytes):
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _supervise(run: Run, ranks: Ranks) -> None:
    """Read the ranks' messages into the Run until every rank has ended or one failed;
    relay Stop; leave no process behind; then finish the Run as the loop would."""
    start, heard = time.perf_counter(), time.monotonic()
    merger, ends, failure = RecordMerger(ranks.world), {}, None
    position = run.position   # _follow moves the Run while they train
    relay = _Relay(run, ranks.requests)
    run.start()
    try:
        while len(ends) < ranks.world and failure is None:
            relay()
            try:
                kind, rank, body = ranks.queue.get(timeout=0.1)
            except queue_module.Empty:
                failure = _silence(ranks, ends, heard)
                continue
            heard = time.monotonic()
            if kind == "record":
                for record in merger.add(rank, body):
                    _follow(run, record)
                    run.emit(record)
            elif kind == "ready" and rank == 0:
                _take_ready(run, body)
            elif kind == "end":
                ends[rank] = body
            elif kind == "failed":
                failure = _root_cause(ranks, (rank, body), ends)
    except KeyboardInterrupt:   # a second Ctrl-C: the ranks are killed, not waited for
        failure = (None, {"text": "interrupted twice: the ranks were killed mid-step; the "
                                  "model keeps the weights it had before this run",
                          "interrupted": True})
    finally:
        ranks.end(patience_s=30 if failure is None else 0)
    _finish(run, ends, failure, position, elapsed_s=time.perf_counter() - start)


class _Relay:
    """Passes the notebook's Stop and set_lr on to the ranks, each once; they take them at
    their next interval boundary (a new LR from the step after it)."""

    def __init__(self, run: Run, requests):
        self.run, self.requests = run, requests
        # None: the first call sends the LR, even one set before the relay started
        # (on_start, Panel.resume right after fit returns)
        self.stopped, self.lr = False, None

    def _base_lr(self):
        return getattr(self.run.schedule, "base_lr", None)   # lr_find swaps the schedule

    def __call__(self) -> None:
        if self.run.stop_requested and not self.stopped:
            self.requests.stop()
            self.stopped = True
        lr = self._base_lr()
        if lr != self.lr:
            self.lr = lr
            if lr is not None:
                self.requests.set_lr(lr)


def _follow(run: Run, record: dict) -> None:
    """The notebook's Run at the ranks' position while they train (the status line, the
    runs table and the ETA read it); _finish sets the final one from rank 0's state."""
    if record["kind"] == "train":
        run.move_to(record["step"], record.get("epoch"))


# What a rank raises when another rank is gone: the other rank's failure is the news.
_PEER_LOST = ("Connection reset", "Connection closed", "Broken pipe", "imed out", "NCCL")


def _root_cause(ranks: Ranks, failure, ends: dict, grace_s: float = 3.0):
    """The failure to report: a rank that lost its peers fails too, often first, so wait
    a moment for the rank that raised (or died) and report that one."""
    failures, deadline = [failure], time.monotonic() + grace_s
    while any(word in failures[0][1]["text"] for word in _PEER_LOST) \
            and time.monotonic() < deadline:
        died = ranks.silent(set(ends) | {rank for rank, _ in failures})
        if died:
            return None, {"text": died}
        try:
            kind, rank, body = ranks.queue.get(timeout=0.1)
        except queue_module.Empty:
            continue
        if kind == "failed":
            failures.append((rank, body))
            failures.sort(key=lambda f: any(w in f[1]["text"] for w in _PEER_LOST))
    rank, body = failures[0]
    if any(word in body["text"] for word in _PEER_LOST):
        quiet = ranks.running(exclude={f[0] for f in failures})
        if quiet:
            body = dict(body, text=f"{body['text']}\n  rank(s) {quiet} sent nothing and are "
                        "still running: they hang (or are far slower); they were stopped")
    return rank, body


def _silence(ranks: Ranks, ends: dict, heard: float):
    why = ranks.silent(set(ends))
    if why is None and time.monotonic() - heard > 2 * RANK_TIMEOUT_S:
        why = (f"no rank reported for {2 * RANK_TIMEOUT_S:.0f} s: they hang (set "
               "NBTRAIN_RANK_TIMEOUT_S for slower steps); they were stopped")
    return None if why is None else (None, {"text": why})


def _take_ready(run: Run, body: dict) -> None:
    """Rank 0's resolved settings (device, amp, data path...) join the notebook's."""
    for name, choice in body["resolved"].items():
        run.resolved.setdefault(name, choice)
    run.equip(total_steps=body["total_steps"])


def _finish(run: Run, ends: dict, failure, position: tuple, elapsed_s: float) -> None:
    """End the notebook's Run as the loop ends its own: rank 0's weights, optimizer state,
    position and RNG in the Run; the error of a failed rank, naming it. Without rank 0's
    state the Run keeps what it had before, its `position` too, so a resume repeats
    nothing and skips nothing."""
    rng, state, error, message = None, None, None, None
    split = len({e["step"] for e in ends.values()}) > 1   # the stop agreement failed
    if failure is not None or split:
        run.move_to(*position)
    if failure is not None:
        rank, body = failure
        state = "interrupted" if body.get("interrupted") else "failed"
        if state == "failed":
            error = _failure_error(run, rank, body)
    elif split:
        state = "failed"
        error = TrainingError("the ranks ended at different steps ("
                              + ", ".join(f"rank {r}: {e['step']}" for r, e in
                                          sorted(ends.items())) + "); the model was "
                              "left as it was before this run", run)
    else:
        first = ends[0]
        rng = _load_state(run, unpack(first["blob"]))
        message = next((e["message"] for e in ends.values() if e["message"]), "")
        if any(e["diverged"] for e in ends.values()):
            run.diverge(message)
        state = "interrupted" if run.interrupted else first["state"]
    run.finish(state, read_rng=lambda: rng if rng is not None else ckpt.rng_state(),
               elapsed_s=elapsed_s, error=error, message=message)


def _failure_error(run: Run, rank, body: dict) -> BaseException:
    lost_peer = any(word in body["text"] for word in _PEER_LOST)   # the news is the other rank
    if body.get("before_start") and body.get("exception") is not None and not lost_peer:
        try:   # a bad setting found while preparing: the error one process would raise
            return unpack(body["exception"])
        except Exception:
            pass
    where = f"rank {rank} of {run.resolved['processes'][0]}: " if rank is not None else ""
    return TrainingError(where + body["text"], run)


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


def _load_state(run: Run, state: dict) -> dict:
    """Rank 0's model, optimizer, schedule, loss scale and position into the notebook's Run."""
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.schedule.load_state_dict(state["schedule"])
    run.scaler.load_state_dict(state["scaler"])
    run.move_to(**{k: state["position"][k] for k in ("step", "epoch", "batch_in_epoch")})
    return state["rng"]


class RecordMerger:
    """One train record per interval from the ranks' records of it: samples/s summed over
    the ranks, the loss averaged, the time split of the slowest rank (`slowest_rank`)."""

    def __init__(self, world: int):
        self.world, self.waiting = world, {}

    def add(self, rank: int, record: dict) -> list:
        if record["kind"] == "end":
            return []
        if record["kind"] != "train":
            return [record] if rank == 0 else []   # validation: already summed over the ranks
        parts = self.waiting.setdefault(record["step"], {})
        parts[rank] = record
        if len(parts) < self.world:
            return []
        del self.waiting[record["step"]]
        return [merge_ranks([parts[r] for r in range(self.world)])]


def merge_ranks(records: list) -> dict:
    slowest = max(range(len(records)), key=lambda r: records[r]["step_time_s"])
    out = dict(records[slowest])
    losses = [r["loss"] for r in records]
    out.update(loss=sum(losses) / len(losses), slowest_rank=slowest,
               samples=sum(r["samples"] for r in records),
               samples_per_s=sum(r["samples_per_s"] for r in records),
               rank_step_time_s=[r["step_time_s"] for r in records])
    bad = [r["first_nonfinite_step"] for r in records if "first_nonfinite_step" in r]
    if bad:
        out["first_nonfinite_step"] = min(bad)
    return out


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


def _rank_main(rank: int, world: int, port: int, blob: bytes, messages, requests) -> None:
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
    process would, shard, wrap, train, report to `messages`. Returns the exception it
    reported, if any (ray_cluster.py re-raises it so Ray ends the other workers)."""
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
        control = _control_group(backend, payload["timeout_s"])
        run = (make_run or RankRun)(cfg, rank, world, messages, requests, control)
        setup = _prepare_rank(run, payload, backend, share)
        messages.put(("ready", rank, {"resolved": dict(run.resolved),
                                      "total_steps": run.total_steps}))
        started = True
        train_safely(run, setup)
        failed = run.error if run.state == "failed" else None
        messages.put(("failed", rank, {"text": str(run.error)}) if failed is not None
                     else ("end", rank, _end_report(run)))
        if leave is not None:
            leave()
        return failed
    except BaseException as exc:
        messages.put(("failed", rank, {"text": f"{type(exc).__name__}: {exc}",
                                       "before_start": not started,
                                       "exception": _packed_error(exc)}))
        return exc


def _control_group(backend: str, timeout_s: float):
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
    (joblib, behind available_cores, reads LOKY_MAX_CPU_COUNT)."""
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


def _end_report(run: RankRun) -> dict:
    report = {"state": run.state, "message": run.message, "diverged": run.diverged,
              "step": run.step, "blob": None}
    if run.rank == 0:
        buffer = io.BytesIO()
        torch.save(run.state_dict(), buffer)
        report["blob"] = buffer.getvalue()
    return report


def _packed_error(exc: BaseException) -> Optional[bytes]:
    try:
        return pack(exc)
    except Exception:
        return None
