"""The demo's tables and sentences: what `nbtrain demo` prints and notebook 07 shows."""
from __future__ import annotations

import math
import textwrap
from typing import List

from ..machine import available_cores, load_now
from .demo import FACTOR, WIDTH, Demo, Line, Row, shown


# -- the text --------------------------------------------------------------------------------------
def busy_note() -> str:
    """A warning when other processes load the machine: the figures will be low and noisy."""
    load, cores = load_now(), available_cores()
    if load <= cores:
        return ""
    return (f"note: the machine is busy (load {load:.1f} on {cores} core(s)): other processes "
            "take CPU time from these runs, so rates are lower and noisier than on an idle "
            "machine.")


def comparison_table(lines: List[Line]) -> str:
    """One row per case: steady samples/s (the median of the timing rounds) with its
    spread, against the row above (the 95% interval too) and the plain loop, validation
    accuracy, the verdict."""
    width = max(len(line.label) for line in lines) + 2
    out = [f"{'':<{width}}{'samples/s':>10}{'spread':>8}{'vs above':>10}{'95% interval':>14}"
           f"{'vs plain':>10}{'val acc':>9}  verdict"]
    for line in lines:
        if line.kind == "same":
            out.append(f"{line.label:<{width}}{'-':>10}{'':>8}{'':>10}{'':>14}{'':>10}"
                       f"{line.val_acc:>9.1%}  {line.words}")
            continue
        above = "" if line.kind == "base" else f"{line.vs_above:.2f}x"
        interval = "" if line.kind == "base" or math.isnan(line.low) else \
            f"{line.low:.2f}-{line.high:.2f}"
        out.append(f"{line.label:<{width}}{line.rate:>10,.0f}{_percent(line.spread):>8}"
                   f"{above:>10}{interval:>14}{line.vs_plain:>9.2f}x{line.val_acc:>9.1%}  "
                   f"{line.words}")
    return "\n".join(out)


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def resolved_table(rows: List[Row]) -> str:
    """What each row's toggle resolved to, and why (its full run's run.resolved)."""
    out, width = [], max(len(row.label) for row in rows) + 2
    entries = []
    for row in rows[1:]:
        resolved = row.first.resolved
        names = [name for name in row.toggle.fields if name in resolved]
        entries += [(row.label if i == 0 else "", f"{name}={shown(resolved[name][0])}",
                     resolved[name][1]) for i, name in enumerate(names)]
    column = max((len(e[1]) for e in entries), default=0) + 2
    out += [f"  {label:<{width}}{setting:<{column}}{why}" for label, setting, why in entries]
    return "\n".join(out)


def own_loop_text(own: dict) -> str:
    applied = ", ".join(f"{k}={shown(v)}" for k, v in own["applied"].items()) or "nothing"
    return (f"your own loop, the same CNN (a DataLoader over the tensors, AdamW, "
            f"{own['epochs']} epochs, whole calls): as written {own['as_written_ms']:.2f} "
            f"ms/step, under nt.watch() {own['watched_ms']:.2f} ms/step: {own['ratio']:.2f}x "
            f"the time (median of {own['rounds']} interleaved rounds, {own['low']:.2f}-"
            f"{own['high']:.2f}); the watch applied {applied}")


def demo_text(demo: Demo, device: str = "cpu") -> str:
    lines = demo.lines
    text = [comparison_table(lines), "", textwrap.fill(
        f"Each row ran once in full ({demo.rows[0].first.summary()['steps']} steps, every "
        "auto measured: the settings below, the accuracy, the time split), then the rows "
        f"that differ were timed in {demo.rounds} rounds of one short run each, the order "
        "alternating. samples/s: the median of the rounds, each run's steady rate (the "
        "median of its records) read against the same round's other rows, so that the "
        "machine's speed in that round is factored out (the rounds are blocks); spread: "
        "the width of that median's 95% interval; vs "
        "above: the median of the per-round ratios to the timed row above, with its 95% "
        "interval: a change counts where the interval leaves out 1 and it is at least "
        f"{FACTOR - 1:.0%} (asv's default factor), else it is within noise, or under "
        f"{FACTOR - 1:.0%}. Each row adds one toggle to the rows above it; the last is "
        "nbtrain's defaults.", WIDTH,
        break_on_hyphens=False),
            "", "what each row's toggle resolved to, and why:", resolved_table(demo.rows)]
    whys = [textwrap.fill(f"{line.label}: {line.why}", WIDTH, initial_indent="  ",
                          subsequent_indent="    ", break_on_hyphens=False)
            for line in lines if line.why]
    if whys:
        text += ["", "where a toggle does not pay here:"] + whys
    if demo.own_loop is not None:
        text += ["", textwrap.fill(own_loop_text(demo.own_loop), WIDTH, break_on_hyphens=False)]
    text += ["", f"demo: {demo.wall_s:.0f} s on {device}"]
    return "\n".join(text)
