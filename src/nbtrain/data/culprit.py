"""Which sample killed a loader worker: a crash (a C extension's segfault on a corrupt
file, the kernel's out-of-memory killer) leaves no exception that names it."""
from __future__ import annotations

import multiprocessing
import signal
from typing import List, Optional


def worker_died(exc: BaseException) -> bool:
    """A DataLoader worker exited or was killed, rather than raising (a raise reads
    'Caught ValueError in DataLoader worker process 0')."""
    return isinstance(exc, RuntimeError) and "DataLoader worker (pid" in str(exc)


def crashing_sample(dataset, indices: List[int], context=None,
                    timeout_s: float = 60.0) -> Optional[str]:
    """Load `indices` one at a time in a throwaway process and name the sample it dies on.

    Never in this process: the sample that killed a worker would take the notebook's
    kernel down with it. None when the probe loads them all (the crash did not repeat).
    `timeout_s` is per sample: a sample that hangs is named as such.
    """
    ctx = context or multiprocessing.get_context()
    receive, send = ctx.Pipe(duplex=False)
    probe = ctx.Process(target=_load_each, args=(dataset, indices, send), daemon=True)
    probe.start()
    try:
        send.close()   # the probe holds the only writer: its death ends the pipe
        loading, hung = _last_started(receive, timeout_s)
        probe.join(timeout=5)
    finally:   # on a timeout or a Ctrl-C too: leave no probe behind
        if probe.is_alive():
            probe.kill()
            probe.join()
        receive.close()
    if hung:
        return f"sample {loading} did not finish loading within {timeout_s:.0f} s"
    if loading is None or probe.exitcode == 0:
        return None
    return (f"sample {loading} kills the process that loads it ({_death(probe.exitcode)}); "
            f"found by loading samples {indices[0]}..{indices[-1]} one at a time in a "
            f"separate process. Fix the data behind it, or leave it out with "
            f"torch.utils.data.Subset")


def _last_started(receive, timeout_s: float):
    """(the index the probe last began loading, None once it reports all loaded;
    whether that sample took longer than `timeout_s`)."""
    loading = None
    try:
        while receive.poll(timeout_s):
            loading = receive.recv()
            if loading is None:
                return None, False
    except EOFError:   # the probe died mid-sample
        return loading, False
    return loading, loading is not None


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
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:   # a real-time signal has no name
        return f"signal {-exitcode}"
    return name + (", most often the out-of-memory killer" if name == "SIGKILL" else "")
