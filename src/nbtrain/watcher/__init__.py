"""The own-loop engine: a training loop the user wrote, watched from outside and fed into
an ordinary Run, so every view of nbtrain works on it unchanged (entry.watch).

Its parts are objects the Watcher owns, each with its own state; what they share is the
step's edge (edge.py: the Tally of the step in progress, the Plan of what the watch may
change, and whether nbtrain's own code runs). Each one job: core.py (the wiring, the
backward, the model found, the end), forward.py (the model's forward), steps.py (what a
step is), loader.py (the DataLoader: data wait, epochs, batched fetch, workers), copies.py
(CUDA copies one batch ahead), autocast.py (autocast, channels_last), fp16.py (fp16's
loss scaling, only where fp16 may be in force), records.py (losses, records, host reads),
measure.py (the bf16 trial, the FLOP count and the peak, within the measuring budget),
settings.py (what a watch may set, and its Plan), data_parallel.py (one rank of N)."""
from .core import Watcher
from .edge import StopWatching
from .records import READS_COUNTED_FOR
from .settings import OWN_LOOP_FIELDS, own_loop_config, record_floor_s

__all__ = ["Watcher", "StopWatching", "READS_COUNTED_FOR", "OWN_LOOP_FIELDS",
           "own_loop_config", "record_floor_s"]
