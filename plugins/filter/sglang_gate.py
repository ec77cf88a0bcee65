"""Ansible filters for the fleet summary (the smoke gate's verdict is the sglang_smoke_gate
action's, plugins/action/sglang_smoke_gate.py).

    {{ server | sglang_rollout_row(outcome, smoke_result, restart_result, model_stage_results,
                                   message) }}   one server's row, as roll_out_server.yml notes it
    {{ rows | sglang_rollout_outcome(outcome) }}   the rows, the last one's outcome replaced
                                                 (a rollback after its failure)
    {{ ansible_play_hosts_all | sglang_rollout_table(hostvars, ansible_check_mode) }}
                                                 the fleet summary, as lines
    {{ 'module_utils.nvidia_smi' | sglang_fleet_module_file }}   the installed file of a
    module (one the monitoring role copies to hosts alone; the smoke client and the live sampler
    go as zipapps, sglang_fleet/host_zipapp.py)

Thin wrappers over the installed sglang_fleet package (gate.py; tested there).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.ansible_values import plain_mapping
    from sglang_fleet.rollout.fleet_summary import format_rollout_table, rollout_row, rollout_rows
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
else:
    PACKAGE_ERROR = None


def sglang_rollout_row(  # noqa: PLR0917 (Jinja passes filter arguments by position)
    server: Any,
    outcome: str,
    smoke: Any = None,
    restarted: Any = None,
    staged: Any = None,
    message: Any = None,
) -> dict[str, Any]:
    """sglang_fleet.rollout.fleet_summary.rollout_row(): one server's row of the fleet summary
    (roll_out_server.yml)."""
    try:
        return rollout_row(
            plain_mapping(server, "server") or {},
            str(outcome),
            smoke=plain_mapping(smoke, "smoke gate result", optional=True),
            restarted=plain_mapping(restarted, "restart result", optional=True),
            staged=plain_mapping(staged, "model_stage_results", optional=True),
            message=None if message is None else str(message),
        )
    except ValueError as exc:
        raise AnsibleFilterError(f"sglang_rollout_row: {exc}") from exc


def sglang_rollout_outcome(rows: Any, outcome: Any) -> list[dict[str, Any]]:
    """The fleet summary's rows with the last one's outcome replaced: roll_out_server.yml notes a
    failed server before its rollback (so a rollback that fails too still reads "failed"), and
    the rollback's own outcome afterwards (sglang_fleet.rollout.rollback.row_outcome)."""
    if not isinstance(rows, list) or not rows or not isinstance(rows[-1], Mapping):
        raise AnsibleFilterError("sglang_rollout_outcome: the rows must end with a server's row")
    return [*rows[:-1], {**rows[-1], "outcome": str(outcome)}]


def _host_entry(host: str, hostvars: Mapping[str, Any], check_mode: bool) -> dict[str, Any]:
    """What the rollout recorded on one host: the sglang_server role's documented output facts
    (sglang_server_servers, sglang_server_rollout_results, and the pre-flight's
    sglang_server_preflight.calibration_refused);
    absent when it never got there. A host the `inspect` entry point found in need of a rollout
    (sglang_server_rollout_needed) that the rollout did not reach (sglang_server_rollout_reached)
    counts as never got there. Under --check (check_mode) the servers a rollout would restart
    (sglang_server_restart_names) read "would restart"."""
    facts = hostvars.get(host) or {}
    checked = facts.get("sglang_server_preflight")
    refused = (checked.get("calibration_refused") if isinstance(checked, Mapping) else None) or {}
    pending = bool(facts.get("sglang_server_rollout_needed")) and not facts.get(
        "sglang_server_rollout_reached"
    )
    servers = (
        facts.get("sglang_server_servers")
        if "sglang_server_servers" in facts and not pending
        else None
    )
    return {
        "host": host,
        "servers": None
        if servers is None
        else [{"name": s["name"], "config_hash": s["config_hash"]} for s in servers],
        "results": [
            plain_mapping(r, "rollout result")
            for r in (facts.get("sglang_server_rollout_results") or [])
        ],
        "error": facts.get("sglang_server_failure") if "sglang_server_failure" in facts else None,
        "refused": {str(name): str(message) for name, message in dict(refused).items()},
        "would_restart": [str(name) for name in facts.get("sglang_server_restart_names") or []]
        if check_mode
        else [],
    }


def sglang_rollout_table(
    hosts: list, hostvars: Mapping[str, Any], check_mode: bool = False
) -> list[str]:
    """The fleet summary of playbooks/deploy.yml, from the facts each host's rollout set;
    check_mode (ansible_check_mode): nothing restarted, so say what would."""
    try:
        entries = [_host_entry(str(h), hostvars, bool(check_mode)) for h in hosts]
    except ValueError as exc:  # a rollout result that is no mapping
        raise AnsibleFilterError(str(exc)) from exc
    return format_rollout_table(rollout_rows(entries))


def sglang_fleet_module_file(name: str) -> str:
    """Path of a module of the installed sglang_fleet package (a file copied to hosts alone)."""
    spec = importlib.util.find_spec(f"sglang_fleet.{name}")
    if spec is None or not spec.origin:
        raise AnsibleFilterError(f"sglang_fleet.{name} is not installed on the control node")
    return spec.origin


class FilterModule:
    """Ansible's entry point for filter plugins."""

    def filters(self) -> dict[str, Any]:
        return controller_package.filters(
            {
                "sglang_rollout_row": sglang_rollout_row,
                "sglang_rollout_outcome": sglang_rollout_outcome,
                "sglang_rollout_table": sglang_rollout_table,
                "sglang_fleet_module_file": sglang_fleet_module_file,
            },
            PACKAGE_ERROR,
        )
