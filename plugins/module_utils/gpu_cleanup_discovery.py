"""gpu_cleanup's discovery: every process holding a needed GPU (or, for a CPU server, every
process of the service), merged from nvidia-smi and the device files and ports held, classified
by the ownership rules. Reads only. Standard library only: it runs on GPU hosts.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.sglang_fleet.fleet.plugins.module_utils.gpu_cleanup_ownership import (
    Ownership,
    is_ignored,
    owning_unit,
    relative_cgroup,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.nvidia_smi import (
    NvidiaSmiError,
    apps_query_argv,
    check_result,
    gpu_query_argv,
    parse_compute_apps,
    parse_gpus,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.procfs import (
    PROC,
    ProcInfo,
    fd_targets,
    list_pids,
    listening_inodes,
    read_proc,
    socket_inodes,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.timed_command import Runner

_NUMBERED_DEVICE = re.compile(r"nvidia(\d+)")  # fullmatch: `$` takes a trailing newline


def device_gpu(target: str, device_glob: str) -> int | str | None:
    """GPU index for a device-file fd target: N for nvidiaN, "any" for other matches."""
    if not fnmatch.fnmatchcase(target, device_glob):
        return None
    numbered = _NUMBERED_DEVICE.fullmatch(os.path.basename(target))
    return int(numbered.group(1)) if numbered else "any"


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
    _held, listeners = scan_fds("", listen, proc_root)
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


def port_holders(ownership: Ownership, proc_root: str = PROC) -> list[dict[str, Any]]:
    """Who listens on ownership.rules.ports, each classified by the cleanup's rules (ours or
    not, and why), without reading any GPU: what a pre-flight needs to know before a start."""
    ports = ownership.rules.ports
    listen = listening_inodes(ports, proc_root) if ports else {}
    _held, listeners = scan_fds("", listen, proc_root)
    return _port_holders(listeners, ownership, proc_root)
