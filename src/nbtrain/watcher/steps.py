"""What a step of the loop is, seen from outside.

- With optimizers: torch's global optimizer step hooks. An optimizer's step ends a step
  of the Run, unless it follows another optimizer's step with no training batch between
  (a GAN's generator after its discriminator): that one is part of the same step, so a
  step is one training batch, its samples counted once; with several optimizers a step,
  the step boundary (where Stop ends the loop) is after the last of them. Where the
  second optimizer then steps again on its own (layer by layer: one optimizer's steps,
  then the next one's), its first step was a step of its own, and is counted so.
  Several `backward` per step (gradient accumulation) are its micro-batches; a backward
  inside an optimizer's step (a closure's) after one before it is an evaluation of that
  one step (LBFGS, SAM), its loss and samples the first one's, unless a training batch
  came since: then it is the step's last micro-batch (Lightning's accumulation runs it in
  the closure). An optimizer step with no backward before
  it (gradients set by hand, torch.func) is a step too. A step that saw no batch and no
  forward (a layer's `forward` called directly on a batch fetched once) trains on the
  data the loop holds: its samples are the last step's.
- Without one (the loop updates its parameters by hand, `p.data.add_(...)`): a leaf of
  the first loss's graph is watched; a backward that finds its gradient zeroed, set to
  None or replaced, or the leaf itself changed in place since the last backward, ends
  the step before it. The last one ends with the watch.

What it changes (optimize=True): the optimizer's kernel (fused where torch has one),
for the watch only; `Optimizer.state_dict` reports the loop's own flags meanwhile, so a
checkpoint saved inside the watch is the one the loop would save.
"""
from __future__ import annotations

import functools
import weakref
from collections import deque

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..auto import frameworks
from ..train.optim import apply_impl, impl_for


class Steps:
    """The watch's part that ends steps: the optimizers' step hooks, or a loop's updates by
    hand. At a step's end it asks the records part for a record due and the measuring part
    to look; around an fp16 step, the scaling part unscales (fp16.py)."""

    def __init__(self, edge, scaling, records, measure, between, first_sign):
        self.edge, self.scaling, self.records, self.measure = edge, scaling, records, measure
        self.between = between          # between.py: a step's end starts the gap after it
        self._first_sign = first_sign   # core: the loop's first sign of training (its device)
        self.hand = None                # HandSteps: while no optimizer has stepped
        self.micro_last = 1             # backward() calls of the last step
        self._samples_last = 0          # samples of the last step that saw any
        self._joined_saw = True         # the step a second optimizer joined saw samples
        self.in_step = False            # inside an optimizer's step: a backward is its closure's
        self._lead = None               # the first optimizer to step
        self.lr = None                  # the lr its last step ran with (its scheduler steps after)
        self._stepped = []              # ids of the optimizers that stepped in this step, in order
        self._per_step = 1              # the optimizers that step in one step of the loop
        self._optimizers = weakref.WeakSet()
        self._flags_as_found = weakref.WeakKeyDictionary()   # optimizer -> its groups' flags

    def install(self) -> None:
        patches = self.edge.patches
        patches.keep(register_optimizer_step_pre_hook(self._before_step).remove)
        patches.keep(register_optimizer_step_post_hook(self._after_step).remove)
        patches.patch(torch.optim.Optimizer, "state_dict", self._wrap_state_dict)

    def hook_other_optimizer(self, cls) -> None:
        """A framework's own optimizer class (fastai's, not a torch.optim one: torch's
        global hooks never see its step): its `step` calls the same two hooks, for the
        watch only. Its param_groups give the lr; its kernel stays its own."""
        part = self

        def wrap(original):
            @functools.wraps(original)
            def step(optimizer, *args, **kwargs):
                part._before_step(optimizer, args, kwargs)
                result = original(optimizer, *args, **kwargs)
                part._after_step(optimizer, args, kwargs)
                return result
            return step
        self.edge.patches.patch(cls, "step", wrap)

    # -- optimizer steps ------------------------------------------------------------------
    def _before_step(self, optimizer, args, kwargs) -> None:
        edge = self.edge
        if edge.inside:
            return
        if optimizer not in self._optimizers:
            self._adopt(optimizer)
        self.in_step = True
        if edge.tally.backwards:
            self.scaling.unscale_or_skip(optimizer)   # fp16 only (fp16.py)
            # a second Ctrl-C waits until the step is counted (Run.enter, as an attribute
            # set: this runs every step, and a call costs more than the set)
            edge.run.phase = "update"
        elif edge.tally.at_boundary:   # a closure's step, or one without backward: Stop ends the
            edge.stop_if_asked()   # loop here, before the step has changed anything

    def _adopt(self, optimizer) -> None:
        """An optimizer seen for the first time (before its first step of the watch)."""
        edge = self.edge
        run = edge.run
        self._optimizers.add(optimizer)
        if run.optimizer is None:
            run.equip(optimizer=optimizer)
        device = optimizer.param_groups[0]["params"][0].device
        impl, why = impl_for(optimizer, device, run.config.optimizer_impl,
                             edge.plan.why_not("optimizer_impl"))
        run.resolved.setdefault("optimizer_impl", (impl, why))
        if impl in ("fused", "foreach"):
            self._flags_as_found[optimizer] = [_flags(g) for g in optimizer.param_groups]
        edge.patches.keep(apply_impl(optimizer, impl))

    def _after_step(self, optimizer, args, kwargs) -> None:
        """An optimizer step ends a step of the Run unless it follows another optimizer's
        step with no training batch between and did not step itself since: a GAN's
        generator after its discriminator, on the same batch."""
        edge = self.edge
        tally = edge.tally
        if self.scaling.stepped_scaled():
            self.scaling.after_scaled_step()
        self.in_step = False
        if edge.inside:
            return
        if self._lead is None:
            self._lead, self.hand = optimizer, None
            self._describe()
        if optimizer is self._lead:
            self.lr = optimizer.param_groups[0]["lr"]
        if not tally.trained:   # no backward: the step is the only sign of training
            self._first_sign(optimizer.param_groups[0]["params"][0].device)
        key, stepped = id(optimizer), self._stepped
        if tally.batches or not stepped or key in stepped:   # it starts a step
            self.close()   # the loop at the boundary, unless more optimizers step after this
            if len(stepped) > 1 and key != stepped[0]:
                self._own_step_before(key)
            self._stepped = [key]
            if self._per_step > 1:
                tally.boundary(False)
            return
        # a second optimizer on the same batch: the same step (its backwards too)
        if tally.backwards:
            interval = edge.interval
            self._joined_saw = interval.samples > interval.samples_done
            interval.extend_step()
            tally.joined()
        stepped.append(key)
        if len(stepped) > self._per_step:
            self._per_step = len(stepped)
            self._describe()
        # with several optimizers a step, the boundary is after the last of them
        tally.boundary(len(stepped) >= self._per_step)

    def _own_step_before(self, key: int) -> None:
        """The optimizer that just stepped had joined the step before after another one:
        stepping again without that one first (layer by layer, not a GAN), the joined step
        was a step of its own, counted now. The optimizers per step are as found from now on."""
        stepped = self._stepped
        if key not in stepped:
            return
        self._per_step = len(stepped) - stepped.index(key)
        self._describe()
        edge = self.edge
        edge.run.advance(0)   # its batches and samples are the step's it was joined to,
        if not self._joined_saw:   # or, where it saw none, the last step's
            edge.interval.add_samples(self._samples_last)
        edge.interval.end_step()

    def close(self, measure: bool = True) -> None:
        """The step ends: counted, its record if one is due, the measuring part told."""
        edge = self.edge
        run, interval, tally = edge.run, edge.interval, edge.tally
        if not tally.backwards:   # an optimizer step without backward: its batch's samples
            interval.add_samples(tally.take_samples())
            run.resolved.setdefault("loss", (None, (
                "not seen: your loop's steps run no backward() the watch sees (gradients "
                "set by hand, or from torch.func), so no loss is recorded")))
        seen = interval.samples - interval.samples_done
        if seen:
            self._samples_last = seen
        elif not tally.ahead:   # no batch, no forward seen: the data the loop holds, the
            interval.add_samples(self._samples_last)   # last step's (not a batch held back)
        batches, backwards = tally.close()
        self.between.step_ended()
        run.advance(batches or backwards or 1)
        interval.end_step()
        self.micro_last = backwards
        if interval.steps >= self.records.record_at:
            self.records.record_due()
        run.phase = "load"   # Run.enter, inlined (above)
        if measure and self.measure.pending:
            self.measure.step_ends(by_hand=self.hand is not None)

    def _describe(self) -> None:
        resolved = self.edge.run.resolved
        if self._lead is None:
            why = ("your loop updates its parameters itself (no optimizer stepped): a step "
                   "ends where the gradient of a parameter is zeroed or the parameter "
                   "updated before the next backward()")
            resolved["step"] = ("an update by hand", why)
            return
        name = type(self._lead).__name__
        if self._per_step < 2:
            framework = frameworks.framework_of(resolved)
            whose = f"the {name} in {framework.name}'s loop" if framework else f"your {name}"
            resolved["step"] = ("an optimizer step", f"each step of {whose}")
            return
        resolved["step"] = ("a training batch", (
            f"{self._per_step} optimizers step in one step of your loop: a step of the Run ends "
            "at an optimizer's step that follows a new training batch (or that optimizer's "
            "own last step); the others' steps after it, on the same batch, are part of it"))

    # -- updates by hand --------------------------------------------------------------------
    def watch_hand_updates(self, loss: torch.Tensor) -> None:
        """At the first backward: until an optimizer steps, a leaf of its graph tells
        where a step ends."""
        if self._lead is not None:
            return
        leaf = _a_leaf(loss)
        if leaf is not None:
            self.hand = HandSteps(leaf)
            self._describe()

    # -- what the loop's checkpoints see ----------------------------------------------------
    def _wrap_state_dict(self, original):
        found_flags = self._flags_as_found

        @functools.wraps(original)
        def state_dict(optimizer):
            state = original(optimizer)
            found = found_flags.get(optimizer)
            if found is not None:   # the kernel is the watch's: the flags the loop gave
                state["param_groups"] = [_with_flags(g, flags) for g, flags
                                         in zip(state["param_groups"], found)]
            return state
        return state_dict


class HandSteps:
    """Where a loop without an optimizer updates: the state of one leaf of its loss's graph
    after a backward, compared at the next one."""

    def __init__(self, leaf: torch.Tensor):
        self.leaf = leaf
        self.grad = None
        self.grad_version = self.version = -1

    def note(self) -> None:
        """After a backward: the leaf's gradient as it left it."""
        self.grad = self.leaf.grad
        self.grad_version = -1 if self.grad is None else self.grad._version
        self.version = self.leaf._version

    def updated(self) -> bool:
        """Before the next backward: whether the loop zeroed, replaced or set the gradient
        aside, or changed the leaf in place, since the last one (an accumulating loop
        does none of these)."""
        grad = self.leaf.grad
        return grad is None or grad is not self.grad or grad._version != self.grad_version \
            or self.leaf._version != self.version


def _a_leaf(loss: torch.Tensor, most: int = 10_000):
    """A tensor the loss's backward accumulates a gradient into (breadth first from its
    grad_fn), or None."""
    start = loss.grad_fn
    if start is None:
        return None
    queue, seen = deque([start]), {start}
    while queue and len(seen) < most:
        node = queue.popleft()
        variable = getattr(node, "variable", None)   # AccumulateGrad
        if isinstance(variable, torch.Tensor):
            return variable
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
    return None


def _flags(group: dict) -> dict:
    return {k: group[k] for k in ("fused", "foreach") if k in group}


def _with_flags(group: dict, flags: dict) -> dict:
    group = {k: v for k, v in group.items() if k not in ("fused", "foreach")}
    group.update(flags)
    return group
