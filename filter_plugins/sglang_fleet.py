"""Ansible filters over sglang_fleet: the rollout's capacity pre-flight and the run diagnosis.

    {{ model_config | sglang_plan(weight_bytes, plan_args, host_facts) }}
    {{ smoke_result | sglang_diagnose(log_text, concurrency, plan_context) }}

Thin wrappers: the logic lives in sglang_fleet/ (tested there). model_config and the
weight argument may be what `slurp` + `b64decode` give (JSON text) or already parsed;
the weight argument may be the byte count or the parsed model.safetensors.index.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError

# Ansible loads this file by path, not as part of a package: make the repository root (its
# parent's parent) importable so the filters use the same sglang_fleet the tests cover.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from sglang_fleet.diagnose import diagnose  # noqa: E402  (needs the sys.path entry above)
from sglang_fleet.modelcfg import ModelConfigError, weight_bytes_from_index  # noqa: E402
from sglang_fleet.plan import PlanInputError, plan  # noqa: E402


def _as_dict(value: Any, what: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise AnsibleFilterError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise AnsibleFilterError(f"{what} must be a mapping, got {type(value).__name__}")
    return value


def _weight_bytes(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return weight_bytes_from_index(_as_dict(value, "weights (model.safetensors.index.json)"))


def sglang_plan(
    model_config: Any, weights: Any, args: dict | None = None, host: dict | None = None
) -> dict:
    """sglang_fleet.plan.plan() for the pre-flight; bad input fails the task with the reason."""
    try:
        return plan(
            _as_dict(model_config, "model_config"),
            _weight_bytes(weights),
            dict(args or {}),
            dict(host or {}),
        )
    except (PlanInputError, ModelConfigError) as exc:
        raise AnsibleFilterError(f"sglang_plan: {exc}") from exc


def sglang_diagnose(
    smoke_result: Any,
    log_text: str | None = None,
    concurrency: int | None = None,
    plan_context: dict | None = None,
) -> dict:
    """sglang_fleet.diagnose.diagnose() for the smoke gate's summary."""
    smoke = _as_dict(smoke_result, "smoke_result") if smoke_result else None
    return diagnose(
        smoke, log_text or None, int(concurrency) if concurrency else None, plan_context
    )


class FilterModule:
    """Ansible's entry point for filter plugins."""

    def filters(self) -> dict[str, Any]:
        return {"sglang_plan": sglang_plan, "sglang_diagnose": sglang_diagnose}
