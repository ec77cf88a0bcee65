"""The result JSON (docs/CONTRACTS.md, "Smoke result JSON") from the requests' records,
with metrics as SGLang's bench_serving computes them, and its short human summary."""

from __future__ import annotations

import math
import statistics
from typing import Any

from sglang_fleet.smoke.smoke_client.failures import MALFORMED
from sglang_fleet.smoke.smoke_client.streams import RequestRecord, Timeline
from sglang_fleet.smoke.smoke_client.workload import Config, lengths_digest

_MAX_DISTRIBUTION_SAMPLES = 10000
_MAX_ERRORS = 10
_PERCENTILE = 99


def percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy.percentile's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _stats_ms(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [value * 1000.0 for value in seconds]
    return {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"p99_{name}_ms": percentile(ms, _PERCENTILE),
    }


def _capped(values: list[float], cap: int = _MAX_DISTRIBUTION_SAMPLES) -> list[float]:
    """An evenly spaced subsample, so a long run's plot still shows the whole run."""
    if len(values) <= cap:
        return values
    step = len(values) / cap
    return [values[int(i * step)] for i in range(cap)]


def _tpot(record: RequestRecord) -> float | None:
    if record.output_tokens <= 1:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def _goodput(cfg: Config, records: list[RequestRecord]) -> float | None:
    """Share of all requests sent that completed within every SLO given (bench_serving's
    slo_attainment); a one-token answer has no TPOT and so meets that SLO."""
    if (cfg.slo_ttft_ms is None and cfg.slo_tpot_ms is None) or not records:
        return None
    good = 0
    for record in records:
        if record.error is not None:
            continue
        if cfg.slo_ttft_ms is not None and record.ttft * 1000.0 > cfg.slo_ttft_ms:
            continue
        tpot = _tpot(record) or 0.0
        if cfg.slo_tpot_ms is not None and tpot * 1000.0 > cfg.slo_tpot_ms:
            continue
        good += 1
    return good / len(records)


def summarize(
    cfg: Config,
    records: list[RequestRecord],
    duration: float,
    timeline: Timeline,
    server: dict[str, Any] | None,
) -> dict[str, Any]:
    """The result JSON (docs/CONTRACTS.md, "Smoke result JSON")."""
    done = [r for r in records if r.error is None]
    errors = [r.error for r in records if r.error is not None]
    reasons: dict[str, int] = {}
    for record in records:
        if record.error is not None:
            reason = record.reason or MALFORMED
            reasons[reason] = reasons.get(reason, 0) + 1
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    ttfts = [r.ttft for r in done]
    itls = [gap for r in done for gap in r.itl]
    tpots = [t for t in (_tpot(r) for r in done) if t is not None]
    latencies = [r.latency for r in done]
    per_second = duration if duration > 0 else math.inf
    result: dict[str, Any] = {
        "backend": cfg.backend,
        "completed": len(done),
        "failed": len(errors),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / per_second,
        "input_throughput": input_tokens / per_second,
        "output_throughput": output_tokens / per_second,
    }
    for name, values in (
        ("ttft", ttfts),
        ("tpot", tpots),
        ("itl", itls),
        ("e2e_latency", latencies),
    ):
        result.update(_stats_ms(name, values))
    result.update(
        {
            "concurrency": sum(latencies) / per_second,
            "max_concurrency": cfg.max_concurrency,
            # JSON has no infinity: null means "all at once", as fast as the limit allows
            "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else None,
            "num_prompts": len(records),
            "seed": cfg.seed,
            # With a job's shape, its mean lengths (what a plan reads) and its identity.
            "random_input_len": _mean_length(cfg, 0),
            "random_output_len": _mean_length(cfg, 1),
            "lengths": (
                {"pairs": len(cfg.lengths), "digest": lengths_digest(cfg.lengths)}
                if cfg.lengths
                else None
            ),
            "goodput": _goodput(cfg, records),
            "slo": {"ttft_ms": cfg.slo_ttft_ms, "tpot_ms": cfg.slo_tpot_ms},
            "server_metrics": server,
            "timeline": [{"t": i, "output_tokens": n} for i, n in enumerate(timeline.counts)],
            "ttft_ms_all": [t * 1000.0 for t in _capped(ttfts)],
            "itl_ms_all": [t * 1000.0 for t in _capped(itls)],
            "failure_reasons": dict(sorted(reasons.items())),
            "errors": errors[:_MAX_ERRORS],
        }
    )
    return result


def _mean_length(cfg: Config, which: int) -> int:
    pairs = cfg.pairs()
    return round(sum(pair[which] for pair in pairs) / len(pairs))


def format_summary(result: dict[str, Any]) -> str:
    """A short human summary, laid out like bench_serving's."""
    rows = [
        ("Backend", result["backend"]),
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Benchmark duration (s)", "{:.2f}".format(result["duration"])),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", "{:.2f}".format(result["request_throughput"])),
        ("Output token throughput (tok/s)", "{:.2f}".format(result["output_throughput"])),
        ("Concurrency", "{:.2f}".format(result["concurrency"])),
        (
            "Median / P99 TTFT (ms)",
            "{:.2f} / {:.2f}".format(result["median_ttft_ms"], result["p99_ttft_ms"]),
        ),
        (
            "Median / P99 TPOT (ms)",
            "{:.2f} / {:.2f}".format(result["median_tpot_ms"], result["p99_tpot_ms"]),
        ),
        (
            "Median / P99 ITL (ms)",
            "{:.2f} / {:.2f}".format(result["median_itl_ms"], result["p99_itl_ms"]),
        ),
    ]
    if result["goodput"] is not None:
        rows.append(("Goodput (share within SLO)", "{:.3f}".format(result["goodput"])))
    server = result["server_metrics"]
    if server is not None:
        rows.append(("Server generated tokens (delta)", server["generation_tokens_delta"]))
        rows.append(
            (
                "Peak running / queued requests",
                "{} / {}".format(server["peak_num_running_reqs"], server["peak_num_queue_reqs"]),
            )
        )
        rows.append(("Peak token usage", server["peak_token_usage"]))
        if server.get("left_out"):
            rows.append(("Left out (sum past the float maximum)", ", ".join(server["left_out"])))
    if result["failure_reasons"]:
        reasons = ", ".join(f"{k} {v}" for k, v in result["failure_reasons"].items())
        rows.append(("Failure reasons", reasons))
    lines = ["{:=^60}".format(" Smoke Benchmark Result ")]
    lines += ["{:<40} {}".format(label + ":", value) for label, value in rows]
    lines += [f"error: {e}" for e in result["errors"][:3]]
    lines.append("=" * 60)
    return "\n".join(lines)
