"""The nvidia_driver role never installs under running SGLang servers (tasks/guard.yml), its
package source can be the host's own repositories (nvidia_driver_repository: preconfigured),
and its reboot method is two variables. Run through ansible-playbook against this machine in
check mode, with stand-ins for nvidia-smi and systemctl on PATH: nothing here is changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

ROOT = Path(__file__).resolve().parent.parent
ROLE = ROOT / "roles" / "nvidia_driver"
RUNNING = "sglang@kimi.service loaded active running SGLang inference server kimi\n"


def stub(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body, encoding="utf-8")
    path.chmod(0o755)
    return str(path)


def run_role(
    tmp_path: Path,
    *,
    smi_version: str = "580.95.05",
    units: str = "",
    tags: str = "nvidia_driver_preflight",
    python: str = sys.executable,
    **variables: Any,
) -> subprocess.CompletedProcess[str]:
    """The role's main entry point (argument specs checked) in --check on localhost."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    stub(bindir / "systemctl", f"cat <<'EOF'\n{units}EOF\n")
    smi = stub(tmp_path / "nvidia-smi", f"printf '0, NVIDIA H200, {smi_version}\\n'\n")
    play = {
        "hosts": "localhost",
        "gather_facts": True,
        "vars": {"ansible_python_interpreter": python},
        "roles": [
            {
                "role": "nvidia_driver",
                "nvidia_driver_nvidia_smi": smi,
                "nvidia_driver_modinfo": str(tmp_path / "no-modinfo"),
                "nvidia_driver_module_version_file": str(tmp_path / "no-module"),
                **variables,
            }
        ],
    }
    playbook = tmp_path / "play.yml"
    playbook.write_text(json.dumps([play]), encoding="utf-8")
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_ROLES_PATH": str(ROOT / "roles"),
        "ANSIBLE_LIBRARY": str(ROOT / "plugins" / "modules"),
        "ANSIBLE_LOCALHOST_WARNING": "false",
    }
    options = ["--tags", tags] if tags else []
    return subprocess.run(
        [str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", "localhost,", "-c", "local",
         "--check", *options, str(playbook)],
        capture_output=True, text=True, env=env, timeout=180, check=False,
    )  # fmt: skip


@pytest.mark.slow
def test_a_branch_change_under_running_servers_is_refused_before_anything(tmp_path: Path) -> None:
    done = run_role(tmp_path, units=RUNNING, nvidia_driver_branch="590", tags="")
    assert done.returncode != 0
    out = done.stdout
    assert "Refuse to change the driver under running servers" in out
    assert "sglang@kimi.service" in out
    assert "ansible-playbook playbooks/driver_upgrade.yml" in out
    assert "nvidia_driver_branch" in out
    assert "nvidia-smi reports 580.95.05" in out
    # Refused before nouveau, the repository, the pin or the packages.
    for later in (
        "Blacklist nouveau",
        "Configure the package repository",
        "Install the driver packages",
    ):
        assert later not in out, later


@pytest.mark.slow
def test_the_rolling_path_says_the_servers_are_stopped(tmp_path: Path) -> None:
    done = run_role(
        tmp_path, units=RUNNING, nvidia_driver_branch="590", nvidia_driver_servers_stopped=True
    )
    assert done.returncode == 0, done.stdout
    assert "Refuse to change the driver under running servers" in done.stdout  # listed, skipped
    assert "sglang@kimi.service" not in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("smi_version", "units"),
    [("590.10.01", RUNNING), ("580.95.05", "")],
    ids=["branch-present-servers-running", "branch-change-no-server"],
)
def test_no_refusal_when_nothing_installs_or_nothing_runs(
    tmp_path: Path, smi_version: str, units: str
) -> None:
    done = run_role(tmp_path, smi_version=smi_version, units=units, nvidia_driver_branch="590")
    assert done.returncode == 0, done.stdout
    assert "where SGLang servers run:" not in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("value", ["mirror", "cuda", "none"])
def test_a_bad_repository_value_is_refused_naming_the_allowed_ones(
    tmp_path: Path, value: str
) -> None:
    done = run_role(tmp_path, nvidia_driver_repository=value)
    assert done.returncode != 0
    assert 'nvidia_driver_repository must be "" (the distribution\'s choice' in done.stdout
    assert '"preconfigured"' in done.stdout
    assert f'got "{value}"' in done.stdout
    assert "Probe the driver already on the host" not in done.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    not Path("/usr/bin/python3").exists()
    or subprocess.run(["/usr/bin/python3", "-c", "import apt"], check=False).returncode != 0,
    reason="needs the system python3 with python3-apt (the apt module's check mode)",
)
def test_preconfigured_uses_the_hosts_own_repositories(tmp_path: Path) -> None:
    """The whole role in check mode with an installed package as the 'driver': no repository
    task, the package step against the host's own sources."""
    done = run_role(
        tmp_path,
        tags="",
        python="/usr/bin/python3",
        nvidia_driver_branch="590",
        nvidia_driver_repository="preconfigured",
        nvidia_driver_packages=["bash"],
        nvidia_driver_blacklist_nouveau=False,
        nvidia_driver_persistenced=False,
        nvidia_driver_verify=False,
    )
    assert done.returncode == 0, done.stdout
    out = done.stdout
    assert "Find the mirror the host's own apt sources use" not in out
    assert "Add Debian's contrib and non-free components" not in out
    assert "TASK [nvidia_driver : Install the driver packages]" in out
    assert "TASK [nvidia_driver : Probe the kernel module after the install]" in out


def test_the_reboot_takes_its_method_from_the_role_variables() -> None:
    [reboot] = [
        task
        for task in yaml.safe_load((ROLE / "tasks" / "install.yml").read_text(encoding="utf-8"))
        if "ansible.builtin.reboot" in task
    ]
    args = reboot["ansible.builtin.reboot"]
    assert args["reboot_command"] == "{{ nvidia_driver_reboot_command | default(omit, true) }}"
    assert (
        args["boot_time_command"] == "{{ nvidia_driver_boot_time_command | default(omit, true) }}"
    )
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text(encoding="utf-8"))
    # Empty by default: ansible.builtin.reboot's own shutdown command and boot id.
    assert defaults["nvidia_driver_reboot_command"] == ""
    assert defaults["nvidia_driver_boot_time_command"] == ""
    assert "not _nvidia_driver_local" in reboot["when"]


def test_only_the_rolling_playbook_says_the_servers_are_stopped() -> None:
    """nvidia_driver_servers_stopped is set nowhere but in playbooks/driver_upgrade.yml."""
    setters = sorted(
        str(path.relative_to(ROOT))
        for folder in ("playbooks", "inventory", "roles", "molecule")
        for path in (ROOT / folder).rglob("*.yml")
        if "nvidia_driver_servers_stopped: true" in path.read_text(encoding="utf-8")
    )
    assert setters == ["playbooks/driver_upgrade.yml"]


@pytest.mark.parametrize(
    ("connection", "host", "address", "local"),
    [
        ("community.docker.docker", "driver-gpu1", None, False),
        ("docker", "driver-gpu1", "driver-gpu1", False),
        ("ssh", "gpu-node-01", "10.0.0.11", False),
        ("local", "gpu-node-01", None, True),
        ("ssh", "localhost", None, True),
        ("ssh", "gpu-node-01", "127.0.0.1", True),
    ],
)
def test_the_local_guard_spares_containers_and_remote_hosts(
    connection: str, host: str, address: str | None, local: bool
) -> None:
    """_nvidia_driver_local (preflight.yml), which keeps the reboot off the control node, as
    Ansible's templating evaluates it: a container reached through the docker connection (as
    Molecule's docker driver names it, or by ansible_host) is rebooted like any remote host."""
    [decide] = [
        task
        for task in yaml.safe_load((ROLE / "tasks" / "preflight.yml").read_text(encoding="utf-8"))
        if task.get("name") == "Decide what to install"
    ]
    expression = decide["ansible.builtin.set_fact"]["_nvidia_driver_local"]
    variables = {"ansible_connection": connection, "inventory_hostname": host}
    if address:
        variables["ansible_host"] = address
    templar = Templar(loader=DataLoader(), variables=variables)
    assert templar.template(trust_as_template(expression)) is local
