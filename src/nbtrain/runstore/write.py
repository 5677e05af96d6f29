"""The run store: every run a row in a local SQLite database, written as its records come.

A kernel that dies (out of memory, a restart, a laptop asleep) takes its Runs with it;
the store keeps what they measured. `nt.runs()` lists the stored runs, `nt.load_run(id)`
gives one back as a Run (records, resolved, summary, report, Dashboard), and
`nt.delete_runs(...)` removes them.

    >>> run = nt.fit(model, (x, y), loss_fn, config=nt.TrainConfig(name="baseline"))
    >>> nt.runs(name="baseline")          # a table in a notebook; .to_pandas()
    >>> again = nt.load_run(run.id)       # after a restart too

Where: `$NBTRAIN_HOME/runs.sqlite` (`~/.nbtrain` by default); `TrainConfig(store=False)`
keeps a run out, `store="path.sqlite"` picks another file. The standard library's
sqlite3 in WAL mode (readers never wait for the writer, two processes may write one
file): two tables, `runs` (a row per run: config, resolved with the reasons, the
machine, the state, and the columns the listing shows) and `records` (a JSON row per
record, in order).

The training thread never waits for the disk: a run's records go into a bounded queue
(a deque: an append is ~0.1 us) read by one writer thread per store file, which writes
them in one transaction at most every second and at the run's end, so a SIGKILL loses at
most the last second. A run that ends within its first second, before this process has
opened the file, is written to a file of its own in the pending folder beside it
(`runs.sqlite.pending/<id>.json`) instead: a short program never loads SQLite (~5 ms of
it), and the next writer or reader to open the store, in any process, folds it in. A
store that cannot be opened or written (read-only, full, not a database, locked past a
timeout) gives one warning naming the file and what to do, and the run trains on
without it.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import copy
import functools
import json
import math
import os
import platform
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Union

from ..run import Run
from . import pending

if TYPE_CHECKING:
    import sqlite3

FILE_NAME = "runs.sqlite"
COMMIT_EVERY_S = 1.0      # the most a SIGKILL loses; one transaction per second at most
POLL_S = 0.25             # how often the writer looks at its queue between commits
BUSY_TIMEOUT_S = 10.0     # another process's transaction: sqlite waits this long for it
LOCKED_GIVE_UP_S = 60.0   # then the writer retries each second, up to this long, and drops
QUEUE_LIMIT = 100_000     # records waiting for the writer; beyond, they are dropped (said once)
IDLE_EXIT_S = 10.0        # an idle writer thread ends; the next run starts another
BEGIN_WAIT_S = 2.0        # a run that ends before its row is written waits this long for it
SCHEMA_VERSION = 1
URGENT = ("begin", "end", "flush", "discard")   # written at once, not within the second
SAME = 0   # a record's "diagnosis" stored as this: the same as the record before (~170 bytes)

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, name TEXT, kind TEXT, started REAL, ended REAL, state TEXT,
    message TEXT, pid INTEGER, pid_started REAL, host TEXT,
    config TEXT, resolved TEXT, machine TEXT, notes TEXT,
    steps INTEGER, epoch INTEGER, total_steps INTEGER, wall_s REAL,
    samples INTEGER, busy_s REAL, last_loss REAL, device TEXT, amp TEXT,
    records INTEGER, last_record REAL, schema INTEGER);
CREATE INDEX IF NOT EXISTS runs_by_start ON runs (started);
CREATE TABLE IF NOT EXISTS records (
    run_id TEXT NOT NULL, seq INTEGER NOT NULL, t REAL, record TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)) WITHOUT ROWID;
"""


# -- where ----------------------------------------------------------------------------------
def home() -> Path:
    """$NBTRAIN_HOME, else ~/.nbtrain."""
    own = os.environ.get("NBTRAIN_HOME")
    return Path(own).expanduser() if own else Path.home() / ".nbtrain"


def path_of(store: Union[bool, str, os.PathLike, None] = True) -> Optional[Path]:
    """The file a `TrainConfig.store` value names (None: not stored), absolute: a relative
    name is the working folder's now, not the one the writer thread finds when it writes
    (a cell that changed folder since). A folder gets runs.sqlite inside."""
    if store is False or store is None:
        return None
    if store is True:
        return home().absolute() / FILE_NAME
    path = Path(store).expanduser().absolute()
    return path / FILE_NAME if path.is_dir() else path


def new_id() -> str:
    """A run's id: when it started and 4 random hex digits, "250131-142501-9f3a"."""
    return f"{time.strftime('%y%m%d-%H%M%S')}-{os.urandom(2).hex()}"


@functools.lru_cache(maxsize=1)
def this_process() -> tuple:
    """(host, pid, the process's start time): what tells a live run from a dead one."""
    try:
        started = _started_from_proc()
    except (OSError, ValueError, IndexError, StopIteration):   # not Linux; a bare /proc
        try:
            import psutil
            started = psutil.Process().create_time()
        except Exception:
            started = None
    return socket.gethostname(), os.getpid(), started


def _started_from_proc() -> float:
    """psutil's create_time() on Linux, from the two files it reads (boot time + the start
    in clock ticks), without psutil's import, which a short watched loop would pay."""
    with open("/proc/self/stat") as f:   # the command name, in parentheses, may hold spaces
        ticks = int(f.read().rpartition(")")[2].split()[19])
    with open("/proc/stat") as f:
        boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


@functools.lru_cache(maxsize=1)
def machine() -> dict:
    """The machine a run ran on (one dict per process; the writer thread builds it)."""
    import torch

    from ..machine import cpu_model
    info = {"host": socket.gethostname(), "platform": platform_text(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cpu": cpu_model(), "cores": os.cpu_count()}
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def platform_text() -> str:
    """What platform.platform() says ("Linux-6.1.0-x86_64-with-glibc2.36") without its
    libc_ver(), which reads the whole Python binary: 1.5-10 ms of the writer's first begin,
    beside the loop's first step."""
    uname = platform.uname()
    libc = ""
    with contextlib.suppress(AttributeError, ValueError, OSError):   # not glibc: not said
        libc = "-with-" + os.confstr("CS_GNU_LIBC_VERSION").replace(" ", "")
    return f"{uname.system}-{uname.release}-{uname.machine}{libc}"


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"), default=str)


# -- the writer: one thread per store file, fed by every run of this process ---------------------
class Writer:
    """Writes what runs `submit` into one store file, from its own thread."""

    def __init__(self, path: Path):
        self.path = path
        self.pid = os.getpid()
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._conn: Optional[sqlite3.Connection] = None
        self._totals: Dict[str, dict] = {}   # run id -> the listing's running figures
        self.problem = ""       # why the store cannot be written now ('' when it can)
        self.dropped = 0        # records dropped: the queue was full, or the store broken
        self.busy_s = 0.0       # the writer thread's CPU time in its writes (bench/store.py)

    # -- from any thread ---------------------------------------------------------------------
    def submit(self, item: tuple, urgent: bool = False) -> bool:
        """Queue `item`; False when it was dropped (a full queue)."""
        if len(self._queue) >= QUEUE_LIMIT:
            self.dropped += 1
            return False
        self._queue.append(item)
        if urgent:
            self._wake.set()
        if self._thread is None or not self._thread.is_alive():
            self._start()
        return True

    def flush(self, timeout: float = 5.0, into_store: bool = False) -> bool:
        """Wait until what was submitted before this call is committed (or dropped);
        `into_store`: into the store file itself, every pending file folded in (a reader's
        flush), not a run's own pending file."""
        if self._thread is None or not self._thread.is_alive():
            if not self._queue and not (into_store and pending.has_pending(self.path)):
                return True
        done = threading.Event()
        self.submit(("flush", into_store, done), urgent=True)
        return done.wait(timeout)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._main, name="nbtrain-store",
                                                daemon=True)
                self._thread.start()

    # -- the writer thread -------------------------------------------------------------------
    def _main(self) -> None:
        queued: List[tuple] = []
        last_commit, idle_since, locked_since = 0.0, time.monotonic(), None
        while True:
            self._wake.wait(POLL_S)
            self._wake.clear()
            if not queued:
                held_since = time.monotonic()
            while self._queue:   # a begin's row made at once, beside the loop's first steps
                queued.append(self._prepared(self._queue.popleft()))
            now = time.monotonic()
            if queued:
                idle_since = now
                if self._urgent(queued) or now - max(last_commit, held_since) >= COMMIT_EVERY_S:
                    cpu = time.thread_time()
                    outcome = self._write(queued)
                    self.busy_s += time.thread_time() - cpu
                    if outcome == "locked" and (locked_since is None
                                                or now - locked_since < LOCKED_GIVE_UP_S):
                        locked_since = locked_since or now
                        time.sleep(COMMIT_EVERY_S)   # another writer holds it: try again soon
                        continue
                    if outcome == "locked":
                        self.dropped += sum(item[0] == "record" for item in queued)
                        self._broken(f"it stayed locked by another process for more than "
                                     f"{LOCKED_GIVE_UP_S:.0f} s", "close the other program "
                                     "that writes it, or choose another file")
                    locked_since = None
                    self._release(queued)
                    queued = []
                    last_commit = time.monotonic()
            elif now - idle_since > IDLE_EXIT_S:
                with self._lock:   # a submit now starts a new thread, after this one ends
                    if self._queue:
                        continue
                    self._close()
                    self._thread = None
                if self._queue:   # submitted while this thread was ending: it saw it alive
                    self._start()
                return

    @staticmethod
    def _prepared(item: tuple) -> tuple:
        """A begin with the runs table's row made (its JSON, this process, the machine),
        as every item leaves the queue: the one place a row is made, so that a short run's
        end waits only for its file, and a pending file holds the row as it was made."""
        if item[0] != "begin":
            return item
        run_id, row, history, done = item[1:]
        host, pid, pid_started = this_process()
        row = dict(row, config=_json(row["config"].to_dict()), resolved=_json(row["resolved"]),
                   machine=_json(machine()), schema=SCHEMA_VERSION,   # the JSON made here
                   host=host, pid=pid, pid_started=pid_started)
        return "begin", run_id, row, history, done

    def _urgent(self, items: List[tuple]) -> bool:
        """Whether `items` are written at once. A run's begin waits for its first second
        where the file is not open yet: a run that ends within it goes to its own pending
        file (pending.py), and the file's opening is not paid beside its first steps."""
        if self._conn is None and pending.whole_runs(items, begun_only=True):
            return any(item[0] in ("end", "flush") for item in items)
        return any(item[0] in URGENT for item in items)

    def _release(self, items: List[tuple]) -> None:
        """Tell those waiting for `items` that they are written (or dropped)."""
        for item in items:
            if item[0] in ("flush", "begin", "end") and item[-1] is not None:
                item[-1].set()

    def _write(self, items: List[tuple]) -> str:
        """One transaction for `items`: "ok", "locked" (try again) or "broken"."""
        if self._conn is None and pending.whole_runs(items) \
                and pending.opens_as_a_store(self.path):
            return self._write_pending(items)
        import sqlite3   # the writer thread's alone: a run's start does not load it
        opening = self._conn is None
        if opening and not self._open(items):
            self.dropped += sum(item[0] == "record" for item in items)
            return "broken"
        try:
            if opening or any(item[0] == "flush" and item[1] for item in items):
                self._fold_pending()
            self._transaction(items)
            return "ok"
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                return "locked"
            self._fail(exc)
        except (sqlite3.Error, OSError) as exc:
            self._fail(exc)
        self.dropped += sum(item[0] == "record" for item in items)
        return "broken"

    def _transaction(self, items: List[tuple]) -> None:
        with self._conn:   # one transaction: committed here, rolled back on an error
            touched, rows = set(), []
            for item in items:
                if item[0] in ("begin", "record", "update", "end"):
                    touched.add(item[1])
                if item[0] == "record":   # in order, many at a time
                    rows.append(self._record_row(*item[1:]))
                    continue
                self._insert(rows)
                getattr(self, "_" + item[0])(*item[1:])
            self._insert(rows)
            for run_id in touched:
                self._write_totals(run_id)
        for item in items:   # their rows are gone: their figures too
            if item[0] in ("end", "discard"):
                self._totals.pop(item[1], None)

    # -- the pending files (pending.py): runs that ended within their first second ------------
    def _write_pending(self, items: List[tuple]) -> str:
        """Each run of `items` (whole runs) to its own pending file, without the Events
        waiting for them."""
        runs: Dict[str, list] = {}
        for item in items:
            if item[0] in ("begin", "end"):
                item = item[:-1] + (None,)
            if item[0] != "flush":
                runs.setdefault(item[1], []).append(item)
        try:
            pending.write(self.path, {run_id: _json(run) for run_id, run in runs.items()})
        except OSError as exc:
            self._fail(exc)
            self.dropped += sum(item[0] == "record" for item in items)
            return "broken"
        return "ok"

    def _fold_pending(self) -> None:
        """Write the pending files in (this process's and any other's), a transaction each.
        A file folded twice writes the same rows again (INSERT OR REPLACE, the same
        updates): nothing doubles."""
        for file, items in pending.waiting(self.path):
            self._transaction(items)
            pending.done(file)

    def _open(self, items: List[tuple]) -> bool:
        """Connect, on the first write and after a failure (when a new run begins)."""
        import sqlite3
        if self.problem and not any(item[0] == "begin" for item in items):
            return False   # broken: tried again when the next run begins
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S)
            try:
                conn.execute("PRAGMA journal_mode=WAL")   # readers never block the writer
                conn.execute("PRAGMA synchronous=NORMAL")   # WAL: durable at checkpoints
                conn.executescript(SCHEMA)
            except BaseException:
                conn.close()
                raise
        except (sqlite3.Error, OSError) as exc:
            self._fail(exc)
            return False
        self._conn, self.problem = conn, ""
        return True

    def _fail(self, exc: BaseException) -> None:
        text = str(exc)
        if "readonly" in text or "read-only" in text or isinstance(exc, PermissionError):
            why, fix = f"it is read-only ({text})", \
                "make it writable (chmod u+w), or set $NBTRAIN_HOME or TrainConfig(store=...) " \
                "to a writable place"
        elif "not a database" in text or "malformed" in text or "corrupt" in text:
            why, fix = f"it is not a readable SQLite database ({text})", \
                f"move it aside (mv {self.path} {self.path}.broken) and a new store is made"
        elif "full" in text:
            why, fix = f"the disk is full ({text})", "free some space"
        else:
            why, fix = f"{type(exc).__name__}: {text}", \
                "check the file, or choose another with TrainConfig(store='other.sqlite')"
        self._broken(why, fix)

    def _broken(self, why: str, fix: str) -> None:
        self.problem = (f"nbtrain: the run store {self.path} cannot be written: {why}. Runs "
                        f"train on without it; to keep them, {fix} (TrainConfig(store=False) "
                        f"turns the store off).")
        self._close()

    def _close(self) -> None:
        if self._conn is not None:
            import sqlite3
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None

    # -- what each item does, inside the transaction -----------------------------------------
    def _begin(self, run_id: str, row: dict, history: list, done=None) -> None:
        """`row` as _prepared made it (here or in the pending file's process)."""
        self._conn.execute(f"INSERT OR REPLACE INTO runs ({', '.join(row)}) "
                           f"VALUES ({', '.join('?' * len(row))})", list(row.values()))
        self._totals[run_id] = {"records": 0, "samples": 0, "busy_s": 0.0,
                                         "last_loss": None, "steps": 0, "last_record": None}
        t = row["started"]
        rows = [self._record_row(run_id, -len(history) + seq, record, t)   # a resumed run's
                for seq, record in enumerate(history)]                     # records so far
        self._insert(rows)

    def _insert(self, rows: list) -> None:
        """Insert the record rows `rows` (and empty the list)."""
        if rows:
            self._conn.executemany("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?)", rows)
            rows.clear()

    def _record_row(self, run_id: str, seq: int, record: dict, t: float) -> tuple:
        """The row of one record; the run's running figures counted."""
        totals = self._totals.get(run_id)
        said = record.get("diagnosis")
        if totals is not None and said is not None:   # a sentence a record, mostly the same
            if said == totals.get("diagnosis"):
                record = dict(record, diagnosis=SAME)
            totals["diagnosis"] = said
        if totals is not None:
            self._count(totals, record, t)
        return run_id, seq, t, _json(record)

    @staticmethod
    def _count(totals: dict, record: dict, t: float) -> None:
        totals["records"] += 1
        totals["last_record"] = t
        if record.get("kind") == "train":
            totals["samples"] += record.get("samples", 0)
            totals["busy_s"] += record.get("interval_s", 0.0)
            totals["last_loss"] = record.get("loss")
            totals["steps"] = record.get("step", totals["steps"])

    def _update(self, run_id: str, fields: dict) -> None:
        fields = _row_fields(fields)
        self._conn.execute(f"UPDATE runs SET {', '.join(f'{k} = ?' for k in fields)} "
                           "WHERE id = ?", [*fields.values(), run_id])

    def _end(self, run_id: str, fields: dict, done=None) -> None:
        self._update(run_id, fields)
        totals = self._totals.get(run_id)
        if totals is not None:
            totals["steps"] = fields.get("steps", totals["steps"])

    def _write_totals(self, run_id: str) -> None:
        totals = self._totals.get(run_id)
        if totals is None:
            return
        loss = totals["last_loss"]
        self._conn.execute(
            "UPDATE runs SET records = ?, samples = ?, busy_s = ?, last_loss = ?, steps = ?, "
            "last_record = ? WHERE id = ?",
            (totals["records"], totals["samples"], totals["busy_s"],
             loss if isinstance(loss, (int, float)) and math.isfinite(loss) else None,
             totals["steps"], totals["last_record"], run_id))

    def _discard(self, run_id: str) -> None:
        self._delete([run_id])

    def _delete(self, ids: list, done=None) -> None:
        for run_id in ids:
            self._conn.execute("DELETE FROM records WHERE run_id = ?", (run_id,))
            self._conn.execute("DELETE FROM runs WHERE id = ?", (run_id,))

    def _flush(self, into_store: bool, done) -> None:
        pass


def _row_fields(fields: dict) -> dict:
    """The runs table's columns from a run's fields (JSON where they are not plain)."""
    out = {}
    for key, value in fields.items():
        if key in ("resolved", "notes", "config"):
            out[key] = _json(value)
        else:
            out[key] = value
    if "resolved" in fields:
        for key in ("device", "amp"):
            value = fields["resolved"].get(key)
            if value is not None:
                out[key] = str(value[0])
    return out


WRITERS: Dict[Path, Writer] = {}
_WRITERS_LOCK = threading.Lock()


def writer_for(path: Path) -> Writer:
    """The writer of `path` in this process (a forked child makes its own)."""
    with _WRITERS_LOCK:
        writer = WRITERS.get(path)
        if writer is None or writer.pid != os.getpid():
            writer = WRITERS[path] = Writer(path)
        return writer


def flush_all(timeout: float = 5.0) -> None:
    """Commit what every writer of this process holds (nt.runs() and the exit call it)."""
    for writer in list(WRITERS.values()):
        if writer.pid == os.getpid():
            writer.flush(timeout)


atexit.register(flush_all)   # a script's last run is committed before the interpreter goes
if hasattr(os, "register_at_fork"):   # a forked child (a DataLoader worker) starts afresh
    os.register_at_fork(after_in_child=WRITERS.clear)


# -- one run, kept as it goes ---------------------------------------------------------------------
class StoredRun:
    """A Run's subscriber that keeps its records in the store; `run.discard()` removes it.

    Called in the training thread for every record: it copies the record (the loop's
    own dict stays the loop's) and queues it, nothing more."""

    def __init__(self, run: Run, writer: Writer, kind: str, name: Optional[str] = None):
        self.run, self.writer, self.kind = run, writer, kind
        self.name = run.config.name or name
        self.id = run.id
        self._seq = 0
        self._resolved_sent = False
        self._warned = False
        self._begun = threading.Event()   # set once the writer has tried to write its row

    def begin(self) -> "StoredRun":
        run = self.run
        row = {"id": self.id, "name": self.name, "kind": self.kind, "started": time.time(),
               "state": "running", "config": copy.copy(run.config), "resolved": dict(run.resolved),
               "total_steps": run.total_steps, "steps": run.step, "records": 0}
        # Written at once, beside the loop's first steps: a broken store is known soon, and
        # the first record after it warns, in this thread; a run that ends sooner waits for
        # it at its end (_end), which a short run otherwise would (the file's opening).
        self.writer.submit(("begin", self.id, row, [dict(r) for r in run.history],
                            self._begun), urgent=True)
        run.subscribe(self)
        return self

    def __call__(self, record: dict) -> None:
        if record["kind"] == "end":
            return self._end()
        if not self._resolved_sent:   # the first record: "auto" is resolved by now
            self._resolved_sent = True
            self.writer.submit(("update", self.id, {"resolved": dict(self.run.resolved),
                                                    "total_steps": self.run.total_steps}))
        self.writer.submit(("record", self.id, self._seq, dict(record), time.time()))
        self._seq += 1
        if self.writer.problem and not self._warned and self._begun.is_set():
            self._warn()

    def _end(self) -> None:
        """The state at the end, written at once (not waited for: nt.runs(), load_run()
        and the interpreter's exit wait for it); a run shorter than the opening of the file
        waits for that, to warn here about a broken store."""
        run = self.run
        fields = {"state": run.state, "ended": time.time(), "message": run.message,
                  "steps": run.step, "epoch": run.epoch, "total_steps": run.total_steps,
                  "wall_s": run.wall_s, "resolved": dict(run.resolved),
                  "notes": list(run.notes)}
        self.writer.submit(("end", self.id, fields, None), urgent=True)
        if not self._begun.is_set():
            self._begun.wait(BEGIN_WAIT_S)
        if (self.writer.problem or self.writer.dropped) and not self._warned:
            self._warn()

    def _warn(self) -> None:
        self._warned = True
        problem = self.writer.problem or (
            f"nbtrain: the run store {self.writer.path} dropped {self.writer.dropped} "
            f"records: more came than its writer could keep up with.")
        warnings.warn(problem, RuntimeWarning, stacklevel=2)

    def discard(self) -> None:
        self.run.unsubscribe(self)
        self.writer.submit(("discard", self.id), urgent=True)


def keep(run: Run, kind: str, name: Optional[str] = None) -> Optional[StoredRun]:
    """Store `run` (kind "fit", "watch" or "trial") from now on, unless its config says
    store=False; `name` is its stored name when the config gives none."""
    run.keep_as(new_id(), kind)   # an id even when not stored: the trackers name it so
    path = path_of(run.config.store)
    if path is None:
        return None
    stored = StoredRun(run, writer_for(path), kind, name).begin()
    run.keep_as(run.id, kind, stored)
    return stored
