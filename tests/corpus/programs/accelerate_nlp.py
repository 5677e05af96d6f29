# Shape: Hugging Face accelerate examples/nlp_example.py and, with
# --gradient_accumulation_steps above 1, examples/by_feature/gradient_accumulation.py,
# https://github.com/huggingface/accelerate/blob/main/examples/nlp_example.py and
# https://github.com/huggingface/accelerate/blob/main/examples/by_feature/gradient_accumulation.py
# (Apache-2.0, The HuggingFace Inc. team; read 2025). Written anew in those scripts' shape,
# not copied: this project keeps third-party code out of its commits. Kept from them: main()
# with argparse (--mixed_precision, --cpu, --gradient_accumulation_steps) calling
# training_function(config, args); get_dataloaders(accelerator, batch_size) with a
# collate_fn of tokenizer.pad(padding="longest", return_tensors="pt"); set_seed; the model
# moved to accelerator.device; torch AdamW; get_linear_schedule_with_warmup;
# accelerator.prepare(model, optimizer, train_dataloader, eval_dataloader, lr_scheduler);
# batch.to(accelerator.device); outputs = model(**batch); accelerator.backward(loss);
# nlp_example: loss / gradient_accumulation_steps and a step when step % N == 0 (N is 1
# there); by_feature: Accelerator(gradient_accumulation_steps=N) and
# `with accelerator.accumulate(model):` around forward, backward, optimizer.step(),
# lr_scheduler.step(), optimizer.zero_grad() on every batch (the wrappers skip all but
# every Nth); eval under torch.no_grad() with accelerator.gather_for_metrics and
# accelerator.print.
# Changed: no download: a BertTokenizer over a vocab.txt of 32 words written to a temporary
# folder, a tiny BertConfig (2 layers, hidden 32) in place of bert-base-cased, MRPC's
# pairs made in code (seeded; label: the two sentences start with the same word); accuracy
# counted by hand in place of evaluate's glue metric; config lr 5e-4, 2 epochs, batch 8
# (64 train and 32 eval pairs), 2 warm-up steps in place of 100.
import argparse
import os
import random
import tempfile

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import (BertConfig, BertForSequenceClassification, BertTokenizer,
                          get_linear_schedule_with_warmup)

EVAL_BATCH_SIZE = 16
WORDS = ["the", "a", "company", "said", "shares", "rose", "fell", "on", "monday", "percent",
         "market", "bank", "stock", "price", "year", "quarter", "profit", "sales", "report",
         "new", "deal", "billion", "court", "judge", "city", "police", "state", "group", "plan",
         "week", "analysts", "expected"]


def make_pairs(n, seed):
    """Stand-in for a split of GLUE MRPC: sentence1, sentence2, label."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s1 = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
        s2 = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
        label = rng.randint(0, 1)
        if label:
            s2[0] = s1[0]
        elif s2[0] == s1[0]:
            label = 1
        rows.append({"sentence1": " ".join(s1), "sentence2": " ".join(s2), "label": label})
    return rows


def get_dataloaders(accelerator: Accelerator, batch_size: int = 8):
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    tokenizer = BertTokenizer(os.path.join(folder, "vocab.txt"))
    datasets = {"train": make_pairs(64, 0), "validation": make_pairs(32, 1)}

    def tokenize_function(example):
        outputs = tokenizer(example["sentence1"], example["sentence2"], truncation=True, max_length=None)
        outputs["labels"] = example["label"]
        return outputs

    tokenized_datasets = {split: [tokenize_function(e) for e in rows] for split, rows in datasets.items()}

    def collate_fn(examples):
        return tokenizer.pad(examples, padding="longest", return_tensors="pt")

    train_dataloader = DataLoader(tokenized_datasets["train"], shuffle=True, collate_fn=collate_fn,
                                  batch_size=batch_size)
    eval_dataloader = DataLoader(tokenized_datasets["validation"], shuffle=False, collate_fn=collate_fn,
                                 batch_size=EVAL_BATCH_SIZE)
    return train_dataloader, eval_dataloader, len(tokenizer)


def training_function(config, args):
    gradient_accumulation_steps = args.gradient_accumulation_steps
    by_feature = gradient_accumulation_steps > 1   # examples/by_feature/gradient_accumulation.py
    if by_feature:
        accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                                  gradient_accumulation_steps=gradient_accumulation_steps)
    else:
        accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    set_seed(seed)
    train_dataloader, eval_dataloader, vocab_size = get_dataloaders(accelerator, batch_size)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=2))
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    num_training_steps = len(train_dataloader) * num_epochs
    if not by_feature:
        num_training_steps //= gradient_accumulation_steps
    lr_scheduler = get_linear_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=2,
                                                   num_training_steps=num_training_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            batch.to(accelerator.device)
            if by_feature:
                with accelerator.accumulate(model):
                    output = model(**batch)
                    loss = output.loss
                    accelerator.backward(loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
            else:
                outputs = model(**batch)
                loss = outputs.loss
                loss = loss / gradient_accumulation_steps
                accelerator.backward(loss)
                if step % gradient_accumulation_steps == 0:
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()

        model.eval()
        correct = total = 0
        for step, batch in enumerate(eval_dataloader):
            batch.to(accelerator.device)
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == references).sum().item()
            total += len(references)
        accelerator.print(f"epoch {epoch}:", {"accuracy": correct / total})


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None,
                        choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    args = parser.parse_args()
    config = {"lr": 5e-4, "num_epochs": 2, "seed": 42, "batch_size": 8}
    training_function(config, args)


if __name__ == "__main__":
    main()
