"""Data-parallel training in local processes on torch.distributed: TrainConfig(processes=N).

`fit` hands a run with processes > 1 here. This, the notebook's process, starts N rank
processes; each runs the same per-rank loop as a one-process fit (loop._prepare,
loop._train_safely) on its share of each epoch's samples, with the model wrapped in
DistributedDataParallel: gradients travel only through torch.distributed (gloo on CPU,
nccl on CUDA, one GPU per rank). The ranks' records stream back through a queue into the
notebook's one Run, so the Panel, Dashboard and progress bar work unchanged; Stop is
agreed by all ranks at interval boundaries; at the end the user's model object holds rank
0's weights and run.optimizer its state.
"""
from __future__ import annotations

import torch

from .devices import resolve_device


def resolve_processes(run) -> int:
    """How many processes train the run; records the choice in run.resolved["processes"]."""
    requested = run.config.processes
    if requested != "auto":
        run.resolved["processes"] = (requested, "asked for")
        return requested
    device, _ = resolve_device(run.config.device) if run.config.device != "cpu" \
        else (torch.device("cpu"), "")
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus > 1:
        choice = (gpus, f"{gpus} visible GPUs: one process each")
    elif gpus == 1:
        choice = (1, "one visible GPU: one process")
    else:
        choice = (1, f"device is {device.type}: one process uses every core (processes=N "
                     "splits them between N processes)")
    run.resolved["processes"] = choice
    return choice[0]
