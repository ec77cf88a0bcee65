"""The planner's use of the host's calibration records: read them by the store's rule, match,
predict and judge the flag set (`apply`; `calibration_mode` enforce, warn or ignore).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sglang_fleet.capacity.calibration import CalibrationError
from sglang_fleet.capacity.calibration_match import match
from sglang_fleet.capacity.calibration_predict import Prediction, predict
from sglang_fleet.capacity.calibration_store import StoreRead, read_store
from sglang_fleet.capacity.model_config import ModelShape
from sglang_fleet.capacity.plan_issues import issue

MODES = ("enforce", "warn", "ignore")


@dataclass
class Applied:
    """What calibration contributes to one plan."""

    prediction: Prediction | None
    record: dict[str, Any] | None
    reason: str
    warnings: list[dict[str, str]] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)


def oom_issue(prediction: Prediction, mode: str) -> dict[str, str] | None:
    """The free-after-graph finding when the prediction is below the margin, else None."""
    if prediction.fits:
        return None
    overruled = (
        " Reported as a warning because calibration_mode is 'warn'." if mode == "warn" else ""
    )
    return issue(
        "oom_risk_mem_fraction",
        f"mem_fraction_static {prediction.mem_fraction_static:.3f} leaves a predicted "
        f"{prediction.free_after_graph_gib:.2f} GiB free after CUDA graph capture, below the "
        f"{prediction.margin_gib:.1f} GiB margin (calibrated: "
        f"{prediction.calibrated_mem_fraction_static:.3f} on {prediction.recorded_at}): expect "
        "CUDA out of memory during CUDA graph capture or a large prefill. The highest fraction "
        f"that keeps the margin is {prediction.max_safe_mem_fraction_static:.3f}.{overruled}",
    )


def apply(
    records: Any,
    flags: Mapping[str, Any],
    host: Mapping[str, Any],
    shape: ModelShape,
    *,
    margin_gib: float = 5.0,
    mode: str = "enforce",
    flags_complete: bool = True,
    extra_weight_gib: Callable[[int], float] | None = None,
    draft_budget_layers: int = 0,
) -> Applied:
    """Match, predict and judge: the planner's use of the host's calibration records.

    mode: 'enforce' (a flag set predicted below the margin is an error), 'warn' (the same
    finding as a warning: the operator overrules it) or 'ignore' (estimates only).
    """
    if mode not in MODES:
        raise CalibrationError(f"calibration_mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "ignore":
        return Applied(None, None, "calibration_mode is 'ignore'")
    # Records given as data pass the store's rule too: whoever hands them over, what the rule
    # refuses never plans (and never refuses a flag set). A StoreRead has passed it already
    # (the planner reads its store path once, and build_record checks its log path's record).
    found = records if isinstance(records, StoreRead) else read_store(records)
    record, reason = match(found.records, flags, host, flags_complete=flags_complete)
    if record is None and found.set_aside and not found.records:
        reason = f"no calibration usable: {found.problems()}"
    if record is None:
        warning = issue(
            "calibration_mismatch",
            f"{reason}. The plan falls back to estimates from the GPU size and the checkpoint.",
        )
        return Applied(None, None, reason, warnings=[warning])
    prediction = predict(
        record,
        flags,
        host,
        shape,
        margin_gib,
        extra_weight_gib=extra_weight_gib,
        draft_budget_layers=draft_budget_layers,
    )
    applied = Applied(prediction, record, reason)
    oom = oom_issue(prediction, mode) if prediction.can_start else None
    if oom is not None:
        (applied.errors if mode == "enforce" else applied.warnings).append(oom)
    return applied
