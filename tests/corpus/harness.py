"""Run the corpus's training programs three ways and keep what the tests compare.

Each program in programs/ runs as its author would run it: a script as `__main__`
(runpy), a program with `main()` imported under its own name and main() called with its
argv (its locals kept at return, for the models they hold). Three ways:

- "as written": no nbtrain at all;
- "watched": inside `with nt.watch(optimize=False, progress=False) as run:`;
- "defaults": inside `with nt.watch(progress=False) as run:`.

Every way starts from the same seeds (torch, random, numpy), set before the watch is
entered: a watch that drew from an RNG would show in the weights. Around each run the
harness takes torch's surface (the functions of its classes and modules, the global hook
dicts) and, after it, the surface of each model and optimizer the program made, so a test
can ask whether anything was left patched or hooked.

Counts made by hand: each Program says how many steps and samples its sizes give (the
arithmetic in a comment); in the as-written run the harness counts the optimizer's
step() calls through torch's own global hook (removed at once), or, for a loop that
updates by hand, reads the program's own counter, so the arithmetic is checked too.

Frameworks (transformers' Trainer, accelerate, Lightning, fastai, skorch, timm): a program
names the modules it imports (`requires`; the tests skip it where one is missing) and
they are imported before its surface is taken; the models and optimizers a framework
holds are named by a path from the program's names ("trainer.optimizers.0",
"net.module_"); a file run two ways (its argv) is two entries (`script`); a main() that
trains in a function it calls keeps that function's locals (`frame`).
"""
from __future__ import annotations

import copy
import importlib
import importlib.util
import io
import math
import os
import pickle
import random
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch
from torch.optim import optimizer as optim_hooks   # torch.optim deletes its name 'optimizer'
from torch.utils.data import DataLoader

from torchvision_ops import declare_missing_ops   # tests/corpus/, on sys.path (conftest)

declare_missing_ops()   # before anything imports torchvision (transformers does too)

import nbtrain as nt   # noqa: E402  (after the ops above: nbtrain may import transformers)

PROGRAMS = Path(__file__).resolve().parent / "programs"
SEED = 1
WAYS = {
    "as written": None,
    "watched": dict(optimize=False, progress=False),
    "defaults": dict(progress=False),
}
TIMES: Dict[Tuple[str, str], float] = {}   # (program, way) -> seconds, for the summary


@dataclass(frozen=True)
class Program:
    """One program of the corpus and what its sizes give."""
    name: str
    shape: str                      # what loop shape it covers, for the report
    steps: int                      # optimizer steps (or hand updates) its sizes give
    samples: int                    # training samples its forward passes take
    models: Tuple[str, ...] = ("model",)        # names in its namespace
    optimizers: Tuple[str, ...] = ("optimizer",)
    argv: Tuple[str, ...] = ()      # "{dir}" is the run's own directory
    entry: str = "script"           # "script": runs as __main__; "main": main() called
    prepare: Optional[Callable[[Path], None]] = None   # writes its data stand-in
    hand_steps: Optional[Callable[[dict], int]] = None  # a loop without an optimizer
    optimizers_per_step: int = 1    # optimizers that step on each batch (one step of the Run)
    seen: Tuple[str, ...] = ("samples", "loss")   # what the loop shows a watch (see below)
    requires: Tuple[str, ...] = ()  # a framework's modules it imports (skipped without them)
    script: Optional[str] = None    # its file's stem where two entries run one file (argv)
    frame: str = "main"             # entry "main": the function whose locals are kept

    @property
    def path(self) -> Path:
        return PROGRAMS / f"{self.script or self.name}.py"

    def missing(self) -> Optional[str]:
        """The first package of `requires` that cannot be imported, or None."""
        for module in self.requires:
            if importlib.util.find_spec(module.split(".")[0]) is None:
                return module.split(".")[0]
        return None


@dataclass
class Result:
    program: Program
    way: str
    namespace: dict
    seconds: float
    run: Optional[object] = None    # the watch's Run
    torch_before: dict = field(default_factory=dict)
    torch_after: dict = field(default_factory=dict)
    step_calls: int = 0             # optimizer step() calls, as written only
    inside: dict = field(default_factory=dict)   # what was made inside the watch

    def models(self) -> Dict[str, torch.nn.Module]:
        return {name: lookup(self.namespace, name) for name in self.program.models}

    def optimizers(self) -> Dict[str, torch.optim.Optimizer]:
        return {name: lookup(self.namespace, name) for name in self.program.optimizers}

    def loaders(self) -> Dict[str, DataLoader]:
        return {name: v for name, v in self.namespace.items() if isinstance(v, DataLoader)}


def lookup(namespace: dict, name: str):
    """A name of a program's namespace, or a path from one into a framework's objects:
    "trainer.model" (an attribute), "trainer.optimizers.0" (an item of a list)."""
    first, *rest = name.split(".")
    found = namespace[first]
    for part in rest:
        found = found[int(part)] if part.isdigit() else getattr(found, part)
    return found


# -- the data stand-ins the harness writes ------------------------------------------------
def write_text_corpus(root: Path) -> None:
    """train/valid/test.txt of seeded random words (word_language_model's --data)."""
    words = [f"w{i}" for i in range(50)]
    rng = random.Random(0)
    for split, lines in (("train", 60), ("valid", 20), ("test", 20)):
        text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(lines))
        (root / "data").mkdir(exist_ok=True)
        (root / "data" / f"{split}.txt").write_text(text + "\n", encoding="utf8")


def write_token_bins(root: Path) -> None:
    """train.bin/val.bin of uint16 token ids < 64, as nanoGPT's prepare.py writes them."""
    gen = np.random.default_rng(0)
    (root / "data").mkdir(exist_ok=True)
    for split, n in (("train", 4000), ("val", 1000)):
        gen.integers(0, 64, n, dtype=np.uint16).tofile(root / "data" / f"{split}.bin")


def write_mnist(root: Path) -> None:
    """data/MNIST/raw's four idx files, as torchvision's MNIST reads them (its download
    skipped where they exist): 128 train and 64 test 28x28 digits-like images, each class a
    seeded blob pattern plus noise."""
    gen = np.random.default_rng(0)
    raw = root / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    patterns = gen.random((10, 28, 28)) > 0.7
    for split, n in (("train", 128), ("t10k", 64)):
        labels = gen.integers(0, 10, n).astype(np.uint8)
        images = (patterns[labels] * 180 + gen.integers(0, 75, (n, 28, 28))).astype(np.uint8)
        (raw / f"{split}-images-idx3-ubyte").write_bytes(
            np.array([0x803, n, 28, 28], ">i4").tobytes() + images.tobytes())
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(
            np.array([0x801, n], ">i4").tobytes() + labels.tobytes())


def write_sine_wave(root: Path) -> None:
    """traindata.pt as time_sequence_prediction/generate_sine_wave.py writes it (a float64
    numpy array of shifted sines, torch.save'd), with N=11 waves of L=50 for 100 x 1000."""
    rng = np.random.RandomState(2)
    T, L, N = 20, 50, 11
    x = np.empty((N, L), "int64")
    x[:] = np.array(range(L)) + rng.randint(-4 * T, 4 * T, N).reshape(N, 1)
    torch.save(np.sin(x / 1.0 / T).astype("float64"), root / "traindata.pt")


def write_cora(root: Path) -> None:
    """cora/cora.content and cora/cora.cites in the Cora files' layout (paper id, binary
    word features, class name; cited and citing ids): 400 papers, 64 words, 7 classes,
    1200 citations, mostly within a class."""
    gen = np.random.default_rng(0)
    classes = ["Case_Based", "Genetic_Algorithms", "Neural_Networks", "Probabilistic_Methods",
               "Reinforcement_Learning", "Rule_Learning", "Theory"]
    n, words = 400, 64
    ids = gen.choice(np.arange(1000, 1_000_000), n, replace=False)
    labels = gen.integers(0, len(classes), n)
    topic = gen.random((len(classes), words)) < 0.15
    feats = (gen.random((n, words)) < 0.03) | (topic[labels] & (gen.random((n, words)) < 0.5))
    (root / "cora").mkdir(exist_ok=True)
    (root / "cora" / "cora.content").write_text("".join(
        f"{ids[i]}\t" + "\t".join(str(int(v)) for v in feats[i]) + f"\t{classes[labels[i]]}\n"
        for i in range(n)))
    cites = []
    for _ in range(1200):
        a = gen.integers(n)
        same = np.flatnonzero(labels == labels[a]) if gen.random() < 0.8 else np.arange(n)
        cites.append(f"{ids[gen.choice(same)]}\t{ids[a]}\n")
    (root / "cora" / "cora.cites").write_text("".join(cites))


def write_image_folder(root: Path) -> None:
    """data/cubsub/{train,val}/<class>/*.png: an ImageFolder of 4 classes, 8 train and 4
    val images of 40x40 each, colored by class plus noise (the tutorial's bird subset)."""
    from PIL import Image
    gen = np.random.default_rng(0)
    for split, per_class in (("train", 8), ("val", 4)):
        for c in range(4):
            folder = root / "data" / "cubsub" / split / f"{c:03d}.class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                base = np.array([60 * c, 200 - 40 * c, 90 + 30 * c])
                pixels = np.clip(base + gen.normal(0, 40, (40, 40, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"img_{i}.png")


def write_translation_pairs(root: Path) -> None:
    """data/eng-fra.txt as the seq2seq tutorial reads it (English, a tab, French, a line a
    pair): 60 seeded pairs of short sentences, some not of the "i am"/"he is" forms the
    tutorial keeps, so its filter drops them."""
    rng = random.Random(0)
    subjects = [("I am", "je suis"), ("He is", "il est"), ("She is", "elle est"),
                ("You are", "vous etes"), ("We are", "nous sommes"), ("They are", "ils sont"),
                ("It was", "c etait")]
    words = [("tired", "fatigue"), ("happy", "heureux"), ("cold", "froid"), ("late", "en retard"),
             ("very tall", "tres grand"), ("at home", "a la maison"), ("not ready", "pas pret"),
             ("too small", "trop petit"), ("a teacher", "professeur"), ("busy today", "occupe aujourd hui")]
    lines = []
    for _ in range(60):
        (en_s, fr_s), (en_w, fr_w) = rng.choice(subjects), rng.choice(words)
        lines.append(f"{en_s} {en_w}.\t{fr_s} {fr_w}.")
    (root / "data").mkdir(exist_ok=True)
    (root / "data" / "eng-fra.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def lm_batches(ns: dict) -> int:
    """word_language_model's hand updates: one per bptt window, each epoch."""
    return math.ceil((ns["train_data"].size(0) - 1) / ns["args"].bptt) * ns["args"].epochs


def fastai_steps(ns: dict) -> int:
    """fastai's own Optimizer (no torch one, so no step hook): the steps its Adam state
    counts (step_stat), one count per parameter, all alike. (Learner.train_iter would be
    the training batches, but show_results' get_preds resets it with a before_fit.)"""
    counts = {int(state["step"]) for state in ns["learn"].opt.state.values() if "step" in state}
    assert len(counts) == 1, counts
    return counts.pop()


CORPUS = [
    Program("mnist_cnn", "main(); train()/test() functions; Adadelta; StepLR per epoch; "
            "eval under no_grad; per-sample Dataset with transforms",
            steps=2 * 320 // 32, samples=2 * 320, entry="main"),
    Program("regression_poly", "module-level; no optimizer (update by hand under no_grad); "
            "count() loop ending on its own criterion; .item() every step",
            steps=20, samples=20 * 32, models=("fc",), optimizers=(),
            hand_steps=lambda ns: ns["batch_idx"]),   # 20 batches at SEED (checked as written)
    Program("vae", "module-level globals; RNG drawn in forward (randn_like); Adam; shuffled "
            "test loader under no_grad; save_image",
            steps=2 * 512 // 64, samples=2 * 512, argv=("--outf", "{dir}/results")),
    Program("dcgan", "two models, two Adam optimizers; D: two backward then step, G: backward "
            "then step; BatchNorm; noise from the global RNG; per-epoch state_dict saves",
            # a step is a training batch (issue 38): D's step and G's after it are one
            steps=2 * 256 // 32, samples=2 * 256, models=("netG", "netD"),
            optimizers=("optimizerD", "optimizerG"), argv=("--outf", "{dir}", "--manualSeed", "999"),
            hand_steps=lambda ns: ns["opt"].niter * len(ns["dataloader"])),
    Program("quickstart", "tutorial train()/test() functions; SGD; step before zero_grad; "
            "unshuffled loader",
            steps=2 * 640 // 64, samples=2 * 640),
    Program("imagenet_train", "main(); torchvision resnet18; SGD momentum + weight decay; "
            "top-k accuracy .item() every batch; non_blocking copies; checkpoint dict each epoch",
            steps=2 * 96 // 16, samples=2 * 96, entry="main"),
    Program("word_language_model", "no DataLoader (bptt windows of one tensor, seq-first); "
            "LSTM hidden carried and detached; clip_grad_norm_; update by hand; LR annealed; "
            "torch.save(model) of the whole module; try/except KeyboardInterrupt",
            steps=2 * 10, samples=2 * 10 * 8, optimizers=(), argv=("--data", "{dir}/data"),
            prepare=write_text_corpus, hand_steps=lm_batches),   # 780 tokens / 8 = 97 rows: 10 windows
    Program("nanogpt_train", "config globals; memmap batches; while True ending on its own "
            "criterion; LR set by hand per iteration; grad accumulation x2; GradScaler "
            "(disabled); clip_grad_norm_ after unscale_; estimate_loss under no_grad",
            steps=24 + 1, samples=(24 + 1) * 2 * 4,   # iterations 0..24, 2 micro-batches of 4
            argv=("--data_dir={dir}/data", "--out_dir={dir}/out"), prepare=write_token_bins),
    Program("hf_no_trainer", "main(); transformers BertForSequenceClassification from a "
            "config; dict batches, model(**batch).loss; AdamW groups; linear schedule per "
            "step; grad accumulation; max_train_steps break; eval under no_grad",
            # 8 batches an epoch, a step at batches 0,2,4,6,7: 5, then 3 more (batches 0-4)
            steps=8, samples=(8 + 5) * 8, entry="main"),
    Program("distillation", "two models: teacher trained, then called under no_grad in eval "
            "mode while the student trains; optimizers local to functions",
            steps=2 * 2 * 192 // 32, samples=2 * 2 * 192, models=("nn_deep", "new_nn_light"),
            optimizers=()),
    Program("ema", "copy.deepcopy(model) EMA updated every step under no_grad; OneCycleLR per "
            "batch; eval under inference_mode; TensorDataset loader",
            steps=3 * 640 // 64, samples=3 * 640, models=("model", "model_ema")),
    Program("checkpointing", "torch.utils.checkpoint per block and checkpoint_sequential "
            "(forward recomputed in backward, dropout RNG kept); SGD Nesterov; MultiStepLR; "
            "TensorDataset loader with a seeded generator",
            steps=2 * 448 // 32, samples=2 * 448),
    Program("compiled", "torch.compile(model) (inductor on the CPU); batches made in the loop, "
            "no DataLoader; opt.zero_grad(True)",
            steps=24, samples=24 * 16, optimizers=("opt",)),
    Program("time_sequence_prediction", "closure optimizer: LBFGS optimizer.step(closure), the "
            "closure calling zero_grad, forward, .item() and backward, several evaluations a "
            "step; float64 LSTMCells unrolled by hand; full batch, no DataLoader",
            # 2 steps of the whole training set, 8 waves (11 less 3 test); the closure's
            # several evaluations of those 8 in a step are one step's samples, counted once
            steps=2, samples=2 * 8, models=("seq",), prepare=write_sine_wave),
    Program("forward_forward", "layer-wise training: each Layer its own Adam, trained its "
            "epochs after the one before on one batch fetched once; Layer.forward called "
            "directly (no __call__); Net.train(x_pos, x_neg) overrides Module.train",
            # 2 layers x 25 epochs; each step trains on the 128 images of the one batch
            # (forwarded as their positive and their negative overlay)
            steps=2 * 25, samples=2 * 25 * 128, models=("layer1", "layer2"),
            optimizers=("opt1", "opt2"), prepare=write_mnist),
    Program("maml_sine", "meta-learning: inner updates from torch.autograd.grad("
            "create_graph=True), second-order outer backward, Adam over a plain list of "
            "tensors (no nn.Module); numpy-drawn tasks, no DataLoader",
            # 100 iterations; each forwards 4 tasks x (20 support + 20 query) points; the
            # watch sees none of them: no nn.Module is called and no DataLoader iterated
            steps=100, samples=100 * 4 * (20 + 20), models=(), optimizers=("opt",),
            seen=("loss",)),
    Program("reinforce", "policy gradient, no DataLoader: a forward of batch 1 per "
            "environment step, log-probs kept, one backward and step per episode; "
            "count(1) ending on the running reward; CartPole stand-in",
            # at the seeds (543, the harness's) 44 episodes (checked as written) of 1531
            # environment steps in all, one state forwarded each (counted by a forward hook
            # on the program as written, no watch)
            steps=44, samples=1531, models=("policy",)),
    Program("gcn", "full-batch graph training: one step an epoch on every node, sparse "
            "features and adjacency (torch.spmm), loss on the train nodes' rows; eval of "
            "two masks under no_grad every epoch",
            # 100 epochs of one full-batch step; each forward takes all 400 nodes
            steps=100, samples=100 * 400, models=("gcn",), prepare=write_cora),
    Program("mingpt_adder", "endless sampler: RandomSampler(replacement=True, "
            "num_samples=1e10), next(data_iter) remade on StopIteration, max_iters stop; "
            "Trainer class; callback evaluating with generate() under no_grad",
            # max_iters 40, batch 64
            steps=40, samples=40 * 64, optimizers=(),
            argv=("--trainer.max_iters=40", "--trainer.num_workers=0", "--data.ndigit=1")),
    Program("dp_cifar10", "torch.func: vmap(grad_and_value(functional_call)) per-sample "
            "gradients on detached weights, no backward(); param.grad assigned by hand "
            "(clipped, noised), then SGD step; tqdm-wrapped loader; cosine LR by hand",
            # 2 epochs of 256 / 16 batches; the loss stays inside torch.func's transforms,
            # where no backward() shows it to the watch
            steps=2 * 256 // 16, samples=2 * 256, entry="main", seen=("samples",)),
    Program("cifar10_tutorial", "notebook cells at module level; loaders with num_workers=2 "
            "of their own, batch 4; a first batch taken from the train loader before "
            "training; SGD momentum; a test forward with gradients on after training",
            # 2 epochs of 192 / 4 batches
            steps=2 * 192 // 4, samples=2 * 192, models=("net",)),
    Program("siamese_network", "two inputs per forward (pairs through one trunk), a "
            "Dataset drawing from Python's random; resnet18 trunk; Adadelta; StepLR",
            # 2 epochs of 128 / 32 pair batches
            steps=2 * 128 // 32, samples=2 * 128, entry="main", prepare=write_mnist),
    Program("hopenet", "torch.autograd.backward(loss_seq, grad_seq) of three losses in place "
            "of loss.backward(); Adam of 3 groups (one at lr 0) from generators; per-sample "
            "PIL Dataset with num_workers=2",
            # 2 epochs of 48 / 16 batches
            steps=2 * 48 // 16, samples=2 * 48),
    Program("transfer_learning", "two models one after the other: a frozen ResNet with a new "
            "fc (requires_grad=False, optimizer on fc only), then a full fine-tune with two "
            "param groups; train/val phases under set_grad_enabled; best state_dict "
            "deep-copied and loaded back",
            # 2 scenarios x 2 epochs x 32 / 8 batches
            steps=2 * 2 * 32 // 8, samples=2 * 2 * 32, models=("model_conv", "model_ft"),
            optimizers=("optimizer_conv", "optimizer_ft"), prepare=write_image_folder),
    Program("seq2seq_translation", "two models, two optimizers made inside a function, both "
            "stepping on one backward; an RNN encoder called once per word (batch 1), a "
            "decoder once per output word; teacher forcing drawn per pair; no DataLoader",
            # 60 iterations, one sentence pair each (its words are its sequence, not samples)
            # (encoder's and decoder's step() each iteration: 120 calls, 2 a step)
            steps=60, samples=60, models=("encoder1", "attn_decoder1"), optimizers=(),
            optimizers_per_step=2, prepare=write_translation_pairs),
    # -- frameworks that own the loop (the [frameworks] extra; skipped without them): the
    # models and optimizers they hold are named by a path from the program's names
    Program("hf_trainer", "transformers Trainer (the course's chapter): TrainingArguments, "
            "Trainer(model, args, train_dataset=, data_collator=DataCollatorWithPadding, "
            "processing_class=) then train(); AdamW and linear decay made by the Trainer, "
            "stepped through accelerate's wrappers; list-of-dicts dataset; predict() after",
            # 2 epochs of 64 / 8 batches
            steps=2 * 64 // 8, samples=2 * 64, optimizers=("trainer.optimizer",),
            argv=("--output_dir", "{dir}/test-trainer"), requires=("transformers", "accelerate")),
    Program("hf_trainer_accumulation", "hf_trainer with gradient_accumulation_steps=2: "
            "the Trainer's own accumulation, a step every 2 batches (the model takes "
            "**kwargs, so the Trainer leaves each micro-batch's loss unscaled and logs their sum)",
            # 2 epochs of 64 / 8 batches, a step every 2
            steps=2 * 64 // 8 // 2, samples=2 * 64, optimizers=("trainer.optimizer",),
            argv=("--output_dir", "{dir}/test-trainer", "--gradient_accumulation_steps", "2"),
            requires=("transformers", "accelerate"), script="hf_trainer"),
    Program("accelerate_nlp", "accelerate's nlp_example: Accelerator().prepare(model, "
            "optimizer, loaders, scheduler) (AcceleratedOptimizer, DataLoaderShard, "
            "AcceleratedScheduler); accelerator.backward(loss); tokenizer.pad collate; "
            "main() calling training_function(), whose locals are kept",
            # 2 epochs of 64 / 8 batches, a step each
            steps=2 * 64 // 8, samples=2 * 64, entry="main", frame="training_function",
            argv=("--cpu",), requires=("accelerate", "transformers")),
    Program("accelerate_nlp_accumulation", "accelerate's by_feature/gradient_accumulation: "
            "Accelerator(gradient_accumulation_steps=2), `with accelerator.accumulate(model):`, "
            "optimizer.step()/zero_grad()/scheduler.step() called every batch, the wrappers "
            "skipping the steps between (no_sync)",
            # 2 epochs of 64 / 8 batches; the inner AdamW steps on every 2nd
            steps=2 * 64 // 8 // 2, samples=2 * 64, entry="main", frame="training_function",
            argv=("--cpu", "--gradient_accumulation_steps", "2"),
            requires=("accelerate", "transformers"), script="accelerate_nlp"),
    Program("lightning_autoencoder", "Lightning in 15 minutes: LitAutoEncoder(encoder, "
            "decoder) LightningModule; Adam from configure_optimizers; the loop Lightning's, "
            "forward and backward inside optimizer.step(closure); batch size 1; "
            "limit_train_batches",
            # limit_train_batches=100 of 256 samples in batches of 1, max_epochs=1
            steps=100, samples=100, models=("autoencoder",), optimizers=("trainer.optimizers.0",),
            requires=("pytorch_lightning",)),
    Program("lightning_onecycle_accum", "LightningModule: SGD + OneCycleLR with "
            "{'interval': 'step'} from configure_optimizers (total_steps from "
            "estimated_stepping_batches); accumulate_grad_batches=2 (the first micro-batch's "
            "backward outside the optimizer's step, the second inside its closure)",
            # 2 epochs of 256 / 16 batches, a step every 2
            steps=2 * 256 // 16 // 2, samples=2 * 256, optimizers=("trainer.optimizers.0",),
            requires=("pytorch_lightning",)),
    Program("fastai_tabular", "fastai tabular tutorial: TabularDataLoaders.from_df (its own "
            "TfmdDL, not a torch DataLoader; drop_last), tabular_learner, fit_one_cycle; "
            "fastai's own Optimizer (no torch optimizer: updates through p.data); "
            "validation each epoch; show_results",
            # 2 epochs of 512 / 64 batches (the last 128 rows are the valid set); fastai's
            # Optimizer is no torch one: the steps are the ones its Adam state counts
            steps=2 * 512 // 64, samples=2 * 512, models=("learn.model",), optimizers=(),
            hand_steps=fastai_steps, requires=("fastai.tabular.all",)),
    Program("skorch_readme", "skorch README: NeuralNetClassifier(MyModule, max_epochs=10, "
            "lr=0.1, iterator_train__shuffle=True).fit(X, y); SGD and the NLL of the "
            "softmax made by skorch; a stratified 20% valid split each epoch",
            # 1000 points, 800 trained (ValidSplit(5)); 10 epochs of ceil(800 / 128) = 7 batches
            steps=10 * 7, samples=10 * 800, models=("net.module_",),
            optimizers=("net.optimizer_",), requires=("skorch", "sklearn")),
    Program("timm_train", "timm train.py: main(); timm.create_model (test_vit from its "
            "config), create_optimizer_v2 (AdamW, no decay on bias/norm groups), "
            "create_scheduler_v2 cosine with warm-up (step_update per update, step per "
            "epoch); its own torch.autocast bf16; ModelEmaV3 updated each step; "
            "LabelSmoothingCrossEntropy; validate() of model and EMA under no_grad",
            # 2 epochs of 128 / 16 batches (drop_last)
            steps=2 * 128 // 16, samples=2 * 128, models=("model", "model_ema"), entry="main",
            requires=("timm",)),
]
BY_NAME = {program.name: program for program in CORPUS}


# -- running one program -------------------------------------------------------------------
def seed_all(seed: int = SEED) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def import_frameworks(programs) -> None:
    """Import the installed frameworks of `programs` (those a session runs), before its
    first run: some patch torch at import (lightning_fabric wraps torch.compile, which then
    sets `_compile_kwargs` on each compiled module; fastcore adds Tensor methods), so a
    program run before that import and again after it would differ by the import, not by
    the watch. Every program, every way, then runs in the one world they leave."""
    for program in programs:
        if program.missing() is None:
            for module in program.requires:
                importlib.import_module(module)


def run_program(program: Program, way: str, inside: Optional[Callable[[dict], dict]] = None,
                checked: bool = True) -> Result:
    """Run `program` one way in a directory of its own; `inside(namespace)` runs before
    the watch ends (the program's objects still watched) and its dict is kept. `checked`:
    what the tests check is gathered (main()'s locals, kept by a trace function; the steps
    as written, counted by a global optimizer hook); a benchmark passes False to time the
    program as its user runs it, where every Python call would otherwise pay the trace."""
    workdir = Path(tempfile.mkdtemp(prefix=f"corpus-{program.name}-"))
    if program.prepare is not None:
        program.prepare(workdir)
    argv = [str(program.path)] + [arg.replace("{dir}", str(workdir)) for arg in program.argv]
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    import_frameworks([program])   # its framework's import-time patches are not the watch's
    result = Result(program, way, {}, 0.0, torch_before=torch_surface())
    counter = count_step_calls(result) if checked and way == "as written" else None
    try:
        sys.argv = argv
        os.chdir(workdir)
        seed_all()
        start = time.perf_counter()
        if WAYS[way] is None:
            result.namespace = execute(program, checked)
        else:
            with nt.watch(**WAYS[way]) as run:
                result.namespace = execute(program, checked)
                result.inside = inside(result.namespace) if inside else {}
            result.run = run
        result.seconds = time.perf_counter() - start
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        if counter is not None:
            counter.remove()
    result.torch_after = torch_surface()
    TIMES[(program.name, way)] = result.seconds
    return result


def execute(program: Program, keep_locals: bool = True) -> dict:
    """The program's namespace at its end: a script's globals, or main()'s locals (with
    its module's globals under them; only its globals where not `keep_locals`)."""
    if program.entry == "script":
        return runpy.run_path(str(program.path), run_name="__main__")
    module = fresh_module(program)
    if not keep_locals:
        module.main()
        return vars(module)
    return {**vars(module), **call_keeping_locals(module.main, getattr(module, program.frame))}


def fresh_module(program: Program) -> types.ModuleType:
    """The program imported anew under its file's name (its globals as at the start; its
    classes picklable by that name, from programs/ on sys.path)."""
    name = program.path.stem
    module = types.ModuleType(name)
    module.__file__ = str(program.path)
    sys.modules[name] = module
    exec(compile(program.path.read_text(), str(program.path), "exec"), vars(module))
    return module


def call_keeping_locals(fn: Callable[[], object], keep: Optional[Callable] = None) -> dict:
    """Call fn() and return the locals of `keep`'s frame (fn's own by default, a function
    it calls: nlp_example's training_function) at its last return. A trace function on
    that one function's frames only (the global one declines every other frame at its call)."""
    code, kept = (keep or fn).__code__, {}

    def on_frame(frame, event, arg):
        if event == "return":
            kept.update(frame.f_locals)
        return on_frame

    def on_call(frame, event, arg):
        return on_frame if frame.f_code is code else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return kept


def count_step_calls(result: Result):
    """Count optimizer step() calls into `result.step_calls` through torch's own global
    hook (as written only: the watch would see this hook). Returns its handle."""
    def counted(optimizer, args, kwargs):
        result.step_calls += 1
    return optim_hooks.register_optimizer_step_post_hook(counted)


def hand_count(result: Result) -> int:
    """The steps the as-written run made, counted by the harness or the program itself."""
    if result.program.hand_steps is not None:
        return result.program.hand_steps(result.namespace)
    per_step = result.program.optimizers_per_step   # a fraction where they do not divide
    return result.step_calls // per_step if result.step_calls % per_step == 0 else result.step_calls / per_step


def run_counts(run) -> Tuple[int, int]:
    """(steps, samples) of a watch's Run, as run.summary() reports them."""
    summary = run.summary()
    return summary["steps"], summary["samples"]


def expected_counts(program: Program) -> Tuple[int, int]:
    """(steps, samples) the watch must count: a loop that shows it no sample (no
    nn.Module called, no DataLoader iterated) counts none."""
    return program.steps, program.samples if "samples" in program.seen else 0


# -- what is compared -----------------------------------------------------------------------
def weights(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return dict(model.state_dict())


def different_weights(a: torch.nn.Module, b: torch.nn.Module) -> list:
    """The state_dict entries of a and b that are not bit for bit equal."""
    wa, wb = weights(a), weights(b)
    if wa.keys() != wb.keys():
        return [f"keys differ: {sorted(set(wa) ^ set(wb))}"]
    return [name for name in wa if not (wa[name].dtype == wb[name].dtype and torch.equal(wa[name], wb[name]))]


def not_finite(model: torch.nn.Module) -> list:
    return [name for name, t in weights(model).items()
            if t.is_floating_point() and not torch.isfinite(t).all()]


def _global_hook_dicts() -> dict:
    module_hooks = torch.nn.modules.module
    # the flag dicts (_with_kwargs, _always_called) are left out: torch's own
    # register_module_forward_hook(with_kwargs=True) leaves {id: True} there after
    # handle.remove() (torch 2.13), a flag of a hook that is gone
    names = [n for n in dir(module_hooks) if n.startswith("_global_") and isinstance(getattr(module_hooks, n), dict)
             and not n.endswith(("_with_kwargs", "_always_called"))]
    found = {f"torch.nn.modules.module.{n}": getattr(module_hooks, n) for n in names}
    found.update({f"torch.optim.optimizer.{n}": getattr(optim_hooks, n) for n in
                  ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")})
    return found


# torch's classes whose every attribute is compared (a patch or an added attribute shows),
# and its modules whose functions present before are compared (a lazy import may add some)
CLASSES = {
    "torch.Tensor": torch.Tensor, "torch._C.TensorBase": torch._C.TensorBase,
    "torch.nn.Module": torch.nn.Module, "torch.optim.Optimizer": torch.optim.Optimizer,
    "DataLoader": DataLoader,
    "_SingleProcessDataLoaderIter": torch.utils.data.dataloader._SingleProcessDataLoaderIter,
    "_MultiProcessingDataLoaderIter": torch.utils.data.dataloader._MultiProcessingDataLoaderIter,
    "torch.amp.GradScaler": torch.amp.GradScaler,
    **{f"torch.optim.{n}": c for n, c in vars(torch.optim).items()
       if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)},
}
MODULES = {"torch": torch, "torch.nn.functional": torch.nn.functional, "torch.nn.utils": torch.nn.utils,
           "torch.nn.utils.clip_grad": torch.nn.utils.clip_grad, "torch.autograd": torch.autograd,
           "torch.utils.checkpoint": torch.utils.checkpoint}


def torch_surface() -> dict:
    """{where: the object there} for torch's classes, modules, global hooks and state."""
    surface = {}
    for label, cls in CLASSES.items():
        surface.update({f"{label}.{name}": value for name, value in vars(cls).items()})
    for label, module in MODULES.items():
        surface.update({f"{label}.{name}": value for name, value in vars(module).items() if callable(value)})
    surface.update({name: dict(hooks) for name, hooks in _global_hook_dicts().items()})
    surface.update({
        "grad enabled": torch.is_grad_enabled(), "autocast cpu": torch.is_autocast_enabled("cpu"),
        "threads": torch.get_num_threads(), "default dtype": torch.get_default_dtype(),
        "sys.gettrace": sys.gettrace(), "sys.getprofile": sys.getprofile(),
        "SIGINT handler": signal.getsignal(signal.SIGINT),
        "anomaly mode": torch.is_anomaly_enabled(),
        "saved tensors hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
    })
    return surface


def surface_changes(before: dict, after: dict) -> list:
    """What differs in `after` from `before`; a module function new in `after` is a lazy
    import, not a leftover, so new names count only on the classes."""
    changed = [k for k in before if k not in after or after[k] is not before[k]
               and after[k] != before[k] and not torch_wrapped_step(before[k], after[k])]
    added = [k for k in after if k not in before and not k.startswith(tuple(f"{m}." for m in MODULES))]
    return changed + [f"added {k}" for k in added]


def torch_wrapped_step(before, after) -> bool:
    """Optimizer.__init__ wraps its class's step once (_patch_step_function: the profiler's
    hook, marked `hooked`): torch's own change at a class's first optimizer, no leftover."""
    return getattr(after, "hooked", False) and getattr(after, "__wrapped__", None) is before


def module_surface(model: torch.nn.Module) -> dict:
    """Per submodule: its hook dicts' sizes, its instance attributes' names, and each
    parameter's dtype, strides and requires_grad (a channels_last left behind shows)."""
    surface = {}
    for path, module in model.named_modules():
        attrs = vars(module)
        surface[f"{path}: attributes"] = sorted(attrs)
        surface.update({f"{path}.{name}": len(value) for name, value in attrs.items()
                        if name.endswith("hooks") and hasattr(value, "__len__")})
        surface.update({f"{path}.{name}": (p.dtype, p.stride(), p.requires_grad, type(p))
                        for name, p in module.named_parameters(recurse=False)})
    return surface


def optimizer_surface(optimizer: torch.optim.Optimizer) -> dict:
    """Its hook dicts' sizes, attribute names, defaults and each group's settings."""
    attrs = vars(optimizer)
    surface = {"attributes": sorted(attrs), "defaults": dict(optimizer.defaults)}
    surface.update({name: len(value) for name, value in attrs.items()
                    if name.endswith("hooks") and hasattr(value, "__len__")})
    for i, group in enumerate(optimizer.param_groups):
        surface[f"group {i}"] = {k: v for k, v in group.items() if k != "params"}
    return surface


def loader_surface(loader: DataLoader) -> dict:
    # the dataset's class by name: a program's own Dataset class is a new class object in
    # each run (runpy, or the program imported anew), the same class all the same
    dataset = type(loader.dataset)
    return {"attributes": sorted(vars(loader)), "num_workers": loader.num_workers,
            "pin_memory": loader.pin_memory, "batch_sampler": type(loader.batch_sampler),
            "collate_fn": by_name(loader.collate_fn),
            "dataset": f"{dataset.__module__}.{dataset.__qualname__}"}


def by_name(fn):
    """A program's own function by its name: one defined in a function (accelerate's
    get_dataloaders' collate_fn) is a new object in each run, the same function all the
    same. Anything else (a wrapper: it has __wrapped__) is itself."""
    if isinstance(fn, types.FunctionType) and not hasattr(fn, "__wrapped__"):
        return f"{fn.__module__}.{fn.__qualname__}"
    return fn


def object_surfaces(result: Result) -> dict:
    """Every model's, optimizer's and loader's surface, by name."""
    surfaces = {f"model {n}": module_surface(m) for n, m in result.models().items()}
    surfaces.update({f"optimizer {n}": optimizer_surface(o) for n, o in result.optimizers().items()})
    surfaces.update({f"loader {n}": loader_surface(d) for n, d in result.loaders().items()})
    for name, m in result.inside.get("deepcopies", {}).items():
        surfaces[f"deepcopy of {name}"] = module_surface(m)
    return surfaces


def surface_diff(expected: dict, got: dict) -> list:
    """'object key: expected -> got' for every entry that differs."""
    out = []
    for obj in expected:
        for key in set(expected[obj]) | set(got.get(obj, {})):
            a, b = expected[obj].get(key), got.get(obj, {}).get(key)
            if a != b and not (callable(a) and a is b):
                out.append(f"{obj} {key}: {a!r} -> {b!r}")
    return out


# -- what the watch's objects must survive --------------------------------------------------
def dump_inside(namespace_of: Callable[[dict], Tuple[dict, dict]], pickles: bool):
    """An `inside` for run_program: copy.deepcopy of each model and, where `pickles` (a
    script's classes are its passing __main__'s, picklable only while it runs),
    torch.save and pickle.dumps of each model and torch.save of each optimizer's
    state_dict, all while the watch holds them. What fails is kept as its error."""
    def inside(namespace: dict) -> dict:
        models, optimizers = namespace_of(namespace)
        copies = {name: copy.deepcopy(model) for name, model in models.items()}
        try:
            blobs, saved_weights = saved(models, optimizers) if pickles else ({}, {})
        except Exception as error:   # the test reports it; the run itself goes on
            return {"deepcopies": copies, "error": f"{type(error).__name__}: {error}"}
        return {"blobs": blobs, "weights": saved_weights, "deepcopies": copies}
    return inside


def saved(models: dict, optimizers: dict) -> Tuple[dict, dict]:
    """({file name: bytes} of the models and optimizer states, {name.weights: bytes})."""
    blobs, saved_weights = {}, {}
    for name, model in models.items():
        buf = io.BytesIO()
        torch.save(model, buf)
        blobs[f"{name}.torch"] = buf.getvalue()
        blobs[f"{name}.pickle"] = pickle.dumps(model)
        state = io.BytesIO()
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, state)
        saved_weights[f"{name}.weights"] = state.getvalue()
    for name, optimizer in optimizers.items():
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        blobs[f"{name}.optim"] = buf.getvalue()
    return blobs, saved_weights


FRESH_LOAD = r"""
import io, pickle, sys
from pathlib import Path
import torch
from torchvision_ops import declare_missing_ops
declare_missing_ops()
folder = Path(sys.argv[1])
for path in sorted(folder.iterdir()):
    data = path.read_bytes()
    if path.suffix in (".weights", ".optim"):
        continue
    model = torch.load(io.BytesIO(data), weights_only=False) if path.suffix == ".torch" else pickle.loads(data)
    expected = torch.load(folder / (path.stem + ".weights"), weights_only=True)
    got = model.state_dict()
    assert got.keys() == expected.keys(), (path.name, sorted(set(got) ^ set(expected)))
    for k in got:
        assert torch.equal(got[k], expected[k]), (path.name, k)
    for mod_name, mod in model.named_modules():
        for attr, hooks in vars(mod).items():
            if attr.endswith("hooks") and hasattr(hooks, "__len__"):
                assert len(hooks) == 0, (path.name, mod_name, attr, hooks)
import numpy as np
numpy_scalars = [getattr(np, "_core", None) or np.core, np.dtype, type(np.dtype("float64"))]
numpy_scalars[0] = numpy_scalars[0].multiarray.scalar   # a program's own float64 LR
for path in folder.glob("*.optim"):
    with torch.serialization.safe_globals(numpy_scalars):
        state = torch.load(path, weights_only=True)
    assert "state" in state and "param_groups" in state, path.name
leaked = sorted(m for m in sys.modules if m.split(".")[0] == "nbtrain")
assert not leaked, leaked
print("loaded", len(list(folder.iterdir())), "files")
"""


def load_in_fresh_python(blobs: dict, weights: dict) -> subprocess.CompletedProcess:
    """Write the blobs and load them in a new interpreter that never imports nbtrain
    (its path: programs/ for the classes, tests/corpus/ for the torchvision ops)."""
    folder = Path(tempfile.mkdtemp(prefix="corpus-pickles-"))
    for name, data in {**blobs, **weights}.items():
        (folder / name).write_bytes(data)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(PROGRAMS), str(PROGRAMS.parent)])
    return subprocess.run([sys.executable, "-c", FRESH_LOAD, str(folder)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=str(folder))
