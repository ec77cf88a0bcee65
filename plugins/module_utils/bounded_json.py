"""JSON from a host or a server, read with a bound on its nesting (docs/ARCHITECTURE.md,
"Bounded readers"). Standard library only: modules import it as
``ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_json``, the control-node
package as ``sglang_fleet.module_utils.bounded_json``.

Python's json module recurses once per level of nesting: a document of a few kilobytes of
``[[[[...`` ends in RecursionError, which no reader here expects (they catch ValueError), and a
value nested a few hundred levels deep still breaks the code that walks it afterwards. No
document this project reads (a lock, a last-known-good record, a manifest, /server_info, a
router's worker list, a smoke result) nests more than a handful of levels, so anything deeper
than MAX_DEPTH is refused as not being the document it claims to be.

    loads(raw, "lkg/meta.json")   # the value, or ValueError naming what was read
"""

from __future__ import annotations

from json import loads as _json_loads
from typing import Any

MAX_DEPTH = 32


class TooDeep(ValueError):
    """JSON nested deeper than a reader accepts (a ValueError: readers that catch that catch it)."""


def depth_problem(value: Any, max_depth: int = MAX_DEPTH) -> str:
    """Why value nests too deep ('' when it does not); iterative, so any value can be asked."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > max_depth:
            return f"nested deeper than {max_depth} levels"
        stack.extend((child, depth + 1) for child in children)
    return ""


def loads(
    data: str | bytes | bytearray, what: str, max_depth: int = MAX_DEPTH, **kwargs: Any
) -> Any:
    """The JSON value of data; ValueError naming `what` when it is not JSON, is not UTF-8, or
    nests deeper than max_depth. kwargs go to json.loads (parse_constant, ...)."""
    try:
        value = _json_loads(data, **kwargs)
    except RecursionError:
        raise TooDeep(f"{what}: nested deeper than {max_depth} levels") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what}: not UTF-8 text ({exc.reason})") from None
    except ValueError as exc:
        raise ValueError(f"{what}: not JSON ({exc})") from None
    problem = depth_problem(value, max_depth)
    if problem:
        raise TooDeep(f"{what}: {problem}")
    return value
