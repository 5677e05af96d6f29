"""`nbtrain demo`: the digits CNN trained as a plain loop would, then with nbtrain's toggles
added one at a time in the order of the article nbtrain grew from (the data path, the
precision, the optimizer kernel; on a GPU also pinned copies and prefetch), so each row
says what its toggle brought here; then the same CNN as a loop you wrote, under nt.watch.

Two phases. First every row runs once in full (16 epochs, with validation): long enough
that each "auto" measures (the threads probe needs ~340 steps, the bf16 trial its rounds),
and these runs give the settings each row resolved to, its accuracy and its time split.
A row whose settings resolve to those of the row above is that case again and says so.
Then the timing: the other rows replayed with the settings they resolved to, one epoch
each (23 steps, ~0.2 s), in rounds whose order alternates (forward, then backward): at
least MIN_ROUNDS, then until every row's rate and every ratio has an interval within its
target, or the next round would end past BUDGET_S from the demo's start. On a busy
machine the first rounds may end up to twice BUDGET_S, and only where the FEWEST_ROUNDS
a 95% interval needs fit: a row timed in fewer has no figures (they would be noise) and
says why in words. Why so short: a shared machine's speed wanders from one second to the
next, as much for short runs as for long ones (bench/machine_noise.py); what narrows a
comparison is the number of pairs, and short runs give several a second. A row's gain
is the median of its per-round ratios to the timed row above; it counts where the 95%
interval of that median leaves out 1 and the gain is at least 10% (FACTOR), else the row
says "within noise" (or "under 10%"). Its runs are measurements for the table, kept out
of the run store (nt.runs()).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..config import SETTINGS, TrainConfig
from ..data import datasets
from ..entry import fit, watch
from .demo_text import (Line, Outcome, busy_note, demo_text, no_rounds_note,
                        own_loop_untimed_words, shown, untimed_row_words, untimed_words)

BATCH_SIZE = 64
# 16 passes over digits' 1,438 training images: 368 steps a run. The threads probe takes
# ~17 steps and at most budget.SHARE of a run, so a run shorter than 340 steps would keep
# torch's threads unmeasured; 16 epochs leave margin.
EPOCHS = 16
TIMING_STEPS, TIMING_LOG_EVERY = 23, 5   # each timing run: one epoch, ~0.2 s, 5 records
MIN_ROUNDS, MAX_ROUNDS = 12, 400
LEVEL = 0.95           # the intervals: 95% for the median (distribution-free)
# The fewest rounds with a 95% interval of the median (median_interval): a row timed in
# fewer has figures that are noise, so it gets none, and rounds that cannot reach it are
# not worth their time.
FEWEST_ROUNDS = 6
TARGET_SPREAD = 0.10   # rounds go on until every row's rate interval is at most this wide
TARGET_RATIO_SPREAD = 0.04   # ... and every ratio's (+-2%), or the budget ends
# A change counts where it is both there (its 95% interval leaves out 1) and at least 10%,
# asv's default --factor for reporting a benchmark's change: a smaller real change is
# printed with its interval but not called a gain (bench/demo_aa.py checks that two rows of
# the same settings read alike).
FACTOR = 1.10
BUDGET_S = 79.0        # no round starts that would end after this (the rows' part of 90 s)
OWN_LOOP_EPOCHS, OWN_LOOP_ROUNDS = 4, 3

# Everything a hand-written loop leaves at PyTorch's defaults: fp32, per-sample
# DataLoader with no workers and no pinning, the data where it is, the for-loop optimizer,
# torch's threads.
PLAIN = dict(amp="off", batched_fetch=False, num_workers=0, pin_memory=False,
             data_on_device=False, prefetch_to_device=False, optimizer_impl="for-loop")


@dataclass(frozen=True)
class Toggle:
    """A row: the fields it hands to "auto" (the rows above keep theirs), the share of the
    step it works on (summary()'s `<share>_frac`) and where it pays: the row's why-line
    when it does not pay here."""
    label: str
    fields: Tuple[str, ...]
    share: str   # "data_wait", "copy" or "compute"
    pays: str


# The article's order: the data path (batched fetch, then workers with the threads they
# share the cores with), precision, the optimizer kernel.
BATCHED_FETCH = Toggle("+ batched fetch", ("batched_fetch", "data_on_device", "pin_memory",
                                           "prefetch_to_device"), "data_wait",
                       "batched fetch pays where loading is a large share of the step")
THREADS = Toggle("+ measured threads", ("num_workers", "num_threads"), "compute",
                 "measured threads pay where other processes or workers hold the cores")
PRECISION = Toggle("+ mixed precision", ("amp",), "compute",
                   "bf16 pays where matmuls and convolutions are most of the step, on units "
                   "made for it")
OPTIMIZER = Toggle("+ fused optimizer", ("optimizer_impl",), "compute",
                   "one fused kernel pays where the for-loop's launches per parameter tensor "
                   "are a large share of the step")
CPU_TOGGLES = (BATCHED_FETCH, THREADS, PRECISION, OPTIMIZER)
# On a GPU the copies to it too: pinned, then made a batch ahead, then not made at all.
GPU_TOGGLES = (
    Toggle("+ batched fetch", ("batched_fetch",), "data_wait", BATCHED_FETCH.pays),
    Toggle("+ workers, threads", ("num_workers", "num_threads"), "data_wait",
           "workers pay where loading is a large share of the step"),
    Toggle("+ pinned copies", ("pin_memory",), "copy",
           "pinned memory pays where copies are a large share of the step"),
    Toggle("+ prefetch", ("prefetch_to_device",), "copy",
           "a copy made a batch ahead pays where copies are a large share of the step"),
    Toggle("+ data on the GPU", ("data_on_device",), "copy",
           "data kept on the GPU pays where copies are a large share of the step"),
    PRECISION, OPTIMIZER,
)


def digits_cnn() -> nn.Module:
    return nn.Sequential(                                        # (N, 1, 8, 8)
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),                                         # (N, 64, 4, 4)
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(),
        nn.Linear(128, 10))


def demo_cnn() -> nn.Module:
    """The demo's CNN: two small convolutions, then two 512-wide layers (0.53M parameters).
    Its step splits between convolutions, matmuls and the optimizer's update of every
    parameter, so each toggle has work of its own to speed up (digits_cnn() is nearly all
    convolution, where an optimizer's gain hides in the noise)."""
    return nn.Sequential(                                        # (N, 1, 8, 8)
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(),                           # (N, 32 * 4 * 4)
        nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 10))


def toggles_for(device: str) -> Tuple[Toggle, ...]:
    return GPU_TOGGLES if device.startswith("cuda") else CPU_TOGGLES


def demo_configs(base: TrainConfig, toggles: Sequence[Toggle] = CPU_TOGGLES) -> dict:
    """'plain loop', then one toggle more per row, ending at `base` ("auto" everywhere)."""
    plain = dict(PLAIN, num_threads=torch.get_num_threads())   # a plain loop keeps torch's
    configs = {"plain loop": base.replace(**plain)}
    for toggle in toggles:
        for name in toggle.fields:
            plain.pop(name)
        configs[toggle.label] = base.replace(**plain)
    return configs


# -- the figures: pure functions of the rates -------------------------------------------------
def steady_rate(run) -> float:
    """A run's samples/s without its slow spells: the median of its records' rates after
    the first (whose steps allocate a new model's optimizer state), where summary()'s
    whole-run mean takes a pause of another process on the cores in full."""
    rates = [r["samples_per_s"] for r in run.records("train")]
    rates = rates[1:] if len(rates) > 1 else rates
    return statistics.median(rates) if rates else math.nan


def median_interval(values: Sequence[float], level: float = LEVEL) -> Tuple[float, float]:
    """The distribution-free `level` interval of the median of `values`: the k-th smallest
    and the k-th largest, k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2.
    No machine's noise is normal, and this assumes nothing of it. (NaN, NaN) where `values`
    are too few for such an interval (fewer than 6 at 95%)."""
    ordered, n = sorted(values), len(values)
    k, below = 0, 0.0
    while k < n:
        below += math.comb(n, k) / 2 ** n   # P(Binomial(n, 1/2) <= k)
        if below > (1 - level) / 2:
            break
        k += 1
    if k == 0:
        return math.nan, math.nan
    return ordered[k - 1], ordered[n - k]


def spread(values: Sequence[float]) -> float:
    """How well the median of `values` is known: its 95% interval's width over it (0.1 is
    +-5%). It narrows as rounds are added (about as 1/sqrt(rounds)); NaN for too few."""
    low, high = median_interval(values)
    median = statistics.median(values) if values else math.nan
    return (high - low) / median if median else math.nan


def round_adjusted(rates: Sequence[float], others: Sequence[Sequence[float]]) -> List[float]:
    """A row's per-round rates with each round's machine speed factored out: `rates[k]`
    over the geometric mean of the other timed rows' rates in round k, each relative to
    its own median (1.0 in a round of typical speed). The rounds are blocks: all rows of
    one ran within a second, so a slower spell of the shared machine slows them alike
    (bench/machine_noise.py measures how it wanders), and
    what is left is how well this row's own rate is known. A round's speed comes from the
    other rows that have a rate in it; a round where this row or all of them have none is
    left out; no other timed row: the rates as they are."""
    usable = [row for row in others if _measured(row)]
    if not usable:
        return _measured(rates)
    typical = [statistics.median(_measured(row)) for row in usable]
    adjusted = []
    for k, rate in enumerate(rates):
        speeds = [row[k] / med for row, med in zip(usable, typical)
                  if k < len(row) and row[k] > 0]
        if rate > 0 and speeds:
            adjusted.append(rate / math.exp(statistics.fmean(map(math.log, speeds))))
    return adjusted


def per_round_ratios(values: Sequence[float], above: Sequence[float]) -> List[float]:
    """`values[k] / above[k]`: both ran in round k, seconds apart, so the machine's
    slower spells hit both. A round where either has no rate (no records) is left out."""
    return [a / b for a, b in zip(values, above) if a > 0 and b > 0]


def paired_ratio(values: Sequence[float], above: Sequence[float]) -> float:
    """The median of the per-round ratios."""
    return statistics.median(per_round_ratios(values, above))


def verdict(ratio: float, low: float, high: float) -> Tuple[str, str]:
    """(kind, words) of a row `ratio` times as fast as the row above, the 95% interval of
    that ratio `low`-`high`: 'gain' or 'loss' where the interval leaves out 1 and the
    change is at least FACTOR, else 'noise': "within noise" where the interval takes in 1,
    "under 10%" where the change is there but smaller, "too few rounds to tell" where
    there is no interval (fewer than 6 rounds)."""
    if math.isnan(low):
        return "noise", "too few rounds to tell"
    if low <= 1 <= high:
        return "noise", "within noise"
    if ratio >= FACTOR:
        return "gain", f"{ratio:.2f}x faster"
    if ratio <= 1 / FACTOR:
        return "loss", f"{1 / ratio:.2f}x slower"
    return "noise", f"under {FACTOR - 1:.0%}"


def more_rounds(done: int, unsettled: Sequence[str], elapsed_s: float, round_s: float,
                min_rounds: int = MIN_ROUNDS, max_rounds: int = MAX_ROUNDS,
                budget_s: float = BUDGET_S) -> bool:
    """Whether to run another timing round (`round_s`: the last one's time, or before the
    first the estimate of round_estimate): up to `min_rounds` while the rounds an interval
    still needs (FEWEST_ROUNDS) would end within twice the budget (a machine busy with
    other work: the busy note says so), since fewer give figures that are noise; then
    while a figure is `unsettled` (its interval wider than its target), up to
    `max_rounds`, if one more round ends in budget."""
    if done >= max_rounds:
        return False
    if done < min_rounds:
        needed = max(1, min(FEWEST_ROUNDS, min_rounds) - done)
        return elapsed_s + needed * round_s <= 2 * budget_s
    if elapsed_s + round_s > budget_s:
        return False
    return bool(unsettled)


# -- the rows ------------------------------------------------------------------------------------
@dataclass
class Row:
    label: str
    toggle: Optional[Toggle]              # None: the plain loop
    first: object = None                  # the full run: what "auto" resolved to, and why
    runs: list = field(default_factory=list)   # the timing runs, one a round
    same_as: Optional[str] = None         # the row above whose settings this one resolved to
    full_s: float = 0.0                   # the full run's wall time (0: not timed)

    @property
    def rates(self) -> List[float]:
        return [steady_rate(r) for r in self.runs]

    @property
    def settings(self) -> dict:
        """The settings the row's full run resolved to (config fields only)."""
        return {k: v for k, (v, _) in self.first.resolved.items() if k in SETTINGS}

    def share(self, name: str) -> float:
        """summary()'s `<name>_frac` of the full run: the time split of a whole training."""
        return self.first.summary()[f"{name}_frac"]


def lines_of(rows: List[Row]) -> List[Line]:
    """The table's figures and verdicts: each timed row against the timed row above it
    (a row that resolved to the settings above it is that row again). A row with fewer
    than FEWEST_ROUNDS rounds has no interval, so its figures are noise: it has none, and
    says so in words (the text under the table says why: Demo.untimed)."""
    out, basis, plain = [], None, rows[0]
    adjusted = adjusted_rates(rows)
    for row in rows:
        acc = row.first.summary().get("val_acc", math.nan)
        if row.same_as is not None:
            out.append(Line(row.label, math.nan, math.nan, math.nan, math.nan, acc, "same",
                            f"same settings as {row.same_as!r}", why_same(row)))
            continue
        rates, own = row.rates, adjusted[row.label]
        ratios = per_round_ratios(rates, basis.rates) if basis else _measured(rates)
        if len(ratios) < FEWEST_ROUNDS:
            out.append(Line(row.label, math.nan, math.nan, math.nan, math.nan, acc,
                            "untimed", untimed_row_words(len(ratios))))
        elif basis is None:
            out.append(Line(row.label, statistics.median(own), spread(own), 1.0, 1.0, acc,
                            "base", "", raw_spread=spread(_measured(rates))))
        else:
            out.append(_timed_line(row, basis, plain, own, acc))
        basis = row
    return out


def _timed_line(row: Row, basis: Row, plain: Row, own: List[float], acc: float) -> Line:
    """A timed row's line: its rate, its ratio to the timed row above with that ratio's
    95% interval and verdict, and its ratio to the plain loop."""
    ratios = per_round_ratios(row.rates, basis.rates)
    ratio, (low, high) = statistics.median(ratios), median_interval(ratios)
    kind, words = verdict(ratio, low, high)
    vs_plain = per_round_ratios(row.rates, plain.rates)
    return Line(row.label, statistics.median(own), spread(own), ratio,
                statistics.median(vs_plain) if vs_plain else math.nan, acc, kind,
                words, why_not(row, basis) if kind != "gain" else "", low, high,
                spread(_measured(row.rates)))


def adjusted_rates(rows: List[Row]) -> Dict[str, List[float]]:
    """Each timed row's rates, each round's machine speed factored out (round_adjusted)."""
    timed = {row.label: row.rates for row in rows if row.same_as is None}
    return {label: round_adjusted(rates, [r for other, r in timed.items() if other != label])
            for label, rates in timed.items()}


def unsettled(rows: List[Row]) -> List[str]:
    """The figures whose interval is still wider than its target: a row's rate, or its
    ratio to the timed row above."""
    timed = [row for row in rows if row.same_as is None]
    adjusted = adjusted_rates(rows)
    wide = [row.label for row in timed if not spread(adjusted[row.label]) <= TARGET_SPREAD]
    return wide + [f"{row.label} / {above.label}" for above, row in zip(timed, timed[1:])
                   if not spread(per_round_ratios(row.rates, above.rates))
                   <= TARGET_RATIO_SPREAD]


def _measured(rates: Sequence[float]) -> List[float]:
    """The rates of the runs that have one (a run without records has NaN)."""
    return [r for r in rates if r > 0]


def why_same(row: Row) -> str:
    """A row that changed nothing: what its toggle resolved to, and why (the run's reasons
    for the fields it hands to "auto" that are not the plain loop's value anyway)."""
    resolved = row.first.resolved
    return "; ".join(f"{name}={shown(resolved[name][0])}: {resolved[name][1]}"
                     for name in row.toggle.fields if name in resolved)


def why_not(row: Row, above: Row) -> str:
    """A toggle that did not pay here: the share of the step it works on, from the row
    above's own time split, where it pays, and what it resolved to."""
    share = above.share(row.toggle.share)
    step_ms = above.first.summary()["step_time_s"] * 1e3
    what = {"data_wait": "loading (the data wait)", "copy": "copying to the device",
            "compute": "compute"}[row.toggle.share]
    changed = {k: v for k, v in row.settings.items() if above.settings.get(k) != v}
    return (f"{what} was {share:.0%} of the {step_ms:.1f} ms step above; {row.toggle.pays}"
            + (f" (here: {', '.join(f'{k}={shown(v)}' for k, v in changed.items())})"
               if changed else ""))


def mark_same_settings(rows: List[Row]) -> None:
    """A row whose full run resolved to the settings of the row above is that case again."""
    for above, row in zip(rows, rows[1:]):
        if row.settings == above.settings:
            row.same_as = above.same_as or above.label


def timing_config(base: TrainConfig, row: Row, steps: int = TIMING_STEPS) -> TrainConfig:
    """`base` with every setting the row's full run resolved to, for `steps`, a record
    every TIMING_LOG_EVERY: a run of it measures nothing (no probe, no trial), it only
    does what the full run chose."""
    return base.replace(**dict(row.settings, max_steps=steps, log_every=TIMING_LOG_EVERY))


def round_order(rows: List[Row], k: int) -> List[Row]:
    """The timed rows (not those that are a row above again), forward in even rounds and
    backward in odd ones: each pair of neighbours runs in both orders, so a trend of the
    machine's speed over a round cancels (ABBA)."""
    timed = [row for row in rows if row.same_as is None]
    return timed if k % 2 == 0 else timed[::-1]


# -- the demo ------------------------------------------------------------------------------------
@dataclass
class Demo:
    rows: List[Row]
    rounds: int
    wall_s: float
    own_loop: Optional[dict] = None
    untimed: str = ""   # why the rows have too few rounds for figures ('' where they do not)
    own_loop_untimed: str = ""   # why the own loop was not timed ('' where it was)

    @property
    def lines(self) -> List[Line]:
        return lines_of(self.rows)

    @property
    def runs(self) -> Dict[str, list]:
        return {row.label: [row.first] + row.runs for row in self.rows}

    @property
    def finished(self) -> bool:
        return all(r.state == "finished" for runs in self.runs.values() for r in runs)

    def outcome(self, device: str) -> Outcome:
        """The demo as plain data, for demo_text."""
        return Outcome(self.lines, resolved_entries(self.rows),
                       self.rows[0].first.summary()["steps"], self.rounds, self.untimed,
                       FACTOR, self.own_loop, self.own_loop_untimed, self.wall_s, device)


def run_demo(epochs: int = EPOCHS, max_rounds: int = MAX_ROUNDS, progress: bool = False,
             min_rounds: int = MIN_ROUNDS, budget_s: float = BUDGET_S,
             timing_steps: int = TIMING_STEPS,
             own_loop_epochs: int = OWN_LOOP_EPOCHS, own_loop_rounds: int = OWN_LOOP_ROUNDS,
             say: Callable[[str], None] = print) -> Demo:
    """Run every row in full, then time the rows that differ in alternating rounds; print
    the table, the settings each row resolved to, and the own-loop line; return the Demo."""
    start = time.perf_counter()
    x, y = datasets.digits("train")
    # no FLOP count (the table shows no MFU): its ~1.7 s go to the timing rounds
    base = TrainConfig(epochs=epochs, batch_size=BATCH_SIZE, optimizer="adamw", lr=3e-3,
                       scheduler="onecycle", seed=0, store=False, count_flops=False)
    busy = busy_note(budget_s)
    if busy:
        say(busy)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    configs = demo_configs(base, toggles_for(device))
    rows = [Row(label, toggle) for (label, toggle)
            in zip(configs, (None,) + toggles_for(device))]
    bar = _progress_bar() if progress else False

    def train(config: TrainConfig, progress=False, **val):
        torch.manual_seed(0)
        return fit(demo_cnn(), (x, y), nn.functional.cross_entropy, config=config,
                   progress=progress, **val)

    val = datasets.digits("val")
    for row in rows:   # the full runs: with the bar if asked for (300 timing runs: never)
        say(f"{row.label}: {epochs} epochs, every auto measured")
        begin = time.perf_counter()
        row.first = train(configs[row.label], val_data=val, progress=bar)
        row.full_s = time.perf_counter() - begin
    mark_same_settings(rows)
    rounds = time_in_rounds(rows, lambda row: train(timing_config(base, row, timing_steps)),
                            start, say, min_rounds, max_rounds, budget_s,
                            round_estimate(rows, timing_steps))
    demo = Demo(rows, rounds, 0.0, untimed=_untimed(rounds, max_rounds, budget_s))
    # the own loop's whole calls, like the first rounds, only where they end within twice
    # the budget: on a machine too busy for that its ratio would be noise, and late
    own_s = own_loop_estimate(rows, epochs, own_loop_epochs, own_loop_rounds)
    elapsed = time.perf_counter() - start
    if elapsed + own_s <= 2 * budget_s:
        demo.own_loop = own_loop_ratio(x, y, own_loop_epochs, own_loop_rounds, say)
    else:
        demo.own_loop_untimed = own_loop_untimed_words(elapsed, own_s, 2 * own_loop_rounds,
                                                       budget_s)
        say(demo.own_loop_untimed)
    demo.wall_s = time.perf_counter() - start
    say("\n" + demo_text(demo.outcome(device)) + ("\n\n" + busy if busy else ""))
    return demo


def _untimed(rounds: int, max_rounds: int, budget_s: float) -> str:
    """Why the rows have no figures, where too few rounds ran for an interval; '' else."""
    if rounds >= FEWEST_ROUNDS:
        return ""
    return untimed_words(rounds, FEWEST_ROUNDS, rounds >= max_rounds, budget_s)


def resolved_entries(rows: List[Row]) -> List[Tuple[str, str, str]]:
    """What each row's toggle resolved to, and why (its full run's run.resolved), as
    (the row's label on its first entry, 'name=value', why)."""
    entries = []
    for row in rows[1:]:
        resolved = row.first.resolved
        names = [name for name in row.toggle.fields if name in resolved]
        entries += [(row.label if i == 0 else "", f"{name}={shown(resolved[name][0])}",
                     resolved[name][1]) for i, name in enumerate(names)]
    return entries


def time_in_rounds(rows: List[Row], timing_run: Callable[[Row], object], start: float,
                   say: Callable[[str], None], min_rounds: int = MIN_ROUNDS,
                   max_rounds: int = MAX_ROUNDS, budget_s: float = BUDGET_S,
                   first_round_s: float = 0.0) -> int:
    """Append a `timing_run(row)` to each timed row per round, in round_order, while
    more_rounds says so (the demo began at `start`; `first_round_s`: the first round's
    estimate, round_estimate); returns the rounds run."""
    timed = [row for row in rows if row.same_as is None]
    rounds, round_s = 0, first_round_s
    if not more_rounds(0, unsettled(rows), time.perf_counter() - start, round_s, min_rounds,
                       max_rounds, budget_s):
        if max_rounds:   # else none were asked for
            say(no_rounds_note(time.perf_counter() - start, round_s, FEWEST_ROUNDS,
                               budget_s))
        return 0
    say(f"timing {len(timed)} rows in rounds of a short run each, the order alternating")
    while more_rounds(rounds, unsettled(rows), time.perf_counter() - start, round_s,
                      min_rounds, max_rounds, budget_s):
        round_start = time.perf_counter()
        for row in round_order(rows, rounds):
            row.runs.append(timing_run(row))
        rounds += 1
        round_s = time.perf_counter() - round_start
        if rounds % 20 == 0:
            say(f"  {rounds} rounds, {time.perf_counter() - start:.0f} s")
    return rounds


def round_estimate(rows: Sequence[Row], timing_steps: int = TIMING_STEPS) -> float:
    """A timing round's seconds before any is run: each timed row's full run, scaled from
    its steps to `timing_steps` (an over-estimate: the full run also validated and
    measured). 0 where the full runs were not timed."""
    return sum(row.full_s * timing_steps / row.first.summary()["steps"]
               for row in rows if row.same_as is None and row.full_s)


def own_loop_estimate(rows: Sequence[Row], epochs: int, own_epochs: int, rounds: int) -> float:
    """The own loop's seconds before it runs: each round a call as written (about the plain
    loop's full run) and one watched (about the last row's, nbtrain's defaults), scaled
    from the full runs' `epochs` to `own_epochs`. 0 where the full runs were not timed."""
    return rounds * (rows[0].full_s + rows[-1].full_s) * own_epochs / epochs


def _rotated(rows: list, k: int) -> list:
    k %= len(rows)
    return rows[k:] + rows[:k]


def _progress_bar():
    from ..views.progress import (
        attach_progress,  # the UI hands the bar to fit (a view, above it)
    )
    return attach_progress


# -- your own loop, watched ------------------------------------------------------------------------
def the_loop(model, loader, epochs: int) -> int:
    """The loop a tutorial writes; returns its steps."""
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    steps = 0
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            steps += 1
    return steps


def own_loop_ratio(x, y, epochs: int, rounds: int, say: Callable[[str], None] = print) -> dict:
    """The same CNN in a hand-written loop, as written and inside `nt.watch()` (whole
    calls, the watch's start and end included), interleaved: ms per step of each, the
    median of the per-round ratios, and what the watch applied."""
    times: Dict[str, List[float]] = {"as written": [], "nt.watch()": []}
    run = None
    for k in range(rounds):
        for way in _rotated(list(times), k):
            say(f"your own loop, round {k + 1}: {way}")
            torch.manual_seed(0)
            model = demo_cnn()
            loader = DataLoader(TensorDataset(x, y), batch_size=BATCH_SIZE, shuffle=True,
                                generator=torch.Generator().manual_seed(1))
            begin = time.perf_counter()
            if way == "as written":
                steps = the_loop(model, loader, epochs)
            else:
                with watch(progress=False, store=False) as run:
                    steps = the_loop(model, loader, epochs)
            times[way].append((time.perf_counter() - begin) / steps)
    ratios = [w / a for w, a in zip(times["nt.watch()"], times["as written"])]
    applied = {k: v for k, (v, _) in run.resolved.items()   # what changes the loop's speed
               if k in ("amp", "batched_fetch", "optimizer_impl", "pin_memory",
                        "prefetch_to_device") and v not in (False, "off")}
    return {"as_written_ms": statistics.median(times["as written"]) * 1e3,
            "watched_ms": statistics.median(times["nt.watch()"]) * 1e3,
            "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "rounds": rounds, "epochs": epochs, "applied": applied, "state": run.state}












