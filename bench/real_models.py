"""Real models as people write them: a plain loop, nbtrain's defaults, an expert's loop.

    python bench/real_models.py [--repeats 5] [--steps 40]

ms/step of one epoch (setup included) for a CNN and a small ResNet on in-memory tensors,
BERT from a tiny BertConfig on a map-style Dataset of dict samples (model(**batch)), and
the CNN on a per-sample Dataset. The plain loop is what a tutorial writes: a DataLoader
(batch_size, shuffle=True), AdamW, torch's default threads. The expert's loop (tensor
rows only) slices batches from the tensors, uses AdamW(fused=True) and the thread count
that timed fastest just before. nbtrain runs `TrainConfig()` defaults. Ways are
interleaved in every repeat (others share the cores), each after one untimed warm-up
epoch (imports, nbtrain's cached probes); the table gives medians and the min-max spread.
Targets: defaults at most 1.0x the plain loop, at most 1.03x the expert on tensors.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import nbtrain as nt
from nbtrain.machine import machine_line
from nbtrain.data import available_cores
from rounds import interleaved   # bench/rounds.py

BATCH, LR = 64, 1e-3


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


class Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                                  nn.ReLU(), nn.Conv2d(c, c, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(c))

    def forward(self, x):
        return F.relu(x + self.body(x))


def resnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                         nn.ReLU(), Block(16), nn.MaxPool2d(2), Block(16),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification
    config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=128,
                        max_position_embeddings=64, num_labels=2)
    return BertForSequenceClassification(config)


class Images(Dataset):
    """Per-sample images, as a Dataset over decoded files returns them."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Tokens(Dataset):
    """A tokenizer's fixed-length dict samples: the default collate makes a dict batch."""

    def __init__(self, n: int, length: int = 32):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 1000, (n, length), generator=gen)
        self.labels = torch.randint(0, 2, (n,), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.labels[i]}


def images(n: int):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 16, 16, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def plain_loop(make_model, data, loss_fn) -> float:
    """Seconds of one epoch the way a tutorial writes it."""
    start = time.perf_counter()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    dataset = torch.utils.data.TensorDataset(*data) if isinstance(data, tuple) else data
    for batch in DataLoader(dataset, batch_size=BATCH, shuffle=True):
        if loss_fn is None:
            loss = model(**batch).loss
        else:
            loss = loss_fn(model(batch[0]), batch[1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def expert_loop(make_model, data, loss_fn, threads: int) -> float:
    """Seconds of one epoch hand-tuned: batched slicing, fused AdamW, the best threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    start = time.perf_counter()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    x, y = data
    order = torch.randperm(len(x))
    for first in range(0, len(x), BATCH):
        idx = order[first:first + BATCH]
        loss = loss_fn(model(x.index_select(0, idx)), y.index_select(0, idx))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    seconds = time.perf_counter() - start
    torch.set_num_threads(before)
    return seconds


def nbtrain_defaults(make_model, data, loss_fn) -> float:
    start = time.perf_counter()
    nt.fit(make_model(), data, loss_fn, config=nt.TrainConfig(batch_size=BATCH, lr=LR),
           progress=False)
    return time.perf_counter() - start


def best_threads(make_model, data, loss_fn) -> int:
    """The expert's thread count: each count timed on one epoch, twice, interleaved."""
    counts = sorted({1, torch.get_num_threads()})
    times = {t: [] for t in counts}
    for _ in range(2):
        for t in counts:
            times[t].append(expert_loop(make_model, data, loss_fn, t))
    return min(counts, key=lambda t: min(times[t]))


def cases(steps: int):
    n = steps * BATCH
    x, y = images(n)
    return [("CNN, tensors 3x16x16", cnn, (x, y), F.cross_entropy),
            ("ResNet-style, tensors 3x16x16", resnet, (x, y), F.cross_entropy),
            ("BERT-tiny, dict samples (Dataset)", bert, Tokens(n), None),
            ("CNN, per-sample Dataset", cnn, Images(x, y), F.cross_entropy)]


def measure(case, repeats: int, steps: int) -> dict:
    name, make_model, data, loss_fn = case
    ways = {"plain loop": lambda: plain_loop(make_model, data, loss_fn),
            "nbtrain defaults": lambda: nbtrain_defaults(make_model, data, loss_fn)}
    if isinstance(data, tuple):
        threads = best_threads(make_model, data, loss_fn)
        ways[f"expert ({threads} thread(s))"] = lambda: expert_loop(make_model, data, loss_fn,
                                                                    threads)
    for way in ways.values():   # warm-up: imports, first allocations, nbtrain's probes
        way()
    seconds = interleaved(list(ways), repeats, lambda w: ways[w]())   # rotating which is first
    return {w: [s / steps * 1e3 for s in v] for w, v in seconds.items()}


def main():
    print(machine_line())   # the caption: which CPU, its bf16 units, the load
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = []
    for case in cases(args.steps):
        ms = measure(case, args.repeats, args.steps)
        plain = statistics.median(ms["plain loop"])
        expert = next((statistics.median(v) for w, v in ms.items() if w.startswith("expert")),
                      None)
        for way, values in ms.items():
            med = statistics.median(values)
            vs_expert = f"{med / expert:.2f}x" if expert else "-"
            rows.append(f"| {case[0]} | {way} | {med:.2f} | {min(values):.2f}-{max(values):.2f} "
                        f"| {med / plain:.2f}x | {vs_expert} |")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    print(f"{cpu}, {available_cores()} cores, torch {torch.__version__}; load average "
          f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after; median of "
          f"{args.repeats} interleaved epochs of {args.steps} steps, batch {BATCH}\n")
    print("| case | way | ms/step | spread | vs plain | vs expert |\n|---|---|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
