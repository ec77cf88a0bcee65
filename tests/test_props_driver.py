"""Property-based tests of playbooks/driver_upgrade.yml's decisions (Hypothesis; profiles in
tests/conftest.py): sglang_fleet/rollout/driver_upgrade.py's settings, plan and summary lines
from generated host reads, some well formed and some with fields of any type, and the clean
step's take-out (VerbAction._take_out) from any answer of `systemctl is-active`. Invariants
(issue 44): never an exception, in bounded time; a read that cannot be typed refuses the run,
naming the host; when the run may start, every server that runs on a host that changes stops
and comes back, and the GPUs are cleaned first; a replica is stopped without leaving its router
only when its unit is proven to serve nothing."""

from __future__ import annotations

import time
from typing import Any

from ansible.utils.helpers import pct_to_int
from hypothesis import event, given
from hypothesis import strategies as st
from sglang_fleet.module_utils.typed_number import NumberError, Range
from sglang_fleet.module_utils.typed_number import read as read_number
from test_driver_rollout import driver, server, worker
from test_router_leave_action import FakeLeave, leave_args

from sglang_fleet.rollout import driver_upgrade as dr

# Values of any type a hostvar can hold, and the numbers that break float() and int().
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([10**400, -1, 0, 1, 8]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(st.sampled_from(list("0123456789%-. \n²٣abcx")), max_size=6),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.sampled_from(["url", "workers"]), st.integers(0, 3), max_size=2),
)
FIELDS = ["accelerator", "driver", "installing", "gpu_count", "active_units", "servers",
          "routers", "min_healthy_others"]  # fmt: skip


def _host(name: str, routed: bool, running: bool, gpus: int, others: int) -> dict[str, Any]:
    servers = [server(f"s-{name}", name, router=dr_url() if routed else None)]
    return {
        "accelerator": "cuda",
        "driver": driver(gpus=gpus),
        "servers": servers,
        "active_units": [servers[0]["unit"]] if running else [],
        "routers": ({servers[0]["name"]: {"workers": [], "error": ""}} if routed else {}),
        "min_healthy_others": others,
    }


def dr_url() -> str:
    return "http://gw:30000"


def _typed(value: Any, allowed: Range) -> bool:
    try:
        read_number(value, "x", allowed)
    except NumberError:
        return False
    return True


def _spoil(read: dict[str, Any], field: str, value: Any) -> bool:
    """Put value in a field of the read; True when the run must then refuse (a field the first
    play never writes so). A router answer of another shape refuses only where a replica
    leaves: not counted here."""
    if field in ("installing", "gpu_count"):
        read["driver"][field] = value
        if field == "installing":
            return not isinstance(value, bool)
        return value is not None and not _typed(value, dr.GPU_COUNT)
    read[field] = value
    if field == "driver":
        return not isinstance(value, dict)
    if field in ("active_units", "servers"):
        return not (isinstance(value, list) and value == [])
    if field == "min_healthy_others":
        return not _typed(value, dr.MIN_OTHERS)
    return field != "routers"


HOSTS = st.lists(
    st.fixed_dictionaries(
        {
            "routed": st.booleans(),
            "running": st.booleans(),
            "gpus": st.integers(min_value=0, max_value=8),
            "others": st.integers(min_value=0, max_value=3),
        }
    ),
    min_size=1,
    max_size=5,
)


SPOILS = st.one_of(
    st.none(), st.tuples(st.integers(min_value=0, max_value=4), st.sampled_from(FIELDS), anything)
)
SERIALS = st.one_of(st.just([1, "25%"]), anything, st.lists(anything, max_size=3))


@given(hosts=HOSTS, spoil=SPOILS, serial=SERIALS)
def test_the_plan_refuses_what_it_cannot_type_and_never_skips_a_clean(
    hosts: list[dict[str, Any]], spoil: tuple[int, str, Any] | None, serial: Any
) -> None:
    names = [f"gpu{index}" for index in range(len(hosts))]
    reads: dict[str, dict[str, Any]] = {}
    for name, spec in zip(names, hosts, strict=True):
        reads[name] = _host(name, spec["routed"], spec["running"], spec["gpus"], spec["others"])
    spoiled: set[str] = set()
    spoiled_routers = ""
    if spoil:
        name = names[spoil[0] % len(names)]
        spoiled_routers = name if spoil[1] == "routers" else ""
        if _spoil(reads[name], spoil[1], spoil[2]):
            spoiled.add(name)
    for name, spec in zip(names, hosts, strict=True):  # each router lists its replicas
        if spec["routed"] and name != spoiled_routers:
            reads[name]["routers"][f"s-{name}"]["workers"] = [
                worker(other) for other, o in zip(names, hosts, strict=True) if o["routed"]
            ]
    started = time.process_time()  # CPU time: a loaded machine stretches wall time
    plan = dr.plan(names, reads, serial)
    assert time.process_time() - started < 1.0
    for name in spoiled:
        assert any(problem.startswith(f"{name}: ") for problem in plan["problems"]), (name, plan)
    event("refused" if plan["problems"] else "may start")
    if plan["problems"]:
        return
    assert not spoiled
    for name in names:
        read, decided = reads[name], plan["hosts"][name]
        if not decided["change"]:
            continue
        running = [s["name"] for s in read["servers"] if s["unit"] in read["active_units"]]
        assert decided["stop"] == running  # every one that stops comes back
        event("a host with running servers changes" if running else "an idle host changes")
        if running:  # the clean (drain, stop, GPUs proven clear) runs before the reboot
            assert decided["clean_gpus"] == list(range(read["driver"]["gpu_count"]))
            assert decided["clean_gpus"]
    used = dr.DEFAULT_SERIAL if serial is None else serial
    sizes = [len(batch) for batch in dr.batches(plan["direct"], used)]
    assert all(size >= 1 for size in sizes) and sum(sizes) == len(plan["direct"])


@given(serial=st.one_of(anything, st.lists(anything, max_size=3)), branch=anything)
def test_settings_are_checked_never_raised_and_agree_with_ansible(serial: Any, branch: Any) -> None:
    problems = dr.settings_problems(serial, branch)
    assert all(p.split(":")[0] in (dr.SERIAL_VAR, dr.BRANCH_VAR) for p in problems)
    if not any(p.startswith(dr.SERIAL_VAR) for p in problems):
        raw = serial if isinstance(serial, list) else [serial]
        for item, checked in zip(raw, dr.check_serial(serial), strict=True):
            for hosts in (1, 7, 10):  # Ansible's own reading of each batch: the same size
                assert pct_to_int(item, hosts) == pct_to_int(checked, hosts) >= 1
    if branch is not None and not any(p.startswith(dr.BRANCH_VAR) for p in problems):
        assert dr.check_branch(branch).isascii() and dr.check_branch(branch).isdigit()


@given(before=anything, after=anything, stopped_at=anything, healthy_at=anything)
def test_the_summary_line_never_raises(
    before: Any, after: Any, stopped_at: Any, healthy_at: Any
) -> None:
    line = dr.host_summary("gpu01", before, after, [{"name": "kimi", "healthy_at": healthy_at}],
                           stopped_at)  # fmt: skip
    assert line.startswith("gpu01: driver ") and "inf s" not in line and "nan s" not in line


@given(
    answer=st.one_of(
        st.sampled_from(["active", "inactive", "failed", "activating", "deactivating",
                         "reloading", "refreshing", "maintenance", "unknown", ""]),
        st.text(max_size=20),
    ),
    failed=st.booleans(),
)  # fmt: skip
def test_a_replica_stops_without_its_take_out_only_when_proven_idle(
    answer: str, failed: bool
) -> None:
    class Host(FakeLeave):
        def _execute_module(self, module_name: str, module_args: dict, task_vars: Any = None):
            if module_name.endswith("command"):
                self.calls.append(("command", module_args, False))
                return {"rc": 0, "stdout": answer + "\n", "failed": failed, "msg": "no"}
            return super()._execute_module(module_name, module_args, task_vars)

    action = Host(leave_args(), {})
    result = action.run_it()
    took_out = "sglang_router_workers" in [name for name, _, _ in action.calls]
    idle = not failed and answer.strip() in ("inactive", "failed", "activating")
    assert took_out or idle or result.get("failed"), (answer, failed, result)
    if idle:
        assert not took_out and not result.get("failed")
    elif not took_out:
        assert "cannot be read" in result["msg"]
