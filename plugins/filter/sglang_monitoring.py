"""Ansible filters of the monitoring role: typed settings and what Prometheus scrapes.

    {{ {'monitoring_rate_window': monitoring_rate_window, ...} | sglang_monitoring_settings }}
        the settings typed and checked (sglang_fleet/monitoring/settings.py): what templates print
    {{ hosts | sglang_scrape_targets(monitoring_host, key_dir, ttft_ms, tpot_ms, job_hosts) }}
        {servers, routers, nodes, slos, jobs}: no key in it, safe to template and log
    {{ hosts | sglang_monitoring_credentials(key_dir) }}
        [{path, key}]: for a task with no_log only
    {{ text | sglang_yaml_string }}
        one YAML double-quoted scalar that Prometheus reads back as the same text

Thin wrappers over the installed sglang_fleet package (monitoring/scrape_targets.py,
monitoring/settings.py, docs/MONITORING.md): bad input fails the task naming the variable, or
the host, server and field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.ansible_values import plain
    from sglang_fleet.monitoring import scrape_targets
    from sglang_fleet.monitoring import settings as monitoring_settings
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
else:
    PACKAGE_ERROR = None


def _wrap(func: Callable[..., Any], *args: Any) -> Any:
    """func on the arguments as plain Python values; its errors as the task's failure."""
    try:
        return func(*(plain(arg) for arg in args))
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise AnsibleFilterError(f"monitoring: {exc}") from exc


def sglang_monitoring_settings(values: dict) -> dict[str, Any]:
    return _wrap(monitoring_settings.check_settings, values)


def sglang_scrape_targets(  # noqa: PLR0917 (Jinja passes filter arguments by position)
    hosts: list,
    monitoring_host: str,
    key_dir: str,
    ttft_ms: float,
    tpot_ms: float,
    job_hosts: list | None = None,
) -> dict[str, Any]:
    return _wrap(
        scrape_targets.targets, hosts, str(monitoring_host), str(key_dir), ttft_ms, tpot_ms,
        job_hosts or [],
    )  # fmt: skip


def sglang_monitoring_credentials(hosts: list, key_dir: str) -> list[dict[str, str]]:
    return _wrap(scrape_targets.server_credentials, hosts, str(key_dir))


def sglang_yaml_string(value: Any) -> str:
    return _wrap(scrape_targets.yaml_string, value)


class FilterModule:
    """Filters of the monitoring role."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return controller_package.filters(
            {
                "sglang_monitoring_settings": sglang_monitoring_settings,
                "sglang_scrape_targets": sglang_scrape_targets,
                "sglang_monitoring_credentials": sglang_monitoring_credentials,
                "sglang_yaml_string": sglang_yaml_string,
            },
            PACKAGE_ERROR,
        )
