"""Ansible filter over sglang_fleet.plan: the rollout's capacity pre-flight.

    {{ server | sglang_server_plan(model_config, weights, gpus, host_ram_mib, workload) }}
    {{ model_config | sglang_plan(weights, plan_args, host_facts) }}

server is one entry of sglang_server_servers (its plan_args are the planner's flags); gpus is
what the nvidia_gpu_info module returned. model_config and weights may be what `slurp` +
`b64decode` give (JSON text) or already parsed; weights may be a byte count or the parsed
model.safetensors.index.json. The logic lives in sglang_fleet.plan (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError

from sglang_fleet.modelcfg import ModelConfigError, weight_bytes_from_index
from sglang_fleet.plan import PlanInputError, plan


def _as_dict(value: Any, what: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise AnsibleFilterError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, Mapping):
        raise AnsibleFilterError(f"{what} must be a mapping, got {type(value).__name__}")
    return json.loads(json.dumps(dict(value)))


def _weight_bytes(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return weight_bytes_from_index(_as_dict(value, "weights (model.safetensors.index.json)"))


def sglang_plan(
    model_config: Any, weights: Any, args: dict | None = None, host: dict | None = None
) -> dict:
    """sglang_fleet.plan.plan(); bad input fails the task with the reason."""
    try:
        return plan(
            _as_dict(model_config, "model_config"),
            _weight_bytes(weights),
            _as_dict(args or {}, "plan arguments"),
            _as_dict(host or {}, "host facts"),
        )
    except (PlanInputError, ModelConfigError) as exc:
        raise AnsibleFilterError(f"sglang_plan: {exc}") from exc


def sglang_server_plan(  # noqa: PLR0917 (Jinja passes filter arguments by position)
    server: Any,
    model_config: Any,
    weights: Any,
    gpus: Any,
    host_ram_mib: Any,
    workload: dict | None = None,
) -> dict:
    """The plan of one described server on this host's GPUs (min memory.total) and RAM."""
    server = _as_dict(server, "server")
    gpu_list = [_as_dict(gpu, "gpu") for gpu in (gpus or [])]
    if not gpu_list:
        raise AnsibleFilterError(f"sglang_server_plan: no GPU reported for {server.get('name')}")
    host = {
        "gpu_memory_mib": min(float(gpu["memory_total_mib"]) for gpu in gpu_list),
        "host_ram_gib": float(host_ram_mib) / 1024,
        "gpu_count": len(gpu_list),
    }
    args = {**server.get("plan_args", {}), **_as_dict(workload or {}, "workload")}
    return sglang_plan(model_config, weights, args, host)


class FilterModule:
    """Ansible's entry point for filter plugins."""

    def filters(self) -> dict[str, Any]:
        return {"sglang_plan": sglang_plan, "sglang_server_plan": sglang_server_plan}
