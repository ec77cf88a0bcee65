"""Ansible filters for the smoke gate: the verdict on a benchmark result, and what to keep of it.

    {{ smoke_result | sglang_gate(thresholds, lkg_smoke_result) }}   {passed, failures, summary}
    {{ smoke_result | sglang_smoke_compact(diagnosis, report_path) }}  metrics, workload, verdict
    {{ ansible_play_hosts_all | sglang_rollout_table(hostvars) }}    the fleet summary, as lines

Thin wrappers: the logic lives in sglang_fleet/gate.py (tested there). The result may be what
`slurp` + `b64decode` give (JSON text) or already parsed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError

# Ansible loads this file by path, not as part of a package: make the repository root (its
# parent's parent) importable so the filters use the same sglang_fleet the tests cover.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from sglang_fleet.gate import (  # noqa: E402  (needs the sys.path entry above)
    GateInputError,
    compact,
    evaluate,
    format_rollout_table,
    rollout_rows,
)
from sglang_fleet.servers import config_hash  # noqa: E402


def _plain(value: Any, what: str, optional: bool = False) -> dict[str, Any] | None:
    """Ansible's lazy containers (or JSON text) as a plain dict."""
    if optional and not value:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise AnsibleFilterError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, Mapping):
        raise AnsibleFilterError(f"{what} must be a mapping, got {type(value).__name__}")
    return json.loads(json.dumps(dict(value)))


def sglang_gate(result: Any, thresholds: Any = None, baseline: Any = None) -> dict[str, Any]:
    """sglang_fleet.gate.evaluate(); unusable thresholds fail the task naming the threshold."""
    try:
        return evaluate(
            _plain(result, "smoke result") or {},
            _plain(thresholds, "thresholds", optional=True) or {},
            _plain(baseline, "last-known-good smoke result", optional=True),
        )
    except GateInputError as exc:
        raise AnsibleFilterError(f"sglang_gate: {exc}") from exc


def sglang_smoke_compact(result: Any, diagnosis: Any = None, report: str | None = None) -> dict:
    """sglang_fleet.gate.compact(): the part of a passing result that last-known-good keeps."""
    return compact(
        _plain(result, "smoke result") or {},
        _plain(diagnosis, "diagnosis", optional=True),
        str(report) if report else None,
    )


def _host_entry(host: str, hostvars: Mapping[str, Any]) -> dict[str, Any]:
    """What the restart recorded on one host (facts it set; absent when it never got there)."""
    facts = hostvars.get(host) or {}
    servers = facts.get("_sglang_server_servers") if "_sglang_server_servers" in facts else None
    return {
        "host": host,
        "servers": None
        if servers is None
        else [
            {"name": s["name"], "config_hash": config_hash(_plain(s, "server"))} for s in servers
        ],
        "results": [
            _plain(r, "rollout result") for r in (facts.get("sglang_server_rollout_results") or [])
        ],
        "error": facts.get("deploy_failure") if "deploy_failure" in facts else None,
    }


def sglang_rollout_table(hosts: list, hostvars: Mapping[str, Any]) -> list[str]:
    """The fleet summary of playbooks/deploy.yml, from the facts each host's rollout set."""
    return format_rollout_table(rollout_rows([_host_entry(str(h), hostvars) for h in hosts]))


class FilterModule:
    """Ansible's entry point for filter plugins."""

    def filters(self) -> dict[str, Any]:
        return {
            "sglang_gate": sglang_gate,
            "sglang_smoke_compact": sglang_smoke_compact,
            "sglang_rollout_table": sglang_rollout_table,
        }
