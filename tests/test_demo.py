"""`nbtrain demo`'s structure: its rows, their labels, and the verdicts as pure functions of
given figures (no wall clock: what a machine measures is bench/demo_stability.py's)."""
import math

import pytest

import nbtrain
from nbtrain import demo, probe
from nbtrain.demo import Line, Row, lines_of, more_rounds, paired_ratio, spread, verdict


def changed_fields(configs):
    values = list(configs.values())
    return [{k for k, v in b.to_dict().items() if a.to_dict()[k] != v}
            for a, b in zip(values, values[1:])]


@pytest.mark.parametrize("toggles", [demo.CPU_TOGGLES, demo.GPU_TOGGLES])
def test_each_row_hands_its_own_fields_to_auto_and_the_last_is_the_defaults(toggles):
    configs = demo.demo_configs(nbtrain.TrainConfig(), toggles)
    assert list(configs) == ["plain loop"] + [t.label for t in toggles]
    assert list(configs.values())[-1] == nbtrain.TrainConfig()
    changed = changed_fields(configs)
    # a field the plain loop sets to torch's own value (num_workers=0 ...) may not change
    assert all(c <= set(t.fields) for c, t in zip(changed, toggles))
    plain = configs["plain loop"]
    assert (plain.amp, plain.batched_fetch, plain.optimizer_impl, plain.pin_memory) == \
        ("off", False, "for-loop", False)


def test_the_rows_follow_the_article_data_path_then_precision_then_the_optimizer():
    cpu = [t.label for t in demo.CPU_TOGGLES]
    assert cpu == ["+ batched fetch", "+ measured threads", "+ mixed precision",
                   "+ fused optimizer"]
    gpu = [t.label for t in demo.GPU_TOGGLES]
    assert gpu.index("+ pinned copies") < gpu.index("+ prefetch") < \
        gpu.index("+ mixed precision") < gpu.index("+ fused optimizer")
    assert gpu.index("+ batched fetch") < gpu.index("+ workers, threads") < \
        gpu.index("+ pinned copies")
    assert demo.toggles_for("cuda:0") is demo.GPU_TOGGLES
    assert demo.toggles_for("cpu") is demo.CPU_TOGGLES


def test_the_runs_are_long_enough_for_the_threads_probe_to_measure():
    """'+ measured threads' is true only if its run is long enough that "auto" measures."""
    x, _ = nbtrain.datasets.digits("train")
    planned = demo.EPOCHS * math.ceil(len(x) / demo.BATCH_SIZE)
    assert planned * probe.BUDGET_SHARE >= probe._fewest_steps([(0, 1), (0, 2)])


def test_spread_is_the_middle_half_over_the_median():
    assert spread([100.0]) != spread([100.0])   # NaN: one run has no spread
    assert spread([90.0, 100.0, 110.0]) == pytest.approx(0.10)
    # an outlier widens max-min, barely the middle half
    assert spread([98.0, 99.0, 100.0, 101.0, 102.0, 10.0]) < 0.05


def test_paired_ratio_is_the_median_of_the_per_round_ratios():
    # round 2 was a slow spell for both: the pair's ratio stays 1.2
    assert paired_ratio([120.0, 60.0, 124.0], [100.0, 50.0, 100.0]) == pytest.approx(1.2)


@pytest.mark.parametrize("ratio,noise,expected", [
    (1.20, 0.05, ("gain", "1.20x faster")),
    (1.04, 0.05, ("noise", "within noise")),     # inside the spread
    (1.02, 0.00, ("noise", "within noise")),     # inside the floor, however tight the rounds
    (0.955, 0.01, ("noise", "within noise")),
    (0.80, 0.05, ("loss", "1.25x slower")),
    (0.94, 0.08, ("noise", "within noise")),
    (1.35, 0.40, ("noise", "within noise")),     # a big gain, but the rounds spread wider
    (1.10, math.nan, ("gain", "1.10x faster")),  # one run each: the floor only
    (1.06, 0.02, ("gain", "1.06x faster")),
])
def test_a_gain_within_the_spread_is_within_noise(ratio, noise, expected):
    assert verdict(ratio, noise) == expected


def test_rounds_go_on_until_the_spread_is_small_or_a_cap():
    assert more_rounds(1, [0.01], 10, 10)                      # fewer than the minimum
    assert not more_rounds(1, [0.01], demo.BUDGET_S, demo.BUDGET_S + 1)   # a swamped machine
    assert not more_rounds(3, [0.05, 0.08], 30, 10)            # every row within 10%
    assert more_rounds(3, [0.05, 0.15], 30, 10)                # one row too wide
    assert not more_rounds(3, [0.05, 0.15], demo.BUDGET_S - 5, 10)   # the next ends too late
    assert not more_rounds(9, [0.05, 0.15], 30, 1)             # the round cap


class FakeRun:
    """What lines_of reads of a Run: resolved, records, summary()."""

    def __init__(self, rate, settings, data_wait=0.01, step_s=0.013):
        self.resolved = {k: (v, f"why {k}") for k, v in settings.items()}
        self._rate, self._split = rate, dict(data_wait_frac=data_wait, copy_frac=0.0,
                                              compute_frac=1 - data_wait, step_time_s=step_s)
        self.state = "finished"

    def records(self, kind):
        return [{"samples_per_s": self._rate}]

    def summary(self):
        return dict(self._split, val_acc=0.975)


def rows_of(rates_by_row, settings_by_row, same=()):
    rows = []
    for (toggle, rates), settings in zip(zip((None,) + demo.CPU_TOGGLES, rates_by_row),
                                         settings_by_row):
        label = "plain loop" if toggle is None else toggle.label
        rows.append(Row(label, toggle, [FakeRun(r, settings) for r in rates]))
    for i in same:
        rows[i].same_as = rows[i - 1].same_as or rows[i - 1].label
    return rows


PLAIN_SETTINGS = dict(batched_fetch=False, num_threads=2, amp="off", optimizer_impl="for-loop")


def test_the_table_says_what_each_row_brought_from_given_figures():
    fetched = dict(PLAIN_SETTINGS, batched_fetch=True)
    fused = dict(fetched, optimizer_impl="fused")
    rows = rows_of([[4500, 4600, 4400], [4550, 4650, 4450], [0], [0], [5000, 5100, 4900]],
                   [PLAIN_SETTINGS, fetched, fetched, fetched, fused], same=(2, 3))
    lines = lines_of(rows)
    assert [line.kind for line in lines] == ["base", "noise", "same", "same", "gain"]
    assert lines[4].vs_above == pytest.approx(5000 / 4550, rel=1e-3)   # against the timed row
    assert lines[4].vs_plain == pytest.approx(5000 / 4500, rel=1e-3)
    assert lines[2].words == "same settings as '+ batched fetch'"
    assert lines[3].words == "same settings as '+ batched fetch'"   # the timed row, not the one above
    assert "num_threads=2: why num_threads" in lines[2].why
    # a toggle that does not pay says why, from the time split of the row above
    assert lines[1].why.startswith("loading (the data wait) was 1% of the 13.0 ms step above; "
                                   "batched fetch pays where loading is a large share")
    assert "(here: batched_fetch=True)" in lines[1].why and lines[4].why == ""
    table = demo.comparison_table(lines)
    assert "within noise" in table and "1.10x faster" in table and "-" in table
    # the verdict shows what it measured the gain against: here the floor, the rounds tight
    assert lines[1].noise == lines[4].noise == demo.NOISE_FLOOR and "(noise 5%)" in table
    assert [row.split("  ")[0] for row in table.splitlines()[1:]] == [r.label for r in rows]


def test_every_row_shows_what_its_toggle_resolved_to_and_why():
    fetched = dict(PLAIN_SETTINGS, batched_fetch=True)
    rows = rows_of([[1], [1], [1], [1], [1]], [PLAIN_SETTINGS] + [fetched] * 4)
    text = demo.resolved_table(rows)
    assert "+ measured threads" in text and "num_threads=2" in text and "why num_threads" in text
    assert "optimizer_impl=for-loop" in text and "amp=off" in text


def test_the_own_loop_line_gives_the_ratio_and_what_the_watch_applied():
    own = dict(as_written_ms=14.0, watched_ms=12.6, ratio=0.9, low=0.88, high=0.93, rounds=3,
               epochs=4, applied={"batched_fetch": True, "optimizer_impl": "fused"})
    text = demo.own_loop_text(own)
    assert "as written 14.00 ms/step, under nt.watch() 12.60 ms/step: 0.90x the time" in text
    assert "batched_fetch=True, optimizer_impl=fused" in text
    assert demo.own_loop_text(dict(own, applied={})).endswith("the watch applied nothing")


def test_the_plain_loop_first_run_is_every_rows_basis():
    line = lines_of(rows_of([[100, 100, 100]], [PLAIN_SETTINGS]))[0]
    assert isinstance(line, Line) and line.kind == "base" and line.vs_plain == 1.0
