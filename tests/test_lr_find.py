"""lr_find(): an exponential LR sweep whose suggestion trains, robust to noisy losses."""
import math
import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.tools.lr_find import lr_find, smooth_curve, suggest_lr


@pytest.fixture(scope="module")
def digits():
    return nt.datasets.digits("train", images=False), nt.datasets.digits("val", images=False)


def digits_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def cpu(**overrides) -> nt.TrainConfig:
    return nt.TrainConfig(device="cpu", amp="off", batch_size=64, **overrides)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_suggested_lr_trains_digits(digits, optimizer):
    (x, y), (xv, yv) = digits
    found = lr_find(digits_mlp, (x, y), F.cross_entropy, config=cpu(optimizer=optimizer))
    assert found.lrs[0] < found.suggestion < found.lr_at_min
    torch.manual_seed(0)
    run = nt.fit(digits_mlp(), (x, y), F.cross_entropy, val_data=(xv, yv), progress=False,
                 config=found.config.replace(epochs=6))
    assert run.config.lr == found.suggestion and run.config.optimizer == optimizer
    assert run.summary()["val_acc"] > 0.9


def test_the_sweep_is_exponential_and_leaves_the_model_alone(digits):
    (x, y), _ = digits
    model = digits_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    found = lr_find(model, (x, y), F.cross_entropy, config=cpu(), start_lr=1e-5, end_lr=1e-2,
                    num_steps=30)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert found.run.model is not model
    ratios = [b / a for a, b in zip(found.lrs, found.lrs[1:])]
    assert found.lrs[0] == pytest.approx(1e-5) and found.lrs[-1] == pytest.approx(1e-2)
    assert ratios == pytest.approx([(1e-2 / 1e-5) ** (1 / 29)] * 29)
    assert len(found.losses) == len(found.lrs) == 30
    assert not found.diverged and any("raise end_lr" in n for n in found.notes)
    assert found.run.config.scheduler == "constant"   # the sweep's own LR, not the config's


def test_the_schedule_of_the_config_is_kept_for_training(digits):
    (x, y), _ = digits
    cfg = cpu(scheduler="cosine", warmup_steps=20, min_lr=1e-4, lr=0.5)
    found = lr_find(digits_mlp, (x, y), F.cross_entropy, config=cfg, num_steps=30)
    assert found.config.scheduler == "cosine" and found.config.warmup_steps == 20
    assert found.config.lr == found.suggestion
    assert found.config.min_lr == min(1e-4, found.suggestion)


def test_the_sweep_stops_when_the_loss_diverges(digits):
    (x, y), _ = digits
    found = lr_find(digits_mlp, (x, y), F.cross_entropy, config=cpu(optimizer="sgd"),
                    end_lr=1000.0)
    assert found.diverged and len(found.lrs) < 100 and found.run.state == "stopped"
    tail = found.losses[-1]
    assert not math.isfinite(tail) or tail > 4 * min(found.losses)
    assert found.notes == []


def noisy_curve(seed: int, n: int = 100):
    """A typical range-test curve in log-LR: flat, falling, lowest near 1e-1.5, exploding;
    plus batch noise (sd 0.15) and rare spikes (+1.5, 1 in 15), which raw finders trip on."""
    rng = random.Random(seed)
    lrs = [10 ** (-7 + 8 * i / (n - 1)) for i in range(n)]
    true = [0.3 + 2.0 / (1 + math.exp(2.5 * (math.log10(lr) + 3.5)))
            + 0.5 * math.exp(3 * (math.log10(lr) + 0.8)) for lr in lrs]
    noisy = [t + rng.gauss(0, 0.15) + (1.5 if rng.random() < 1 / 15 else 0.0) for t in true]
    return lrs, noisy, true


def test_the_suggestion_is_robust_to_noise():
    lrs, _, true = noisy_curve(0)
    true_min = lrs[min(range(len(true)), key=true.__getitem__)]
    for seed in range(30):
        lrs, noisy, _ = noisy_curve(seed)
        suggestion, _, _ = suggest_lr(lrs, noisy)
        # within a factor 3 of a tenth of the true minimum, on every draw of noise
        assert true_min / 30 < suggestion < true_min / 3.3, seed


def test_smoothing_does_not_lag():
    """An EMA shifts a falling curve right; the centred smoother keeps the minimum in place."""
    values = [abs(i - 60) / 10 for i in range(100)]
    smoothed = smooth_curve(values)
    assert min(range(100), key=smoothed.__getitem__) == 60


def test_non_finite_tail_is_cut():
    lrs = [10 ** (-5 + i / 10) for i in range(40)]
    losses = [2 - i / 20 for i in range(30)] + [float("nan")] * 10
    suggestion, i_min, smoothed = suggest_lr(lrs, losses)
    assert len(smoothed) == 30 and suggestion == pytest.approx(lrs[i_min] / 10)


@pytest.mark.parametrize("kwargs, words", [
    (dict(start_lr=1.0, end_lr=1e-3), "0 < start_lr < end_lr"),
    (dict(num_steps=5), "num_steps >= 20"),
    (dict(diverge=0.5), "diverge must be > 1"),
])
def test_bad_ranges_say_what_is_allowed(digits, kwargs, words):
    (x, y), _ = digits
    with pytest.raises(ValueError) as info:
        lr_find(digits_mlp, (x, y), F.cross_entropy, **kwargs)
    assert words in str(info.value)


def test_figure_and_text(digits):
    pytest.importorskip("plotly")
    (x, y), _ = digits
    found = lr_find(digits_mlp, (x, y), F.cross_entropy, config=cpu(), num_steps=40)
    fig = found.figure()
    assert fig.layout.xaxis.type == "log"
    assert [t.name for t in fig.data][:3] == ["loss per step", "smoothed", "lowest loss"]
    assert list(fig.data[3].x) == [found.suggestion] * 2   # the suggestion, as a data line
    text = repr(found)
    assert text.startswith("LR range test: ") and f"suggested lr {found.suggestion:.3g}" in text
    assert found._repr_html_().startswith("<pre>")
