"""What a step of the loop is, seen from outside.

- With optimizers: torch's global optimizer step hooks. An optimizer's step ends a step
  of the Run, unless it follows another optimizer's step with no training batch between
  (a GAN's generator after its discriminator): that one is part of the same step, so a
  step is one training batch, its samples counted once; with several optimizers a step,
  the step boundary (where Stop ends the loop) is after the last of them. Several
  `backward` per step (gradient accumulation) are its micro-batches.
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

from ..train.optim import apply_impl, impl_for


class StepsPart:
    """The Watcher's part that ends steps (a mixin: it shares the run and the interval)."""

    def _init_steps(self) -> None:
        self._lead = None               # the first optimizer to step
        self._stepped = set()           # ids of the optimizers that stepped in this step
        self._per_step = 1              # the most optimizers that stepped in one step
        self._optimizers = weakref.WeakSet()
        self._flags_as_found = weakref.WeakKeyDictionary()   # optimizer -> its groups' flags
        self._hand = None               # HandSteps: while no optimizer has stepped
        self._batches = 0               # training batches since the last step (loader.py)
        self._micro_last = 1            # backward() calls of the last step

    def _install_steps(self) -> None:
        self._patch(torch.optim.Optimizer, "state_dict", self._wrap_state_dict)

    # -- optimizer steps ------------------------------------------------------------------
    def _before_step(self, optimizer, args, kwargs) -> None:
        if self._inside:
            return
        if optimizer not in self._optimizers:
            self._adopt(optimizer)
        if self._backwards:
            if self.scaler is not None:
                self._unscale_or_skip(optimizer)
            # a second Ctrl-C waits until the step is counted (Run.enter, as an attribute
            # set: this runs every step, and a call costs more than the set)
            self.run.phase = "update"

    def _adopt(self, optimizer) -> None:
        """An optimizer seen for the first time (before its first step of the watch)."""
        self._optimizers.add(optimizer)
        if self.run.optimizer is None:
            self.run.equip(optimizer=optimizer)
        device = optimizer.param_groups[0]["params"][0].device
        impl, why = impl_for(optimizer, device, self.run.config.optimizer_impl, self.optimize)
        self.run.resolved.setdefault("optimizer_impl", (impl, why))
        if impl in ("fused", "foreach"):
            self._flags_as_found[optimizer] = [_flags(g) for g in optimizer.param_groups]
        self._keep(apply_impl(optimizer, impl))

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self._set_aside or self._kernel_scaled:
            self._after_scaled_step()
        if self._inside:
            return
        if self._lead is None:
            self._lead, self._hand = optimizer, None
            self._describe_steps()
        if self._backwards and self._starts_a_step(optimizer):
            self._close_step()
            self._stepped = {id(optimizer)}
        elif self._backwards:   # its backwards belong to the step just ended
            self.interval.extend_step()
            self._backwards = 0
            self._stepped.add(id(optimizer))
        else:   # a second optimizer on the same backward: the same step
            self._stepped.add(id(optimizer))
        if len(self._stepped) > self._per_step:
            self._per_step = len(self._stepped)
            self._describe_steps()
        # with several optimizers a step, the boundary is after the last of them
        self._at_boundary = len(self._stepped) >= self._per_step

    def _starts_a_step(self, optimizer) -> bool:
        """An optimizer step ends a step of the Run unless it follows another optimizer's
        step with no training batch between and did not step itself since: a GAN's
        generator after its discriminator, on the same batch."""
        return self._batches > 0 or not self._stepped or id(optimizer) in self._stepped

    def _close_step(self, measure: bool = True) -> None:
        run, interval = self.run, self.interval
        run.advance(self._batches or self._backwards)
        self._micro_last = self._backwards
        self._backwards = self._batches = 0
        interval.end_step()
        if interval.steps == self._record_at:
            self._record_due()
        run.phase = "load"   # Run.enter, inlined (above)
        self._at_boundary = True
        if measure and self._measuring:
            self._measure_at_step_end()

    def _describe_steps(self) -> None:
        if self._lead is None:
            why = ("your loop updates its parameters itself (no optimizer stepped): a step "
                   "ends where the gradient of a parameter is zeroed or the parameter "
                   "updated before the next backward()")
            self.run.resolved["step"] = ("an update by hand", why)
            return
        name = type(self._lead).__name__
        if self._per_step < 2:
            self.run.resolved["step"] = ("an optimizer step", f"each step of your {name}")
            return
        self.run.resolved["step"] = ("a training batch", (
            f"{self._per_step} optimizers step in one step of your loop: a step of the Run ends "
            "at an optimizer's step that follows a new training batch (or that optimizer's "
            "own last step); the others' steps after it, on the same batch, are part of it"))

    # -- updates by hand --------------------------------------------------------------------
    def _watch_hand_updates(self, loss: torch.Tensor) -> None:
        """At the first backward: until an optimizer steps, a leaf of its graph tells
        where a step ends."""
        if self._lead is not None:
            return
        leaf = _a_leaf(loss)
        if leaf is not None:
            self._hand = HandSteps(leaf)
            self._describe_steps()

    # -- what the loop's checkpoints see ----------------------------------------------------
    def _wrap_state_dict(self, original):
        watcher = self

        @functools.wraps(original)
        def state_dict(optimizer):
            state = original(optimizer)
            found = watcher._flags_as_found.get(optimizer)
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
