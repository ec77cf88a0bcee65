"""What to change next for a verdict: the levers (fp8 KV cache, a higher or safer
mem_fraction_static, more GPUs, attention DP), each with the planner's expected capacity
when a model is at hand (docs/DIAGNOSIS.md).
"""

from __future__ import annotations

from typing import Any

from sglang_fleet.capacity import kv_cache
from sglang_fleet.capacity.model_config import ModelConfigError, model_shape
from sglang_fleet.capacity.planner import plan
from sglang_fleet.capacity.planner_inputs import PlanInputError
from sglang_fleet.diagnosis.evidence import FRACTION_STEP, make_lever


# --- levers ------------------------------------------------------------------------------
def plan_with(ctx: dict[str, Any], **overrides: Any) -> dict[str, Any] | None:
    args = dict(ctx.get("args") or {}) | overrides
    try:
        return plan(
            ctx["model_config"], int(ctx["weight_bytes"]), args, dict(ctx.get("host") or {})
        )
    except (PlanInputError, KeyError, TypeError, ValueError):
        return None


def _dtype_words(dtype: str) -> str:
    return "auto: the model's dtype, bf16 for most models" if dtype == "auto" else dtype


def _fp8_lever(
    ctx: dict[str, Any] | None, current: dict[str, Any] | None, ev: dict[str, Any]
) -> dict[str, str] | None:
    dtype = ((ctx or {}).get("args") or {}).get("kv_cache_dtype", "auto")
    if dtype in kv_cache.FP8_DTYPES or dtype in kv_cache.FP4_DTYPES:
        return None
    fp8 = plan_with(ctx, kv_cache_dtype="fp8_e4m3") if ctx else None
    if fp8 and current and not fp8["errors"]:
        return make_lever(
            "kv_cache_dtype_fp8",
            f"Use --kv-cache-dtype fp8_e4m3: one byte per KV element instead of two. The planner "
            f"expects max_total_num_tokens {fp8['max_total_num_tokens']} (now "
            f"{current['max_total_num_tokens']}), about {fp8['max_concurrent_requests']} "
            "concurrent "
            f"requests (now {current['max_concurrent_requests']}), ~{fp8['kv_bound_output_tok_s']} "
            "output tok/s while KV-bound. A quality trade-off: check outputs on your task.",
        )
    tokens = ev.get("max_total_num_tokens")
    pool = f" (max_total_num_tokens now {int(tokens)})" if tokens else ""
    return make_lever(
        "kv_cache_dtype_fp8",
        f"Use --kv-cache-dtype fp8_e4m3 (now {_dtype_words(dtype)}): the same pool holds "
        f"about twice the KV tokens of bf16{pool}, so about twice the concurrent decodes. "
        "A quality trade-off: check outputs on your task.",
    )


def _fraction_lever(ctx: dict[str, Any] | None, current: dict[str, Any] | None) -> dict[str, str]:
    if not (ctx and current):
        now = ((ctx or {}).get("args") or {}).get("mem_fraction_static")
        now_words = f" (now {now})" if now is not None else ""
        return make_lever(
            "mem_fraction_static",
            f"Raise --mem-fraction-static{now_words} in small steps while the memory left after "
            "CUDA graph capture stays above the planner's margin (run "
            "sglang_fleet.capacity.planner with --calibrate-from this run's log): too high a "
            "value runs out of memory during a large prefill.",
        )
    d = current["details"]
    now, limit = d["mem_fraction_static"], d["max_safe_mem_fraction_static"]
    target = kv_cache.floor_to(limit, FRACTION_STEP)
    raised = plan_with(ctx, mem_fraction_static=round(target, 3)) if target > now + 1e-9 else None
    if raised is None or raised["errors"]:
        return make_lever(
            "mem_fraction_static_at_limit",
            f"--mem-fraction-static {now} is already at the planner's safe limit ({limit:.3f}): "
            "raising it risks CUDA out of memory during CUDA graph capture or a large prefill.",
        )
    basis = (
        "measured free memory after CUDA graph capture"
        if d["calibrated"]
        else "SGLang's own reserve estimate"
    )
    return make_lever(
        "mem_fraction_static",
        f"Raise --mem-fraction-static from {now} to {target:.3f} (within the headroom, by "
        f"{basis}): max_total_num_tokens {raised['max_total_num_tokens']} (now "
        f"{current['max_total_num_tokens']}), about {raised['max_concurrent_requests']} "
        "concurrent requests.",
    )


def _gpu_lever(ctx: dict[str, Any] | None) -> dict[str, str]:
    mla_note = ""
    if ctx:
        try:
            if model_shape(ctx["model_config"]).is_mla:
                mla_note = (
                    " For this MLA model a larger --tp-size only frees weight memory per GPU: "
                    "the latent KV cache is replicated on every rank, not split."
                )
        except (ModelConfigError, KeyError):
            mla_note = ""
    return make_lever(
        "more_gpus",
        "Add GPUs: each data-parallel replica (--dp-size, or another server) brings its own KV "
        f"pool, so two replicas hold twice the concurrent decodes.{mla_note}",
    )


def _attn_dp_lever(
    ctx: dict[str, Any] | None, current: dict[str, Any] | None
) -> dict[str, str] | None:
    """Attention data parallelism for an MLA model: one KV pool per attention-DP rank
    (docs/ATTENTION-DP.md), sized by the planner's table of layouts."""
    if not (ctx and current):
        return None
    try:
        if not model_shape(ctx["model_config"]).is_mla:
            return None
    except (ModelConfigError, KeyError):
        return None
    pick = current.get("recommended_layout")
    rows = {row["attn_dp_size"]: row for row in current.get("attention_dp_layouts") or []}
    now = current["layout"]
    if not pick or pick["attn_dp_size"] == now["attn_dp_size"]:
        return None
    row = rows[pick["attn_dp_size"]]
    graph = (
        f" --cuda-graph-max-bs-decode {row['cuda_graph_max_bs_decode']}"
        if row["cuda_graph_max_bs_decode"]
        else ""
    )
    return make_lever(
        "attention_dp",
        f"Use --attn-dp-size {row['attn_dp_size']}{graph} (attention data parallelism; now "
        f"{now['attn_dp_size']}): under plain TP every GPU holds every request's latent KV, "
        f"with attention DP each of the {row['kv_pools']} ranks has its own pool. The planner "
        f"expects {row['total_kv_tokens']} KV tokens in all (now {current['total_kv_tokens']}), "
        f"about {row['max_concurrent_requests']} concurrent requests (now "
        f"{current['max_concurrent_requests']}), ~{row['kv_bound_output_tok_s']} output tok/s "
        f"while KV-bound (decode roofline {row['decode_roofline_tok_s']} tok/s), at "
        f"{row['weights_per_gpu_gib']} GiB of weights per GPU (now "
        f"{now['weights_per_gpu_gib']}: the attention projections are split over "
        f"{row['attn_tp_size']} GPU(s) instead of {now['attn_tp_size']}). Set "
        "--mem-fraction-static explicitly: SGLang's default reserve grows under attention DP.",
    )


def _at_safe_fraction(
    ctx: dict[str, Any] | None, current: dict[str, Any] | None
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, str] | None]:
    """(context, plan, lever) to size the other levers with. A current fraction that its own
    calibration refuses (less free after CUDA graph capture than the margin) plans no lever:
    every flag set at that fraction has the same error. So the levers are planned at the
    highest safe fraction, and the first lever says to go there."""
    refused = next(
        (e for e in (current or {}).get("errors") or [] if e["code"] == "oom_risk_mem_fraction"),
        None,
    )
    if ctx is None or current is None or refused is None:
        return ctx, current, None
    d = current["details"]
    now, safe = (
        d["mem_fraction_static"],
        kv_cache.floor_to(d["max_safe_mem_fraction_static"], FRACTION_STEP),
    )
    lowered = plan_with(ctx, mem_fraction_static=round(safe, 3)) if safe < now else None
    if lowered is None or lowered["errors"]:
        return ctx, current, None
    at_safe = dict(ctx) | {"args": dict(ctx.get("args") or {}) | {"mem_fraction_static": safe}}
    lever = make_lever(
        "mem_fraction_static_above_limit",
        f"Lower --mem-fraction-static from {now} to {safe:.3f}, the highest safe fraction: "
        f"{now} leaves a predicted {d['free_after_graph_gib']} GiB free after CUDA graph "
        f"capture, under the {d['free_after_graph_margin_gib']} GiB margin (expect CUDA out of "
        f"memory in a large prefill). At {safe:.3f} the planner expects max_total_num_tokens "
        f"{lowered['max_total_num_tokens']} (now {current['max_total_num_tokens']}), about "
        f"{lowered['max_concurrent_requests']} concurrent requests. The other levers are "
        f"planned at {safe:.3f}.",
    )
    return at_safe, lowered, lever


def _kv_levers(ctx: dict[str, Any] | None, ev: dict[str, Any]) -> list[dict[str, str]]:
    current = plan_with(ctx) if ctx else None
    ctx, current, lowered = _at_safe_fraction(ctx, current)
    fp8 = _fp8_lever(ctx, current, ev)
    attn_dp = _attn_dp_lever(ctx, current)
    # With fp8 KV already on, attention DP is the largest lever left for an MLA model.
    first = [fp8, attn_dp] if fp8 is not None else [attn_dp]
    if lowered is not None:  # first of all: the fraction it runs at is not safe
        return [lever for lever in [lowered, *first, _gpu_lever(ctx)] if lever is not None]
    levers = [*first, _fraction_lever(ctx, current), _gpu_lever(ctx)]
    return [lever for lever in levers if lever is not None]


def verdict_levers(
    verdict: str, ev: dict[str, Any], ctx: dict[str, Any] | None
) -> list[dict[str, str]]:
    if verdict == "kv_cache_bound":
        return _kv_levers(ctx, ev)
    if verdict == "compute_bound":
        return [
            make_lever(
                "batch_caps",
                "Requests queue while the KV cache has room: check --max-running-requests and "
                "--cuda-graph-max-bs-decode, which cap the running batch below the KV capacity.",
            ),
            make_lever(
                "more_gpus",
                "Add GPUs: a larger --tp-size speeds up each step; --dp-size adds replicas.",
            ),
            make_lever(
                "speculative_decoding",
                "Speculative decoding (EAGLE / MTP draft heads) raises per-request decode "
                "speed when the GPU is busy.",
            ),
        ]
    if verdict == "client_bound":
        return [
            make_lever(
                "client",
                f"The client kept only {ev.get('client_concurrency_achieved')} of "
                f"{ev.get('client_concurrency_asked')} requests in flight and the server had no "
                "queue: "
                "run more client processes or a higher request rate, and check the client's CPU.",
            )
        ]
    if verdict == "healthy":
        return [
            make_lever(
                "raise_load",
                "The server kept up with the load: raise the client concurrency until token usage "
                "nears 0.9 or a queue forms, to find the capacity.",
            )
        ]
    if verdict == "idle":
        return [
            make_lever(
                "sample_under_load",
                "Nothing to diagnose: no request ran or waited during the window. Sample again "
                "while the server carries its usual load (or a longer --window).",
            )
        ]
    return _nothing_measured(ev)


def _nothing_measured(ev: dict[str, Any]) -> list[dict[str, str]]:
    """The lever of an `unknown` verdict: why there was nothing to judge."""
    if ev.get("completed") == 0 and ev.get("failed"):
        return [
            make_lever(
                "requests_failed",
                f"Every request failed ({ev['failed']} of {ev['failed']}): the run measured "
                "nothing about the server's capacity. Fix the failures first (the smoke "
                "result's failure_reasons and errors, the server log), then measure again.",
            )
        ]
    return [
        make_lever(
            "collect_data",
            "No server samples: run with --enable-metrics (smoke samples /metrics) or pass "
            "the server log.",
        )
    ]
