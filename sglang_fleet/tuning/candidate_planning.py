"""Each autotune candidate planned with the calibrated capacity planner: its prediction
(KV-bound concurrency, waves, memory free after CUDA graph capture), and the prune of one that
cannot start, risks running out of memory or cannot hold one request of the workload.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from sglang_fleet.capacity import calibration_record, speculative
from sglang_fleet.capacity.planner import plan
from sglang_fleet.capacity.planner_inputs import PLANNER_FLAGS, PlanInputError
from sglang_fleet.tuning.autotune_candidates import candidate_flags, sglang_adjustments
from sglang_fleet.tuning.speed_model import refit

# Flags the planner reads (the rest of a candidate's flags are compared, not planned), and the
# CUDA graph batch size its calibrated prediction takes.
_PLANNER_FLAGS = (*PLANNER_FLAGS, "cuda_graph_max_bs_decode")
_CANNOT_START = ("not_enough_memory", "not_enough_gpus", "hicache_host_ram")


def measured_accept_length(state: Mapping[str, Any], flags: Mapping[str, Any]) -> float | None:
    """The accept length trials of this algorithm and draft measured (their median)."""
    key = (speculative.algorithm_of(flags), flags.get("speculative_draft_model_path"))
    found = [
        trial["spec_accept_length"]
        for trial in state["trials"]
        if trial.get("spec_accept_length")
        and _speculation_key(dict(state["base_flags"]) | dict(trial.get("tuned") or {})) == key
    ]
    return statistics.median(found) if found else None


def _speculation_key(flags: Mapping[str, Any]) -> tuple[str | None, Any]:
    return speculative.algorithm_of(flags), flags.get("speculative_draft_model_path")


def _speculative_args(
    state: Mapping[str, Any], flags: Mapping[str, Any], expected: float | None
) -> dict[str, Any]:
    """The planner's speculative inputs for a flag set: the draft read on the canary, the job's
    concurrency, and the accept length trials measured (else the operator's expectation)."""
    if speculative.algorithm_of(flags) is None:
        return {}
    args: dict[str, Any] = {"job_concurrency": state["workload"]["concurrency"]}
    draft = (state["context"].get("drafts") or {}).get(flags.get("speculative_draft_model_path"))
    if draft:
        args |= {
            "speculative_draft_config": draft["config"],
            "speculative_draft_weight_bytes": draft["weight_bytes"],
        }
    accept = measured_accept_length(state, flags) or expected
    if accept:
        args["speculative_accept_length"] = accept
    return args


def _plan_flags(
    state: Mapping[str, Any], flags: Mapping[str, Any], accept_length: float | None = None
) -> dict[str, Any]:
    ctx, work = state["context"], state["workload"]
    args = {k: flags[k] for k in _PLANNER_FLAGS if flags.get(k) is not None}
    args |= _speculative_args(state, flags, accept_length)
    args |= {
        "avg_input_len": work["input_len"],
        "avg_output_len": work["output_len"],
        "calibration": state["calibrations"],
        "calibration_mode": "enforce",
        "server_flags": calibration_record.public_flags(flags),
        "sglang_version": ctx.get("sglang_version"),
        "min_free_after_graph_gib": state["margin_gib"],
        "plan_layouts": False,
    }
    return plan(ctx["model_config"], ctx["weight_bytes"], args, ctx["host"])


def _prune_reason(state: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, str] | None:
    errors = {e["code"]: e["message"] for e in result["errors"]}
    for code in _CANNOT_START:
        if code in errors:
            return {"code": "cannot_start", "reason": errors[code]}
    if "oom_risk_mem_fraction" in errors:
        return {"code": "oom_risk", "reason": errors["oom_risk_mem_fraction"]}
    if errors:
        code, message = next(iter(errors.items()))
        return {"code": code, "reason": message}
    unfit = _rank_unfit(state["workload"], result)
    if unfit is not None:
        return unfit
    floor = _oom_floor(state)
    free = result["details"].get("free_after_graph_gib")
    if floor is not None and free is not None and free <= floor[0]:
        return {
            "code": "oom_risk",
            "reason": f"predicted {free:.2f} GiB free after CUDA graph capture, no more than "
            f"trial {floor[1]} had ({floor[0]:.2f} GiB predicted) when it ran out of memory",
        }
    return None


def _rank_unfit(work: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, str] | None:
    """Per attention-DP rank: its pool must hold one request, and its decode graphs should
    cover its batch (a rank running more requests than they cover runs those steps without
    CUDA graphs; a larger graph batch is its own candidate)."""
    need = work["input_len"] + work["output_len"]
    tokens = result["max_total_num_tokens"]  # one attention-DP rank's pool
    ranks = result["layout"]["attn_dp_size"]
    per_rank = f" per attention-DP rank (x {ranks})" if ranks > 1 else ""
    if tokens < need or result["max_concurrent_requests"] < 1:
        return {
            "code": "cannot_fit",
            "reason": f"max_total_num_tokens {tokens}{per_rank} cannot hold one request of the "
            f"workload ({work['input_len']} + {work['output_len']} = {need} tokens)",
        }
    graph_bs = result["layout"]["cuda_graph_max_bs_decode"]
    rank_batch = math.ceil(min(result["max_concurrent_requests"], work["concurrency"]) / ranks)
    if ranks <= 1 or graph_bs is None or graph_bs >= rank_batch:
        return None
    return {
        "code": "graph_batch_short",
        "reason": f"cuda_graph_max_bs_decode {graph_bs} is below the {rank_batch} requests "
        f"one of the {ranks} attention-DP ranks is planned to run",
    }


def _oom_floor(state: Mapping[str, Any]) -> tuple[float, int] | None:
    """The most free memory a calibrated trial was predicted to have when it still OOMed."""
    worst = None
    for trial in state["trials"]:
        free = (trial.get("predicted") or {}).get("free_after_graph_gib")
        known = trial.get("oom") and trial.get("calibrated") and free is not None
        if known and (worst is None or free > worst[0]):
            worst = (free, trial["n"])
    return worst


def _speedup(result: Mapping[str, Any], running: int) -> tuple[bool, float | None]:
    """(speculates, the planner's speed-up at the running batch, None when not known)."""
    section = result.get("speculative")
    if not section:
        return False, None
    points = {p["batch"]: p["speedup"] for p in (section.get("speedup") or {}).get("points", [])}
    return True, points.get(running)


def _predicted(
    state: Mapping[str, Any], result: Mapping[str, Any], flags: Mapping[str, Any]
) -> dict[str, Any]:
    work = state["workload"]
    concurrency = min(result["max_concurrent_requests"], work["concurrency"])
    details = result["details"]
    speculates, gain = _speedup(result, concurrency)
    return {
        "speculative": speculates,
        # x output over the same flags without speculation at this running batch; None while
        # no accept length is known (the search then tries it rather than stop early).
        "speedup": gain,
        "speedup_unknown": speculates and gain is None,
        "max_total_num_tokens": result["max_total_num_tokens"],
        "concurrency": concurrency,
        "waves": math.ceil(work["num_prompts"] / max(concurrency, 1)),
        "free_after_graph_gib": details.get("free_after_graph_gib"),
        "calibrated": bool(details.get("calibrated")),
        "oom_warning": any(w["code"] == "oom_risk_mem_fraction" for w in result["warnings"]),
        "per_request_tok_s": details.get("per_request_tok_s"),
        "total_kv_tokens": result["total_kv_tokens"],
        "sglang_adjusts": sglang_adjustments(flags, result["layout"]),
    }


def _plan_candidate(state: dict[str, Any], candidate: dict[str, Any]) -> None:
    flags = candidate_flags(state, candidate)
    try:
        result = _plan_flags(state, flags, candidate.get("accept_length"))
    except PlanInputError as exc:
        candidate.update(status="pruned", prune={"code": "invalid", "reason": str(exc)})
        return
    candidate["predicted"] = _predicted(state, result, flags)
    prune = _prune_reason(state, result)
    if prune is not None:
        candidate.update(status="pruned", prune=prune)


def replan(state: dict[str, Any]) -> None:
    """Plan every untried candidate again (a new calibration or an OOM changes the picture)."""
    for candidate in state["candidates"]:
        if candidate["status"] in ("pending", "pruned") and (
            candidate["prune"] is None or candidate["prune"]["code"] != "invalid"
        ):
            candidate.update(status="pending", prune=None)
            _plan_candidate(state, candidate)
    refit(state)
