"""`nbtrain demo`: the digits CNN trained as a plain loop would, then with nbtrain's toggles
added one at a time in the order of the article nbtrain grew from (the data path, the
precision, the optimizer kernel; on a GPU also pinned copies and prefetch), so each row
says what its toggle brought here; then the same CNN as a loop you wrote, under nt.watch.

A shared machine is noisy (one run of a fraction of a second could be off by 50%): each
run is long enough to measure its "auto" choices (the threads probe needs ~340 steps),
its rate is its steady one (the median of its records, so a slow spell of another process
moves it little), and the cases are run in interleaved rounds, the order rotating, until
every row's spread is at most 10% (at least 3 rounds, at most 9, within a time budget;
fewer than 3 only where the machine is so busy they would take over twice the budget).
A row whose settings resolve to those of the row above is the same case: run once, it
says so instead of timing noise. A gain smaller than the spread says "within noise".
Its runs are measurements for the table, kept out of the run store (nt.runs()).
"""
from __future__ import annotations

import math
import os
import statistics
import textwrap
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from . import datasets
from .config import SETTINGS, TrainConfig
from .devices import available_cores
from .entry import fit, watch

BATCH_SIZE = 64
# 16 passes over digits' 1,438 training images: 368 steps of ~13 ms on a 2-core EPYC, ~5 s a
# run. The threads probe takes ~17 steps and at most 5% of a run (probe.BUDGET_SHARE), so a
# run shorter than 340 steps would keep torch's threads unmeasured; 16 epochs leave margin.
EPOCHS = 16
MIN_ROUNDS, MAX_ROUNDS = 3, 9
TARGET_SPREAD = 0.10   # rounds go on until every timed row's spread is at most this
BUDGET_S = 70.0        # no round starts that would end after this (the rows' part of 90 s)
# Below 5% a ratio is not a gain on a shared machine, however tight the rounds: two probes
# of the same case there differ by up to 4% (probe.MIN_GAIN's measurement), and five demos
# in a row on the 2-core EPYC read the batched-fetch row 1.01x-1.18x, its split allowing 4%.
NOISE_FLOOR = 0.05
OWN_LOOP_EPOCHS, OWN_LOOP_ROUNDS = 4, 3
WIDTH = 100   # the text's paragraphs are wrapped at this

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
    """A run's samples/s without its slow spells: the median of its records' rates (a
    record every 10 steps), where summary()'s whole-run mean takes a pause of another
    process on the cores in full."""
    rates = [r["samples_per_s"] for r in run.records("train")]
    return statistics.median(rates) if rates else math.nan


def spread(values: Sequence[float]) -> float:
    """The interquartile range of `values` over their median: 0.1 is +-5% around it for
    the middle half of the rounds. Unlike max-min it does not grow with every round added,
    so more rounds narrow it. NaN for fewer than 2 values."""
    if len(values) < 2:
        return math.nan
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    median = statistics.median(values)
    return (q3 - q1) / median if median else math.nan


def paired_ratio(values: Sequence[float], above: Sequence[float]) -> float:
    """The median of the per-round ratios `values[k] / above[k]`: both ran in the same
    round, so a slow spell of the machine hits both."""
    return statistics.median(a / b for a, b in zip(values, above))


def noise_bar(noise: float) -> float:
    """What a gain must pass to count: the rounds' spread `noise`, at least NOISE_FLOOR."""
    return max(noise if not math.isnan(noise) else 0.0, NOISE_FLOOR)


def verdict(ratio: float, noise: float) -> Tuple[str, str]:
    """(kind, words) of a row that is `ratio` times as fast as the row above, each row's
    rounds spread by up to `noise`: 'gain', 'loss', or 'noise' when the difference is
    within the spread (or under NOISE_FLOOR)."""
    if math.isnan(ratio) or abs(ratio - 1) <= noise_bar(noise):
        return "noise", "within noise"
    if ratio > 1:
        return "gain", f"{ratio:.2f}x faster"
    return "loss", f"{1 / ratio:.2f}x slower"


def more_rounds(done: int, spreads: Sequence[float], elapsed_s: float, round_s: float,
                min_rounds: int = MIN_ROUNDS, max_rounds: int = MAX_ROUNDS,
                target: float = TARGET_SPREAD, budget_s: float = BUDGET_S) -> bool:
    """Whether to run another round: up to `min_rounds` unless one more would end after
    twice the budget (a machine busy with other work: the busy note says so); then while a
    row is spread wider than `target`, up to `max_rounds`, if one more round ends in budget."""
    if done < min_rounds:
        return elapsed_s + round_s <= 2 * budget_s
    if done >= max_rounds or elapsed_s + round_s > budget_s:
        return False
    return any(s > target for s in spreads)


# -- the rows ------------------------------------------------------------------------------------
@dataclass
class Row:
    label: str
    toggle: Optional[Toggle]              # None: the plain loop
    runs: list = field(default_factory=list)
    same_as: Optional[str] = None         # the row above whose settings this one resolved to

    @property
    def rates(self) -> List[float]:
        return [steady_rate(r) for r in self.runs]

    @property
    def settings(self) -> dict:
        """The speed settings the row's first run resolved to (config fields only)."""
        return {k: v for k, (v, _) in self.runs[0].resolved.items() if k in SETTINGS}

    def share(self, name: str) -> float:
        values = [r.summary()[f"{name}_frac"] for r in self.runs]
        values = [v for v in values if not math.isnan(v)]
        return statistics.median(values) if values else math.nan


@dataclass
class Line:
    """One row of the table, in figures and words (what demo_stability compares)."""
    label: str
    rate: float
    spread: float
    vs_above: float
    vs_plain: float
    val_acc: float
    kind: str       # 'base', 'same', 'gain', 'loss', 'noise'
    words: str
    why: str = ""   # for a toggle that does not pay here: why, from the run's time split
    noise: float = math.nan   # what the verdict measured the gain against (spreads, floor)


def lines_of(rows: List[Row]) -> List[Line]:
    """The table's figures and verdicts: each timed row against the timed row above it
    (a row that resolved to the settings above it is that row again)."""
    out, basis, plain = [], None, rows[0]
    for row in rows:
        acc = statistics.median(r.summary().get("val_acc", math.nan) for r in row.runs)
        if row.same_as is not None:
            out.append(Line(row.label, math.nan, math.nan, math.nan, math.nan, acc, "same",
                            f"same settings as {row.same_as!r}", why_same(row)))
            continue
        rates = row.rates
        if basis is None:
            out.append(Line(row.label, statistics.median(rates), spread(rates), 1.0, 1.0, acc,
                            "base", ""))
        else:
            ratio = paired_ratio(rates, basis.rates)
            noise = max(spread(rates), spread(basis.rates),   # either row's, or the pairs'
                        spread([a / b for a, b in zip(rates, basis.rates)]))
            kind, words = verdict(ratio, noise)
            out.append(Line(row.label, statistics.median(rates), spread(rates), ratio,
                            paired_ratio(rates, plain.rates), acc, kind, words,
                            why_not(row, basis) if kind != "gain" else "",
                            noise_bar(noise)))
        basis = row
    return out


def why_same(row: Row) -> str:
    """A row that changed nothing: what its toggle resolved to, and why (the run's reasons
    for the fields it hands to "auto" that are not the plain loop's value anyway)."""
    resolved = row.runs[0].resolved
    return "; ".join(f"{name}={_shown(resolved[name][0])}: {resolved[name][1]}"
                     for name in row.toggle.fields if name in resolved)


def why_not(row: Row, above: Row) -> str:
    """A toggle that did not pay here: the share of the step it works on, from the row
    above's own time split, where it pays, and what it resolved to."""
    share = above.share(row.toggle.share)
    step_ms = statistics.median(r.summary()["step_time_s"] for r in above.runs) * 1e3
    what = {"data_wait": "loading (the data wait)", "copy": "copying to the device",
            "compute": "compute"}[row.toggle.share]
    changed = {k: v for k, v in row.settings.items() if above.settings.get(k) != v}
    return (f"{what} was {share:.0%} of the {step_ms:.1f} ms step above; {row.toggle.pays}"
            + (f" (here: {', '.join(f'{k}={_shown(v)}' for k, v in changed.items())})"
               if changed else ""))


# -- the demo ------------------------------------------------------------------------------------
@dataclass
class Demo:
    rows: List[Row]
    rounds: int
    wall_s: float
    own_loop: Optional[dict] = None

    @property
    def lines(self) -> List[Line]:
        return lines_of(self.rows)

    @property
    def runs(self) -> Dict[str, list]:
        return {row.label: row.runs for row in self.rows}

    @property
    def finished(self) -> bool:
        return all(r.state == "finished" for row in self.rows for r in row.runs)


def run_demo(epochs: int = EPOCHS, max_rounds: int = MAX_ROUNDS, progress: bool = False,
             min_rounds: int = MIN_ROUNDS, budget_s: float = BUDGET_S,
             own_loop_epochs: int = OWN_LOOP_EPOCHS, own_loop_rounds: int = OWN_LOOP_ROUNDS,
             say: Callable[[str], None] = print) -> Demo:
    """Train every case in interleaved rounds; print the table, the settings each row
    resolved to, and the own-loop line; return the Demo."""
    start = time.perf_counter()
    x, y = datasets.digits("train")
    xv, yv = datasets.digits("val")
    base = TrainConfig(epochs=epochs, batch_size=BATCH_SIZE, optimizer="adamw", lr=3e-3,
                       scheduler="onecycle", seed=0, store=False)
    busy = busy_note()
    if busy:
        say(busy)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    configs = demo_configs(base, toggles_for(device))
    rows = [Row(label, toggle) for (label, toggle)
            in zip(configs, (None,) + toggles_for(device))]
    bar = _progress_bar() if progress else False

    def train(row: Row, round_no: int) -> None:
        say(f"round {round_no}: {row.label}")
        torch.manual_seed(0)
        row.runs.append(fit(digits_cnn(), (x, y), nn.functional.cross_entropy,
                            config=configs[row.label], val_data=(xv, yv), progress=bar))

    rounds, timed = 0, []
    while True:
        round_start = time.perf_counter()
        order = rows if rounds == 0 else _rotated(timed, rounds)
        for row in order:
            train(row, rounds + 1)
        rounds += 1
        if rounds == 1:   # a row resolved to the settings of the row above is that case again
            for above, row in zip(rows, rows[1:]):
                if row.settings == above.settings:
                    row.same_as = above.same_as or above.label
            timed = [row for row in rows if row.same_as is None]
        now = time.perf_counter()
        round_s = sum(_wall(row.runs[-1]) for row in timed) if rounds == 1 else now - round_start
        if not more_rounds(rounds, [spread(row.rates) for row in timed], now - start, round_s,
                           min_rounds, max_rounds, budget_s=budget_s):
            break
    demo = Demo(rows, rounds, 0.0)
    demo.own_loop = own_loop_ratio(x, y, own_loop_epochs, own_loop_rounds, say)
    demo.wall_s = time.perf_counter() - start
    say("\n" + demo_text(demo, device) + ("\n\n" + busy if busy else ""))
    return demo


def _rotated(rows: list, k: int) -> list:
    k %= len(rows)
    return rows[k:] + rows[:k]


def _wall(run) -> float:
    return run.summary()["wall_s"]


def _progress_bar():
    from .progress import attach_progress   # the UI hands the bar to fit (a view, above it)
    return attach_progress


def _shown(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


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
            model = digits_cnn()
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


# -- the text --------------------------------------------------------------------------------------
def busy_note() -> str:
    """A warning when other processes load the machine: the figures will be low and noisy."""
    load, cores = os.getloadavg()[0], available_cores()
    if load <= cores:
        return ""
    return (f"note: the machine is busy (load {load:.1f} on {cores} core(s)): other processes "
            "take CPU time from these runs, so rates are lower and noisier than on an idle "
            "machine.")


def comparison_table(lines: List[Line]) -> str:
    """One row per case: steady samples/s (median of the rounds) with its spread, against
    the row above and the plain loop, validation accuracy, the verdict."""
    width = max(len(line.label) for line in lines) + 2
    out = [f"{'':<{width}}{'samples/s':>10}{'spread':>8}{'vs above':>10}{'vs plain':>10}"
           f"{'val acc':>9}  verdict"]
    for line in lines:
        if line.kind == "same":
            out.append(f"{line.label:<{width}}{'-':>10}{'':>8}{'':>10}{'':>10}"
                       f"{line.val_acc:>9.1%}  {line.words}")
            continue
        above = "" if line.kind == "base" else f"{line.vs_above:.2f}x"
        noise = "" if line.kind == "base" else f" (noise {line.noise:.0%})"
        out.append(f"{line.label:<{width}}{line.rate:>10,.0f}{line.spread:>8.0%}{above:>10}"
                   f"{line.vs_plain:>9.2f}x{line.val_acc:>9.1%}  {line.words}{noise}")
    return "\n".join(out)


def resolved_table(rows: List[Row]) -> str:
    """What each row's toggle resolved to, and why (its first run's run.resolved)."""
    out, width = [], max(len(row.label) for row in rows) + 2
    entries = []
    for row in rows[1:]:
        resolved = row.runs[0].resolved
        names = [name for name in row.toggle.fields if name in resolved]
        entries += [(row.label if i == 0 else "", f"{name}={_shown(resolved[name][0])}",
                     resolved[name][1]) for i, name in enumerate(names)]
    shown = max((len(e[1]) for e in entries), default=0) + 2
    out += [f"  {label:<{width}}{setting:<{shown}}{why}" for label, setting, why in entries]
    return "\n".join(out)


def own_loop_text(own: dict) -> str:
    applied = ", ".join(f"{k}={_shown(v)}" for k, v in own["applied"].items()) or "nothing"
    return (f"your own loop, the same CNN (a DataLoader over the tensors, AdamW, "
            f"{own['epochs']} epochs, whole calls): as written {own['as_written_ms']:.2f} "
            f"ms/step, under nt.watch() {own['watched_ms']:.2f} ms/step: {own['ratio']:.2f}x "
            f"the time (median of {own['rounds']} interleaved rounds, {own['low']:.2f}-"
            f"{own['high']:.2f}); the watch applied {applied}")


def demo_text(demo: Demo, device: str = "cpu") -> str:
    lines = demo.lines
    text = [comparison_table(lines), "", textwrap.fill(
        f"{demo.rounds} interleaved rounds; samples/s: the median of the rounds, each run's "
        "steady rate (the median of its records); spread: the middle half of the rounds over "
        "the median; vs above: the median of the per-round ratios to the timed row above; "
        "noise: the widest spread of the two rows and of their per-round ratios, at least "
        f"{NOISE_FLOOR:.0%}, which a gain must pass to count. "
        "Each row adds one toggle to the rows above it; the last is nbtrain's defaults.",
        WIDTH, break_on_hyphens=False), "", "what each row's toggle resolved to, and why:", resolved_table(demo.rows)]
    whys = [textwrap.fill(f"{line.label}: {line.why}", WIDTH, initial_indent="  ",
                          subsequent_indent="    ", break_on_hyphens=False)
            for line in lines if line.why]
    if whys:
        text += ["", "where a toggle does not pay here:"] + whys
    if demo.own_loop is not None:
        text += ["", textwrap.fill(own_loop_text(demo.own_loop), WIDTH, break_on_hyphens=False)]
    text += ["", f"demo: {demo.wall_s:.0f} s on {device}"]
    return "\n".join(text)
