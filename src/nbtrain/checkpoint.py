"""Checkpoints: everything a run needs to continue bit for bit, in one torch.save file.

Written atomically (temp file in the same folder, then rename) so a crash mid-write
never leaves a truncated checkpoint; read with `weights_only=True`, which unpickles
tensors and plain containers only, never arbitrary code.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

FORMAT = 1


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def state_of(run) -> dict:
    return {
        "format": FORMAT,
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "schedule": run.schedule.state_dict(),
        "scaler": run.scaler.state_dict(),
        # RNG as it was when training ended, not as the user's later cells left it
        "rng": run._rng_at_end if run._rng_at_end is not None else rng_state(),
        "position": {"step": run.step, "epoch": run.epoch, "batch_in_epoch": run.batch_in_epoch},
        "config": run.config.to_dict(),
        "history": list(run.history),
    }


def path_in(folder) -> str:
    return os.path.join(os.fspath(folder), "last.pt")


def save(state: dict, path) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return str(path)


def load(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: pass the path of a file that "
                                "nbtrain wrote (checkpoint_dir/last.pt) or a Run.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path} is not a readable nbtrain checkpoint: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not an nbtrain checkpoint (format {FORMAT}).")
    return state


def restore(run, state: dict) -> None:
    """Load `state` into the freshly built parts of `run` and move it to the saved position."""
    from .config import ConfigError
    saved = state["config"]
    if saved["optimizer"] != run.config.optimizer:
        raise ConfigError(f"TrainConfig.optimizer={run.config.optimizer!r} cannot resume a run "
                          f"trained with {saved['optimizer']!r}: its optimizer state does not "
                          f"fit. Resume with optimizer={saved['optimizer']!r}, or start anew.")
    try:
        run.model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise ValueError(f"the checkpoint does not fit this model: {exc}") from exc
    run.optimizer.load_state_dict(state["optimizer"])
    run.schedule.load_state_dict(state["schedule"])
    if run.config.lr != saved["lr"]:   # a new lr given for the rest of the run wins
        run.schedule.base_lr = run.config.lr
    if state["scaler"]:
        run.scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    pos = state["position"]
    run.step, run.epoch, run.batch_in_epoch = pos["step"], pos["epoch"], pos["batch_in_epoch"]
    run.history = list(state["history"])
