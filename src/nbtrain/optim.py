"""Build the optimizer: param groups without decay on biases/norms, fastest implementation."""
from __future__ import annotations

import re
from typing import Tuple

import torch

from .config import ConfigError, TrainConfig

_CLASSES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "radam": "RAdam",
            "nadam": "NAdam", "rmsprop": "RMSprop", "adagrad": "Adagrad"}
# Fused kernels (one launch for all params) exist for these, per device type (torch 2.4+).
_FUSED = {"cuda": {"sgd", "adam", "adamw", "adagrad"}, "cpu": {"sgd", "adam", "adamw", "adagrad"},
          "mps": {"adam", "adamw"}}


def param_groups(model: torch.nn.Module, cfg: TrainConfig) -> list:
    """Weight decay on matrices and kernels only: decaying biases and norm scales hurts."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.decay_norm_and_bias or cfg.weight_decay == 0:
        return [{"params": params, "weight_decay": cfg.weight_decay}]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


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


def resolve_impl(cfg: TrainConfig, device: torch.device) -> Tuple[str, str]:
    if callable(cfg.optimizer):
        return "its own", "your optimizer: its class or factory picks the kernel"
    fused_ok = _has_fused(cfg.optimizer, device.type)
    if cfg.optimizer_impl == "fused" and not fused_ok:
        from .config import ConfigError
        raise ConfigError(f"TrainConfig.optimizer_impl='fused' is not available for "
                          f"optimizer={cfg.optimizer!r} on {device.type}: use 'auto'.",
                          field="optimizer_impl")
    if cfg.optimizer_impl != "auto":
        return cfg.optimizer_impl, "asked for"
    if fused_ok:
        return "fused", f"fused {cfg.optimizer} kernel exists on {device.type}"
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
    sets every group's LR from `lr` and the schedule before each step."""
    made = cfg.optimizer
    groups = param_groups(model, cfg)
    if isinstance(made, type) and issubclass(made, torch.optim.Optimizer):
        return made(groups, lr=cfg.lr)
    opt = made(groups)
    if not isinstance(opt, torch.optim.Optimizer):
        raise _config_error(f"TrainConfig.optimizer={made!r} returned a {type(opt).__name__}, "
                            "not a torch.optim.Optimizer: pass an Optimizer subclass or a "
                            "function params -> torch.optim.Optimizer.")
    rates = sorted({group["lr"] for group in opt.param_groups})
    if rates != [cfg.lr]:
        raise _config_error(f"TrainConfig.optimizer={made!r} made an optimizer with lr "
                            f"{', '.join(map(str, rates))}, but TrainConfig.lr={cfg.lr}: nbtrain "
                            "sets every group's LR from lr (and the scheduler) before each step. "
                            f"Pass TrainConfig(lr={rates[0]}) to train with it (one LR for all "
                            "groups; a scheduler factory shapes it over the steps).")
    return opt


def _config_error(text: str) -> ConfigError:
    return ConfigError(text, field="optimizer")
