"""plugins/modules/sglang_state_files.py, run for real in a temporary folder: a server's small state
files (its calibration store, what is set aside beside it) written atomically with their mode,
only when they differ; the folder made when missing; nothing outside the folder, nothing through
a symlink; check mode writes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import load_plugin

module = load_plugin("plugins/modules/sglang_state_files.py")


def test_files_are_written_once_with_their_mode(tmp_path: Path) -> None:
    folder = tmp_path / "state" / "llama"
    files = [
        {"name": "calibration.json", "content": "{}\n", "mode": "0644"},
        {"name": "calibration.set-aside-1.json", "content": "[]\n", "mode": "0600"},
    ]
    done = module.write(str(folder), files, check_mode=False)
    assert done == {
        "changed": True,
        "written": ["calibration.json", "calibration.set-aside-1.json"],
    }
    assert (folder / "calibration.json").read_text() == "{}\n"
    assert (folder / "calibration.set-aside-1.json").stat().st_mode & 0o777 == 0o600
    assert module.write(str(folder), files, check_mode=False) == {"changed": False, "written": []}
    os.chmod(folder / "calibration.json", 0o666)
    assert module.write(str(folder), files[:1], False)["written"] == ["calibration.json"]
    assert (folder / "calibration.json").stat().st_mode & 0o777 == 0o644


def test_check_mode_writes_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    done = module.write(str(folder), [{"name": "c.json", "content": "x"}], check_mode=True)
    assert done["written"] == ["c.json"] and not folder.exists()


@pytest.mark.parametrize("name", ["../escape.json", "a/b.json", "..", "", "x\0y"])
def test_a_name_that_leaves_the_folder_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="is not a file name inside"):
        module.write(str(tmp_path), [{"name": name, "content": "x"}], check_mode=False)
    assert list(tmp_path.iterdir()) == []


def test_a_symlink_is_never_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text("keep")
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "calibration.json").symlink_to(outside)
    with pytest.raises(ValueError, match="is not a regular file"):
        module.write(str(folder), [{"name": "calibration.json", "content": "x"}], False)
    assert outside.read_text() == "keep"
    linked = tmp_path / "linked"
    linked.symlink_to(folder)
    with pytest.raises(ValueError, match="exists and is not a folder"):
        module.write(str(linked), [{"name": "c.json", "content": "x"}], False)
