"""`nbtrain demo`'s structure: its rows, their labels, and the verdicts as pure functions of
given figures (no wall clock: what a machine measures is bench/demo_stability.py's)."""
import math
import time

import pytest
import torch

import nbtrain
from nbtrain.tools import demo, demo_text
from nbtrain.auto import budget, workers as probe
from nbtrain.tools.demo import Line, Row, lines_of, more_rounds, paired_ratio, spread, verdict


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
    x, _ = nbtrain.data.datasets.digits("train")
    planned = demo.EPOCHS * math.ceil(len(x) / demo.BATCH_SIZE)
    assert planned * budget.SHARE >= probe._fewest_steps([(0, 1), (0, 2)])


def test_the_median_interval_is_the_binomial_order_statistics():
    assert demo.median_interval(range(1, 101)) == (40, 61)     # n=100: the 40th and 61st
    assert demo.median_interval(range(1, 21)) == (6, 15)
    assert demo.median_interval(range(1, 7)) == (1, 6)         # the fewest with a 95% one
    assert all(math.isnan(v) for v in demo.median_interval([1, 2, 3, 4, 5]))
    # an outlier moves it little: it is ranks, not values
    assert demo.median_interval(list(range(1, 20)) + [10_000]) == (6, 15)


def test_spread_is_the_median_intervals_width_and_narrows_with_rounds():
    pattern = [90.0, 95.0, 100.0, 105.0, 110.0]
    assert math.isnan(spread(pattern))                         # too few for an interval
    assert spread(pattern * 2) == pytest.approx(0.20)           # n=10: the 2nd to the 9th
    assert spread(pattern * 8) == pytest.approx(0.10)           # n=40: the 14th to the 27th
    assert spread(pattern * 40) == 0.0                          # n=200: all within 100


def test_a_runs_rate_is_the_median_of_its_records_after_the_first():
    class Records:
        def __init__(self, *rates):
            self.rates = rates

        def records(self, kind):
            return [{"samples_per_s": r} for r in self.rates]
    # the first record's steps allocate the optimizer's state: slow, and left out
    assert demo.steady_rate(Records(100.0, 200.0, 210.0, 1.0)) == 200.0
    assert demo.steady_rate(Records(100.0)) == 100.0
    assert math.isnan(demo.steady_rate(Records()))


def test_paired_ratio_is_the_median_of_the_per_round_ratios():
    # round 2 was a slow spell for both: the pair's ratio stays 1.2
    assert paired_ratio([120.0, 60.0, 124.0], [100.0, 50.0, 100.0]) == pytest.approx(1.2)


@pytest.mark.parametrize("ratio,low,high,expected", [
    (1.20, 1.15, 1.25, ("gain", "1.20x faster")),
    (1.10, 1.02, 1.12, ("gain", "1.10x faster")),     # FACTOR itself, and there
    (1.06, 1.04, 1.08, ("noise", "under 10%")),       # there, but under FACTOR
    (1.12, 0.98, 1.20, ("noise", "within noise")),    # the interval takes in no change
    (0.97, 0.93, 0.99, ("noise", "under 10%")),
    (0.80, 0.75, 0.85, ("loss", "1.25x slower")),
    (1.30, math.nan, math.nan, ("noise", "too few rounds to tell")),   # under 6 rounds
])
def test_a_change_counts_where_its_interval_leaves_out_1_and_it_is_at_least_the_factor(
        ratio, low, high, expected):
    assert demo.FACTOR == 1.10
    assert verdict(ratio, low, high) == expected


def test_the_first_rounds_run_only_where_the_rounds_an_interval_needs_fit_twice_the_budget():
    """On a busy machine (the full runs ended 120 s in, a round ~7 s): the 6 rounds a 95%
    interval needs would end past 158 s, and fewer give figures that are noise: none."""
    twice = 2 * demo.BUDGET_S
    assert demo.FEWEST_ROUNDS == 6
    assert not more_rounds(0, ["plain loop"], twice - 6 * 7 + 1, 7)
    assert more_rounds(0, ["plain loop"], twice - 6 * 7, 7)
    assert not more_rounds(3, ["plain loop"], twice - 3 * 5 + 1, 5)   # 3 more still needed
    assert more_rounds(3, ["plain loop"], twice - 3 * 5, 5)
    assert more_rounds(6, ["plain loop"], twice - 5, 5)                # then one at a time
    assert more_rounds(0, [], 10, 1, min_rounds=1, max_rounds=1)       # fewer asked for


def test_rounds_go_on_until_every_interval_is_narrow_or_a_cap():
    assert more_rounds(1, [], 10, 1)                              # fewer than the minimum
    assert not more_rounds(1, ["plain loop"], demo.BUDGET_S, demo.BUDGET_S + 1)   # swamped
    assert not more_rounds(demo.MIN_ROUNDS, [], 30, 1)            # every figure settled
    assert more_rounds(demo.MIN_ROUNDS, ["plain loop"], 30, 1)    # one still too wide
    assert not more_rounds(demo.MIN_ROUNDS, ["plain loop"], demo.BUDGET_S - 0.5, 1)  # too late
    assert not more_rounds(demo.MAX_ROUNDS, ["plain loop"], 30, 1)   # the round cap
    assert not more_rounds(5, ["plain loop"], 10, 1, max_rounds=5)  # the cap under the minimum


def test_the_timing_rounds_alternate_their_order_and_time_only_differing_rows():
    """ABBA: a row's pair with the row above runs in both orders, so a trend of the machine
    over the round weighs on neither; a row that resolved to the settings above is not
    timed again."""
    rows = rows_of([[1] * 8] * 5, [PLAIN_SETTINGS] + [dict(PLAIN_SETTINGS, amp="bf16")] * 4)
    demo.mark_same_settings(rows)
    assert [row.same_as for row in rows] == [None, None] + ["+ batched fetch"] * 3
    assert demo.round_order(rows, 0) == rows[:2] and demo.round_order(rows, 1) == rows[1::-1]


def test_time_in_rounds_runs_the_timed_rows_in_abba_order():
    settings = [dict(PLAIN_SETTINGS, num_threads=t) for t in (2, 2, 1, 4, 8)]
    rows = rows_of([[1.0]] * 5, settings)
    demo.mark_same_settings(rows)   # "+ batched fetch" is the plain loop again
    for row in rows:
        row.runs = []
    called = []

    def timing_run(row):
        called.append(row.label)
        return FakeRun(1000.0, {})
    rounds = demo.time_in_rounds(rows, timing_run, time.perf_counter(), lambda _: None,
                                 min_rounds=3, max_rounds=3)
    a, b, c, d = "plain loop", "+ measured threads", "+ mixed precision", "+ fused optimizer"
    assert rounds == 3 and called == [a, b, c, d, d, c, b, a, a, b, c, d]
    assert rows[1].runs == [] and all(len(row.runs) == 3 for row in rows if row is not rows[1])
    # a machine too busy for even one round in twice the budget: none
    assert demo.time_in_rounds(rows, timing_run, time.perf_counter() - 3 * demo.BUDGET_S,
                               lambda _: None) == 0


def test_no_round_starts_where_the_full_runs_left_too_little_and_the_demo_says_so():
    rows = rows_of([[1.0]] * 2, [PLAIN_SETTINGS, dict(PLAIN_SETTINGS, batched_fetch=True)])
    for row in rows:
        row.runs = []
    said, start = [], time.perf_counter() - 120
    rounds = demo.time_in_rounds(rows, lambda row: pytest.fail("a round ran"), start,
                                 said.append, first_round_s=7.0)
    assert rounds == 0 and len(said) == 1
    assert said[0].startswith("not timing the rows: the full runs ended 120 s into the demo, "
                              "and the 6 rounds a 95% interval needs (~7.0 s each, from the "
                              "full runs) would end past 158 s (twice the budget)"), said


def test_a_rounds_estimate_is_each_timed_rows_full_run_scaled_to_a_timing_run():
    rows = rows_of([[1.0]] * 3, [PLAIN_SETTINGS] * 3, same=(2,))
    rows[0].full_s, rows[1].full_s, rows[2].full_s = 36.8, 18.4, 99.0   # 368 steps each
    assert demo.round_estimate(rows, timing_steps=23) == pytest.approx(2.3 + 1.15)
    rows[1].full_s = 0.0                                # not timed (bench/demo_aa.py's rows)
    assert demo.round_estimate(rows, timing_steps=23) == pytest.approx(2.3)


def test_a_round_without_a_rate_is_left_out_of_the_ratios():
    assert demo.per_round_ratios([120.0, math.nan, 0.0, 110.0], [100.0, 100.0, 100.0, 100.0]) \
        == pytest.approx([1.2, 1.1])


def test_unsettled_names_the_figures_still_wider_than_their_targets():
    steady = [1000.0] * 12
    rows = rows_of([steady, steady, steady, [1000.0, 1200.0] * 6, steady],
                   [PLAIN_SETTINGS, dict(PLAIN_SETTINGS, batched_fetch=True),
                    dict(PLAIN_SETTINGS, batched_fetch=True, num_threads=1),
                    dict(PLAIN_SETTINGS, batched_fetch=True, num_threads=1, amp="bf16"),
                    dict(PLAIN_SETTINGS, batched_fetch=True, num_threads=1, amp="bf16",
                         optimizer_impl="fused")])
    assert demo.unsettled(rows) == ["+ mixed precision",
                                    "+ mixed precision / + measured threads",
                                    "+ fused optimizer / + mixed precision"]
    rows[3].runs = rows[2].runs
    assert demo.unsettled(rows) == []


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
        return dict(self._split, val_acc=0.975, steps=368)


def rows_of(rates_by_row, settings_by_row, same=()):
    """Rows of FakeRuns: a full run each (its settings and time split), timing runs at
    `rates`."""
    rows = []
    for (toggle, rates), settings in zip(zip((None,) + demo.CPU_TOGGLES, rates_by_row),
                                         settings_by_row):
        label = "plain loop" if toggle is None else toggle.label
        rows.append(Row(label, toggle, FakeRun(rates[0], settings),
                        [FakeRun(r, settings) for r in rates]))
    for i in same:
        rows[i].same_as = rows[i - 1].same_as or rows[i - 1].label
    return rows


PLAIN_SETTINGS = dict(batched_fetch=False, num_threads=2, amp="off", optimizer_impl="for-loop")


def test_the_table_says_what_each_row_brought_from_given_figures():
    fetched = dict(PLAIN_SETTINGS, batched_fetch=True)
    fused = dict(fetched, optimizer_impl="fused")
    rows = rows_of([[4500, 4600, 4400] * 3, [4550, 4650, 4450] * 3, [0], [0],
                    [5100, 5200, 5000] * 3],
                   [PLAIN_SETTINGS, fetched, fetched, fetched, fused], same=(2, 3))
    lines = lines_of(rows)
    assert [line.kind for line in lines] == ["base", "noise", "same", "same", "gain"]
    assert lines[1].words == "under 10%"   # 1.01x, every round: there, but small
    assert lines[4].vs_above == pytest.approx(5100 / 4550, rel=1e-3)   # against the timed row
    assert lines[4].vs_plain == pytest.approx(5100 / 4500, rel=1e-3)
    assert lines[2].words == "same settings as '+ batched fetch'"
    assert lines[3].words == "same settings as '+ batched fetch'"   # the timed row, not the one above
    assert "num_threads=2: why num_threads" in lines[2].why
    # a toggle that does not pay says why, from the time split of the row above
    assert lines[1].why.startswith("loading (the data wait) was 1% of the 13.0 ms step above; "
                                   "batched fetch pays where loading is a large share")
    assert "(here: batched_fetch=True)" in lines[1].why and lines[4].why == ""
    table = demo_text.comparison_table(lines)
    assert "under 10%" in table and "1.12x faster" in table and "-" in table
    # the ratio comes with its interval: the 2nd and 8th of 9 per-round ratios
    assert (lines[4].low, lines[4].high) == pytest.approx((5200 / 4650, 5000 / 4450))
    assert "1.12-1.12" in table and "1.01-1.01" in table
    assert [row.split("  ")[0] for row in table.splitlines()[1:]] == [r.label for r in rows]


def test_every_row_shows_what_its_toggle_resolved_to_and_why():
    fetched = dict(PLAIN_SETTINGS, batched_fetch=True)
    rows = rows_of([[1], [1], [1], [1], [1]], [PLAIN_SETTINGS] + [fetched] * 4)
    text = demo_text.resolved_table(demo.resolved_entries(rows))
    assert "+ measured threads" in text and "num_threads=2" in text and "why num_threads" in text
    assert "optimizer_impl=for-loop" in text and "amp=off" in text


def test_the_own_loop_line_gives_the_ratio_and_what_the_watch_applied():
    own = dict(as_written_ms=14.0, watched_ms=12.6, ratio=0.9, low=0.88, high=0.93, rounds=3,
               epochs=4, applied={"batched_fetch": True, "optimizer_impl": "fused"})
    text = demo_text.own_loop_text(own)
    assert "as written 14.00 ms/step, under nt.watch() 12.60 ms/step: 0.90x the time" in text
    assert "batched_fetch=True, optimizer_impl=fused" in text
    assert demo_text.own_loop_text(dict(own, applied={})).endswith("the watch applied nothing")


def test_a_timing_run_replays_what_the_full_run_resolved_so_it_measures_nothing(tmp_path):
    x, y = nbtrain.data.datasets.digits("train")
    config = nbtrain.TrainConfig(epochs=1, batch_size=64, store=False)
    row = Row("+ fused optimizer", demo.OPTIMIZER, nbtrain.fit(
        demo.demo_cnn(), (x[:256], y[:256]), torch.nn.functional.cross_entropy,
        config=config, progress=False))
    replay = demo.timing_config(config, row)
    assert (replay.max_steps, replay.log_every) == (demo.TIMING_STEPS, demo.TIMING_LOG_EVERY)
    assert (replay.amp, replay.optimizer_impl) == (row.settings["amp"], "fused")
    again = nbtrain.fit(demo.demo_cnn(), (x[:256], y[:256]), torch.nn.functional.cross_entropy,
                        config=replay, progress=False)
    assert all(again.resolved[k][0] == v for k, v in row.settings.items()
               if k in again.resolved)                        # the same choices ...
    assert row.first.resolved["num_threads"][1] != "asked for"
    assert again.resolved["amp"][1] == again.resolved["num_threads"][1] == "asked for"  # ... untimed


def test_the_plain_loop_first_run_is_every_rows_basis():
    line = lines_of(rows_of([[100] * demo.FEWEST_ROUNDS], [PLAIN_SETTINGS]))[0]
    assert isinstance(line, Line) and line.kind == "base" and line.vs_plain == 1.0


def test_a_rounds_machine_speed_is_factored_out_of_each_rows_rate():
    """The rounds are blocks: a slow spell of the machine slows every row of its round
    alike, and a row's spread is what is left once that is factored out."""
    drift = [1.0, 0.7, 1.2, 0.9, 1.1, 0.8, 1.0, 1.3] * 2       # the machine's speed
    plain = [1000 * d for d in drift]
    fused = [1500 * d for d in drift]
    assert demo.spread(plain) > 0.3
    assert demo.round_adjusted(plain, [fused]) == pytest.approx([1000 * 1.0] * 16)
    wobbly = [r * (1.05 if k % 2 else 0.95) for k, r in enumerate(fused)]   # its own noise
    adjusted = demo.round_adjusted(wobbly, [plain])
    assert demo.spread(adjusted) == pytest.approx(0.10 / 1.0, abs=0.011)
    assert demo.round_adjusted(plain, []) == plain                 # no other row: as it is
    assert len(demo.round_adjusted(plain, [fused[:3] + [math.nan] + fused[4:]])) == 15
    # a round's speed from the other rows that have a rate in it
    assert len(demo.round_adjusted(plain, [fused[:3] + [math.nan] + fused[4:], fused])) == 16


def test_a_rows_own_noise_is_not_factored_out_with_the_rounds():
    """Each row is read against the others only: its own wobble stays in its spread (were
    it in the round's speed, a row alone with one other would read half its noise)."""
    steady = [1000.0] * 16
    wobbly = [1000.0 * (1.1 if k % 2 else 0.9) for k in range(16)]
    fused = dict(PLAIN_SETTINGS, optimizer_impl="fused")
    rows = rows_of([steady, wobbly], [PLAIN_SETTINGS, fused])
    rows = [rows[0], Row("+ fused optimizer", demo.OPTIMIZER, rows[1].first, rows[1].runs)]
    adjusted = demo.adjusted_rates(rows)
    assert demo.spread(adjusted["+ fused optimizer"]) == pytest.approx(0.2)
    assert demo.spread(adjusted["plain loop"]) == pytest.approx(0.2)   # against a wobbly one


def test_the_table_spread_is_the_adjusted_one_and_the_raw_one_is_kept():
    drift = [1.0, 0.7, 1.2, 0.9, 1.1, 0.8, 1.0, 1.3] * 2
    fused = dict(PLAIN_SETTINGS, optimizer_impl="fused")
    rows = rows_of([[1000 * d for d in drift], [1500 * d for d in drift]],
                   [PLAIN_SETTINGS, fused])
    rows = [rows[0], Row("+ fused optimizer", demo.OPTIMIZER, rows[1].first, rows[1].runs)]
    lines = lines_of(rows)
    assert [line.spread for line in lines] == [0.0, 0.0]
    assert all(line.raw_spread > 0.3 for line in lines)
    assert demo.unsettled(rows) == []


def untimed_rows(rounds):
    """The CPU rows, '+ mixed precision' the row above again, each timed row with
    `rounds` runs whose rates differ wildly (a busy machine: 17x from one to the next)."""
    rates = [[82.0, 1421.0, 90.0, 1300.0, 85.0][:rounds],
             [1421.0, 90.0, 1400.0, 80.0, 1390.0][:rounds], [4101.0] * rounds, [0.0],
             [5534.0] * rounds]
    rows = rows_of([r or [1.0] for r in rates],
                   [PLAIN_SETTINGS, dict(PLAIN_SETTINGS, batched_fetch=True),
                    dict(PLAIN_SETTINGS, batched_fetch=True, num_threads=1),
                    dict(PLAIN_SETTINGS, batched_fetch=True, num_threads=1),
                    dict(PLAIN_SETTINGS, batched_fetch=True, num_threads=1,
                         optimizer_impl="fused")], same=(3,))
    for row in rows:
        row.runs = [] if row.same_as else row.runs[:rounds]
    return rows


@pytest.mark.parametrize("rounds", [0, 1, 5])
def test_a_row_timed_in_too_few_rounds_says_why_in_words_never_nan_or_a_ratio(rounds):
    """The busy machine of issue 56: 0 rounds printed nan and nanx in every timed row, and
    1 round printed 17.27x 'too few rounds to tell'. A figure that could not be measured,
    or is noise (no 95% interval under 6 rounds), is said in words."""
    why = demo_text.untimed_words(rounds, demo.FEWEST_ROUNDS, False, demo.BUDGET_S)
    lines = lines_of(untimed_rows(rounds))
    assert [line.kind for line in lines] == ["untimed", "untimed", "untimed", "same", "untimed"]
    table = demo_text.comparison_table(lines)
    assert "nan" not in table.lower()
    for line, row in zip(lines, table.splitlines()[1:]):   # no rate, spread or ratio: "-"
        assert row[:row.index("97.5%")].split() == line.label.split() + ["-"], row
    assert all(line.why == "" for line in lines if line.kind == "untimed")  # pays: unknown
    rounds_ = {0: "0 rounds", 1: "1 round", 5: "5 rounds"}[rounds]
    assert why == (f"the machine was too busy: {rounds_} completed within the budget "
                   "(158 s), and a 95% interval needs 6")
    words = "not timed (0 rounds)" if rounds == 0 else f"too few rounds to tell ({rounds_})"
    assert table.splitlines()[1].endswith(f"97.5%  {words}")


def test_too_few_rounds_because_fewer_were_asked_for_says_so():
    assert demo_text.untimed_words(1, 6, True, demo.BUDGET_S) == \
        "max_rounds=1, and a 95% interval needs 6 rounds"
    assert demo._untimed(1, 1, demo.BUDGET_S) == demo_text.untimed_words(1, 6, True, 79.0)
    assert demo._untimed(3, 400, demo.BUDGET_S).startswith("the machine was too busy: 3 "
                                                           "rounds completed")
    assert demo._untimed(6, 400, demo.BUDGET_S) == ""


def test_a_demo_with_no_rounds_prints_no_nan_and_says_it_could_not_time_the_rows():
    untimed = demo._untimed(0, demo.MAX_ROUNDS, demo.BUDGET_S)
    own = dict(as_written_ms=60.44, watched_ms=33.57, ratio=0.84, low=0.24, high=1.14,
               rounds=3, epochs=4, applied={"batched_fetch": True})
    result = demo.Demo(untimed_rows(0), 0, 278.0, own, untimed)
    text = demo_text.demo_text(result.outcome("cpu"))
    assert "nan" not in text.lower() and "timed in 0 rounds" not in text
    assert ("the rows that differ were then to be timed in rounds of one short run each, "
            "and have no figures: the machine was too busy: 0 rounds completed within the "
            "budget (158 s), and a 95% interval needs 6.") \
        in " ".join(text.split())
    whys = text[text.index("where a toggle does not pay here:"):]
    assert "+ mixed precision: amp=off" in whys    # changed nothing: it does not pay
    assert "+ batched fetch:" not in whys and "+ fused optimizer:" not in whys   # unknown
    assert text.endswith("demo: 278 s on cpu")


def test_an_own_loop_too_late_for_the_budget_is_not_run_and_says_so():
    """The own loop's 6 whole calls: each round one as written (about the plain loop's full
    run) and one watched (about the defaults'), at 4 of the full runs' 16 epochs."""
    rows = untimed_rows(0)
    rows[0].full_s, rows[-1].full_s = 160.0, 33.0      # the full runs at load ~9 on 2 cores
    estimate = demo.own_loop_estimate(rows, 16, 4, 3)
    assert estimate == pytest.approx(3 * (160 + 33) / 4)
    words = demo_text.own_loop_untimed_words(415.0, estimate, 6, demo.BUDGET_S)
    assert words == ("your own loop under nt.watch(): not timed: the machine was too busy: "
                     "the demo was 415 s in, and the 6 whole calls (~145 s, from the full "
                     "runs) would end past 158 s (twice the budget)")
    result = demo.Demo(rows, 0, 543.0, None, demo._untimed(0, 400, 79.0), words)
    text = demo_text.demo_text(result.outcome("cpu"))
    assert " ".join(words.split()) in " ".join(text.split()) and "nan" not in text.lower()


def test_an_own_loop_ratio_within_the_noise_of_its_rounds_is_said_in_words():
    own = dict(as_written_ms=60.44, watched_ms=33.57, ratio=0.84, low=0.24, high=1.14,
               rounds=3, epochs=4, applied={})
    text = demo_text.own_loop_text(own)
    assert "0.84x" not in text
    assert "under nt.watch() 33.57 ms/step: within the noise of 3 interleaved rounds, " \
        "0.24-1.14: no difference to tell; the watch applied nothing" in text


def test_the_busy_note_says_the_demo_will_run_past_its_budget_and_why(monkeypatch):
    monkeypatch.setattr(demo_text, "load_now", lambda: 4.7)
    monkeypatch.setattr(demo_text, "available_cores", lambda: 2)
    note = demo_text.busy_note(demo.BUDGET_S)
    assert note.startswith("note: the machine is busy (load 4.7 on 2 core(s))")
    assert "the demo will likely run past its budget (79 s for the rows): each row still " \
        "runs in full, since its settings are measured on it; the timing rounds stop by " \
        "158 s, and what they could not time is said so." in note
    monkeypatch.setattr(demo_text, "load_now", lambda: 1.5)
    assert demo_text.busy_note(demo.BUDGET_S) == ""


def test_the_text_imports_nothing_of_the_demo_and_the_demo_imports_the_text_once():
    """No import circle: demo_text is text over plain data, demo.py runs and calls it."""
    import ast
    import inspect

    def imported(module):
        return [(node.module or "", node.col_offset)
                for node in ast.walk(ast.parse(inspect.getsource(module)))
                if isinstance(node, ast.ImportFrom)]
    assert not [m for m, _ in imported(demo_text) if m.endswith("demo")]
    assert [(m, col) for m, col in imported(demo) if m == "demo_text"] == [("demo_text", 0)]
