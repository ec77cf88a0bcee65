"""Ansible's values as plain Python: the filter plugins' one conversion (docs/ARCHITECTURE.md).

Ansible hands filters lazy or tagged containers, or JSON text where a registered result was
templated; the sglang_fleet functions take plain dicts and lists. A ValueError names what was
wrong; each filter plugin turns it into AnsibleFilterError where it calls the package.
(A recorded figure is read by plugins/module_utils/typed_number.py's finite_or_none.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, overload

from sglang_fleet.module_utils.bounded_json import loads as bounded_loads


def _key(key: Any) -> str:
    """A mapping key as JSON names it (1 -> "1", True -> "true", None -> "null")."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool | int | float):
        return json.dumps(key)
    return str(key)


def plain(value: Any) -> Any:
    """value with every mapping a dict with str keys and every list or tuple a list, all the
    way down; strings, numbers, None and anything else are kept as they are."""
    if isinstance(value, Mapping):
        return {_key(key): plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


@overload
def plain_mapping(value: Any, what: str, optional: Literal[False] = False) -> dict[str, Any]: ...


@overload
def plain_mapping(value: Any, what: str, optional: bool) -> dict[str, Any] | None: ...


def plain_mapping(value: Any, what: str, optional: bool = False) -> dict[str, Any] | None:
    """value (a mapping, or JSON text of one) as a plain dict; None for nothing when optional."""
    if optional and not value:
        return None
    if isinstance(value, str):
        try:
            value = bounded_loads(value, what)
        except ValueError as exc:
            raise ValueError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a mapping, got {type(value).__name__}")
    return plain(value)
