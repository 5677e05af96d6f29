# Shape: activation (gradient) checkpointing as torch.utils.checkpoint's documentation
# shows it, https://docs.pytorch.org/docs/stable/checkpoint.html (BSD-3-Clause, PyTorch;
# read 2025), in a residual MLP with dropout: each block's forward is run under
# checkpoint(block, x, use_reentrant=False) (recomputed in backward, the RNG state kept
# so dropout draws the same mask), the head under checkpoint_sequential. Written for this
# corpus (no one public program); the loop around it is the usual one: a DataLoader over
# a TensorDataset with a seeded generator, SGD with Nesterov momentum, MultiStepLR stepped
# each epoch, loss.item() every batch, a validation pass under torch.no_grad().
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, width, p=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, width=48, depth=4, classes=5):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Dropout(0.1), nn.Linear(width, classes))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.training else block(x)
        return checkpoint_sequential(self.head, 2, x, use_reentrant=False) if self.training else self.head(x)


torch.manual_seed(0)
x = torch.randn(512, 16)
y = torch.randint(0, 5, (512,))
loader = DataLoader(TensorDataset(x[:448], y[:448]), batch_size=32, shuffle=True,
                    generator=torch.Generator().manual_seed(3))
val_x, val_y = x[448:], y[448:]
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[1], gamma=0.3)
losses = []
for epoch in range(2):
    model.train()
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    scheduler.step()
    model.eval()
    with torch.no_grad():
        val_loss = F.cross_entropy(model(val_x), val_y).item()
    print(f"epoch {epoch}: train {sum(losses[-14:]) / 14:.4f} val {val_loss:.4f}")
