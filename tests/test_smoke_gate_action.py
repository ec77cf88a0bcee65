"""plugins/action/sglang_smoke_gate.py: measure a fresh start, report, judge, in one step.

The host is replaced by a fake `_execute_module` (the folders, the benchmark command, the result
file, the journal, the last-known-good record) and the copy of the client by a stub; the report
and the picture are written for real into a temporary reports folder. What is checked: a
passing run hands its compact result on; a failing threshold and a server that returns fewer
tokens than asked fail naming why; the key reaches the client on stdin only, under no_log; a
benchmark that ran past its timeout says so; the relative gate reads last-known-good; an
unknown workload key fails before the host is touched; check mode runs nothing.
"""

from __future__ import annotations

import base64
import io
import json
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ansible.errors import AnsibleActionFail
from conftest import load_plugin

ACTION = load_plugin("plugins/action/sglang_smoke_gate.py")
KEY = "sk-very-secret"
SERVER = {"name": "llama", "unit": "sglang@llama.service", "port": 30000}
WORKLOAD = {"num_prompts": 4, "max_concurrency": 2, "random_input_len": 8, "random_output_len": 4}
CLIENT = "/usr/local/lib/sglang-fleet/smoke.pyz"


def smoke_result(short: int = 0, throughput: float = 120.0) -> dict[str, Any]:
    """What the client writes; `short` requests got fewer tokens than they asked for (the
    client counts them as failed, reason short_output)."""
    requests = 4
    return {
        "completed": requests - short,
        "failed": short,
        "failure_reasons": {"short_output": short} if short else {},
        "num_prompts": requests,
        "duration": 1.5,
        "concurrency": 1.8,
        "output_throughput": throughput,
        "request_throughput": 2.6,
        "input_throughput": 20.0,
        "p99_ttft_ms": 35.0,
        "p99_tpot_ms": 8.0,
        "mean_ttft_ms": 30.0,
        "goodput": None,
        "errors": [],
        "backend": "sglang",
        "random_input_len": 8,
        "random_output_len": 4,
        "max_concurrency": 2,
        "server_metrics": {},
    }


class FakeGate(ACTION.ActionModule):
    def __init__(self, args: dict[str, Any], host: dict[str, Any], check_mode: bool = False):
        self._task = SimpleNamespace(
            args=args, async_val=0, check_mode=check_mode, no_log=False, action="sglang_smoke_gate"
        )
        self._play_context = SimpleNamespace(check_mode=check_mode)
        self._connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir="/tmp/ansible-tmp"))
        self.host, self.calls, self.copied = host, [], []

    def _execute_module(self, module_name: str, module_args: dict, task_vars: Any = None) -> dict:
        name = module_name.rsplit(".", 1)[-1]
        self.calls.append((name, module_args, self._task.no_log))
        return getattr(self, "host_" + name)(module_args)

    def host_sglang_smoke_run(self, args: dict) -> dict:
        """The host's part: the client's command run, its result and the journal read back."""
        argv = args["argv"]
        client = zipfile.ZipFile(io.BytesIO(base64.b64decode(args["client_zipapp"])))
        assert b"from sglang_fleet.smoke.smoke_client.command_line import main" in client.read(
            "__main__.py"
        )
        self.copied.append(args["client_path"])
        result = json.dumps(self.host["result"])
        assert argv[argv.index("--json") + 1] == args["result_path"]
        answer = {
            "changed": True,
            "rc": self.host.get("rc", 0),
            "stderr_tail": self.host.get("stderr", ""),
            "result": result,
            "journal": self.host.get("journal", ""),
        }
        if args.get("baseline_path"):  # read back in the same run (no slurp of its own)
            answer["baseline"] = self.host["files"].get(args["baseline_path"])
        return answer

    def _picture(self, base: str) -> str:
        Path(base + ".png").write_bytes(b"png")
        return ""

    def run_it(self) -> dict[str, Any]:
        return self.run(task_vars={"inventory_hostname": "gpu-a"})


def gate_args(tmp_path: Path, **change: Any) -> dict[str, Any]:
    return {
        "server": SERVER,
        "workload": WORKLOAD,
        "python": "/usr/bin/python3",
        "client_path": CLIENT,
        "state_dir": "/var/lib/sglang-fleet",
        "reports_dir": str(tmp_path / "reports"),
        "api_key": KEY,
        "timeout": 60,
        "journal_lines": 100,
        "thresholds": {"max_failure_rate": 0.0},
    } | change


def test_a_passing_run_hands_its_compact_result_on(tmp_path: Path) -> None:
    action = FakeGate(gate_args(tmp_path), {"files": {}, "result": smoke_result()})
    result = action.run_it()
    assert not result.get("failed"), result["msg"]
    assert result["passed"] is True and result["summary"].startswith("PASS")
    report = Path(result["report"])
    assert report.parent == tmp_path / "reports" / "gpu-a" / "llama"
    assert json.loads(report.read_text())["completed"] == 4
    assert (
        report.with_suffix(".diagnosis.json").exists()
        or Path(str(report)[: -len(".json")] + ".diagnosis.json").exists()
    )
    kept = result["passed_result"]
    assert kept["metrics"]["output_throughput"] == 120.0 and kept["report"] == str(report)
    assert result["measured"]["passed"] is True and result["measured"]["report"] == str(report)
    assert "ansible_facts" not in result  # registered by the role (smoke_gate_run)
    assert result["lines"][0].startswith("gpu-a llama: PASS")
    assert action.copied == [CLIENT]


def test_the_key_reaches_the_client_on_stdin_only_under_no_log(tmp_path: Path) -> None:
    action = FakeGate(gate_args(tmp_path), {"files": {}, "result": smoke_result()})
    result = action.run_it()
    [(args, no_log)] = [(a, n) for name, a, n in action.calls if name == "sglang_smoke_run"]
    assert args["api_key"] == KEY and no_log is True
    assert KEY not in " ".join(args["argv"])
    assert KEY not in json.dumps(result)
    assert action._task.no_log is False  # restored


def test_a_server_that_returns_too_few_tokens_fails_the_gate(tmp_path: Path) -> None:
    host = {"files": {}, "result": smoke_result(short=1)}
    result = FakeGate(gate_args(tmp_path), host).run_it()
    assert result["failed"] is True and result["passed"] is False
    assert result["msg"].startswith("smoke gate: FAIL"), result["msg"]
    assert "short_output 1" in result["msg"], result["msg"]
    assert result["measured"]["passed"] is False
    assert result["passed_result"] is None


def test_a_missed_threshold_names_it(tmp_path: Path) -> None:
    args = gate_args(tmp_path, thresholds={"min_output_tok_s": 500})
    result = FakeGate(args, {"files": {}, "result": smoke_result()}).run_it()
    assert result["failed"] is True
    assert "output" in result["msg"] and "500" in result["msg"], result["msg"]


def test_the_relative_gate_reads_the_last_known_good_result(tmp_path: Path) -> None:
    baseline = {"metrics": {"output_throughput": 400.0}, "workload": {
        "backend": "sglang", "random_input_len": 8, "random_output_len": 4, "max_concurrency": 2,
        "num_prompts": 4}}  # fmt: skip
    meta = "/var/lib/sglang-fleet/llama/lkg/meta.json"
    host = {"files": {meta: json.dumps({"smoke_result": baseline})}, "result": smoke_result()}
    args = gate_args(tmp_path, thresholds={"max_regression_pct": 10})
    action = FakeGate(args, host)
    result = action.run_it()
    assert result["failed"] is True, result["summary"]
    assert "regress" in result["msg"] or "below" in result["msg"], result["msg"]
    # The record comes back with the benchmark's own module run: one module run on the host.
    assert [name for name, _, _ in action.calls] == ["sglang_smoke_run"]
    [(run_args, _)] = [(a, n) for name, a, n in action.calls if name == "sglang_smoke_run"]
    assert run_args["baseline_path"] == meta
    # Without a record the relative gate has nothing to compare with, and passes on the rest.
    result = FakeGate(args, {"files": {}, "result": smoke_result()}).run_it()
    assert not result.get("failed"), result["msg"]


def test_without_the_relative_gate_no_record_is_read(tmp_path: Path) -> None:
    action = FakeGate(gate_args(tmp_path), {"files": {}, "result": smoke_result()})
    action.run_it()
    [(run_args, _)] = [(a, n) for name, a, n in action.calls if name == "sglang_smoke_run"]
    assert run_args["baseline_path"] == ""


def test_the_picture_is_drawn_beside_the_rollout_not_waited_for(tmp_path: Path) -> None:
    """The gate starts the picture and goes on: the stand-in for the controller's Python draws
    only once the test says so after the gate returned, so a gate that waited for it would find
    it giving up (after 20 s, so that the test never hangs). What it says goes to the log."""
    go, base = tmp_path / "go", tmp_path / "20261205T000000Z"
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/bash\n"
        'png="${@: -1}"; echo "drawing $png" >&2\n'
        f'for _ in $(seq 400); do [ -e {go} ] && {{ echo drawn > "$png"; exit 0; }}\n'
        "sleep 0.05; done\n"
        'echo "gave up" > "$png"\n'
    )
    python.chmod(0o755)
    action = FakeGate(gate_args(tmp_path), {})
    action.begin({"ansible_playbook_python": str(python)})
    assert ACTION.ActionModule._picture(action, str(base)) == ""
    go.touch()
    png = Path(str(base) + ".png")
    for _ in range(400):
        if png.exists() and png.read_text():
            break
        time.sleep(0.05)
    assert png.read_text() == "drawn\n"
    assert f"drawing {png}" in Path(str(base) + ".png.log").read_text()


def test_a_picture_that_cannot_be_started_is_said(tmp_path: Path) -> None:
    action = FakeGate(gate_args(tmp_path), {})
    action.begin({"ansible_playbook_python": str(tmp_path / "no-such-python")})
    said = ACTION.ActionModule._picture(action, str(tmp_path / "no-such-folder" / "stamp"))
    assert "no-such-folder" in said


def test_a_benchmark_past_its_timeout_says_so(tmp_path: Path) -> None:
    host = {"files": {}, "result": smoke_result(), "rc": 124, "stderr": "killed"}
    result = FakeGate(gate_args(tmp_path), host).run_it()
    assert result["failed"] is True
    assert result["msg"] == (
        "smoke benchmark of llama failed: it ran past smoke_gate_timeout (60 s): killed"
    )


def test_an_unknown_workload_key_fails_before_the_host_is_touched(tmp_path: Path) -> None:
    action = FakeGate(
        gate_args(tmp_path, workload=WORKLOAD | {"prompts": 3}), {"files": {}, "result": {}}
    )
    with pytest.raises(AnsibleActionFail, match=r"smoke_gate_workload.prompts: not a workload"):
        action.run_it()
    assert action.calls == []


def test_check_mode_runs_nothing(tmp_path: Path) -> None:
    action = FakeGate(gate_args(tmp_path), {"files": {}, "result": {}}, check_mode=True)
    result = action.run_it()
    assert result["skipped"] is True and action.calls == []
    assert "would be benchmarked (4 requests)" in result["msg"]


class LockedGate(FakeGate):
    """The gate with the rollout lock: fleet_lock answers from `lock_answers`, in order."""

    def host_fleet_lock(self, args: dict) -> dict:
        return self.host["lock_answers"].pop(0) | {"lease_s": args.get("lease_s")}


LOCK = {"path": "/run/lock/sglang-fleet.lock", "token": "t-1", "lease_s": 900}


def test_the_lease_covers_the_benchmark_then_goes_back(tmp_path: Path) -> None:
    host = {"files": {}, "result": smoke_result(), "lock_answers": [{}, {}]}
    action = LockedGate(gate_args(tmp_path, lock=LOCK), host)
    result = action.run_it()
    assert not result.get("failed"), result["msg"]
    leases = [a["lease_s"] for name, a, _ in action.calls if name == "fleet_lock"]
    assert leases == [900 + 60, 900]
    names = [name for name, _, _ in action.calls]
    assert names.index("fleet_lock") < names.index("sglang_smoke_run")  # renewed before it runs


def test_a_lock_taken_over_fails_the_gate_without_a_benchmark(tmp_path: Path) -> None:
    gone = {"failed": True, "msg": "the lock is bob's now"}
    host = {"files": {}, "result": smoke_result(), "lock_answers": [gone, gone]}
    action = LockedGate(gate_args(tmp_path, lock=LOCK), host)
    result = action.run_it()
    assert result["failed"] is True and result["lock_lost"] is True
    assert "bob's" in result["msg"]
    assert "sglang_smoke_run" not in [name for name, _, _ in action.calls]
