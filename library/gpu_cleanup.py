#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module gpu_cleanup: kill the deployed SGLang service's stray GPU processes, then prove
the GPUs the deployment needs are clear. Runs on the GPU host: standard library only."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_cleanup
short_description: Kill leftover SGLang GPU processes and gate on the GPUs being clear
description:
  - Finds every process holding a GPU, from C(nvidia-smi --query-compute-apps) and from the
    processes that hold NVIDIA device files open (nvidia-smi misses some, for example processes
    in other PID namespaces or ones that hold a device without a context yet).
  - Classifies each one as I(ours) (a process of the SGLang service being deployed, by systemd
    unit cgroup, process title, launch module or listening port) or I(foreign).
  - Only processes on the GPUs the deployment needs (I(gpus)) matter. A host may run two servers
    on disjoint GPU sets, so processes on other GPUs are reported and never touched, even when
    they look like SGLang, because the title and module rules recognise any SGLang, not just ours.
  - If a foreign process holds a needed GPU, the module fails with a table naming each one and
    kills nothing at all, unless I(allow_kill_foreign) is set. Everything is decided before the
    first signal is sent.
  - With I(state=clean) it stops the active systemd units of I(ours.units), then kills the
    remaining process groups (SIGTERM, bounded wait, SIGKILL), then polls until no process holds
    a needed GPU and each needed GPU's used memory is at most I(max_used_mib).
  - A GPU that stays above the threshold with no process on it is reported in C(stuck_gpus);
    resetting it (C(nvidia-smi -r)) happens only when I(reset_stuck_gpus) is set.
  - A process that lives in a systemd service unit other than I(ours.units) is foreign even when
    its title or command line look like SGLang (it belongs to another server deployed as a unit).
version_added: "0.1.0"
author: sglang-fleet
options:
  state:
    description:
      - C(clean) kills ours on the needed GPUs and then gates on them being clear.
      - C(inspect) only reports (never kills, never waits, fails only when nvidia-smi fails).
    type: str
    choices: [clean, inspect]
    default: clean
  gpus:
    description: GPU indexes the deployment needs. Empty means every GPU on the host.
    type: list
    elements: int
    default: []
  nvidia_smi:
    description: Path or name of the nvidia-smi binary.
    type: str
    default: nvidia-smi
  device_glob:
    description:
      - Glob of the NVIDIA device files whose holders count as GPU users.
      - C(nvidiaN) maps to GPU N. A process holding only other matches (C(nvidiactl),
        C(nvidia-uvm)) could be on any GPU. For a process nvidia-smi lists, nvidia-smi's GPUs are
        used and its device files only confirm it.
      - The GPU-less test double keeps plain files under its state directory instead.
    type: str
    default: /dev/nvidia*
  ours:
    description: How to recognise processes of the SGLang service being deployed.
    type: dict
    default: {}
    suboptions:
      units:
        description:
          - systemd units of the service. A process whose cgroup is inside one is ours, and
            active units are stopped (C(systemctl stop)) before any process is signalled.
          - A name without a suffix gets C(.service).
        type: list
        elements: str
        default: []
      process_titles:
        description: Prefixes of process titles (C(sglang::) matches C(sglang::scheduler_TP0)).
        type: list
        elements: str
        default: []
      launch_modules:
        description: Python modules run with C(-m), such as C(sglang.launch_server).
        type: list
        elements: str
        default: []
      ports:
        description: TCP ports; a process listening on one of them is ours.
        type: list
        elements: int
        default: []
  ignore_names:
    description:
      - Driver daemons and monitors that keep device files open without being workloads. Matched
        against the process name (C(/proc/PID/comm)) and the basename of its first argument.
    type: list
    elements: str
    default: [nvidia-persistenced, nv-fabricmanager, nv-hostengine, dcgm-exporter, nvidia-smi]
  allow_kill_foreign:
    description: Kill foreign processes on the needed GPUs too, instead of failing.
    type: bool
    default: false
  term_timeout:
    description: Seconds to wait after SIGTERM before SIGKILL (SGLang drains on SIGTERM).
    type: float
    default: 30
  clear_timeout:
    description: Seconds the gate waits for the needed GPUs to become clear.
    type: float
    default: 60
  poll_interval:
    description: Seconds between polls while waiting.
    type: float
    default: 1
  max_used_mib:
    description:
      - A needed GPU counts as clear when its C(memory.used) is at most this many MiB.
      - An idle GPU is not at 0; drivers that report NVML v1 memory include the driver's reserve,
        a few hundred MiB up to about 1 GiB on recent data-centre GPUs. One leftover SGLang rank
        holds tens of GiB (C(--mem-fraction-static) of the card), so 2048 MiB separates the two
        with margin on both sides. Leftover processes themselves are caught by the process check,
        not by this threshold.
    type: int
    default: 2048
  reset_stuck_gpus:
    description:
      - Run C(nvidia-smi -r -i N) on a needed GPU that stays above I(max_used_mib) after every
        process on it is gone. Off by default, because a reset is the operator's call.
    type: bool
    default: false
notes:
  - Run with privilege escalation, since reading other users' C(/proc/PID/fd) and signalling their
    processes needs root.
  - Supports check mode; C(would_kill) and C(would_stop_units) say what a real run would do.
"""

EXAMPLES = r"""
- name: Kill leftovers of the SGLang service and wait for GPUs 0-7 to be clear
  gpu_cleanup:
    gpus: [0, 1, 2, 3, 4, 5, 6, 7]
    ours:
      units: [sglang-kimi.service]
      process_titles: ["sglang::"]
      launch_modules: [sglang.launch_server]
      ports: [8000]
  become: true
  register: cleanup

- name: Report who holds which GPU, touch nothing
  gpu_cleanup:
    state: inspect
  register: gpu_holders

- name: Against the GPU-less test double
  gpu_cleanup:
    nvidia_smi: /usr/local/bin/nvidia-smi
    device_glob: /var/lib/gpusim/dev/nvidia*
    gpus: [0, 1]
    ours:
      process_titles: ["sglang::"]
"""

RETURN = r"""
needed_gpus:
  description: GPU indexes that had to be clear (I(gpus), or every GPU when empty).
  returned: always
  type: list
  elements: int
  sample: [0, 1]
gpus:
  description: GPUs as nvidia-smi reported them at the end of the run.
  returned: always
  type: list
  elements: dict
  sample:
    - {index: 0, uuid: GPU-8e1..., name: NVIDIA H200, memory_used_mib: 0,
       memory_total_mib: 143771, needed: true}
processes:
  description:
    - Every process found holding a GPU before anything was done, with its classification.
    - C(gpus) are indexes (from nvidia-smi when it lists the process, else from the numbered
      device files held); C(any_gpu) is true when a process nvidia-smi does not list holds only a
      control device (C(nvidiactl), C(nvidia-uvm)), or nvidia-smi named a GPU it could not map.
    - C(sources) says who saw it (C(nvidia-smi), C(device)). C(ours) and C(reasons) say which
      rule matched, or why it is foreign. C(action) is C(kill), C(block) (foreign on a needed
      GPU), C(keep) (not on a needed GPU, or not visible in /proc) or C(ignore) (I(ignore_names)).
    - C(pid) is null when nvidia-smi hid it (C([Insufficient Permissions])).
  returned: always
  type: list
  elements: dict
  sample:
    - {pid: 4242, pgid: 4230, user: ml, uid: 1000, cmdline: "sglang::scheduler_TP0",
       gpus: [0], any_gpu: false, used_mib: 81234, sources: [nvidia-smi, device],
       ours: true, reasons: ["process_title:sglang::"], on_needed_gpus: true, action: kill}
blockers:
  description: Foreign processes on needed GPUs (the module failed unless allow_kill_foreign).
  returned: always
  type: list
  elements: dict
table:
  description: Fixed-width table (PID, PGID, USER, GPU, MiB, COMMAND) of the blockers.
  returned: always
  type: str
would_stop_units:
  description: Units of ours.units that are active and would be (or were) stopped.
  returned: always
  type: list
  elements: str
would_kill:
  description:
    - Process groups that a clean run kills (or would kill in check mode / inspect).
    - C(pgid) is null when members are signalled one by one (their group holds a protected or
      foreign process).
  returned: always
  type: list
  elements: dict
  sample: [{pgid: 4230, pids: [4242, 4243], commands: ["sglang::scheduler_TP0", "sglang::..."]}]
stopped_units:
  description: Units that were stopped.
  returned: always
  type: list
  elements: str
killed:
  description:
    - Groups (or single processes) signalled; C(signal) is the last one sent (C(SIGTERM) or
      C(SIGKILL)), C(survived) lists pids still alive after SIGKILL (uninterruptible sleep).
  returned: always
  type: list
  elements: dict
clear:
  description:
    - Whether every needed GPU ended clear. With I(state=inspect), whether they are clear now.
    - Null in check mode (nothing was waited for).
  returned: always
  type: bool
remaining:
  description: Processes still on needed GPUs when the gate gave up (inspect, on them now).
  returned: always
  type: list
  elements: dict
stuck_gpus:
  description:
    - Needed GPUs above max_used_mib with no process left on them when the gate gave up (inspect,
      now). A reset (reset_stuck_gpus) or a reboot is the operator's call.
  returned: always
  type: list
  elements: int
reset_gpus:
  description: GPUs reset with nvidia-smi -r (only with reset_stuck_gpus).
  returned: always
  type: list
  elements: int
ignored:
  description: Processes skipped by ignore_names.
  returned: always
  type: list
  elements: dict
waited_s:
  description: Seconds spent killing and gating.
  returned: always
  type: float
"""

import fnmatch
import os
import pwd
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.nvidia_smi import (
    NvidiaSmiError,
    apps_query_argv,
    check_result,
    gpu_query_argv,
    parse_compute_apps,
    parse_gpus,
)

PROC = "/proc"
_NUMBERED_DEVICE = re.compile(r"^nvidia(\d+)$")
_SOCKET_LINK = re.compile(r"^socket:\[(\d+)\]$")
_TCP_LISTEN = "0A"
# Container runtimes name their cgroup scopes like this; see owning_unit().
_UNIT_SUFFIXES = (".service", ".scope")
_ACTIVE_STATES = {"active", "activating", "deactivating", "reloading", "refreshing"}
COMMAND_WIDTH = 90

Runner = Callable[[list[str], float], tuple[int, str, str]]


def run_command(argv: list[str], timeout: float) -> tuple[int, str, str]:
    """Run argv with a time bound; a missing binary is rc 127 like a shell would say."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as exc:
        return 127, "", f"{argv[0]}: not found ({exc})"
    except subprocess.TimeoutExpired:
        return 124, "", f"{' '.join(argv)}: no answer within {timeout:g} s"
    return done.returncode, done.stdout, done.stderr


# --------------------------------------------------------------------------- /proc reading


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


def parse_stat(text: str) -> tuple[str, int, int, int]:
    """(state, ppid, pgid, starttime) from /proc/PID/stat.

    The command name is in parentheses and may itself hold spaces and parentheses, so fields are
    counted from the last ')'.
    """
    rest = text[text.rindex(")") + 2 :].split()
    return rest[0], int(rest[1]), int(rest[2]), int(rest[19])


def parse_status_uid(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


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
        _, controllers, path = parts
        if controllers == "name=systemd":
            return path
        if controllers == "":
            unified = path
    return unified


def owning_unit(cgroup_path: str) -> str | None:
    """The innermost systemd unit (service or scope) in a cgroup path, or None.

    Sub-cgroups a delegated unit makes for itself carry no unit suffix and are skipped.
    """
    for part in reversed(cgroup_path.strip("/").split("/")):
        if part.endswith(_UNIT_SUFFIXES):
            return part
    return None


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
        uid = parse_status_uid(_read(os.path.join(base, "status")))
    except (OSError, ValueError, IndexError):
        return None
    try:
        cgroup = parse_cgroup(_read(os.path.join(base, "cgroup")))
    except OSError:
        cgroup = ""
    # setproctitle rewrites argv in place, so a title shows up as one padded argument.
    cmdline = raw_cmdline.rstrip("\0 ").split("\0") if raw_cmdline else []
    return ProcInfo(pid, ppid, pgid, state, starttime, uid, user_name(uid), cmdline, comm, cgroup)


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


def device_gpu(target: str, device_glob: str) -> int | str | None:
    """GPU index for a device-file fd target: N for nvidiaN, "any" for other matches."""
    if not fnmatch.fnmatchcase(target, device_glob):
        return None
    numbered = _NUMBERED_DEVICE.match(os.path.basename(target))
    return int(numbered.group(1)) if numbered else "any"


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
    return {int(m.group(1)) for t in targets if (m := _SOCKET_LINK.match(t))}


def scan_device_holders(device_glob: str, proc_root: str = PROC) -> dict[int, set[int | str]]:
    """{pid: {gpu index or "any"}} for every process holding a matching device file."""
    holders: dict[int, set[int | str]] = {}
    for pid in list_pids(proc_root):
        gpus = {
            g for t in fd_targets(pid, proc_root) if (g := device_gpu(t, device_glob)) is not None
        }
        if gpus:
            holders[pid] = gpus
    return holders


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


# --------------------------------------------------------------------------- classification


@dataclass
class OursRules:
    units: list[str] = field(default_factory=list)
    process_titles: list[str] = field(default_factory=list)
    launch_modules: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> OursRules:
        params = params or {}
        units = [u if "." in u else f"{u}.service" for u in params.get("units") or []]
        return cls(
            units=units,
            process_titles=list(params.get("process_titles") or []),
            launch_modules=list(params.get("launch_modules") or []),
            ports=[int(p) for p in params.get("ports") or []],
        )


def runs_module(argv: list[str], module: str) -> bool:
    """True when argv runs ``python ... -m module`` (also ``-mmodule``)."""
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv):
            return argv[i + 1] == module
        if arg.startswith("-m") and not arg.startswith("--"):
            return arg[2:] == module
    return False


def has_title(info: ProcInfo, prefix: str) -> bool:
    """Process title match; the kernel's comm keeps only 15 bytes of a title."""
    joined = " ".join(info.cmdline)
    return joined.startswith(prefix) or (bool(info.comm) and info.comm.startswith(prefix[:15]))


def classify(
    info: ProcInfo, rules: OursRules, listen: dict[int, int], targets: list[str]
) -> tuple[bool, list[str]]:
    """(ours, reasons). Reasons name the rule that matched, or why the process is foreign."""
    unit = owning_unit(info.cgroup)
    if unit in rules.units:
        return True, [f"unit:{unit}"]
    if unit and unit.endswith(".service"):
        # Title/module rules recognise any SGLang; one inside another service unit is another
        # deployment's server, not a leftover of ours.
        return False, [f"in another systemd service: {unit}"]
    reasons = [f"process_title:{p}" for p in rules.process_titles if has_title(info, p)]
    reasons += [f"launch_module:{m}" for m in rules.launch_modules if runs_module(info.cmdline, m)]
    ports = sorted({listen[i] for i in socket_inodes(targets) if i in listen})
    reasons += [f"port:{p}" for p in ports]
    if reasons:
        return True, reasons
    return False, ["matches no rule of ours"]


def is_ignored(info: ProcInfo, ignore_names: list[str]) -> bool:
    first = os.path.basename(info.cmdline[0]) if info.cmdline else ""
    return any(name in (info.comm, first) or info.comm == name[:15] for name in ignore_names)


# --------------------------------------------------------------------------- discovery


@dataclass
class Snapshot:
    gpus: list[dict[str, Any]]
    processes: list[dict[str, Any]]


def query_gpus(nvidia_smi: str, runner: Runner) -> tuple[list[dict[str, Any]], list[dict]]:
    """(gpus, compute apps) from nvidia-smi; raises NvidiaSmiError with the reason."""
    argv = gpu_query_argv(nvidia_smi)
    rc, out, err = runner(argv, 30)
    if rc == 127:
        raise NvidiaSmiError(f"nvidia-smi not found: {nvidia_smi!r} ({err.strip()})")
    gpus = parse_gpus(check_result(argv, rc, out, err))
    argv = apps_query_argv(nvidia_smi)
    rc, out, err = runner(argv, 30)
    apps = parse_compute_apps(
        check_result(argv, rc, out, err), {g["uuid"]: g["index"] for g in gpus}
    )
    return gpus, apps


def _record(pid: int | None, info: ProcInfo | None) -> dict[str, Any]:
    return {
        "pid": pid,
        "pgid": info.pgid if info else None,
        "ppid": info.ppid if info else None,
        "starttime": info.starttime if info else None,
        "user": info.user if info else "?",
        "uid": info.uid if info else None,
        "cmdline": " ".join(info.cmdline) if info and info.cmdline else (info.comm if info else ""),
        "comm": info.comm if info else "",
        "cgroup": info.cgroup if info else "",
        "gpus": set(),
        "any_gpu": False,
        "used_mib": None,
        "sources": [],
        "visible": info is not None,
    }


def _add_gpu(record: dict[str, Any], gpu: int | str | None) -> None:
    if isinstance(gpu, int):
        record["gpus"].add(gpu)
    else:
        record["any_gpu"] = True


def _add_device_gpus(rec: dict[str, Any], held: set[int | str]) -> None:
    """GPUs of a process nvidia-smi does not list, from the device files it holds.

    nvidia-smi knows which GPUs a process has a context on; device files only fill in for the
    processes it misses. Every CUDA process also holds nvidiactl and nvidia-uvm, so those mean
    "could be any GPU" only for a process that holds no numbered device at all.
    """
    numbered = {g for g in held if isinstance(g, int)}
    rec["gpus"].update(numbered)
    if not numbered:
        rec["any_gpu"] = True


def discover(
    nvidia_smi: str,
    device_glob: str,
    rules: OursRules,
    *,
    ignore_names: list[str],
    runner: Runner,
    proc_root: str = PROC,
) -> Snapshot:
    """Every process holding a GPU, merged from nvidia-smi and the device-file scan, classified."""
    gpus, apps = query_gpus(nvidia_smi, runner)
    records: dict[Any, dict[str, Any]] = {}
    for n, app in enumerate(apps):
        key = app["pid"] if app["pid"] is not None else f"hidden-{n}"
        rec = records.get(key)
        if rec is None:
            info = read_proc(app["pid"], proc_root) if app["pid"] is not None else None
            rec = records[key] = _record(app["pid"], info)
            if info is None and app["process_name"]:
                rec["cmdline"] = str(app["process_name"])
        _add_gpu(rec, app["gpu_index"])
        if app["used_mib"] is not None:
            rec["used_mib"] = (rec["used_mib"] or 0) + app["used_mib"]
        if "nvidia-smi" not in rec["sources"]:
            rec["sources"].append("nvidia-smi")
    for pid, held in scan_device_holders(device_glob, proc_root).items():
        rec = records.get(pid)
        if rec is None:
            rec = records[pid] = _record(pid, read_proc(pid, proc_root))
        rec["sources"].append("device")
        if "nvidia-smi" not in rec["sources"]:
            _add_device_gpus(rec, held)
    listen = listening_inodes(rules.ports, proc_root) if rules.ports else {}
    processes = []
    for rec in records.values():
        _classify_record(rec, rules, ignore_names, listen, proc_root)
        rec["gpus"] = sorted(rec["gpus"])
        processes.append(rec)
    processes.sort(key=lambda r: (r["pid"] is None, r["pid"] or 0))
    return Snapshot(gpus, processes)


def _classify_record(
    rec: dict[str, Any],
    rules: OursRules,
    ignore_names: list[str],
    listen: dict[int, int],
    proc_root: str,
) -> None:
    info = read_proc(rec["pid"], proc_root) if rec["pid"] is not None else None
    rec["ignored"] = False
    if info is None:
        rec["ours"] = False
        rec["reasons"] = ["hidden by nvidia-smi" if rec["pid"] is None else "not visible in /proc"]
        return
    if is_ignored(info, ignore_names):
        rec["ignored"] = True
        rec["ours"] = False
        rec["reasons"] = ["ignore_names"]
        return
    targets = fd_targets(info.pid, proc_root) if listen else []
    rec["ours"], rec["reasons"] = classify(info, rules, listen, targets)


# --------------------------------------------------------------------------- decision


def on_needed(rec: dict[str, Any], needed: set[int]) -> bool:
    return rec["any_gpu"] or bool(needed.intersection(rec["gpus"]))


@dataclass
class Plan:
    kill_groups: list[dict[str, Any]]
    blockers: list[dict[str, Any]]


def protected_pgids(proc_root: str = PROC) -> tuple[set[int], set[int]]:
    """(pgids, pids) that must never be signalled: ours, our ancestors', PID 1's."""
    chain = ancestors(os.getpid(), proc_root)
    pids = {0, 1, os.getpid()} | {p.pid for p in chain}
    pgids = {0, 1, os.getpgid(0)} | {p.pgid for p in chain}
    return pgids, pids


def group_members(pgid: int, proc_root: str = PROC) -> list[ProcInfo]:
    members = []
    for pid in list_pids(proc_root):
        info = read_proc(pid, proc_root)
        if info is not None and info.pgid == pgid:
            members.append(info)
    return members


def decide(
    processes: list[dict[str, Any]],
    needed: set[int],
    allow_kill_foreign: bool,
    protected: tuple[set[int], set[int]],
    proc_root: str = PROC,
) -> Plan:
    """Set each record's action and group what is to be killed. Sends no signal.

    A process group is killed whole (a TP server's ranks and its launcher share one) unless it
    holds a protected process or a foreign GPU holder that is not itself to be killed; then its
    targets are signalled one by one.
    """
    prot_pgids, prot_pids = protected
    blockers, targets = [], []
    for rec in processes:
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
        elif rec["action"] == "kill" and rec["pid"] in prot_pids:
            rec["action"] = "keep"
            rec["reasons"] = [*rec["reasons"], "protected: this module or its ancestor"]
        elif rec["action"] == "kill":
            targets.append(rec)
    spared = {r["pid"] for r in processes if r["action"] in ("keep", "block") and r["pid"]}
    return Plan(_group_targets(targets, spared, prot_pgids, prot_pids, proc_root), blockers)


def _group_targets(
    targets: list[dict[str, Any]],
    spared: set[int],
    prot_pgids: set[int],
    prot_pids: set[int],
    proc_root: str,
) -> list[dict[str, Any]]:
    groups: dict[int, list[dict[str, Any]]] = {}
    for rec in targets:
        groups.setdefault(rec["pgid"], []).append(rec)
    plan = []
    for pgid, recs in sorted(groups.items()):
        members = group_members(pgid, proc_root)
        whole = pgid not in prot_pgids and not any(
            m.pid in spared or m.pid in prot_pids for m in members
        )
        chosen = members if whole else [read_proc(r["pid"], proc_root) for r in recs]
        chosen = [m for m in chosen if m is not None]
        if not chosen:
            continue
        plan.append(
            {
                "pgid": pgid if whole else None,
                "pids": [m.pid for m in chosen],
                "starttimes": [m.starttime for m in chosen],
                "commands": [" ".join(m.cmdline)[:COMMAND_WIDTH] or m.comm for m in chosen],
            }
        )
    return plan


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


# --------------------------------------------------------------------------- killing


def alive(pid: int, starttime: int, proc_root: str = PROC) -> bool:
    """Still running and still the same process (a reused pid has another start time).

    A zombie has released its memory and only waits for its parent to reap it: gone.
    """
    info = read_proc(pid, proc_root)
    return info is not None and info.starttime == starttime and info.state not in ("Z", "X")


def _survivors(group: dict[str, Any], proc_root: str) -> list[int]:
    return [
        pid
        for pid, start in zip(group["pids"], group["starttimes"], strict=True)
        if alive(pid, start, proc_root)
    ]


def _signal(group: dict[str, Any], sig: signal.Signals, proc_root: str) -> None:
    living = _survivors(group, proc_root)
    if not living:
        return
    try:
        if group["pgid"] is not None:
            os.killpg(group["pgid"], sig)
            return
    except ProcessLookupError:
        return
    for pid in living:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue


def _wait_gone(
    groups: list[dict[str, Any]], timeout: float, poll: float, proc_root: str
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        left = [g for g in groups if _survivors(g, proc_root)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


def terminate(
    groups: list[dict[str, Any]],
    term_timeout: float,
    poll_interval: float,
    proc_root: str = PROC,
    kill_wait: float = 10.0,
) -> list[dict[str, Any]]:
    """SIGTERM every group, wait up to term_timeout, SIGKILL the survivors. Returns a report.

    Groups already gone (a stopped unit took them) are left out of the report.
    """
    report = []
    live = [g for g in groups if _survivors(g, proc_root)]
    for group in live:
        _signal(group, signal.SIGTERM, proc_root)
        report.append({"pgid": group["pgid"], "pids": group["pids"], "signal": "SIGTERM"})
    stubborn = _wait_gone(live, term_timeout, poll_interval, proc_root)
    for group in stubborn:
        _signal(group, signal.SIGKILL, proc_root)
    left = _wait_gone(stubborn, kill_wait, min(poll_interval, 0.2), proc_root)
    for entry, group in zip(report, live, strict=True):
        if group in stubborn:
            entry["signal"] = "SIGKILL"
        entry["survived"] = _survivors(group, proc_root) if group in left else []
    return report


# --------------------------------------------------------------------------- units


def active_units(units: list[str], runner: Runner) -> list[str]:
    active = []
    for unit in units:
        rc, out, _ = runner(["systemctl", "is-active", unit], 15)
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


# --------------------------------------------------------------------------- gate


@dataclass
class GateResult:
    clear: bool
    remaining: list[dict[str, Any]]
    busy_gpus: list[int]
    stuck_gpus: list[int]
    gpus: list[dict[str, Any]]


def evaluate(snapshot: Snapshot, needed: set[int], max_used_mib: int) -> GateResult:
    """Is every needed GPU clear in this snapshot? Unknown memory counts as busy."""
    remaining = [p for p in snapshot.processes if not p.get("ignored") and on_needed(p, needed)]
    busy = sorted(
        g["index"]
        for g in snapshot.gpus
        if g["index"] in needed
        and (g["memory_used_mib"] is None or g["memory_used_mib"] > max_used_mib)
    )
    held = {g for p in remaining for g in p["gpus"]}
    any_held = any(p["any_gpu"] for p in remaining)
    stuck = [g for g in busy if g not in held and not any_held]
    clear = not remaining and not busy
    return GateResult(clear, remaining, busy, stuck, snapshot.gpus)


def wait_clear(
    snap: Callable[[], Snapshot],
    needed: set[int],
    max_used_mib: int,
    timeout: float,
    poll_interval: float,
) -> GateResult:
    deadline = time.monotonic() + timeout
    while True:
        result = evaluate(snap(), needed, max_used_mib)
        if result.clear or time.monotonic() >= deadline:
            return result
        time.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))


def reset_gpus(gpus: list[int], nvidia_smi: str, runner: Runner) -> tuple[list[int], list[str]]:
    done, warnings = [], []
    for index in gpus:
        rc, out, err = runner([nvidia_smi, "-r", "-i", str(index)], 120)
        if rc == 0:
            done.append(index)
        else:
            warnings.append(f"nvidia-smi -r -i {index} exited {rc}: {(out + err).strip()[:300]}")
    return done, warnings


# --------------------------------------------------------------------------- orchestration


def public(rec: dict[str, Any]) -> dict[str, Any]:
    """A process record as returned to Ansible (internal bookkeeping left out)."""
    return {k: v for k, v in rec.items() if k not in ("starttime", "visible")}


def cleanup(
    params: dict[str, Any],
    check_mode: bool,
    runner: Runner = run_command,
    proc_root: str = PROC,
) -> tuple[bool, dict[str, Any]]:
    """Do the whole job. Returns (failed, result); result carries msg and changed.

    Raises NvidiaSmiError when nvidia-smi cannot be used.
    """
    rules = OursRules.from_params(params.get("ours"))
    ignore = list(params.get("ignore_names") or [])

    def snap() -> Snapshot:
        return discover(
            params["nvidia_smi"],
            params["device_glob"],
            rules,
            ignore_names=ignore,
            runner=runner,
            proc_root=proc_root,
        )

    started = time.monotonic()
    before = snap()
    indexes = {g["index"] for g in before.gpus}
    needed = set(params.get("gpus") or indexes)
    result: dict[str, Any] = {
        "changed": False,
        "needed_gpus": sorted(needed),
        "would_stop_units": [],
        "stopped_units": [],
        "killed": [],
        "clear": None,
        "remaining": [],
        "stuck_gpus": [],
        "reset_gpus": [],
        "waited_s": 0.0,
        "warnings": [],
    }
    missing = sorted(needed - indexes)
    plan = decide(
        before.processes,
        needed,
        params["allow_kill_foreign"],
        protected_pgids(proc_root),
        proc_root,
    )
    result["processes"] = [public(p) for p in before.processes if not p["ignored"]]
    result["ignored"] = [public(p) for p in before.processes if p["ignored"]]
    result["blockers"] = [public(p) for p in plan.blockers]
    result["table"] = format_table(plan.blockers) if plan.blockers else ""
    result["would_kill"] = [
        {k: g[k] for k in ("pgid", "pids", "commands")} for g in plan.kill_groups
    ]
    result["gpus"] = _gpu_view(before.gpus, needed)
    if missing:
        result["msg"] = f"GPUs {missing} are needed but nvidia-smi lists only {sorted(indexes)}"
        return True, result
    if rules.units:
        result["would_stop_units"] = active_units(rules.units, runner)
    if params["state"] == "inspect":
        gate = evaluate(before, needed, params["max_used_mib"])
        result["clear"] = gate.clear
        result["remaining"] = [public(p) for p in gate.remaining]
        result["stuck_gpus"] = gate.stuck_gpus
        result["msg"] = _inspect_message(gate, plan)
        return False, result
    if plan.blockers:
        result["msg"] = (
            f"Foreign processes hold GPUs this deployment needs ({_gpu_list(needed)}); "
            "nothing was killed. Stop them, or set allow_kill_foreign to kill them.\n"
            + result["table"]
        )
        return True, result
    if check_mode:
        result["changed"] = bool(plan.kill_groups or result["would_stop_units"])
        result["msg"] = _check_message(result)
        return False, result
    return _clean(
        params,
        result,
        plan=plan,
        needed=needed,
        snap=snap,
        runner=runner,
        proc_root=proc_root,
        started=started,
    )


def _clean(
    params: dict[str, Any],
    result: dict[str, Any],
    *,
    plan: Plan,
    needed: set[int],
    snap: Callable[[], Snapshot],
    runner: Runner,
    proc_root: str,
    started: float,
) -> tuple[bool, dict[str, Any]]:
    stopped, warnings = stop_units(result["would_stop_units"], params["term_timeout"] + 30, runner)
    result["stopped_units"] = stopped
    result["warnings"] += warnings
    result["killed"] = terminate(
        plan.kill_groups, params["term_timeout"], params["poll_interval"], proc_root
    )
    gate = wait_clear(
        snap, needed, params["max_used_mib"], params["clear_timeout"], params["poll_interval"]
    )
    if not gate.clear and gate.stuck_gpus and params["reset_stuck_gpus"]:
        reset, warnings = reset_gpus(gate.stuck_gpus, params["nvidia_smi"], runner)
        result["reset_gpus"] = reset
        result["warnings"] += warnings
        gate = wait_clear(
            snap, needed, params["max_used_mib"], params["clear_timeout"], params["poll_interval"]
        )
    result["changed"] = bool(result["stopped_units"] or result["killed"] or result["reset_gpus"])
    result["clear"] = gate.clear
    result["remaining"] = [public(p) for p in gate.remaining]
    result["stuck_gpus"] = gate.stuck_gpus
    result["gpus"] = _gpu_view(gate.gpus, needed)
    result["waited_s"] = round(time.monotonic() - started, 2)
    if gate.clear:
        result["msg"] = _done_message(result, needed)
        return False, result
    result["msg"] = _gate_failure(gate, params, needed)
    return True, result


def _gpu_view(gpus: list[dict[str, Any]], needed: set[int]) -> list[dict[str, Any]]:
    return [{**g, "needed": g["index"] in needed} for g in gpus]


def _gpu_list(gpus: Iterable[int]) -> str:
    return ",".join(str(g) for g in sorted(gpus))


def _inspect_message(gate: GateResult, plan: Plan) -> str:
    state = "clear" if gate.clear else f"not clear (busy: {_gpu_list(gate.busy_gpus) or '-'})"
    return (
        f"needed GPUs {state}; {len(plan.kill_groups)} group(s) of ours would be killed, "
        f"{len(plan.blockers)} foreign process(es) block"
    )


def _check_message(result: dict[str, Any]) -> str:
    pids = [p for g in result["would_kill"] for p in g["pids"]]
    units = result["would_stop_units"]
    if not pids and not units:
        return "nothing to kill"
    return f"would stop units {units} and kill pids {pids} (check mode: nothing done)"


def _done_message(result: dict[str, Any], needed: set[int]) -> str:
    pids = [p for k in result["killed"] for p in k["pids"]]
    did = f"killed pids {pids}" if pids else "nothing to kill"
    if result["stopped_units"]:
        did = f"stopped {result['stopped_units']}, {did}"
    return f"GPUs {_gpu_list(needed)} clear; {did}"


def _gate_failure(gate: GateResult, params: dict[str, Any], needed: set[int]) -> str:
    parts = [
        f"GPUs {_gpu_list(needed)} not clear after {params['clear_timeout']:g} s "
        f"(threshold {params['max_used_mib']} MiB)."
    ]
    if gate.remaining:
        parts.append("Still holding them:\n" + format_table(gate.remaining))
    if gate.stuck_gpus:
        used = {g["index"]: g["memory_used_mib"] for g in gate.gpus}
        listing = ", ".join(f"GPU {g}: {used.get(g)} MiB" for g in gate.stuck_gpus)
        parts.append(
            f"Busy with no process left ({listing}): memory the driver did not release. "
            "Resetting the GPU (nvidia-smi -r -i N, set reset_stuck_gpus) or rebooting the host "
            "is the operator's call."
        )
    return "\n".join(parts)


ARGUMENT_SPEC: dict[str, Any] = {
    "state": {"type": "str", "choices": ["clean", "inspect"], "default": "clean"},
    "gpus": {"type": "list", "elements": "int", "default": []},
    "nvidia_smi": {"type": "str", "default": "nvidia-smi"},
    "device_glob": {"type": "str", "default": "/dev/nvidia*"},
    "ours": {
        "type": "dict",
        "default": {},
        "options": {
            "units": {"type": "list", "elements": "str", "default": []},
            "process_titles": {"type": "list", "elements": "str", "default": []},
            "launch_modules": {"type": "list", "elements": "str", "default": []},
            "ports": {"type": "list", "elements": "int", "default": []},
        },
    },
    "ignore_names": {
        "type": "list",
        "elements": "str",
        "default": [
            "nvidia-persistenced",
            "nv-fabricmanager",
            "nv-hostengine",
            "dcgm-exporter",
            "nvidia-smi",
        ],
    },
    "allow_kill_foreign": {"type": "bool", "default": False},
    "term_timeout": {"type": "float", "default": 30},
    "clear_timeout": {"type": "float", "default": 60},
    "poll_interval": {"type": "float", "default": 1},
    "max_used_mib": {"type": "int", "default": 2048},
    "reset_stuck_gpus": {"type": "bool", "default": False},
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    try:
        failed, result = cleanup(module.params, module.check_mode)
    except NvidiaSmiError as exc:
        module.fail_json(msg=str(exc), changed=False)
    if os.geteuid() != 0:
        result["warnings"].append(
            "not running as root: other users' processes may be missed or not killable (use become)"
        )
    for warning in result.pop("warnings"):
        module.warn(warning)
    if failed:
        module.fail_json(**result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
