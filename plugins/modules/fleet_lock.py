#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module fleet_lock: the host's rollout lock file, measured on the host's own clock.

Runs on the GPU host: standard library only. The action plugin of the same name runs first on
the controller: it names this run and decides whether another run's lock is stale
(docs/LOCKING.md). This module only reads and writes the lock file, one call at a time.
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: fleet_lock
short_description: Take, renew and release a host's rollout lock without stealing from a live run
description:
  - One lock file per host (I(path)) says which Ansible run is changing the host's SGLang servers.
    C(deploy.yml), C(rollback.yml) and C(gpu_cleanup.yml) take the same lock.
  - Ages are measured on the host's own clock (C(CLOCK_BOOTTIME) while the host has not rebooted,
    its wall clock otherwise), never by comparing the clocks of two controllers.
  - C(state=acquired) creates the lock, or re-enters it when this same run holds it already.
    When another run holds it, the module does not fail; it returns that holder, its age and
    the time left on its lease, and the action plugin decides on the controller whether that
    holder is provably gone (docs/LOCKING.md, "Staleness rule"). A stale lock is replaced only
    when the file is still byte for byte the one judged stale (I(replace_sha256)).
  - C(state=renewed) extends the lease of our own lock (same I(token)); it fails when the lock
    is no longer ours. C(state=released) removes our own lock and leaves any other alone.
  - The file is written to a temporary file, flushed, and linked or renamed into place, so a
    reader sees a whole record or none. Calls are serialised by C(flock) on a file next to it
    (the lock's name with C(.guard) appended), which stays on disk.
  - A file that is empty, truncated or not a lock record is reported (path, size, what is wrong)
    and counts as held until it is older than I(lease_s); it is never a traceback.
  - Check mode writes nothing and says what would happen.
version_added: "0.1.0"
author: sglang-fleet maintainers (@sglang-fleet)
options:
  path:
    description: Absolute path of the lock file on the host. Its directory must exist.
    type: path
    default: /run/lock/sglang-fleet-deploy.lock
  state:
    description:
      - C(acquired) takes the lock (or reports its holder), C(renewed) extends our lease,
        C(released) removes our lock.
    type: str
    choices: [acquired, renewed, released]
    default: acquired
  owner:
    description:
      - Who is taking the lock, as the action plugin describes this run on the controller
        (user, uid, controller, controller_boot_id, controller_pidns, pid, pid_starttime,
        cmdline_sha256, playbook). Stored as is. Required with C(state=acquired).
    type: dict
  run_id:
    description:
      - Identifies this Ansible run (the action plugin derives it). A lock held by the same
        run_id is re-entered instead of reported as held. Required with C(state=acquired).
    type: str
  token:
    description:
      - The token that C(state=acquired) returned. Required to renew. Releasing with an empty
        token does nothing (the run never took the lock, for example in check mode).
    type: str
    default: ""
  lease_s:
    description:
      - Seconds the lock stays valid after its last renewal. C(acquired) stores it (default
        900); C(renewed) replaces it when given, else keeps the stored one.
      - A lock file that cannot be read counts as held until it is this old (default 900).
    type: int
  replace_sha256:
    description:
      - Take over a stale lock. The file is replaced only if its SHA-256 is still this value
        (the C(holder.sha256) the action judged stale); otherwise C(outcome=changed).
    type: str
notes:
  - Use it through the action plugin C(fleet_lock), which fills I(owner), I(run_id) and
    I(replace_sha256). docs/LOCKING.md describes the file format and the staleness rule.
"""

EXAMPLES = r"""
- name: Take this host's rollout lock (the action plugin decides about a stale holder)
  sglang_fleet.fleet.fleet_lock:
    path: /run/lock/sglang-fleet-deploy.lock
    state: acquired
    lease_s: 900
  register: _fleet_lock

- name: Renew it before a long step
  sglang_fleet.fleet.fleet_lock:
    path: /run/lock/sglang-fleet-deploy.lock
    state: renewed
    token: "{{ _fleet_lock.token }}"
    lease_s: 1800

- name: Release it (only if it is still ours)
  sglang_fleet.fleet.fleet_lock:
    path: /run/lock/sglang-fleet-deploy.lock
    state: released
    token: "{{ _fleet_lock.token | default('') }}"
"""

RETURN = r"""
outcome:
  description:
    - What happened. C(acquired) (created), C(reentered) (this run held it already),
      C(taken_over) (a stale lock replaced), C(held) (another run holds it; not a failure here),
      C(changed) (the lock judged stale changed meanwhile), C(renewed), C(released), C(kept)
      (released one level of a re-entered lock), C(absent) (nothing to release), C(not_ours)
      (release left another run's lock alone), C(not_held) (release with an empty token),
      C(lost) (renew found the lock gone or someone else's; the task fails).
    - In check mode C(would_acquire), C(would_take_over), C(would_renew), C(would_release).
  type: str
  returned: always
acquired:
  description: Whether this run holds the lock after the call.
  type: bool
  returned: always
token:
  description: Our token (pass it to renewed and released); empty when we do not hold the lock.
  type: str
  returned: always
run_id:
  description: The run id the lock is held under, when it is ours.
  type: str
  returned: always
depth:
  description: How often this run holds the lock (re-entered acquisitions count up).
  type: int
  returned: always
lease_s:
  description: Our lease in seconds, when we hold the lock.
  type: int
  returned: always
holder:
  description:
    - The lock file as found, when it is not ours (or, for C(taken_over), the one replaced);
      null when there was none. Keys C(readable), C(problem), C(size), C(sha256), C(owner),
      C(run_id), C(lease_s), C(age_s), C(renewed_ago_s), C(lease_left_s) (negative when the
      lease has ended), C(clock) (C(boottime), C(wall) or C(mtime)), C(clock_note), C(summary).
  type: dict
  returned: always
lock_lost:
  description:
    - True when C(state=renewed) found the lock gone or someone else's. The run must stop, and a
      rescue must not roll back, because another run may be working on the host.
  type: bool
  returned: when the lock was lost
lock_file:
  description: The lock file (not C(path), which would make Ansible add file attributes).
  type: str
  returned: always
"""

import errno
import fcntl
import hashlib
import json
import math
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_json import TooDeep
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_json import (
    loads as bounded_loads,
)

RECORD_VERSION = 1
DEFAULT_LEASE_S = 900
GUARD_TIMEOUT_S = 10.0
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
# Keys an owner record needs for the message; the liveness keys are the action plugin's concern.
DISPLAY_KEYS = ("user", "controller", "pid", "playbook")
# A time this far ahead of the host's clock cannot be a time of this clock (docs/LOCKING.md,
# "A time in the future"): the lock's age cannot be measured.
FUTURE_TOLERANCE_S = 2.0


class LockError(Exception):
    """A lock file that cannot be handled (directory missing, guard busy, permissions)."""


@dataclass(frozen=True)
class HostClock:
    boot_id: str
    boottime: float
    wall: float


def read_host_clock() -> HostClock:
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as handle:
            boot_id = handle.read().strip()
    except OSError:
        boot_id = ""
    return HostClock(boot_id, time.clock_gettime(time.CLOCK_BOOTTIME), time.time())


# --------------------------------------------------------------------------- reading the file


@dataclass(frozen=True)
class Found:
    """What lies at the lock path: raw bytes (None when absent), the record or what is wrong."""

    raw: bytes | None
    mtime: float
    record: dict[str, Any] | None
    problem: str
    legacy: dict[str, Any] | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.raw or b"").hexdigest()


def _is_number(value: Any) -> bool:
    """A finite JSON number (json.loads reads NaN and Infinity; no age or lease is either)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def record_problem(data: Any) -> str:
    """Why a parsed JSON value is not a lock record of ours ('' when it is one)."""
    if not isinstance(data, dict):
        return f"not a lock record (JSON {type(data).__name__})"
    typed = {"token": str, "run_id": str, "owner": dict, "host_clock": dict, "depth": int}
    missing = [key for key, kind in typed.items() if not isinstance(data.get(key), kind)]
    if not _is_number(data.get("lease_s")) or data["lease_s"] <= 0:
        missing.append("lease_s")
    clock = data.get("host_clock") if isinstance(data.get("host_clock"), dict) else {}
    times = ("taken_boottime", "renewed_boottime", "taken_wall", "renewed_wall")
    missing += [f"host_clock.{k}" for k in times if not _is_number(clock.get(k))]
    if not isinstance(clock.get("boot_id"), str):
        missing.append("host_clock.boot_id")
    return f"not a lock record (missing or bad: {', '.join(missing)})" if missing else ""


def legacy_owner(data: Any) -> dict[str, Any] | None:
    """The holder named by the shell lock of older playbooks ({controller, pid, user, started})."""
    if isinstance(data, dict) and {"controller", "pid", "user", "started"} <= set(data):
        return {"user": data["user"], "controller": data["controller"], "pid": data["pid"]}
    return None


def parse(raw: bytes, mtime: float) -> Found:
    if not raw.strip():
        return Found(raw, mtime, None, "empty")
    try:
        data = bounded_loads(raw, "the lock file")
    except TooDeep:
        return Found(raw, mtime, None, "JSON nested too deep to be a lock: damaged")
    except ValueError:
        return Found(raw, mtime, None, "not JSON: truncated or damaged")
    legacy = legacy_owner(data)
    if legacy:
        return Found(raw, mtime, None, "written by an older sglang-fleet (no lease)", legacy)
    problem = record_problem(data)
    return Found(raw, mtime, None if problem else data, problem)


def read_lock(path: str) -> Found:
    # O_NONBLOCK: a FIFO put in the lock's place must not hang the module.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return Found(None, 0.0, None, "")
    except OSError as exc:
        raise LockError(f"cannot read the lock file {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise LockError(f"{path} is not a regular file: remove it by hand")
        return parse(handle.read(1 << 20), info.st_mtime)


# --------------------------------------------------------------------------- ages and messages


def human_duration(seconds: float) -> str:
    """3 min 20 s, 2 h 5 min, 1 d 3 h: never negative."""
    total = max(0, round(seconds))
    if total < 60:
        return f"{total} s"
    if total < 3600:
        big, small = f"{total // 60} min", f"{total % 60} s"
    elif total < 86400:
        big, small = f"{total // 3600} h", f"{total % 3600 // 60} min"
    else:
        big, small = f"{total // 86400} d", f"{total % 86400 // 3600} h"
    return big if small.startswith("0 ") else f"{big} {small}"


@dataclass(frozen=True)
class Ages:
    age_s: float
    renewed_ago_s: float
    lease_s: float
    clock: str
    note: str
    future_s: float = 0.0  # how far the file's time lies ahead of the host's clock

    @property
    def unmeasurable(self) -> bool:
        return self.future_s > FUTURE_TOLERANCE_S

    @property
    def lease_left_s(self) -> float:
        return self.lease_s - self.renewed_ago_s


def measure(found: Found, now: HostClock, fallback_lease_s: float) -> Ages:
    """Age and lease of the file on the host's clock: boot time, else wall time, else mtime."""
    rec = found.record
    if rec is None:
        age = renewed = now.wall - found.mtime
        clock, note, lease = "mtime", "the file's modification time on the host", fallback_lease_s
    elif rec["host_clock"]["boot_id"] == now.boot_id and now.boot_id:
        hc = rec["host_clock"]
        age, renewed = now.boottime - hc["taken_boottime"], now.boottime - hc["renewed_boottime"]
        clock, note, lease = "boottime", "", rec["lease_s"]
    else:
        hc = rec["host_clock"]
        age, renewed = now.wall - hc["taken_wall"], now.wall - hc["renewed_wall"]
        why = "the host rebooted since" if now.boot_id else "the host has no boot id"
        clock, note, lease = "wall", f"{why}: by its wall clock", rec["lease_s"]
        if now.boot_id and hc["boot_id"] and min(age, renewed) < 0:
            # Written in an earlier boot, so at least as long ago as this boot began: a wall
            # clock that says "in the future" (set back at boot) cannot hold the lock forever.
            age, renewed = max(age, now.boottime), max(renewed, now.boottime)
            note = f"{note}; the host's clock went back, ages counted from this boot's start"
    future = max(-min(age, renewed), 0.0)
    if future > FUTURE_TOLERANCE_S:
        what = "modification time" if rec is None else "renewal time"
        note = f"{note}; its {what} is {human_duration(future)} in the future".lstrip("; ")
    elif future > 0:
        note = f"{note}; the host's clock went back, ages counted as 0".lstrip("; ")
    return Ages(max(age, 0.0), max(renewed, 0.0), float(lease), clock, note, future)


def describe_owner(owner: dict[str, Any]) -> str:
    show = {key: owner.get(key) or "?" for key in DISPLAY_KEYS}
    text = f"{show['user']}@{show['controller']} (pid {show['pid']}"
    return text + (f", playbook {show['playbook']})" if owner.get("playbook") else ")")


def lease_text(ages: Ages) -> str:
    left = ages.lease_left_s
    if left > 0:
        return f"lease ends in {human_duration(left)}"
    return f"lease ended {human_duration(-left)} ago"


def summarize(found: Found, ages: Ages, path: str) -> str:
    clock = "by the host's clock" if not ages.note else f"by the host's clock ({ages.note})"
    if ages.unmeasurable:
        what = (
            describe_owner(found.record["owner"])
            if found.record is not None
            else f"a lock file {path} ({len(found.raw or b'')} bytes, {found.problem or 'legacy'})"
        )
        return (
            f"{what}, whose age cannot be measured {clock}: it is not judged by its lease, "
            "which would never end"
        )
    if found.record is not None:
        who = describe_owner(found.record["owner"])
        return f"{who}, taken {human_duration(ages.age_s)} ago {clock}, {lease_text(ages)}"
    what = (
        f"{describe_owner(found.legacy)}, a lock of an older sglang-fleet"
        if found.legacy
        else f"an unreadable lock file {path} ({len(found.raw or b'')} bytes, {found.problem})"
    )
    return (
        f"{what}, written {human_duration(ages.age_s)} ago {clock}; it counts as held for "
        f"{human_duration(ages.lease_s)} after that (lease_s), {lease_text(ages)}"
    )


def holder_view(found: Found, now: HostClock, fallback_lease_s: float, path: str) -> dict[str, Any]:
    ages = measure(found, now, fallback_lease_s)
    rec = found.record or {}
    return {
        "readable": found.record is not None,
        "problem": found.problem,
        "size": len(found.raw or b""),
        "sha256": found.sha256,
        "owner": rec.get("owner") or found.legacy or {},
        "run_id": rec.get("run_id", ""),
        "lease_s": round(ages.lease_s),
        "depth": rec.get("depth", 0),
        "age_s": round(ages.age_s),
        "renewed_ago_s": round(ages.renewed_ago_s),
        "lease_left_s": round(ages.lease_left_s),
        "clock": ages.clock,
        "clock_note": ages.note,
        "future_s": round(ages.future_s),
        "unmeasurable": ages.unmeasurable,
        "summary": summarize(found, ages, path),
    }


# --------------------------------------------------------------------------- writing the file


def utc(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


def new_record(owner: dict[str, Any], run_id: str, lease_s: int, now: HostClock) -> dict[str, Any]:
    return {
        "version": RECORD_VERSION,
        "token": secrets.token_hex(16),
        "run_id": run_id,
        "owner": owner,
        "lease_s": lease_s,
        "depth": 1,
        "taken_at": utc(now.wall),
        "renewed_at": utc(now.wall),
        "host_clock": {
            "boot_id": now.boot_id,
            "taken_boottime": round(now.boottime, 3),
            "renewed_boottime": round(now.boottime, 3),
            "taken_wall": round(now.wall, 3),
            "renewed_wall": round(now.wall, 3),
        },
    }


def renewed_record(
    rec: dict[str, Any], now: HostClock, lease_s: int | None, depth_change: int = 0
) -> dict[str, Any]:
    """The record with a fresh renewal time; after a reboot the taken time moves to this boot."""
    hc = dict(rec["host_clock"])
    if hc["boot_id"] != now.boot_id:
        taken_ago = max(now.wall - hc["taken_wall"], 0.0)
        hc.update(boot_id=now.boot_id, taken_boottime=round(now.boottime - taken_ago, 3))
    hc.update(renewed_boottime=round(now.boottime, 3), renewed_wall=round(now.wall, 3))
    return {
        **rec,
        "lease_s": lease_s if lease_s is not None else rec["lease_s"],
        "depth": rec["depth"] + depth_change,
        "renewed_at": utc(now.wall),
        "host_clock": hc,
    }


def _write_temp(path: str, record: dict[str, Any]) -> str:
    directory, name = os.path.split(path)
    temp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(json.dumps(record, sort_keys=True, allow_nan=False).encode() + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        os.unlink(temp)
        raise
    return temp


def _sync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create(path: str, record: dict[str, Any]) -> bool:
    """Link a complete record into place; False when a file appeared there first."""
    temp = _write_temp(path, record)
    try:
        os.link(temp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(temp)
    _sync_dir(path)
    return True


def replace(path: str, record: dict[str, Any]) -> None:
    """Put a complete record in place; a failed replace leaves no temporary file behind."""
    temp = _write_temp(path, record)
    try:
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise
    _sync_dir(path)


def remove(path: str) -> None:
    os.unlink(path)
    _sync_dir(path)


@contextmanager
def guard(path: str, timeout: float = GUARD_TIMEOUT_S) -> Iterator[None]:
    """Serialise fleet_lock calls on this host (read, decide, write happen as one step)."""
    guard_path = f"{path}.guard"
    try:
        fd = os.open(guard_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise LockError(f"cannot open {guard_path}: {exc.strerror}") from exc
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise LockError(
                        f"{guard_path} stayed locked for {timeout:.0f} s by another process"
                    ) from exc
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the three states


def result(outcome: str, path: str, **fields: Any) -> dict[str, Any]:
    base = {
        "outcome": outcome,
        "lock_file": path,
        "acquired": False,
        "token": "",
        "run_id": "",
        "depth": 0,
        "lease_s": 0,
        "holder": None,
        "changed": False,
    }
    return {**base, **fields}


def ours(outcome: str, path: str, rec: dict[str, Any], **fields: Any) -> dict[str, Any]:
    mine = {"token": rec["token"], "run_id": rec["run_id"], "depth": rec["depth"]}
    return result(outcome, path, acquired=True, lease_s=rec["lease_s"], **mine, **fields)


@dataclass(frozen=True)
class Acquire:
    """A request to take the lock (replace_sha256: the stale file the action judged)."""

    path: str
    owner: dict[str, Any]
    run_id: str
    lease_s: int = DEFAULT_LEASE_S
    replace_sha256: str | None = None


def acquire(
    req: Acquire, check_mode: bool, clock: Callable[[], HostClock] = read_host_clock
) -> dict[str, Any]:
    found = read_lock(req.path)
    if found.raw is not None:
        return _take_held(req, found, clock(), check_mode)
    if check_mode:
        msg = f"check mode: {req.path} is free, a run would take it"
        return result("would_acquire", req.path, changed=True, lease_s=req.lease_s, msg=msg)
    rec = new_record(req.owner, req.run_id, req.lease_s, clock())
    if create(req.path, rec):
        return ours("acquired", req.path, rec, changed=True, msg=f"took {req.path}")
    # Only a writer that skips the guard (a by-hand edit) can get here: look again.
    found = read_lock(req.path)
    if found.raw is None:
        return result("changed", req.path, msg=f"{req.path} appeared and vanished: try again")
    return _take_held(req, found, clock(), check_mode)


def _take_held(req: Acquire, found: Found, now: HostClock, check_mode: bool) -> dict[str, Any]:
    path = req.path
    if found.record is not None and found.record["run_id"] == req.run_id:
        lease = max(req.lease_s, found.record["lease_s"])
        rec = renewed_record(found.record, now, lease, depth_change=1)
        if not check_mode:
            replace(path, rec)
        msg = f"this run holds {path} already (depth {rec['depth']})"
        return ours("reentered", path, rec, msg=msg)
    view = holder_view(found, now, req.lease_s, path)
    if req.replace_sha256 is None:
        return result("held", path, holder=view, msg=f"{path} is held by {view['summary']}")
    if found.sha256 != req.replace_sha256:
        msg = f"{path} changed since it was judged stale: now {view['summary']}"
        return result("changed", path, holder=view, msg=msg)
    if check_mode:
        msg = f"check mode: a run would take over {path} from {view['summary']}"
        return result("would_take_over", path, holder=view, changed=True, msg=msg)
    rec = new_record(req.owner, req.run_id, req.lease_s, now)
    replace(path, rec)
    msg = f"took over {path} from {view['summary']}"
    return ours("taken_over", path, rec, holder=view, changed=True, msg=msg)


def not_ours(found: Found, token: str) -> bool:
    return found.record is None or found.record["token"] != token


def renew(
    path: str,
    token: str,
    lease_s: int | None,
    check_mode: bool,
    clock: Callable[[], HostClock] = read_host_clock,
) -> dict[str, Any]:
    found = read_lock(path)
    now = clock()
    if found.raw is None:
        msg = (
            f"lost the lock {path}: the file is gone (removed by hand?); stopping, because "
            "another run may be working on this host now"
        )
        return result("lost", path, failed=True, lock_lost=True, msg=msg)
    if not_ours(found, token):
        view = holder_view(found, now, lease_s or DEFAULT_LEASE_S, path)
        msg = (
            f"lost the lock {path}: it is now held by {view['summary']}; stopping, because "
            "that run may be working on this host"
        )
        return result("lost", path, failed=True, lock_lost=True, holder=view, msg=msg)
    rec = renewed_record(found.record, now, lease_s)
    if check_mode:
        return ours("would_renew", path, rec, msg=f"check mode: {path} is ours, not renewed")
    replace(path, rec)
    return ours("renewed", path, rec, msg=f"renewed {path} for {human_duration(rec['lease_s'])}")


def release(
    path: str,
    token: str,
    check_mode: bool,
    clock: Callable[[], HostClock] = read_host_clock,
) -> dict[str, Any]:
    if not token:
        return result("not_held", path, msg="this run took no lock: nothing to release")
    found = read_lock(path)
    if found.raw is None:
        return result("absent", path, msg=f"{path} is gone already")
    if not_ours(found, token):
        view = holder_view(found, clock(), DEFAULT_LEASE_S, path)
        warning = f"{path} is no longer ours and was left alone: held by {view['summary']}"
        return result("not_ours", path, holder=view, warnings=[warning], msg=warning)
    rec = found.record
    if check_mode:
        return result("would_release", path, changed=True, msg=f"check mode: would free {path}")
    if rec["depth"] > 1:
        kept = renewed_record(rec, clock(), None, -1)
        replace(path, kept)
        return ours("kept", path, kept, msg=f"{path} stays held by the outer acquisition")
    remove(path)
    return result("released", path, changed=True, msg=f"released {path}")


# --------------------------------------------------------------------------- entry point

ARGUMENT_SPEC: dict[str, Any] = {
    "path": {"type": "path", "default": "/run/lock/sglang-fleet-deploy.lock"},
    "state": {"type": "str", "choices": ["acquired", "renewed", "released"], "default": "acquired"},
    "owner": {"type": "dict"},
    "run_id": {"type": "str"},
    # Which run holds the lock: a random id the module itself returns and writes into the lock
    # file, not a secret (no_log would only hide it from the operator reading a takeover).
    "token": {"type": "str", "default": "", "no_log": False},
    "lease_s": {"type": "int"},
    "replace_sha256": {"type": "str"},
}


def bad_params(params: dict[str, Any], check_mode: bool = False) -> str:
    path, lease = params["path"], params["lease_s"]
    if not os.path.isabs(path):
        return f"path must be an absolute path, got {path!r}"
    if not os.path.isdir(os.path.dirname(path)):
        return f"path: the directory {os.path.dirname(path)} does not exist on the host"
    if lease is not None and lease <= 0:
        return f"lease_s must be a whole number of seconds above 0, got {lease}"
    if params["state"] == "acquired" and not (params["owner"] and params["run_id"]):
        return "state=acquired needs owner and run_id (use the fleet_lock action plugin)"
    # In check mode acquiring takes no lock and returns no token: renewing it does nothing.
    if params["state"] == "renewed" and not params["token"] and not check_mode:
        return "state=renewed needs the token that state=acquired returned"
    return ""


def run(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    """Check mode only reads; an empty release token touches nothing; the rest is guarded."""
    if check_mode or (params["state"] == "released" and not params["token"]):
        return dispatch(params, check_mode)
    with guard(params["path"]):
        return dispatch(params, False)


def dispatch(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    path, state, token = params["path"], params["state"], params["token"]
    if state == "acquired":
        lease = params["lease_s"] or DEFAULT_LEASE_S
        req = Acquire(path, params["owner"], params["run_id"], lease, params["replace_sha256"])
        return acquire(req, check_mode)
    if state == "renewed" and not token:  # only in check mode (bad_params)
        return result("not_held", path, msg="check mode: no lock was taken, none to renew")
    if state == "renewed":
        return renew(path, token, params["lease_s"], check_mode)
    return release(path, token, check_mode)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    problem = bad_params(module.params, module.check_mode)
    if problem:
        module.fail_json(msg=problem, changed=False)
    try:
        outcome = run(module.params, module.check_mode)
    except (LockError, OSError) as exc:
        module.fail_json(msg=f"fleet_lock {module.params['path']}: {exc}", changed=False)
    for warning in outcome.pop("warnings", []):
        module.warn(warning)
    if outcome.get("failed"):
        module.fail_json(**outcome)
    module.exit_json(**outcome)


if __name__ == "__main__":
    main()
