"""A record's achieved FLOP rate and MFU, from the FLOPs a step takes and the device's
peak that flops.py found (both in `run.resolved`). Apart from flops.py, which loads the
FLOP counter's machinery: every record needs these, a count only some runs."""
from __future__ import annotations


def rate_fields(record: dict, resolved: dict) -> dict:
    """A train record's achieved TFLOP/s and MFU (empty when FLOPs were not counted)."""
    flops = resolved.get("flops_per_step", (None, ""))[0]
    if not flops:
        return {}
    tflops = flops * record["steps"] / record["interval_s"] / 1e12
    peak = resolved.get("peak_tflops", (None, ""))[0]
    return {"tflops": tflops, "mfu": tflops / peak} if peak else {"tflops": tflops}


def percent(mfu: float) -> str:
    """An MFU as people read it: 12%, or 0.4% where a whole percent would say 0%."""
    return f"{mfu:.0%}" if mfu >= 0.095 else f"{mfu:.1%}"
