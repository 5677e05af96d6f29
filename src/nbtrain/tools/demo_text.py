"""The demo's tables and sentences: what `nbtrain demo` prints and notebook 07 shows.

Pure text over plain data (Lines, tuples, numbers): tools/demo.py runs the demo and hands
its figures here; this module imports nothing of it. A figure that could not be measured,
or is noise, is said in words here, never printed as NaN or as a number that reads like a
result."""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

from ..machine import available_cores, load_now

WIDTH = 100   # the text's paragraphs are wrapped at this


@dataclass
class Line:
    """One row of the table, in figures and words (what demo_stability compares)."""
    label: str
    rate: float
    spread: float
    vs_above: float
    vs_plain: float
    val_acc: float
    kind: str       # 'base', 'same', 'gain', 'loss', 'noise', 'untimed'
    words: str
    why: str = ""   # for a toggle that does not pay here: why, from the run's time split
    low: float = math.nan    # the 95% interval of vs_above
    high: float = math.nan
    raw_spread: float = math.nan   # the spread of the rates as measured, the machine's
    #                                wander from round to round in it (the table's is without)


class Outcome(NamedTuple):
    """What the demo's text is made of: the table's lines, each row's resolved settings as
    (row label or '', 'name=value', why), a full run's steps, the timing rounds and, where
    too few of them were run for an interval, why (`untimed`), the factor a change must
    reach, the own-loop figures or why there are none, the wall time and the device."""
    lines: List[Line]
    resolved: List[Tuple[str, str, str]]
    steps: int
    rounds: int
    untimed: str
    factor: float
    own_loop: Optional[dict]
    own_loop_untimed: str
    wall_s: float
    device: str


def shown(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# -- what is said while it runs -------------------------------------------------------------------
def busy_note(budget_s: float) -> str:
    """A warning when other processes load the machine: the figures will be low and noisy,
    and the demo will likely run past its budget (`budget_s` for the rows)."""
    load, cores = load_now(), available_cores()
    if load <= cores:
        return ""
    return (f"note: the machine is busy (load {load:.1f} on {cores} core(s)): other processes "
            "take CPU time from these runs, so rates are lower and noisier than on an idle "
            f"machine, and the demo will likely run past its budget ({budget_s:.0f} s for "
            "the rows): each row still runs in full, since its settings are measured on it; "
            f"the timing rounds stop by {2 * budget_s:.0f} s, and what they could not time "
            "is said so.")


def no_rounds_note(elapsed_s: float, round_s: float, fewest: int, budget_s: float) -> str:
    """Said where no timing round will run: the full runs left too little of the budget
    for the rounds an interval needs (demo.more_rounds)."""
    return (f"not timing the rows: the full runs ended {elapsed_s:.0f} s into the demo, and "
            f"the {fewest} rounds a 95% interval needs (~{round_s:.1f} s each, from the full "
            f"runs) would end past {2 * budget_s:.0f} s (twice the budget)")


def untimed_words(rounds: int, fewest: int, capped: bool, budget_s: float) -> str:
    """Why the rows have no figures: fewer rounds than the `fewest` an interval needs, cut
    by max_rounds (`capped`) or else by the budget (a machine too busy for them)."""
    if capped:
        return f"max_rounds={rounds}, and a 95% interval needs {fewest} rounds"
    return (f"the machine was too busy: {_rounds(rounds)} completed within the budget "
            f"({2 * budget_s:.0f} s), and a 95% interval needs {fewest}")


def untimed_row_words(rounds: int) -> str:
    """A row's verdict where it has too few rounds for figures (why: the text below)."""
    return "not timed (0 rounds)" if rounds == 0 else \
        f"too few rounds to tell ({_rounds(rounds)})"


def own_loop_untimed_words(elapsed_s: float, estimate_s: float, calls: int,
                           budget_s: float) -> str:
    """Said where the own loop is not run: its calls would end past twice the budget."""
    return (f"your own loop under nt.watch(): not timed: the machine was too busy: the demo "
            f"was {elapsed_s:.0f} s in, and the {calls} whole calls (~{estimate_s:.0f} s, "
            f"from the full runs) would end past {2 * budget_s:.0f} s (twice the budget)")


def _rounds(n: int) -> str:
    return f"{n} round" + ("" if n == 1 else "s")


# -- the table ------------------------------------------------------------------------------------
def comparison_table(lines: List[Line]) -> str:
    """One row per case: steady samples/s (the median of the timing rounds) with its
    spread, against the row above (the 95% interval too) and the plain loop, validation
    accuracy, the verdict. A row with no figures (the same settings as a row above, or
    too few rounds) shows '-' and says why in words."""
    width = max(len(line.label) for line in lines) + 2
    out = [f"{'':<{width}}{'samples/s':>10}{'spread':>8}{'vs above':>10}{'95% interval':>14}"
           f"{'vs plain':>10}{'val acc':>9}  verdict"]
    for line in lines:
        if line.kind in ("same", "untimed"):
            out.append(f"{line.label:<{width}}{'-':>10}{'':>8}{'':>10}{'':>14}{'':>10}"
                       f"{line.val_acc:>9.1%}  {line.words}")
            continue
        above = "" if line.kind == "base" else f"{line.vs_above:.2f}x"
        interval = "" if line.kind == "base" else f"{line.low:.2f}-{line.high:.2f}"
        out.append(f"{line.label:<{width}}{line.rate:>10,.0f}{_percent(line.spread):>8}"
                   f"{above:>10}{interval:>14}{_times(line.vs_plain):>10}{line.val_acc:>9.1%}  "
                   f"{line.words}")
    return "\n".join(out)


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def _times(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def resolved_table(entries: Sequence[Tuple[str, str, str]]) -> str:
    """What each row's toggle resolved to, and why: (row label or '', setting, why)."""
    width = max((len(e[0]) for e in entries), default=0) + 2
    column = max((len(e[1]) for e in entries), default=0) + 2
    return "\n".join(f"  {label:<{width}}{setting:<{column}}{why}"
                     for label, setting, why in entries)


def own_loop_text(own: dict) -> str:
    """The own-loop line: each way's ms/step and their ratio; a ratio whose rounds range
    over 1 is noise, and said so instead of as a ratio."""
    applied = ", ".join(f"{k}={shown(v)}" for k, v in own["applied"].items()) or "nothing"
    spread = (f"{own['rounds']} interleaved rounds, {own['low']:.2f}-{own['high']:.2f}")
    ratio = (f"within the noise of {spread}: no difference to tell"
             if own["low"] <= 1 <= own["high"] else
             f"{own['ratio']:.2f}x the time (median of {spread})")
    return (f"your own loop, the same CNN (a DataLoader over the tensors, AdamW, "
            f"{own['epochs']} epochs, whole calls): as written {own['as_written_ms']:.2f} "
            f"ms/step, under nt.watch() {own['watched_ms']:.2f} ms/step: {ratio}; the watch "
            f"applied {applied}")


def how_timed(outcome: Outcome) -> str:
    """The paragraph under the table: how the figures were made, or why there are none."""
    full = (f"Each row ran once in full ({outcome.steps} steps, every auto measured: the "
            "settings below, the accuracy, the time split)")
    if outcome.untimed:
        return (f"{full}; the rows that differ were then to be timed in rounds of one short "
                f"run each, and have no figures: {outcome.untimed}.")
    factor = f"{outcome.factor - 1:.0%}"
    return (f"{full}, then the rows that differ were timed in {outcome.rounds} rounds of "
            "one short run each, the order alternating. samples/s: the median of the "
            "rounds, each run's steady rate (the median of its records) read against the "
            "same round's other rows, so that the machine's speed in that round is factored "
            "out (the rounds are blocks); spread: the width of that median's 95% interval; "
            "vs above: the median of the per-round ratios to the timed row above, with its "
            "95% interval: a change counts where the interval leaves out 1 and it is at "
            f"least {factor} (asv's default factor), else it is within noise, or under "
            f"{factor}. Each row adds one toggle to the rows above it; the last is "
            "nbtrain's defaults.")


def demo_text(outcome: Outcome) -> str:
    text = [comparison_table(outcome.lines), "", _fill(how_timed(outcome)),
            "", "what each row's toggle resolved to, and why:",
            resolved_table(outcome.resolved)]
    whys = [textwrap.fill(f"{line.label}: {line.why}", WIDTH, initial_indent="  ",
                          subsequent_indent="    ", break_on_hyphens=False)
            for line in outcome.lines if line.why]
    if whys:
        text += ["", "where a toggle does not pay here:"] + whys
    if outcome.own_loop is not None:
        text += ["", _fill(own_loop_text(outcome.own_loop))]
    elif outcome.own_loop_untimed:
        text += ["", _fill(outcome.own_loop_untimed)]
    text += ["", f"demo: {outcome.wall_s:.0f} s on {outcome.device}"]
    return "\n".join(text)


def _fill(paragraph: str) -> str:
    return textwrap.fill(paragraph, WIDTH, break_on_hyphens=False)
