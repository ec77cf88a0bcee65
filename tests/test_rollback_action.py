"""plugins/action/sglang_rollback.py and plugins/action/sglang_router_join.py: the rollback and
the router rejoin as verbs, their decisions in sglang_fleet/rollout/rollback.py.

The host is a fake `_execute_module` (and, for the rollback, a fake `_action` for the
last-known-good restore and the restart it runs). What is checked: a failure that lost the lock
or left the server untouched runs nothing on the host and says so; otherwise the kept files go
back and start (never with a router), or, without a record, the server is stopped and cleaned;
the failure message and the fleet summary's outcome follow; a replica this run took out goes
back into its router without asking, one it did not goes back only when its router answers;
the key only under no_log; check mode touches nothing.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from ansible.errors import AnsibleActionFail
from conftest import load_plugin

from sglang_fleet.rollout import rollback

ROLLBACK = load_plugin("plugins/action/sglang_rollback.py")
JOIN = load_plugin("plugins/action/sglang_router_join.py")
ROUTER = {"url": "http://10.0.0.5:30080", "worker_url": "http://10.0.0.11:30000"}
SERVER = {"name": "llama", "unit": "sglang@llama.service", "port": 30000, "gpus": [0, 1],
          "paths": {"lkg_dir": "/var/lib/sglang/llama/lkg"}, "router": ROUTER}  # fmt: skip
RESTART = {"launch_module": "sglang.launch_server", "owner_users": ["root", "sglang"],
           "cleanup": {}, "health": {"timeout": 600},
           "lock": {"path": "/run/lock/x.lock", "token": "t", "lease_s": 900}}  # fmt: skip
RECORD = {"config_hash": "abc123", "flags": {"tp": 2}}


def _task(args: dict[str, Any], check_mode: bool, action: str) -> SimpleNamespace:
    return SimpleNamespace(args=args, async_val=0, check_mode=check_mode, no_log=False,
                           action=action)  # fmt: skip


class FakeRollback(ROLLBACK.ActionModule):
    def __init__(self, args: dict[str, Any], host: dict[str, Any], check_mode: bool = False):
        self._task = _task(args, check_mode, "sglang_rollback")
        self._play_context = SimpleNamespace(check_mode=check_mode)
        self._connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir="/tmp/ansible-tmp"))
        self.host, self.calls = host, []

    def _action(self, name: str, task_args: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((name, task_args))
        if name == "sglang_last_known_good":
            found = self.host.get("lkg", True)
            return {"found": found, "record": RECORD if found else None, "steps": ["restored"]}
        return self.host.get("restart", {"changed": True, "downtime": {"downtime_seconds": 9.0},
                                         "steps": ["started"]})  # fmt: skip

    def _execute_module(self, module_name: str, module_args: dict, task_vars: Any = None) -> dict:
        name = module_name.rsplit(".", 1)[-1]
        self.calls.append((name, module_args))
        if name == "command":
            return {"rc": 0, "stdout": ""}
        return {"msg": "GPUs 0,1 clear"}


def run_rollback(host: dict[str, Any] | None = None, check_mode: bool = False, **args: Any):
    action = FakeRollback({"server": SERVER, "restart": RESTART, **args}, host or {}, check_mode)
    return action, action.run(task_vars={"inventory_hostname": "gpu-a"})


@pytest.mark.parametrize(
    ("failure", "decision"),
    [
        (None, rollback.GO_BACK),
        ({"msg": "gate failed"}, rollback.GO_BACK),
        ({"lock_lost": True, "untouched": True}, rollback.LOCK_LOST),
        ({"lock_lost": "False", "untouched": "True"}, rollback.UNTOUCHED),
    ],
)
def test_the_decision_reads_the_failed_steps_result(failure: dict | None, decision: str) -> None:
    assert rollback.decide(failure) == decision


def test_a_failed_rollout_goes_back_and_starts_its_kept_files_without_a_router() -> None:
    action, result = run_rollback(failure={"msg": "p99 TTFT 900 ms > 500 ms"})
    assert [name for name, _ in action.calls] == ["sglang_last_known_good", "sglang_restart"]
    assert action.calls[0][1] == {"server": SERVER, "state": "restored"}
    assert action.calls[1][1] == {**RESTART, "server": SERVER}  # no router: it left before
    assert result["rolled_back"] is True and result["rejoin"] is True
    assert result["row_outcome"] == "rolled back" and not result.get("failed")
    assert result["msg"] == (
        "llama: the new configuration failed: p99 TTFT 900 ms > 500 ms Rolled back to the "
        "last-known-good configuration abc123, which serves again."
    )
    assert result["restarted"]["downtime"] == {"downtime_seconds": 9.0}


@pytest.mark.parametrize(
    ("failure", "words"),
    [
        ({"msg": "renew failed", "lock_lost": True},
         "llama: the new configuration failed: renew failed " + rollback.LOCK_LOST_NOTE),
        ({"msg": "too few healthy", "untouched": True},
         "llama: its router would not let it go: too few healthy " + rollback.UNTOUCHED_NOTE),
    ],
)  # fmt: skip
def test_a_lost_lock_or_an_untouched_server_is_left_alone(failure: dict, words: str) -> None:
    action, result = run_rollback(failure=failure)
    assert action.calls == []
    assert result["msg"] == words and result["rolled_back"] is False
    assert result["rejoin"] is False and result["row_outcome"] == "failed"
    assert result["changed"] is False


def test_without_a_record_the_failed_server_is_stopped_and_cleaned() -> None:
    action, result = run_rollback({"lkg": False}, failure={"msg": "no health"})
    names = [name for name, _ in action.calls]
    assert names == ["sglang_last_known_good", "command", "gpu_cleanup"]
    assert action.calls[1][1]["argv"][-1] == "systemctl stop sglang@llama.service"
    assert action.calls[2][1]["gpus"] == [0, 1] and action.calls[2][1]["state"] == "clean"
    assert result["outcome"] == rollback.NO_LKG_NOTE and result["rejoin"] is False
    assert result["row_outcome"] == "failed"


def test_a_rollback_whose_start_fails_fails_the_host() -> None:
    failed = {"failed": True, "msg": "llama: health gate timed out", "lock_lost": False}
    _, result = run_rollback({"restart": failed}, failure={"msg": "gate failed"})
    assert result["failed"] is True and "rollback: llama: health gate timed out" in result["msg"]


def test_an_entry_point_rollback_says_what_it_did() -> None:
    _, result = run_rollback()
    assert result["msg"].startswith("llama: Rolled back to the last-known-good configuration")


@pytest.mark.parametrize("value", ["maybe", "lost", 2, 0.0, [], {"x": 1}, "true-ish"])
def test_a_flag_it_cannot_read_refuses_and_nothing_runs(value: Any) -> None:
    """Fail closed: a lock_lost/untouched/taken_out that is neither true nor false stops the
    verb before any step (a guess either way stops a server or skips a rejoin)."""
    with pytest.raises(ValueError, match=r"failure\.lock_lost must be true or false"):
        rollback.decide({"lock_lost": value})
    action = FakeRollback({"server": SERVER, "restart": RESTART,
                           "failure": {"untouched": value}}, {}, False)  # fmt: skip
    with pytest.raises(AnsibleActionFail, match=r"failure\.untouched must be true or false"):
        action.run(task_vars={"inventory_hostname": "gpu-a"})
    assert action.calls == []
    join = FakeJoin({"server": SERVER, "api_key": "sk-secret", "timeout": 60,
                     "taken_out": value}, {}, False)  # fmt: skip
    with pytest.raises(AnsibleActionFail, match="taken_out must be true or false"):
        join.run(task_vars={"inventory_hostname": "gpu-a"})
    assert join.calls == []


def test_rollback_check_mode_and_bad_arguments_touch_nothing() -> None:
    action, result = run_rollback(check_mode=True, failure={"msg": "x"})
    assert action.calls == [] and result["skipped"] is True
    with pytest.raises(AnsibleActionFail, match="unknown restart key"):
        run_rollback(restart={**RESTART, "router": ROUTER})
    with pytest.raises(AnsibleActionFail, match="failure must be"):
        run_rollback(failure="boom")


class FakeJoin(JOIN.ActionModule):
    def __init__(self, args: dict[str, Any], host: dict[str, Any], check_mode: bool = False):
        self._task = _task(args, check_mode, "sglang_router_join")
        self._play_context = SimpleNamespace(check_mode=check_mode)
        self._connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir="/tmp/ansible-tmp"))
        self.host, self.calls = host, []

    def _execute_module(self, module_name: str, module_args: dict, task_vars: Any = None) -> dict:
        name = module_name.rsplit(".", 1)[-1]
        self.calls.append((name, module_args, self._task.no_log, self._task.check_mode))
        if name == "uri":
            return self.host.get("liveness", {"status": 200})
        return self.host.get("workers", {"changed": True})


def run_join(host: dict[str, Any] | None = None, check_mode: bool = False, **args: Any):
    action = FakeJoin({"server": SERVER, "api_key": "sk-secret", "timeout": 60, **args},
                      host or {}, check_mode)  # fmt: skip
    return action, action.run(task_vars={"inventory_hostname": "gpu-a"})


def test_a_replica_this_run_took_out_goes_back_without_asking() -> None:
    action, result = run_join(taken_out=True)
    [(name, args, quiet, _)] = action.calls
    assert name == "sglang_router_workers" and quiet is True
    assert args == {"router_url": ROUTER["url"], "worker_url": ROUTER["worker_url"],
                    "state": "present", "timeout": 60, "api_key": "sk-secret"}  # fmt: skip
    assert result["joined"] is True and result["router_out"] is False
    assert "sk-secret" not in repr(result)


def test_one_it_did_not_take_out_goes_back_when_its_router_answers() -> None:
    action, result = run_join(taken_out=False)
    assert [call[0] for call in action.calls] == ["uri", "sglang_router_workers"]
    assert action.calls[0][1]["url"] == f"{ROUTER['url']}/liveness"
    assert action.calls[0][3] is False  # the probe reads, in check mode too
    assert result["joined"] is True


def test_a_router_that_does_not_answer_lists_it_itself_later() -> None:
    action, result = run_join({"liveness": {"status": -1, "msg": "refused"}}, taken_out="false")
    assert [call[0] for call in action.calls] == ["uri"]
    assert result["joined"] is False and not result.get("failed")
    assert "does not answer" in result["msg"] and "own worker list" in result["msg"]


def test_a_put_back_that_fails_fails_the_host() -> None:
    _, result = run_join({"workers": {"failed": True, "msg": "not healthy in 60 s"}},
                         taken_out=True)  # fmt: skip
    assert result["failed"] is True and "not healthy in 60 s" in result["msg"]
    assert result["router_out"] is True


def test_join_without_a_router_or_in_check_mode_touches_nothing() -> None:
    action, result = run_join(server={**SERVER, "router": None}, taken_out=True)
    assert action.calls == [] and result["skipped"] is True
    action, result = run_join(check_mode=True, taken_out=True)
    assert action.calls == [] and result["skipped"] is True


@pytest.mark.parametrize(
    ("taken_out", "answers", "plan"),
    [(True, None, "put back"), (False, True, "put back"), (False, False, "leave")],
)
def test_the_join_plan(taken_out: bool, answers: bool | None, plan: str) -> None:
    assert rollback.join_plan(taken_out, answers) == plan
