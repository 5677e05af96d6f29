"""When to redraw, apart from how to draw: at most every `interval` seconds while records come,
once more at the end, never from more than one thread at a time."""
from __future__ import annotations

import threading
import time
import warnings
from typing import Callable, Optional

INTERVAL_S = 0.25         # about 4 redraws a second: live to the eye, cheap for the kernel



# -- when to redraw ---------------------------------------------------------------------------
class RedrawThrottle:
    """When to redraw, apart from how (as fastprogress's `update_every` and tqdm's `mininterval`).

    `poke()` is all a training thread calls: it sets a flag and, for an ending run, wakes
    the drawing thread at once. The drawing thread calls `draw()` at most every
    `interval` seconds while there is something new, under `lock`, and exits when
    `active()` says no run is left to watch. `flush()` draws now, from the caller's thread.
    """

    def __init__(self, draw: Callable[[], None], active: Callable[[], bool],
                 interval: float = INTERVAL_S):
        self.draw, self.active, self.interval = draw, active, interval
        self.lock = threading.RLock()       # the one lock: buffers, figure and table
        self.draws = 0
        self.busy_s = 0.0                   # time spent drawing: what the charts cost
        self._pending = False
        self._urgent = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._warned = False

    def poke(self, urgent: bool = False) -> None:
        """Something new to draw (any thread; never blocks)."""
        self._pending = True
        if urgent:
            self._urgent.set()

    def watch(self) -> None:
        """Make sure the drawing thread runs (a run was added)."""
        with self.lock:
            self._closed = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="nbtrain-dashboard",
                                                daemon=True)
                self._thread.start()

    def flush(self) -> None:
        with self.lock:
            self._pending = False
            self._draw_safely()

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait until the drawing thread has drawn the end of every run; True when it has."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return self._thread is None

    def close(self) -> None:
        self._closed = True
        self._urgent.set()
        self.join(2 * self.interval + 1)

    def _loop(self) -> None:
        while True:
            self._urgent.wait(self.interval)
            self._urgent.clear()
            with self.lock:
                if self._pending:
                    self._pending = False
                    self._draw_safely()
                if self._closed or (not self.active() and not self._pending):
                    self._thread = None
                    return

    def _draw_safely(self) -> None:
        start = time.perf_counter()
        try:
            self.draw()
            self.draws += 1
        except Exception as exc:   # a chart bug must not kill the thread that draws every run
            if not self._warned:
                self._warned = True
                warnings.warn(f"nbtrain dashboard: drawing failed with {exc!r}; the charts "
                              "may be stale. Training is not affected.")
        finally:
            self.busy_s += time.perf_counter() - start
