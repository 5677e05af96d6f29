"""Which sample killed a loader worker: a crash (a C extension's segfault on a corrupt
file, the kernel's out-of-memory killer) leaves no exception that names it."""
from __future__ import annotations

import multiprocessing
import re
import signal
import time
from typing import List, Optional


def worker_died(exc: BaseException) -> bool:
    """A DataLoader worker exited or was killed, rather than raising (a raise reads
    'Caught ValueError in DataLoader worker process 0')."""
    return isinstance(exc, RuntimeError) and re.search(r"DataLoader worker \(pid", str(exc)) is not None


def crashing_sample(dataset, indices: List[int], context=None,
                    timeout_s: float = 120.0) -> Optional[str]:
    """Load `indices` one at a time in a throwaway process and name the sample it dies on.

    Never in this process: the sample that killed a worker would take the notebook's
    kernel down with it. None when the probe loads them all (the crash did not repeat).
    """
    ctx = context or multiprocessing.get_context()
    receive, send = ctx.Pipe(duplex=False)
    probe = ctx.Process(target=_load_each, args=(dataset, indices, send), daemon=True)
    probe.start()
    send.close()   # the probe holds the only writer: its death ends the pipe
    loading = _last_started(receive, time.monotonic() + timeout_s)
    probe.join(timeout=5)
    if probe.is_alive():
        probe.kill()
        probe.join()
        return None if loading is None else \
            f"sample {loading} did not finish loading within {timeout_s:.0f} s"
    if loading is None or probe.exitcode == 0:
        return None
    return (f"sample {loading} kills the process that loads it ({_death(probe.exitcode)}); "
            f"found by loading samples {indices[0]}..{indices[-1]} one at a time in a "
            f"separate process. Fix the data behind it, or leave it out with "
            f"torch.utils.data.Subset")


def _last_started(receive, deadline: float):
    """The index the probe last began loading; None once it reports all loaded."""
    loading = None
    try:
        while receive.poll(max(0.0, deadline - time.monotonic())):
            loading = receive.recv()
            if loading is None:
                break
    except EOFError:   # the probe died mid-sample
        pass
    return loading


def _load_each(dataset, indices, send) -> None:
    for i in indices:
        send.send(i)
        try:
            dataset[i]
        except Exception:   # an exception reaches the loop through the loader; we seek a crash
            pass
    send.send(None)


def _death(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exit code {exitcode}"
    name = signal.Signals(-exitcode).name
    return name + (", most often the out-of-memory killer" if name == "SIGKILL" else "")
