"""Every entry point that stops a server takes a routed replica out of its router first: a
rollout inside its restart action (roll_out_server.yml's start sets __sglang_server_take_out, and
replace_server.yml hands the server's router to sglang_restart), the others through
roles/sglang_server/tasks/router_take_out.yml (docs/STAGING.md, "Drain before every stop of a
routed replica"). An autotune trial (roles/autotune/tasks/trial_server.yml) runs the same
steps through include_role. Read from the task files themselves, so a new stop path that skips
the drain fails here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROLES = Path(__file__).resolve().parent.parent / "roles"
TASKS = ROLES / "sglang_server" / "tasks"
TRIAL = ROLES / "autotune" / "tasks" / "trial_server.yml"
# Task files that stop a server (directly, or through replace_server.yml, the rollback action or
# the gpu_cleanup role, shown as "gpu_cleanup").
STOPS = ("replace_server.yml", "rollback_server.yml", "gpu_cleanup")


def _flat(tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for task in tasks or []:
        out.append(task)
        for key in ("block", "rescue", "always"):
            out.extend(_flat(task.get(key, [])))
    return out


def _includes(path: Path) -> list[str]:
    """The sglang_server task files a file runs, in order: its own includes and imports, and
    another role's include_role of sglang_server's steps (tasks_from)."""
    included = []
    for task in _flat(yaml.safe_load(path.read_text())):
        if "ansible.builtin.include_tasks" in task or "ansible.builtin.import_tasks" in task:
            included.append(
                str(
                    task.get("ansible.builtin.include_tasks")
                    or task["ansible.builtin.import_tasks"]
                )
            )
        role = task.get("ansible.builtin.include_role") or {}
        name = str(role.get("name", "")).removeprefix("sglang_fleet.fleet.")  # roles by FQCN
        if name == "sglang_server" and role.get("tasks_from"):
            included.append(f"{role['tasks_from']}.yml")
        if name == "gpu_cleanup":
            included.append("gpu_cleanup")
    return included


@pytest.mark.parametrize(
    ("entry", "stop"),
    [
        (TASKS / "rollback_replica.yml", "rollback_server.yml"),
        (TASKS / "clean.yml", "gpu_cleanup"),
        (TRIAL, "replace_server.yml"),
        # After a driver change (playbooks/driver_upgrade.yml): a replica its router lists again
        # leaves and drains before the restart stops a unit systemd started at boot.
        (TASKS / "driver_server_up.yml", "rollback_server.yml"),
    ],
    ids=lambda value: value.name if isinstance(value, Path) else value,
)
def test_a_routed_replica_is_taken_out_before_it_stops(entry: Path, stop: str) -> None:
    included = _includes(entry)
    assert "router_take_out.yml" in included, f"{entry} never drains"
    assert included.index("router_take_out.yml") < included.index(stop)


def test_a_rollout_drains_in_its_restart_action() -> None:
    [start] = [
        t for t in _flat(yaml.safe_load((TASKS / "roll_out_server.yml").read_text()))
        if t.get("ansible.builtin.import_tasks") == "replace_server.yml"
    ]  # fmt: skip
    assert start["vars"]["__sglang_server_take_out"] is True
    [restart] = yaml.safe_load((TASKS / "replace_server.yml").read_text())
    args = restart["sglang_fleet.fleet.sglang_restart"]
    assert "sglang_server_target.router if __sglang_server_take_out" in args["router"]
    assert set(args["drain"]) == {"timeout", "min_healthy_others", "drain_timeout"}
    # The take-out task file is not run a second time around it.
    assert "router_take_out.yml" not in _includes(TASKS / "roll_out_server.yml")


@pytest.mark.parametrize(
    "entry",
    [
        TASKS / "roll_out_server.yml",
        TASKS / "rollback_replica.yml",
        TRIAL,
        TASKS / "driver_server_up.yml",
    ],
    ids=lambda path: path.name,
)
def test_a_replica_that_serves_again_goes_back_into_its_router(entry: Path) -> None:
    included = _includes(entry)
    assert included[-1] == "router_put_back.yml"


def test_rollback_goes_through_the_draining_path() -> None:
    assert "rollback_replica.yml" in _includes(TASKS / "rollback.yml")
    assert "rollback_server.yml" not in _includes(TASKS / "rollback.yml")


def test_no_other_task_file_stops_a_server_without_the_drain() -> None:
    """The files that include a stop are exactly the known entry points (and the stops'
    own nesting); a new one must be added above, with its drain."""
    known = {"sglang_server/roll_out_server.yml", "sglang_server/rollback_replica.yml",
             "sglang_server/clean.yml", "autotune/trial_server.yml",
             "sglang_server/driver_server_up.yml"}  # fmt: skip
    nested = {"sglang_server/rollback_server.yml", "sglang_server/replace_server.yml",
              "sglang_server/roll_out_server.yml"}  # fmt: skip
    callers = {
        f"{path.parent.parent.name}/{path.name}"
        for path in ROLES.glob("*/tasks/*.yml")
        if any(stop in _includes(path) for stop in STOPS)
    }
    assert callers <= known | nested, callers - known - nested
    assert "autotune/trial_server.yml" in callers  # the trial's steps are read through include_role
