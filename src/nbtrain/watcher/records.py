"""What a watch records: each loss the loop's backward runs on (kept on the device; on
the CPU, where a read is no sync, read at once), a record every `log_every` steps (with
the default, at least RECORD_EVERY_S and at most RECORDS_MERGED x log_every steps apart
from step READS_COUNTED_FOR on), and the loop's host reads (`.item()`, `.tolist()`,
`float()`, `int()`, `bool()`, `print` of the step's tensors, `.cpu()`, `.numpy()`)
counted over the first READS_COUNTED_FOR steps, each at the line of the user's code that
made it, for the diagnosis and `run.host_reads()`, then that rate standing."""
from __future__ import annotations

import linecache
import math
import os
import re
import sys
import time
import weakref
from collections import Counter, deque

import torch

from ..auto import frameworks
from ..train.emit import flush_interval, log_interval
from .settings import RECORDS_MERGED

_item = torch._C.TensorBase.item   # torch's own, under the watch's counting wrapper
# the host reads counted when the tensor has a graph, too (a CPU loss's loss.item()); the
# first five take no arguments, and the optimizers call item() on their CPU step counts
READS = ("item", "tolist", "__float__", "__int__", "__bool__")
SHOWN = ("__repr__", "__format__")   # print(loss), f"{loss}": torch's printing code reads
COPIES = ("cpu", "numpy")            # counted for a tensor on a device only
READS_COUNTED_FOR = 30   # steps; then the rate counted stands (_stop_counting_reads)
# the packages whose frames are not the user's code, as their modules' files name them: a
# read is the line of the first frame outside them (print(loss) reads in torch's printing)
NOT_YOURS = tuple(os.path.dirname(path) + os.sep for path in
                  (torch.__file__, os.path.dirname(os.path.dirname(__file__))))


class Records:
    """The watch's part that records: the losses, a record every `log_every` steps, the
    loop's host reads. It reads from the loader part whether the training loader collates
    tensors sample by sample (a count of the records)."""

    def __init__(self, edge, loader, record_floor_s: float):
        self.edge, self.loader = edge, loader
        self._host_reads = Counter()    # (file, line) -> the loop's host reads there, this interval
        self._read_patches = []         # undo the host-read counters (after READS_COUNTED_FOR)
        self._reads_counted = []        # (host reads by line, steps) of each interval so far
        self._reads_per_step = 0.0      # the rate they counted
        self._losses = deque(maxlen=8)  # weak references to recent losses (kept graphs)
        self._keeps_losses = False      # the loop keeps them (seen over READS_COUNTED_FOR steps)
        self._reads_at_once = None      # each loss read as a float: the first loss on the CPU
        self._loop_scaled = None        # (the loop's GradScaler's last output, that scaler)
        self._sums = ""                 # the framework whose step's loss is its micro-batches' sum
        self._log_every = edge.run.config.log_every
        self.record_at = self._log_every   # the interval's steps at the next record (record_due)
        self._record_floor_s = record_floor_s
        self._describe_log_every()

    def install(self) -> None:
        patch = self.edge.patches.patch
        self._read_patches = [patch(torch.Tensor, name, self._counting(name))
                              for name in (*READS, *SHOWN, *COPIES)]
        patch(torch.amp.GradScaler, "scale", self._noting_scale)

    # -- the loss -----------------------------------------------------------------------------
    def add_loss(self, loss: torch.Tensor, samples: int) -> None:
        if self._reads_at_once is None:   # the first loss's device says, for the whole watch:
            self._reads_at_once = loss.is_cpu   # an interval's losses are all floats or all tensors
        if self._loop_scaled is not None and self._loop_scaled[0]() is loss:
            value = loss.detach() / self._loop_scaled[1]._scale   # the loop's scaler's: unscaled
        else:
            value = loss
        if self._reads_at_once:   # the CPU: no sync, and cheaper than a stack at the record
            value = _item(value) if value.dim() == 0 else _item(value.detach().float().mean())
        else:
            value = value.detach()
            value = value if value.dim() == 0 else value.float().mean()
        self.edge.interval.add(value, samples)
        if self._read_patches:   # kept losses are looked for over the host reads' steps
            self._losses.append(weakref.ref(loss))

    def sum_micro_batches(self, framework: str) -> None:
        """The loop's framework scales each micro-batch's loss to its share of the step
        before its backward: a step's loss is their sum, as the framework logs it (said
        once a step of several micro-batches is recorded)."""
        self._sums = framework

    def _noting_scale(self, original):
        """GradScaler.scale, noting the scaled loss of a loop with its own scaler."""
        part, edge = self, self.edge

        def scale(scaler, outputs):
            scaled = original(scaler, outputs)
            if not edge.inside and isinstance(scaled, torch.Tensor) and scaled is not outputs:
                part._loop_scaled = (weakref.ref(scaled), scaler)
            return scaled
        scale.__wrapped__ = original
        return scale

    # -- records ------------------------------------------------------------------------------
    def _describe_log_every(self) -> None:
        every = self._log_every
        why = f"asked for: a record every {every} step(s)" if not self._record_floor_s \
            else (f"a record every {every} steps, at least {self._record_floor_s * 1e3:.0f} ms and "
                  f"at most {every * RECORDS_MERGED} steps apart (from step {READS_COUNTED_FOR}): "
                  f"a record costs the loop ~50 us; nt.watch(log_every={every}) records "
                  f"exactly every {every}")
        self.edge.run.resolved["log_every"] = (every, why)

    def record_due(self) -> None:
        """log_every more steps: a record, or, where the default's records would come closer
        together than RECORD_EVERY_S, a look again after log_every more. While host reads
        are counted, a record every log_every steps (log counts them per record). Losses
        read at once (the CPU) are looked at each time: a non-finite one is recorded now,
        so that on_nan='stop' ends the loop as soon as without the floor."""
        interval = self.edge.interval
        if self._read_patches or not self._record_floor_s or \
                interval.steps >= self._log_every * RECORDS_MERGED or \
                time.perf_counter() - interval.t0 >= self._record_floor_s:
            self.log()
        elif self._reads_at_once and not math.isfinite(sum(interval.losses)):
            self.log(flush=True)   # its record now, not at the next close
        else:
            self.record_at += self._log_every
            return
        self.record_at = self._log_every

    def log(self, flush: bool = False, lr=None, at=None) -> None:
        """Close the interval with the loop's counts since the last record (counted here,
        not per step: each call in a step is time the loop waits for); `flush`: emit its
        record now (Interval.close emits the one before); `lr`, `at`: see last()."""
        edge = self.edge
        interval, run = edge.interval, edge.run
        if self._sums and not interval.sums and interval.micro > interval.steps:
            interval.sum_micro_batches()
            run.resolved["step_loss"] = ("the sum of its micro-batches'", (
                f"{self._sums} scales each micro-batch's loss to its share of the step before "
                "backward() (by the accumulation count, or by its share of the step's "
                "tokens): their sum is the step's loss, as it logs it"))
        if self._read_patches:
            reads = sum(self._host_reads.values())
            self._reads_counted.append((self._host_reads, interval.steps))
            self._host_reads = Counter()
            # a loss still alive two losses later: the loop keeps them, and with them their
            # graphs (the last one's step may be held until the next: skorch's last result)
            self._keeps_losses = any((t := ref()) is not None and t.requires_grad
                                     for ref in list(self._losses)[:-2])
            if run.step >= READS_COUNTED_FOR:
                self._stop_counting_reads()
        else:
            reads = self._reads_per_step * interval.steps
        interval.count("host_reads", reads)
        if self.loader.collates_tensors:   # every sample of the training loader's batches
            interval.count("collated_samples", interval.samples)
        interval.count("kept_losses", interval.steps * self._keeps_losses)
        with edge.own:   # the record's reads of the losses are not the loop's
            log_interval(run, interval, _lr(run.optimizer) if lr is None else float(lr), at)
            if flush:
                flush_interval(run, interval)

    def last(self, lr, ended_at) -> None:
        """The watch's last records. They end at the last step's end (`ended_at`): what the
        loop did after it (a sampling, a plot, a last evaluation) is no step's time, and
        run.gaps() has it. The lr is the one that step ran with (`lr`): a scheduler may
        have stepped after it."""
        interval = self.edge.interval
        if interval.steps:
            self.log(lr=lr, at=ended_at)
        elif self._read_patches:   # the last step ended a record: its reads after it are its
            interval.count_in_last("host_reads", sum(self._host_reads.values()))
        self.flush(until=ended_at)

    def flush(self, until=None) -> None:
        """The last record; a loop shorter than READS_COUNTED_FOR steps: its table of host
        reads, from the steps it made, those after its last step counted as that step's (a
        loop reads its loss after optimizer.step())."""
        if self._read_patches:
            if self._reads_counted:
                self._reads_counted[-1][0].update(self._host_reads)
            self._stop_counting_reads()
        flush_interval(self.edge.run, self.edge.interval, until)

    # -- host reads ---------------------------------------------------------------------------
    def _counting(self, name: str):
        """A wrapper that counts a host read of a tensor on a device, or (READS, SHOWN) of
        one computed with gradients: the loop's loss.item(), not a CPU index's."""
        part, edge = self, self.edge

        def wrap(original):
            if name in READS:   # no arguments: the optimizers' item() runs often
                def read(tensor):
                    if (tensor.requires_grad or not tensor.is_cpu) and not edge.inside:
                        return part._read_at_your_line(original, tensor)
                    return original(tensor)
                return read
            grad_counts = name in SHOWN

            def read_to(tensor, *args, **kwargs):
                if (grad_counts and tensor.requires_grad or not tensor.is_cpu) \
                        and not edge.inside:
                    return part._read_at_your_line(original, tensor, *args, **kwargs)
                return original(tensor, *args, **kwargs)
            return read_to
        return wrap

    def _read_at_your_line(self, original, tensor, *args, **kwargs):
        """One host read of the loop's, counted at the line of the user's code that made it;
        what the read itself reads (print's tolist(), its .cpu() of a GPU tensor) is part of
        it, not counted again."""
        self._host_reads[_your_line(sys._getframe(2))] += 1
        with self.edge.own:
            return original(tensor, *args, **kwargs)

    def _stop_counting_reads(self) -> None:
        """Host reads counted over the first READS_COUNTED_FOR steps: a loop reads in the
        same places every step, and each counted read is a Python call on the way to one
        of torch's C methods (the optimizers call item() on their step counts). From here
        the records carry the rate counted, and the methods are torch's own again."""
        # from the second interval on: a read after a step falls in the interval after it,
        # so the first interval is one read short
        intervals = self._reads_counted[1:] or self._reads_counted
        lines, steps = Counter(), sum(n for _, n in intervals)
        for counted, _ in intervals:
            lines.update(counted)
        self._reads_per_step = sum(lines.values()) / max(steps, 1)
        for undo in self._read_patches:
            undo()
        self._read_patches = []
        self._losses.clear()
        self._emit_host_reads(lines, steps)

    def _emit_host_reads(self, lines: Counter, steps: int) -> None:
        """The table of run.host_reads(), as a record the run store keeps (nt.load_run):
        a row per line, the most reads a step first (JSON's types, so that a loaded
        history equals the live one)."""
        rows = [{"where": _where(file, line), "code": linecache.getline(file, line).strip(),
                 "per_step": reads / max(steps, 1)}
                for (file, line), reads in lines.most_common()]
        self.edge.run.emit({"kind": "host_reads", "step": self.edge.run.step, "steps": steps,
                            "per_step": self._reads_per_step, "rows": rows})


def _your_line(frame) -> tuple:
    """(file, line) of the first frame outside torch and nbtrain (NOT_YOURS): the line of
    the user's code that read; a read with no such frame is ("", 0)."""
    while frame is not None and frame.f_code.co_filename.startswith(NOT_YOURS):
        frame = frame.f_back
    return ("", 0) if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def _where(file: str, line: int) -> str:
    """"file:line", or for a notebook's cell "cell 3, line 5", as IPython's tracebacks name
    it (its In[3]); IPython is asked only where it is loaded already. A framework's file
    is named from its package, as its own code ("skorch/net.py:1277, skorch's own code")."""
    if not file:
        return "(no frame of yours)"
    theirs = frameworks.in_its_code(file, line)
    if theirs is not None:
        return theirs
    shell = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
    cell = getattr(getattr(shell, "compile", None), "_filename_map", {}).get(file)
    if cell is None:   # the name IPython gives a cell without a kernel: <ipython-input-3-...>
        numbered = re.match(r"<ipython-input-(\d+)-", file)
        cell = numbered and int(numbered.group(1))
    return f"cell {cell}, line {line}" if cell is not None else f"{file}:{line}"


def _lr(optimizer) -> float:
    """A float (fastai's hyper-parameters are numpy's), NaN without an optimizer."""
    return float(optimizer.param_groups[0]["lr"]) if optimizer is not None else float("nan")
