"""Precision and layout for the watch only (optimize=True): autocast around the model's
forward (bf16; fp16 with a GradScaler applied through the backward and step hooks), its
outputs given back in float32 for the loop's loss, and channels_last. bf16 on a CPU with
"auto" is decided on the loop's own steps (measure.py); a loop that runs its own
autocast keeps it."""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch.amp.grad_scaler import OptState

from ..auto import budget
from ..auto.precision import amp_for, auto_amp, bf16_units, known_bf16_gain
from ..machine import device_name, gpu_has_bf16, model_key

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TRIAL = "trial"   # amp_choice's value where bf16 is measured on the loop's own steps


class Precision:
    """The watch's part that changes the model's forward: autocast, channels_last, and
    fp16's GradScaler through the backward and step hooks."""

    def __init__(self, edge):
        self.edge = edge
        self.amp = "off"
        self.scaler = None              # amp='fp16': the GradScaler the hooks apply
        self._to_channels_last = False  # channels_last=True: convert at the next forward
        self._channels_last = False     # the model is in NHWC now
        self._autocast = []             # the autocast contexts entered in the model's forward
        self._unscaled = set()          # ids of the optimizers unscaled since the last update
        self._kernel_scaled = []        # fused optimizers holding the scale, until their step ends
        self._in_kernel = set()         # ids of those inf-checked this step: gradients still scaled
        self._set_aside = []            # (param, grad) of a step skipped on inf, until after it
        self._grads_scaled = False      # the loop's last backward ran on the scaled loss
        self._to_optimizer = False      # an optimizer has zeroed or stepped: the loss may be scaled
        self._undo_zero_grad = None     # the zero_grad patch that tells it, until it has

    def install(self) -> None:
        patches = self.edge.patches
        for name in ("clip_grad_norm_", "clip_grad_value_"):   # fp16: the scale, along
            patches.patch(torch.nn.utils, name, self._wrap_clip)
        if self.edge.run.config.amp in ("auto", "fp16"):   # fp16 may come: see _wrap_zero_grad
            self._undo_zero_grad = patches.patch(torch.optim.Optimizer, "zero_grad",
                                                 self._wrap_zero_grad)

    def resolve(self, model) -> tuple:
        """amp and channels_last for the model found; returns the amp choice, (TRIAL, why)
        where bf16 is to be measured on the loop's own steps (fp32 until then)."""
        edge = self.edge
        run, device = edge.run, edge.device
        requested = run.config.amp
        if edge.optimize and requested != "off" and torch.is_autocast_enabled(device.type):
            choice = ("off", "your loop runs its forward under its own autocast: kept as it is")
        else:
            choice = amp_choice(requested, device, edge.optimize, bf16_key(model, device))
        run.resolved["amp"] = ("off", choice[1]) if choice[0] == TRIAL else choice
        self.amp = run.resolved["amp"][0]
        if self.amp == "fp16":
            self.scaler = torch.amp.GradScaler(device.type)
            run.equip(scaler=self.scaler)
        else:
            self._gradients_go_to_an_optimizer()
        self._to_channels_last = edge.optimize and run.config.channels_last is True
        return choice

    def changes_forward(self) -> bool:
        return self.amp != "off" or self._to_channels_last

    def stepped_scaled(self) -> bool:
        """fp16: a step left gradients set aside or a fused kernel holding the scale."""
        return bool(self._set_aside or self._kernel_scaled)

    # -- the model's forward --------------------------------------------------------------
    def forward_changed(self, args):
        """At the model's forward: autocast entered; channels_last inputs. The new args, or
        None for the loop's own."""
        if self.amp != "off":
            context = torch.autocast(self.edge.device.type, dtype=DTYPES[self.amp])
            context.__enter__()
            self._autocast.append(context)
        if not self._to_channels_last:
            return None
        if not self._channels_last:   # the second forward: the first backward is done
            if self.edge.trained:
                self._convert_to_channels_last(self.edge.model)
            else:
                return None
        return tuple(a.contiguous(memory_format=torch.channels_last)
                     if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args)

    def forward_done(self, output):
        if not self._autocast:
            return None
        self.exit_autocast()
        # the loop computes its loss outside the forward: give it fp32 outputs, as autocast
        # would give its loss function (cross_entropy and friends autocast to fp32)
        return _as_float32(output)

    def exit_autocast(self) -> None:
        while self._autocast:
            self._autocast.pop().__exit__(None, None, None)

    def _convert_to_channels_last(self, model) -> None:
        """channels_last=True: the model's 4-d weights in NHWC from its second forward (the
        first one's backward holds the weights as they were), for the watch only: the same
        Parameter objects, laid out as they were again on the way out."""
        model.to(memory_format=torch.channels_last)
        self._channels_last = True
        self.edge.patches.keep(lambda: model.to(memory_format=torch.contiguous_format))
        self.edge.run.resolved["channels_last"] = (True, "asked for: the model's 4-d weights "
                                                         "and inputs in NHWC, for the watch only")

    # -- fp16: a GradScaler through the hooks, as scaler.scale / unscale_ / step / update --
    def scaled_for_backward(self, loss):
        """fp16: the loss the backward runs on, scaled (after the last step's update), once
        the loop's gradients are known to go to an optimizer, which unscales them at its
        step: a loop that updates its weights by hand would apply the scaled gradients."""
        if self.scaler is None:
            return loss
        if not self._to_optimizer:
            self._grads_scaled = False
            return loss
        self._update_scale()
        self._grads_scaled = True
        self.edge.inside = True
        try:
            return self.scaler.scale(loss)
        finally:
            self.edge.inside = False

    def gradients_handed_back(self) -> None:
        """fp16: torch.autograd.grad's gradients go to the loop unscaled, since the loop
        uses them itself (a hand update, a norm, `p.grad = g`): an optimizer step or a
        clip on them has nothing to unscale, until a backward runs on a scaled loss again."""
        if self.scaler is not None:
            self._update_scale()
        self._grads_scaled = False

    def _wrap_zero_grad(self, original):
        """Until an optimizer steps, its zero_grad() tells that the loop's gradients go to
        one (`opt.zero_grad(); loss.backward(); opt.step()`), so that the first backward is
        scaled as GradScaler's recipe scales it; a loop that zeroes no optimizer's
        gradients has its first step's unscaled, checked for inf at the step."""
        part = self

        @functools.wraps(original)
        def zero_grad(optimizer, *args, **kwargs):
            if not part.edge.inside:
                part._gradients_go_to_an_optimizer()
            return original(optimizer, *args, **kwargs)
        return zero_grad

    def _gradients_go_to_an_optimizer(self) -> None:
        self._to_optimizer = True
        if self._undo_zero_grad is not None:
            self._undo_zero_grad()
            self._undo_zero_grad = None

    def last_update(self) -> None:
        """The last step's update at the end: the Run's scaler is current. A loop whose
        gradients never went to an optimizer is told its loss was not scaled."""
        if self.scaler is None:
            return
        with contextlib.suppress(Exception):
            self._update_scale()
        if not self._to_optimizer and self.edge.trained:
            self.edge.run.resolved["amp"] = ("fp16", (
                "autocast to float16; no loss scaled: your loop updates its weights itself, "
                "and a GradScaler unscales only at an optimizer's step"))

    def _update_scale(self) -> None:
        """The scaler's update after a step: once per step, before the next backward (after
        every optimizer of the step has unscaled with the same scale)."""
        if self._unscaled:
            self.scaler.update()
            self._unscaled.clear()
            self._in_kernel.clear()

    def unscale_or_skip(self, optimizer) -> None:
        """Before `optimizer` steps: its gradients unscaled (GradScaler.unscale_); with an
        inf or NaN among them the step is skipped, as GradScaler.step skips it: without a
        gradient, torch's optimizers leave a parameter and its state as they are. The
        gradients are set aside for the step and given back after it (after_scaled_step)."""
        self._gradients_go_to_an_optimizer()
        if id(optimizer) in self._unscaled:
            return
        if self._grads_scaled and _kernel_takes_the_scale(optimizer):
            self._hand_scale_to_kernel(optimizer)
            return
        self.edge.inside = True   # the inf check's .item() is not the loop's host read
        try:
            if self._grads_scaled:
                self.scaler.unscale_(optimizer)
            else:
                self._check_unscaled(optimizer)
            self._unscaled.add(id(optimizer))
            # what GradScaler.step reads (torch/amp/grad_scaler.py, _maybe_opt_step)
            state = self.scaler._per_optimizer_states[id(optimizer)]
            found_inf = sum(v.item() for v in state["found_inf_per_device"].values())
        finally:
            self.edge.inside = False
        if found_inf:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        self._set_aside.append((param, param.grad))
                        param.grad = None

    def _check_unscaled(self, optimizer) -> None:
        """GradScaler.unscale_ with a scale of 1, for gradients of a loss the watch did not
        scale: checked for inf, and counted by the scaler's update() as a step of its own."""
        scaler = self.scaler
        if scaler._scale is None:   # no loss scaled yet
            scaler._lazy_init_scale_growth_tracker(self.edge.device)
        one = torch.ones((), dtype=torch.float32, device=scaler._scale.device)
        found_inf = torch.zeros((), dtype=torch.float32, device=scaler._scale.device)
        state = scaler._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = scaler._unscale_grads_(optimizer, one, found_inf, False)
        state["stage"] = OptState.UNSCALED

    def _hand_scale_to_kernel(self, optimizer) -> None:
        """A fused optimizer unscales its gradients and skips its step on inf in its own
        kernel, given `grad_scale` and `found_inf` as attributes: what GradScaler.step does
        for one (`_step_supports_amp_scaling`). The inf check stays on the device, so the
        step has no host read; the gradients stay scaled (_wrap_clip scales a clip's limit
        along), and the attributes go again after the step (after_scaled_step)."""
        scaler = self.scaler
        self.edge.inside = True
        try:
            found = scaler._check_inf_per_device(optimizer)   # counts infs, unscales nothing
            scale = scaler._get_scale_async()
            optimizer.grad_scale = scale
            optimizer.found_inf = sum(t.to(scale.device, non_blocking=True) for t in found.values())
        finally:
            self.edge.inside = False
        self._unscaled.add(id(optimizer))   # inf-checked: the step's update() counts it
        self._in_kernel.add(id(optimizer))
        self._kernel_scaled.append(optimizer)

    def take_back_scale(self) -> None:
        """After a fused step: its kernel has unscaled the gradients in place."""
        while self._kernel_scaled:
            optimizer = self._kernel_scaled.pop()
            self._in_kernel.discard(id(optimizer))
            for name in ("grad_scale", "found_inf"):
                optimizer.__dict__.pop(name, None)

    def after_scaled_step(self) -> None:
        """fp16: a skipped step's gradients back, as GradScaler leaves them; a fused
        optimizer's scale taken back."""
        while self._set_aside:
            param, grad = self._set_aside.pop()
            param.grad = grad
        if self._kernel_scaled:
            self.take_back_scale()

    def _wrap_clip(self, original):
        """torch.nn.utils.clip_grad_norm_ / clip_grad_value_ on the scaled gradients of an
        fp16 watch: the limit scaled along, the norm returned unscaled, so the loop clips
        its true gradients, as with scaler.unscale_(opt) before the clip."""
        part, edge = self, self.edge
        by_norm = original.__name__ == "clip_grad_norm_"
        name = "max_norm" if by_norm else "clip_value"   # torch's names: either way of passing

        @functools.wraps(original)
        def clip(parameters, *args, **kwargs):
            if name not in kwargs and not args:   # no limit: torch's own TypeError says so
                return original(parameters, **kwargs)
            limit, args = (kwargs.pop(name), args) if name in kwargs else (args[0], args[1:])
            scaler = part.scaler
            # the gradients are true from autograd.grad, or once an optimizer has unscaled
            # them in place
            if scaler is None or edge.inside or not part._grads_scaled or \
                    part._unscaled - part._in_kernel:
                return original(parameters, limit, *args, **kwargs)
            # a norm is unscaled on the device; clamp's limits are numbers, read under
            # `inside` (not the loop's read)
            edge.inside = True
            try:
                scale = scaler._get_scale_async() if by_norm else scaler.get_scale()
            finally:
                edge.inside = False
            if by_norm and _TOTAL_NORM is not None:
                return _clip_norm_of_scaled(parameters, limit, scale, *args, **kwargs)
            result = original(parameters, limit * scale, *args, **kwargs)
            return result / scale if isinstance(result, torch.Tensor) else result
        return clip


# torch >= 2.6: clip_grad_norm_'s two halves, so that the limit stays a number
_TOTAL_NORM = getattr(torch.nn.utils, "get_total_norm", None)


def _clip_norm_of_scaled(parameters, max_norm, scale, norm_type=2.0,
                         error_if_nonfinite=False, foreach=None):
    """clip_grad_norm_ to the true `max_norm` of gradients scaled by `scale`, a device
    tensor: the norm unscaled on the device, since torch's clip reads a tensor limit with
    float(), a sync every step."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm = _TOTAL_NORM(grads, norm_type, error_if_nonfinite, foreach) / scale
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach)
    return norm


def bf16_key(model, device) -> tuple:
    """What a bf16 measurement (and a FLOP count) depends on: the model's key and the
    device's name."""
    return "watch", model_key(model), device_name(device)


def amp_choice(requested: str, device: torch.device, optimize: bool, key):
    """The watch's amp, (value, why): as fit resolves it, where the loop can take it;
    (TRIAL, why) where bf16 is to be measured on the loop's own steps."""
    if not optimize:
        return "off", "optimize=False: the loop runs as written"
    if requested == "off":
        return "off", "asked for"
    if requested == "fp16":
        if device.type not in ("cuda", "cpu"):
            return "off", f"no autocast nbtrain trusts on {device.type}"
        return "fp16", ("asked for: autocast to float16, and a GradScaler through the "
                        "backward and step hooks (the loss scaled, the step skipped on inf)")
    if device.type == "cuda" and not gpu_has_bf16(device):   # the loop has no GradScaler
        return "off", ("this GPU has no bf16; nt.watch(amp='fp16') applies fp16 with a "
                       "GradScaler through the hooks (a clip must be called as "
                       "torch.nn.utils.clip_grad_norm_ to be scaled along)")
    if device.type not in ("cpu", "cuda"):
        return "off", f"no autocast nbtrain trusts on {device.type}"
    if requested == "bf16":
        return "bf16", "asked for"
    candidate, why = auto_amp(device)
    if candidate != "bf16":
        return "off", why
    units = bf16_units(device)
    gain, source = known_bf16_gain(key)
    if gain is None:
        return TRIAL, (f"{units}: bf16 is measured on your loop's own steps, a pair of blocks "
                       f"at a time, each once it costs at most {budget.words()} of the time run "
                       "so far; fp32 until then")
    if amp_for(gain, True, "off") == "bf16":   # a known gain was decisive
        return "bf16", f"{units}; {source} {gain:.2f}x faster than fp32 on this model"
    return "off", (f"{units}, but bf16 {source} {gain:.2f}x of fp32 speed on this "
                   "model (too small to gain)")


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


def _as_float32(output):
    """16-bit floating outputs of an autocast forward as float32; anything else as it is."""
    if isinstance(output, torch.Tensor):
        return output.float() if output.dtype in (torch.bfloat16, torch.float16) else output
    if isinstance(output, tuple) and not hasattr(output, "_fields"):
        return tuple(_as_float32(o) for o in output)
    return output
