"""The tuning loop's brain: candidates, pruning, order, early stop (docs/AUTOTUNE.md).

A run is a JSON *state* that the playbook drives one trial at a time:

    python3 -m sglang_fleet.tuning.autotune init   --spec SPEC.json --context CTX.json --state
    S.json
    python3 -m sglang_fleet.tuning.autotune next   --state S.json          # prints a trial or null
    python3 -m sglang_fleet.tuning.autotune record --state S.json --result RESULT.json
    python3 -m sglang_fleet.tuning.autotune report --state S.json --out-dir reports/HOST/SERVER

or, from Python, `new_state`, `next_trial`, `record_trial`, `write_report`.

- Candidates are the grid of the operator's lists (SPACE_FLAGS) over the server's flags.
- The calibrated planner (sglang_fleet.capacity.planner with the host's calibration records) prunes
  those that cannot start (no KV memory, too few GPUs, HiCache over RAM), that risk running
  out of memory (free after CUDA graph capture below the margin), and those whose KV pool
  cannot hold one request of the workload.
- The rest are ordered by predicted output tok/s. The prediction is the planner's
  KV-bound concurrency B = min(KV pool / (input + output), max_running_requests, client
  concurrency) times per-request decode speed 1 / t(B), with t(B) = a + b * B (a step of a
  larger batch takes longer). With fixed request lengths the N requests of the job run in
  ceil(N / B) waves, so the job takes  out * (a * waves + b * N) + prefill  seconds:
  duration = A * waves + K, and A, K are fitted to the trials measured so far.
- Early stop: once the best measured trial that passed the SLOs reaches the best remaining
  prediction x (1 - tolerance), no untried candidate is expected to beat it by more than the
  tolerance, and the search ends.
- Before any calibration exists, the first trial is the server's current flag set (it
  serves today): its start calibrates the host, and every later candidate is planned with
  measured memory.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import json
import math
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sglang_fleet import input_files
from sglang_fleet.capacity import attention_dp, calibration, kv_cache
from sglang_fleet.capacity.noop_flags import NOOP_FLAGS
from sglang_fleet.capacity.planner import (
    MIN_FREE_AFTER_GRAPH_GIB,
    PLANNER_FLAGS,
    PlanInputError,
    plan,
)
from sglang_fleet.module_utils import bounded_json

STATE_SCHEMA = "sglang-fleet/autotune/1"
SPACE_FLAGS = (
    "mem_fraction_static",
    "max_running_requests",
    "chunked_prefill_size",
    "kv_cache_dtype",
    # Attention DP (docs/ATTENTION-DP.md) and the decode CUDA graph batch its ranks need.
    "attn_dp_size",
    "cuda_graph_max_bs_decode",
    # The prefill chunk one attention-DP rank runs: the candidate's chunked_prefill_size is
    # this x attn_dp_size, because SGLang divides the flag by the attention-DP size.
    "chunked_prefill_size_per_rank",
)
PER_RANK_CHUNK = "chunked_prefill_size_per_rank"
# SGLang multiplies schedule_conservativeness by this under attention DP (parallel_hook).
ATTN_DP_CONSERVATIVENESS = 0.3
# KV dtypes that store as many bits as the model: no quality trade-off to opt into.
LOSSLESS_KV_DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16")
DEFAULT_TOLERANCE = 0.05
MAX_CANDIDATES = 1024
# Flags the planner reads (the rest of a candidate's flags are compared, not planned), and the
# CUDA graph batch size its calibrated prediction takes.
_PLANNER_FLAGS = (*PLANNER_FLAGS, "cuda_graph_max_bs_decode")
_CANNOT_START = ("not_enough_memory", "not_enough_gpus", "hicache_host_ram")
BASELINE_ID = "base"
# The inputs that make a search: a rerun with the same ones resumes the state, other ones
# start a new search (spec_digest). The context is the checkpoint (model_config, weight_bytes),
# the GPUs (model, memory, count) and the SGLang version: a GPU swap or an upgrade is a new
# search, never a resumed one whose winner was measured on something else.
SPEC_KEYS = (
    "server",
    "base_flags",
    "space",
    "workload",
    "slo",
    "tolerance",
    "max_trials",
    "margin_gib",
    "context",
)
WORKLOAD_KEYS = ("input_len", "output_len", "concurrency", "num_prompts")
# Bounds that keep every figure of a plan finite: no request is longer than 16 Mi tokens and no
# job has more prompts or concurrency than that.
MAX_WORKLOAD_VALUE = 1 << 24
# Prune codes a calibration can lift: only then is the baseline trial worth a restart.
_CALIBRATION_REVISES = ("cannot_start", "oom_risk", "cannot_fit")


class AutotuneInputError(ValueError):
    """The autotune inputs are invalid; the message names the variable and allowed values."""


# --- inputs -------------------------------------------------------------------------------
def _positive_int(value: Any, where: str, allow_minus_one: bool = False) -> int:
    try:
        number = int(value)
        ok = not isinstance(value, bool) and float(value) == number
    except (TypeError, ValueError):
        ok = False
    if not ok or not (number >= 1 or (allow_minus_one and number == -1)):
        extra = " or -1 (disabled)" if allow_minus_one else ""
        raise AutotuneInputError(f"{where}: {value!r} is not a positive integer{extra}")
    return number


def _fraction(value: Any, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not 0 < number < 1:
        raise AutotuneInputError(f"{where}: {value!r} is not a fraction between 0 and 1")
    return number


def _kv_dtype(value: Any, where: str, allowed: list[str]) -> str:
    text = str(value)
    if text not in kv_cache.KV_ELEM_BYTES:
        choices = ", ".join(sorted(kv_cache.KV_ELEM_BYTES))
        raise AutotuneInputError(f"{where}: {text!r} is not a KV cache dtype ({choices})")
    if text not in allowed:
        raise AutotuneInputError(
            f"{where}: {text} is not in autotune_kv_cache_dtypes_allowed "
            f"({', '.join(allowed)}). fp8 and fp4 KV caches trade output quality for capacity: "
            "add the dtype there to opt in."
        )
    return text


def _space_values(name: str, values: Any, allowed_dtypes: list[str]) -> list[Any]:
    where = f"autotune_space.{name}"
    if not isinstance(values, list) or not values:
        raise AutotuneInputError(f"{where} must be a non-empty list")
    if name == "mem_fraction_static":
        out: list[Any] = [_fraction(v, where) for v in values]
    elif name == "kv_cache_dtype":
        out = [_kv_dtype(v, where, allowed_dtypes) for v in values]
    else:
        chunk = name in ("chunked_prefill_size", PER_RANK_CHUNK)
        out = [_positive_int(v, where, chunk) for v in values]
    return list(dict.fromkeys(out))  # keep the operator's order, drop repeats


def validate_space(space: Any, allowed_dtypes: Iterable[str] | None = None) -> dict[str, list]:
    """The candidate space as typed lists; raises AutotuneInputError naming the variable."""
    allowed = list(allowed_dtypes) if allowed_dtypes is not None else list(LOSSLESS_KV_DTYPES)
    if not isinstance(space, Mapping) or not space:
        raise AutotuneInputError(
            f"autotune_space must be a mapping of lists, keys among {', '.join(SPACE_FLAGS)}"
        )
    noop = sorted(set(space) & set(NOOP_FLAGS))
    if noop:
        raise AutotuneInputError(
            f"autotune_space: {', '.join(noop)} does nothing in SGLang 0.5.23 (declared, read "
            "by no module; docs/SGLANG.md): trials over it would measure noise. Remove it; "
            f"allowed keys: {', '.join(SPACE_FLAGS)}"
        )
    if PER_RANK_CHUNK in space and "chunked_prefill_size" in space:
        raise AutotuneInputError(
            f"autotune_space: give chunked_prefill_size or {PER_RANK_CHUNK}, not both (the "
            "second is the first divided by attn_dp_size, as SGLang divides it)"
        )
    unknown = sorted(set(space) - set(SPACE_FLAGS))
    if unknown:
        raise AutotuneInputError(
            f"autotune_space: unknown key(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(SPACE_FLAGS)}"
        )
    typed = {
        name: _space_values(name, space[name], allowed) for name in SPACE_FLAGS if name in space
    }
    size = math.prod(len(v) for v in typed.values())
    if size > MAX_CANDIDATES:
        raise AutotuneInputError(
            f"autotune_space spans {size} candidates; at most {MAX_CANDIDATES} are planned"
        )
    return typed


def validate_workload(workload: Any) -> dict[str, int]:
    if not isinstance(workload, Mapping):
        raise AutotuneInputError(
            "autotune_workload must be a mapping {input_len, output_len, concurrency, num_prompts}"
        )
    unknown = sorted(str(key) for key in workload if key not in WORKLOAD_KEYS)
    if unknown:
        raise AutotuneInputError(
            f"autotune_workload: unknown key(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(WORKLOAD_KEYS)}"
        )
    out = {}
    for name in ("input_len", "output_len", "concurrency"):
        if workload.get(name) is None:
            raise AutotuneInputError(f"autotune_workload.{name} is required")
        out[name] = _bounded_int(workload[name], f"autotune_workload.{name}")
    prompts = workload.get("num_prompts")
    out["num_prompts"] = (
        out["concurrency"]
        if prompts is None
        else _bounded_int(prompts, "autotune_workload.num_prompts")
    )
    return out


def _bounded_int(value: Any, where: str) -> int:
    number = _positive_int(value, where)
    if number > MAX_WORKLOAD_VALUE:
        raise AutotuneInputError(f"{where}: {value!r} is above {MAX_WORKLOAD_VALUE}")
    return number


def validate_slo(slo: Any) -> dict[str, float | None]:
    slo = dict(slo or {})
    unknown = sorted(set(slo) - {"p99_ttft_ms", "p99_tpot_ms", "max_failures"})
    if unknown:
        raise AutotuneInputError(
            f"autotune_slo: unknown key(s) {', '.join(unknown)}; "
            "allowed: p99_ttft_ms, p99_tpot_ms, max_failures"
        )
    out: dict[str, float | None] = {}
    for name in ("p99_ttft_ms", "p99_tpot_ms"):
        value = slo.get(name)
        if value is not None and (not isinstance(value, int | float) or value <= 0):
            raise AutotuneInputError(f"autotune_slo.{name}: {value!r} is not a positive number")
        out[name] = None if value is None else float(value)
    failures = slo.get("max_failures", 0)
    if isinstance(failures, bool) or not isinstance(failures, int) or failures < 0:
        raise AutotuneInputError(f"autotune_slo.max_failures: {failures!r} is not an integer >= 0")
    out["max_failures"] = failures
    return out


def validate_inputs(
    *,
    space: Any,
    workload: Any,
    slo: Any = None,
    kv_cache_dtypes_allowed: Iterable[str] | None = None,
    tolerance: Any = DEFAULT_TOLERANCE,
    max_trials: Any = None,
) -> dict[str, Any]:
    """Every operator input of a search, typed; raises AutotuneInputError naming the variable
    and what it allows. Needs no host: the playbook calls it before touching one."""
    try:
        tol = float(tolerance)
    except (TypeError, ValueError):
        tol = math.nan
    if isinstance(tolerance, bool) or not 0 <= tol < 1:
        raise AutotuneInputError(f"autotune_tolerance: {tolerance!r} is not a number in [0, 1)")
    allowed = None if kv_cache_dtypes_allowed is None else [str(d) for d in kv_cache_dtypes_allowed]
    for dtype in allowed or []:
        if dtype not in kv_cache.KV_ELEM_BYTES:
            choices = ", ".join(sorted(kv_cache.KV_ELEM_BYTES))
            raise AutotuneInputError(
                f"autotune_kv_cache_dtypes_allowed: {dtype!r} is not a KV cache dtype ({choices})"
            )
    return {
        "space": validate_space(space, allowed),
        "workload": validate_workload(workload),
        "slo": validate_slo(slo),
        "tolerance": tol,
        "max_trials": None
        if max_trials is None
        else _positive_int(max_trials, "autotune_max_trials"),
    }


def spec_digest(state: Mapping[str, Any]) -> str:
    """What makes two searches the same search: server, current flags, typed inputs."""
    spec = {name: state.get(name) for name in SPEC_KEYS}
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _stamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")


# --- state --------------------------------------------------------------------------------
def new_state(
    *,
    server: str,
    base_flags: Mapping[str, Any],
    space: Mapping[str, Any],
    workload: Mapping[str, Any],
    context: Mapping[str, Any],
    slo: Mapping[str, Any] | None = None,
    kv_cache_dtypes_allowed: Iterable[str] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    max_trials: int | None = None,
    margin_gib: float = MIN_FREE_AFTER_GRAPH_GIB,
) -> dict[str, Any]:
    """A fresh search. context: {model_config, weight_bytes, host {gpu_memory_mib,
    host_ram_gib, gpu_count, gpu_name}, sglang_version, calibration (the host's store)}."""
    typed = validate_inputs(
        space=space,
        workload=workload,
        slo=slo,
        kv_cache_dtypes_allowed=kv_cache_dtypes_allowed,
        tolerance=tolerance,
        max_trials=max_trials,
    )
    for name in ("model_config", "weight_bytes", "host"):
        if context.get(name) is None:
            raise AutotuneInputError(f"autotune context lacks {name}")
    _check_context(context, typed["workload"])
    margin = _as_float(margin_gib)
    if isinstance(margin_gib, bool) or margin is None or not 0 <= margin < math.inf:
        raise AutotuneInputError(f"autotune margin_gib: {margin_gib!r} is not a number >= 0")
    typed_space = typed["space"]
    store = calibration.read_store(context.get("calibration"))
    state: dict[str, Any] = {
        "schema": STATE_SCHEMA,
        "started_at": _stamp(),
        "server": server,
        "base_flags": calibration.public_flags(base_flags),
        "space": typed_space,
        "workload": typed["workload"],
        "slo": typed["slo"],
        "tolerance": typed["tolerance"],
        "max_trials": typed["max_trials"],
        "margin_gib": float(margin_gib),
        "context": {
            "model_config": context["model_config"],
            "weight_bytes": int(context["weight_bytes"]),
            "host": dict(context["host"]),
            "sglang_version": context.get("sglang_version"),
        },
        "calibrations": store.records,
        # Entries of the host's store no plan may use: named here, never planned with.
        "calibrations_set_aside": [entry.describe() for entry in store.set_aside],
        "candidates": _grid(base_flags, typed_space),
        "trials": [],
        "speed_model": None,
        "in_flight": None,
        "done": False,
        "stop_reason": None,
    }
    state["spec_digest"] = spec_digest(state)
    _replan(state)
    return state


def _check_context(context: Mapping[str, Any], workload: Mapping[str, int]) -> None:
    """What every candidate's plan needs from the host and the model, before any trial."""
    host = context["host"]
    if not isinstance(host, Mapping):
        raise AutotuneInputError("autotune context host must be a mapping")
    for name in ("gpu_memory_mib", "gpu_count"):
        value = _as_float(host.get(name))
        if value is None or not 0 < value < math.inf:
            raise AutotuneInputError(
                f"autotune context host.{name}: {host.get(name)!r} is not a positive number "
                "(read from the host's GPUs)"
            )
    model = context["model_config"]
    window = model.get("max_position_embeddings") if isinstance(model, Mapping) else None
    need = workload["input_len"] + workload["output_len"]
    if isinstance(window, int) and not isinstance(window, bool) and 0 < window < need:
        raise AutotuneInputError(
            f"autotune_workload: input_len + output_len = {need} tokens, more than the model's "
            f"context window (max_position_embeddings {window})"
        )


def _grid(base: Mapping[str, Any], space: Mapping[str, list]) -> list[dict[str, Any]]:
    names = [n for n in SPACE_FLAGS if n in space]
    candidates = []
    for index, values in enumerate(itertools.product(*(space[n] for n in names))):
        tuned = _as_sglang_flags(base, dict(zip(names, values, strict=True)))
        candidates.append(
            {
                "id": f"c{index:03d}",
                "tuned": tuned,
                "changes": sum(1 for k, v in tuned.items() if _differs(base.get(k), v)),
                "status": "pending",
                "prune": None,
                "predicted": None,
            }
        )
    return candidates


def attn_dp_of(flags: Mapping[str, Any]) -> int:
    """The attention-DP size a flag set runs (both spellings, as SGLang resolves them)."""
    try:
        return attention_dp.resolve_layout(
            int(flags.get("tp_size") or 1),
            int(flags.get("dp_size") or 1),
            int(flags.get("attn_dp_size") or 1),
            str(flags.get("enable_dp_attention")).lower() in ("true", "1", "yes"),
        ).attn_dp_size
    except (attention_dp.LayoutError, TypeError, ValueError):
        return int(flags.get("attn_dp_size") or 1)  # the planner names the problem


def _as_sglang_flags(base: Mapping[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """A grid point as the flags a trial overlays on the server's (real SGLang flags only):
    a per-rank chunk becomes chunked_prefill_size x attn_dp_size, and a candidate attention-DP
    size replaces the deprecated spelling of the server's flags."""
    tuned = dict(point)
    if "attn_dp_size" in tuned and str(base.get("enable_dp_attention")).lower() == "true":
        tuned |= {"enable_dp_attention": False, "dp_size": 1}
    per_rank = tuned.pop(PER_RANK_CHUNK, None)
    if per_rank is not None:
        ranks = attn_dp_of(dict(base) | tuned)
        tuned["chunked_prefill_size"] = per_rank * ranks if per_rank > 0 else per_rank
    return tuned


def sglang_adjustments(flags: Mapping[str, Any], layout: Mapping[str, Any]) -> dict[str, Any]:
    """What SGLang changes by itself under attention DP (parallel_hook, pool_configurator):
    the prefill chunk and --max-running-requests are divided over the ranks, and
    schedule_conservativeness is multiplied by 0.3 (the scheduler admits more eagerly, so
    retractions are likelier). Empty without attention DP."""
    ranks = int(layout["attn_dp_size"])
    if ranks <= 1:
        return {}
    mrr = flags.get("max_running_requests")
    return {
        "attn_dp_size": ranks,
        "chunked_prefill_size_per_rank": layout["chunked_prefill_size_per_rank"],
        "max_running_requests_per_rank": None if mrr is None else max(1, int(mrr) // ranks),
        "schedule_conservativeness": round(
            float(flags.get("schedule_conservativeness") or 1.0) * ATTN_DP_CONSERVATIVENESS, 3
        ),
    }


def _differs(current: Any, value: Any) -> bool:
    if current is None:
        return True
    return str(current) != str(value) and _as_float(current) != _as_float(value)


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def candidate_flags(state: Mapping[str, Any], candidate: Mapping[str, Any]) -> dict[str, Any]:
    """The whole flag set a trial starts the server with."""
    return dict(state["base_flags"]) | dict(candidate.get("tuned") or {})


# --- planning -----------------------------------------------------------------------------
def _plan_flags(state: Mapping[str, Any], flags: Mapping[str, Any]) -> dict[str, Any]:
    ctx, work = state["context"], state["workload"]
    args = {k: flags[k] for k in _PLANNER_FLAGS if flags.get(k) is not None}
    args |= {
        "avg_input_len": work["input_len"],
        "avg_output_len": work["output_len"],
        "calibration": state["calibrations"],
        "calibration_mode": "enforce",
        "server_flags": calibration.public_flags(flags),
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


def _predicted(
    state: Mapping[str, Any], result: Mapping[str, Any], flags: Mapping[str, Any]
) -> dict[str, Any]:
    work = state["workload"]
    concurrency = min(result["max_concurrent_requests"], work["concurrency"])
    details = result["details"]
    return {
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
        result = _plan_flags(state, flags)
    except PlanInputError as exc:
        candidate.update(status="pruned", prune={"code": "invalid", "reason": str(exc)})
        return
    candidate["predicted"] = _predicted(state, result, flags)
    prune = _prune_reason(state, result)
    if prune is not None:
        candidate.update(status="pruned", prune=prune)


def _replan(state: dict[str, Any]) -> None:
    """Plan every untried candidate again (a new calibration or an OOM changes the picture)."""
    for candidate in state["candidates"]:
        if candidate["status"] in ("pending", "pruned") and (
            candidate["prune"] is None or candidate["prune"]["code"] != "invalid"
        ):
            candidate.update(status="pending", prune=None)
            _plan_candidate(state, candidate)
    _refit(state)


# --- the speed model ----------------------------------------------------------------------
def _measured(state: Mapping[str, Any]) -> list[tuple[int, float]]:
    """(waves, job seconds) of the trials that completed the whole job."""
    work = state["workload"]
    tokens = work["num_prompts"] * work["output_len"]
    points = []
    for trial in state["trials"]:
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
    waves = [w for w, _ in points]
    if len(set(waves)) < 2:
        a = sum(d / w for w, d in points) / len(points)
        return {"a": a, "k": 0.0, "source": "scaled"}
    n = len(points)
    mean_w = sum(waves) / n
    mean_d = sum(d for _, d in points) / n
    var = sum((w - mean_w) ** 2 for w in waves)
    a = sum((w - mean_w) * (d - mean_d) for w, d in points) / var
    k = mean_d - a * mean_w
    if a <= 0 or k < 0:
        # Noise can tilt the line; a negative step time or prefill time is not physical.
        k = max(0.0, k) if a > 0 else 0.0
        a = sum((d - k) / w for w, d in points) / n
    return {"a": a, "k": k, "source": "fitted"}


def _refit(state: dict[str, Any]) -> None:
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
            predicted["output_tok_s"] = round(predict_tok_s(model, work, predicted["waves"]), 1)


def predict_tok_s(model: Mapping[str, Any], workload: Mapping[str, int], waves: int) -> float:
    duration = model["a"] * waves + model["k"]
    return workload["num_prompts"] * workload["output_len"] / duration if duration > 0 else 0.0


# --- choosing and stopping ----------------------------------------------------------------
def _order_key(candidate: Mapping[str, Any]) -> tuple:
    p = candidate["predicted"]
    return (
        not p["calibrated"] and p["oom_warning"],  # uncalibrated risk last
        -p["output_tok_s"],
        -p["concurrency"],  # ties: the steady-state KV-bound model prefers more concurrency
        candidate["changes"],  # then the flag set closest to what serves today
        candidate["id"],
    )


def pending(state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Untried, unpruned candidates, best predicted first."""
    todo = [c for c in state["candidates"] if c["status"] == "pending"]
    return sorted(todo, key=_order_key)


def best_trial(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """The eligible trial (whole job done, SLOs met) with the most output tok/s."""
    ok = [t for t in state["trials"] if t.get("outcome") == "ok"]
    return max(ok, key=lambda t: (t["output_throughput"], -t["n"])) if ok else None


def _stop_reason(state: Mapping[str, Any]) -> str | None:
    todo = pending(state)
    if not todo:
        return "every candidate was tried or pruned"
    limit = state["max_trials"]
    if limit is not None and len(state["trials"]) >= limit:
        return f"the trial budget ({limit}) is spent"
    best = best_trial(state)
    if best is None:
        return None
    top = todo[0]["predicted"]["output_tok_s"]
    bar = top * (1 - state["tolerance"])
    if best["output_throughput"] >= bar:
        return (
            f"early stop: trial {best['n']} measured {best['output_throughput']:.1f} tok/s, at "
            f"least the best remaining prediction {top:.1f} tok/s x (1 - {state['tolerance']:g})"
        )
    return None


def _needs_baseline(state: Mapping[str, Any]) -> bool:
    """No calibration matched yet and the current flag set has not run in this search."""
    if any(t["candidate"] == BASELINE_ID for t in state["trials"]):
        return False
    return not any(c["predicted"] and c["predicted"]["calibrated"] for c in state["candidates"])


def _calibration_may_help(state: Mapping[str, Any]) -> bool:
    """A candidate left, or one pruned for a reason measured memory can lift: otherwise a
    baseline start would restart the server for a search that cannot run any trial."""
    return any(
        c["status"] == "pending" or (c["prune"] or {}).get("code") in _CALIBRATION_REVISES
        for c in state["candidates"]
    )


def next_trial(state: dict[str, Any]) -> dict[str, Any] | None:
    """The next flag set to try ({n, candidate, flags, tuned, predicted}), or None when done.

    Marks it in flight: calling again before record_trial returns the same trial, so an
    interrupted run resumes where it stopped.
    """
    if state["in_flight"] is not None:
        return state["in_flight"]
    if state["done"]:
        return None
    if _needs_baseline(state) and _calibration_may_help(state):
        trial = {
            "n": len(state["trials"]) + 1,
            "candidate": BASELINE_ID,
            "tuned": {},
            "flags": dict(state["base_flags"]),
            "predicted": None,
            "why": "calibrate: the server's current flag set starts first",
        }
        state["in_flight"] = trial
        return trial
    reason = _stop_reason(state)
    if reason is not None:
        state.update(done=True, stop_reason=reason)
        return None
    chosen = pending(state)[0]
    trial = {
        "n": len(state["trials"]) + 1,
        "candidate": chosen["id"],
        "tuned": dict(chosen["tuned"]),
        "flags": candidate_flags(state, chosen),
        "predicted": dict(chosen["predicted"]),
        "why": "best predicted of the candidates left",
    }
    state["in_flight"] = trial
    return trial


def _not_finite(smoke: Mapping[str, Any]) -> list[str]:
    """Figures of a smoke result that are present but not finite numbers (NaN would beat every
    real trial in a max(), and fail no SLO in a comparison)."""
    bad = []
    for name in (*_FIGURES, "output_throughput"):
        value = smoke.get(name)
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
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
    }
    state["trials"].append(row)
    _mark_candidate(state, trial["candidate"], row["outcome"])
    record = result.get("calibration")
    if record:
        try:
            state["calibrations"] = calibration.add_record(state["calibrations"], record)
        except calibration.CalibrationError as exc:
            row["calibration_not_kept"] = str(exc)
    state["in_flight"] = None
    _replan(state)
    return row


def _clip(text: str | None, limit: int = 2400) -> str | None:
    """The error kept in the state: its head (what failed) and its tail (the journal's end)."""
    if not text:
        return None
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]}\n[...]\n{text[-(limit - head) :]}"


_FIGURES = ("output_throughput", "p99_ttft_ms", "p99_tpot_ms", "completed", "failed", "duration")


def _smoke_figures(smoke: Mapping[str, Any] | None) -> dict[str, Any]:
    """The figures kept in the state; one that is not a finite number is kept as None."""
    smoke = smoke or {}
    bad = _not_finite(smoke)
    return {name: None if name in bad else smoke.get(name) for name in _FIGURES}


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


def winner(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """The best eligible trial with its whole flag set, or None."""
    best = best_trial(state)
    if best is None:
        return None
    return dict(best) | {"flags": dict(state["base_flags"]) | dict(best["tuned"])}


# --- outputs ------------------------------------------------------------------------------
def profile_yaml(state: Mapping[str, Any], profile_name: str | None = None) -> str:
    """The winner as an inventory profile (sglang_server_profiles) to paste or commit."""
    best = winner(state)
    name = profile_name or f"{state['server']}-autotuned"
    if best is None:
        return f"---\n# autotune for {state['server']}: no trial met the SLOs; no profile.\n"
    keys = [
        "chunked_prefill_size" if k == PER_RANK_CHUNK else k
        for k in SPACE_FLAGS
        if k in state["space"]
    ]
    keys += list(best["tuned"])  # what replaced a deprecated spelling
    tuned = {k: best["flags"][k] for k in dict.fromkeys(keys) if k in best["flags"]}
    lines = [
        "---",
        f"# autotune for {state['server']}: trial {best['n']} of {len(state['trials'])}, "
        f"{best['output_throughput']:.1f} output tok/s",
        f"# on the workload {_workload_text(state['workload'])}.",
        "# Add the entry to sglang_server_profiles in the inventory and set the server's",
        "# profile to it. A server's own flags override its profile: drop these keys there.",
        "sglang_server_profiles:",
        f"  {name}:",
    ]
    lines += [f"    {key}: {_yaml_scalar(value)}" for key, value in tuned.items()]
    return "\n".join(lines) + "\n"


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))


def _workload_text(work: Mapping[str, int]) -> str:
    return (
        f"{work['num_prompts']} requests of {work['input_len']} + {work['output_len']} tokens, "
        f"{work['concurrency']} concurrent"
    )


def _tuned_text(tuned: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in tuned.items()) or "(current flags)"


def _num(value: Any, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def report_markdown(state: Mapping[str, Any]) -> str:
    """The report's table: trials, pruned candidates and why, the winner."""
    lines = [
        f"# autotune: {state['server']}",
        "",
        f"Workload: {_workload_text(state['workload'])}. SLOs: {json.dumps(state['slo'])}. "
        f"Tolerance {state['tolerance']:g}.",
        f"Stopped: {state['stop_reason'] or 'not yet'}.",
        "",
        "| trial | candidate | flags | predicted tok/s | output tok/s | p99 TTFT ms | "
        "p99 TPOT ms | failed | outcome |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in state["trials"]:
        predicted = (t.get("predicted") or {}).get("output_tok_s")
        lines.append(
            f"| {t['n']} | {t['candidate']} | {_tuned_text(t['tuned'])} | {_num(predicted)} | "
            f"{_num(t.get('output_throughput'))} | {_num(t.get('p99_ttft_ms'), '{:.0f}')} | "
            f"{_num(t.get('p99_tpot_ms'))} | {_num(t.get('failed'), '{}')} | "
            f"{t['outcome']}{' (OOM)' if t.get('oom') else ''} |"
        )
    pruned = [c for c in state["candidates"] if c["status"] == "pruned"]
    lines += ["", f"## Pruned before trying ({len(pruned)})", ""]
    lines += ["| candidate | flags | why |", "|---|---|---|"]
    lines += [
        f"| {c['id']} | {_tuned_text(c['tuned'])} | {c['prune']['code']}: {c['prune']['reason']} |"
        for c in pruned
    ]
    left = [c for c in state["candidates"] if c["status"] == "pending"]
    lines += ["", f"Not tried (predicted no better within the tolerance): {len(left)}.", ""]
    best = winner(state)
    lines.append(
        f"**Winner**: trial {best['n']} ({best['candidate']}), {_tuned_text(best['tuned'])}: "
        f"{best['output_throughput']:.1f} output tok/s."
        if best
        else "**Winner**: none (no trial met the SLOs)."
    )
    return "\n".join(lines) + "\n"


def write_report(state: Mapping[str, Any], out_dir: str | Path, stamp: str) -> dict[str, str]:
    """reports/<host>/<server>/autotune-<stamp>.{md,json,png} and the winner's profile YAML."""
    # matplotlib is imported only to draw (it is slow to import and the loop never draws).
    from sglang_fleet.tuning.autotune_picture import render_png  # noqa: PLC0415

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": out / f"autotune-{stamp}.md",
        "json": out / f"autotune-{stamp}.json",
        "png": out / f"autotune-{stamp}.png",
        "profile": out / f"autotune-{stamp}-profile.yml",
    }
    paths["markdown"].write_text(report_markdown(state), encoding="utf-8")
    best = winner(state)
    summary = {k: v for k, v in state.items() if k != "context"} | {"winner": best}
    paths["json"].write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    paths["profile"].write_text(profile_yaml(state), encoding="utf-8")
    render_png(state, paths["png"], best)
    return {k: str(v) for k, v in paths.items()}


# --- command line -------------------------------------------------------------------------
def _read_json(path: str) -> Any:
    """A JSON file the role wrote: a regular file, bounded in size and nesting."""
    try:
        raw = input_files.read_bytes(path, input_files.JSON_LIMIT, "")
        return bounded_json.loads(raw, str(path))
    except ValueError as exc:
        raise AutotuneInputError(str(exc).strip()) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


_STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "server": str,
    "base_flags": dict,
    "space": dict,
    "workload": dict,
    "slo": dict,
    "tolerance": (int, float),
    "margin_gib": (int, float),
    "context": dict,
    "calibrations": (dict, list),
    "candidates": list,
    "trials": list,
    "done": bool,
    "spec_digest": str,
}


_DIGEST_MISMATCH = "its inputs do not match its spec_digest (edited by hand?)"


def _state_problem(state: Any) -> str:
    """Why a parsed state file is not a whole autotune state of this schema ('' when it is)."""
    if not isinstance(state, dict):
        return f"not an autotune state (JSON {type(state).__name__})"
    if state.get("schema") != STATE_SCHEMA:
        return f"schema {state.get('schema')!r}, not {STATE_SCHEMA!r}"
    bad = [k for k, kind in _STATE_TYPES.items() if not isinstance(state.get(k), kind)]
    if not isinstance(state.get("in_flight"), dict | None):
        bad.append("in_flight")
    if not all(
        isinstance(c, dict) and {"id", "tuned", "status"} <= set(c)
        for c in state.get("candidates") or [None]
    ):
        bad.append("candidates[]")
    if not all(
        isinstance(t, dict) and "candidate" in t and "outcome" in t
        for t in state.get("trials") or []
    ):
        bad.append("trials[]")
    if bad:
        return f"missing or bad: {', '.join(sorted(set(bad)))}"
    if state["spec_digest"] != spec_digest(state):
        return _DIGEST_MISMATCH
    return ""


def load_state(path: str | Path, digest_may_differ: bool = False) -> dict[str, Any]:
    """The state file, checked: AutotuneInputError naming the file and the server otherwise.

    digest_may_differ: for init, which never resumes such a state (its stored digest is not
    what its inputs give) but replaces it as a search of other inputs, as it does a state an
    older sglang-fleet wrote with a digest that covered less."""
    try:
        raw = input_files.read_bytes(path, input_files.JSON_LIMIT, "")
        state = bounded_json.loads(raw, "the state file", parse_constant=_no_constant)
    except ValueError as exc:  # not a regular file, too large, not JSON, nested too deep
        state, problem = None, f"not JSON ({str(exc).strip()})"
    else:
        problem = _state_problem(state)
    if problem == _DIGEST_MISMATCH and digest_may_differ:
        return {**state, "spec_digest": None}
    if problem:
        server = state.get("server") if isinstance(state, dict) else None
        raise AutotuneInputError(
            f"autotune state {path} (server {server if isinstance(server, str) else '?'}): "
            f"{problem}; move it away, or run init --force to start a new search"
        )
    return state


def save_state(state: Mapping[str, Any], path: str | Path) -> None:
    """Write atomically: an interrupted run must find a whole state file."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, target)


def _old_state(path: str, force: bool) -> dict[str, Any] | None:
    """The state a rerun finds: checked, unless --force replaces it whatever it holds."""
    if not Path(path).exists():
        return None
    try:
        return load_state(path, digest_may_differ=True)
    except AutotuneInputError:
        if not force:
            raise
        return {"started_at": None, "done": None, "stop_reason": "unreadable", "trials": []}


def _cmd_init(ns: argparse.Namespace) -> Any:
    spec, ctx = _read_json(ns.spec), _read_json(ns.context)
    state = new_state(
        server=spec["server"],
        base_flags=spec["base_flags"],
        space=spec.get("space"),
        workload=spec.get("workload"),
        context=ctx,
        slo=spec.get("slo"),
        kv_cache_dtypes_allowed=spec.get("kv_cache_dtypes_allowed"),
        tolerance=spec.get("tolerance", DEFAULT_TOLERANCE),
        max_trials=spec.get("max_trials"),
        margin_gib=spec.get("margin_gib", MIN_FREE_AFTER_GRAPH_GIB),
    )
    old = _old_state(ns.state, ns.force)
    if old is not None and not ns.force and old.get("spec_digest") == state["spec_digest"]:
        return load_summary(old) | {"resumed": True, "replaced": None}  # a rerun goes on
    save_state(state, ns.state)
    replaced = None
    if old is not None:
        replaced = {k: old.get(k) for k in ("started_at", "done", "stop_reason")}
        replaced["trials"] = len(old.get("trials") or [])
    return load_summary(state) | {"resumed": False, "replaced": replaced}


def trials_at_most(state: Mapping[str, Any]) -> int:
    """How many trials this search may still run, at most: the length of the tuning loop
    (roles/autotune/tasks/main.yml), which ends earlier when next_trial() says done. The trial in
    flight, a baseline start, and every candidate not tried yet (a pruned one may come back
    after a calibration), within what is left of the trial budget."""
    in_flight = 1 if state["in_flight"] is not None else 0
    if state["done"]:
        return in_flight
    bound = in_flight + 1 + sum(1 for c in state["candidates"] if c["status"] != "tried")
    if state["max_trials"] is not None:
        left = max(0, state["max_trials"] - len(state["trials"]))
        bound = min(bound, in_flight + 1 + left)
    return bound


def load_summary(state: Mapping[str, Any]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for c in state["candidates"]:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    return {
        "trials_at_most": trials_at_most(state),
        "server": state["server"],
        "started_at": state.get("started_at"),
        "candidates": len(state["candidates"]),
        "by_status": counts,
        "trials": len(state["trials"]),
        "done": state["done"],
        "stop_reason": state["stop_reason"],
        "winner": winner(state),
    }


def _cmd_next(ns: argparse.Namespace) -> Any:
    state = load_state(ns.state)
    trial = next_trial(state)
    save_state(state, ns.state)
    return trial


def _cmd_record(ns: argparse.Namespace) -> Any:
    state = load_state(ns.state)
    if state["in_flight"] is None:
        raise AutotuneInputError("no trial is in flight: call next first")
    row = record_trial(state, state["in_flight"], _read_json(ns.result))
    save_state(state, ns.state)
    return row


def _cmd_report(ns: argparse.Namespace) -> Any:
    state = load_state(ns.state)
    return write_report(state, ns.out_dir, ns.stamp or state.get("started_at") or _stamp())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m sglang_fleet.tuning.autotune", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="plan the candidates (a rerun keeps an existing state)")
    init.add_argument("--spec", required=True, help="JSON: server, base_flags, space, ...")
    init.add_argument("--context", required=True, help="JSON: model_config, weight_bytes, ...")
    init.add_argument(
        "--force",
        action="store_true",
        help="start over (by default a state of the same inputs is resumed, one of other "
        "inputs is replaced)",
    )
    sub.add_parser("next", help="print the next trial as JSON, or null when done")
    record = sub.add_parser("record", help="record the trial in flight")
    record.add_argument("--result", required=True, help="JSON: smoke, calibration, error, phase")
    report = sub.add_parser("report", help="write the table, picture and winner profile")
    report.add_argument("--out-dir", required=True)
    report.add_argument(
        "--stamp", default=None, help="file name stamp (default: when the search started)"
    )
    for command in sub.choices.values():
        command.add_argument("--state", required=True, help="the search's JSON state file")
    ns = parser.parse_args(argv)
    handlers = {"init": _cmd_init, "next": _cmd_next, "record": _cmd_record, "report": _cmd_report}
    try:
        output = handlers[ns.command](ns)
    except (AutotuneInputError, OSError, json.JSONDecodeError, KeyError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(output, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
