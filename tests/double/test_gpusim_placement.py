"""The double places weights tensor by tensor as SGLang 0.5.23 does (gpusim/placement.py).

Every expected number below is worked out by hand from the wheel's layers (the module's
docstring names them) and the fixtures' config.json, not from sglang_fleet.
"""

from __future__ import annotations

import pytest
from gpusim.memory import GIB, MemoryArgs, plan_memory, rank_weights
from gpusim.model import load_model
from gpusim.placement import ATTN_TP, KV_HEADS, REPLICATED, TP, Quantization, tensor_list
from gpusim_helpers import KIMI, LLAMA

GPU_MIB = 97887
LAYERS = 61
# Kimi-K2.5 (text config): hidden 7168, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128,
# 64 heads, 384 routed experts in 60 MoE layers, vocab 163840; attention in bf16 (ignored by
# the int4 recipe), routed experts int4 in groups of 32.
QKV_A = 7168 * (1536 + 512 + 64)  # fused_qkv_a_proj_with_mqa, ReplicatedLinear
NORMS = 1536 + 512 + 2 * 7168  # q_a_layernorm, kv_a_layernorm, input/post-attention norms
ROUTER = 384 * 7168 * 2 + 384 * 4  # MoEGate.weight (bf16) + e_score_correction_bias (fp32)
Q_B, KV_B, O_PROJ = 1536 * 64 * 192, 512 * 64 * 256, 64 * 128 * 7168
EMBED = 163840 * 7168 * 2
# The fixture's total_size less every tensor config.json describes: the encoder's share.
KIMI_UNLISTED = 25_972_736
KIMI_CHECKPOINT = 594_231_324_672
# Kimi-K2.5 at tp 8, bytes per GPU: whole on every GPU, split over attention TP (with the
# w_kc/w_vc copy of kv_b_proj that post_load_weights adds), the rest over tp.
KIMI_WHOLE = (QKV_A + NORMS) * LAYERS * 2 + 7168 * 2 + ROUTER * 60 + KIMI_UNLISTED
KIMI_ATTN_TP = (Q_B + 2 * KV_B + O_PROJ) * LAYERS * 2 + EMBED
KIMI_OVER_TP = KIMI_CHECKPOINT - KIMI_WHOLE - (KIMI_ATTN_TP - KV_B * LAYERS * 2)


def kimi_weights_per_gpu(tp: int = 8, attn_dp: int = 1) -> float:
    """Bytes per GPU of the Kimi fixture: 71.094 GiB at tp 8 (checkpoint / 8: 69.178)."""
    return KIMI_WHOLE + KIMI_ATTN_TP / (tp // attn_dp) + KIMI_OVER_TP / tp


def test_kimi_tensors_add_up_to_the_checkpoint() -> None:
    model = load_model(KIMI)
    tensors = tensor_list(model.text_config, is_mla=True, dtype_bytes=2)
    routed = 60 * 384 * 3 * 7168 * 2048  # weights; int4 = 1/2 byte + a bf16 scale per 32
    in_checkpoint = sum(t.nbytes for t in tensors if not t.derived)
    assert next(t for t in tensors if t.name.endswith(".experts")).nbytes == routed // 2 + (
        routed // 32 * 2
    )
    assert model.weight_bytes - in_checkpoint == KIMI_UNLISTED
    assert model.weight_bytes * 1e-4 > KIMI_UNLISTED  # config.json describes the checkpoint


@pytest.mark.parametrize("attn_dp", [1, 2, 8])
def test_kimi_at_tp8_keeps_the_replicated_projections_whole(attn_dp: int) -> None:
    placed = rank_weights(load_model(KIMI), MemoryArgs(tp_size=8, attn_dp_size=attn_dp))
    assert placed.by_group[REPLICATED] == KIMI_WHOLE  # 2.054 GiB on every GPU
    # q_b, kv_b, its w_kc/w_vc copy and o_proj, and the input embedding: over tp / attn_dp.
    assert placed.by_group[ATTN_TP] == pytest.approx(KIMI_ATTN_TP / (8 // attn_dp))
    # The rest of the checkpoint over tp: the whole less what is placed otherwise.
    assert placed.by_group[TP] == pytest.approx(KIMI_OVER_TP / 8)
    assert placed.total == pytest.approx(kimi_weights_per_gpu(8, attn_dp))
    if attn_dp == 1:
        # fused_qkv_a_proj_with_mqa alone: 1.72 GiB on each GPU where checkpoint / tp gave
        # it 0.22 (issue 47: "about 1.5 GiB per GPU").
        assert pytest.approx(1.505, abs=1e-3) == QKV_A * LAYERS * 2 * (1 - 1 / 8) / GIB
        assert placed.total / GIB == pytest.approx(71.094, abs=1e-3)
        assert model_even_split_gib() == pytest.approx(69.178, abs=1e-3)


def model_even_split_gib() -> float:
    return load_model(KIMI).weight_bytes / 8 / GIB


def test_the_kv_budget_pays_for_the_replicated_weights() -> None:
    # pre = (97887 - 768) / 1024; rest = pre - weights - pre * 0.10 - 100 MiB (VLM cache).
    model = load_model(KIMI)
    args = MemoryArgs(tp_size=8, mem_fraction_static=0.90, kv_cache_dtype="fp8_e4m3")
    plan = plan_memory(model, args, GPU_MIB, [GPU_MIB] * 8, 400 * GIB)
    pre = (GPU_MIB - 768) / 1024
    weights = rank_weights(model, MemoryArgs(tp_size=8)).total / GIB
    rest = pre - weights - pre * 0.10 - 100 / 1024
    assert plan.max_total_num_tokens == int(rest * GIB // ((512 + 64) * 61)) == 432935


def test_llama_splits_over_tp_and_replicates_kv_heads_past_their_count() -> None:
    llama = load_model(LLAMA)
    tensors = tensor_list(llama.text_config, is_mla=False, dtype_bytes=2)
    assert sum(t.nbytes for t in tensors) == llama.weight_bytes  # described to the byte
    kv = 2 * 4096 * 8 * 128 * 32 * 2  # k_proj + v_proj, 8 heads of 128, 32 layers, bf16
    eight = rank_weights(llama, MemoryArgs(tp_size=8))
    assert eight.by_group[KV_HEADS] == kv / 8  # one head per GPU
    sixteen = rank_weights(llama, MemoryArgs(tp_size=16, nnodes=2))
    assert sixteen.by_group[KV_HEADS] == kv / 8  # still one head: two GPUs hold each
    norms = (2 * 4096 * 32 + 4096) * 2
    assert eight.by_group[REPLICATED] == norms


def test_a_quantization_the_double_does_not_read_falls_back_to_an_even_split() -> None:
    llama = load_model(LLAMA)
    small = type(llama)(**{**llama.__dict__, "weight_bytes": llama.weight_bytes // 4})
    placed = rank_weights(small, MemoryArgs(tp_size=8))
    assert placed.fallback
    assert placed.total == small.weight_bytes / 8


def test_compressed_tensors_ignore_list_keeps_attention_in_bf16() -> None:
    quant = Quantization(load_model(KIMI).text_config, 2)
    assert quant.linear_bytes("model.layers.0.self_attn.q_b_proj", 1024) == 2048
    assert quant.linear_bytes("model.layers.0.mlp.shared_experts.gate_proj", 1024) == 2048
    assert quant.linear_bytes("model.layers.0.mlp.gate_proj", 1024) == 2048
    assert quant.linear_bytes("model.layers.0.mlp.experts.0.gate_proj", 1024) == 512 + 64
