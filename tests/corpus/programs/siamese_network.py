# Shape: pytorch/examples siamese_network/main.py,
# https://github.com/pytorch/examples/blob/main/siamese_network/main.py (BSD-3-Clause,
# pytorch/examples; read at 77f55b9). Written anew in that program's shape, not copied:
# this project keeps third-party code out of its commits. Kept from it: main() with
# argparse, a SiameseNetwork of torchvision's resnet18(weights=None) with a 1-channel conv1
# and its fc cut off (children()[:-1] in a Sequential), forward(input1, input2) through
# forward_once twice, the features concatenated into a Linear/ReLU/Linear head and a
# Sigmoid, xavier init through apply; APP_MATCHER: a Dataset over MNIST's tensors grouped
# by class whose __getitem__ draws a pair from Python's global `random` (same class for an
# even index, another class for an odd one) and returns (image_1, image_2, target); train()
# and test() functions, BCELoss on `model(images_1, images_2).squeeze()`, Adadelta(lr=1.0),
# StepLR stepped each epoch, test under model.eval() and torch.no_grad().
# Changed: MNIST is the harness's stand-in (data/MNIST/raw, 128 train and 64 test images;
# root 'data' for '../data', which would be outside the run's directory); batch 32, test
# batch 64, 2 epochs, log interval 2.
import argparse
import random

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import torchvision
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import Dataset
from torchvision import datasets


class SiameseNetwork(nn.Module):
    """Two images through one ResNet-18 trunk, their features compared by a small head."""

    def __init__(self):
        super().__init__()
        self.resnet = torchvision.models.resnet18(weights=None)
        # MNIST is gray: one input channel for resnet18's three
        self.resnet.conv1 = nn.Conv2d(1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)
        self.fc_in_features = self.resnet.fc.in_features
        self.resnet = torch.nn.Sequential(*(list(self.resnet.children())[:-1]))   # no fc
        self.fc = nn.Sequential(
            nn.Linear(self.fc_in_features * 2, 256),
            nn.ReLU(inplace=True),
            nn.Linear(256, 1),
        )
        self.sigmoid = nn.Sigmoid()
        self.resnet.apply(self.init_weights)
        self.fc.apply(self.init_weights)

    def init_weights(self, m):
        if isinstance(m, nn.Linear):
            torch.nn.init.xavier_uniform_(m.weight)
            m.bias.data.fill_(0.01)

    def forward_once(self, x):
        output = self.resnet(x)
        return output.view(output.size()[0], -1)

    def forward(self, input1, input2):
        output1 = self.forward_once(input1)
        output2 = self.forward_once(input2)
        output = torch.cat((output1, output2), 1)
        output = self.fc(output)
        return self.sigmoid(output)


class APP_MATCHER(Dataset):
    def __init__(self, root, train, download=False):
        super().__init__()
        self.dataset = datasets.MNIST(root, train=train, download=download)
        self.data = self.dataset.data.unsqueeze(1).clone()   # (N, 1, 28, 28)
        self.group_examples()

    def group_examples(self):
        np_arr = np.array(self.dataset.targets.clone(), dtype=None, copy=None)
        self.grouped_examples = {}
        for i in range(0, 10):
            self.grouped_examples[i] = np.where((np_arr == i))[0]

    def __len__(self):
        return self.data.shape[0]

    def __getitem__(self, index):
        # a random class and image for the first; for an even index another image of that
        # class (a positive pair), for an odd one an image of another class (negative)
        selected_class = random.randint(0, 9)
        random_index_1 = random.randint(0, self.grouped_examples[selected_class].shape[0] - 1)
        index_1 = self.grouped_examples[selected_class][random_index_1]
        image_1 = self.data[index_1].clone().float()
        if index % 2 == 0:
            random_index_2 = random.randint(0, self.grouped_examples[selected_class].shape[0] - 1)
            while random_index_2 == random_index_1:
                random_index_2 = random.randint(0, self.grouped_examples[selected_class].shape[0] - 1)
            index_2 = self.grouped_examples[selected_class][random_index_2]
            image_2 = self.data[index_2].clone().float()
            target = torch.tensor(1, dtype=torch.float)
        else:
            other_selected_class = random.randint(0, 9)
            while other_selected_class == selected_class:
                other_selected_class = random.randint(0, 9)
            random_index_2 = random.randint(0, self.grouped_examples[other_selected_class].shape[0] - 1)
            index_2 = self.grouped_examples[other_selected_class][random_index_2]
            image_2 = self.data[index_2].clone().float()
            target = torch.tensor(0, dtype=torch.float)
        return image_1, image_2, target


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    criterion = nn.BCELoss()
    for batch_idx, (images_1, images_2, targets) in enumerate(train_loader):
        images_1, images_2, targets = images_1.to(device), images_2.to(device), targets.to(device)
        optimizer.zero_grad()
        outputs = model(images_1, images_2).squeeze()
        loss = criterion(outputs, targets)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
                epoch, batch_idx * len(images_1), len(train_loader.dataset),
                100. * batch_idx / len(train_loader), loss.item()))
            if args.dry_run:
                break


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    criterion = nn.BCELoss()
    with torch.no_grad():
        for (images_1, images_2, targets) in test_loader:
            images_1, images_2, targets = images_1.to(device), images_2.to(device), targets.to(device)
            outputs = model(images_1, images_2).squeeze()
            test_loss += criterion(outputs, targets).sum().item()
            pred = torch.where(outputs > 0.5, 1, 0)
            correct += pred.eq(targets.view_as(pred)).sum().item()
    test_loss /= len(test_loader.dataset)
    print("\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\n".format(
        test_loss, correct, len(test_loader.dataset), 100. * correct / len(test_loader.dataset)))


def main():
    parser = argparse.ArgumentParser(description="PyTorch Siamese network Example")
    parser.add_argument("--batch-size", type=int, default=32, metavar="N")
    parser.add_argument("--test-batch-size", type=int, default=64, metavar="N")
    parser.add_argument("--epochs", type=int, default=2, metavar="N")
    parser.add_argument("--lr", type=float, default=1.0, metavar="LR")
    parser.add_argument("--gamma", type=float, default=0.7, metavar="M")
    parser.add_argument("--no-accel", action="store_true")
    parser.add_argument("--dry-run", action="store_true", default=False)
    parser.add_argument("--seed", type=int, default=1, metavar="S")
    parser.add_argument("--log-interval", type=int, default=2, metavar="N")
    parser.add_argument("--save-model", action="store_true", default=False)
    args = parser.parse_args()
    use_accel = not args.no_accel and torch.accelerator.is_available()
    torch.manual_seed(args.seed)
    device = torch.accelerator.current_accelerator() if use_accel else torch.device("cpu")
    print(f"Using device: {device}")

    train_kwargs = {"batch_size": args.batch_size}
    test_kwargs = {"batch_size": args.test_batch_size}
    if use_accel:
        accel_kwargs = {"num_workers": 1, "pin_memory": True, "shuffle": True}
        train_kwargs.update(accel_kwargs)
        test_kwargs.update(accel_kwargs)
    train_dataset = APP_MATCHER("data", train=True, download=True)
    test_dataset = APP_MATCHER("data", train=False)
    train_loader = torch.utils.data.DataLoader(train_dataset, **train_kwargs)
    test_loader = torch.utils.data.DataLoader(test_dataset, **test_kwargs)

    model = SiameseNetwork().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()
    if args.save_model:
        torch.save(model.state_dict(), "siamese_network.pt")


if __name__ == "__main__":
    main()
