"""The watch of one rank of N (%%fasttrain --processes N): the loop as written, made
data-parallel from outside.

- the training DataLoader yields this rank's shard of every epoch: the sampler's order of
  the epoch, every world-th sample from the rank's own (DistributedSampler's striding), cut
  to the same length on every rank and batched as the loader batches; so the ranks' k-th
  batches together are the k-th batch of world x the batch size;
- the model's parameters and buffers start as rank 0's (broadcast at its first forward);
- the model's gradients are averaged over the ranks while each backward runs, in buckets
  as DDP's reducer sends them (buckets.py); with the loss a mean over the batch, the update
  is that of the whole global batch. With gradient accumulation each micro-batch's share
  is averaged in turn (the average of an average plus the new part is the average of the
  sum); a closure's evaluations (LBFGS) and hand updates after backward() see averaged
  gradients.
  Gradients no backward of the model made (another model's, set by hand) are averaged
  the same way before the optimizer's step, ahead of an fp16 step's inf check, so every
  rank skips the same steps.

A loop whose training data comes from no DataLoader cannot be split, nor can hand updates
from torch.autograd.grad be averaged, nor a sampler without a length be cut to equal
shards: the first such step raises NotDataParallel on every rank alike, before any update.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, IterableDataset

from .buckets import Buckets, average


class NotDataParallel(RuntimeError):
    """The loop cannot be made data-parallel as written."""


class DataParallel:
    """The watch's part that makes the loop data-parallel over `world` ranks."""

    def __init__(self, edge, rank: int, world: int, trains_on_a_loader):
        self.edge, self.rank, self.world = edge, rank, world
        self._trains_on_a_loader = trains_on_a_loader   # the loader part's answer
        self._buckets = None    # the model's trainable parameters: averaged in each backward
        self._averaged = set()  # ids of the parameters averaged since their optimizer's step

    def install(self) -> None:
        """Before the steps part's hooks: the rest of a step's gradients are averaged
        before an fp16 step unscales them and checks them for inf."""
        self.edge.patches.keep(register_optimizer_step_pre_hook(self._average_rest).remove)
        self.edge.run.resolved["processes"] = (self.world, (
            f"rank {self.rank} of {self.world}: each rank's DataLoader yields its shard of "
            "every epoch; gradients averaged over the ranks during each backward"))

    # -- the model: rank 0's weights on every rank ------------------------------------------
    def found_model(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        params = [p for p in model.parameters() if p.requires_grad]
        if params:
            self._buckets = Buckets(params, self.world, self.edge.patches)

    # -- the gradients ----------------------------------------------------------------------
    def backward_starts(self) -> None:
        if self._buckets is not None:
            self._buckets.backward_starts()

    def backward_done(self) -> None:
        """The backward's end: the model's gradients, the ranks' average."""
        if self._buckets is not None:
            self._buckets.backward_ends()
            self._averaged.update(map(id, self._buckets.params))

    def _average_rest(self, optimizer, args, kwargs) -> None:
        if self.edge.inside:
            return
        if not self._trains_on_a_loader():
            raise NotDataParallel(
                f"--processes {self.world}: your loop trains on data that comes from no "
                "DataLoader, so nbtrain cannot give each process its share; it would train "
                f"the same samples {self.world} times. Iterate a DataLoader in the loop, or "
                "run the cell in one process.")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        rest = [p for p in params if id(p) not in self._averaged]
        self._averaged.difference_update(map(id, params))
        if rest:
            average(rest, self.world)

    def refuse_hand_gradients(self) -> None:
        """torch.autograd.grad's gradients go to the loop, not to the parameters: nbtrain
        cannot average them."""
        raise NotDataParallel(
            f"--processes {self.world}: your loop updates its weights from "
            "torch.autograd.grad's gradients, which nbtrain cannot average over the "
            "processes (each would train on its own). Use loss.backward() and an optimizer, "
            "or run the cell in one process.")

    # -- the data: this rank's shard --------------------------------------------------------
    def shard(self, loader: DataLoader):
        """The loader's batches of this rank's samples for one epoch, from a loader like it."""
        sampler = loader.sampler
        if loader.batch_size is None or isinstance(loader.dataset, IterableDataset) or \
                not hasattr(sampler, "__len__"):
            raise NotDataParallel(
                f"--processes {self.world}: your DataLoader has no sampler nbtrain can split "
                "into equal shares (an IterableDataset, a batch_sampler of its own, "
                "batch_size=None, or a sampler without a length); give it a map-style "
                "dataset, a batch_size and a sampler with a length, or run the cell in one "
                "process.")
        batches = _batched(self._my_indices(loader.sampler), loader.batch_size,
                           loader.drop_last)
        shard = DataLoader(loader.dataset, batch_sampler=batches,
                           num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                           pin_memory=loader.pin_memory, timeout=loader.timeout,
                           worker_init_fn=loader.worker_init_fn, generator=loader.generator)
        with self.edge.own:   # the shard's own iterator is nbtrain's, not a loader of the loop
            return iter(shard)

    def _my_indices(self, sampler):
        """Every world-th index of the epoch's order from this rank's own, drawn as the
        loader draws it, cut to the same count on every rank; read lazily (an endless
        sampler, minGPT's RandomSampler of 1e10 samples)."""
        end = len(sampler) // self.world * self.world
        return itertools.islice(iter(sampler), self.rank, end, self.world)

def _batched(indices, batch_size: int, drop_last: bool):
    """Batches of `indices` as they come (an endless sampler's too)."""
    batch = []
    for index in indices:
        batch.append(index)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch and not drop_last:
        yield batch

