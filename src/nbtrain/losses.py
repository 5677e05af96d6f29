"""One batch's forward pass and loss, as the loop, validation and max_batch_size compute it.

Its own module so that loop.py and memory.py can both import it at module level (loop
imports memory, so memory could not import it from loop).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


def outputs_and_loss(forward: Callable, loss_fn: Optional[Callable], batch):
    """(model output, scalar loss) for one batch: `loss_fn(forward(*inputs), targets)`, or
    with no loss_fn the model's own loss (a tensor, or a dict / object with `loss`)."""
    if loss_fn is None:
        out = forward(batch)
        loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", out)
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        out = forward(*batch[:-1])
        loss = loss_fn(out, batch[-1])
    else:
        raise TypeError(f"with a loss_fn each batch must be (inputs, targets); got a "
                        f"{type(batch).__name__}. Pass loss_fn=None and make the model "
                        "return the loss for other batch shapes.")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) \
            else type(loss).__name__
        raise ValueError(f"the loss must be a scalar tensor; got {what}. Average it "
                         "(e.g. reduction='mean') or return loss.mean().")
    return out, loss
