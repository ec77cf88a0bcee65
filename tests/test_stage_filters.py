"""The filters the model_stage and sglang_server roles call are registered under the names the
task files use (plugins/filter/model_stage.py, plugins/filter/sglang_stop.py), and they work
on what Ansible hands them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError
from conftest import load_plugin

ROOT = Path(__file__).resolve().parent.parent
stage = load_plugin("plugins/filter/model_stage.py")
stop = load_plugin("plugins/filter/sglang_stop.py")
REGISTERED = {**stage.FilterModule().filters(), **stop.FilterModule().filters()}


def _used_in(paths: list[Path], prefix: str) -> set[str]:
    # By FQCN (sglang_fleet.fleet.<filter>, docs/COLLECTION.md) or by short name.
    pattern = re.compile(rf"\|\s*(?:sglang_fleet\.fleet\.)?({prefix}[a-z_]+)")
    return {name for path in paths for name in pattern.findall(path.read_text())}


def test_every_filter_the_task_files_use_is_registered() -> None:
    files = [
        *(ROOT / "roles").glob("*/tasks/*.yml"),
        *(ROOT / "playbooks").glob("*.yml"),
    ]
    used = _used_in(files, "model_stage_") | _used_in(files, "sglang_(?:stop|downtime|drain)_")
    assert used, "the task files use these filters"
    assert used <= set(REGISTERED), used - set(REGISTERED)


def test_the_plan_filter_names_the_variable_of_a_bad_source() -> None:
    servers = [{"name": "a", "model_path": "/m/a", "model_source": {"rsync": "/s"}}]
    with pytest.raises(AnsibleFilterError, match=r"sglang_server_instances\[a\]\.model_source"):
        REGISTERED["model_stage_copies"](servers)


def test_the_summary_filter_reads_loop_results() -> None:
    results = [{"item": {"path": "/m/a"}, "changed": True, "copy_seconds": 2.5}]
    assert REGISTERED["model_stage_summary"](results)["/m/a"]["copy_seconds"] == 2.5


def test_the_stop_filters_take_ansible_s_values() -> None:
    downtime = {"was_running": True, "stop_result": "success", "downtime_seconds": 12.0}
    assert REGISTERED["sglang_downtime_seconds"](downtime) == 12.0
    assert REGISTERED["sglang_downtime_seconds"](None) is None
    assert REGISTERED["sglang_drain_note"](None, downtime) is None
    assert REGISTERED["sglang_stop_notes"](["a"], {"a": downtime}, {}) == [
        "a: down 12.0 s (stop to healthy)"
    ]


SETTINGS = {
    "model_stage_free_margin_gb": 50,
    "model_stage_keep": 2,
    "model_stage_bwlimit_kbps": 0,
    "model_stage_verify_workers": 4,
    "model_stage_timeout": 86400,
    "model_stage_poll": 10,
    "model_stage_manifest_name": "model.sha256.json",
    "model_stage_ssh_command": "ssh -o BatchMode=yes",
    "model_stage_hf_python": "",
    "model_stage_hf_endpoint": "",
}


def test_the_settings_filter_types_the_role_s_defaults() -> None:
    checked = REGISTERED["model_stage_settings"]({**SETTINGS, "model_stage_keep": "3"})
    assert checked["model_stage_keep"] == 3 and checked["model_stage_free_margin_gb"] == 50.0


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("model_stage_bwlimit_kbps", -5),
        ("model_stage_keep", 0),
        ("model_stage_verify_workers", 0),
        ("model_stage_free_margin_gb", float("nan")),
        ("model_stage_free_margin_gb", -1),
        ("model_stage_timeout", "1e400"),
        ("model_stage_ssh_command", "-oProxyCommand=sh"),
        ("model_stage_hf_python", "venv/bin/python"),
        ("model_stage_hf_endpoint", "http://user:pw@mirror/"),
        ("model_stage_manifest_name", "../m.json"),
    ],
)
def test_a_bad_setting_fails_naming_its_variable(variable: str, value: object) -> None:
    """Issue 33: a negative bandwidth limit reached rsync on the host."""
    with pytest.raises(AnsibleFilterError, match=rf"^{variable}: "):
        REGISTERED["model_stage_settings"]({**SETTINGS, variable: value})
