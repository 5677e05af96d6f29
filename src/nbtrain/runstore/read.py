"""Reading the run store (write.py writes it): `nt.runs()` lists the stored runs, newest
first, as a table; `nt.load_run(id)` gives one back as a Run (records, resolved, summary,
report, Dashboard), `records="all"` with every record stored; `nt.delete_runs(...)`
removes runs. A run left "running" by a process that no longer exists is listed as
crashed."""
from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import time
from pathlib import Path
from typing import Iterable, List, Optional, Union

from ..config import FACTORY_FIELDS, SETTINGS, TrainConfig
from ..run import Run
from .pending import has_pending
from .write import WRITERS, BUSY_TIMEOUT_S, SAME, path_of, this_process, writer_for

COLUMNS = ("id", "name", "kind", "started", "state", "steps", "samples/s", "last loss",
           "device", "amp")


def _connect(store) -> Optional[sqlite3.Connection]:
    path = path_of(store)
    if path is None:
        return None
    _fold_in(path)
    if not path.exists():
        return None
    conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S)   # read-only if the file is
    conn.row_factory = sqlite3.Row
    return conn


def _fold_in(path: Path) -> None:
    """This process's last records and every pending file (runs that ended within their
    first second, of any process) written into the store before it is read."""
    writer = WRITERS.get(path)
    if (writer is not None and writer.pid == os.getpid()) or has_pending(path):
        writer_for(path).flush(into_store=True)


def _alive(host: str, pid: Optional[int], started: Optional[float]) -> bool:
    """Whether the process that wrote a "running" row still runs (another host's: assumed)."""
    if host != this_process()[0] or pid is None:
        return True
    import psutil
    try:
        process = psutil.Process(pid)
        return started is None or abs(process.create_time() - started) < 1.0
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.Error:   # exists, another user's
        return True


def _state_of(row) -> str:
    if row["state"] == "running" and not _alive(row["host"], row["pid"], row["pid_started"]):
        return "crashed"
    return row["state"]


LISTED = ("id, name, kind, started, ended, state, pid, pid_started, host, steps, total_steps, "
          "samples, busy_s, last_loss, device, amp, records, last_record")


class RunTable:
    """The stored runs, newest first: shown as a table in a notebook, `len()`, iteration
    over row dicts, `[i]`, `.ids`, `.to_pandas()`."""

    SHOWN = 50   # rows in the notebook's table; all of them in to_pandas()

    def __init__(self, rows: List[dict], path: Optional[Path]):
        self.rows, self.path = rows, path

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, index):
        """A row's dict; a slice is a table again (`nt.runs()[:5]`: the five newest)."""
        if isinstance(index, slice):
            return RunTable(self.rows[index], self.path)
        return self.rows[index]

    @property
    def ids(self) -> List[str]:
        return [row["id"] for row in self.rows]

    def to_pandas(self):
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("nt.runs().to_pandas needs pandas: pip install pandas") from None
        frame = pd.DataFrame(self.rows, columns=list(_ROW_KEYS))
        frame["started"] = pd.to_datetime(frame["started"], unit="s")
        frame["last_record"] = pd.to_datetime(frame["last_record"], unit="s")
        return frame

    def _cells(self) -> List[dict]:
        """The shown rows as text, by column title (tables.py's tables take dicts)."""
        return [dict(zip(COLUMNS, (
            row["id"], row["name"] or "", row["kind"], _when(row["started"]), row["state"],
            f"{row['steps']}" + (f"/{row['total_steps']}" if row["total_steps"] else ""),
            _number(row["samples_per_s"], ",.0f"), _number(row["last_loss"], ".4g"),
            row["device"] or "", row["amp"] or ""))) for row in self.rows[:self.SHOWN]]

    def _more(self) -> str:
        more = len(self.rows) - self.SHOWN
        return f"... and {more} more (nt.runs().to_pandas() has them all)" if more > 0 else ""

    def _repr_html_(self) -> str:
        from ..tables import html_table
        if not self.rows:
            return f"<p>No stored runs in {_escape(str(self.path))}.</p>"
        more = self._more()
        return html_table(_TITLED, self._cells()) + (f"<p>{_escape(more)}</p>" if more else "")

    def __repr__(self) -> str:
        from ..tables import text_table
        if not self.rows:
            return f"No stored runs in {self.path}."
        more = self._more()
        return text_table(_TITLED, self._cells()) + (f"\n{more}" if more else "")


_TITLED = [(title, title) for title in COLUMNS]
_ROW_KEYS = ("id", "name", "kind", "started", "ended", "state", "steps", "total_steps",
             "samples_per_s", "last_loss", "device", "amp", "records", "last_record", "host",
             "pid")


def _escape(text: str) -> str:
    import html
    return html.escape(text, quote=False)


def _when(t: Optional[float]) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else ""


def _number(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def runs(name: Optional[str] = None, state: Optional[str] = None, kind: Optional[str] = None,
         store: Union[bool, str, os.PathLike] = True) -> RunTable:
    """The stored runs, newest first (`name`, `state`, `kind` filter them: "fit", "watch",
    "trial"). A run left "running" by a process that no longer exists shows as "crashed".

    >>> nt.runs(name="baseline").to_pandas()
    """
    conn = _connect(store)
    if conn is None:
        return RunTable([], path_of(store))
    where, args = [], []
    for column, value in (("name", name), ("kind", kind)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    if state is not None and state != "crashed":   # crashed rows are 'running' ones
        where.append("state = ?")
        args.append(state)
    elif state == "crashed":
        where.append("state = 'running'")
    query = f"SELECT {LISTED} FROM runs" + (f" WHERE {' AND '.join(where)}" if where else "") \
        + " ORDER BY started DESC"
    try:
        with contextlib.closing(conn):
            rows = conn.execute(query, args).fetchall()
    except sqlite3.Error as exc:
        if "no such table" in str(exc):   # a file its first writer is making right now
            return RunTable([], path_of(store))
        raise RuntimeError(f"nbtrain: cannot read the run store {path_of(store)}: {exc}") from None
    out = []
    for row in rows:
        shown = _state_of(row)
        if state is not None and shown != state:
            continue
        busy = row["busy_s"]
        out.append({"id": row["id"], "name": row["name"], "kind": row["kind"],
                    "started": row["started"], "ended": row["ended"], "state": shown,
                    "steps": row["steps"] or 0, "total_steps": row["total_steps"],
                    "samples_per_s": row["samples"] / busy if busy else None,
                    "last_loss": row["last_loss"], "device": row["device"], "amp": row["amp"],
                    "records": row["records"], "last_record": row["last_record"],
                    "host": row["host"], "pid": row["pid"]})
    return RunTable(out, path_of(store))


def _find(conn, run_id: str):
    """The row of `run_id`: the whole id, or a part of one that only one id has."""
    row = conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
    if row is not None:
        return row
    found = conn.execute("SELECT * FROM runs WHERE id LIKE ? LIMIT 2",
                         (f"%{run_id}%",)).fetchall() if run_id else []
    if len(found) == 1:
        return found[0]
    if found:
        raise KeyError(f"nbtrain: several stored runs have {run_id!r} in their id; give more of it")
    return None


RECORDS = ("kept", "all")   # load_run's choice: the history as the live run kept it, or all


def load_run(run_id: str, store: Union[bool, str, os.PathLike] = True,
             records: str = "kept") -> Run:
    """The stored run `run_id` (its id, or a unique part of it) as a Run: records(),
    history, resolved, summary(), summary_text(), report(), nt.Dashboard(run) work as on
    the live one; the model and optimizer are not stored (a checkpoint keeps those).

    records="kept" (the default) gives the history as the live run kept it: past the
    config's history_limit, older intervals merged in pairs, the recent ones whole.
    records="all" gives every record the store kept, one per log_every steps however long
    the run (a crashed run's up to its last commit; a resumed run's from before the resume
    as its checkpoint kept them), all of them in memory. Either way nt.Dashboard(run) and
    run.report() thin only for drawing: at most 400 points a chart, picked evenly over the
    records they are given and ending at the last one (with "all", evenly over the
    steps); the runs table's totals cover the whole run.

    >>> run = nt.load_run(nt.runs()[0]["id"])
    >>> print(run.summary_text())
    >>> every = nt.load_run(run.id, records="all")   # not merged: a record per log_every
    """
    if records not in RECORDS:
        raise ValueError(f"nt.load_run(records={records!r}): records is 'kept' (the history "
                         f"as the live run kept it, the default) or 'all' (every record the "
                         f"store kept)")
    conn = _connect(store)
    if conn is None:
        raise KeyError(f"nbtrain: no run store at {path_of(store)}: no run {run_id!r}")
    with contextlib.closing(conn):
        row = _find(conn, str(run_id))
        if row is None:
            raise KeyError(f"nbtrain: no stored run {run_id!r} in {path_of(store)} "
                           f"(nt.runs() lists them)")
        stored = _records([text for (text,) in conn.execute(
            "SELECT record FROM records WHERE run_id = ? ORDER BY seq", (row["id"],))])
    return _as_run(row, stored, bounded=records == "kept")


def _records(texts: List[str]) -> List[dict]:
    """The stored records as they were emitted (a diagnosis stored as SAME: the one before)."""
    records, said = [], None
    for text in texts:
        record = json.loads(text)
        if "diagnosis" in record:
            if record["diagnosis"] == SAME:
                record["diagnosis"] = said
            said = record["diagnosis"]
        records.append(record)
    return records


def _as_run(row, records: list, bounded: bool) -> Run:
    state, message = _state_of(row), row["message"] or ""
    if state == "crashed":
        message = (f"the process that trained it (pid {row['pid']} on {row['host']}) ended "
                   f"without finishing it; its last record was written at "
                   f"{_when(row['last_record']) or '(none)'}")
    last_train = next((r for r in reversed(records) if r.get("kind") == "train"), {})
    return Run.ended_before(
        _config_of(json.loads(row["config"] or "{}")), records, id=row["id"], kind=row["kind"],
        state=state, message=message,
        resolved={name: tuple(pair) for name, pair in json.loads(row["resolved"] or "{}").items()},
        notes=json.loads(row["notes"] or "[]"), machine=json.loads(row["machine"] or "{}"),
        started=row["started"], ended=row["ended"],
        step=row["steps"] or last_train.get("step", 0),
        epoch=row["epoch"] if row["epoch"] is not None else last_train.get("epoch", 0),
        total_steps=row["total_steps"],
        wall_s=row["wall_s"] if row["wall_s"] is not None else last_train.get("time_s", 0.0),
        bounded=bounded)


def _config_of(values: dict) -> TrainConfig:
    """The stored config as a TrainConfig: fields this version lacks are left out, and a
    value it cannot take (your own optimizer, stored by its name) is kept as text."""
    known = {k: v for k, v in values.items() if k in SETTINGS}
    kept_as_text = {k: known.pop(k) for k in FACTORY_FIELDS
                    if isinstance(known.get(k), str) and not SETTINGS[k].kind.accepts(known[k])}
    try:
        cfg = TrainConfig(**known)
    except ValueError:
        cfg = TrainConfig()
        for name, value in known.items():
            with contextlib.suppress(ValueError, TypeError):
                setattr(cfg, name, value)
    for name, value in kept_as_text.items():   # shown as the checkpoint names it, never run
        object.__setattr__(cfg, name, value)
    return cfg


def delete_runs(ids: Union[str, Iterable[str], None] = None, *, name: Optional[str] = None,
                state: Optional[str] = None, store: Union[bool, str, os.PathLike] = True) -> int:
    """Remove stored runs: by id (one or several), or every run with `name` (and/or
    `state`); returns how many were removed.

    >>> nt.delete_runs(name="scratch")
    """
    if ids is None and name is None and state is None:
        raise ValueError("nt.delete_runs() needs ids, name= or state= (nothing would be "
                         "chosen; to remove the whole store, delete its file)")
    if isinstance(ids, str):
        ids = [ids]
    chosen = set(ids or [])
    if name is not None or state is not None:
        chosen |= {row["id"] for row in runs(name=name, state=state, store=store)
                   if ids is None or row["id"] in chosen}
        if ids is not None:
            chosen &= set(ids)
    path = path_of(store)
    if chosen and path is not None:
        _fold_in(path)
    if not chosen or path is None or not path.exists():
        return 0
    with contextlib.closing(sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S)) as conn:
        with conn:
            removed = 0
            for run_id in chosen:
                conn.execute("DELETE FROM records WHERE run_id = ?", (run_id,))
                removed += conn.execute("DELETE FROM runs WHERE id = ?", (run_id,)).rowcount
    return removed
