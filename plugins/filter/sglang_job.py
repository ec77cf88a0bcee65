"""Ansible filters of the sglang_job role (playbooks/job.yml, docs/JOB.md).

    {{ {'sglang_job_action': ..., ...} | sglang_job_settings }}
        the settings typed; a bad one fails the task naming the variable
    {{ sglang_job_api_key | sglang_job_key_problem }}
        what is wrong with the key ("" for nothing), never quoting it: set it under no_log
    {{ sglang_job_input | sglang_job_input(max_tokens, avg_input_len) }}
        {path, size, sha256, rows, unusable, duplicates, avg_input_len, avg_output_len}
    {{ sglang_server_servers | sglang_job_read_request(host, nvidia_smi, calibration_mode) }}
        what sglang_host_state must read for the plan
    {{ sglang_server_servers | sglang_job_plans(host, read, workload, host_ram_mib, mode) }}
        [{host, name, port, listen, router_url, model, planned, problem}]
    {{ hostvars | sglang_job_targets(hosts, job_host, model, concurrency) }}
        {model, targets: [{url, concurrency, planned, servers, via}], lines}
    {{ hostvars | sglang_job_key(hosts, servers, override) }}
        the key the job sends: for a task with no_log only
    {{ settings | sglang_job_record(input_facts, model) }}
        the job's record on its host
    {{ old | sglang_job_record_problem(new, started) }}
        why a start may not go on with the job's record as it is ("" when it may)
    {{ settings | sglang_job_resumed(old) }}
        resume: the settings with the job's own model, max_tokens and sampling from its record
    {{ settings | sglang_job_command(chosen, paths) }}
        {argv, exec_start}: the runner's command line in the unit
    {{ status_json | sglang_job_status_lines(name, unit_status) }}
        what `status` shows

Thin wrappers over the installed sglang_fleet package (job/play_inputs.py, job/play_targets.py,
rollout/job_plans.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.module_utils.bounded_json import loads as bounded_loads

    from sglang_fleet.ansible_values import plain
    from sglang_fleet.job import play_inputs, play_targets
    from sglang_fleet.rollout import job_plans
    from sglang_fleet.servers import secret_files
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
else:
    PACKAGE_ERROR = None


def _wrap(func: Callable[..., Any], *args: Any) -> Any:
    try:
        return func(*(plain(arg) for arg in args))
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise AnsibleFilterError(f"sglang_job: {exc}") from exc


def sglang_job_settings(values: dict) -> dict[str, Any]:
    return _wrap(play_inputs.check_settings, values)


def sglang_job_key_problem(key: Any) -> str:
    """What is wrong with sglang_job_api_key ("" for nothing), never quoting it."""
    if key in (None, ""):
        return ""
    return play_inputs.key_problem(key) or ""


def sglang_job_input(path: str, max_tokens: Any, avg_input_len: Any = None) -> dict[str, Any]:
    return _wrap(play_inputs.input_facts, path, max_tokens, avg_input_len)


def sglang_job_read_request(
    servers: list, host: str, nvidia_smi: str, calibration_mode: str
) -> dict[str, Any]:
    return _wrap(job_plans.read_request, servers, str(host), str(nvidia_smi), calibration_mode)


def sglang_job_plans(  # noqa: PLR0917 (Jinja passes filter arguments by position)
    servers: list, host: str, read: Any, workload: Any, host_ram_mib: Any, mode: str
) -> list[dict[str, Any]]:
    def plans(*args: Any) -> list[dict[str, Any]]:
        return job_plans.entries(*args[:4], host_ram_mib=args[4], calibration_mode=args[5])

    return _wrap(plans, servers, str(host), read, workload, host_ram_mib, mode)


def _from_hosts(hostvars: Mapping, hosts: list, fact: str) -> list[Any]:
    found = []
    for host in plain(hosts) or []:
        known = hostvars.get(str(host)) or {}
        found.append((str(host), known.get(fact)))
    return found


def sglang_job_targets(
    hostvars: Mapping, hosts: list, job_host: str, model: Any, concurrency: Any
) -> dict[str, Any]:
    entries = [
        e
        for _host, plans in _from_hosts(hostvars, hosts, "sglang_job_plans")
        for e in plain(plans) or []
    ]
    return _wrap(play_targets.targets, entries, str(job_host), model or None, concurrency)


def sglang_job_key(hostvars: Mapping, hosts: list, servers: list, override: str = "") -> str:
    """The job's key (sglang_job_api_key, else its servers' one key): no_log tasks only."""
    keys: dict[str, str] = {}
    for host, instances in _from_hosts(hostvars, hosts, "sglang_server_instances"):
        for name, key in _wrap(secret_files.api_keys, instances or []).items():
            keys[f"{name} on {host}"] = key
    return _wrap(play_targets.api_key, keys, servers, override or "")


def sglang_job_record(settings: dict, facts: dict, model: str) -> dict[str, Any]:
    return _wrap(play_inputs.record, settings, facts, str(model))


def _record_text(old: Any) -> Any:
    """job.json as slurped and decoded (text; empty when there is none), parsed."""
    if not isinstance(old, str) or not old.strip():
        return None
    try:
        return bounded_loads(old, "job.json")
    except ValueError as exc:
        raise AnsibleFilterError(f"sglang_job: the job's record is damaged ({exc})") from exc


def sglang_job_record_problem(old: Any, new: dict, started: bool) -> str:
    return _wrap(play_inputs.record_problem, _record_text(old), new, bool(started))


def sglang_job_resumed(settings: dict, old: Any) -> dict[str, Any]:
    return _wrap(play_inputs.resumed_settings, settings, _record_text(old))


def sglang_job_command(settings: dict, chosen: dict, paths: dict) -> dict[str, Any]:
    return _wrap(play_targets.command, settings, chosen, paths)


def sglang_job_status_lines(status_json: Any, name: str, unit: Any) -> list[str]:
    snapshot = None
    if isinstance(status_json, str) and status_json.strip():
        try:
            snapshot = bounded_loads(status_json, "the runner's status")
        except ValueError:
            snapshot = None
    elif isinstance(status_json, Mapping):
        snapshot = status_json
    return _wrap(play_targets.status_lines, str(name), snapshot, unit or {})


class FilterModule:
    """Filters of the sglang_job role."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return controller_package.filters(
            {
                "sglang_job_settings": sglang_job_settings,
                "sglang_job_key_problem": sglang_job_key_problem,
                "sglang_job_input": sglang_job_input,
                "sglang_job_read_request": sglang_job_read_request,
                "sglang_job_plans": sglang_job_plans,
                "sglang_job_targets": sglang_job_targets,
                "sglang_job_key": sglang_job_key,
                "sglang_job_record": sglang_job_record,
                "sglang_job_record_problem": sglang_job_record_problem,
                "sglang_job_resumed": sglang_job_resumed,
                "sglang_job_command": sglang_job_command,
                "sglang_job_status_lines": sglang_job_status_lines,
            },
            PACKAGE_ERROR,
        )
