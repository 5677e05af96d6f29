"""What the loop measures, without a host sync per step: timers, the Interval of `log_every`
steps, memory (process RSS, the CUDA allocator, NVML)."""
from __future__ import annotations

import bisect
import functools
import math
import time
from typing import Optional

import torch

from .sampling import MemorySampler


class HostTimer:
    """CPU: an op has finished when its call returns, so host time is the work's time, and
    the data wait is the host's time in next(). Sums floats as it goes: nothing is
    allocated per step."""

    marks_steps = True   # its step_done counts (Interval.end_step calls it)

    def __init__(self, before=None):
        self.copy = self.busy = 0.0
        self._step_start = None

    def copy_started(self) -> None:
        self._c0 = time.perf_counter()
        if self._step_start is None:
            self._step_start = self._c0

    def copy_done(self) -> None:
        self.copy += time.perf_counter() - self._c0

    def step_starts(self) -> None:
        """The step's work starts (nt.watch: its first forward), with no copy to time."""
        if self._step_start is None:
            self._step_start = time.perf_counter()

    def wait_started(self) -> None:   # no prefetcher off CUDA
        pass

    wait_done = wait_started

    def step_done(self, host_wait_s: float = 0.0) -> None:
        if self._step_start is not None:
            self.busy += time.perf_counter() - self._step_start
            self._step_start = None

    def last_end(self):
        return None

    def totals(self):
        """(copy seconds, compute seconds, None: the data wait is the loop's host time)."""
        return self.copy, self.busy - self.copy, None


class CudaTimer:
    """CUDA: events recorded in stream order on the compute stream, read once when the
    interval closes.

    Between the end of one step's work and the end of the next, the compute stream is
    idle (nothing queued yet: the host was still fetching the batch, or doing other
    bookkeeping), waits for a prefetcher's copy (`wait_started`/`wait_done`, queued in
    the prefetcher's next()), copies (the step's own `copy_started`/`copy_done`), and
    computes. The host queues work ahead, so the host's time in next() is no measure of
    the GPU's wait: it may gather the next batch while the GPU is still busy. The data
    wait is the GPU's idle time while the host fetched: per step, the smaller of the idle
    gap and the host's time in next() (the gap may also hold a checkpoint or a record;
    the host's wait may have been hidden behind queued work). Without the end of the step
    before (the first step, after validation) the GPU had nothing queued: the host's wait
    is its idle time.

    Reading an event needs it to have happened: `totals` waits for the interval's last
    one (the interval's single sync, shared with the loss read), never one per step.
    """

    marks_steps = True

    def __init__(self, device: torch.device, before=None, pool=None):
        self.pool = [] if pool is None else pool   # events read already: recorded again
        self.steps = []       # per step: (waits, copies, step end, the host's wait in next())
        self._waits, self._copies = [], []
        self.before = before  # the end event of the step just before the first, if any
        self.stream = torch.cuda.current_stream(device)   # the loop's stream on its device

    def _mark(self):
        event = self.pool.pop() if self.pool else torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def _release(self) -> None:
        """The read events back to the pool, all but the last end (the next interval's
        `before`); this interval's own `before` is done with."""
        keep = self.steps[-1][2]
        spent = {id(e): e for waits, copies, end, _ in self.steps
                 for e in (end, *(x for span in waits + copies for x in span))}
        if self.before is not None:
            spent[id(self.before)] = self.before
        spent.pop(id(keep), None)
        self.pool.extend(spent.values())
        self.steps, self.before = [], keep   # read once: a second totals() reads nothing

    def wait_started(self) -> None:
        self._w0 = self._mark()

    def wait_done(self) -> None:
        self._waits.append((self._w0, self._mark()))

    def copy_started(self) -> None:
        self._c0 = self._mark()

    def copy_done(self) -> None:
        self._copies.append((self._c0, self._mark()))

    def step_starts(self) -> None:
        """The step's work starts, with no copy to time: one event, a copy of no length."""
        if not self._copies:
            start = self._mark()
            self._copies.append((start, start))

    def step_done(self, host_wait_s: float = 0.0) -> None:
        if self._copies:
            self.steps.append((self._waits, self._copies, self._mark(), host_wait_s))
            self._waits, self._copies = [], []

    def last_end(self):
        """The end event of the interval's last step (the next interval's `before`)."""
        return self.steps[-1][2] if self.steps else self.before

    def totals(self):
        """(copy, compute, data wait) seconds of the interval's steps."""
        if not self.steps:
            return 0.0, 0.0, 0.0
        self.steps[-1][2].synchronize()
        copy = compute = idle = 0.0
        before = self.before
        for waits, copies, end, host_wait in self.steps:
            waited, copied, start = _spans_s(waits), _spans_s(copies), copies[0][0]
            copy += waited + copied
            compute += _elapsed_s(start, end) - copied
            gap = host_wait if before is None else _elapsed_s(before, start) - waited
            idle += min(max(gap, 0.0), host_wait)
            before = end
        self._release()
        return copy, compute, idle


def _elapsed_s(start, end) -> float:
    return start.elapsed_time(end) / 1000.0   # Event.elapsed_time: milliseconds


def _spans_s(spans) -> float:
    return sum(_elapsed_s(a, b) for a, b in spans)


class NoTimer:
    """telemetry=False: the markers cost a call and nothing else."""

    marks_steps = False

    def __init__(self, before=None):
        pass

    def copy_started(self) -> None:
        pass

    copy_done = wait_started = wait_done = step_starts = copy_started

    def step_done(self, host_wait_s: float = 0.0) -> None:
        pass

    def last_end(self):
        return None

    def totals(self):
        return 0.0, 0.0, None


class RestTimer(NoTimer):
    """nt.watch on the CPU: the step's time is the loader's (the data wait, timed around
    its next()) and the rest, its compute; nothing is marked per step."""

    def totals(self):
        return 0.0, None, None   # compute: the interval's time less its data wait (record)


class Interval:
    """Loss, samples and time split of the steps since the last record.

    Losses stay on the device (detached, so no graph is kept). `close` ends an interval
    and returns the record of the one before it: reading an interval's losses and timings
    waits for the device to finish them, and reading the previous one's leaves the device
    this interval's work to run meanwhile, so logging never drains a GPU's queue. That
    one `.tolist()` per interval is the loop's only host read, and it gives the exact
    step of a first non-finite loss. `flush` returns the last record. Each step's time is
    split into copy (host-to-device, and on CUDA the wait for a prefetched copy) and
    compute (forward, backward, update); data wait is the loop's host time around its
    `next()`, and on CUDA the GPU's idle time within it (CudaTimer; the host's time is
    then the record's `host_fetch_s`). `host_timer`: the timer off CUDA (nt.watch's on the
    CPU is RestTimer: compute is the rest of the step).
    """

    def __init__(self, device: torch.device, start_step: int, timed: bool = True,
                 host_timer=HostTimer):
        self.device = device
        self.timed = timed
        self._timer_class = NoTimer if not timed else (
            functools.partial(CudaTimer, device, pool=[]) if device.type == "cuda" else host_timer)
        self.memory = MemorySampler(device)
        self.diagnosed = (-math.inf, "")   # (when, text) of the last diagnosis (emit.py)
        self.t_start = time.perf_counter()
        self._ended = None
        self.timer = None
        self.sums = False   # a record's loss: the mean of its steps' summed micro-batches
        self.reset(start_step)

    def reset(self, start_step: int, before=None) -> None:
        """A new interval from `start_step`; `before`: the end event of the step just
        before it, when that step ran just before (close), so that its first step's idle
        time is measured too."""
        self.start_step = start_step
        self.steps = self.micro = self.samples = self.skipped = 0
        self.samples_done = 0         # samples of the interval's completed steps
        self.losses = []              # 0-dim device tensors: a list append costs less than
                                      # writing into a buffer (an indexing op per step)
        self.micro_ends = []          # micro-batch count after each step of the interval
        if self.timer is None or self.timer.marks_steps:   # NoTimer, RestTimer: one will do
            self.timer = timer = self._timer_class(before=before)
            self.copy_started, self.copy_done = timer.copy_started, timer.copy_done
            self.step_starts = timer.step_starts
            self.wait_started, self.wait_done = timer.wait_started, timer.wait_done
        self.data_wait_s = 0.0
        self._waited_before_step = 0.0   # data_wait_s at the end of the last step
        self.counts = {}              # name -> total of the interval (nt.watch: host reads)
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor, samples: int) -> None:
        self.losses.append(loss)
        self.micro += 1
        self.samples += samples

    def add_samples(self, samples: int) -> None:
        """Samples of a step whose loss the loop computed out of sight (no backward)."""
        self.samples += samples

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to a per-interval counter; its record has `<name>_per_step`."""
        self.counts[name] = self.counts.get(name, 0) + n

    def count_in_last(self, name: str, n: int) -> None:
        """Add `n` to the counter of the interval closed last, its record not emitted yet
        (nt.watch: the host reads after a loop's last step, which are that step's)."""
        if self._ended is not None:
            self._ended.counts[name] = self._ended.counts.get(name, 0) + n

    def end_step(self) -> None:
        if self.timer.marks_steps:
            self.timer.step_done(self.data_wait_s - self._waited_before_step)
            self._waited_before_step = self.data_wait_s
        self.steps += 1
        self.micro_ends.append(self.micro)
        self.samples_done = self.samples

    def sum_micro_batches(self) -> None:
        """A step's loss is the sum of its micro-batches' (a framework that divides each by
        their count), not their mean; a record's, the mean of its steps'."""
        self.sums = True

    def take_back(self, samples: int) -> None:
        """Samples credited to the last step that are the next one's (nt.watch: a batch its
        loader fetched ahead), from this interval or, where that step ended the last one,
        from that one's record."""
        if self.steps:
            self.samples -= samples
            self.samples_done -= samples
        elif self._ended is not None:
            self._ended.samples -= samples

    def extend_step(self) -> None:
        """The micro-batches since the last step belong to it (nt.watch: a second
        optimizer's backward after the first one's step)."""
        if self.micro_ends:
            self.micro_ends[-1] = self.micro
        self.samples_done = self.samples

    def drop_unfinished_step(self) -> None:
        """Forget the micro-batches of a step that did not finish (an error, a second
        Ctrl-C): a record holds completed steps only, and the run resumes before it."""
        done = self.micro_ends[-1] if self.micro_ends else 0
        del self.losses[done:]
        self.micro, self.samples = done, self.samples_done

    def close(self, step: int, epoch: int, lr: float, at: Optional[float] = None) -> Optional[dict]:
        """End this interval (at `at`, a perf_counter time: its last step's end, where the
        loop went on after it; else now) and start the next; the previous interval's
        record, if any.

        The next interval starts before the previous one is read: the wait for the
        device is time the device spends on its steps, so it is counted as theirs.
        """
        ended = EndedInterval(self, step, epoch, lr, at)
        self.reset(step, before=self.timer.last_end())
        previous, self._ended = self._ended, ended
        return previous.record() if previous is not None else None

    def flush(self, until: Optional[float] = None) -> Optional[dict]:
        """The record of the interval closed last, once. Outside `close`, the wait for the
        device finishes that interval's steps, so it is added to its time, and so is the
        time since that close while the open interval has no step yet (which includes
        the wait inside the close); `until`: none of it after that time (the last step's
        end, where the loop went on after it)."""
        ended, self._ended = self._ended, None
        if ended is None:
            return None
        start = self.t0 if self.steps == 0 else time.perf_counter()
        ended.wait()
        now = time.perf_counter() if until is None else max(until, start)
        if self.steps == 0:
            self.t0 = now   # the open interval starts after the time it handed back
        return ended.record(waited_s=now - start)


class EndedInterval:
    """A closed interval: its host-side figures, and its device values on their way."""

    def __init__(self, interval: Interval, step: int, epoch: int, lr: float,
                 at: Optional[float] = None):
        now = time.perf_counter() if at is None else at
        self.step, self.epoch, self.lr = step, epoch, lr
        self.samples, self.steps, self.skipped = interval.samples, interval.steps, interval.skipped
        self.data_wait_s, self.counts = interval.data_wait_s, interval.counts
        self.elapsed, self.time_s = max(now - interval.t0, 1e-9), now - interval.t_start
        self.memory = interval.memory.read() if interval.timed else {}
        self.timer = interval.timer if interval.timed else None
        self.start_step, self.micro_ends = interval.start_step, interval.micro_ends
        self.sums = interval.sums
        self.losses, self.ready = _start_reading(interval.losses)

    def wait(self) -> None:
        """Until the device has run the interval's steps and copied their losses back."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None

    def record(self, waited_s: float = 0.0) -> dict:
        self.wait()
        values = [] if self.losses is None else \
            self.losses if type(self.losses) is list else self.losses.tolist()   # the host read
        total = sum(values)   # finite unless one of them is not (or the sum overflows)
        finite = values if math.isfinite(total) else [v for v in values if math.isfinite(v)]
        elapsed, steps = self.elapsed + waited_s, max(self.steps, 1)
        per = steps if self.sums else len(finite)
        record = {
            "kind": "train", "step": self.step, "epoch": self.epoch,
            "loss": (total if finite is values else sum(finite)) / per if finite
            else math.nan, "lr": self.lr,
            "samples": self.samples, "steps": self.steps,
            "samples_per_s": self.samples / elapsed, "steps_per_s": self.steps / elapsed,
            "step_time_s": elapsed / steps, "data_wait_s": self.data_wait_s / steps,
            "data_wait_frac": min(self.data_wait_s / elapsed, 1.0),
            "interval_s": elapsed, "time_s": self.time_s + waited_s,
        }
        if self.timer is not None:
            copy_s, compute_s, idle_s = self.timer.totals()
            if compute_s is None:   # RestTimer
                compute_s = max(elapsed - self.data_wait_s, 0.0)
            record.update(copy_s=copy_s / steps, compute_s=compute_s / steps,
                          copy_frac=min(copy_s / elapsed, 1.0),
                          compute_frac=min(compute_s / elapsed, 1.0))
            if idle_s is not None:   # CUDA: the GPU's idle time while the host fetched
                record.update(data_wait_s=idle_s / steps, data_wait_frac=min(idle_s / elapsed, 1.0),
                              host_fetch_s=self.data_wait_s / steps)
        if self.skipped:
            record["skipped_steps"] = self.skipped
        record.update({f"{name}_per_step": n / steps for name, n in self.counts.items()})
        if len(finite) < len(values):   # 1-based number of the step that held the first bad one
            bad = next(i for i, v in enumerate(values) if not math.isfinite(v))
            record["first_nonfinite_step"] = self.start_step + bisect.bisect_right(
                self.micro_ends, bad) + 1
        record.update(self.memory)
        return record


def _start_reading(losses: list):
    """(losses on their way to host memory, the event that says they arrived)."""
    if not losses:
        return None, None
    if type(losses[0]) is float:   # read as they came (nt.watch on the CPU reads them all)
        return losses, None
    stacked = torch.stack(losses).float()
    if stacked.device.type != "cuda":
        return stacked, None   # CPU: already there; MPS: read (and synced) at record time
    host = stacked.to("cpu", non_blocking=True)   # into pinned memory, in stream order
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(stacked.device))
    return host, ready
















# -- NVML (nvidia-ml-py): device-wide memory, utilisation and power ----------------------------














