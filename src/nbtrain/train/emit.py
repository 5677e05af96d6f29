"""A training record, emitted: the interval closed, its FLOP rates and diagnosis added,
the Run told. nbtrain's loop (loop.py) and a watched loop (watcher/records.py) share it."""
from __future__ import annotations

import time
from typing import Optional

from ..auto.diagnosis import diagnose
from ..auto.rates import rate_fields
from ..run import Run
from ..telemetry.timers import Interval


def log_interval(run: Run, interval: Interval, lr: float, at: Optional[float] = None) -> None:
    """Close the interval (at `at`: Interval.close) and emit the one before it."""
    _emit_train(run, interval.close(run.step, run.epoch, lr, at), interval)


def flush_interval(run: Run, interval: Interval, until: Optional[float] = None) -> None:
    """Emit the last closed interval's record now (it waits for the device; Interval.flush)."""
    _emit_train(run, interval.flush(until), interval, last=True)


DIAGNOSE_EVERY_S = 0.25   # records closer together carry the last diagnosis


def _emit_train(run: Run, record: Optional[dict], interval: Interval, last: bool = False) -> None:
    if record is None:
        return
    record.update(rate_fields(record, run.resolved))
    if interval.timed:
        record["diagnosis"] = _diagnosis(run, record, interval, last)
    run.emit(record)
    if record.get("first_nonfinite_step") is None or run.config.on_nan != "stop" \
            or run.diverged:   # the first non-finite step is the one to name
        return
    run.diverge(f"loss became non-finite at step {record['first_nonfinite_step']}; "
                f"training stopped at step {run.step}. Lower lr, set clip_grad_norm, "
                "or use on_nan='skip' to skip such steps.")


def _diagnosis(run: Run, record: dict, interval: Interval, last: bool) -> str:
    """The record's diagnosis, derived again at most every DIAGNOSE_EVERY_S (and for the
    last record): a step of a millisecond makes a record every few milliseconds, and a
    diagnosis is a hint read at human speed, not worth its cost in every one of them."""
    now = time.perf_counter()
    at, text = interval.diagnosed
    if last or not text or now - at >= DIAGNOSE_EVERY_S:
        # a watch's counted reads: the line that reads the most (nt.fit counts none)
        worst = run.host_reads().worst if record.get("host_reads_per_step") else None
        seen = dict(record, worst_host_read=worst) if worst else record
        interval.diagnosed = now, diagnose(seen, run.resolved)
    return interval.diagnosed[1]
