"""playbooks/job.yml refuses bad input before any host is touched, naming the variable.

The inventory's hosts cannot be reached (TEST-NET-1 addresses, a two-second connect timeout):
a run that touched one would say UNREACHABLE. Each bad input must fail on the control node
instead, in the playbook's first plays, with the variable's name in the message; a good start
gets past them and only then reaches for a host (the control case: the harness does see a
touched host).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

INVENTORY = {
    "all": {
        "vars": {
            "ansible_connection": "ssh",
            "ansible_user": "nobody",
            "ansible_ssh_common_args": "-o ConnectTimeout=2 -o BatchMode=yes",
        },
        "children": {
            "gateways": {"hosts": {"gw": {"ansible_host": "192.0.2.10"}}},
            "gpu_hosts": {"hosts": {"gpu1": {"ansible_host": "192.0.2.11"}}},
        },
    }
}


def job_play(tmp_path: Path, **extra: object) -> subprocess.CompletedProcess[str]:
    inventory = tmp_path / "hosts.json"
    inventory.write_text(json.dumps(INVENTORY), encoding="utf-8")
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    argv = [str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", str(inventory)]
    argv += ["-e", json.dumps(extra), str(ROOT / "playbooks" / "job.yml")]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180, check=False)


def good_input(tmp_path: Path) -> str:
    path = tmp_path / "in.jsonl"
    path.write_text(
        json.dumps({"id": 1, "conversations": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    return str(path)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            {"sglang_job_action": "restart"},
            "sglang_job_action must be one of: start, status, stop, resume",
        ),
        ({"sglang_job_name": "a/b"}, "sglang_job_name must be a plain word"),
        (
            {"sglang_job_input": "/nonexistent/in.jsonl"},
            "sglang_job_input /nonexistent/in.jsonl: cannot read it",
        ),
        ({"sglang_job_input": "FIFO"}, "not a regular file"),
        ({"sglang_job_concurrency": 0}, "sglang_job_concurrency must be"),
        (
            {"sglang_job_host": "elsewhere"},
            "sglang_job_host elsewhere must be a host of the inventory",
        ),
        ({"sglang_job_api_key": "two words"}, "sglang_job_api_key must be one word"),
    ],
)
def test_bad_input_is_refused_before_any_host_is_touched(
    tmp_path: Path, change: dict[str, object], words: str
) -> None:
    extra: dict[str, object] = {"sglang_job_name": "eagle3", "sglang_job_action": "start",
                                "sglang_job_input": good_input(tmp_path), **change}  # fmt: skip
    if extra["sglang_job_input"] == "FIFO":
        fifo = tmp_path / "fifo.jsonl"
        os.mkfifo(fifo)
        extra["sglang_job_input"] = str(fifo)
    done = job_play(tmp_path, **extra)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode != 0, out[-2000:]
    assert words in out, out[-2000:]
    assert "UNREACHABLE" not in out and "unreachable=1" not in out, out[-2000:]
    assert "two words" not in out


def test_a_good_start_passes_the_checks_and_only_then_reaches_for_a_host(tmp_path: Path) -> None:
    done = job_play(
        tmp_path, sglang_job_name="eagle3", sglang_job_action="start",
        sglang_job_input=good_input(tmp_path), sglang_job_concurrency=4,
    )  # fmt: skip
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode != 0
    assert "job eagle3: 1 rows in" in out  # the input was read on the control node
    assert "UNREACHABLE" in out, out[-2000:]
