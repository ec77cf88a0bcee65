"""Ansible filters over sglang_fleet.diagnosis.diagnose: what bounds a server's throughput.

    {{ smoke_result | sglang_diagnose(log_text, concurrency, plan_context) }}  after a smoke run
    {{ sample_json | sglang_diagnose_live(plan_context, log_text) }}   a running server, sampled
                                                                       by
                                                                       sglang_fleet/diagnosis/live_metrics.py
    {{ [{host, server, diagnosis}, ...] | sglang_diagnosis_table }}    the table, as lines

Thin wrappers over the installed sglang_fleet package (docs/DIAGNOSIS.md). Results may be JSON
text (as `slurp` + `b64decode` or a command's stdout give them) or already parsed.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.ansible_values import plain_mapping
    from sglang_fleet.diagnosis.live_diagnosis import diagnose_live, table_lines
    from sglang_fleet.diagnosis.run_diagnosis import diagnose
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
else:
    PACKAGE_ERROR = None


def sglang_diagnose(
    smoke_result: Any,
    log_text: str | None = None,
    concurrency: int | None = None,
    plan_context: dict | None = None,
) -> dict:
    """diagnose() for the smoke gate's summary."""
    try:
        result = plain_mapping(smoke_result, "smoke result", optional=True)
        context = plain_mapping(plan_context, "plan context", optional=True)
    except ValueError as exc:
        raise AnsibleFilterError(str(exc)) from exc
    return diagnose(result, log_text or None, int(concurrency) if concurrency else None, context)


def sglang_diagnose_live(
    sample: Any, plan_context: dict | None = None, log_text: str | None = None
) -> dict:
    """diagnose_live() on what sglang_fleet/diagnosis/live_metrics.py printed for a running
    server."""
    try:
        if not isinstance(sample, str):
            sample = plain_mapping(sample, "sample", optional=True)
        context = plain_mapping(plan_context, "plan context", optional=True)
    except ValueError as exc:
        raise AnsibleFilterError(str(exc)) from exc
    try:
        return diagnose_live(sample, context, log_text or None)
    except ValueError as exc:
        raise AnsibleFilterError(f"sglang_diagnose_live: {exc}") from exc


def sglang_diagnosis_table(entries: list) -> list[str]:
    """One header line, then HOST SERVER RUNNING QUEUED TOKEN-USAGE GEN-TOK/S VERDICT LEVER."""
    rows = []
    try:
        for entry in entries or []:
            rows.append(
                {
                    "host": str(entry["host"]),
                    "server": str(entry["server"]),
                    "diagnosis": plain_mapping(entry["diagnosis"], "diagnosis", optional=True)
                    or {},
                }
            )
    except ValueError as exc:
        raise AnsibleFilterError(str(exc)) from exc
    return table_lines(rows)


class FilterModule:
    """Ansible's entry point for filter plugins."""

    def filters(self) -> dict[str, Any]:
        return controller_package.filters(
            {
                "sglang_diagnose": sglang_diagnose,
                "sglang_diagnose_live": sglang_diagnose_live,
                "sglang_diagnosis_table": sglang_diagnosis_table,
            },
            PACKAGE_ERROR,
        )
