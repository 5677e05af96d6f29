"""Which leaf module takes the step, and what makes the memory peak (run.modules(),
run.peak()): measured over a window of a few steps, then every hook removed. Both engines
use it: nt.fit opens one window at a fixed early step, a watch where the measuring budget
affords it (watcher/modules.py).

What a window measures, on the model's leaf modules (named as `named_modules()` names
them; a model without submodules is one leaf, ""):

- forward: torch's global forward pre/post hooks time each leaf's call (perf_counter on a
  CPU; on CUDA a pair of events, read with one sync as the window closes: that path is
  not tested on a CPU machine). A module called twice a step has its calls summed and
  counted; a leaf called inside another leaf's forward counts in that one's. Ops of a
  parent's own forward (a residual's add) are in no row.
- backward: as each leaf's forward ends, a pre-hook on its output's grad_fn stamps when
  the gradient of that output arrives; the time between consecutive stamps is the
  module's whose stamp opened it, the last closing at the backward's end (an autograd
  callback). So a row's backward is its own node's and those of the functional ops
  between it and the leaf before it, which the forward counts in no row. A module whose
  output feeds several others is stamped once, when all their gradients are in; a
  module adding no node of its own (nn.Identity, a frozen embedding) has none. No full
  backward hook is used: it would wrap outputs and break in-place ops after them.
  Activation checkpointing recomputes forwards inside the backward: those are not
  counted as forwards, and their time lands in the backward of the segment's modules.
- the peak (the end of the forward, before the backward): each leaf's activations saved
  for backward (a saved_tensors_hooks pack hook that returns the very tensor it gets and
  records its nbytes, each storage once, for the leaf running), the parameters, the
  gradients as the last backward left them, the optimizer's state. On CUDA the
  allocator's `memory_allocated` at the forward's end gives `bytes` and "other" the rest
  (untested here); on a CPU `bytes` is the parts' sum and "other" 0.

Nothing of the loop's changes: no tensor is replaced, no RNG drawn, the model's own hook
dicts untouched (global hooks and tensor hooks only).
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import List, NamedTuple, Optional

import torch
from torch.nn.modules import module as nn_module

from ..tables import Table
from . import WINDOW_STEPS, not_measured

FIT_AT_STEP = 20      # nt.fit's window: after the first steps' warm-up ...
FIT_MIN_STEPS = 100   # ... in a run long enough that 3 slower steps are a small share of it
TOP = 5               # rows a summary keeps
_engine = torch.autograd.Variable._execution_engine
_current_node = torch._C._current_autograd_node


class ModuleTime(NamedTuple):
    """A leaf module's time a step, over the window."""
    name: str           # as named_modules() names it: "0", "blocks.3.attn.proj"; "" the model
    forward_s: float
    backward_s: float
    share: float        # of the step's module time (forward and backward, all leaves)
    calls: float        # its forward calls a step


class PeakPart(NamedTuple):
    part: str    # a leaf module's name (its activations saved for backward), or a kind
    kind: str    # "activations", "parameters", "gradients", "optimizer state", "other"
    bytes: int


class Peak(NamedTuple):
    """run.peak(): the bytes at the step's peak and the parts that make them."""
    bytes: int
    parts: Table

    def __repr__(self) -> str:
        return f"peak {_mb(self.bytes)}\n{self.parts!r}"


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MB"


# -- reading a kept record back (Run.modules, Run.peak, the summary) ----------------------
def why_none(run) -> str:
    """Why a run has no window's record: nt.fit's runs keep none unless timed (its
    history's fields stay plain numbers); a watch's says why at its end."""
    if run.kind != "fit":
        return "not measured yet" if run.state == "running" else \
            "not measured: the watch saw no model train"
    when = (f"nt.fit times its modules over steps {FIT_AT_STEP + 1}-"
            f"{FIT_AT_STEP + WINDOW_STEPS} of a run of {FIT_MIN_STEPS} steps or more")
    if run.config.compile:
        return "not measured: a torch.compile'd model (its leaves run inside its graph)"
    if run.state == "running" and run.step <= FIT_AT_STEP:
        return f"not measured yet: {when}"
    return f"not measured: the run made {run.step} steps; {when}"


def module_table(record: Optional[dict], why_none: str) -> Table:
    """The rows of a "modules" record, largest share first; its note, or `why_none`."""
    if record is None:
        return Table([], why_none)
    rows = [ModuleTime(**row) for row in record.get("rows", [])]
    return Table(rows, record["note"], ModuleTime._fields)


def peak_of(record: Optional[dict], why_none: str) -> Peak:
    peak = (record or {}).get("peak")
    if not peak:
        return Peak(0, Table([], (record or {}).get("note", why_none)))
    parts = [PeakPart(**part) for part in peak["parts"]]
    first = record["step"] - record["steps"] + 1
    note = (f"at the end of the forward, the largest of steps {first}-{record['step']}; "
            f"{peak['how']}")
    return Peak(peak["bytes"], Table(parts, note, PeakPart._fields))


def summary_entries(record: Optional[dict]) -> dict:
    """What run.summary() says of a measured window: the top rows of each."""
    if not record or not record.get("rows"):
        return {}
    peak = record["peak"]
    return {"modules": record["rows"][:TOP],
            "peak": {"bytes": peak["bytes"], "parts": peak["parts"][:TOP]}}


# -- the window ----------------------------------------------------------------------------
class _HostClock:
    def mark(self):
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        return end - start

    def settle(self) -> None:
        pass


class _CudaClock:
    """Events on the current stream, read once the window closes (one sync then)."""

    def __init__(self, device):
        self.device = device

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)


class ModuleWindow:
    """The hooks of one window over `model`'s leaves: open(), a step_done() per step (True
    when the window is full), close() on every way out (idempotent), then record()."""

    def __init__(self, model: torch.nn.Module, device, optimizer=None, steps: int = WINDOW_STEPS):
        self.root, self.optimizer, self.steps = model, optimizer, steps
        self.leaves = {id(m): name for name, m in model.named_modules()
                       if next(m.children(), None) is None}
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._param_ptrs = {_ptr(p) for p in self.params}
        cuda = torch.device(device).type == "cuda"
        self.clock = _CudaClock(device) if cuda else _HostClock()
        self.device = torch.device(device) if cuda else None
        self.done = 0               # steps timed so far
        self.calls = defaultdict(int)
        self._forwards = []         # (name, start mark, end mark) of each outermost leaf call
        self._stamps = []           # (mark, name; None at a backward's end), as they fire
        self._running = None        # (leaf id, name, start mark) of the leaf in its forward
        self._root_depth = 0        # the root's forwards running (with gradients)
        self._claimed = []          # grad_fn nodes stamped this step (kept: ids stay unique)
        self._claimed_ids = set()
        self._node_hooks = []
        self._in_backward = False
        self._saving = None         # the saved_tensors_hooks of the root forward running
        self._saved = defaultdict(int)   # leaf name -> bytes saved for backward, this forward
        self._seen = set()
        self.activations, self.allocated, self.gradients = {}, 0, 0
        self._handles = []

    # -- open and close ---------------------------------------------------------------------
    def open(self) -> None:
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._pre),
            nn_module.register_module_forward_hook(self._post, always_call=True)]

    def close(self) -> None:
        """Every hook removed (the forward's, the nodes', the saved tensors'), whatever
        state the loop left them in."""
        for handle in self._handles + self._node_hooks:
            handle.remove()
        self._handles, self._node_hooks = [], []
        self._claimed, self._claimed_ids = [], set()
        self._end_saving()

    def step_done(self) -> bool:
        self.done += 1
        self._claimed, self._claimed_ids = [], set()   # this step's graph is consumed
        return self.done >= self.steps

    # -- the forward hooks --------------------------------------------------------------------
    def _pre(self, module, args) -> None:
        if _current_node() is not None:   # a checkpoint's recompute inside the backward
            return
        key = id(module)
        if module is self.root and torch.is_grad_enabled():
            self._root_depth += 1
            if self._root_depth == 1:
                self._start_saving()
        if key in self.leaves and self._root_depth and self._running is None:
            self._running = (key, self.leaves[key], self.clock.mark())

    def _post(self, module, args, output) -> None:
        if _current_node() is not None:
            return
        running, key = self._running, id(module)
        if running is not None and running[0] == key:
            self._running = None
            name = running[1]
            self._forwards.append((name, running[2], self.clock.mark()))
            self.calls[name] += 1
            self._stamp_gradient_of(output, name)
        if module is self.root and self._root_depth:
            self._root_depth -= 1
            if not self._root_depth:
                self._forward_ended()

    # -- the backward stamps -------------------------------------------------------------------
    def _stamp_gradient_of(self, output, name: str) -> None:
        """A pre-hook on each grad_fn of the output not already a leaf's (an nn.Identity's
        output is the module's before it): its backward starts when that node runs."""
        for tensor in _tensors(output):
            node = tensor.grad_fn
            if node is None or id(node) in self._claimed_ids:
                continue
            self._claimed.append(node)
            self._claimed_ids.add(id(node))
            self._node_hooks.append(node.register_prehook(self._stamper(name)))

    def _stamper(self, name: str):
        def stamp(grad_outputs):
            if not self._in_backward:   # the backward's end closes its last interval
                self._in_backward = True
                _engine.queue_callback(self._backward_ended)
            self._stamps.append((self.clock.mark(), name))
        return stamp

    def _backward_ended(self) -> None:
        self._in_backward = False
        self._stamps.append((self.clock.mark(), None))
        self.gradients = max(self.gradients, sum(
            p.grad.nbytes for p in self.params if p.grad is not None))

    # -- the saved activations ---------------------------------------------------------------
    def _start_saving(self) -> None:
        self._saved, self._seen = defaultdict(int), set()
        try:
            saving = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            saving.__enter__()
        except RuntimeError:   # disabled here (torch.func): the peak is not measured
            return
        self._saving = saving

    def _end_saving(self) -> None:
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.__exit__(None, None, None)

    def _pack(self, tensor):
        """The very tensor back: only its bytes are recorded, each storage once, for the
        leaf running (outside any leaf: a parent's own ops)."""
        try:
            ptr = _ptr(tensor)
        except Exception:   # a tensor without storage (sparse, a subclass): not counted
            return tensor
        if ptr not in self._seen and ptr not in self._param_ptrs:
            self._seen.add(ptr)
            name = self._running[1] if self._running is not None else None
            self._saved[name] += tensor.nbytes
        return tensor

    def _forward_ended(self) -> None:
        """The peak: the largest forward's saved tensors, and on CUDA the allocator's."""
        self._end_saving()
        if sum(self._saved.values()) > sum(self.activations.values()):
            self.activations = dict(self._saved)
        if self.device is not None:
            self.allocated = max(self.allocated, torch.cuda.memory_allocated(self.device))

    # -- what it measured ----------------------------------------------------------------------
    def record(self, step: int) -> dict:
        """The "modules" record of a full window ending at `step` (hooks closed first)."""
        self.close()
        self.clock.settle()
        forward, backward = defaultdict(float), defaultdict(float)
        for name, start, end in self._forwards:
            forward[name] += self.clock.seconds(start, end)
        for (mark, name), (after, _) in zip(self._stamps, self._stamps[1:]):
            if name is not None:
                backward[name] += self.clock.seconds(mark, after)
        total = sum(forward.values()) + sum(backward.values()) or 1e-12
        n = max(self.done, 1)
        rows = [{"name": name, "forward_s": forward[name] / n, "backward_s": backward[name] / n,
                 "share": (forward[name] + backward[name]) / total, "calls": self.calls[name] / n}
                for name in self.leaves.values() if name in self.calls]
        rows.sort(key=lambda row: -row["share"])
        note = (f"over steps {step - self.done + 1}-{step}, a step's mean (backward: from the "
                "arrival of each output's gradient to the next)")
        return {"kind": "modules", "step": step, "steps": self.done, "rows": rows,
                "note": note, "peak": self._peak()}

    def _peak(self) -> dict:
        parts = [(name, "activations", b) for name, b in self.activations.items()
                 if name is not None and b]
        outside = self.activations.get(None, 0)
        if outside:
            parts.append(("activations outside leaves", "activations", outside))
        parts += [("parameters", "parameters", sum(p.nbytes for p in self.params)),
                  ("gradients", "gradients", self.gradients),
                  ("optimizer state", "optimizer state", _state_bytes(self.optimizer))]
        known = sum(b for _, _, b in parts)
        if self.device is not None:
            total = max(self.allocated, known)
            how = "bytes: the CUDA allocator's at the forward's end"
        else:
            total, how = known, "bytes: the parts' sum (other: not measured on a CPU)"
        parts.append(("other", "other", total - known))
        parts.sort(key=lambda p: -p[2])
        return {"bytes": total, "how": how,
                "parts": [{"part": p, "kind": k, "bytes": b} for p, k, b in parts]}


def _unpack(tensor):
    return tensor


def _ptr(tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _tensors(output):
    """The tensors of a module's output: a tensor, or those of a tuple, list or dict."""
    if isinstance(output, torch.Tensor):
        return (output,)
    values = output.values() if isinstance(output, dict) else \
        output if isinstance(output, (tuple, list)) else ()
    return [v for v in values if isinstance(v, torch.Tensor)]


def _state_bytes(optimizer) -> int:
    """The optimizer's state tensors, each storage once."""
    if optimizer is None:
        return 0
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and _ptr(value) not in seen:
                seen.add(_ptr(value))
                total += value.nbytes
    return total


class FitWindow:
    """nt.fit's one window: steps FIT_AT_STEP+1.. of a run of at least FIT_MIN_STEPS; a
    context around the loop, so that whatever ends it removes the hooks. The loop calls
    `before(step)` and `after(step)` each step (an int compared, outside the window)."""

    def __init__(self, run):
        self.run, self.window = run, None
        long_enough = (run.total_steps or 0) >= FIT_MIN_STEPS
        # a compiled model's leaves run inside its graph, where no hook sees them
        due = long_enough and run.step <= FIT_AT_STEP and not run.config.compile
        self.at = FIT_AT_STEP if due else None

    def before(self, step: int) -> None:
        if step == self.at:
            self.window = ModuleWindow(self.run.model, next(self.run.model.parameters()).device,
                                       self.run.optimizer)
            self.window.open()

    def after(self, step: int) -> None:
        if self.window is not None and self.window.step_done():
            window, self.window, self.at = self.window, None, None
            self.run.emit(window.record(step))

    def __enter__(self) -> "FitWindow":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        window, self.window = self.window, None
        if window is not None:
            window.close()
            why = f"{kind.__name__} in step {self.run.step + 1}" if kind is not None else \
                f"the run ended at step {self.run.step}"
            self.run.emit(not_measured(self.run.step, f"{why}, inside the window: its "
                                       f"{window.done} step(s) discarded"))
