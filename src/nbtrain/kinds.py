"""What values a setting accepts: one small class per kind of value.

Each kind answers three questions in one place:
is this value allowed (`accepts`), how is it described in an error or a help line
(`allowed`), and how is it read from text (`parse`, for the magic's options, `--compare`
values and the panel's text boxes). TrainConfig's declarations (config.py) pick one per
field.
"""
from __future__ import annotations

import difflib
import math
import os
from typing import Any, Dict, Optional, Tuple

TRUE_WORDS = ("true", "on", "yes", "1")
FALSE_WORDS = ("false", "off", "no", "0")


Resolved = Tuple[Any, str]   # a setting as resolved for a run: (value, why it was chosen)
ResolvedSettings = Dict[str, Resolved]   # Run.resolved: setting name -> Resolved


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Kind:
    """The values one setting accepts."""
    allowed = ""         # for errors and help: "a whole number >= 1"
    metavar = "VALUE"    # for the magic's help: --batch-size N
    convert = str        # how `parse` reads text: int, float, str

    def accepts(self, value) -> bool:
        raise NotImplementedError

    def parse(self, text: str):
        """The value of the right type that `text` stands for; ValueError when there is none.

        Whether the value is allowed is `accepts`'s question, asked by TrainConfig."""
        try:
            return self.convert(text)
        except ValueError:
            raise ValueError(f"expected {self.allowed}, got {text!r}") from None

    def describe(self, value) -> str:
        """`allowed`, with a hint fitted to the rejected value where one helps."""
        return self.allowed

    def normalise(self, value):
        """The value as stored: a list read from JSON becomes the tuple it was."""
        return value


class Whole(Kind):
    """A whole number, at least `low` when given (bools are not numbers here)."""
    metavar = "N"
    convert = int

    def __init__(self, low: Optional[int] = None, high: Optional[int] = None):
        self.low, self.high = low, high
        if high is None:
            self.allowed = "a whole number" + (f" >= {low}" if low is not None else "")
        else:
            self.allowed = f"a whole number from {low:,} to {high:,}"

    def accepts(self, value) -> bool:
        return _is_int(value) and (self.low is None or value >= self.low) \
            and (self.high is None or value <= self.high)


class Number(Kind):
    """A real number in a range; `open` ends exclude their bound."""
    metavar = "X"
    convert = float

    def __init__(self, low=None, high=None, low_open=False, high_open=False, example=""):
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open
        self.allowed = "a number " + self._range() + (f" (for example {example})" if example else "")

    def _range(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"

    def accepts(self, value) -> bool:
        if not _is_number(value) or not math.isfinite(value):   # NaN passes every comparison
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below


class Flag(Kind):
    """True or False."""
    allowed = "True or False"
    metavar = "True|False"

    def accepts(self, value) -> bool:
        return isinstance(value, bool)

    def parse(self, text: str) -> bool:
        word = text.strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
        raise ValueError(f"expected true or false, got {text!r}")


class Choice(Kind):
    """One of a fixed list of values (names, or None for "the library's default")."""

    def __init__(self, *options):
        self.options = options
        self.allowed = "one of " + ", ".join(repr(o) for o in options)
        self.metavar = "{" + ",".join(str(o) for o in options) + "}"   # argparse's way

    def accepts(self, value) -> bool:
        return value in self.options

    def describe(self, value) -> str:
        return self.allowed + (f" (did you mean {self.closest(value)!r}?)"
                               if self.closest(value) else "")

    def closest(self, value) -> Optional[str]:
        """The option `value` most likely meant: the same but for case, else the closest."""
        names = [str(o) for o in self.options]
        same = [n for n in names if n.lower() == str(value).lower()]
        return (same or difflib.get_close_matches(str(value), names, n=1) or [None])[0]

    def parse(self, text: str):
        """The option written `text`; other text is returned as is, for TrainConfig to
        reject with its did-you-mean hint."""
        return next((option for option in self.options if str(option) == text), text)


class Literal(Kind):
    """Exactly one value, such as "auto" or None; a part of AnyOf."""

    def __init__(self, value):
        self.value = value
        self.allowed = repr(value)

    def accepts(self, value) -> bool:
        return value is self.value or (type(value) is type(self.value) and value == self.value)

    def parse(self, text: str):
        if text.strip().lower() == str(self.value).lower():
            return self.value
        raise ValueError(f"expected {self.allowed}, got {text!r}")


class AnyOf(Kind):
    """A value that any one of `kinds` accepts, e.g. 'auto' or a whole number."""

    def __init__(self, *kinds: Kind, allowed: str = ""):
        self.kinds = kinds
        self.allowed = allowed or " or ".join(k.allowed for k in kinds)
        self.metavar = "|".join(k.metavar if not isinstance(k, Literal) else str(k.value)
                                for k in kinds)

    def accepts(self, value) -> bool:
        return any(kind.accepts(value) for kind in self.kinds)

    def describe(self, value) -> str:
        """`allowed`, with the first hint one of the kinds has for `value` (did you mean)."""
        hints = [kind.describe(value)[len(kind.allowed):] for kind in self.kinds]
        return self.allowed + next((hint for hint in hints if hint), "")

    def parse(self, text: str):
        for kind in self.kinds:
            try:
                return kind.parse(text)
            except ValueError:
                pass
        raise ValueError(f"expected {self.allowed}, got {text!r}")


class OrNone(AnyOf):
    """None (the setting is off, or decided elsewhere) or what `kind` accepts."""

    def __init__(self, kind: Kind):
        super().__init__(Literal(None), kind)
        self.kind = kind


def AutoOr(kind: Kind) -> AnyOf:
    """'auto' (nbtrain decides at the start of a run, and says why) or what `kind` accepts."""
    return AnyOf(Literal("auto"), kind)


AUTO_FLAG = AnyOf(Flag(), Literal("auto"), allowed="True, False or 'auto'")


class Device(Kind):
    """A torch device name nbtrain can train on."""
    allowed = "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
    metavar = "DEV"

    def accepts(self, value) -> bool:
        return isinstance(value, str) and (
            value in ("auto", "cpu", "cuda", "mps")
            or (value.startswith("cuda:") and value[5:].isdigit()))


class Pair(Kind):
    """Two numbers, each as `part` accepts; written "0.9,0.999" in text."""
    metavar = "A,B"

    def __init__(self, part: Number, example: Tuple[float, float]):
        self.part, self.example = part, example
        self.allowed = f"two numbers {part._range()}, for example {example}"

    def accepts(self, value) -> bool:
        return isinstance(value, tuple) and len(value) == 2 and all(map(self.part.accepts, value))

    def normalise(self, value):
        return tuple(value) if isinstance(value, list) else value

    def parse(self, text: str) -> tuple:
        try:
            values = tuple(float(part) for part in text.split(","))
        except ValueError:
            values = ()
        if len(values) != 2:
            example = ",".join(str(v) for v in self.example)
            raise ValueError(f"expected two numbers separated by a comma, such as {example}, "
                             f"got {text!r}")
        return values


class Path(Kind):
    """A file-system path (a str or a pathlib.Path)."""
    allowed = "a folder path"
    metavar = "PATH"

    def accepts(self, value) -> bool:
        return isinstance(value, (str, os.PathLike))


class Text(Kind):
    """Any text, such as a run's name."""
    allowed = "a text (str)"
    metavar = "TEXT"

    def accepts(self, value) -> bool:
        return isinstance(value, str)


class Several(Kind):
    """`none` (the word for nothing), one of `options`, or a tuple of several of them;
    written "a,b" in text."""

    def __init__(self, *options: str, none: str = "none"):
        self.options, self.none = options, none
        names = ", ".join(repr(o) for o in options)
        self.allowed = f"{none!r}, one of {names}, or a tuple of several of them"
        self.metavar = "{" + ",".join((none,) + options) + "}[,...]"

    def accepts(self, value) -> bool:
        if value == self.none or value in self.options:
            return isinstance(value, str)
        return isinstance(value, tuple) and len(value) > 0 and len(set(value)) == len(value) \
            and all(isinstance(v, str) and v in self.options for v in value)

    def normalise(self, value):
        if isinstance(value, list):
            value = tuple(value)
        return value[0] if isinstance(value, tuple) and len(value) == 1 else value

    def describe(self, value) -> str:
        wrong = [v for v in (value if isinstance(value, (tuple, list)) else (value,))
                 if v not in self.options and v != self.none]
        close = difflib.get_close_matches(str(wrong[0]), self.options, n=1) if wrong else []
        return self.allowed + (f" (did you mean {close[0]!r}?)" if close else "")

    def parse(self, text: str):
        parts = tuple(part.strip() for part in text.split(",") if part.strip())
        return parts[0] if len(parts) == 1 else parts


class Factory(Kind):
    """The user's own code for a part nbtrain builds: a class or a function that makes it.

    Not readable from text (`parse` fails, so an AnyOf tries its other kinds); the magic
    looks such a value up by variable name instead. A checkpoint stores only its name
    (`custom_name`), so resuming needs the same factory passed again.
    """
    metavar = "NAME"

    def __init__(self, allowed: str):
        self.allowed = allowed

    def accepts(self, value) -> bool:
        return callable(value) and not isinstance(value, str)

    def parse(self, text: str):
        raise ValueError(f"expected {self.allowed}, got the text {text!r}")


CUSTOM = "custom:"   # how a checkpoint names a factory: "custom:Adadelta"


def custom_name(value) -> str:
    """The name a checkpoint stores for a class or function: "custom:Adadelta"."""
    inner = getattr(value, "func", value)   # functools.partial
    return CUSTOM + getattr(inner, "__qualname__", type(inner).__name__)


def takes_factories(kind: Kind) -> bool:
    """Whether `kind` accepts a class or function (then text may name a variable)."""
    return isinstance(kind, Factory) or any(map(takes_factories, getattr(kind, "kinds", ())))


def text_of(value: Any) -> str:
    """A value written the way `parse` reads it back (betas as 0.9,0.999)."""
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if callable(value) and not isinstance(value, str):
        return custom_name(value)
    return str(value)
