"""Real data that ships with a package, so everything runs offline."""
from __future__ import annotations

from typing import Tuple

import torch


def digits(split: str = "train", val_fraction: float = 0.2, seed: int = 0,
           images: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 handwritten 8x8 digits as (inputs, targets) tensors.

    >>> x, y = digits("train")        # x: (1438, 1, 8, 8) float32 in [0, 1], y: int64
    >>> xv, yv = digits("val")        # the other 359, never seen in training

    `images=False` gives flat (N, 64) rows instead of (N, 1, 8, 8) images.
    """
    if split not in ("train", "val", "all"):
        raise ValueError(f"split must be 'train', 'val' or 'all'; got {split!r}.")
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0     # pixels are 0..16
    y = torch.tensor(data.target, dtype=torch.long)
    if images:
        x = x.reshape(-1, 1, 8, 8)                                 # (N, 64) -> (N, C, H, W)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(x) * val_fraction)
    pick = {"train": order[n_val:], "val": order[:n_val], "all": order}[split]
    return x[pick], y[pick]
