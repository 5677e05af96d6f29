"""Files written atomically: readers see the old file or the new one, never half of one.

A checkpoint cut short by a crash, or a cache entry read by a second notebook while it
is written, must not be a truncated file: write a temp file in the same folder (a
rename is atomic only within one filesystem), flush it to disk, then rename it over
the target.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_write(path, mode: str = "wb"):
    """A file object to write `path` through; it replaces `path` only when the block ends
    without an error. On an error the temp file is removed and `path` is left as it was.

    >>> with atomic_write("runs/last.pt") as f:
    ...     torch.save(state, f)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())   # on disk before the rename makes it the file
        os.replace(tmp, path)
    except BaseException:   # KeyboardInterrupt too: no temp file left behind
        os.unlink(tmp)
        raise
