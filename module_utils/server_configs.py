"""The sglang@ servers' launch configuration as written on a GPU host, walked once for every
reader: the drop-ins of each sglang@NAME unit (<systemd_dir>/sglang@NAME.service.d/*.conf) and
the copies each server keeps as last-known-good (<state_dir>/NAME/lkg/*.conf). Standard library
only; every listing and every file is bounded.

Readers: what pruning a model must keep (model_in_use.configured_references) and which SGLang
virtualenvs are in use (library/ml_env_versions.py).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterator

from ansible.module_utils.bounded_file import read_regular

MAX_ENTRIES = 4096  # servers in a state folder, unit folders, files in one of them
MAX_CONF_BYTES = 1 << 20  # a drop-in is a few hundred bytes
LKG_DIR = "lkg"


def listing(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))[:MAX_ENTRIES]
    except OSError:
        return []


def _confs(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    return [os.path.join(folder, n) for n in listing(folder) if n.endswith(".conf")]


def launch_files(systemd_dir: str, state_dir: str) -> Iterator[tuple[str, str]]:
    """(who, path) of every drop-in of an sglang@ unit, then of every last-known-good copy;
    who is "sglang@NAME.service (its unit)" or "NAME (its last-known-good)"."""
    for entry in listing(systemd_dir):
        if entry.startswith("sglang@") and entry.endswith(".service.d"):
            for path in _confs(os.path.join(systemd_dir, entry)):
                yield f"{entry[: -len('.d')]} (its unit)", path
    for server in listing(state_dir):
        for path in _confs(os.path.join(state_dir, server, LKG_DIR)):
            yield f"{server} (its last-known-good)", path


def read_conf(path: str) -> str | None:
    """A drop-in's text, None when it is missing, unreadable, not a regular file or too big."""
    try:
        data = read_regular(path, MAX_CONF_BYTES)
    except (OSError, ValueError):
        return None
    return None if data is None else data.decode("utf-8", errors="replace")


def exec_start_lines(text: str) -> list[list[str]]:
    """The words of each non-empty ExecStart= line of a unit file or drop-in (systemd's quoting
    as sglang_fleet/servers/launch_line.py writes it: shell-like quotes, %% and $$ doubled)."""
    lines: list[list[str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith("ExecStart="):
            continue
        value = line[len("ExecStart=") :]
        try:
            parts = shlex.split(value)
        except ValueError:
            parts = value.split()
        if parts:
            lines.append([p.replace("%%", "%").replace("$$", "$") for p in parts])
    return lines
