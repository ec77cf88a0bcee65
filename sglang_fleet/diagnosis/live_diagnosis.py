"""A running server diagnosed from a live /metrics sample (`diagnose_live`, docs/DIAGNOSIS.md),
and the table several of them print as.
"""

from __future__ import annotations

import statistics
from typing import Any

from sglang_fleet.capacity.planner_inputs import PLANNER_FLAGS
from sglang_fleet.diagnosis.evidence import Sample, make_lever, samples_from_metrics
from sglang_fleet.diagnosis.run_diagnosis import diagnose, dropped_note, finite_only, noop_notes
from sglang_fleet.diagnosis.speculation import plannable_flags
from sglang_fleet.module_utils import bounded_json

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


def as_sample(sample: dict | str) -> dict[str, Any]:
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
    args = dict(ctx.get("args") or {}) | plannable_flags(server_args, ctx.get("args") or {})
    per_request = observed.get("kv_tokens_per_running_req")
    if per_request and "avg_input_len" not in args and "avg_output_len" not in args:
        args |= {"avg_input_len": per_request, "avg_output_len": 0}
    if observed.get("per_request_tok_s") and "per_request_tok_s" not in args:
        args["per_request_tok_s"] = observed["per_request_tok_s"]
    return ctx | {"args": args}


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
        "levers": [make_lever(code, message)],
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
    sample = finite_only(as_sample(sample), "live sample", dropped)
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
    result["notes"] += list(sample.get("warnings") or []) + dropped_note(dropped)
    for note in noop_notes(info, info.get("version")):
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
