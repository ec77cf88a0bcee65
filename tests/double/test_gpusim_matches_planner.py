"""The double and the planner (sglang_fleet) size the KV pool alike for the fixtures.

Each reads SGLang 0.5.23 its own way: the double lays the checkpoint out tensor by tensor
(gpusim/placement.py), the planner by parts (capacity/attention_dp.weight_layout). A drift of
either would make the deploy's pre-flight pass or fail where the simulated server does the
opposite. gpusim itself never imports sglang_fleet: only this test holds the two side by side.

One difference stays, bounded here: the planner splits over tp what config.json does not
describe and the layer norms, which the double keeps whole on every GPU (SGLang's RMSNorm is a
replicated vector; Kimi-K2.5's undescribed bytes are its encoder's, whose MLP is a
ReplicatedLinear). The planner's budget is that many bytes x (1 - 1/tp) larger, no more.
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
# Bytes the planner splits over tp and the double replicates. Kimi-K2.5: its norms (q_a and kv_a
# layernorms, two per layer, the final one; bf16) and the checkpoint's 25,972,736 bytes beyond
# what config.json describes. The Llama: none (the planner splits its norms, the double keeps
# them whole, but nothing the planner lays out is replicated).
KIMI_NORMS = ((1536 + 512 + 2 * 7168) * 61 + 7168) * 2
PLANNER_SPLITS = {KIMI: KIMI_NORMS + 25_972_736, LLAMA: ((2 * 4096 * 32) + 4096) * 2}
KIMI_TOKEN_GAP_FP8 = math.ceil(PLANNER_SPLITS[KIMI] * 7 / 8 / 35136)  # 697 tokens


def token_gap(model_dir: str, tp: int, cell: int) -> int:
    """The most tokens by which the planner's budget may exceed the double's."""
    return math.ceil(PLANNER_SPLITS[model_dir] * (1 - 1 / tp) / cell)


def cell_of(model_dir: str, tp: int, kv_dtype: str) -> int:
    elem = 1 if kv_dtype == "fp8_e4m3" else 2
    if model_dir == KIMI:
        return (512 + 64) * 61 * elem
    return max(1, 8 // tp) * 128 * 2 * 32 * elem


def double_tokens(model_dir: str, tp: int, fraction: float | None, kv_dtype: str) -> int:
    args = MemoryArgs(tp_size=tp, mem_fraction_static=fraction, kv_cache_dtype=kv_dtype)
    model = load_model(model_dir)
    return plan_memory(model, args, GPU_MIB, [GPU_MIB] * tp, 400 * GIB).max_total_num_tokens


def planner_tokens(model_dir: str, tp: int, fraction: float | None, kv_dtype: str) -> int:
    config, weight_bytes = read_model_dir(model_dir)
    args = {"tp_size": tp, "mem_fraction_static": fraction, "kv_cache_dtype": kv_dtype}
    return fleet_plan(config, weight_bytes, args, HOST)["max_total_num_tokens"]


def test_kimi_fp8_at_090_is_sglangs_formula_with_the_multimodal_reserve() -> None:
    # pre = (97887 - 768) / 1024 GiB; Kimi-K2.5 is multimodal, so SGLang keeps
    # SGLANG_VLM_CACHE_SIZE_MB (100 MiB) out of the KV budget. Weights per GPU as SGLang places
    # them: fused_qkv_a_proj_with_mqa (7168 x 2112, 61 layers, bf16) and the MoE router
    # (60 layers of 384 x 7168 bf16 + 384 fp32) whole; w_kc/w_vc, a copy of kv_b_proj
    # (512 x 64 x 256 per layer), over tp like it; the rest of the checkpoint over tp.
    # rest = 94.8428 - 71.0939 - 94.8428 * 0.10 - 0.0977 = 14.1669 GiB; fp8 MLA cell 35136 B
    pre = (GPU_MIB - 768) / 1024
    whole = 7168 * 2112 * 61 * 2 + 60 * (384 * 7168 * 2 + 384 * 4)
    copy = 512 * 64 * 256 * 61 * 2
    weights = whole + (594231324672 - whole) / 8 + copy / 8
    rest = pre - weights / GIB - pre * (1 - 0.90) - 100 / 1024
    formula = math.floor(rest * GIB / ((512 + 64) * 61 * 1))
    assert formula == 433632  # was 491496 with checkpoint / tp on each GPU
    assert planner_tokens(KIMI, 8, 0.90, "fp8_e4m3") == formula
    # The double also keeps the norms and the undescribed bytes whole (see the docstring).
    assert double_tokens(KIMI, 8, 0.90, "fp8_e4m3") == formula - KIMI_TOKEN_GAP_FP8 == 432935


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
    """Same token budget, the default (VLM-adjusted) fraction included, within what the
    planner splits and the double replicates."""
    expected = planner_tokens(model_dir, tp, fraction, kv_dtype)
    assert expected > 0
    gap = expected - double_tokens(model_dir, tp, fraction, kv_dtype)
    assert 0 <= gap <= token_gap(model_dir, tp, cell_of(model_dir, tp, kv_dtype))


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
    # The target's cell and the draft's price: 70272 + int(70272 x 1 / 61) bytes per token.
    gap = planned - double.max_total_num_tokens
    assert 0 <= gap <= token_gap(KIMI, 8, 70272 + 70272 // 61)
    assert planned < planner_tokens(KIMI, 8, fraction, "auto")  # the draft's memory counted
