"""nvidia-smi output forms, liveness of registered processes, the driver-not-loaded state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpusim.nvidia_smi import DRIVER_MESSAGE, run
from gpusim_helpers import child_env

from gpusim import state

UUID0 = state.gpu_uuid(0)
NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A real process to register as a GPU user (its PID must be live)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def smi(*argv: str) -> tuple[int, list[str]]:
    code, out, _ = run(list(argv))
    return code, out


def test_query_gpu_with_header_and_units(state_dir: Path, sleeper: subprocess.Popen) -> None:
    state.register(sleeper.pid, 0, 1234, "python3")
    code, out = smi("--query-gpu=index,uuid,name,memory.used,memory.total", "--format=csv")
    assert code == 0
    assert out[0] == "index, uuid, name, memory.used [MiB], memory.total [MiB]"
    assert out[1] == f"0, {UUID0}, {NAME}, 1234 MiB, 97887 MiB"
    assert out[2] == f"1, {state.gpu_uuid(1)}, {NAME}, 0 MiB, 97887 MiB"
    assert len(out) == 1 + 8


def test_query_gpu_noheader_nounits(state_dir: Path) -> None:
    code, out = smi("--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits")
    assert code == 0
    assert out == [f"{i}, 0, 97887" for i in range(8)]


def test_nounits_keeps_the_unit_in_the_header(state_dir: Path) -> None:
    _, out = smi("--query-gpu=memory.used", "--format=csv,nounits", "-i", "2")
    assert out == ["memory.used [MiB]", "0"]


def test_compute_apps_forms(state_dir: Path, sleeper: subprocess.Popen) -> None:
    query = "--query-compute-apps=pid,gpu_uuid,process_name,used_memory"
    # No processes: noheader prints nothing at all, the header form prints the header only.
    assert smi(query, "--format=csv,noheader,nounits") == (0, [])
    assert smi(query, "--format=csv")[1] == ["pid, gpu_uuid, process_name, used_gpu_memory [MiB]"]
    state.register(sleeper.pid, 3, 4096, "sglang::scheduler_TP3")
    assert smi(query, "--format=csv,noheader")[1] == [
        f"{sleeper.pid}, {state.gpu_uuid(3)}, sglang::scheduler_TP3, 4096 MiB"
    ]
    assert smi(query, "--format=csv,noheader,nounits", "-i", "3")[1] == [
        f"{sleeper.pid}, {state.gpu_uuid(3)}, sglang::scheduler_TP3, 4096"
    ]
    assert smi(query, "--format=csv,noheader,nounits", "--id=0")[1] == []


def test_memory_is_the_sum_of_live_processes(state_dir: Path) -> None:
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        for proc, mib in zip(procs, (1000, 2500), strict=True):
            state.register(proc.pid, 5, mib, "python3")
        assert smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "5")[1] == [
            "3500"
        ]
        procs[0].kill()
        procs[0].wait()
        # The dead process disappears, as on a real GPU.
        assert smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "5")[1] == [
            "2500"
        ]
        assert not (state_dir / "procs" / f"{procs[0].pid}-5.json").exists()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_reused_pid_is_not_counted(state_dir: Path, sleeper: subprocess.Popen) -> None:
    # A record whose start time does not match the live PID belongs to an earlier process.
    record = state.register(sleeper.pid, 1, 777, "python3").to_dict()
    record["start_time"] -= 1
    (state_dir / "procs" / f"{sleeper.pid}-1.json").write_text(json.dumps(record))
    assert state.live_procs() == []


def test_plain_table_and_list(state_dir: Path, sleeper: subprocess.Popen) -> None:
    state.register(sleeper.pid, 1, 2048, "bob-train")
    code, out = smi()
    table = "\n".join(out)
    assert code == 0
    assert "Driver Version: 580.95.05" in table
    assert "2048MiB / 97887MiB" in table
    assert "bob-train" in table and str(sleeper.pid) in table
    assert smi("-L")[1][0] == f"GPU 0: {NAME} (UUID: {UUID0})"


def test_invalid_field_exits_2(state_dir: Path) -> None:
    code, out = smi("--query-gpu=index,bogus", "--format=csv")
    assert code == 2
    assert out[0] == 'Field "bogus" is not a valid field to query.'


def test_driver_not_loaded_real_message_and_exit_code(state_dir: Path) -> None:
    hardware = state.load_hardware(state_dir)
    hardware.driver_loaded = False
    state.save_hardware(hardware, state_dir)
    result = subprocess.run(
        [sys.executable, "-m", "gpusim.nvidia_smi", "--query-gpu=index", "--format=csv"],
        env=child_env(state_dir),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 9  # nvidia-smi: "NVIDIA driver is not loaded"
    assert result.stdout.strip() == DRIVER_MESSAGE
    assert DRIVER_MESSAGE.startswith(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    )


def test_hold_registers_a_foreign_process(state_dir: Path) -> None:
    env = child_env(state_dir)
    hold = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpusim.cli",
            "hold",
            "--gpu",
            "2",
            "--mib",
            "30000",
            "--name",
            "train.py",
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hold.stdout is not None and "holding 30000 MiB" in hold.stdout.readline()
        apps = smi("--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader")
        assert apps[1] == [f"{hold.pid}, train.py, 30000 MiB"]
        # It keeps the device file open, so a /dev/nvidia* holder scan finds it.
        fds = os.listdir(f"/proc/{hold.pid}/fd")
        targets = {os.readlink(f"/proc/{hold.pid}/fd/{fd}") for fd in fds}
        assert str(state_dir / "dev" / "nvidia2") in targets
    finally:
        hold.terminate()
        hold.wait(10)
    assert state.live_procs() == []
