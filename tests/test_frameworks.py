"""nt.watch around the frameworks' own loops (the [frameworks] extra; a missing one skips):
named as the framework, counted as it counts, its lr and loss as it logs them, its whole
model, its own knobs in the advice, and Stop at a step boundary. tests/corpus runs their
public examples three ways; these check what those cannot say: the framework's own
figures beside the Run's."""
from __future__ import annotations

import importlib
import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import nbtrain as nt

sys.path.insert(0, str(Path(__file__).parent / "corpus"))
from torchvision_ops import declare_missing_ops  # noqa: E402

declare_missing_ops()   # transformers and Lightning import torchvision's Python parts
QUIET = dict(progress=False)


def needs(name: str):
    return pytest.importorskip(name, reason=f"needs {name} (pip install -c .ci/constraints.txt "
                                            "-e '.[frameworks]')")


# -- Hugging Face Trainer -------------------------------------------------------------------
def hf_trainer(tmp_path, accumulate=1, callbacks=()):
    transformers = needs("transformers")
    needs("accelerate")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=32)
    model = transformers.BertForSequenceClassification(config)
    ids = torch.randint(5, 100, (96, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids[i], "attention_mask": torch.ones(16, dtype=torch.long),
             "labels": int(ids[i, 1] % 2)} for i in range(96)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=2,
        gradient_accumulation_steps=accumulate, report_to="none", save_strategy="no",
        use_cpu=True, logging_steps=1, disable_tqdm=True, learning_rate=1e-3)
    return transformers.Trainer(model=model, args=args, train_dataset=data,
                                callbacks=list(callbacks))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_hugging_face_trainer_counted_and_logged_as_it_logs(tmp_path, accumulate):
    trainer = hf_trainer(tmp_path, accumulate)
    with nt.watch(optimize=False, log_every=1, **QUIET) as run:
        trainer.train()
    steps = 2 * 12 // accumulate
    assert run.resolved["loop"][0] == "Hugging Face Trainer"
    assert run.step == trainer.state.global_step == steps
    records = run.records("train")
    assert [r["samples"] for r in records] == [8 * accumulate] * steps   # Accelerate reads ahead
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [r["lr"] for r in records] == pytest.approx([h["learning_rate"] for h in logged])
    assert [r["loss"] for r in records] == pytest.approx([h["loss"] for h in logged], rel=1e-4)
    assert run.model is trainer.model
    text = run.summary_text()
    assert "loop you wrote" not in text
    assert "Hugging Face Trainer's code" in text and "your code" not in text   # between steps
    assert ("step_loss" in run.resolved) == (accumulate > 1)   # said where it is a sum


def test_hugging_face_trainer_advice_and_amp_name_its_arguments(tmp_path):
    trainer = hf_trainer(tmp_path)
    with nt.watch(**QUIET) as run:   # the defaults: amp is the Trainer's own argument
        trainer.train()
    assert run.resolved["amp"] == ("off", "Hugging Face Trainer decides it: "
                                          "TrainingArguments(bf16=True)")
    diagnosis = run.summary()["diagnosis"]
    assert "TrainingArguments(" in diagnosis and "in your DataLoader" not in diagnosis
    assert "nt.watch(amp=" not in diagnosis


def test_stop_ends_the_trainers_loop_at_a_step_boundary(tmp_path):
    transformers = needs("transformers")
    runs = []

    class StopAtFive(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                runs[0].stop()

    trainer = hf_trainer(tmp_path, callbacks=[StopAtFive()])
    with nt.watch(optimize=False, **QUIET) as run:
        runs.append(run)
        trainer.train()
    assert run.state == "stopped" and run.step == trainer.state.global_step == 5


# -- Lightning --------------------------------------------------------------------------------
def lightning_run(accumulate=2, stop_at=None):
    L = needs("pytorch_lightning")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    lrs, runs = [], []

    class AutoEncoder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3))
            self.decoder = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 64))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            lrs.append(self.optimizers().param_groups[0]["lr"])   # what this step runs with
            return nn.functional.mse_loss(self.decoder(self.encoder(x)), x)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if stop_at is not None and self.trainer.global_step == stop_at:
                runs[0].stop()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=64)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(0)
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=16)
    model = AutoEncoder()
    trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=accumulate, accelerator="cpu",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nt.watch(log_every=1, **QUIET) as run:
            runs.append(run)
            trainer.fit(model, loader)
    return run, model, trainer, lrs


def test_lightning_with_accumulation_counts_every_micro_batch_and_holds_the_whole_model():
    run, model, trainer, lrs = lightning_run(accumulate=2)
    assert run.resolved["loop"][0] == "Lightning"
    assert run.step == trainer.global_step == 32
    assert run.summary()["samples"] == 2 * 512   # the closure's micro-batch counted too
    assert run.model is model   # the LightningModule, not the encoder it calls first
    assert run.resolved["amp"][1].startswith(
        'Lightning decides it: Trainer(precision="bf16-mixed")')
    # the lr the last step ran with, not the one its scheduler set after it
    assert run.records("train")[-1]["lr"] == pytest.approx(lrs[-1])


def test_lightnings_flops_are_the_whole_training_steps():
    """The FLOP count covers the whole step Lightning runs (the encoder and the decoder the
    LightningModule calls), as torch's FlopCounterMode counts it."""
    L = needs("pytorch_lightning")
    importlib.import_module("torch.utils.flop_counter")   # as after a process's first count
    from torch.utils.flop_counter import FlopCounterMode

    class AutoEncoder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
            self.decoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 64))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return nn.functional.mse_loss(self.decoder(self.encoder(x)), x)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    model = AutoEncoder()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(400 * 64, 64)),
                                         batch_size=64)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nt.watch(optimize=False, **QUIET) as run:
            trainer.fit(model, loader)
    x = torch.randn(64, 64)
    with FlopCounterMode(display=False) as counter:
        model.training_step((x,), 0).backward()
    assert run.resolved["flops_per_step"][0] == counter.get_total_flops() > 0


def test_stop_ends_lightnings_loop_at_a_step_boundary():
    run, model, trainer, _ = lightning_run(accumulate=1, stop_at=7)
    assert run.state == "stopped" and run.step == trainer.global_step == 7


# -- fastai, skorch -------------------------------------------------------------------------
def fastai_learner():
    """A tabular learner on 640 rows made here (512 to train on, in batches of 64)."""
    needs("fastai")
    pd = needs("pandas")
    from fastai.tabular.all import Categorify, Normalize, TabularDataLoaders, tabular_learner
    gen = torch.Generator().manual_seed(0)
    n = 640
    b = torch.randn(n, generator=gen).numpy()
    df = pd.DataFrame({"a": ["x", "y", "z", "w"] * (n // 4), "b": b,
                       "c": torch.randn(n, generator=gen).numpy()})
    df["y"] = ["hi" if v > 0 else "lo" for v in b]
    dls = TabularDataLoaders.from_df(df, y_names="y", cat_names=["a"], cont_names=["b", "c"],
                                     procs=[Categorify, Normalize], bs=64,
                                     valid_idx=list(range(512, n)))
    return tabular_learner(dls, layers=[16])


def test_fastais_own_optimizer_gives_the_steps_and_the_lr():
    learn = fastai_learner()
    from fastai.data.load import DataLoader as FastaiLoader
    its_iter = FastaiLoader.__dict__["__iter__"]
    with nt.watch(optimize=False, log_every=4, **QUIET) as run:
        with learn.no_bar(), learn.no_logging():
            learn.fit_one_cycle(2)
    assert FastaiLoader.__dict__["__iter__"] is its_iter
    assert run.resolved["loop"][0] == "fastai"
    assert run.step == 16 and run.resolved["step"][0] == "an optimizer step"
    lrs = [r["lr"] for r in run.records("train")]
    assert all(isinstance(lr, float) and lr > 0 for lr in lrs)
    assert run.model is learn.model


def test_fastais_own_loader_is_timed_and_its_validation_is_evaluation():
    """fastai's DataLoader makes its batches without torch's DataLoader.__iter__: its
    data wait, its samples, and its validation pass are still seen."""
    learn = fastai_learner()
    with nt.watch(optimize=False, log_every=4, **QUIET) as run:
        with learn.no_bar(), learn.no_logging():
            learn.fit_one_cycle(2)
    summary = run.summary()
    assert summary["samples"] == 2 * 512 and summary["data_wait_frac"] > 0
    assert run.resolved["batched_fetch"] == (False, "fastai's own DataLoader: its batches "
                                             "as it makes them")
    assert run.resolved["num_workers"][0] == 0
    assert "evaluation" in run.summary_text()


def test_skorch_is_named_and_raises_no_false_alarm_of_kept_losses():
    skorch = needs("skorch")
    from sklearn.datasets import make_classification
    X, y = make_classification(400, 20, n_informative=10, random_state=0)

    class Module(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = nn.Sequential(nn.Linear(20, 10), nn.ReLU(), nn.Linear(10, 2))

        def forward(self, X):
            return self.dense(X)

    torch.manual_seed(0)
    net = skorch.NeuralNetClassifier(Module, max_epochs=3, lr=0.1, verbose=0,
                                     iterator_train__shuffle=True, train_split=None,
                                     criterion=nn.CrossEntropyLoss)
    with nt.watch(optimize=False, log_every=4, **QUIET) as run:
        net.fit(X.astype("float32"), y)
        net.predict(X.astype("float32"))   # a new loader, gradients on: no epoch of training
    assert run.resolved["loop"][0] == "skorch"
    assert run.step == 3 * 4 and run.summary()["samples"] == 3 * 400   # batch_size 128
    assert run.epoch == 2   # skorch's 3 epochs, each on a loader of its own (0, 1, 2)
    diagnosis = run.summary()["diagnosis"]
    assert "keeps each step's loss" not in diagnosis
    assert run.model is net.module_
    # skorch reads each batch's loss (net.py's record_batch): its code, not the user's
    assert run.host_reads().worst.where.endswith("skorch's own code")
    assert "it is not in your code" in diagnosis and "total +=" not in diagnosis


# -- %%fasttrain on the cell that calls the framework -------------------------------------
LIGHTNING_CELL = """
import pytorch_lightning as L
class Small(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
torch.manual_seed(0)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
    torch.randn(256, 8), torch.randint(0, 3, (256,))), batch_size=32)
model = Small()
trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, loader)
"""


def test_fasttrain_on_a_cell_that_calls_trainer_fit_watches_lightnings_loop(capsys):
    needs("pytorch_lightning")
    from IPython.core.interactiveshell import InteractiveShell
    from nbtrain.ui import magic
    ip = InteractiveShell.instance()
    ip.push({"torch": torch, "nn": nn})
    magic.load_ipython_extension(ip)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = ip.run_cell(f"%%fasttrain --log-every 4\n{LIGHTNING_CELL}")
        assert result.error_in_exec is None, result.error_in_exec
        run = ip.user_ns["run"]
        assert run.state == "finished" and run.step == ip.user_ns["trainer"].global_step == 16
        assert run.model is ip.user_ns["model"] and run.resolved["loop"][0] == "Lightning"
        assert "Lightning's loop, watched" in capsys.readouterr().out
    finally:
        magic.unload_ipython_extension(ip)
        for name in set(ip.user_ns) - set(ip.user_ns_hidden):
            if not name.startswith("__"):
                del ip.user_ns[name]


def test_timms_prefetch_loader_gives_each_step_its_own_batch():
    needs("timm")
    from timm.data.loader import PrefetchLoader   # reads the next batch before handing one over
    gen = torch.Generator().manual_seed(0)
    base = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randn(512, 3, 8, 8, generator=gen), torch.randint(0, 4, (512,), generator=gen)),
        batch_size=32)
    loader = PrefetchLoader(base, device=torch.device("cpu"), mean=(0.5,) * 3, std=(0.5,) * 3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 4))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with nt.watch(optimize=False, log_every=10, **QUIET) as run:
        for _ in range(2):
            for x, y in loader:
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    assert run.step == 32 and [r["samples"] for r in run.records("train")] == [320] * 3 + [64]
