"""Checkpoints: everything a run needs to continue bit for bit, in one torch.save file.

Written atomically (temp file in the same folder, then rename) so a crash mid-write
never leaves a truncated checkpoint; read with `weights_only=True`, which unpickles
tensors and plain containers only, never arbitrary code.
"""
from __future__ import annotations

import copy
import os
import zipfile
from pathlib import Path
from typing import Optional

import torch

from .files import atomic_write

FORMAT = 1
# The run's timed "auto" choices, which a resume keeps (prepare.kept_choices), and where they were made
KEPT_CHOICES = ("amp", "num_threads", "num_workers")
RESOLVED_KEPT = ("device", "processes") + KEPT_CHOICES


def rng_state(device=None) -> dict:
    """The CPU RNG, plus the CUDA RNG of `device` when the run trains on a GPU.

    Only the run's own GPU: the others are not the run's, and a resume may see fewer GPUs or
    train on another index. A CPU run never calls into torch.cuda.
    """
    state = {"cpu": torch.default_generator.get_state()}   # what get_rng_state returns
    if device is not None and getattr(device, "type", device) != "cpu" \
            and torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _device_of(run) -> torch.device:
    """The device the run trains on, as fit resolved it (CPU for a run never prepared)."""
    name, _ = run.resolved.get("device", ("cpu", ""))
    return torch.device(name)


def state_of(run) -> dict:
    return {
        "format": FORMAT,
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "schedule": run.schedule.state_dict(),
        "scaler": run.scaler.state_dict(),
        # RNG as it was when training ended, not as the user's later cells left it
        "rng": run.rng_at_end if run.rng_at_end is not None else rng_state(_device_of(run)),
        "position": {"step": run.step, "epoch": run.epoch, "batch_in_epoch": run.batch_in_epoch},
        "config": run.config.to_dict(),
        "history": list(run.history),
        "resolved": {name: run.resolved[name] for name in RESOLVED_KEPT if name in run.resolved},
    }


def path_in(folder) -> str:
    return os.path.join(os.fspath(folder), "last.pt")


def save(state: dict, path) -> str:
    path = Path(path)
    with atomic_write(path) as f:
        torch.save(state, f)
    return str(path)


def load(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: pass the path of a file that "
                                "nbtrain wrote (checkpoint_dir/last.pt) or a Run.")
    _check_intact(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path} is not a readable nbtrain checkpoint: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not an nbtrain checkpoint (format {FORMAT}).")
    return state


def _check_intact(path: Path) -> None:
    """torch.save writes a zip whose members carry CRC-32s, but torch.load does not check
    them: a flipped bit in a weight loads silently. Check every member first (one more
    read of the file)."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError) as exc:
        raise ValueError(f"{path} is not a readable nbtrain checkpoint ({exc}): it is damaged, "
                         "or not a file nbtrain wrote. Resume from an earlier checkpoint, or "
                         "start anew.") from None
    if damaged is not None:
        raise ValueError(f"{path} is damaged: its part {damaged!r} fails its CRC check "
                         "(the file changed after it was written). Resume from an earlier "
                         "checkpoint, or start anew.")


def restore(run, state: dict) -> None:
    """Load `state` into the freshly built parts of `run` and move it to the saved position."""
    from .config import ConfigError
    from .kinds import text_of
    saved = state["config"]
    given = text_of(run.config.optimizer)   # your own optimizer by name: "custom:Adadelta"
    if saved["optimizer"] != given:
        raise ConfigError(f"TrainConfig.optimizer={given!r} cannot resume a run trained"
                          f" with {saved['optimizer']!r}: its optimizer state does not "
                          f"fit. Resume with optimizer={saved['optimizer']!r}, or start anew.",
                          field="optimizer")
    _check_model_fits(run.model.state_dict(), state["model"])   # before anything is loaded
    _check_groups_fit(run, saved, state["optimizer"])
    run.model.load_state_dict(state["model"])
    # A copy: load_state_dict keeps the given state tensors (`.to` on the same device returns
    # them), so resuming from a Run would step that Run's own moments, and each branch of it.
    run.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
    run.schedule.load_state_dict(state["schedule"])
    if run.config.lr != saved["lr"]:   # a new lr given for the rest of the run wins
        run.schedule.base_lr = run.config.lr
    if state["scaler"]:
        run.scaler.load_state_dict(state["scaler"])
    _restore_rng(state["rng"], _device_of(run))
    pos = state["position"]
    run.move_to(pos["step"], pos["epoch"], pos["batch_in_epoch"])
    _continue_position(run, saved)
    run.replace_history(state["history"])


def _continue_position(run, saved_config: dict) -> None:
    """A checkpoint of another batch_size, grad_accum_steps or process count: continue at
    the same sample of the epoch, in the data order the new settings imply. The position
    counts one process's batches: batch k of all processes ends at sample
    (k + 1) x batch_size x processes of the epoch's order."""
    before, world = _processes(saved_config), run.resolved.get("processes", (1, ""))[0]
    sizes = _batch_sizes(run, saved_config)
    changed = _changed(saved_config, run.config, (before, world), sizes)
    if not changed:
        return
    seen = run.batch_in_epoch * sizes[0] * before
    per_batch = sizes[1] * world
    run.move_to(batch_in_epoch=seen // per_batch)   # the batch that holds sample `seen`
    order = f" in the data order of {world} process(es)" if before != world else ""
    each = " of each" if world > 1 else ""
    note = (f"resumed a run of {changed}: the epoch continues at sample {seen}{order} "
            f"(batch {run.batch_in_epoch}{each})")
    first = run.batch_in_epoch * per_batch
    if first < seen:
        note += (f"; batch {run.batch_in_epoch} starts at sample {first}, so samples {first} "
                 f"to {seen - 1} ({seen - first}) are trained on again")
    run.notes.append(note)


def _processes(saved_config: dict) -> int:
    count = saved_config.get("processes", 1)
    return count if isinstance(count, int) else 1


def _batch_sizes(run, saved_config: dict) -> tuple:
    """(saved, new) batch size. Your own DataLoader's is its own, the same on both sides:
    TrainConfig.batch_size does not apply to it (its batch_size may be None: count batches)."""
    if "batch_size" in run.resolved:   # set by a given DataLoader only
        size = run.resolved["batch_size"][0] or 1
        return size, size
    return saved_config["batch_size"], run.config.batch_size


def _changed(saved_config: dict, cfg, processes: tuple, sizes: tuple) -> str:
    """What moved the position: "2 process(es) with 1 and batch_size=8 with batch_size=16"."""
    (before, world), (old_size, new_size) = processes, sizes
    changes = [f"{before} process(es) with {world}"] if before != world else []
    if old_size != new_size:
        changes.append(f"batch_size={old_size} with batch_size={new_size}")
    old_accum = saved_config.get("grad_accum_steps", 1)
    if old_accum != cfg.grad_accum_steps:
        changes.append(f"grad_accum_steps={old_accum} with grad_accum_steps={cfg.grad_accum_steps}")
    return " and ".join(changes)


def _check_model_fits(mine: dict, saved: dict) -> None:
    """Refuse a checkpoint of another model before loading any of it: torch's
    load_state_dict copies the matching layers before it reports the others."""
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    resized = [f"{k} {tuple(saved[k].shape)} -> {tuple(mine[k].shape)}" for k in mine
               if k in saved and hasattr(mine[k], "shape") and mine[k].shape != saved[k].shape]
    problems = [f"{what}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                for what, names in (("not in the checkpoint", missing),
                                    ("only in the checkpoint", unexpected),
                                    ("shape changed", resized)) if names]
    if problems:
        raise ValueError("the checkpoint does not fit this model (nothing was loaded): "
                         + "; ".join(problems) + ". Resume with the model it was saved from.")


def _check_groups_fit(run, saved_config: dict, saved_optimizer: dict) -> None:
    """Parameter groups come from weight_decay and decay_norm_and_bias: name a change of
    those instead of torch's "different number of parameter groups"."""
    groups = [len(g["params"]) for g in saved_optimizer["param_groups"]]
    mine = [len(g["params"]) for g in run.optimizer.param_groups]
    if groups == mine:
        return
    changed = [f"{name} changed from {saved_config[name]!r} to {getattr(run.config, name)!r}"
               for name in ("weight_decay", "decay_norm_and_bias")
               if saved_config.get(name) != getattr(run.config, name)]
    raise ValueError(f"the checkpoint's optimizer has parameter groups of {groups} parameters, "
                     f"this run's of {mine}" + (f": {'; '.join(changed)}" if changed else "")
                     + ". Resume with the settings it was saved with, or start anew.")


def _restore_rng(rng: dict, device: torch.device) -> None:
    """Put the saved CUDA RNG on the GPU this run trains on, whichever index it had before."""
    torch.set_rng_state(rng["cpu"])
    cuda = rng.get("cuda")
    if device.type != "cuda" or cuda is None:   # a CPU resume never touches (or starts) CUDA
        return
    if isinstance(cuda, list):   # older checkpoints: every visible GPU's state, by index
        index = device.index if device.index is not None else torch.cuda.current_device()
        cuda = cuda[index] if index < len(cuda) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


# -- what `resume=` may be -----------------------------------------------------------------------
CHECKPOINT_FILE = "last.pt"   # nbtrain's checkpoint file inside a Ray checkpoint's folder


def state_to_resume(resume) -> Optional[dict]:
    """The state `fit(resume=...)` continues from: a Run's, or a checkpoint file's (a path,
    a Ray Result or Checkpoint, a checkpoint folder); None for no resume."""
    if resume is None:
        return None
    if hasattr(resume, "state_dict") and hasattr(resume, "history"):   # a Run
        if resume.optimizer is None:   # interrupted before step 1: nothing to continue
            return None
        return resume.state_dict()
    resume = checkpoint_path(resume) or resume
    if isinstance(resume, (str, bytes)) or hasattr(resume, "__fspath__"):
        return load(resume)
    raise TypeError(f"resume must be a Run, a checkpoint path or a Ray Result/Checkpoint; "
                    f"got {type(resume).__name__}.")


def checkpoint_path(resume) -> Optional[str]:
    """The nbtrain checkpoint file in a Ray Result, a Ray Checkpoint (on any storage Ray
    reads: it is copied here), a checkpoint folder, or a run's storage folder (its last
    checkpoint); None when `resume` is none of those."""
    if type(resume).__name__ == "Result" and hasattr(resume, "checkpoint"):   # ray.train
        if resume.checkpoint is None:
            raise ValueError("this Ray run saved no checkpoint: set checkpoint_dir (Ray's "
                             "storage_path) to save one")
        resume = resume.checkpoint
    if hasattr(resume, "to_directory"):   # a ray.train.Checkpoint
        folder = resume.to_directory()
    elif isinstance(resume, (str, os.PathLike)) and os.path.isdir(resume):
        folder = os.fspath(resume)
    else:
        return None
    if not os.path.isfile(os.path.join(folder, CHECKPOINT_FILE)):
        saved = sorted(name for name in os.listdir(folder) if name.startswith("checkpoint_")
                       and os.path.isfile(os.path.join(folder, name, CHECKPOINT_FILE)))
        if not saved:
            raise FileNotFoundError(f"no nbtrain checkpoint in {folder} (expected "
                                    f"{CHECKPOINT_FILE}, or checkpoint_*/{CHECKPOINT_FILE} "
                                    "folders of a cluster='ray' run)")
        folder = os.path.join(folder, saved[-1])
    return os.path.join(folder, CHECKPOINT_FILE)
