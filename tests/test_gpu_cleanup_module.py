"""Tests for library/gpu_cleanup.py and module_utils/nvidia_smi.py.

Parsing is tested on real nvidia-smi output (tests/fixtures/nvidia_smi/, sources in SOURCES.md),
classification and the kill decision on fake /proc trees, killing on real process groups, and the
packaged module once through ansible-playbook.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "nvidia_smi"


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# The module imports its parser as Ansible packages it (ansible.module_utils.nvidia_smi).
nvsmi = _load("ansible.module_utils.nvidia_smi", ROOT / "module_utils" / "nvidia_smi.py")
gc = _load("gpu_cleanup", ROOT / "library" / "gpu_cleanup.py")

# Fake pids beyond any kernel's pid_max (2**22), so they never collide with real ones.
BASE = 9_000_000
GPU_UUIDS = [f"GPU-0000000{i}-aaaa-bbbb-cccc-00000000000{i}" for i in range(4)]


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


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
        return gc.run_command(["/nonexistent/nvidia-smi", *argv[1:]], timeout)

    with pytest.raises(nvsmi.NvidiaSmiError, match="nvidia-smi not found"):
        gc.query_gpus("/nonexistent/nvidia-smi", runner)


# --------------------------------------------------------------------------- /proc parsing


def test_parse_stat_with_parentheses_in_the_name() -> None:
    stat = "4242 (sglang::sch) (x)) S 1 4230 4230 0 -1 4194560 " + " ".join(["0"] * 12) + " 777 0"
    assert gc.parse_stat(stat) == ("S", 1, 4230, 777)


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("0::/system.slice/sglang-kimi.service\n", "/system.slice/sglang-kimi.service"),
        (
            "12:pids:/system.slice/sglang.service\n"
            "4:memory:/system.slice/sglang.service\n"
            "1:name=systemd:/system.slice/sglang.service\n",
            "/system.slice/sglang.service",
        ),
        # hybrid layout as on the machine that wrote these tests
        ("9:name=systemd:/user.slice/user-1000.slice/session-3.scope\n8:pids:/\n0::/\n", None),
    ],
)
def test_parse_cgroup_v1_v2_hybrid(text: str, path: str | None) -> None:
    expected = path or "/user.slice/user-1000.slice/session-3.scope"
    assert gc.parse_cgroup(text) == expected


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
    assert gc.owning_unit(path) == unit


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
    assert gc.parse_listen_inodes(TCP, [8000]) == {55501}
    assert gc.parse_listen_inodes(TCP, [8000, 2024]) == {55501, 1605}
    assert gc.parse_listen_inodes(TCP, [9999]) == set()


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
    assert gc.runs_module(argv, "sglang.launch_server") is expected


# --------------------------------------------------------------------------- fake /proc trees


class FakeProc:
    """A /proc look-alike: stat, status, cmdline, comm, cgroup and fd links per pid."""

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
        cgroup: str = "/user.slice/user-1000.slice/session-3.scope",
        fds: list[str] = (),
        comm: str | None = None,
    ) -> None:
        d = self.root / str(pid)
        (d / "fd").mkdir(parents=True)
        comm = comm or os.path.basename(cmdline[0])[:15]
        rest = " ".join(["0"] * 13)
        (d / "stat").write_text(f"{pid} ({comm}) S 1 {pgid or pid} {pgid or pid} 0 -1 {rest} 500 0")
        (d / "status").write_text(f"Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        (d / "cmdline").write_text("\0".join(cmdline) + "\0")
        (d / "comm").write_text(comm + "\n")
        (d / "cgroup").write_text(f"0::{cgroup}\n")
        for n, target in enumerate(fds):
            os.symlink(target, d / "fd" / str(n))


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


RULES = gc.OursRules.from_params(
    {
        "units": ["sglang-a"],
        "process_titles": ["sglang::"],
        "launch_modules": ["sglang.launch_server"],
        "ports": [8000],
    }
)
IGNORE = ["nvidia-persistenced", "nvidia-smi"]


@pytest.fixture
def fake(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def _host(fake: FakeProc) -> None:
    """Orphaned ranks of a hand-started server, a foreign job, another server, a daemon."""
    launcher = BASE + 100
    fake.add(launcher, ["bash", "run.sh"], pgid=launcher)
    fake.add(BASE + 101, ["sglang::scheduler_TP0"], pgid=launcher, fds=["/dev/nvidia0"])
    fake.add(BASE + 102, ["sglang::scheduler_TP1"], pgid=launcher, fds=["/dev/nvidia1"])
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


def _snapshot(fake: FakeProc, apps: str = "") -> Any:
    return gc.discover(
        "nvidia-smi",
        "/dev/nvidia*",
        RULES,
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
    assert procs[BASE + 300]["reasons"] == ["in another systemd service: sglang-b.service"]
    assert procs[BASE + 200]["reasons"] == ["matches no rule of ours"]
    assert procs[BASE + 400]["ignored"] is True


def test_port_and_launch_module_rules(fake: FakeProc) -> None:
    fake.add(BASE + 600, ["python3", "serve.py"], fds=["/dev/nvidia0", "socket:[55501]"])
    fake.add(BASE + 601, ["python3", "-m", "sglang.launch_server"], fds=["/dev/nvidia0"])
    (fake.root / "net" / "tcp").write_text(TCP)
    procs = _by_pid(_snapshot(fake).processes)
    assert procs[BASE + 600]["reasons"] == ["port:8000"]
    assert procs[BASE + 601]["reasons"] == ["launch_module:sglang.launch_server"]


def _decide(fake: FakeProc, needed: set[int], allow: bool = False, apps: str = "") -> Any:
    snap = _snapshot(fake, apps)
    protected = ({0, 1}, {0, 1})
    return snap, gc.decide(snap.processes, needed, allow, protected, str(fake.root))


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
    # The whole group goes, launcher included: it is the hand-started server's process group.
    assert plan.kill_groups[0]["pgid"] == BASE + 100
    assert sorted(plan.kill_groups[0]["pids"]) == [BASE + 100, BASE + 101, BASE + 102]


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


def test_group_with_a_spared_member_is_signalled_per_process(fake: FakeProc) -> None:
    # Same process group, but one member is a foreign GPU holder: never killpg that group.
    fake.add(BASE + 101, ["sglang::scheduler_TP0"], pgid=BASE + 100, fds=["/dev/nvidia0"])
    fake.add(BASE + 102, ["python3", "eval.py"], pgid=BASE + 100, fds=["/dev/nvidia3"])
    _, plan = _decide(fake, {0})
    assert plan.kill_groups == [
        {
            "pgid": None,
            "pids": [BASE + 101],
            "starttimes": [500],
            "commands": ["sglang::scheduler_TP0"],
        }
    ]


def test_protected_group_is_never_signalled_whole(fake: FakeProc) -> None:
    fake.add(BASE + 101, ["sglang::scheduler_TP0"], pgid=BASE + 100, fds=["/dev/nvidia0"])
    snap = _snapshot(fake)
    plan = gc.decide(snap.processes, {0}, False, ({0, 1, BASE + 100}, {0, 1}), str(fake.root))
    assert plan.kill_groups[0]["pgid"] is None
    plan = gc.decide(snap.processes, {0}, False, ({0, 1}, {0, 1, BASE + 101}), str(fake.root))
    assert plan.kill_groups == []


def test_process_hidden_by_nvidia_smi_blocks(fake: FakeProc) -> None:
    apps = f"[Insufficient Permissions], {GPU_UUIDS[0]}, [Insufficient Permissions], [N/A]\n"
    _, plan = _decide(fake, {0}, allow=True, apps=apps)
    assert [p["reasons"] for p in plan.blockers] == [["hidden by nvidia-smi"]]
    assert "       ?        ? ?" in gc.format_table(plan.blockers)


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
    # It still says what a clean run would have killed, for the operator.
    assert sorted(result["would_kill"][0]["pids"]) == [BASE + 100, BASE + 101, BASE + 102]


def test_check_mode_reports_would_kill(fake: FakeProc) -> None:
    fake.add(BASE + 101, ["sglang::scheduler_TP0"], fds=["/dev/nvidia0"])
    failed, result = gc.cleanup(_params(gpus=[0]), True, smi_runner(), str(fake.root))
    assert not failed
    assert result["changed"] is True
    assert result["would_kill"] == [
        {"pgid": BASE + 101, "pids": [BASE + 101], "commands": ["sglang::scheduler_TP0"]}
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
    return gc.Snapshot(gpus, list(processes))


def _proc(pid: int, gpus: list[int]) -> dict[str, Any]:
    return {"pid": pid, "gpus": gpus, "any_gpu": False, "ignored": False}


def test_gate_clear_busy_and_stuck() -> None:
    assert gc.evaluate(_snap({0: 3, 1: 2048, 2: 90000}), {0, 1}, 2048).clear
    held = gc.evaluate(_snap({0: 60000, 1: 70000}, [_proc(7, [0])]), {0, 1}, 2048)
    assert not held.clear
    assert held.busy_gpus == [0, 1]
    assert held.stuck_gpus == [1]  # busy with nobody on it
    unknown = gc.evaluate(_snap({0: None}), {0}, 2048)
    assert not unknown.clear and unknown.stuck_gpus == [0]


def test_wait_clear_polls_until_memory_is_released() -> None:
    snaps = iter(
        [_snap({0: 80000}, [_proc(7, [0])]), _snap({0: 80000}), _snap({0: 5}), _snap({0: 5})]
    )
    result = gc.wait_clear(lambda: next(snaps), {0}, 2048, timeout=30, poll_interval=0)
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
        "ours": {"process_titles": ["sglang::"], "units": [], "launch_modules": [], "ports": []},
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
    members = gc.group_members(pgid)
    return {
        "pgid": pgid,
        "pids": [m.pid for m in members],
        "starttimes": [m.starttime for m in members],
    }


@pytest.mark.slow
def test_sigterm_kills_the_whole_process_group() -> None:
    proc = spawn("fleet-test::launcher")
    try:
        group = _group(proc.pid)
        assert len(group["pids"]) == 2  # the launcher and its child share the group
        report = gc.terminate([group], term_timeout=10, poll_interval=0.05)
        assert report == [
            {"pgid": proc.pid, "pids": group["pids"], "signal": "SIGTERM", "survived": []}
        ]
        assert proc.wait(timeout=5) == -signal.SIGTERM
        assert not any(
            gc.alive(p, s) for p, s in zip(group["pids"], group["starttimes"], strict=True)
        )
    finally:
        _reap(proc)


@pytest.mark.slow
def test_process_ignoring_sigterm_gets_sigkill_after_the_timeout() -> None:
    proc = spawn("fleet-test::stubborn", ignore_term=True)
    try:
        report = gc.terminate([_group(proc.pid)], term_timeout=0.5, poll_interval=0.05)
        assert report[0]["signal"] == "SIGKILL"
        assert report[0]["survived"] == []
        assert proc.wait(timeout=5) == -signal.SIGKILL
    finally:
        _reap(proc)


def _device_runner(gpus: int = 2) -> Any:
    return smi_runner(gpus=gpus)


@pytest.mark.slow
def test_clean_kills_ours_on_needed_gpu_and_spares_the_rest(tmp_path: Path) -> None:
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
        "ours": {"process_titles": ["fleet-test::"]},
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
        "ANSIBLE_LIBRARY": str(ROOT / "library"),
        "ANSIBLE_MODULE_UTILS": str(ROOT / "module_utils"),
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
