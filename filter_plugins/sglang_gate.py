"""Ansible filters for the smoke gate: the verdict on a benchmark result, and what to keep of it.

    {{ smoke_result | sglang_gate(thresholds, lkg_smoke_result) }}   {passed, failures, summary}
    {{ smoke_result | sglang_smoke_compact(diagnosis, report_path) }}  metrics, workload, verdict
    {{ ansible_play_hosts_all | sglang_rollout_table(hostvars, ansible_check_mode) }}
                                                 the fleet summary, as lines
    {{ 'smoke' | sglang_fleet_module_file }}   the installed sglang_fleet/smoke.py (copied to hosts)
    {{ workload | sglang_smoke_argv(python, client, port, json_path, timeout) }}  client command

Thin wrappers over the installed sglang_fleet package (gate.py; tested there). The
result may be what `slurp` + `b64decode` give (JSON text) or already parsed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError

from sglang_fleet.gate import (
    GateInputError,
    compact,
    evaluate,
    format_rollout_table,
    rollout_rows,
    smoke_argv,
)
from sglang_fleet.plain import plain_mapping


def sglang_smoke_argv(  # noqa: PLR0917 (Jinja passes filter arguments by position)
    workload: Any, python: str, client: str, port: Any, json_path: str, timeout: Any
) -> list[str]:
    """sglang_fleet.gate.smoke_argv(): the smoke client's command; an unknown workload key fails
    the task naming it."""
    try:
        return smoke_argv(
            plain_mapping(workload, "smoke_gate_workload") or {},
            python=str(python), client=str(client), port=int(port), json_path=str(json_path),
            timeout=int(timeout),
        )  # fmt: skip
    except GateInputError as exc:
        raise AnsibleFilterError(str(exc)) from exc


def sglang_gate(result: Any, thresholds: Any = None, baseline: Any = None) -> dict[str, Any]:
    """sglang_fleet.gate.evaluate(); unusable thresholds fail the task naming the threshold."""
    try:
        return evaluate(
            plain_mapping(result, "smoke result") or {},
            plain_mapping(thresholds, "thresholds", optional=True) or {},
            plain_mapping(baseline, "last-known-good smoke result", optional=True),
        )
    except GateInputError as exc:
        raise AnsibleFilterError(f"sglang_gate: {exc}") from exc
    except ValueError as exc:  # the inputs themselves: no mapping, or not JSON
        raise AnsibleFilterError(str(exc)) from exc


def sglang_smoke_compact(result: Any, diagnosis: Any = None, report: str | None = None) -> dict:
    """sglang_fleet.gate.compact(): the part of a passing result that last-known-good keeps."""
    try:
        kept = plain_mapping(result, "smoke result") or {}
        diagnosed = plain_mapping(diagnosis, "diagnosis", optional=True)
    except ValueError as exc:
        raise AnsibleFilterError(str(exc)) from exc
    return compact(kept, diagnosed, str(report) if report else None)


def _host_entry(host: str, hostvars: Mapping[str, Any], check_mode: bool) -> dict[str, Any]:
    """What the rollout recorded on one host: the sglang_server role's documented output facts
    (sglang_server_servers, sglang_server_rollout_results, and the pre-flight's
    sglang_server_preflight.calibration_refused);
    absent when it never got there. A host the `check` entry point found in need of a rollout
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
    """Path of a module of the installed sglang_fleet package (the smoke client goes to hosts)."""
    spec = importlib.util.find_spec(f"sglang_fleet.{name}")
    if spec is None or not spec.origin:
        raise AnsibleFilterError(f"sglang_fleet.{name} is not installed on the control node")
    return spec.origin


class FilterModule:
    """Ansible's entry point for filter plugins."""

    def filters(self) -> dict[str, Any]:
        return {
            "sglang_gate": sglang_gate,
            "sglang_smoke_compact": sglang_smoke_compact,
            "sglang_rollout_table": sglang_rollout_table,
            "sglang_fleet_module_file": sglang_fleet_module_file,
            "sglang_smoke_argv": sglang_smoke_argv,
        }
