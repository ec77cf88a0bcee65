"""The pre-flight's decisions, in Python (plugins/action/sglang_preflight.py, docs/ARCHITECTURE.md).

The action reads the host through modules; everything it decides from what it read is here,
tested without a host:
- flags_key: what a passed flag check proves (these flag sets parse with this interpreter's
  SGLang), so a rollout play does not import SGLang again after the check play proved them;
- running_units: which units run, from one `systemctl show --property=SubState` call;
- foreign_port_problem: a port held by a program that is not the server or its leftovers (the
  cleanup module's ownership rules decided which holders are ours, docs/GPU-CLEANUP.md);
- server_plan: one described server's capacity plan on its own GPUs
(sglang_fleet.capacity.planner), with
  the host's calibration records when given (docs/CALIBRATION.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from sglang_fleet.ansible_values import plain, plain_mapping
from sglang_fleet.capacity import speculative
from sglang_fleet.capacity.model_config import weight_bytes_from_index
from sglang_fleet.capacity.planner import plan
from sglang_fleet.servers.describe import server_gpus

# The planner's calibration input, as the role gives it (filter sglang_server_plan's argument).
CALIBRATION_KEYS = frozenset({"store", "mode", "sglang_version"})


def flags_key(python: str, launch_module: str, servers: list[Mapping[str, Any]]) -> str:
    """What a passed flag check proves: the interpreter, the launch module and every argv."""
    text = json.dumps(
        [python, launch_module, [list(server["flag_argv"]) for server in servers]],
        sort_keys=True,
    )
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


def running_units(units: list[str], substates: str) -> list[str]:
    """The units that run, from `systemctl show --property=SubState --value -- UNIT...`: one
    SubState per unit in the order asked, with an empty line between units (a unit systemd does
    not know is "dead")."""
    states = [line.strip() for line in substates.splitlines() if line.strip()]
    if len(states) != len(units):
        raise ValueError(
            f"systemctl printed {len(states)} state(s) for {len(units)} unit(s): {substates!r}"
        )
    return [unit for unit, state in zip(units, states, strict=True) if state == "running"]


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def foreign_port_problem(server: Mapping[str, Any], holders: list[Mapping[str, Any]]) -> str:
    """Why the rollout stops on this server's port ("" when it is free or ours)."""
    foreign = [holder for holder in holders if not holder.get("ours")]
    if not foreign:
        return ""
    listed = "; ".join(
        f"pid {h.get('pid')} ({h.get('user')}) {_cut(str(h.get('cmdline', '')), 80)}"
        f" [{'; '.join(h.get('reasons') or [])}]"
        for h in foreign
    )
    return (
        f"sglang_server_instances[{server['name']}].port: port {server['port']} is held by a "
        f"program that is not {server['unit']} or a leftover of it, so the rollout stops here: "
        f"{listed}"
    )


def weight_bytes(value: Any) -> int:
    """A byte count, its text, or a parsed model.safetensors.index.json."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return weight_bytes_from_index(plain_mapping(value, "weights (model.safetensors.index.json)"))


def calibration_args(calibration: Any, server: Mapping[str, Any]) -> dict[str, Any]:
    """The planner's calibration arguments from {store, mode, sglang_version}."""
    if not calibration:
        return {}
    given = plain_mapping(calibration, "calibration")
    unknown = sorted(set(given) - CALIBRATION_KEYS)
    if unknown:
        raise ValueError(
            f"sglang_server_plan: unknown calibration key(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(CALIBRATION_KEYS))}"
        )
    # A damaged entry of the store is set aside by the planner (calibration_store.read_store) and
    # named in the plan's bounds line, never a reason to refuse the host.
    store = given.get("store")
    args: dict[str, Any] = {
        "calibration": store if store not in (None, "") else None,
        "calibration_mode": given.get("mode") or "enforce",
        "sglang_version": given.get("sglang_version") or None,
    }
    if "flags" in server:
        args["server_flags"] = dict(server["flags"])
    return args


def draft_path(server: Mapping[str, Any]) -> str | None:
    """The draft model's directory a speculative server loads (None without one, and for
    NGRAM, which has no draft model)."""
    flags = server.get("flags") or {}
    path = flags.get("speculative_draft_model_path")
    if not path or speculative.algorithm_of(flags) in (None, "NGRAM"):
        return None
    return str(path)


def _draft_args(draft: Any) -> dict[str, Any]:
    """The planner's draft arguments from the draft's description as read on the host."""
    if not draft:
        return {}
    given = plain_mapping(draft, "draft")
    return {
        "speculative_draft_config": plain_mapping(given.get("config"), "draft config.json"),
        "speculative_draft_weight_bytes": weight_bytes(given.get("weight_bytes")),
    }


def server_plan(  # noqa: PLR0917 (the filter passes them by position)
    server: Any,
    model_config: Any,
    weights: Any,
    gpus: Any,
    host_ram_mib: Any,
    workload: Any = None,
    calibration: Any = None,
    *,
    draft: Any = None,
    speculation_reset: str = "warn",
) -> dict[str, Any]:
    """The plan of one described server on its GPUs (min memory.total, name) and the host's
    RAM, with the host's calibration records when `calibration` is given; a CPU server's on
    the host's RAM alone (docs/CPU-SERVERS.md). draft: a speculative server's draft model as
    read ({config, weight_bytes}); speculation_reset: what the 48 reset is (warn, refuse).
    Bad input raises ValueError (PlanInputError and ModelConfigError are ValueErrors) naming
    what was wrong."""
    server = plain_mapping(server, "server")
    config = plain_mapping(model_config, "model_config")
    work = plain_mapping(workload or {}, "workload") | _draft_args(draft)
    work["speculation_reset"] = speculation_reset
    if server.get("device") == "cpu":
        args = {**server.get("plan_args", {}), **work}
        return plan(
            config, weight_bytes(weights), args, {"host_ram_gib": float(host_ram_mib) / 1024}
        )
    gpu_list = [plain_mapping(gpu, "gpu") for gpu in (plain(gpus) or [])]
    if not gpu_list:
        raise ValueError(f"sglang_server_plan: no GPU reported for {server.get('name')}")
    own = server_gpus(server, gpu_list)
    host: dict[str, Any] = {
        "gpu_memory_mib": min(float(gpu["memory_total_mib"]) for gpu in own),
        "host_ram_gib": float(host_ram_mib) / 1024,
        "gpu_count": len(gpu_list),
    }
    names = sorted({str(gpu["name"]) for gpu in own if gpu.get("name")})
    if len(names) == 1:
        host["gpu_name"] = names[0]
    args = {**server.get("plan_args", {}), **work, **calibration_args(calibration, server)}
    return plan(config, weight_bytes(weights), args, host)
