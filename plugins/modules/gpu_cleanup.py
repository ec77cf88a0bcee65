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
author: sglang-fleet maintainers (@sglang-fleet)
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
  sglang_fleet.fleet.gpu_cleanup:
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
  sglang_fleet.fleet.gpu_cleanup:
    state: inspect
  register: gpu_holders

- name: Against the GPU-less test double
  sglang_fleet.fleet.gpu_cleanup:
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

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.gpu_cleanup_discovery import (
    Snapshot,
    discover,
    discover_cpu,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.gpu_cleanup_gate import (
    GateResult,
    evaluate,
    reset_gpus,
    wait_clear,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.gpu_cleanup_kill import (
    active_units,
    stop_units,
    terminate,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.gpu_cleanup_ownership import (
    OursRules,
    OwnerError,
    Ownership,
    container_root,
    resolve_owner_uids,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.gpu_cleanup_plan import (
    Plan,
    decide,
    format_reasons,
    format_table,
    protected_pids,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.nvidia_smi import NvidiaSmiError
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.procfs import PROC, own_cgroup
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.timed_command import (
    Runner,
    run_command,
)


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
