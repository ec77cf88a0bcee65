"""Tests for plugins/modules/nvidia_driver_check.py: the decision on captured nvidia-smi output,
then the
module end to end through ansible-playbook with stub nvidia-smi / modinfo scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import load_plugin

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "nvidia_smi"
VENV_BIN = ROOT / ".venv" / "bin"


ndc = load_plugin("plugins/modules/nvidia_driver_check.py")

NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"


def rows(count: int, version: str = "580.95.05", name: str = NAME) -> str:
    return "\n".join(f"{i}, {name}, {version}" for i in range(count)) + "\n"


def obs(
    output: str = "",
    rc: int = 0,
    found: bool = True,
    loaded: str | None = None,
    installed: str | None = None,
) -> Any:
    return ndc.Observation(
        smi_found=found,
        smi_rc=rc,
        smi_output=output,
        loaded_module_version=loaded,
        installed_module_version=installed,
    )


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


# --------------------------------------------------------------------------- decide()


def test_healthy_host_matches_branch_and_count() -> None:
    verdict = ndc.decide(obs(rows(8), loaded="580.95.05", installed="580.95.05"), "580", 8)
    assert verdict.state == "healthy"
    assert verdict.healthy
    assert verdict.gpu_count == 8
    assert verdict.driver_version == "580.95.05"
    assert verdict.driver_branch == "580"
    assert verdict.branch_matches
    assert not verdict.reboot_needed


def test_gpu_name_with_comma_keeps_version_and_name() -> None:
    verdict = ndc.decide(obs(rows(2, name="Tesla V100-SXM2-32GB, rev a1")), "", 0)
    assert verdict.gpu_names == ["Tesla V100-SXM2-32GB, rev a1"] * 2
    assert verdict.driver_version == "580.95.05"


def test_driver_not_loaded_real_output_says_reboot() -> None:
    verdict = ndc.decide(
        obs(fixture("driver_not_loaded.txt"), rc=9, installed="580.95.05"), "580", 8
    )
    assert verdict.state == "not_loaded"
    assert not verdict.healthy
    assert verdict.reboot_needed
    assert verdict.message.startswith("NVIDIA kernel module not loaded, reboot needed")
    assert "580.95.05" in verdict.message
    assert not verdict.branch_matches


def test_driver_not_loaded_without_installed_module_points_at_dkms() -> None:
    verdict = ndc.decide(obs(fixture("driver_not_loaded.txt"), rc=9), "580", 8)
    assert verdict.state == "not_loaded"
    assert "DKMS" in verdict.message


def test_nvml_mismatch_real_output_is_a_version_mismatch() -> None:
    verdict = ndc.decide(
        obs(fixture("nvml_version_mismatch.txt"), rc=18, loaded="570.86.15", installed="580.95.05"),
        "580",
        8,
    )
    assert verdict.state == "version_mismatch"
    assert verdict.reboot_needed
    assert "kernel module and userland" in verdict.message
    assert "570.86.15" in verdict.message
    assert "580.95.05" in verdict.message


def test_loaded_module_older_than_installed_is_a_mismatch_even_when_smi_answers() -> None:
    verdict = ndc.decide(
        obs(rows(8, "570.86.15"), loaded="570.86.15", installed="580.95.05"), "", 8
    )
    assert verdict.state == "version_mismatch"
    assert verdict.reboot_needed


def test_fewer_gpus_than_expected() -> None:
    verdict = ndc.decide(obs(rows(7)), "580", 8)
    assert verdict.state == "too_few_gpus"
    assert verdict.message.startswith("fewer GPUs than expected")
    assert "lists 7, expected 8" in verdict.message
    assert verdict.branch_matches  # the driver is right; the skip-install decision reads this


def test_more_gpus_than_expected_is_its_own_state() -> None:
    verdict = ndc.decide(obs(rows(8)), "580", 4)
    assert verdict.state == "too_many_gpus"


def test_zero_expected_accepts_any_count_above_zero() -> None:
    assert ndc.decide(obs(rows(3)), "580", 0).healthy
    empty = ndc.decide(obs(""), "580", 0)
    assert empty.state == "no_gpus"
    assert not empty.branch_matches


def test_wrong_branch_is_reported_before_the_count() -> None:
    verdict = ndc.decide(obs(rows(4, "570.86.15")), "580", 8)
    assert verdict.state == "wrong_branch"
    assert not verdict.branch_matches
    assert "570.86.15" in verdict.message
    assert "wanted branch 580" in verdict.message


def test_missing_nvidia_smi_is_absent() -> None:
    verdict = ndc.decide(obs(found=False, rc=127), "580", 8)
    assert verdict.state == "absent"
    assert not verdict.reboot_needed


def test_no_devices_and_unknown_failures() -> None:
    assert ndc.decide(obs("No devices were found", rc=6), "", 0).state == "no_gpus"
    other = ndc.decide(obs("Unable to determine the device handle", rc=15), "", 0)
    assert other.state == "error"
    assert "exit 15" in other.message


def test_garbage_output_is_an_error_not_healthy() -> None:
    verdict = ndc.decide(obs("this is not csv\n"), "", 0)
    assert verdict.state == "error"
    assert not verdict.healthy


# --------------------------------------------------------------------------- the module itself


def _stub(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body), encoding="utf-8")
    path.chmod(0o755)
    return str(path)


def _run_module(tmp_path: Path, args: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Run the module through ansible-playbook on localhost and return (rc, task result)."""
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        json.dumps(
            [
                {
                    "hosts": "localhost",
                    "gather_facts": False,
                    "tasks": [
                        {"nvidia_driver_check": args, "register": "r"},
                    ],
                }
            ]
        ),
        encoding="utf-8",
    )
    env = {
        **os.environ,
        "ANSIBLE_LIBRARY": str(ROOT / "plugins" / "modules"),
        # Its module_utils by the collection's name, from this checkout (docs/COLLECTION.md).
        "ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"),
        "ANSIBLE_STDOUT_CALLBACK": "json",
        "ANSIBLE_LOCALHOST_WARNING": "false",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false",
        "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
    }
    done = subprocess.run(
        [str(VENV_BIN / "ansible-playbook"), "-c", "local", "-i", "localhost,", str(playbook)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    report = json.loads(done.stdout)
    result = report["plays"][0]["tasks"][0]["hosts"]["localhost"]
    return done.returncode, result


@pytest.mark.slow
def test_module_verify_fails_with_message_and_probe_does_not(tmp_path: Path) -> None:
    smi = _stub(
        tmp_path / "nvidia-smi",
        f'printf "%s\\n" "{fixture("driver_not_loaded.txt").strip()}"\nexit 9\n',
    )
    modinfo = _stub(tmp_path / "modinfo", "echo 580.95.05\n")
    common = {
        "nvidia_smi": smi,
        "modinfo": modinfo,
        "module_version_file": str(tmp_path / "absent"),
        "expected_branch": "580",
    }
    rc, probe = _run_module(tmp_path, common)
    assert rc == 0
    assert probe["state"] == "not_loaded"
    assert probe["installed_module_version"] == "580.95.05"
    assert probe["loaded_module_version"] is None
    assert probe["reboot_needed"] is True
    assert probe["changed"] is False

    rc, verify = _run_module(tmp_path, {**common, "fail_unhealthy": True})
    assert rc != 0
    assert verify["failed"] is True
    assert verify["msg"].startswith("NVIDIA kernel module not loaded, reboot needed")


@pytest.mark.slow
def test_module_healthy_with_loaded_module_file(tmp_path: Path) -> None:
    smi = _stub(tmp_path / "nvidia-smi", "printf '0, H200, 580.95.05\\n1, H200, 580.95.05\\n'\n")
    version_file = tmp_path / "version"
    version_file.write_text("580.95.05\n", encoding="utf-8")
    rc, result = _run_module(
        tmp_path,
        {
            "nvidia_smi": smi,
            "modinfo": str(tmp_path / "no-modinfo"),
            "module_version_file": str(version_file),
            "expected_branch": "580",
            "expected_gpu_count": 2,
            "fail_unhealthy": True,
        },
    )
    assert rc == 0
    assert result["state"] == "healthy"
    assert result["gpu_names"] == ["H200", "H200"]
    assert result["loaded_module_version"] == "580.95.05"
