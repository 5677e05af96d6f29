"""The model's gradients averaged over the ranks while the backward still runs, as DDP's
reducer does it, with hooks on the loop's own parameters in place of a wrapped model.

- The trainable parameters are cut into buckets in the order the backward makes their
  gradients (the model's order reversed); the first bucket is small so that the first
  all_reduce starts early, the rest hold up to BUCKET_BYTES.
- A parameter's post-accumulate-grad hook marks it ready; a bucket whose parameters are all
  ready is flattened and all_reduced asynchronously while the backward goes on.
- Buckets start strictly in order, on every rank: a rank's collectives are matched by
  their order, so a bucket that is ready early waits for the ones before it.
- At the backward's end the parameters no hook marked (not reached on this rank) are
  ready as they stand, the buckets left start in order, and every one is waited for and
  written back: the average over the ranks, a parameter without a gradient counting as
  zeros (DDP's find_unused_parameters), and staying without one where no rank had one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

FIRST_BUCKET_BYTES = 1 << 20   # DDP's first bucket: communication starts after the last layers
BUCKET_BYTES = 25 << 20        # DDP's bucket_cap_mb


class _Bucket:
    __slots__ = ("params", "left", "sent")

    def __init__(self, params: list):
        self.params, self.left, self.sent = params, len(params), None


class Buckets:
    """The all_reduce of one model's gradients, overlapped with each backward."""

    def __init__(self, params: list, world: int, patches):
        self.world = world
        self.buckets = [_Bucket(ps) for ps in _split(params[::-1])]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0          # the first bucket not yet sent
        self.active = False     # a watched backward runs: its hooks count
        for p in params:
            patches.keep(_hook(p, self._ready))

    @property
    def params(self) -> list:
        return [p for b in self.buckets for p in b.params]

    def backward_starts(self) -> None:
        for bucket in self.buckets:
            bucket.left, bucket.sent = len(bucket.params), None
        self._next, self.active = 0, True

    def backward_ends(self) -> None:
        """Every bucket sent (in order), waited for and written back."""
        if not self.active:
            return
        self.active = False
        for bucket in self.buckets[self._next:]:
            bucket.sent = _send(bucket.params)
        for bucket in self.buckets:
            _write_back(bucket.params, *bucket.sent, self.world)
            bucket.sent = None

    def _ready(self, param) -> None:
        if not self.active:   # a backward the watch does not count (nbtrain's own)
            return
        self._bucket_of[id(param)].left -= 1
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].left == 0:
            bucket = buckets[self._next]
            bucket.sent = _send(bucket.params)
            self._next += 1


def average(params: list, world: int) -> None:
    """The params' gradients, the ranks' average, now."""
    _write_back(params, *_send(params), world)


def _split(params: list) -> list:
    """Consecutive groups of `params`, the first up to FIRST_BUCKET_BYTES, the rest up to
    BUCKET_BYTES (a larger parameter alone)."""
    groups, group, size, cap = [], [], 0, FIRST_BUCKET_BYTES
    for p in params:
        nbytes = p.numel() * 4   # sent in float32
        if group and size + nbytes > cap:
            groups.append(group)
            group, size, cap = [], 0, BUCKET_BYTES
        group.append(p)
        size += nbytes
    return groups + [group] if group else groups


def _hook(param, ready):
    """The post-accumulate-grad hook on `param`, and the call that removes it and leaves
    the parameter's hook table as it was (None before the first hook)."""
    had_table = param._post_accumulate_grad_hooks is not None
    handle = param.register_post_accumulate_grad_hook(ready)

    def remove() -> None:
        handle.remove()
        if not had_table and not param._post_accumulate_grad_hooks:
            param._post_accumulate_grad_hooks = None
    return remove


def _send(params: list):
    """The all_reduce of the params' gradients, started: one flat float32 tensor, led by a
    has-gradient flag per parameter (a rank without a gradient adds zeros)."""
    missing = [p.grad is None for p in params]
    has = torch.ones(len(params), device=params[0].device)   # filled on the device: no copy
    for i, m in enumerate(missing):
        if m:   # a fill: no copy from the host
            has[i] = 0.0
    flat = torch.cat([has, *[(torch.zeros_like(p) if m else p.grad).reshape(-1).float()
                             for p, m in zip(params, missing)]])
    return flat, missing, dist.all_reduce(flat, async_op=True)


def _write_back(params: list, flat, missing: list, work, world: int) -> None:
    """The average into the gradients, once the all_reduce is done. Where this rank had no
    gradient, whether any rank had one is read back (a sync, on this rare path only)."""
    work.wait()
    counts = flat[:len(params)].tolist() if any(missing) else None
    offset = len(params)
    flat[offset:].div_(world)   # one kernel, not one a parameter
    for i, p in enumerate(params):
        part = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if not missing[i]:
            p.grad.copy_(part)
        elif counts[i]:
            p.grad = part.to(p.dtype)
