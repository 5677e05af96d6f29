"""TrainConfig(report_to=...): a run's records sent to TensorBoard and MLflow, through
their own libraries (torch.utils.tensorboard.SummaryWriter; mlflow's MlflowClient).

    >>> nt.fit(model, data, loss_fn, config=nt.TrainConfig(report_to=("tensorboard", "mlflow")))
    $ tensorboard --logdir runs        # or: mlflow ui

Each record's numbers become scalars at its step (loss, lr, samples/s, step time, data
wait, MFU, memory, the validation loss); the config and the settings "auto" resolved,
with their reasons, become params (MLflow) and hparams and a text (TensorBoard); the
state at the end ends the MLflow run. As for the run store, the training thread only
appends to a queue: each tracker has a thread of its own, and the run's end waits for
it (an MLflow server far away is the run's cost only there). A tracker that fails
gives one warning and the run trains on.
"""
from __future__ import annotations

import collections
import importlib.util
import math
import os
import threading
import time
import warnings
from pathlib import Path
from typing import List, Optional

from ..config import ConfigError, TrainConfig, reporters
from ..run import Run

EXTRAS = {"tensorboard": ("tensorboard", "TensorBoard"), "mlflow": ("mlflow", "MLflow")}
NOT_SCALARS = ("step", "epoch", "samples", "steps", "interval_s", "time_s")
END_WAIT_S = 60.0   # the run's end waits this long for a tracker to send what it has
MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED"}   # the rest: KILLED


def check(cfg: TrainConfig) -> None:
    """A tracker whose library is missing: a ConfigError naming the extra, before the run."""
    for name in reporters(cfg):
        module, label = EXTRAS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"TrainConfig.report_to={cfg.report_to!r} sends the records to {label}, but "
                f"{module} is not installed: pip install 'nbtrain[{name}]' (or pip install "
                f"{module}), or leave {name} out of report_to.", field="report_to")


def attach(run: Run) -> List["Tracker"]:
    """Start the trackers `run.config.report_to` asks for; they subscribe to the run."""
    trackers = [Tracker(run, SINKS[name](run)) for name in reporters(run.config)]
    for tracker in trackers:
        run.subscribe(tracker)
    return trackers


def numbers(record: dict) -> dict:
    """The record's scalars: its finite numbers but the position and the counts."""
    return {key: float(value) for key, value in record.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            and key not in NOT_SCALARS and math.isfinite(value)}


def settings_of(run: Run) -> dict:
    """The config's fields and the resolved values ("used.amp"), as text or numbers."""
    out = {name: _plain(value) for name, value in run.config.to_dict().items()}
    resolved = dict(run.resolved)   # one copy: the training thread may be adding to it
    out.update({f"used.{name}": _plain(value) for name, (value, _) in resolved.items()})
    return out


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value if value is not None else "None"
    return str(value)


class Tracker:
    """A run's subscriber that hands each record to a sink's own thread."""

    def __init__(self, run: Run, sink):
        self.run, self.sink = run, sink
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._failed: Optional[str] = None
        self._warned = False
        self._thread = threading.Thread(target=self._main, name=f"nbtrain-{sink.name}",
                                        daemon=True)
        self._thread.start()

    def __call__(self, record: dict) -> None:
        if self._failed is None:
            self._queue.append(dict(record))
        if record["kind"] == "end":
            self._wake.set()
            self._thread.join(END_WAIT_S)
            if self._thread.is_alive() and self._failed is None:
                self._failed = f"it had not sent everything after {END_WAIT_S:.0f} s"
        if self._failed is not None and not self._warned:
            self._warned = True
            warnings.warn(f"nbtrain: report_to={self.sink.name!r}: {self._failed}; the run "
                          f"trained on without it.", RuntimeWarning, stacklevel=2)

    def _main(self) -> None:
        try:
            self.sink.start()
            while True:
                self._wake.wait(0.5)
                self._wake.clear()
                batch = []
                while self._queue:
                    batch.append(self._queue.popleft())
                ended = [r for r in batch if r["kind"] == "end"]
                self.sink.records([r for r in batch if r["kind"] != "end"])
                if ended:
                    self.sink.end(ended[-1])
                    return
        except Exception as exc:   # a tracker's failure must not reach the loop
            self._failed = f"{type(exc).__name__}: {exc}"
            self._queue.clear()
            try:
                self.sink.close()
            except Exception:
                pass


# -- the sinks: the libraries' own calls, in the tracker's thread ------------------------------------
class TensorBoardSink:
    """torch.utils.tensorboard.SummaryWriter: a log dir per run under report_dir."""
    name = "tensorboard"

    def __init__(self, run: Run):
        self.run = run
        self.log_dir = Path(run.config.report_dir) / (
            f"{run.name}-{run.id}" if run.name else str(run.id))
        self.writer = None

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def records(self, records: list) -> None:
        for record in records:
            kind, step = record["kind"], record.get("step", 0)
            for key, value in numbers(record).items():
                self.writer.add_scalar(f"{kind}/{key}", value, global_step=step)

    def end(self, record: dict) -> None:
        run = self.run
        reasons = "\n".join(f"| {name} | {value} | {why} |"
                            for name, (value, why) in run.resolved.items())
        self.writer.add_text("settings", "| setting | used | why |\n|---|---|---|\n" + reasons,
                             global_step=run.step)
        self.writer.add_text("state", f"{run.state}: {run.message}" if run.message else run.state,
                             global_step=run.step)
        train = run.records("train")
        final = {"hparam/final_loss": train[-1]["loss"]} if train else {}
        self.writer.add_hparams(settings_of(run), final, run_name=".", global_step=run.step)
        self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class MlflowSink:
    """mlflow.MlflowClient: a run in $MLFLOW_EXPERIMENT_NAME's experiment (else MLflow's
    default one) on the tracking URI MLflow finds ($MLFLOW_TRACKING_URI, else ./mlruns)."""
    name = "mlflow"
    BATCH = 1000   # log_batch takes at most 1000 metrics a call

    def __init__(self, run: Run):
        self.run = run
        self.client = self.run_id = None
        self.logged: set = set()   # params are written once: those already sent

    def start(self) -> None:
        from mlflow import MlflowClient
        self.client = MlflowClient()
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        experiment_id = "0"
        if experiment:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else \
                self.client.create_experiment(experiment)
        run = self.run
        self.run_id = self.client.create_run(
            experiment_id, run_name=run.name or run.id,
            tags={"nbtrain.id": str(run.id), "nbtrain.kind": run.kind}).info.run_id
        self._params(settings_of(run))

    def _params(self, values: dict) -> None:
        from mlflow.entities import Param
        new = [Param(key, str(value)[:500]) for key, value in values.items()
               if key not in self.logged]
        for i in range(0, len(new), 100):   # log_batch takes at most 100 params a call
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        self.logged.update(p.key for p in new)

    def records(self, records: list) -> None:
        from mlflow.entities import Metric
        metrics = []
        now = int(time.time() * 1000)
        for record in records:
            kind, step = record["kind"], int(record.get("step", 0))
            for key, value in numbers(record).items():
                name = key if kind == "train" or key.startswith(kind + "_") else f"{kind}_{key}"
                metrics.append(Metric(name, value, now, step))
        for i in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + self.BATCH])
        if records and len(self.logged) < len(settings_of(self.run)):
            self._params(settings_of(self.run))   # the settings "auto" resolved, once known

    def end(self, record: dict) -> None:
        run = self.run
        self._params(settings_of(run))
        self._params({f"why.{name}": why for name, (_, why) in run.resolved.items()})
        self.client.set_tag(self.run_id, "nbtrain.state", run.state)
        if run.message:
            self.client.set_tag(self.run_id, "nbtrain.message", run.message[:5000])
        self.client.set_terminated(self.run_id, status=MLFLOW_STATUS.get(run.state, "KILLED"))

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FAILED")


SINKS = {"tensorboard": TensorBoardSink, "mlflow": MlflowSink}
