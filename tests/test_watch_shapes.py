"""Every way of training that nt.watch counts: a closure optimizer, several optimizers one
after another, torch.autograd.backward, hand updates from torch.autograd.grad, a loop whose
only sign of training is an optimizer's step; and Stop ending each of them at a step.

Each loop runs as written and watched only (optimize=False): the weights must be the
same bit for bit, the Run's steps and samples those the loop's sizes give."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import nbtrain as nt

QUIET = dict(optimize=False, progress=False)
BATCH = 16


def _data(n=BATCH, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=gen), torch.randn(n, 1, generator=gen)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _as_written_and_watched(train, *, stop_at=None):
    """`train(model, stop)` as written and inside a watch; stop(step) is called after each
    step the loop makes (it asks the Run to stop at `stop_at`)."""
    written = _model()
    train(written, lambda step: None)
    watched = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a watch that saw no step warns: none must here
        with nt.watch(**QUIET) as run:
            train(watched, lambda step: run.stop() if step == stop_at else None)
    return written, watched, run


# -- the closure optimizer ------------------------------------------------------------------
def _lbfgs(model, after_step, steps=3):
    x, y = _data()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=8)
    for step in range(1, steps + 1):
        def closure():
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        optimizer.step(closure)
        after_step(step)


def test_a_closure_optimizer_step_is_one_step_its_backwards_evaluations():
    written, watched, run = _as_written_and_watched(_lbfgs)
    assert _same_weights(written, watched)
    assert run.state == "finished"
    assert run.step == 3
    assert run.summary()["samples"] == 3 * BATCH


def test_stop_ends_a_closure_loop_before_the_next_step_changes_anything():
    _, watched, run = _as_written_and_watched(_lbfgs, stop_at=2)
    assert run.state == "stopped" and run.step == 2
    two = _model()
    _lbfgs(two, lambda step: None, steps=2)
    assert _same_weights(two, watched)


# -- several optimizers, one after another ----------------------------------------------------
def _layer_by_layer(model, after_step, per_layer=5):
    """mnist_forward_forward's shape: each layer has its own optimizer and trains after the
    one before, on one batch fetched once (no DataLoader in the loop)."""
    x, y = _data()
    first, second = model[0], model[2]
    done = 0
    for layer, params in ((first, first.parameters()), (second, second.parameters())):
        optimizer = torch.optim.Adam(params, lr=0.01)
        for _ in range(per_layer):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            done += 1
            after_step(done)


def test_layer_by_layer_training_counts_every_step_of_every_layer():
    written, watched, run = _as_written_and_watched(_layer_by_layer)
    assert _same_weights(written, watched)
    assert run.step == 10
    assert run.summary()["samples"] == 10 * BATCH


@pytest.mark.parametrize("stop_at", [3, 7])
def test_stop_ends_layer_by_layer_training_in_either_layer(stop_at):
    _, _, run = _as_written_and_watched(_layer_by_layer, stop_at=stop_at)
    assert run.state == "stopped" and run.step == stop_at


def test_a_gan_pair_on_one_batch_is_still_one_step():
    """Two optimizers that alternate on the same batches stay one step (issue 38's rule),
    next to the layer-by-layer rule above."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data(64)), batch_size=BATCH)

    def gan(model, after_step):
        d_opt = torch.optim.SGD(model[0].parameters(), lr=0.01)
        g_opt = torch.optim.SGD(model[2].parameters(), lr=0.01)
        for i, (x, y) in enumerate(loader, 1):
            for opt in (d_opt, g_opt):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            after_step(i)
    written, watched, run = _as_written_and_watched(gan)
    assert _same_weights(written, watched)
    assert run.step == 4 and run.summary()["samples"] == 64


# -- torch.autograd.backward and torch.autograd.grad -----------------------------------------
def _autograd_backward(model, after_step, steps=12):
    x, y = _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        torch.autograd.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        after_step(step)


def test_torch_autograd_backward_is_a_backward():
    written, watched, run = _as_written_and_watched(_autograd_backward)
    assert _same_weights(written, watched)
    assert run.step == 12 and run.history
    assert run.summary()["final_loss"] == pytest.approx(
        nn.functional.mse_loss(written(_data()[0]), _data()[1]).item(), rel=0.5)


def test_stop_ends_an_autograd_backward_loop():
    _, _, run = _as_written_and_watched(_autograd_backward, stop_at=5)
    assert run.state == "stopped" and run.step == 5


def _grad_updates(model, after_step, steps=12):
    """Hand updates from torch.autograd.grad, no optimizer (a meta-learning step's shape)."""
    x, y = _data()
    params = list(model.parameters())
    for step in range(1, steps + 1):
        loss = nn.functional.mse_loss(model(x), y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(0.05 * g)
        after_step(step)


def test_hand_updates_from_autograd_grad_are_steps():
    written, watched, run = _as_written_and_watched(_grad_updates)
    assert _same_weights(written, watched)
    assert run.step == 12 and run.history
    assert run.summary()["samples"] == 12 * BATCH


def test_stop_ends_a_loop_of_autograd_grad_updates():
    _, _, run = _as_written_and_watched(_grad_updates, stop_at=4)
    assert run.state == "stopped" and run.step == 4


def _maml(model, after_step, steps=6):
    """An inner step from autograd.grad(create_graph=True), an outer Adam step: the inner
    gradients are the step's graph, not steps of their own."""
    x, y = _data()
    meta = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        inner = nn.functional.mse_loss(model(x[:8]), y[:8])
        grads = torch.autograd.grad(inner, list(model.parameters()), create_graph=True)
        fast = {name: p - 0.1 * g for (name, p), g in zip(model.named_parameters(), grads)}
        outer = nn.functional.mse_loss(torch.func.functional_call(model, fast, (x[8:],)), y[8:])
        meta.zero_grad()
        outer.backward()
        meta.step()
        after_step(step)


def test_a_meta_learning_step_counts_its_outer_steps():
    written, watched, run = _as_written_and_watched(_maml)
    assert _same_weights(written, watched)
    assert run.step == 6


# -- an optimizer step and nothing else -------------------------------------------------------
def _func_grads_then_step(model, after_step, steps=8):
    """Gradients from torch.func.grad set on the parameters, then the optimizer steps: no
    backward the watch can see."""
    x, y = _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def loss_of(params):
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)
    for step in range(1, steps + 1):
        params = {k: v.detach() for k, v in model.named_parameters()}
        grads = torch.func.grad(loss_of)(params)
        for name, p in model.named_parameters():
            p.grad = grads[name]
        optimizer.step()
        after_step(step)


def test_an_optimizer_step_without_a_visible_backward_is_a_step():
    written, watched, run = _as_written_and_watched(_func_grads_then_step)
    assert _same_weights(written, watched)
    assert run.step == 8 and run.state == "finished"


def test_stop_ends_a_loop_whose_only_sign_is_the_optimizer_step():
    _, _, run = _as_written_and_watched(_func_grads_then_step, stop_at=3)
    assert run.state == "stopped" and run.step == 3


def test_the_watch_leaves_autograd_as_it_found_it():
    backward, grad = torch.autograd.backward, torch.autograd.grad
    tensor_backward = torch.Tensor.__dict__["backward"]
    with nt.watch(**QUIET):
        _grad_updates(_model(), lambda step: None, steps=2)
        assert torch.autograd.backward is not backward and torch.autograd.grad is not grad
    assert torch.autograd.backward is backward and torch.autograd.grad is grad
    assert torch.Tensor.__dict__["backward"] is tensor_backward



def test_the_flop_count_imports_no_compiler_into_a_program_that_had_none():
    """A hand-update loop imports no torch._dynamo as written; its FLOP count under the
    watch must not import it either (seconds inside a short program). The loop runs until
    the count is made: it starts once it and the loadings (nbtrain's, torch's FLOP
    formulas) cost 5% of the run, which is later on a slower machine (CI missed 6,000)."""
    import subprocess
    import sys
    program = (
        "import sys, torch, nbtrain as nt\n"
        "from torch import nn\n"
        "model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))\n"
        "x, y = torch.randn(64, 6), torch.randn(64, 1)\n"
        "with nt.watch(optimize=False, progress=False) as run:\n"
        "    for step in range(100_000):\n"
        "        model.zero_grad(); nn.functional.mse_loss(model(x), y).backward()\n"
        "        with torch.no_grad():\n"
        "            for p in model.parameters(): p.sub_(0.01 * p.grad)\n"
        "        if step % 500 == 0 and 'flops_per_step' in run.resolved: break\n"
        "print(run.resolved['flops_per_step'][0], 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out == ["61440", "False"]


# -- samples where no DataLoader shows them ---------------------------------------------------
def test_an_rnn_fed_its_hidden_state_a_word_at_a_time_counts_its_batch_once_a_step():
    cell = nn.RNNCell(6, 8)
    optimizer = torch.optim.SGD(cell.parameters(), lr=0.01)
    words = torch.randn(5, 4, 6)   # 5 words of a batch of 4 sentences
    with nt.watch(**QUIET) as run:
        for _ in range(3):
            hidden = torch.zeros(4, 8)
            for word in words:
                hidden = cell(word, hidden)
            optimizer.zero_grad()
            hidden.pow(2).mean().backward()
            optimizer.step()
    assert run.step == 3 and run.summary()["samples"] == 3 * 4


def test_a_look_at_a_batch_before_training_is_no_step_and_no_epoch():
    """The CIFAR-10 tutorial shows `next(iter(trainloader))` before it trains."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data(64)), batch_size=BATCH)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with nt.watch(**QUIET) as run:
        next(iter(loader))
        for epoch in range(2):
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
    assert run.step == 8 and run.summary()["samples"] == 2 * 64
    assert run.epoch == 1   # the second pass of the two it trained on


def test_a_step_that_sees_no_batch_and_no_forward_trains_on_the_data_it_holds():
    """forward-forward's shape: a layer's forward called directly on a batch fetched once."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data(64)), batch_size=32)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with nt.watch(**QUIET) as run:
        x, y = next(iter(loader))
        for _ in range(5):
            optimizer.zero_grad()
            nn.functional.mse_loss(model.forward(x), y).backward()
            optimizer.step()
    assert run.step == 5 and run.summary()["samples"] == 5 * 32
