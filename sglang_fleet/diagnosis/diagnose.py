"""Bottleneck diagnosis of a run, or of a running server: what bounds it, what to change next.

    python3 -m sglang_fleet.diagnosis.diagnose [--log SERVER_LOG] [--smoke-result RESULT.json] \
        [--concurrency N] [--model-path DIR --gpu-memory-mib MIB ...] --json
    python3 -m sglang_fleet.diagnosis.diagnose --url http://HOST:PORT [--api-key-file F] [--window
    30] \
        [--json | --table] [--log SERVER_LOG] [--model-path DIR --gpu-memory-mib MIB ...]
    python3 -m sglang_fleet.diagnosis.diagnose --sample LIVE_SAMPLE.json [--json | --table] ...

After a run it reads what the smoke benchmark sampled from /metrics (`server_metrics.samples`,
see docs/CONTRACTS.md) and/or the server log's "Decode batch" lines. With --url it samples a
running server's /metrics for --window seconds without touching it
(sglang_fleet.diagnosis.live_metrics; with
--sample it reads such a sample taken on the GPU host) and judges that window the same way
(docs/DIAGNOSIS.md). It prints one JSON object: `verdict` (kv_cache_bound, compute_bound,
client_bound, healthy, idle; `unknown` when there is nothing to judge), `evidence` (the
numbers), `levers` (next steps, objects with code and message) and `notes`; a live diagnosis
adds `summary`, `row` and `server`. With a model (planner flags, or `plan_context` in the pure
functions) the levers carry the planner's expected capacity. Exit status: 0 with a diagnosis;
1 when a live server could not be sampled (unreachable, no --enable-metrics, API key refused);
2 on bad usage. The verdict itself never changes the exit status.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from sglang_fleet import input_files
from sglang_fleet.capacity import attention_dp, kv_cache, logged_flags, speculative
from sglang_fleet.capacity.model_config import ModelConfigError, model_shape, read_model_dir
from sglang_fleet.capacity.noop_flags import noop_flag_issues
from sglang_fleet.capacity.planner import add_plan_arguments, plan, read_draft, split_namespace
from sglang_fleet.capacity.planner_inputs import PLANNER_FLAGS, PlanInputError
from sglang_fleet.capacity.server_log import Calibration, parse_decode_lines, parse_log
from sglang_fleet.diagnosis import live_metrics
from sglang_fleet.module_utils import bounded_json, typed_number

NON_NEGATIVE = typed_number.Range(0)

# A run is KV-bound when, over the busy samples, requests waited in the queue at least this
# share of the time ...
QUEUED_SHARE = 0.3
# ... while the KV cache was this full (median token usage; the Kimi job saw 0.85-0.96) ...
HIGH_TOKEN_USAGE = 0.8
# ... and the median running requests stayed at or below this share of the concurrency
# the client asked for (the Kimi job, docs/THE-JOB.md: ~50 of 150).
FAR_BELOW = 0.7
# The client is the bound when it kept fewer than this share of its concurrency in flight.
CLIENT_SHORTFALL = 0.7
# Fractions suggested as a lever are rounded down to this step.
FRACTION_STEP = 0.005

HICACHE_NOTE = (
    "Not a lever for decode slots: HiCache (--enable-hierarchical-cache) only spills evicted "
    "prefix-cache entries to host RAM; every running request's KV must stay on the GPU."
)


@dataclass(frozen=True)
class Sample:
    running: int
    queue: int
    token_usage: float
    gen_throughput: float
    # Speculative decoding: accepted tokens per verify and accepted share of the drafts
    # (sglang:spec_accept_length / spec_accept_rate, or the Decode batch line's accept len).
    accept_length: float | None = None
    accept_rate: float | None = None


def samples_from_metrics(server_metrics: dict[str, Any] | None) -> list[Sample]:
    """Samples of the smoke result's `server_metrics.samples` (docs/CONTRACTS.md)."""
    rows = (server_metrics or {}).get("samples") if isinstance(server_metrics, dict) else None
    return [
        Sample(
            running=int(_figure(r, "num_running_reqs")),
            queue=int(_figure(r, "num_queue_reqs")),
            token_usage=_figure(r, "token_usage"),
            gen_throughput=_figure(r, "gen_throughput"),
            accept_length=_figure(r, "spec_accept_length") or None,
            accept_rate=_figure(r, "spec_accept_rate") or None,
        )
        for r in rows or []
        if isinstance(r, dict)
    ]


def _figure(row: dict[str, Any], name: str) -> float:
    """A sampled figure, 0 when it is absent or no finite number >= 0 (a sample is the result's
    JSON: typed_number reads it)."""
    return typed_number.finite_or_none(row.get(name), NON_NEGATIVE) or 0.0


def samples_from_log(text: str) -> tuple[list[Sample], int]:
    """Samples of the Decode batch lines of a server log, and how many data-parallel
    schedulers wrote them (each logs its own batch: "[... DP1 TP0] Decode batch, ...")."""
    parsed = parse_decode_lines(text.splitlines())
    dp_ranks = {s.rank.split()[0] for s in parsed if s.rank.startswith("DP")}
    samples = [
        Sample(
            s.num_running_reqs,
            s.num_queue_reqs,
            s.token_usage,
            s.gen_throughput,
            s.accept_length,
            s.accept_rate,
        )
        for s in parsed
    ]
    return samples, max(1, len(dp_ranks))


def _lever(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def _client_concurrency(
    smoke: dict[str, Any], concurrency: int | None
) -> tuple[float | None, float | None]:
    asked = concurrency if concurrency is not None else smoke.get("max_concurrency")
    achieved = smoke.get("concurrency")
    return (
        typed_number.finite_or_none(asked, NON_NEGATIVE) or None,
        typed_number.finite_or_none(achieved, NON_NEGATIVE),
    )


def _requests_fitting(smoke: dict[str, Any], pool: Any) -> int | None:
    """How many of the benchmark's requests (input + output tokens each) the KV pool holds
    whole: SGLang admits a request only when its remaining output fits beside the running
    ones, so a small pool is full at this many running requests whatever its token usage
    reads (bench/planner_accuracy.py: 2 of 1024 tokens at requests of 200 + 200)."""
    size = _figure(smoke, "random_input_len") + _figure(smoke, "random_output_len")
    pool = typed_number.finite_or_none(pool, NON_NEGATIVE) if isinstance(pool, int | float) else 0
    if size <= 0 or not pool:
        return None
    return max(1, int(pool // size))


def _evidence(
    samples: list[Sample],
    source: str,
    smoke: dict[str, Any],
    asked: float | None,
    achieved: float | None,
) -> dict[str, Any]:
    busy = [s for s in samples if s.running > 0 or s.queue > 0]
    ev: dict[str, Any] = {
        "source": source,
        "samples": len(samples),
        "busy_samples": len(busy),
        "client_concurrency_asked": asked,
        "client_concurrency_achieved": achieved,
        "output_throughput": smoke.get("output_throughput"),
        "max_total_num_tokens": (smoke.get("server_metrics") or {}).get("max_total_num_tokens"),
    }
    # A benchmark's own counts (absent live): with none completed, its achieved concurrency
    # (computed from successful requests) says nothing about the client.
    for name in ("completed", "failed"):
        if smoke.get(name) is not None:
            ev[name] = int(_figure(smoke, name))
    if busy:
        ev |= {
            "median_running_reqs": statistics.median(s.running for s in busy),
            "peak_running_reqs": max(s.running for s in busy),
            "median_queue_reqs": statistics.median(s.queue for s in busy),
            "peak_queue_reqs": max(s.queue for s in busy),
            "queued_share": round(sum(s.queue > 0 for s in busy) / len(busy), 3),
            "median_token_usage": round(statistics.median(s.token_usage for s in busy), 3),
            "peak_token_usage": max(s.token_usage for s in busy),
            "mean_gen_throughput": round(statistics.fmean(s.gen_throughput for s in busy), 1),
            "peak_demand": max(s.running + s.queue for s in busy),
        }
    accepted = [s for s in busy if s.accept_length]
    if accepted:
        ev["spec_accept_length"] = round(statistics.median(s.accept_length for s in accepted), 3)
        rates = [s.accept_rate for s in accepted if s.accept_rate is not None]
        ev["spec_accept_rate"] = round(statistics.median(rates), 3) if rates else None
    fitting = _requests_fitting(smoke, ev["max_total_num_tokens"])
    if fitting is not None:
        ev["requests_fitting_kv"] = fitting
    slo_tpot = (smoke.get("slo") or {}).get("tpot_ms")
    if slo_tpot and smoke.get("mean_tpot_ms") is not None:
        ev["mean_tpot_ms"] = smoke["mean_tpot_ms"]
        ev["slo_tpot_ms"] = slo_tpot
    return ev


def _classify_without_load(ev: dict[str, Any], asked: float | None, client_short: bool) -> str:
    if client_short:
        return "client_bound"
    # Samples of a server that had nothing to do, and no client that says it sent any.
    return "idle" if ev["samples"] and asked is None else "unknown"


def _classify(ev: dict[str, Any]) -> str:
    if ev.get("completed") == 0:
        return "unknown"  # a run that measured nothing: _nothing_measured() names why
    return _classify_measured(ev)


def _classify_measured(ev: dict[str, Any]) -> str:
    asked, achieved = ev["client_concurrency_asked"], ev["client_concurrency_achieved"]
    client_short = (
        asked is not None and achieved is not None and achieved < CLIENT_SHORTFALL * asked
    )
    if not ev["busy_samples"]:
        return _classify_without_load(ev, asked, client_short)
    queued = ev["queued_share"] >= QUEUED_SHARE
    # Without the client's figure, the demand the server saw (running + queued) stands in.
    reference = asked / ev["schedulers"] if asked is not None else ev["peak_demand"]
    running_far_below = ev["median_running_reqs"] <= FAR_BELOW * reference
    fitting = ev.get("requests_fitting_kv")
    kv_full = ev["median_token_usage"] >= HIGH_TOKEN_USAGE or (
        fitting is not None and ev["median_running_reqs"] / ev["schedulers"] >= fitting
    )
    if queued and kv_full and running_far_below:
        return "kv_cache_bound"
    never_reached = (
        asked is not None and ev["peak_demand"] < CLIENT_SHORTFALL * asked / ev["schedulers"]
    )
    if not queued and (client_short or never_reached):
        return "client_bound"
    if queued:
        return "compute_bound"
    if "slo_tpot_ms" in ev and ev["mean_tpot_ms"] > ev["slo_tpot_ms"]:
        return "compute_bound"
    return "healthy"


# --- levers ------------------------------------------------------------------------------
def _plan_with(ctx: dict[str, Any], **overrides: Any) -> dict[str, Any] | None:
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
    fp8 = _plan_with(ctx, kv_cache_dtype="fp8_e4m3") if ctx else None
    if fp8 and current and not fp8["errors"]:
        return _lever(
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
    return _lever(
        "kv_cache_dtype_fp8",
        f"Use --kv-cache-dtype fp8_e4m3 (now {_dtype_words(dtype)}): the same pool holds "
        f"about twice the KV tokens of bf16{pool}, so about twice the concurrent decodes. "
        "A quality trade-off: check outputs on your task.",
    )


def _fraction_lever(ctx: dict[str, Any] | None, current: dict[str, Any] | None) -> dict[str, str]:
    if not (ctx and current):
        now = ((ctx or {}).get("args") or {}).get("mem_fraction_static")
        now_words = f" (now {now})" if now is not None else ""
        return _lever(
            "mem_fraction_static",
            f"Raise --mem-fraction-static{now_words} in small steps while the memory left after "
            "CUDA graph capture stays above the planner's margin (run "
            "sglang_fleet.capacity.planner with --calibrate-from this run's log): too high a "
            "value runs out of memory during a large prefill.",
        )
    d = current["details"]
    now, limit = d["mem_fraction_static"], d["max_safe_mem_fraction_static"]
    target = kv_cache.floor_to(limit, FRACTION_STEP)
    raised = _plan_with(ctx, mem_fraction_static=round(target, 3)) if target > now + 1e-9 else None
    if raised is None or raised["errors"]:
        return _lever(
            "mem_fraction_static_at_limit",
            f"--mem-fraction-static {now} is already at the planner's safe limit ({limit:.3f}): "
            "raising it risks CUDA out of memory during CUDA graph capture or a large prefill.",
        )
    basis = (
        "measured free memory after CUDA graph capture"
        if d["calibrated"]
        else "SGLang's own reserve estimate"
    )
    return _lever(
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
    return _lever(
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
    return _lever(
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
    lowered = _plan_with(ctx, mem_fraction_static=round(safe, 3)) if safe < now else None
    if lowered is None or lowered["errors"]:
        return ctx, current, None
    at_safe = dict(ctx) | {"args": dict(ctx.get("args") or {}) | {"mem_fraction_static": safe}}
    lever = _lever(
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
    current = _plan_with(ctx) if ctx else None
    ctx, current, lowered = _at_safe_fraction(ctx, current)
    fp8 = _fp8_lever(ctx, current, ev)
    attn_dp = _attn_dp_lever(ctx, current)
    # With fp8 KV already on, attention DP is the largest lever left for an MLA model.
    first = [fp8, attn_dp] if fp8 is not None else [attn_dp]
    if lowered is not None:  # first of all: the fraction it runs at is not safe
        return [lever for lever in [lowered, *first, _gpu_lever(ctx)] if lever is not None]
    levers = [*first, _fraction_lever(ctx, current), _gpu_lever(ctx)]
    return [lever for lever in levers if lever is not None]


def _levers(verdict: str, ev: dict[str, Any], ctx: dict[str, Any] | None) -> list[dict[str, str]]:
    if verdict == "kv_cache_bound":
        return _kv_levers(ctx, ev)
    if verdict == "compute_bound":
        return [
            _lever(
                "batch_caps",
                "Requests queue while the KV cache has room: check --max-running-requests and "
                "--cuda-graph-max-bs-decode, which cap the running batch below the KV capacity.",
            ),
            _lever(
                "more_gpus",
                "Add GPUs: a larger --tp-size speeds up each step; --dp-size adds replicas.",
            ),
            _lever(
                "speculative_decoding",
                "Speculative decoding (EAGLE / MTP draft heads) raises per-request decode "
                "speed when the GPU is busy.",
            ),
        ]
    if verdict == "client_bound":
        return [
            _lever(
                "client",
                f"The client kept only {ev.get('client_concurrency_achieved')} of "
                f"{ev.get('client_concurrency_asked')} requests in flight and the server had no "
                "queue: "
                "run more client processes or a higher request rate, and check the client's CPU.",
            )
        ]
    if verdict == "healthy":
        return [
            _lever(
                "raise_load",
                "The server kept up with the load: raise the client concurrency until token usage "
                "nears 0.9 or a queue forms, to find the capacity.",
            )
        ]
    if verdict == "idle":
        return [
            _lever(
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
            _lever(
                "requests_failed",
                f"Every request failed ({ev['failed']} of {ev['failed']}): the run measured "
                "nothing about the server's capacity. Fix the failures first (the smoke "
                "result's failure_reasons and errors, the server log), then measure again.",
            )
        ]
    return [
        _lever(
            "collect_data",
            "No server samples: run with --enable-metrics (smoke samples /metrics) or pass "
            "the server log.",
        )
    ]


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
    asked, achieved = _client_concurrency(smoke, concurrency)
    ev = _evidence(samples, source if samples else "none", smoke, asked, achieved)
    # Each data-parallel scheduler sees its share of the client's requests.
    ev["schedulers"] = schedulers
    cal = parse_log(log_text) if log_text else None  # parsed once for all that follows
    if cal is not None and ev["max_total_num_tokens"] is None:
        ev["max_total_num_tokens"] = cal.max_total_num_tokens
    ctx = _with_log_calibration(plan_context, log_text, cal)
    verdict = _classify(ev)
    notes = [HICACHE_NOTE] if verdict == "kv_cache_bound" else []
    levers = _levers(verdict, ev, ctx)
    running = _running_speculation(smoke, cal)
    first, last, spec_notes = _speculation_findings(ev, running, ctx)
    levers = first + levers + last
    notes += spec_notes
    if cal is not None:
        notes += _noop_notes(cal.server_args, None)
        notes += [skipped] if (skipped := cal.long_lines_note()) else []
        if verdict == "kv_cache_bound":
            levers = _cap_lever(cal.server_args, ev) + levers
    notes += _dropped_note(dropped)
    return {"verdict": verdict, "evidence": ev, "levers": levers, "notes": notes}


# --- speculative decoding (docs/SPECULATIVE.md) ----------------------------------------------
def _running_speculation(smoke: dict[str, Any], cal: Calibration | None) -> dict[str, Any]:
    """The running server's speculative flags and the max_running_requests it resolved: from
    /server_info (a live sample's `server_info`), else from the log (its server_args and its
    scheduler line)."""
    info = smoke.get("server_info") if isinstance(smoke.get("server_info"), dict) else {}
    stated = cal.server_args if cal is not None else {}
    found: dict[str, Any] = {}
    for name in speculative.FLAGS:
        value = info.get(name, stated.get(name))
        if value is not None:
            found[name] = value
    resolved = info.get("max_running_requests")
    if resolved is None and cal is not None:
        resolved = cal.max_running_requests
    found["resolved_max_running_requests"] = resolved
    return found


def _at_reset_cap(ev: dict[str, Any], running: dict[str, Any]) -> bool:
    """Speculation on, running requests at SGLang's reset cap of 48, and a queue behind them."""
    on = speculative.algorithm_of(running) is not None or ev.get("spec_accept_length")
    cap = running.get("resolved_max_running_requests")
    if cap is None:  # no flags at hand: a plateau at exactly 48 says it
        cap = ev.get("peak_running_reqs")
    return bool(
        on
        and cap == speculative.RESET_MAX_RUNNING_REQUESTS
        and ev.get("busy_samples")
        and ev["median_running_reqs"] >= speculative.RESET_MAX_RUNNING_REQUESTS - 1
        and ev["queued_share"] >= QUEUED_SHARE
    )


def _reset_value(ev: dict[str, Any], plan_now: dict[str, Any] | None) -> str:
    section = (plan_now or {}).get("speculative") or {}
    fits = section.get("max_concurrent_requests_without_reset")
    if fits:
        return f"{fits} (what the planner says the KV pool holds)"
    pool, fits = ev.get("max_total_num_tokens"), ev.get("requests_fitting_kv")
    running, usage = ev.get("median_running_reqs"), ev.get("median_token_usage")
    if pool and running and usage:  # the KV tokens each running request holds, as measured
        per_request = round(usage * pool / running)
        fits = int(pool // per_request) if per_request >= 1 else fits
    if fits:
        return f"{fits} (what the KV pool holds at the requests' measured size)"
    return "the concurrency the job sends, as far as the KV pool holds it"


def _speculation_findings(
    ev: dict[str, Any], running: dict[str, Any], ctx: dict[str, Any] | None
) -> tuple[list[dict[str, str]], list[dict[str, str]], list[str]]:
    """(levers before the verdict's, levers after them, notes) about speculative decoding."""
    accept = ev.get("spec_accept_length")
    if speculative.algorithm_of(running) is None and not accept:
        return [], [], []
    plan_now = _plan_with(ctx) if ctx else None
    first: list[dict[str, str]] = []
    if _at_reset_cap(ev, running):
        first.append(
            _lever(
                "speculative_reset_cap",
                f"Running requests sit at {speculative.RESET_MAX_RUNNING_REQUESTS} with "
                f"{ev['median_queue_reqs']:g} queued: SGLang 0.5.23 resets "
                "--max-running-requests to 48 for speculative decoding when it is not given. "
                f"Set it (max_running_requests: {_reset_value(ev, plan_now)}).",
            )
        )
    notes: list[str] = []
    if accept:
        rate = ev.get("spec_accept_rate")
        notes.append(
            f"Speculative decoding: accept length {accept:g}"
            + (f", accept rate {rate:g}" if rate is not None else "")
            + f" over the window ({ev['source']})."
        )
    last = _speculation_pays(ev, accept, ctx, plan_now, notes)
    return first, last, notes


def _speculation_pays(
    ev: dict[str, Any],
    accept: float | None,
    ctx: dict[str, Any] | None,
    plan_now: dict[str, Any] | None,
    notes: list[str],
) -> list[dict[str, str]]:
    """Whether speculation costs throughput at the batch the window ran (the planner's
    speed-up model at the measured accept length), as a lever when it costs."""
    if not accept or not ev.get("busy_samples"):
        return []
    batch = max(1, round(ev["median_running_reqs"]))
    judged = (
        _plan_with(ctx, speculative_accept_length=accept, job_concurrency=batch)
        if ctx and plan_now is not None
        else None
    )
    section = (judged or {}).get("speculative") or {}
    gain = section.get("speedup_at_job_concurrency")
    if gain is None:
        notes.append(
            "Whether it pays at this load is not judged: the planner needs the model and the "
            "draft (--model-path, --speculative-draft-model-path, --gpu-memory-mib) and the "
            f"GPU's figures ({section.get('speedup_reason') or 'no plan'})."
        )
        return []
    ranges = "; ".join(f"{a}-{b}" for a, b in section["speedup"]["pays_at_batches"]) or "none"
    if gain >= 1:
        notes.append(
            f"Speculation pays at this load: the planner expects x{gain:g} output at {batch} "
            f"running requests (it pays at running batches {ranges})."
        )
        return []
    return [
        _lever(
            "speculation_costs",
            f"Speculative decoding costs throughput at this load: at {batch} running requests "
            f"and accept length {accept:g} the planner expects x{gain:g} of plain decoding's "
            f"output (it pays at running batches {ranges}; {section['model']}). Turn it off "
            "(remove speculative_algorithm) for this job, or keep the running batch where it "
            "pays.",
        )
    ]


def _cap_lever(stated: dict[str, Any], ev: dict[str, Any]) -> list[dict[str, str]]:
    """The pool is the run's own --max-total-tokens: that flag is the first lever."""
    cap, pool = stated.get("max_total_tokens"), ev.get("max_total_num_tokens")
    if not isinstance(cap, int) or isinstance(cap, bool) or pool is None or int(pool) != cap:
        return []
    where = (
        " On the CPU engine the cap is what bounds host RAM: raise it within what "
        "sglang_fleet.capacity.planner --device cpu says fits (docs/CPU-SERVERS.md)."
        if stated.get("device") == "cpu"
        else ""
    )
    return [
        _lever(
            "max_total_tokens",
            f"The KV pool is the run's own --max-total-tokens {cap}, not what memory allows: "
            f"raise it (or leave it out and let SGLang size the pool).{where}",
        )
    ]


def finite_only(value: Any, where: str, dropped: list[str]) -> Any:
    """The value with every NaN, infinite or huge number replaced by None (JSON reads Infinity,
    NaN and integers of any size; no count, rate or time is one, and float() of a 400-digit
    integer raises OverflowError), naming each in ``dropped`` (module_utils/typed_number.py)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and typed_number.finite_or_none(value) is None:
        dropped.append(where)
        return None
    if isinstance(value, dict):
        return {k: finite_only(v, f"{where}.{k}", dropped) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_only(v, f"{where}[{i}]", dropped) for i, v in enumerate(value)]
    return value


def _dropped_note(dropped: list[str]) -> list[str]:
    if not dropped:
        return []
    shown = ", ".join(dropped[:5]) + (f" and {len(dropped) - 5} more" if len(dropped) > 5 else "")
    return [f"Values that are not finite numbers were left out: {shown}."]


def _noop_notes(flags: dict[str, Any], version: str | None) -> list[str]:
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
    ctx: dict | None, log_text: str | None, cal: Calibration | None = None
) -> dict | None:
    """ctx with the logged run's flags (and the log as calibration); cal: the log parsed."""
    if not ctx:
        return None
    args = dict(ctx.get("args") or {})
    if log_text:
        cal = cal or parse_log(log_text)
        # The run's own flags are what the levers compare against: as the log states them,
        # or as its lines show them (sglang_fleet.capacity.logged_flags), never assumed.
        shape, weights = _model_layout(ctx)
        # logged_flags resolves the deprecated `--dp-size N --enable-dp-attention` to
        # attn_dp_size N, dp_size 1, as SGLang does.
        run = logged_flags.infer(cal, shape, weights, stated=args.get("calibration_log_flags"))
        for key in ("tp_size", "dp_size", "attn_dp_size", "mem_fraction_static", "kv_cache_dtype"):
            if run.flags.get(key) is not None:
                args.setdefault(key, run.flags[key])
        logged = {k: cal.server_args[k] for k in speculative.FLAGS if cal.server_args.get(k)}
        for key, value in _plannable(logged, args).items():
            args.setdefault(key, value)
        if cal.has_memory:
            args.setdefault("calibration_log", log_text)
    return dict(ctx) | {"args": args}


# --- a running server (live sample, docs/DIAGNOSIS.md) -----------------------------------
# The running server's own flags (/server_info) that the planner takes. SGLang reports every
# argument resolved, so ones whose unset state means something to the planner stay out:
# chunked_prefill_size, max_running_requests (SGLang's default fraction depends on whether
# they were given) and hicache_ratio (always 2.0 when unset).
LIVE_PLAN_ARGS = tuple(
    flag
    for flag in PLANNER_FLAGS
    if flag not in ("chunked_prefill_size", "max_running_requests", "hicache_ratio")
)

_NOT_SAMPLED_LEVERS = {
    "no_metrics": (
        "enable_metrics",
        "Add --enable-metrics to the server's flags (inventory flags: enable_metrics: true) "
        "and roll it out: the live diagnosis reads /metrics and nothing else about the load.",
    ),
    "unauthorized": (
        "api_key",
        "Give the server's API key (--api-key-file, or SGLANG_API_KEY in the environment): "
        "/server_info needs it, /metrics does not.",
    ),
}
_CHECK_SERVER = (
    "check_server",
    "Check that the server runs and listens at that address (systemctl status "
    "sglang@<name>; journalctl -u sglang@<name>).",
)


def _as_sample(sample: dict | str) -> dict[str, Any]:
    if isinstance(sample, str):
        sample = bounded_json.loads(sample, "the live sample")
    if not isinstance(sample, dict):
        raise ValueError(f"a live sample must be a JSON object, got {type(sample).__name__}")
    return sample


def _server_args(info: dict[str, Any]) -> dict[str, Any]:
    args = {k: info[k] for k in LIVE_PLAN_ARGS if info.get(k) is not None}
    if not args.get("hicache_size"):
        args.pop("hicache_size", None)
    return args


def _observed_load(
    samples: list[Sample], max_tokens: float | None, gen_tok_s: float | None
) -> dict[str, Any]:
    """KV tokens each running request holds and tokens/s each one decodes, as measured."""
    running = [s for s in samples if s.running > 0]
    if not running:
        return {}
    observed: dict[str, Any] = {}
    if max_tokens:
        per_request = statistics.median(s.token_usage * max_tokens / s.running for s in running)
        if per_request >= 1:
            observed["kv_tokens_per_running_req"] = round(per_request)
    if gen_tok_s:
        observed["per_request_tok_s"] = round(
            gen_tok_s / statistics.median(s.running for s in running), 2
        )
    return observed


def _live_context(
    plan_context: dict | None, server_args: dict[str, Any], observed: dict[str, Any]
) -> dict[str, Any] | None:
    """The planner context for the levers: the running server's flags win over the caller's
    (they are what runs), and the measured load stands in for a workload nobody gave."""
    if not plan_context and not server_args:
        return None
    ctx = dict(plan_context or {})
    args = dict(ctx.get("args") or {}) | _plannable(server_args, ctx.get("args") or {})
    per_request = observed.get("kv_tokens_per_running_req")
    if per_request and "avg_input_len" not in args and "avg_output_len" not in args:
        args |= {"avg_input_len": per_request, "avg_output_len": 0}
    if observed.get("per_request_tok_s") and "per_request_tok_s" not in args:
        args["per_request_tok_s"] = observed["per_request_tok_s"]
    return ctx | {"args": args}


def _plannable(flags: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """The running server's flags the levers' plans can take: its speculative flags only with
    the draft's config.json at hand (--speculative-draft-model-path), without which the planner
    cannot place the draft; then the levers are planned without it."""
    needs_draft = speculative.algorithm_of(flags) not in (None, "NGRAM")
    if needs_draft and args.get("speculative_draft_config") is None:
        return {k: v for k, v in flags.items() if k not in speculative.FLAGS}
    return flags


def _rate(delta: float | None, window: float | None) -> float | None:
    return round(delta / window, 1) if delta is not None and window else None


def _token_rates(metrics: dict[str, Any]) -> dict[str, Any]:
    """Tokens per second over the window. SGLang's realtime_tokens_total counts every forward
    pass; generation/prompt_tokens_total count a request when it finishes, so they stand in
    only where the realtime counter is missing (docs/DIAGNOSIS.md)."""
    window = metrics.get("window_s")
    if metrics.get("decode_tokens_delta") is not None:
        return {
            "generation_tok_s": _rate(metrics["decode_tokens_delta"], window),
            "prompt_tok_s": _rate(metrics.get("prefill_tokens_delta"), window),
            "tok_s_source": "realtime_tokens_total",
        }
    return {
        "generation_tok_s": _rate(metrics.get("generation_tokens_delta"), window),
        "prompt_tok_s": _rate(metrics.get("prompt_tokens_delta"), window),
        "tok_s_source": "finished requests (generation_tokens_total)",
    }


def _row(result: dict[str, Any]) -> dict[str, Any]:
    """The columns of the fleet table: the busy medians, or zeros for a server with no load."""
    ev = result["evidence"]
    busy = bool(ev.get("busy_samples"))
    gen = ev.get("generation_tok_s")
    first = result["levers"][0] if result["levers"] else {"code": None, "message": None}
    return {
        "running": ev.get("median_running_reqs", 0) if busy else 0,
        "queued": ev.get("median_queue_reqs", 0) if busy else 0,
        "token_usage": ev.get("median_token_usage", 0.0) if busy else ev.get("token_usage"),
        "gen_tok_s": gen if gen is not None else ev.get("mean_gen_throughput"),
        "verdict": result["verdict"],
        "first_lever": first["code"],
        "first_lever_message": first["message"],
    }


def _one_line(result: dict[str, Any]) -> str:
    if result.get("error"):
        return f"not sampled ({result['error']['code']}): {result['error']['message']}"
    row, ev = result["row"], result["evidence"]
    gen = row["gen_tok_s"]
    usage = row["token_usage"]
    return (
        f"{row['verdict']}: running {row['running']:g}, queued {row['queued']:g}, "
        f"token usage {'n/a' if usage is None else f'{usage:.2f}'}, "
        f"{'n/a' if gen is None else f'{gen:.1f}'} gen tok/s over {ev.get('window_s') or 0:.0f} s"
        + (f"; first lever: {row['first_lever']}" if row["first_lever"] else "")
    )


def _not_sampled(sample: dict[str, Any]) -> dict[str, Any]:
    error = dict(sample["error"])
    code, message = _NOT_SAMPLED_LEVERS.get(error.get("code"), _CHECK_SERVER)
    result: dict[str, Any] = {
        "verdict": "unknown",
        "evidence": {"source": "none", "samples": 0, "busy_samples": 0},
        "levers": [_lever(code, message)],
        "notes": [],
        "error": error,
        "server": {"url": sample.get("url")},
    }
    result["row"] = _row(result) | {"running": None, "queued": None}
    result["summary"] = _one_line(result)
    return result


def diagnose_live(
    sample: dict | str, plan_context: dict | None = None, log_text: str | None = None
) -> dict:
    """Classify a running server from a live sample (sglang_fleet.diagnosis.live_metrics; JSON text
    is fine).

    Pure. The verdict, evidence, levers and notes are diagnose()'s for the window's /metrics
    samples; the server's /server_info flags size the levers (with plan_context's model
    {model_config, weight_bytes, args, host}, to the planner's numbers) and log_text, the
    server's log, only calibrates them. Adds `summary` (one line), `row` (the fleet table's
    columns) and `server` (the flags read); a sample that failed gives verdict unknown, its
    `error` and the lever that fixes it.
    """
    dropped: list[str] = []
    sample = finite_only(_as_sample(sample), "live sample", dropped)
    if sample.get("error"):
        return _not_sampled(sample)
    metrics = sample.get("server_metrics") or {}
    info = sample.get("server_info") or {}
    rates = _token_rates(metrics)
    gen_tok_s = rates["generation_tok_s"]
    max_tokens = metrics.get("max_total_num_tokens") or info.get("max_total_num_tokens")
    observed = _observed_load(samples_from_metrics(metrics), max_tokens, gen_tok_s)
    ctx = _live_context(plan_context, _server_args(info), observed)
    as_run = {
        "server_metrics": metrics | {"max_total_num_tokens": max_tokens},
        "output_throughput": gen_tok_s,
        "server_info": info,
    }
    result = diagnose(as_run, log_text, None, ctx)
    ev = result["evidence"]
    ev |= observed | rates
    ev |= {
        "window_s": metrics.get("window_s"),
        "retracted_requests": metrics.get("retracted_requests_delta"),
        "schedulers": metrics.get("schedulers") or 1,
    }
    if not ev["busy_samples"]:
        ev["token_usage"] = max(
            (r.get("token_usage") or 0.0 for r in metrics.get("samples") or []), default=0.0
        )
    if ev["busy_samples"] and metrics.get("decode_tokens_delta") == 0:
        result["notes"].append(
            "Requests ran or waited but no token was decoded in the window: the server may "
            "be stuck (check its log), or only prefilled."
        )
    result["notes"] += list(sample.get("warnings") or []) + _dropped_note(dropped)
    for note in _noop_notes(info, info.get("version")):
        flag = note.split(" does nothing")[0].rsplit(" ", 1)[0]
        if not any(n.startswith(flag + " ") for n in result["notes"]):
            result["notes"].append(note)
    result["server"] = {"url": sample.get("url")} | info
    result["row"] = _row(result)
    result["summary"] = _one_line(result)
    return result


_TABLE_HEADER = (
    "HOST", "SERVER", "RUNNING", "QUEUED", "TOKEN USAGE", "GEN TOK/S", "VERDICT", "FIRST LEVER"
)  # fmt: skip


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table_lines(entries: list[dict[str, Any]]) -> list[str]:
    """The fleet table of live diagnoses, as lines (a debug task prints one line per item).

    entries: [{host, server, diagnosis}] with diagnosis a diagnose_live() result. Servers that
    could not be sampled get a line below the table saying why."""
    cells = [_TABLE_HEADER]
    for entry in entries:
        row = entry["diagnosis"]["row"]
        cells.append(
            (
                str(entry["host"]),
                str(entry["server"]),
                _cell(row["running"], "g"),
                _cell(row["queued"], "g"),
                _cell(row["token_usage"], ".2f"),
                _cell(row["gen_tok_s"], ".1f"),
                str(row["verdict"]),
                str(row["first_lever"] or "-"),
            )
        )
    widths = [max(len(row[i]) for row in cells) for i in range(len(_TABLE_HEADER))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines += [
        f"{e['host']} {e['server']}: {e['diagnosis']['summary']}"
        for e in entries
        if e["diagnosis"].get("error")
    ]
    return lines


# --- command line ----------------------------------------------------------------------
def _plan_context(ns: argparse.Namespace) -> dict[str, Any] | None:
    if not ns.model_path:
        return None
    config, weight_bytes = read_model_dir(ns.model_path)
    args, host = split_namespace(ns)
    args = read_draft(args)
    if "gpu_memory_mib" not in host:
        raise PlanInputError("--model-path needs --gpu-memory-mib to size the levers")
    return {"model_config": config, "weight_bytes": weight_bytes, "args": args, "host": host}


def _summary(result: dict[str, Any]) -> str:
    ev = result["evidence"]
    numbers = ", ".join(f"{k}={v}" for k, v in ev.items() if v is not None)
    lines = [f"verdict: {result['verdict']}", f"evidence: {numbers}"]
    lines += [f"lever {lv['code']}: {lv['message']}" for lv in result["levers"]]
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m sglang_fleet.diagnosis.diagnose",
        description=__doc__.splitlines()[0],
        # An abbreviation would let "--api-key SECRET" pass as --api-key-file and print it.
        allow_abbrev=False,
    )
    parser.add_argument("--log", help="SGLang server log (Decode batch lines, start-up lines)")
    parser.add_argument(
        "--smoke-result",
        help="smoke benchmark result JSON (sglang_fleet.bench.smoke_client --json)",
    )
    live_metrics.add_sampling_arguments(parser)
    parser.add_argument(
        "--sample",
        help="live sample JSON, as sglang_fleet/diagnosis/live_metrics.py writes it on a GPU host",
    )
    parser.add_argument("--concurrency", type=int, help="concurrency the client asked for")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--table", action="store_true", help="print the fleet table's row (live)")
    add_plan_arguments(parser, model_required=False)
    return parser


def _check_sources(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    if ns.url and ns.sample:
        parser.error("give --url or --sample, not both")
    is_live = bool(ns.url or ns.sample)
    if is_live and ns.smoke_result:
        parser.error("--smoke-result is a finished run: not with --url or --sample")
    if is_live and ns.concurrency is not None:
        parser.error("--concurrency is the benchmark client's: a live server has none")
    if not is_live and not ns.log and not ns.smoke_result:
        parser.error("give --url, --sample, or --log and/or --smoke-result")
    if not is_live and ns.table:
        parser.error("--table needs --url or --sample")


def _live_sample(ns: argparse.Namespace) -> dict[str, Any]:
    if ns.sample:
        return _as_sample(input_files.read_text(ns.sample, input_files.JSON_LIMIT, "--sample"))
    live_metrics.check_url(ns.url)
    live_metrics.check_window(ns.window, ns.interval)
    api_key = live_metrics.read_api_key(ns.api_key_file)
    try:
        return live_metrics.sample_server(ns.url, ns.window, ns.interval, api_key)
    except live_metrics.SampleError as exc:
        return live_metrics.error_sample(ns.url, exc.code, str(exc))


def _print_live(result: dict[str, Any], ns: argparse.Namespace) -> None:
    if ns.json:
        print(json.dumps(result, indent=2))
    elif ns.table:
        url = urlsplit(result["server"].get("url") or "")
        name = result["server"].get("served_model_name") or "-"
        entry = {"host": url.netloc or "-", "server": name, "diagnosis": result}
        print("\n".join(table_lines([entry])))
    else:
        print(result["summary"])
        if not result.get("error"):
            print(_summary(result))


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    ns = parser.parse_args(argv)
    _check_sources(parser, ns)
    try:
        log_text = input_files.read_text(ns.log, input_files.LOG_LIMIT, "--log") if ns.log else None
        smoke = (
            bounded_json.loads(
                input_files.read_text(ns.smoke_result, input_files.JSON_LIMIT, "--smoke-result"),
                "--smoke-result",
            )
            if ns.smoke_result
            else None
        )
        ctx = _plan_context(ns)
        sample = _live_sample(ns) if ns.url or ns.sample else None
    except (
        OSError,
        ValueError,  # JSON that does not parse, or is not an object
        ModelConfigError,
        PlanInputError,
        live_metrics.UsageError,
    ) as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if sample is None:
        result = diagnose(smoke, log_text, ns.concurrency, ctx)
        print(json.dumps(result, indent=2) if ns.json else _summary(result))
        return 0
    result = diagnose_live(sample, ctx, log_text)
    _print_live(result, ns)
    if result.get("error"):
        print(f"{parser.prog}: {result['error']['message']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
