"""Ansible filters of the monitoring role: what Prometheus scrapes, from the inventory.

    {{ hosts | sglang_monitoring_plan(monitoring_host, key_dir, ttft_ms, tpot_ms) }}
        {servers, routers, nodes, slos}: no key in it, safe to template and log
    {{ hosts | sglang_monitoring_credentials(key_dir) }}
        [{path, key}]: for a task with no_log only

Thin wrappers over the installed sglang_fleet package (monitoring.py, docs/MONITORING.md): an
inventory Prometheus cannot scrape fails the task naming the server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ansible.errors import AnsibleFilterError

from sglang_fleet import monitoring
from sglang_fleet.plain import plain


def sglang_monitoring_plan(
    hosts: list, monitoring_host: str, key_dir: str, ttft_ms: float, tpot_ms: float
) -> dict[str, Any]:
    try:
        return monitoring.scrape_plan(
            plain(hosts), str(monitoring_host), str(key_dir), float(ttft_ms), float(tpot_ms)
        )
    except (KeyError, ValueError) as exc:
        raise AnsibleFilterError(f"monitoring: {exc}") from exc


def sglang_monitoring_credentials(hosts: list, key_dir: str) -> list[dict[str, str]]:
    return monitoring.server_credentials(plain(hosts), str(key_dir))


class FilterModule:
    """Filters of the monitoring role."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {
            "sglang_monitoring_plan": sglang_monitoring_plan,
            "sglang_monitoring_credentials": sglang_monitoring_credentials,
        }
