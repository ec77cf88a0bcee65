"""Ansible filters of playbooks/driver_upgrade.yml: the driver rollout decided in Python
(sglang_fleet.rollout.driver_upgrade, tested in tests/test_driver_rollout.py).

    {{ driver_upgrade_serial | driver_rollout_settings_problems(nvidia_driver_branch) }}
        -> [problem, ...]    the run's settings, checked before any host is read
    {{ ansible_play_hosts | driver_rollout_plan(hostvars, driver_upgrade_serial) }}
        -> {problems, routed, direct, hosts: {host: {change, stop, clean_gpus, ...}}, lines}
    {{ inventory_hostname | driver_rollout_summary(before, after, restarted, stopped_at) }}
        -> the line a host ends with
    {{ inventory_hostname | driver_rollout_down_report(stopped, active_units, servers, failure,
                                                       restarted) }}
        -> why a host failed and which of its servers stay down

The plan reads, per host: ml_env_accelerator, nvidia_driver_plan (the nvidia_driver role's
pre-flight), sglang_server_servers and sglang_server_driver_read
(roles/sglang_server/tasks/driver_host_read.yml).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.ansible_values import plain
    from sglang_fleet.rollout import driver_upgrade as _rollout
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
else:
    PACKAGE_ERROR = None


def driver_rollout_settings_problems(serial: Any, branch: Any = None) -> list[str]:
    return _rollout.settings_problems(plain(serial), plain(branch))


def _read(known: Mapping[str, Any]) -> dict[str, Any]:
    read = plain(known.get("sglang_server_driver_read") or {})
    lkg = read.get("lkg") or {}
    servers = [
        {
            "name": server.get("name"),
            "unit": server.get("unit"),
            "device": server.get("device"),
            "nodes": server.get("nodes") or [],
            "router": server.get("router"),
            "lkg": bool(lkg.get(server.get("name"))),
        }
        for server in plain(known.get("sglang_server_servers") or [])
    ]
    return {
        "accelerator": str(known.get("ml_env_accelerator") or "cuda"),
        "driver": plain(known.get("nvidia_driver_plan")) or None,
        "servers": servers,
        "active_units": read.get("active_units") or [],
        "routers": read.get("routers") or {},
        "min_healthy_others": read.get("min_healthy_others", 1),
    }


def driver_rollout_plan(hosts: Any, hostvars: Mapping, serial: Any = None) -> dict[str, Any]:
    names = [str(host) for host in plain(hosts) or []]
    reads = {host: _read(hostvars.get(host) or {}) for host in names}
    try:
        return _rollout.plan(names, reads, plain(serial))
    except (KeyError, TypeError, ValueError) as exc:
        raise AnsibleFilterError(f"driver_rollout_plan: {exc}") from exc


def driver_rollout_summary(
    host: Any, before: Any, after: Any, restarted: Any = None, stopped_at: Any = None
) -> str:
    return _rollout.host_summary(str(host), before, after, plain(restarted) or [], stopped_at)


def driver_rollout_down_report(  # noqa: PLR0917 (Jinja passes filter arguments by position)
    host: Any, stopped: Any, active_units: Any, servers: Any, failure: Any, restarted: Any = None
) -> str:
    return _rollout.down_report(
        str(host),
        plain(stopped) or [],
        plain(active_units) or [],
        plain(servers) or [],
        str(failure),
        restarted=[
            str(entry.get("name")) for entry in plain(restarted) or [] if isinstance(entry, dict)
        ],
    )


class FilterModule:
    """Filters of playbooks/driver_upgrade.yml."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return controller_package.filters(
            {
                "driver_rollout_settings_problems": driver_rollout_settings_problems,
                "driver_rollout_plan": driver_rollout_plan,
                "driver_rollout_summary": driver_rollout_summary,
                "driver_rollout_down_report": driver_rollout_down_report,
            },
            PACKAGE_ERROR,
        )
