"""What the watch changes in the model's forward, for the watch only (as the Plan
allows): autocast around it (bf16 or fp16; fp16's loss scaling is fp16.py's part), its
outputs given back in float32 for the loop's loss, and channels_last. The amp comes from
the one ladder nt.fit climbs too (auto.precision.resolve_amp); bf16 "auto" is decided on
the loop's own steps (measure.py) where no gain is known for the same bf16 key; a loop
that runs its own autocast keeps it."""
from __future__ import annotations

import functools

import torch

from ..auto import budget
from ..auto.precision import (
    OWN_AUTOCAST,
    bf16_key,
    bf16_units,
    decided_amp,
    known_bf16_gain,
    model_inputs,
    resolve_amp,
)
from .scaling import clip_out_of_reach

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TRIAL = "trial"   # watch_amp's value where bf16 is measured on the loop's own steps


class Autocast:
    """The watch's part that changes the model's forward: autocast and channels_last. It
    alone writes the Run's amp (`settle`); the measuring part switches it during the bf16
    trial through `run_in`."""

    def __init__(self, edge):
        self.edge = edge
        self.amp = "off"                # what the model's forward runs in now (read-only outside)
        self.key = None                 # the model found's bf16 key, made when first called
        self._to_channels_last = False  # channels_last=True: convert at the next forward
        self._channels_last = False     # the model is in NHWC now
        self._autocast = []             # the autocast contexts entered in the model's forward

    def resolve(self, model, args) -> str:
        """amp and channels_last for the model found, its first forward taking `args`;
        returns the amp chosen, TRIAL where bf16 is to be measured on the loop's own steps
        (fp32 until then)."""
        edge = self.edge
        device, plan = edge.device, edge.plan
        inputs = model_inputs(args)
        # made where a gain or a count is looked up: its repr(model) takes ~1 ms on a small
        # ViT, which a watch that measures nothing never needs
        self.key = functools.cache(lambda: bf16_key(model, device, inputs))
        own = _own_autocast(device)   # whatever the Plan: the diagnosis then advises no amp
        amp, why = watch_amp(edge.run.config.amp, device, plan.why_not("amp"), self.key, own)
        self.settle("off" if amp == TRIAL else amp, why)
        self._to_channels_last = plan.may("channels_last") and edge.run.config.channels_last is True
        return amp

    def settle(self, amp: str, why: str) -> None:
        """The Run's amp and what the forward runs in, from here on: the one place a watch
        writes run.resolved["amp"]."""
        self.amp = amp
        self.edge.run.resolved["amp"] = (amp, why)

    def run_in(self, amp: str) -> None:
        """The bf16 trial's block: the forwards from here run in `amp` ("off" or "bf16")."""
        self.amp = amp

    def changes_forward(self) -> bool:
        return self.amp != "off" or self._to_channels_last

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
            if self.edge.tally.trained:
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


def _own_autocast(device: torch.device):
    """The dtype of the autocast the loop runs its forward under on `device`; None where it
    runs none, or the device has no autocast (meta, standing in for a GPU in tests)."""
    try:
        enabled = torch.is_autocast_enabled(device.type)
    except RuntimeError:   # "unknown device type for autocast"
        return None
    return torch.get_autocast_dtype(device.type) if enabled else None


def _as_float32(output):
    """16-bit floating outputs of an autocast forward as float32; anything else as it is."""
    if isinstance(output, torch.Tensor):
        return output.float() if output.dtype in (torch.bfloat16, torch.float16) else output
    if isinstance(output, tuple) and not hasattr(output, "_fields"):
        return tuple(_as_float32(o) for o in output)
    return output


def watch_amp(requested: str, device: torch.device, why_not: str, key, own_autocast):
    """The watch's amp, (value, why): the loop's own autocast kept (`own_autocast`: its
    dtype, or None; a Plan's refusal said beside it), the Plan's refusal, or the one
    ladder's answer (resolve_amp: the same ConfigError as nt.fit's for the same request on
    the same device); (TRIAL, why) where "auto" took bf16 and no gain is known for `key()`,
    so that bf16 is measured on the loop's own steps."""
    if own_autocast:   # "off" is what the watch adds, not what the forward runs in
        dtype = str(own_autocast).replace("torch.", "")
        return "off", (f"{why_not + '; ' if why_not else ''}{OWN_AUTOCAST} ({dtype}), kept "
                       "as it is: the watch adds none")
    if why_not:
        return "off", why_not
    amp, why = resolve_amp(requested, device)
    held = clip_out_of_reach() if amp == "fp16" and requested == "auto" else ""
    if held:
        return "off", (f"{why}; but {held}, bound before the watch, which would clip fp16's "
                       "scaled gradients: fp32, as written (call it as "
                       "torch.nn.utils.clip_grad_norm_(...) to have its limit scaled along)")
    if amp == "fp16":
        return "fp16", (f"{why}: autocast to float16, and a GradScaler through the backward "
                        "and step hooks (the loss scaled, the step skipped on inf)")
    if requested != "auto" or amp != "bf16":
        return amp, why
    units = bf16_units(device)
    gain, source = known_bf16_gain(key())
    if gain is None:
        return TRIAL, (f"{units}: bf16 is measured on your loop's own steps, a pair of blocks "
                       f"at a time, each once it costs at most {budget.words()} of the time run "
                       "so far; fp32 until then")
    return decided_amp(gain, source, units, "off")   # a known gain was decisive
