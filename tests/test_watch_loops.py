"""nt.watch on the loops real programs have: BatchNorm, dropout, no optimizer, several
optimizers, a loop catching KeyboardInterrupt, checkpoints saved inside the watch; and the
rule that measuring waits until it costs at most 5% of the loop."""
from __future__ import annotations

import contextlib
import copy
import io
import pickle
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as modules
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from nbtrain.auto import budget
from nbtrain.watcher import measure
from nbtrain.watcher.measure import Bf16Trial, FlopCount

QUIET = dict(progress=False)


def conv_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
                         nn.Flatten(), nn.Linear(8 * 6 * 6, 10))


def bn_dropout_program(steps_out=None, save=False):
    """A ResNet-like shape: BatchNorm's running statistics and dropout's RNG in every step."""
    torch.manual_seed(0)
    model = conv_net()
    opt = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
    data = TensorDataset(torch.randn(96, 3, 8, 8), torch.randint(0, 10, (96,)))
    saved = []
    for x, y in DataLoader(data, batch_size=8, shuffle=True):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if save:   # what real programs do inside their loop: an EMA, a best model
            ema = copy.deepcopy(model)
            saved.append((pickle.dumps(model), ema))
    return model, opt, saved


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def hooks_now() -> tuple:
    return (len(modules._global_forward_pre_hooks), len(modules._global_forward_hooks),
            torch.Tensor.backward, torch.optim.Optimizer.state_dict,
            torch.amp.GradScaler.scale, DataLoader.__iter__)


# -- nothing the loop can observe changes ------------------------------------------------------
def test_batchnorm_and_dropout_bit_for_bit_on_a_fresh_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("NBTRAIN_HOME", str(tmp_path))   # nothing cached: a machine's first run
    before = hooks_now()
    expected, _, _ = bn_dropout_program()
    rng = torch.get_rng_state()
    with nt.watch(optimize=False, **QUIET) as run:
        got, opt, _ = bn_dropout_program()
    assert same(expected, got) and torch.equal(torch.get_rng_state(), rng)
    assert run.step == 12 and run.summary()["samples"] == 96
    assert hooks_now() == before and not got._forward_hooks and not got._forward_pre_hooks
    with nt.watch(**QUIET) as run:   # the defaults: finite
        got, _, _ = bn_dropout_program()
    assert all(torch.isfinite(t).all() for t in got.state_dict().values() if t.is_floating_point())


def test_a_model_saved_inside_a_watch_loads_where_nbtrain_was_never_imported(tmp_path):
    with nt.watch(**QUIET) as run:   # the defaults: the fused kernel where torch has one
        model, opt, saved = bn_dropout_program(save=True)
        torch.save(model, tmp_path / "model.pt")
        torch.save(opt.state_dict(), tmp_path / "opt.pt")
        inside = opt.state_dict()
    assert len(saved) == 12 and not saved[0][1]._forward_hooks   # the EMA copies: no hooks
    assert run.resolved["optimizer_impl"][0] == "fused"
    assert inside["param_groups"][0]["fused"] is None   # the flags the loop gave
    code = ("import sys, torch; m = torch.load(sys.argv[1], weights_only=False); "
            "s = torch.load(sys.argv[2]); assert 'nbtrain' not in sys.modules; "
            "print(type(m).__name__, len(s['state']))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model.pt"),
                          str(tmp_path / "opt.pt")], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Sequential", "6"]


# -- the loops real code has ---------------------------------------------------------------------
def hand_updates(steps=40, accumulate=1):
    """pytorch/examples' regression: no optimizer, `p.data.add_`, batches from a function."""
    torch.manual_seed(0)
    fc = nn.Linear(3, 1)
    updates = 0
    for i in range(steps):
        fc.zero_grad()
        for _ in range(accumulate):
            x = torch.randn(16, 3)
            F.smooth_l1_loss(fc(x), x.sum(1, keepdim=True)).backward()
        for p in fc.parameters():
            p.data.add_(-0.1 * p.grad)
        updates += 1
    return fc, updates


@pytest.mark.parametrize("accumulate", [1, 3])
def test_updates_by_hand_are_the_steps(accumulate):
    expected, updates = hand_updates(accumulate=accumulate)
    with nt.watch(optimize=False, log_every=10, **QUIET) as run:
        got, _ = hand_updates(accumulate=accumulate)
    assert same(expected, got)
    assert run.step == updates == 40 and len(run.records()) == 4
    assert run.summary()["samples"] == 40 * 16 * accumulate
    assert run.resolved["step"][0] == "an update by hand"


def gan(batches=10):
    """DCGAN's shape: two models, two optimizers, three backward() a batch."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 6))
    D = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    opt_g, opt_d = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    loader = DataLoader(TensorDataset(torch.randn(batches * 8, 6)), batch_size=8, shuffle=True)
    bce = nn.BCEWithLogitsLoss()
    for (real,) in loader:
        D.zero_grad()
        bce(D(real), torch.ones(8, 1)).backward()
        fake = G(torch.randn(8, 4))
        bce(D(fake.detach()), torch.zeros(8, 1)).backward()
        opt_d.step()
        G.zero_grad()
        bce(D(fake), torch.ones(8, 1)).backward()
        opt_g.step()
    return G, D


def test_a_gan_is_one_step_a_batch_and_its_samples_counted_once():
    g1, d1 = gan()
    with nt.watch(optimize=False, log_every=5, **QUIET) as run:
        g2, d2 = gan()
    assert same(g1, g2) and same(d1, d2)
    assert run.step == 10 and run.summary()["samples"] == 80
    assert run.resolved["step"][0] == "a training batch"


def test_stop_ends_a_loop_that_catches_keyboard_interrupt_itself():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    steps = []
    with nt.watch(**QUIET) as run:
        try:   # word_language_model's main.py: Ctrl-C ends training early, then it evaluates
            for i in range(1000):
                opt.zero_grad()
                model(torch.randn(8, 4)).sum().backward()
                opt.step()
                steps.append(i)
                if i == 6:
                    threading.Thread(target=run.stop).start()
                    threading.Event().wait(0.05)
        except KeyboardInterrupt:
            steps.append("caught")
    assert run.state == "stopped" and run.step == 7 and "caught" not in steps


def test_a_loops_own_grad_scaler_is_recorded_unscaled():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), 0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    losses = []
    with nt.watch(optimize=False, log_every=1, **QUIET) as run:
        for _ in range(3):
            loss = model(torch.ones(2, 4)).pow(2).mean()
            losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert [r["loss"] for r in run.records()] == pytest.approx(losses, rel=1e-6)


# -- what is measured, and when ----------------------------------------------------------------
def test_a_short_loop_is_not_measured_and_the_run_says_why():
    with nt.watch(optimize=False, **QUIET) as run:
        hand_updates(steps=5)
    assert run.resolved["flops_per_step"][0] is None
    assert "at most 5%" in run.resolved["flops_per_step"][1]
    assert run.resolved["measuring_s"][0] == 0.0


def test_a_loop_updating_by_hand_counts_the_flops_of_its_steps():
    with nt.watch(optimize=False, **QUIET) as run:
        hand_updates(steps=300, accumulate=3)
    assert run.resolved["flops_per_step"][0] == 3 * (2 + 2) * 16 * 3, run.resolved["flops_per_step"]


def test_the_flop_count_of_a_real_step_equals_torchs_counter():
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(0)
    model = conv_net()
    x = torch.randn(4, 3, 8, 8)
    with FlopCounterMode(display=False) as reference:
        model(x).sum().backward()
    count = FlopCount()
    count.start()
    try:
        model(x).sum().backward()
    finally:
        count.stop()
    assert count.total == reference.get_total_flops() > 0 and 0 < count.conv_share() < 1


def test_a_long_enough_loop_counts_its_flops_within_the_budget():
    x, y = torch.randn(512, 16), torch.randint(0, 4, (512,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with nt.watch(optimize=False, **QUIET) as run:
        for _ in range(12):
            for xb, yb in DataLoader(TensorDataset(x, y), batch_size=16):
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
    flops = run.resolved["flops_per_step"][0]
    assert flops == 3 * 2 * 16 * (16 * 64 + 64 * 4) - 2 * 16 * 16 * 64   # no input gradient
    spent, why = run.resolved["measuring_s"]
    assert spent <= budget.SHARE * run.summary()["wall_s"] + 1e-3, why


def trial_with(fp32_s: list, bf16_s: list) -> Bf16Trial:
    """A trial fed block times: warm-up 1 s, then the ORDER's blocks."""
    trial = Bf16Trial()
    trial.start(step_s=1.0, now=0.0, waited_s=0.0, first_step=1)
    times = {"off": iter(fp32_s), "bf16": iter(bf16_s)}
    now = 0.0
    for block, mode in enumerate(trial.ORDER):
        assert trial.mode == mode
        per_step = 1.0 if block == 0 else next(times[mode])
        for _ in range(trial.steps_per_block):
            now += per_step
            trial.step_done(now, 0.0, trial.ends_block(now, 0.0))
    assert not trial.running
    return trial


@pytest.mark.parametrize("fp32, bf16, keep, decisive", [
    ([1.0, 1.02, 0.98], [0.8, 0.82, 0.79], True, True),     # every bf16 block faster, 1.25x
    ([1.0, 1.02, 0.98], [0.95, 0.96, 0.94], False, True),   # faster, but only 1.05x
    ([1.0, 1.02, 0.98], [1.3, 1.4, 1.35], False, True),     # slower
    ([1.0, 0.7, 1.3], [0.8, 0.82, 1.1], False, False),      # 1.22x, within the blocks' noise
])
def test_bf16_is_kept_only_where_it_beat_fp32_beyond_the_noise(fp32, bf16, keep, decisive):
    trial = trial_with(fp32, bf16)
    assert trial.verdict()[0] is keep and trial.decisive() is decisive


def test_the_bf16_trial_runs_on_the_loops_own_steps_and_decides(monkeypatch, tmp_path):
    """A CPU said to have bf16 units (this one may not): the trial's blocks really run in
    bf16, and the choice is the trial's, said with the steps it was measured on."""
    from nbtrain.auto import precision as ladder
    from nbtrain.watcher import autocast
    monkeypatch.setenv("NBTRAIN_HOME", str(tmp_path))
    monkeypatch.setattr(ladder, "cpu_bf16_feature", lambda: "avx512_bf16")
    monkeypatch.setattr(measure, "BLOCK_S", 0.002)
    monkeypatch.setattr(autocast, "known_bf16_gain", lambda key: (None, ""))   # never measured
    monkeypatch.setattr(measure, "remember_bf16_gain", lambda key, gain, load=None: None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    dtypes = []
    probe = model[0].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    x, y = torch.randn(2048, 64), torch.randint(0, 4, (2048,))
    with nt.watch(count_flops=False, **QUIET) as run:
        # until the trial has decided: it starts once it costs at most 5% of the loop so
        # far, later on a fast machine (10 epochs of this MLP can end before it, in 0.17 s)
        for _ in range(200):
            for xb, yb in DataLoader(TensorDataset(x, y), batch_size=32):
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
            if "fp32 until then" not in run.resolved["amp"][1]:   # the trial has decided
                break
        # a step after the decision (the epoch may have ended on the trial's last bf16 block)
        opt.zero_grad()
        F.cross_entropy(model(x[:32]), y[:32]).backward()
        opt.step()
    probe.remove()
    amp, why = run.resolved["amp"]
    assert "measured on your loop's own steps" in why, why
    assert torch.bfloat16 in dtypes and dtypes[0] == torch.float32   # fp32 until the trial
    assert (amp == "bf16") == (dtypes[-1] == torch.bfloat16)


# -- a torch.compile'd model -------------------------------------------------------------------
def compiled_program(when: str, watched: bool):
    """The torch.compile tutorial's shape: compile (before the watch, inside it, or after 3
    eager steps, once the watch has its model's calls through its class), then steps on
    batches made in the loop. Returns (the model's weights, torch.compile's frames, the
    warnings the program saw)."""
    import warnings

    import torch._dynamo.utils as dynamo_utils
    torch._dynamo.reset()   # each from nothing compiled: the frames count is its own
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters())
    compiled = torch.compile(model) if when == "before" else model
    dynamo_utils.counters.clear()
    with warnings.catch_warnings(record=True) as seen, \
            (nt.watch(optimize=False, **QUIET) if watched else contextlib.nullcontext()):
        warnings.simplefilter("always")
        for step in range(6):
            if step == {"inside": 0, "after eager steps": 3}.get(when):
                compiled = torch.compile(model)
            opt.zero_grad()
            F.cross_entropy(compiled(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            opt.step()
    frames = dict(dynamo_utils.counters["frames"])
    return model, frames, [str(w.message) for w in seen]


@pytest.mark.parametrize("when", ["before", "inside", "after eager steps"])
def test_a_compiled_model_is_compiled_as_unwatched_and_warned_of_nothing(when):
    """The watch's global hooks would make torch.compile trace every submodule's slow path,
    compile again where they come and go, and warn the loop of hooks it never set; a
    model compiled after the watch wraps its class's calls compiles as unwatched too."""
    before = (torch.compile, torch._dynamo.eval_frame.OptimizedModule.__call__)
    plain, plain_frames, plain_warnings = compiled_program(when, watched=False)
    watched, frames, warned = compiled_program(when, watched=True)
    assert same(plain, watched)
    assert frames == plain_frames and warned == plain_warnings == []
    assert (torch.compile, torch._dynamo.eval_frame.OptimizedModule.__call__) == before


def test_torch_compile_as_a_decorator_inside_a_watch_is_torchs_own():
    """torch.compile(backend=...) with no model returns a decorator before torch._dynamo
    is imported: the watch's wrapper passes it through, and wraps OptimizedModule at the
    first compile that imports it (a fresh Python: in this one dynamo is imported). After
    the watch both are torch's own, told by identity: the very function torch.compile was,
    and a call defined in torch's own file, unwrapped. A file name without "nbtrain" in it
    is no test: in a clone folder named nbtrain, torch's file is under nbtrain/.venv."""
    program = r"""
import sys, torch, torch.nn as nn, nbtrain as nt
assert "torch._dynamo.eval_frame" not in sys.modules   # the watch wraps torch.compile
own_compile = torch.compile
with nt.watch(optimize=False, progress=False, store=False):
    decorate = torch.compile(backend="eager")   # no model: a decorator, dynamo not imported
    model = decorate(nn.Linear(3, 2))
    model(torch.randn(4, 3)).sum().backward()
    again = torch.compile(nn.Linear(3, 2), backend="eager")   # now OptimizedModule is wrapped
    again(torch.randn(4, 3)).sum().backward()
frames = sys.modules["torch._dynamo.eval_frame"]
assert isinstance(model, frames.OptimizedModule) and again.weight.grad is not None
assert torch.compile is own_compile
call = vars(frames.OptimizedModule)["__call__"]
assert call.__code__.co_filename == frames.__file__ and not hasattr(call, "__wrapped__")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", program], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_a_compiled_forward_taking_a_keyword_named_module():
    class Takes(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x, module=None):
            return self.lin(x) if module is None else module(x)
    torch._dynamo.reset()
    compiled = torch.compile(Takes(), backend="eager")
    other = nn.Linear(3, 1)
    with nt.watch(optimize=False, **QUIET):
        compiled(torch.randn(4, 3), module=other).sum().backward()
    assert other.weight.grad is not None
    assert not modules._global_forward_hooks and not modules._global_forward_pre_hooks


class CountingScaler(torch.amp.GradScaler):
    """Counts the steps GradScaler takes the unscale path for, where it reads found_inf
    back to the host (torch/amp/grad_scaler.py, _maybe_opt_step)."""
    reads = 0

    def _maybe_opt_step(self, *args, **kwargs):
        CountingScaler.reads += 1
        return super()._maybe_opt_step(*args, **kwargs)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_a_loops_own_grad_scaler_hands_the_fused_kernel_its_scale(impl):
    """The watch's fused AdamW takes a loop's own GradScaler as torch's fused=True does:
    the kernel unscales and skips on inf, with no found_inf read back per step; the loop
    updates as it would with the kernel asked for, and the optimizer is left as found."""
    def loop(opt, model):
        scaler = CountingScaler("cpu", init_scale=1024.0)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        for _ in range(4):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
    torch.manual_seed(0)
    model, asked = nn.Linear(4, 1), nn.Linear(4, 1)
    asked.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), 1e-2)
    found = dict(vars(opt))
    CountingScaler.reads = 0
    with nt.watch(optimizer_impl=impl, amp="off", **QUIET) as run:
        loop(opt, model)
    reads = CountingScaler.reads
    loop(torch.optim.AdamW(asked.parameters(), 1e-2, **{impl: True}), asked)
    assert run.resolved["optimizer_impl"][0] == impl
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), asked.parameters()))
    # found_inf read back each step, but with the fused kernel from the second on (the
    # watch makes it fused in the first step's pre-hook, after GradScaler chose its path)
    assert reads == (1 if impl == "fused" else 4)
    assert vars(opt).keys() == found.keys() and opt.param_groups[0]["fused"] is None
