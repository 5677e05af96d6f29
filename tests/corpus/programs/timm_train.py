# Shape: pytorch-image-models (timm) train.py,
# https://github.com/huggingface/pytorch-image-models/blob/main/train.py
# (Apache-2.0, Ross Wightman; read 2025). Written anew in that script's shape, not copied:
# this project keeps third-party code out of its commits. Kept from it: main() with
# argparse (--model, --num-classes, --opt, --lr, --weight-decay, --sched, --epochs,
# --warmup-epochs, --smoothing, --amp, --amp-dtype, --model-ema, --model-ema-decay);
# timm.create_model; create_optimizer_v2(model, opt=, lr=, weight_decay=);
# create_scheduler_v2(optimizer, sched=, num_epochs=, warmup_epochs=, updates_per_epoch=)
# with lr_scheduler.step_update(num_updates=) after each update and
# lr_scheduler.step(epoch + 1) after each epoch; amp_autocast = partial(torch.autocast,
# device_type=, dtype=bfloat16) and no loss scaler for bf16; ModelEmaV3(model, decay=)
# updated after each step with step=num_updates; LabelSmoothingCrossEntropy; a
# train_one_epoch() of zero_grad, forward under amp_autocast(), backward, step, with
# AverageMeter of loss.item(); validate() of model and model_ema under torch.no_grad() and
# amp_autocast() with timm.utils.accuracy.
# Changed: no create_dataset/create_loader (their transforms and prefetcher): plain
# DataLoaders over 128 train and 32 val seeded 3x32x32 images of 4 classes made in code,
# batch 16; timm's tiny `test_vit` built from its config at img_size 32 (no pretrained
# weights); 2 epochs, warm-up 1; no distributed, checkpoint saver, mixup or logging to files.
import argparse
import time
from functools import partial

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import timm
from timm.loss import LabelSmoothingCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import AverageMeter, ModelEmaV3, accuracy

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
parser.add_argument("--model", default="test_vit", type=str)
parser.add_argument("--num-classes", type=int, default=4)
parser.add_argument("--img-size", type=int, default=32)
parser.add_argument("-b", "--batch-size", type=int, default=16)
parser.add_argument("--opt", default="adamw", type=str)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--weight-decay", type=float, default=0.05)
parser.add_argument("--sched", default="cosine", type=str)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--warmup-epochs", type=int, default=1)
parser.add_argument("--warmup-lr", type=float, default=1e-5)
parser.add_argument("--min-lr", type=float, default=1e-6)
parser.add_argument("--smoothing", type=float, default=0.1)
parser.add_argument("--amp", action="store_true", default=True)
parser.add_argument("--amp-dtype", default="bfloat16", type=str)
parser.add_argument("--model-ema", action="store_true", default=True)
parser.add_argument("--model-ema-decay", type=float, default=0.998)
parser.add_argument("--log-interval", type=int, default=4)


def synthetic_images(n, classes, size, seed):
    """Stand-in for an ImageFolder: each class a seeded color pattern plus noise."""
    gen = torch.Generator().manual_seed(seed)
    patterns = torch.rand(classes, 3, size, size, generator=gen)
    labels = torch.randint(0, classes, (n,), generator=gen)
    images = patterns[labels] + 0.5 * torch.randn(n, 3, size, size, generator=gen)
    return TensorDataset(images, labels)


def main():
    args = parser.parse_args()
    device = torch.device("cpu")

    model = timm.create_model(args.model, pretrained=False, num_classes=args.num_classes,
                              img_size=args.img_size)
    model.to(device=device)

    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay)

    amp_autocast = partial(torch.autocast, device_type=device.type, enabled=False)
    loss_scaler = None   # bf16 or fp32: no scaling (train.py's NativeScaler is for float16)
    if args.amp:
        amp_dtype = torch.bfloat16 if args.amp_dtype == "bfloat16" else torch.float16
        amp_autocast = partial(torch.autocast, device_type=device.type, dtype=amp_dtype)

    model_ema = None
    if args.model_ema:
        model_ema = ModelEmaV3(model, decay=args.model_ema_decay)

    loader_train = DataLoader(synthetic_images(128, args.num_classes, args.img_size, 0),
                              batch_size=args.batch_size, shuffle=True, drop_last=True)
    loader_eval = DataLoader(synthetic_images(32, args.num_classes, args.img_size, 1),
                             batch_size=args.batch_size)

    updates_per_epoch = len(loader_train)
    lr_scheduler, num_epochs = create_scheduler_v2(
        optimizer, sched=args.sched, num_epochs=args.epochs, warmup_epochs=args.warmup_epochs,
        warmup_lr=args.warmup_lr, min_lr=args.min_lr, updates_per_epoch=updates_per_epoch)

    train_loss_fn = LabelSmoothingCrossEntropy(smoothing=args.smoothing).to(device=device)
    validate_loss_fn = nn.CrossEntropyLoss().to(device=device)

    for epoch in range(num_epochs):
        train_metrics = train_one_epoch(epoch, model, loader_train, optimizer, train_loss_fn, args,
                                        lr_scheduler=lr_scheduler, amp_autocast=amp_autocast,
                                        loss_scaler=loss_scaler, model_ema=model_ema)
        eval_metrics = validate(model, loader_eval, validate_loss_fn, amp_autocast=amp_autocast)
        if model_ema is not None:
            ema_eval_metrics = validate(model_ema, loader_eval, validate_loss_fn, amp_autocast=amp_autocast)
            eval_metrics = ema_eval_metrics
        lr_scheduler.step(epoch + 1, eval_metrics["top1"])
        print(f"epoch {epoch}: train {train_metrics}, eval {eval_metrics}")


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args, lr_scheduler=None,
                    amp_autocast=None, loss_scaler=None, model_ema=None):
    losses_m = AverageMeter()
    model.train()
    num_updates = epoch * len(loader)
    end = time.time()
    for batch_idx, (input, target) in enumerate(loader):
        input, target = input.to(torch.device("cpu")), target.to(torch.device("cpu"))
        optimizer.zero_grad()
        with amp_autocast():
            output = model(input)
            loss = loss_fn(output, target)
        loss.backward()
        optimizer.step()
        losses_m.update(loss.item(), input.size(0))
        if model_ema is not None:
            model_ema.update(model, step=num_updates)
        num_updates += 1
        if batch_idx % args.log_interval == 0:
            lr = optimizer.param_groups[0]["lr"]
            print(f"Train: {epoch} [{batch_idx}/{len(loader)}] loss {losses_m.val:.4f} "
                  f"({losses_m.avg:.4f}) lr {lr:.3e} time {time.time() - end:.3f}")
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)
        end = time.time()
    return {"loss": losses_m.avg}


def validate(model, loader, loss_fn, amp_autocast=None):
    losses_m, top1_m = AverageMeter(), AverageMeter()
    model.eval()
    with torch.no_grad():
        for input, target in loader:
            with amp_autocast():
                output = model(input)
                loss = loss_fn(output, target)
            acc1, = accuracy(output, target, topk=(1,))
            losses_m.update(loss.item(), input.size(0))
            top1_m.update(acc1.item(), output.size(0))
    return {"loss": losses_m.avg, "top1": top1_m.avg}


if __name__ == "__main__":
    main()
