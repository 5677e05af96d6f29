"""The run's time between its steps, by what took it (run.gaps()): the engines add each
part as it ends; the steps are what the wall time leaves. Sync-free: host clocks only, at
the edges of what is timed, never inside a step."""
from __future__ import annotations

from typing import Dict, List

# What takes a run's time besides its steps, in the order the table lists them:
# validation or a loop's evaluation pass, torch.save and checkpoints, the training loader's
# first batch of an epoch (its iterator and workers starting), the loop's own code between
# steps (a watch's: logging, plotting, anything nbtrain does not name).
PARTS = ("evaluation", "saving", "loader start", "your code")


class Gaps:
    """Seconds per part of PARTS, added as each ends (`add`). A watch also adds the whole
    time between its steps (`between_s`, from a step's end to the next one's start) and
    the named parts' share of it (`named_s`): the loop's own code is what they leave."""

    __slots__ = ("seconds", "between_s", "named_s")

    def __init__(self, seconds: Dict[str, float] = None):
        self.seconds = dict.fromkeys(PARTS, 0.0)
        if seconds:
            self.seconds.update({k: float(v) for k, v in seconds.items() if k in self.seconds})
        self.between_s = self.named_s = 0.0

    def add(self, part: str, seconds: float, between: bool = False) -> None:
        """`seconds` of `part`; `between`: spent between two steps (of `between_s`)."""
        self.seconds[part] += seconds
        if between:
            self.named_s += seconds

    def parts(self) -> Dict[str, float]:
        """Seconds by part, the loop's own code included."""
        own = self.seconds["your code"] + max(self.between_s - self.named_s, 0.0)
        return {**self.seconds, "your code": own}

    def table(self, wall_s: float) -> List[dict]:
        """Rows of `part`, `seconds` and `share` of `wall_s`: "steps" first (what the parts
        leave of the wall time), then PARTS; they add up to `wall_s`."""
        parts = self.parts()
        between = sum(parts.values())
        rows = [("steps", max(wall_s - between, 0.0))] + list(parts.items())
        total = max(wall_s, between, 1e-12)
        return [{"part": part, "seconds": seconds, "share": seconds / total}
                for part, seconds in rows]


def between_words(rows: List[dict], loop: str = "") -> str:
    """The parts between steps that took at least 1% of the wall time, largest first, in
    words ("evaluation 31%, your code 12%"); "-" for none. `loop`: the framework whose loop
    ran, whose own code (its logging, callbacks, and yours) is then what "your code" is."""
    named = sorted((row for row in rows if row["part"] != "steps" and row["share"] >= 0.01),
                   key=lambda row: -row["share"])
    own = f"{loop}'s code" if loop else "your code"
    return ", ".join(f"{own if row['part'] == 'your code' else row['part']} {row['share']:.0%}"
                     for row in named) or "-"
