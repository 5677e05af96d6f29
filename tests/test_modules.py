"""run.modules() and run.peak(): a window of a few steps timed leaf module by leaf module,
under nt.watch and nt.fit, then every hook removed (telemetry/modules.py,
watcher/modules.py)."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

import nbtrain as nt
from nbtrain.auto import budget
from nbtrain.telemetry.modules import FIT_AT_STEP, WINDOW_STEPS, ModuleWindow

QUIET = dict(optimize=False, progress=False, store=False, count_flops=False)
GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                "_global_forward_hooks_always_called", "_global_backward_hooks",
                "_global_backward_pre_hooks")


class Sleepy(nn.Module):
    """A leaf planted slow: its forward sleeps 5 ms."""

    def forward(self, x):
        time.sleep(0.005)
        return x * 1.0


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.005)
        return grad


class SlowBackward(nn.Module):
    """A leaf whose backward sleeps 5 ms (its forward is a copy)."""

    def forward(self, x):
        return _SlowBackward.apply(x)


class Fails(nn.Module):
    """A leaf that raises while a window's hooks are on."""

    def forward(self, x):
        if _window_open():
            raise ZeroDivisionError("planted")
        return x


@pytest.fixture
def generous(monkeypatch):
    """The whole run's time as the measuring budget: a window opens within a few steps."""
    monkeypatch.setattr(budget, "SHARE", 1.0)


def _hooks_now() -> dict:
    return {name: dict(getattr(nn_module, name)) for name in GLOBAL_HOOKS}


def _window_open() -> bool:
    return any(type(getattr(h, "__self__", None)) is ModuleWindow
               for h in nn_module._global_forward_pre_hooks.values())


def _train(model, steps, opt=None, x=None, y=None, each=None):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 8) if x is None else x
    y = torch.randint(0, 4, (x.shape[0],)) if y is None else y
    for i in range(steps):
        if each is not None and each(i):
            break
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _untouched(model) -> bool:
    return all(not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                    or m._backward_pre_hooks) for m in model.modules())


def test_a_leaf_planted_slow_comes_first_within_the_budget():
    """Under the default budget: the window opens once 3 slower steps are affordable, the
    rows are the leaves, their shares add up, the hooks are gone after it."""
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(inplace=True), Sleepy(), nn.Linear(32, 4))
    before = _hooks_now()
    open_after = []
    with nt.watch(**QUIET) as run:
        _train(model, 150, each=lambda i: open_after.append(_window_open()) and False)
    rows = run.modules()
    assert [row.name for row in rows][0] == "2"
    assert sorted(row.name for row in rows) == ["0", "1", "2", "3"]
    assert rows[0].forward_s >= 0.004 and rows[0].calls == 1
    assert sum(row.share for row in rows) == pytest.approx(1.0)
    assert sum(open_after) == WINDOW_STEPS and not open_after[-1]   # 3 steps, once
    assert _hooks_now() == before and _untouched(model)
    assert run.summary()["modules"][0]["name"] == "2"


def test_a_slow_backward_is_its_modules_own(generous):
    """Backward by gradient arrival: a leaf whose backward sleeps has the time, the leaf
    before it (whose output feeds two others) and after it do not."""

    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.slow = nn.Linear(8, 16), SlowBackward()
            self.left, self.right = nn.Linear(16, 16), nn.Linear(16, 16)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            h = self.stem(x)
            return self.head(self.slow(self.left(h)) + self.right(h))

    with nt.watch(**QUIET) as run:
        _train(Branches(), 30)
    rows = {row.name: row for row in run.modules()}
    assert run.modules()[0].name == "slow"
    assert rows["slow"].backward_s >= 0.004
    assert all(rows[name].backward_s < 0.002 for name in ("stem", "left", "right", "head"))


def test_a_model_without_submodules_is_one_row_named_empty(generous):
    with nt.watch(**QUIET) as run:
        _train(nn.Linear(8, 4), 30)
    (row,) = run.modules()
    assert row.name == "" and row.share == 1.0 and row.backward_s > 0


def test_a_module_called_twice_a_step_has_its_times_summed_and_calls_counted(generous):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.sleepy, self.head = Sleepy(), nn.Linear(8, 4)

        def forward(self, x):
            return self.head(self.sleepy(self.sleepy(x)))

    with nt.watch(**QUIET) as run:
        _train(Twice(), 30)
    rows = {row.name: row for row in run.modules()}
    assert rows["sleepy"].calls == 2 and rows["head"].calls == 1
    assert rows["sleepy"].forward_s >= 0.009


def test_a_module_that_raises_inside_the_window_leaves_no_hook_and_its_error(generous):
    model = nn.Sequential(nn.Linear(8, 8), Fails(), nn.Linear(8, 4))
    before = _hooks_now()
    with pytest.raises(ZeroDivisionError, match="planted") as raised:
        with nt.watch(**QUIET) as run:
            _train(model, 30)
    assert raised.type is ZeroDivisionError
    assert _hooks_now() == before and _untouched(model)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert list(run.modules()) == [] and list(run.peak().parts) == []
    assert run.modules().note.startswith("not measured: ZeroDivisionError in step")
    assert "inside the window" in run.modules().note and "modules" not in run.summary()


def test_a_run_that_ends_inside_a_window_discards_it_with_the_reason(generous):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    before = _hooks_now()
    opened = []

    def stop(i):   # one step into the window, then the loop ends
        opened.append(_window_open())
        return sum(opened) == 2

    with nt.watch(**QUIET) as run:
        _train(model, 30, each=stop)
    assert _hooks_now() == before and _untouched(model)
    assert list(run.modules()) == []
    assert run.modules().note == (f"not measured: your loop ended at step {run.step}, inside "
                                  "the window: its 1 step(s) discarded")


def test_the_watched_loop_stays_bit_exact_with_the_window_on(generous):
    """optimize=False: the same weights, as written and watched (in-place ReLU after a
    BatchNorm, whose output's node the window hooks)."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                             nn.Flatten(), nn.Dropout(0.1), nn.Linear(4 * 6 * 6, 4))

    def train(model):
        torch.manual_seed(1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, 40, opt, x=torch.randn(16, 1, 8, 8))
        return model.state_dict()

    plain = train(make())
    with nt.watch(**QUIET) as run:
        watched = train(make())
    assert run.modules(), run.modules().note   # the window ran
    assert plain.keys() == watched.keys()
    assert all(torch.equal(plain[k], watched[k]) for k in plain)


def test_a_64_mb_activation_is_the_largest_part_of_the_peak(generous):
    class Big(nn.Module):
        """Saves 64 MiB for backward: tanh keeps its output (16 x 1M floats)."""

        def forward(self, x):
            return torch.tanh(x.repeat(1, 2 ** 20 // x.shape[1])).mean(dim=1, keepdim=True)

    model = nn.Sequential(nn.Linear(8, 8), Big(), nn.Linear(1, 4))
    opt = torch.optim.AdamW(model.parameters())
    with nt.watch(**QUIET) as run:
        _train(model, 12, opt)
    peak = run.peak()
    top = peak.parts[0]
    assert (top.part, top.kind) == ("1", "activations")
    assert top.bytes == pytest.approx(64 * 2 ** 20, rel=0.25)
    kinds = {part.part: part.bytes for part in peak.parts}
    params = sum(p.nbytes for p in model.parameters())
    assert kinds["parameters"] == kinds["gradients"] == params
    assert kinds["optimizer state"] >= 2 * params   # AdamW: two moments a parameter
    assert peak.bytes == sum(part.bytes for part in peak.parts)
    assert run.summary()["peak"]["parts"][0]["part"] == "1"


def test_fit_times_its_modules_in_one_window_and_a_stored_run_answers(tmp_path):
    db = str(tmp_path / "runs.sqlite")
    model = nn.Sequential(nn.Linear(8, 16), Sleepy(), nn.Linear(16, 4))
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    before = _hooks_now()
    cfg = nt.TrainConfig(max_steps=100, batch_size=16, count_flops=False, store=db)
    run = nt.fit(model, (x, y), F.cross_entropy, config=cfg)
    assert _hooks_now() == before and _untouched(model)
    assert run.modules()[0].name == "1"
    assert run.modules().note.startswith(
        f"over steps {FIT_AT_STEP + 1}-{FIT_AT_STEP + WINDOW_STEPS}")
    assert {p.part for p in run.peak().parts} >= {"0", "parameters", "optimizer state"}
    loaded = nt.load_run(run.id, store=db)
    assert list(loaded.modules()) == list(run.modules())
    assert loaded.peak() == run.peak()


def test_a_short_fit_says_why_it_has_no_table():
    cfg = nt.TrainConfig(max_steps=10, batch_size=16, count_flops=False, store=False)
    run = nt.fit(nn.Linear(8, 4), (torch.randn(64, 8), torch.randint(0, 4, (64,))),
                 F.cross_entropy, config=cfg)
    assert list(run.modules()) == []
    assert run.modules().note.startswith("not measured: the run made 10 steps")
    assert run.peak().bytes == 0 and run.peak().parts.note == run.modules().note


def test_a_fit_that_fails_inside_its_window_removes_the_hooks_and_says_so():
    model = nn.Sequential(nn.Linear(8, 8), Fails(), nn.Linear(8, 4))
    before = _hooks_now()
    cfg = nt.TrainConfig(max_steps=100, batch_size=16, count_flops=False, store=False)
    with pytest.raises(nt.TrainingError) as raised:
        nt.fit(model, (torch.randn(64, 8), torch.randint(0, 4, (64,))), F.cross_entropy,
               config=cfg)
    assert repr(raised.value.__cause__) == "ZeroDivisionError('planted')"   # the loop's own
    assert _hooks_now() == before and _untouched(model)
    note = raised.value.run.modules().note
    assert note == (f"not measured: ZeroDivisionError in step {FIT_AT_STEP + 1}, inside the "
                    "window: its 0 step(s) discarded")


def test_the_dashboards_table_names_the_slowest_layer_and_the_peaks_largest_part():
    from nbtrain.views import dashboard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    cfg = nt.TrainConfig(max_steps=100, batch_size=16, count_flops=False, store=False)
    run = nt.fit(model, (x, y), F.cross_entropy, config=cfg, progress=False)
    rows, top = run.modules(), run.peak().parts[0]
    text = dashboard._where_text(run)
    assert text.startswith(f"layer {rows[0].name} {rows[0].share:.0%}")
    assert f"{top.bytes / 2**20:.1f} MiB" in text
    short = nt.fit(model, (x, y), F.cross_entropy, progress=False,
                   config=cfg.replace(max_steps=10))
    assert dashboard._where_text(short) == "-"   # no window: nothing to name
