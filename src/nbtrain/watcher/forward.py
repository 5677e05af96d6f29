"""The watch's forward part: the model's forward, seen without a hook on the model (a hook
on it would travel with `torch.save(model)` and `copy.deepcopy`).

- Global module forward hooks until the model is found (the first outermost module called
  with gradients on and trainable parameters), and after, only while every module's call
  matters (without a DataLoader, until a step has shown whether another network feeds the
  model: a GAN's generator).
- Then the model's own calls through its class's `__call__`, while they still matter:
  samples without a DataLoader, autocast or channels_last, a measurement under way.
- A torch.compile'd model's call is wrapped instead, its forward traced without the hooks.

At the model's forward it tells the autocast part (autocast, channels_last), the measuring
part (a step starts) and, without a DataLoader, the tally (the forward's samples); it tells
the watcher when it finds the model (`found`).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import time
import weakref

import torch
from torch.compiler import is_compiling
from torch.multiprocessing.reductions import StorageWeakRef

from ..data.nested import tensors_in
from .loader import batch_dim_of, samples_in

_current_node = torch._C._current_autograd_node   # not None while a backward runs


class Forward:
    """The watch's part that sees the model's forward. `found(model)` is the watcher's, at
    the model's first forward; `active()` says whether this watch still runs (a reference
    to torch.compile kept past it wraps nothing)."""

    def __init__(self, edge, loader, autocast, measure, between, found, active):
        self.edge, self.loader, self.autocast, self.measure = edge, loader, autocast, measure
        self.between = between          # between.py: a step's start without a DataLoader
        self._found, self._active = found, active
        self._depth = 0                 # module calls in progress, until the model is found
        self._hooks = []                # the global forward hooks' handles, while needed
        self.hooked = False             # whether they are in (read every backward: no call)
        self._batch_dim = 0             # where a forward's input holds its samples
        self._outputs = []              # weak references to the last forward's output tensors
        self._in_model = False          # the model's forward runs (its own modules run)
        self._made = {}                 # storages another network's last forward returned
        self._fed_by_network = False    # a forward of the model took one of them (a GAN)

    def install(self) -> None:
        self._add_hooks()
        self.edge.patches.keep(self._remove_hooks)
        self._watch_compiled_calls()

    def model_found(self, model) -> None:
        self._batch_dim = batch_dim_of(model)

    # -- the global hooks ----------------------------------------------------------------------
    def _add_hooks(self) -> None:
        hooks = torch.nn.modules.module
        self._hooks = [
            hooks.register_module_forward_pre_hook(self._forward_starts),
            hooks.register_module_forward_hook(self._forward_ends, with_kwargs=True,
                                               always_call=True)]
        self.hooked = True

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
            # torch's handle forgets this one (torch/nn/modules/module.py, with_kwargs)
            torch.nn.modules.module._global_forward_hooks_with_kwargs.pop(handle.id, None)
        self._hooks = []
        self.hooked = False

    @contextlib.contextmanager
    def _hooks_away(self):
        """The watch's global forward hooks out of torch's dicts, then back in their place."""
        module = torch.nn.modules.module
        dicts = (module._global_forward_pre_hooks, module._global_forward_hooks,
                 module._global_forward_hooks_with_kwargs,
                 module._global_forward_hooks_always_called)
        ours = {handle.id for handle in self._hooks}
        before = [dict(hooks) for hooks in dicts]
        for hooks in dicts:
            for key in ours:
                hooks.pop(key, None)
        try:
            yield
        finally:   # ours back in order (those the call did not drop); others as they are now
            still_ours = {handle.id for handle in self._hooks}
            for hooks, was in zip(dicts, before):
                now = dict(hooks)
                hooks.clear()
                hooks.update((k, v) for k, v in was.items() if k in still_ours or k in now)
                hooks.update((k, v) for k, v in now.items() if k not in was)

    # -- a torch.compile'd model: its call wrapped, its forward traced without the hooks --
    def _watch_compiled_calls(self) -> None:
        """Global hooks make torch.compile trace every submodule's slow path (the corpus's
        programs/compiled.py shows the cost), compile again where they come or go, and warn the
        loop. OptimizedModule's call is wrapped instead: at once where torch has the
        class, else from the first torch.compile."""
        frames = sys.modules.get("torch._dynamo.eval_frame")
        if frames is not None:
            self.edge.patches.patch(frames.OptimizedModule, "__call__", self._wrap_compiled_call)
        else:
            self.edge.patches.patch(torch, "compile", self._wrap_compile)

    def _wrap_compile(self, original):
        part, wrapped = self, []

        @functools.wraps(original)
        def compile(*args, **kwargs):
            result = original(*args, **kwargs)
            # torch._dynamo is imported once a model or function is compiled (not by the
            # decorator form, torch.compile(mode=...)); a reference kept past the watch
            # wraps nothing
            frames = sys.modules.get("torch._dynamo.eval_frame")
            if not wrapped and frames is not None and part._active():
                wrapped.append(True)
                part.edge.patches.patch(frames.OptimizedModule, "__call__", part._wrap_compiled_call)
            return result
        return compile

    def _wrap_compiled_call(self, original):
        part = self

        def traced_without_hooks(module, /, *args, **kwargs):
            with part._hooks_away():
                return original(module, *args, **kwargs)

        def __call__(module, /, *args, **kwargs):
            if part.edge.inside or not part._hooks:
                return original(module, *args, **kwargs)
            return part._watched_call(traced_without_hooks, module, args, kwargs)
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
        part, model = self, self.edge.model

        @functools.wraps(original)
        def __call__(module, /, *args, **kwargs):
            # another of the class, a nested call, or torch.compile tracing: as it is
            if module is not model or part.edge.inside or is_compiling():
                return original(module, *args, **kwargs)
            return part._watched_call(original, module, args, kwargs, model_only=True)
        return __call__

    def _every_module_needed(self) -> bool:
        """Whether the global hooks must stay (each takes every module call off nn.Module's
        fast path): until the model is found, and without a DataLoader until a step has
        shown whether another network feeds it (a GAN's generator: its outputs are no
        samples)."""
        return self.edge.model is None or (
            self.loader.training is None and (self._fed_by_network or self.edge.run.step < 1))

    def _model_calls_needed(self) -> bool:
        """Whether the model's own forward still needs watching: samples without a
        DataLoader, autocast or channels_last, or a measurement under way."""
        return self.loader.training is None or self.autocast.changes_forward() or \
            self.measure.undecided()

    def drop_hooks_if_unneeded(self) -> None:
        """The global hooks removed once every module's call no longer matters; the model's
        own calls, where they still do, watched through its class (_wrap_model_calls)."""
        if not self._hooks or self._every_module_needed():
            return
        if self._model_calls_needed() and not self._wrap_model_calls():
            return
        self._remove_hooks()

    # -- the hooks' work ----------------------------------------------------------------------
    def _forward_starts(self, module, args):
        edge = self.edge
        if is_compiling() or edge.inside:   # traced by torch.compile: the hook is not there
            return None
        if module is not edge.model:
            if edge.model is None:
                self._look_for_model(module, args)
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
        if edge.tally.at_boundary:
            edge.stop_if_asked()
        if torch.is_grad_enabled():   # an evaluation forward (no_grad) is no step's
            if self.loader.training is None:   # else the training batch starts the step
                if edge.tally.at_boundary:
                    self.between.step_starts(time.perf_counter())
                if edge.marks_steps:
                    edge.interval.step_starts()
                self.measure.step_starts()
        return self.autocast.forward_changed(args)

    def _look_for_model(self, module, args) -> None:
        if self._depth == 0 and torch.is_grad_enabled() and \
                any(p.requires_grad for p in module.parameters()):
            self._found(module, args)
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
        return self.autocast.forward_done(output)

    def _count_forward_samples(self, args, kwargs, output) -> None:
        """Each forward's batch adds samples (a policy's states), except a forward fed
        what a network made, not data: the tensor the model's last forward returned (an
        RNN fed its hidden state a word at a time goes on with the same samples), or what
        shares its storage with another network's last output (a GAN's discriminator fed
        its generator's fakes, detached or not, takes the step's batch once, the real one)."""
        inputs = tensors_in(args)
        recurrent = self._outputs and any(ref() is t for t in inputs for ref in self._outputs)
        made = self._made and any(_storage_id(t) in self._made for t in inputs)
        self._fed_by_network = self._fed_by_network or bool(made)
        if not (recurrent or made):
            self.edge.tally.forward(samples_in(args, kwargs, self._batch_dim))
        self._outputs = [weakref.ref(t) for t in tensors_in(output)]

    def _note_made(self, module, output) -> None:
        """Without a DataLoader: the output of a network other than the model, run with
        gradients (a generator), called outside the model's forward; the last one is kept."""
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors and any(p.requires_grad for p in module.parameters()):
            self._made = _held_storages(tensors)


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
