"""fp16's loss scaling through the watch's hooks (optimize=True, amp="fp16" in force), as
a GradScaler recipe would do it in the loop: the loss scaled at its backward, the
gradients unscaled (or a fused kernel handed the scale) before each optimizer's step, the
step skipped on inf, the scale updated once per step, and a clip's limit scaled along.

The part exists only where fp16 may be in force (scaling.py's `loss_scaling`, which
loads this module only there).
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch.amp.grad_scaler import OptState

from .scaling import CLIPS


class LossScaling:
    """The watch's part that applies fp16's GradScaler through the backward and step hooks
    (see the module's docstring). Until the model is found (`begin`) it only notes whether
    the loop's gradients go to an optimizer (_wrap_zero_grad); where the amp found is not
    fp16 its patches are undone and it lets everything through."""

    def __init__(self, edge, autocast):
        self.edge, self.autocast = edge, autocast
        self.scaler = None              # the GradScaler the hooks apply, once fp16 is in force
        self._unscaled = set()          # ids of the optimizers unscaled since the last update
        self._kernel_scaled = []        # fused optimizers holding the scale, until their step ends
        self._in_kernel = set()         # ids of those inf-checked this step: gradients still scaled
        self._set_aside = []            # (param, grad) of a step skipped on inf, until after it
        self._grads_scaled = False      # the loop's last backward ran on the scaled loss
        self._to_optimizer = False      # an optimizer has zeroed or stepped: the loss may be scaled
        self._undo = []                 # the clip and zero_grad patches
        self._undo_zero_grad = None     # the zero_grad patch that tells it, until it has

    def install(self) -> None:
        patches = self.edge.patches
        self._undo = [patches.patch(torch.nn.utils, name, self._wrap_clip) for name in CLIPS]
        self._undo_zero_grad = patches.patch(torch.optim.Optimizer, "zero_grad",
                                             self._wrap_zero_grad)

    def begin(self, fp16: bool, device) -> None:
        """The model is found: fp16 in force, with a GradScaler the Run keeps; or not, and
        torch's functions are its own again."""
        if fp16:
            self.scaler = torch.amp.GradScaler(device.type)
            self.edge.run.equip(scaler=self.scaler)
            return
        for undo in self._undo:
            undo()
        self._gradients_go_to_an_optimizer()

    def stepped_scaled(self) -> bool:
        """A step left gradients set aside or a fused kernel holding the scale."""
        return bool(self._set_aside or self._kernel_scaled)

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
        with self.edge.own:
            return self.scaler.scale(loss)

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
        if not self._to_optimizer and self.edge.tally.trained:
            self.autocast.settle("fp16", (
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
        if self.scaler is None:   # before the model is found, or not fp16 after all
            return
        self._gradients_go_to_an_optimizer()
        if id(optimizer) in self._unscaled:
            return
        if self._grads_scaled and _kernel_takes_the_scale(optimizer):
            self._hand_scale_to_kernel(optimizer)
            return
        with self.edge.own:   # the inf check's .item() is not the loop's host read
            if self._grads_scaled:
                self.scaler.unscale_(optimizer)
            else:
                self._check_unscaled(optimizer)
            self._unscaled.add(id(optimizer))
            # what GradScaler.step reads (torch/amp/grad_scaler.py, _maybe_opt_step)
            state = self.scaler._per_optimizer_states[id(optimizer)]
            found_inf = sum(v.item() for v in state["found_inf_per_device"].values())
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
        with self.edge.own:
            found = scaler._check_inf_per_device(optimizer)   # counts infs, unscales nothing
            scale = scaler._get_scale_async()
            optimizer.grad_scale = scale
            optimizer.found_inf = sum(t.to(scale.device, non_blocking=True) for t in found.values())
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
            with edge.own:
                scale = scaler._get_scale_async() if by_norm else scaler.get_scale()
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
