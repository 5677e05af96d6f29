# Shape: pytorch/examples regression/main.py,
# https://github.com/pytorch/examples/blob/main/regression/main.py (BSD-3-Clause,
# pytorch/examples; read at 1877b87). Written anew in that program's shape, not copied:
# this project keeps third-party code out of its commits. Kept from it: a module-level
# script, no optimizer (the update is written by hand on each parameter), `for batch_idx
# in count(1)` ending on its own criterion (the loss under a threshold), `loss.item()`
# every step, fresh random batches drawn from the global RNG each step.
# Changed: the threshold 1e-3 raised to 1.0 and an 80-batch cap added, so the loop ends
# in tens of steps; the update under torch.no_grad() (current torch refuses an in-place
# update of a leaf that requires grad).
from itertools import count

import torch
import torch.nn.functional as F

POLY_DEGREE = 4
W_target = torch.randn(POLY_DEGREE, 1) * 5
b_target = torch.randn(1) * 5


def make_features(x):
    """A matrix with columns [x, x^2, x^3, x^4]."""
    x = x.unsqueeze(1)
    return torch.cat([x ** i for i in range(1, POLY_DEGREE + 1)], 1)


def f(x):
    return x.mm(W_target) + b_target.item()


def poly_desc(W, b):
    terms = " ".join(f"{w:+.2f} x^{i + 1}" for i, w in enumerate(W))
    return f"y = {terms} {b[0]:+.2f}"


def get_batch(batch_size=32):
    random = torch.randn(batch_size)
    x = make_features(random)
    return x, f(x)


fc = torch.nn.Linear(W_target.size(0), 1)

for batch_idx in count(1):
    batch_x, batch_y = get_batch()
    fc.zero_grad()
    output = F.smooth_l1_loss(fc(batch_x), batch_y)
    loss = output.item()
    output.backward()
    with torch.no_grad():
        for param in fc.parameters():
            param.add_(-0.1 * param.grad)
    if loss < 1.0 or batch_idx >= 80:
        break

print(f"Loss: {loss:.6f} after {batch_idx} batches")
print("==> Learned function:\t" + poly_desc(fc.weight.view(-1), fc.bias))
print("==> Actual function:\t" + poly_desc(W_target.view(-1), b_target))
