"""The own-loop engine: a training loop the user wrote, watched from outside and fed into
an ordinary Run, so every view of nbtrain works on it unchanged (entry.watch).

Its parts are objects the Watcher owns, each with its own state; what they share is the
step's edge (edge.py: the backward calls, batches and samples since the last step, and
whether nbtrain's own code runs). Each one job: core.py (the hooks, the model, the backward, the end), steps.py
(what a step is), loader.py (the DataLoader: data wait, epochs, batched fetch, workers),
copies.py (CUDA copies one batch ahead), precision.py (autocast, fp16's scaler, clip),
records.py (losses, records, host reads), measure.py (the bf16 trial, the FLOP count and
the peak, within the measuring budget), settings.py (what a watch may set)."""
from .core import Watcher
from .edge import StopWatching
from .records import READS_COUNTED_FOR
from .settings import OWN_LOOP_FIELDS, own_loop_config, record_floor_s

__all__ = ["Watcher", "StopWatching", "READS_COUNTED_FOR", "OWN_LOOP_FIELDS",
           "own_loop_config", "record_floor_s"]
