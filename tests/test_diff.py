"""nt.diff(a, b): two runs compared per step, the cause named in words.

Two real short fits on the digits: one with a planted slow data path (a Dataset whose
__getitem__ sleeps 20 ms a sample, num_workers=0: about 80 ms a step) and one without
(no sleep, num_workers=2: about a millisecond), so that no machine's load can flip the
verdict; then the same runs read back from the store. The within-noise case and the
modules and gaps come from runs made of records (Run.emit), where the numbers are set.
"""
from __future__ import annotations

import json
import re
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.run import Run
from nbtrain.tools.diff import Change, Diff, Moved, diff

from conftest import Samples, quick

SLEEP_S = 0.02   # a sample: 4 of them make a step about 60x a step without them


class Sleepy(Samples):
    """Samples whose __getitem__ sleeps `sleep_s` first: a planted slow data path."""

    def __init__(self, x, y, sleep_s: float):
        super().__init__(x, y)
        self.sleep_s = sleep_s

    def __getitem__(self, i):
        time.sleep(self.sleep_s)
        return super().__getitem__(i)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return tmp_path_factory.mktemp("diff") / "runs.sqlite"


@pytest.fixture(scope="module")
def runs(db):
    """(fast, slow): the same model and data, the slow one's samples sleeping."""
    x, y = nt.datasets.digits(images=False)
    short = dict(batch_size=4, max_steps=18, log_every=3, count_flops=False, store=str(db))
    fast = nt.fit(mlp(), Sleepy(x, y, 0.0), F.cross_entropy,
                  config=quick(num_workers=2, **short), progress=False)
    slow = nt.fit(mlp(), Sleepy(x, y, SLEEP_S), F.cross_entropy,
                  config=quick(num_workers=0, **short), progress=False)
    return fast, slow


def first_line(d: Diff) -> str:
    return d.text().splitlines()[0]


# -- two real runs ---------------------------------------------------------------------------------
def test_a_planted_slow_data_path_is_named_with_the_setting_that_differs(runs):
    fast, slow = runs
    d = nt.diff(fast, slow)
    assert d.decisive and d.ratio > 5 and d.cause == "data wait"
    line = first_line(d)
    assert re.match(r"b is \d+(\.\d)?x slower a step: data wait \d+% -> \d+% of the step "
                    r"\(.+ -> .+ ms\), with num_workers 2 -> 0$", line), line
    assert d.settings[0] == Change("num_workers", 2, 0, True, "asked for")
    assert all(c.resolved for c in d.settings)   # the configs differ in num_workers alone
    assert "  num_workers 2 -> 0 (asked for)" in d.text().splitlines()
    share_a, share_b = d.split["data wait"]
    assert share_b > share_a and d.part_s["data wait"][1] > 10 * d.part_s["data wait"][0]


def test_the_other_way_round_b_is_faster(runs):
    fast, slow = runs
    d = nt.diff(slow, fast)
    assert d.ratio < 0.2 and d.cause == "data wait"
    assert re.match(r"b is \d+(\.\d)?x faster a step: data wait .*, with num_workers 0 -> 2$",
                    first_line(d)), first_line(d)


def test_stored_runs_give_the_same_diff(runs, db):
    fast, slow = runs
    live = nt.diff(fast, slow)
    stored = nt.diff(nt.load_run(fast.id, store=db), nt.load_run(slow.id, store=db))
    assert stored.headline == live.headline and stored.ratio == live.ratio
    assert stored.settings == live.settings and stored.split == live.split


def test_a_run_against_itself_stored_is_the_same_within_the_noise(runs, db):
    fast, _ = runs
    d = nt.diff(fast, nt.load_run(fast.id, store=db))
    assert not d.decisive and d.cause == "" and d.settings == []   # tuples and lists alike
    assert first_line(d).startswith("b and a take the same time a step within the noise")
    assert "settings: the same" in d.text()


# -- runs made of records: the noise, modules and gaps ---------------------------------------------
def made_run(step_times_ms, wait_frac=0.1, **config) -> Run:
    """A Run whose train records have these step times (after a first, warm-up one)."""
    run = Run(nt.TrainConfig(**config))
    for step, ms in enumerate([50.0, *step_times_ms], 1):
        s = ms / 1e3
        run.emit({"kind": "train", "step": step, "steps": 1, "step_time_s": s,
                  "data_wait_s": s * wait_frac, "copy_s": 0.0, "compute_s": s * (1 - wait_frac),
                  "data_wait_frac": wait_frac, "copy_frac": 0.0, "compute_frac": 1 - wait_frac})
    return run


def test_within_the_noise_says_so_in_words_never_a_ratio():
    a = made_run([10, 12, 9, 11, 13, 10])
    b = made_run([11, 9.5, 12.5, 10.5, 12, 14], batch_size=32)   # 1.06x by the medians
    d = nt.diff(a, b)
    assert not d.decisive and d.cause == ""
    line = first_line(d)
    assert line == ("b and a take the same time a step within the noise: the middle half of "
                    "a's records took 10-12 ms a step, b's 11-12 ms"), line
    assert not re.search(r"\d+(\.\d+)?x", line)
    assert "  batch_size 64 -> 32" in d.text()   # what differs is still listed


def test_too_few_records_to_tell_says_so():
    d = nt.diff(made_run([10, 10]), made_run([30, 30]))
    assert not d.decisive
    assert first_line(d).startswith("too few records to tell a and b apart (2 and 2 after the "
                                    "first, 3 each needed)")


class Measured(Run):
    """A stand-in for a Run with run.modules() and run.gaps() (being added to Run)."""

    def __init__(self, records_of: Run, modules, gaps):
        super().__init__(records_of.config)
        self.history, self._modules, self._gaps = records_of.history, modules, gaps

    def modules(self):
        return self._modules

    def gaps(self):
        return self._gaps


def gaps_table(evaluation_s: float, loader_s: float) -> list:
    return [{"part": "steps", "seconds": 5.0, "share": 0.5},
            {"part": "evaluation", "seconds": evaluation_s, "share": 0.1},
            {"part": "loader start", "seconds": loader_s, "share": 0.1}]


def test_modules_that_moved_and_gaps_that_grew_when_measured():
    a = Measured(made_run([10] * 5), {"0 (Linear)": {"forward_s": 0.001, "backward_s": 0.002},
                                      "2 (Linear)": {"forward_s": 0.001, "backward_s": 0.001}},
                 gaps_table(0.2, 1.0))
    b = Measured(made_run([30] * 5), {"0 (Linear)": {"forward_s": 0.005, "backward_s": 0.010},
                                      "2 (Linear)": {"forward_s": 0.001, "backward_s": 0.001}},
                 gaps_table(3.1, 0.5))
    d = nt.diff(a, b)
    assert d.modules == [Moved("0 (Linear)", 0.003, 0.015)]
    assert d.gaps == [Moved("evaluation", 0.2, 3.1)]   # steps are the step; loader start shrank
    lines = d.text().splitlines()
    assert "modules whose time moved: 0 (Linear) 3 ms -> 15 ms" in lines
    assert "gaps that grew: evaluation 200 ms -> 3.10 s" in lines


def test_not_measured_where_a_run_has_no_such_method_or_it_returns_nothing():
    a = Measured(made_run([10] * 5), [], gaps_table(0.2, 1.0))
    b = made_run([30] * 5)
    b.modules = b.gaps = None   # a Run from before run.modules() and run.gaps()
    d = nt.diff(a, b)
    assert d.modules is None and d.gaps is None
    measured = Measured(b, {"0 (Linear)": {"forward_s": 1e-3, "backward_s": 2e-3}},
                        gaps_table(0.2, 1.0))
    zeros = Measured(b, {"0 (Linear)": {"forward_s": 0.0, "backward_s": 0.0}}, gaps_table(0, 0))
    d = nt.diff(measured, zeros)   # every row zero: nothing was measured
    assert d.modules is None and d.gaps is None
    assert "modules whose time moved: not measured" in d.text().splitlines()
    assert "gaps that grew: not measured" in d.text().splitlines()


def test_plain_dict_and_readable_repr():
    d = nt.diff(made_run([10] * 5), made_run([30] * 5, wait_frac=0.7))
    plain = d.to_dict()
    assert json.loads(json.dumps(plain))["ratio"] == pytest.approx(3.0)
    assert plain["headline"] == first_line(d)
    assert plain["cause"] == "data wait" and plain["split"]["data wait"] == (0.1, 0.7)
    assert repr(d) == f"<nbtrain.Diff: {first_line(d)}>"
    assert first_line(d) == ("b is 3.0x slower a step: data wait 10% -> 70% of the step "
                             "(1 ms -> 21 ms)")


# -- bad input -------------------------------------------------------------------------------------
def test_not_a_run_names_what_to_pass():
    with pytest.raises(TypeError, match=r"nt.diff: a must be a Run .*nt.load_run\(id\).*got str"):
        nt.diff("run-1", made_run([10] * 5))


def test_a_run_with_no_step_records_names_the_fix():
    empty = Run(nt.TrainConfig())
    with pytest.raises(ValueError, match=r"run b \(created\) has no step records .* lower "
                                         r"TrainConfig.log_every"):
        nt.diff(made_run([10] * 5), empty)


def test_nt_diff_and_nt_diff_class_are_the_tools():
    assert nt.diff is diff and nt.Diff is Diff
