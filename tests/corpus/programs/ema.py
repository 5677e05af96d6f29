# Shape: an exponential moving average of the weights as timm keeps it
# (timm/utils/model_ema.py ModelEmaV2, used by timm's train.py),
# https://github.com/huggingface/pytorch-image-models/blob/main/timm/utils/model_ema.py
# (Apache-2.0, Ross Wightman; read 2025). Written anew in that shape, not copied: this
# project keeps third-party code out of its commits. Kept from it: the EMA a
# copy.deepcopy(model) in eval mode, updated after every optimizer step under
# torch.no_grad() over the state_dict's values (buffers too), ema = decay * ema +
# (1 - decay) * model; an LR scheduler stepped every batch (OneCycleLR); evaluation of
# the model and of the EMA under torch.inference_mode() with model.eval()/train().
# Changed: an MLP with BatchNorm on a TensorDataset of 768 random rows (seeded) instead
# of an image model and ImageNet, 3 epochs of 12 batches.
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class ModelEmaV2(nn.Module):
    def __init__(self, model, decay=0.9999, device=None):
        super().__init__()
        self.module = copy.deepcopy(model)   # a copy of the model whose weights are averaged
        self.module.eval()
        self.decay = decay
        self.device = device
        if self.device is not None:
            self.module.to(device=device)

    def _update(self, model, update_fn):
        with torch.no_grad():
            for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
                if self.device is not None:
                    model_v = model_v.to(device=self.device)
                ema_v.copy_(update_fn(ema_v, model_v))

    def update(self, model):
        self._update(model, update_fn=lambda e, m: self.decay * e + (1. - self.decay) * m)

    def set(self, model):
        self._update(model, update_fn=lambda e, m: m)


def evaluate(model, loader):
    model.eval()
    correct = 0
    with torch.inference_mode():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(loader.dataset)


gen = torch.Generator().manual_seed(0)
x = torch.randn(768, 32, generator=gen)
y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()
train_loader = DataLoader(TensorDataset(x[:640], y[:640]), batch_size=64, shuffle=True)
val_loader = DataLoader(TensorDataset(x[640:], y[640:]), batch_size=128)

model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
model_ema = ModelEmaV2(model, decay=0.9)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
epochs = 3
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, epochs=epochs,
                                                steps_per_epoch=len(train_loader))
for epoch in range(epochs):
    model.train()
    for xb, yb in train_loader:
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        model_ema.update(model)
    print(f"epoch {epoch}: loss {loss.item():.4f} acc {evaluate(model, val_loader):.3f} "
          f"ema acc {evaluate(model_ema.module, val_loader):.3f}")
