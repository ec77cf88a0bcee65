"""The ml_env role's pre-flight against a wheelhouse: the SGLang versions it holds are read from
the wheels' file names, and a version it does not hold is refused before anything is built,
naming ml_env_sglang_version and the versions there (docs/UPGRADES.md). Run through
ansible-playbook against this machine in --check (the pre-flight only reads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WHEELS = (
    "sglang-0.5.22-cp311-cp311-manylinux_2_34_x86_64.whl",
    "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
    "sglang-0.5.23+regressed-py3-none-any.whl",
    "sglang_router-0.3.2-cp38-abi3-manylinux_2_28_x86_64.whl",  # another distribution
)


def preflight(tmp_path: Path, version: str) -> subprocess.CompletedProcess[str]:
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir(exist_ok=True)
    for name in WHEELS:
        (wheelhouse / name).write_bytes(b"")
    play = {
        "hosts": "localhost",
        "gather_facts": True,
        "vars": {"ansible_python_interpreter": sys.executable},
        "tasks": [
            {
                "ansible.builtin.include_role": {"name": "ml_env", "tasks_from": "preflight"},
                "vars": {"ml_env_wheelhouse": str(wheelhouse), "ml_env_sglang_version": version},
            }
        ],
    }
    playbook = tmp_path / "play.yml"
    playbook.write_text(json.dumps([play]), encoding="utf-8")
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_LOCALHOST_WARNING": "false",
    }
    return subprocess.run(
        [str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", "localhost,", "-c", "local",
         "--check", str(playbook)],
        capture_output=True, text=True, env=env, timeout=180, check=False, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.5.23", "0.5.23+regressed"])
def test_a_version_the_wheelhouse_holds_passes(tmp_path: Path, version: str) -> None:
    done = preflight(tmp_path, version)
    assert done.returncode == 0, done.stdout[-2000:]


@pytest.mark.slow
def test_a_version_the_wheelhouse_lacks_is_refused_naming_what_it_holds(tmp_path: Path) -> None:
    done = preflight(tmp_path, "0.5.99")
    assert done.returncode != 0
    flat = " ".join(done.stdout.split())
    assert "ml_env_sglang_version 0.5.99 is not in the wheelhouse" in flat, done.stdout[-2000:]
    assert "it holds SGLang 0.5.22, 0.5.23, 0.5.23+regressed." in flat
