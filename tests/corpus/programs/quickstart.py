# Shape: the PyTorch quickstart tutorial, pytorch/tutorials
# beginner_source/basics/quickstart_tutorial.py,
# https://pytorch.org/tutorials/beginner/basics/quickstart_tutorial.html (BSD-3-Clause,
# pytorch/tutorials; read 2025). Written anew in that tutorial's shape, not copied: this
# project keeps third-party code out of its commits. Kept from it: a module-level script,
# a NeuralNetwork of Flatten and a Linear/ReLU stack, CrossEntropyLoss, SGD lr=1e-3,
# train(dataloader, model, loss_fn, optimizer) with loss.item() every 100 batches (here 5)
# and test() under model.eval() and torch.no_grad(), an epochs loop calling both, then
# torch.save(model.state_dict(), "model.pth").
# Changed: FashionMNIST swapped for FakeData (640/128 images, seeded), 2 epochs, the
# print interval 5 batches.
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import ToTensor

training_data = datasets.FakeData(640, (1, 28, 28), 10, transform=ToTensor())   # FashionMNIST
test_data = datasets.FakeData(128, (1, 28, 28), 10, transform=ToTensor(), random_offset=3)
batch_size = 64
train_dataloader = DataLoader(training_data, batch_size=batch_size)
test_dataloader = DataLoader(test_data, batch_size=batch_size)
device = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"


class NeuralNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512), nn.ReLU(),
            nn.Linear(512, 512), nn.ReLU(),
            nn.Linear(512, 10))

    def forward(self, x):
        return self.linear_relu_stack(self.flatten(x))


model = NeuralNetwork().to(device)
loss_fn = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)


def train(dataloader, model, loss_fn, optimizer):
    size = len(dataloader.dataset)
    model.train()
    for batch, (X, y) in enumerate(dataloader):
        X, y = X.to(device), y.to(device)
        loss = loss_fn(model(X), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if batch % 5 == 0:
            print(f"loss: {loss.item():>7f}  [{(batch + 1) * len(X):>5d}/{size:>5d}]")


def test(dataloader, model, loss_fn):
    size, num_batches = len(dataloader.dataset), len(dataloader)
    model.eval()
    test_loss, correct = 0, 0
    with torch.no_grad():
        for X, y in dataloader:
            X, y = X.to(device), y.to(device)
            pred = model(X)
            test_loss += loss_fn(pred, y).item()
            correct += (pred.argmax(1) == y).type(torch.float).sum().item()
    print(f"Test Error: Accuracy: {100 * correct / size:>0.1f}%, Avg loss: {test_loss / num_batches:>8f}")


epochs = 2
for t in range(epochs):
    print(f"Epoch {t + 1}\n-------------------------------")
    train(train_dataloader, model, loss_fn, optimizer)
    test(test_dataloader, model, loss_fn)
torch.save(model.state_dict(), "model.pth")
