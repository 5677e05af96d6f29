"""The frameworks whose loops nt.watch knows by name: how to tell one runs the loop (its
modules' frames on the stack of the loop's first forward or backward), the model it
holds, what it does to the loss under accumulation, and the knob a user of it turns for
each piece of advice, written as they would write it. A loop no framework runs is "your
own": the advice then names the line of the user's code.

This module imports none of the frameworks: a frame's module name says whose it is.
"""
from __future__ import annotations

import sys
from typing import NamedTuple, Optional

OWN = "your own"   # resolved["loop"] of a loop the user wrote


class Framework(NamedTuple):
    name: str             # as its users call it, in the summary's "loop" line
    modules: tuple        # the module names (prefixes) whose frames run its loop
    workers: str          # loader workers, {n} the number to try
    batch: str            # a larger batch
    amp: str              # mixed precision, {amp} "bf16" or "fp16"
    compile: str          # torch.compile
    sums_micro_batches: bool = False   # divides each micro-batch's loss by its count
    optimizer: str = ""   # "module:Class" of its own optimizer, not a torch.optim one
    loader: str = ""      # "module:Class" of its own loader, not a torch DataLoader
    loader_workers: str = ""   # the attribute (dotted) of that loader's worker processes


FRAMEWORKS = (   # the outermost on the stack names the loop: Trainer runs Accelerate's code
    Framework("Hugging Face Trainer", ("transformers.trainer",),
              workers="TrainingArguments(dataloader_num_workers={n}, "
                      "dataloader_persistent_workers=True)",
              batch="TrainingArguments(per_device_train_batch_size=...) larger",
              amp="TrainingArguments({amp}=True)",
              compile="TrainingArguments(torch_compile=True)", sums_micro_batches=True),
    Framework("Lightning", ("lightning.pytorch.", "pytorch_lightning.", "lightning.fabric."),
              workers="DataLoader(..., num_workers={n}, persistent_workers=True) in your "
                      "train_dataloader() or DataModule",
              batch="a larger batch_size in your train_dataloader() or DataModule",
              amp='Trainer(precision="{amp}-mixed")',
              compile="model = torch.compile(model) before trainer.fit(model)",
              sums_micro_batches=True),
    Framework("fastai", ("fastai.",),
              workers="dls = ....dataloaders(..., num_workers={n})",
              batch="dls = ....dataloaders(..., bs=...) larger",
              amp="learn.to_{amp}()", compile="learn.model = torch.compile(learn.model)",
              optimizer="fastai.optimizer:Optimizer", loader="fastai.data.load:DataLoader",
              loader_workers="fake_l.num_workers"),
    Framework("skorch", ("skorch.",),
              workers="NeuralNet(..., iterator_train__num_workers={n}, "
                      "iterator_train__persistent_workers=True)",
              batch="NeuralNet(..., batch_size=...) larger",
              amp="NeuralNet with skorch.hf.AccelerateMixin and "
                  "Accelerator(mixed_precision='{amp}')",
              compile="NeuralNet(..., compile=True)"),
    Framework("Accelerate", ("accelerate.",),
              workers="DataLoader(..., num_workers={n}, persistent_workers=True) before "
                      "accelerator.prepare",
              batch="a larger batch_size in your DataLoader",
              amp="Accelerator(mixed_precision='{amp}')",
              compile="Accelerator(dynamo_backend='inductor')", sums_micro_batches=True),
)
BY_NAME = {framework.name: framework for framework in FRAMEWORKS}


def running(frame=None) -> Optional[Framework]:
    """The framework whose code is on the stack from `frame` (the caller's) outwards: the
    outermost one found; None where none is (the user's own loop)."""
    frame = frame or sys._getframe(1)
    found = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        for framework in FRAMEWORKS:
            if module.startswith(framework.modules):
                found = framework
        frame = frame.f_back
    return found


def holding_module(model, frame):
    """The module that holds `model` and whose method runs on the stack from `frame`
    outwards, the outermost such (a LightningModule's training_step calls its encoder;
    the model is the LightningModule); `model` itself where none does."""
    import torch
    holder = model
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_varnames[:1] == ("self",) \
            else None
        if isinstance(owner, torch.nn.Module) and owner is not holder and \
                any(m is holder for m in owner.modules()):
            holder = owner
        frame = frame.f_back
    return holder


def optimizer_class(framework: Framework):
    """The framework's own optimizer class, from its module as loaded; None where it has
    none or it is not loaded (its loop is running, so its module is)."""
    return _loaded(framework.optimizer)


def loader_classes() -> list:
    """(framework, class) of each framework's own loader whose module is loaded: a
    program builds its loaders (importing the framework) before it trains on them."""
    found = ((framework, _loaded(framework.loader)) for framework in FRAMEWORKS)
    return [(framework, cls) for framework, cls in found if cls is not None]


def loader_workers(framework: Framework, loader) -> int:
    """The worker processes the framework's own `loader` loads with."""
    value = loader
    for name in framework.loader_workers.split("."):
        value = getattr(value, name, 0)
    return value if isinstance(value, int) else 0


def _loaded(spec: str):
    """The class a "module:Class" names, where its module is loaded; else None."""
    if not spec:
        return None
    module, name = spec.split(":")
    return getattr(sys.modules.get(module), name, None)


# a host read's `where` in a framework's file ends so: "skorch/net.py:1277, skorch's own code"
IN_ITS_CODE = "'s own code"


def in_its_code(path: str, line: int) -> Optional[str]:
    """A line of a framework's file in words, from its package ("skorch/net.py:1277,
    skorch's own code"); None for any other file (the user's)."""
    path = path.replace("\\", "/")
    for framework in FRAMEWORKS:
        for package in dict.fromkeys(module.split(".")[0] for module in framework.modules):
            if f"/{package}/" in path:
                inside = path.rsplit(f"/{package}/", 1)[1]
                return f"{package}/{inside}:{line}, {framework.name}{IN_ITS_CODE}"
    return None


def framework_of(resolved: dict) -> Optional[Framework]:
    """The framework a watched run's loop is (its resolved "loop"); None for the user's
    own loop or nt.fit's."""
    return BY_NAME.get(resolved.get("loop", (None, ""))[0])


def watched(resolved: dict) -> bool:
    """Whether the run is a watched loop: the user's own, or a framework's."""
    loop = resolved.get("loop", (None, ""))[0]
    return loop == OWN or loop in BY_NAME
