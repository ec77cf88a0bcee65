"""Bottleneck diagnosis of a run: what bounded its throughput, and what to change next.

    python3 -m sglang_fleet.diagnose [--log SERVER_LOG] [--smoke-result RESULT.json] \
        [--concurrency N] [--model-path DIR --gpu-memory-mib MIB ...] --json

Reads what the smoke benchmark sampled from /metrics (`server_metrics.samples`, see
docs/CONTRACTS.md) and/or the server log's "Decode batch" lines, and prints one JSON
object: `verdict` (kv_cache_bound, compute_bound, client_bound, healthy; `unknown` when
there is nothing to judge), `evidence` (the numbers), `levers` (next steps, objects with
code and message) and `notes`. With a model (planner flags, or `plan_context` in the pure
function) the levers carry the planner's expected capacity. Exit status: 0 with a
diagnosis, 2 on bad usage; the verdict itself never changes the exit status.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_fleet import kvmath
from sglang_fleet.calibrate import parse_decode_lines, parse_log
from sglang_fleet.modelcfg import ModelConfigError, model_shape, read_model_dir
from sglang_fleet.plan import PlanInputError, add_plan_arguments, plan, split_namespace

# A run is KV-bound when, over the busy samples, requests waited in the queue at least this
# share of the time ...
QUEUED_SHARE = 0.3
# ... while the KV cache was this full (median token usage; the story saw 0.85-0.96) ...
HIGH_TOKEN_USAGE = 0.8
# ... and the median running requests stayed at or below this share of the concurrency
# the client asked for (the story: ~50 of 150).
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


def samples_from_metrics(server_metrics: dict[str, Any] | None) -> list[Sample]:
    """Samples of the smoke result's `server_metrics.samples` (docs/CONTRACTS.md)."""
    rows = (server_metrics or {}).get("samples") or []
    return [
        Sample(
            running=int(r.get("num_running_reqs") or 0),
            queue=int(r.get("num_queue_reqs") or 0),
            token_usage=float(r.get("token_usage") or 0.0),
            gen_throughput=float(r.get("gen_throughput") or 0.0),
        )
        for r in rows
    ]


def samples_from_log(text: str) -> tuple[list[Sample], int]:
    """Samples of the Decode batch lines of a server log, and how many data-parallel
    schedulers wrote them (each logs its own batch: "[... DP1 TP0] Decode batch, ...")."""
    parsed = parse_decode_lines(text.splitlines())
    dp_ranks = {s.rank.split()[0] for s in parsed if s.rank.startswith("DP")}
    samples = [
        Sample(s.num_running_reqs, s.num_queue_reqs, s.token_usage, s.gen_throughput)
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
    return (float(asked) if asked else None), (float(achieved) if achieved is not None else None)


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
    slo_tpot = (smoke.get("slo") or {}).get("tpot_ms")
    if slo_tpot and smoke.get("mean_tpot_ms") is not None:
        ev["mean_tpot_ms"] = smoke["mean_tpot_ms"]
        ev["slo_tpot_ms"] = slo_tpot
    return ev


def _classify(ev: dict[str, Any]) -> str:
    asked, achieved = ev["client_concurrency_asked"], ev["client_concurrency_achieved"]
    client_short = (
        asked is not None and achieved is not None and achieved < CLIENT_SHORTFALL * asked
    )
    if not ev["busy_samples"]:
        return "client_bound" if client_short else "unknown"
    queued = ev["queued_share"] >= QUEUED_SHARE
    # Without the client's figure, the demand the server saw (running + queued) stands in.
    reference = asked / ev["schedulers"] if asked is not None else ev["peak_demand"]
    running_far_below = ev["median_running_reqs"] <= FAR_BELOW * reference
    if queued and ev["median_token_usage"] >= HIGH_TOKEN_USAGE and running_far_below:
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


def _fp8_lever(ctx: dict[str, Any] | None, current: dict[str, Any] | None) -> dict[str, str] | None:
    dtype = ((ctx or {}).get("args") or {}).get("kv_cache_dtype", "auto")
    if dtype in kvmath.FP8_DTYPES or dtype in kvmath.FP4_DTYPES:
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
    return _lever(
        "kv_cache_dtype_fp8",
        "Use --kv-cache-dtype fp8_e4m3: about twice the KV tokens of bf16, so about twice the "
        "concurrent decodes. A quality trade-off: check outputs on your task.",
    )


def _fraction_lever(ctx: dict[str, Any] | None, current: dict[str, Any] | None) -> dict[str, str]:
    if not (ctx and current):
        return _lever(
            "mem_fraction_static",
            "Raise --mem-fraction-static in small steps while the memory left after CUDA graph "
            "capture stays above the planner's margin (run sglang_fleet.plan with --calibrate-from "
            "this run's log): too high a value runs out of memory during a large prefill.",
        )
    d = current["details"]
    now, limit = d["mem_fraction_static"], d["max_safe_mem_fraction_static"]
    target = kvmath.floor_to(limit, FRACTION_STEP)
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


def _kv_levers(ctx: dict[str, Any] | None) -> list[dict[str, str]]:
    current = _plan_with(ctx) if ctx else None
    levers = [_fp8_lever(ctx, current), _fraction_lever(ctx, current), _gpu_lever(ctx)]
    return [lever for lever in levers if lever is not None]


def _levers(verdict: str, ev: dict[str, Any], ctx: dict[str, Any] | None) -> list[dict[str, str]]:
    if verdict == "kv_cache_bound":
        return _kv_levers(ctx)
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
    smoke = smoke_result or {}
    samples = samples_from_metrics(smoke.get("server_metrics"))
    source, schedulers = "server_metrics", 1
    if not samples and log_text:
        (samples, schedulers), source = samples_from_log(log_text), "log"
    asked, achieved = _client_concurrency(smoke, concurrency)
    ev = _evidence(samples, source if samples else "none", smoke, asked, achieved)
    # Each data-parallel scheduler sees its share of the client's requests.
    ev["schedulers"] = schedulers
    if log_text and ev["max_total_num_tokens"] is None:
        ev["max_total_num_tokens"] = parse_log(log_text).max_total_num_tokens
    ctx = _with_log_calibration(plan_context, log_text)
    verdict = _classify(ev)
    notes = [HICACHE_NOTE] if verdict == "kv_cache_bound" else []
    return {"verdict": verdict, "evidence": ev, "levers": _levers(verdict, ev, ctx), "notes": notes}


def _with_log_calibration(ctx: dict | None, log_text: str | None) -> dict | None:
    if not ctx:
        return None
    args = dict(ctx.get("args") or {})
    if log_text:
        cal = parse_log(log_text)
        # The run's own flags are what the levers compare against.
        for key, value in (
            ("tp_size", cal.tp_size),
            ("dp_size", cal.dp_size),
            ("mem_fraction_static", cal.mem_fraction_static),
            ("kv_cache_dtype", cal.kv_cache_dtype),
        ):
            if value is not None:
                args.setdefault(key, value)
        if cal.has_memory:
            args.setdefault("calibration_log", log_text)
    return dict(ctx) | {"args": args}


# --- command line ----------------------------------------------------------------------
def _plan_context(ns: argparse.Namespace) -> dict[str, Any] | None:
    if not ns.model_path:
        return None
    config, weight_bytes = read_model_dir(ns.model_path)
    args, host = split_namespace(ns)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m sglang_fleet.diagnose", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--log", help="SGLang server log (Decode batch lines, start-up lines)")
    parser.add_argument(
        "--smoke-result", help="smoke benchmark result JSON (sglang_fleet.smoke --json)"
    )
    parser.add_argument("--concurrency", type=int, help="concurrency the client asked for")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_plan_arguments(parser, model_required=False)
    ns = parser.parse_args(argv)
    if not ns.log and not ns.smoke_result:
        parser.error("give --log and/or --smoke-result")
    try:
        log_text = Path(ns.log).read_text(encoding="utf-8", errors="replace") if ns.log else None
        smoke = (
            json.loads(Path(ns.smoke_result).read_text(encoding="utf-8"))
            if ns.smoke_result
            else None
        )
        ctx = _plan_context(ns)
    except (OSError, json.JSONDecodeError, ModelConfigError, PlanInputError) as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    result = diagnose(smoke, log_text, ns.concurrency, ctx)
    print(json.dumps(result, indent=2) if ns.json else _summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
