"""autotune(): valid candidates only, successive halving, the fastest pick, a cache."""
import importlib
import json
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import nbtrain as nt
from nbtrain.tools.autotune import autotune, candidate_settings, search, search_space
from nbtrain.tools.tuning_cache import NOT_SPEED

at = importlib.import_module("nbtrain.tools.autotune")   # the module: nt.autotune is the function

from conftest import mlp


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    return tmp_path


def tiny_tensors(n=2048, features=8):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, features, generator=gen), torch.randint(0, 3, (n,), generator=gen)


class SleepyDataset(Dataset):
    """Each sample waits ~2 ms (like a read from a network disk): workers overlap the waits."""

    def __init__(self, n=256):
        self.x, self.y = tiny_tensors(n)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(0.002)
        return self.x[i], self.y[i]


def space_of(data, device="cpu", space=None, **base):
    kind = at.data_kind(data)
    return kind, search_space(kind, data, nt.TrainConfig(**base), torch.device(device), space)


# -- which settings are tried ----------------------------------------------------------------
def test_the_search_space_is_exactly_the_settings_declared_tuned():
    """config.py marks what autotune searches (speed="tuned"); a newly declared one needs
    candidate values here, and the cache key leaves out every setting that is not speed."""
    from nbtrain.config import SETTINGS
    for data in (tiny_tensors(), SleepyDataset(8)):
        _, space = space_of(data)
        assert set(space) == set(at.TUNABLE)
    assert NOT_SPEED >= set(at.TUNABLE) and {"lr", "seed", "epochs"} <= NOT_SPEED
    assert {"optimizer", "grad_accum_steps", "compile"}.isdisjoint(NOT_SPEED)
    assert {n for n, m in SETTINGS.items() if m.speed == "tuned"} == set(at.TUNABLE)


def test_tensor_candidates_on_cpu_are_valid_and_only_what_can_matter():
    kind, space = space_of(tiny_tensors(), space={"amp": ["off"]})
    cands = candidate_settings(kind, space)
    base = nt.TrainConfig(device="cpu")
    for c in cands:
        base.replace(**c)   # every candidate is a valid config
        assert c["pin_memory"] is False and c["channels_last"] is False   # CPU, flat rows
        assert (c["num_workers"] > 0) == (c["batched_fetch"] is False)
        assert c["prefetch_factor"] is None and c["persistent_workers"] is False
    assert {c["batch_size"] for c in cands} == {64, 128}
    assert any(c["batched_fetch"] for c in cands)


def test_dataset_candidates_try_prefetch_and_persistence_only_with_workers():
    kind, space = space_of(SleepyDataset(8), space={"amp": ["off"]})
    cands = candidate_settings(kind, space)
    assert kind == "dataset" and all("batched_fetch" not in c for c in cands)
    for c in cands:
        nt.TrainConfig(device="cpu").replace(**c)
        if c["num_workers"] == 0:
            assert c["prefetch_factor"] is None and c["persistent_workers"] is False
    with_workers = [c for c in cands if c["num_workers"]]
    assert {c["prefetch_factor"] for c in with_workers} == {None, 4}
    assert {c["persistent_workers"] for c in with_workers} == {False, True}


def test_cuda_candidates_pin_and_keep_data_on_the_device():
    """Built without a GPU: the space is a pure function of the device type."""
    kind, space = space_of(tiny_tensors(), device="cuda", space={"amp": ["off", "bf16"]})
    cands = candidate_settings(kind, space)
    resident = [c for c in cands if c["data_on_device"] is True]
    assert resident and all(c["pin_memory"] is False and c["batched_fetch"] for c in resident)
    assert any(c["pin_memory"] is True for c in cands)
    assert all(c["data_on_device"] == "auto" for c in cands if c["num_workers"])


def test_images_try_channels_last_and_loaders_keep_their_own_data_path():
    x = torch.randn(32, 1, 8, 8)
    _, space = space_of((x, torch.zeros(32, dtype=torch.long)))
    assert space["channels_last"] == [False, True]
    loader = DataLoader(TensorDataset(x, torch.zeros(32, dtype=torch.long)), batch_size=8)
    kind, space = space_of(loader, space={"amp": ["off"]})
    assert candidate_settings(kind, space) == [
        {"amp": "off", "channels_last": False}, {"amp": "off", "channels_last": True}]


def test_space_rejects_what_cannot_be_tuned():
    with pytest.raises(ValueError) as info:
        space_of(tiny_tensors(), space={"lr": [1e-3]})
    assert "cannot tune 'lr'" in str(info.value) and "num_workers" in str(info.value)
    with pytest.raises(ValueError) as info:
        space_of(tiny_tensors(), space={"batch_size": 64})
    assert "non-empty list" in str(info.value)


# -- the search, with a fake clock: deterministic -----------------------------------------------
class FakeMeasure:
    """Samples/s from a formula instead of training: the search logic alone. The config
    as given (settings=None) resolves like "auto" on 2 cores: one worker, fp32."""

    def __init__(self, speed):
        self.speed, self.calls, self.tuned_keys = speed, [], []
        self.as_given = dict(dataset_candidates()[0], num_workers=1)

    def __call__(self, settings, seconds):
        self.calls.append((settings, seconds))
        effective = dict(settings or self.as_given)
        return dict(samples_per_s=self.speed(effective), measured_s=seconds, steps=10,
                    error=None, settings=effective, as_given=settings is None,
                    wall_s=seconds + 0.001)


def dataset_candidates():
    kind, space = space_of(SleepyDataset(8), space={"amp": ["off", "bf16"]})
    return candidate_settings(kind, space)


def fake_speed(c):
    """Workers help, 2 most; bf16 a little; persistent workers a little more."""
    return (1000 * (1 + c.get("num_workers", 0)) + 150 * (c.get("amp") == "bf16")
            + 150 * bool(c.get("persistent_workers")) + 2 * c.get("batch_size", 64))


def test_successive_halving_prunes_and_refines():
    cands = dataset_candidates()
    measure = FakeMeasure(fake_speed)
    trials, _, _ = search(measure, cands, budget_s=1.0, base=nt.TrainConfig())
    per_round = [sum(t["round"] == r for t in trials) for r in range(5)]
    # stage 1: 12 data-path x precision x batch combos + your config; stage 2: refinements
    assert per_round == [13, 5, 2, 4, 2]
    assert [t["stage"] for t in trials] == [1] * 20 + [2] * 6
    seconds = sorted({s for _, s in measure.calls})
    assert seconds[0] < seconds[-1]   # survivors are measured longer
    last = [(c["prefetch_factor"], c["persistent_workers"]) for c, _ in measure.calls[-4:]]
    assert last[:2] == last[2:] and len(set(last)) == 2   # final: two interleaved passes
    assert len(trials[-1]["repeats"]) == 2
    best = at.pick(trials, nt.TrainConfig())
    assert best["settings"]["num_workers"] == 2 and best["settings"]["persistent_workers"]
    assert best["settings"]["amp"] == "bf16" and best["settings"]["batch_size"] == 128


def test_within_noise_the_simpler_setting_wins():
    """A worker process or bf16 must beat the plain setting by more than TIE (3%)."""
    cands = dataset_candidates()
    speed = lambda c: 1000 * (1 + 0.01 * c.get("num_workers", 0)) * (1.005 if c.get("amp") == "bf16" else 1)
    trials, _, _ = search(FakeMeasure(speed), cands, budget_s=1.0, base=nt.TrainConfig())
    best = at.pick(trials, nt.TrainConfig())
    assert best["settings"]["num_workers"] == 0 and best["settings"]["amp"] == "off"


def test_a_spent_budget_ends_the_search_with_the_best_so_far():
    class Slow(FakeMeasure):   # every trial costs a second beyond its timed part
        def __call__(self, settings, seconds):
            return dict(super().__call__(settings, seconds), wall_s=seconds + 1.0)
    trials, _, notes = search(Slow(fake_speed), dataset_candidates(), budget_s=2.0,
                              base=nt.TrainConfig())
    assert {t["round"] for t in trials} == {0} and len(trials) == 13   # round 0 always runs
    assert at.pick(trials, nt.TrainConfig())["settings"]["num_workers"] == 2
    assert "budget ran out" in notes[0]


def test_a_failing_candidate_loses_and_all_failing_says_why():
    cands = dataset_candidates()

    class Flaky(FakeMeasure):
        def __call__(self, settings, seconds):
            out = super().__call__(settings, seconds)
            if settings and settings.get("num_workers") == 2:
                out.update(samples_per_s=0.0, error="RuntimeError: out of memory")
            return out
    trials, _, _ = search(Flaky(fake_speed), cands, budget_s=1.0, base=nt.TrainConfig())
    assert at.pick(trials, nt.TrainConfig())["settings"]["num_workers"] == 1
    broken = [dict(t, error="ValueError: boom") for t in trials]
    with pytest.raises(RuntimeError) as info:
        at.pick(broken, nt.TrainConfig())
    assert "every trial failed" in str(info.value) and "boom" in str(info.value)


def test_plan_fits_the_rounds_in_the_budget():
    plan = at.Plan(10.0, [[13, 5, 2], [4, 2]])
    plan.overhead_s = 0.1
    plan.left_s = lambda: 10.0   # a frozen clock
    t0 = plan.seconds(0, 0)   # every stage's last round is 9x, the one before 3x as long
    timed = 13 * t0 + 5 * 3 * t0 + 2 * 9 * t0 + 4 * 3 * t0 + 2 * 9 * t0
    assert timed + 0.1 * 30 == pytest.approx(10.0)   # last rounds: 2 passes each
    plan.left_s = lambda: 10.0 - (t0 + 0.1)   # one trial took what it was given
    assert plan.seconds(0, 0, done=1) == pytest.approx(t0)
    plan.left_s = lambda: 10.0 - 13 * (t0 + 0.1)   # so did round 0
    assert plan.seconds(0, 1) == pytest.approx(3 * t0)
    plan.left_s = lambda: 10.0 - 13 * (t0 + 0.1) - 5 * (3 * t0 + 0.1)
    assert plan.seconds(0, 2) == pytest.approx(9 * t0 / 2)   # a last round: 2 passes of T/2
    plan.left_s = lambda: -1.0   # over budget: trials shrink to the floor, never to zero
    assert plan.seconds(0, 2) == at.MIN_TRIAL_S and not plan.affordable(2, final=True)


# -- real trials ------------------------------------------------------------------------------
def test_in_memory_tensors_get_batched_fetch_not_workers():
    """Per-sample workers on tensors pay a __getitem__ per row, a collate and a pickle
    per batch; one index op per batch is >10x faster here."""
    x, y = tiny_tensors(4096, 32)
    tuning = autotune(lambda: nn.Linear(32, 3), (x, y), F.cross_entropy, budget_s=3, cache=False,
                      config=nt.TrainConfig(device="cpu", batch_size=512),
                      space={"amp": ["off"], "batch_size": [512], "num_workers": [1, 2]})
    assert tuning.settings["batched_fetch"] is True and tuning.settings["num_workers"] == 0
    assert tuning.config.batched_fetch is True and tuning.config.batch_size == 512
    assert {t["settings"].get("num_workers") for t in tuning.trials} == {0, 1, 2}


def test_waiting_dataset_gets_workers():
    # 512 samples: an epoch long enough that forking two workers from the suite's process
    # (large after the corpus's programs) is a small part of it
    tuning = autotune(mlp, SleepyDataset(512), F.cross_entropy, budget_s=3, cache=False,
                      config=nt.TrainConfig(device="cpu", batch_size=16),
                      space={"amp": ["off"], "batch_size": [16], "num_workers": [0, 2],
                             "prefetch_factor": [None], "persistent_workers": [False]})
    assert tuning.settings["num_workers"] == 2
    run = nt.fit(mlp(), SleepyDataset(64), F.cross_entropy, progress=False,
                 config=tuning.config.replace(max_steps=3))
    assert run.resolved["num_workers"][0] == 2


def test_the_answer_is_cached_per_model_data_and_machine(cache_in_tmp, monkeypatch):
    monkeypatch.setattr(at, "busy_note", lambda: "")   # an idle machine, whatever CI runs
    x, y = tiny_tensors(512)
    built = []

    def make_model():
        built.append(1)
        return mlp()
    kwargs = dict(config=nt.TrainConfig(device="cpu"), budget_s=1,
                  space={"amp": ["off"], "batch_size": [32], "num_workers": [0]})
    first = autotune(make_model, (x, y), F.cross_entropy, **kwargs)
    assert not first.from_cache and len(built) > 1
    files = list((cache_in_tmp / "autotune").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["about"]["data"]["input"] == [[8], "torch.float32"]

    def no_training(*args, **kw):
        raise AssertionError("a cached answer must not train")
    monkeypatch.setattr(at, "fit", no_training)
    built.clear()
    second = autotune(make_model, (x, y), F.cross_entropy, **kwargs)
    assert second.from_cache and len(built) == 1   # one build, for the model's signature
    assert second.config == first.config and "from the cache" in repr(second)
    with pytest.raises(RuntimeError, match="must not train"):   # another shape: measured again
        autotune(make_model, (x[:, :4], y), F.cross_entropy, **kwargs)


def test_table_and_config(monkeypatch):
    x, y = tiny_tensors(512)
    tuning = autotune(mlp, (x, y), F.cross_entropy, config=nt.TrainConfig(device="cpu"),
                      budget_s=1, cache=False,
                      space={"amp": ["off"], "num_workers": [1], "batch_size": [32, 64]})
    text = repr(tuning)
    assert text.startswith("autotune: ") and "fastest: " in text and "samples/s" in text
    assert "your config" in text and "*" in text
    assert isinstance(tuning.config, nt.TrainConfig) and tuning.samples_per_s > 0
    assert "<table>" in tuning._repr_html_()
    import IPython.display
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kw: shown.append(obj))
    tuning._ipython_display_()
    assert shown and "text/html" in shown[-1]


def test_a_busy_machine_is_noted(monkeypatch):
    import psutil
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval: 85.0)
    assert "CPUs 85% busy" in at.busy_note() and "not cached" in at.busy_note()
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval: 10.0)
    assert at.busy_note() == ""


def test_trials_timed_on_a_busy_machine_are_not_cached(cache_in_tmp, monkeypatch):
    monkeypatch.setattr(at, "busy_note", lambda: "other processes kept the CPUs 90% busy")
    x, y = tiny_tensors(512)
    tuning = autotune(mlp, (x, y), F.cross_entropy, config=nt.TrainConfig(device="cpu"),
                      budget_s=1, space={"amp": ["off"], "batch_size": [32], "num_workers": [0]})
    assert "90% busy" in " ".join(tuning.notes)
    assert not list((cache_in_tmp / "autotune").glob("*.json"))


def test_ctrl_c_stops_the_tuning_not_just_a_trial(monkeypatch):
    class Interrupted:
        state = "interrupted"
    monkeypatch.setattr(at, "fit", lambda *a, **kw: Interrupted())
    x, y = tiny_tensors(64)
    with pytest.raises(KeyboardInterrupt):
        autotune(mlp, (x, y), F.cross_entropy, config=nt.TrainConfig(device="cpu"), budget_s=1,
                 cache=False)


def test_a_given_dataloader_is_tuned_only_where_it_can_be():
    x, y = tiny_tensors(256)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    tuning = autotune(mlp, loader, F.cross_entropy, config=nt.TrainConfig(device="cpu"),
                      budget_s=1, cache=False, space={"amp": ["off"]})
    assert set(tuning.settings) == {"amp", "channels_last"}
    assert tuning.config.amp == "off"


def test_a_failed_cache_write_keeps_the_old_entry_and_leaves_no_temp_file(cache_in_tmp):
    entry = {"version": at.CACHE_VERSION, "trials": []}
    at.save_cached("k", entry)
    circular = {"version": at.CACHE_VERSION}
    circular["self"] = circular
    with pytest.raises(ValueError, match="Circular"):   # json.dump fails mid-write
        at.save_cached("k", circular)
    assert [p.name for p in (cache_in_tmp / "autotune").iterdir()] == ["k.json"]
    assert at.load_cached("k") == entry
