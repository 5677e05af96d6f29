# Shape: the PyTorch "Training a Classifier" tutorial (60 Minute Blitz), pytorch/tutorials
# beginner_source/blitz/cifar10_tutorial.py,
# https://pytorch.org/tutorials/beginner/blitz/cifar10_tutorial.html (BSD-3-Clause,
# pytorch/tutorials; read at 04e3d04). Written anew in that tutorial's shape, not copied:
# this project keeps third-party code out of its commits. Kept from it: notebook cells as
# one module-level script; train and test loaders of batch 4 with num_workers=2 of their
# own (shuffled train, ordered test) over per-sample PIL images with ToTensor and
# Normalize; a first batch taken with next(iter(trainloader)) and shown before training
# (that iterator left open); the LeNet-like Net; CrossEntropyLoss; SGD(lr=0.001,
# momentum=0.9); two epochs of zero_grad/forward/backward/step with running_loss +=
# loss.item() printed every so many mini-batches; then a test batch shown, the network's
# guesses for it (a forward with gradients on, outside no_grad, as the tutorial has it),
# accuracy over the test set and per class under torch.no_grad().
# Changed: CIFAR-10 swapped for FakeData (192 train and 40 test images of 3x32x32,
# seeded); the print every 20 mini-batches for 2000; imshow draws into a figure closed at
# once (Agg), not plt.show(); `next(dataiter)` for the old `dataiter.next()`; a class
# with no test image reads 0 % (40 test images: one may be missing).
import matplotlib
import torch
import torchvision
import torchvision.transforms as transforms

matplotlib.use("Agg")

transform = transforms.Compose(
    [transforms.ToTensor(),
     transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])

# stand-ins for torchvision.datasets.CIFAR10(root='./data', train=..., download=True, ...)
trainset = torchvision.datasets.FakeData(192, (3, 32, 32), 10, transform=transform)
trainloader = torch.utils.data.DataLoader(trainset, batch_size=4, shuffle=True, num_workers=2)
testset = torchvision.datasets.FakeData(40, (3, 32, 32), 10, transform=transform, random_offset=11)
testloader = torch.utils.data.DataLoader(testset, batch_size=4, shuffle=False, num_workers=2)

classes = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

########################################################################
# Let us show some of the training images, for fun.
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def imshow(img):
    img = img / 2 + 0.5     # unnormalize
    npimg = img.numpy()
    plt.imshow(np.transpose(npimg, (1, 2, 0)))
    plt.close()


dataiter = iter(trainloader)
images, labels = next(dataiter)
imshow(torchvision.utils.make_grid(images))
print(" ".join("%5s" % classes[labels[j]] for j in range(4)))

########################################################################
# 2. Define a Convolutional Neural Network
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


net = Net()

########################################################################
# 3. Define a Loss function and optimizer
import torch.optim as optim  # noqa: E402

criterion = nn.CrossEntropyLoss()
optimizer = optim.SGD(net.parameters(), lr=0.001, momentum=0.9)

########################################################################
# 4. Train the network
for epoch in range(2):   # loop over the dataset multiple times
    running_loss = 0.0
    for i, data in enumerate(trainloader, 0):
        inputs, labels = data   # data is a list of [inputs, labels]
        optimizer.zero_grad()
        outputs = net(inputs)
        loss = criterion(outputs, labels)
        loss.backward()
        optimizer.step()
        running_loss += loss.item()
        if i % 20 == 19:   # every 20 mini-batches
            print("[%d, %5d] loss: %.3f" % (epoch + 1, i + 1, running_loss / 20))
            running_loss = 0.0
print("Finished Training")

########################################################################
# 5. Test the network on the test data
dataiter = iter(testloader)
images, labels = next(dataiter)
imshow(torchvision.utils.make_grid(images))
print("GroundTruth: ", " ".join("%5s" % classes[labels[j]] for j in range(4)))

outputs = net(images)
_, predicted = torch.max(outputs, 1)
print("Predicted: ", " ".join("%5s" % classes[predicted[j]] for j in range(4)))

correct = 0
total = 0
with torch.no_grad():   # no gradients: not training
    for data in testloader:
        images, labels = data
        outputs = net(images)
        _, predicted = torch.max(outputs, 1)
        total += labels.size(0)
        correct += (predicted == labels).sum().item()
print("Accuracy of the network on the %d test images: %d %%" % (total, 100 * correct / total))

class_correct = list(0. for i in range(10))
class_total = list(0. for i in range(10))
with torch.no_grad():
    for data in testloader:
        images, labels = data
        outputs = net(images)
        _, predicted = torch.max(outputs, 1)
        c = (predicted == labels).squeeze()
        for i in range(4):
            label = labels[i]
            class_correct[label] += c[i].item()
            class_total[label] += 1
for i in range(10):
    print("Accuracy of %5s : %2d %%" % (classes[i], 100 * class_correct[i] / max(class_total[i], 1)))

del dataiter
