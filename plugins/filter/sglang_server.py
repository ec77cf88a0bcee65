"""Ansible filters of the sglang_server role: the inventory's servers, resolved once, and checks.

    {{ sglang_server_instances | sglang_server_describe(profiles, overrides, defaults,
                                                         nccl_env, runtime, cluster,
                                                         tuned, device) }}
    {{ sglang_server_instances | sglang_server_cluster(hostvars, inventory_hostname) }}
    {{ servers | sglang_host_errors(host) }}         host: {gpu_count, ram_mib}
    {{ servers | map('sglang_server_errors', host) }}
    {{ servers | sglang_restart_decision(changed_paths, running_units, lkg_slurps) }}
    {{ servers | sglang_server_secret_files(secrets) }}     the secrets files: only for no_log tasks
    {{ servers | sglang_server_records_and_routers }}       {records, routers}: sglang_host_state's
    {{ servers | sglang_restart_lines(restart_names, lkg_slurps, running_units) }}  check's words
    {{ servers | sglang_servers_on_gpus([0, 1]) }}          the servers using any of those GPUs
    {{ sglang_server_instances | sglang_server_api_keys }}   {name: key}: only for no_log tasks
    {{ sglang_server_instances | sglang_server_secrets }}    {name: {field: secret}}: no_log only
    {{ hosts | sglang_rollout_groups(hostvars) }}    {host: [multinode, routed or direct]}
    {{ servers | sglang_node_restarts(hostvars, fact) }}  servers across hosts a node restarts

Thin wrappers over the installed sglang_fleet package (docs/ARCHITECTURE.md): bad input fails
the task with the variable to fix.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.module_utils.bounded_json import loads as bounded_loads

    from sglang_fleet import server_secrets as _server_secrets
    from sglang_fleet.ansible_values import plain
    from sglang_fleet.servers import (
        describe,
        host_checks,
        restart_decision,
        secret_files,
        server_values,
        unit_files,
    )
    from sglang_fleet.servers import nodes as _nodes
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
else:
    PACKAGE_ERROR = None


def _wrap(func: Callable[..., Any], *args: Any) -> Any:
    try:
        return func(*(plain(arg) for arg in args))
    except (server_values.ServerConfigError, ValueError) as exc:
        raise AnsibleFilterError(str(exc)) from exc


def sglang_server_describe(  # noqa: PLR0917 (Jinja passes filter arguments by position)
    servers: list,
    profiles: dict | None = None,
    overrides: dict | None = None,
    defaults: dict | None = None,
    nccl_env: dict | None = None,
    runtime: dict | None = None,
    cluster: dict | None = None,
    tuned: dict | None = None,
    device: str = "cuda",
) -> list[dict]:
    """sglang_fleet.servers.describe.describe_servers(): every server with what the role writes;
    cluster {host: inventory_hostname} gives the default host of a router's worker URL; device
    is the host's default (sglang_server_device)."""
    try:
        return describe.describe_servers(
            plain(servers),
            plain(profiles or {}),
            plain(overrides or {}),
            plain(defaults or {}),
            nccl_env=plain(nccl_env or {}),
            runtime=plain(runtime or {}),
            cluster=plain(cluster or {}),
            tuned=plain(tuned or {}),
            device=plain(device),
        )
    except (server_values.ServerConfigError, ValueError) as exc:
        raise AnsibleFilterError(str(exc)) from exc


def sglang_server_errors(server: dict, host: dict) -> list[dict]:
    return _wrap(host_checks.server_errors, server, host)


def sglang_host_errors(servers: list, host: dict) -> list[dict]:
    return _wrap(host_checks.host_errors, servers, host)


def _lkg_record(read: Any) -> dict[str, Any] | None:
    """An lkg/meta.json as a dict, from its text (what the pre-flight read) or a slurp result;
    None where there is none or it does not parse."""
    if read is None:
        return None
    try:
        text = read if isinstance(read, str) else base64.b64decode(read["content"])
        record = bounded_loads(text, "lkg/meta.json")
    except (KeyError, TypeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _records(servers: list, lkg: Any) -> list[dict[str, Any] | None]:
    """Each server's last-known-good record, in the servers' order. lkg: {server name: its
    lkg/meta.json text or null} (the pre-flight's `lkg_records`, which may name more servers
    than a rollout play's scope), or a list in the servers' order of texts, slurp results or
    nulls."""
    given = plain(lkg)
    if isinstance(given, dict):
        return [_lkg_record(given.get(str(s.get("name")))) for s in plain(servers) or []]
    return [_lkg_record(item) for item in given or []]


def sglang_restart_decision(
    servers: list, changed_paths: list, running_units: list, lkg_slurps: Any
) -> list[str]:
    """sglang_fleet.servers.restart_decision.restart_decision(): the servers a rollout restarts
    (lkg_slurps: see _records)."""
    records = _records(servers, lkg_slurps)
    return _wrap(restart_decision.restart_decision, servers, changed_paths, running_units, records)


def sglang_server_records_and_routers(servers: list) -> dict[str, list[dict]]:
    """sglang_fleet.servers.unit_files.records_and_routers(): what sglang_host_state checks besides
    files."""
    return _wrap(unit_files.records_and_routers, servers)


def sglang_server_secret_files(servers: list, secrets: dict) -> list[dict]:
    """sglang_fleet.servers.secret_files.secret_files(): the secrets files (the keys): no_log tasks
    only."""
    return _wrap(secret_files.secret_files, servers, secrets)


def sglang_server_secrets(servers: Any) -> dict[str, dict[str, str]]:
    """{name: {secret field: value}} (sglang_fleet/server_secrets.py): no_log tasks only."""
    return _server_secrets.server_secrets(plain(servers))


def sglang_restart_lines(
    servers: list, restart_names: list, lkg_slurps: Any, running_units: list
) -> list[str]:
    """sglang_fleet.servers.restart_decision.restart_lines(): what a rollout would do, flag by
    flag."""
    records = _records(servers, lkg_slurps)
    return _wrap(restart_decision.restart_lines, servers, restart_names, records, running_units)


def sglang_server_cluster(servers: Any, hostvars: Mapping, host: str) -> dict[str, Any]:
    """Where multi-node servers run: this host's name and, for every host named in a server's
    nodes that the inventory knows, its interfaces and how it describes its servers (names,
    node lists and GPU counts only: never a key). Hosts of no server's nodes are not read."""
    names = {
        node
        for server in (plain(servers) or [])
        if isinstance(server, Mapping)
        for node in (server.get("nodes") or [])
        if isinstance(node, str)
    }
    hosts = {}
    for name in sorted(names):
        if name not in hostvars:
            continue
        known = hostvars[name]
        hosts[name] = _nodes.host_facts(
            plain(known.get("ansible_facts") or {}),
            plain(known.get("sglang_server_instances") or []),
        )
    return {"host": str(host), "hosts": hosts}


def sglang_servers_on_gpus(servers: list, gpus: list) -> list[dict]:
    """The described servers that use any of gpus (all of them when gpus is empty)."""
    wanted = {int(gpu) for gpu in plain(gpus) or []}
    return [
        server
        for server in plain(servers)
        if not wanted or wanted.intersection(int(gpu) for gpu in server["gpus"])
    ]


def sglang_server_api_keys(servers: Any) -> dict[str, str]:
    """{name: API key}: read only by no_log tasks (the secrets file, the smoke client's stdin)."""
    return secret_files.api_keys(plain(servers))


def sglang_rollout_groups(hosts: list, hostvars: Mapping) -> dict[str, list[str]]:
    """nodes.rollout_groups() from what the `inspect` entry point left on each host
    (sglang_server_servers, sglang_server_rollout_needed)."""
    names = [str(host) for host in plain(hosts) or []]
    facts = {}
    for host in names:
        known = hostvars.get(host) or {}
        facts[host] = {
            "servers": [
                {key: server.get(key) for key in ("name", "nodes", "router")}
                for server in plain(known.get("sglang_server_servers") or [])
            ],
            "needed": bool(known.get("sglang_server_rollout_needed")),
        }
    return _wrap(_nodes.rollout_groups, names, facts)


def sglang_node_restarts(servers: list, hostvars: Mapping, fact: str) -> list[str]:
    """nodes.restarts_with_nodes(): each node's own restart decision is the fact named `fact`."""
    described = plain(servers) or []
    nodes = {node for server in described for node in server.get("nodes") or []}
    decisions = {node: plain((hostvars.get(node) or {}).get(fact) or []) for node in sorted(nodes)}
    return _wrap(_nodes.restarts_with_nodes, described, decisions)


class FilterModule:
    """Filters of the sglang_server role."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return controller_package.filters(
            {
                "sglang_server_describe": sglang_server_describe,
                "sglang_server_errors": sglang_server_errors,
                "sglang_host_errors": sglang_host_errors,
                "sglang_restart_decision": sglang_restart_decision,
                "sglang_server_secret_files": sglang_server_secret_files,
                "sglang_server_records_and_routers": sglang_server_records_and_routers,
                "sglang_restart_lines": sglang_restart_lines,
                "sglang_servers_on_gpus": sglang_servers_on_gpus,
                "sglang_server_cluster": sglang_server_cluster,
                "sglang_server_api_keys": sglang_server_api_keys,
                "sglang_server_secrets": sglang_server_secrets,
                "sglang_rollout_groups": sglang_rollout_groups,
                "sglang_node_restarts": sglang_node_restarts,
            },
            PACKAGE_ERROR,
        )
