"""How a config declares its fields, wherever the component that reads them lives.

``setting(help, default, allowed=..., resume=...)`` is a dataclass field with its one-line doc (the flag's help
and docs/config.md), the range a number must lie in (``Range``), and what a resume does when the field differs from
the checkpoint's (``OnResume``: refused, warned or free). The training config (``sd.train.config``) is made of the
top-level fields and one section a component (``sd.lora.mode.LoraConfig``, ``sd.evaluation.EvalConfig``, ...).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """The values a numeric field allows: an interval with finite ends, so inf and nan never fit."""

    low: float
    high: float = math.inf
    low_open: bool = False  # low itself is out
    high_open: bool = True  # high itself is out

    def allows(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self, kind: str = "float") -> str:
        """``>= 1``, ``in [0, 1)``, ``> 0 and finite`` (a float with no upper end)."""
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {number(self.low)}{' and finite' if kind == 'float' else ''}"
        return (f"in {'(' if self.low_open else '['}{number(self.low)}, {number(self.high)}"
                f"{')' if self.high_open else ']'}")


def number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


POSITIVE, NON_NEGATIVE, COUNT = Range(0, low_open=True), Range(0), Range(1)
FRACTION, BELOW_ONE = Range(0, 1, high_open=False), Range(0, 1)

REFUSE, WARN, FREE = "refuse", "warn", "free"
ORDER, MATH, SCHEDULE = "the data order", "the training math", "the learning-rate schedule"


@dataclass(frozen=True)
class OnResume:
    """A field changed between a checkpoint and the command that resumes it: ``refuse`` (it fixes the math or
    the data order: the resumed run would not continue the same run; ``then`` says what it fixes), ``warn``
    (accepted; ``then`` says what the resumed run does) or ``free`` (nothing the run computes depends on it).
    ``subject``: refused only in a run on a subject folder (elsewhere the field is unused)."""

    action: str = FREE
    then: str = ""
    subject: bool = False


def refused(what: str, subject: bool = False) -> OnResume:
    return OnResume(REFUSE, what, subject)


def warned(then: str) -> OnResume:
    return OnResume(WARN, then)


def setting(help: str, default=dataclasses.MISSING, default_factory=dataclasses.MISSING,
            allowed: Range | None = None, resume: OnResume = OnResume()):
    """A config field with its one-line doc, the range of a number (every int and float field has one) and its
    resume rule."""
    metadata = {"help": help, "allowed": allowed, "resume": resume}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def default_of(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
