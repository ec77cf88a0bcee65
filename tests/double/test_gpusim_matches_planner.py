"""The double and the planner (sglang_fleet) size the KV pool the same way for the fixtures.

Both follow SGLang 0.5.23's arithmetic; a drift of either would make the deploy's pre-flight
pass or fail where the simulated server does the opposite. gpusim itself never imports
sglang_fleet: only this test holds the two side by side.
"""

from __future__ import annotations

import math

import pytest
from gpusim.memory import GIB, MemoryArgs, plan_memory
from gpusim.model import load_model
from gpusim_helpers import KIMI, LLAMA

from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.capacity.planner import plan as fleet_plan

GPU_MIB = 97887
HOST = {"gpu_memory_mib": GPU_MIB, "host_ram_gib": 400, "gpu_count": 8}


def double_tokens(model_dir: str, tp: int, fraction: float | None, kv_dtype: str) -> int:
    args = MemoryArgs(tp_size=tp, mem_fraction_static=fraction, kv_cache_dtype=kv_dtype)
    model = load_model(model_dir)
    return plan_memory(model, args, GPU_MIB, [GPU_MIB] * tp, 400 * GIB).max_total_num_tokens


def planner_tokens(model_dir: str, tp: int, fraction: float | None, kv_dtype: str) -> int:
    config, weight_bytes = read_model_dir(model_dir)
    args = {"tp_size": tp, "mem_fraction_static": fraction, "kv_cache_dtype": kv_dtype}
    return fleet_plan(config, weight_bytes, args, HOST)["max_total_num_tokens"]


def test_kimi_fp8_at_090_is_sglangs_formula_with_the_multimodal_reserve() -> None:
    # pre = (97887 - 768) / 1024 GiB; weights 594231324672 B / 8; Kimi-K2.5 is multimodal,
    # so SGLang keeps SGLANG_VLM_CACHE_SIZE_MB (100 MiB) out of the KV budget.
    # rest = 94.8428 - 69.1776 - 94.8428 * 0.10 - 0.0977 = 16.0833 GiB; fp8 MLA cell 35136 B
    pre = (GPU_MIB - 768) / 1024
    rest = pre - 594231324672 / 8 / GIB - pre * (1 - 0.90) - 100 / 1024
    formula = math.floor(rest * GIB / ((512 + 64) * 61 * 1))
    assert formula == 491496
    assert double_tokens(KIMI, 8, 0.90, "fp8_e4m3") == formula
    assert planner_tokens(KIMI, 8, 0.90, "fp8_e4m3") == formula


@pytest.mark.parametrize(
    ("model_dir", "tp"),
    [(KIMI, 8), (LLAMA, 1), (LLAMA, 8)],
    ids=["kimi-tp8", "llama-tp1", "llama-tp8"],
)
@pytest.mark.parametrize("fraction", [0.85, 0.93, None], ids=["0.85", "0.93", "default"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_double_and_planner_agree_on_the_fixtures(
    model_dir: str, tp: int, fraction: float | None, kv_dtype: str
) -> None:
    """Same token budget, the default (VLM-adjusted) fraction included."""
    expected = planner_tokens(model_dir, tp, fraction, kv_dtype)
    assert expected > 0
    assert double_tokens(model_dir, tp, fraction, kv_dtype) == expected


@pytest.mark.parametrize("fraction", [0.85, 0.88])
def test_double_and_planner_agree_with_an_eagle3_draft(fraction: float) -> None:
    """The draft's weights and its KV budget (issue 46): the double places them from the wheel's
    own code (gpusim/gpusim/speculative.py), the planner from its own reading
    (sglang_fleet/capacity/): the same token budget for the Kimi target and its EAGLE-3 draft."""
    from test_gpusim_speculative import EAGLE3, kimi_eagle3_plan  # noqa: PLC0415 (its fixture)

    _, double = kimi_eagle3_plan(mem_fraction_static=fraction, kv_cache_dtype="auto")
    config, weight_bytes = read_model_dir(KIMI)
    draft_config, draft_bytes = read_model_dir(EAGLE3)
    args = {
        "tp_size": 8, "mem_fraction_static": fraction, "kv_cache_dtype": "auto",
        "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": EAGLE3,
        "speculative_draft_config": draft_config, "speculative_draft_weight_bytes": draft_bytes,
        "speculative_num_steps": 3, "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4, "max_running_requests": 100,
    }  # fmt: skip
    planned = fleet_plan(config, weight_bytes, args, HOST)["max_total_num_tokens"]
    assert double.max_total_num_tokens == planned
    assert planned < planner_tokens(KIMI, 8, fraction, "auto")  # the draft's memory counted
