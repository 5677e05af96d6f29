# Shape: PyTorch's functorch examples dp_cifar10/cifar10_transforms.py (DP-SGD with
# torch.func per-sample gradients),
# https://github.com/pytorch/pytorch/blob/main/functorch/examples/dp_cifar10/cifar10_transforms.py
# (BSD-3-Clause, pytorch/pytorch; read at 01caf79). Written anew in that program's shape,
# not copied: this project keeps third-party code out of its commits. Kept from it: main()
# with parse_args(), a CIFAR-10 loader whose batch is sample_rate * len(dataset), a
# GroupNorm net, SGD with momentum, a cosine LR written into the param groups each epoch,
# train() over tqdm(train_loader) where each batch's per-sample gradients come from
# vmap(grad_and_value(compute_loss_and_output, has_aux=True), (None, 0, 0)) over
# functional_call(model, weights, image.unsqueeze(0)) with the weights detached (no
# loss.backward() anywhere), the per-sample gradients set as param.grad_sample, then
# clipped to a norm, summed, noised and assigned as param.grad / batch_size, then
# optimizer.step() and zero_grad(); loss.item() and numpy accuracy every batch; test()
# under model.eval() and torch.no_grad(); a checkpoint dict saved every epoch, the best
# copied.
# Changed: CIFAR-10 swapped for FakeData (256/64 images of 3x32x32, seeded); a small conv
# net with GroupNorm (the norm_layer upstream gives torchvision's resnet18, whose
# per-sample gradients are too heavy for 2 cores); sample_rate 1/16 (batch 16), 2 epochs,
# no loader workers (2 upstream), print every 8 batches, tqdm to a null stream. No
# logger or secure RNG; the arguments nothing reads (--resume, --delta, ...) left out.
import argparse
import os
import shutil
from datetime import datetime, timedelta

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import torch.utils.data
import torchvision.transforms as transforms
from torch.func import functional_call, grad_and_value, vmap
from torchvision.datasets import FakeData
from tqdm import tqdm

NULL = open(os.devnull, "w")


def save_checkpoint(state, is_best, filename="checkpoint.tar"):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, "model_best.pth.tar")


def accuracy(preds, labels):
    return (preds == labels).mean()


def compute_norms(sample_grads):
    batch_size = sample_grads[0].shape[0]
    norms = [sample_grad.view(batch_size, -1).norm(2, dim=-1) for sample_grad in sample_grads]
    norms = torch.stack(norms, dim=0).norm(2, dim=0)
    return norms, batch_size


def clip_and_accumulate_and_add_noise(model, max_per_sample_grad_norm=1.0, noise_multiplier=1.0):
    sample_grads = tuple(param.grad_sample for param in model.parameters())
    # the norms, the clipping factors, clipped and summed, gaussian noise added
    sample_norms, batch_size = compute_norms(sample_grads)
    clip_factor = max_per_sample_grad_norm / (sample_norms + 1e-6)
    clip_factor = clip_factor.clamp(max=1.0)
    grads = tuple(torch.einsum("i,i...", clip_factor, sample_grad) for sample_grad in sample_grads)
    stddev = max_per_sample_grad_norm * noise_multiplier
    noises = tuple(torch.normal(0, stddev, grad_param.shape, device=grad_param.device)
                   for grad_param in grads)
    grads = tuple(noise + grad_param for noise, grad_param in zip(noises, grads))
    # the new grads assigned, the sample grads deleted
    for param, param_grad in zip(model.parameters(), grads):
        param.grad = param_grad / batch_size
        del param.grad_sample


def train(args, model, train_loader, optimizer, epoch, device):
    start_time = datetime.now()
    criterion = nn.CrossEntropyLoss()
    losses = []
    top1_acc = []
    for i, (images, target) in enumerate(tqdm(train_loader, file=NULL)):
        images = images.to(device)
        target = target.to(device)

        # per-sample gradients: the loss written for one example, grad'd, vmapped
        def compute_loss_and_output(weights, image, target):
            images = image.unsqueeze(0)
            targets = target.unsqueeze(0)
            output = functional_call(model, weights, images)
            loss = criterion(output, targets)
            return loss, output.squeeze(0)

        grads_loss_output = grad_and_value(compute_loss_and_output, has_aux=True)
        weights = dict(model.named_parameters())
        detached_weights = {k: v.detach() for k, v in weights.items()}
        sample_grads, (sample_loss, output) = vmap(grads_loss_output, (None, 0, 0))(
            detached_weights, images, target)
        loss = sample_loss.mean()
        for name, grad_sample in sample_grads.items():
            weights[name].grad_sample = grad_sample.detach()

        clip_and_accumulate_and_add_noise(model, args.max_per_sample_grad_norm, args.sigma)

        preds = np.argmax(output.detach().cpu().numpy(), axis=1)
        labels = target.detach().cpu().numpy()
        losses.append(loss.item())
        top1_acc.append(accuracy(preds, labels))
        optimizer.step()
        optimizer.zero_grad()
        if i % args.print_freq == 0:
            print(f"\tTrain Epoch: {epoch} \tLoss: {np.mean(losses):.6f} Acc@1: {np.mean(top1_acc):.6f} ")
    return datetime.now() - start_time


def test(args, model, test_loader, device):
    model.eval()
    criterion = nn.CrossEntropyLoss()
    losses = []
    top1_acc = []
    with torch.no_grad():
        for images, target in tqdm(test_loader, file=NULL):
            images = images.to(device)
            target = target.to(device)
            output = model(images)
            loss = criterion(output, target)
            preds = np.argmax(output.detach().cpu().numpy(), axis=1)
            labels = target.detach().cpu().numpy()
            losses.append(loss.item())
            top1_acc.append(accuracy(preds, labels))
    top1_avg = np.mean(top1_acc)
    print(f"\tTest set:Loss: {np.mean(losses):.6f} Acc@1: {top1_avg:.6f} ")
    return np.mean(top1_acc)


def small_convnet(num_classes=10, norm_layer=nn.BatchNorm2d):
    """Stands in for torchvision's resnet18(norm_layer=...): conv, norm, relu, pooled."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), norm_layer(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), norm_layer(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32 * 4, num_classes))


def main():
    args = parse_args()
    device = args.device
    generator = None
    normalize = [transforms.ToTensor(),
                 transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))]
    train_transform = transforms.Compose(normalize)
    test_transform = transforms.Compose(normalize)
    # stand-ins for CIFAR10(root=args.data_root, train=..., download=True, transform=...)
    train_dataset = FakeData(256, (3, 32, 32), 10, transform=train_transform)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=int(args.sample_rate * len(train_dataset)), generator=generator,
        num_workers=args.workers, pin_memory=True)
    test_dataset = FakeData(64, (3, 32, 32), 10, transform=test_transform, random_offset=7)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.batch_size_test,
                                              shuffle=False, num_workers=args.workers)
    best_acc1 = 0
    model = small_convnet(norm_layer=lambda c: nn.GroupNorm(args.gn_groups, c))
    model = model.to(device)
    if args.optim == "SGD":
        optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                              weight_decay=args.weight_decay)
    elif args.optim == "RMSprop":
        optimizer = optim.RMSprop(model.parameters(), lr=args.lr)
    elif args.optim == "Adam":
        optimizer = optim.Adam(model.parameters(), lr=args.lr)
    else:
        raise NotImplementedError("Optimizer not recognized. Please check spelling")

    accuracy_per_epoch = []
    time_per_epoch = []
    for epoch in range(args.start_epoch, args.epochs + 1):
        if args.lr_schedule == "cos":
            lr = args.lr * 0.5 * (1 + np.cos(np.pi * epoch / (args.epochs + 1)))
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
        train_duration = train(args, model, train_loader, optimizer, epoch, device)
        top1_acc = test(args, model, test_loader, device)
        is_best = top1_acc > best_acc1
        best_acc1 = max(top1_acc, best_acc1)
        time_per_epoch.append(train_duration)
        accuracy_per_epoch.append(float(top1_acc))
        save_checkpoint({"epoch": epoch + 1, "arch": "Convnet", "state_dict": model.state_dict(),
                         "best_acc1": best_acc1, "optimizer": optimizer.state_dict()},
                        is_best, filename=args.checkpoint_file + ".tar")
    time_per_epoch_seconds = [t.total_seconds() for t in time_per_epoch]
    avg_time_per_epoch = sum(time_per_epoch_seconds) / len(time_per_epoch_seconds)
    metrics = {"accuracy": best_acc1, "accuracy_per_epoch": accuracy_per_epoch,
               "avg_time_per_epoch_str": str(timedelta(seconds=int(avg_time_per_epoch))),
               "time_per_epoch": time_per_epoch_seconds}
    print(metrics)


def parse_args():
    parser = argparse.ArgumentParser(description="PyTorch CIFAR10 DP Training")
    parser.add_argument("-j", "--workers", default=0, type=int, metavar="N")
    parser.add_argument("--epochs", default=2, type=int, metavar="N")
    parser.add_argument("--start-epoch", default=1, type=int, metavar="N")
    parser.add_argument("-b", "--batch-size-test", default=64, type=int, metavar="N")
    parser.add_argument("--sample-rate", default=0.0625, type=float, metavar="SR")
    parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, metavar="LR", dest="lr")
    parser.add_argument("--momentum", default=0.9, type=float, metavar="M")
    parser.add_argument("--wd", "--weight-decay", default=0, type=float, metavar="W", dest="weight_decay")
    parser.add_argument("-p", "--print-freq", default=8, type=int, metavar="N")
    parser.add_argument("--sigma", type=float, default=1.5, metavar="S")
    parser.add_argument("-c", "--max-per-sample-grad_norm", type=float, default=10.0, metavar="C")
    parser.add_argument("--checkpoint-file", type=str, default="checkpoint")
    parser.add_argument("--optim", type=str, default="SGD")
    parser.add_argument("--lr-schedule", type=str, choices=["constant", "cos"], default="cos")
    parser.add_argument("--device", type=str, default="cpu")
    parser.add_argument("--gn-groups", type=int, default=8)
    return parser.parse_args()


if __name__ == "__main__":
    main()
