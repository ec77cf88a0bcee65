"""The driver play's decisions and the clean step's take-out refuse when their inputs cannot be
read or typed (issue 44, item 1): sglang_fleet/rollout/driver_upgrade.py (which hosts change,
which servers stop and come back, which GPUs are cleaned first) and VerbAction._take_out
(whether a replica leaves its router before it stops).

Each test here failed on a8010cc (the fault its docstring names) and passes now.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from test_driver_rollout import direct_fleet, driver, fleet
from test_router_leave_action import FakeLeave, leave_args

from sglang_fleet.rollout import driver_upgrade as dr


def one_host(**driver_change: Any) -> tuple[list[str], dict[str, dict]]:
    hosts, reads = direct_fleet(1)
    reads["gpu01"]["driver"].update(driver_change)
    return hosts, reads


# --------------------------------------------------------------------------- the GPUs to clean


@pytest.mark.parametrize("count", ["0", -1, 8.7, True, "eight", 10**400, [8]])
def test_a_gpu_count_that_is_no_count_refuses_the_run(count: Any) -> None:
    """clean_gpus decides whether the clean (drain, stop, GPUs proven clear) runs before the
    reboot. a8010cc took "0" and -1 as no GPU to clean while servers ran (the clean skipped, the
    servers cut by the reboot), 8.7 as GPUs 0-7 and True as GPU 0; "eight" and 10**400 raised."""
    hosts, reads = one_host(gpu_count=count)
    plan = dr.plan(hosts, reads)
    # "0" is a count: then servers run where nvidia-smi sees no GPU, which refuses too.
    named = "nvidia-smi does not answer" if count == "0" else "gpu_count"
    assert any(named in problem for problem in plan["problems"]), plan["problems"]


def test_a_gpu_count_as_text_is_read_as_its_number() -> None:
    hosts, reads = one_host(gpu_count="8")
    plan = dr.plan(hosts, reads)
    assert plan["problems"] == [] and plan["hosts"]["gpu01"]["clean_gpus"] == list(range(8))


@pytest.mark.parametrize("installing", ["false", "no", 1, None])
def test_whether_the_driver_changes_must_be_a_bool(installing: Any) -> None:
    """a8010cc read the text "false" as true: the host's servers stopped for a driver the role
    does not install."""
    hosts, reads = one_host(installing=installing)
    plan = dr.plan(hosts, reads)
    assert any("installing" in problem for problem in plan["problems"]), plan


def test_a_gpu_host_whose_driver_plan_was_not_read_refuses() -> None:
    """a8010cc called a GPU host without nvidia_driver_plan "up to date"."""
    hosts, reads = direct_fleet(2)
    reads["gpu02"]["driver"] = None
    plan = dr.plan(hosts, reads)
    assert any("gpu02: nvidia_driver_plan was not read" in p for p in plan["problems"])


def test_an_accelerator_that_is_neither_cuda_nor_cpu_refuses() -> None:
    """a8010cc took "CUDA" as a CPU host: no driver to change, silently."""
    hosts, reads = direct_fleet(1)
    reads["gpu01"]["accelerator"] = "CUDA"
    assert any("ml_env_accelerator" in p for p in dr.plan(hosts, reads)["problems"])


# --------------------------------------------------------------------------- what runs


@pytest.mark.parametrize("active", ["sglang@kimi.service", None, [["sglang@kimi.service"]]])
def test_active_units_that_are_not_a_list_of_names_refuse(active: Any) -> None:
    """a8010cc iterated the text "sglang@kimi.service" as characters: no server ran, none was to
    come back after the clean stopped it."""
    hosts, reads = direct_fleet(1)
    reads["gpu01"]["active_units"] = active
    plan = dr.plan(hosts, reads)
    assert any("active now were not read" in p for p in plan["problems"]), plan


@pytest.mark.parametrize("others", [-1, "abc", 1.5, True, 10**400])
def test_min_healthy_others_is_typed(others: Any) -> None:
    """a8010cc took -1 as a setting that lets a single-replica router lose its only replica,
    1.5 and True as 1, and raised on "abc"."""
    hosts, reads = fleet(3)
    reads["gpu1"]["min_healthy_others"] = others
    plan = dr.plan(hosts, reads)
    assert any("sglang_server_router_min_healthy_others" in p for p in plan["problems"]), plan


@pytest.mark.parametrize(
    "answer",
    [
        {"workers": ["http://gpu1:8000"], "error": ""},
        {"workers": "http://gpu1:8000", "error": ""},
        {"workers": [{"is_healthy": True}], "error": ""},
        ["http://gpu1:8000"],
    ],
)
def test_a_router_answer_of_another_shape_refuses_the_run(answer: Any) -> None:
    """a8010cc raised AttributeError (a traceback, not the filter's error) on such an answer."""
    hosts, reads = fleet(2)
    reads["gpu1"]["routers"] = {"r-gpu1": copy.deepcopy(answer)}
    plan = dr.plan(hosts, reads)
    assert any("its worker list is not one" in p for p in plan["problems"]), plan


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize("branch", ["590\n", "0", 10**5000], ids=["newline", "zero", "huge"])
def test_a_branch_is_whole_ascii_digits(branch: Any) -> None:
    """`^[0-9]+$` with re.match took "590\\n"; str(10**5000) raised ValueError (Python's digit
    limit) out of settings_problems."""
    problems = dr.settings_problems([1], branch)
    assert [p.split(":")[0] for p in problems] == ["nvidia_driver_branch"]


@pytest.mark.parametrize("serial", ["²", ["1", "²"], [1, " 100% "], "25%\n"])
def test_a_serial_of_other_digits_is_a_problem_not_a_traceback(serial: Any) -> None:
    """str.isdigit() takes "²", which int() then refuses: a8010cc's settings_problems raised.
    A percentage with text after its % passed a8010cc's check (it stripped the text first),
    and Ansible's own reading (pct_to_int) then failed the play that uses it."""
    problems = dr.settings_problems(serial, "590")
    assert [p.split(":")[0] for p in problems] == ["driver_upgrade_serial"]


@pytest.mark.parametrize("healthy_at", [10**400, "1e999", float("nan")])
def test_the_summary_line_survives_a_time_that_is_no_number(healthy_at: Any) -> None:
    """a8010cc's float() let OverflowError out of the summary of a host that came back."""
    line = dr.host_summary("gpu01", "580", "590", [{"name": "kimi", "healthy_at": healthy_at}], 1.0)
    assert line == "gpu01: driver 580 -> 590; restarted kimi; gates passed"


# --------------------------------------------------------------------------- the take-out


@pytest.mark.parametrize("state", ["reloading", "refreshing", "deactivating"])
def test_a_replica_that_still_serves_leaves_its_router_before_it_stops(state: str) -> None:
    """a8010cc took anything but "active" as "does not run" and skipped the take-out: a
    reloading replica was stopped while its router still sent to it."""
    action = FakeLeave(leave_args(), {"active": state})
    result = action.run_it()
    assert [name for name, _, _ in action.calls] == [
        "command",
        "fleet_lock",
        "sglang_router_workers",
    ]
    assert result["router_out"] is True and not result.get("failed")


@pytest.mark.parametrize("state", ["", "unknown", "Failed to connect to bus"])
def test_a_unit_whose_state_cannot_be_read_is_not_stopped_without_its_take_out(
    state: str,
) -> None:
    """An empty or unexpected answer (systemctl not reachable): a8010cc skipped the drain."""
    action = FakeLeave(leave_args(), {"active": state})
    result = action.run_it()
    assert result["failed"] is True and "cannot be read" in result["msg"]
    assert [name for name, _, _ in action.calls] == ["command"]


def test_a_failed_state_read_refuses() -> None:
    class Unreachable(FakeLeave):
        def _execute_module(self, module_name: str, module_args: dict, task_vars: Any = None):
            if module_name.endswith("command"):
                self.calls.append(("command", module_args, False))
                return {"failed": True, "msg": "bash: not found", "rc": 127, "stdout": ""}
            return super()._execute_module(module_name, module_args, task_vars)

    result = Unreachable(leave_args(), {}).run_it()
    assert result["failed"] is True and "bash: not found" in result["msg"]


@pytest.mark.parametrize("state", ["inactive", "failed", "activating"])
def test_a_unit_that_serves_nothing_is_not_taken_out(state: str) -> None:
    action = FakeLeave(leave_args(), {"active": state})
    result = action.run_it()
    assert [name for name, _, _ in action.calls] == ["command"]
    assert result["router_out"] is False and not result.get("failed")


def test_a_healthy_plan_is_unchanged() -> None:
    hosts, reads = fleet(3)
    plan = dr.plan(hosts, reads)
    assert plan["problems"] == [] and plan["routed"] == hosts
    assert plan["hosts"]["gpu1"]["clean_gpus"] == list(range(8)) and driver()["installing"]
