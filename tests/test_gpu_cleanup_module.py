"""Tests for plugins/modules/gpu_cleanup.py, its parts (plugins/module_utils/gpu_cleanup_*.py,
procfs.py) and plugins/module_utils/nvidia_smi.py.

Parsing is tested on real nvidia-smi output (tests/fixtures/nvidia_smi/, sources in SOURCES.md),
classification and the kill decision on fake /proc trees built from real /proc samples
(tests/fixtures/proc/, sources in SOURCES.md), killing on real process groups, and the packaged
module once through ansible-playbook. The ownership rules under test are in docs/GPU-CLEANUP.md.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import load_plugin

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "nvidia_smi"
PROC_FIXTURES = ROOT / "tests" / "fixtures" / "proc"


# The module imports its parts as Ansible packages them (ansible.module_utils.<name>): the
# nvidia-smi parser, /proc reading, then one file per job of the cleanup.
nvsmi = load_plugin("plugins/module_utils/nvidia_smi.py")
gc_procfs = load_plugin("plugins/module_utils/procfs.py")
gc_command = load_plugin("plugins/module_utils/timed_command.py")
gc_ownership = load_plugin("plugins/module_utils/gpu_cleanup_ownership.py")
gc_discovery = load_plugin("plugins/module_utils/gpu_cleanup_discovery.py")
gc_plan = load_plugin("plugins/module_utils/gpu_cleanup_plan.py")
gc_kill = load_plugin("plugins/module_utils/gpu_cleanup_kill.py")
gc_gate = load_plugin("plugins/module_utils/gpu_cleanup_gate.py")
gc = load_plugin("plugins/modules/gpu_cleanup.py")

# Fake pids beyond any kernel's pid_max (2**22), so they never collide with real ones.
BASE = 9_000_000
GPU_UUIDS = [f"GPU-0000000{i}-aaaa-bbbb-cccc-00000000000{i}" for i in range(4)]


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def proc_fixture(name: str) -> str:
    return (PROC_FIXTURES / name).read_text(encoding="utf-8")


def cgroup_fixture(name: str) -> str:
    return proc_fixture(f"cgroup/{name}.txt")


# --------------------------------------------------------------------------- nvidia-smi parsing


def test_query_gpu_noheader_nounits_real_output() -> None:
    fields = [
        "index",
        "uuid",
        "name",
        "temperature.gpu",
        "utilization.gpu",
        "memory.used",
        "memory.total",
    ]
    rows = nvsmi.parse_csv(fixture("query_gpu_noheader_nounits_titanx.txt"), fields)
    assert [r["index"] for r in rows] == list(range(8))
    assert rows[0]["uuid"] == "GPU-004f693d-767b-b215-b4a9-a18af0ffd643"
    assert rows[0]["name"] == "GeForce GTX TITAN X"
    assert [r["memory.used"] for r in rows[:2]] == [802, 10032]
    assert rows[7]["memory.total"] == 12206


def test_compute_apps_with_header_and_units_real_output() -> None:
    fields = ["gpu_uuid", "pid", "process_name", "used_gpu_memory"]
    rows = nvsmi.parse_csv(fixture("compute_apps_header_units_h200.txt"), fields)
    assert [r["pid"] for r in rows] == [10525, 10529, 10526, 10528, 10550]
    assert [r["used_gpu_memory"] for r in rows] == [1542, 818, 818, 818, 14410]
    assert rows[1]["process_name"] == "/root/tools/memhög ünïcode"
    assert rows[2]["process_name"] == "/root/tools/mem? hog"
    assert rows[3]["process_name"] == '/root/tools/mem "q" hog'


def test_header_alias_used_memory_matches_used_gpu_memory_header() -> None:
    # We ask for `used_memory`; nvidia-smi titles that column `used_gpu_memory [MiB]`.
    fields = ["gpu_uuid", "pid", "process_name", "used_memory"]
    rows = nvsmi.parse_csv(fixture("compute_apps_header_units_h200.txt"), fields)
    assert len(rows) == 5
    assert rows[4]["used_memory"] == 14410


@pytest.mark.parametrize(
    "name", ["compute_apps_header_only.txt", "compute_apps_noheader_nounits_empty.txt"]
)
def test_no_processes_forms(name: str) -> None:
    fields = ["gpu_uuid", "pid", "process_name", "used_gpu_memory"]
    assert nvsmi.parse_csv(fixture(name), fields) == []


def test_na_memory_is_unknown_not_zero() -> None:
    fields = ["gpu_uuid", "pid", "process_name", "used_gpu_memory"]
    (row,) = nvsmi.parse_csv(fixture("compute_apps_wddm_na.txt"), fields)
    assert row["pid"] == 2056
    assert row["process_name"] == "C:\\Windows\\System32\\dwm.exe"
    assert row["used_gpu_memory"] is None


def test_insufficient_permissions_row_keeps_a_hidden_process() -> None:
    fields = ["gpu_uuid", "pid", "process_name", "used_gpu_memory"]
    (row,) = nvsmi.parse_csv(fixture("compute_apps_mig_insufficient_permissions.txt"), fields)
    assert row == {
        "gpu_uuid": "GPU-ae3738d5-9aa2-e1c9-53be-65b6d373d3d9",
        "pid": None,
        "process_name": None,
        "used_gpu_memory": None,
    }


def test_parse_gpus_and_apps_in_the_module_query_order() -> None:
    gpus = nvsmi.parse_gpus(
        "index, uuid, name, memory.used [MiB], memory.total [MiB]\n"
        f"0, {GPU_UUIDS[0]}, NVIDIA H200, 130013 MiB, 143771 MiB\n"
        f"1, {GPU_UUIDS[1]}, NVIDIA H200, [N/A], 143771 MiB\n"
    )
    assert gpus[0] == {
        "index": 0,
        "uuid": GPU_UUIDS[0],
        "name": "NVIDIA H200",
        "memory_used_mib": 130013,
        "memory_total_mib": 143771,
    }
    assert gpus[1]["memory_used_mib"] is None
    apps = nvsmi.parse_compute_apps(
        f"1460, {GPU_UUIDS[1]}, [Insufficient Permissions], [N/A]\n"
        f"9001, {GPU_UUIDS[0]}, /usr/bin/python3, 17000\n"
        "42, GPU-not-listed, /root/tools/mem, hog, 818\n",
        {GPU_UUIDS[0]: 0, GPU_UUIDS[1]: 1},
    )
    assert [(a["pid"], a["gpu_index"], a["used_mib"]) for a in apps] == [
        (1460, 1, None),
        (9001, 0, 17000),
        (42, None, 818),
    ]
    assert apps[0]["process_name"] is None
    assert apps[2]["process_name"] == "/root/tools/mem, hog"


def test_row_with_missing_columns_fails_loudly() -> None:
    with pytest.raises(nvsmi.NvidiaSmiError, match="unexpected nvidia-smi line"):
        nvsmi.parse_csv("0, GPU-x\n", nvsmi.GPU_FIELDS)


@pytest.mark.parametrize(
    ("name", "rc", "reason"),
    [
        ("driver_not_loaded.txt", 9, "cannot communicate with the NVIDIA driver"),
        ("nvml_version_mismatch.txt", 18, "differ in version"),
    ],
)
def test_driver_failures_are_explained(name: str, rc: int, reason: str) -> None:
    argv = nvsmi.gpu_query_argv("nvidia-smi")
    with pytest.raises(nvsmi.NvidiaSmiError, match=reason) as err:
        nvsmi.check_result(argv, rc, fixture(name), "")
    assert "--query-gpu=index,uuid,name,memory.used,memory.total" in str(err.value)


def test_successful_result_passes_through() -> None:
    assert nvsmi.check_result(["nvidia-smi"], 0, "0, a\n", "") == "0, a\n"


def test_missing_binary_is_reported_as_such() -> None:
    def runner(argv: list[str], timeout: float) -> tuple[int, str, str]:
        return gc_command.run_command(["/nonexistent/nvidia-smi", *argv[1:]], timeout)

    with pytest.raises(nvsmi.NvidiaSmiError, match="nvidia-smi not found"):
        gc_discovery.query_gpus("/nonexistent/nvidia-smi", runner)


# ------------------------------------------------ cgroup paths (parsers: tests/test_procfs.py)


@pytest.mark.parametrize(
    ("path", "unit"),
    [
        ("/system.slice/sglang.service", "sglang.service"),
        ("/system.slice/sglang.service/payload", "sglang.service"),
        ("/user.slice/user-1000.slice/session-3.scope", "session-3.scope"),
        ("/user.slice/user-1000.slice/user@1000.service/tmux-spawn-1.scope", "tmux-spawn-1.scope"),
        ("/", None),
    ],
)
def test_owning_unit_is_the_innermost_unit(path: str, unit: str | None) -> None:
    assert gc_ownership.owning_unit(path) == unit


# Each container runtime's cgroup as /proc/PID/cgroup shows it from the host: the part of the
# path that marks the container.
CONTAINER_LAYOUTS = {
    "docker_systemd_v2": "docker-",
    "docker_cgroupfs_v1": "docker/",
    "kubepods_cri_containerd_v1": "kubepods.slice/",
    "kubepods_crio_v2": "kubepods.slice/",
    "kubepods_cgroupfs_v1": "kubepods/",
    "podman_v2": "machine.slice/libpod-",
    "podman_rootless_root_v2": "libpod-",
    "lxc_v2": "lxc.payload.trainer/",
    "nspawn_v2": "machine.slice/machine-trainer.scope",
}


# The Molecule test host: a Docker container (cgroupfs driver, cgroup v1 hybrid, host cgroup
# namespace) running systemd. Captured there: a process started by `docker exec` (as Ansible's
# modules are) and one of a systemd unit.
TESTHOST_ROOT = gc_ownership.container_root(
    gc_procfs.parse_cgroup(cgroup_fixture("testhost_exec_v1"))
)


@pytest.mark.parametrize(("name", "marker"), sorted(CONTAINER_LAYOUTS.items()))
def test_container_cgroups_are_recognised(name: str, marker: str) -> None:
    path = gc_procfs.parse_cgroup(cgroup_fixture(name))
    container = gc_ownership.container_cgroup(path)
    assert container is not None and container.startswith(marker), container


@pytest.mark.parametrize(
    "name",
    [
        "session_root_v2",
        "session_other_user_v2",
        "run_scope_v2",
        "our_unit_v2",
        "other_unit_v2",
        "testhost_exec_v1",
        "testhost_unit_v1",
    ],
)
def test_host_cgroups_are_no_container(name: str) -> None:
    path = gc_ownership.relative_cgroup(gc_procfs.parse_cgroup(cgroup_fixture(name)), TESTHOST_ROOT)
    assert gc_ownership.container_cgroup(path) is None


@pytest.mark.parametrize(
    ("path", "root"),
    [
        ("/docker/abc", "/docker/abc"),
        ("/docker/abc/system.slice/ansible.service", "/docker/abc"),
        ("/docker/abc/docker/def", "/docker/abc/docker/def"),
        ("/system.slice/docker-abc.scope/system.slice/x.service", "/system.slice/docker-abc.scope"),
        ("/machine.slice/libpod-abc.scope/container", "/machine.slice/libpod-abc.scope"),
        ("/kubepods/besteffort/pod1a-2b/c0ffee", "/kubepods/besteffort/pod1a-2b/c0ffee"),
        ("/lxc.payload.trainer/system.slice/trainer.service", "/lxc.payload.trainer"),
        ("/user.slice/user-0.slice/session-7.scope", ""),
        ("/", ""),
        ("", ""),
    ],
)
def test_container_root_of_the_modules_own_cgroup(path: str, root: str) -> None:
    assert gc_ownership.container_root(path) == root


def test_relative_cgroup_only_strips_a_whole_prefix() -> None:
    assert gc_ownership.relative_cgroup("/docker/abc/system.slice/x.service", "/docker/abc") == (
        "/system.slice/x.service"
    )
    assert gc_ownership.relative_cgroup("/docker/abc", "/docker/abc") == "/"
    assert gc_ownership.relative_cgroup("/docker/abcd", "/docker/abc") == "/docker/abcd"
    assert gc_ownership.relative_cgroup("/docker/abc", "") == "/docker/abc"


@pytest.mark.parametrize(
    ("path", "uid"),
    [
        ("/user.slice/user-1000.slice/session-3.scope", 1000),
        ("/user.slice/user-0.slice/user@0.service/app.slice/tmux-spawn-1.scope", 0),
        ("/system.slice/sshd.service", None),
    ],
)
def test_login_uid_from_the_user_slice(path: str, uid: int | None) -> None:
    assert gc_ownership.login_uid(path) == uid


TCP = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout "
    "inode\n"
    "   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 "
    "55501 1 0000000000000000 100 0 0 10 0\n"
    "   1: 0100007F:1F40 0100007F:D2A4 01 00000000:00000000 00:00000000 00000000  1000        0 "
    "55502 1 0000000000000000 20 4 30 10 -1\n"
    "   2: 00000000:07E8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 "
    "1605 1 0000000000000000 100 0 0 10 0\n"
)


def test_listen_inodes_only_for_listening_sockets_on_wanted_ports() -> None:
    assert gc_procfs.parse_listen_inodes(TCP, [8000]) == {55501}
    assert gc_procfs.parse_listen_inodes(TCP, [8000, 2024]) == {55501, 1605}
    assert gc_procfs.parse_listen_inodes(TCP, [9999]) == set()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["python3", "-m", "sglang.launch_server", "--port", "8000"], True),
        (["python3", "-msglang.launch_server"], True),
        (["python3", "-m", "sglang.bench_serving"], False),
        (["python3", "train.py", "--note", "-m sglang.launch_server"], False),
    ],
)
def test_runs_module(argv: list[str], expected: bool) -> None:
    assert gc_ownership.runs_module(argv, "sglang.launch_server") is expected


# --------------------------------------------------------------------------- fake /proc trees


# root's ssh login, where a hand-started server (nohup) lives.
ROOT_SESSION = "/user.slice/user-0.slice/session-3.scope"


class FakeProc:
    """A /proc look-alike: stat, status, cmdline, comm, cgroup and fd links per pid.

    ``status`` and ``cgroup_text`` take whole files (real samples from tests/fixtures/proc/);
    otherwise a process runs as ``uid`` (real and effective) in the cgroup path ``cgroup``.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "net").mkdir(parents=True)
        (root / "net" / "tcp").write_text(TCP.splitlines()[0] + "\n")
        (root / "net" / "tcp6").write_text(TCP.splitlines()[0] + "\n")

    def add(
        self,
        pid: int,
        cmdline: list[str],
        *,
        pgid: int | None = None,
        uid: int = 0,
        status: str | None = None,
        cgroup: str = ROOT_SESSION,
        cgroup_text: str | None = None,
        fds: list[str] = (),
        comm: str | None = None,
        starttime: int = 500,
    ) -> None:
        d = self.root / str(pid)
        (d / "fd").mkdir(parents=True)
        comm = comm or os.path.basename(cmdline[0])[:15]
        self.set_start(pid, starttime, comm=comm, pgid=pgid or pid)
        (d / "status").write_text(status or f"Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        (d / "cmdline").write_text("\0".join(cmdline) + "\0")
        (d / "comm").write_text(comm + "\n")
        (d / "cgroup").write_text(cgroup_text or f"0::{cgroup}\n")
        for n, target in enumerate(fds):
            os.symlink(target, d / "fd" / str(n))

    def set_start(self, pid: int, starttime: int, *, comm: str, pgid: int) -> None:
        """Write pid's stat; a new start time is what a reused pid looks like."""
        rest = " ".join(["0"] * 13)
        stat = f"{pid} ({comm}) S 1 {pgid} {pgid} 0 -1 {rest} {starttime} 0"
        (self.root / str(pid) / "stat").write_text(stat)


def smi_runner(gpus: int = 4, used: dict[int, int] | None = None, apps: str = "") -> Any:
    """A runner that answers nvidia-smi queries the way the real one prints them."""
    used = used or {}

    def runner(argv: list[str], timeout: float) -> tuple[int, str, str]:
        if argv[1].startswith("--query-gpu"):
            lines = [
                f"{i}, {GPU_UUIDS[i]}, NVIDIA RTX PRO 6000, {used.get(i, 3)}, 97887"
                for i in range(gpus)
            ]
            return 0, "\n".join(lines) + "\n", ""
        if argv[1].startswith("--query-compute-apps"):
            return 0, apps, ""
        if argv[:2] == ["systemctl", "is-active"]:
            return 3, "inactive\n", ""
        raise AssertionError(f"unexpected command {argv}")

    return runner


RULES = gc_ownership.OursRules.from_params(
    {
        "units": ["sglang-a"],
        "process_titles": ["sglang::"],
        "launch_modules": ["sglang.launch_server"],
        "ports": [8000],
    }
)
IGNORE = ["nvidia-persistenced", "nvidia-smi"]
# Owners: root and a service user with uid 998 (user names are resolved in cleanup()).
SERVICE_UID = 998
OWNERSHIP = gc_ownership.Ownership(RULES, {0, SERVICE_UID})


@pytest.fixture
def fake(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def _host(fake: FakeProc) -> None:
    """Orphaned ranks of a server root started by hand, a foreign job, another server, a daemon.

    The server's process group is the shell that launched it: the shell, SGLang's launcher, the
    ranks, and a `sleep` the shell also started.
    """
    shell = BASE + 100
    fake.add(shell, ["bash", "run.sh"], pgid=shell)
    fake.add(BASE + 101, ["sglang::scheduler_TP0"], pgid=shell, fds=["/dev/nvidia0"])
    fake.add(BASE + 102, ["sglang::scheduler_TP1"], pgid=shell, fds=["/dev/nvidia1"])
    fake.add(BASE + 103, ["python3", "-m", "sglang.launch_server", "--tp", "2"], pgid=shell)
    fake.add(BASE + 104, ["sleep", "600"], pgid=shell)
    fake.add(BASE + 200, ["python3", "train.py"], uid=4242, fds=["/dev/nvidia3", "/dev/nvidiactl"])
    fake.add(
        BASE + 300,
        ["sglang::scheduler_TP0"],
        cgroup="/system.slice/sglang-b.service",
        fds=["/dev/nvidia2"],
    )
    fake.add(
        BASE + 400, ["/usr/bin/nvidia-persistenced"], fds=[f"/dev/nvidia{i}" for i in range(4)]
    )
    fake.add(BASE + 500, ["python3", "-c", "x"], cgroup="/system.slice/sglang-a.service")


def _snapshot(fake: FakeProc, apps: str = "", ownership: Any = OWNERSHIP) -> Any:
    return gc_discovery.discover(
        "nvidia-smi",
        "/dev/nvidia*",
        ownership,
        ignore_names=IGNORE,
        runner=smi_runner(apps=apps),
        proc_root=str(fake.root),
    )


def _by_pid(processes: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {p["pid"]: p for p in processes}


def test_discovery_merges_nvidia_smi_and_device_holders(fake: FakeProc) -> None:
    _host(fake)
    apps = f"{BASE + 101}, {GPU_UUIDS[0]}, python3, 81234\n{BASE + 500}, {GPU_UUIDS[1]}, x, 9\n"
    procs = _by_pid(_snapshot(fake, apps).processes)
    assert procs[BASE + 101]["sources"] == ["nvidia-smi", "device"]
    assert procs[BASE + 101]["used_mib"] == 81234
    assert procs[BASE + 101]["gpus"] == [0]
    # nvidiactl comes with every CUDA process: the numbered device says which GPU.
    assert procs[BASE + 200]["gpus"] == [3] and procs[BASE + 200]["any_gpu"] is False
    assert procs[BASE + 200]["user"] == "4242"
    assert procs[BASE + 500]["sources"] == ["nvidia-smi"]
    assert BASE + 100 not in procs  # the launcher holds no GPU


def test_classification_reasons(fake: FakeProc) -> None:
    _host(fake)
    apps = f"{BASE + 500}, {GPU_UUIDS[1]}, x, 9\n"
    procs = _by_pid(_snapshot(fake, apps).processes)
    assert procs[BASE + 101]["ours"] and procs[BASE + 101]["reasons"] == ["process_title:sglang::"]
    assert procs[BASE + 500]["reasons"] == ["unit:sglang-a.service"]
    assert procs[BASE + 300]["ours"] is False
    assert procs[BASE + 300]["reasons"] == [
        "inside systemd unit sglang-b.service, not one of ours.units"
    ]
    assert procs[BASE + 200]["reasons"] == ["matches no rule of ours"]
    assert procs[BASE + 400]["ignored"] is True


def test_port_and_launch_module_rules(fake: FakeProc) -> None:
    fake.add(BASE + 600, ["sglang::scheduler_TP0"], fds=["/dev/nvidia0", "socket:[55501]"])
    fake.add(BASE + 601, ["python3", "-m", "sglang.launch_server"], fds=["/dev/nvidia0"])
    (fake.root / "net" / "tcp").write_text(TCP)
    snap = _snapshot(fake)
    procs = _by_pid(snap.processes)
    assert procs[BASE + 600]["reasons"] == ["process_title:sglang::", "port:8000"]
    assert procs[BASE + 601]["reasons"] == ["launch_module:sglang.launch_server"]
    assert [(h["pid"], h["ports"], h["ours"]) for h in snap.port_holders] == [
        (BASE + 600, [8000], True)
    ]


def test_a_port_alone_never_makes_a_process_ours(fake: FakeProc) -> None:
    # Root's own program on our port, holding a GPU, but neither titled nor launched like SGLang.
    fake.add(BASE + 600, ["python3", "serve.py"], fds=["/dev/nvidia0", "socket:[55501]"])
    (fake.root / "net" / "tcp").write_text(TCP)
    snap, plan = _decide(fake, {0})
    (proc,) = snap.processes
    assert proc["ours"] is False and proc["action"] == "block"
    assert proc["reasons"] == [
        "listens on port 8000 of ours but has no title or launch module of ours "
        "(a port alone proves nothing)"
    ]
    assert [b["pid"] for b in plan.blockers] == [BASE + 600] and plan.kill_groups == []
    assert snap.port_holders[0]["ours"] is False


# --------------------------------------------------------------------------- who is ours


def _one(fake: FakeProc, pid: int, needed: set[int] = frozenset({0}), **kwargs: Any) -> Any:
    """The decision about one GPU holder: (record, plan)."""
    snap, plan = _decide(fake, set(needed), **kwargs)
    return _by_pid(snap.processes)[pid], plan


def test_another_users_hand_started_sglang_blocks(fake: FakeProc) -> None:
    # nobody started an SGLang by hand (runuser) from root's ssh login: titled, on our port.
    fake.add(
        BASE + 700,
        ["sglang::scheduler_TP0"],
        status=proc_fixture("status/nobody.txt"),
        fds=["/dev/nvidia0", "socket:[55501]"],
    )
    (fake.root / "net" / "tcp").write_text(TCP)
    rec, plan = _one(fake, BASE + 700)
    assert (rec["ours"], rec["action"], rec["uid"], rec["user"]) == (
        False, "block", 65534, "nobody",
    )  # fmt: skip
    assert rec["reasons"] == [
        "looks like ours (process_title:sglang::, port:8000) but runs as nobody (uid 65534), "
        "not an owner user"
    ]
    assert plan.kill_groups == []


def test_effective_uid_must_be_an_owner_too(fake: FakeProc) -> None:
    fake.add(
        BASE + 701,
        ["sglang::scheduler_TP0"],
        status=proc_fixture("status/real_root_effective_nobody.txt"),
        fds=["/dev/nvidia0"],
    )
    rec, _ = _one(fake, BASE + 701)
    assert rec["action"] == "block"
    assert rec["reasons"][0].endswith(
        "but runs with effective uid 65534 (nobody), not an owner user"
    )


@pytest.mark.parametrize(
    ("uid", "cgroup"),
    [
        (0, ROOT_SESSION),  # root's nohup from an ssh login
        (0, "/"),  # a session-less start (setsid from a container's exec)
        (SERVICE_UID, ROOT_SESSION),  # the service user's rank, started by root with runuser
        (0, "/user.slice/user-0.slice/user@0.service/app.slice/tmux-spawn-1.scope"),
    ],
)
def test_orphans_of_owner_users_are_killed(fake: FakeProc, uid: int, cgroup: str) -> None:
    fake.add(BASE + 702, ["sglang::scheduler_TP0"], uid=uid, cgroup=cgroup, fds=["/dev/nvidia0"])
    rec, plan = _one(fake, BASE + 702)
    assert (rec["ours"], rec["action"], rec["reasons"]) == (
        True, "kill", ["process_title:sglang::"],
    )  # fmt: skip
    assert plan.kill_groups[0]["pids"] == [BASE + 702]


@pytest.mark.parametrize("layout", sorted(CONTAINER_LAYOUTS))
def test_sglang_inside_a_container_blocks(fake: FakeProc, layout: str) -> None:
    # Root's SGLang in a container: same title and uid as ours, but not ours to kill.
    text = cgroup_fixture(layout)
    fake.add(BASE + 703, ["sglang::scheduler_TP0"], cgroup_text=text, fds=["/dev/nvidia0"])
    rec, plan = _one(fake, BASE + 703)
    assert (rec["ours"], rec["action"]) == (False, "block")
    assert rec["reasons"] == [
        f"inside container {gc_ownership.container_cgroup(gc_procfs.parse_cgroup(text))}"
    ]
    assert plan.kill_groups == []


@pytest.mark.parametrize(
    ("layout", "reason"),
    [
        (
            "run_scope_v2",
            "inside systemd unit run-r3c1f0e9b2a4d4e6f8a0b1c2d3e4f5a6b.scope, "
            "not one of ours.units",
        ),
        (
            "session_other_user_v2",
            f"inside session-3.scope of user {gc_procfs.user_name(1000)} (uid 1000), "
            "not an owner user",
        ),
        (
            "other_unit_v2",
            "inside systemd unit sglang@other.service, not one of ours.units",
        ),
    ],
)
def test_sglang_in_someone_elses_unit_or_login_blocks(
    fake: FakeProc, layout: str, reason: str
) -> None:
    # Runs as root and is titled like ours, so only the scope tells it apart.
    text = cgroup_fixture(layout)
    fake.add(BASE + 704, ["sglang::scheduler_TP0"], cgroup_text=text, fds=["/dev/nvidia0"])
    rec, _ = _one(fake, BASE + 704)
    assert (rec["ours"], rec["action"], rec["reasons"]) == (False, "block", [reason])


def test_a_unit_of_ours_proves_ownership_whatever_the_uid(fake: FakeProc) -> None:
    rules = gc_ownership.OursRules.from_params(
        {"units": ["sglang@kimi"], "process_titles": ["sglang::"]}
    )
    ownership = gc_ownership.Ownership(rules, {0})
    fake.add(
        BASE + 705,
        ["sglang::scheduler_TP0"],
        uid=SERVICE_UID,
        cgroup_text=cgroup_fixture("our_unit_v2"),
        fds=["/dev/nvidia0"],
    )
    rec, _ = _one(fake, BASE + 705, ownership=ownership)
    assert (rec["ours"], rec["reasons"]) == (True, ["unit:sglang@kimi.service"])


def test_a_container_of_the_same_unit_name_is_not_ours(fake: FakeProc) -> None:
    rules = gc_ownership.OursRules.from_params({"units": ["sglang@kimi"]})
    path = "/system.slice/docker-0a1b.scope/system.slice/system-sglang.slice/sglang@kimi.service"
    fake.add(BASE + 706, ["sglang::scheduler_TP0"], cgroup=path, fds=["/dev/nvidia0"])
    rec, _ = _one(fake, BASE + 706, ownership=gc_ownership.Ownership(rules, {0}))
    assert rec["action"] == "block"
    assert rec["reasons"] == [
        "inside container docker-0a1b.scope/system.slice/system-sglang.slice/sglang@kimi.service"
    ]


def test_run_inside_a_container_the_module_judges_that_containers_processes(
    fake: FakeProc,
) -> None:
    # As on the Molecule test host: the module, the orphans and the units share one container;
    # another container on the same machine stays foreign.
    exec_text, unit_text = (cgroup_fixture(f"testhost_{n}_v1") for n in ("exec", "unit"))
    rules = gc_ownership.OursRules.from_params(
        {"units": ["sglang@kimi"], "process_titles": ["sglang::"]}
    )
    ownership = gc_ownership.Ownership(rules, {0}, own_container=TESTHOST_ROOT)
    fake.add(BASE + 707, ["sglang::scheduler_TP0"], cgroup_text=exec_text, fds=["/dev/nvidia0"])
    fake.add(BASE + 708, ["sglang::scheduler_TP1"], cgroup_text=unit_text, fds=["/dev/nvidia1"])
    fake.add(BASE + 709, ["sglang::scheduler_TP0"], cgroup="/docker/f00d", fds=["/dev/nvidia1"])
    snap, plan = _decide(fake, {0, 1}, ownership=ownership)
    procs = _by_pid(snap.processes)
    assert procs[BASE + 707]["reasons"] == ["process_title:sglang::"]
    assert procs[BASE + 708]["reasons"] == ["unit:sglang@kimi.service"]
    assert procs[BASE + 709]["reasons"] == ["inside container docker/f00d"]
    assert [b["pid"] for b in plan.blockers] == [BASE + 709]
    # Seen from the machine running Docker, all three are inside containers.
    snap, _ = _decide(fake, {0, 1}, ownership=gc_ownership.Ownership(rules, {0}))
    assert all(p["reasons"][0].startswith("inside container docker/") for p in snap.processes)


def test_owner_users_resolve_names_and_uids() -> None:
    assert gc_ownership.resolve_owner_uids(["root", "65534", 7]) == {0, 65534, 7}
    with pytest.raises(gc_ownership.OwnerError, match=r"ours\.users: no user 'no-such-user-x'"):
        gc_ownership.resolve_owner_uids(["root", "no-such-user-x"])


def test_unknown_owner_user_fails_before_anything_is_looked_at(fake: FakeProc) -> None:
    params = _params(gpus=[0])
    params["ours"] = {**params["ours"], "users": ["root", "sglnag"]}
    with pytest.raises(gc_ownership.OwnerError, match="sglnag"):
        gc.cleanup(params, False, smi_runner(), str(fake.root))


def test_owner_users_default_to_root() -> None:
    assert gc_ownership.OursRules.from_params({}).users == ["root"]
    assert gc_ownership.OursRules.from_params({"users": []}).users == []


def _decide(
    fake: FakeProc,
    needed: set[int],
    *,
    allow: bool = False,
    apps: str = "",
    protected: set[int] = frozenset({0, 1}),
    ownership: Any = OWNERSHIP,
) -> Any:
    snap = _snapshot(fake, apps, ownership)
    plan = gc_plan.decide(
        snap,
        needed,
        allow_kill_foreign=allow,
        ownership=ownership,
        protected=set(protected),
        proc_root=str(fake.root),
    )
    return snap, plan


def test_decision_kills_ours_on_needed_gpus_only(fake: FakeProc) -> None:
    _host(fake)
    snap, plan = _decide(fake, {0, 1})
    actions = {p["pid"]: p["action"] for p in snap.processes}
    assert actions == {
        BASE + 101: "kill",
        BASE + 102: "kill",
        BASE + 200: "keep",
        BASE + 300: "keep",
        BASE + 400: "ignore",
    }
    assert plan.blockers == []
    # The ranks and SGLang's launcher are signalled; the shell and its sleep are not ours.
    (group,) = plan.kill_groups
    assert group["pgid"] == BASE + 100
    assert group["pids"] == [BASE + 101, BASE + 102, BASE + 103]
    assert group["starttimes"] == [500, 500, 500]
    assert group["spared"] == [
        {"pid": BASE + 100, "command": "bash run.sh", "reason": "matches no rule of ours"},
        {"pid": BASE + 104, "command": "sleep 600", "reason": "matches no rule of ours"},
    ]


def test_foreign_on_other_gpu_is_left_alone(fake: FakeProc) -> None:
    fake.add(BASE + 101, ["sglang::scheduler_TP0"], fds=["/dev/nvidia0"])
    fake.add(BASE + 200, ["python3", "train.py"], uid=4242, fds=["/dev/nvidia3"])
    snap, plan = _decide(fake, {0, 1})
    assert plan.blockers == []
    assert _by_pid(snap.processes)[BASE + 200]["action"] == "keep"
    assert [g["pids"] for g in plan.kill_groups] == [[BASE + 101]]


def test_allow_kill_foreign_turns_blockers_into_targets(fake: FakeProc) -> None:
    fake.add(BASE + 200, ["python3", "train.py"], uid=4242, fds=["/dev/nvidia0"])
    _, plan = _decide(fake, {0}, allow=True)
    assert plan.blockers == []
    assert plan.kill_groups[0]["pids"] == [BASE + 200]


def test_group_keeping_a_gpu_process_loses_only_its_targets(fake: FakeProc) -> None:
    # One group: a rank on a needed GPU, a job on GPU 3 (not needed, kept) and SGLang's launcher.
    # Signalling the launcher would take down its whole tree, GPU 3 included: only the rank goes.
    fake.add(BASE + 101, ["sglang::scheduler_TP0"], pgid=BASE + 100, fds=["/dev/nvidia0"])
    fake.add(BASE + 102, ["python3", "eval.py"], pgid=BASE + 100, fds=["/dev/nvidia3"])
    fake.add(BASE + 103, ["python3", "-m", "sglang.launch_server"], pgid=BASE + 100)
    _, plan = _decide(fake, {0})
    assert plan.kill_groups == [
        {
            "pgid": BASE + 100,
            "pids": [BASE + 101],
            "starttimes": [500],
            "commands": ["sglang::scheduler_TP0"],
            "spared": [
                {
                    "pid": BASE + 102,
                    "command": "python3 eval.py",
                    "reason": "holds a GPU and is not killed here (action keep)",
                },
                {
                    "pid": BASE + 103,
                    "command": "python3 -m sglang.launch_server",
                    "reason": "its group keeps a GPU process that is not killed here",
                },
            ],
        }
    ]


def test_protected_processes_are_never_signalled(fake: FakeProc) -> None:
    # The module's own ancestor shares the group (it launched the server): spared.
    fake.add(BASE + 100, ["python3", "-m", "sglang.launch_server"], pgid=BASE + 100)
    fake.add(BASE + 101, ["sglang::scheduler_TP0"], pgid=BASE + 100, fds=["/dev/nvidia0"])
    _, plan = _decide(fake, {0}, protected={0, 1, BASE + 100})
    assert plan.kill_groups[0]["pids"] == [BASE + 101]
    assert plan.kill_groups[0]["spared"][0]["reason"] == "protected: this module or its ancestor"
    snap, plan = _decide(fake, {0}, protected={0, 1, BASE + 101})
    assert plan.kill_groups == []
    assert _by_pid(snap.processes)[BASE + 101]["action"] == "keep"


def test_process_hidden_by_nvidia_smi_blocks(fake: FakeProc) -> None:
    apps = f"[Insufficient Permissions], {GPU_UUIDS[0]}, [Insufficient Permissions], [N/A]\n"
    _, plan = _decide(fake, {0}, allow=True, apps=apps)
    assert [p["reasons"] for p in plan.blockers] == [["hidden by nvidia-smi"]]
    assert "       ?        ? ?" in gc_plan.format_table(plan.blockers)


def test_nvidia_smi_decides_the_gpu_of_a_listed_process(fake: FakeProc) -> None:
    # A process nvidia-smi places on GPU 3 may still hold every device file (NVML opens them
    # all): nvidia-smi's answer wins, so it does not block GPU 0.
    fds = [f"/dev/nvidia{i}" for i in range(4)] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    fake.add(BASE + 200, ["python3", "train.py"], uid=4242, fds=fds)
    apps = f"{BASE + 200}, {GPU_UUIDS[3]}, python3, 4000\n"
    snap, plan = _decide(fake, {0}, apps=apps)
    assert snap.processes[0]["gpus"] == [3]
    assert plan.blockers == []


def test_control_device_only_holder_could_be_on_any_gpu(fake: FakeProc) -> None:
    fake.add(BASE + 202, ["python3", "probe.py"], uid=4242, fds=["/dev/nvidiactl"])
    snap, plan = _decide(fake, {1})
    assert snap.processes[0]["any_gpu"] is True
    assert [b["pid"] for b in plan.blockers] == [BASE + 202]


def test_foreign_blocker_fails_with_table_and_kills_nothing(fake: FakeProc) -> None:
    _host(fake)
    fake.add(BASE + 201, ["python3", "train.py"], uid=4242, fds=["/dev/nvidia1", "/dev/nvidiactl"])
    params = _params(gpus=[0, 1])
    params["ours"]["launch_modules"] = ["sglang.launch_server"]
    failed, result = gc.cleanup(params, False, smi_runner(), str(fake.root))
    assert failed
    assert result["killed"] == [] and result["stopped_units"] == []
    assert "nothing was killed" in result["msg"]
    header, row = result["table"].splitlines()
    assert header.split() == ["PID", "PGID", "USER", "GPU", "MiB", "COMMAND"]
    assert row.split() == [
        str(BASE + 201),
        str(BASE + 201),
        "4242",
        "1",
        "-",
        "python3",
        "train.py",
    ]
    # Under the table, why it is not ours.
    assert result["msg"].endswith(f"  pid {BASE + 201}: matches no rule of ours")
    # It still says what a clean run would have killed, for the operator.
    assert result["would_kill"][0]["pids"] == [BASE + 101, BASE + 102, BASE + 103]


def test_check_mode_reports_would_kill(fake: FakeProc) -> None:
    fake.add(BASE + 101, ["sglang::scheduler_TP0"], fds=["/dev/nvidia0"])
    failed, result = gc.cleanup(_params(gpus=[0]), True, smi_runner(), str(fake.root))
    assert not failed
    assert result["changed"] is True
    assert result["would_kill"] == [
        {
            "pgid": BASE + 101,
            "pids": [BASE + 101],
            "commands": ["sglang::scheduler_TP0"],
            "spared": [],
        }
    ]
    assert result["killed"] == [] and result["clear"] is None


def test_inspect_never_fails_on_foreign(fake: FakeProc) -> None:
    fake.add(BASE + 200, ["python3", "train.py"], fds=["/dev/nvidia0"])
    failed, result = gc.cleanup(
        _params(gpus=[0], state="inspect"), False, smi_runner(), str(fake.root)
    )
    assert not failed
    assert [b["pid"] for b in result["blockers"]] == [BASE + 200]
    assert "1 foreign process(es) block" in result["msg"]
    assert result["clear"] is False
    assert [p["pid"] for p in result["remaining"]] == [BASE + 200]
    assert result["killed"] == [] and result["changed"] is False


def test_needed_gpu_that_does_not_exist_fails(fake: FakeProc) -> None:
    failed, result = gc.cleanup(_params(gpus=[0, 9]), False, smi_runner(), str(fake.root))
    assert failed and "[9]" in result["msg"]


# --------------------------------------------------------------------------- gate


def _snap(used: dict[int, int | None], processes: list[dict[str, Any]] = ()) -> Any:
    gpus = [
        {"index": i, "uuid": "u", "name": "n", "memory_used_mib": m, "memory_total_mib": 97887}
        for i, m in used.items()
    ]
    return gc_discovery.Snapshot(gpus, list(processes))


def _proc(pid: int, gpus: list[int]) -> dict[str, Any]:
    return {"pid": pid, "gpus": gpus, "any_gpu": False, "ignored": False}


def test_gate_clear_busy_and_stuck() -> None:
    assert gc_gate.evaluate(_snap({0: 3, 1: 2048, 2: 90000}), {0, 1}, 2048).clear
    held = gc_gate.evaluate(_snap({0: 60000, 1: 70000}, [_proc(7, [0])]), {0, 1}, 2048)
    assert not held.clear
    assert held.busy_gpus == [0, 1]
    assert held.stuck_gpus == [1]  # busy with nobody on it
    unknown = gc_gate.evaluate(_snap({0: None}), {0}, 2048)
    assert not unknown.clear and unknown.stuck_gpus == [0]


def test_wait_clear_polls_until_memory_is_released() -> None:
    snaps = iter(
        [_snap({0: 80000}, [_proc(7, [0])]), _snap({0: 80000}), _snap({0: 5}), _snap({0: 5})]
    )
    result = gc_gate.wait_clear(lambda: next(snaps), {0}, 2048, timeout=30, poll_interval=0)
    assert result.clear
    assert next(snaps).gpus[0]["memory_used_mib"] == 5  # stopped at the first clear snapshot


def test_gate_timeout_reports_stuck_gpu_and_suggests_reset(fake: FakeProc) -> None:
    params = _params(gpus=[0, 1], clear_timeout=0)
    failed, result = gc.cleanup(params, False, smi_runner(used={1: 50000}), str(fake.root))
    assert failed
    assert result["stuck_gpus"] == [1] and result["clear"] is False
    assert "GPU 1: 50000 MiB" in result["msg"]
    assert "nvidia-smi -r" in result["msg"]
    assert result["reset_gpus"] == [] and result["changed"] is False


def test_reset_runs_only_when_asked(fake: FakeProc) -> None:
    calls: list[list[str]] = []
    base = smi_runner(used={1: 50000})
    state = {"reset": False}

    def runner(argv: list[str], timeout: float) -> tuple[int, str, str]:
        if "-r" in argv:
            calls.append(argv)
            state["reset"] = True
            return 0, "GPU 00000000:1B:00.0 was successfully reset.\n", ""
        return (smi_runner() if state["reset"] else base)(argv, timeout)

    params = _params(gpus=[1], clear_timeout=0, reset_stuck_gpus=True)
    failed, result = gc.cleanup(params, False, runner, str(fake.root))
    assert not failed, result["msg"]
    assert calls == [["nvidia-smi", "-r", "-i", "1"]]
    assert result["reset_gpus"] == [1] and result["changed"] is True


# --------------------------------------------------------------------------- real processes


def _params(**overrides: Any) -> dict[str, Any]:
    params = {
        "state": "clean",
        "gpus": [],
        "nvidia_smi": "nvidia-smi",
        "device_glob": "/dev/nvidia*",
        "ours": {
            "process_titles": ["sglang::"],
            "units": [],
            "launch_modules": [],
            "ports": [],
            # root owns the fake trees' processes; the real ones run as whoever runs the tests.
            "users": ["root", str(os.getuid())],
        },
        "ignore_names": IGNORE,
        "allow_kill_foreign": False,
        "term_timeout": 5,
        "clear_timeout": 5,
        "poll_interval": 0.05,
        "max_used_mib": 2048,
        "reset_stuck_gpus": False,
    }
    params.update(overrides)
    return params


TITLED = textwrap.dedent(
    """
    import signal, subprocess, sys, time, setproctitle
    title, device, ignore_term = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setproctitle.setproctitle(title)
    held = open(device) if device != "-" else None
    if title.endswith("launcher"):
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("ready", flush=True)
    time.sleep(60)
    """
)


def spawn(title: str, device: str = "-", ignore_term: bool = False) -> subprocess.Popen[str]:
    """A process in its own process group (as a launcher started with nohup from a shell)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", TITLED, title, device, "1" if ignore_term else "0"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _reap(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _group(pgid: int) -> dict[str, Any]:
    members = gc_plan.group_members(pgid)
    return {
        "pgid": pgid,
        "pids": [m.pid for m in members],
        "starttimes": [m.starttime for m in members],
    }


@pytest.mark.slow
def test_sigterm_reaches_every_planned_member() -> None:
    proc = spawn("fleet-test::launcher")
    try:
        group = _group(proc.pid)
        assert len(group["pids"]) == 2  # the launcher and its child share the group
        report = gc_kill.terminate([group], term_timeout=10, poll_interval=0.05)
        assert report == [
            {
                "pgid": proc.pid,
                "pids": group["pids"],
                "signal": "SIGTERM",
                "skipped": [],
                "survived": [],
            }
        ]
        assert proc.wait(timeout=5) == -signal.SIGTERM
        assert not any(
            gc_kill.alive(p, s) for p, s in zip(group["pids"], group["starttimes"], strict=True)
        )
    finally:
        _reap(proc)


@pytest.mark.slow
def test_process_ignoring_sigterm_gets_sigkill_after_the_timeout() -> None:
    proc = spawn("fleet-test::stubborn", ignore_term=True)
    try:
        report = gc_kill.terminate([_group(proc.pid)], term_timeout=0.5, poll_interval=0.05)
        assert report[0]["signal"] == "SIGKILL"
        assert report[0]["survived"] == []
        assert proc.wait(timeout=5) == -signal.SIGKILL
    finally:
        _reap(proc)


@pytest.mark.slow
def test_a_pid_whose_start_time_changed_is_not_signalled() -> None:
    proc = spawn("fleet-test::bystander")
    try:
        group = _group(proc.pid)
        # As if the process classified had exited and its pid gone to this one.
        group["starttimes"] = [group["starttimes"][0] - 1]
        report = gc_kill.terminate([group], term_timeout=0.2, poll_interval=0.05)
        assert report[0]["pids"] == [] and report[0]["survived"] == []
        (skipped,) = report[0]["skipped"]
        assert skipped["pid"] == proc.pid
        assert skipped["reason"].startswith("pid reused: start time ")
        assert proc.poll() is None
    finally:
        _reap(proc)


def test_pid_reused_since_classification_is_skipped_and_reported(fake: FakeProc) -> None:
    fake.add(BASE + 101, ["sglang::scheduler_TP0"], fds=["/dev/nvidia0"])
    _, plan = _decide(fake, {0})
    # Between classification and the signal the rank exits and its pid goes to a new shell.
    fake.set_start(BASE + 101, 777, comm="bash", pgid=BASE + 101)
    (fake.root / str(BASE + 101) / "cmdline").write_text("bash\0")
    report = gc_kill.terminate(plan.kill_groups, 0, 0, proc_root=str(fake.root))
    assert report == [
        {
            "pgid": BASE + 101,
            "pids": [],
            "signal": "SIGTERM",
            "skipped": [
                {
                    "pid": BASE + 101,
                    "reason": "pid reused: start time 777 now, 500 when classified "
                    "(bash runs there now); not signalled",
                }
            ],
            "survived": [],
        }
    ]


def test_clean_run_reports_a_skipped_pid(fake: FakeProc) -> None:
    target = BASE + 101
    fake.add(target, ["sglang::scheduler_TP0"], fds=["/dev/nvidia0"])
    smi = smi_runner()

    def runner(argv: list[str], timeout: float) -> tuple[int, str, str]:
        if argv[:2] == ["systemctl", "is-active"]:
            return 0, "active\n", ""
        if argv[:2] == ["systemctl", "stop"]:
            # While the unit stops, the rank exits and a new process gets its pid.
            shutil.rmtree(fake.root / str(target) / "fd")
            (fake.root / str(target) / "fd").mkdir()
            fake.set_start(target, 901, comm="bash", pgid=target)
            return 0, "", ""
        return smi(argv, timeout)

    params = _params(gpus=[0])
    params["ours"]["units"] = ["sglang-a"]
    failed, result = gc.cleanup(params, False, runner, str(fake.root))
    assert not failed, result["msg"]
    (entry,) = result["killed"]
    assert entry["pids"] == [] and entry["skipped"][0]["pid"] == target
    assert result["warnings"] == [f"pid {target} skipped: {entry['skipped'][0]['reason']}"]
    assert result["msg"].endswith(f"skipped pids [{target}] (pid reused since classified)")


def _require_no_unit() -> None:
    """Skip when the tests run inside a systemd unit: processes they spawn belong to that unit,
    which the module rightly takes for somebody else's."""
    own = gc_procfs.own_cgroup()
    unit = gc_ownership.owning_unit(
        gc_ownership.relative_cgroup(own, gc_ownership.container_root(own))
    )
    if unit and gc_ownership.login_uid(own) is None:
        pytest.skip(f"the tests run inside systemd unit {unit}")


@pytest.mark.slow
def test_clean_leaves_the_launching_shells_sleep_alone(tmp_path: Path) -> None:
    _require_no_unit()
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").write_text("")
    # A shell starts a rank in the background, then becomes a `sleep` (same process group).
    shell = subprocess.Popen(
        ["sh", "-c", '"$0" -c "$1" sglang::scheduler_TP0 "$2" 0 & exec sleep 60',
         sys.executable, TITLED, str(dev / "nvidia0")],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert shell.stdout is not None and shell.stdout.readline().strip() == "ready"
        params = _params(gpus=[0], device_glob=f"{dev}/nvidia*")
        failed, result = gc.cleanup(params, False, _device_runner())
        assert not failed, result["msg"]
        (killed,) = result["killed"]
        assert killed["pgid"] == shell.pid and shell.pid not in killed["pids"]
        assert len(killed["pids"]) == 1 and killed["signal"] == "SIGTERM"
        (spared,) = result["would_kill"][0]["spared"]
        assert (spared["pid"], spared["command"]) == (shell.pid, "sleep 60")
        assert shell.poll() is None  # the sleep lives on
        # The rank is dead: a zombie, since its parent (now the sleep) never reaps it.
        rank = gc_procfs.read_proc(killed["pids"][0])
        assert rank is None or rank.state == "Z"
    finally:
        _reap(shell)


def _device_runner(gpus: int = 2) -> Any:
    return smi_runner(gpus=gpus)


@pytest.mark.slow
def test_clean_kills_ours_on_needed_gpu_and_spares_the_rest(tmp_path: Path) -> None:
    _require_no_unit()
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        (dev / name).write_text("")
    ours = spawn("sglang::scheduler_TP0", str(dev / "nvidia0"))
    ours_elsewhere = spawn("sglang::scheduler_TP1", str(dev / "nvidia1"))
    foreign = spawn("fleet-test::training", str(dev / "nvidia1"))
    try:
        params = _params(gpus=[0], device_glob=f"{dev}/nvidia*")
        failed, result = gc.cleanup(params, False, _device_runner())
        assert not failed, result["msg"]
        assert result["changed"] is True and result["clear"] is True
        assert [k["pids"] for k in result["killed"]] == [[ours.pid]]
        assert ours.wait(timeout=5) == -signal.SIGTERM
        # On a GPU the deployment does not need: ours by title, but not touched.
        assert ours_elsewhere.poll() is None and foreign.poll() is None
        procs = _by_pid(result["processes"])
        assert procs[ours_elsewhere.pid]["action"] == "keep"
        assert procs[foreign.pid]["reasons"] == ["matches no rule of ours"]
        # A second run finds nothing to do.
        failed, again = gc.cleanup(params, False, _device_runner())
        assert not failed and again["changed"] is False and again["killed"] == []
    finally:
        _reap(ours, ours_elsewhere, foreign)


@pytest.mark.slow
def test_module_through_ansible_playbook(tmp_path: Path) -> None:
    """The packaged module (AnsiballZ, module_utils import) runs and returns its data."""
    ansible = ROOT / ".venv" / "bin" / "ansible-playbook"
    if not ansible.exists():
        pytest.skip("control-node venv missing")
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").write_text("")
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f'  --query-gpu=*) echo "0, {GPU_UUIDS[0]}, NVIDIA RTX PRO 6000, 3, 97887" ;;\n'
        "  --query-compute-apps=*) ;;\n"
        "  *) exit 2 ;;\n"
        "esac\n"
    )
    smi.chmod(0o755)
    out = tmp_path / "result.json"
    playbook = tmp_path / "play.yml"
    args = {
        "gpus": [0],
        "nvidia_smi": str(smi),
        "device_glob": f"{dev}/nvidia*",
        "ours": {"process_titles": ["fleet-test::"], "users": [str(os.getuid())]},
        "term_timeout": 5,
        "clear_timeout": 5,
        "poll_interval": 0.1,
    }
    playbook.write_text(
        json.dumps(
            [
                {
                    "hosts": "localhost",
                    "gather_facts": False,
                    "tasks": [
                        {"gpu_cleanup": args, "register": "r"},
                        {
                            "ansible.builtin.copy": {
                                "content": "{{ r | to_json }}",
                                "dest": str(out),
                            }
                        },
                    ],
                }
            ]
        )
    )
    victim = spawn("fleet-test::scheduler_TP0", str(dev / "nvidia0"))
    env = {
        **os.environ,
        "ANSIBLE_LIBRARY": str(ROOT / "plugins" / "modules"),
        "ANSIBLE_MODULE_UTILS": str(ROOT / "plugins" / "module_utils"),
        # Its module_utils by the collection's name, from this checkout (docs/COLLECTION.md).
        "ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"),
        "ANSIBLE_LOCALHOST_WARNING": "false",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false",
    }
    try:
        done = subprocess.run(
            [str(ansible), "-i", "localhost,", "-c", "local", str(playbook),
             "-e", f"ansible_python_interpreter={sys.executable}"],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        result = json.loads(out.read_text())
        assert result["changed"] is True and result["clear"] is True
        assert [k["pids"] for k in result["killed"]] == [[victim.pid]]
        assert victim.wait(timeout=5) == -signal.SIGTERM
    finally:
        _reap(victim)


def test_active_unit_is_stopped_before_any_signal(fake: FakeProc) -> None:
    unit_pid = BASE + 500
    fake.add(unit_pid, ["python3", "-m", "x"], cgroup="/system.slice/sglang-a.service",
             fds=["/dev/nvidia0"])  # fmt: skip
    calls: list[list[str]] = []
    smi = smi_runner()

    def runner(argv: list[str], timeout: float) -> tuple[int, str, str]:
        if argv[0] == "systemctl":
            calls.append(argv)
            if argv[1] == "is-active":
                return 0, "active\n", ""
            shutil.rmtree(fake.root / str(unit_pid))  # systemd took the unit's processes
            return 0, "", ""
        return smi(argv, timeout)

    ours = {"units": ["sglang-a"], "process_titles": [], "launch_modules": [], "ports": []}
    ours["users"] = ["root"]
    failed, checked = gc.cleanup(_params(gpus=[0], ours=ours), True, runner, str(fake.root))
    assert not failed and checked["would_stop_units"] == ["sglang-a.service"]
    assert calls == [["systemctl", "is-active", "sglang-a.service"]]  # check mode stops nothing
    failed, result = gc.cleanup(_params(gpus=[0], ours=ours), False, runner, str(fake.root))
    assert not failed, result["msg"]
    assert calls[-1] == ["systemctl", "stop", "sglang-a.service"]
    assert result["stopped_units"] == ["sglang-a.service"]
    assert result["killed"] == []  # nothing left to signal after the stop
    assert result["changed"] is True and result["clear"] is True


def test_documented_options_match_the_argument_spec() -> None:
    docs = yaml.safe_load(gc.DOCUMENTATION)["options"]
    assert set(docs) == set(gc.ARGUMENT_SPEC)
    for name, spec in gc.ARGUMENT_SPEC.items():
        assert docs[name].get("default") == spec.get("default"), name
        assert docs[name]["type"] == spec["type"], name
    suboptions = docs["ours"]["suboptions"]
    assert set(suboptions) == set(gc.ARGUMENT_SPEC["ours"]["options"])
    yaml.safe_load(gc.EXAMPLES)
    returned = yaml.safe_load(gc.RETURN)
    assert {"would_kill", "killed", "blockers", "table", "stuck_gpus", "clear"} <= set(returned)


# --------------------------------------------------------------------------- CPU servers


def no_smi_runner(argv: list[str], timeout: float) -> tuple[int, str, str]:
    """A host without nvidia-smi: a CPU server's cleanup must never ask for it."""
    if argv[:2] == ["systemctl", "is-active"]:
        return 3, "inactive\n", ""
    raise AssertionError(f"unexpected command {argv}")


def _cpu_host(fake: FakeProc) -> None:
    """A CPU server in its unit sglang-a (process tree as SGLang 0.5.23 runs it on CPU), another
    CPU server in unit sglang-b, a hand-started SGLang of root on our port, a foreign job."""
    unit_a = "/system.slice/system-sglang.slice/sglang-a.service"
    launcher = BASE + 700
    fake.add(launcher, ["python3", "-m", "sglang.launch_server", "--device", "cpu"], cgroup=unit_a)
    fake.add(BASE + 701, ["sglang::scheduler"], pgid=launcher, cgroup=unit_a)
    fake.add(BASE + 702, ["sglang::detokenizer"], pgid=launcher, cgroup=unit_a)
    tracker = ["python3", "-c", "from multiprocessing.resource_tracker import main;main(7)"]
    fake.add(BASE + 703, tracker, pgid=launcher, cgroup=unit_a)
    unit_b = "/system.slice/system-sglang.slice/sglang-b.service"
    fake.add(BASE + 800, ["python3", "-m", "sglang.launch_server"], cgroup=unit_b)
    fake.add(BASE + 801, ["sglang::scheduler"], pgid=BASE + 800, cgroup=unit_b)
    fake.add(BASE + 900, ["python3", "train.py"], uid=4242)


def _cpu_params(**overrides: Any) -> dict[str, Any]:
    params = _params(accelerator="cpu", **overrides)
    params["ours"].update(units=["sglang-a"], launch_modules=["sglang.launch_server"])
    return params


def test_cpu_server_tree_is_ours_without_nvidia_smi(fake: FakeProc) -> None:
    _cpu_host(fake)
    failed, result = gc.cleanup(_cpu_params(), True, no_smi_runner, str(fake.root))
    assert not failed, result["msg"]
    assert result["accelerator"] == "cpu"
    assert result["gpus"] == [] and result["needed_gpus"] == []
    # Launcher, scheduler, detokenizer and the resource tracker: the unit proves each one.
    assert [(p["pid"], p["reasons"]) for p in result["processes"]] == [
        (BASE + 700 + n, ["unit:sglang-a.service"]) for n in range(4)
    ]
    assert result["would_kill"][0]["pids"] == [BASE + 700 + n for n in range(4)]
    assert result["blockers"] == []


def test_cpu_hand_started_server_on_our_port_is_killed_with_its_group(fake: FakeProc) -> None:
    launcher = BASE + 600
    fake.add(launcher, ["python3", "-m", "sglang.launch_server"], fds=["socket:[55501]"])
    fake.add(BASE + 601, ["sglang::scheduler"], pgid=launcher)
    fake.add(BASE + 602, ["bash"], pgid=launcher)
    (fake.root / "net" / "tcp").write_text(TCP)
    params = _cpu_params()
    params["ours"]["ports"] = [8000]
    failed, result = gc.cleanup(params, True, no_smi_runner, str(fake.root))
    assert not failed, result["msg"]
    (group,) = result["would_kill"]
    assert group["pids"] == [launcher, BASE + 601]
    assert [s["pid"] for s in group["spared"]] == [BASE + 602]


def test_cpu_foreign_program_on_our_port_blocks(fake: FakeProc) -> None:
    fake.add(BASE + 600, ["python3", "serve.py"], uid=4242, fds=["socket:[55501]"])
    (fake.root / "net" / "tcp").write_text(TCP)
    params = _cpu_params()
    params["ours"]["ports"] = [8000]
    failed, result = gc.cleanup(params, False, no_smi_runner, str(fake.root))
    assert failed
    assert [b["pid"] for b in result["blockers"]] == [BASE + 600]
    assert "nothing was killed" in result["msg"]


def test_cpu_gate_is_clear_when_nothing_of_ours_is_left(fake: FakeProc) -> None:
    fake.add(BASE + 800, ["sglang::scheduler"], cgroup="/system.slice/sglang-b.service")
    failed, result = gc.cleanup(_cpu_params(), False, no_smi_runner, str(fake.root))
    assert not failed
    assert result["clear"] is True and result["processes"] == []
    assert result["msg"] == "GPUs (none: CPU server) clear; nothing to kill"


def test_cpu_with_gpus_is_refused(fake: FakeProc) -> None:
    with pytest.raises(gc_ownership.OwnerError, match="accelerator cpu"):
        gc.cleanup(_cpu_params(gpus=[0]), False, no_smi_runner, str(fake.root))


def test_cpu_kill_takes_the_whole_tree_of_a_real_process_group(tmp_path: Path) -> None:
    """Real processes: a launcher stand-in and its children in one group, found by port."""
    script = textwrap.dedent(
        """
        import os, socket, subprocess, sys, time
        rank = [sys.executable, "-m", "sglang_cpu_stand_in", "-c", "import time; time.sleep(60)"]
        kids = [subprocess.Popen(rank) for _ in range(2)]
        s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
        print(s.getsockname()[1], *[k.pid for k in kids], flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_cpu_stand_in", "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(_stand_in_module(tmp_path))},
    )
    try:
        port, *kids = (int(x) for x in proc.stdout.readline().split())
        params = _params(accelerator="cpu", term_timeout=5, clear_timeout=10)
        params["ours"].update(launch_modules=["sglang_cpu_stand_in"], ports=[port])
        params["ours"]["process_titles"] = []
        failed, result = gc.cleanup(params, False, no_smi_runner)
        assert not failed, result["msg"]
        assert result["clear"] is True
        assert proc.wait(timeout=10) is not None
        (group,) = result["killed"]
        assert sorted(group["pids"]) == sorted([proc.pid, *kids])
        deadline = time.monotonic() + 10
        while not all(_zombie(pid) for pid in kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_zombie(pid) for pid in kids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _stand_in_module(tmp_path: Path) -> Path:
    """A module `sglang_cpu_stand_in` that runs its -c argument (a launcher by module name)."""
    path = tmp_path / "mods"
    path.mkdir()
    (path / "sglang_cpu_stand_in.py").write_text("import sys\nexec(sys.argv[2])\n")
    return path


def _zombie(pid: int) -> bool:
    """Gone, or dead and waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return True
