"""More shapes of training nt.watch counts: a GAN with no DataLoader (either network
first), and hand-set gradients from torch.autograd.grad under fp16's GradScaler."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import nbtrain as nt

QUIET = dict(optimize=False, progress=False)
BATCH = 16


def _gan_without_loader(d_first: bool, steps=6):
    """Real samples drawn by hand (no DataLoader); the discriminator's loss on real and
    detached fakes, then the generator's."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    D = nn.Sequential(nn.Linear(2, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    d_opt, g_opt = torch.optim.Adam(D.parameters(), 1e-3), torch.optim.Adam(G.parameters(), 1e-3)
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
    for _ in range(steps):
        real, z = torch.randn(BATCH, 2), torch.randn(BATCH, 4)
        d_opt.zero_grad()
        if d_first:
            loss_d = bce(D(real), ones) + bce(D(G(z).detach()), zeros)
        else:
            fake = G(z)
            loss_d = bce(D(fake.detach()), zeros) + bce(D(real), ones)
        loss_d.backward()
        d_opt.step()
        g_opt.zero_grad()
        loss_g = bce(D(G(z) if d_first else fake), ones)
        loss_g.backward()
        g_opt.step()
    return G, D


@pytest.mark.parametrize("d_first", [True, False], ids=["D first", "G first"])
def test_a_gan_without_a_dataloader_counts_its_batch_once_a_step(d_first):
    g1, d1 = _gan_without_loader(d_first)
    with nt.watch(**QUIET) as run:
        g2, d2 = _gan_without_loader(d_first)
    for a, b in ((g1, g2), (d1, d2)):
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert run.step == 6 and run.summary()["samples"] == 6 * BATCH


def _hand_set_grads_then_step(model, steps=5, clip=None, backward_first=0):
    """Gradients from torch.autograd.grad set on the parameters by hand (clipped, where
    `clip`), then opt.step(); the first `backward_first` steps' from loss.backward()."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 1, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        if step < backward_first:
            opt.zero_grad()
            loss.backward()
        else:
            grads = torch.autograd.grad(loss, list(model.parameters()))
            for p, g in zip(model.parameters(), grads):
                p.grad = g
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def _small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


@pytest.mark.parametrize("impl", ["fused", "foreach"])   # the kernel unscales, or unscale_
@pytest.mark.parametrize("clip, backward_first", [(None, 0), (0.05, 0), (None, 2)],
                         ids=["step", "clipped", "after backward steps"])
def test_fp16_hand_set_gradients_from_autograd_grad_update_as_fp32_would(impl, clip,
                                                                         backward_first):
    """autograd.grad's gradients are the loop's, unscaled: the step and the clip take
    them as they are, after scaled backwards too (the watch's GradScaler asserted that no
    loss was scaled; the clip read a scale there was none of)."""
    fp32 = _hand_set_grads_then_step(_small_model(), clip=clip, backward_first=backward_first)
    with nt.watch(amp="fp16", optimizer_impl=impl, progress=False) as run:
        fp16 = _hand_set_grads_then_step(_small_model(), clip=clip,
                                         backward_first=backward_first)
    assert run.resolved["amp"][0] == "fp16" and run.resolved["optimizer_impl"][0] == impl
    assert run.state == "finished" and run.step == 5
    start = _small_model()
    moved = sum((a - s).abs().sum() for a, s in zip(fp32.parameters(), start.parameters()))
    apart = sum((a - b).abs().sum() for a, b in zip(fp32.parameters(), fp16.parameters()))
    assert apart < 0.05 * moved   # fp16 autocast's rounding only


def _by_hand(model, steps=8, lr=0.05):
    """pytorch/examples regression's update: backward, then each weight moved by hand."""
    torch.manual_seed(1)
    x, y = torch.randn(64, 6), torch.randn(64, 1)
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return model


def test_fp16_on_a_loop_that_updates_by_hand_scales_no_loss():
    """No optimizer unscales a hand update: the loss stays unscaled (it was scaled by
    65536 and the weights went to NaN), autocast still runs, and the Run says so."""
    fp32 = _by_hand(_small_model())
    with nt.watch(amp="fp16", progress=False) as run:
        fp16 = _by_hand(_small_model())
    assert run.state == "finished" and run.step == 8
    assert "no loss scaled" in run.resolved["amp"][1]
    start = _small_model()
    moved = sum((a - s).abs().sum() for a, s in zip(fp32.parameters(), start.parameters()))
    apart = sum((a - b).abs().sum() for a, b in zip(fp32.parameters(), fp16.parameters()))
    assert apart < 0.05 * moved   # fp16 autocast's rounding only


def test_fp16_without_an_optimizers_zero_grad_checks_the_first_step_for_inf():
    """A loop that zeroes with model.zero_grad(): its first backward is not scaled (it
    could be a hand update's); the first step is still checked for inf and skipped, and
    the scale lowered, as GradScaler does; later steps are scaled."""
    torch.manual_seed(1)
    x, y = torch.randn(64, 6), torch.randn(64, 1)
    model = _small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = [p.detach().clone() for p in model.parameters()]
    scaled = []
    with nt.watch(amp="fp16", optimizer_impl="for-loop", progress=False) as run:
        for step in range(4):
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            scaled.append(model[0].weight.grad.abs().max().item())
            if step == 0:
                model[0].weight.grad[0, 0] = float("inf")
            opt.step()
            if step == 0:
                assert all(torch.equal(a, b) for a, b in zip(start, model.parameters()))
    assert run.scaler.get_scale() == 2.0 ** 15   # halved once, by the skipped first step
    assert scaled[1] > 1000 * scaled[0]          # from the second step on, scaled
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert run.step == 4


def test_without_a_dataloader_the_model_is_watched_through_its_class_after_a_step():
    """The global forward hooks take every module call off nn.Module's fast path; once a
    step has shown that no other network feeds the model, its own calls are watched
    through its class instead (a class attribute: a deepcopy of the model carries none)."""
    import copy
    from torch.nn.modules import module as modules
    model = _small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 6), torch.randn(64, 1)
    seen = []
    with nt.watch(optimize=False, log_every=1, progress=False) as run:
        for _ in range(4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            twin = copy.deepcopy(model)
            seen.append((len(modules._global_forward_pre_hooks),
                         type(model).__call__ is not nn.Module.__call__,
                         len(twin._forward_pre_hooks) + len(twin._forward_hooks)))
    assert seen == [(1, False, 0)] + [(0, True, 0)] * 3
    assert [r["samples"] for r in run.records("train")] == [64] * 4
    assert "__call__" not in vars(type(model)) and not modules._global_forward_pre_hooks
