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
import os
import queue as queue_module
import socket
import sys
import time
from typing import Optional, Tuple

import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from .. import checkpoint as ckpt
from ..auto.devices import resolve_device
from ..config import ConfigError, TrainConfig
from ..run import Run, TrainingError
from ..telemetry.gaps import PARTS
from ..train.optim import build_optimizer, resolve_impl
from ..train.prepare import batches_per_epoch, count_steps, dataset_length
from ..train.schedule import Schedule
from .ranks import KeptScalerState, RankFailure, pack, rank_main, unpack


def resolve_processes(run) -> int:
    """How many processes train the run; records the choice in run.resolved["processes"]."""
    requested = run.config.processes
    if requested != "auto":
        run.resolved["processes"] = (requested, "asked for")
        return requested
    device, _ = resolve_device(run.config.device) if run.config.device != "cpu" \
        else (torch.device("cpu"), "")
    choice = auto_processes(device, one_gpu_named=run.config.device.startswith("cuda:"))
    run.resolved["processes"] = choice
    return choice[0]


def auto_processes(device: torch.device, one_gpu_named: bool = False) -> tuple:
    """processes="auto" (fit's, and %%fasttrain --processes auto's): (N, why), a process
    on every visible GPU, one on a CPU."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus > 1 and one_gpu_named:
        # one GPU named: ranks on every GPU would each resolve it to that one (NCCL
        # refuses a GPU shared by two ranks)
        return (1, f"device={device} names one GPU: one process on it (device='cuda' or "
                   "'auto' trains on every visible GPU)")
    if gpus > 1:
        return (gpus, f"{gpus} visible GPUs: one process each")
    if gpus == 1:
        return (1, "one visible GPU: one process")
    return (1, f"device is {device.type}: one process uses every core (processes=N "
               "splits them between N processes)")


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
    (ray_train.Workers), not local processes."""
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
        return functools.partial(supervise, run, ranks)
    return begin


def _prepare_here(run: Run, model, train_data, state, world: int) -> None:
    """The notebook's Run as one process would have it before step 1 (steps, schedule,
    an optimizer over the notebook's model for the state that comes back), without
    moving the model or touching a GPU: the ranks resolve the rest and send it."""
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
    n = dataset_length(train_data)   # None: an IterableDataset, count_steps asks for max_steps
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

    def __init__(self, world: int, payload: dict, target=rank_main):
        ctx = mp.get_context(START_METHOD)
        ctx.set_forkserver_preload(["torch", "torch.distributed", "nbtrain.parallel.processes"])
        self.world = world
        self.queue = ctx.Queue()
        self.requests = Requests(ctx)
        blob = pack(payload)
        port = _free_port()
        self.procs = [ctx.Process(target=target, name=f"nbtrain-rank{rank}",
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
        """Why a rank that has not sent its end is gone, if one is."""
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def supervise(run: Run, ranks: Ranks, load_state=None) -> None:
    """Read the ranks' messages into the Run until every rank has ended or one failed;
    relay Stop; leave no process behind; then finish the Run as the loop would.
    `load_state(run, blob) -> rng`: rank 0's end state into the notebook (_load_state's
    default: fit's model, optimizer, schedule and loss scale; a cell's: its results)."""
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
            if kind == "record" and body["kind"] == "gaps":
                _take_gaps(run, rank, body)
            elif kind == "record":
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
        failure = (None, RankFailure("interrupted twice: the ranks were killed mid-step; the "
                                     "model keeps the weights it had before this run",
                                     interrupted=True))
    finally:
        ranks.end(patience_s=30 if failure is None else 0)
    _finish(run, ends, failure, position, elapsed_s=time.perf_counter() - start,
            load_state=load_state or (lambda run_, blob: _load_state(run_, unpack(blob))))


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


def _take_gaps(run: Run, rank: int, record: dict) -> None:
    """Rank 0's time between its steps, as the notebook's Run's (its own end adds the wall
    time, the processes' start included, to the steps)."""
    if rank == 0:
        for part in PARTS:
            run.between.add(part, record.get(part, 0.0))


def _follow(run: Run, record: dict) -> None:
    """The notebook's Run at the ranks' position while they train (the status line, the
    runs table and the ETA read it); _finish sets the final one from rank 0's state."""
    if record["kind"] == "train":
        run.move_to(record["step"], record.get("epoch"))


# What a rank raises when another rank is gone: the other rank's failure is the news.
_PEER_LOST = ("Connection reset", "Connection closed", "Broken pipe", "imed out", "NCCL")


def _root_cause(ranks: Ranks, failure, ends: dict, grace_s: float = 3.0):
    """The failure that is the cause: a rank that lost its peers fails too, often first,
    so wait a moment for the rank that raised (or died) and take that one."""
    failures, deadline = [failure], time.monotonic() + grace_s
    while any(word in failures[0][1].text for word in _PEER_LOST) \
            and time.monotonic() < deadline:
        died = ranks.silent(set(ends) | {rank for rank, _ in failures})
        if died:
            return None, RankFailure(died)
        try:
            kind, rank, body = ranks.queue.get(timeout=0.1)
        except queue_module.Empty:
            continue
        if kind == "failed":
            failures.append((rank, body))
            failures.sort(key=lambda f: any(w in f[1].text for w in _PEER_LOST))
    rank, body = failures[0]
    if any(word in body.text for word in _PEER_LOST):
        quiet = ranks.running(exclude={f[0] for f in failures})
        if quiet:
            body = body._replace(text=f"{body.text}\n  rank(s) {quiet} sent nothing and are "
                                 "still running: they hang (or are far slower); they were "
                                 "stopped")
    return rank, body


def _silence(ranks: Ranks, ends: dict, heard: float):
    why = ranks.silent(set(ends))
    if why is None and time.monotonic() - heard > 2 * RANK_TIMEOUT_S:
        why = (f"no rank sent a word for {2 * RANK_TIMEOUT_S:.0f} s: they hang (set "
               "NBTRAIN_RANK_TIMEOUT_S for slower steps); they were stopped")
    return None if why is None else (None, RankFailure(why))


def _take_ready(run: Run, body: dict) -> None:
    """Rank 0's resolved settings (device, amp, data path...) join the notebook's."""
    for name, choice in body["resolved"].items():
        run.resolved.setdefault(name, choice)
    run.equip(total_steps=body["total_steps"])


def _finish(run: Run, ends: dict, failure, position: tuple, elapsed_s: float,
            load_state) -> None:
    """End the notebook's Run as the loop ends its own: rank 0's weights, optimizer state,
    position and RNG in the Run; the error of a failed rank, naming it. Without rank 0's
    state the Run keeps what it had before, its `position` too, so a resume repeats
    nothing and skips nothing."""
    rng, state, error, message = None, None, None, None
    split = len({e.step for e in ends.values()}) > 1   # the stop agreement failed
    if failure is not None or split:
        run.move_to(*position)
    if failure is not None:
        rank, body = failure
        state = "interrupted" if body.interrupted else "failed"
        if state == "failed":
            error = _failure_error(run, rank, body)
    elif split:
        state = "failed"
        error = TrainingError("the ranks ended at different steps ("
                              + ", ".join(f"rank {r}: {e.step}" for r, e in
                                          sorted(ends.items())) + "); the model was "
                              "left as it was before this run", run)
    else:
        first = ends[0]
        rng = load_state(run, first.blob)
        message = next((e.message for e in ends.values() if e.message), "")
        if any(e.diverged for e in ends.values()):
            run.diverge(message)
        state = "interrupted" if run.interrupted else first.state
    run.finish(state, read_rng=lambda: rng if rng is not None else ckpt.rng_state(),
               elapsed_s=elapsed_s, error=error, message=message)


def _failure_error(run: Run, rank, body: RankFailure) -> BaseException:
    lost_peer = any(word in body.text for word in _PEER_LOST)   # the news is the other rank
    if body.before_start and body.exception is not None and not lost_peer:
        try:   # a bad setting found while preparing: the error one process would raise
            return unpack(body.exception)
        except Exception:
            pass
    where = f"rank {rank} of {run.resolved['processes'][0]}: " if rank is not None else ""
    return TrainingError(where + body.text, run)


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
