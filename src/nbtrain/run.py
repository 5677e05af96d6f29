"""Run: the state and history of one training run, shared by the engines and its viewers.

The engines move it through its methods (equip, start, enter, advance, move_to, finish);
viewers subscribe to its records."""
from __future__ import annotations

import threading
import warnings
from typing import Callable, Dict, List, Optional, Tuple

from .config import TrainConfig

STATES = ("created", "running", "finished", "stopped", "interrupted", "failed")
# and "crashed": a stored run whose process died while it trained (nt.load_run, nt.runs)


class TrainingError(RuntimeError):
    """Training failed; `.run` holds the Run with its model, optimizer and history intact."""

    def __init__(self, message: str, run: "Run"):
        super().__init__(message)
        self.run = run


class Run:
    """One training run: live while it trains, complete afterwards.

    >>> run = nt.fit(model, (x, y), loss_fn, config=nt.TrainConfig(max_steps=100))
    >>> run.summary()["samples_per_s"]
    """

    def __init__(self, config: TrainConfig):
        self.config = config
        self.state = "created"
        self.message = ""                   # why it ended, when not simply finished
        self.error: Optional[BaseException] = None
        self.history: List[dict] = []
        self.resolved: Dict[str, Tuple[object, str]] = {}   # setting -> (value, reason)
        self.notes: List[str] = []
        self.model = self.optimizer = self.schedule = self.scaler = None
        self.step = 0                       # optimizer steps done
        self.epoch = 0
        self.batch_in_epoch = 0             # batches of `epoch` already consumed
        self.phase = "load"                 # where the loop is, for errors and Ctrl-C: "load",
                                            # "step", "update", "validate" or "checkpoint"
        self.measuring = ""                 # what the setup measures now (the progress line)
        self.total_steps: Optional[int] = None
        self.wall_s = 0.0
        self._stop = threading.Event()
        self._interrupted = False           # set by Ctrl-C: ends as "interrupted"
        self._diverged = False              # a non-finite loss stopped it: weights may be too
        self._rng_at_end = None
        self.released = False
        self._subscribers: List[Callable[[dict], None]] = []
        self._thread: Optional[threading.Thread] = None   # the thread that trains it
        self._done = threading.Event()
        self.id: Optional[str] = None       # its name in the run store and the reporters
        self.kind = "fit"                   # "fit", "watch" or "trial" (compare, autotune)
        self._stored = None                 # its row in the run store (store.StoredRun)

    # -- control, from any thread ---------------------------------------------------------
    def stop(self) -> None:
        """Stop at the next step boundary; model, optimizer and history are kept."""
        self._stop.set()

    def wait(self, timeout: Optional[float] = None) -> "Run":
        """Block until a background run ends (returns at once for a blocking one)."""
        self._done.wait(timeout)
        return self

    def set_lr(self, lr: float) -> None:
        """Change the base LR live: the schedule applies it from the next step."""
        if not lr > 0:
            raise ValueError(f"lr must be > 0; got {lr!r}")
        if self.schedule is None:
            raise RuntimeError("this run has no schedule yet: set TrainConfig.lr instead")
        self.schedule.base_lr = float(lr)

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def training_thread(self) -> Optional[threading.Thread]:
        """The thread that trains it (a background fit's own, or the caller's); None
        before it starts."""
        return self._thread

    # -- records ----------------------------------------------------------------------------
    def subscribe(self, fn: Callable[[dict], None]) -> Callable[[dict], None]:
        """Call `fn(record)` for each record from now on (in the training thread)."""
        self._subscribers.append(fn)
        return fn

    def unsubscribe(self, fn: Callable[[dict], None]) -> None:
        if fn in self._subscribers:
            self._subscribers.remove(fn)

    def records(self, kind: str = "train") -> List[dict]:
        return [r for r in self.history if r["kind"] == kind]

    # -- how the engines move the Run: every change of its state goes through these ------
    PARTS = ("model", "optimizer", "schedule", "scaler", "total_steps")

    def equip(self, **parts) -> None:
        """Set what the run trains with (`PARTS`), before step 1; a tool may swap the
        schedule (lr_find's sweep)."""
        unknown = set(parts) - set(self.PARTS)
        if unknown:
            raise TypeError(f"Run.equip() takes {', '.join(self.PARTS)}; got {sorted(unknown)}")
        for name, value in parts.items():
            setattr(self, name, value)

    def start(self, thread: Optional[threading.Thread] = None) -> None:
        """Mark the run "running"; with `thread` (a background fit) start it too: "running"
        before it starts, so that a caller polling right after fit returns sees it."""
        self.state = "running"
        self._thread = thread or threading.current_thread()
        if thread is not None:
            thread.start()

    def enter(self, phase: str) -> None:
        """Where the loop is now: "load", "step", "update", "validate" or "checkpoint"."""
        self.phase = phase

    def set_measuring(self, what: str) -> None:
        """What the setup measures before step 1 ("threads and workers"), '' when done."""
        self.measuring = what

    def advance(self, batches: int) -> None:
        """One optimizer step done, on `batches` micro-batches of the epoch."""
        self.step += 1
        self.batch_in_epoch += batches

    def next_epoch(self) -> None:
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    @property
    def position(self) -> Tuple[int, int, int]:
        """(step, epoch, batch_in_epoch): where a resume continues."""
        return self.step, self.epoch, self.batch_in_epoch

    def move_to(self, step: Optional[int] = None, epoch: Optional[int] = None,
                batch_in_epoch: Optional[int] = None) -> None:
        """Put the run at a position (a resume, the ranks' progress); None keeps a part."""
        self.step = self.step if step is None else step
        self.epoch = self.epoch if epoch is None else epoch
        self.batch_in_epoch = self.batch_in_epoch if batch_in_epoch is None else batch_in_epoch

    def replace_history(self, records: List[dict]) -> None:
        """A resumed run's history, continued by this one."""
        self.history = list(records)

    @property
    def stop_requested(self) -> bool:
        """Whether the run is to end at the next step boundary (stop(), Ctrl-C, divergence)."""
        return self._stop.is_set()

    def stop_check(self) -> Callable[[], bool]:
        """`stop_requested` as a function, for a hook that asks at every step."""
        return self._stop.is_set

    def interrupt(self) -> None:
        """Ctrl-C: stop at the step boundary, and end as "interrupted" rather than "stopped"."""
        self._interrupted = True
        self._stop.set()

    @property
    def interrupted(self) -> bool:
        return self._interrupted

    def diverge(self, message: str) -> None:
        """A non-finite loss: stop at the step boundary, saying why in `message`."""
        self._diverged = True
        self.message = message
        self._stop.set()

    @property
    def diverged(self) -> bool:
        """Whether a non-finite loss stopped the run: its weights may be non-finite too,
        so the loop writes no checkpoint over the last good one."""
        return self._diverged

    def emit(self, record: dict, keep: bool = True) -> None:
        """Add `record` to the history (unless keep=False) and pass it to each subscriber."""
        if keep:
            self.history.append(record)
            if len(self.history) > self.config.history_limit:
                self.history = compact(self.history)
        for fn in list(self._subscribers):
            try:
                fn(record)
            except Exception as exc:   # a broken viewer must not kill training
                self.unsubscribe(fn)
                warnings.warn(f"nbtrain: subscriber {fn!r} raised {exc!r}; it was removed.")

    def finish(self, state: Optional[str], read_rng: Callable[[], dict], elapsed_s: float = 0.0,
               error: Optional[BaseException] = None, message: Optional[str] = None) -> None:
        """The engine's last call, however training ended: the final `state` (None keeps
        the current one), its error or message, the time it trained; keep the RNG as
        training left it (`read_rng()`), send the "end" record (not kept in history),
        release wait(). wait() returns even if reading the RNG fails (a broken CUDA
        context)."""
        self.state = state or self.state
        self.error = error if error is not None else self.error
        self.message = message if message is not None else self.message
        self.wall_s += elapsed_s
        try:
            self._rng_at_end = read_rng()
            self.emit({"kind": "end", "state": self.state, "step": self.step,
                       "message": self.message}, keep=False)
        finally:
            self._done.set()

    @property
    def rng_at_end(self) -> Optional[dict]:
        """The RNG state when training ended (None before): a checkpoint taken later, after
        the user's cells drew numbers, resumes from this one."""
        return self._rng_at_end

    # -- the run store (nbtrain.store: nt.runs(), nt.load_run(id)) ------------------------
    @property
    def name(self) -> Optional[str]:
        """TrainConfig.name: how nt.runs(), TensorBoard and MLflow call the run."""
        return self.config.name

    def keep_as(self, run_id: str, kind: str, stored=None) -> None:
        """The run's id and kind (set by fit and watch), and its row in the run store."""
        self.id, self.kind, self._stored = run_id, kind, stored

    def discard(self) -> bool:
        """Remove the run from the run store (nt.runs() no longer lists it; the Run itself
        is unchanged); False when it was not stored."""
        stored, self._stored = self._stored, None
        if stored is None:
            return False
        stored.discard()
        return True

    # -- results ------------------------------------------------------------------------
    def summary(self) -> dict:
        """Throughput, time split, memory, final loss/metrics and the settings used."""
        from .report import summarize
        return summarize(self)

    def summary_text(self) -> str:
        from .report import summary_table
        return summary_table(self)

    def state_dict(self) -> dict:
        """Everything needed to resume exactly (model, optimizer, schedule, position, RNG,
        history): see `nbtrain.checkpoint`. `run.save(path)` writes it to a file."""
        from .checkpoint import state_of
        return state_of(self)

    def checkpoint(self) -> dict:
        """The old name of `state_dict()`: it returns the state and writes nothing."""
        warnings.warn("Run.checkpoint() is now Run.state_dict() (it writes nothing; "
                      "run.save(path) writes a checkpoint file)", DeprecationWarning, stacklevel=2)
        return self.state_dict()

    def release(self) -> dict:
        """Free optimizer state and gradients, run the GC, empty the CUDA cache; report MB freed."""
        from .memory import release
        freed = release(self)
        self.released = True
        return freed

    # -- export ---------------------------------------------------------------------------
    def to_json(self, path) -> str:
        import json
        with open(path, "w") as f:
            json.dump({"config": self.config.to_dict(), "history": self.history}, f, indent=1)
        return str(path)

    def to_csv(self, path, kind: str = "train") -> str:
        import csv
        rows = self.records(kind)
        columns = list(dict.fromkeys(key for row in rows for key in row))
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
        return str(path)

    def to_pandas(self, kind: Optional[str] = "train"):
        """The history as a DataFrame (pandas must be installed); kind=None: every record."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("Run.to_pandas needs pandas: pip install pandas") from None
        return pd.DataFrame(self.records(kind) if kind else self.history)

    def save(self, path) -> str:
        from .checkpoint import save
        return save(self.state_dict(), path)

    def report(self, path) -> str:
        """One self-contained HTML file: charts, summary, settings and why (nbtrain.export)."""
        from .export import run_report
        return run_report(self, path)

    def __repr__(self) -> str:
        total = self.total_steps if self.total_steps is not None else "?"
        last = self.records("train")[-1:] or [{}]
        loss = last[0].get("loss")
        loss_text = f", loss {loss:.4g}" if isinstance(loss, float) else ""
        return f"<nbtrain.Run {self.state}: step {self.step}/{total}{loss_text}>"


# -- bounded history ------------------------------------------------------------------------
_SUMMED = ("samples", "steps", "interval_s", "skipped_steps")
_PER_STEP = ("loss", "data_wait_s", "copy_s", "compute_s")
_PER_SECOND = ("data_wait_frac", "copy_frac", "compute_frac", "tflops", "mfu")
_PEAKS = ("peak_rss_mb", "cuda_peak_allocated_mb")


def merge(a: dict, b: dict) -> dict:
    """One train record covering the intervals of `a` then `b`."""
    out = dict(b)
    steps, seconds = a["steps"] + b["steps"], a["interval_s"] + b["interval_s"]
    for key in _SUMMED:
        if key in a or key in b:
            out[key] = a.get(key, 0) + b.get(key, 0)
    for key in _PER_STEP:
        if key in a and key in b:
            out[key] = (a[key] * a["steps"] + b[key] * b["steps"]) / steps
    for key in _PER_SECOND:
        if key in a and key in b:
            out[key] = (a[key] * a["interval_s"] + b[key] * b["interval_s"]) / seconds
    for key in _PEAKS:
        if key in a and key in b:
            out[key] = max(a[key], b[key])
    out.update(samples_per_s=out["samples"] / seconds, steps_per_s=steps / seconds,
               step_time_s=seconds / steps)
    return out


def compact(history: list) -> list:
    """Halve the older half of the history: neighbouring train records are merged in
    pairs, and of each two validation records the later is kept. The history stays
    bounded however long the run and whatever the mix of records (validation every epoch
    included), and recent intervals keep full resolution."""
    half = len(history) // 2
    older, newer = history[:half], history[half:]
    kept, waiting = [], {}   # (position, record); kind -> the first of a pair
    for position, record in enumerate(older):
        kind = record["kind"]
        if kind not in ("train", "val"):
            kept.append((position, record))
        elif kind in waiting:
            first = waiting.pop(kind)[1]
            kept.append((position, merge(first, record) if kind == "train" else record))
        else:
            waiting[kind] = (position, record)
    kept.extend(waiting.values())
    kept.sort(key=lambda pair: pair[0])
    return [record for _, record in kept] + newer
