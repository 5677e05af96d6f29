"""Hugging Face-style models and batches: a mapping batch is called as model(**batch).

The transformers models are built from small configs and the tokenizer from a word list
here, so nothing is downloaded; the tests that need transformers skip without it.
"""
import inspect
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import nbtrain as nt
from nbtrain.data import describe_bad_sample, make_mover
from nbtrain.data.nested import batch_len, tensors
from nbtrain.auto.losses import outputs_and_loss

from conftest import quick


# -- mapping batches, without transformers ------------------------------------------------
class Keyworded(nn.Module):
    """A model called as model(x=..., labels=...), returning a dict with its loss."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class WholeBatch(nn.Module):
    """A model whose forward takes the batch whole, as nbtrain called every model before."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, batch):
        return nn.functional.cross_entropy(self.linear(batch["x"]), batch["labels"])


class DictSamples(Dataset):
    def __init__(self, n=96):
        gen = torch.Generator().manual_seed(0)
        self.y = torch.randint(0, 3, (n,), generator=gen)
        self.x = torch.randn(n, 8, generator=gen) + 3 * nn.functional.one_hot(self.y, 8)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def test_a_mapping_batch_is_passed_as_keywords():
    model = Keyworded()
    batch = {"x": torch.randn(4, 8), "labels": torch.tensor([0, 1, 2, 0])}
    out, loss = outputs_and_loss(model, None, batch)
    assert loss is out["loss"] and out["logits"].shape == (4, 3)


def test_a_forward_with_one_batch_argument_keeps_getting_the_batch_whole():
    batch = {"x": torch.randn(4, 8), "labels": torch.tensor([0, 1, 2, 0])}
    _, loss = outputs_and_loss(WholeBatch(), None, batch)
    assert loss.dim() == 0


def test_a_wrong_call_names_the_signature_and_the_keys():
    batch = {"inputs": torch.randn(4, 8), "labels": torch.tensor([0, 1, 2, 0])}
    with pytest.raises(TypeError) as info:
        outputs_and_loss(Keyworded(), None, batch)
    text = str(info.value)
    assert "model(**batch)" in text and str(inspect.signature(Keyworded().forward)) in text
    assert "(inputs, labels)" in text and "takes no inputs" in text


def test_a_model_that_returns_no_loss_says_to_pass_labels():
    class NoLabels(Keyworded):
        def forward(self, x, labels=None):
            return {"loss": None, "logits": self.linear(x)}
    with pytest.raises(ValueError, match="labels"):
        outputs_and_loss(NoLabels(), None, {"x": torch.randn(2, 8)})


def test_a_mapping_that_is_not_a_dict_is_a_batch_everywhere():
    from conftest import Encoding
    batch = Encoding(input_ids=torch.zeros(5, 7, dtype=torch.long), mask=torch.ones(5, 7))
    assert batch_len(batch) == 5   # samples, not the 2 keys
    assert len(tensors(batch)) == 2
    moved = make_mover(torch.device("meta"), False, False, False)(batch)
    assert {k: v.device.type for k, v in moved.items()} == {"input_ids": "meta", "mask": "meta"}


def test_an_object_with_to_moves_itself():
    class Graph:
        def __init__(self, device="cpu"):
            self.device = device

        def to(self, device):
            return Graph(device)

    moved = make_mover(torch.device("meta"), False, False, False)({"g": Graph(), "name": "a"})
    assert moved["g"].device == torch.device("meta") and moved["name"] == "a"


def test_the_bad_sample_report_reads_mapping_samples():
    class OneLonger(DictSamples):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            return {**item, "x": torch.zeros(9)} if i == 2 else item
    text = describe_bad_sample(OneLonger(), [0, 1, 2, 3])
    assert text.startswith("sample 2 has") and "(9,)" in text and "(8,)" in text


def test_fit_with_dict_samples_counts_samples_and_scores_labels():
    run = nt.fit(Keyworded(), DictSamples(), None, progress=False, val_data=DictSamples(40),
                 config=quick(epochs=3, num_workers=0, grad_accum_steps=2, lr=0.1))
    assert run.state == "finished"
    train = run.records("train")
    assert sum(r["samples"] for r in train) == 3 * 96   # samples, not 2 keys per batch
    val = run.records("val")[-1]
    assert val["val_acc"] > 0.8   # from the output's logits and the batch's labels


# -- transformers models, built from configs ----------------------------------------------
WORDS = ["[PAD]", "[UNK]"] + [f"w{i}" for i in range(40)] + ["good", "bad"]


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer(hf):
    """A word-level tokenizer made here: no download."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return hf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


class Reviews(Dataset):
    """Sentences of 4 to 12 words; the label says whether "good" or "bad" is among them.

    Samples are a tokenizer's dicts of unequal length: a padding collator batches them.
    """

    def __init__(self, tokenizer, n, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            words = [f"w{j}" for j in torch.randint(0, 40, (int(torch.randint(3, 12, (1,),
                                                                       generator=gen)),),
                                                    generator=gen)]
            words.insert(int(torch.randint(0, len(words), (1,), generator=gen)),
                         "good" if i % 2 else "bad")
            self.items.append({**tokenizer(" ".join(words)), "labels": i % 2})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def bert(hf):
    torch.manual_seed(0)
    config = hf.BertConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=37, pad_token_id=0)
    return hf.BertForSequenceClassification(config)


def padded_loaders(hf, tokenizer):
    collate = hf.DataCollatorWithPadding(tokenizer)
    train = DataLoader(Reviews(tokenizer, 120), batch_size=16, shuffle=True, collate_fn=collate)
    val = DataLoader(Reviews(tokenizer, 50, seed=1), batch_size=16, collate_fn=collate)
    return train, val


def test_the_padding_collator_returns_a_mapping_that_is_not_a_dict(hf, tokenizer):
    train, _ = padded_loaders(hf, tokenizer)
    batch = next(iter(train))
    assert not isinstance(batch, dict) and batch_len(batch) == 16 and len(batch) == 3


def test_bert_trains_on_padded_dict_batches(hf, tokenizer):
    model = bert(hf)
    train, val = padded_loaders(hf, tokenizer)
    run = nt.fit(model, train, None, val_data=val, progress=False,
                 config=quick(epochs=2, grad_accum_steps=2, amp="bf16", lr=3e-3))
    assert run.state == "finished" and run.step == 2 * math.ceil(len(train) / 2)
    records = run.records("train")
    assert sum(r["samples"] for r in records) == 2 * 120   # samples, not the batch's 3 keys
    assert all(r["samples_per_s"] == pytest.approx(r["samples"] / r["interval_s"])
               for r in records if r.get("interval_s"))
    # validation weighs each batch by its samples (the last one has 2) and scores logits
    # against labels: the same numbers as a hand-written pass over the validation data
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [(model(**b), b["labels"]) for b in val]
    loss = sum(o.loss.float() * len(y) for o, y in outs) / 50
    acc = sum((o.logits.argmax(-1) == y).sum() for o, y in outs) / 50
    last = run.records("val")[-1]
    assert last["val_loss"] == pytest.approx(float(loss), rel=1e-3)
    assert last["val_acc"] == pytest.approx(float(acc))


def test_gpt2_trains_on_dict_samples_through_nbtrains_own_loader(hf):
    class Tokens(Dataset):   # fixed-length samples: nbtrain's loader collates them to a dict
        def __init__(self):
            self.ids = torch.randint(0, 50, (48, 10), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    model = hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=50, n_positions=16, n_embd=32,
                                             n_layer=1, n_head=2))
    run = nt.fit(model, Tokens(), None, val_data=Tokens(), progress=False,
                 config=quick(epochs=2, batch_size=8, num_workers=0, grad_accum_steps=2,
                              amp="bf16"))
    assert run.state == "finished"
    assert sum(r["samples"] for r in run.records("train")) == 2 * 48
    val = run.records("val")[-1]
    assert math.isfinite(val["val_loss"]) and "val_acc" not in val   # per-token logits: no acc


def test_fasttrain_trains_bert_on_padded_dict_batches(hf, tokenizer):
    from IPython.core.interactiveshell import InteractiveShell
    from nbtrain.ui import magic
    ip = InteractiveShell.instance()
    magic.load_ipython_extension(ip)
    train, val = padded_loaders(hf, tokenizer)
    ip.push({"make_model": lambda: bert(hf), "loaders": (train, val)})
    try:
        result = ip.run_cell("%%fasttrain --epochs 2 --accum 2 --amp bf16 --device cpu --lr 3e-3\n"
                             "model = make_model()\n"
                             "train_data, val_data = loaders\n")
        assert result.success, result.error_in_exec
        run = ip.user_ns["run"]
        assert run.state == "finished"
        assert sum(r["samples"] for r in run.records("train")) == 2 * 120
        assert "val_acc" in run.records("val")[-1]
    finally:
        magic.unload_ipython_extension(ip)
        for name in ("run", "model", "train_data", "val_data", "make_model", "loaders"):
            ip.user_ns.pop(name, None)


def test_the_bf16_probes_key_holds_a_mapping_samples_shapes():
    from nbtrain.data import make_batches
    from nbtrain.train.prepare import input_shapes
    resolved = {}
    batches = make_batches(DictSamples(), quick(num_workers=0), torch.device("cpu"), resolved)
    shapes, batch_size = input_shapes(batches)
    assert batch_size == 32
    assert dict(shapes) == {"x": ("tensor", (8,), torch.float32),
                            "labels": ("tensor", (), torch.int64)}
