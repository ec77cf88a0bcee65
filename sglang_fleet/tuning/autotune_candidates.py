"""An autotune search's candidates: the grid of the operator's lists (SPACE_FLAGS) over the
server's flags, each candidate as the whole flag set a trial starts the server with, and what
SGLang adjusts by itself under attention DP.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from sglang_fleet.capacity import attention_dp, speculative
from sglang_fleet.tuning.autotune_inputs import (
    PER_RANK_CHUNK,
    SPACE_FLAGS,
    SPECULATIVE,
    as_float,
    speculative_flags,
)

# SGLang multiplies schedule_conservativeness by this under attention DP (parallel_hook).
ATTN_DP_CONSERVATIVENESS = 0.3


def grid(
    base: Mapping[str, Any], space: Mapping[str, list], concurrency: int | None = None
) -> list[dict[str, Any]]:
    """Every combination of the space's lists as a pending candidate over the base flags.
    concurrency: the job's (autotune_workload), what a speculative candidate without
    max_running_requests gets instead of SGLang's reset to 48."""
    names = [n for n in SPACE_FLAGS if n in space]
    candidates = []
    for index, values in enumerate(itertools.product(*(space[n] for n in names))):
        point = dict(zip(names, values, strict=True))
        item = point.get(SPECULATIVE)
        tuned = _as_sglang_flags(base, point, concurrency)
        candidates.append(
            {
                "id": f"c{index:03d}",
                "tuned": tuned,
                "changes": sum(1 for k, v in tuned.items() if _differs(base.get(k), v)),
                "status": "pending",
                "prune": None,
                "predicted": None,
                # The accept length the operator expects, until a trial measures one.
                "accept_length": (item or {}).get("accept_length"),
            }
        )
    return candidates


def _speculative_overlay(
    base: Mapping[str, Any],
    point: Mapping[str, Any],
    item: Mapping[str, Any] | None,
    concurrency: int | None,
) -> dict[str, Any]:
    """The flags a speculative setting lays over the server's: null removes every
    --speculative-* flag the server has (the same flags without speculation); a setting replaces
    them (the draft path the server's own unless it names one), and without
    max_running_requests anywhere it sets the job's concurrency: SGLang 0.5.23 would reset it to
    48, and the trial would measure that cap instead of speculation."""
    off = {name: None for name in speculative.FLAGS if base.get(name) is not None}
    if item is None:
        return off
    flags = off | speculative_flags(item)
    if "speculative_draft_model_path" not in flags or flags["speculative_draft_model_path"] is None:
        flags.pop("speculative_draft_model_path", None)
    given = base.get("max_running_requests") is not None or "max_running_requests" in point
    if not given and concurrency:
        flags["max_running_requests"] = concurrency
    return flags


def _as_sglang_flags(
    base: Mapping[str, Any], point: dict[str, Any], concurrency: int | None = None
) -> dict[str, Any]:
    """A grid point as the flags a trial overlays on the server's (real SGLang flags only):
    a per-rank chunk becomes chunked_prefill_size x attn_dp_size, a candidate attention-DP
    size replaces the deprecated spelling of the server's flags, and a speculative setting
    becomes the --speculative-* flags (null: none)."""
    tuned = dict(point)
    if SPECULATIVE in tuned:
        tuned |= _speculative_overlay(base, point, tuned.pop(SPECULATIVE), concurrency)
    if "attn_dp_size" in tuned and str(base.get("enable_dp_attention")).lower() == "true":
        tuned |= {"enable_dp_attention": False, "dp_size": 1}
    per_rank = tuned.pop(PER_RANK_CHUNK, None)
    if per_rank is not None:
        ranks = attention_dp.attn_dp_of(dict(base) | tuned)
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
    if current is None or value is None:  # a flag added, or removed (null)
        return current is not value
    return str(current) != str(value) and as_float(current) != as_float(value)


def candidate_flags(state: Mapping[str, Any], candidate: Mapping[str, Any]) -> dict[str, Any]:
    """The whole flag set a trial starts the server with."""
    return dict(state["base_flags"]) | dict(candidate.get("tuned") or {})
