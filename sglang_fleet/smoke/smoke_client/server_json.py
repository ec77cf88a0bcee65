"""The bounded JSON reader: a server's JSON, refused when it nests deeper than a
server's JSON does."""

from __future__ import annotations

import json
from typing import Any

# JSON from a server nests a few levels; deeper is not what it claims to be (the project's
# readers bound it with plugins/module_utils/bounded_json.py; this package runs alone, so it has
# its own).
MAX_JSON_DEPTH = 32


def _open_brackets(payload: bytes | bytearray | str) -> int:
    """How many `[` and `{` the text holds: an upper bound on its nesting (each level opens
    one; brackets inside strings only raise the count)."""
    if isinstance(payload, str):
        return payload.count("[") + payload.count("{")
    return payload.count(b"[") + payload.count(b"{")


def loads(payload: bytes | bytearray | str) -> Any:
    """A server's JSON, nested at most MAX_JSON_DEPTH levels; ValueError for anything else
    (json itself ends deeper nesting in RecursionError).

    The bound costs one count of brackets per document: only a text with more than
    MAX_JSON_DEPTH of them (never a stream chunk of SGLang's, whose token ids are one list)
    has its parsed value walked. The walk visited every token id of a final record, once per
    request, which was most of the smoke client's CPU per token beyond the reads themselves."""
    try:
        value = json.loads(payload)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    if _open_brackets(payload) <= MAX_JSON_DEPTH:
        return value
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        )
        if children and depth > MAX_JSON_DEPTH:
            raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return value
