# Shape: natanielruiz/deep-head-pose code/train_hopenet.py (with code/hopenet.py and
# code/datasets.py), https://github.com/natanielruiz/deep-head-pose (Apache-2.0, Nataniel
# Ruiz; train_hopenet.py read at 1a3aa42, hopenet.py at 0b8e19c). Written anew in that
# program's shape, not copied: this project keeps third-party code out of its commits.
# Kept from it: a script whose work is under `if __name__ == '__main__'`, a Hopenet (a
# ResNet of torchvision's blocks, made by its own _make_layer) with three heads of 66
# angle bins (yaw, pitch, roll); an Adam of three parameter groups built from generator
# functions (conv1/bn1/fc_finetune at lr 0, which also sets the 'bn' modules it meets to
# eval; the residual layers at lr; the heads at 5 x lr); a per-sample pose Dataset
# returning (image, binned labels, continuous labels, name) through PIL transforms, shuffled
# with num_workers=2; per batch a cross-entropy loss per angle plus alpha times the MSE of
# the softmax-expected angle (idx_tensor * 3 - 99), and the three losses backpropagated
# with `torch.autograd.backward(loss_seq, grad_seq)` (not loss.backward()), then
# optimizer.step(); a state_dict snapshot every epoch.
# Changed: the ResNet-50 of [3, 4, 6, 3] Bottlenecks (ImageNet weights loaded) becomes
# [1, 1, 1, 1] BasicBlocks from random weights at 64x64 inputs (an adaptive average pool
# for AvgPool2d(7) at 224), as the three-logit forward that train_hopenet.py calls; the
# 300W-LP images and .mat poses are a seeded stand-in made by the Dataset (48 images of
# 72x72, poses in [-99, 99) degrees); Scale(240)/RandomCrop(224) become Resize(72)/
# RandomCrop(64); batch 16, 2 epochs, print every 2 iterations; CPU for .cuda(gpu);
# Variable and xrange gone (Python 3); softmax over dim 1 (implicit upstream);
# grad_seq of 0-dim ones (the losses are 0-dim: torch.ones(1) no longer broadcasts there).
import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torchvision
from PIL import Image
from torch.utils.data import Dataset
from torchvision import transforms


class Hopenet(nn.Module):
    """A ResNet with three fully connected heads of angle bins: yaw, pitch and roll."""

    def __init__(self, block, layers, num_bins):
        self.inplanes = 64
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc_yaw = nn.Linear(512 * block.expansion, num_bins)
        self.fc_pitch = nn.Linear(512 * block.expansion, num_bins)
        self.fc_roll = nn.Linear(512 * block.expansion, num_bins)
        self.fc_finetune = nn.Linear(512 * block.expansion + 3, 3)   # unused; its lr is 0
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                m.weight.data.normal_(0, np.sqrt(2. / n))
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.data.fill_(1)
                m.bias.data.zero_()

    def _make_layer(self, block, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.avgpool(x)
        x = x.view(x.size(0), -1)
        return self.fc_yaw(x), self.fc_pitch(x), self.fc_roll(x)


class Pose_300W_LP(Dataset):
    """Stands in for datasets.Pose_300W_LP: per index a seeded RGB image (its colors a
    function of the pose) and its pose; labels binned into 66 bins of 3 degrees."""

    def __init__(self, data_dir, filename_list, transform, length=48):
        self.data_dir, self.transform, self.length = data_dir, transform, length
        rng = np.random.default_rng(0)
        self.poses = rng.uniform(-99, 99, (length, 3)).astype(np.float32)   # yaw, pitch, roll
        self.noise = rng.integers(0, 60, (length, 72, 72, 3))

    def __getitem__(self, index):
        yaw, pitch, roll = self.poses[index]
        base = np.array([128 + yaw, 128 + pitch, 128 + roll])
        img = Image.fromarray(np.clip(base + self.noise[index], 0, 255).astype(np.uint8))
        if self.transform is not None:
            img = self.transform(img)
        bins = np.array(range(-99, 102, 3))
        binned_pose = np.digitize([yaw, pitch, roll], bins) - 1
        labels = torch.LongTensor(binned_pose)
        cont_labels = torch.FloatTensor([yaw, pitch, roll])
        return img, labels, cont_labels, f"image_{index:05d}"

    def __len__(self):
        return self.length


def parse_args():
    parser = argparse.ArgumentParser(description="Head pose estimation using the Hopenet network.")
    parser.add_argument("--gpu", dest="gpu_id", default=0, type=int)
    parser.add_argument("--num_epochs", dest="num_epochs", default=2, type=int)
    parser.add_argument("--batch_size", dest="batch_size", default=16, type=int)
    parser.add_argument("--lr", dest="lr", default=0.001, type=float)
    parser.add_argument("--dataset", dest="dataset", default="Pose_300W_LP", type=str)
    parser.add_argument("--data_dir", dest="data_dir", default="", type=str)
    parser.add_argument("--filename_list", dest="filename_list", default="", type=str)
    parser.add_argument("--output_string", dest="output_string", default="", type=str)
    parser.add_argument("--alpha", dest="alpha", default=0.001, type=float)
    parser.add_argument("--snapshot", dest="snapshot", default="", type=str)
    return parser.parse_args()


def get_ignored_params(model):
    b = [model.conv1, model.bn1, model.fc_finetune]
    for i in range(len(b)):
        for module_name, module in b[i].named_modules():
            if "bn" in module_name:
                module.eval()
            for name, param in module.named_parameters():
                yield param


def get_non_ignored_params(model):
    b = [model.layer1, model.layer2, model.layer3, model.layer4]
    for i in range(len(b)):
        for module_name, module in b[i].named_modules():
            if "bn" in module_name:
                module.eval()
            for name, param in module.named_parameters():
                yield param


def get_fc_params(model):
    b = [model.fc_yaw, model.fc_pitch, model.fc_roll]
    for i in range(len(b)):
        for module_name, module in b[i].named_modules():
            for name, param in module.named_parameters():
                yield param


if __name__ == "__main__":
    args = parse_args()
    num_epochs = args.num_epochs
    batch_size = args.batch_size
    if not os.path.exists("output/snapshots"):
        os.makedirs("output/snapshots")

    model = Hopenet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], 66)
    print("Loading data.")
    transformations = transforms.Compose([
        transforms.Resize(72), transforms.RandomCrop(64), transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    pose_dataset = Pose_300W_LP(args.data_dir, args.filename_list, transformations)
    train_loader = torch.utils.data.DataLoader(dataset=pose_dataset, batch_size=batch_size,
                                               shuffle=True, num_workers=2)
    criterion = nn.CrossEntropyLoss()
    reg_criterion = nn.MSELoss()
    alpha = args.alpha   # the regression loss's coefficient
    softmax = nn.Softmax(dim=1)
    idx_tensor = torch.FloatTensor([idx for idx in range(66)])
    optimizer = torch.optim.Adam([{"params": get_ignored_params(model), "lr": 0},
                                  {"params": get_non_ignored_params(model), "lr": args.lr},
                                  {"params": get_fc_params(model), "lr": args.lr * 5}],
                                 lr=args.lr)

    print("Ready to train network.")
    for epoch in range(num_epochs):
        for i, (images, labels, cont_labels, name) in enumerate(train_loader):
            # binned labels and continuous ones
            label_yaw, label_pitch, label_roll = labels[:, 0], labels[:, 1], labels[:, 2]
            label_yaw_cont, label_pitch_cont, label_roll_cont = cont_labels[:, 0], cont_labels[:, 1], cont_labels[:, 2]
            yaw, pitch, roll = model(images)
            # cross entropy losses
            loss_yaw = criterion(yaw, label_yaw)
            loss_pitch = criterion(pitch, label_pitch)
            loss_roll = criterion(roll, label_roll)
            # MSE of the expected angles
            yaw_predicted = torch.sum(softmax(yaw) * idx_tensor, 1) * 3 - 99
            pitch_predicted = torch.sum(softmax(pitch) * idx_tensor, 1) * 3 - 99
            roll_predicted = torch.sum(softmax(roll) * idx_tensor, 1) * 3 - 99
            loss_reg_yaw = reg_criterion(yaw_predicted, label_yaw_cont)
            loss_reg_pitch = reg_criterion(pitch_predicted, label_pitch_cont)
            loss_reg_roll = reg_criterion(roll_predicted, label_roll_cont)
            # total losses
            loss_yaw += alpha * loss_reg_yaw
            loss_pitch += alpha * loss_reg_pitch
            loss_roll += alpha * loss_reg_roll

            loss_seq = [loss_yaw, loss_pitch, loss_roll]
            grad_seq = [torch.ones(()) for _ in range(len(loss_seq))]
            optimizer.zero_grad()
            torch.autograd.backward(loss_seq, grad_seq)
            optimizer.step()
            if (i + 1) % 2 == 0:
                print("Epoch [%d/%d], Iter [%d/%d] Losses: Yaw %.4f, Pitch %.4f, Roll %.4f"
                      % (epoch + 1, num_epochs, i + 1, len(pose_dataset) // batch_size,
                         loss_yaw.item(), loss_pitch.item(), loss_roll.item()))
        # a snapshot each epoch
        if epoch % 1 == 0 and epoch < num_epochs:
            print("Taking snapshot...")
            torch.save(model.state_dict(),
                       "output/snapshots/" + args.output_string + "_epoch_" + str(epoch + 1) + ".pkl")
