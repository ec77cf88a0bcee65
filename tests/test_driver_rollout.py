"""playbooks/driver_upgrade.yml's decision (sglang_fleet/rollout/driver_upgrade.py): which hosts
change, in
which order, the N-1 rule for replicas behind a router, every refusal before any host is
touched, and the lines it prints."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from ansible.utils.helpers import pct_to_int
from conftest import load_plugin

from sglang_fleet.rollout import driver_upgrade as dr

ROUTER = "http://gw:30000"


def driver(version: str = "580.95.05", installing: bool = True, gpus: int | None = 8) -> dict:
    return {
        "branch": "590",
        "installing": installing,
        "driver_version": version,
        "gpu_count": gpus,
        "state": "wrong_branch" if installing else "healthy",
        "message": "probe",
    }


def server(name: str, host: str, router: str | None = ROUTER, **extra: Any) -> dict:
    return {
        "name": name,
        "unit": f"sglang@{name}.service",
        "device": "cuda",
        "nodes": [],
        "router": {"url": router, "worker_url": f"http://{host}:8000"} if router else None,
        "lkg": True,
        **extra,
    }


def worker(host: str, healthy: bool = True, port: int = 8000) -> dict:
    return {"url": f"http://{host}:{port}", "is_healthy": healthy, "id": host}


def fleet(n: int = 3, **per_host: Any) -> tuple[list[str], dict[str, dict]]:
    """n hosts, each running one replica of one router, every replica listed healthy."""
    hosts = [f"gpu{i}" for i in range(1, n + 1)]
    workers = [worker(h) for h in hosts]
    reads = {}
    for h in hosts:
        reads[h] = {
            "accelerator": "cuda",
            "driver": driver(),
            "servers": [server(f"r-{h}", h)],
            "active_units": [f"sglang@r-{h}.service"],
            "routers": {f"r-{h}": {"workers": copy.deepcopy(workers), "error": ""}},
            "min_healthy_others": 1,
        }
        reads[h].update(per_host.get(h, {}))
    return hosts, reads


def direct_fleet(n: int) -> tuple[list[str], dict[str, dict]]:
    hosts = [f"gpu{i:02d}" for i in range(1, n + 1)]
    reads = {
        h: {
            "accelerator": "cuda",
            "driver": driver(),
            "servers": [server("kimi", h, router=None)],
            "active_units": ["sglang@kimi.service"],
            "routers": {},
        }
        for h in hosts
    }
    return hosts, reads


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([1, "25%"], [1, "25%"]),
        (2, [2]),
        ("3", [3]),
        ("50%", ["50%"]),
        ([1, "2", " 100%"], [1, 2, "100%"]),
    ],
)
def test_serial_values_ansible_understands(value: Any, expected: list) -> None:
    assert dr.check_serial(value) == expected


@pytest.mark.parametrize(
    "value", [0, -1, "0", "0%", "101%", "abc", 1.5, True, [], [1, None], [1, [2]], {"a": 1}]
)
def test_a_bad_serial_is_refused_naming_the_variable(value: Any) -> None:
    with pytest.raises(dr.DriverRolloutError) as caught:
        dr.check_serial(value)
    assert caught.value.variable == "driver_upgrade_serial"
    assert str(caught.value).startswith("driver_upgrade_serial: ")


@pytest.mark.parametrize(("value", "expected"), [("590", "590"), (590, "590")])
def test_branch_values(value: Any, expected: str) -> None:
    assert dr.check_branch(value) == expected


@pytest.mark.parametrize("value", ["latest", "590.10", "", 0, True, None, "r590"])
def test_a_non_numeric_branch_is_refused_naming_the_variable(value: Any) -> None:
    with pytest.raises(dr.DriverRolloutError, match=r"^nvidia_driver_branch: "):
        dr.check_branch(value)


def test_settings_problems_name_every_bad_setting() -> None:
    assert dr.settings_problems([1, "25%"], "590") == []
    assert dr.settings_problems([1, "25%"]) == []  # branch unset: the role's default
    problems = dr.settings_problems("0", "newest")
    assert [p.split(":")[0] for p in problems] == ["driver_upgrade_serial", "nvidia_driver_branch"]


def test_batches_match_ansible_serial() -> None:
    hosts = [f"h{i}" for i in range(10)]
    # [1, '25%'] of 10: a canary, then int(2.5) = 2 at a time.
    assert [len(b) for b in dr.batches(hosts, [1, "25%"])] == [1, 2, 2, 2, 2, 1]
    assert [len(b) for b in dr.batches(hosts, [1, 5, "50%"])] == [1, 5, 4]
    assert [len(b) for b in dr.batches(hosts[:3], ["10%"])] == [1, 1, 1]  # never 0
    assert dr.batches([], [1]) == []
    assert [h for b in dr.batches(hosts, 3) for h in b] == hosts  # every host once, in order


def test_batches_equal_ansibles_own() -> None:
    """The same numbers as Ansible's playbook executor (helpers.pct_to_int)."""
    for total in (1, 3, 7, 10, 33):
        for serial in ([1, "25%"], ["30%"], [2, "10%", 5]):
            sizes = [len(b) for b in dr.batches([str(i) for i in range(total)], serial)]
            left, index, expected = total, 0, []
            while left > 0:
                size = pct_to_int(serial[index], total)
                expected.append(min(size, left))
                left -= size
                index = min(index + 1, len(serial) - 1)
            assert sizes == expected, (total, serial)


# ------------------------------------------------------------------ which hosts, which order


def test_routed_hosts_go_alone_first_then_the_others_in_batches() -> None:
    hosts, reads = fleet(2)
    d_hosts, d_reads = direct_fleet(5)
    reads.update(d_reads)
    plan = dr.plan(hosts + d_hosts, reads, [1, "50%"])
    assert plan["problems"] == []
    assert plan["routed"] == ["gpu1", "gpu2"]
    assert plan["direct"] == d_hosts
    assert plan["hosts"]["gpu1"]["when"] == "alone, 1 of 2 (replicas behind a router)"
    assert plan["hosts"]["gpu01"]["when"] == "batch 1 of 3 (canary)"
    assert plan["hosts"]["gpu02"]["when"] == "batch 2 of 3"
    assert plan["hosts"]["gpu05"]["when"] == "batch 3 of 3"
    assert plan["hosts"]["gpu01"]["stop"] == ["kimi"]
    assert plan["hosts"]["gpu01"]["clean_gpus"] == list(range(8))


def test_hosts_already_on_the_branch_and_cpu_hosts_are_left_alone() -> None:
    hosts, reads = direct_fleet(3)
    reads["gpu02"]["driver"] = driver("590.10.01", installing=False)
    reads["gpu03"] = {"accelerator": "cpu", "driver": None, "servers": [], "active_units": []}
    plan = dr.plan(hosts, reads)
    assert plan["direct"] == ["gpu01"]
    assert plan["hosts"]["gpu02"]["change"] is False
    assert plan["hosts"]["gpu02"]["stop"] == []
    assert plan["hosts"]["gpu02"]["when"] == "up to date"
    assert plan["hosts"]["gpu03"]["when"] == "CPU host: no driver"


def test_only_running_servers_stop_and_come_back() -> None:
    hosts, reads = direct_fleet(1)
    reads["gpu01"]["servers"].append(server("idle", "gpu01", router=None, lkg=False))
    plan = dr.plan(hosts, reads)
    assert plan["problems"] == []  # a stopped server needs no last-known-good to stay stopped
    assert plan["hosts"]["gpu01"]["stop"] == ["kimi"]


def test_a_host_whose_nvidia_smi_does_not_answer_is_not_cleaned_when_nothing_runs() -> None:
    hosts, reads = direct_fleet(1)
    reads["gpu01"]["driver"] = driver(version=None, gpus=None)
    reads["gpu01"]["active_units"] = []
    plan = dr.plan(hosts, reads)
    assert plan["problems"] == []
    assert plan["hosts"]["gpu01"]["clean_gpus"] == []
    assert plan["hosts"]["gpu01"]["change"]


# --------------------------------------------------------------------------- the N-1 rule


def test_a_healthy_router_fleet_may_start() -> None:
    hosts, reads = fleet(3)
    plan = dr.plan(hosts, reads)
    assert plan["problems"] == []
    assert plan["routed"] == hosts


def test_an_unhealthy_replica_refuses_the_run() -> None:
    hosts, reads = fleet(3)
    for h in hosts:
        reads[h]["routers"][f"r-{h}"]["workers"][2]["is_healthy"] = False
    problems = dr.plan(hosts, reads)["problems"]
    assert len(problems) == 1
    assert "worker http://gpu3:8000 is not healthy" in problems[0]
    assert "fewer than N-1 of its 3" in problems[0]


def test_a_replica_the_router_does_not_list_refuses_the_run() -> None:
    hosts, reads = fleet(3)
    for h in hosts:
        reads[h]["routers"][f"r-{h}"]["workers"].pop(0)
    problems = dr.plan(hosts, reads)["problems"]
    assert any("r-gpu1 on gpu1 (http://gpu1:8000) is not in its worker list" in p for p in problems)


def test_a_stopped_replica_on_a_host_that_does_not_change_still_counts() -> None:
    """Another replica already out means one more out would leave N-2."""
    hosts, reads = fleet(3)
    reads["gpu3"]["driver"] = driver("590.10.01", installing=False)
    reads["gpu3"]["active_units"] = []
    for h in hosts:
        reads[h]["routers"][f"r-{h}"]["workers"][2]["is_healthy"] = False
    problems = dr.plan(hosts, reads)["problems"]
    assert any("http://gpu3:8000 is not healthy" in p for p in problems)


def test_a_single_replica_router_is_refused_unless_the_operator_accepts_the_outage() -> None:
    hosts, reads = fleet(1)
    problems = dr.plan(hosts, reads)["problems"]
    assert problems == [
        "router http://gw:30000 lists 1 replica(s): taking the one on gpu1 out leaves 0, fewer "
        "than sglang_server_router_min_healthy_others (1); add a replica first, or set it to 0 "
        "on that host to accept the outage"
    ]
    reads["gpu1"]["min_healthy_others"] = 0
    assert dr.plan(hosts, reads)["problems"] == []


def test_two_replicas_of_one_router_on_one_host_are_refused() -> None:
    hosts, reads = fleet(3)
    extra = server("r-gpu1-b", "gpu1")
    extra["router"]["worker_url"] = "http://gpu1:8001"
    reads["gpu1"]["servers"].append(extra)
    reads["gpu1"]["active_units"].append("sglang@r-gpu1-b.service")
    for h in hosts:
        reads[h]["routers"][f"r-{h}"]["workers"].append(worker("gpu1", port=8001))
    reads["gpu1"]["routers"]["r-gpu1-b"] = copy.deepcopy(reads["gpu1"]["routers"]["r-gpu1"])
    problems = dr.plan(hosts, reads)["problems"]
    assert problems == [
        "router http://gw:30000: gpu1 holds 2 of its replicas (r-gpu1, r-gpu1-b): the host's "
        "reboot takes them out together, below N-1 of 4"
    ]


def test_one_router_under_two_urls_is_one_router() -> None:
    """The gateway reaches its own router on loopback, the others by name: one router, N=2."""
    hosts, reads = fleet(2)
    reads["gpu1"]["servers"][0]["router"]["url"] = "http://127.0.0.1:30000"
    reads["gpu1"]["routers"]["r-gpu1"]["workers"][1]["is_healthy"] = False
    problems = dr.plan(hosts, reads)["problems"]
    # gpu2's replica is unhealthy in the list gpu1 read: both lists are the same router's.
    assert any("worker http://gpu2:8000 is not healthy" in p for p in problems)


def test_a_router_that_does_not_answer_refuses_the_run() -> None:
    hosts, reads = fleet(2)
    reads["gpu2"]["routers"]["r-gpu2"] = {"workers": [], "error": "cannot reach the router"}
    problems = dr.plan(hosts, reads)["problems"]
    assert problems == [
        "router http://gw:30000 (asked from gpu2 for r-gpu2): cannot reach the router: the "
        "router's replicas cannot be proven healthy"
    ]


def test_a_router_that_loses_no_replica_is_not_asked_to_be_healthy() -> None:
    hosts, reads = fleet(2)
    for h in hosts:
        reads[h]["driver"] = driver("590.10.01", installing=False)
        reads[h]["routers"][f"r-{h}"] = {"workers": [], "error": "down"}
    assert dr.plan(hosts, reads)["problems"] == []


# ---------------------------------------------------------- servers that could not come back


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"lkg": False}, "kimi runs without a last-known-good record"),
        ({"nodes": ["gpu01", "gpu09"]}, "kimi runs across hosts (gpu01, gpu09)"),
        ({"device": "cpu"}, "kimi runs on SGLang's CPU engine"),
    ],
)
def test_a_running_server_that_could_not_come_back_refuses_the_run(
    change: dict, expected: str
) -> None:
    hosts, reads = direct_fleet(2)
    reads["gpu01"]["servers"][0].update(change)
    problems = dr.plan(hosts, reads)["problems"]
    assert len(problems) == 1
    assert problems[0].startswith(f"gpu01: {expected}")


def test_an_undescribed_unit_refuses_the_run() -> None:
    hosts, reads = direct_fleet(1)
    reads["gpu01"]["active_units"].append("sglang@old.service")
    [problem] = dr.plan(hosts, reads)["problems"]
    assert problem.startswith("gpu01: sglang@old.service run(s) but no server")


def test_running_servers_without_nvidia_smi_refuse_the_run() -> None:
    hosts, reads = direct_fleet(1)
    reads["gpu01"]["driver"] = driver(version=None, gpus=None)
    reads["gpu01"]["driver"]["message"] = "Driver/library version mismatch"
    [problem] = dr.plan(hosts, reads)["problems"]
    assert "nvidia-smi does not answer (Driver/library version mismatch)" in problem


def test_problems_of_hosts_that_do_not_change_do_not_count() -> None:
    hosts, reads = direct_fleet(2)
    reads["gpu02"]["driver"] = driver("590.10.01", installing=False)
    reads["gpu02"]["servers"][0]["lkg"] = False
    assert dr.plan(hosts, reads)["problems"] == []


def test_a_bad_serial_is_a_problem_of_the_plan_too() -> None:
    hosts, reads = direct_fleet(2)
    problems = dr.plan(hosts, reads, [0])["problems"]
    assert [p.split(":")[0] for p in problems] == ["driver_upgrade_serial"]


# --------------------------------------------------------------------------- what it says


def test_the_table() -> None:
    hosts, reads = direct_fleet(2)
    reads["gpu02"]["driver"] = driver("590.10.01", installing=False)
    assert dr.plan(hosts, reads)["lines"] == [
        "HOST   DRIVER NOW  BRANCH  SERVERS THAT STOP  WHEN",
        "gpu01  580.95.05   590     kimi               batch 1 of 1",
        "gpu02  590.10.01   -       -                  up to date",
    ]


def test_the_summary_line() -> None:
    line = dr.host_summary(
        "gpu01",
        "580.95.05",
        "590.10.01",
        [{"name": "kimi", "healthy_at": 1042.5}, {"name": "llama", "healthy_at": "bad"}],
        1000.0,
    )
    assert line == (
        "gpu01: driver 580.95.05 -> 590.10.01; restarted kimi (out of service 42.5 s), llama; "
        "gates passed"
    )
    assert dr.host_summary("gpu02", None, "590.10.01", [], 0) == (
        "gpu02: driver none -> 590.10.01; no server to restart; gates passed"
    )


def test_the_down_report_names_what_stays_down() -> None:
    servers = [server("kimi", "h", router=None), server("llama", "h", router=None)]
    text = dr.down_report(
        "gpu01", ["kimi", "llama"], ["sglang@llama.service"], servers, "verify failed"
    )
    assert text.startswith("gpu01: the driver change failed: verify failed")
    assert "Down, left stopped: kimi." in text
    assert "playbooks/rollback.yml --limit gpu01" in text
    assert "Running, not through this run's gates: llama" in text
    assert text.endswith("hosts after this one were not touched.")
    assert "No server of this host was stopped." in dr.down_report("h", [], [], [], "x")
    # llama came back through its gates, then kimi failed.
    text = dr.down_report(
        "gpu01", ["llama", "kimi"], ["sglang@llama.service"], servers, "gate", restarted=["llama"]
    )
    assert "Back and serving (gates passed): llama." in text
    assert "Down, left stopped: kimi." in text
    assert "Running" not in text


# --------------------------------------------------------------------------- the filter plugin


def test_the_filter_reads_what_the_first_play_left_on_each_host() -> None:
    plugin = load_plugin("plugins/filter/sglang_driver.py")
    described = [
        {
            "name": "kimi",
            "unit": "sglang@kimi.service",
            "device": "cuda",
            "nodes": [],
            "router": None,
            "port": 8000,
        }
    ]
    hostvars = {
        "gpu01": {
            "nvidia_driver_plan": driver(),
            "sglang_server_servers": described,
            "sglang_server_driver_read": {
                "active_units": ["sglang@kimi.service"],
                "lkg": {"kimi": True},
                "routers": {},
                "min_healthy_others": 1,
                "lock_path": "/run/lock/sglang-fleet.lock",
            },
        },
        "cpu01": {"ml_env_accelerator": "cpu"},
    }
    plan = plugin.driver_rollout_plan(["gpu01", "cpu01"], hostvars, [1, "25%"])
    assert plan["problems"] == []
    assert plan["direct"] == ["gpu01"]
    assert plan["hosts"]["gpu01"]["stop"] == ["kimi"]
    assert plan["hosts"]["cpu01"]["when"] == "CPU host: no driver"
    hostvars["gpu01"]["sglang_server_driver_read"]["lkg"] = {}
    [problem] = plugin.driver_rollout_plan(["gpu01"], hostvars)["problems"]
    assert "without a last-known-good record" in problem
    assert plugin.driver_rollout_settings_problems("0%", "590")[0].startswith(
        "driver_upgrade_serial: "
    )
    restarted = [{"name": "kimi", "healthy_at": 130.0}]
    assert plugin.driver_rollout_summary("gpu01", "580.95.05", "590.10.01", restarted, 100.0) == (
        "gpu01: driver 580.95.05 -> 590.10.01; restarted kimi (out of service 30.0 s); gates passed"
    )
    report = plugin.driver_rollout_down_report(
        "gpu01", ["kimi"], [], described, "verify failed", []
    )
    assert "Down, left stopped: kimi." in report
