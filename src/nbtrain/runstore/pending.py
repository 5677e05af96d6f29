"""The pending files: a run that ends within its first second, before its process has
opened the run store, is kept in a file of its own beside it instead
(`runs.sqlite.pending/<id>.json`), so that a short program never loads SQLite (its import,
the file's opening and schema: ~5 ms of the writer thread beside the loop). write.py's
writer writes them, and folds them in whenever it opens the store; nt.runs(), load_run()
and delete_runs() have it open the store first (read.py).

A file holds the run's items as the writer's queue had them (the begin's row made
already, with the host, pid and machine of the process that trained it), written whole and
then renamed: a reader sees all of it or none.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

PENDING = ".pending"   # the folder's suffix beside the store file


def folder_of(path: Path) -> Path:
    """The folder of the runs not folded into the store `path` yet (one JSON file each)."""
    return path.with_name(path.name + PENDING)


def has_pending(path: Path) -> bool:
    folder = folder_of(path)
    return folder.is_dir() and any(folder.glob("*.json"))


def whole_runs(items: List[tuple], begun_only: bool = False) -> bool:
    """Whether the writer's `items` hold whole runs only, each begun and (unless
    `begun_only`) ended there, and no flush into the store: what a pending file may take."""
    begun, ended = set(), set()
    for item in items:
        if item[0] == "begin":
            begun.add(item[1])
        elif item[0] == "end":
            ended.add(item[1])
        elif item[0] == "flush":
            if item[1]:
                return False
        elif item[0] not in ("record", "update") or item[1] not in begun:
            return False
    return begun_only or begun == ended


def opens_as_a_store(path: Path) -> bool:
    """Whether `path` can be opened and written as a store, as far as the file alone tells
    without SQLite: absent (made at the first write) or a writable SQLite file. A short
    run goes to a pending file only then; otherwise to the store, whose opening says what
    is wrong at once, in the run."""
    if not path.exists():
        return os.access(path.parent if path.parent.exists() else path.parent.parent, os.W_OK)
    try:
        with open(path, "rb") as f:
            header = f.read(16)
    except OSError:
        return False
    return header in (b"SQLite format 3\x00", b"") and os.access(path, os.W_OK)


def write(path: Path, runs: Dict[str, str]) -> None:
    """Each run's items, as JSON text, to its file (OSError where the folder cannot be
    written). As durable as the store's commits: no fsync."""
    folder = folder_of(path)
    folder.mkdir(parents=True, exist_ok=True)
    for run_id, text in runs.items():
        temp = folder / f".{run_id}.tmp"
        temp.write_text(text)
        os.replace(temp, folder / f"{run_id}.json")


def waiting(path: Path) -> Iterator[Tuple[Path, List[tuple]]]:
    """(file, items) of every pending file of the store `path`, oldest id first; one that
    cannot be read is set aside (`.unreadable`), not lost, and one folded meanwhile by
    another process skipped. Remove each once written in (`done`)."""
    folder = folder_of(path)
    for file in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            yield file, [tuple(item) for item in json.loads(file.read_text())]
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            with contextlib.suppress(OSError):
                file.rename(file.with_suffix(".unreadable"))


def done(file: Path) -> None:
    with contextlib.suppress(FileNotFoundError):   # two processes may fold one file
        file.unlink()
