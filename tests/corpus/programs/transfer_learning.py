# Shape: the PyTorch "Transfer Learning for Computer Vision" tutorial, pytorch/tutorials
# beginner_source/transfer_learning_tutorial.py,
# https://pytorch.org/tutorials/beginner/transfer_learning_tutorial.html (BSD-3-Clause,
# pytorch/tutorials; read at 039ee0e, the version on a 10-class CUB subset). Written anew
# in that tutorial's shape, not copied: this project keeps third-party code out of its
# commits. Kept from it: a module-level script seeding torch, random and numpy; per-phase
# transforms (RandomResizedCrop and flips to train, Resize/CenterCrop to validate);
# ImageFolder datasets and DataLoaders in dicts by phase; a first batch shown with
# next(iter(dataloaders['train'])); train_model(): per epoch a 'train' then a 'val' phase
# (model.train()/model.eval()), every batch's forward under
# torch.set_grad_enabled(phase == 'train') with backward and step in the train phase only,
# loss.item() * batch size summed, scheduler.step() after the train phase, the best
# epoch's weights kept with copy.deepcopy(model.state_dict()) and loaded back at the end;
# visualize_model() under no_grad restoring the mode; then two scenarios: a ResNet-18 used
# as a fixed feature extractor (every parameter requires_grad=False, a new fc, SGD on
# model_conv.fc.parameters() only), then one fine-tuned whole with two parameter groups
# (the fc at lr 1e-2, the rest at 1e-3); StepLR(step_size=7, gamma=0.1) for each.
# Changed: resnet18(weights=None) for pretrained=True (no downloads); the CUB subset is the
# harness's ImageFolder (4 classes, 32 train and 16 val images of 40x40, data/cubsub);
# crops of 32 for 224 (Resize 36 for 256); batch 8 for 64, no loader workers (4 upstream),
# 2 epochs a scenario for 25; plt.pause left out of imshow (Agg); the Co-Tuning scenario
# left out.
import copy
import os
import random
import time

import matplotlib
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import torchvision
from torch.optim import lr_scheduler
from torchvision import datasets, models, transforms

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

seed = 0   # for reproducibility
torch.manual_seed(seed)
random.seed(seed)
np.random.seed(seed)
plt.ion()

data_transforms = {
    "train": transforms.Compose([
        transforms.RandomResizedCrop(32),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]),
    "val": transforms.Compose([
        transforms.Resize(36),
        transforms.CenterCrop(32),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]),
}
data_dir = "data/cubsub"
image_datasets = {x: datasets.ImageFolder(os.path.join(data_dir, x), data_transforms[x])
                  for x in ["train", "val"]}
dataloaders = {x: torch.utils.data.DataLoader(image_datasets[x], batch_size=8,
                                              shuffle=(x == "train"), num_workers=0)
               for x in ["train", "val"]}
dataset_sizes = {x: len(image_datasets[x]) for x in ["train", "val"]}
class_names = image_datasets["train"].classes
device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def imshow(inp, title=None):
    """Imshow for Tensor."""
    inp = inp.numpy().transpose((1, 2, 0))
    mean = np.array([0.485, 0.456, 0.406])
    std = np.array([0.229, 0.224, 0.225])
    inp = np.clip(std * inp + mean, 0, 1)
    plt.imshow(inp)
    if title is not None:
        plt.title(title)


# a batch of training data, the first 4 images in a grid
inputs, classes = next(iter(dataloaders["train"]))
out = torchvision.utils.make_grid(inputs[:4])
imshow(out, title=[class_names[x] for x in classes[:4]])


def train_model(model, criterion, optimizer, scheduler, num_epochs=25):
    since = time.time()
    best_model_wts = copy.deepcopy(model.state_dict())
    best_acc = 0.0
    for epoch in range(num_epochs):
        print("Epoch {}/{}".format(epoch, num_epochs - 1))
        print("-" * 10)
        for phase in ["train", "val"]:   # a training and a validation phase each epoch
            if phase == "train":
                model.train()
            else:
                model.eval()
            running_loss = 0.0
            running_corrects = 0
            for inputs, labels in dataloaders[phase]:
                inputs = inputs.to(device)
                labels = labels.to(device)
                optimizer.zero_grad()
                # gradients only in the train phase
                with torch.set_grad_enabled(phase == "train"):
                    outputs = model(inputs)
                    target_outputs = outputs[1] if isinstance(outputs, tuple) else outputs
                    _, preds = torch.max(target_outputs, 1)
                    loss = criterion(outputs, labels)
                    if phase == "train":
                        loss.backward()
                        optimizer.step()
                running_loss += loss.item() * inputs.size(0)
                running_corrects += torch.sum(preds == labels.data)
            if phase == "train":
                scheduler.step()
            epoch_loss = running_loss / dataset_sizes[phase]
            epoch_acc = running_corrects.double() / dataset_sizes[phase]
            print("{} Loss: {:.4f} Acc: {:.4f}".format(phase, epoch_loss, epoch_acc))
            if phase == "val" and epoch_acc > best_acc:   # keep the best weights
                best_acc = epoch_acc
                best_model_wts = copy.deepcopy(model.state_dict())
        print()
    time_elapsed = time.time() - since
    print("Training complete in {:.0f}m {:.0f}s".format(time_elapsed // 60, time_elapsed % 60))
    print("Best val Acc: {:4f}".format(best_acc))
    model.load_state_dict(best_model_wts)
    return model


def visualize_model(model, num_images=6):
    was_training = model.training
    model.eval()
    images_so_far = 0
    plt.figure()
    with torch.no_grad():
        for i, (inputs, labels) in enumerate(dataloaders["val"]):
            inputs = inputs.to(device)
            labels = labels.to(device)
            outputs = model(inputs)
            target_outputs = outputs[1] if isinstance(outputs, tuple) else outputs
            _, preds = torch.max(target_outputs, 1)
            for j in range(inputs.size()[0]):
                label = labels[j].item()
                images_so_far += 1
                ax = plt.subplot(num_images // 2, 2, images_so_far)
                ax.axis("off")
                ax.set_title("label:{}; predicted: {}".format(class_names[label], class_names[preds[j]]))
                imshow(inputs.cpu().data[j])
                if images_so_far == num_images:
                    model.train(mode=was_training)
                    return
        model.train(mode=was_training)


######################################################################
# 1. ConvNet as fixed feature extractor: every parameter frozen but a new fc
model_conv = torchvision.models.resnet18(weights=None)
for param in model_conv.parameters():
    param.requires_grad = False
num_ftrs = model_conv.fc.in_features
model_conv.fc = nn.Linear(num_ftrs, len(class_names))   # a new module: requires_grad=True
model_conv = model_conv.to(device)
criterion = nn.CrossEntropyLoss()
optimizer_conv = optim.SGD(model_conv.fc.parameters(), lr=0.01, momentum=0.9)
exp_lr_scheduler = lr_scheduler.StepLR(optimizer_conv, step_size=7, gamma=0.1)
model_conv = train_model(model_conv, criterion, optimizer_conv, exp_lr_scheduler, num_epochs=2)
visualize_model(model_conv)
plt.ioff()

######################################################################
# 2. Finetuning the convnet: all of it, the new fc at a higher rate
model_ft = models.resnet18(weights=None)
num_ftrs = model_ft.fc.in_features
model_ft.fc = nn.Linear(num_ftrs, len(class_names))
model_ft = model_ft.to(device)
criterion = nn.CrossEntropyLoss()
params = [{"params": [p for name, p in model_ft.named_parameters() if "fc" in name], "lr": 1e-2},
          {"params": [p for name, p in model_ft.named_parameters() if "fc" not in name], "lr": 1e-3}]
optimizer_ft = optim.SGD(params, momentum=0.9)
exp_lr_scheduler = lr_scheduler.StepLR(optimizer_ft, step_size=7, gamma=0.1)
model_ft = train_model(model_ft, criterion, optimizer_ft, exp_lr_scheduler, num_epochs=2)
visualize_model(model_ft)
plt.close("all")
