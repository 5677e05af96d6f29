"""The Watcher: one watch of a loop the user wrote. What it sees, through torch's global
hooks and a few functions it wraps until the watch ends; nothing is put on the user's
objects, so the model, its optimizer and their copies pickle as they would unwatched.

- the model: the first outermost module called with gradients on and trainable
  parameters (global module forward hooks, kept only while something needs the model's
  forward: samples without a DataLoader, autocast, channels_last, a measurement due; a
  torch.compile'd model's call is wrapped instead, and runs without them);
- the loss: the tensor `Tensor.backward` runs on, detached (records.py reads it);
- a step: see steps.py (an optimizer step, or an update by hand);
- the batches: see loader.py; the copies to the GPU: copies.py.

What it changes (optimize=True only): precision.py (autocast, fp16's scaler), loader.py
(batched fetch, workers), copies.py (copies one batch ahead), steps.py (the fused
optimizer kernel). What it measures, within the measuring budget: measure.py.
`Watcher.remove` undoes every hook and patch on every way out; `finish` ends the Run.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import time
import weakref
from typing import Optional

import torch
from torch.compiler import is_compiling
from torch.multiprocessing.reductions import StorageWeakRef

from .. import checkpoint as ckpt
from ..run import Run
from ..telemetry.timers import HostTimer, Interval, RestTimer
from .copies import Copies
from .edge import Edge, StopWatching
from .loader import Loader, batch_dim_of, samples_in
from .measure import Measure
from .precision import TRIAL, Precision
from .records import Records
from .settings import AS_WRITTEN
from .steps import Steps

_current_node = torch._C._current_autograd_node   # not None while a backward runs


class Watcher:
    """The hooks of one watch and the parts that do its bookkeeping, each with its own
    state; what they share is the step's edge (edge.py). See the module's docstring."""

    active: Optional["Watcher"] = None   # one watch at a time in a process

    def __init__(self, run: Run, optimize: bool, record_floor_s: float = 0.0,
                 ranks: Optional[tuple] = None):
        self.run, self.optimize = run, optimize
        self.edge = edge = Edge(run, optimize)
        self.precision = Precision(edge)
        self.measure = Measure(edge, self.precision, done=self._drop_forward_hooks_if_unneeded)
        self.copies = Copies(edge)
        self.loader = Loader(edge, self.copies, self.measure)
        self.records = Records(edge, self.loader, record_floor_s)
        self.steps = Steps(edge, self.precision, self.records, self.measure,
                           first_sign=self._first_sign)
        self.ranks = None if ranks is None else _data_parallel(edge, self.loader, ranks)
        self.loader.ranks = self.ranks
        self._depth = 0                 # module calls in progress, until the model is found
        self._forward_hooks = []        # the global forward hooks' handles, while needed
        self._batch_dim = 0             # where a forward's input holds its samples
        self._outputs = []              # weak references to the last forward's output tensors
        self._in_model = False          # the model's forward runs (its own modules run)
        self._made = {}                 # storages another network's last forward returned
        self._fed_by_network = False    # a forward of the model took one of them (a GAN)

    @property
    def model(self):
        return self.edge.model

    @property
    def trained(self) -> bool:
        """Whether the loop's first backward has run."""
        return self.edge.trained

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
        if threads != "auto" and self.optimize:   # for the watch only, as fit does
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            patches.keep(lambda: torch.set_num_threads(before))
            self.run.resolved["num_threads"] = (threads, "asked for (for the watch only)")
        if self.ranks is not None:   # its step hook first: the gradients averaged, then
            self.ranks.install()     # an fp16 step's unscale and inf check
        self.steps.install()
        self._add_forward_hooks()
        patches.keep(self._remove_forward_hooks)
        self._watch_compiled_calls()
        # Tensor.backward calls torch.autograd.backward by its module's name: one patch
        # sees both ways of running a backward
        patches.patch(torch.autograd, "backward", self._wrap_backward)
        patches.patch(torch.autograd, "grad", self._wrap_grad)
        self.loader.install()
        self.records.install()
        self.precision.install()
        self.copies.install()

    def remove(self) -> None:
        """Undo every hook and patch, last first, whatever else fails."""
        self.measure.end()
        self.precision.exit_autocast()
        self.precision.take_back_scale()   # a step that failed: no post hook took them back
        self.copies.forget()
        self.edge.patches.undo_all()

    # -- the model's forward: global hooks, since a hook on the model would travel with it --
    def _add_forward_hooks(self) -> None:
        hooks = torch.nn.modules.module
        self._forward_hooks = [
            hooks.register_module_forward_pre_hook(self._forward_starts),
            hooks.register_module_forward_hook(self._forward_ends, with_kwargs=True,
                                               always_call=True)]

    def _remove_forward_hooks(self) -> None:
        for handle in self._forward_hooks:
            handle.remove()
            # torch's handle forgets this one (torch/nn/modules/module.py, with_kwargs)
            torch.nn.modules.module._global_forward_hooks_with_kwargs.pop(handle.id, None)
        self._forward_hooks = []

    @contextlib.contextmanager
    def _forward_hooks_away(self):
        """The watch's global forward hooks out of torch's dicts, then back in their place."""
        module = torch.nn.modules.module
        dicts = (module._global_forward_pre_hooks, module._global_forward_hooks,
                 module._global_forward_hooks_with_kwargs,
                 module._global_forward_hooks_always_called)
        ours = {handle.id for handle in self._forward_hooks}
        before = [dict(hooks) for hooks in dicts]
        for hooks in dicts:
            for key in ours:
                hooks.pop(key, None)
        try:
            yield
        finally:   # ours back in order (those the call did not drop); others as they are now
            still_ours = {handle.id for handle in self._forward_hooks}
            for hooks, was in zip(dicts, before):
                now = dict(hooks)
                hooks.clear()
                hooks.update((k, v) for k, v in was.items() if k in still_ours or k in now)
                hooks.update((k, v) for k, v in now.items() if k not in was)

    # -- a torch.compile'd model: its call wrapped, its forward traced without the hooks --
    def _watch_compiled_calls(self) -> None:
        """Global hooks make torch.compile trace every submodule's slow path (the corpus's
        compiled.py shows the cost), compile again where they come or go, and warn the
        loop. OptimizedModule's call is wrapped
        instead: at once where torch has the class, else from the first torch.compile."""
        frames = sys.modules.get("torch._dynamo.eval_frame")
        if frames is not None:
            self.edge.patches.patch(frames.OptimizedModule, "__call__", self._wrap_compiled_call)
        else:
            self.edge.patches.patch(torch, "compile", self._wrap_compile)

    def _wrap_compile(self, original):
        watcher, wrapped = self, []

        @functools.wraps(original)
        def compile(*args, **kwargs):
            result = original(*args, **kwargs)
            # torch._dynamo is imported once a model or function is compiled (not by the
            # decorator form, torch.compile(mode=...)); a reference kept past the watch
            # wraps nothing
            frames = sys.modules.get("torch._dynamo.eval_frame")
            if not wrapped and frames is not None and Watcher.active is watcher:
                wrapped.append(True)
                watcher.edge.patches.patch(frames.OptimizedModule, "__call__", watcher._wrap_compiled_call)
            return result
        return compile

    def _wrap_compiled_call(self, original):
        watcher = self

        def traced_without_hooks(module, /, *args, **kwargs):
            with watcher._forward_hooks_away():
                return original(module, *args, **kwargs)

        def __call__(module, /, *args, **kwargs):
            if watcher.edge.inside or not watcher._forward_hooks:
                return original(module, *args, **kwargs)
            return watcher._watched_call(traced_without_hooks, module, args, kwargs)
        return __call__

    def _watched_call(self, call, module, args, kwargs, model_only: bool = False):
        """`call(module, *args, **kwargs)` with what the forward hooks would do around it,
        as torch's _call_impl runs them; `model_only`: `module` is the model, called
        neither traced nor nested (the model's class's own calls)."""
        starts, ends = (self._model_starts, self._model_ends) if model_only else \
            (self._forward_starts, self._forward_ends)
        try:
            changed = starts(module, args)
            args = args if changed is None else changed
            output = call(module, *args, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):   # torch silences an always_call hook's
                ends(module, args, kwargs, None)   # error, for the loop's
            raise
        done = ends(module, args, kwargs, output)
        return output if done is None else done

    # -- the model's own calls, once no other module's call matters ------------------------
    def _wrap_model_calls(self) -> bool:
        """The model's calls through its class's __call__, where that is nn.Module's: a
        class attribute does not travel with the model (a deepcopy, a pickle) as a hook on
        it would, and its submodules keep nn.Module's fast path. False for a class with a
        __call__ of its own (torch.compile's OptimizedModule)."""
        cls = type(self.edge.model)
        if cls.__call__ is not torch.nn.Module.__call__:
            return False
        self.edge.patches.patch(cls, "__call__", self._wrap_model_call)
        return True

    def _wrap_model_call(self, original):
        watcher, model = self, self.edge.model

        @functools.wraps(original)
        def __call__(module, /, *args, **kwargs):
            # another of the class, a nested call, or torch.compile tracing: as it is
            if module is not model or watcher.edge.inside or is_compiling():
                return original(module, *args, **kwargs)
            return watcher._watched_call(original, module, args, kwargs, model_only=True)
        return __call__

    def _every_module_needed(self) -> bool:
        """Whether the global hooks must stay (each takes every module call off nn.Module's
        fast path): until the model is found, and without a DataLoader until a step has
        shown whether another network feeds it (a GAN's generator: its outputs are no
        samples)."""
        return self.edge.model is None or (
            self.loader.training is None and (self._fed_by_network or self.run.step < 1))

    def _model_calls_needed(self) -> bool:
        """Whether the model's own forward still needs watching: samples without a
        DataLoader, autocast or channels_last, or a measurement under way."""
        return self.loader.training is None or self.precision.changes_forward() or \
            self.measure.undecided()

    def _drop_forward_hooks_if_unneeded(self) -> None:
        """The global hooks removed once every module's call no longer matters; the model's
        own calls, where they still do, watched through its class (_wrap_model_calls)."""
        if not self._forward_hooks or self._every_module_needed():
            return
        if self._model_calls_needed() and not self._wrap_model_calls():
            return
        self._remove_forward_hooks()

    def _forward_starts(self, module, args):
        edge = self.edge
        if is_compiling() or edge.inside:   # traced by torch.compile: the hook is not there
            return None
        if module is not edge.model:
            if edge.model is None:
                self._look_for_model(module)
                self._in_model = module is edge.model   # its layers are no other network
            return None
        return self._model_starts(module, args)

    def _model_starts(self, model, args):
        """The model's forward starts, neither traced nor nested: the step's start without a
        DataLoader, a stop asked for, autocast. The args changed, or None."""
        if _current_node() is not None:   # recomputed in a backward (checkpointing)
            return None
        edge = self.edge
        self._in_model = True
        if edge.at_boundary:
            edge.stop_if_asked()
        if torch.is_grad_enabled():   # an evaluation forward (no_grad) is no step's
            if self.loader.training is None:   # else the training batch starts the step
                if edge.marks_steps:
                    edge.interval.step_starts()
                self.measure.step_starts()
        return self.precision.forward_changed(args)

    def _look_for_model(self, module) -> None:
        if self._depth == 0 and torch.is_grad_enabled() and \
                any(p.requires_grad for p in module.parameters()):
            self._found_model(module)
        else:
            self._depth += 1

    def _forward_ends(self, module, args, kwargs, output):
        edge = self.edge
        if is_compiling() or edge.inside:
            return None
        if module is not edge.model:
            if edge.model is None:
                self._depth -= 1
            elif not self._in_model and self.loader.training is None:
                self._note_made(module, output)
            return None
        return self._model_ends(module, args, kwargs, output)

    def _model_ends(self, model, args, kwargs, output):
        """The model's forward ends, neither traced nor nested: its samples counted without
        a DataLoader, autocast left. The output changed, or None."""
        if _current_node() is not None:
            return None
        self._in_model = False
        if self.loader.training is None and torch.is_grad_enabled():   # no DataLoader
            self._count_forward_samples(args, kwargs, output)
        return self.precision.forward_done(output)

    def _count_forward_samples(self, args, kwargs, output) -> None:
        """Each forward's batch adds samples (a policy's states), except a forward fed
        what a network made, not data: the tensor the model's last forward returned (an
        RNN fed its hidden state a word at a time goes on with the same samples), or what
        shares its storage with another network's last output (a GAN's discriminator fed
        its generator's fakes, detached or not, takes the step's batch once, the real one)."""
        inputs = _tensors_in(args)
        recurrent = self._outputs and any(ref() is t for t in inputs for ref in self._outputs)
        made = self._made and any(_storage_id(t) in self._made for t in inputs)
        self._fed_by_network = self._fed_by_network or bool(made)
        if not (recurrent or made):
            self.edge.samples += samples_in(args, kwargs, self._batch_dim)
        self._outputs = [weakref.ref(t) for t in _tensors_in(output)]

    def _note_made(self, module, output) -> None:
        """Without a DataLoader: the output of a network other than the model, run with
        gradients (a generator), called outside the model's forward; the last one is kept."""
        tensors = [t for t in _tensors_in(output) if t.requires_grad]
        if tensors and any(p.requires_grad for p in module.parameters()):
            self._made = _held_storages(tensors)

    def _found_model(self, model) -> None:
        """The model the loop trains, at the start of its first forward: what depends on it
        is resolved from what the watch knows; nothing is run to find out."""
        edge = self.edge
        edge.model = model
        self.run.equip(model=model)
        if self.ranks is not None:
            self.ranks.found_model(model)
        self._batch_dim = batch_dim_of(model)
        device = next(p for p in model.parameters() if p.requires_grad).device
        self._ensure_interval(device)
        self.run.resolved.setdefault("num_threads", (torch.get_num_threads(),
                                                     AS_WRITTEN + " (torch's setting)"))
        amp = self.precision.resolve(model)
        self.measure.plan(model, bf16_trial=amp[0] == TRIAL)
        if self.copies.pending and self.loader.training is None:
            self.copies.none("your loop iterates no DataLoader (its model ran before any batch)")

    def _ensure_interval(self, device: torch.device) -> Interval:
        edge = self.edge
        if edge.interval is None:
            edge.device = device
            self.run.resolved["loop"] = ("your own", "nt.watch: the loop you wrote, watched")
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
        scaled = self.precision.scaled_for_backward

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
            watcher.precision.gradients_handed_back()
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
        if steps.in_step and edge.backwards:   # a closure's evaluation after its first
            edge.samples = 0
            return
        if edge.backwards and steps.hand is not None and steps.hand.updated():
            steps.close()   # a loop updating by hand: its update came before this
        if edge.at_boundary:
            if edge.stop_asked():   # Edge.stop_if_asked, inlined: this runs every step
                raise StopWatching()
            edge.at_boundary = False
            if self._forward_hooks and edge.trained:   # outside any forward hook's call
                self._drop_forward_hooks_if_unneeded()
        if not edge.trained:
            self._first_backward(loss)
        self.records.add_loss(loss, edge.samples)
        edge.samples = 0
        edge.backwards += 1

    def _after_hand_backward(self) -> None:
        steps = self.steps
        steps.hand.note()
        if self.measure.count is not None:   # by hand: a count ends with its backward
            self.measure.counted_backward(steps.micro_last)

    def _first_backward(self, loss: torch.Tensor) -> None:
        self._first_sign(loss.device)
        self.steps.watch_hand_updates(loss)

    def _first_sign(self, device: torch.device) -> None:
        """The loop's first sign of training (a backward, or an optimizer's step)."""
        self.edge.trained = True
        self.loader.adopt()
        self._ensure_interval(device)
        self._drop_forward_hooks_if_unneeded()

    # -- the end ------------------------------------------------------------------------------
    def finish(self, exc: Optional[BaseException]) -> bool:
        """End the Run: undo every hook first, then the last records, then the state.
        True when `exc` is the watch's own stop (the with block swallows it)."""
        self.precision.last_update()
        self.remove()
        edge, run = self.edge, self.run
        interval = edge.interval
        self.copies.finish(has_loader=self.loader.training is not None)
        self.measure.say_what_was_not_measured()
        if interval is not None:
            with contextlib.suppress(Exception):   # the user's error is the one to report
                if exc is None and self.steps.hand is not None and edge.backwards:
                    self.steps.close(measure=False)   # the last update by hand ran after its backward
                interval.drop_unfinished_step()
                if interval.steps:
                    self.records.log()
                self.records.flush()
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
        elif not self.edge.trained:
            seen = f"the forward of your {type(model).__name__}, but no backward()"
        else:   # a backward's update by hand may be unseen: it counts as a step
            seen = "backward(), but no optimizer step"
        if self.loader.training is not None:
            seen = f"batches of a DataLoader; {seen}"
        return f"nt.watch saw no training step: {seen}"


def _data_parallel(edge, loader, ranks: tuple):
    """This rank's data-parallel part (ranks.py), loaded by a watch of N processes only:
    torch.distributed is not a single process's start."""
    from .ranks import DataParallel
    return DataParallel(edge, loader, *ranks)


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


def _storage_id(tensor: torch.Tensor):
    """The tensor's storage, the same for its views and detached copies, as an int (None
    for a tensor without one: sparse, or functorch's)."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _held_storages(tensors) -> dict:
    """The tensors' storages by _storage_id, each held by a weak reference: while it is
    held no other storage takes its id, and the tensors' memory is not kept."""
    held = {}
    for tensor in tensors:
        key = _storage_id(tensor)
        if key is not None:
            held[key] = StorageWeakRef(tensor.untyped_storage())
    return held


def _transformed(loss: torch.Tensor) -> bool:
    """Whether autograd.grad runs inside a torch.func transform (its tensors wrapped)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(loss)


def _tensors_in(value, depth: int = 2) -> list:
    """The tensors of a forward's arguments or output, two levels down (an LSTM's
    `(out, (h, c))`)."""
    if isinstance(value, torch.Tensor):
        return [value]
    found = []
    if depth and isinstance(value, (tuple, list)):
        for item in value:   # a call only for an item that is no tensor (it runs every forward)
            if isinstance(item, torch.Tensor):
                found.append(item)
            else:
                found.extend(_tensors_in(item, depth - 1))
    return found
