"""sglang_fleet/host_zipapp.py: the host-side programs as one file each.

The archives are built for real and run with a bare interpreter (-I -S: no site-packages, no
sglang_fleet, as on a GPU host), with the oldest host Python there is here as well.
"""

from __future__ import annotations

import importlib
import io
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import sglang_fleet
from sglang_fleet.host_zipapp import ZipappError, build, closure, main, scan

SMOKE = "sglang_fleet.smoke.smoke_client.command_line"
SAMPLER = "sglang_fleet.diagnosis.live_metrics"


def _host_pythons() -> list[str]:
    """This interpreter and the system's python3 (Debian's, as a GPU host has) when it differs."""
    found = [sys.executable]
    system = shutil.which("python3", path="/usr/bin")
    if system and Path(system).resolve() != Path(sys.executable).resolve():
        found.append(system)
    return found


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_same_sources_give_the_same_bytes() -> None:
    assert build(SMOKE) == build(SMOKE)


def test_building_runs_none_of_the_modules_it_packs() -> None:
    """The sources are read, not run: only the packages on the way are imported."""
    probe = (
        "import sys; from sglang_fleet.host_zipapp import build; build(sys.argv[1]);"
        "print(sorted(m for m in sys.modules if m.startswith('sglang_fleet.smoke.smoke_client.')))"
    )
    ran = subprocess.run(
        [sys.executable, "-c", probe, SMOKE], capture_output=True, text=True, check=False
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[]"


def test_the_smoke_client_archive_holds_its_package_and_nothing_else() -> None:
    names = zipfile.ZipFile(io.BytesIO(build(SMOKE))).namelist()
    assert names == sorted(names)
    others = [n for n in names if not n.startswith("sglang_fleet/smoke/smoke_client/")]
    assert others == [
        "__main__.py",
        "sglang_fleet/__init__.py",
        "sglang_fleet/module_utils/__init__.py",
        "sglang_fleet/module_utils/fleet_http.py",  # the one URL rule (check_url)
        "sglang_fleet/smoke/__init__.py",
    ]
    # every module of the package the entry reaches, none of the control-node modules
    assert "sglang_fleet/smoke/smoke_client/streams.py" in names
    assert not any(n.endswith(("gate.py", "smoke_picture.py")) for n in names)


@pytest.mark.parametrize("python", _host_pythons())
def test_the_smoke_client_runs_from_its_archive_alone(python: str, tmp_path: Path) -> None:
    archive = tmp_path / "smoke.pyz"
    archive.write_bytes(build(SMOKE))
    bare = [python, "-I", "-S", str(archive)]
    helped = subprocess.run([*bare, "--help"], capture_output=True, text=True, check=False)
    assert helped.returncode == 0, helped.stderr
    assert "--random-output-len" in helped.stdout
    url = f"http://127.0.0.1:{_closed_port()}"
    ran = subprocess.run(
        [*bare, "--url", url, "--num-prompts", "1", "--vocab-size", "1000"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 1, ran.stderr
    assert ran.stderr.startswith(f"smoke: cannot reach the server at {url}")


def test_a_module_that_imports_beyond_the_standard_library_is_refused() -> None:
    """The report picture needs matplotlib: a GPU host has none, so it cannot be a host program."""
    with pytest.raises(ZipappError, match=r"smoke_picture.py imports matplotlib"):
        closure("sglang_fleet.smoke.smoke_picture")


def test_an_entry_outside_the_package_is_refused() -> None:
    with pytest.raises(ZipappError, match="not a module of sglang_fleet"):
        closure("json")


def test_a_relative_import_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "relative_probe.py").write_text(
        "from . import ansible_values\n\n\ndef main():\n    return 0\n"
    )
    monkeypatch.setattr(sglang_fleet, "__path__", [*sglang_fleet.__path__, str(tmp_path)])
    importlib.invalidate_caches()
    with pytest.raises(ZipappError, match="a relative import"):
        closure("sglang_fleet.relative_probe")


def test_the_command_line_writes_a_runnable_archive(tmp_path: Path) -> None:
    out = tmp_path / "live.pyz"
    assert main([SAMPLER, "-o", str(out)]) == 0
    assert out.read_bytes() == build(SAMPLER) and out.stat().st_mode & 0o777 == 0o755
    helped = subprocess.run(
        [sys.executable, "-I", "-S", str(out), "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert helped.returncode == 0 and helped.stdout.startswith("usage: live.pyz"), helped.stderr


# --- programs that need a third-party package (the job runner) -----------------------------
JOB = "sglang_fleet.job.command_line"


def test_a_program_may_name_the_third_party_packages_its_host_provides() -> None:
    with pytest.raises(ZipappError, match=r"progress.py imports prometheus_client.*requires"):
        closure(JOB)
    program = scan(JOB, ["prometheus_client"])
    assert program.required == {"prometheus_client"}
    # tqdm is imported inside try/except ImportError: optional, not needed, not packed.
    assert program.optional == {"tqdm"}
    names = zipfile.ZipFile(io.BytesIO(build(JOB, ["prometheus_client"]))).namelist()
    assert "sglang_fleet/job/progress.py" in names
    assert not any(n.startswith(("prometheus_client/", "tqdm/")) for n in names)


def test_only_an_import_guarded_by_import_error_is_optional(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "guard_probe.py").write_text(
        "try:\n    import yaml\nexcept (ValueError, ModuleNotFoundError):\n    yaml = None\n"
        "try:\n    import jinja2\nexcept ValueError:\n    jinja2 = None\n"
        "def main():\n    return 0\n"  # an entry runs main() (host_zipapp refuses one without)
    )
    monkeypatch.setattr(sglang_fleet, "__path__", [*sglang_fleet.__path__, str(tmp_path)])
    importlib.invalidate_caches()
    with pytest.raises(ZipappError, match=r"guard_probe.py imports jinja2"):
        scan("sglang_fleet.guard_probe")
    assert scan("sglang_fleet.guard_probe", ["jinja2"]).optional == {"yaml"}


@pytest.mark.parametrize("name", ["json", "sglang_fleet", "prometheus-client", ""])
def test_requires_names_a_third_party_import(name: str) -> None:
    with pytest.raises(ZipappError, match="requires"):
        scan(JOB, [name])


def test_the_job_runner_runs_from_its_archive_with_its_package_beside_it(tmp_path: Path) -> None:
    """As on the job's host: the archive and a python whose path has prometheus_client and
    nothing else of this project (the role's virtualenv)."""
    import prometheus_client  # noqa: PLC0415 (the controller's copy, put on the child's path)

    site = tmp_path / "site"
    shutil.copytree(Path(prometheus_client.__file__).parent, site / "prometheus_client")
    archive = tmp_path / "job.pyz"
    assert main([JOB, "--requires", "prometheus_client", "-o", str(archive)]) == 0
    python = _host_pythons()[-1]
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    ran = subprocess.run(
        [python, "-S", str(archive), "status", str(tmp_path / "none.jsonl")],
        capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip
    assert ran.returncode == 2, ran.stderr
    assert "no job ledger beside it" in ran.stderr
    bare = subprocess.run(
        [python, "-I", "-S", str(archive), "--help"], capture_output=True, text=True, check=False
    )
    assert bare.returncode == 1 and "prometheus_client" in bare.stderr
