# Shape: the Hugging Face LLM course, chapter 3 "Fine-tuning a model with the Trainer API",
# https://huggingface.co/learn/llm-course/chapter3/3 (Apache-2.0, The HuggingFace Inc. team,
# huggingface/course; read 2025). Written anew in that chapter's shape, not copied: this
# project keeps third-party code out of its commits. Kept from it: notebook cells at module
# level; a tokenize_function of sentence pairs with truncation=True mapped over the
# splits; DataCollatorWithPadding(tokenizer) padding each batch; TrainingArguments(output
# dir); a model for sequence classification with num_labels=2;
# Trainer(model, training_args, train_dataset=, eval_dataset=, data_collator=,
# processing_class=tokenizer) then trainer.train(); trainer.predict() on the validation
# split with argmax predictions.
# Changed: no download: a BertTokenizer over a vocab.txt of 40 words written in the
# output dir, and a tiny BertConfig (2 layers, hidden 32) in place of bert-base-uncased;
# MRPC's pairs made in code (seeded; the label: do the two sentences start with the same
# word); a plain list of examples in place of a datasets.Dataset (no `datasets`); the
# arguments set for a short CPU run: 2 epochs of 64 pairs in batches of 8, use_cpu,
# report_to="none", save_strategy="no", logging_steps=2, disable_tqdm; argparse for the output dir
# and --gradient_accumulation_steps (1 or 2).
import argparse
import os
import random

import numpy as np
from transformers import (BertConfig, BertForSequenceClassification, BertTokenizer,
                          DataCollatorWithPadding, Trainer, TrainingArguments)

parser = argparse.ArgumentParser()
parser.add_argument("--output_dir", default="test-trainer")
parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
args = parser.parse_args()

WORDS = ["the", "a", "company", "said", "shares", "rose", "fell", "on", "monday", "tuesday",
         "percent", "market", "bank", "stock", "price", "year", "quarter", "profit", "loss",
         "sales", "report", "new", "deal", "billion", "million", "court", "judge", "city",
         "police", "state", "officials", "group", "plan", "week", "analysts", "expected",
         "cents", "up", "down", "late"]
os.makedirs(args.output_dir, exist_ok=True)
vocab_file = os.path.join(args.output_dir, "vocab.txt")
with open(vocab_file, "w") as f:
    f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
tokenizer = BertTokenizer(vocab_file)


def make_pairs(n, seed):
    """Stand-in for a split of GLUE MRPC: sentence1, sentence2, label."""
    rng = random.Random(seed)
    rows = []
    for idx in range(n):
        s1 = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
        s2 = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
        label = rng.randint(0, 1)
        if label:
            s2[0] = s1[0]
        elif s2[0] == s1[0]:
            label = 1
        rows.append({"sentence1": " ".join(s1), "sentence2": " ".join(s2), "label": label, "idx": idx})
    return rows


raw_datasets = {"train": make_pairs(64, 0), "validation": make_pairs(32, 1)}


def tokenize_function(example):
    return tokenizer(example["sentence1"], example["sentence2"], truncation=True)


tokenized_datasets = {split: [{**tokenize_function(example), "label": example["label"]}
                              for example in rows] for split, rows in raw_datasets.items()}
data_collator = DataCollatorWithPadding(tokenizer=tokenizer)

training_args = TrainingArguments(
    args.output_dir, num_train_epochs=2, per_device_train_batch_size=8,
    gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=5e-4,
    logging_steps=2, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
)

config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                    num_labels=2)
model = BertForSequenceClassification(config)

trainer = Trainer(
    model,
    training_args,
    train_dataset=tokenized_datasets["train"],
    eval_dataset=tokenized_datasets["validation"],
    data_collator=data_collator,
    processing_class=tokenizer,
)
trainer.train()

predictions = trainer.predict(tokenized_datasets["validation"])
preds = np.argmax(predictions.predictions, axis=-1)
print("accuracy", (preds == predictions.label_ids).mean())
