"""Action fleet_lock: name this Ansible run, take the host's lock, and judge a holder's liveness.

Runs in the task's worker on the controller, then calls the `fleet_lock` module on the host.
The module only reads and writes the lock file; whether another run's lock may be taken over
is decided here, because only the controller can see that run's processes (docs/LOCKING.md):

- a holder whose run has any process left on this controller is alive, whatever its lease;
- a holder from this controller (same boot, same PID namespace) with no process left is gone;
- any other holder (another controller, an unreadable file) is stale only when its lease, as
  measured on the host's clock, has ended.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

# plugins/module_utils/procfs.py, the /proc reader the gpu_cleanup module ships to GPU hosts,
# imported by the collection's name as a module imports it: this action needs nothing of the
# controller package sglang_fleet, so it imports and runs without it (docs/COLLECTION.md).
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.procfs import (
    PROC,
    parse_stat,
    parse_status_uids,
    user_name,
)

display = Display()

STATES = ("acquired", "renewed", "released")
# A takeover can lose a race (the holder renewed, another run took it): judge again, a few times.
MAX_TRIES = 3
# Ancestry walks stop here: a loop in ppid data read from a changing /proc must not hang.
MAX_DEPTH = 64
LIVENESS_KEYS = {
    "controller_boot_id": str,
    "controller_pidns": str,
    "pid": int,
    "pid_starttime": int,
    "uid": int,
    "cmdline_sha256": str,
}


# ----------------------------------------------------------------- /proc on the controller


@dataclasses.dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    uid: int
    starttime: int  # clock ticks after boot (field 22 of /proc/PID/stat)
    cmdline: bytes


def _read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return None


def read_proc(pid: int, proc: str = PROC) -> Proc | None:
    """One live process, or None when it is gone, hidden or a zombie (it may exit while we
    read). A zombie keeps its pid and start time until reaped, but does nothing any more."""
    stat = _read_bytes(f"{proc}/{pid}/stat")
    status = _read_bytes(f"{proc}/{pid}/status")
    cmdline = _read_bytes(f"{proc}/{pid}/cmdline")
    if stat is None or status is None or cmdline is None:
        return None
    try:
        fields = parse_stat(stat.decode(errors="replace"))
        uid, _euid = parse_status_uids(status.decode(errors="replace"))
    except (ValueError, IndexError):
        return None
    if uid is None or fields.state in ("Z", "X"):
        return None
    return Proc(pid, fields.ppid, uid, fields.starttime, cmdline)


def list_procs(proc: str = PROC) -> dict[int, Proc]:
    procs = {}
    for name in os.listdir(proc):
        if name.isdigit():
            info = read_proc(int(name), proc)
            if info is not None:
                procs[info.pid] = info
    return procs


def playbook_process(start: int, procs: Mapping[int, Proc]) -> Proc:
    """The ansible-playbook process of this worker.

    Workers are forked from ansible-playbook without exec, so they carry its command line:
    walk up while the parent's command line is the same. ansible-core 2.21 puts each worker in
    a session of its own (setsid), so process groups and sessions do not lead there.
    """
    current = procs[start]
    for _depth in range(MAX_DEPTH):
        parent = procs.get(current.ppid)
        if parent is None or parent.cmdline != current.cmdline:
            return current
        current = parent
    return current


def hidepid_active(mountinfo: str, proc: str = PROC) -> bool:
    """Whether /proc hides other users' processes (then their absence proves nothing)."""
    for line in mountinfo.splitlines():
        fields = line.split(" - ")
        if len(fields) == 2 and fields[0].split()[4:5] == [proc]:
            options = fields[1].split()[2:3]
            for option in options[0].split(",") if options else []:
                if option.startswith("hidepid=") and option[8:] not in ("0", "off"):
                    return True
    return False


# --------------------------------------------------------------------------- this run


@dataclasses.dataclass(frozen=True)
class Controller:
    hostname: str
    boot_id: str
    pidns: str
    euid: int
    hidepid: bool


def read_controller(proc: str = PROC) -> Controller:
    boot_id = (_read_bytes(f"{proc}/sys/kernel/random/boot_id") or b"").decode().strip()
    try:
        pidns = os.readlink(f"{proc}/self/ns/pid")
    except OSError:
        pidns = ""
    mountinfo = (_read_bytes(f"{proc}/self/mountinfo") or b"").decode(errors="replace")
    return Controller(
        socket.gethostname(), boot_id, pidns, os.geteuid(), hidepid_active(mountinfo, proc)
    )


def playbook_names(cmdline: bytes) -> str:
    """Playbook file names only: the rest of a command line may carry secrets (-e key=...)."""
    args = [arg.decode(errors="replace") for arg in cmdline.split(b"\0") if arg]
    books = [os.path.basename(a) for a in args if a.endswith((".yml", ".yaml"))]
    if books:
        return ",".join(books)
    tools = [os.path.basename(a) for a in args[:2] if "ansible" in os.path.basename(a)]
    return tools[0] if tools else "?"


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    controller: Controller
    playbook: Proc

    @property
    def run_id(self) -> str:
        c, p = self.controller, self.playbook
        key = f"{c.hostname}|{c.boot_id}|{c.pidns}|{p.pid}|{p.starttime}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def owner(self) -> dict[str, Any]:
        c, p = self.controller, self.playbook
        return {
            "user": user_name(p.uid),
            "uid": p.uid,
            "controller": c.hostname,
            "controller_boot_id": c.boot_id,
            "controller_pidns": c.pidns,
            "pid": p.pid,
            "pid_starttime": p.starttime,
            "cmdline_sha256": hashlib.sha256(p.cmdline).hexdigest(),
            "playbook": playbook_names(p.cmdline),
        }


def identify(procs: Mapping[int, Proc], controller: Controller, worker: int) -> RunIdentity:
    return RunIdentity(controller, playbook_process(worker, procs))


def fallback_identity(controller: Controller) -> RunIdentity:
    """Without a readable /proc (not Linux) the run is named by its parent pid. Without a boot
    id it never counts as "this controller", so nothing is proven gone from an empty table."""
    blind = dataclasses.replace(controller, boot_id="", pidns="")
    return RunIdentity(blind, Proc(os.getppid(), 0, os.geteuid(), 0, b""))


# --------------------------------------------------------------------------- liveness


def _descends_from(pid: int, ancestor: int, procs: Mapping[int, Proc]) -> bool:
    for _depth in range(MAX_DEPTH):
        if pid == ancestor:
            return True
        info = procs.get(pid)
        if info is None or info.ppid in (0, pid):
            return False
        pid = info.ppid
    return False


def run_processes(owner: Mapping[str, Any], procs: Mapping[int, Proc], own_pid: int) -> list[int]:
    """Processes left of the run that wrote owner: its ansible-playbook, or any process with
    the same user and command line started no earlier (its workers, also once re-parented
    after ansible-playbook was killed). Our own run (own_pid and below) is left out."""
    top = procs.get(owner["pid"])
    if top is not None and top.starttime == owner["pid_starttime"]:
        return [top.pid]
    found = []
    for info in procs.values():
        same_run = (
            info.uid == owner["uid"]
            and info.starttime >= owner["pid_starttime"]
            and hashlib.sha256(info.cmdline).hexdigest() == owner["cmdline_sha256"]
        )
        if same_run and not _descends_from(info.pid, own_pid, procs):
            found.append(info.pid)
    return sorted(found)


def liveness_owner(holder: Mapping[str, Any]) -> dict[str, Any] | None:
    owner = holder.get("owner") or {}
    if not holder.get("readable"):
        return None
    for key, kind in LIVENESS_KEYS.items():
        if not isinstance(owner.get(key), kind) or isinstance(owner.get(key), bool):
            return None
    return dict(owner)


@dataclasses.dataclass(frozen=True)
class Verdict:
    stale: bool
    reason: str
    advice: str
    pids: tuple[int, ...] = ()


def _by_lease(holder: Mapping[str, Any], why_blind: str, path: str, host: str) -> Verdict:
    by_hand = f"remove {path} on {host} by hand"
    if holder.get("unmeasurable"):
        # A time ahead of the host's clock: the lease would never end, and taking the lock
        # over would steal from whatever wrote it. Neither: the operator decides.
        return Verdict(
            False,
            f"{why_blind}, and its time lies ahead of the host's clock, so it is neither taken "
            "over nor waited for",
            f"Find out what wrote {path}; if you are sure no run is working on {host}, {by_hand}.",
        )
    left = int(holder.get("lease_left_s", 0))
    if left <= 0:
        return Verdict(True, f"{why_blind}, and its lease has ended", "")
    advice = (
        f"Wait for that run to end (or for its lease to end). If you are sure no run is working "
        f"on {host}, {by_hand}."
        if holder.get("readable")
        else f"It is taken over when its lease ends; if you are sure no run is working on {host}, "
        f"{by_hand} now."
    )
    return Verdict(False, f"{why_blind}, so only the end of its lease frees the lock", advice)


def judge(
    holder: Mapping[str, Any], me: RunIdentity, procs: Mapping[int, Proc], path: str, host: str
) -> Verdict:
    """Whether the lock described by holder (the module's view) may be taken over by us."""
    owner = liveness_owner(holder)
    if owner is None:
        why = "the lock file does not name a run this controller could look for"
        return _by_lease(holder, why, path, host)
    c = me.controller
    where = (owner["controller_boot_id"], owner["controller_pidns"])
    if not c.boot_id or where != (c.boot_id, c.pidns):
        why = (
            f"it was taken from {owner.get('controller', '?')}, another controller (or another "
            "boot or container of one) whose processes this run cannot see"
        )
        return _by_lease(holder, why, path, host)
    if c.hidepid and c.euid not in (0, owner["uid"]):
        why = "/proc on this controller hides other users' processes (hidepid)"
        return _by_lease(holder, why, path, host)
    pids = run_processes(owner, procs, me.playbook.pid)
    if not pids:
        return Verdict(True, "no process of that run is left on this controller", "")
    shown = ", ".join(map(str, pids[:8])) + (" ..." if len(pids) > 8 else "")
    lease_over = int(holder.get("lease_left_s", 0)) <= 0
    ended = " (its lease has ended, but the run is still alive)" if lease_over else ""
    reason = f"that run still has {len(pids)} process(es) on this controller: pid {shown}{ended}"
    advice = "Wait for it to end, or stop it (those pids) if it hangs."
    return Verdict(False, reason, advice, tuple(pids))


def processes_now(me: RunIdentity) -> dict[int, Proc]:
    """A fresh process table for judging, read after the module answered."""
    if not me.controller.boot_id:
        return {}
    try:
        return list_procs()
    except OSError as exc:
        raise AnsibleActionFail(f"fleet_lock: cannot list processes in {PROC}: {exc}") from exc


# --------------------------------------------------------------------------- arguments


def check_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """The task's arguments, checked before the host is touched."""
    state = args.get("state", "acquired")
    if state not in STATES:
        raise AnsibleActionFail(
            f"fleet_lock: state must be one of {', '.join(STATES)}, got {state!r}"
        )
    checked: dict[str, Any] = {"state": state}
    if "path" in args:
        path = str(args["path"])
        if not path.startswith("/"):
            raise AnsibleActionFail(f"fleet_lock: path must be an absolute path, got {path!r}")
        checked["path"] = path
    if args.get("lease_s") is not None:
        checked["lease_s"] = _lease(args["lease_s"])
    token = args.get("token", "")
    if not isinstance(token, str):
        raise AnsibleActionFail(
            f"fleet_lock: token must be the string that state=acquired returned, got {token!r}"
        )
    if state != "acquired":
        checked["token"] = token
    elif token:
        raise AnsibleActionFail("fleet_lock: token is for state=renewed and state=released only")
    return checked


def _lease(value: Any) -> int:
    try:
        lease = int(str(value).strip())
    except ValueError:
        lease = 0
    if lease <= 0:
        raise AnsibleActionFail(
            f"fleet_lock: lease_s must be a whole number of seconds above 0, got {value!r}"
        )
    return lease


# --------------------------------------------------------------------------- the action


class ActionModule(ActionBase):
    """Takes, renews and releases a host's rollout lock (module fleet_lock on the host)."""

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("path", "state", "lease_s", "token"))

    def run(self, tmp: Any = None, task_vars: dict | None = None) -> dict:
        result = super().run(tmp, task_vars)
        args = check_args(self._task.args)
        if args["state"] != "acquired":
            return {**result, **self._lock_module(args, task_vars)}
        host = str((task_vars or {}).get("inventory_hostname", "?"))
        return {**result, **self._acquire(args, host, task_vars)}

    def _lock_module(self, args: dict[str, Any], task_vars: dict | None) -> dict:
        return self._execute_module(
            module_name="sglang_fleet.fleet.fleet_lock", module_args=args, task_vars=task_vars
        )

    def _acquire(self, args: dict[str, Any], host: str, task_vars: dict | None) -> dict:
        controller = read_controller()
        try:
            me = identify(list_procs(), controller, os.getpid())
        except (OSError, KeyError):
            me = fallback_identity(controller)
        base = {**args, "owner": me.owner(), "run_id": me.run_id}
        replace: dict[str, str] = {}
        verdict = None
        for _attempt in range(MAX_TRIES):
            got = self._lock_module({**base, **replace}, task_vars)
            outcome = got.get("outcome")
            if got.get("failed") or outcome in ("acquired", "reentered", "would_acquire"):
                return got
            if outcome in ("taken_over", "would_take_over") and verdict is not None:
                return self._taken_over(got, verdict, host)
            if outcome == "changed":
                replace = {}
                continue
            verdict = judge(got["holder"], me, processes_now(me), got["lock_file"], host)
            if not verdict.stale:
                return self._held(got, verdict, host)
            replace = {"replace_sha256": got["holder"]["sha256"]}
        return {
            "failed": True,
            "msg": f"{host}: the lock {got.get('lock_file', '')} kept changing while it was "
            "judged; another run is taking it at the same time: try again",
        }

    def _held(self, got: dict, verdict: Verdict, host: str) -> dict:
        msg = f"{host} is locked by {got['holder']['summary']}; {verdict.reason}. {verdict.advice}"
        got.update(verdict={"stale": False, "reason": verdict.reason, "pids": list(verdict.pids)})
        if self._play_context.check_mode:
            display.warning(f"check mode: a real run would stop here: {msg}")
            got.update(msg=f"check mode: {msg}", changed=False)
            return got
        got.update(failed=True, msg=msg)
        return got

    def _taken_over(self, got: dict, verdict: Verdict, host: str) -> dict:
        verb = "would take" if got["outcome"] == "would_take_over" else "took"
        msg = f"{host}: {verb} over the lock of {got['holder']['summary']}: {verdict.reason}"
        got.update(msg=msg, verdict={"stale": True, "reason": verdict.reason, "pids": []})
        display.warning(msg)
        return got
