"""Last-known-good in one step: action_plugins/sglang_last_known_good.py and its module.

The module runs for real in a temporary folder: the files and the record are kept (0600, in a
0700 folder), a second run with the same content writes nothing, a stale secrets file goes, a
name that would leave the folder or a symlinked source is refused, and check mode writes
nothing. The action is run against that module through a fake `_execute_module`: the record it
builds, the module run under no_log, and a --diff that shows the flags without a secret.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import load_plugin

module = load_plugin("library/sglang_last_known_good.py")
ACTION = load_plugin("action_plugins/sglang_last_known_good.py")
KEY = "sk-very-secret"


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "etc").mkdir()
    files = {
        "dropin": tmp_path / "etc" / "10-launch.conf",
        "env_file": tmp_path / "etc" / "llama.env",
        "secrets_file": tmp_path / "etc" / "llama.secrets.yaml",
    }
    files["dropin"].write_text("[Service]\nExecStart=...\n")
    files["env_file"].write_text("NCCL_PROTO=LL\n")
    files["secrets_file"].write_text(f"api_key: {KEY}\n")
    return {**files, "lkg_dir": tmp_path / "state" / "llama" / "lkg"}


def keep_params(host: dict[str, Path], secrets: bool, record: dict | None = None) -> dict:
    files = [{"name": "10-launch.conf", "src": str(host["dropin"])},
             {"name": "server.env", "src": str(host["env_file"])}]  # fmt: skip
    if secrets:
        files.append({"name": "secrets.yaml", "src": str(host["secrets_file"])})
    return {
        "lkg_dir": str(host["lkg_dir"]),
        "files": files,
        "absent": [] if secrets else ["secrets.yaml"],
        "record": record or {"server": "llama", "config_hash": "abc123", "flags": {}},
    }


def test_the_files_and_the_record_are_kept_once(host: dict[str, Path]) -> None:
    done = module.keep(keep_params(host, secrets=True), check_mode=False)
    lkg = host["lkg_dir"]
    assert done["changed"] and sorted(done["written"]) == [
        "10-launch.conf", "meta.json", "secrets.yaml", "server.env"]  # fmt: skip
    assert done["previous"] is None
    assert (lkg / "secrets.yaml").read_text() == f"api_key: {KEY}\n"
    assert all((lkg / n).stat().st_mode & 0o777 == 0o600 for n in os.listdir(lkg))
    assert lkg.stat().st_mode & 0o777 == 0o700
    assert json.loads((lkg / "meta.json").read_text())["config_hash"] == "abc123"
    again = module.keep(keep_params(host, secrets=True), check_mode=False)
    assert again == {"changed": False, "written": [], "previous": json.loads(
        (lkg / "meta.json").read_text())}  # fmt: skip


def test_a_stale_secrets_file_goes_and_check_mode_writes_nothing(host: dict[str, Path]) -> None:
    module.keep(keep_params(host, secrets=True), check_mode=False)
    record = {"server": "llama", "config_hash": "def456", "flags": {}}
    would = module.keep(keep_params(host, secrets=False, record=record), check_mode=True)
    assert sorted(would["written"]) == ["meta.json", "secrets.yaml"]
    assert (host["lkg_dir"] / "secrets.yaml").exists()
    module.keep(keep_params(host, secrets=False, record=record), check_mode=False)
    assert not (host["lkg_dir"] / "secrets.yaml").exists()


def test_nothing_leaves_the_folder_or_follows_a_symlink(host: dict[str, Path]) -> None:
    outside = keep_params(host, secrets=False)
    outside["files"][0]["name"] = "../../escaped.conf"
    with pytest.raises(ValueError, match="is not a file name inside"):
        module.keep(outside, check_mode=False)
    link = host["dropin"].with_name("link.conf")
    link.symlink_to(host["secrets_file"])
    linked = keep_params(host, secrets=False)
    linked["files"][0]["src"] = str(link)
    with pytest.raises(ValueError, match="is not a regular file"):
        module.keep(linked, check_mode=False)


class FakeKeep(ACTION.ActionModule):
    def __init__(self, args: dict[str, Any], diff: bool = False):
        self._task = SimpleNamespace(args=args, async_val=0, check_mode=False, no_log=False,
                                     diff=diff, action="sglang_last_known_good")  # fmt: skip
        self._play_context = SimpleNamespace(check_mode=False)
        self._connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir="/tmp/ansible-tmp"))
        self.calls: list[tuple[str, dict, bool]] = []

    def _execute_module(self, module_name: str, module_args: dict, task_vars: Any = None) -> dict:
        self.calls.append((module_name, module_args, self._task.no_log))
        return module.keep(module_args, check_mode=False)


def described(host: dict[str, Path], flags: dict) -> dict[str, Any]:
    return {
        "name": "llama",
        "config_hash": "abc123",
        "flags": flags,
        "api_key_set": True,
        "paths": {key: str(value) for key, value in host.items()},
    }


def test_the_action_keeps_the_record_under_no_log_and_diffs_without_secrets(host) -> None:
    FakeKeep({"server": described(host, {"tp_size": 1})}).run(task_vars={})
    flags = {"tp_size": 2, "admin_api_key": "admin-secret"}
    action = FakeKeep(
        {"server": described(host, flags) | {"config_hash": "def456"}, "sglang_version": "0.5.23",
         "smoke_result": {"metrics": {"output_throughput": 100.0}}},
        diff=True,
    )  # fmt: skip
    result = action.run(task_vars={})
    [(name, _args, no_log)] = action.calls
    assert name == "sglang_last_known_good" and no_log is True
    assert result["record"]["sglang_version"] == "0.5.23"
    assert result["previous"] == "abc123" and "(was abc123)" in result["msg"]
    assert '"tp_size": 2' in result["diff"]["after"] and '"tp_size": 1' in result["diff"]["before"]
    assert "admin-secret" not in json.dumps(result)
    assert KEY not in json.dumps(result)
