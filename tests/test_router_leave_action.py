"""plugins/action/sglang_router_leave.py: a routed replica leaves its router before a stop
that is not a rollout's (a rollback, a GPU cleanup, an autotune trial).

The host is a fake `_execute_module`. What is checked: a running replica renews the lock for
the drain's bound, leaves through sglang_router_workers with the key under no_log only, and
reports its drain; one that does not run is not taken out; a router that refuses fails the
task with nothing removed; check mode and bad arguments touch nothing. The rollout's restart
runs the same take-out (tests/test_restart_action.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from ansible.errors import AnsibleActionFail
from conftest import load_plugin

ACTION = load_plugin("plugins/action/sglang_router_leave.py")
SERVER = {"name": "llama", "unit": "sglang@llama.service", "port": 30000}
ROUTER = {"url": "http://10.0.0.5:30080", "worker_url": "http://10.0.0.11:30000",
          "metrics_url": "http://10.0.0.11:30000/metrics"}  # fmt: skip
DRAIN = {"timeout": 60, "min_healthy_others": 1, "drain_timeout": 120}
LOCK = {"path": "/run/lock/sglang-fleet.lock", "token": "t-1", "lease_s": 900}
DRAINED = {"changed": True, "drained": True, "running_reqs": 0.0, "drain_seconds": 3.5}


class FakeLeave(ACTION.ActionModule):
    def __init__(self, args: dict[str, Any], host: dict[str, Any], check_mode: bool = False):
        self._task = SimpleNamespace(args=args, async_val=0, check_mode=check_mode, no_log=False,
                                     action="sglang_router_leave")  # fmt: skip
        self._play_context = SimpleNamespace(check_mode=check_mode)
        self._connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir="/tmp/ansible-tmp"))
        self.host, self.calls = host, []

    def _execute_module(self, module_name: str, module_args: dict, task_vars: Any = None) -> dict:
        name = module_name.rsplit(".", 1)[-1]
        self.calls.append((name, module_args, self._task.no_log))
        if name == "command":
            assert module_args["argv"][2].startswith("systemctl is-active")
            return {"rc": 0, "stdout": self.host.get("active", "active") + "\n"}
        if name == "fleet_lock":
            return {"lease_s": module_args.get("lease_s")}
        return self.host.get("router", DRAINED)

    def run_it(self) -> dict[str, Any]:
        return self.run(task_vars={"inventory_hostname": "gpu-a"})


def leave_args(**change: Any) -> dict[str, Any]:
    return {"server": SERVER, "router": ROUTER, "drain": DRAIN, "lock": LOCK,
            "api_key": "sk-secret"} | change  # fmt: skip


def test_a_running_replica_leaves_its_router_after_the_lease_covers_the_drain() -> None:
    action = FakeLeave(leave_args(), {})
    result = action.run_it()
    assert not result.get("failed"), result
    assert [name for name, _, _ in action.calls] == ["command", "fleet_lock",
                                                     "sglang_router_workers"]  # fmt: skip
    [(_, lock, _)] = [call for call in action.calls if call[0] == "fleet_lock"]
    assert lock == {"path": LOCK["path"], "state": "renewed", "token": "t-1", "lease_s": 1020}
    [(_, removal, quiet)] = [call for call in action.calls if call[0] == "sglang_router_workers"]
    assert removal == {"router_url": ROUTER["url"], "state": "absent",
                       "worker_url": ROUTER["worker_url"],
                       "drain_metrics_url": ROUTER["metrics_url"], "timeout": 60,
                       "min_healthy_others": 1, "drain_timeout": 120,
                       "api_key": "sk-secret"}  # fmt: skip
    assert quiet is True and action._task.no_log is False  # the key under no_log only
    assert result["router_out"] is True and result["changed"] is True
    assert result["drain"] == {"drained": True, "running_reqs": 0.0, "drain_seconds": 3.5}
    assert result["server"] == "llama" and "drained: True after 3.5 s" in result["msg"]
    assert "sk-secret" not in repr(result)


def test_a_replica_that_does_not_run_stays_listed() -> None:
    action = FakeLeave(leave_args(), {"active": "inactive"})
    result = action.run_it()
    assert [name for name, _, _ in action.calls] == ["command"]
    assert result["router_out"] is False and result["drain"] is None
    assert result["changed"] is False and not result.get("failed")


def test_a_router_that_refuses_fails_with_the_replica_still_listed() -> None:
    refused = {"failed": True, "msg": "refusing to remove http://10.0.0.11:30000: 0 other "
               "healthy worker(s) would be left, min_healthy_others is 1"}  # fmt: skip
    result = FakeLeave(leave_args(), {"router": refused}).run_it()
    assert result["failed"] is True and result["router_out"] is False
    assert "0 other healthy worker(s) would be left" in result["msg"]
    assert result["msg"].startswith("llama: taking it out of its router")


def test_without_a_lock_held_nothing_is_renewed() -> None:
    action = FakeLeave(leave_args(lock={"path": LOCK["path"], "token": ""}), {})
    assert action.run_it()["router_out"] is True
    assert "fleet_lock" not in [name for name, _, _ in action.calls]


def test_check_mode_touches_nothing() -> None:
    action = FakeLeave(leave_args(), {}, check_mode=True)
    result = action.run_it()
    assert result["skipped"] is True and action.calls == []
    assert "llama would leave its router" in result["msg"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"router": {"url": ROUTER["url"]}}, "router needs worker_url"),
        ({"drain": {"drain_timeout": 1, "grace": 2}}, r"unknown router or drain key\(s\)"),
        ({"router": None}, "router required"),
        ({"server": {"name": "llama"}}, "server must be a described server"),
    ],
)
def test_bad_arguments_fail_before_the_host_is_touched(change: dict, message: str) -> None:
    action = FakeLeave(leave_args(**change), {})
    with pytest.raises(AnsibleActionFail, match=message):
        action.run_it()
    assert action.calls == []
