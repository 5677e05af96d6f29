"""Fresh models for runs that must start alike (compare, lr_find, autotune).

Each run trains its own model, never the user's object: a factory is called, a given
model is deep-copied, so the user's model is left untouched.
"""
from __future__ import annotations

import copy

import torch


def fresh_model(make_model) -> torch.nn.Module:
    """A new model from a factory, or a deep copy of a given model (left untouched)."""
    if isinstance(make_model, torch.nn.Module):
        return copy.deepcopy(make_model)
    if not callable(make_model):
        raise TypeError(f"make_model must be a function returning a torch.nn.Module (or a "
                        f"model to copy); got {type(make_model).__name__}.")
    model = make_model()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"make_model() must return a torch.nn.Module; got "
                        f"{type(model).__name__}. Pass the function, e.g. make_model=make_mlp.")
    return model


def initial_weights(make_model, seed: int) -> dict:
    """The weights every config of `seed` starts from: built once, deep-copied."""
    torch.manual_seed(seed)
    return copy.deepcopy(fresh_model(make_model).state_dict())
