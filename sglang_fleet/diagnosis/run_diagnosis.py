"""A finished run diagnosed (`diagnose`): its evidence, verdict, levers and notes, from the smoke
result's samples and/or the server log (docs/DIAGNOSIS.md).
"""

from __future__ import annotations

from typing import Any

from sglang_fleet.capacity import attention_dp, logged_flags, speculative
from sglang_fleet.capacity.model_config import ModelConfigError, model_shape
from sglang_fleet.capacity.noop_flags import noop_flag_issues
from sglang_fleet.capacity.server_log import StartupLog, parse_log
from sglang_fleet.diagnosis.evidence import (
    HICACHE_NOTE,
    classify,
    client_concurrency,
    gather_evidence,
    samples_from_log,
    samples_from_metrics,
)
from sglang_fleet.diagnosis.levers import verdict_levers
from sglang_fleet.diagnosis.speculation import (
    cap_lever,
    plannable_flags,
    running_speculation,
    speculation_findings,
)
from sglang_fleet.module_utils import typed_number


def diagnose(
    smoke_result: dict | None = None,
    log_text: str | None = None,
    concurrency: int | None = None,
    plan_context: dict | None = None,
) -> dict:
    """Classify one run. Pure: inputs are the smoke result, the log text and optional planner
    context {model_config, weight_bytes, args, host} used to size the levers; a log with
    start-up lines calibrates that plan unless the context brings its own calibration."""
    dropped: list[str] = []
    smoke = finite_only(smoke_result or {}, "smoke result", dropped)
    samples = samples_from_metrics(smoke.get("server_metrics"))
    source, schedulers = "server_metrics", 1
    if not samples and log_text:
        (samples, schedulers), source = samples_from_log(log_text), "log"
    asked, achieved = client_concurrency(smoke, concurrency)
    ev = gather_evidence(samples, source if samples else "none", smoke, asked, achieved)
    # Each data-parallel scheduler sees its share of the client's requests.
    ev["schedulers"] = schedulers
    startup = parse_log(log_text) if log_text else None  # parsed once for all that follows
    if startup is not None and ev["max_total_num_tokens"] is None:
        ev["max_total_num_tokens"] = startup.max_total_num_tokens
    ctx = _with_log_calibration(plan_context, log_text, startup)
    verdict = classify(ev)
    notes = [HICACHE_NOTE] if verdict == "kv_cache_bound" else []
    levers = verdict_levers(verdict, ev, ctx)
    running = running_speculation(smoke, startup)
    first, last, spec_notes = speculation_findings(ev, running, ctx)
    levers = first + levers + last
    notes += spec_notes
    if startup is not None:
        notes += noop_notes(startup.server_args, None)
        notes += [skipped] if (skipped := startup.long_lines_note()) else []
        if verdict == "kv_cache_bound":
            levers = cap_lever(startup.server_args, ev) + levers
    notes += dropped_note(dropped)
    return {"verdict": verdict, "evidence": ev, "levers": levers, "notes": notes}


def finite_only(value: Any, where: str, dropped: list[str]) -> Any:
    """The value with every NaN, infinite or huge number replaced by None (JSON reads Infinity,
    NaN and integers of any size; no count, rate or time is one, and float() of a 400-digit
    integer raises OverflowError), naming each in ``dropped``
    (plugins/module_utils/typed_number.py)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and typed_number.finite_or_none(value) is None:
        dropped.append(where)
        return None
    if isinstance(value, dict):
        return {k: finite_only(v, f"{where}.{k}", dropped) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_only(v, f"{where}[{i}]", dropped) for i, v in enumerate(value)]
    return value


def dropped_note(dropped: list[str]) -> list[str]:
    if not dropped:
        return []
    shown = ", ".join(dropped[:5]) + (f" and {len(dropped) - 5} more" if len(dropped) > 5 else "")
    return [f"Values that are not finite numbers were left out: {shown}."]


def noop_notes(flags: dict[str, Any], version: str | None) -> list[str]:
    """Flags that do nothing in the installed SGLang (sglang_fleet.capacity.noop_flags)."""
    return [f"{i['code']}: {i['message']}" for i in noop_flag_issues(flags, version)]


def _model_layout(ctx: dict) -> tuple[Any, Any]:
    """config.json's shape and weight placement, when the context has the model (a live
    diagnosis from the role may carry only the flags)."""
    config, weight_bytes = ctx.get("model_config"), ctx.get("weight_bytes")
    if not isinstance(config, dict) or not weight_bytes:
        return None, None
    try:
        shape = model_shape(config)
        return shape, attention_dp.weight_layout(config, shape, int(weight_bytes))
    except (ModelConfigError, TypeError, ValueError):
        return None, None


def _with_log_calibration(
    ctx: dict | None, log_text: str | None, startup: StartupLog | None = None
) -> dict | None:
    """ctx with the logged run's flags (and the log as calibration); startup: the log parsed."""
    if not ctx:
        return None
    args = dict(ctx.get("args") or {})
    if log_text:
        startup = startup or parse_log(log_text)
        # The run's own flags are what the levers compare against: as the log states them,
        # or as its lines show them (sglang_fleet.capacity.logged_flags), never assumed.
        shape, weights = _model_layout(ctx)
        # logged_flags resolves the deprecated `--dp-size N --enable-dp-attention` to
        # attn_dp_size N, dp_size 1, as SGLang does.
        run = logged_flags.infer(startup, shape, weights, stated=args.get("calibration_log_flags"))
        for key in ("tp_size", "dp_size", "attn_dp_size", "mem_fraction_static", "kv_cache_dtype"):
            if run.flags.get(key) is not None:
                args.setdefault(key, run.flags[key])
        logged = {
            k: startup.server_args[k] for k in speculative.FLAGS if startup.server_args.get(k)
        }
        for key, value in plannable_flags(logged, args).items():
            args.setdefault(key, value)
        if startup.has_memory:
            args.setdefault("calibration_log", log_text)
    return dict(ctx) | {"args": args}
