"""Ansible filters of the sglang_router role: its settings checked and its command line,
each decided once in Python.

    {{ settings | sglang_router_problems }}
        -> [problem, ...]   (sglang_fleet.servers.router_settings.settings_problems; [] when all is
        well)
    {{ flags | sglang_router_command(python, launcher, key_credential) }}
        -> {flag_argv, argv, exec_start}   (sglang_fleet.servers.router_settings.router_command)

A thin wrapper over the installed sglang_fleet package (docs/ARCHITECTURE.md): bad input fails
the task with the reason.
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
    from sglang_fleet.servers import router_settings
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
else:
    PACKAGE_ERROR = None


def sglang_router_command(
    flags: dict, python: str, launcher: str, key_credential: str = ""
) -> dict[str, Any]:
    try:
        return router_settings.router_command(
            plain(flags),
            python=str(python),
            launcher=str(launcher),
            key_credential=str(key_credential),
        )
    except ValueError as exc:
        raise AnsibleFilterError(f"sglang_router: {exc}") from exc


def sglang_router_problems(settings: dict) -> list[str]:
    return router_settings.settings_problems(plain(settings))


class FilterModule:
    """Filters of the sglang_router role."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return controller_package.filters(
            {
                "sglang_router_command": sglang_router_command,
                "sglang_router_problems": sglang_router_problems,
            },
            PACKAGE_ERROR,
        )
