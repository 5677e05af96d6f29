"""Files written atomically: readers see the old file or the new one, never half of one.

A checkpoint cut short by a crash, or a cache entry read by a second notebook while it
is written, must not be a truncated file: write a temp file in the same folder (a
rename is atomic only within one filesystem), flush it to disk, then rename it over
the target.
"""
from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from pathlib import Path
from typing import Optional


@contextlib.contextmanager
def atomic_write(path, mode: str = "wb", durable: bool = True):
    """A file object to write `path` through; it replaces `path` only when the block ends
    without an error. On an error the temp file is removed and `path` is left as it was.
    `durable=False` (a cache, measured again if a crash loses it) skips the fsync, which
    costs a run's end milliseconds.

    >>> with atomic_write("runs/last.pt") as f:
    ...     torch.save(state, f)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())   # on disk before the rename makes it the file
        os.replace(tmp, path)
    except BaseException:   # KeyboardInterrupt too: no temp file left behind
        os.unlink(tmp)
        raise


def remove_stale_temps(path: Path) -> None:
    """Remove the temp files of writes to `path` whose process is gone (killed mid-write:
    SIGKILL leaves no chance to clean up). A live process's temp file is its write in
    progress, and stays."""
    for temp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = temp.name[len(path.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                temp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)   # signal 0: asks only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, but another user's
        return True
    return True


def cache_dir() -> Path:
    """Where nbtrain caches measurements (autotune's answers, a machine's peak FLOP/s):
    $NBTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/nbtrain, else ~/.cache/nbtrain."""
    env = os.environ
    return _cache_dir(env.get("NBTRAIN_CACHE_DIR"), env.get("XDG_CACHE_HOME"),
                      env.get("HOME"), env.get("USERPROFILE"))


@functools.lru_cache(maxsize=8)
def _cache_dir(own: Optional[str], xdg: Optional[str], *home: Optional[str]) -> Path:
    """By the variables it depends on (`home`: Path.home()'s on POSIX and on Windows): each
    run asks (the FLOP peak's and bf16's caches), and building the Path costs more than
    the lookup (~15 us)."""
    if own:
        return Path(own)
    root = xdg or Path.home() / ".cache"
    return Path(root) / "nbtrain"
