"""plugins/modules/ml_env_versions.py: SGLang versions side by side, who uses each, and the only
changes
made to them (docs/UPGRADES.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_plugin

versions = load_plugin("plugins/modules/ml_env_versions.py")
configs = load_plugin("plugins/module_utils/server_configs.py")


def make_version(root: Path, name: str, key: str = "k1", complete: bool = True) -> Path:
    venv = root / "versions" / name
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    if complete:
        (venv / "sglang-fleet-env.json").write_text(json.dumps({"version": name, "key": key}))
    return venv


def dropin(units: Path, unit: str, python: str) -> None:
    folder = units / f"{unit}.d"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "10-launch.conf").write_text(
        f"[Service]\nExecStart=\nExecStart={python} -m sglang.launch_server --port 1\n"
    )


def no_units(argv: list[str], timeout: float) -> tuple[int, str, str]:
    return 0, "", ""


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    paths = {"root": tmp_path / "ml-env", "units": tmp_path / "units", "state": tmp_path / "state"}
    for path in paths.values():
        path.mkdir()
    return paths


def survey(host: dict[str, Path], run=no_units) -> dict:
    return versions.survey(str(host["root"]), "k1", run, str(host["units"]), str(host["state"]))


def test_users_come_from_units_last_known_good_and_running_processes(
    host: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = host["root"]
    for name in ("0.5.21", "0.5.22", "0.5.23"):
        make_version(root, name)
    dropin(host["units"], "sglang@a.service", f"{root}/versions/0.5.23/bin/python")
    dropin(host["units"], "other.service", f"{root}/versions/0.5.21/bin/python")  # not ours
    lkg = host["state"] / "a" / "lkg"
    lkg.mkdir(parents=True)
    (lkg / "10-launch.conf").write_text(f"ExecStart={root}/versions/0.5.22/bin/python -m x\n")
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(f"{root}/versions/0.5.21/bin/python\0-m\0sglang.launch_server\0".encode())
    monkeypatch.setattr(
        versions, "read_regular",
        lambda path, limit: cmdline.read_bytes() if path == "/proc/42/cmdline" else
        Path(path).read_bytes() if Path(path).exists() else None,
    )  # fmt: skip

    def run(argv: list[str], timeout: float) -> tuple[int, str, str]:
        if argv[1] == "list-units":
            return 0, "sglang@b.service loaded active running SGLang b\n", ""
        return 0, "42\n", ""

    found = {v["name"]: v["used_by"] for v in survey(host, run)["versions"]}
    assert found == {
        "0.5.21": ["sglang@b.service (running)"],
        "0.5.22": ["a (its last-known-good)"],
        "0.5.23": ["sglang@a.service (its unit)"],
    }


def test_prune_refuses_a_used_version_before_removing_anything(host: dict[str, Path]) -> None:
    root = host["root"]
    for name in ("0.5.20", "0.5.21", "0.5.22"):
        make_version(root, name)
    dropin(host["units"], "sglang@a.service", f"{root}/versions/0.5.21/bin/python")
    with pytest.raises(ValueError, match=r"ml_env_remove_versions .*0\.5\.21 \(used by sglang@a"):
        versions.prune(str(root), "0.5.22", survey(host), 3, ["0.5.20", "0.5.21"], False)
    assert sorted(p.name for p in (root / "versions").iterdir()) == ["0.5.20", "0.5.21", "0.5.22"]


def test_prune_keeps_wanted_and_used_and_removes_oldest_unused(host: dict[str, Path]) -> None:
    root = host["root"]
    for name in ("0.5.19", "0.5.20", "0.5.21", "0.5.22"):  # created oldest first
        make_version(root, name)
    (root / "versions" / ".building-0.5.23").mkdir()
    dropin(host["units"], "sglang@a.service", f"{root}/versions/0.5.19/bin/python")
    gone = versions.prune(str(root), "0.5.22", survey(host), 2, [], False)
    assert gone == ["0.5.20", "0.5.21"]
    assert sorted(p.name for p in (root / "versions").iterdir()) == ["0.5.19", "0.5.22"]


def test_prune_in_check_mode_removes_nothing(host: dict[str, Path]) -> None:
    root = host["root"]
    for name in ("0.5.20", "0.5.21", "0.5.22"):
        make_version(root, name)
    assert versions.prune(str(root), "0.5.22", survey(host), 1, [], True) == ["0.5.20", "0.5.21"]
    assert len(list((root / "versions").iterdir())) == 3


def test_wanted_version_is_never_pruned_by_name(host: dict[str, Path]) -> None:
    make_version(host["root"], "0.5.23")
    with pytest.raises(ValueError, match="ml_env_sglang_version"):
        versions.prune(str(host["root"]), "0.5.23", survey(host), 3, ["0.5.23"], False)


def test_install_puts_a_complete_build_in_place_and_refuses_a_used_one(
    host: dict[str, Path],
) -> None:
    root = host["root"]
    old = make_version(root, "0.5.23", key="old")
    (old / "canary").write_text("")
    build = root / "versions" / ".building-0.5.23"
    (build / "bin").mkdir(parents=True)
    (build / "bin" / "python").write_text("")
    (build / "sglang-fleet-env.json").write_text(json.dumps({"version": "0.5.23", "key": "k1"}))
    dropin(host["units"], "sglang@a.service", f"{root}/versions/0.5.23/bin/python")
    with pytest.raises(ValueError, match="never changed in place"):
        versions.install(str(root), "0.5.23", survey(host), False)
    assert (old / "canary").exists()
    (host["units"] / "sglang@a.service.d" / "10-launch.conf").unlink()
    assert versions.install(str(root), "0.5.23", survey(host), False) == ["0.5.23"]
    assert not (old / "canary").exists() and not build.exists()
    (entry,) = survey(host)["versions"]
    assert entry["ready"] and entry["key"] == "k1"


def test_incomplete_or_broken_versions_are_not_ready(host: dict[str, Path]) -> None:
    root = host["root"]
    make_version(root, "0.5.21", complete=False)
    broken = make_version(root, "0.5.22")
    (broken / "bin" / "python").unlink()
    (broken / "bin" / "python").symlink_to(root / "nowhere")
    assert [v["ready"] for v in survey(host)["versions"]] == [False, False]


def test_the_older_layout_is_reported_and_never_a_version(host: dict[str, Path]) -> None:
    root = host["root"]
    (root / "pyvenv.cfg").write_text("home = /usr/bin\n")
    dropin(host["units"], "sglang@a.service", f"{root}/bin/python")
    found = survey(host)
    assert found["legacy"] == {"present": True, "used_by": ["sglang@a.service (its unit)"]}
    assert found["versions"] == []


@pytest.mark.parametrize("line", ["ExecStart=", "Description=x"])
def test_drop_in_lines_without_an_interpreter(line: str) -> None:
    assert configs.exec_starts(line) == []


def test_a_drop_in_line_systemd_would_not_run_is_not_understood() -> None:
    # It used to be read as the interpreter "'unterminated" (outside the root: nobody's).
    with pytest.raises(configs.NotUnderstood, match="unbalanced quoting"):
        configs.exec_starts("ExecStart='unterminated")
