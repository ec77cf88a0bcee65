"""Ansible filter over sglang_fleet.capacity.planner: the rollout's capacity pre-flight.

    {{ server | sglang_server_plan(model_config, weights, gpus, host_ram_mib, workload,
                                   calibration) }}
    {{ model_config | sglang_plan(weights, plan_args, host_facts) }}
    {{ plan | sglang_plan_verdict(server_name, workload, warnings_fatal) }}

server is one entry of sglang_server_servers (its plan_args are the planner's flags, its
flags the whole flag set a calibration record is compared with); gpus is what the
nvidia_gpu_info module returned (the server's own GPUs give the memory and name). calibration
is {store: the host's calibration.json as slurped (text, may be empty), mode: enforce | warn
| ignore, sglang_version: the installed version} (docs/CALIBRATION.md). model_config and
weights may be what `slurp` + `b64decode` give (JSON text) or already parsed; weights may be
a byte count or the parsed model.safetensors.index.json. The logic lives in
sglang_fleet.capacity.planner (its inputs typed in sglang_fleet.capacity.planner_inputs) and
sglang_fleet.rollout.preflight_inputs (docs/ARCHITECTURE.md); what a plan means for the rollout
(the line that says what bounds the server, a calibrated refusal, the message that fails the
host) in sglang_fleet.capacity.verdict.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.ansible_values import plain_mapping
    from sglang_fleet.capacity.model_config import ModelConfigError
    from sglang_fleet.capacity.planner import plan
    from sglang_fleet.capacity.planner_inputs import PlanInputError
    from sglang_fleet.capacity.verdict import verdict
    from sglang_fleet.rollout.preflight_inputs import server_plan, weight_bytes
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
else:
    PACKAGE_ERROR = None


def sglang_plan(
    model_config: Any, weights: Any, args: dict | None = None, host: dict | None = None
) -> dict:
    """sglang_fleet.capacity.planner.plan(); bad input fails the task with the reason."""
    try:
        return plan(
            plain_mapping(model_config, "model_config"),
            weight_bytes(weights),
            plain_mapping(args or {}, "plan arguments"),
            plain_mapping(host or {}, "host facts"),
        )
    except (PlanInputError, ModelConfigError) as exc:
        raise AnsibleFilterError(f"sglang_plan: {exc}") from exc
    except ValueError as exc:  # the inputs themselves: no mapping, or not JSON
        raise AnsibleFilterError(str(exc)) from exc


def sglang_server_plan(  # noqa: PLR0917 (Jinja passes filter arguments by position)
    server: Any,
    model_config: Any,
    weights: Any,
    gpus: Any,
    host_ram_mib: Any,
    workload: dict | None = None,
    calibration: dict | None = None,
) -> dict:
    """sglang_fleet.rollout.preflight_inputs.server_plan(): one described server's plan on its own
    GPUs and
    the host's RAM, with the host's calibration records when `calibration` is given."""
    try:
        return server_plan(server, model_config, weights, gpus, host_ram_mib, workload, calibration)
    except (PlanInputError, ModelConfigError) as exc:
        raise AnsibleFilterError(f"sglang_plan: {exc}") from exc
    except ValueError as exc:  # the inputs themselves: no mapping, or not JSON
        raise AnsibleFilterError(str(exc)) from exc


def sglang_plan_verdict(
    plan_result: Any, name: str, workload: Any, warnings_fatal: bool = False
) -> dict[str, str]:
    """sglang_fleet.capacity.verdict.verdict(): {bounds, refusal, blocking} of one server's plan."""
    if not isinstance(warnings_fatal, bool):
        raise AnsibleFilterError(
            f"sglang_plan_verdict: warnings_fatal must be true or false, got {warnings_fatal!r}"
        )
    try:
        return verdict(
            plain_mapping(plan_result, "plan"),
            str(name),
            plain_mapping(workload or {}, "workload"),
            warnings_fatal=warnings_fatal,
        )
    except (KeyError, ValueError) as exc:
        raise AnsibleFilterError(f"sglang_plan_verdict: not a plan ({exc})") from exc


class FilterModule:
    """Ansible's entry point for filter plugins."""

    def filters(self) -> dict[str, Any]:
        return controller_package.filters(
            {
                "sglang_plan": sglang_plan,
                "sglang_server_plan": sglang_server_plan,
                "sglang_plan_verdict": sglang_plan_verdict,
            },
            PACKAGE_ERROR,
        )
