"""Ansible filters of the autotune role: its inputs checked, a trial's benchmark and result.

    {{ autotune_space | sglang_autotune_inputs(workload, slo, dtypes_allowed, tolerance,
                                               max_trials) }}      typed, or the error to fix
    {{ autotune_workload | sglang_autotune_smoke_workload }}        smoke_gate_workload's keys
    {{ trial_result | sglang_autotune_trial_result(smoke_json) }}   RESULT.json of `record`
    {{ space | sglang_autotune_draft_paths(base_flags) }}            draft models to read

Thin wrappers over the installed sglang_fleet package (tuning/autotune_inputs.py,
docs/AUTOTUNE.md): a bad input fails the task naming the variable and what it allows, before
any host is touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.module_utils.bounded_json import loads as bounded_loads

    from sglang_fleet.ansible_values import plain
    from sglang_fleet.tuning import autotune_inputs
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
else:
    PACKAGE_ERROR = None

# Every request the same length (the smoke client sends exactly these token counts), as the
# search's wave model assumes; no warm-up beyond one request.
_SMOKE_FIXED = {"backend": "sglang", "seed": 42, "warmup_requests": 1}
# tolerance not given: the package's default, read when called (this file imports without the
# package).
_DEFAULT_TOLERANCE = object()


def sglang_autotune_inputs(  # noqa: PLR0917 (Jinja passes filter arguments by position)
    space: Any,
    workload: Any,
    slo: Any = None,
    kv_cache_dtypes_allowed: Any = None,
    tolerance: Any = _DEFAULT_TOLERANCE,
    max_trials: Any = None,
) -> dict[str, Any]:
    """autotune_inputs.validate_inputs(): the operator's inputs typed; an error names the
    variable."""
    if tolerance is _DEFAULT_TOLERANCE:
        tolerance = autotune_inputs.DEFAULT_TOLERANCE
    try:
        return autotune_inputs.validate_inputs(
            space=plain(space),
            workload=plain(workload),
            slo=plain(slo),
            kv_cache_dtypes_allowed=plain(kv_cache_dtypes_allowed),
            tolerance=tolerance,
            max_trials=max_trials,
        )
    except autotune_inputs.AutotuneInputError as exc:
        raise AnsibleFilterError(str(exc)) from exc


def sglang_autotune_smoke_workload(workload: Any) -> dict[str, Any]:
    """The search's workload as the smoke client's flags (smoke_gate_workload)."""
    try:
        typed = autotune_inputs.validate_workload(plain(workload))
    except autotune_inputs.AutotuneInputError as exc:
        raise AnsibleFilterError(str(exc)) from exc
    return _SMOKE_FIXED | {
        "num_prompts": typed["num_prompts"],
        "max_concurrency": typed["concurrency"],
        "random_input_len": typed["input_len"],
        "random_output_len": typed["output_len"],
        # A job's shape: its lengths in turn, instead of the fixed ones (docs/JOB.md).
        "lengths": typed.get("lengths"),
        "slo_ttft_ms": None,
        "slo_tpot_ms": None,
    }


def sglang_autotune_trial_result(trial: Any, smoke: Any = None) -> dict[str, Any]:
    """What `autotune record` reads, from a trial's result (the autotune role's
    trial, roles/autotune/tasks/trial_server.yml) and the smoke client's JSON
    (text or parsed; empty when the benchmark never ran)."""
    trial = plain(trial) or {}
    if not isinstance(trial, Mapping):
        raise AnsibleFilterError("sglang_autotune_trial_result: the trial result must be a mapping")
    if isinstance(smoke, str | bytes):
        try:
            smoke = bounded_loads(smoke, "the smoke result") if smoke.strip() else None
        except ValueError as exc:
            raise AnsibleFilterError(f"sglang_autotune_trial_result: {exc}") from None
    failed = trial.get("outcome") != "passed"
    return {
        "smoke": plain(smoke),
        "calibration": trial.get("calibration"),
        "error": (trial.get("error") or "failed") if failed else None,
        "phase": trial.get("phase") if failed else None,
    }


def sglang_autotune_draft_paths(space: Any, base_flags: Any) -> list[str]:
    """autotune_inputs.draft_paths(): the draft models a search may start (the typed space of
    sglang_autotune_inputs and the server's flags), read on the canary before any trial."""
    return autotune_inputs.draft_paths(plain(space) or {}, plain(base_flags) or {})


class FilterModule:
    """Ansible's entry point for filter plugins."""

    def filters(self) -> dict[str, Any]:
        return controller_package.filters(
            {
                "sglang_autotune_inputs": sglang_autotune_inputs,
                "sglang_autotune_smoke_workload": sglang_autotune_smoke_workload,
                "sglang_autotune_trial_result": sglang_autotune_trial_result,
                "sglang_autotune_draft_paths": sglang_autotune_draft_paths,
            },
            PACKAGE_ERROR,
        )
