"""What a stop cost: downtime from the stop to a passed health gate, and a drain that ran out of
time with the requests it left running (docs/STAGING.md, docs/ROUTER.md).

The sglang_server role records, per server, `sglang_server_downtimes[name]` =
{was_running, stop_result, downtime_seconds} (replace_server.yml) and, for a replica behind a
router, `sglang_server_drain_results[name]` = {drained, running_reqs, drain_seconds}
(router_take_out.yml). The fleet summary and the rollback's message read them through these
functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_fleet.module_utils.typed_number import Range, finite_or_none


def _count(value: Any) -> int | None:
    number = finite_or_none(value, Range(0))
    return None if number is None else int(number)


def downtime_seconds(downtime: Mapping[str, Any] | None) -> float | None:
    """Seconds from the stop to the passed health gate; None when the server was not running
    before (a first start has no downtime to measure) or nothing was recorded."""
    if not downtime or not downtime.get("was_running"):
        return None
    return finite_or_none(downtime.get("downtime_seconds"), Range(0))


def killed_at_stop(downtime: Mapping[str, Any] | None) -> bool:
    """systemd killed the server: its SIGTERM drain outlasted TimeoutStopSec (Result=timeout)."""
    return bool(
        downtime and downtime.get("was_running") and downtime.get("stop_result") == "timeout"
    )


def drain_note(
    drain: Mapping[str, Any] | None, downtime: Mapping[str, Any] | None = None
) -> str | None:
    """A sentence when the stop did not go cleanly: the router drain ran out of time, or systemd
    killed the server at the end of TimeoutStopSec. None for a clean drain (or none at all)."""
    timed_out = bool(drain) and drain.get("drained") is False
    killed = killed_at_stop(downtime)
    if not timed_out and not killed:
        return None
    parts = []
    if timed_out:
        running = _count(drain.get("running_reqs"))
        seconds = finite_or_none(drain.get("drain_seconds"))
        parts.append(
            "drain ran out of time"
            + (f" after {seconds:.0f} s" if seconds is not None else "")
            + (f" with {running} request(s) still running" if running is not None else "")
        )
    if killed:
        running = _count(drain.get("running_reqs")) if timed_out else None
        parts.append(
            "systemd killed the server at the end of TimeoutStopSec: "
            + (f"up to {running} request(s) cut" if running is not None else "requests cut")
        )
    elif timed_out:
        parts.append("they finished in SGLang's own SIGTERM drain (not killed)")
    return "; ".join(parts)


def stop_notes(
    names: list[str],
    downtimes: Mapping[str, Any] | None,
    drains: Mapping[str, Any] | None,
) -> list[str]:
    """A line per stopped server: its downtime and, if it did, how the drain ran out of time."""
    downtimes = downtimes or {}
    drains = drains or {}
    lines = []
    for name in names:
        downtime = downtimes.get(name)
        seconds = downtime_seconds(downtime)
        text = f"{name}: down {seconds:.1f} s (stop to healthy)" if seconds is not None else None
        note = drain_note(drains.get(name), downtime)
        if text or note:
            lines.append(", ".join(t for t in (text or name, note) if t))
    return lines
