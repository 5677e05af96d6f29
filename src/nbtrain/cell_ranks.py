"""A notebook cell (or a script) that trains, as written, in N processes: the engine of
%%fasttrain --processes N and `nbtrain run --processes N script.py`.

It sits beside entry.py, in the way in: each rank runs the cell inside entry's nt.watch,
and the notebook's Run is kept and shown as a watch's is (entry.keep, attach_hooks), so it
imports the entry; the magic and the command line only call `train_cell`/`run_script`.

The notebook's side sends the cell's text and the namespace it needs (cloudpickle: classes
and functions the notebook defined travel by value) to N rank processes
(parallel/processes.py's Ranks, supervised as nt.fit's ranks are). Each rank runs the cell
inside nt.watch, whose DataParallel part makes the loop data-parallel
(watcher/data_parallel.py); its
records stream back into the notebook's one Run. At the end rank 0's results land in the
notebook's namespace: the objects the cell made, and the trained state of the models and
optimizers it was given, loaded into the notebook's own objects.
"""
from __future__ import annotations

import ast
import builtins
import linecache
import os
import signal
import sys
import traceback
from collections import defaultdict
from datetime import timedelta

import torch

from . import checkpoint as ckpt
from .config import ConfigError
from .entry import attach_hooks, ctrl_c_stops, keep, remember, watch, watch_config
from .parallel.processes import (
    RANK_TIMEOUT_S,
    Ranks,
    auto_processes,
    nbtrain_environment,
    supervise,
)
from .parallel.ranks import RankEnd, RankFailure, RankRun, control_group, pack, unpack
from .run import Run

# names IPython keeps in a notebook's namespace: its own, never the cell's
_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open"}
CELL_FILE = "<cell>"   # the file name a cell's tracebacks show in a rank


def processes_for(asked) -> int:
    """`--processes`: a number, or "auto": every GPU of the machine, one process on a CPU."""
    if asked == "auto":
        return auto_processes(torch.device("cuda" if torch.cuda.is_available() else "cpu"))[0]
    return int(asked)


def train_cell(cell: str, ns: dict, world: int, settings: dict, progress=False,
               script=None) -> Run:
    """Run `cell` in `world` processes, data-parallel; the notebook's Run, ended once every
    rank has (a failed rank's traceback in `run.error`: the caller fails with it). Ctrl-C
    is a Stop the ranks agree on, as in one process. `script` (run_script): the file's
    path and argv, as `python` would set them."""
    namespace = _packed_namespace(cell, ns, world)
    run = Run(watch_config(None, {k: v for k, v in settings.items() if k != "optimize"})[0])
    run.resolved["processes"] = (world, f"--processes {world}: your code, as written, in "
                                 f"{world} processes; each rank's DataLoader its shard")
    remember(run)
    keep(run, ("watch", None))
    attach_hooks(run, None, None, progress)
    payload = dict(cell=cell, namespace=namespace, settings=settings, script=script,
                   timeout_s=RANK_TIMEOUT_S, env=nbtrain_environment())
    ranks = Ranks(world, payload, target=cell_rank_main)
    with ctrl_c_stops(run):
        supervise(run, ranks, load_state=lambda run, blob: _take_results(ns, run, blob))
    return run


def run_script(path: str, args: list, processes="auto") -> int:
    """`nbtrain run --processes N script.py [args]`: the script as `python script.py args`
    would run it, in N processes, data-parallel. The exit status: 0 where it finished or
    was stopped, 1 where not (a failed rank's traceback on stderr, as python puts it)."""
    world = processes_for(processes)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    script = dict(path=os.path.abspath(path), argv=[path, *args])
    run = train_cell(source, {}, world, {}, progress=False, script=script)
    print(run.summary_text())
    if run.state == "failed":
        print(run.error, file=sys.stderr)
    return 0 if run.state in ("finished", "stopped") else 1


def _packed_namespace(cell: str, ns: dict, world: int) -> bytes:
    """The notebook's names the cell uses, packed once (cloudpickle); where that fails,
    the name that cannot travel is found and named, before any process starts."""
    import cloudpickle
    used = {node.id for node in ast.walk(ast.parse(cell)) if isinstance(node, ast.Name)}
    names = sorted(name for name in used & set(ns)
                   if not name.startswith("_") and name not in _IPYTHON_NAMES)
    try:
        return pack({name: ns[name] for name in names})
    except Exception as exc:
        together = exc
    for name in names:
        try:
            cloudpickle.dumps(ns[name])
        except Exception as exc:
            raise ConfigError(
                f"--processes {world}: `{name}` ({type(ns[name]).__name__}) cannot be sent to "
                f"the processes ({type(exc).__name__}: {exc}). Make it inside the cell, or "
                "run the cell in one process.", field="processes") from None
    raise together   # every name alone travels: the failure is of them together


# -- a rank's side ------------------------------------------------------------------------------
def cell_rank_main(rank: int, world: int, port: int, blob: bytes, messages, requests) -> None:
    """One rank: join the group, run the cell inside a watch of rank `rank`, send its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the notebook relays Ctrl-C as a Stop
    try:
        _run_cell_rank(rank, world, port, blob, messages, requests)
    finally:
        messages.close()
        messages.join_thread()   # the message is in the pipe before the process exits


def _run_cell_rank(rank: int, world: int, port: int, blob: bytes, messages, requests) -> None:
    import torch.distributed as dist
    filename = None   # the user's code's, once known: its traceback starts there
    try:
        payload = unpack(blob)
        os.environ.update(payload["env"])
        # as torchrun sets them: a cell that reads its rank finds it
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
        if cuda:
            torch.cuda.set_device(rank)
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"   # a cell may train on the CPU
        timeout = timedelta(seconds=payload["timeout_s"])
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timeout)
        control = control_group(backend, payload["timeout_s"])

        def make_run(cfg):
            return RankRun(cfg, rank, world, messages, requests, control)
        given = unpack_on_gpu(payload["namespace"])   # after set_device: this rank's GPU
        ns = dict(given, __name__="__main__", __builtins__=builtins)
        contents = {name: _contents(value) for name, value in given.items()}
        filename = _as_script(payload["script"], ns, rank)
        messages.put(("ready", rank, {"resolved": {}, "total_steps": None}))
        watched = watch(progress=False, _rank=(rank, world, make_run), **payload["settings"])
        watched.warns_untrained = False   # a cell for fit: the notebook runs it next
        with watched as run:
            _run_source(payload["cell"], filename, ns)
        if isinstance(sys.stdout, _Marked):
            sys.stdout.close_line()
        messages.put(("end", rank, _rank_end(run, rank, ns, (given, contents), payload["script"])))
        dist.destroy_process_group()
    except BaseException as exc:
        messages.put(("failed", rank, RankFailure(_traceback_from(exc, filename))))


def _run_source(code: str, filename: str, ns: dict) -> None:
    """exec, where a script's sys.exit(0) (or exit()) is the end it is for python."""
    if filename == CELL_FILE:   # a traceback shows the cell's lines, as IPython's does
        linecache.cache[CELL_FILE] = (len(code), None, code.splitlines(True), CELL_FILE)
    try:
        exec(compile(code, filename, "exec"), ns)
    except SystemExit as done:
        if done.code not in (None, 0):
            raise


def _traceback_from(exc: BaseException, filename) -> str:
    """The rank's traceback from the first frame of the user's code (`filename`) on: the
    frames of nbtrain that ran it say nothing to the user. All of it where the error came
    before the user's code ran."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__)).rstrip()


def _as_script(script, ns: dict, rank: int) -> str:
    """A script's rank runs as `python script.py args` would: its argv, __file__ and
    folder on sys.path; its torch.save files written by rank 0 only (as a torchrun script
    guards them with `if rank == 0`; _save_aside), the other ranks' prints marked with
    their rank.
    Returns the file name its tracebacks show."""
    if script is None:
        return CELL_FILE
    sys.argv = list(script["argv"])
    sys.path.insert(0, os.path.dirname(script["path"]))
    ns["__file__"] = script["path"]
    sys.stdout = _Marked(sys.stdout, f"[rank {rank}] " if rank else "")
    if rank:
        _save_aside(rank)
    return script["path"]


def _save_aside(rank: int) -> None:
    """A rank other than 0 saves files with torch.save in a folder of its own, gone when it
    ends, and torch.load of a file it saved reads its copy: the script's files are rank
    0's alone, and a script that loads back what it saved still finds it."""
    import shutil
    import tempfile
    from multiprocessing.util import Finalize
    folder = tempfile.mkdtemp(prefix=f"nbtrain-rank{rank}-")
    Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=0)
    aside, save, load = {}, torch.save, torch.load

    def place(f):
        if not isinstance(f, (str, os.PathLike)):   # a buffer: the rank's own
            return f
        return aside.setdefault(os.path.abspath(f), os.path.join(folder, str(len(aside))))

    def save_aside(obj, f, *args, **kwargs):
        return save(obj, place(f), *args, **kwargs)

    def load_aside(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            f = aside.get(os.path.abspath(f), f)
        return load(f, *args, **kwargs)
    torch.save, torch.load = save_aside, load_aside


class _Marked:
    """A stream that writes whole lines, each at once and marked: the ranks share one
    pipe, and a line written in pieces would interleave with another rank's."""

    def __init__(self, stream, mark: str):
        self.stream, self.mark, self.pending = stream, mark, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self.stream.write(f"{self.mark}{line}\n")
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def close_line(self) -> None:
        """A last line without its newline, written at the end."""
        if self.pending:
            self.write("\n")

    def __getattr__(self, name: str):   # isatty, encoding, fileno: the stream's own
        return getattr(self.stream, name)


def _rank_end(run, rank: int, ns: dict, given: tuple, script) -> RankEnd:
    """What a rank sends at its end. Rank 0's `blob`: the names the cell bound, the models
    and optimizers it was given (trained in place), and the lists, dicts and sets it was
    given and changed (a history appended to); the other ranks send their step only.
    `given`: the names the cell was given, and their contents when it started."""
    blob = None
    if rank == 0:   # a script's results have no notebook to go to
        results = {} if script else _results(ns, *given)
        blob = pack({"results": results, "given": sorted(given[0]),
                     "position": run.position, "rng": ckpt.rng_state()})
    return RankEnd(step=run.step, state=run.state, message=run.message or "", blob=blob)


def _results(ns: dict, given: dict, contents: dict) -> dict:
    import cloudpickle
    out = {}
    for name, value in ns.items():
        if name.startswith("_") or name == "__builtins__":
            continue
        made = given.get(name, _MISSING) is not value
        trained = isinstance(value, (torch.nn.Module, torch.optim.Optimizer))
        changed = not made and not _same(_contents(value), contents[name])
        if not (made or trained or changed):
            continue
        try:
            cloudpickle.dumps(value)
        except Exception:   # a name the notebook cannot get back (an open file): left out
            continue
        out[name] = value
    return out


_MISSING = object()
_CONTAINERS = (list, dict, set)


def _contents(value, depth: int = 2) -> list:
    """A list's, dict's or set's keys and items, two levels deep, as the objects themselves
    (each container before its items): a change in place changes one of them."""
    if depth == 0 or type(value) not in _CONTAINERS:
        return [value]
    items = [x for kv in value.items() for x in kv] if type(value) is dict else list(value)
    return [value, *[x for item in items for x in _contents(item, depth - 1)]]


def _same(now: list, before: list) -> bool:
    return len(now) == len(before) and all(a is b for a, b in zip(now, before))


# -- the notebook's side, at the end --------------------------------------------------------------
def _take_results(ns: dict, run: Run, blob: bytes) -> dict:
    """Rank 0's results into the notebook and its position into the Run; its RNG state.
    Results that cannot be taken back (a model of another shape under the same name) are
    said in the Run's resolved settings, and the Run still ends."""
    back = unpack_on_gpu(blob)
    try:
        take_back(ns, back["results"], back["given"])
    except Exception as exc:
        run.resolved["results"] = (None, f"not all taken back: {type(exc).__name__}: {exc}")
    run.move_to(*back["position"])
    return back["rng"]


def unpack_on_gpu(blob: bytes):
    """pack's payload with what was on a GPU on this process's current GPU (a model the
    notebook moved to the GPU arrives there), the rest on the CPU, as it was."""
    import io

    def place(storage, location: str):
        return storage.cuda() if location.startswith("cuda") and torch.cuda.is_available() \
            else storage
    return torch.load(io.BytesIO(blob), map_location=place, weights_only=False)


def take_back(ns: dict, results: dict, given=()) -> None:
    """Rank 0's objects into the notebook: a model or optimizer the cell was given
    (`given`: its names) takes the trained state into the notebook's own object, and so
    does a list, dict or set the cell was given and changed; any other name is set. An
    optimizer that came back over a model the notebook holds is pointed at that model's
    own parameters."""
    params = {}   # id of a parameter that came back -> the notebook's own
    for name, value in results.items():
        mine = ns.get(name) if name in given else None
        if isinstance(value, torch.nn.Module) and type(mine) is type(value):
            mine.load_state_dict(value.state_dict())
            params.update((id(a), b) for a, b in zip(value.parameters(), mine.parameters()))
    for name, value in results.items():
        mine = ns.get(name) if name in given else None
        if isinstance(value, torch.optim.Optimizer):
            _point_at(value, params)
            if type(mine) is type(value):
                mine.load_state_dict(value.state_dict())
                continue
        if isinstance(value, torch.nn.Module) and type(mine) is type(value):
            continue
        if type(value) in _CONTAINERS and type(mine) is type(value):
            _refill(mine, value)
            continue
        ns[name] = value


def _refill(mine, value) -> None:
    """A list, dict or set of the notebook's, holding what rank 0's holds."""
    if type(mine) is list:
        mine[:] = value
    else:
        mine.clear()
        mine.update(value)


def _point_at(optimizer: torch.optim.Optimizer, params: dict) -> None:
    """The optimizer's parameters (and their state) swapped for the notebook's own."""
    for group in optimizer.param_groups:
        group["params"] = [params.get(id(p), p) for p in group["params"]]
    optimizer.state = defaultdict(dict, {params.get(id(p), p): s
                                         for p, s in optimizer.state.items()})
