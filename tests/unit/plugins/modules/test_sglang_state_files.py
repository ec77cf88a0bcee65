"""ansible-test units: the sglang_state_files module run as Ansible runs it (its arguments,
its JSON result), imported by the collection's name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_collections.sglang_fleet.fleet.plugins.modules import sglang_state_files


def _run(args: dict, capsys: pytest.CaptureFixture[str]) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        sglang_state_files.main()
    return json.loads(capsys.readouterr().out)


def test_writes_what_differs_then_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "kimi"
    args = {"folder": str(folder), "files": [{"name": "calibration.json", "content": "{}\n"}]}
    first = _run(args, capsys)
    assert (first["changed"], first["written"]) == (True, ["calibration.json"])
    assert (folder / "calibration.json").read_text() == "{}\n"
    second = _run(args, capsys)
    assert (second["changed"], second["written"]) == (False, [])


def test_a_name_outside_the_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = {"folder": str(tmp_path), "files": [{"name": "../escape", "content": "x"}]}
    result = _run(args, capsys)
    assert result["failed"] is True
    assert "state files" in result["msg"]
    assert not (tmp_path.parent / "escape").exists()
