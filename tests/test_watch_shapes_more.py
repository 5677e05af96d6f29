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


def _hand_set_grads_then_step(model, steps=5):
    """Gradients from torch.autograd.grad set on the parameters by hand, then opt.step()."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 1, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
    return model


def _small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def test_fp16_hand_set_gradients_from_autograd_grad_update_as_fp32_would():
    fp32 = _hand_set_grads_then_step(_small_model())
    with nt.watch(amp="fp16", progress=False) as run:
        fp16 = _hand_set_grads_then_step(_small_model())
    assert run.resolved["amp"][0] == "fp16" and run.state == "finished" and run.step == 5
    for a, b in zip(fp32.parameters(), fp16.parameters()):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    start = _small_model()   # the update moved the weights, as fp32's did
    moved = sum((a - s).abs().sum() for a, s in zip(fp32.parameters(), start.parameters()))
    diff = sum((a - b).abs().sum() for a, b in zip(fp32.parameters(), fp16.parameters()))
    assert diff < 0.05 * moved
