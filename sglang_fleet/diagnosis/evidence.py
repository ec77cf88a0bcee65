"""What a diagnosis judges: a run's samples (the smoke client's /metrics samples or the log's
"Decode batch" lines), the evidence they give and the verdict (kv_cache_bound, compute_bound,
client_bound, healthy, idle, unknown; docs/DIAGNOSIS.md).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from sglang_fleet.capacity.server_log import parse_decode_lines
from sglang_fleet.module_utils import typed_number

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


def make_lever(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def client_concurrency(
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


def gather_evidence(
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


def classify(ev: dict[str, Any]) -> str:
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
