"""What pruning must keep (docs/STAGING.md, "What pruning keeps"): every folder a running
process, a server's configuration or a last-known-good record refers to, compared by device and
inode, never by path text. Runs on the GPU host: standard library only.

A reference is any path a process or a file names: each word of a process's command line (and
the value of each --flag=value), relative ones taken from the process's working directory,
its working directory itself and the files it holds open or mapped; each word of the ExecStart=
lines of the servers' systemd drop-ins and of the copies kept as last-known-good, and each
string of a last-known-good record's flags, relative ones taken from the units' working
directory. A folder is in use when it is one of the folders a reference resolves to or lies
in. So `--model-path rev-a` run from /models/llama, SGLang's `--model` alias, an abbreviation
argparse accepts, a link to the revision, a bind mount of it and a stopped server's
last-known-good revision all keep it. Words that are no path resolve to nothing and cost a
failed stat.

Everything read is bounded; a record or a drop-in that cannot be read makes `unreadable`
non-empty, and the caller prunes nothing then (what it refers to cannot be known).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from typing import Any

from ansible.module_utils.bounded_file import read_regular
from ansible.module_utils.bounded_json import loads as bounded_loads
from ansible.module_utils.server_configs import (
    LKG_DIR,
    MAX_ENTRIES,
    exec_start_lines,
    launch_files,
    listing,
    read_conf,
)

PROC = "/proc"
MAX_CMDLINE = 1 << 20
MAX_MAPS = 8 << 20
MAX_RECORD = 1 << 20
META = "meta.json"


def _words(argv: Iterable[str]) -> Iterator[str]:
    """Every word that may name a path: the word, and after '=' its value (--model-path=x)."""
    for word in argv:
        if not word:
            continue
        yield word
        if word.startswith("-") and "=" in word:
            yield word.split("=", 1)[1]


def _absolute(word: str, cwd: str | None) -> str | None:
    if word.startswith("/"):
        return word
    if cwd is None or word.startswith("-") or "\0" in word:
        return None
    return os.path.join(cwd, word)


def _read(path: str, limit: int) -> bytes | None:
    """A regular file's bytes (/proc's files are regular), None when it cannot be read."""
    try:
        return read_regular(path, limit)
    except (OSError, ValueError):
        return None


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def process_references(proc: str | None = None) -> list[str]:
    """Absolute paths every running process refers to (see the module docstring); proc: where
    /proc is (PROC when None)."""
    proc = proc or PROC
    found: list[str] = []
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        base = os.path.join(proc, pid)
        raw = _read(os.path.join(base, "cmdline"), MAX_CMDLINE)
        if raw is None:
            continue
        cwd = _link(os.path.join(base, "cwd"))
        if cwd and cwd.startswith("/"):
            found.append(cwd)
        else:
            cwd = None
        argv = [w.decode(errors="surrogateescape") for w in raw.split(b"\0")[1:]]
        for word in _words(argv):
            path = _absolute(word, cwd)
            if path:
                found.append(path)
        try:
            fds = os.listdir(os.path.join(base, "fd"))[:MAX_ENTRIES]
        except OSError:
            fds = []
        for fd in fds:
            target = _link(os.path.join(base, "fd", fd))
            if target and target.startswith("/"):
                found.append(target.removesuffix(" (deleted)"))
        maps = _read(os.path.join(base, "maps"), MAX_MAPS) or b""
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith(b"/"):
                found.append(fields[5].decode(errors="surrogateescape"))
    return found


def _strings(value: Any) -> Iterator[str]:
    """Every string of a record's flags (a value, or an item of a list value)."""
    items = value.values() if isinstance(value, dict) else []
    for item in items:
        for one in item if isinstance(item, list) else [item]:
            if isinstance(one, str):
                yield one


def configured_references(
    state_dir: str, systemd_dir: str, workdir: str
) -> tuple[list[str], list[str]]:
    """(absolute paths the servers' configurations and last-known-good records refer to, the
    files that could not be read)."""
    found: list[str] = []
    unreadable: list[str] = []

    def take(words: Iterable[str]) -> None:
        for word in _words(words):
            path = _absolute(word, workdir)
            if path:
                found.append(path)

    for _who, path in launch_files(systemd_dir, state_dir):
        text = read_conf(path)
        if text is None:
            unreadable.append(path)
        else:
            take(word for line in exec_start_lines(text) for word in line)
    for server in listing(state_dir):
        lkg = os.path.join(state_dir, server, LKG_DIR)
        meta = os.path.join(lkg, META)
        if not os.path.lexists(meta):
            continue
        try:
            record = bounded_loads(read_regular(meta, MAX_RECORD) or b"", meta)
        except (OSError, ValueError):
            unreadable.append(meta)
            continue
        flags = record.get("flags") if isinstance(record, dict) else None
        take(_strings(flags))
    return found, unreadable


class InUse:
    """Whether a folder is one a reference resolves to or lies in, by (device, inode)."""

    def __init__(self, references: Iterable[str]) -> None:
        self.identities: set[tuple[int, int]] = set()
        seen: set[str] = set()
        for reference in references:
            try:
                real = os.path.realpath(reference)
            except (OSError, ValueError):
                continue
            while real not in seen:
                seen.add(real)
                try:
                    info = os.stat(real)
                except (OSError, ValueError):
                    info = None
                if info is not None and stat.S_ISDIR(info.st_mode):
                    self.identities.add((info.st_dev, info.st_ino))
                parent = os.path.dirname(real)
                if parent == real:
                    break
                real = parent

    def __call__(self, info: os.stat_result) -> bool:
        return (info.st_dev, info.st_ino) in self.identities
