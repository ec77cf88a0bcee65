"""Ansible filters for what a stop cost (thin wrappers over sglang_fleet.smoke.downtime; tested
there).

{{ names | sglang_stop_notes(sglang_server_downtimes, sglang_server_drain_results) }}  lines
{{ sglang_server_downtimes[name] | sglang_downtime_seconds }}   stop to healthy, or None
{{ drain_result | sglang_drain_note(downtime) }}    how a drain ran out of time, or None
"""

from __future__ import annotations

from typing import Any

from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.ansible_values import plain_mapping
    from sglang_fleet.smoke.downtime import downtime_seconds, drain_note, stop_notes
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
else:
    PACKAGE_ERROR = None


def sglang_stop_notes(names: Any, downtimes: Any = None, drains: Any = None) -> list[str]:
    return stop_notes(
        [str(n) for n in names or []],
        plain_mapping(downtimes, "downtimes", True) or {},
        plain_mapping(drains, "drains", True) or {},
    )


def sglang_downtime_seconds(downtime: Any) -> float | None:
    return downtime_seconds(plain_mapping(downtime, "downtime", True) or {})


def sglang_drain_note(drain: Any, downtime: Any = None) -> str | None:
    return drain_note(
        plain_mapping(drain, "drain result", True) or {},
        plain_mapping(downtime, "downtime", True) or {},
    )


class FilterModule:
    """Ansible's entry point for filter plugins."""

    def filters(self) -> dict[str, Any]:
        return controller_package.filters(
            {
                "sglang_stop_notes": sglang_stop_notes,
                "sglang_downtime_seconds": sglang_downtime_seconds,
                "sglang_drain_note": sglang_drain_note,
            },
            PACKAGE_ERROR,
        )
