"""The memory model against worked examples of SGLang's formula (arithmetic shown)."""

from __future__ import annotations

import math

import pytest
from gpusim.memory import (
    GIB,
    MemoryArgs,
    StartupFailure,
    capture_oom,
    cell_size_bytes,
    default_mem_fraction_static,
    plan_memory,
    prefill_graph_buckets,
    prefill_oom_message,
)
from gpusim.model import load_model
from gpusim_helpers import KIMI, LLAMA
from test_gpusim_placement import kimi_weights_per_gpu

GPU_MIB = 97887  # RTX PRO 6000 Blackwell (96 GB)
HOST_RAM = 400 * GIB
# pre = free GiB before weights = (97887 MiB - 768 MiB CUDA context) / 1024
PRE_GIB = (97887 - 768) / 1024  # 94.8428...
MM_RESERVE_GIB = 100 / 1024  # SGLANG_VLM_CACHE_SIZE_MB default, multimodal models only
KIMI_TP8_GIB = kimi_weights_per_gpu(8) / GIB  # 71.0939, as SGLang places the tensors


def plan(model_dir: str, tp: int, **kwargs: object):
    model = load_model(model_dir)
    args = MemoryArgs(tp_size=tp, **kwargs)
    return plan_memory(model, args, GPU_MIB, [GPU_MIB] * tp, HOST_RAM)


def test_model_dirs_are_read_like_sglang() -> None:
    llama, kimi = load_model(LLAMA), load_model(KIMI)
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim, llama.is_mla) == (
        32,
        8,
        128,
        False,
    )
    # Kimi-K2.5 nests the language model in text_config.
    assert (kimi.num_layers, kimi.kv_lora_rank, kimi.qk_rope_head_dim, kimi.is_mla) == (
        61,
        512,
        64,
        True,
    )
    assert kimi.weight_bytes == 594_231_324_672
    assert kimi.context_len == 262144


def test_mha_bf16_worked_example() -> None:
    # Llama-3.1-8B, TP1, bf16 KV, mem_fraction_static 0.85.
    # cell = kv_heads(8) * (head_dim 128 + v_head_dim 128) * layers 32 * 2 bytes = 131072
    # weights = 16060522496 B / 2**30 = 14.9575 GiB; post = pre - weights = 79.8853
    # rest = post - pre * (1 - 0.85) = 79.8853 - 14.2264 = 65.6589 GiB
    # tokens = floor(65.6589 * 2**30 / 131072) = 537877
    p = plan(LLAMA, 1, mem_fraction_static=0.85)
    weights = 16060522496 / GIB
    rest = PRE_GIB - weights - PRE_GIB * 0.15
    assert p.cell_size == 8 * (128 + 128) * 32 * 2 == 131072
    assert p.max_total_num_tokens == math.floor(rest * GIB / 131072) == 537877


def test_mha_fp8_halves_the_cell_and_doubles_tokens() -> None:
    # Same as above with fp8_e4m3: 1 byte per element -> cell 65536 ->
    # floor(65.6589 * 2**30 / 65536) = 1075754 tokens (2 x 537877, less one for flooring).
    p = plan(LLAMA, 1, mem_fraction_static=0.85, kv_cache_dtype="fp8_e4m3")
    rest = PRE_GIB - 16060522496 / GIB - PRE_GIB * 0.15
    assert p.cell_size == 65536
    assert p.max_total_num_tokens == math.floor(rest * GIB / 65536) == 1075754


def test_mha_cell_divides_kv_heads_by_tp_but_not_below_one() -> None:
    llama = load_model(LLAMA)
    assert cell_size_bytes(llama, 2, "auto") == 4 * 256 * 32 * 2  # 8 kv heads / tp 2
    assert cell_size_bytes(llama, 16, "auto") == 1 * 256 * 32 * 2  # max(1, 8 // 16)


def test_mla_bf16_worked_example() -> None:
    # Kimi-K2.5 int4 on 8 x 96 GB, TP8, bf16 KV, mem_fraction_static 0.85.
    # cell = (kv_lora_rank 512 + qk_rope_head_dim 64) * 61 layers * 2 = 70272 (not / tp)
    # weights per GPU as SGLang places them (test_gpusim_placement.py) = 71.0939 GiB
    # (checkpoint / 8 would be 69.1776: fused_qkv_a_proj_with_mqa and the router stay whole)
    # multimodal (vision_config): SGLANG_VLM_CACHE_SIZE_MB 100 MiB = 0.0977 GiB kept out
    # rest = (94.8428 - 71.0939) - 94.8428 * 0.15 - 0.0977 = 9.4248 GiB
    # tokens = floor(9.4248 * 2**30 / 70272) = 144009 (173289 with checkpoint / 8)
    p = plan(KIMI, 8, mem_fraction_static=0.85)
    rest = PRE_GIB - KIMI_TP8_GIB - PRE_GIB * 0.15 - MM_RESERVE_GIB
    assert p.cell_size == (512 + 64) * 61 * 2 == 70272
    assert p.multimodal_reserve_gib == MM_RESERVE_GIB
    assert p.weight_gib == pytest.approx(71.0939, abs=1e-4)
    assert p.max_total_num_tokens == math.floor(rest * GIB / 70272) == 144009


def test_mla_fp8_doubles_tokens() -> None:
    # fp8_e4m3: cell 35136 -> floor(9.4248 * 2**30 / 35136) = 288018
    p = plan(KIMI, 8, mem_fraction_static=0.85, kv_cache_dtype="fp8_e4m3")
    rest = PRE_GIB - KIMI_TP8_GIB - PRE_GIB * 0.15 - MM_RESERVE_GIB
    assert p.cell_size == 35136
    assert p.max_total_num_tokens == math.floor(rest * GIB / 35136) == 288018


def test_multimodal_reserve_follows_sglang_env_and_language_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = plan(KIMI, 8, mem_fraction_static=0.85).max_total_num_tokens
    text_only = plan(KIMI, 8, mem_fraction_static=0.85, language_model_only=True)
    assert text_only.multimodal_reserve_gib == 0
    assert text_only.max_total_num_tokens == math.floor(
        (PRE_GIB - KIMI_TP8_GIB - PRE_GIB * 0.15) * GIB / 70272
    )
    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "0")
    assert plan(KIMI, 8, mem_fraction_static=0.85).max_total_num_tokens == (
        text_only.max_total_num_tokens
    )
    monkeypatch.delenv("SGLANG_VLM_CACHE_SIZE_MB")
    # A GPU feature transport adds SGLANG_MM_FEATURE_CACHE_MB (1024 MiB) to the reserve.
    ipc = plan(KIMI, 8, mem_fraction_static=0.85, mm_feature_transport="cuda_ipc")
    assert ipc.multimodal_reserve_gib == (100 + 1024) / 1024
    assert ipc.max_total_num_tokens < plain
    assert plan(LLAMA, 1, mem_fraction_static=0.85).multimodal_reserve_gib == 0


def test_weights_that_leave_no_kv_room_fail_like_sglang() -> None:
    # Kimi at 0.70: rest = 23.7489 - 94.8428 * 0.30 = -4.70 GiB <= 0; the least viable
    # fraction is 1 - 23.7489 / 94.8428 = 0.7496 (0.7294 were the weights checkpoint / 8)
    with pytest.raises(StartupFailure) as info:
        plan(KIMI, 8, mem_fraction_static=0.70)
    assert info.value.exc_type == "ValueError"
    assert "Loaded weights leave no GPU memory for the KV cache" in info.value.message
    assert "Raise --mem-fraction-static above 0.750" in info.value.message


def test_rest_smaller_than_one_token_is_not_enough_memory() -> None:
    # Choose mem_fraction_static so that rest is positive but below one 70272-byte cell.
    post = PRE_GIB - KIMI_TP8_GIB
    mfs = 1 - (post - MM_RESERVE_GIB - 1000 / GIB) / PRE_GIB  # rest = 1000 bytes
    with pytest.raises(StartupFailure) as info:
        plan(KIMI, 8, mem_fraction_static=mfs)
    assert info.value.message.startswith(
        "Not enough memory. Please try to increase --mem-fraction-static."
    )


def test_default_mem_fraction_static_mimics_sglang_0_5_23() -> None:
    llama, kimi = load_model(LLAMA), load_model(KIMI)
    # 96 GB tier: chunk 8192, decode graph max_bs 256 (tp<4) or 512 (tp>=4).
    # MHA TP1: 512 + 8192*1.5 + 1*1/8*1024 + 256*2 + 58 prefill buckets*8 = 13904 MiB
    assert len(prefill_graph_buckets(8192)) == 58
    assert default_mem_fraction_static(llama, MemoryArgs(tp_size=1), GPU_MIB, 8192, 256) == round(
        (97887 - 13904) / 97887, 3
    )
    # MLA TP8: 512 + 12288 + 1024 + 512*2 + 1536 (MLA prefill graphs) = 16384 MiB -> 0.833,
    # then adjust_mem_fraction_for_vlm (Kimi-K2.5 has a 27-layer, 1152-wide ViT):
    # complexity 27 * 1152**2 / (24 * 1024**2) = 1.4238 -> 0.95 * (1 - 0.1 * 0.4238)
    vlm = 0.95 * (1 - 0.1 * (27 * 1152**2 / (24 * 1024**2) - 1))
    kimi_default = default_mem_fraction_static(kimi, MemoryArgs(tp_size=8), GPU_MIB, 8192, 512)
    assert kimi_default == pytest.approx(0.833 * vlm) == pytest.approx(0.7578, abs=1e-4)
    text_only = MemoryArgs(tp_size=8, language_only=True)
    assert default_mem_fraction_static(kimi, text_only, GPU_MIB, 8192, 512) == 0.833
    p = plan(KIMI, 8)
    assert (p.mem_fraction_static, p.chunked_prefill_size) == (kimi_default, 8192)


def test_headroom_kimi_job_093_ooms_in_large_prefill_088_works() -> None:
    # Headroom = pre * (1 - mfs); graphs + runtime (512 + 1024 MiB) must fit, then 0.5 MiB
    # per prefill token: an 8192-token chunk needs 4 GiB more. Graphs as the double allocates
    # them: 52 captured decode sizes (1..512) x 8 MiB + the fp32 logits buffer 512 x 163840
    # (320 MiB) + 16 live bf16 activations of 512 x 7168 (112 MiB) = 848 MiB, and the MLA
    # prefill workspace 1536 MiB.
    ok = plan(KIMI, 8, mem_fraction_static=0.88, kv_cache_dtype="fp8_e4m3")
    tight = plan(KIMI, 8, mem_fraction_static=0.93, kv_cache_dtype="fp8_e4m3")
    assert capture_oom(ok) is None and capture_oom(tight) is None  # capture itself succeeds
    assert prefill_oom_message(ok, 8192) is None
    assert tight.graph_mib == {"decode": 52 * 8 + 320 + 112, "prefill": 1536}
    # 0.93: headroom 94.84 * 0.07 = 6.64 GiB - 3.80 GiB = 2.81 GiB -> 5756 tokens at most
    assert tight.max_prefill_activation_tokens == 5756
    message = prefill_oom_message(tight, 8192)
    assert message is not None and message.startswith("CUDA out of memory.")
    assert prefill_oom_message(tight, 2000) is None
    # 0.98 leaves 1.9 GiB: not even the CUDA graphs fit.
    failure = capture_oom(plan(KIMI, 8, mem_fraction_static=0.98, kv_cache_dtype="fp8_e4m3"))
    assert failure is not None and "CUDA out of memory" in failure.message


def test_hicache_host_pool_is_per_rank() -> None:
    # 300 GB per rank x 8 ranks: each rank may have (400 - 10) GiB / 8 = 52.34 GB.
    failing = plan(
        KIMI, 8, mem_fraction_static=0.88, enable_hierarchical_cache=True, hicache_size=300
    )
    assert failing.hicache_failure is not None
    assert failing.hicache_failure.message == (
        "Not enough host memory available. Requesting 300.00 GB but only have 52.34 GB free. "
        "Please reduce the size of the hierarchical cache."
    )
    ok = plan(
        KIMI,
        8,
        mem_fraction_static=0.88,
        kv_cache_dtype="fp8_e4m3",
        enable_hierarchical_cache=True,
        hicache_size=48,
    )
    assert ok.hicache_failure is None
    # 48e9 bytes / 35136 bytes per token = 1366120 tokens, plus SGLang's padding page.
    assert ok.host_pool_tokens == 48_000_000_000 // 35136 + 1
    # HiCache adds prefix-cache capacity only: the device token budget is unchanged.
    plain = plan(KIMI, 8, mem_fraction_static=0.88, kv_cache_dtype="fp8_e4m3")
    assert ok.max_total_num_tokens == plain.max_total_num_tokens


def test_flag_checks_sglang_does() -> None:
    with pytest.raises(StartupFailure, match="mutually exclusive"):
        plan(LLAMA, 1, enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(StartupFailure, match="tp_size must be divisible by number of nodes"):
        plan(LLAMA, 3, nnodes=2)


def test_memory_held_by_another_process_unbalances_tp() -> None:
    kimi = load_model(KIMI)
    free = [GPU_MIB] * 8
    free[3] -= 20000  # a zombie holding 20 GB on GPU 3
    with pytest.raises(StartupFailure, match="The memory capacity is unbalanced"):
        plan_memory(kimi, MemoryArgs(tp_size=8), GPU_MIB, free, HOST_RAM)
