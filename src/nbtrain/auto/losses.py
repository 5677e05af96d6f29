"""One batch's forward pass and loss, as the loop, validation and max_batch_size compute it.

Its own module so that loop.py and memory.py can both import it at module level (loop
imports memory, so memory could not import it from loop).
"""
from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping
from typing import Callable, Optional

import torch


def outputs_and_loss(forward: Callable, loss_fn: Optional[Callable], batch):
    """(model output, scalar loss) for one batch: `loss_fn(forward(*inputs), targets)`, or
    with no loss_fn the model's own loss (a tensor, or a mapping / object with `loss`).

    With no loss_fn a mapping batch is passed as keywords, `forward(**batch)`, as Hugging
    Face models expect; see `call_model` for when the batch is passed whole instead.
    """
    if loss_fn is None:
        out = call_model(forward, batch)
        loss = _own_loss(out, batch)
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        out = forward(*batch[:-1])
        loss = loss_fn(out, batch[-1])
    else:
        raise TypeError(f"with a loss_fn each batch must be (inputs, targets); got a "
                        f"{type(batch).__name__}. Pass loss_fn=None and make the model "
                        "return the loss for other batch shapes (a mapping batch is "
                        "passed as model(**batch)).")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) \
            else type(loss).__name__
        raise ValueError(f"the loss must be a scalar tensor; got {what}. Average it "
                         "(e.g. reduction='mean') or return loss.mean().")
    return out, loss


def _own_loss(out, batch):
    """The loss a model returned: the output itself, or its `loss` entry or attribute."""
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", out)
    if loss is None:   # a Hugging Face model computes a loss only when given labels
        keys = f" (its keys: {', '.join(map(str, batch))})" if isinstance(batch, Mapping) else ""
        raise ValueError(f"the model returned no loss for a batch{keys}. With loss_fn=None "
                         "the model must compute it: give a Hugging Face model `labels` in "
                         "the batch, or pass a loss_fn.")
    return loss


def call_model(forward: Callable, batch):
    """`forward(**batch)` for a mapping batch, else `forward(batch)`.

    A forward that takes one positional argument named after none of the batch's keys
    (`def forward(self, batch)`, an nn.Sequential) gets the mapping whole, as before.
    """
    if not isinstance(batch, Mapping):
        return forward(batch)
    params = _parameters(forward)
    if params is None or params.takes_keywords(batch):
        if params is not None:
            params.check_keywords(batch)
        return forward(**batch)
    return forward(batch)


class _Parameters:
    """What a forward's signature says about the ways it may be called."""

    def __init__(self, signature: inspect.Signature):
        self.signature = signature
        kinds = inspect.Parameter
        ps = list(signature.parameters.values())
        self.names = {p.name for p in ps if p.kind in (kinds.POSITIONAL_OR_KEYWORD,
                                                       kinds.KEYWORD_ONLY)}
        self.required = {p.name for p in ps if p.name in self.names and p.default is p.empty}
        self.any_keyword = any(p.kind == kinds.VAR_KEYWORD for p in ps)
        positional = [p for p in ps if p.kind in (kinds.POSITIONAL_ONLY,
                                                  kinds.POSITIONAL_OR_KEYWORD)]
        self.one_positional = len(positional) == 1 or (
            not positional and any(p.kind == kinds.VAR_POSITIONAL for p in ps))

    def takes_keywords(self, batch: Mapping) -> bool:
        if self.any_keyword or self.names & set(batch):
            return True
        return not self.one_positional

    def check_keywords(self, batch: Mapping) -> None:
        """Fail before the call, naming the signature and the keys, when they cannot meet."""
        keys = set(batch)
        unknown = sorted(map(str, keys - self.names)) if not self.any_keyword else []
        missing = sorted(self.required - keys)
        if unknown or missing:
            problem = (f"it takes no {', '.join(unknown)}" if unknown
                       else f"it needs {', '.join(missing)}")
            raise TypeError(f"a mapping batch is passed as model(**batch), but the model's "
                            f"forward{self.signature} does not fit the batch's keys "
                            f"({', '.join(map(str, batch))}): {problem}. Rename the keys "
                            "(e.g. in your Dataset or collate_fn), or pass a loss_fn and "
                            "(inputs, targets) batches.")


_SIGNATURES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _parameters(forward: Callable) -> Optional[_Parameters]:
    """The signature of the model's forward, read once per model (None: not readable)."""
    try:
        return _SIGNATURES[forward]
    except (KeyError, TypeError):   # TypeError: not weakly referable, read it every time
        pass
    target = getattr(forward, "_orig_mod", forward)   # torch.compile's wrapper
    if isinstance(target, torch.nn.Module):
        target = target.forward
    try:
        params = _Parameters(inspect.signature(target))
    except (TypeError, ValueError):   # a builtin without a signature: keywords, as documented
        params = None
    try:
        _SIGNATURES[forward] = params
    except TypeError:
        pass
    return params
