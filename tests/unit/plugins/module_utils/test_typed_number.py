"""ansible-test units: the one reader of numbers, imported by the collection's name as a module
imports it on a host (plugins/module_utils/typed_number.py)."""

from __future__ import annotations

import math

import pytest
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.typed_number import (
    NumberError,
    Range,
    read,
)


def test_a_number_in_range_is_read() -> None:
    assert read(8, "tp_size", Range(1, 64, integer=True)) == 8


@pytest.mark.parametrize("value", [math.nan, math.inf, 10**400, "9" * 5000, True, 65])
def test_anything_else_is_refused_by_name(value: object) -> None:
    with pytest.raises(NumberError, match="tp_size"):
        read(value, "tp_size", Range(1, 64, integer=True))
