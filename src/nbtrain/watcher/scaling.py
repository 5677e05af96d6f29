"""Whether fp16's loss scaling takes part in a watch (`loss_scaling`): fp16.py's
LossScaling where fp16 may be in force (amp="fp16", or "auto" with a GPU, whose ladder may
take fp16), loaded only there; elsewhere NoScaling, whose methods do nothing (an optional
feature as a no-op, as GradScaler(enabled=False) is).
"""
from __future__ import annotations

import torch


def loss_scaling(edge, autocast):
    """LossScaling where fp16 may come into force, else NoScaling."""
    cfg = edge.run.config
    may_come = cfg.amp == "fp16" or (cfg.amp == "auto" and torch.cuda.is_available())
    if edge.plan.may("amp") and may_come:
        from .fp16 import LossScaling
        return LossScaling(edge, autocast)
    return NoScaling()


CLIPS = ("clip_grad_norm_", "clip_grad_value_")   # torch.nn.utils's, scaled along (_wrap_clip)


def clip_out_of_reach() -> str:
    """Where a name bound before the watch holds torch's own clip (`from torch.nn.utils
    import clip_grad_norm_` at the top of a module or a notebook, or in a frame running
    now), in words; '' where none does. The watch scales a clip's limit along by patching
    torch.nn.utils, which such a name does not see: it would clip fp16's scaled gradients
    to the true limit, so "auto" does not take fp16 there (nt.fit clips in its own loop).
    Read once, where "auto" would take fp16: every module's names and the live frames'."""
    import sys
    originals = {id(getattr(torch.nn.utils.clip_grad, name)): name for name in CLIPS}
    scopes = [(name, vars(module)) for name, module in list(sys.modules.items())
              if not name.startswith(("torch", "nbtrain")) and hasattr(module, "__dict__")]
    frame = sys._getframe(1)
    while frame is not None:
        scopes.append((frame.f_code.co_filename, frame.f_locals))
        frame = frame.f_back
    for where, names in scopes:
        for key, value in list(names.items()):
            if id(value) in originals:
                return f"`{key}` in {where} is torch's {originals[id(value)]}"
    return ""


class NoScaling:
    """No fp16: every call of the steps part and the backward goes through as it is."""

    def install(self) -> None: ...
    def begin(self, fp16: bool, device) -> None: ...
    def last_update(self) -> None: ...
    def take_back_scale(self) -> None: ...
    def gradients_handed_back(self) -> None: ...
    def unscale_or_skip(self, optimizer) -> None: ...
    def after_scaled_step(self) -> None: ...

    def stepped_scaled(self) -> bool:
        return False

    def scaled_for_backward(self, loss):
        return loss
