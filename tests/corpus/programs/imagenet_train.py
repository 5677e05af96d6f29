# Shape: the train()/validate() loop of pytorch/examples imagenet/main.py,
# https://github.com/pytorch/examples/blob/main/imagenet/main.py (BSD-3-Clause,
# pytorch/examples; read 2025). Written anew in that program's shape, not copied: this
# project keeps third-party code out of its commits. Kept from it: main() with argparse,
# a torchvision.models architecture by name, CrossEntropyLoss, SGD with momentum and
# weight decay, StepLR stepped once an epoch, AverageMeter/ProgressMeter and top-k
# accuracy() read with .item() every batch, `images.to(device, non_blocking=True)`, the
# data time and batch time measured with time.time(), validate() under model.eval() and
# torch.no_grad(), best acc@1 kept and a checkpoint dict (epoch, arch, state_dict,
# best_acc1, optimizer, scheduler) saved each epoch.
# Changed: ImageFolder swapped for FakeData (96/32 images of 3x32x32, seeded), resnet18
# with num_classes=10, batch 16, 2 epochs, no distributed or multiprocessing paths.
import argparse
import shutil
import time

import torch
import torch.nn as nn
import torch.optim
import torch.utils.data
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from torch.optim.lr_scheduler import StepLR

best_acc1 = 0


def main():
    global best_acc1
    parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
    parser.add_argument("-a", "--arch", default="resnet18")
    parser.add_argument("--epochs", default=2, type=int)
    parser.add_argument("-b", "--batch-size", default=16, type=int)
    parser.add_argument("--lr", default=0.1, type=float)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("-p", "--print-freq", default=2, type=int)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = models.__dict__[args.arch](num_classes=10).to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = StepLR(optimizer, step_size=30, gamma=0.1)
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    # stand-ins for datasets.ImageFolder(traindir / valdir, ...)
    train_dataset = datasets.FakeData(96, (3, 32, 32), 10, transform=transforms.Compose([
        transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]))
    val_dataset = datasets.FakeData(32, (3, 32, 32), 10, random_offset=99,
                                    transform=transforms.Compose([transforms.ToTensor(), normalize]))
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               shuffle=True, pin_memory=torch.cuda.is_available())
    val_loader = torch.utils.data.DataLoader(val_dataset, batch_size=args.batch_size, shuffle=False)
    for epoch in range(args.epochs):
        train(train_loader, model, criterion, optimizer, epoch, device, args)
        acc1 = validate(val_loader, model, criterion, args)
        scheduler.step()
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        save_checkpoint({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.state_dict(),
                         "best_acc1": best_acc1, "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict()}, is_best)


def train(train_loader, model, criterion, optimizer, epoch, device, args):
    batch_time, data_time = AverageMeter("Time"), AverageMeter("Data")
    losses, top1, top5 = AverageMeter("Loss"), AverageMeter("Acc@1"), AverageMeter("Acc@5")
    progress = ProgressMeter(len(train_loader), [batch_time, data_time, losses, top1, top5],
                             prefix=f"Epoch: [{epoch}]")
    model.train()
    end = time.time()
    for i, (images, target) in enumerate(train_loader):
        data_time.update(time.time() - end)
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1, images.size(0))
        top5.update(acc5, images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        batch_time.update(time.time() - end)
        end = time.time()
        if i % args.print_freq == 0:
            progress.display(i + 1)


def validate(val_loader, model, criterion, args):
    top1 = AverageMeter("Acc@1")
    model.eval()
    with torch.no_grad():
        for images, target in val_loader:
            output = model(images)
            criterion(output, target)
            acc1, = accuracy(output, target, topk=(1,))
            top1.update(acc1, images.size(0))
    print(f" * Acc@1 {top1.avg:.3f}")
    return top1.avg


def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, "model_best.pth.tar")


class AverageMeter:
    """Computes and stores the average and current value."""
    def __init__(self, name):
        self.name = name
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self):
        return f"{self.name} {self.val:.3f} ({self.avg:.3f})"


class ProgressMeter:
    def __init__(self, num_batches, meters, prefix=""):
        self.num_batches, self.meters, self.prefix = num_batches, meters, prefix

    def display(self, batch):
        print("\t".join([f"{self.prefix}[{batch}/{self.num_batches}]"] + [str(m) for m in self.meters]))


def accuracy(output, target, topk=(1,)):
    """The accuracy over the k top predictions, for each k."""
    with torch.no_grad():
        maxk, batch_size = max(topk), target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:k].reshape(-1).float().sum(0).mul_(100.0 / batch_size).item() for k in topk]


if __name__ == "__main__":
    main()
