"""A run with speculative decoding, diagnosed (docs/SPECULATIVE.md): the speculation it ran,
whether it pays at the measured accept length, the 48 reset of max_running_requests.
"""

from __future__ import annotations

from typing import Any

from sglang_fleet.capacity import speculative
from sglang_fleet.capacity.server_log import StartupLog
from sglang_fleet.diagnosis.evidence import QUEUED_SHARE, make_lever
from sglang_fleet.diagnosis.levers import plan_with


# --- speculative decoding (docs/SPECULATIVE.md) ----------------------------------------------
def running_speculation(smoke: dict[str, Any], startup: StartupLog | None) -> dict[str, Any]:
    """The running server's speculative flags and the max_running_requests it resolved: from
    /server_info (a live sample's `server_info`), else from the log (its server_args and its
    scheduler line)."""
    info = smoke.get("server_info") if isinstance(smoke.get("server_info"), dict) else {}
    stated = startup.server_args if startup is not None else {}
    found: dict[str, Any] = {}
    for name in speculative.FLAGS:
        value = info.get(name, stated.get(name))
        if value is not None:
            found[name] = value
    resolved = info.get("max_running_requests")
    if resolved is None and startup is not None:
        resolved = startup.max_running_requests
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


def speculation_findings(
    ev: dict[str, Any], running: dict[str, Any], ctx: dict[str, Any] | None
) -> tuple[list[dict[str, str]], list[dict[str, str]], list[str]]:
    """(levers before the verdict's, levers after them, notes) about speculative decoding."""
    accept = ev.get("spec_accept_length")
    if speculative.algorithm_of(running) is None and not accept:
        return [], [], []
    plan_now = plan_with(ctx) if ctx else None
    first: list[dict[str, str]] = []
    if _at_reset_cap(ev, running):
        first.append(
            make_lever(
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
        plan_with(ctx, speculative_accept_length=accept, job_concurrency=batch)
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
        make_lever(
            "speculation_costs",
            f"Speculative decoding costs throughput at this load: at {batch} running requests "
            f"and accept length {accept:g} the planner expects x{gain:g} of plain decoding's "
            f"output (it pays at running batches {ranges}; {section['model']}). Turn it off "
            "(remove speculative_algorithm) for this job, or keep the running batch where it "
            "pays.",
        )
    ]


def cap_lever(stated: dict[str, Any], ev: dict[str, Any]) -> list[dict[str, str]]:
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
        make_lever(
            "max_total_tokens",
            f"The KV pool is the run's own --max-total-tokens {cap}, not what memory allows: "
            f"raise it (or leave it out and let SGLang size the pool).{where}",
        )
    ]


def plannable_flags(flags: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """The running server's flags the levers' plans can take: its speculative flags only with
    the draft's config.json at hand (--speculative-draft-model-path), without which the planner
    cannot place the draft; then the levers are planned without it."""
    needs_draft = speculative.algorithm_of(flags) not in (None, "NGRAM")
    if needs_draft and args.get("speculative_draft_config") is None:
        return {k: v for k, v in flags.items() if k not in speculative.FLAGS}
    return flags
