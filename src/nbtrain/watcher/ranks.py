"""The watch of one rank of N (%%fasttrain --processes N): the loop as written, made
data-parallel from outside.

- the training DataLoader yields this rank's shard of every epoch: the sampler's order of
  the epoch, every world-th sample from the rank's own (DistributedSampler's striding), cut
  to the same length on every rank and batched as the loader batches; so the ranks' k-th
  batches together are the k-th batch of world x the batch size;
- the model's parameters and buffers start as rank 0's (broadcast at its first forward);
- the gradients are averaged over the ranks while the backward runs: as each parameter's
  gradient is accumulated (a post-accumulate-grad hook, as DDP's reducer hooks in), an
  asynchronous all_reduce of it starts; the backward's end waits for them and divides by
  the ranks. With the loss a mean over the batch, the update is that of the whole global
  batch; with gradient accumulation each micro-batch's share is averaged in turn (the
  average of an average plus the new part is the average of the sum). Gradients no
  backward of the model made (another model's, set by hand) are averaged in one
  all_reduce before the optimizer's step.

A loop whose training data comes from no DataLoader cannot be split, nor can hand updates
from torch.autograd.grad be averaged: the first such step raises NotDataParallel on every
rank alike, before any update.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader


class NotDataParallel(RuntimeError):
    """The loop cannot be made data-parallel as written."""


class Ranks:
    """The watch's part that makes the loop data-parallel over `world` ranks."""

    def __init__(self, edge, loader, rank: int, world: int):
        self.edge, self.loader, self.rank, self.world = edge, loader, rank, world
        self._synced = set()    # ids of the models whose weights were broadcast
        self._works = []        # (gradient, its all_reduce in flight) of this backward
        self._averaged = set()  # ids of the parameters whose gradient is averaged

    def install(self) -> None:
        self.edge.patches.keep(register_optimizer_step_pre_hook(self._average).remove)
        self.edge.run.resolved["processes"] = (self.world, (
            f"rank {self.rank} of {self.world}: each rank's DataLoader yields its shard of "
            "every epoch; gradients averaged over the ranks before each optimizer step"))

    # -- the model: rank 0's weights on every rank ------------------------------------------
    def found_model(self, model: torch.nn.Module) -> None:
        if id(model) in self._synced:
            return
        self._synced.add(id(model))
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        for param in model.parameters():
            if param.requires_grad:
                self.edge.patches.keep(
                    param.register_post_accumulate_grad_hook(self._reduce).remove)
        self.edge.patches.keep(self.backward_done)   # nothing left in flight at the end

    # -- the gradients: averaged as the backward runs ----------------------------------------
    def _reduce(self, param: torch.Tensor) -> None:
        if not self.edge.inside:
            self._works.append((param.grad, dist.all_reduce(param.grad, async_op=True)))
            self._averaged.add(id(param))

    def backward_done(self) -> None:
        """The backward's end: its all_reduces done, each gradient the ranks' average."""
        for grad, work in self._works:
            work.wait()
            grad.div_(self.world)
        self._works.clear()

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
        if loader.batch_sampler is None or isinstance(loader.dataset, torch.utils.data.IterableDataset):
            raise NotDataParallel(
                f"--processes {self.world}: your DataLoader has no sampler to split (an "
                "IterableDataset, or batch_size=None); give it a map-style dataset and a "
                "batch_size, or run the cell in one process.")
        batches = _batched(self._my_indices(loader.sampler), loader.batch_size,
                           loader.drop_last)
        shard = DataLoader(loader.dataset, batch_sampler=batches,
                           num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                           pin_memory=loader.pin_memory, timeout=loader.timeout,
                           worker_init_fn=loader.worker_init_fn, generator=loader.generator)
        edge = self.edge
        edge.inside = True   # the shard's own iterator is nbtrain's, not a loader of the loop
        try:
            return iter(shard)
        finally:
            edge.inside = False

    def _my_indices(self, sampler):
        """Every world-th index of the epoch's order from this rank's own, drawn as the
        loader draws it; cut to the same count on every rank where the sampler has a
        length (an endless one, minGPT's RandomSampler of 1e10 samples, is read lazily)."""
        try:
            end = len(sampler) // self.world * self.world
        except TypeError:
            end = None
        return itertools.islice(iter(sampler), self.rank, end, self.world)

    # -- the update: gradients averaged ------------------------------------------------------
    def _average(self, optimizer, args, kwargs) -> None:
        edge = self.edge
        if edge.inside:
            return
        if self.loader.training is None:
            raise NotDataParallel(
                f"--processes {self.world}: your loop trains on data that comes from no "
                "DataLoader, so nbtrain cannot give each process its share; it would train "
                f"the same samples {self.world} times. Iterate a DataLoader in the loop, or "
                "run the cell in one process.")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None and id(p) not in self._averaged]
        self._averaged.difference_update(id(p) for p in params)
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])   # the rest, in one all_reduce
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


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
