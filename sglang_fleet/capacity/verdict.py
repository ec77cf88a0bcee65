"""What a server's capacity plan means for the rollout, in words (the sglang_server role's
pre-flight, roles/sglang_server/tasks/plan.yml; docs/CALIBRATION.md).

verdict() takes one plan (sglang_fleet.capacity.planner.plan(), through the sglang_server_plan
filter) and
says three things:
- bounds: what bounds the server's throughput, the line the pre-flight shows for every server;
- refusal: why this host's calibration refuses the flag set ("" when it does not), which the
  fleet summary shows as "refused (calibrated)";
- blocking: the message the host fails with ("" when nothing blocks): the planner's errors,
  and its warnings too when the operator made them fatal, with the way to overrule a refusal
  that rests on a calibration.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_fleet.capacity.planner import speculative_lines

# The planner's error when a calibration of this host predicts too little free memory after CUDA
# graph capture: the one refusal that sglang_server_calibration_mode: warn overrules.
CALIBRATED_REFUSAL_CODE = "oom_risk_mem_fraction"
OVERRULE_HINT = (
    " (refused on this host's calibration before anything stopped; to start it anyway, set"
    " sglang_server_calibration_mode: warn)"
)


def bounds_message(name: str, plan: Mapping[str, Any], workload: Mapping[str, Any]) -> str:
    """One line: KV tokens, concurrency, KV-bound output, headroom, calibration, warnings."""
    details = plan["details"]
    words = [
        f"{name}: {plan['max_total_num_tokens']} KV tokens ({plan['cell_size_bytes']} B/token),"
        f" about {plan['max_concurrent_requests']} concurrent requests of"
        f" {workload['avg_input_len']}+{workload['avg_output_len']} tokens, KV-bound output about"
        f" {plan['kv_bound_output_tok_s']} tok/s; {plan['headroom_gib']} GiB outside the static"
        f" pool; HiCache host total {plan['hicache_host_gib_total']} GiB."
    ]
    if details.get("calibrated"):
        words.append(
            f"Calibrated ({details['calibration']}): {details['free_after_graph_gib']} GiB free"
            " after CUDA graph capture predicted, highest safe mem_fraction_static"
            f" {details['max_safe_mem_fraction_static']}."
        )
    else:
        words.append("Not calibrated: estimates only.")
    set_aside = details.get("calibration_set_aside") or []
    if set_aside:
        words.append(
            "Calibrations set aside (no plan uses them; the next healthy start moves them to a"
            f" side file beside the store): {'; '.join(set_aside)}."
        )
    if plan.get("speculative") and plan["speculative"].get("settings"):
        words += [f"{line}." for line in speculative_lines(plan["speculative"])]
    words += [f"WARNING {w['code']}: {w['message']}" for w in plan["warnings"]]
    return " ".join(words)


def calibrated_refusal(plan: Mapping[str, Any]) -> str:
    """The calibration's refusal of this flag set, "" when there is none (or no calibration)."""
    if not plan["details"].get("calibrated"):
        return ""
    return " | ".join(e["message"] for e in plan["errors"] if e["code"] == CALIBRATED_REFUSAL_CODE)


def blocking_message(name: str, plan: Mapping[str, Any], *, warnings_fatal: bool) -> str:
    """What fails the host before anything stops, "" when nothing does."""
    blocking = list(plan["errors"]) + (list(plan["warnings"]) if warnings_fatal else [])
    if not blocking:
        return ""
    message = f"sglang_server_instances[{name}]: " + " | ".join(b["message"] for b in blocking)
    return message + (OVERRULE_HINT if calibrated_refusal(plan) else "")


def verdict(
    plan: Mapping[str, Any], name: str, workload: Mapping[str, Any], *, warnings_fatal: bool
) -> dict[str, str]:
    """{bounds, refusal, blocking} of one server's plan (see the module's docstring)."""
    return {
        "bounds": bounds_message(name, plan, workload),
        "refusal": calibrated_refusal(plan),
        "blocking": blocking_message(name, plan, warnings_fatal=warnings_fatal),
    }
