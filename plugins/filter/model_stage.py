"""Ansible filters for weight staging (thin wrappers over sglang_fleet.servers.model_source; tested
there).

{{ sglang_server_instances | model_stage_copies }}     [{path, source, servers}], one per path
{{ sglang_server_instances | model_stage_protected }}  every model_path (never pruned)
{{ {'model_stage_keep': ..., ...} | model_stage_settings }}  the role's settings, checked
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.ansible_values import plain
    from sglang_fleet.servers.model_source import (
        StageConfigError,
        check_settings,
        host_copies,
        protected_paths,
        stage_summary,
    )
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
else:
    PACKAGE_ERROR = None


def _plain_list(value: Any) -> list:
    """A list (of servers or of loop results) as plain data; None is an empty list."""
    value = plain(value) if value is not None else []
    if not isinstance(value, list):
        raise AnsibleFilterError(f"model_stage: expected a list, got {type(value).__name__}")
    return value


def model_stage_copies(servers: Any) -> list[dict[str, Any]]:
    """One copy per model_path with a model_source; a bad source fails naming the variable."""
    try:
        return host_copies(_plain_list(servers))
    except StageConfigError as exc:
        raise AnsibleFilterError(str(exc)) from exc


def model_stage_protected(servers: Any) -> list[str]:
    """Every model_path of the host's servers."""
    return protected_paths(_plain_list(servers))


def model_stage_settings(settings: Any) -> dict[str, Any]:
    """The role's settings typed and in range; a bad one fails naming its variable."""
    try:
        return check_settings(plain(settings))
    except (StageConfigError, ValueError) as exc:
        raise AnsibleFilterError(str(exc)) from exc


def model_stage_summary(results: Any) -> dict[str, dict[str, Any]]:
    """{model_path: {changed, bytes, copy_seconds, ...}} from the staging loop's results."""
    return stage_summary(_plain_list(results))


class FilterModule:
    """Ansible's entry point for filter plugins."""

    def filters(self) -> dict[str, Any]:
        return controller_package.filters(
            {
                "model_stage_copies": model_stage_copies,
                "model_stage_protected": model_stage_protected,
                "model_stage_settings": model_stage_settings,
                "model_stage_summary": model_stage_summary,
            },
            PACKAGE_ERROR,
        )
