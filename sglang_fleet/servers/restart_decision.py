"""Which servers a rollout restarts, and what it would do to each, flag by flag
(docs/INVENTORY.md).

restart_decision() is the rollout's decision (the sglang_server role's configure.yml results in,
server names out); restart_lines() says it in words for the operator: which servers would
restart, why, and which flags change against the configuration each one last passed with (its
last-known-good record, `lkg/meta.json`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sglang_fleet.server_secrets import redact
from sglang_fleet.servers.launch_line import to_argv


def _flag_words(flags: Mapping[str, Any]) -> dict[str, list[str]]:
    """{--flag: its value words} as the launch line renders each flag (omitted ones left out).
    A flag named like a secret (an old record may hold one) reads <redacted>, nested ones too."""
    words: dict[str, list[str]] = {}
    for key, value in redact(dict(flags)).items():
        try:
            argv = to_argv({key: value})
        except ValueError:  # a record edited by hand: say so rather than fail the check
            argv = [f"--{key}", "(a value no launch line can hold)"]
        if argv:
            words[argv[0]] = argv[1:]
    return words


def flag_changes(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[str]:
    """`- --flag old` / `+ --flag new` lines, in launch-line order; [] when the flags match.
    Secrets never show (sglang_fleet/server_secrets.py)."""
    before = _flag_words(old if isinstance(old, Mapping) else {})
    after = _flag_words(new)
    lines = []
    for flag in sorted(before.keys() | after.keys(), key=lambda f: (f != "--model-path", f)):
        if before.get(flag) == after.get(flag):
            continue
        if flag in before:
            lines.append(" ".join(["-", flag, *before[flag]]))
        if flag in after:
            lines.append(" ".join(["+", flag, *after[flag]]))
    return lines


def restart_lines(
    servers: Sequence[Mapping[str, Any]],
    restart_names: Sequence[str],
    records: Sequence[Mapping[str, Any] | None],
    running_units: Sequence[str],
) -> list[str]:
    """One line per server (and one per changed flag under it) of what a rollout would do.

    records: each server's last-known-good record (None where it has none), in servers' order.
    """
    lines = []
    for server, record in zip(servers, records, strict=True):
        name = server["name"]
        if name not in restart_names:
            lines.append(f"{name}: unchanged")
            continue
        changes = flag_changes(record.get("flags"), server["flags"]) if record else []
        before, after = (record or {}).get("sglang_version"), server.get("sglang_version")
        upgrade = f"SGLang {before} -> {after}" if before and after and before != after else ""
        if server["unit"] not in running_units:
            why = "not running"
        elif record is None:
            why = "no last-known-good record yet"
        elif changes:
            why = f"{len(changes)} flag line(s) differ from its last-known-good configuration"
            why = f"{upgrade}; {why}" if upgrade else why
        elif upgrade:
            why = f"{upgrade}, same flags"
        else:
            why = "its unit, environment, secrets or logging changed; same flags"
        lines.append(f"{name}: would restart ({why})")
        lines += [f"  {change}" for change in changes]
    return lines


def restart_decision(
    servers: Sequence[Mapping[str, Any]],
    changed_paths: Sequence[str],
    running_units: Sequence[str],
    records: Sequence[Mapping[str, Any] | None],
) -> list[str]:
    """Names of the servers a rollout restarts, in the servers' order.

    changed_paths: the files configure.yml wrote or removed that changed. A changed file of no
    server (the host's template unit) restarts every server; a server's own file (its `files`, its
    secrets file) restarts it. A server not running restarts, and so does one whose last-known-good
    record is missing or names another configuration (a run interrupted between writing files and
    restarting). records: each server's record (None where it has none), in servers' order.
    """
    owners = {
        path: server["name"]
        for server in servers
        for path in [*(file["path"] for file in server["files"]), server["paths"]["secrets_file"]]
    }
    changed = {owners.get(path) for path in changed_paths}
    return [
        server["name"]
        for server, record in zip(servers, records, strict=True)
        if None in changed
        or server["name"] in changed
        or server["unit"] not in running_units
        or (record or {}).get("config_hash") != server["config_hash"]
    ]
