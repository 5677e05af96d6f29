# Shape: Hugging Face transformers examples/pytorch/text-classification/
# run_glue_no_trainer.py, https://github.com/huggingface/transformers/blob/main/examples/pytorch/text-classification/run_glue_no_trainer.py
# (Apache-2.0, The HuggingFace Inc. team; read 2025). Written anew in that script's
# shape, not copied: this project keeps third-party code out of its commits. Kept from
# it: main() with argparse, a model for sequence classification built from its config,
# batches as dicts through default_data_collator, AdamW over two parameter groups (no
# decay for bias and LayerNorm.weight), get_scheduler("linear") stepped every optimizer
# step, gradient accumulation (loss / gradient_accumulation_steps, a step every N
# batches or at the loader's end), `outputs = model(**batch); loss = outputs.loss`,
# completed_steps counted and a stop at max_train_steps, evaluation under model.eval()
# and torch.no_grad() with argmax predictions.
# Changed: no Accelerator (plain loops on the CPU: accelerator.backward(loss) is
# loss.backward()), no download: a tiny BertConfig (2 layers, hidden 32) and random token
# ids (seeded) instead of GLUE and a tokenizer, 2 epochs of 8 batches of 8.
import argparse
import math

import torch
from torch.utils.data import DataLoader
from transformers import (BertConfig, BertForSequenceClassification, default_data_collator,
                          get_scheduler)


def synthetic_glue(n, seq_len, vocab, seed):
    """Stand-in for the tokenized GLUE split: input_ids, attention_mask, labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (n, seq_len), generator=gen)
    labels = (ids[:, 1] % 2).tolist()   # learnable from one token
    return [{"input_ids": ids[i], "attention_mask": torch.ones(seq_len, dtype=torch.long),
             "labels": labels[i]} for i in range(n)]


def main():
    parser = argparse.ArgumentParser(description="Finetune a transformers model on a text classification task")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--lr_scheduler_type", default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(config)
    train_dataset, eval_dataset = synthetic_glue(64, 16, 128, 0), synthetic_glue(32, 16, 128, 1)
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator,
                                 batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=args.max_train_steps)

    completed_steps = 0
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss / args.gradient_accumulation_steps
            loss.backward()
            if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        correct = total = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            correct += (predictions == batch["labels"]).sum().item()
            total += len(predictions)
        print(f"epoch {epoch}: accuracy {correct / total:.3f}")


if __name__ == "__main__":
    main()
