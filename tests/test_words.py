"""Words that agree with their figures: a bf16 trial's verdict says what its ratio says (a
2.6x slowdown is "slower", never "within the noise"), "as written" is said only of steps
that ran as written, the amp line and the diagnosis under a loop's own autocast never
contradict each other, and the settings table gives each figure its unit."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.auto.diagnosis import diagnose
from nbtrain.auto.precision import decide, gain_words
from nbtrain.tables import setting
from nbtrain.watcher.measure import Bf16Trial

import test_fit
import test_watch_bf16_evidence as evidence

clock = evidence.clock   # the fixture: a CPU with bf16 units, on the model's clock
bf16_measured = test_fit.bf16_measured   # the fixture: fit's probe measures, on a clock
Timed = evidence.Timed

FP32 = [1.0e-3, 1.02e-3, 1.1e-3]
SLOW = [1.05e-3, 2.6e-3, 2.7e-3]   # one bf16 block quick: the rank test cannot decide


def trial_with(fp32_s: list, bf16_s: list) -> Bf16Trial:
    """A trial fed block times (a warm-up of 1 s a step, then the ORDER's blocks), each
    block's steps until the trial ends it (a slow bf16 block ends early)."""
    trial = Bf16Trial()
    trial.start(step_s=1.0, now=0.0, waited_s=0.0, first_step=1)
    times = {"off": iter(fp32_s), "bf16": iter(bf16_s)}
    now, block = 0.0, 0
    while trial.running:
        per_step = 1.0 if block == 0 else next(times[trial.mode])
        ended = False
        while not ended:
            now += per_step
            ended = trial.ends_block(now, 0.0)
            trial.step_done(now, 0.0, ended)
        block += 1
    return trial


# -- the verdict's words come from its figure and the blocks' spread ------------------------
def test_a_slowdown_beyond_the_blocks_spread_is_slower_though_undecided():
    verdict = decide(FP32, SLOW, "off")
    assert not verdict.decisive and verdict.amp == "off"   # fp32, as before: words only
    words = gain_words(verdict)
    assert words.startswith("bf16 0.39x of fp32 (slower"), words
    assert "noise" not in words and "no difference" not in words


def test_the_watchs_verdict_on_such_blocks_says_slower():
    keep, gain, why = trial_with([t * 1e3 for t in FP32], [t * 1e3 for t in SLOW]).verdict()
    assert not keep and gain == pytest.approx(0.39, abs=0.005)
    assert why.startswith("bf16 0.39x of fp32 (slower"), why


def test_a_speedup_beyond_the_spread_but_undecided_says_faster_and_keeps_fp32():
    verdict = decide(FP32, [0.5e-3, 0.52e-3, 1.2e-3], "off")
    assert not verdict.decisive and verdict.amp == "off"
    assert gain_words(verdict).startswith("bf16 1.96x of fp32 (faster"), gain_words(verdict)


def test_blocks_that_overlap_in_the_median_are_noise_and_name_no_ratio():
    verdict = decide([4e-3, 1e-3, 4e-3], [2e-3, 5e-3, 2e-3], "off")
    words = gain_words(verdict)
    assert words.startswith("bf16 against fp32: no difference beyond the noise: fp32 steps "
                            "took 1.0-4.0 ms, bf16 steps 2.0-5.0 ms"), words
    assert "x of fp32" not in words


def test_fits_probe_says_such_a_slowdown_too(bf16_measured, monkeypatch):
    """nt.fit's 8 blocks each: bf16 2.6x slower in 5, quicker than fp32 in 3 (24 of the 64
    pairs: undecided); the medians stand apart."""
    from nbtrain.auto.precision import bf16_choice
    step = test_fit.TimedSteps(monkeypatch, [1e-3] * 9, [2.6e-3] * 6 + [0.5e-3] * 3)
    amp, why = bf16_choice(step, key="mlp")
    assert amp == "off" and why == ("CPU has avx512_bf16; bf16 0.38x of fp32 on this model "
                                    "(slower, though its blocks overlap fp32's): fp32 "
                                    "(measured again next run)"), why


@pytest.mark.parametrize("fp32, bf16, said", [
    ([1.0, 1.02, 0.98], [0.8, 0.82, 0.79],
     "bf16 1.25x faster than fp32, beyond the noise of the blocks"),
    ([1.0, 1.02, 0.98], [0.95, 0.96, 0.94], "bf16 only 1.05x of fp32 (less than 1.1x)"),
    ([1.0, 1.02, 0.98], [2.6, 2.7, 2.65], "bf16 0.38x of fp32 (slower)"),
])
def test_decided_verdicts_say_their_figure(fp32, bf16, said):
    assert gain_words(decide(fp32, bf16, "off")) == said


# -- "as written" only of steps that ran as written ------------------------------------------
class Recorded(Timed):
    """Timed, keeping the dtype its layer computed in at each forward (the watch gives the
    loop float32 outputs back)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.dtypes = []

    def forward(self, x):
        out = super().forward(x)
        self.dtypes.append(out.dtype)
        return out


def watched_loop(clock, steps, bf16_s=2e-3):
    """run_loop's cell (test_watch_bf16_evidence): bf16 2x slower on the clock; returns (the
    run, {step: the dtype its forward ran in})."""
    torch.manual_seed(0)
    model = Recorded(clock, 1e-3, bf16_s)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    with nt.watch(progress=False, count_flops=False, store=False) as run:
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return run, dict(enumerate(model.dtypes, start=1))


def steps_named(why: str) -> set:
    """The steps a message says ran in bf16: '5, 8-9 and 12' -> {5, 8, 9, 12}."""
    found = re.search(r"steps? ([\d, and-]+) ran in bf16 for the trial", why)
    assert found, why
    named = set()
    for part in re.split(r", | and ", found.group(1)):
        first, _, last = part.partition("-")
        named |= set(range(int(first), int(last or first) + 1))
    return named


def test_a_decided_trial_names_its_bf16_steps_and_where_fp32_is_kept_from(clock):
    for _ in range(6):   # short runs: a pair each, until the blocks decide
        run, dtypes = watched_loop(clock, 50)
        amp, why = run.resolved["amp"]
        if "fp32 kept from step" in why:
            break
    assert amp == "off" and "as written" not in why, why
    assert "bf16 0.50x of fp32 (slower), measured on your loop's own steps" in why, why
    bf16_steps = {step for step, dtype in dtypes.items() if dtype == torch.bfloat16}
    assert bf16_steps and steps_named(why) == bf16_steps, (why, sorted(bf16_steps))
    kept_from = int(re.search(r"fp32 kept from step (\d+)", why).group(1))
    assert kept_from > max(bf16_steps)
    assert all(dtypes[s] == torch.float32 for s in dtypes if s >= kept_from)


def test_a_run_whose_trial_ran_only_its_warm_up_names_that_step_not_as_written(clock):
    """bf16 2.6x slower: a warm-up step costs more than estimated, and no pair fits the
    second run; the one step it ran in bf16 is named."""
    watched_loop(clock, 50, bf16_s=2.6e-3)
    run, dtypes = watched_loop(clock, 50, bf16_s=2.6e-3)
    why = run.resolved["amp"][1]
    assert "as written" not in why and "fp32; step" in why, why
    assert steps_named(why) == {s for s, dtype in dtypes.items() if dtype == torch.bfloat16}


def test_a_run_that_ended_before_any_bf16_step_says_as_written(clock):
    run, dtypes = watched_loop(clock, 50)   # 30 ms blocks: none affordable in 2.5 ms
    why = run.resolved["amp"][1]
    assert torch.bfloat16 not in dtypes.values()
    assert "fp32, as written" in why, why


def test_a_trial_still_undecided_names_the_steps_it_ran_in_bf16(clock):
    watched_loop(clock, 50)
    run, dtypes = watched_loop(clock, 50)   # blocks sized by the first run: a pair
    why = run.resolved["amp"][1]
    assert "fp32 until it decides" in why, why
    bf16_steps = {step for step, dtype in dtypes.items() if dtype == torch.bfloat16}
    assert bf16_steps and steps_named(why) == bf16_steps, (why, sorted(bf16_steps))


# -- the loop's own autocast: no advice to add one ---------------------------------------------
def test_under_the_loops_own_autocast_the_diagnosis_never_advises_amp(monkeypatch):
    from nbtrain import machine
    monkeypatch.setenv("NBTRAIN_CPU_BF16", "avx512_bf16")   # a CPU where bf16 would be advised
    machine.cpu_bf16_feature.cache_clear()
    try:
        model = torch.nn.Linear(8, 3)
        opt = torch.optim.SGD(model.parameters(), 0.1)
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        with nt.watch(progress=False, count_flops=False, store=False) as run:
            for _ in range(3):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
        amp, why = run.resolved["amp"]
        assert amp == "off" and "your loop runs its forward under its own autocast" in why
        assert "bfloat16" in why, why
        compute_bound = {"data_wait_frac": 0.0, "copy_frac": 0.0, "compute_frac": 1.0}
        for fractions in (compute_bound, {**compute_bound, "mfu": 0.3},
                          {**compute_bound, "mfu": 0.6}):
            said = diagnose(fractions, run.resolved)
            assert "amp=" not in said, said
        # the same run without its own autocast is advised bf16: the test can tell
        plain = {**run.resolved, "amp": ("off", "CPU has avx512_bf16: asked for")}
        assert "nt.watch(amp='bf16')" in diagnose(compute_bound, plain)
    finally:
        machine.cpu_bf16_feature.cache_clear()


# -- the settings table: each figure with its unit, three significant digits -----------------
@pytest.mark.parametrize("name, value, shown", [
    ("peak_tflops", 0.20199282113457864, "0.202 TFLOP/s"),
    ("flops_per_step", 1294336, "1.29 MFLOP"),
    ("flops_per_step", 508526592, "509 MFLOP"),
    ("flops_per_step", 1017053184, "1.02 GFLOP"),
    ("flops_per_step", 999_700, "1 MFLOP"),
    ("flops_per_step", 384, "384 FLOP"),
    ("measuring_s", 0.01234567, "0.0123 s"),
    ("setup_s", 2.0, "2 s"),
    ("num_workers", 4, "4"),
    ("amp", "bf16", "bf16"),
    ("pin_memory", False, "False"),
    ("peak_tflops", None, "None"),
    ("batch_size", 0.123456, "0.123"),
])
def test_a_setting_is_shown_with_its_unit_to_three_significant_digits(name, value, shown):
    assert setting(name, value) == shown


def test_the_panels_and_the_reports_settings_tables_show_units():
    from nbtrain.ui.panel import _resolved_html
    from nbtrain.views.html_report import _resolved_table
    run = SimpleNamespace(state="finished", resolved={
        "peak_tflops": (0.20199282113457864, "measured"),
        "flops_per_step": (1294336, "counted"), "num_workers": (0, "asked for")})
    for page in (_resolved_html(run), _resolved_table(run)):
        assert "0.202 TFLOP/s" in page and "1.29 MFLOP" in page, page
        assert "0.20199" not in page and "1294336" not in page
