"""The own-loop engine: a training loop the user wrote, watched from outside and fed into
an ordinary Run, so every view of nbtrain works on it unchanged.

It sees the loop through PyTorch's own hooks and a few functions it wraps for the
watch only:

- a step is an optimizer step: torch's global optimizer step hooks
  (`register_optimizer_step_pre_hook` / `_post_hook`); several `backward` per step
  (gradient accumulation) and several optimizers stepping on one backward are one step;
- the loss is the tensor `Tensor.backward` ran on, detached and kept on the device (the
  Interval reads it once per record, as in fit; on the CPU, where a read is no sync, it
  is read at once); a record every `log_every` steps, and with the default log_every at
  least RECORD_EVERY_S and at most RECORDS_MERGED x log_every steps apart from step
  READS_COUNTED_FOR on (_record_due);
- the model is the first module called with trainable parameters; samples are counted
  from the training DataLoader's batches, or, where the loop iterates none (or autocast
  or channels_last change the forward), from the batch the model's outermost forward
  received (module forward hooks);
- data wait is the time inside the iterator of a DataLoader (`DataLoader.__iter__`);
- host reads (`.item()`, `.tolist()`, `.cpu()`, `.numpy()` of the step's tensors) are
  counted for the diagnosis over the first READS_COUNTED_FOR steps, then that rate stands.

With `optimize=True` it applies the speed settings to the user's objects for the watch
only: autocast around the model's forward, batched fetch for a DataLoader over a
TensorDataset, the fused optimizer kernel, and on CUDA the batch tensors the loop copies
to the GPU copied one batch ahead from pinned memory, its own `.to(device)` handed the
copy (data/moves.py). `Watcher.remove` undoes every hook and patch;
the Run ends through `Watcher.finish`.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import time
import weakref
from collections import deque
from typing import Optional

import torch
from torch.compiler import is_compiling
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)
from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler,
                              SequentialSampler, TensorDataset, default_collate)

from . import checkpoint as ckpt
from . import flops
from .config import SETTINGS, ConfigError, TrainConfig, as_config
from .data import shippable
from .data.batches import batch_chunks, pinned_rows, stop_workers
from .data.moves import AheadCopies, MoveLog, plain, resolve_copies
from .data.nested import batch_len
from .devices import available_cores, cpu_bf16_choice, cpu_bf16_feature, gpu_has_bf16
from .loop import flush_interval, log_interval
from .memory import leaves_no_trace
from .optim import apply_impl, impl_for
from .run import Run
from .telemetry import HostTimer, Interval, RestTimer

# The TrainConfig fields a watch can apply to someone else's loop; the rest (epochs,
# batch_size, optimizer, lr, scheduler, ...) the loop itself decides.
OWN_LOOP_FIELDS = ("amp", "batched_fetch", "pin_memory", "prefetch_to_device", "num_workers",
                   "num_threads", "optimizer_impl", "channels_last", "log_every", "count_flops",
                   "telemetry", "history_limit", "on_nan")
# Settings a watch does not apply: asked for, they are refused rather than ignored.
NOT_APPLIED = {
    "persistent_workers": "the workers nt.watch starts are kept across epochs already",
}
KEPT = "your loop's own"
_item = torch._C.TensorBase.item   # torch's own, under the watch's counting wrapper
READS = ("item", "tolist")   # the host reads counted when the tensor has a graph, too
READS_COUNTED_FOR = 30   # steps; then the rate counted stands (_stop_counting_reads)
# The default log_every's records, from READS_COUNTED_FOR on: every 10 steps, at least
# RECORD_EVERY_S and at most RECORDS_MERGED x 10 steps apart. A record costs ~50 us of cold
# Python (docs/guide/measured.md): every 10 steps of a 0.5 ms step, that is 1% of the loop's
# time, for 200 records a second where the Dashboard draws 4 times a second. The bound in
# steps bounds how late a non-finite loss on a GPU is seen (on the CPU it is seen at once,
# _record_due). A log_every the user sets is kept exactly.
RECORD_EVERY_S = 0.05
RECORDS_MERGED = 10


class StopWatching(BaseException):
    """Raised into the user's loop at a step boundary after Stop or Ctrl-C; the watch
    swallows it. A BaseException, as KeyboardInterrupt, so `except Exception` in the loop
    does not catch it."""


def record_floor_s(config: TrainConfig, settings: dict) -> float:
    """How far apart the watch's records are at least (RECORD_EVERY_S), or 0.0 where the
    user set log_every (in `settings`, or a config's other than the default)."""
    chosen = "log_every" in settings or config.log_every != _defaults().log_every
    return 0.0 if chosen else RECORD_EVERY_S


def own_loop_config(config, settings: dict) -> TrainConfig:
    """The watch's TrainConfig: `config` with `settings`; a field the loop decides (given
    here, or set in `config`) is a ConfigError naming it."""
    base = _defaults() if config is None else as_config(config)
    defaults = _defaults()
    for name in settings:
        if name not in SETTINGS:
            raise ConfigError(f"nt.watch() got an unknown setting {name!r}; it takes "
                              f"{', '.join(OWN_LOOP_FIELDS)}.", field=name)
    changed = [name for name in SETTINGS if name in settings
               or getattr(base, name) != getattr(defaults, name)]
    for name in changed:
        if name in NOT_APPLIED:
            raise ConfigError(f"TrainConfig.{name} is not applied to a loop of your own: "
                              f"{NOT_APPLIED[name]}.", field=name)
    if settings.get("on_nan", base.on_nan) == "skip":
        raise ConfigError("TrainConfig.on_nan='skip' would skip your loop's update, which "
                          "runs in your code: nt.watch takes on_nan='stop' (a non-finite loss "
                          "ends the loop at the next step boundary).", field="on_nan")
    loops = [name for name in changed if name not in OWN_LOOP_FIELDS]
    if loops:
        raise ConfigError(f"TrainConfig.{loops[0]} belongs to your loop: under nt.watch the loop "
                          f"you wrote decides it (its DataLoader, optimizer, scheduler, "
                          f"epochs). Change it in your code; nt.watch takes "
                          f"{', '.join(OWN_LOOP_FIELDS)}.", field=loops[0])
    return base.replace(**settings)   # one construction, from the defaults or `config`


@functools.lru_cache(maxsize=1)
def _defaults() -> TrainConfig:
    """TrainConfig's defaults, to compare with and never handed out: a cell that re-runs a
    watch builds one config, not three (each construction checks every field)."""
    return TrainConfig()


class Watcher:
    """The hooks of one watch and the bookkeeping they do; see the module's docstring."""

    active: Optional["Watcher"] = None   # one watch at a time in a process

    def __init__(self, run: Run, optimize: bool, record_floor_s: float = 0.0):
        self.run, self.optimize = run, optimize
        self.model = self.interval = self.device = None
        self.amp = "off"
        self.scaler = None              # amp='fp16': the GradScaler the hooks apply
        self._to_channels_last = False  # channels_last=True: convert at the next forward
        self._channels_last = False     # the model is in NHWC now
        self._unscaled = set()          # ids of the optimizers unscaled since the last update
        self._kernel_scaled = []        # fused optimizers holding the scale, until their step ends
        self._in_kernel = set()         # ids of those inf-checked this step: gradients still scaled
        self._set_aside = []            # (param, grad) of a step skipped on inf, until after it
        self._undo = []                 # what remove() calls, last first
        self._inside = False            # nbtrain's own code runs: its calls are not the loop's
        self._depth = 0                 # module calls in progress, until the model is found
        self._candidate = None
        self._model_hooks = []
        self._autocast = []             # the autocast contexts entered in the model's forward
        self._samples = 0               # samples forwarded since the last backward
        self._loader_counts = False     # they come from the training loader's batches
        self._backwards = 0             # backward() calls since the last step
        self._host_reads = 0
        self._read_patches = []         # undo the host-read counters (after READS_COUNTED_FOR)
        self._reads_counted = []        # (host reads, steps) of each interval so far
        self._reads_per_step = 0.0      # the rate they counted
        self._losses = deque(maxlen=8)  # weak references to recent losses (kept graphs)
        self._keeps_losses = False      # the loop keeps them (seen over READS_COUNTED_FOR steps)
        self._optimizers = weakref.WeakSet()
        self._training_loader = None
        self._at_boundary = True
        self._collates_tensors = False  # the loop's DataLoader collates tensors sample by sample
        self._epoch_wait = None         # the share of the last whole epoch spent waiting for data
        self._chosen_workers = None
        self._copies_pending = False    # CUDA: the loop's copies of its batch are being learned
        self._moves = None              # the first batch's MoveLog, until the next batch
        self._copy_patches = []         # undo Tensor.to / Tensor.cuda's (_copying)
        self._ahead = None              # AheadCopies: the batches' copies made one batch ahead
        self._pin = False               # the batched fetch writes into pinned memory
        self._shadows = weakref.WeakKeyDictionary()           # your loader -> one with workers
        self._shadow_iterators = weakref.WeakKeyDictionary()  # your loader -> that one's iterator
        self._started = time.perf_counter()
        self._stop_asked = run.stop_check()
        self._reads_at_once = None      # each loss read as a float: the first loss on the CPU
        self._marks_steps = False       # the interval's timer marks each step's start
        self._log_every = self._record_at = run.config.log_every   # the interval's steps at
        self._record_floor_s = record_floor_s                   # the next record (_record_due)
        self._describe_log_every()

    # -- install and undo -------------------------------------------------------------------
    def install(self) -> None:
        if Watcher.active is not None:
            raise RuntimeError("nt.watch is already watching a loop in this process: end that "
                               "`with nt.watch()` block first (a watch inside a watch would "
                               "count every step twice).")
        Watcher.active = self
        self._undo.append(lambda: setattr(Watcher, "active", None))
        try:
            self._install_hooks()
        except BaseException:
            self.remove()
            raise

    def _install_hooks(self) -> None:
        threads = self.run.config.num_threads
        if threads != "auto" and self.optimize:   # for the watch only, as fit does
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            self._keep(lambda: torch.set_num_threads(before))
            self.run.resolved["num_threads"] = (threads, "asked for (for the watch only)")
        self._keep(register_optimizer_step_pre_hook(self._before_step).remove)
        self._keep(register_optimizer_step_post_hook(self._after_step).remove)
        module_hooks = torch.nn.modules.module
        self._global_forward = [   # until the model is found (_found_model)
            module_hooks.register_module_forward_pre_hook(self._any_forward_starts),
            module_hooks.register_module_forward_hook(self._any_forward_ends, with_kwargs=True,
                                                      always_call=True)]
        self._keep(self._remove_global_forward_hooks)
        self._patch(torch.Tensor, "backward", self._wrap_backward)
        self._read_patches = [self._patch(torch.Tensor, name, self._counting(name in READS))
                              for name in (*READS, "cpu", "numpy")]
        self._patch(DataLoader, "__iter__", self._wrap_iter)
        for name in ("clip_grad_norm_", "clip_grad_value_"):   # fp16: the scale, along
            self._patch(torch.nn.utils, name, self._wrap_clip)
        self._keep(self._stop_shadow_workers)   # undone first: before torch's iterator is back
        cfg = self.run.config
        self._copies_pending = self.optimize and torch.cuda.is_available() and \
            cfg.prefetch_to_device is not False
        if self._copies_pending:
            self._copy_patches = [self._patch(torch.Tensor, name, self._copying(name))
                                  for name in ("to", "cuda")]

    def _keep(self, undo) -> None:
        self._undo.append(undo)

    def _patch(self, owner, name: str, make):
        """Replace `owner.name` with `make(original)` until remove(); an inherited one (a
        C method of TensorBase) is removed again rather than set, so that lookup finds the
        very object it found before. Returns the function that undoes it."""
        own = name in owner.__dict__
        original = owner.__dict__[name] if own else getattr(owner, name)
        setattr(owner, name, make(getattr(owner, name)))
        undone = []

        def undo() -> None:   # once: the host-read patches are undone early (_log)
            if not undone:
                undone.append(True)
                setattr(owner, name, original) if own else delattr(owner, name)
        self._undo.append(undo)
        return undo

    def remove(self) -> None:
        """Undo every hook and patch, last first, whatever else fails."""
        self._exit_autocast()
        self._take_back_scale()   # a step that failed: no post hook took them back
        self._moves = None        # a batch and its copies on the GPU, not kept past the watch
        if self._ahead is not None:
            self._ahead.clear()
        while self._undo:
            try:
                self._undo.pop()()
            except Exception:   # the next undo still runs
                pass

    def _remove_global_forward_hooks(self) -> None:
        for handle in self._global_forward:
            handle.remove()
        self._global_forward = []

    # -- the model: found at its first outermost forward with gradients --------------------
    def _any_forward_starts(self, module, args) -> None:
        if self._inside:
            return
        if self._depth == 0 and torch.is_grad_enabled() and \
                any(p.requires_grad for p in module.parameters()):
            self._candidate = module
        self._depth += 1

    def _any_forward_ends(self, module, args, kwargs, output) -> None:
        if self._inside:
            return
        self._depth -= 1
        if self._depth == 0 and module is self._candidate:
            self._candidate = None
            self._samples += _samples_in(args, kwargs)
            self._found_model(module, args, kwargs)

    def _found_model(self, model, args, kwargs) -> None:
        """The model the loop trains: resolve what depends on it, hook it alone from now on."""
        self._remove_global_forward_hooks()
        self.model = model
        self.run.equip(model=model)
        self._ensure_interval(next(model.parameters()).device)
        self.run.resolved.setdefault("num_threads", (torch.get_num_threads(),
                                                     KEPT + " (torch's setting)"))
        started = time.perf_counter()
        self._inside = True
        try:
            # what bf16's measurement and the FLOP count are cached by: repr(model) once
            key = _architecture(model, args, kwargs)
            self.amp = self._resolve_amp(model, args, kwargs, key)
            if self.amp == "fp16":
                self.scaler = torch.amp.GradScaler(self.device.type)
                self.run.equip(scaler=self.scaler)
            if self.run.config.count_flops:
                self._count_flops(model, args, kwargs, key)
        finally:
            self._inside = False
        setup_s = time.perf_counter() - started
        self.run.resolved["setup_s"] = (round(setup_s, 4), "measuring on the first batch (bf16 "
                                        "probe, FLOP count), before its backward")
        if self._copies_pending and self._training_loader is None:
            self._no_copies("your loop iterates no DataLoader (its model ran before any batch)")
        self.interval.reset(self.run.step)   # the measuring is no step's time
        self.interval.step_starts()
        self._to_channels_last = self.optimize and self.run.config.channels_last is True
        self._keep(lambda: [h.remove() for h in self._model_hooks])
        # Where the loop iterates a DataLoader and nothing changes the forward, the samples
        # come from the loader's batches and the model gets no hook: any hook takes each of
        # its calls off nn.Module's fast path (a sixth of what a watch added to a step,
        # bench/instructions.py).
        self._loader_counts = self._training_loader is not None and self.amp == "off" \
            and not self._to_channels_last
        if self._loader_counts:
            return
        self._model_hooks = [model.register_forward_pre_hook(self._model_starts, with_kwargs=True)]
        if self.amp != "off":   # the autocast's end: a hook per forward only where there is one
            self._model_hooks.append(model.register_forward_hook(
                self._model_ends, with_kwargs=True, always_call=True))

    def _model_starts(self, module, args, kwargs):
        if self._inside:
            return None
        if self._at_boundary:
            self._stop_if_asked()
        if torch.is_grad_enabled():   # an evaluation forward (no_grad) is no step's
            self._samples += _samples_in(args, kwargs)
            self.interval.step_starts()   # the step's compute starts with its first forward
        if self.amp != "off":
            context = torch.autocast(self.device.type, dtype=_DTYPES[self.amp])
            context.__enter__()
            self._autocast.append(context)
        if self._to_channels_last:
            if not self._channels_last:   # the second forward: the first backward is done
                self._convert_to_channels_last(module)
            return _channels_last_inputs(args, kwargs)
        return None

    def _convert_to_channels_last(self, model) -> None:
        """channels_last=True: the model's 4-d weights in NHWC from its second forward (the
        first one's backward holds the weights as they were), for the watch only: the same
        Parameter objects, laid out as they were again on the way out."""
        model.to(memory_format=torch.channels_last)
        self._channels_last = True
        self._keep(lambda: model.to(memory_format=torch.contiguous_format))
        self.run.resolved["channels_last"] = (True, "asked for: the model's 4-d weights and "
                                                    "inputs in NHWC, for the watch only")

    def _model_ends(self, module, args, kwargs, output):
        if self._inside or not self._autocast:
            return None
        self._exit_autocast()
        # the loop computes its loss outside the forward: give it fp32 outputs, as autocast
        # would give its loss function (cross_entropy and friends autocast to fp32)
        return _as_float32(output)

    def _exit_autocast(self) -> None:
        while self._autocast:
            self._autocast.pop().__exit__(None, None, None)

    # -- backward: the loss, one micro-batch ------------------------------------------------
    def _wrap_backward(self, original):
        watcher = self

        def backward(tensor, *args, **kwargs):
            if not watcher._inside:
                watcher._on_backward(tensor)
                if watcher.scaler is not None:   # fp16: the gradients of the scaled loss
                    watcher._update_scale()
                    tensor = watcher.scaler.scale(tensor)
            return original(tensor, *args, **kwargs)
        return backward

    # -- fp16: a GradScaler through the hooks, as scaler.scale / unscale_ / step / update --
    def _update_scale(self) -> None:
        """The scaler's update after a step: once per step, before the next backward (after
        every optimizer of the step has unscaled with the same scale)."""
        if self._unscaled:
            self.scaler.update()
            self._unscaled.clear()
            self._in_kernel.clear()

    def _unscale_or_skip(self, optimizer) -> None:
        """Before `optimizer` steps: its gradients unscaled (GradScaler.unscale_); with an
        inf or NaN among them the step is skipped, as GradScaler.step skips it: without a
        gradient, torch's optimizers leave a parameter and its state as they are. The
        gradients are set aside for the step and given back after it (_after_step)."""
        if id(optimizer) in self._unscaled:
            return
        if _kernel_takes_the_scale(optimizer):
            self._hand_scale_to_kernel(optimizer)
            return
        self._inside = True   # the inf check's .item() is not the loop's host read
        try:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))
            # what GradScaler.step reads (torch/amp/grad_scaler.py, _maybe_opt_step)
            state = self.scaler._per_optimizer_states[id(optimizer)]
            found_inf = sum(v.item() for v in state["found_inf_per_device"].values())
        finally:
            self._inside = False
        if found_inf:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        self._set_aside.append((param, param.grad))
                        param.grad = None

    def _hand_scale_to_kernel(self, optimizer) -> None:
        """A fused optimizer unscales its gradients and skips its step on inf in its own
        kernel, given `grad_scale` and `found_inf` as attributes: what GradScaler.step does
        for one (`_step_supports_amp_scaling`). The inf check stays on the device, so the
        step has no host read; the gradients stay scaled (_wrap_clip scales a clip's limit
        along), and the attributes go again after the step (_after_step)."""
        scaler = self.scaler
        self._inside = True
        try:
            found = scaler._check_inf_per_device(optimizer)   # counts infs, unscales nothing
            scale = scaler._get_scale_async()
            optimizer.grad_scale = scale
            optimizer.found_inf = sum(t.to(scale.device, non_blocking=True) for t in found.values())
        finally:
            self._inside = False
        self._unscaled.add(id(optimizer))   # inf-checked: the step's update() counts it
        self._in_kernel.add(id(optimizer))
        self._kernel_scaled.append(optimizer)

    def _take_back_scale(self) -> None:
        """After a fused step: its kernel has unscaled the gradients in place."""
        while self._kernel_scaled:
            optimizer = self._kernel_scaled.pop()
            self._in_kernel.discard(id(optimizer))
            for name in ("grad_scale", "found_inf"):
                optimizer.__dict__.pop(name, None)

    def _wrap_clip(self, original):
        """torch.nn.utils.clip_grad_norm_ / clip_grad_value_ on the scaled gradients of an
        fp16 watch: the limit scaled along, the norm returned unscaled, so the loop clips
        its true gradients, as with scaler.unscale_(opt) before the clip."""
        watcher = self

        by_norm = original.__name__ == "clip_grad_norm_"

        def clip(parameters, limit, *args, **kwargs):
            scaler = watcher.scaler
            # the gradients are true once an optimizer has unscaled them in place
            if scaler is None or watcher._inside or watcher._unscaled - watcher._in_kernel:
                return original(parameters, limit, *args, **kwargs)
            # a norm's limit may be a tensor (max_norm / total_norm): the scale stays on the
            # device; clamp's limits are numbers, read under _inside (not the loop's read)
            watcher._inside = True
            try:
                scale = scaler._get_scale_async() if by_norm else scaler.get_scale()
            finally:
                watcher._inside = False
            result = original(parameters, limit * scale, *args, **kwargs)
            return result / scale if isinstance(result, torch.Tensor) else result
        clip.__wrapped__ = original
        return clip

    def _on_backward(self, loss: torch.Tensor) -> None:
        if self._at_boundary:
            if self._stop_asked():   # _stop_if_asked, inlined: this runs every step
                raise StopWatching()
            self._at_boundary = False
        interval = self.interval
        if interval is None:
            interval = self._ensure_interval(loss.device)
        if self._reads_at_once is None:   # the first loss's device says, for the whole watch:
            self._reads_at_once = loss.is_cpu   # an interval's losses are all floats or all tensors
        if self._reads_at_once:   # the CPU: no sync, and cheaper than a stack at the record
            value = _item(loss) if loss.dim() == 0 else _item(loss.detach().float().mean())
        else:
            value = loss.detach()
            value = value if value.dim() == 0 else value.float().mean()
        interval.add(value, self._samples)
        self._samples = 0
        self._backwards += 1
        if self._read_patches:   # kept losses are looked for over the host reads' steps
            self._losses.append(weakref.ref(loss))

    def _ensure_interval(self, device: torch.device) -> Interval:
        if self.interval is None:
            self.device = device
            self.run.resolved["loop"] = ("your own", "nt.watch: the loop you wrote, watched")
            self.run.resolved.setdefault("device", (str(device), "your loop's: where the model is"))
            # on the CPU a step's compute is what its data wait leaves (data wait: the
            # loader's time; compute: the rest), with no timer call per step (RestTimer)
            self.interval = Interval(device, self.run.step, self.run.config.telemetry,
                                     host_timer=RestTimer if device.type == "cpu" else HostTimer)
            self._marks_steps = self.interval.timer.marks_steps   # step_starts counts
            if device.type == "cuda":   # the watch's peak, not the kernel's
                torch.cuda.reset_peak_memory_stats(device)
        return self.interval

    # -- optimizer steps ----------------------------------------------------------------------
    def _before_step(self, optimizer, args, kwargs) -> None:
        if self._inside:
            return
        if optimizer is not self.run.optimizer and optimizer not in self._optimizers:
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
        self._keep(apply_impl(optimizer, impl))

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self._set_aside or self._kernel_scaled:
            self._after_scaled_step()
        if self._inside or not self._backwards:
            return   # another optimizer stepping on the same backward: the same step
        run, interval = self.run, self.interval
        run.advance(self._backwards)
        self._backwards = 0
        interval.end_step()
        if interval.steps == self._record_at:
            self._record_due()
        run.phase = "load"   # Run.enter, inlined (above)
        self._at_boundary = True

    def _after_scaled_step(self) -> None:
        """fp16: a skipped step's gradients back, as GradScaler leaves them; a fused
        optimizer's scale taken back."""
        while self._set_aside:
            param, grad = self._set_aside.pop()
            param.grad = grad
        if self._kernel_scaled:
            self._take_back_scale()

    def _describe_log_every(self) -> None:
        every = self._log_every
        why = f"asked for: a record every {every} step(s)" if not self._record_floor_s \
            else (f"a record every {every} steps, at least {self._record_floor_s * 1e3:.0f} ms and "
                  f"at most {every * RECORDS_MERGED} steps apart (from step {READS_COUNTED_FOR}): "
                  f"a record costs the loop ~50 us; nt.watch(log_every={every}) records "
                  f"exactly every {every}")
        self.run.resolved["log_every"] = (every, why)

    def _record_due(self) -> None:
        """log_every more steps: a record, or, where the default's records would come closer
        together than RECORD_EVERY_S, a look again after log_every more. While host reads
        are counted, a record every log_every steps (_log counts them per record). Losses
        read at once (the CPU) are looked at each time: a non-finite one is recorded now,
        so that on_nan='stop' ends the loop as soon as without the floor."""
        interval = self.interval
        if self._read_patches or not self._record_floor_s or \
                interval.steps >= self._log_every * RECORDS_MERGED or \
                time.perf_counter() - interval.t0 >= self._record_floor_s:
            self._log()
        elif self._reads_at_once and not math.isfinite(sum(interval.losses)):
            self._log(flush=True)   # its record now, not at the next close
        else:
            self._record_at += self._log_every
            return
        self._record_at = self._log_every

    def _log(self, flush: bool = False) -> None:
        """Close the interval with the loop's counts since the last record (counted here,
        not per step: each call in a step is time the loop waits for); `flush`: emit its
        record now (Interval.close emits the one before)."""
        interval = self.interval
        if self._read_patches:
            reads = self._host_reads
            self._reads_counted.append((reads, interval.steps))
            # a loss still alive after its step: the loop keeps it, and with it its graph
            self._keeps_losses = any((t := ref()) is not None and t.requires_grad
                                     for ref in list(self._losses)[:-1])
            if self.run.step >= READS_COUNTED_FOR:
                self._stop_counting_reads()
        else:
            reads = self._reads_per_step * interval.steps
        interval.count("host_reads", reads)
        if self._collates_tensors:   # every sample of the training loader's batches
            interval.count("collated_samples", interval.samples)
        interval.count("kept_losses", interval.steps * self._keeps_losses)
        self._host_reads = 0
        self._inside = True   # the record's reads of the losses are not the loop's
        try:
            log_interval(self.run, interval, _lr(self.run.optimizer))
            if flush:
                flush_interval(self.run, interval)
        finally:
            self._inside = False

    def _stop_counting_reads(self) -> None:
        """Host reads counted over the first READS_COUNTED_FOR steps: a loop reads in the
        same places every step, and each counted read is a Python call on the way to one
        of torch's C methods (the optimizers call item() on their step counts). From here
        the records carry the rate counted, and the methods are torch's own again."""
        # from the second interval on: a read after a step falls in the interval after it,
        # so the first interval is one read short
        intervals = self._reads_counted[1:] or self._reads_counted
        self._reads_per_step = sum(r for r, _ in intervals) / max(sum(n for _, n in intervals), 1)
        for undo in self._read_patches:
            undo()
        self._read_patches = []
        self._losses.clear()

    def _stop_if_asked(self) -> None:
        """End the loop at the step boundary: after a finished step, before the next one
        has changed anything (its batch may be loaded; its forward has not run). Called
        only at a boundary: the callers, which run every step, check `_at_boundary` first."""
        if self._stop_asked():   # Run.stop_requested, one call where the property makes two
            raise StopWatching()

    # -- the loader: data wait, batched fetch ---------------------------------------------
    def _wrap_iter(self, original):
        watcher = self

        def __iter__(loader):
            if watcher._inside:
                return original(loader)
            return watcher._timed_batches(loader, original)
        return __iter__

    def _timed_batches(self, loader, original):
        self._new_epoch(loader)
        training = self._training_loader() is loader
        batches = iter(self._source(loader, original))
        if training and self._ahead is not None:
            batches = self._copied_ahead(batches)
        clock = time.perf_counter   # locals: they run every batch
        stop_asked = self._stop_asked
        epoch_start, waited = clock(), 0.0
        while True:
            if self._at_boundary and stop_asked():   # _stop_if_asked, inlined
                raise StopWatching()
            start = clock()
            try:
                batch = next(batches)
            except StopIteration:
                if training:   # a whole epoch: what it waited
                    self._epoch_wait = waited / max(clock() - epoch_start, 1e-9)
                return
            finally:
                wait = clock() - start
                waited += wait
                interval = self.interval
                if interval is not None:
                    interval.data_wait_s += wait
            if training:
                if self._loader_counts:
                    self._samples += _batch_samples(batch)
                    if self._marks_steps:   # CUDA: the step's work starts with its batch
                        interval.step_starts()
                if self._copies_pending:
                    batches = self._follow_copies(batch, batches)
            yield batch

    def _source(self, loader, original):
        """Where this pass's batches come from: one index op per batch, the loader's
        batches loaded by worker processes, or the loader as it is."""
        if self._batched(loader):
            return self._fetch_batched(loader)
        workers = self._workers_for(loader)
        if not workers:
            return original(loader)
        shadow = self._shadows.get(loader)
        if shadow is None or shadow.num_workers != workers:
            pin = loader.pin_memory or self._ahead is not None and self._ahead.pin
            shadow = self._shadows[loader] = _served_by_workers(loader, workers, self.run.config, pin)
        elif loader in self._shadow_iterators:
            # kept workers reset their iterator without its base-seed draw: draw it as the
            # loader's own new iterator would, so the sampler's order stays the loader's
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        self._shadow_iterators[loader] = iterator = original(shadow)   # torch's own iterator
        return iterator

    def _workers_for(self, loader) -> int:
        """Worker processes for the loop's per-sample loader: as asked, or, with "auto",
        once a whole epoch of the loop itself waited for data a real share of its time
        (measured on the loop's own steps: nothing is run to find out)."""
        cfg = self.run.config
        if not self.optimize or self._training_loader() is not loader or _batchable(loader) \
                or isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is None:
            return 0
        if cfg.num_workers != "auto":
            self.run.resolved["num_workers"] = (cfg.num_workers, "asked for: your loader's "
                                                "batches loaded by that many worker(s), for "
                                                "the watch only")
            return cfg.num_workers
        if self._chosen_workers is None and self._epoch_wait is not None and not loader.num_workers:
            self._chosen_workers = self._choose_workers(self._epoch_wait)
        return self._chosen_workers or 0

    def _choose_workers(self, share: float) -> int:
        cores = available_cores()
        if share < WAITS_FOR_DATA or cores < 2:
            return 0
        workers = min(8, cores - 1)   # fit's rule: training keeps a core
        self.run.resolved["num_workers"] = (workers, (
            f"the loop waited for data {share:.0%} of epoch {self.run.epoch}: from epoch "
            f"{self.run.epoch + 1} your loader's batches are loaded by {workers} worker(s) "
            "(its sampler, generator and collate kept; for the watch only)"))
        return workers

    def _stop_shadow_workers(self) -> None:
        for loader, iterator in list(self._shadow_iterators.items()):
            stop_workers(iterator, self._shadows.get(loader))
        self._shadows.clear()

    def _new_epoch(self, loader) -> None:
        """Each pass over the first loader the loop iterates starts an epoch."""
        if self._training_loader is None:
            self._training_loader = weakref.ref(loader)
            self._describe_loader(loader)
        elif self._training_loader() is loader:
            self.run.next_epoch()

    def _describe_loader(self, loader) -> None:
        resolved, cfg = self.run.resolved, self.run.config
        resolved.setdefault("num_workers", (loader.num_workers, KEPT))
        resolved.setdefault("pin_memory", self._pin_as_found(loader))
        resolved.setdefault("prefetch_to_device", (False, self._why_no_copies_ahead()))
        why_not = _why_not_batchable(loader)
        possible = not why_not
        if cfg.batched_fetch is True and not possible:
            why = "not possible for this DataLoader: " + why_not
        elif not self.optimize or cfg.batched_fetch is False:
            why = "off: " + ("optimize=False" if not self.optimize else "asked for")
        else:
            why = why_not or ("a TensorDataset with the default collate: one index op per "
                              "batch instead of a __getitem__ per sample, the same batches in "
                              "the same order")
        resolved["batched_fetch"] = (bool(self.optimize and possible
                                          and cfg.batched_fetch is not False), why)
        self._collates_tensors = possible and not resolved["batched_fetch"][0]

    def _pin_as_found(self, loader) -> tuple:
        """pin_memory until step 1 shows what the loop copies (_follow_copies), or for good."""
        if loader.pin_memory or self.run.config.pin_memory is not True or self._copies_pending:
            return loader.pin_memory, KEPT
        if not torch.cuda.is_available():
            return False, "asked for, but there is no CUDA device: nothing to pin for"
        return False, ("asked for, but the watch pins only what it copies ahead (here "
                       "prefetch_to_device=False): DataLoader(pin_memory=True) pins your "
                       "loader's batches")

    def _why_no_copies_ahead(self) -> str:
        """Until step 1 shows what the loop copies (_follow_copies), or for good."""
        if self._copies_pending:
            return "decided after your loop's first step, on what it copies to the GPU"
        if not self.optimize:
            return "off: optimize=False"
        if self.run.config.prefetch_to_device is False:
            return "off: asked for"
        return "no CUDA device: your loop's batches need no copy to a GPU"

    def _batched(self, loader) -> bool:
        return self._training_loader() is loader and self.run.resolved["batched_fetch"][0]

    def _fetch_batched(self, loader):
        """The DataLoader's batches, each with one index op per tensor: what its own
        iterator makes (default_collate of a TensorDataset's rows: a list of stacked
        tensors), drawing the same numbers from its RNG (the iterator's base seed, then
        its sampler's order), so the batches and the RNG after them are the loader's own."""
        torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        tensors = loader.dataset.tensors
        pin = loader.pin_memory and torch.cuda.is_available()
        for index in _batch_indices(loader):
            if pin or self._pin:
                yield [pinned_rows(t, index) for t in tensors]
            else:
                yield [t.index_select(0, index) for t in tensors]   # = t[index], at half its cost

    # -- CUDA: your loop's copies of its batch, learned over step 1, then made ahead ----------
    def _follow_copies(self, batch, batches):
        """At the training loader's first batch: note what the loop copies to a GPU until
        the next one (a MoveLog, fed by the watch's Tensor.to and .cuda). At the next:
        resolve pin_memory and prefetch_to_device on what it copied, and from the batch
        after it copy those tensors ahead. Returns the batches to go on with."""
        if self._moves is None:
            self._moves = MoveLog(batch)
            return batches
        log, self._moves, self._copies_pending = self._moves, None, False
        loader, cfg, resolved = self._training_loader(), self.run.config, self.run.resolved
        batched = resolved["batched_fetch"][0]
        (pin, why_pin), (ahead, why_ahead) = resolve_copies(
            cfg.pin_memory, cfg.prefetch_to_device, log, loader.pin_memory,
            can_pin=batched or plain(batch))
        resolved["pin_memory"], resolved["prefetch_to_device"] = (pin, why_pin), (ahead, why_ahead)
        if not ahead:
            self._no_copies(why_ahead)
            return batches
        self._pin = pin and batched   # the batched fetch writes pinned rows itself
        self._ahead = AheadCopies(log.moved, log.target(),
                                  pin=pin and not batched and not loader.pin_memory)
        return self._copied_ahead(batches)

    def _no_copies(self, why: str) -> None:
        """Nothing will be copied ahead: torch's own Tensor.to and .cuda again."""
        self._copies_pending, self._moves = False, None
        for undo in self._copy_patches:
            undo()
        self.run.resolved["prefetch_to_device"] = (False, why)

    def _copied_ahead(self, batches):
        markers = {} if self.interval is None else {"markers": self.interval}   # times the waits
        return self._ahead.batches(batches, **markers)

    def _copying(self, name: str):
        """Tensor.to / Tensor.cuda for a watch on CUDA: over step 1 they note what the loop
        copies (MoveLog); once copies are made ahead, the loop's call on a tensor of its
        batch returns the copy made for it, where it asks for just that copy."""
        watcher = self

        def wrap(original):
            def moved(tensor, *args, **kwargs):
                if watcher._inside or is_compiling():   # traced code: torch's own, as it is
                    return original(tensor, *args, **kwargs)
                ahead = watcher._ahead
                if ahead is not None and ahead.ready:
                    copy = ahead.take(tensor, *_move_request(name, args, kwargs))
                    if copy is not None:
                        return copy
                result = original(tensor, *args, **kwargs)
                if watcher._moves is not None:
                    watcher._moves.note(tensor, result, *_move_request(name, args, kwargs)[1:])
                return result
            return moved
        return wrap

    # -- host reads ---------------------------------------------------------------------------
    def _counting(self, grad_counts: bool):
        """A wrapper that counts a host read of a tensor on a device, or (item, tolist) of
        one computed with gradients: the loop's loss.item(), not a CPU index's."""
        watcher = self

        def wrap(original):
            if grad_counts:   # item(), tolist(): no arguments; the optimizers call item()
                def read(tensor):   # on their CPU step counts, so this runs often
                    if (tensor.requires_grad or not tensor.is_cpu) and not watcher._inside:
                        watcher._host_reads += 1
                    return original(tensor)
                return read

            def read_to(tensor, *args, **kwargs):
                if not tensor.is_cpu and not watcher._inside:
                    watcher._host_reads += 1
                return original(tensor, *args, **kwargs)
            return read_to
        return wrap

    # -- settings resolved on the model -----------------------------------------------------
    def _resolve_amp(self, model, args, kwargs, key) -> str:
        requested, device = self.run.config.amp, self.device
        choice = _amp_choice(requested, device, self.optimize,
                             lambda amp: _probe_step(model, args, kwargs, amp),
                             key=key)
        self.run.resolved["amp"] = choice
        return choice[0]

    def _count_flops(self, model, args, kwargs, key) -> None:
        batch, loss_fn = _as_batch(args, kwargs)
        self.run.resolved.update(flops.resolve(
            model, loss_fn, lambda: batch, self.amp, self.device, 1, torch.get_num_threads(),
            key=("watch", key)))

    # -- the end ------------------------------------------------------------------------------
    def finish(self, exc: Optional[BaseException]) -> bool:
        """End the Run: undo every hook first, then the last records, then the state.
        True when `exc` is the watch's own stop (the with block swallows it)."""
        if self.scaler is not None:   # the last step's update: the Run's scaler is current
            with contextlib.suppress(Exception):
                self._update_scale()
        self.remove()
        run, interval = self.run, self.interval
        if self._copies_pending and self._training_loader is not None:
            self._no_copies("your loop took no second batch from its loader: nothing to "
                            "copy ahead")
        if interval is not None:
            with contextlib.suppress(Exception):   # the user's error is the one to report
                interval.drop_unfinished_step()
                if interval.steps:
                    self._log()
                flush_interval(run, interval)
        # after the last records: a non-finite loss in them stops the run too (run.diverge)
        stopped = isinstance(exc, StopWatching) or (exc is None and run.stop_requested)
        error = exc if exc is not None and not isinstance(
            exc, (StopWatching, KeyboardInterrupt)) else None
        if stopped or isinstance(exc, KeyboardInterrupt):
            state = "interrupted" if run.interrupted or isinstance(exc, KeyboardInterrupt) \
                else "stopped"
        else:
            state = "failed" if error is not None else "finished"
        device = self.device or torch.device("cpu")
        run.finish(state, read_rng=lambda: ckpt.rng_state(device),
                   elapsed_s=time.perf_counter() - self._started, error=error)
        return isinstance(exc, StopWatching)


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _amp_choice(requested: str, device: torch.device, optimize: bool, step, key):
    """The watch's amp, (value, why): as fit resolves it, where the loop can take it."""
    if not optimize:
        return "off", "optimize=False: the loop runs as written"
    if requested == "off":
        return "off", "asked for"
    if requested == "fp16":
        if device.type not in ("cuda", "cpu"):
            return "off", f"no autocast nbtrain trusts on {device.type}"
        return "fp16", ("asked for: autocast to float16, and a GradScaler through the "
                        "backward and step hooks (the loss scaled, the step skipped on inf)")
    if device.type == "cuda":
        if gpu_has_bf16(device):
            return "bf16", f"{torch.cuda.get_device_name(device)} has bf16: autocast, no scaler"
        return "off", ("this GPU has no bf16; nt.watch(amp='fp16') applies fp16 with a "
                       "GradScaler through the hooks (a clip must be called as "
                       "torch.nn.utils.clip_grad_norm_ to be scaled along)")
    if device.type != "cpu":
        return "off", f"no autocast nbtrain trusts on {device.type}"
    if requested == "bf16":
        return "bf16", "asked for"
    if not cpu_bf16_feature():
        return "off", "CPU has no bf16 matmul units (avx512_bf16, amx_bf16): bf16 runs slower"
    return cpu_bf16_choice(step, key)


# torch's optimizers whose fused kernels take grad_scale and found_inf (their step reads
# them as attributes); their single-tensor and foreach kernels refuse them
_SCALING = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def _kernel_takes_the_scale(optimizer) -> bool:
    """A fused optimizer of those, with its step not overridden (torch wraps each class's
    step in its hook caller, so compare the functions under the wrappers). Not SGD with
    momentum before every parameter has its buffer: fused SGD makes the buffers with
    empty_like on the first step and keeps them even when found_inf skips the update
    (torch/optim/sgd.py, _fused_sgd), where unscale-and-skip leaves none."""
    if not _steps_as_torchs(type(optimizer)) or \
            not all(group.get("fused") for group in optimizer.param_groups):
        return False
    if isinstance(optimizer, torch.optim.SGD):
        return all(optimizer.state.get(p, {}).get("momentum_buffer") is not None
                   for group in optimizer.param_groups if group["momentum"]
                   for p in group["params"])
    return True


@functools.lru_cache(maxsize=None)
def _steps_as_torchs(cls) -> bool:
    """Whether `cls` steps with one of _SCALING's own step functions (asked every fp16
    step: the answer for a class does not change)."""
    step = inspect.unwrap(cls.step)
    return any(step is inspect.unwrap(scaling.step) for scaling in _SCALING)


def _probe_step(model, args, kwargs, amp: str) -> None:
    """A forward and backward of the model on the loop's first batch, leaving no trace."""
    with leaves_no_trace(model):
        context = torch.autocast("cpu", dtype=torch.bfloat16) if amp == "bf16" \
            else contextlib.nullcontext()
        with context:
            output = model(*args, **kwargs)
        _first_tensor(output).float().sum().backward()


def _architecture(model, args, kwargs) -> tuple:
    """What a bf16 measurement depends on: layers, parameter shapes, the batch's shapes."""
    shapes = tuple((tuple(p.shape), p.dtype) for p in model.parameters())
    batch = tuple((tuple(t.shape), t.dtype) for t in _tensors(args, kwargs))
    return (repr(model), shapes, batch)


def _as_batch(args, kwargs):
    """(batch, loss_fn) for flops.resolve from a forward's arguments: the output's sum
    stands in for the loop's loss (whose own FLOPs are negligible next to the model's)."""
    if kwargs and not args:
        return dict(kwargs), None
    return (*args, None), lambda output, _targets: _first_tensor(output).float().sum()


def _channels_last_inputs(args, kwargs):
    """The forward's 4-d tensor arguments in NHWC (a no-op for those already so)."""
    def convert(value):
        if isinstance(value, torch.Tensor) and value.dim() == 4:
            return value.contiguous(memory_format=torch.channels_last)
        return value
    return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}


def _samples_in(args, kwargs) -> int:
    """Samples in a forward's arguments (`model(x)`, `model(batch)`, `model(**batch)`)."""
    return _batch_samples(args if args else dict(kwargs))


def _batch_samples(batch) -> int:
    """Samples in a batch (a loader's, or a forward's arguments): its first element's
    length when that is a tensor, the common case, cheaply; else batch_len's answer."""
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(first, torch.Tensor) and first.shape:   # not 0-dim
        return first.shape[0]
    try:
        return batch_len(batch)
    except Exception:
        return 0


def _move_request(name: str, args, kwargs):
    """(device, dtype, memory_format) that a call `tensor.to(*args, **kwargs)` (or
    `.cuda(...)`) asks for; Nones where it cannot be read (torch's own call then says why)."""
    try:
        if name == "to":
            if kwargs.get("copy"):
                return None, None, None
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
            return device, dtype, memory_format
        device = args[0] if args else kwargs.get("device")
        memory_format = args[2] if len(args) > 2 else kwargs.get("memory_format")
        if device is None or isinstance(device, int):
            device = torch.device("cuda", device)
        return torch.device(device), None, memory_format
    except Exception:
        return None, None, None


def _tensors(args, kwargs):
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


def _first_tensor(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if hasattr(output, "values") else output
    return next(v for v in values if isinstance(v, torch.Tensor))


def _as_float32(output):
    """16-bit floating outputs of an autocast forward as float32; anything else as it is."""
    if isinstance(output, torch.Tensor):
        return output.float() if output.dtype in (torch.bfloat16, torch.float16) else output
    if isinstance(output, tuple) and not hasattr(output, "_fields"):
        return tuple(_as_float32(o) for o in output)
    return output


WAITS_FOR_DATA = 0.25   # a quarter of an epoch waiting for data: worker processes may pay


def _served_by_workers(loader, workers: int, cfg, pin: bool) -> DataLoader:
    """A DataLoader that loads `loader`'s batches with `workers` processes: its batch
    sampler (so the same batches in the same order), generator, collate and worker init;
    pinned (in its pin thread) where `pin`; workers kept across epochs."""
    dataset = shippable(loader.dataset, cfg.multiprocessing_context)
    return DataLoader(dataset, batch_sampler=loader.batch_sampler, num_workers=workers,
                      collate_fn=loader.collate_fn, pin_memory=pin,
                      generator=loader.generator, worker_init_fn=loader.worker_init_fn,
                      timeout=loader.timeout, persistent_workers=True,
                      prefetch_factor=cfg.prefetch_factor,
                      multiprocessing_context=cfg.multiprocessing_context)


def _batch_indices(loader):
    """The index tensor of each batch the loader's batch sampler lists, in its order. For
    torch's own samplers, the epoch's order made at once and split, drawing from the RNG
    what they draw and when (torch/utils/data/sampler.py): a Python int per sample and a
    tensor made of a list per batch would cost more than a small model's step."""
    sampler, batches = loader.sampler, loader.batch_sampler
    if type(batches) is BatchSampler and batches.sampler is sampler:
        n, size, drop_last = len(loader.dataset), batches.batch_size, batches.drop_last
        if type(sampler) is SequentialSampler:
            chunks = batch_chunks(torch.arange(n), size)
            yield from chunks[:n // size] if drop_last else chunks
            return
        if type(sampler) is RandomSampler and not sampler.replacement \
                and sampler.num_samples == n:
            yield from _random_sampler_batches(sampler.generator, n, size, drop_last)
            return
    for indices in batches:
        yield torch.as_tensor(indices)


def _random_sampler_batches(generator, n: int, size: int, drop_last: bool):
    """RandomSampler's batches as BatchSampler groups them: a seed from the global RNG
    where the sampler has no generator, one permutation of the epoch, then a second one,
    empty, drawn when the batch sampler asks past the first one's end (before a shorter
    last batch, or after the last full one)."""
    if generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    chunks = batch_chunks(torch.randperm(n, generator=generator), size)
    full = n // size
    yield from chunks[:full]
    torch.randperm(n, generator=generator)
    if len(chunks) > full and not drop_last:
        yield chunks[full]


def _batchable(loader) -> bool:
    return not _why_not_batchable(loader)


def _why_not_batchable(loader) -> str:
    if type(loader.dataset) is not TensorDataset:
        return f"a {type(loader.dataset).__name__}: samples are read one by one"
    if loader.batch_sampler is None:
        return "batch_size=None: samples unbatched"
    if loader.collate_fn is not default_collate:
        return "its own collate_fn"
    if loader.num_workers:
        return f"{loader.num_workers} worker(s) of its own"
    return ""


def _lr(optimizer) -> float:
    return optimizer.param_groups[0]["lr"] if optimizer is not None else float("nan")
