"""What the role writes and runs for one resolved server: the launch drop-in, the environment
file, the logging configuration, paths, argv, and the configuration hash that names it all.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from sglang_fleet.capacity.planner_inputs import PLANNER_FLAGS
from sglang_fleet.servers.launch_line import env_file_line, exec_start, to_argv
from sglang_fleet.servers.secret_files import MANAGED_HEADER, ROOT_FILE, has_secrets
from sglang_fleet.servers.server_values import SERVERS_VAR, ServerConfigError, checked_mapping


def config_hash(server: Mapping[str, Any]) -> str:
    """A short, stable name for what a server runs: flags, environment, which secrets are set and
    the SGLang version it runs (docs/UPGRADES.md).

    The fleet summary and the last-known-good record use it to say which configuration passed.
    """
    identity = {
        "flags": server.get("flags", {}),
        "environment": server.get("environment", {}),
        "api_key_set": bool(server.get("api_key_set")),
    }
    if server.get("sglang_version"):  # absent in descriptions made without one
        identity["sglang_version"] = str(server["sglang_version"])
    others = [name for name in server.get("secrets_set") or [] if name != "api_key"]
    if others:  # absent otherwise: servers with an API key alone keep their hash
        identity["secrets_set"] = sorted(others)
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- what the role writes

SYSTEMD_DIR = "/etc/systemd/system"
# Where the unit finds the secrets file systemd hands it (LoadCredential=): %d is the unit's
# credentials directory, a specifier systemd expands, so it is appended unquoted.
SECRETS_CREDENTIAL = "sglang-secrets.yaml"
LOGGING_CONFIG_ENV = "SGLANG_LOGGING_CONFIG_PATH"
# SGLang logs its resolved server arguments, API key included, at info level through this logger
# (docs/SGLANG.md, "Logs"): raised to WARNING on servers that have a key.
KEY_LOGGING_LOGGER = "sglang.srt.entrypoints.engine"
RUNTIME_KEYS = ("python", "launch_module", "config_dir", "state_dir")
# The SGLang version the python above holds (sglang_server_sglang_version): part of each server's
# configuration, so an upgrade rolls out like a flag change (docs/UPGRADES.md).
VERSION_RE = re.compile(r"[0-9][0-9A-Za-z.+!_-]{0,63}")  # fullmatch: `$` takes a trailing newline


def check_runtime(runtime: Mapping[str, Any]) -> dict[str, str]:
    """Where SGLang is installed, which version it is and where the role keeps files, checked
    once."""
    runtime = checked_mapping(runtime, "runtime")
    values = {}
    version = runtime.get("sglang_version")
    if version is not None:
        if not isinstance(version, str) or not VERSION_RE.fullmatch(version):
            raise ServerConfigError(
                "sglang_server_sglang_version", f"{version!r} is not an exact SGLang version"
            )
        values["sglang_version"] = version
    for key in RUNTIME_KEYS:
        value = runtime.get(key)
        if not isinstance(value, str) or not value:
            raise ServerConfigError(f"sglang_server_{key}", f"{value!r} must be a non-empty string")
        if key != "launch_module" and not value.startswith("/"):
            raise ServerConfigError(f"sglang_server_{key}", f"{value!r} must be an absolute path")
        values[key] = value
    return values


def _logging_config(flags: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's own log format through SGLANG_LOGGING_CONFIG_PATH, minus the key-bearing line."""
    level = str(flags.get("log_level") or "info").upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "sglang": {"format": "[%(asctime)s] %(message)s", "datefmt": "%Y-%m-%d %H:%M:%S"}
        },
        "handlers": {
            "console": {
                "class": "logging.StreamHandler",
                "formatter": "sglang",
                "stream": "ext://sys.stdout",
            }
        },
        "root": {"level": level, "handlers": ["console"]},
        "loggers": {KEY_LOGGING_LOGGER: {"level": "WARNING"}},
    }


def _dropin_text(name: str, exec_line: str, load_credential: str | None) -> str:
    """The drop-in that gives sglang@<name>.service its launch line."""
    text = (
        f"{MANAGED_HEADER}# Launch line of SGLang server {name}, quoted for systemd's command-line"
        " parser by\n# sglang_fleet.servers.describe (docs/ARCHITECTURE.md).\n[Service]\n"
    )
    if load_credential:
        text += (
            "# The API key never appears on the command line: systemd hands the root-only secrets"
            " file to the\n# service as a credential and SGLang reads it with --config.\n"
            f"LoadCredential={load_credential}\n"
        )
    return f"{text}ExecStart=\nExecStart={exec_line}\n"


def _env_text(name: str, env_lines: list[str]) -> str:
    """The EnvironmentFile of sglang@<name>.service."""
    return (
        f"{MANAGED_HEADER}# Environment of SGLang server {name}: its GPU set, this host's NCCL"
        " settings and, with\n# an API key, the logging configuration that keeps the key out of"
        " the journal.\n" + "".join(f"{line}\n" for line in env_lines)
    )


def _server_files(name: str, paths: Mapping[str, str], rendered: Mapping[str, Any]) -> list[dict]:
    """Every file of one server a rollout writes (or removes), with its content: configure.yml
    writes exactly these and inspect.yml compares exactly these. The secrets file is apart
    (secret_files()): its content is the key."""
    files = [
        {"path": paths["dropin"], **ROOT_FILE,
         "content": _dropin_text(name, rendered["exec_start"], rendered["load_credential"])},
        {"path": paths["env_file"], **ROOT_FILE,
         "content": _env_text(name, rendered["env_lines"])},
    ]  # fmt: skip
    if rendered["logging_config"] is not None:
        text = json.dumps(rendered["logging_config"], indent=4, sort_keys=True) + "\n"
        files.append({"path": paths["logging_file"], **ROOT_FILE, "content": text})
    else:
        files.append({"path": paths["secrets_file"], "absent": True})
    return [{"server": name, **file} for file in files]


def records_and_routers(servers: list[Mapping[str, Any]]) -> dict[str, list[dict]]:
    """What a converged host holds besides its files (the sglang_host_state module's `records`
    and `routers`): each server's last-known-good record naming its configuration hash, and each
    replica listed by its router."""
    return {
        "records": [
            {"label": server["name"], "path": f"{server['paths']['lkg_dir']}/meta.json",
             "key": "config_hash", "value": server["config_hash"]}
            for server in servers
        ],
        "routers": [
            {"label": server["name"], "router_url": server["router"]["url"],
             "worker_url": server["router"]["worker_url"]}
            for server in servers
            if server.get("router")
        ],
    }  # fmt: skip


def render_server(server: dict[str, Any], runtime: Mapping[str, str]) -> dict[str, Any]:
    """Everything the role writes and runs for one resolved server, computed in one place."""
    name = server["name"]
    config_dir, state_dir = runtime["config_dir"], runtime["state_dir"]
    paths = {
        "dropin_dir": f"{SYSTEMD_DIR}/{server['unit']}.d",
        "dropin": f"{SYSTEMD_DIR}/{server['unit']}.d/10-launch.conf",
        "env_file": f"{config_dir}/{name}.env",
        "secrets_file": f"{config_dir}/{name}.secrets.yaml",
        "logging_file": f"{config_dir}/{name}.logging.json",
        "state_dir": f"{state_dir}/{name}",
        "lkg_dir": f"{state_dir}/{name}/lkg",
        # Outside lkg/: a rollback restores lkg/ only, so calibrations survive it.
        "calibration_file": f"{state_dir}/{name}/calibration.json",
    }
    try:
        flag_argv = to_argv(server["flags"])
        argv = [runtime["python"], "-m", runtime["launch_module"], *flag_argv]
        exec_line = exec_start(argv)
        environment = dict(server["environment"])
        if has_secrets(server):
            environment[LOGGING_CONFIG_ENV] = paths["logging_file"]
        env_lines = [env_file_line(key, environment[key]) for key in sorted(environment)]
    except ValueError as exc:
        raise ServerConfigError(f"{SERVERS_VAR}[{name}]", str(exc)) from None
    keyed = has_secrets(server)
    if keyed:
        argv += ["--config", f"%d/{SECRETS_CREDENTIAL}"]
        exec_line += f" --config %d/{SECRETS_CREDENTIAL}"
    rendered = {
        "flag_argv": flag_argv,
        "argv": argv,
        "exec_start": exec_line,
        "env_lines": env_lines,
        "logging_config": _logging_config(server["flags"]) if keyed else None,
        "load_credential": f"{SECRETS_CREDENTIAL}:{paths['secrets_file']}" if keyed else None,
        "paths": paths,
        "plan_args": {key: server["flags"][key] for key in PLANNER_FLAGS if key in server["flags"]},
        "sglang_version": runtime.get("sglang_version"),
        "config_hash": config_hash({**server, "sglang_version": runtime.get("sglang_version")}),
    }
    rendered["files"] = _server_files(name, paths, rendered)
    rendered["directories"] = [{"path": paths["dropin_dir"], **ROOT_FILE, "mode": "0755"}]
    return rendered
