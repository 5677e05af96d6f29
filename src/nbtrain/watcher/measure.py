"""What a watch measures, and when: never at the model's first forward, and each part only
once the loop has run long enough that it costs at most the measuring budget (auto/budget.py)
of the time run so far, as nt.fit does. The parts, in order:

1. bf16 "auto" on a CPU or GPU with bf16 units (optimize=True): a trial on the loop's own steps,
   blocks of steps with and without autocast interleaved (Bf16Trial), judged by
   auto.precision.decide with fp32 (the loop as written) the default. A decisive result is remembered per architecture on the machine,
   with the load average it was measured under (measured again once that has moved). Each
   pair of blocks starts once it is affordable on its own, and the pairs a run measured
   without deciding are kept for the same model's next run (a short loop re-run as a cell
   decides over a few runs).
2. The FLOPs of one of the loop's steps, counted as it runs (a dispatch mode that runs
   every op as it is and adds up torch's FLOP formulas: the loop's numbers unchanged).
3. The time of each leaf module, and what makes the memory peak: a window of a few steps
   (the modules part, modules.py), then its hooks removed.
4. The device's peak, where it is not known already (a GEMM probe, cached on disk).

Nothing here draws from the loop's RNG. `run.resolved["measuring_s"]` says what it cost.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..auto import budget
from ..auto.precision import (
    bf16_blocks,
    bf16_units,
    blocks_decisive,
    decide,
    drop_bf16_blocks,
    gain_words,
    keep_bf16_blocks,
    median,
    remember_bf16_gain,
)
from ..machine import load_now

BLOCK_S = 0.03       # a trial block's length: many steps of a small model, a few of a large one
BLOCK_STEPS = 3      # at least
UNITS_A_RUN = 3      # a short loop's block: a third of its last run's budget (warm-up, pair, room)
COUNT_COST = 3.0     # a step under the FLOP count takes up to ~this many steps (Python per op)
COUNT_LOAD_S = 0.005   # a process's first count loads torch.utils.flop_counter and auto/flops.py
PEAK_PROBE_S = 1.0   # what a GEMM probe of the peak may take (flops.probe_gemm)


class Measure:
    """The watch's part that measures within the budget: the bf16 trial (it tells the
    autocast part which amp each block runs in, and its verdict), the FLOP count, the peak.
    `done` is called once nothing is left to measure (the watch may then drop its forward
    hooks)."""

    def __init__(self, edge, autocast, modules, done):
        self.edge, self.autocast, self.modules, self._done = edge, autocast, modules, done
        self.pending = False       # a part is pending or running: step ends look (fast flag)
        self.measured_s = 0.0      # what the measuring cost the loop so far
        self.loading_s = budget.take_loading_s()   # the engine, loaded by this watch (its first)
        self.count = None          # "due": the next step is counted; a FlopCount while it runs
        self._trial = None         # Bf16Trial, until decided
        self._trial_key = None     # what its blocks and gain are kept under
        self._count_key = None     # () -> what a FLOP count is kept under in _COUNTED
        self._peak_due = False
        self._peak_cost_s = None   # what its probe costs (0: known), looked up once a watch
        self._quiet_until = 0.0    # only the peak left, not affordable before this time
        self._compiled = False
        self._conv_share = 0.0

    def plan(self, model, key, bf16_trial: bool) -> None:
        """At the model's first forward: what is to be measured on it; `key`, what a
        bf16 gain and a FLOP count depend on (auto.precision.bf16_key), made when called."""
        resolved = self.edge.run.resolved
        self._quiet_until = 0.0
        if bf16_trial:
            self._plan_trial(key)
        self._compiled = type(model).__name__ == "OptimizedModule"
        if self.modules.plan(self._compiled):
            self.pending = True
        if not self.edge.run.config.count_flops:
            return
        if self._compiled:
            resolved["flops_per_step"] = (None, "not counted: a torch.compile'd model "
                                          "(a counting mode would run it uncompiled)")
            return
        device = str(self.edge.device)   # the model's device at its first forward, as the key's
        self._count_key = lambda: (key(), device)
        counted = _COUNTED.get(self._count_key()) if _COUNTED else None
        if counted is not None:
            self._set_flops(*counted, "counted before in this process for this model")
        self._peak_due = True
        self.pending = True

    def _plan_trial(self, key) -> None:
        """The bf16 trial, going on from the blocks the model's earlier runs kept."""
        self._trial_key = key = key()
        kept = bf16_blocks(key)
        # the load before the loop's own steps add to it, or the kept blocks' first one's
        self._trial = Bf16Trial(load=kept["load"] if kept else load_now(), kept=kept)
        self.pending = True
        if kept and self._trial.pairs():
            amp, why = self.edge.run.resolved["amp"]
            self.autocast.settle(amp, f"{why}; {self._trial.standing()} so far")

    def undecided(self) -> bool:
        """Whether bf16 is still to be decided by a trial on the loop's steps."""
        return self._trial is not None

    # -- at each step's end while something is pending ---------------------------------------
    def step_starts(self) -> None:
        """A step starts (its first forward, or its training batch): a count due starts."""
        if self.count == "due":
            self.count = FlopCount()
            self.count.start()

    def step_ends(self, by_hand: bool) -> None:
        """A step ended; `by_hand`: the loop updates by hand, so a count ends with its
        backward (counted_backward) instead."""
        now = time.perf_counter()
        if now < self._quiet_until:   # only the peak's probe is left, and it is not affordable
            return
        if isinstance(self.count, FlopCount):
            if not by_hand:
                self._end_flop_count(now)
        elif self._trial is not None and self._trial.running:
            self._trial_step(now)
        elif self.modules.running:
            self._spent(self.modules.step_done(now))
        else:
            self._start_what_is_affordable(now)
        self.pending = self._trial is not None or self.count is not None or \
            self._peak_due or self._flops_wanted() or self.modules.due or self.modules.running
        if not self.pending:
            self._say_what_measuring_cost()
            self._done()

    def _flops_wanted(self) -> bool:
        return self.edge.run.config.count_flops and not self._compiled and \
            "flops_per_step" not in self.edge.run.resolved

    def _start_what_is_affordable(self, now: float) -> None:
        step_s = self._step_s(now)
        trial = self._trial
        if trial is not None:
            # a pair (or the warm-up) at a time, each within the budget when it starts
            if self.affords(trial.cost_s(step_s), now):
                now = self._gpu_done(now)
                trial.start(step_s, now, self.edge.waited_s, self.edge.run.step + 1, trial.unit())
                self.autocast.run_in(trial.mode)
            return   # the FLOPs and the peak after the trial: the peak depends on the amp
        if self._flops_wanted():
            load_s = budget.first_use_s("torch.utils.flop_counter", COUNT_LOAD_S)
            if self.affords(COUNT_COST * step_s + load_s, now):
                self.count = "due"
            return
        if self.modules.due:   # one window at a time: nothing else measured within it
            if self.affords(self.modules.cost_s(step_s), now):
                self.modules.open(now, step_s)
            return
        if self._peak_due:   # the last part: the amp is settled, nothing else is due
            cost = self._peak_cost()
            if self.affords(cost, now):
                self._probe_peak()
            else:   # a probe (1 s) waits for 20 s of the run: no step's end looks before then
                self._quiet_until = self._affordable_from(cost)

    def _peak_cost(self) -> float:
        """The probe's cost, 0 where the peak is known: asked once a watch (it reads the
        cache's file, which no step's end should)."""
        if self._peak_cost_s is None:
            from ..auto import flops   # each use loads it: a watch measuring nothing never does
            known = flops.peak_known(self.edge.device, self.autocast.amp)
            self._peak_cost_s = 0.0 if known else PEAK_PROBE_S
        return self._peak_cost_s

    def affords(self, cost_s: float, now: float) -> bool:
        """Whether measuring (or a trial) that may cost `cost_s` is within the budget now,
        with what was measured so far and the engine's loading counted as spent."""
        return budget.affordable(cost_s, self.measured_s + self.loading_s,
                                 now - self.edge.started + self.loading_s)

    def _affordable_from(self, cost_s: float) -> float:
        """The time (perf_counter's) from which `cost_s` more is affordable, while nothing
        else is measured: `affords` holds once the run has run (spent + cost) / SHARE."""
        spent_s = self.measured_s + self.loading_s
        return self.edge.started - self.loading_s + (spent_s + cost_s) / budget.SHARE

    def _step_s(self, now: float) -> float:
        """The loop's mean time per step so far (its setup before step 1 included: an
        estimate on the safe side)."""
        return (now - self.edge.started - self.measured_s) / max(self.edge.run.step, 1)

    def _spent(self, seconds: float) -> None:
        """Measuring time the loop waited for: counted, and taken out of the open record's
        time (the loop's throughput is the loop's)."""
        seconds = max(seconds, 0.0)
        self.measured_s += seconds
        interval = self.edge.interval
        interval.t0 += min(seconds, time.perf_counter() - interval.t0)

    # -- 1. the bf16 trial ------------------------------------------------------------------
    def _trial_step(self, now: float) -> None:
        trial, edge = self._trial, self.edge
        ends_block = trial.ends_block(now, edge.waited_s)
        if ends_block:
            now = self._gpu_done(now)
        trial.step_done(now, edge.waited_s, ends_block)
        self.autocast.run_in(trial.mode)
        if trial.running:
            return
        self._spent(trial.take_extra_s())   # the unit's cost, as it ends
        if trial.complete():
            self._decide(trial)

    def _decide(self, trial: "Bf16Trial") -> None:
        """The trial's blocks are all in: its verdict, for the rest of the run and (where
        decisive) for the model's next runs; its blocks are done with either way (within
        the noise, the next run measures anew, its blocks sized by this one's length)."""
        edge = self.edge
        self._trial = None
        keep, gain, why = trial.verdict()
        amp = "bf16" if keep else "off"
        if trial.decisive():
            remember_bf16_gain(self._trial_key, gain, trial.load)
            drop_bf16_blocks(self._trial_key)
        else:
            ran = time.perf_counter() - edge.started
            keep_bf16_blocks(self._trial_key, trial.kept(ran, blocks=False))
        # the next step runs in `amp`; the trial's bf16 blocks did not run as written
        then = f"bf16 from step {edge.run.step + 1}" if keep else \
            f"fp32 kept from step {edge.run.step + 1}{trial.ran_in_bf16('; ')}"
        self.autocast.settle(amp, f"{bf16_units(edge.device)}; {why}, measured on your loop's "
                             f"own steps {trial.steps_measured(edge.run.step)}: {then}")
        self._done()

    def _gpu_done(self, now: float) -> float:
        """On a GPU, a trial block's edge waits for the kernels queued so far, so that each
        block is timed by the GPU's work, not by how far ahead the host queued it (one
        sync at each block's end and each warm-up's or pair's start, 11 in a trial run at
        once); on a CPU, `now` as it is."""
        if self.edge.device.type != "cuda":
            return now
        torch.cuda.synchronize(self.edge.device)
        return time.perf_counter()

    # -- 2. the FLOP count ------------------------------------------------------------------
    def _end_flop_count(self, now: float) -> None:
        count, self.count = self.count, None
        count.stop()
        self._spent(now - count.started - self._step_s(now))
        self._counted(count.total, count.conv_share(),
                      f"counted on your loop's step {self.edge.run.step} as it ran")

    def counted_backward(self, per_step: int) -> None:
        """A loop updating by hand ends its step at its next backward: its count is one
        forward and backward, times the `per_step` backwards of a step."""
        if not isinstance(self.count, FlopCount):
            return
        count, self.count = self.count, None
        count.stop()
        now = time.perf_counter()
        per_step = max(per_step, 1)
        self._spent(now - count.started - self._step_s(now) / per_step)
        self._counted(count.total * per_step, count.conv_share(),
                      f"counted on a forward and backward of your loop's step "
                      f"{self.edge.run.step + 1} as it ran, x {per_step} backward() a step")

    def _counted(self, total: int, share: float, how: str) -> None:
        _COUNTED[self._count_key()] = (total, share)
        self._set_flops(total, share, how)

    def _set_flops(self, total: int, share: float, how: str) -> None:
        from ..auto import flops
        self._conv_share = share
        self.edge.run.resolved["flops_per_step"] = (
            total, f"{total / 1e9:.4g} GFLOP: {flops.COUNTED}, {how} (torch's FLOP formulas)")

    # -- 3. the peak --------------------------------------------------------------------------
    def _probe_peak(self) -> None:
        from ..auto import flops
        started, edge = time.perf_counter(), self.edge
        try:
            with edge.own:
                peak = flops.run_peak(edge.device, self.autocast.amp, torch.get_num_threads(),
                                      self._conv_share)
        except Exception as exc:
            peak = (None, f"not measured ({type(exc).__name__}: {exc})")
        edge.run.resolved["peak_tflops"] = peak
        self._peak_due = False
        self._spent(time.perf_counter() - started)

    # -- the end ----------------------------------------------------------------------------
    def end(self) -> None:
        """A count still running (the loop ended or failed in its step): its mode off."""
        if isinstance(self.count, FlopCount):
            self.count.stop()
        self.count = None
        if self._trial is not None and self._trial.running:
            now = time.perf_counter()
            self._trial.abandon(now, self.edge.waited_s)
            self._spent(self._trial.take_extra_s())
            self.autocast.run_in("off")

    def say_what_was_not_measured(self, exc) -> None:
        """The watch ends (`exc`, what ended it): each part not measured says why."""
        edge = self.edge
        ran = time.perf_counter() - edge.started
        why = _ended_before(ran, "measuring", self.loading_s)
        resolved = edge.run.resolved
        if self._trial is not None:
            self.autocast.settle("off", self._keep_trial(ran, why))
            self._trial = None
        if edge.run.config.count_flops and not self._compiled and edge.model is not None \
                and "flops_per_step" not in resolved:
            resolved["flops_per_step"] = (None, f"not counted: {why}")
        if self._peak_due and "peak_tflops" not in resolved:
            resolved["peak_tflops"] = (None, f"not measured: {why}")
        self.modules.finish(exc, _ended_before(ran, "timing its modules", self.loading_s))
        self._say_what_measuring_cost()

    def _keep_trial(self, ran: float, why: str) -> str:
        """An undecided trial's pairs kept for the model's next run (with this run's
        length, which sizes its blocks); what the amp's message says."""
        trial, units = self._trial, bf16_units(self.edge.device)
        keep_bf16_blocks(self._trial_key, trial.kept(ran))
        ran_in_bf16 = trial.ran_in_bf16("; ")   # "as written" only where none did
        if not trial.pairs():
            return (f"{units}, but {why}: fp32{ran_in_bf16 or ', as written'} (a re-run of "
                    "this model measures bf16 a few blocks a run)")
        return (f"{units}; {trial.standing()}, each run's at most {budget.words()} of it: "
                f"fp32 until it decides{ran_in_bf16}")

    def _say_what_measuring_cost(self) -> None:
        ran = max(time.perf_counter() - self.edge.started, 1e-9)
        self.edge.run.resolved["measuring_s"] = (round(self.measured_s, 4), (
            f"the watch's measuring took {self.measured_s * 1e3:.1f} ms, "
            f"{self.measured_s / ran:.1%} of the {ran:.2f} s watched; each part started only "
            f"where it{_with_loading(self.loading_s)} would cost at most {budget.words()} of "
            "the time run so far"))


def _with_loading(loading_s: float) -> str:
    return f", with the {loading_s * 1e3:.0f} ms nbtrain took to load," if loading_s else ""


def _ended_before(ran: float, what: str, loading_s: float) -> str:
    """Why a measurement did not run: the loop ended before it was affordable."""
    return (f"your loop ended after {ran:.2f} s, before {what}{_with_loading(loading_s)} "
            f"would have cost at most {budget.words()} of the time run")


_COUNTED: dict = {}   # (architecture, device) -> (FLOPs of a step, conv share): this process


class FlopCount(TorchDispatchMode):
    """FLOPs of the ops that run while it is on: each op runs as it is (no decomposition,
    so the loop's numbers are its own), and torch's FLOP formulas add up."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No dynamo guard around __torch_dispatch__: its first call would import
        torch._dynamo into the user's program (seconds: docs/guide/measured.md), and a
        count never runs around a compiled model (Measure counts only eager ones)."""
        return False

    def __init__(self):
        super().__init__()
        self.started = time.perf_counter()   # a process's first count: its loading is its cost
        from torch.utils.flop_counter import flop_registry
        self._registry = flop_registry
        self.total = self.conv = 0

    def start(self) -> None:
        self.__enter__()

    def stop(self) -> None:
        self.__exit__(None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self._registry.get(func._overloadpacket)
        if formula is not None:
            try:
                flops_of_op = formula(*args, **kwargs, out_val=out)
            except Exception:   # a formula that cannot read these arguments: not counted
                return out
            self.total += flops_of_op
            if "convolution" in str(func):
                self.conv += flops_of_op
        return out

    def conv_share(self) -> float:
        return self.conv / self.total if self.total else 0.0


class Bf16Trial:
    """Blocks of the loop's steps, bf16 and fp32 interleaved: a bf16 warm-up block, then
    (fp32, bf16), (bf16, fp32), (fp32, bf16), so that a drift of the machine's speed
    weighs on both alike. Each block's time per step leaves out the loader's wait.

    A run may measure only some of the pairs (`kept`: those of earlier runs of the model,
    auto.precision.bf16_blocks); each run warms up first, since a new process pays bf16's
    first calls in its first block."""

    ORDER = ("bf16", "off", "bf16", "bf16", "off", "off", "bf16")

    def __init__(self, load: float = 0.0, kept: Optional[dict] = None):
        self.load = load   # the load average as the first block began: what the gain is kept with
        kept = kept or {"off": [], "bf16": [], "runs": 0, "run_s": None, "extras": []}
        # at most a pair short of a whole trial: a whole one has decided, and is dropped
        pairs = min(len(kept["off"]), len(kept["bf16"]), self._pairs() - 1)
        self.per_step = {"bf16": kept["bf16"][:pairs], "off": kept["off"][:pairs]}
        self.runs_before, self.pairs_before = kept["runs"], pairs
        self.last_run_s = kept["run_s"]   # the last run's length: a short loop's blocks fit it
        self.extras = kept["extras"]      # what a bf16 step cost beyond fp32's, the last blocks'
        self.running = False
        self.mode = "off"
        self.warm_up = None  # this run's warm-up block's time per step
        self.first_step = 0
        self.bf16_steps = []   # (first, last): this run's spans of steps run in bf16
        self.steps_per_block = 0
        self._unit_bf16 = []   # (time per step, steps) of the bf16 blocks not yet paid for

    def _pairs(self) -> int:
        return (len(self.ORDER) - 1) // 2

    def compared(self) -> int:
        """The compared blocks measured, earlier runs' included."""
        return len(self.per_step["off"]) + len(self.per_step["bf16"])

    def complete(self) -> bool:
        return self.compared() == len(self.ORDER) - 1

    def _next_block(self) -> int:
        return self.compared() + 1 if self.warm_up is not None else 0

    def unit(self) -> int:
        """The blocks of the next step of the trial: the warm-up, or a pair."""
        return 1 if self.warm_up is None else 2

    def cost_s(self, step_s: float) -> float:
        """What the next unit (the warm-up or a pair) may cost at most: its bf16 block."""
        return self._steps(step_s) * self._step_cost(step_s)

    def _step_cost(self, step_s: float) -> float:
        """A bf16 step's cost beyond fp32: at half speed, or what the last bf16 blocks
        measured (their median: one slow block does not stop the trial), where that is
        more. A first block's cost is known only once it has run."""
        return max(step_s, median(self.extras)) if self.extras else step_s

    def _steps(self, step_s: float) -> int:
        """BLOCK_S of steps, at least BLOCK_STEPS; where the model's last run was short, as
        many as let a warm-up and a pair cost at most the budget of a run that long (one
        step at least)."""
        full = max(BLOCK_STEPS, math.ceil(BLOCK_S / max(step_s, 1e-9)))
        if self.last_run_s is None:
            return full
        cost = max(self._step_cost(step_s), 1e-9)
        fits = math.floor(budget.SHARE * self.last_run_s / (UNITS_A_RUN * cost))
        return max(1, min(full, fits))

    def start(self, step_s: float, now: float, waited_s: float, first_step: int,
              blocks: Optional[int] = None) -> None:
        """Run the next `blocks` blocks (all that are left where None), from the step after
        `now`."""
        self.running, self.steps_per_block = True, self._steps(step_s)
        self._pace = step_s   # the loop's before the unit: fp32's, until a block measures it
        self._allowed_s = self.cost_s(step_s)   # what each bf16 block may cost beyond it
        self._left = blocks or len(self.ORDER) - self._next_block()
        self.mode = self.ORDER[self._next_block()]
        self.first_step = self.first_step or first_step
        self._block_first = first_step   # the step number of the block's first step
        self._block_start, self._waited, self._done = now, waited_s, 0

    def ends_block(self, now: float, waited_s: float) -> bool:
        """The step done at `now` ends its block: the block's steps have all run, or, in a
        bf16 block, what they cost beyond fp32's pace has reached what the block was allowed
        (bf16 slower than half speed: a first block's cost is known only as it runs)."""
        if self._done + 1 >= self.steps_per_block:
            return True
        block_s = (now - self._block_start) - (waited_s - self._waited)
        return self.mode == "bf16" and block_s - (self._done + 1) * self._pace >= self._allowed_s

    def step_done(self, now: float, waited_s: float, ends_block: bool) -> None:
        self._done += 1
        if not ends_block:
            return
        per_step = ((now - self._block_start) - (waited_s - self._waited)) / self._done
        if self.mode == "bf16":
            self._unit_bf16.append((per_step, self._done))
        self._block_ran()
        if self.warm_up is None:   # the warm-up block is not compared
            self.warm_up = per_step
        else:
            self.per_step[self.mode].append(per_step)
        self._left -= 1
        if self._left == 0 or self.complete():
            self.running, self.mode = False, "off"
            return
        self.mode = self.ORDER[self._next_block()]
        self._block_start, self._waited, self._done = now, waited_s, 0

    def _block_ran(self) -> None:
        """The block's `_done` steps have run: its steps kept where in bf16, the next
        block's first step after them."""
        first, last = self._block_first, self._block_first + self._done - 1
        if self.mode == "bf16" and self._done:
            if self.bf16_steps and self.bf16_steps[-1][1] == first - 1:   # (bf16, bf16): one span
                first = self.bf16_steps.pop()[0]
            self.bf16_steps.append((first, last))
        self._block_first = last + 1

    def abandon(self, now: float, waited_s: float) -> None:
        """The loop ended in a block: a bf16 block's steps so far are paid for, nothing of
        it compared."""
        if self.running and self.mode == "bf16" and self._done:
            per_step = ((now - self._block_start) - (waited_s - self._waited)) / self._done
            self._unit_bf16.append((per_step, self._done))
        if self.running:
            self._block_ran()
        self.running, self.mode = False, "off"

    def take_extra_s(self) -> float:
        """What the bf16 blocks run since the last call cost beyond fp32's pace (the median
        fp32 block's, or the loop's before the unit where none has run)."""
        fp32 = median(self.per_step["off"]) if self.per_step["off"] else self._pace
        extras = [(max(t - fp32, 0.0), steps) for t, steps in self._unit_bf16]
        # a trial's bf16 blocks at most: what the loop costs now, not long ago
        self.extras = (self.extras + [e for e, _ in extras])[-self.ORDER.count("bf16"):]
        self._unit_bf16 = []
        return sum(e * steps for e, steps in extras)

    def gain(self) -> float:
        return median(self.per_step["off"]) / median(self.per_step["bf16"])

    def verdict(self):
        """(keep bf16, the median gain, why: gain_words): `decide`, with fp32 as the default
        (the loop as written)."""
        verdict = decide(self.per_step["off"], self.per_step["bf16"], "off")
        return verdict.amp == "bf16", verdict.gain, gain_words(verdict)

    def decisive(self) -> bool:
        return blocks_decisive(self.per_step["off"], self.per_step["bf16"])

    # -- what is kept for the next run ------------------------------------------------------
    def pairs(self) -> int:
        """The pairs measured, earlier runs' included (a half pair is not kept)."""
        return min(len(self.per_step["off"]), len(self.per_step["bf16"]))

    def runs(self) -> int:
        """The runs whose blocks are in, this one's where it measured a pair."""
        return self.runs_before + (self.pairs() > self.pairs_before)

    def kept(self, run_s: float, blocks: bool = True) -> dict:
        """The pairs so far (none where not `blocks`) and this run's length, for the next
        run (auto.precision.keep_bf16_blocks's entry)."""
        pairs = self.pairs() if blocks else 0
        return {"off": self.per_step["off"][:pairs], "bf16": self.per_step["bf16"][:pairs],
                "runs": self.runs() if blocks else 0, "run_s": run_s, "extras": self.extras,
                "load": self.load}

    def standing(self) -> str:
        """Where the trial stands, in words."""
        runs = self.runs()
        return (f"bf16 trial: {2 * self.pairs()} of {len(self.ORDER) - 1} blocks measured over "
                f"{runs} run{'s' if runs != 1 else ''}")

    def ran_in_bf16(self, before: str = "") -> str:
        """`before` and which of this run's steps ran in bf16 for the trial, in words ('steps
        5-7, 11-13 and 20' ...); '' where none did."""
        if not self.bf16_steps:
            return ""
        spans = [f"{a}" if a == b else f"{a}-{b}" for a, b in self.bf16_steps]
        listed = spans[0] if len(spans) == 1 else f"{', '.join(spans[:-1])} and {spans[-1]}"
        many = len(spans) > 1 or self.bf16_steps[0][0] != self.bf16_steps[0][1]
        return f"{before}step{'s' if many else ''} {listed} ran in bf16 for the trial"

    def steps_measured(self, last_step: int) -> str:
        """Which steps the trial measured, in words."""
        here = f"{self.first_step}-{last_step}"
        if not self.pairs_before:
            return here
        runs = self.runs_before
        return (f"{here}, and {2 * self.pairs_before} blocks of the {runs} run"
                f"{'s' if runs != 1 else ''} before")
