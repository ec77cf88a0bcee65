"""A router's worker list (sglang-router 0.3.2's ``GET /workers``), read whole or refused.

Standard library only: modules import it as
``ansible_collections.sglang_fleet.fleet.plugins.module_utils.router_workers``, the control node's
package as ``sglang_fleet.module_utils.router_workers``.

Who is listed and who is healthy decide a take-out, a drain, a put-back and a driver rollout's
N-1 rule, so a list is used only when every entry is understood: a mapping with an ``id`` and a
``url`` (short printable strings the URL reader can split) and an ``is_healthy`` that is true or
false. Anything else (a list where the mapping is, a worker that is a number, a url that is
not a string, a health of 1 or "yes", too many workers) is a WorkerListError naming the router
and what was wrong: a reader that skipped the entries it did not understand would count fewer
workers, or miss the one it is about to take out, and decide on that.

    workers = parse_workers(answer, "GET http://10.0.0.1:30000/workers")
    # [{"id", "url", "is_healthy", "load", "model_id"}, ...] or WorkerListError
"""

from __future__ import annotations

import math
import urllib.parse
from typing import Any

# Far above any fleet (a router fronts a few dozen replicas); a longer list is not a worker list.
MAX_WORKERS = 4096
# A worker id is a UUID (36 characters) in 0.3.2; a URL is scheme, host and port.
MAX_ID_CHARS = 256
MAX_URL_CHARS = 2048
MAX_MODEL_ID_CHARS = 1024
# A count beyond this is no count of requests (and past 2**1023 has no float).
MAX_LOAD = 1 << 63
FIELDS = ("id", "url", "is_healthy", "load", "model_id")


class WorkerListError(ValueError):
    """A router's answer that is not a worker list this reader understands; the message names
    the router (as given by the caller) and what was wrong."""


def url_key(url: str) -> str:
    """A worker URL as sglang-router compares it: scheme and host case-insensitive, the rest as
    written. ValueError for text that is no URL (an unclosed ``[``)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(
        (parts.scheme.lower(), parts.netloc.lower(), parts.path, parts.query, parts.fragment)
    )


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    return "null" if value is None else type(value).__name__


def _text(worker: dict[str, Any], key: str, limit: int, where: str) -> str:
    value = worker.get(key)
    if not isinstance(value, str):
        raise WorkerListError(f"{where}: its {key} is {_kind(value)}, not a string")
    if not value:
        raise WorkerListError(f"{where}: its {key} is empty")
    if len(value) > limit or not value.isprintable() or value != value.strip():
        raise WorkerListError(
            f"{where}: its {key} is not printable text of at most {limit} characters "
            "without white space around it"
        )
    return value


def _load(value: Any) -> int | float | None:
    """The router's load figure when it is a finite count, else None (shown, never decided on)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value < MAX_LOAD else None
    if isinstance(value, float) and math.isfinite(value) and value >= 0:
        return value
    return None


def parse_worker(item: Any, where: str) -> dict[str, Any]:
    """One worker as {id, url, is_healthy, load, model_id}; WorkerListError naming `where`."""
    if not isinstance(item, dict):
        raise WorkerListError(f"{where} is {_kind(item)}, not a mapping")
    url = _text(item, "url", MAX_URL_CHARS, where)
    if not url.isascii():
        raise WorkerListError(f"{where}: its url is not ASCII")
    try:
        url_key(url)
    except ValueError as err:
        raise WorkerListError(f"{where}: its url cannot be read ({err})") from None
    healthy = item.get("is_healthy")
    if not isinstance(healthy, bool):
        raise WorkerListError(f"{where}: its is_healthy is {_kind(healthy)}, not true or false")
    model_id = item.get("model_id")
    if not isinstance(model_id, str) or len(model_id) > MAX_MODEL_ID_CHARS:
        model_id = None
    return {
        "id": _text(item, "id", MAX_ID_CHARS, where),
        "url": url,
        "is_healthy": healthy,
        "load": _load(item.get("load")),
        "model_id": model_id,
    }


def parse_workers(answer: Any, where: str) -> list[dict[str, Any]]:
    """Every worker of the answer to ``GET /workers`` ({"workers": [...], ...}), each as
    parse_worker gives it; WorkerListError naming `where` for anything else."""
    if not isinstance(answer, dict):
        raise WorkerListError(f"{where} answered {_kind(answer)}, not a mapping with 'workers'")
    workers = answer.get("workers")
    if not isinstance(workers, list):
        raise WorkerListError(f"{where} answered {_kind(workers)} as 'workers', not a list")
    if len(workers) > MAX_WORKERS:
        raise WorkerListError(
            f"{where} lists {len(workers)} workers, more than {MAX_WORKERS}: not a worker list"
        )
    return [parse_worker(item, f"{where}: worker {index}") for index, item in enumerate(workers)]
