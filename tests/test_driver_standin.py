"""molecule/shared/driver_standin.yml, the stand-in driver branch a driver-change scenario installs
on the double: its scripts and package, run here on a private gpusim state directory, against
the real nvidia_driver_check probe (plugins/modules/) and gpusim's nvidia-smi. Before the package
the probe sees branch 580 and nothing to reboot for; after its postinst, a module installed but not
loaded (reboot needed); after the reboot stand-in, branch 590 loaded and healthy."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from conftest import load_plugin

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "molecule" / "shared" / "driver_standin.yml"
NVIDIA_SMI = ROOT / ".venv" / "bin" / "nvidia-smi"
ndc = load_plugin("plugins/modules/nvidia_driver_check.py")
VARS = {
    "_driver_standin_branch": "590",
    "_driver_standin_version": "590.10.01",
    "_driver_standin_package": "gpusim-nvidia-driver-590",
}


def tasks() -> dict[str, dict[str, Any]]:
    return {task["name"]: task for task in yaml.safe_load(STANDIN.read_text(encoding="utf-8"))}


def render(text: str, **extra: Any) -> str:
    """The task's text as Ansible renders it (the one filter it uses: quote)."""
    env = jinja2.Environment(keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    env.filters["quote"] = shlex.quote
    return env.from_string(text).render(**VARS, **extra)


def write_script(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)
    return path


def probe(state: Path, branch: str) -> dict[str, Any]:
    params = {
        "nvidia_smi": str(NVIDIA_SMI),
        "modinfo": str(state.parent / "bin" / "gpusim-modinfo"),
        "module_version_file": str(state / "module-loaded"),
        "timeout": 30,
    }
    return vars(ndc.decide(ndc.observe(params), branch, 8))


@pytest.fixture
def host(tmp_path: Path, state_dir: Path) -> dict[str, Path]:
    """The double's state directory with the stand-in's files as the task file lays them out,
    its scripts in tmp/bin, and a systemctl that records its calls."""
    named = tasks()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    write_script(
        bindir / "gpusim-modinfo",
        named["Install the modinfo stand-in (the installed kernel module's version)"][
            "ansible.builtin.copy"
        ]["content"],
    )
    write_script(
        bindir / "gpusim-reboot",
        named["Install the reboot stand-in"]["ansible.builtin.copy"]["content"],
    )
    write_script(bindir / "systemctl", f'#!/bin/sh\necho "$*" >> {tmp_path}/systemctl.calls\n')
    for name in ("module-installed", "module-loaded"):
        (state_dir / name).write_text("580.95.05\n", encoding="utf-8")
    (state_dir / "boot_id").write_text("first-boot\n", encoding="utf-8")
    return {"tmp": tmp_path, "state": state_dir, "bin": bindir}


def test_the_first_run_reads_the_version_the_double_reports(tmp_path: Path) -> None:
    cmd = tasks()["Read the driver the double reports now"]["ansible.builtin.shell"]["cmd"]
    hardware = tmp_path / "hardware.yaml"
    script = cmd.replace("/var/lib/gpusim/hardware.yaml", str(hardware))

    def run() -> str:
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
        return done.stdout.strip()

    assert run() == "580.95.05"  # no file: gpusim's default
    hardware.write_text("gpu_count: 8\ndriver_version: '575.51.03'\n", encoding="utf-8")
    assert run() == "575.51.03"


def test_modinfo_answers_only_for_the_nvidia_module(host: dict[str, Path]) -> None:
    env = {**os.environ, "GPUSIM_STATE_DIR": str(host["state"])}
    modinfo = str(host["bin"] / "gpusim-modinfo")
    done = subprocess.run(
        [modinfo, "-F", "version", "nvidia"], capture_output=True, text=True, env=env, check=False
    )
    assert (done.returncode, done.stdout) == (0, "580.95.05\n")
    done = subprocess.run(
        [modinfo, "-F", "version", "nouveau"], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 1
    assert "not found" in done.stderr


@pytest.mark.slow
def test_install_then_reboot_moves_the_double_to_the_new_branch(host: dict[str, Path]) -> None:
    state, tmp, bindir = host["state"], host["tmp"], host["bin"]
    before = probe(state, "590")
    assert before["state"] == "wrong_branch"
    assert before["driver_version"] == "580.95.05"
    assert before["reboot_needed"] is False

    # The package's postinst, as dpkg runs it.
    [postinst] = [
        item
        for item in tasks()["Write the package's control file, payload and postinst"]["loop"]
        if item["path"] == "DEBIAN/postinst"
    ]
    script = write_script(tmp / "postinst", render(postinst["content"]))
    env = {**os.environ, "GPUSIM_STATE_DIR": str(state)}
    subprocess.run([str(script), "configure"], env=env, check=True)
    assert (state / "driver-pending").read_text() == "590.10.01\n"
    installed = probe(state, "590")
    assert installed["reboot_needed"] is True  # the role reboots on this
    assert installed["installed_module_version"] == "590.10.01"
    assert installed["loaded_module_version"] == "580.95.05"

    # What a reboot finds and does: a server unit enabled, a process on a GPU, a lock in /run/lock.
    sleeper = subprocess.Popen(["sleep", "600"])
    start = int(Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    (state / "procs" / f"{sleeper.pid}-0.json").write_text(
        json.dumps(
            {"pid": sleeper.pid, "gpu_index": 0, "used_mib": 1000, "name": "x", "start_time": start}
        ),
        encoding="utf-8",
    )
    locks, wants = tmp / "lock", tmp / "wants"
    locks.mkdir()
    wants.mkdir()
    (locks / "sglang-fleet.lock").write_text("{}", encoding="utf-8")
    (wants / "sglang@kimi.service").write_text("", encoding="utf-8")
    subprocess.run(
        [sys.executable, str(bindir / "gpusim-reboot")],
        env={
            **env,
            "PATH": f"{bindir}:{os.environ['PATH']}",
            "GPUSIM_REBOOT_LOCK_DIR": str(locks),
            "GPUSIM_REBOOT_UNITS_DIR": str(wants),
            "GPUSIM_REBOOT_LOG": str(tmp / "reboot.log"),
        },
        check=True,
        timeout=60,
    )
    assert sleeper.wait(timeout=10) == -9
    assert list((state / "procs").glob("*.json")) == []
    assert list(locks.iterdir()) == []
    assert not (state / "driver-pending").exists()
    assert (state / "boot_id").read_text().strip() not in ("", "first-boot")
    assert (tmp / "systemctl.calls").read_text().splitlines() == [
        "stop sglang@*",
        "start --no-block sglang@kimi.service",
    ]
    assert "driver 590.10.01 loaded" in (tmp / "reboot.log").read_text()
    hardware = yaml.safe_load((state / "hardware.yaml").read_text())
    assert hardware["driver_version"] == "590.10.01"
    assert hardware["gpu_count"] == 8  # the rest of the file kept

    after = probe(state, "590")
    assert after["state"] == "healthy", after["message"]
    assert after["driver_version"] == "590.10.01"
    assert after["reboot_needed"] is False

    # A second reboot with nothing pending changes no driver.
    subprocess.run(
        [sys.executable, str(bindir / "gpusim-reboot")],
        env={**env, "PATH": f"{bindir}:{os.environ['PATH']}", "GPUSIM_REBOOT_LOCK_DIR": str(locks),
             "GPUSIM_REBOOT_UNITS_DIR": str(wants), "GPUSIM_REBOOT_LOG": str(tmp / "reboot.log")},
        check=True,
    )  # fmt: skip
    assert probe(state, "590")["driver_version"] == "590.10.01"


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("dpkg-deb"), reason="needs dpkg-deb (Debian)")
def test_the_package_and_its_repository(tmp_path: Path) -> None:
    """dpkg-deb builds the package, the index names it; apt reads the repository and would
    install it (apt-get -s, private lists: nothing of this machine's apt changes)."""
    named = tasks()
    build = tmp_path / "build"
    repo = tmp_path / "driver-repo"
    for item in named["Lay out the package's build folder and the repository"]["loop"]:
        rendered = render(item, _driver_standin_build=str(build))
        Path(rendered.replace("/var/lib/gpusim", str(tmp_path))).mkdir(parents=True, exist_ok=True)
    for item in named["Write the package's control file, payload and postinst"]["loop"]:
        path = build / render(item["path"])
        path.write_text(render(item["content"]), encoding="utf-8")
        path.chmod(int(item["mode"], 8))
    cmd = render(
        named["Build the package and index the repository"]["ansible.builtin.shell"]["cmd"],
        _driver_standin_build=str(build),
    ).replace("/var/lib/gpusim/driver-repo", str(repo))
    subprocess.run(["bash", "-c", cmd], check=True)
    deb = repo / "gpusim-nvidia-driver-590_590.10.01_all.deb"
    fields = subprocess.run(
        ["dpkg-deb", "-f", str(deb)], capture_output=True, text=True, check=True
    ).stdout
    assert "Package: gpusim-nvidia-driver-590" in fields
    assert "Version: 590.10.01" in fields
    index = (repo / "Packages").read_text()
    assert "Filename: ./gpusim-nvidia-driver-590_590.10.01_all.deb" in index
    assert "SHA256: " in index
    assert " Packages" in (repo / "Release").read_text()
    listing = named["List the repository in apt's sources"]["ansible.builtin.copy"]["content"]
    assert "deb [trusted=yes] file:/var/lib/gpusim/driver-repo ./" in listing

    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("apt-get as root needed to read the repository")
    lists = tmp_path / "lists"
    (lists / "partial").mkdir(parents=True)
    (tmp_path / "cache" / "archives" / "partial").mkdir(parents=True)
    sources = tmp_path / "sources.list"
    sources.write_text(listing.replace("/var/lib/gpusim/driver-repo", str(repo)), encoding="utf-8")
    options = [
        "-o", f"Dir::Etc::sourcelist={sources}", "-o", "Dir::Etc::sourceparts=-",
        "-o", f"Dir::State::Lists={lists}", "-o", "Debug::NoLocking=1",
        "-o", f"Dir::Cache={tmp_path / 'cache'}",
    ]  # fmt: skip
    subprocess.run(["apt-get", "update", "-q", *options], check=True, capture_output=True)
    simulated = subprocess.run(
        ["apt-get", "-s", "install", "gpusim-nvidia-driver-590", *options],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Inst gpusim-nvidia-driver-590 (590.10.01" in simulated


def test_the_header_names_every_role_variable_it_needs() -> None:
    """The variables the header tells a scenario to set exist in the role, and they are all a
    scenario needs to point the role at the stand-in."""
    header = STANDIN.read_text(encoding="utf-8").split("\n- name:")[0]
    defaults = yaml.safe_load(
        (ROOT / "roles" / "nvidia_driver" / "defaults" / "main.yml").read_text(encoding="utf-8")
    )
    named = [
        line.split(":")[0].strip("# ").strip()
        for line in header.splitlines()
        if line.startswith("#   nvidia_driver_")
    ]
    assert set(named) == {
        "nvidia_driver_branch",
        "nvidia_driver_repository",
        "nvidia_driver_packages",
        "nvidia_driver_reboot",
        "nvidia_driver_reboot_command",
        "nvidia_driver_boot_time_command",
        "nvidia_driver_modinfo",
        "nvidia_driver_module_version_file",
    }
    assert set(named) <= set(defaults)
