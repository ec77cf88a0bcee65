"""The table of attention-DP layouts a GPU plan lists, and the layout it recommends.

One row per attention-DP size that divides tp (docs/ATTENTION-DP.md): the same flag set planned
at that size, with a decode CUDA graph batch that covers one rank's planned batch, and the
decode roofline; the recommendation is the row with the highest planned throughput.
"""

from __future__ import annotations

import math
from typing import Any

from sglang_fleet.capacity import attention_dp
from sglang_fleet.capacity.gpu_planner import GpuPlanner

# A layout's CUDA graphs are captured for batch sizes up to this (SGLang's largest default).
_MAX_GRAPH_BS = 512


def _graph_bs_for(per_rank: int) -> int:
    """cuda_graph_max_bs_decode that covers a rank's planned batch (a multiple of 8): SGLang's
    default (512 on this GPU class) would reserve bs x attn_dp x 4.5 MiB under attention DP."""
    return max(8, min(_MAX_GRAPH_BS, math.ceil(per_rank / 8) * 8))


def layout_rows(
    model_config: dict, weight_bytes: int, args: dict, host: dict, tp: int
) -> list[dict[str, Any]]:
    """The table: one row per attention-DP size a tp of `tp` allows (attention_dp.attn_dp_sizes).
    args: the planner's arguments of the GPU plan the table belongs to."""
    return [
        _layout_row(model_config, weight_bytes, args, host, n)
        for n in attention_dp.attn_dp_sizes(tp)
    ]


def _layout_row(
    config: dict, weight_bytes: int, args: dict, host: dict, attn_dp: int
) -> dict[str, Any]:
    """One row of the attention-DP table: the flag set at attn_dp_size `attn_dp`."""
    layout_args = dict(args) | {
        "attn_dp_size": attn_dp,
        "enable_dp_attention": False,
        "dp_size": 1,
        "plan_layouts": False,
    }
    result = GpuPlanner(config, weight_bytes, layout_args, host).run()
    given = args.get("cuda_graph_max_bs_decode")
    if attn_dp > 1 and given is None and result["max_concurrent_requests"] > 0:
        per_rank = math.ceil(result["max_concurrent_requests"] / attn_dp)
        layout_args["cuda_graph_max_bs_decode"] = _graph_bs_for(per_rank)
        result = GpuPlanner(config, weight_bytes, layout_args, host).run()
    row = dict(result["layout"])
    row["cuda_graph_max_bs_decode"] = layout_args.get("cuda_graph_max_bs_decode")
    row["decode_roofline_tok_s"] = result["decode_roofline"].get("tok_s")
    row["decode_roofline"] = result["decode_roofline"]
    row["errors"] = [e["code"] for e in result["errors"]]
    return row


def _bound(row: dict[str, Any]) -> float:
    """A layout's planned throughput, capped by its decode roofline."""
    roof = row.get("decode_roofline_tok_s")
    kv = float(row["kv_bound_output_tok_s"])
    return kv if roof is None else min(kv, float(roof))


def recommend(rows: list[dict[str, Any]], current: int) -> dict[str, Any] | None:
    """The attention-DP size with the highest planned throughput (KV-bound, capped by the
    roofline) among those that fit; within 2 % of it, the fewer ranks (less replication)."""
    fit = [row for row in rows if not row["errors"] and row["max_concurrent_requests"] > 0]
    if not fit:
        return None
    top = max(_bound(row) for row in fit)
    best = min((row for row in fit if _bound(row) >= top * 0.98), key=lambda r: r["attn_dp_size"])
    now = next((row for row in rows if row["attn_dp_size"] == current), None)
    gain = _bound(best) / _bound(now) if now and _bound(now) > 0 else None
    return {
        "attn_dp_size": best["attn_dp_size"],
        "cuda_graph_max_bs_decode": best["cuda_graph_max_bs_decode"],
        "planned_output_tok_s": round(_bound(best), 1),
        "gain_over_current": None if gain is None else round(gain, 2),
        "reason": (
            f"attention DP {best['attn_dp_size']}: {best['total_kv_tokens']} KV tokens in "
            f"{best['kv_pools']} pool(s), {best['max_concurrent_requests']} concurrent requests, "
            f"~{_bound(best):.0f} tok/s planned (KV-bound, capped by the decode roofline), with "
            f"{best['weights_per_gpu_gib']} GiB of weights per GPU; the highest of the layouts "
            "that fit (fewer ranks win within 2 %)"
        ),
    }
