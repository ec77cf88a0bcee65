"""A finished autotune trial recorded: its outcome against the SLOs, the figures kept, the
calibration its start produced, and every untried candidate planned again.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from sglang_fleet.capacity import calibration, calibration_store, speculative
from sglang_fleet.module_utils.typed_number import Range, finite_or_none
from sglang_fleet.tuning.autotune_inputs import AutotuneInputError
from sglang_fleet.tuning.candidate_planning import replan
from sglang_fleet.tuning.trial_choice import BASELINE_ID

_FIGURES = ("output_throughput", "p99_ttft_ms", "p99_tpot_ms", "completed", "failed", "duration")


def _not_finite(smoke: Mapping[str, Any]) -> list[str]:
    """Figures of a smoke result that are present but not finite numbers (NaN would beat every
    real trial in a max(), and fail no SLO in a comparison)."""
    bad = []
    for name in (*_FIGURES, "output_throughput"):
        value = smoke.get(name)
        # No text here: the result is JSON the smoke client wrote, whose figures are numbers.
        if value is not None and (
            not isinstance(value, int | float) or finite_or_none(value, Range(0)) is None
        ):
            bad.append(name)
    return sorted(set(bad))


def _outcome(state: Mapping[str, Any], smoke: Mapping[str, Any] | None, error: str | None) -> str:
    if error or not smoke or _not_finite(smoke):
        return "failed"
    slo = state["slo"]
    failed = int(smoke.get("failed") or 0)
    expected = state["workload"]["num_prompts"]
    if failed > slo["max_failures"] or int(smoke.get("completed") or 0) + failed < expected:
        return "failed" if int(smoke.get("completed") or 0) == 0 else "slo_miss"
    for name in ("p99_ttft_ms", "p99_tpot_ms"):
        limit = slo[name]
        if limit is not None and float(smoke.get(name) or 0.0) > limit:
            return "slo_miss"
    return "ok"


def _is_oom(error: str | None, smoke: Mapping[str, Any] | None) -> bool:
    texts = [error or ""] + [str(e) for e in (smoke or {}).get("errors") or []]
    return any("out of memory" in t.lower() for t in texts)


def record_trial(
    state: dict[str, Any], trial: Mapping[str, Any], result: Mapping[str, Any]
) -> dict[str, Any]:
    """Record what a trial did. result: {smoke: the smoke JSON or null, calibration: the
    record this start produced or null, error: text or null (a start that failed, the
    journal's last lines), phase: start | health | smoke | null}. Returns the trial row."""
    if state["in_flight"] is None or state["in_flight"]["candidate"] != trial["candidate"]:
        raise AutotuneInputError(f"trial {trial.get('candidate')!r} is not the one in flight")
    smoke, error = result.get("smoke"), result.get("error")
    if isinstance(smoke, Mapping) and _not_finite(smoke) and not error:
        error = f"the smoke result's {', '.join(_not_finite(smoke))} is not a finite number >= 0"
    predicted = state["in_flight"].get("predicted") or {}
    row = {
        "n": state["in_flight"]["n"],
        "candidate": trial["candidate"],
        "tuned": dict(state["in_flight"]["tuned"]),
        "outcome": _outcome(state, smoke, error),
        "phase": result.get("phase"),
        "error": _clip(error),
        "oom": _is_oom(error, smoke),
        "calibrated": bool(predicted.get("calibrated")),
        "predicted": predicted or None,
        "waves": _waves(state, result, predicted),
        **_smoke_figures(smoke),
        "spec_accept_length": _accept_length(smoke),
    }
    state["trials"].append(row)
    _mark_candidate(state, trial["candidate"], row["outcome"])
    record = result.get("calibration")
    if record:
        try:
            state["calibrations"] = calibration_store.add_record(state["calibrations"], record)
        except calibration.CalibrationError as exc:
            row["calibration_not_kept"] = str(exc)
    state["in_flight"] = None
    replan(state)
    return row


def _clip(text: str | None, limit: int = 2400) -> str | None:
    """The error kept in the state: its head (what failed) and its tail (the journal's end)."""
    if not text:
        return None
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]}\n[...]\n{text[-(limit - head) :]}"


def _smoke_figures(smoke: Mapping[str, Any] | None) -> dict[str, Any]:
    """The figures kept in the state; one that is not a finite number is kept as None."""
    smoke = smoke or {}
    bad = _not_finite(smoke)
    return {name: None if name in bad else smoke.get(name) for name in _FIGURES}


def _accept_length(smoke: Mapping[str, Any] | None) -> float | None:
    """The median accept length the benchmark's /metrics samples read (sglang:spec_accept_length,
    docs/SPECULATIVE.md); None for a server that does not speculate."""
    samples = ((smoke or {}).get("server_metrics") or {}).get("samples") or []
    found = [
        value
        for row in samples
        if isinstance(row, Mapping)
        and (value := finite_or_none(row.get("spec_accept_length"), Range(1))) is not None
    ]
    return round(statistics.median(found), 3) if found else None


def _waves(state: Mapping[str, Any], result: Mapping[str, Any], predicted: Mapping) -> int | None:
    """The waves the job ran in: from the server's own token budget when the start reported
    it (the baseline has no prediction), else the prediction's."""
    record = result.get("calibration") or {}
    tokens = (record.get("measured") or {}).get("max_total_num_tokens")
    work = state["workload"]
    if tokens:
        fit = int(tokens) // (work["input_len"] + work["output_len"])
        flags = state["in_flight"]["flags"]
        cap = flags.get("max_running_requests")
        if cap is None and speculative.reset_applies(flags):
            cap = speculative.RESET_MAX_RUNNING_REQUESTS
        concurrency = min(fit, int(cap) if cap else fit, work["concurrency"])
        return math.ceil(work["num_prompts"] / max(concurrency, 1))
    return predicted.get("waves")


def _mark_candidate(state: dict[str, Any], candidate_id: str, outcome: str) -> None:
    """The candidate is tried; the baseline also stands for a candidate equal to it."""
    for candidate in state["candidates"]:
        if candidate["id"] == candidate_id or (
            candidate_id == BASELINE_ID and candidate["changes"] == 0
        ):
            candidate["status"] = "tried"
            candidate["outcome"] = outcome
