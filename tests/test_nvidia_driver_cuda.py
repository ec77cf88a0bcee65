"""The driver pre-flight refuses a branch that cannot run the CUDA of the pinned SGLang's torch,
before anything is installed (roles/nvidia_driver/tasks/preflight.yml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import run_local_play

ROOT = Path(__file__).resolve().parent.parent
ROLE = ROOT / "roles" / "nvidia_driver"


def run_preflight(tmp_path: Path, **variables: object) -> subprocess.CompletedProcess[str]:
    play = {
        "hosts": "localhost",
        "connection": "local",
        "gather_facts": True,
        "vars": {"ansible_python_interpreter": sys.executable},
        "tasks": [
            {
                "name": "Pre-flight of nvidia_driver",
                "ansible.builtin.include_role": {
                    "name": "nvidia_driver",
                    "tasks_from": "preflight",
                },
                "vars": variables,
            }
        ],
    }
    return run_local_play(tmp_path, play, "--check")


def test_cuda_13_needs_branch_580(tmp_path: Path) -> None:
    done = run_preflight(tmp_path, nvidia_driver_branch="570", nvidia_driver_cuda_major=13)
    assert done.returncode != 0
    assert 'nvidia_driver_branch "570" cannot run CUDA 13' in done.stdout, done.stdout
    assert "needs branch 580 or newer" in done.stdout
    assert "nvidia_driver_cuda_major" in done.stdout
    # Refused before the probe, let alone an install.
    assert "Probe the driver already on the host" not in done.stdout


@pytest.mark.parametrize(("branch", "cuda"), [("580", 13), ("535", 12)])
def test_a_branch_that_runs_the_cuda_passes_the_check(
    tmp_path: Path, branch: str, cuda: int
) -> None:
    done = run_preflight(tmp_path, nvidia_driver_branch=branch, nvidia_driver_cuda_major=cuda)
    assert "cannot run CUDA" not in done.stdout
    assert "Check the branch runs the CUDA of the pinned SGLang's torch" in done.stdout


def test_the_default_matches_the_pinned_sglang() -> None:
    """ml_env pins SGLang 0.5.23: torch 2.14.1, built for CUDA 13 (make resolve-gpu-deps)."""
    ml_env = yaml.safe_load((ROOT / "roles" / "ml_env" / "defaults" / "main.yml").read_text())
    driver = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    assert ml_env["ml_env_sglang_version"] == "0.5.23"
    assert driver["nvidia_driver_cuda_major"] == 13
    assert int(driver["nvidia_driver_branch"]) >= 580
