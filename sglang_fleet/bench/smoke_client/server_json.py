"""The bounded JSON reader: a server's JSON, refused when it nests deeper than a
server's JSON does."""

from __future__ import annotations

import json
from typing import Any

# JSON from a server nests a few levels; deeper is not what it claims to be (the project's
# readers bound it with module_utils/bounded_json.py; this package runs alone, so it has
# its own).
MAX_JSON_DEPTH = 32


def loads(payload: bytes | bytearray | str) -> Any:
    """A server's JSON, nested at most MAX_JSON_DEPTH levels; ValueError for anything else
    (json itself ends deeper nesting in RecursionError)."""
    try:
        value = json.loads(payload)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        )
        if children and depth > MAX_JSON_DEPTH:
            raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)
    return value
