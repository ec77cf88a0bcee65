"""plugins/module_utils/typed_number.py: the one reader of a number from outside
(docs/ARCHITECTURE.md,
"Numbers"). Every hostile number is a NumberError naming the input, never another exception."""

from __future__ import annotations

import math

import pytest
from sglang_fleet.module_utils.typed_number import (
    MAX_INT,
    NumberError,
    Range,
    finite_or_none,
    read,
    shown,
)

COUNT = Range(1, 4096, integer=True)
FRACTION = Range(0, 1, low_open=True)


@pytest.mark.parametrize(
    ("value", "allowed", "expected"),
    [
        (8, COUNT, 8),
        ("8", COUNT, 8),
        (" 8 ", COUNT, 8),
        (8.0, COUNT, 8),
        ("0.88", FRACTION, 0.88),
        (1, FRACTION, 1),
        ("1e3", Range(), 1000.0),
        ("-2.5", Range(), -2.5),
    ],
)
def test_numbers_in_range_are_read(value, allowed, expected) -> None:
    got = read(value, "x", allowed)
    assert got == expected and type(got) is type(expected)


HOSTILE = [
    True,
    None,
    [1],
    {"a": 1},
    b"8",
    math.nan,
    math.inf,
    -math.inf,
    "nan",
    "inf",
    "Infinity",
    "1e999",
    10**400,
    -(10**400),
    MAX_INT,
    "9" * 5000,
    "1" * 65,
    "8 or 9",
    "0x10",
    "",
    "8.5",
    0,
    4097,
    2.0**60,
]


@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: shown(v, 16))
def test_hostile_values_are_refused_by_name(value) -> None:
    with pytest.raises(NumberError) as caught:
        read(value, "sglang_server_thing", COUNT)
    assert str(caught.value).startswith("sglang_server_thing must be an integer from 1 to 4096")
    assert len(str(caught.value)) < 200  # a 5,000-digit value is described, not echoed


def test_a_big_integer_is_named_by_its_size() -> None:
    with pytest.raises(NumberError, match="a 401-digit integer"):
        read(10**400, "measured.pre_gib")
    assert shown(10**4400) == "a 4401-digit integer"  # past int's own 4,300-digit str limit


def test_text_can_be_refused() -> None:
    with pytest.raises(NumberError, match="got the text '8'"):
        read("8", "x", COUNT, text=False)


def test_a_recorded_figure_is_finite_or_none() -> None:
    assert finite_or_none("12.5") == 12.5 and finite_or_none(3) == 3.0
    for broken in (None, True, "x", math.nan, math.inf, 10**400, "1e999", [1], "9" * 5000):
        assert finite_or_none(broken) is None, broken
    assert finite_or_none(-1, Range(0)) is None
