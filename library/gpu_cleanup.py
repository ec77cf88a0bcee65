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
  - Classifies each one as I(ours) (a leftover of the SGLang service being deployed) or
    I(foreign). A process in one of I(ours.units) is ours, whatever user it runs as. A process
    matching I(ours.process_titles) or I(ours.launch_modules) is ours only when its real and
    effective uids are those of I(ours.users) and it runs in no container and in no login or
    systemd unit of somebody else. A port of I(ours.ports) only adds evidence; alone it makes
    nothing ours. The rules, their order and why are in docs/GPU-CLEANUP.md.
  - Only processes on the GPUs the deployment needs (I(gpus)) matter. A host may run two servers
    on disjoint GPU sets, so processes on other GPUs are reported and never touched, even when
    they look like SGLang, because the title and module rules recognise any SGLang, not just ours.
  - If a foreign process holds a needed GPU, the module fails with a table naming each one and
    kills nothing at all, unless I(allow_kill_foreign) is set. Everything is decided before the
    first signal is sent.
  - With I(state=clean) it stops the active systemd units of I(ours.units), then signals the
    planned processes one by one (SIGTERM, bounded wait, SIGKILL), then polls until no process
    holds a needed GPU and each needed GPU's used memory is at most I(max_used_mib).
  - A process group is never signalled as a whole. Besides the GPU holders it kills, a group's
    members that hold no GPU are signalled only when they are ours by the same rules (SGLang's
    launcher, its detokenizer); a shell or a C(sleep) in the same group is left alone.
  - Each signal goes only to the process that was classified. Its start time is read again
    right before the signal (through a pidfd where the kernel has them), and a pid that now
    belongs to another process is skipped and reported.
  - A GPU that stays above the threshold with no process on it is reported in C(stuck_gpus);
    resetting it (C(nvidia-smi -r)) happens only when I(reset_stuck_gpus) is set.
  - A process in a systemd unit other than I(ours.units) is foreign even when its title or
    command line look like SGLang (it belongs to another server deployed as a unit, or to a
    transient C(run-*.scope) somebody made), and so is one inside a container (C(docker-*.scope),
    C(cri-containerd-*.scope), C(crio-*), C(libpod-*), C(kubepods), C(machine.slice), C(lxc)).
  - With I(accelerator=cpu) (SGLang's CPU engine) there is no GPU to prove clear and no
    nvidia-smi is run. The server's processes are those inside I(ours.units) (the launcher, its
    C(sglang::scheduler) and C(sglang::detokenizer), the multiprocessing resource tracker) and
    those listening on I(ours.ports), classified by the same rules; the gate holds once none of
    them is left. I(gpus) must then be empty.
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
  accelerator:
    description:
      - C(gpu) finds the processes holding the needed GPUs (nvidia-smi and device files) and
        gates on those GPUs being clear.
      - C(cpu) is for servers on SGLang's CPU engine, which hold no GPU; the processes of
        I(ours.units) and of I(ours.ports) are the service's, and the gate holds when none is
        left. nvidia-smi is not needed on the host.
    type: str
    choices: [gpu, cpu]
    default: gpu
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
        description:
          - TCP ports of the service. Listening on one adds evidence to a process that is ours
            by title or launch module; a port alone never makes a process ours.
        type: list
        elements: int
        default: []
      users:
        description:
          - Owner users, as names or numeric uids. A title or launch-module match makes a
            process ours only when its real and effective uids are among these, and a login
            (C(user-N.slice), such as an ssh C(session-N.scope)) of another user makes every
            process in it foreign.
          - Root launches SGLang by hand with C(nohup), so the default is C(root); pass the
            service user too (the gpu_cleanup role passes C(gpu_cleanup_owner_users)).
          - A name this host does not know fails the module, naming this option.
        type: list
        elements: str
        default: [root]
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
      users: [root, sglang]
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
accelerator:
  description: C(gpu) or C(cpu), as asked (I(accelerator)).
  returned: always
  type: str
  sample: gpu
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
    - {pid: 4242, pgid: 4230, user: root, uid: 0, cmdline: "sglang::scheduler_TP0",
       gpus: [0], any_gpu: false, used_mib: 81234, sources: [nvidia-smi, device],
       ours: true, reasons: ["process_title:sglang::", "port:8000"], on_needed_gpus: true,
       action: kill}
    - {pid: 5150, pgid: 5150, user: nobody, uid: 65534, cmdline: "sglang::scheduler_TP0",
       gpus: [1], any_gpu: false, used_mib: 20000, sources: [nvidia-smi, device],
       ours: false, on_needed_gpus: true, action: block,
       reasons: ["looks like ours (process_title:sglang::) but runs as nobody (uid 65534),
                  not an owner user"]}
blockers:
  description: Foreign processes on needed GPUs (the module failed unless allow_kill_foreign).
  returned: always
  type: list
  elements: dict
table:
  description:
    - Fixed-width table (PID, PGID, USER, GPU, MiB, COMMAND) of the blockers. The failure
      message prints it, then one line per blocker saying why it is not ours.
  returned: always
  type: str
owner_uids:
  description: The uids I(ours.users) resolved to on this host.
  returned: always
  type: list
  elements: int
  sample: [0, 998]
port_holders:
  description:
    - Every process listening on a port of I(ours.ports), GPU holder or not, classified by the
      same rules (C(ours), C(reasons)). A check that a port is free, or held only by leftovers
      of ours, reads this.
  returned: always
  type: list
  elements: dict
  sample:
    - {pid: 4242, pgid: 4230, user: root, uid: 0, cmdline: "sglang::scheduler_TP0",
       cgroup: /user.slice/user-0.slice/session-4.scope, ports: [8000], ours: true,
       reasons: ["process_title:sglang::", "port:8000"]}
would_stop_units:
  description: Units of ours.units that are active and would be (or were) stopped.
  returned: always
  type: list
  elements: str
would_kill:
  description:
    - Per process group, the processes (C(pids)) a clean run signals, or would signal in check
      mode and inspect. Each is signalled by pid, never the group as a whole.
    - C(spared) lists the group's other members that are left alone, with the reason (not ours,
      a GPU holder kept or blocked, protected, or the group keeps a GPU process elsewhere).
  returned: always
  type: list
  elements: dict
  sample:
    - {pgid: 4230, pids: [4230, 4242, 4243],
       commands: ["python3 -m sglang.launch_server ...", "sglang::scheduler_TP0", "..."],
       spared: [{pid: 4231, command: "sleep 3600", reason: "matches no rule of ours"}]}
stopped_units:
  description: Units that were stopped.
  returned: always
  type: list
  elements: str
killed:
  description:
    - Per process group, the C(pids) signalled; C(signal) is the last one sent (C(SIGTERM) or
      C(SIGKILL)), C(survived) lists pids still alive after SIGKILL (uninterruptible sleep).
    - C(skipped) lists planned pids that were not signalled because the pid now belongs to
      another process (its start time changed since it was classified), with the reason.
  returned: always
  type: list
  elements: dict
  sample:
    - {pgid: 4230, pids: [4242], signal: SIGTERM, survived: [],
       skipped: [{pid: 4243, reason: "pid reused: start time 9120 now, 500 when classified
                  (bash runs there now); not signalled"}]}
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

import errno
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
_UNIT_SUFFIXES = (".service", ".scope")
_ACTIVE_STATES = {"active", "activating", "deactivating", "reloading", "refreshing"}
COMMAND_WIDTH = 90

# How container runtimes name their cgroups (docs/GPU-CLEANUP.md, "Containers"): a systemd scope
# per container (systemd cgroup driver) ...
_CONTAINER_SCOPE = re.compile(r"^(docker|cri-containerd|crio|containerd|libpod|machine)-.+\.scope$")
# ... or a runtime directory holding one directory per container (cgroupfs driver) ...
_CONTAINER_DIRS = frozenset({"docker", "containerd", "crio", "lxc", "libpod_parent"})
# ... or whole subtrees that hold nothing but containers, pods and virtual machines.
_CONTAINER_TREES = ("kubepods", "lxc.payload.", "lxc.monitor.", "machine.slice")
_KUBE_POD = re.compile(r"^pod[0-9a-fA-F_-]+$")
# logind puts every login of user N (its session scopes, its user manager) under user-N.slice.
_USER_SLICE = re.compile(r"^user-(\d+)\.slice$")
_GONE = "gone"

Runner = Callable[[list[str], float], tuple[int, str, str]]


class OwnerError(ValueError):
    """ours.users names a user this host does not know."""


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
    euid: int | None = None


def parse_stat(text: str) -> tuple[str, int, int, int]:
    """(state, ppid, pgid, starttime) from /proc/PID/stat.

    The command name is in parentheses and may itself hold spaces and parentheses, so fields are
    counted from the last ')'.
    """
    rest = text[text.rindex(")") + 2 :].split()
    return rest[0], int(rest[1]), int(rest[2]), int(rest[19])


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
        _, controllers, path = parts
        if controllers == "name=systemd":
            return path
        if controllers == "":
            unified = path
    return unified


def _parts(cgroup_path: str) -> list[str]:
    return [part for part in cgroup_path.split("/") if part]


def owning_unit(cgroup_path: str) -> str | None:
    """The innermost systemd unit (service or scope) in a cgroup path, or None.

    Sub-cgroups a delegated unit makes for itself carry no unit suffix and are skipped.
    """
    for part in reversed(_parts(cgroup_path)):
        if part.endswith(_UNIT_SUFFIXES):
            return part
    return None


def _is_container_part(parts: list[str], i: int) -> bool:
    part = parts[i]
    if part in _CONTAINER_DIRS:
        return i + 1 < len(parts)
    return bool(_CONTAINER_SCOPE.match(part)) or part.startswith(_CONTAINER_TREES)


def container_cgroup(cgroup_path: str) -> str | None:
    """The path from the first container cgroup on (``docker-ID.scope``, ``docker/ID``,
    ``kubepods.slice/...``), or None when the path is in no container."""
    parts = _parts(cgroup_path)
    for i in range(len(parts)):
        if _is_container_part(parts, i):
            return "/".join(parts[i:])
    return None


def container_root(cgroup_path: str) -> str:
    """The cgroup of the innermost container that cgroup_path lies in; "" outside containers.

    Applied to this module's own cgroup: run inside a container (a system container, a test
    host), the module sees that container's processes as a host sees its own. A path whose
    container cannot be delimited gives "", so that everything in it stays foreign.
    """
    parts = _parts(cgroup_path)
    end, i, in_kubepods = 0, 0, False
    while i < len(parts):
        part = parts[i]
        in_kubepods = in_kubepods or part.startswith("kubepods")
        if part in _CONTAINER_DIRS or (in_kubepods and _KUBE_POD.match(part)):
            # The next part is the container (cgroupfs: docker/ID, kubepods/QOS/podUID/ID).
            if i + 1 < len(parts):
                end = i + 2
            i += 2
            continue
        if _CONTAINER_SCOPE.match(part) or part.startswith(("lxc.payload.", "lxc.monitor.")):
            end = i + 1
        i += 1
    return "/" + "/".join(parts[:end]) if end else ""


def relative_cgroup(cgroup_path: str, root: str) -> str:
    """cgroup_path below root when it lies there (root "" leaves it as it is)."""
    if root and (cgroup_path == root or cgroup_path.startswith(root + "/")):
        return cgroup_path[len(root) :] or "/"
    return cgroup_path


def login_uid(cgroup_path: str) -> int | None:
    """N when the path lies in user-N.slice (a login of user N), else None."""
    for part in _parts(cgroup_path):
        if matched := _USER_SLICE.match(part):
            return int(matched.group(1))
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


def scan_fds(
    device_glob: str, listen: dict[int, int], proc_root: str = PROC
) -> tuple[dict[int, set[int | str]], dict[int, set[int]]]:
    """({pid: GPU index or "any" per device file held}, {pid: ports of ours it listens on}).

    One pass over every process's open files serves both.
    """
    devices: dict[int, set[int | str]] = {}
    ports: dict[int, set[int]] = {}
    for pid in list_pids(proc_root):
        targets = fd_targets(pid, proc_root)
        gpus = {g for t in targets if (g := device_gpu(t, device_glob)) is not None}
        if gpus:
            devices[pid] = gpus
        held = {listen[i] for i in socket_inodes(targets) if i in listen}
        if held:
            ports[pid] = held
    return devices, ports


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
    users: list[str] = field(default_factory=lambda: ["root"])

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> OursRules:
        params = params or {}
        units = [u if "." in u else f"{u}.service" for u in params.get("units") or []]
        users = params.get("users")
        return cls(
            units=units,
            process_titles=list(params.get("process_titles") or []),
            launch_modules=list(params.get("launch_modules") or []),
            ports=[int(p) for p in params.get("ports") or []],
            users=["root"] if users is None else [str(u) for u in users],
        )


def resolve_owner_uids(users: Iterable[str]) -> set[int]:
    """uids of ours.users (names or numeric uids); an unknown name is an error, not a skip."""
    uids, unknown = set(), []
    for user in users:
        text = str(user).strip()
        if text.isdigit():
            uids.add(int(text))
            continue
        try:
            uids.add(pwd.getpwnam(text).pw_uid)
        except KeyError:
            unknown.append(text)
    if unknown:
        raise OwnerError(
            f"ours.users: no user {', '.join(repr(u) for u in unknown)} on this host. List the "
            "users whose leftover SGLang processes may be killed, as user names or numeric uids "
            "(the gpu_cleanup role's gpu_cleanup_owner_users: root and the service user)."
        )
    return uids


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


Verdict = tuple[bool, list[str]]


@dataclass
class Ownership:
    """Decides whether a process is a leftover of the service; rules in docs/GPU-CLEANUP.md.

    In order: a container cgroup makes it foreign; a login slice (user-N.slice) of a user who is
    not an owner makes it foreign; one of ours.units makes it ours, whatever its uid; any other
    systemd unit makes it foreign. Then a title or launch-module match makes it ours only when
    its real and effective uids are owner uids. A port of ours only adds evidence: alone it
    proves nothing, since anything may listen on a free port.
    """

    rules: OursRules
    owner_uids: set[int]
    # Cgroup of the container this module runs in ("" on a host): see container_root().
    own_container: str = ""

    def classify(self, info: ProcInfo, ports: Iterable[int] = ()) -> Verdict:
        """(ours, reasons): the rule that matched, or why the process is foreign."""
        port_reasons = [f"port:{p}" for p in sorted(set(ports))]
        by_scope = self._by_scope(relative_cgroup(info.cgroup, self.own_container))
        if by_scope is not None:
            return by_scope
        matched = [f"process_title:{p}" for p in self.rules.process_titles if has_title(info, p)]
        matched += [
            f"launch_module:{m}" for m in self.rules.launch_modules if runs_module(info.cmdline, m)
        ]
        if not matched and port_reasons:
            listed = ", ".join(r.removeprefix("port:") for r in port_reasons)
            return False, [
                f"listens on port {listed} of ours but has no title or launch module of ours "
                "(a port alone proves nothing)"
            ]
        if not matched:
            return False, ["matches no rule of ours"]
        stranger = self._not_owner(info)
        if stranger:
            return False, [f"looks like ours ({', '.join(matched + port_reasons)}) but {stranger}"]
        return True, matched + port_reasons

    def _by_scope(self, cgroup_path: str) -> Verdict | None:
        """The verdict the cgroup alone gives, or None when it leaves the question open."""
        container = container_cgroup(cgroup_path)
        if container:
            return False, [f"inside container {container}"]
        unit = owning_unit(cgroup_path)
        uid = login_uid(cgroup_path)
        if uid is not None:
            # A login of an owner (root's ssh session that ran nohup) proves nothing either
            # way; a login of anyone else is theirs, whatever uid the process runs as.
            if uid in self.owner_uids:
                return None
            where = unit or f"user-{uid}.slice"
            return False, [
                f"inside {where} of user {user_name(uid)} (uid {uid}), not an owner user"
            ]
        if unit in self.rules.units:
            return True, [f"unit:{unit}"]
        if unit:
            return False, [f"inside systemd unit {unit}, not one of ours.units"]
        return None

    def _not_owner(self, info: ProcInfo) -> str:
        """Why the process's uids disqualify it, or "" when both are owner uids."""
        if info.uid is None:
            return "its uid could not be read"
        if info.uid not in self.owner_uids:
            return f"runs as {info.user} (uid {info.uid}), not an owner user"
        if info.euid is not None and info.euid not in self.owner_uids:
            name = user_name(info.euid)
            return f"runs with effective uid {info.euid} ({name}), not an owner user"
        return ""


def is_ignored(info: ProcInfo, ignore_names: list[str]) -> bool:
    first = os.path.basename(info.cmdline[0]) if info.cmdline else ""
    return any(name in (info.comm, first) or info.comm == name[:15] for name in ignore_names)


# --------------------------------------------------------------------------- discovery


@dataclass
class Snapshot:
    gpus: list[dict[str, Any]]
    processes: list[dict[str, Any]]
    # Every process listening on a port of ours, GPU holder or not, classified.
    port_holders: list[dict[str, Any]] = field(default_factory=list)
    # {pid: ports of ours it listens on}, for classifying the members of a group to kill.
    listeners: dict[int, set[int]] = field(default_factory=dict)


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
    """A process record. ``starttime`` is the one read here, where the process is classified:
    the kill compares it with the start time read right before each signal."""
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
        "_info": info,
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
    ownership: Ownership,
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
    ports = ownership.rules.ports
    listen = listening_inodes(ports, proc_root) if ports else {}
    held, listeners = scan_fds(device_glob, listen, proc_root)
    for pid, gpus_held in held.items():
        rec = records.get(pid)
        if rec is None:
            rec = records[pid] = _record(pid, read_proc(pid, proc_root))
        rec["sources"].append("device")
        if "nvidia-smi" not in rec["sources"]:
            _add_device_gpus(rec, gpus_held)
    processes = []
    for rec in records.values():
        _classify_record(rec, ownership, ignore_names, listeners.get(rec["pid"], set()))
        rec["gpus"] = sorted(rec["gpus"])
        processes.append(rec)
    processes.sort(key=lambda r: (r["pid"] is None, r["pid"] or 0))
    port_holders = _port_holders(listeners, ownership, proc_root)
    return Snapshot(gpus, processes, port_holders, listeners)


def discover_cpu(
    ownership: Ownership, *, ignore_names: list[str], proc_root: str = PROC
) -> Snapshot:
    """The processes of a CPU server: every process inside one of ours.units (whatever it is:
    SGLang's launcher, scheduler, detokenizer, the multiprocessing resource tracker) and every
    process listening on one of ours.ports, classified. A CPU server holds no device, so there is
    no GPU to scope by: each such process counts as on what the deployment needs."""
    ports = ownership.rules.ports
    listen = listening_inodes(ports, proc_root) if ports else {}
    _, listeners = scan_fds("", listen, proc_root)
    records: dict[Any, dict[str, Any]] = {}
    for pid in sorted(list_pids(proc_root)):
        info = read_proc(pid, proc_root)
        if info is None or info.state in ("Z", "X"):
            continue
        unit = owning_unit(relative_cgroup(info.cgroup, ownership.own_container))
        sources = (["unit"] if unit in ownership.rules.units else []) + (
            ["port"] if pid in listeners else []
        )
        if sources:
            rec = records[pid] = _record(pid, info)
            rec["any_gpu"] = True
            rec["sources"] = sources
    processes = []
    for rec in records.values():
        _classify_record(rec, ownership, ignore_names, listeners.get(rec["pid"], set()))
        rec["gpus"] = []
        processes.append(rec)
    return Snapshot([], processes, _port_holders(listeners, ownership, proc_root), listeners)


def _classify_record(
    rec: dict[str, Any], ownership: Ownership, ignore_names: list[str], ports: set[int]
) -> None:
    info = rec["_info"]
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
    rec["ours"], rec["reasons"] = ownership.classify(info, ports)


def _port_holders(
    listeners: dict[int, set[int]], ownership: Ownership, proc_root: str
) -> list[dict[str, Any]]:
    holders = []
    for pid, ports in sorted(listeners.items()):
        info = read_proc(pid, proc_root)
        if info is None:
            continue
        ours, reasons = ownership.classify(info, ports)
        holders.append(
            {
                "pid": pid,
                "pgid": info.pgid,
                "user": info.user,
                "uid": info.uid,
                "cmdline": " ".join(info.cmdline) or info.comm,
                "cgroup": info.cgroup,
                "ports": sorted(ports),
                "ours": ours,
                "reasons": reasons,
            }
        )
    return holders


# --------------------------------------------------------------------------- decision


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
        "pids": [pid for pid, _, _ in chosen],
        "starttimes": [start for _, start, _ in chosen],
        "commands": [command[:COMMAND_WIDTH] for _, _, command in chosen],
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


# --------------------------------------------------------------------------- killing


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
        entry["pids"] = [pid for pid, _ in sent]
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
        entry["survived"] = [pid for pid, _ in _survivors(left, proc_root)]
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
    return {k: v for k, v in rec.items() if k not in ("starttime", "visible", "_info")}


def cleanup(
    params: dict[str, Any],
    check_mode: bool,
    runner: Runner = run_command,
    proc_root: str = PROC,
) -> tuple[bool, dict[str, Any]]:
    """Do the whole job. Returns (failed, result); result carries msg and changed.

    Raises NvidiaSmiError when nvidia-smi cannot be used, OwnerError for an unknown owner user.
    """
    rules = OursRules.from_params(params.get("ours"))
    ownership = Ownership(
        rules, resolve_owner_uids(rules.users), container_root(own_cgroup(proc_root))
    )
    ignore = list(params.get("ignore_names") or [])
    on_cpu = params.get("accelerator") == "cpu"
    if on_cpu and params.get("gpus"):
        raise OwnerError(
            f"gpus: {params['gpus']} given with accelerator cpu; a server on SGLang's CPU engine "
            "holds no GPU (leave gpus empty)"
        )

    def snap() -> Snapshot:
        if on_cpu:
            return discover_cpu(ownership, ignore_names=ignore, proc_root=proc_root)
        return discover(
            params["nvidia_smi"],
            params["device_glob"],
            ownership,
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
        "accelerator": "cpu" if on_cpu else "gpu",
        "needed_gpus": sorted(needed),
        "owner_uids": sorted(ownership.owner_uids),
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
        before,
        needed,
        allow_kill_foreign=params["allow_kill_foreign"],
        ownership=ownership,
        protected=protected_pids(proc_root),
        proc_root=proc_root,
    )
    result["processes"] = [public(p) for p in before.processes if not p["ignored"]]
    result["ignored"] = [public(p) for p in before.processes if p["ignored"]]
    result["port_holders"] = before.port_holders
    result["blockers"] = [public(p) for p in plan.blockers]
    result["table"] = format_table(plan.blockers) if plan.blockers else ""
    result["would_kill"] = [
        {k: g[k] for k in ("pgid", "pids", "commands", "spared")} for g in plan.kill_groups
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
            + "\nWhy each one is not ours (docs/GPU-CLEANUP.md):\n"
            + format_reasons(plan.blockers)
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
    result["warnings"] += [
        f"pid {s['pid']} skipped: {s['reason']}" for k in result["killed"] for s in k["skipped"]
    ]
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
    result["changed"] = bool(
        result["stopped_units"] or any(k["pids"] for k in result["killed"]) or result["reset_gpus"]
    )
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
    """The needed GPUs as the messages name them; none for a CPU server."""
    listed = ",".join(str(g) for g in sorted(gpus))
    return listed or "(none: CPU server)"


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
    skipped = [s["pid"] for k in result["killed"] for s in k["skipped"]]
    if skipped:
        did = f"{did}; skipped pids {skipped} (pid reused since classified)"
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
    "accelerator": {"type": "str", "choices": ["gpu", "cpu"], "default": "gpu"},
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
            "users": {"type": "list", "elements": "str", "default": ["root"]},
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
    except (NvidiaSmiError, OwnerError) as exc:
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
