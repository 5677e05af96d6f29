"""profile(): where a step's time goes, operator by operator (torch.profiler).

MFU (flops.py) says how far a run is from the hardware; the profile says why: the
operators that take the time, and the share of it in matmuls and convolutions (the work
MFU counts), elementwise ops, data movement, and the rest (Python, autograd, launches).

The run is `fit` itself, with the given settings: the profiler records `steps` steps
after `warmup` of them (plus the profiler's own warm-up step), told where each step
starts by the LR schedule, which the loop asks once per step. Nothing in the loop knows
it is being profiled.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections import Counter
from typing import Callable, List, NamedTuple, Optional

import torch

from ..config import as_config
from ..entry import fit, trials, without_validation
from ..tables import formatted, html_table, text_table
from ..views.display import display_with_figure
from .models import fresh_model

MATMUL, ELEMENTWISE, MOVEMENT, OTHER = "matmul/conv", "elementwise", "data movement", "other"
CATEGORIES = (MATMUL, ELEMENTWISE, MOVEMENT, OTHER)
_MATMUL_WORDS = ("mm", "matmul", "linear", "conv", "attention", "gemm", "einsum", "baddbmm")
_MOVEMENT = {"copy_", "to", "_to_copy", "contiguous", "clone", "cat", "stack", "index",
             "index_select", "gather", "scatter", "scatter_add_", "embedding", "pin_memory",
             "_pin_memory", "transpose", "t", "permute", "view", "reshape", "expand", "slice",
             "select", "narrow", "empty", "empty_like", "zeros", "zeros_like", "fill_", "zero_",
             "memcpy", "memset", "unsqueeze", "squeeze", "flatten", "as_strided", "detach",
             "resize_", "set_", "_unsafe_view", "split", "chunk", "unbind", "item",
             "_local_scalar_dense", "stride", "lift_fresh", "new_empty", "empty_strided"}


def category(name: str) -> str:
    """Which kind of work an operator is, from its name (aten::addmm -> matmul/conv)."""
    if not name.startswith("aten::"):
        low = name.lower()   # a CUDA kernel, or Python, autograd and profiler frames
        if any(word in low for word in ("gemm", "conv", "cutlass", "flash")):
            return MATMUL
        return MOVEMENT if "memcpy" in low or "memset" in low else OTHER
    base = name[len("aten::"):]
    if base in _MOVEMENT:
        return MOVEMENT
    if any(word in base for word in _MATMUL_WORDS):
        return MATMUL
    return ELEMENTWISE


class Profile:
    """The result of `nt.profile`: operators by self time, shares by kind, trace files."""

    def __init__(self, run, operators: List[dict], trace_path: str, steps: int,
                 memory_snapshot: Optional[str] = None, top: int = 15):
        self.run, self.operators, self.trace_path = run, operators, trace_path
        self.steps, self.memory_snapshot, self.top = steps, memory_snapshot, top
        total = sum(op["self_ms"] for op in operators) or 1.0
        self.shares = {kind: sum(op["self_ms"] for op in operators if op["category"] == kind)
                       / total for kind in CATEGORIES}
        self.step_ms = total / steps

    COLUMNS = [("operator", "name"), ("kind", "category"), ("calls", "calls"),
               ("self ms / step", "ms_per_step"), ("share", "share_text")]

    def rows(self) -> List[dict]:
        return [{**op, "ms_per_step": op["self_ms"] / self.steps,
                 "share_text": formatted(op["share"], ".1%")} for op in self.operators[:self.top]]

    def shares_text(self) -> str:
        return ", ".join(f"{kind} {share:.0%}" for kind, share in self.shares.items())

    def notes(self) -> List[str]:
        lines = [f"trace (open in https://ui.perfetto.dev or chrome://tracing): {self.trace_path}"]
        if self.memory_snapshot:
            lines.append(f"memory snapshot (drag onto https://pytorch.org/memory_viz): "
                         f"{self.memory_snapshot}")
        return lines

    def __repr__(self) -> str:
        head = (f"{self.steps} profiled steps on {self.run.resolved['device'][0]}, "
                f"{self.step_ms:.3g} ms of operator self time per step: {self.shares_text()}")
        return "\n".join([head, "", text_table(self.COLUMNS, self.rows()), ""] + self.notes())

    def _repr_html_(self) -> str:
        import html
        notes = "".join(f"<p>{html.escape(line)}</p>" for line in self.notes())
        return (f"<p>{self.steps} profiled steps, {self.step_ms:.3g} ms of operator self time "
                f"per step: {html.escape(self.shares_text())}</p>"
                + html_table(self.COLUMNS, self.rows()) + notes)

    def figure(self):
        """The top operators' self time per step, coloured by kind (Plotly)."""
        import plotly.graph_objects as go
        rows = self.rows()[::-1]   # the largest at the top of a horizontal bar chart
        fig = go.Figure()
        for kind in CATEGORIES:
            mine = [r for r in rows if r["category"] == kind]
            if mine:
                fig.add_trace(go.Bar(x=[r["ms_per_step"] for r in mine],
                                     y=[r["name"] for r in mine], orientation="h", name=kind))
        fig.update_layout(title="self time per step by operator", xaxis_title="ms per step",
                          height=max(300, 22 * len(rows) + 120), barmode="stack",
                          yaxis={"categoryorder": "array", "categoryarray": [r["name"] for r in rows]})
        return fig

    def _ipython_display_(self) -> None:
        display_with_figure(self, self.figure)


class _StepMarks:
    """The run's Schedule, telling the profiler where each step starts: the loop asks the
    LR once at the start of every step (see loop._step)."""

    def __init__(self, schedule, prof):
        self.schedule, self.prof = schedule, prof

    def lr(self, step: int) -> float:
        if step:   # the profiler's step 0 began when it started
            self.prof.step()
        return self.schedule.lr(step)

    def __getattr__(self, name):
        return getattr(self.schedule, name)


def profile(make_model, train_data, loss_fn: Optional[Callable] = None, *, config=None,
            steps: int = 10, warmup: int = 5, folder: Optional[str] = None,
            top: int = 15) -> Profile:
    """Train `steps` steps under torch.profiler after `warmup` steps, with `config`'s settings.

    >>> prof = nt.profile(make_cnn, dataset, F.cross_entropy, config=cfg, steps=10)
    >>> prof                     # top operators, the share of matmul/elementwise/movement
    >>> prof.trace_path          # a Chrome/Perfetto trace of the profiled steps

    `make_model`: a function returning the model, or a model (deep-copied: yours is left
    untouched). Files go to `folder` (default: a new temporary folder). On CUDA a memory
    snapshot of the run is written too (`prof.memory_snapshot`).
    """
    from torch.profiler import ProfilerActivity, schedule
    from torch.profiler import profile as torch_profile
    if steps < 1 or warmup < 0:
        raise ValueError(f"profile needs steps >= 1 and warmup >= 0; got steps={steps}, "
                         f"warmup={warmup}.")
    # warmup steps, the profiler's own warm-up step, then the recorded ones
    cfg = without_validation(as_config(config)).replace(max_steps=warmup + 1 + steps)
    folder = folder or tempfile.mkdtemp(prefix="nbtrain-profile-")
    os.makedirs(folder, exist_ok=True)
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    snapshot = os.path.join(folder, "memory_snapshot.pickle") if cuda else None
    with _memory_history(snapshot), torch_profile(
            activities=activities, schedule=schedule(wait=warmup, warmup=1, active=steps)) as prof:
        with trials("profile"):
            run = fit(fresh_model(make_model), train_data, loss_fn, config=cfg, progress=False,
                      schedule=lambda s: _StepMarks(s, prof))
    trace = os.path.join(folder, "trace.json")
    prof.export_chrome_trace(trace)
    return Profile(run, operators(prof, on_device=cuda), trace, steps, snapshot, top)


def operators(prof, on_device: bool) -> List[dict]:
    """Every operator with its self time, largest first. On CUDA the time is the device's
    (the kernels each aten op launched itself); on CPU the host's, including Python,
    autograd and profiler frames (their self time is the loop's overhead)."""
    rows = []
    for event in prof.key_averages():
        if on_device:
            if not event.key.startswith("aten::"):
                continue   # kernels are already counted under the aten op that launched them
            us = getattr(event, "self_device_time_total", None)
            us = us if us is not None else event.self_cuda_time_total
        else:
            us = event.self_cpu_time_total
        if us > 0:
            rows.append({"name": event.key, "category": category(event.key),
                         "calls": event.count, "self_ms": us / 1000.0})
    rows.sort(key=lambda r: -r["self_ms"])
    total = sum(r["self_ms"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["self_ms"] / total
    return rows


@contextlib.contextmanager
def _memory_history(path: Optional[str]):
    """Record every CUDA allocation with its stack while the block runs, then write the
    snapshot to `path` (None: nothing recorded)."""
    if path is None:
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)


# -- host syncs on CUDA ------------------------------------------------------------------------
def _is_sync(caught) -> bool:
    """A warning of torch.cuda.set_sync_debug_mode("warn"): c10's warn_or_error_on_sync
    says "called a synchronizing CUDA operation"."""
    return "synchroniz" in str(caught.message)


def host_syncs(fn: Callable[[], object]) -> int:
    """How many CUDA calls in `fn()` made the host wait for the GPU (a `.item()`, a copy to
    the host, ...): torch.cuda.set_sync_debug_mode("warn") warns at each (c10's
    warn_or_error_on_sync). CUDA only."""
    import warnings
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum(_is_sync(w) for w in caught)


class StepSyncs(NamedTuple):
    """The host syncs of one run's steps (`step_syncs`)."""
    per_step: float
    steps: int          # the steps counted
    sources: Counter    # (filename, lineno) of the Python line each sync came from -> how many


class _SyncWindow:
    """set_sync_debug_mode("warn") from step `first`'s end (0: the run's start) to step
    `last`'s end, of the first Run seen; notes where in `caught` that span begins and ends."""

    def __init__(self, first: int, last: int, caught: list):
        self.first, self.last, self.caught = first, last, caught
        self.run = self.begin = self.end = None

    def at_boundary(self, run) -> None:
        """Called as a run starts and after each of its steps."""
        if self.run is None:
            self.run = run
        if run is not self.run or self.end is not None:
            return
        if self.begin is None and run.step == self.first:
            self.begin = len(self.caught)
            torch.cuda.set_sync_debug_mode("warn")
        elif self.begin is not None and run.step >= self.last:
            self.close()

    def close(self) -> None:
        """Back to the default mode: at the last step's end, or where the run ended."""
        if self.begin is not None and self.end is None:
            torch.cuda.set_sync_debug_mode("default")
            self.end = len(self.caught)


@contextlib.contextmanager
def _step_boundaries(call: Callable[[object], None]):
    """`call(run)` as any Run starts and after each step it counts (Run.advance: fit's loop
    and the watch's steps alike), while the block runs; Run's own methods put back after."""
    from ..run import Run
    start, advance = Run.start, Run.advance

    def started(self, *args, **kwargs):
        call(self)   # before a background fit's thread can take its first step
        start(self, *args, **kwargs)

    def advanced(self, *args, **kwargs):
        advance(self, *args, **kwargs)
        call(self)
    Run.start, Run.advance = started, advanced
    try:
        yield
    finally:
        Run.start, Run.advance = start, advance


def step_syncs(train: Callable[[int], Callable[[], object]], steps: int = 40,
               warmup: int = 0) -> StepSyncs:
    """The host syncs of one run's steps alone, and where they come from: `train(steps)`
    gives a call that trains (nt.fit or a loop under nt.watch) `steps` steps; the syncs are
    counted from the end of step `warmup` (0: the first step's start, after the setup) to
    the end of the last step, so the setup's and the end's are not. A run that ends before
    its last step is an AssertionError, not a figure divided by steps that never ran."""
    import warnings
    if not 0 <= warmup < steps:
        raise ValueError(f"step_syncs needs 0 <= warmup < steps; got {warmup}, {steps}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        window = _SyncWindow(warmup, steps, caught)
        try:
            with _step_boundaries(window.at_boundary):
                train(steps)()
        finally:
            window.close()
    done = window.run.step if window.run is not None else 0
    if window.end is None or done != steps:
        raise AssertionError(f"the run did {done} of its {steps} steps: no syncs per step")
    syncs = [w for w in caught[window.begin:window.end] if _is_sync(w)]
    return StepSyncs(len(syncs) / (steps - warmup), steps - warmup,
                     Counter((w.filename, w.lineno) for w in syncs))


def sources_text(sources: Counter, top: int = 5) -> str:
    """The lines the most syncs came from: "torch/amp/grad_scaler.py:371 x40, ..."."""
    def short(filename):
        return "/".join(filename.replace(os.sep, "/").split("/")[-2:])
    return ", ".join(f"{short(f)}:{line} x{n}" for (f, line), n in sources.most_common(top))


def host_syncs_per_step(train: Callable[[int], Callable[[], object]], steps: int = 40,
                        warmup: int = 0) -> float:
    """The host syncs per step of one run's steps (`step_syncs`); prints where they came
    from (a failing test's captured output shows it)."""
    found = step_syncs(train, steps, warmup)
    if found.sources:
        print(f"{found.per_step:.2f} host syncs per step over {found.steps} steps, from "
              f"{sources_text(found.sources)}")
    return found.per_step
