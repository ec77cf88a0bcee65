"""Last-known-good in one step: plugins/action/sglang_last_known_good.py and its module.

The module runs for real in a temporary folder: the files and the record are kept (0600, in a
0700 folder), a second run with the same content writes nothing, a stale secrets file goes, a
name that would leave the folder or a symlinked source is refused, and check mode writes
nothing; a restore puts back only what differs (and reloads systemd then), the secrets file
only when the kept set had a key, and says when there is no record. The action is run against
that module through a fake `_execute_module`: the record it builds, the module run under
no_log, and a --diff that shows the flags without a secret.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import load_plugin

module = load_plugin("plugins/modules/sglang_last_known_good.py")
ACTION = load_plugin("plugins/action/sglang_last_known_good.py")
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
        if module_args.get("state") == "restored":
            return module.restore(module_args, check_mode=False, reload=lambda: None)
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
    assert name == "sglang_fleet.fleet.sglang_last_known_good" and no_log is True
    assert result["record"]["sglang_version"] == "0.5.23"
    assert result["previous"] == "abc123" and "(was abc123)" in result["msg"]
    assert '"tp_size": 2' in result["diff"]["after"] and '"tp_size": 1' in result["diff"]["before"]
    assert "admin-secret" not in json.dumps(result)
    assert KEY not in json.dumps(result)


def restore_params(host: dict[str, Path]) -> dict:
    return {
        "lkg_dir": str(host["lkg_dir"]),
        "state": "restored",
        "files": [
            {"name": "10-launch.conf", "dest": str(host["dropin"]), "mode": "0644"},
            {"name": "server.env", "dest": str(host["env_file"]), "mode": "0644"},
            {"name": "secrets.yaml", "dest": str(host["secrets_file"]), "mode": "0600"},
        ],
    }


def test_a_restore_puts_back_what_differs_and_reloads_once(host: dict[str, Path]) -> None:
    record = {"server": "llama", "config_hash": "abc123", "flags": {}, "api_key_set": True}
    module.keep(keep_params(host, secrets=True, record=record), check_mode=False)
    host["dropin"].write_text("[Service]\nExecStart=... --mem-fraction-static 0.99\n")
    host["secrets_file"].write_text("api_key: sk-new\n")
    reloads: list[int] = []
    done = module.restore(restore_params(host), False, lambda: reloads.append(1))
    assert done["found"] and done["changed"] and reloads == [1]
    assert done["written"] == [str(host["dropin"]), str(host["secrets_file"])]
    assert host["dropin"].read_text() == "[Service]\nExecStart=...\n"
    assert host["secrets_file"].read_text() == f"api_key: {KEY}\n"
    assert host["secrets_file"].stat().st_mode & 0o777 == 0o600
    assert done["record"]["config_hash"] == "abc123"
    again = module.restore(restore_params(host), False, lambda: reloads.append(1))
    assert not again["changed"] and again["written"] == [] and reloads == [1]


def test_a_restore_without_a_key_leaves_the_secrets_file(host: dict[str, Path]) -> None:
    module.keep(keep_params(host, secrets=False), check_mode=False)
    host["secrets_file"].write_text("api_key: sk-new\n")
    done = module.restore(restore_params(host), False, lambda: None)
    assert not done["changed"] and host["secrets_file"].read_text() == "api_key: sk-new\n"


def test_a_restore_with_no_record_or_a_bad_one_changes_nothing(host: dict[str, Path]) -> None:
    done = module.restore(restore_params(host), False, lambda: pytest.fail("reloaded"))
    assert done == {"changed": False, "found": False, "record": None, "written": []}
    module.keep(keep_params(host, secrets=False), check_mode=False)
    (host["lkg_dir"] / "server.env").unlink()
    (host["lkg_dir"] / "server.env").symlink_to("/etc/shadow")
    with pytest.raises(ValueError, match="is not a regular file"):
        module.restore(restore_params(host), False, lambda: None)
    host["dropin"].write_text("changed\n")
    module.restore(restore_params(host) | {"files": restore_params(host)["files"][:1]}, True,
                   lambda: pytest.fail("reloaded in check mode"))  # fmt: skip
    assert host["dropin"].read_text() == "changed\n"


def test_the_action_restores_under_no_log_without_secrets_in_its_result(host) -> None:
    flags = {"tp_size": 2, "admin_api_key": "admin-secret"}
    FakeKeep({"server": described(host, flags)}).run(task_vars={})
    host["dropin"].write_text("edited by hand\n")
    action = FakeKeep({"server": described(host, flags), "state": "restored"})
    result = action.run(task_vars={})
    [(name, args, no_log)] = action.calls
    assert name == "sglang_fleet.fleet.sglang_last_known_good" and no_log is True
    assert args["state"] == "restored"
    assert result["found"] and result["changed"] and result["written"] == [str(host["dropin"])]
    assert result["record"]["flags"] == {"tp_size": 2}
    assert "admin-secret" not in json.dumps(result) and KEY not in json.dumps(result)
    assert "abc123 is in place" in result["msg"]


def test_a_node_of_a_server_across_hosts_records_nothing_another_node_failed_with(host) -> None:
    server = described(host, {"tp_size": 2}) | {"nodes": ["gpu-a", "gpu-b"]}
    hostvars = {
        "gpu-a": {"sglang_server_restarted": {"server": "llama"}, "smoke_gate_run": {}},
        "gpu-b": {"sglang_server_restarted": {"server": "llama", "failed": True}},
    }
    action = FakeKeep({"server": server})
    with pytest.raises(ACTION.AnsibleActionFail, match="node gpu-b of llama failed: every node"):
        action.run(task_vars={"hostvars": hostvars})
    assert action.calls == [] and not host["lkg_dir"].exists()
    hostvars["gpu-b"]["sglang_server_restarted"] = {"server": "llama"}
    FakeKeep({"server": server}).run(task_vars={"hostvars": hostvars})
    assert (host["lkg_dir"] / "meta.json").exists()
