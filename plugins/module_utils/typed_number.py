"""The one reader of a number that comes from outside (docs/ARCHITECTURE.md, "Numbers").

Numbers reach this project as JSON from hosts and servers, as text in logs and on command
lines, and as operators' settings. Each of those can hold what Python's numbers do not survive:
JSON and Python ints have no size limit, so `float(10**400)` and `math.isfinite(10**400)` raise
OverflowError; `int()` of more than 4,300 digits raises ValueError; `float("1e999")` is inf and
JSON reads NaN and Infinity; True is an int. Every reader here takes such a value through
`read()` (a number or NumberError, a ValueError naming the input and the allowed values, never
another exception) or `finite_or_none()` (a recorded figure: a finite float or None).

Standard library only: modules import it as
``ansible_collections.sglang_fleet.fleet.plugins.module_utils.typed_number``, the control node's
package as ``sglang_fleet.module_utils.typed_number``.

    read("8", "tp_size", Range(1, 4096, integer=True))     # 8
    read(10**400, "measured.pre_gib", Range(0, 1 << 20))    # NumberError: ...a 401-digit integer
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# Longer number text is refused before any conversion (no figure a host, server or operator
# gives is anywhere near: a float's repr is at most 24 characters).
MAX_TEXT = 64
# Integers beyond this magnitude are refused whatever the range: they are no count, size or
# figure of a machine, and past 2**1023 they have no float.
MAX_INT = 1 << 63
# A decimal or float number's text as JSON, Python and the shell write it; no part repeats
# inside another, so a match is linear in the (capped) length.
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_INTEGER = re.compile(r"[+-]?[0-9]+")
# Floats represent every integer up to 2**53 exactly: an integral float beyond it is no count.
_EXACT_FLOAT_INT = 1 << 53


class NumberError(ValueError):
    """A value that is not a number in its range; `what` names the input, `message` says why."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(f"{what} {message}")
        self.what = what
        self.message = message


@dataclass(frozen=True)
class Range:
    """The allowed numbers: a closed or open interval, integers only or not, and how to say it."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def holds(self, value: int | float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        kind = "an integer" if self.integer else "a number"
        low, high = _bound(self.low), _bound(self.high)
        if self.low == -math.inf and self.high == math.inf:
            return "an integer" if self.integer else "a finite number"
        if (
            self.integer
            and not (self.low_open or self.high_open)
            and math.inf
            not in (
                -self.low,
                self.high,
            )
        ):
            return f"an integer from {low} to {high}"
        if self.low_open and self.high_open and math.inf not in (-self.low, self.high):
            return f"{kind} between {low} and {high} (both excluded)"
        parts = []
        if self.low != -math.inf:
            parts.append(f"{'>' if self.low_open else '>='} {low}")
        if self.high != math.inf:
            parts.append(f"{'<' if self.high_open else '<='} {high}")
        return f"{kind} {' and '.join(parts)}"


ANY = Range()


def _bound(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def shown(value: Any, limit: int = 40) -> str:
    """value as an error message shows it: a short repr, a long one cut, a big integer by its
    size (its repr is the very thing that can take seconds and kilobytes)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= MAX_INT:
        return f"a {_digits(value)}-digit integer"
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else None
    if text is None:
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else f"{text[:limit]}..."


def _digits(value: int) -> int:
    # int's str() of a huge value is quadratic and capped at 4,300 digits: count by bits, then
    # correct the estimate (it is low by at most one).
    magnitude = abs(value)
    digits = max(1, math.floor((magnitude.bit_length() - 1) * math.log10(2)) + 1)
    return digits + 1 if magnitude >= 10**digits else digits


def _from_text(text: str, what: str, allowed: Range) -> int | float:
    word = text.strip()
    if len(word) > MAX_TEXT:
        raise NumberError(what, f"must be {allowed}, got {len(word)} characters of text")
    if _INTEGER.fullmatch(word):
        return int(word)
    if _NUMBER.fullmatch(word):
        return float(word)
    raise NumberError(what, f"must be {allowed}, got {shown(text)}")


def read(value: Any, what: str, allowed: Range = ANY, *, text: bool = True) -> int | float:
    """value as a number in `allowed`: an int, a finite float, or (with text) a string holding
    one number; an int for an integer range. Anything else (booleans, None, containers, NaN,
    infinities, integers past MAX_INT, text past MAX_TEXT characters, numbers out of range) is a
    NumberError naming `what`, never another exception."""
    number: int | float
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise NumberError(what, f"must be {allowed}, got {shown(value)}")
    if isinstance(value, str):
        if not text:
            raise NumberError(what, f"must be {allowed}, got the text {shown(value)}")
        number = _from_text(value, what, allowed)
    else:
        number = value
    if isinstance(number, int) and abs(number) >= MAX_INT:
        raise NumberError(what, f"must be {allowed}, got {shown(number)}")
    if isinstance(number, float) and not math.isfinite(number):
        raise NumberError(what, f"must be {allowed}, got {shown(value)}")
    if allowed.integer and isinstance(number, float):
        if not number.is_integer() or abs(number) >= _EXACT_FLOAT_INT:
            raise NumberError(what, f"must be {allowed}, got {shown(value)}")
        number = int(number)
    if not allowed.holds(number):
        raise NumberError(what, f"must be {allowed}, got {shown(value)}")
    return number


def finite_or_none(value: Any, allowed: Range = ANY) -> float | None:
    """A recorded figure (JSON, a log's text) as a finite float in `allowed`; None for a missing,
    boolean, broken, huge, NaN, infinite or out-of-range one."""
    if value is None:
        return None
    try:
        return float(read(value, "a figure", allowed))
    except NumberError:
        return None
