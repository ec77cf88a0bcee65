"""plugins/action/sglang_restart.py: stop, clean, start and health-gate one server in one step.

The host is replaced by a fake `_execute_module` (the shell steps, the cleanup, the lock) and
the health wait by a canned answer. What is checked: a restart renews the lock before the stop,
cleans only this server's GPUs with the operator's settings, starts after the clock and the
restart count are noted, and measures the downtime from the stop to the passed health gate; a
foreign process on its GPUs stops it before the start with the table; a failed health gate and
a lock another run took say so (the latter with lock_lost, before anything stopped); bad
settings fail before the host is touched; check mode touches nothing.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from ansible.errors import AnsibleActionFail
from conftest import load_plugin

from sglang_fleet.rollout import restart

ACTION = load_plugin("plugins/action/sglang_restart.py")
SERVER = {"name": "llama", "unit": "sglang@llama.service", "port": 30000, "gpus": [2, 3],
          "device": "cuda"}  # fmt: skip
LOCK = {"path": "/run/lock/sglang-fleet.lock", "token": "t-1", "lease_s": 900}


class FakeRestart(ACTION.ActionModule):
    def __init__(self, args: dict[str, Any], host: dict[str, Any], check_mode: bool = False):
        self._task = SimpleNamespace(args=args, async_val=0, check_mode=check_mode, no_log=False,
                                     action="sglang_restart")  # fmt: skip
        self._play_context = SimpleNamespace(check_mode=check_mode)
        self._connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir="/tmp/ansible-tmp"))
        self.host, self.calls = host, []

    def _execute_module(self, module_name: str, module_args: dict, task_vars: Any = None) -> dict:
        name = module_name.rsplit(".", 1)[-1]
        self.calls.append((name, module_args))
        return getattr(self, "host_" + name)(module_args)

    def host_command(self, args: dict) -> dict:
        script = args["argv"][2]
        if script.endswith("|| true") and "is-active" in script:
            return {"rc": 0, "stdout": self.host.get("active", "active") + "\n"}
        if "systemctl stop" in script:
            return {"rc": 0, "stdout": "1000.0\nactive\nsuccess\n"}
        if "systemctl start" in script:
            return {"rc": self.host.get("start_rc", 0), "stdout": "2\n1010\n", "stderr": "nope"}
        return {"rc": 0, "stdout": "1042.5\n"}  # the clock at the passed health gate

    def host_gpu_cleanup(self, _args: dict) -> dict:
        return self.host["cleanup"]

    def host_sglang_router_workers(self, args: dict) -> dict:
        self.router_no_log = self._task.no_log
        return self.host.get("router", DRAINED)

    def host_fleet_lock(self, args: dict) -> dict:
        return self.host.get("lock", {"lease_s": args.get("lease_s")})

    def _wait(self, server, health, lock) -> dict:
        self.waited = {"since": self._done["started_at"], "health": health, "lock": lock}
        self._done["health_s"] = 12.0
        return self.host["health"]

    def run_it(self) -> dict[str, Any]:
        return self.run(task_vars={"inventory_hostname": "gpu-a"})

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


CLEAN = {"msg": "GPUs 2,3 clear", "processes": []}
DRAINED = {"changed": True, "drained": True, "running_reqs": 0.0, "drain_seconds": 3.5}
ROUTER = {"url": "http://10.0.0.5:30080", "worker_url": "http://10.0.0.11:30000",
          "metrics_url": "http://10.0.0.11:30000/metrics"}  # fmt: skip
DRAIN = {"timeout": 60, "min_healthy_others": 1, "drain_timeout": 120}
HEALTHY = {"state": "healthy", "elapsed_s": 12.0}


def restart_args(**change: Any) -> dict[str, Any]:
    return {
        "server": SERVER,
        "launch_module": "sglang.launch_server",
        "owner_users": ["root", "sglang"],
        "cleanup": {"clear_timeout": "90", "device_glob": "/dev/nvidia*", "gpus": [0]},
        "health": {"timeout": 600, "poll_interval": 5},
        "lock": LOCK,
    } | change


def test_a_restart_renews_stops_cleans_starts_and_measures_the_downtime() -> None:
    action = FakeRestart(restart_args(), {"cleanup": CLEAN, "health": HEALTHY})
    result = action.run_it()
    assert not result.get("failed"), result["msg"]
    assert action.names() == ["fleet_lock", "command", "gpu_cleanup", "command", "command"]
    [cleanup] = [args for name, args in action.calls if name == "gpu_cleanup"]
    # This server's GPUs, unit and port; the operator's settings typed; the inventory's
    # gpu_cleanup_gpus (the `clean` entry point's) not taken.
    assert cleanup["gpus"] == [2, 3] and cleanup["accelerator"] == "gpu"
    assert cleanup["ours"]["units"] == ["sglang@llama.service"]
    assert cleanup["ours"]["ports"] == [30000] and cleanup["ours"]["users"] == ["root", "sglang"]
    assert cleanup["clear_timeout"] == 90.0 and cleanup["state"] == "clean"
    assert result["downtime"] == {"stop_result": "success", "was_running": True,
                                  "downtime_seconds": 42.5}  # fmt: skip
    assert (result["started_at"], result["restarts_baseline"]) == (1010.0, 2)
    assert action.waited["since"] == 1010.0 and action.waited["lock"] == LOCK
    assert result["health_s"] == 12.0 and result["changed"] is True
    assert "42.5 s of downtime" in result["msg"]


def test_a_foreign_process_on_its_gpus_stops_the_restart_before_the_start() -> None:
    holder = {"pid": 77, "user": "alice", "gpus": [2], "used_mib": 4096,
              "cmdline": "python train.py", "ours": False, "action": "block"}  # fmt: skip
    blocked = {"failed": True, "msg": "Foreign processes hold GPUs 2,3; nothing was killed.",
               "processes": [holder]}  # fmt: skip
    action = FakeRestart(restart_args(), {"cleanup": blocked, "health": HEALTHY})
    result = action.run_it()
    assert result["failed"] is True and result["lock_lost"] is False
    assert "Foreign processes hold GPUs 2,3" in result["msg"]
    assert "GPU 2: pid 77 (alice, 4096 MiB) python train.py [foreign, block]" in result["msg"]
    assert [n for n in action.names() if n == "command"] == ["command"]  # stopped, never started


def test_a_failed_health_gate_says_so_with_when_it_started() -> None:
    failed = {"failed": True, "msg": "llama failed to start after 9 s: CUDA out of memory"}
    result = FakeRestart(restart_args(), {"cleanup": CLEAN, "health": failed}).run_it()
    assert result["failed"] is True
    assert result["msg"] == "llama: llama failed to start after 9 s: CUDA out of memory"
    assert result["started_at"] == 1010.0  # the trial reads the journal since then


def test_a_lock_another_run_took_stops_before_anything_stopped() -> None:
    gone = {"failed": True, "msg": "the lock is bob's now"}
    action = FakeRestart(restart_args(), {"cleanup": CLEAN, "health": HEALTHY, "lock": gone})
    result = action.run_it()
    assert result["failed"] is True and result["lock_lost"] is True
    assert action.names() == ["fleet_lock"]


def test_without_a_lock_held_nothing_is_renewed() -> None:
    action = FakeRestart(restart_args(lock={"path": LOCK["path"], "token": ""}),
                         {"cleanup": CLEAN, "health": HEALTHY})  # fmt: skip
    action.run_it()
    assert "fleet_lock" not in action.names()


def test_a_cpu_server_is_cleaned_by_its_unit_and_port() -> None:
    cpu = {**SERVER, "device": "cpu", "gpus": []}
    action = FakeRestart(restart_args(server=cpu), {"cleanup": CLEAN, "health": HEALTHY})
    action.run_it()
    [cleanup] = [args for name, args in action.calls if name == "gpu_cleanup"]
    assert (cleanup["accelerator"], cleanup["gpus"]) == ("cpu", [])


@pytest.mark.parametrize(
    ("cleanup", "message"),
    [
        ({"term_timeout": 0}, "gpu_cleanup_term_timeout must be a number > 0 and <= 86400"),
        ({"term_timeout": 10**400}, "gpu_cleanup_term_timeout must be .*, got a 401-digit integer"),
        ({"clear_timeout": "9" * 5000}, "gpu_cleanup_clear_timeout must be .*5000 characters"),
        ({"poll_interval": "1e999"}, "gpu_cleanup_poll_interval must be a number > 0"),
        ({"clear_timeout": "soon"}, "gpu_cleanup_clear_timeout must be a number"),
        ({"max_used_mib": -1}, "gpu_cleanup_max_used_mib must be an integer from 0 to"),
        ({"max_used_mib": 10**30}, "gpu_cleanup_max_used_mib must be an integer from 0 to"),
        ({"device_glob": "dev/nvidia*"}, "gpu_cleanup_device_glob must be an absolute path"),
        ({"allow_kill_foreign": "maybe"}, "gpu_cleanup_allow_kill_foreign must be true or false"),
        ({"kill_everything": True}, "gpu_cleanup_kill_everything is not a cleanup setting"),
    ],
)
def test_bad_cleanup_settings_fail_before_the_host_is_touched(cleanup: dict, message: str) -> None:
    action = FakeRestart(restart_args(cleanup=cleanup), {"cleanup": CLEAN, "health": HEALTHY})
    with pytest.raises(AnsibleActionFail, match=message):
        action.run_it()
    assert action.calls == []


def test_check_mode_touches_nothing() -> None:
    action = FakeRestart(restart_args(), {"cleanup": CLEAN, "health": HEALTHY}, check_mode=True)
    result = action.run_it()
    assert result["skipped"] is True and action.calls == []


def test_the_downtime_runs_from_the_stop_to_the_health_gate() -> None:
    assert restart.downtime("100.25 inactive", "130.0\n") == {
        "was_running": False,
        "downtime_seconds": 29.8,
    }


def test_a_routed_replica_leaves_its_router_and_drains_before_the_stop() -> None:
    action = FakeRestart(restart_args(router=ROUTER, drain=DRAIN, api_key="sk-secret"),
                         {"cleanup": CLEAN, "health": HEALTHY})  # fmt: skip
    result = action.run_it()
    assert not result.get("failed"), result["msg"]
    assert action.names() == ["command", "fleet_lock", "sglang_router_workers", "fleet_lock",
                              "command", "gpu_cleanup", "command", "command"]  # fmt: skip
    # The lease covers the drain's bound, then goes back to its usual length for the stop.
    leases = [args.get("lease_s") for name, args in action.calls if name == "fleet_lock"]
    assert leases == [900 + 120, 900]
    [removal] = [args for name, args in action.calls if name == "sglang_router_workers"]
    assert removal == {"router_url": ROUTER["url"], "state": "absent",
                       "worker_url": ROUTER["worker_url"],
                       "drain_metrics_url": ROUTER["metrics_url"], "timeout": 60,
                       "min_healthy_others": 1, "drain_timeout": 120,
                       "api_key": "sk-secret"}  # fmt: skip
    assert action.router_no_log is True and action._task.no_log is False  # key under no_log only
    assert result["router_out"] is True
    assert result["drain"] == {"drained": True, "running_reqs": 0.0, "drain_seconds": 3.5}
    assert "sk-secret" not in repr(result)


def test_a_router_that_refuses_leaves_the_server_untouched() -> None:
    refused = {"failed": True, "msg": "refusing to remove http://10.0.0.11:30000: 0 other "
               "healthy worker(s) would be left, min_healthy_others is 1"}  # fmt: skip
    action = FakeRestart(restart_args(router=ROUTER, drain=DRAIN),
                         {"cleanup": CLEAN, "health": HEALTHY, "router": refused})  # fmt: skip
    result = action.run_it()
    assert result["failed"] is True and result["untouched"] is True
    assert result["router_out"] is False and result["changed"] is False
    assert "0 other healthy worker(s) would be left" in result["msg"]
    assert "gpu_cleanup" not in action.names()
    assert not any("systemctl stop" in args["argv"][2] for name, args in action.calls
                   if name == "command")  # fmt: skip


def test_a_replica_that_does_not_run_is_not_taken_out() -> None:
    action = FakeRestart(restart_args(router=ROUTER, drain=DRAIN),
                         {"cleanup": CLEAN, "health": HEALTHY, "active": "inactive"})  # fmt: skip
    result = action.run_it()
    assert "sglang_router_workers" not in action.names()
    assert result["router_out"] is False and result["drain"] is None


def test_a_failed_start_after_the_drain_is_not_untouched_and_stays_out() -> None:
    failed = {"failed": True, "msg": "llama failed to start after 9 s"}
    result = FakeRestart(restart_args(router=ROUTER, drain=DRAIN),
                         {"cleanup": CLEAN, "health": failed}).run_it()  # fmt: skip
    assert result["failed"] is True and result["untouched"] is False
    assert result["router_out"] is True  # the caller's rescue puts it back after the rollback


def test_a_router_without_its_urls_fails_before_the_host_is_touched() -> None:
    action = FakeRestart(restart_args(router={"url": ROUTER["url"]}),
                         {"cleanup": CLEAN, "health": HEALTHY})  # fmt: skip
    with pytest.raises(AnsibleActionFail, match="router needs worker_url"):
        action.run_it()
    assert action.calls == []


BIG = {"name": "big", "nodes": ["gpu-a", "gpu-b"]}


def test_every_node_that_passed_its_restart_and_node_0_its_gate_passed() -> None:
    ok = {"server": "big", "changed": True}
    hostvars = {
        "gpu-a": {"sglang_server_restarted": ok, "smoke_gate_run": {"passed_result": {}}},
        "gpu-b": {"sglang_server_restarted": ok},
    }
    assert restart.failed_nodes(BIG, hostvars) == []
    assert restart.failed_nodes({"name": "solo", "nodes": []}, {}) == []


@pytest.mark.parametrize(
    ("change", "failed"),
    [
        ({"gpu-b": {"sglang_server_restarted": {"server": "big", "failed": True}}}, ["gpu-b"]),
        # Node 0's gate failed; a node's gate result alone never counts for the others.
        (
            {
                "gpu-a": {
                    "sglang_server_restarted": {"server": "big"},
                    "smoke_gate_run": {"failed": True},
                }
            },
            ["gpu-a"],
        ),
        # A result of another server (an earlier one in the loop) is not this restart's.
        ({"gpu-b": {"sglang_server_restarted": {"server": "llama"}}}, ["gpu-b"]),
        ({"gpu-b": {}}, ["gpu-b"]),
    ],
)
def test_a_node_that_did_not_pass_is_named(change: dict, failed: list) -> None:
    hostvars = {
        "gpu-a": {"sglang_server_restarted": {"server": "big"}, "smoke_gate_run": {}},
        "gpu-b": {
            "sglang_server_restarted": {"server": "big"},
            "smoke_gate_run": {"failed": True},
        },
    } | change
    assert restart.failed_nodes(BIG, hostvars) == failed


def test_the_result_names_its_server_pass_or_fail() -> None:
    passed = FakeRestart(restart_args(), {"cleanup": CLEAN, "health": HEALTHY}).run_it()
    broken = {"failed": True, "msg": "llama failed to start"}
    failed = FakeRestart(restart_args(), {"cleanup": CLEAN, "health": broken}).run_it()
    assert passed["server"] == failed["server"] == "llama"
