"""Build the optimizer: param groups without decay on biases/norms, fastest implementation."""
from __future__ import annotations

import re
from typing import Tuple

import torch

from ..config import ConfigError, TrainConfig

_CLASSES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "radam": "RAdam",
            "nadam": "NAdam", "rmsprop": "RMSprop", "adagrad": "Adagrad"}
# Fused kernels (one launch for all params) exist for these, per device type (torch 2.4+).
_FUSED = {"cuda": {"sgd", "adam", "adamw", "adagrad"}, "cpu": {"sgd", "adam", "adamw", "adagrad"},
          "mps": {"adam", "adamw"}}


def param_groups(model: torch.nn.Module, cfg: TrainConfig) -> list:
    """Weight decay on matrices and kernels only: decaying biases and norm scales hurts."""
    params = _trainable(model)
    if cfg.decay_norm_and_bias or cfg.weight_decay == 0:
        return [{"params": params, "weight_decay": cfg.weight_decay}]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _trainable(model: torch.nn.Module) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def _your_groups(model: torch.nn.Module, cfg: TrainConfig) -> list:
    """Your optimizer's own weight decay (a factory's value, a class's default) stands while
    TrainConfig.weight_decay is left at its default 0: a group carrying weight_decay would
    replace it. Set, weight_decay goes into the groups as for a named optimizer."""
    if cfg.weight_decay == 0:
        return [{"params": _trainable(model)}]
    return param_groups(model, cfg)


def _hyperparams(cfg: TrainConfig) -> dict:
    name = cfg.optimizer
    if name == "sgd":
        return {"momentum": cfg.momentum, "nesterov": cfg.nesterov}
    if name in ("adam", "adamw", "radam", "nadam"):
        return {"betas": cfg.betas, "eps": cfg.eps}
    if name == "rmsprop":
        return {"momentum": cfg.momentum, "eps": cfg.eps}
    return {"eps": cfg.eps}


def _has_fused(optimizer: str, device_type: str) -> bool:
    if optimizer == "adagrad" and device_type == "cuda":   # CUDA kernel: torch 2.8 (#153038)
        major, minor = (int(n) for n in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
        return (major, minor) >= (2, 8)
    return optimizer in _FUSED.get(device_type, ())


# Plain SGD (no momentum) on a CPU updates each parameter with one op of its own; its fused
# kernel splits even a tiny tensor across threads, which gains no more than the noise on a
# quiet CPU and waits on a busy core at every step: "auto" keeps plain SGD's own update.
PLAIN_SGD_ON_CPU = ("plain SGD on a CPU: its fused kernel gains no more than the noise and "
                    "loses on a busy machine (docs/guide/measured.md)")


def _fused_pays(optimizer: str, device_type: str, momentum: float) -> bool:
    """Whether "auto" gives `optimizer` its fused kernel: where it has one that pays."""
    if optimizer == "sgd" and device_type == "cpu" and momentum == 0:
        return False
    return _has_fused(optimizer, device_type)


def resolve_impl(cfg: TrainConfig, device: torch.device) -> Tuple[str, str]:
    if callable(cfg.optimizer):
        return "its own", "your optimizer: its class or factory picks the kernel"
    fused_ok = _has_fused(cfg.optimizer, device.type)
    if cfg.optimizer_impl == "fused" and not fused_ok:
        from ..config import ConfigError
        raise ConfigError(f"TrainConfig.optimizer_impl='fused' is not available for "
                          f"optimizer={cfg.optimizer!r} on {device.type}: use 'auto'.",
                          field="optimizer_impl")
    if cfg.optimizer_impl != "auto":
        return cfg.optimizer_impl, "asked for"
    if _fused_pays(cfg.optimizer, device.type, cfg.momentum):
        return "fused", f"fused {cfg.optimizer} kernel exists on {device.type}"
    if fused_ok:
        return "for-loop", PLAIN_SGD_ON_CPU
    if device.type == "cuda":
        return "foreach", "no fused kernel: foreach batches the per-parameter launches"
    return "for-loop", f"no fused {cfg.optimizer} on {device.type}"


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, impl: str) -> torch.optim.Optimizer:
    if callable(cfg.optimizer):
        return _custom_optimizer(model, cfg)
    cls = getattr(torch.optim, _CLASSES[cfg.optimizer])
    kwargs = dict(lr=cfg.lr, **_hyperparams(cfg))
    if impl == "fused":
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = impl == "foreach"
    return cls(param_groups(model, cfg), **kwargs)


def _custom_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The user's optimizer: a class gets nbtrain's param groups and `lr`; a factory gets
    the param groups and builds it as it likes, but its LR must be `lr`, since the loop
    sets every group's LR from `lr` and the schedule before each step. Its weight decay is
    its own unless TrainConfig.weight_decay is set (`_your_groups`)."""
    made = cfg.optimizer
    groups = _your_groups(model, cfg)
    if isinstance(made, type) and issubclass(made, torch.optim.Optimizer):
        opt = made(groups, lr=cfg.lr)
        _check_takes_weight_decay(opt, cfg)
        return opt
    opt = made(groups)
    if not isinstance(opt, torch.optim.Optimizer):
        raise _config_error(f"TrainConfig.optimizer={made!r} returned a {type(opt).__name__}, "
                            "not a torch.optim.Optimizer: pass an Optimizer subclass or a "
                            "function params -> torch.optim.Optimizer.")
    _check_takes_weight_decay(opt, cfg)
    _check_factory_weight_decay(opt, cfg)
    rates = sorted({group["lr"] for group in opt.param_groups})
    if rates != [cfg.lr]:
        raise _config_error(f"TrainConfig.optimizer={made!r} made an optimizer with lr "
                            f"{', '.join(map(str, rates))}, but TrainConfig.lr={cfg.lr}: nbtrain "
                            "sets every group's LR from lr (and the scheduler) before each step. "
                            f"Pass TrainConfig(lr={rates[0]}) to train with it (one LR for all "
                            "groups; a scheduler factory shapes it over the steps).")
    return opt


def _check_takes_weight_decay(opt: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """An optimizer without weight decay keeps a group's weight_decay without using it."""
    if cfg.weight_decay != 0 and "weight_decay" not in opt.defaults:
        raise _config_error(f"TrainConfig.weight_decay={cfg.weight_decay} cannot apply: "
                            f"{type(opt).__name__} has no weight_decay setting. Leave "
                            "weight_decay at 0.0 to train without, or use an optimizer that "
                            "takes one.", field="weight_decay")


def _check_factory_weight_decay(opt: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """A set weight_decay and the factory's own value both say how to decay: refuse to pick
    one silently, as for the LR."""
    own = opt.defaults.get("weight_decay")
    if cfg.weight_decay == 0 or own == cfg.weight_decay:
        return
    raise _config_error(f"TrainConfig.optimizer={cfg.optimizer!r} made an optimizer with "
                        f"weight_decay {own}, but TrainConfig.weight_decay={cfg.weight_decay}. "
                        f"Build it with weight_decay={cfg.weight_decay} to train with that "
                        "(nbtrain keeps it off biases and norm weights unless "
                        "decay_norm_and_bias=True), or leave TrainConfig.weight_decay at 0.0 "
                        f"to train with your factory's {own}.", field="weight_decay")


def _config_error(text: str, field: str = "optimizer") -> ConfigError:
    return ConfigError(text, field=field)


# -- your own optimizer, under nt.watch ---------------------------------------------------------
def impl_for(optimizer: torch.optim.Optimizer, device: torch.device, requested: str,
             why_not: str = "") -> Tuple[str, str]:
    """The kernel the watch gives the loop's optimizer, (impl, why): the fused one where
    torch has it for this class on this device, else the optimizer's own; its own where
    `why_not` says why the watch may not change it (its Plan's line)."""
    name = _CLASSES_BY_TYPE.get(type(optimizer))
    own = _own_impl(optimizer)
    if why_not:
        return own, why_not
    has = bool(name) and _has_fused(name, device.type)
    momentum = optimizer.param_groups[0].get("momentum", 0)
    wanted = requested == "fused" or requested == "auto" and _fused_pays(name, device.type,
                                                                          momentum)
    if has and wanted and _can_switch(optimizer):
        return "fused", f"fused {name} kernel exists on {device.type} (for the watch only)"
    if has and not wanted and requested == "auto":   # a fused kernel that does not pay here
        return own, f"your optimizer's own ({PLAIN_SGD_ON_CPU})"
    if requested == "fused":
        raise ConfigError(f"TrainConfig.optimizer_impl='fused' is not available for your "
                          f"{type(optimizer).__name__} on {device.type} (or it has begun "
                          "stepping, or is differentiable/capturable): use 'auto'.",
                          field="optimizer_impl")
    if requested == "foreach" and "foreach" in optimizer.defaults and _can_switch(optimizer):
        return "foreach", "asked for (for the watch only)"
    return own, "your optimizer's own"


_CLASSES_BY_TYPE = {getattr(torch.optim, cls): name for name, cls in _CLASSES.items()}


def _own_impl(optimizer) -> str:
    group = optimizer.param_groups[0]
    return "fused" if group.get("fused") else ("foreach" if group.get("foreach") else "its own")


def _can_switch(optimizer) -> bool:
    """Before its first step (no state: fused keeps its step counts on the device) and
    with none of the flags fused refuses."""
    groups = optimizer.param_groups
    return not optimizer.state and all(
        not g.get("differentiable") and not g.get("capturable") and not g.get("fused")
        for g in groups)


def apply_impl(optimizer: torch.optim.Optimizer, impl: str):
    """Give `optimizer` the kernel `impl` ("fused", "foreach"; anything else: as it is);
    returns the function that puts its groups' flags back."""
    if impl not in ("fused", "foreach"):
        return lambda: None
    saved = [(g, {k: g[k] for k in ("fused", "foreach") if k in g}) for g in optimizer.param_groups]
    for group, _ in saved:
        group["fused"], group["foreach"] = impl == "fused", impl == "foreach"
    had = {name: vars(optimizer)[name] for name in (_FUSED_CHECK, _AMP) if name in vars(optimizer)}
    # as torch's constructors set it: a loop's own GradScaler hands a fused kernel its scale
    # and inf flag (no found_inf read back each step), and a foreach step none
    optimizer._step_supports_amp_scaling = impl == "fused"

    def restore() -> None:
        for group, flags in saved:
            group.pop("fused", None)
            group.pop("foreach", None)
            group.update(flags)
        for name in (_FUSED_CHECK, _AMP):   # the optimizer's attributes as they were
            vars(optimizer).pop(name, None)
        vars(optimizer).update(had)
    return restore


_FUSED_CHECK = "_need_device_dtype_check_for_fused"   # torch/optim/optimizer.py
_AMP = "_step_supports_amp_scaling"                    # torch/amp/grad_scaler.py, step()
