"""gpu_cleanup's kill plan: from a classified snapshot, the action for each process (kill,
block, keep, ignore) and, per process group, whom to signal and whom to spare. Sends no signal.
Standard library only: it runs on GPU hosts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ansible_collections.sglang_fleet.fleet.plugins.module_utils.gpu_cleanup_discovery import (
    Snapshot,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.gpu_cleanup_ownership import (
    Ownership,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.procfs import (
    PROC,
    ProcInfo,
    ancestors,
    list_pids,
    read_proc,
)

COMMAND_WIDTH = 90


def on_needed(rec: dict[str, Any], needed: set[int]) -> bool:
    return rec["any_gpu"] or bool(needed.intersection(rec["gpus"]))


@dataclass
class Plan:
    kill_groups: list[dict[str, Any]]
    blockers: list[dict[str, Any]]


def protected_pids(proc_root: str = PROC) -> set[int]:
    """Pids that must never be signalled: this module's, its ancestors', PID 1's."""
    return {0, 1, os.getpid()} | {p.pid for p in ancestors(os.getpid(), proc_root)}


def group_members(pgid: int, proc_root: str = PROC) -> list[ProcInfo]:
    members = []
    for pid in sorted(list_pids(proc_root)):
        info = read_proc(pid, proc_root)
        if info is not None and info.pgid == pgid:
            members.append(info)
    return members


def decide(
    snapshot: Snapshot,
    needed: set[int],
    *,
    allow_kill_foreign: bool,
    ownership: Ownership,
    protected: set[int],
    proc_root: str = PROC,
) -> Plan:
    """Set each record's action and plan, per process group, whom to signal. Sends no signal."""
    blockers, targets = [], []
    for rec in snapshot.processes:
        needed_here = on_needed(rec, needed)
        rec["on_needed_gpus"] = needed_here
        if rec["ignored"]:
            rec["action"] = "ignore"
        elif not needed_here or (not rec["visible"] and rec["pid"] is not None):
            rec["action"] = "keep"
        elif rec["ours"] or (allow_kill_foreign and rec["pid"] is not None):
            rec["action"] = "kill"
        else:
            rec["action"] = "block"
        if rec["action"] == "block":
            blockers.append(rec)
        elif rec["action"] == "kill" and rec["pid"] in protected:
            rec["action"] = "keep"
            rec["reasons"] = [*rec["reasons"], "protected: this module or its ancestor"]
        elif rec["action"] == "kill":
            targets.append(rec)
    groups = _plan_groups(targets, snapshot, ownership, protected, proc_root)
    return Plan(groups, blockers)


def _plan_groups(
    targets: list[dict[str, Any]],
    snapshot: Snapshot,
    ownership: Ownership,
    protected: set[int],
    proc_root: str,
) -> list[dict[str, Any]]:
    """Per process group holding a target: the members to signal, and those spared, with why.

    A group is never signalled as a whole: a shell that launched the server by hand shares its
    group with whatever else it started (a `sleep`, a log tail), and a group id can be reused as
    well as a pid. The GPU targets are signalled, plus the members that hold no GPU and are ours
    by the same rules (SGLang's launcher and detokenizer), unless the group keeps a GPU process:
    a launcher takes its whole tree down, including ranks on GPUs this deployment does not need.
    """
    by_group: dict[int, list[dict[str, Any]]] = {}
    for rec in targets:
        by_group.setdefault(rec["pgid"], []).append(rec)
    plan = []
    for pgid, recs in sorted(by_group.items()):
        group = _plan_group(
            pgid,
            recs,
            snapshot=snapshot,
            ownership=ownership,
            protected=protected,
            proc_root=proc_root,
        )
        plan.append(group)
    return plan


def _plan_group(
    pgid: int,
    targets: list[dict[str, Any]],
    *,
    snapshot: Snapshot,
    ownership: Ownership,
    protected: set[int],
    proc_root: str,
) -> dict[str, Any]:
    holders = {r["pid"]: r for r in snapshot.processes if r["pid"] is not None}
    chosen = [(r["pid"], r["starttime"], r["cmdline"]) for r in targets]
    target_pids = {r["pid"] for r in targets}
    # Zombies have nothing left to signal: they only wait to be reaped.
    others = [
        m
        for m in group_members(pgid, proc_root)
        if m.pid not in target_pids and m.state not in ("Z", "X")
    ]
    keeps_gpu = any(holders.get(m.pid, {}).get("action") in ("keep", "block") for m in others)
    spared = []
    for member in others:
        ours, why = _member_verdict(
            member,
            holders,
            keeps_gpu=keeps_gpu,
            ownership=ownership,
            listeners=snapshot.listeners,
            protected=protected,
        )
        command = " ".join(member.cmdline) or member.comm
        if ours:
            chosen.append((member.pid, member.starttime, command))
        else:
            spared.append({"pid": member.pid, "command": command[:COMMAND_WIDTH], "reason": why})
    chosen.sort()
    return {
        "pgid": pgid,
        "pids": [pid for pid, _start, _command in chosen],
        "starttimes": [start for _pid, start, _command in chosen],
        "commands": [command[:COMMAND_WIDTH] for _pid, _start, command in chosen],
        "spared": spared,
    }


def _member_verdict(
    member: ProcInfo,
    holders: dict[int, dict[str, Any]],
    *,
    keeps_gpu: bool,
    ownership: Ownership,
    listeners: dict[int, set[int]],
    protected: set[int],
) -> tuple[bool, str]:
    """(signal it, why not) for a group member that is not itself a GPU target."""
    if member.pid in protected:
        return False, "protected: this module or its ancestor"
    if member.pid in holders:
        return False, f"holds a GPU and is not killed here (action {holders[member.pid]['action']})"
    if keeps_gpu:
        return False, "its group keeps a GPU process that is not killed here"
    ours, reasons = ownership.classify(member, listeners.get(member.pid, ()))
    return ours, "; ".join(reasons)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table an operator reads in the failure message."""
    header = f"{'PID':>8} {'PGID':>8} {'USER':<12} {'GPU':<8} {'MiB':>7}  COMMAND"
    lines = [header]
    for r in rows:
        gpu = "any" if r["any_gpu"] else ",".join(str(g) for g in r["gpus"])
        mib = "-" if r["used_mib"] is None else str(r["used_mib"])
        pid = "?" if r["pid"] is None else str(r["pid"])
        pgid = "?" if r["pgid"] is None else str(r["pgid"])
        command = (r["cmdline"] or "?")[:COMMAND_WIDTH]
        lines.append(f"{pid:>8} {pgid:>8} {r['user'][:12]:<12} {gpu:<8} {mib:>7}  {command}")
    return "\n".join(lines)


def format_reasons(rows: list[dict[str, Any]]) -> str:
    """One line per row saying why it is foreign, to print under the table."""
    return "\n".join(
        f"  pid {'?' if r['pid'] is None else r['pid']}: {'; '.join(r['reasons'])}" for r in rows
    )
