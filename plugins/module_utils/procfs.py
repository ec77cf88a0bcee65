"""Read /proc: a process's stat, uids, cgroup, command line and open files; listening sockets.

Shared by the gpu_cleanup module on GPU hosts (as
ansible_collections.sglang_fleet.fleet.plugins.module_utils.procfs) and by the fleet_lock action
plugin on the controller (as sglang_fleet.module_utils.procfs: Ansible does not put
playbook-adjacent module_utils on the controller's import path, docs/ARCHITECTURE.md), so: standard
library only, Python >= 3.10, and no import of another module_utils file.

Every reader takes proc_root, so tests point it at a fake /proc tree built from real samples
(tests/fixtures/proc/). A process can exit between two reads: readers return None or an empty
result for a process that is gone, never raise.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

PROC = "/proc"
_SOCKET_LINK = re.compile(r"socket:\[(\d+)\]")  # fullmatch: `$` takes a trailing newline
_TCP_LISTEN = "0A"


class ProcStat(NamedTuple):
    """The fields of /proc/PID/stat this project reads."""

    state: str
    ppid: int
    pgid: int
    starttime: int  # clock ticks after boot (field 22)


@dataclass
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    state: str
    starttime: int
    uid: int | None
    user: str
    cmdline: list[str]
    comm: str
    cgroup: str
    euid: int | None = None


def parse_stat(text: str) -> ProcStat:
    """(state, ppid, pgid, starttime) from /proc/PID/stat.

    The command name is in parentheses and may itself hold spaces and parentheses, so fields are
    counted from the last ')'.
    """
    rest = text[text.rindex(")") + 2 :].split()
    return ProcStat(rest[0], int(rest[1]), int(rest[2]), int(rest[19]))


def parse_status_uids(text: str) -> tuple[int | None, int | None]:
    """(real uid, effective uid) from the ``Uid:`` line of /proc/PID/status."""
    for line in text.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            return int(fields[1]), int(fields[2])
    return None, None


def parse_cgroup(text: str) -> str:
    """The systemd cgroup path from /proc/PID/cgroup.

    cgroup v2 has one line ``0::/path``. cgroup v1 has one line per hierarchy; systemd's own is
    ``N:name=systemd:/path``. Hybrid hosts have both, with the same path.
    """
    unified = ""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hierarchy, controllers, path = parts
        if controllers == "name=systemd":
            return path
        if controllers == "":
            unified = path
    return unified


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def user_name(uid: int | None) -> str:
    if uid is None:
        return "?"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def read_proc(pid: int, proc_root: str = PROC) -> ProcInfo | None:
    """What /proc says about pid, or None when it is gone."""
    base = os.path.join(proc_root, str(pid))
    try:
        state, ppid, pgid, starttime = parse_stat(_read(os.path.join(base, "stat")))
        raw_cmdline = _read(os.path.join(base, "cmdline"))
        comm = _read(os.path.join(base, "comm")).strip()
        uid, euid = parse_status_uids(_read(os.path.join(base, "status")))
        # Unreadable only when the process is gone: without its cgroup nothing can be proven.
        cgroup = parse_cgroup(_read(os.path.join(base, "cgroup")))
    except (OSError, ValueError, IndexError):
        return None
    # setproctitle rewrites argv in place, so a title shows up as one padded argument.
    cmdline = raw_cmdline.rstrip("\0 ").split("\0") if raw_cmdline else []
    return ProcInfo(
        pid, ppid, pgid, state, starttime, uid, user_name(uid), cmdline, comm, cgroup, euid
    )


def own_cgroup(proc_root: str = PROC) -> str:
    """This module's own cgroup path ("" when proc_root does not show this process)."""
    info = read_proc(os.getpid(), proc_root)
    return info.cgroup if info else ""


def list_pids(proc_root: str = PROC) -> list[int]:
    return [int(name) for name in os.listdir(proc_root) if name.isdigit()]


def fd_targets(pid: int, proc_root: str = PROC) -> list[str]:
    """Targets of pid's open file descriptors; empty when gone or not readable."""
    fd_dir = os.path.join(proc_root, str(pid), "fd")
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return []
    targets = []
    for name in names:
        try:
            targets.append(os.readlink(os.path.join(fd_dir, name)))
        except OSError:
            continue
    return targets


def parse_listen_inodes(text: str, ports: Iterable[int]) -> set[int]:
    """Socket inodes listening on one of ports, from /proc/net/tcp or /proc/net/tcp6."""
    wanted = set(ports)
    inodes = set()
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10 or cols[3] != _TCP_LISTEN:
            continue
        port = int(cols[1].rsplit(":", 1)[1], 16)
        if port in wanted:
            inodes.add(int(cols[9]))
    return inodes


def listening_inodes(ports: list[int], proc_root: str = PROC) -> dict[int, int]:
    """{socket inode: port} for sockets listening on ports, IPv4 and IPv6."""
    found: dict[int, int] = {}
    for name in ("tcp", "tcp6"):
        try:
            text = _read(os.path.join(proc_root, "net", name))
        except OSError:
            continue
        for port in ports:
            for inode in parse_listen_inodes(text, [port]):
                found[inode] = port
    return found


def socket_inodes(targets: Iterable[str]) -> set[int]:
    return {int(m.group(1)) for t in targets if (m := _SOCKET_LINK.fullmatch(t))}


def ancestors(pid: int, proc_root: str = PROC) -> list[ProcInfo]:
    """pid and its ancestors up to (not including) PID 1, as far as /proc tells."""
    chain = []
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        info = read_proc(pid, proc_root)
        if info is None:
            break
        chain.append(info)
        pid = info.ppid
    return chain
