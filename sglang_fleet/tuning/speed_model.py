"""The autotune speed model: a job of N requests at concurrency B runs in ceil(N / B) waves
and takes duration = A * waves + K seconds; A and K are fitted to the trials measured so far
(A from the planner's per-request speed before any), and give every candidate's predicted
output tok/s; a speculative candidate's is that times the planner's speed-up at its running
batch (docs/SPECULATIVE.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_fleet.capacity import speculative


def _measured(state: Mapping[str, Any]) -> list[tuple[int, float]]:
    """(waves, job seconds) of the trials that completed the whole job without speculation
    (a speculative trial's steps run at another speed: the planner's speed-up scales it)."""
    work = state["workload"]
    tokens = work["num_prompts"] * work["output_len"]
    points = []
    for trial in state["trials"]:
        flags = dict(state["base_flags"]) | dict(trial.get("tuned") or {})
        if speculative.algorithm_of(flags) is not None:
            continue
        tok_s = trial.get("output_throughput")
        whole = trial.get("completed") == work["num_prompts"] and not trial.get("failed")
        if whole and tok_s and trial.get("waves") and trial["outcome"] != "failed":
            points.append((int(trial["waves"]), tokens / float(tok_s)))
    return points


def fit_speed_model(points: list[tuple[int, float]], prior_a: float) -> dict[str, Any]:
    """duration = A * waves + K by least squares; A from the prior with no point, K = 0
    while every point has the same number of waves."""
    if not points:
        return {"a": prior_a, "k": 0.0, "source": "prior"}
    waves = [w for w, _d in points]
    if len(set(waves)) < 2:
        a = sum(d / w for w, d in points) / len(points)
        return {"a": a, "k": 0.0, "source": "scaled"}
    n = len(points)
    mean_w = sum(waves) / n
    mean_d = sum(d for _w, d in points) / n
    var = sum((w - mean_w) ** 2 for w in waves)
    a = sum((w - mean_w) * (d - mean_d) for w, d in points) / var
    k = mean_d - a * mean_w
    if a <= 0 or k < 0:
        # Noise can tilt the line; a negative step time or prefill time is not physical.
        k = max(0.0, k) if a > 0 else 0.0
        a = sum((d - k) / w for w, d in points) / n
    return {"a": a, "k": k, "source": "fitted"}


def refit(state: dict[str, Any]) -> None:
    """Fit the model to the trials measured so far and predict every candidate's output tok/s."""
    work = state["workload"]
    speeds = [
        c["predicted"]["per_request_tok_s"]
        for c in state["candidates"]
        if c["predicted"] and c["predicted"].get("per_request_tok_s")
    ]
    prior_speed = speeds[0] if speeds else 12.0
    prior_a = work["output_len"] / prior_speed
    model = fit_speed_model(_measured(state), prior_a)
    state["speed_model"] = model
    for candidate in state["candidates"]:
        predicted = candidate["predicted"]
        if predicted:
            plain = predict_tok_s(model, work, predicted["waves"])
            predicted["output_tok_s"] = round(plain * (predicted.get("speedup") or 1.0), 1)


def predict_tok_s(model: Mapping[str, Any], workload: Mapping[str, int], waves: int) -> float:
    """Output tok/s of the whole job when it runs in `waves` waves."""
    duration = model["a"] * waves + model["k"]
    return workload["num_prompts"] * workload["output_len"] / duration if duration > 0 else 0.0
