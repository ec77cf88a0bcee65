"""Ansible filters for the sglang_server role: server resolution, validation and rendering.

    {{ sglang_server_instances | sglang_resolve_servers(profiles, overrides, defaults) }}
    {{ server | sglang_server_errors(host) }}        host: {gpu_count, ram_mib}
    {{ servers | sglang_host_errors(host) }}
    {{ server.flags | sglang_argv }}                 ["--model-path", "/m", "--tp-size", "8"]
    {{ server | sglang_launch_argv(python, module) }}  [python, "-m", module, *flags]
    {{ argv | sglang_exec_start }}                   the value of an ExecStart= line
    {{ 'NCCL_PROTO' | sglang_env_line('LL') }}       NCCL_PROTO="LL"
    {{ server | sglang_config_hash }}                12 hex digits naming the configuration

Thin wrappers: the logic lives in sglang_fleet/ (tested there). Bad input fails the task with
the variable to fix.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError

# Ansible loads this file by path, not as part of a package: make the repository root (its
# parent's parent) importable so the filters use the same sglang_fleet the tests cover.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from sglang_fleet import flags as _flags  # noqa: E402  (needs the sys.path entry above)
from sglang_fleet import validate as _validate  # noqa: E402
from sglang_fleet.servers import ServerConfigError, config_hash, resolve_servers  # noqa: E402


def _plain(value: Any) -> Any:
    """Ansible's lazy/tagged containers as plain dicts and lists (deep copies are cheap here)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def _wrap(func: Callable[..., Any], *args: Any) -> Any:
    try:
        return func(*(_plain(arg) for arg in args))
    except (ServerConfigError, ValueError) as exc:
        raise AnsibleFilterError(str(exc)) from exc


def sglang_resolve_servers(
    servers: list, profiles: dict | None = None, overrides: dict | None = None, defaults=None
) -> list[dict]:
    return _wrap(resolve_servers, servers, profiles or {}, overrides or {}, defaults or {})


def sglang_server_errors(server: dict, host: dict) -> list[dict]:
    return _wrap(_validate.server_errors, server, host)


def sglang_host_errors(servers: list, host: dict) -> list[dict]:
    return _wrap(_validate.host_errors, servers, host)


def sglang_argv(flags: dict) -> list[str]:
    return _wrap(_flags.to_argv, flags)


def sglang_launch_argv(server: dict, python: str, launch_module: str) -> list[str]:
    """The full command: the ml-env python running the launch module with the server's flags."""
    return [str(python), "-m", str(launch_module), *sglang_argv(server["flags"])]


def sglang_config_hash(server: dict) -> str:
    return _wrap(config_hash, server)


def sglang_not_last_known_good(servers: list, lkg_slurps: list) -> list[str]:
    """Names of servers whose last-known-good record is missing or names another configuration.

    lkg_slurps: the results of slurping each server's lkg/meta.json, in the same order.
    """
    names = []
    for server, slurp in zip(_plain(servers), _plain(lkg_slurps), strict=True):
        try:
            recorded = json.loads(base64.b64decode(slurp["content"]))["config_hash"]
        except (KeyError, TypeError, ValueError):
            recorded = None
        if recorded != config_hash(server):
            names.append(server["name"])
    return names


def sglang_exec_start(argv: list) -> str:
    return _wrap(_flags.exec_start, argv)


def sglang_env_line(key: str, value: Any) -> str:
    return _wrap(_flags.env_file_line, key, value)


class FilterModule:
    """Filters of the sglang_server role."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {
            "sglang_resolve_servers": sglang_resolve_servers,
            "sglang_server_errors": sglang_server_errors,
            "sglang_host_errors": sglang_host_errors,
            "sglang_argv": sglang_argv,
            "sglang_launch_argv": sglang_launch_argv,
            "sglang_exec_start": sglang_exec_start,
            "sglang_config_hash": sglang_config_hash,
            "sglang_not_last_known_good": sglang_not_last_known_good,
            "sglang_env_line": sglang_env_line,
        }
