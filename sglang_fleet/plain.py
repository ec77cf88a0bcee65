"""Ansible's values as plain Python: the filter plugins' one conversion (docs/ARCHITECTURE.md).

Ansible hands filters lazy containers, or JSON text where a registered result was templated;
the sglang_fleet functions take plain dicts. A ValueError names what was wrong; the filter
plugins turn it into AnsibleFilterError.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def plain_mapping(value: Any, what: str, optional: bool = False) -> dict[str, Any] | None:
    """value (a mapping, or JSON text of one) as a plain dict; None for nothing when optional."""
    if optional and not value:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a mapping, got {type(value).__name__}")
    return json.loads(json.dumps(dict(value)))
