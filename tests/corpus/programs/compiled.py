# Shape: the torch.compile tutorial's training demonstration, pytorch/tutorials
# intermediate_source/torch_compile_tutorial.py,
# https://docs.pytorch.org/tutorials/intermediate/torch_compile_tutorial.html
# (BSD-3-Clause, pytorch/tutorials; read 2025). Written anew in that tutorial's shape,
# not copied: this project keeps third-party code out of its commits. Kept from it: a
# model wrapped as `model = torch.compile(model)` before training, a train step of
# opt.zero_grad(True), forward, CrossEntropyLoss, backward and opt.step(), batches drawn
# by a generate_data() helper each iteration (no DataLoader), an eval forward of the
# compiled model under torch.no_grad() at the end.
# Changed: a small MLP on random 64-feature rows instead of torchvision's resnet18 on
# CUDA images, 24 iterations, batch 16, on the CPU.
import torch
import torch.nn as nn

N_ITERS = 24


def generate_data(b):
    return torch.randn(b, 64), torch.randint(10, (b,))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                                 nn.Linear(128, 10))

    def forward(self, x):
        return self.net(x)


model = MLP()
opt = torch.optim.Adam(model.parameters())
model = torch.compile(model)
loss_fn = nn.CrossEntropyLoss()


def train(mod, data):
    opt.zero_grad(True)
    pred = mod(data[0])
    loss = loss_fn(pred, data[1])
    loss.backward()
    opt.step()
    return loss


for i in range(N_ITERS):
    loss = train(model, generate_data(16))
    if i % 8 == 0:
        print(f"iter {i}: loss {loss.item():.4f}")
with torch.no_grad():
    x, y = generate_data(64)
    print("eval accuracy", (model(x).argmax(1) == y).float().mean().item())
