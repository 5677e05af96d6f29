"""The Watcher: one watch of a loop the user wrote. What it sees, through torch's global
hooks and a few functions it wraps until the watch ends; nothing is put on the user's
objects, so the model, its optimizer and their copies pickle as they would unwatched.

- the model's forward: forward.py (the model found, its samples without a DataLoader);
- the loss: the tensor `Tensor.backward` runs on, detached (records.py reads it);
- a step: see steps.py (an optimizer step, or an update by hand);
- the batches: see loader.py; the copies to the GPU: copies.py.

What it changes (optimize=True only, as settings.py's Plan allows): autocast.py
(autocast, channels_last), fp16.py (fp16's loss scaling, where scaling.py finds that it
may apply), loader.py (batched fetch, workers), copies.py (copies one batch ahead),
steps.py (the fused optimizer kernel). What it measures, within the measuring budget:
measure.py, and modules.py's window over the model's leaf modules. This module keeps the
wiring, the backward, the model found and the end: `Watcher.remove` undoes every hook and
patch on every way out; `finish` ends the Run.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import time
from typing import Optional

import torch

from .. import checkpoint as ckpt
from ..auto import frameworks
from ..run import Run
from ..telemetry.timers import HostTimer, Interval, RestTimer
from .autocast import TRIAL, Autocast
from .between import Between
from .copies import Copies
from .edge import Edge, StopWatching
from .forward import Forward
from .scaling import loss_scaling
from .loader import Loader
from .measure import Measure
from .modules import Modules
from .records import Records
from .settings import AS_WRITTEN, Plan
from .steps import Steps

_current_node = torch._C._current_autograd_node   # not None while a backward runs


class Watcher:
    """The hooks of one watch and the parts that do its bookkeeping, each with its own
    state; what they share is the step's edge (edge.py). See the module's docstring."""

    active: Optional["Watcher"] = None   # one watch at a time in a process

    def __init__(self, run: Run, optimize: bool, record_floor_s: float = 0.0,
                 ranks: Optional[tuple] = None):
        self.run = run
        self.edge = edge = Edge(run, Plan(run.config, optimize))
        self.autocast = Autocast(edge)
        self.scaling = loss_scaling(edge, self.autocast)
        self.forward = None   # Forward, below: the measuring part calls back into it
        self.modules = Modules(edge)
        self.measure = Measure(edge, self.autocast, self.modules,
                               done=lambda: self.forward.drop_hooks_if_unneeded())
        self.copies = Copies(edge)
        self.between = Between(edge)
        self.ranks = None if ranks is None else _data_parallel(
            edge, ranks, trains_on_a_loader=lambda: self.loader.training is not None)
        self.loader = Loader(edge, self.copies, self.measure, self.between, self.ranks)
        self.forward = Forward(edge, self.loader, self.autocast, self.measure, self.between,
                               found=self._found_model, active=lambda: Watcher.active is self)
        self.records = Records(edge, self.loader, record_floor_s)
        self.steps = Steps(edge, self.scaling, self.records, self.measure, self.between,
                           first_sign=self._first_sign)

    @property
    def model(self):
        return self.edge.model

    @property
    def trained(self) -> bool:
        """Whether the loop's first backward has run."""
        return self.edge.tally.trained

    # -- install and undo -------------------------------------------------------------------
    def install(self) -> None:
        if Watcher.active is not None:
            raise RuntimeError("nt.watch is already watching a loop in this process: end that "
                               "`with nt.watch()` block first (a watch inside a watch would "
                               "count every step twice).")
        Watcher.active = self
        self.edge.patches.keep(lambda: setattr(Watcher, "active", None))
        try:
            self._install_hooks()
        except BaseException:
            self.remove()
            raise

    def _install_hooks(self) -> None:
        patches = self.edge.patches
        threads = self.run.config.num_threads
        if threads != "auto" and self.edge.plan.may("num_threads"):   # the watch only, as fit
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            patches.keep(lambda: torch.set_num_threads(before))
            self.run.resolved["num_threads"] = (threads, "asked for (for the watch only)")
        if self.ranks is not None:   # its step hook first: the gradients averaged, then
            self.ranks.install()     # an fp16 step's unscale and inf check
        self.steps.install()
        self.forward.install()
        # Tensor.backward calls torch.autograd.backward by its module's name: one patch
        # sees both ways of running a backward
        patches.patch(torch.autograd, "backward", self._wrap_backward)
        patches.patch(torch.autograd, "grad", self._wrap_grad)
        self.loader.install()
        self.records.install()
        self.scaling.install()
        self.copies.install()
        self.between.install()

    def remove(self) -> None:
        """Undo every hook and patch, last first, whatever else fails."""
        self.measure.end()
        self.autocast.exit_autocast()
        self.scaling.take_back_scale()   # a step that failed: no post hook took them back
        self.copies.forget()
        self.edge.patches.undo_all()

    def _found_model(self, model, args) -> None:
        """The model the loop trains, at the start of its first forward (`args`, its
        inputs): what depends on it is resolved from what the watch knows; nothing is run
        to find out."""
        edge = self.edge
        edge.model = model
        self.run.equip(model=model)
        self._framework_found(frameworks.running(), model)
        if self.ranks is not None:
            self.ranks.found_model(model)
        self.forward.model_found(model)
        device = next(p for p in model.parameters() if p.requires_grad).device
        self._ensure_interval(device)
        self.run.resolved.setdefault("num_threads", (torch.get_num_threads(),
                                                     AS_WRITTEN + " (torch's setting)"))
        amp = self.autocast.resolve(model, args)
        self.scaling.begin(amp == "fp16", device)
        self.measure.plan(model, self.autocast.key, bf16_trial=amp == TRIAL)
        if self.copies.pending and self.loader.training is None:
            self.copies.none("your loop iterates no DataLoader (its model ran before any batch)")

    def _framework_found(self, framework, model) -> None:
        """The loop is a framework's (its code on the stack of the first forward or
        backward): named so, the Run's model the one it holds (the LightningModule whose
        training_step called this one), and what the framework decides for the whole model
        (its precision, the model's memory layout) left to its own knob."""
        if framework is None or self.run.resolved.get("loop", ("",))[0] == framework.name:
            return
        self.run.resolved["loop"] = (framework.name,
                                     f"nt.watch: {framework.name}'s loop, watched")
        if framework.sums_micro_batches:   # the loss a micro-batch's backward gets is a share
            self.records.sum_micro_batches(framework.name)
        optimizer_class = frameworks.optimizer_class(framework)
        if optimizer_class is not None:
            self.steps.hook_other_optimizer(optimizer_class)
        if model is None:   # found at the first backward: the forward's changes are decided
            return
        holder = frameworks.holding_module(model, sys._getframe(2))
        if holder is not model:
            self.run.equip(model=holder)
        plan = self.edge.plan
        plan.refuse("amp", f"{framework.name} decides it: {framework.amp.format(amp='bf16')}")
        plan.refuse("channels_last", f"{framework.name} holds the model: convert it before "
                                     "training, model.to(memory_format=torch.channels_last)")

    def _ensure_interval(self, device: torch.device) -> Interval:
        edge = self.edge
        if edge.interval is None:
            edge.device = device
            self.run.resolved.setdefault("loop", (frameworks.OWN,
                                                  "nt.watch: the loop you wrote, watched"))
            self.run.resolved.setdefault("device", (str(device), "your loop's: where the model is"))
            # on the CPU a step's compute is what its data wait leaves (data wait: the
            # loader's time; compute: the rest), with no timer call per step (RestTimer)
            edge.interval = Interval(device, self.run.step, self.run.config.telemetry,
                                     host_timer=RestTimer if device.type == "cpu" else HostTimer)
            edge.marks_steps = edge.interval.timer.marks_steps   # step_starts counts
            if device.type == "cuda":   # the watch's peak, not the kernel's
                torch.cuda.reset_peak_memory_stats(device)
        return edge.interval

    # -- backward: the loss, one micro-batch ------------------------------------------------
    def _wrap_backward(self, original):
        watcher, edge, steps, ranks = self, self.edge, self.steps, self.ranks
        scaled = self.scaling.scaled_for_backward

        @functools.wraps(original)
        def backward(tensors, *args, **kwargs):
            if edge.inside or _current_node() is not None:   # nested: checkpoint's recompute
                return original(tensors, *args, **kwargs)
            if isinstance(tensors, torch.Tensor):
                watcher._on_backward(tensors)
            else:
                tensors = _read_once(tensors)
                loss = _loss_of(tensors)
                if loss is None:
                    return original(tensors, *args, **kwargs)
                watcher._on_backward(loss)
            if ranks is not None:
                ranks.backward_starts()
            # a closure's backward (LBFGS) runs inside the step: there is no unscale after it
            result = original(tensors if steps.in_step else scaled(tensors), *args, **kwargs)
            if ranks is not None:
                ranks.backward_done()
            if steps.hand is not None:
                watcher._after_hand_backward()
            return result
        return backward

    def _wrap_grad(self, original):
        """torch.autograd.grad: a backward of the loop's when its gradients are an update's
        (a hand update, a meta-learning step): taken with respect to parameters, not an
        input (an adversarial example, a saliency map, a Jacobian), and not a graph of
        their own (create_graph: an inner step, a gradient penalty) nor inside
        torch.func's transforms."""
        watcher, edge = self, self.edge

        @functools.wraps(original)
        def grad(outputs, inputs=None, *args, **kwargs):
            if edge.inside or _current_node() is not None or \
                    kwargs.get("create_graph", args[2] if len(args) > 2 else False):
                return original(outputs, inputs, *args, **kwargs)
            outputs, inputs = _read_once(outputs), _read_once(inputs)
            loss = _loss_of(outputs)
            if loss is None or _transformed(loss) or not watcher._of_weights(inputs):
                return original(outputs, inputs, *args, **kwargs)
            if watcher.ranks is not None:
                watcher.ranks.refuse_hand_gradients()
            watcher._on_backward(loss)
            watcher.scaling.gradients_handed_back()
            result = original(outputs, inputs, *args, **kwargs)
            if watcher.steps.hand is not None:
                watcher._after_hand_backward()
            return result
        return grad

    def _of_weights(self, inputs) -> bool:
        """Whether autograd.grad's inputs are weights: an nn.Parameter among them, or, with
        no model found, any tensor (a network that is a list of tensors)."""
        tensors = [inputs] if isinstance(inputs, torch.Tensor) else inputs or ()
        return self.edge.model is None or \
            any(isinstance(t, torch.nn.Parameter) for t in tensors)

    def _on_backward(self, loss: torch.Tensor) -> None:
        edge, steps = self.edge, self.steps
        tally = edge.tally
        if steps.in_step and tally.backwards and not tally.fresh:   # a closure's evaluation
            tally.reevaluated()   # after its first (a new batch: a micro-batch, steps.py)
            return
        if tally.backwards and steps.hand is not None and steps.hand.updated():
            steps.close()   # a loop updating by hand: its update came before this
        if tally.at_boundary:
            if edge.stop_asked():   # Edge.stop_if_asked, inlined: this runs every step
                raise StopWatching()
            if self.forward.hooked and tally.trained:   # outside any forward hook's call
                self.forward.drop_hooks_if_unneeded()
            if self.loader.epoch_owed:
                self.loader.pay_owed_epoch()
        if not tally.trained:
            self._first_backward(loss)
        self.records.add_loss(loss, tally.backward())

    def _after_hand_backward(self) -> None:
        steps = self.steps
        steps.hand.note()
        if self.measure.count is not None:   # by hand: a count ends with its backward
            self.measure.counted_backward(steps.micro_last)

    def _first_backward(self, loss: torch.Tensor) -> None:
        if self.run.resolved.get("loop", ("",))[0] == frameworks.OWN:   # Accelerate: its
            self._framework_found(frameworks.running(), None)   # backward, the user's forward
        self._first_sign(loss.device)
        self.steps.watch_hand_updates(loss)

    def _first_sign(self, device: torch.device) -> None:
        """The loop's first sign of training (a backward, or an optimizer's step)."""
        self.edge.tally.training()
        self.loader.adopt()
        self._ensure_interval(device)
        self.forward.drop_hooks_if_unneeded()

    # -- the end ------------------------------------------------------------------------------
    def finish(self, exc: Optional[BaseException]) -> bool:
        """End the Run: undo every hook first, then the last records, then the state.
        True when `exc` is the watch's own stop (the with block swallows it)."""
        self.scaling.last_update()
        self.between.end()
        self.remove()
        edge, run = self.edge, self.run
        interval = edge.interval
        self.copies.finish(has_loader=self.loader.training is not None)
        self.measure.say_what_was_not_measured(exc)
        if interval is not None:
            with contextlib.suppress(Exception):   # the user's error is the one to report
                if exc is None and self.steps.hand is not None and edge.tally.backwards:
                    self.steps.close(measure=False)   # the last update by hand ran after its backward
                interval.drop_unfinished_step()
                self.records.last(self.steps.lr, self.between.last_end)
        # after the last records: a non-finite loss in them stops the run too (run.diverge)
        stopped = isinstance(exc, StopWatching) or (exc is None and run.stop_requested)
        error = exc if exc is not None and not isinstance(
            exc, (StopWatching, KeyboardInterrupt)) else None
        if stopped or isinstance(exc, KeyboardInterrupt):
            state = "interrupted" if run.interrupted or isinstance(exc, KeyboardInterrupt) \
                else "stopped"
        else:
            state = "failed" if error is not None else "finished"
        device = edge.device or torch.device("cpu")
        untrained = self.no_training_step() if state == "finished" and run.step == 0 else None
        run.finish(state, read_rng=lambda: ckpt.rng_state(device),
                   elapsed_s=time.perf_counter() - edge.started, error=error, message=untrained)
        return isinstance(exc, StopWatching)

    def no_training_step(self) -> str:
        """What a watch that counted no training step saw, in words: a watch around code
        that never trains must not read as a finished run."""
        model = self.edge.model
        if model is None:
            seen = ("no forward of a module with trainable parameters under gradients, no "
                    "backward(), no optimizer step")
        elif not self.edge.tally.trained:
            seen = f"the forward of your {type(model).__name__}, but no backward()"
        else:   # a backward's update by hand may be unseen: it counts as a step
            seen = "backward(), but no optimizer step"
        if self.loader.training is not None:
            seen = f"batches of a DataLoader; {seen}"
        return f"nt.watch saw no training step: {seen}"


def _data_parallel(edge, ranks: tuple, trains_on_a_loader):
    """This rank's data-parallel part (data_parallel.py), loaded by a watch of N processes
    only: torch.distributed is not a single process's start."""
    from .data_parallel import DataParallel
    return DataParallel(edge, *ranks, trains_on_a_loader)


def _read_once(value):
    """A generator of tensors (model.parameters()) as a tuple, read once, here."""
    if value is None or isinstance(value, (torch.Tensor, list, tuple)):
        return value
    return tuple(value)


def _loss_of(tensors):
    """The loss a backward runs on: the tensor, or the sum of several (autograd.backward's
    and autograd.grad's sequences; detached, a sum no graph needs); None for what is not
    tensors (a GradientEdge)."""
    if isinstance(tensors, torch.Tensor):
        return tensors
    if not isinstance(tensors, (list, tuple)) or \
            not all(isinstance(t, torch.Tensor) for t in tensors) or not tensors:
        return None
    if len(tensors) == 1:
        return tensors[0]
    return torch.stack([t.detach().float().sum() for t in tensors]).sum()


def _transformed(loss: torch.Tensor) -> bool:
    """Whether autograd.grad runs inside a torch.func transform (its tensors wrapped)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(loss)
