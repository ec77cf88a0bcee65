"""The sglang_router role's decisions (docs/ROUTER.md): its settings checked, its command line.

    settings_problems({"workers": [...], "port": 30000, "prometheus_port": 29000, ...})
    -> ["sglang_router_workers: ...", ...]   (every problem, before anything on the host changes)

The URL rule is the one every router and worker URL of this project follows (servers.py checks
a server's router block with it too): url_problem(url).

The command line the role writes into its unit:

    router_command({"host": "0.0.0.0", "port": 30000, "worker_urls": [...], ...},
                   python="/opt/sglang-router/bin/python",
                   launcher="/opt/sglang-router/bin/sglang-router-launch.py",
                   key_credential="api-key")
    -> {"flag_argv": [...], "argv": [...], "exec_start": "..."}

flag_argv: the router's flags as its own parser reads them (the role checks them with the
launcher's --check); argv: the whole command, the launcher reading the API key from the named
systemd credential (never a key on the command line); exec_start: argv quoted for systemd's
ExecStart=. Flags render as the servers' do (sglang_fleet.servers.launch_line.to_argv): true is a
bare
switch, false and null are left out, a list is several values.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sglang_fleet import server_secrets
from sglang_fleet.module_utils.fleet_http import HttpError, check_url, redact_url
from sglang_fleet.servers.launch_line import exec_start, normalize_key, to_argv

# What sglang-router 0.3.2 accepts as a worker URL (docs/ROUTER.md, "Worker API"): scheme, host
# and port, nothing after them; the same shape for the router's own URL.
ROUTER_URL_RE = re.compile(r"(?i)(https?)://(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::([0-9]{1,5}))?")
ROUTER_URL_RULE = "http(s)://host[:port] with no path and no trailing slash"
# A pip version pin: the role installs exactly this sglang-router.
_VERSION_RE = re.compile(r"[0-9][0-9A-Za-z.+!-]*")
# The router's key: one word an HTTP header carries as written (visible ASCII; \S* let control
# characters through, which the modules' HTTP reader refuses).
_ONE_WORD_RE = re.compile(r"[!-~]*")


def url_port(match: re.Match[str]) -> int:
    """The port of a URL that matched ROUTER_URL_RE (the scheme's default when unwritten)."""
    if match.group(3):
        return int(match.group(3))
    return 443 if match.group(1).lower() == "https" else 80


def url_problem(url: Any) -> str | None:
    """Why `url` is no router or worker URL, naming it (None: it is one): the shape sglang-router
    compares as written, and what the project's HTTP reader refuses (port 0 or above 65535,
    a leading zero, a host like '..')."""
    if not isinstance(url, str) or not ROUTER_URL_RE.fullmatch(url):
        return f"{redact_url(repr(url))} must be {ROUTER_URL_RULE}"
    try:
        check_url(url, "")
    except HttpError as exc:
        return str(exc).strip()
    return None


def _port(value: Any) -> int | None:
    """A port as the inventory writes it (8000 or "8000"); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    return int(value) if isinstance(value, str) and value.isdecimal() else None


def _port_pair_problem(port: Any, prometheus_port: Any) -> str | None:
    ports = [_port(port), _port(prometheus_port)]
    if None in ports or ports[0] == ports[1] or min(ports) < 1 or max(ports) > 65535:  # type: ignore[type-var]
        return (
            "sglang_router_port and sglang_router_prometheus_port must be different ports in"
            f" 1-65535 (got {port} and {prometheus_port})"
        )
    return None


def settings_problems(settings: Mapping[str, Any]) -> list[str]:
    """Every problem of the role's settings, each naming its variable (the role fails with all
    of them before anything on the host changes). settings: workers, port, prometheus_port,
    version, wheelhouse, index_url, extra_flags, owned_flags (the router flags the role sets),
    api_key."""
    workers = settings.get("workers")
    problems = []
    if not isinstance(workers, list) or not workers:
        problems.append(
            "sglang_router_workers is empty: list the replicas' URLs (http://host:port)"
        )
        workers = []
    bad = [problem for problem in map(url_problem, workers) if problem]
    if bad:
        problems.append(
            f"sglang_router_workers: {'; '.join(bad)} (the router compares URLs as written; a"
            " trailing slash never becomes healthy)"
        )
    if len({str(url).lower() for url in workers}) != len(workers):
        problems.append(
            "sglang_router_workers lists a URL more than once: "
            + ", ".join(redact_url(str(url)) for url in workers)
        )
    ports = _port_pair_problem(settings.get("port"), settings.get("prometheus_port"))
    problems += [ports] if ports else []
    version = settings.get("version")
    if not isinstance(version, str) or not _VERSION_RE.fullmatch(version):
        problems.append(f'sglang_router_version must be an exact version, got "{version}"')
    if settings.get("wheelhouse") and settings.get("index_url"):
        problems.append("set sglang_router_wheelhouse or sglang_router_index_url, not both")
    owned = {str(k).replace("-", "_") for k in settings.get("owned_flags") or []} | {"api_key"}
    taken = [str(k) for k in settings.get("extra_flags") or {} if str(k).replace("-", "_") in owned]
    if taken:
        problems.append(
            f"sglang_router_extra_flags: {', '.join(taken)} are set by the role (use the"
            " sglang_router_* variable; the API key only through sglang_router_api_key)"
        )
    problems += _extra_flag_secrets(settings.get("extra_flags"))
    key = settings.get("api_key")
    if not isinstance(key, str) or not _ONE_WORD_RE.fullmatch(key):
        problems.append(
            "sglang_router_api_key must be one word of visible ASCII, without spaces, line "
            "breaks or control characters (the key itself is not shown)"
        )
    return problems


def _extra_flag_secrets(flags: Any) -> list[str]:
    """A secret in the router's extra flags, by name or by value at any depth
    (server_secrets.secrets_in()): they reach its argv and its unit file."""
    if not isinstance(flags, Mapping):
        return []
    return [
        f"sglang_router_extra_flags{path}: {why}: the router's flags reach its command line and "
        "unit file (the API key only through sglang_router_api_key)"
        for path, why in server_secrets.secrets_in(dict(flags))
        if path.removeprefix(".").replace("-", "_") != "api_key"  # said above: set by the role
    ]


def router_command(
    flags: Mapping[str, Any], *, python: str, launcher: str, key_credential: str = ""
) -> dict[str, Any]:
    """The router's flag words, its whole command and the ExecStart= value."""
    if any(normalize_key(key) == "api_key" for key in flags):
        raise ValueError("the router's API key never goes on its command line: use a credential")
    flag_argv = to_argv(flags)
    argv = [python, launcher]
    if key_credential:
        argv += ["--api-key-credential", key_credential]
    argv += flag_argv
    return {"flag_argv": flag_argv, "argv": argv, "exec_start": exec_start(argv)}
