"""deploy.yml's staging play checks what it stages before any host is touched (issue 33;
docs/STAGING.md): the play is run as it stands (its first play, on localhost in check mode),
with the inventory's servers or the role's settings made bad, and must stop at a task on the
control node naming the variable, before the role's first task on the host."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import run_local_play

ROOT = Path(__file__).resolve().parent.parent
FIRST_HOST_TASK = "Look for rsync"
GOOD = {
    "name": "llama",
    "model_path": "/models/llama/rev-a",
    "port": 8000,
    "gpus": [0],
    "model_source": {"rsync": "store:/srv/llama/rev-a", "revision": "rev-a"},
}


def _staging_play(variables: dict[str, Any]) -> dict[str, Any]:
    play = yaml.safe_load((ROOT / "playbooks" / "deploy.yml").read_text())[0]
    assert play["name"] == "Stage the weights while the running servers serve"
    return {**play, "hosts": "localhost", "become": False, "vars": variables}


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"sglang_server_instances": [{**GOOD, "model_path": "/models/llama/rev-a\nx"}]},
         "sglang_server_instances[llama].model_path"),
        ({"sglang_server_instances": [{**GOOD, "model_path": "/"}]},
         "sglang_server_instances[llama].model_path"),
        ({"sglang_server_instances": [
            {**GOOD, "model_source": {"rsync": "rsync://store/srv/llama", "revision": "rev-a"}}]},
         "sglang_server_instances[llama].model_source.rsync"),
        ({"sglang_server_instances": [GOOD], "model_stage_bwlimit_kbps": -5},
         "model_stage_bwlimit_kbps: must be an integer from 0 to 1099511627776, got -5"),
        ({"sglang_server_instances": [GOOD], "model_stage_keep": 0},
         "model_stage_keep: must be an integer from 1 to 1000, got 0"),
    ],
    ids=["model-path-newline", "model-path-root", "rsync-daemon-url", "negative-bwlimit",
         "keep-zero"],
)  # fmt: skip
def test_bad_staging_input_stops_the_play_before_any_host_task(
    tmp_path: Path, variables: dict[str, Any], named: str
) -> None:
    done = run_local_play(tmp_path, _staging_play(variables), "--check", timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert named in output, output
    assert f"TASK [model_stage : {FIRST_HOST_TASK}]" not in output, output


def test_the_staging_play_describes_the_servers_first() -> None:
    play = yaml.safe_load((ROOT / "playbooks" / "deploy.yml").read_text())[0]
    first = play["tasks"][0]
    assert first["ansible.builtin.include_role"]["tasks_from"] == "resolve", json.dumps(first)
    assert "when" not in first
