"""How numbers look in nbtrain's tables: text, HTML, and the few formats they share.

Three formats, because the tables say different things:

- `formatted(value, spec)`: a measured value with a given format; '-' when there is none
  (None, or NaN: no validation, target never reached).
- `cell(value)`: a cell of a results table (compare, autotune) whose columns mix
  counts, rates and losses: 1,234 above a thousand, 4 significant digits below.
- `plain(value)`: a run's summary (`print(run)`), where a NaN loss must read "nan"
  (the run diverged) rather than look like a missing value.

A resolved setting's figure (`setting(name, value)`) is shown with its unit, to 3
significant digits, as every table of settings shows it.
"""
from __future__ import annotations

import math
from typing import List


def formatted(value, spec: str = ".4g") -> str:
    """`value` as `format(value, spec)`; '-' for None or a non-finite float."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def cell(value) -> str:
    """A table cell: floats as 1,234 (from 1000 up) or to 4 significant digits, '-' for
    None or NaN, anything else (names, bools, counts) as str."""
    if isinstance(value, float):
        return formatted(value, ",.0f" if abs(value) >= 1000 else ".4g")
    return "-" if value is None else str(value)


def plain(value) -> str:
    """Floats to 4 significant digits ('nan' stays visible), anything else as str."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# the unit of a figure in run.resolved, by setting name (a name ending in _s: seconds)
UNITS = {"peak_tflops": "TFLOP/s", "flops_per_step": "FLOP"}
_PREFIXED = ("FLOP",)   # shown with an SI prefix: a step's FLOPs range from k to P
_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def setting(name: str, value) -> str:
    """A resolved setting's value in a table of settings: a figure with its unit (an SI
    prefix on FLOPs) to 3 significant digits, any other float to 3 significant digits,
    anything else (names, bools, counts, None) as str.

    >>> setting("peak_tflops", 0.20199282113457864), setting("flops_per_step", 1294336)
    ('0.202 TFLOP/s', '1.29 MFLOP')
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    unit = UNITS.get(name, "s" if name.endswith("_s") else "")
    if not unit:
        return _cell(value) if isinstance(value, float) else str(value)
    prefix = ""
    if unit in _PREFIXED:
        value = float(f"{value:.3g}")   # rounded first: 999,700 is 1 M, not 1e+03 k
        scale, prefix = next(((s, p) for s, p in _PREFIXES if abs(value) >= s), (1, ""))
        value /= scale
    return f"{value:.3g} {prefix}{unit}"


def text_table(columns, rows: List[dict]) -> str:
    """Fixed columns, one line per row; missing or NaN values print as '-'."""
    cells = [[title for title, _ in columns]]
    cells += [[cell(row.get(key)) for _, key in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(line, widths))) for line in cells]
    return "\n".join(lines)


def html_table(columns, rows: List[dict]) -> str:
    import html   # a notebook's tables only: a script, or a watch, never loads it
    head = "".join(f"<th>{html.escape(title)}</th>" for title, _ in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell(row.get(key)))}</td>"
                                    for _, key in columns) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class Table(list):
    """Rows (NamedTuples) with a `note`: over which steps they were measured, or in words
    why there are none (never an empty table that reads like "nothing"). Its repr is the
    columns, right-aligned but for those named in `left`, then the note (run.modules(),
    run.peak()'s parts, run.host_reads())."""

    def __init__(self, rows: list, note: str, columns=(), left=()):
        super().__init__(rows)
        self.note, self._columns, self._left = note, columns, left

    def __repr__(self) -> str:
        if not self:
            return self.note
        cells = [[_cell(getattr(row, c)) for c in self._columns] for row in self]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(self._columns)]
        aligns = ["<" if c in self._left else ">" for c in self._columns]
        lines = ["  ".join(f"{c:{a}{w}}" for c, a, w in zip(self._columns, aligns, widths))]
        lines += ["  ".join(f"{v:{a}{w}}" for v, a, w in zip(r, aligns, widths)) for r in cells]
        return "\n".join(lines + [self.note])


def _cell(value) -> str:
    """Floats to 3 significant digits; an empty name (a model without submodules) as ''."""
    if isinstance(value, float):
        return f"{value:.3g}"
    return repr(value) if value == "" else str(value)

