"""The whole call a user waits for: short runs as a notebook re-runs them, against the plain loop.

    python bench/whole_call.py [--repeats 5]

Each repeat makes a new Dataset object of the same data (as re-running the cell that
defines it does) and times the whole call: `nt.fit(...)` with its defaults, its setup
and measuring included, against a plain loop over a DataLoader of the same Dataset
(AdamW, shuffle), interleaved; and for BERT-tiny, Hugging Face's `Trainer` on the same
samples, the peer a Hugging Face user would pick (needs `pip install accelerate`;
skipped, saying so, without it). One untimed warm-up round first: the first call of a
process also finds what is cached on disk (the CPU's peak, the bf16 gain), as a
notebook's second cell does. Printed: the median seconds per call, the min-max spread,
and the paired median of fit's time over the plain loop's. Target (issue 30): at most
1.0x the plain loop on every row, and ahead of the Trainer.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
import nbtrain as nt   # noqa: E402
from nbtrain.tools.demo import digits_cnn   # noqa: E402
from nbtrain.machine import machine_line   # noqa: E402
from real_models import Images, Tokens, bert   # noqa: E402
from rounds import interleaved, paired   # noqa: E402  (bench/rounds.py)

BATCH, LR = 64, 1e-3


def plain(model, dataset, loss_fn, epochs: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for _ in range(epochs):
        for batch in DataLoader(dataset, batch_size=BATCH, shuffle=True):
            loss = model(**batch).loss if loss_fn is None else loss_fn(model(batch[0]), batch[1])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def fit(model, dataset, loss_fn, epochs: int) -> None:
    nt.fit(model, dataset, loss_fn, progress=False,
           config=nt.TrainConfig(batch_size=BATCH, lr=LR, epochs=epochs))


def trainer(model, dataset, loss_fn, epochs: int) -> None:
    from transformers import Trainer, TrainingArguments
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(out, per_device_train_batch_size=BATCH, learning_rate=LR,
                                 num_train_epochs=epochs, weight_decay=0.0, report_to=[],
                                 save_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)
        Trainer(model=model, args=args, train_dataset=dataset).train()


def has_trainer() -> str:
    try:
        import accelerate  # noqa: F401
        import transformers  # noqa: F401
        return ""
    except ImportError as exc:
        return f"skipped: {exc.name} is not installed (pip install accelerate)"


def cases():
    dx, dy = nt.datasets.digits("train")
    yield "digits CNN, per-sample Dataset, 1 epoch", digits_cnn, lambda: Images(dx, dy), \
        F.cross_entropy, 1
    yield "digits CNN, per-sample Dataset, 3 epochs", digits_cnn, lambda: Images(dx, dy), \
        F.cross_entropy, 3
    yield "BERT-tiny, dict samples, 1 epoch of 32 steps", bert, lambda: Tokens(32 * BATCH), \
        None, 1


def one(way, make_model, make_data, loss_fn, epochs) -> float:
    torch.manual_seed(0)
    model, dataset = make_model(), make_data()   # a new Dataset object: a re-run cell
    start = time.perf_counter()
    way(model, dataset, loss_fn, epochs)
    return time.perf_counter() - start


def measure(make_model, make_data, loss_fn, epochs, repeats: int) -> dict:
    ways = {"plain loop": plain, "nt.fit defaults": fit}
    if loss_fn is None and not has_trainer():
        ways["HF Trainer"] = trainer
    for way in ways.values():   # warm-up round: imports, allocations, what is on disk
        one(way, make_model, make_data, loss_fn, epochs)
    return interleaved(list(ways), repeats,
                       lambda name: one(ways[name], make_model, make_data, loss_fn, epochs))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"{machine_line()}\nmedian of {args.repeats} interleaved whole calls, a new "
          "Dataset object each\n")
    print("| case | way | s per call | spread | vs plain loop (paired median) |")
    print("|---|---|---:|---:|---:|")
    for label, make_model, make_data, loss_fn, epochs in cases():
        seconds = measure(make_model, make_data, loss_fn, epochs, args.repeats)
        for name, values in seconds.items():
            ratio = paired(seconds, name, "plain loop")[0]
            print(f"| {label} | {name} | {statistics.median(values):.3f} | "
                  f"{min(values):.3f}-{max(values):.3f} | {ratio:.2f}x |", flush=True)
        if loss_fn is None and has_trainer():
            print(f"| {label} | HF Trainer | - | - | {has_trainer()} |")


if __name__ == "__main__":
    main()
