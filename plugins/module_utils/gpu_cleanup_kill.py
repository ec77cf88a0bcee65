"""gpu_cleanup's signalling: stop the service's units, then signal each planned process by pid
(SIGTERM, bounded wait, SIGKILL), only while it is still the process that was classified.
Standard library only: it runs on GPU hosts.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from typing import Any

from ansible_collections.sglang_fleet.fleet.plugins.module_utils.procfs import PROC, read_proc
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.timed_command import Runner

_ACTIVE_STATES = {"active", "activating", "deactivating", "reloading", "refreshing"}
_GONE = "gone"


def alive(pid: int, starttime: int, proc_root: str = PROC) -> bool:
    """Still running and still the same process (a reused pid has another start time).

    A zombie has released its memory and only waits for its parent to reap it: gone.
    """
    info = read_proc(pid, proc_root)
    return info is not None and info.starttime == starttime and info.state not in ("Z", "X")


def _same_process(pid: int, starttime: int, proc_root: str) -> str | None:
    """None when pid is still the process classified, else _GONE or why it is another one."""
    info = read_proc(pid, proc_root)
    if info is None or info.state in ("Z", "X"):
        return _GONE
    if info.starttime != starttime:
        return (
            f"pid reused: start time {info.starttime} now, {starttime} when classified "
            f"({' '.join(info.cmdline)[:60] or info.comm} runs there now); not signalled"
        )
    return None


def send_checked(
    pid: int, starttime: int, sig: signal.Signals, proc_root: str = PROC
) -> str | None:
    """Signal pid only if it is still the process classified. None when sent, else why not.

    A pidfd pins the process: the start time read after opening it belongs to the process the
    signal goes to, so a pid reused between the check and the signal is never hit. Without
    pidfd support (kernels before 5.3) the re-read just before os.kill is the guard.
    """
    why = _same_process(pid, starttime, proc_root)
    if why is not None:
        return why
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return _GONE
    except OSError as exc:
        if exc.errno == errno.ENOSYS:
            return _kill_plain(pid, sig)
        return f"not signalled: pidfd_open failed ({exc.strerror})"
    try:
        return _send_pinned(pidfd, pid, starttime, sig, proc_root)
    finally:
        os.close(pidfd)


def _send_pinned(
    pidfd: int, pid: int, starttime: int, sig: signal.Signals, proc_root: str
) -> str | None:
    why = _same_process(pid, starttime, proc_root)
    if why is not None:
        return why
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        return _GONE
    return None


def _kill_plain(pid: int, sig: signal.Signals) -> str | None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return _GONE
    return None


def _signal_members(
    entry: dict[str, Any], members: list[tuple[int, int]], sig: signal.Signals, proc_root: str
) -> list[tuple[int, int]]:
    """Signal each member; returns those signalled, notes the skipped ones in entry."""
    sent = []
    for pid, start in members:
        why = send_checked(pid, start, sig, proc_root)
        if why is None:
            sent.append((pid, start))
        elif why != _GONE and pid not in {s["pid"] for s in entry["skipped"]}:
            entry["skipped"].append({"pid": pid, "reason": why})
    return sent


def _survivors(members: list[tuple[int, int]], proc_root: str) -> list[tuple[int, int]]:
    return [(pid, start) for pid, start in members if alive(pid, start, proc_root)]


def _wait_gone(
    groups: list[list[tuple[int, int]]], timeout: float, poll: float, proc_root: str
) -> None:
    deadline = time.monotonic() + timeout
    while any(_survivors(g, proc_root) for g in groups) and time.monotonic() < deadline:
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


def terminate(
    groups: list[dict[str, Any]],
    term_timeout: float,
    poll_interval: float,
    proc_root: str = PROC,
    kill_wait: float = 10.0,
) -> list[dict[str, Any]]:
    """SIGTERM each planned member, wait up to term_timeout, SIGKILL the survivors. A report.

    Each member is signalled by pid after checking its start time (send_checked); a group whose
    members were all gone already (a stopped unit took them) is left out of the report.
    """
    report, signalled = [], []
    for group in groups:
        entry: dict[str, Any] = {"pgid": group["pgid"], "pids": [], "signal": "SIGTERM"}
        entry["skipped"] = []
        planned = list(zip(group["pids"], group["starttimes"], strict=True))
        sent = _signal_members(entry, planned, signal.SIGTERM, proc_root)
        entry["pids"] = [pid for pid, _start in sent]
        if sent or entry["skipped"]:
            report.append(entry)
            signalled.append(sent)
    _wait_gone(signalled, term_timeout, poll_interval, proc_root)
    stubborn = [_survivors(sent, proc_root) for sent in signalled]
    for entry, left in zip(report, stubborn, strict=True):
        if left:
            entry["signal"] = "SIGKILL"
            _signal_members(entry, left, signal.SIGKILL, proc_root)
    _wait_gone(stubborn, kill_wait, min(poll_interval, 0.2), proc_root)
    for entry, left in zip(report, stubborn, strict=True):
        entry["survived"] = [pid for pid, _starttime in _survivors(left, proc_root)]
    return report


def active_units(units: list[str], runner: Runner) -> list[str]:
    active = []
    for unit in units:
        rc, out, _err = runner(["systemctl", "is-active", unit], 15)
        if rc != 127 and out.strip() in _ACTIVE_STATES:
            active.append(unit)
    return active


def stop_units(units: list[str], timeout: float, runner: Runner) -> tuple[list[str], list[str]]:
    """(stopped, warnings). A stop that hangs is bounded; its processes get signalled next."""
    stopped, warnings = [], []
    for unit in units:
        rc, out, err = runner(["systemctl", "stop", unit], timeout)
        if rc == 0:
            stopped.append(unit)
        else:
            warnings.append(f"systemctl stop {unit} exited {rc}: {(out + err).strip()[:300]}")
    return stopped, warnings
