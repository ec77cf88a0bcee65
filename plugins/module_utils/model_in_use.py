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

Everything read is bounded, and nothing unread counts as "nobody": a drop-in or record that
cannot be read, an ExecStart= line server_configs does not understand (an environment variable,
a specifier only systemd knows, env finding its program on a PATH), a folder not listed
completely make `configured_references`'s second list non-empty, and a process whose command
line, working directory, open files or mappings cannot be read (or /proc itself) raises
Unreadable; the caller prunes nothing then, and says what could not be read. A process that
ends while it is read refers to nothing.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Iterator
from typing import Any

from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_file import (
    open_regular,
    read_regular,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_json import (
    loads as bounded_loads,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.server_configs import (
    LKG_DIR,
    NotUnderstood,
    launch_commands,
    launched,
    listing,
)

PROC = "/proc"
MAX_CMDLINE = 1 << 20
MAX_MAPS = 64 << 20  # read a line at a time: a process maps at most vm.max_map_count regions
MAX_RECORD = 1 << 20
META = "meta.json"
MAX_PROBLEMS_SHOWN = 5
# A process that ended between the listing and the read: nothing of it is left to keep.
_GONE = (errno.ENOENT, errno.ESRCH)


class Unreadable(ValueError):
    """What pruning could not read (each item named): what it refers to is not known, so
    nothing is pruned."""

    def __init__(self, problems: list[str]) -> None:
        shown = problems[:MAX_PROBLEMS_SHOWN]
        more = len(problems) - len(shown)
        super().__init__("; ".join(shown) + (f"; and {more} more" if more > 0 else ""))
        self.problems = problems


def _words(argv: Iterable[str]) -> Iterator[str]:
    """Every word that may name a path: the word, and after '=' its value (--model-path=x, and
    an assignment NAME=x that env hands on)."""
    for word in argv:
        if not word:
            continue
        yield word
        if "=" in word:
            yield word.split("=", 1)[1]


def _absolute(word: str, cwd: str | None) -> str | None:
    if word.startswith("/"):
        return word
    if cwd is None or word.startswith("-") or "\0" in word:
        return None
    return os.path.join(cwd, word)


def _gone(err: OSError) -> bool:
    return err.errno in _GONE


def _read(path: str, limit: int) -> bytes | None:
    """A /proc file's bytes; None when its process has ended. OSError (permissions) and
    ValueError (over the limit, not a regular file) are the caller's to name."""
    try:
        return read_regular(path, limit)
    except OSError as err:
        if _gone(err):
            return None
        raise


def _link(path: str) -> str | None:
    """Where a /proc link points; None when its process (or that file descriptor) is gone."""
    try:
        return os.readlink(path)
    except OSError as err:
        if _gone(err):
            return None
        raise


def _map_paths(path: str) -> list[str]:
    """The files a process maps (/proc/PID/maps), read a line at a time, at most MAX_MAPS
    bytes; [] when the process has ended."""
    try:
        fd = open_regular(path)
    except OSError as err:
        if _gone(err):
            return []
        raise
    if fd is None:
        return []
    found: set[str] = set()
    read = 0
    with os.fdopen(fd, "rb") as handle:
        try:
            for line in handle:
                read += len(line)
                if read > MAX_MAPS:
                    raise ValueError(f"{path} is over {MAX_MAPS} bytes")
                fields = line.rstrip(b"\n").split(None, 5)
                if len(fields) == 6 and fields[5].startswith(b"/"):
                    found.add(fields[5].decode(errors="surrogateescape"))
        except OSError as err:  # the process ended while its maps were read
            if _gone(err):
                return []
            raise
    return sorted(found)


def _one_process(base: str) -> list[str]:
    """What one process refers to (see the module docstring); OSError or ValueError when a part
    of it could not be read (a process that has ended refers to nothing)."""
    raw = _read(os.path.join(base, "cmdline"), MAX_CMDLINE)
    if raw is None:
        return []
    found: list[str] = []
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
        fds = os.listdir(os.path.join(base, "fd"))
    except OSError as err:
        if not _gone(err):
            raise
        fds = []
    for fd in fds:
        target = _link(os.path.join(base, "fd", fd))
        if target and target.startswith("/"):
            found.append(target.removesuffix(" (deleted)"))
    return found + _map_paths(os.path.join(base, "maps"))


def process_references(proc: str | None = None) -> list[str]:
    """Absolute paths every running process refers to (see the module docstring); proc: where
    /proc is (PROC when None). Unreadable names each process (or /proc itself) whose command
    line, working directory, open files or mappings could not be read: a host where root may
    not read another user's (a container without CAP_SYS_PTRACE) proves nothing."""
    proc = proc or PROC
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError as err:
        raise Unreadable([f"{proc} cannot be listed ({err.strerror or err})"]) from None
    found: list[str] = []
    problems: list[str] = []
    for pid in pids:
        base = os.path.join(proc, pid)
        try:
            found += _one_process(base)
        except (OSError, ValueError) as err:
            problems.append(f"process {pid} ({base}) cannot be read ({_reason(err)})")
    if problems:
        raise Unreadable(problems)
    return found


def _reason(err: Exception) -> str:
    if isinstance(err, OSError):
        return f"{err.strerror or err}: {err.filename}" if err.filename else str(err)
    return str(err)


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
    """(absolute paths the servers' configurations and last-known-good records refer to, what
    could not be read: a folder not listed completely, a file not read, an ExecStart= line not
    understood (server_configs), a record not read). The caller prunes nothing when the second
    is not empty."""
    found: list[str] = []

    def take(words: Iterable[str]) -> None:
        for word in _words(words):
            path = _absolute(word, workdir)
            if path:
                found.append(path)

    commands, unreadable = launch_commands(systemd_dir, state_dir)
    for launch, lines in commands:
        for command in lines:
            take(command.words)
            try:
                take(launched(command).words)
            except NotUnderstood as err:
                unreadable.append(f"{launch.path}: {err}")
    servers, problem = listing(state_dir, "the servers' state folder")
    unreadable += [problem] if problem else []
    for server in servers:
        lkg = os.path.join(state_dir, server, LKG_DIR)
        meta = os.path.join(lkg, META)
        if not os.path.lexists(meta):
            continue
        try:
            record = bounded_loads(read_regular(meta, MAX_RECORD) or b"", meta)
        except (OSError, ValueError):
            unreadable.append(f"{meta} cannot be read")
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
