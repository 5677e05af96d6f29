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
"""
from __future__ import annotations

import copy
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

    @property
    def path(self) -> Path:
        return PROGRAMS / f"{self.name}.py"


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
        return {name: self.namespace[name] for name in self.program.models}

    def optimizers(self) -> Dict[str, torch.optim.Optimizer]:
        return {name: self.namespace[name] for name in self.program.optimizers}

    def loaders(self) -> Dict[str, DataLoader]:
        return {name: v for name, v in self.namespace.items() if isinstance(v, DataLoader)}


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


def lm_batches(ns: dict) -> int:
    """word_language_model's hand updates: one per bptt window, each epoch."""
    return math.ceil((ns["train_data"].size(0) - 1) / ns["args"].bptt) * ns["args"].epochs


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
]
BY_NAME = {program.name: program for program in CORPUS}


# -- running one program -------------------------------------------------------------------
def seed_all(seed: int = SEED) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def run_program(program: Program, way: str, inside: Optional[Callable[[dict], dict]] = None
                ) -> Result:
    """Run `program` one way in a directory of its own; `inside(namespace)` runs before
    the watch ends (the program's objects still watched) and its dict is kept."""
    workdir = Path(tempfile.mkdtemp(prefix=f"corpus-{program.name}-"))
    if program.prepare is not None:
        program.prepare(workdir)
    argv = [str(program.path)] + [arg.replace("{dir}", str(workdir)) for arg in program.argv]
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    result = Result(program, way, {}, 0.0, torch_before=torch_surface())
    counter = None if way != "as written" else count_step_calls(result)
    try:
        sys.argv = argv
        os.chdir(workdir)
        seed_all()
        start = time.perf_counter()
        if WAYS[way] is None:
            result.namespace = execute(program)
        else:
            with nt.watch(**WAYS[way]) as run:
                result.namespace = execute(program)
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


def execute(program: Program) -> dict:
    """The program's namespace at its end: a script's globals, or main()'s locals (with
    its module's globals under them)."""
    if program.entry == "script":
        return runpy.run_path(str(program.path), run_name="__main__")
    module = fresh_module(program)
    return {**vars(module), **call_keeping_locals(module.main)}


def fresh_module(program: Program) -> types.ModuleType:
    """The program imported anew under its own name (its globals as at the start; its
    classes picklable by that name, from programs/ on sys.path)."""
    module = types.ModuleType(program.name)
    module.__file__ = str(program.path)
    sys.modules[program.name] = module
    exec(compile(program.path.read_text(), str(program.path), "exec"), vars(module))
    return module


def call_keeping_locals(fn: Callable[[], object]) -> dict:
    """Call fn() and return its frame's locals as it returned. A trace function on that
    one frame only (the global one declines every other frame at its call)."""
    code, kept = fn.__code__, {}

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
    return result.step_calls


def run_counts(run) -> Tuple[int, int]:
    """(steps, samples) of a watch's Run, as run.summary() reports them."""
    summary = run.summary()
    return summary["steps"], summary["samples"]


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
    return {"attributes": sorted(vars(loader)), "num_workers": loader.num_workers,
            "pin_memory": loader.pin_memory, "batch_sampler": type(loader.batch_sampler),
            "collate_fn": loader.collate_fn, "dataset": type(loader.dataset)}


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
for path in folder.glob("*.optim"):
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
