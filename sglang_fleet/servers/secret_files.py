"""The root-only secrets file of each server that has a secret (read by SGLang's --config), and
the API keys the smoke client, probes and router need; only no_log tasks see their content.
Also the header and ownership every file the role writes shares.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_fleet import server_secrets as _secrets
from sglang_fleet.servers.server_values import SERVERS_VAR, ServerConfigError

# What Ansible's own templates put first ({{ ansible_managed | comment }}). The role's files kept
# it when they moved from templates to here, so a file a template wrote is the same byte for byte
# (an upgrade restarts nothing).
MANAGED_HEADER = "#\n# Ansible managed\n#\n"
ROOT_FILE = {"owner": "root", "group": "root", "mode": "0644"}


def has_secrets(server: Mapping[str, Any]) -> bool:
    """Whether the server has a secrets file (any secret field, the API key among them)."""
    return bool(server.get("secrets_set") or server.get("api_key_set"))


def secret_files(
    servers: list[Mapping[str, Any]], secrets: Mapping[str, Mapping[str, str]]
) -> list[dict]:
    """The root-only secrets file of each server with a secret, with its content: read by
    SGLang's --config, which turns each key into "--<key> <value>" as written (dashed keys).
    secrets: server_secrets.server_secrets() of the inventory ({name: {field: value}}). Only
    no_log tasks call this."""
    import yaml  # noqa: PLC0415 (the control node's Ansible brings PyYAML; the hosts need none)

    files = []
    for server in servers:
        if not has_secrets(server):
            continue
        given = secrets.get(server["name"])
        given = given if isinstance(given, Mapping) else {}
        fields = sorted(server.get("secrets_set") or ["api_key"])
        missing = [field for field in fields if not given.get(field)]
        if missing:
            raise ServerConfigError(
                f"{SERVERS_VAR}[{server['name']}]",
                f"the description names {', '.join(missing)} but no value was handed over",
            )
        key = {_secrets.secrets_file_key(field): given[field] for field in fields}
        body = yaml.safe_dump(key, indent=4, allow_unicode=True, default_flow_style=False)
        content = (
            f"{MANAGED_HEADER}# Read by SGLang's --config, which turns each key into"
            ' "--<key> <value>" exactly as written:\n# keys take the flags\' dashed spelling.\n'
            f"{body}"
        )
        path = server["paths"]["secrets_file"]
        files.append({"server": server["name"], "path": path, **ROOT_FILE, "mode": "0600",
                      "content": content})  # fmt: skip
    return files


def api_keys(servers: Any) -> dict[str, str]:
    """{server name: API key} of the servers that have one: what the smoke client, the probes and
    the router need. Kept out of describe_servers() so the key never lands in a printed fact."""
    if not isinstance(servers, list):
        return {}
    return {
        str(server["name"]): str(server["api_key"])
        for server in servers
        if isinstance(server, Mapping) and server.get("api_key") not in (None, "")
    }
