"""Timers and memory readings: what a record measures, without a host sync."""

# The module window's length and its empty record (modules.py), here so that a watch can
# price a window and say why it took none without loading that module: a loop too short
# for a window never loads it.
WINDOW_STEPS = 3      # steps a window times: a few, once


def not_measured(step: int, why: str) -> dict:
    """The "modules" record of a window that measured nothing, with its reason."""
    return {"kind": "modules", "step": step, "steps": 0, "rows": [],
            "note": f"not measured: {why}", "peak": None}
