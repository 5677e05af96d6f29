"""Run: the state and history of one training run, shared by the engines and its viewers.

The engines move it through its methods (equip, start, enter, advance, move_to, finish);
viewers subscribe to its records."""
from __future__ import annotations

import math
import threading
import time
import warnings
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from .auto.compiling import warmup_split
from .auto.rates import percent, rate_fields
from .config import TrainConfig
from .tables import Table, plain, setting
from .telemetry.gaps import PARTS, Gaps, between_words

STATES = ("created", "running", "finished", "stopped", "interrupted", "failed")
# and "crashed": a stored run whose process died while it trained (nt.load_run, nt.runs)


class TrainingError(RuntimeError):
    """Training failed; `.run` holds the Run with its model, optimizer and history intact."""

    def __init__(self, message: str, run: "Run"):
        super().__init__(message)
        self.run = run


class HostRead(NamedTuple):
    """A line of your code that read tensors to the host while the loop trained."""
    where: str        # "train.py:12"; in a notebook "cell 3, line 5" (IPython's In[3])
    code: str         # the line's text
    per_step: float   # its reads a step, over the steps counted


class HostReads(Table):
    """`run.host_reads()`: HostRead rows, the most reads a step first; `note` says over
    which steps they were counted, or in words why there are none."""

    def __init__(self, rows: List[HostRead], note: str):
        super().__init__(rows, note, HostRead._fields, left=("where", "code"))

    @property
    def worst(self) -> Optional[HostRead]:
        return self[0] if self else None

    def _repr_html_(self) -> str:
        import html
        from .tables import html_table
        table = html_table([("where", "where"), ("code", "code"), ("per_step", "per_step")],
                           [row._asdict() for row in self]) if self else ""
        return f"{table}<p>{html.escape(self.note)}</p>"


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
        self.between = Gaps()               # the time between steps, by what took it (gaps())
        self._started_at: Optional[float] = None   # this segment's start (perf_counter)
        self._stop = threading.Event()
        self._interrupted = False           # set by Ctrl-C: ends as "interrupted"
        self._diverged = False              # a non-finite loss stopped it: weights may be too
        self._rng_at_end = None
        self.released = False
        self._subscribers: List[Callable[[dict], None]] = []
        self._thread: Optional[threading.Thread] = None   # the thread that trains it
        self._done = threading.Event()
        self.id: Optional[str] = None       # its name in the run store and the trackers
        self.kind = "fit"                   # "fit", "watch" or "trial" (compare, autotune)
        self._stored = None                 # its row in the run store (store.StoredRun)

    @classmethod
    def ended_before(cls, config: TrainConfig, records: List[dict], *, id: str, kind: str,
                     state: str, message: str, resolved: dict, notes: List[str], machine: dict,
                     started, ended, step: int, epoch: int, total_steps: Optional[int],
                     wall_s: float, bounded: bool = True) -> "Run":
        """A Run that ended before: in another process or an earlier session, read back from
        the run store (nt.load_run); nothing trains it, so wait() returns at once.
        bounded=True emits its records again, so that the history is merged past
        history_limit as the live run merged it; bounded=False keeps every one of them."""
        run = cls(config)
        run.id, run.kind = id, kind
        if bounded:
            for record in records:
                run.emit(record)
        else:   # history_limit bounds a live run's memory, not what the store kept
            run.replace_history(records)
        run.resolved, run.notes = resolved, notes
        run.state, run.message, run.machine = state, message, machine
        run.started, run.ended = started, ended
        run.move_to(step=step, epoch=epoch)
        run.total_steps, run.wall_s = total_steps, wall_s
        run._done.set()
        return run

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
        self._started_at = time.perf_counter()
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
        self.emit({"kind": "gaps", "step": self.step, "wall_s": self.wall_s,
                   **self.between.parts()})   # kept, stored: load_run's gaps() reads it
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

    # -- the run store (nbtrain.runstore.write: nt.runs(), nt.load_run(id)) ------------------------
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
        return summarize(self)

    def summary_text(self) -> str:
        return summary_table(self)

    def host_reads(self) -> HostReads:
        """The lines of your code that read tensors to the host while the loop trained
        (`.item()`, `.tolist()`, `float()`/`int()`/`bool()` of a tensor, `print` of one,
        `.cpu()`, `.numpy()`): rows of `where`, `code` and `per_step`, the most first. Each
        read waits for every kernel queued on a GPU. nt.watch counts them over the loop's
        first 30 steps (a loop reads in the same places every step): live from then on,
        and from a stored run (nt.load_run). A read of a CPU tensor without a graph (an
        index's .item()) is no host read and is not counted, nor are nbtrain's own.
        Under nt.fit the table is empty and its `note` says why: fit's loop reads the loss
        once per log_every steps, and reads in your model's forward or loss_fn are not
        counted (run the loop under nt.watch to see them).

        >>> run.host_reads()[0]
        HostRead(where='cell 3, line 7', code='total_loss += loss.item()', per_step=1.0)
        """
        table = next((r for r in self.history if r["kind"] == "host_reads"), None)
        if table is None:
            return HostReads([], self._why_no_host_reads())
        first, last = table["step"] - table["steps"] + 1, table["step"]
        if not table["rows"]:
            return HostReads([], f"none: your loop read no tensor to the host over steps "
                                 f"{first}-{last}")
        return HostReads([HostRead(**row) for row in table["rows"]],
                         f"{table['per_step']:.3g} reads a step in all, counted over steps "
                         f"{first}-{last}")

    def _why_no_host_reads(self) -> str:
        if self.kind != "watch":
            return ("not counted under nt.fit: its loop reads the loss once per log_every "
                    "steps; reads in your model's forward or loss_fn are not counted (run "
                    "the loop under nt.watch to see them)")
        if self.state == "running":
            return "not counted yet: a watch counts them over its loop's first 30 steps"
        if not self.step:
            return "none: the loop made no step"
        return ("not known: this run's records hold no table of host reads (stored by an "
                "nbtrain that did not count their lines, or its process ended before "
                "the 30th step)")

    def gaps(self) -> List[dict]:
        """The run's wall time as parts that add up to it, each a row of `part`, `seconds`
        and `share`: "steps", then what took the time between them: "evaluation"
        (validation; under nt.watch a pass over another DataLoader between steps),
        "saving" (checkpoints, torch.save), "loader start" (the training loader's first
        batch of each epoch: its iterator, its workers' start) and "your code" (a watched
        loop's own code between steps). Live while the run trains; a stored run's from its
        end (nt.load_run).

        >>> [row["part"] for row in run.gaps()]
        ['steps', 'evaluation', 'saving', 'loader start', 'your code']
        """
        if self._started_at is None:   # a stored run: its last segment's, as it ended
            ended = next((r for r in reversed(self.history) if r.get("kind") == "gaps"), None)
            if ended is not None:
                return Gaps({p: ended.get(p, 0.0) for p in PARTS}).table(ended["wall_s"])
        running = self.state == "running" and self._started_at is not None
        wall = self.wall_s + (time.perf_counter() - self._started_at if running else 0.0)
        return self.between.table(wall)

    def modules(self):
        """Each leaf module's time a step over a sampled window of a few steps (then its
        hooks removed): rows of `name` (as named_modules()), `forward_s`, `backward_s`,
        `share` of the step's module time and `calls`, the largest share first; `note`
        says over which steps, or why none (telemetry/modules.py: what it measures).

        >>> run.modules()[0].name
        'blocks.3.attn.proj'
        """
        from .telemetry.modules import module_table, why_none
        return module_table(self._modules_record(), why_none(self))

    def peak(self):
        """The step's memory peak (the end of the forward) from the same window: `bytes`,
        and `parts` of `part`, `kind` and `bytes`, largest first: each leaf's activations
        saved for backward, "parameters", "gradients", "optimizer state", "other"."""
        from .telemetry.modules import peak_of, why_none
        return peak_of(self._modules_record(), why_none(self))

    def _modules_record(self) -> Optional[dict]:
        """The last window's record that measured, else the last one's reason."""
        kept = self.records("modules")
        return next((r for r in reversed(kept) if r["rows"]), kept[-1] if kept else None)

    def state_dict(self) -> dict:
        """Everything needed to resume exactly (model, optimizer, schedule, position, RNG,
        history): see `nbtrain.checkpoint`. `run.save(path)` writes it to a file."""
        from .checkpoint import state_of
        return state_of(self)

    def release(self) -> dict:
        """Free optimizer state and gradients, run the GC, empty the CUDA cache; report MB freed."""
        from .auto.memory import release
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
        """One self-contained HTML file: charts, summary, settings and why (nbtrain.views.html_report)."""
        from .views.html_report import run_report
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


# -- the summary: a dict for code, a text table for people (and nbval) ------------------
def summarize(run) -> dict:
    train = run.records("train")
    val = run.records("val")
    samples = sum(r["samples"] for r in train)
    busy = sum(r["interval_s"] for r in train)
    waited = sum(r["data_wait_s"] * r["steps"] for r in train)
    copied = sum(r.get("copy_s", 0.0) * r["steps"] for r in train)
    computed = sum(r.get("compute_s", 0.0) * r["steps"] for r in train)
    out = {
        "state": run.state, "message": run.message,
        "steps": run.step, "total_steps": run.total_steps, "epochs": run.epoch,
        "samples": samples,
        "samples_per_s": samples / busy if busy else math.nan,
        "step_time_s": busy / run.step if run.step and busy else math.nan,
        "data_wait_frac": waited / busy if busy else math.nan,
        "copy_frac": copied / busy if busy else math.nan,
        "compute_frac": computed / busy if busy else math.nan,
        "wall_s": run.wall_s,
        "final_loss": train[-1]["loss"] if train else math.nan,
        # the highest RSS sampled during this run (ru_maxrss is the whole process's peak)
        "peak_rss_mb": max((r["rss_mb"] for r in train if "rss_mb" in r), default=math.nan),
        "settings": {name: value for name, (value, _) in run.resolved.items()},
        "reasons": {name: why for name, (_, why) in run.resolved.items()},
    }
    if busy:   # the run's whole FLOPs over its whole time (empty when not counted)
        out.update(rate_fields({"steps": sum(r["steps"] for r in train), "interval_s": busy},
                               run.resolved))
    for name in ("host_reads_per_step", "kept_losses_per_step", "collated_samples_per_step"):
        if any(name in r for r in train):   # nt.watch's counters, over the whole run
            out[name] = sum(r.get(name, 0.0) * r["steps"] for r in train) / max(run.step, 1)
    if run.config.compile:   # the compiler's warm-up apart from the steady throughput
        split = warmup_split(train)   # the recompiles during training (a new batch shape)
        first = run.resolved.get("compile_warmup_s", (0.0, ""))[0]   # the setup's compile
        out["compile_warmup_s"] = first + split.get("compile_warmup_s", 0.0)
        out["steady_samples_per_s"] = split.get("steady_samples_per_s", out["samples_per_s"])
    if train and "copy_s" in train[-1]:
        from .auto.diagnosis import diagnose
        out["diagnosis"] = diagnose(dict(out, worst_host_read=run.host_reads().worst),
                                     run.resolved)
    if any("cuda_peak_allocated_mb" in r for r in train):
        out["peak_cuda_mb"] = max(r.get("cuda_peak_allocated_mb", 0.0) for r in train)
    if val:
        out["val_loss"] = val[-1]["val_loss"]
        if "val_acc" in val[-1]:
            out["val_acc"] = val[-1]["val_acc"]
    out["gaps"] = {row["part"]: row["seconds"] for row in run.gaps()}
    if run.records("modules"):
        from .telemetry.modules import summary_entries
        out.update(summary_entries(run._modules_record()))
    return out


def summary_table(run) -> str:
    """Two blocks: results, then each resolved setting with its reason."""
    s = summarize(run)
    total = f"/{s['total_steps']}" if s["total_steps"] is not None else ""   # own loop: unknown
    rows = [("state", s["state"]), ("steps", f"{s['steps']}{total}"),
            ("samples/s", f"{s['samples_per_s']:,.0f}" if s["samples"] else "-"),
            ("wall time", f"{s['wall_s']:.2f} s"), ("final loss", plain(s["final_loss"]))]
    for key, label in (("val_loss", "val loss"), ("val_acc", "val accuracy")):
        if key in s:
            rows.append((label, plain(s[key])))
    if "compile_warmup_s" in s:
        compiles = s["settings"].get("compiles")
        rows.append(("compile", f"warm-up {s['compile_warmup_s']:.2f} s"
                     + (f" ({compiles} graph(s))" if compiles is not None else "")
                     + f", then {s['steady_samples_per_s']:,.0f} samples/s"))
    if "tflops" in s:
        rows.append(("compute rate", f"{s['tflops']:.3g} TFLOP/s" + (
            f", {percent(s['mfu'])} MFU" if "mfu" in s else "")))
    worst = run.host_reads().worst
    if worst is not None:
        rows.append(("host reads", f"{s.get('host_reads_per_step', 0.0):.2g} a step; the most "
                                   f"at {worst.where}: {worst.code} ({worst.per_step:.2g} a step)"))
    if "diagnosis" in s:
        rows.append(("time split", f"data wait {s['data_wait_frac']:.0%}, copy "
                                   f"{s['copy_frac']:.0%}, compute {s['compute_frac']:.0%}"))
        rows.append(("diagnosis", s["diagnosis"]))
    between = between_words(run.gaps(), _framework_name(run.resolved))
    if between != "-":
        rows.append(("between steps", between))
    if s["message"]:
        rows.append(("note", s["message"]))
    width = max(len(name) for name in [k for k, _ in rows] + list(s["settings"])) + 2
    lines = [f"{k:<{width}}{v}" for k, v in rows]
    lines.append("")
    # a value wider than its column keeps a space before its reason
    lines += [f"{name:<{width}}{setting(name, value):<10} {s['reasons'][name]}"
              for name, value in s["settings"].items()]
    return "\n".join(lines)


def _framework_name(resolved: dict) -> str:
    """The framework whose loop a watched run is, "" for any other run."""
    from .auto.frameworks import framework_of
    framework = framework_of(resolved)
    return framework.name if framework else ""
