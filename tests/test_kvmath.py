"""SGLang's memory arithmetic, each rule a worked example with the arithmetic written out.

Model shapes come from the fixture config.json files (real public values):
Llama-3.1-8B (MHA: 32 layers, 8 KV heads, head_dim 4096/32 = 128),
DeepSeek-V3 and Kimi-K2.5 (MLA: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_fleet.capacity import kv_cache
from sglang_fleet.capacity.model_config import ModelConfigError, model_shape, read_model_dir

FIXTURES = Path(__file__).parent / "fixtures" / "models"
GIB = 2**30


def shape_of(name: str):
    config, _ = read_model_dir(FIXTURES / name)
    return model_shape(config)


LLAMA = shape_of("llama-3.1-8b")
DSV3 = shape_of("deepseek-v3")
KIMI = shape_of("kimi-k2.5-int4")


# --- model config -----------------------------------------------------------------------
def test_llama_is_mha_with_head_dim_from_hidden_size():
    assert LLAMA.attention == "MHA"
    assert (LLAMA.num_layers, LLAMA.num_kv_heads, LLAMA.head_dim, LLAMA.v_head_dim) == (
        32,
        8,
        4096 // 32,
        128,
    )
    assert not LLAMA.is_multimodal


def test_deepseek_v3_is_mla():
    assert DSV3.attention == "MLA"
    assert (DSV3.num_layers, DSV3.kv_lora_rank, DSV3.qk_rope_head_dim) == (61, 512, 64)


def test_kimi_k25_reads_the_nested_text_config_and_vision_tower():
    # Top level is the multimodal wrapper; the attention shape lives under text_config.
    assert KIMI.architecture == "KimiK25ForConditionalGeneration"
    assert KIMI.attention == "MLA"
    assert (KIMI.num_layers, KIMI.kv_lora_rank, KIMI.qk_rope_head_dim) == (61, 512, 64)
    assert KIMI.context_length == 262144
    assert KIMI.is_multimodal
    assert (KIMI.vit_layers, KIMI.vit_hidden_size) == (27, 1152)  # vt_* keys


def test_weight_bytes_come_from_the_safetensors_index():
    _, weights = read_model_dir(FIXTURES / "llama-3.1-8b")
    assert weights == 16060522496


def test_single_file_checkpoint_uses_the_file_size(tmp_path: Path):
    (tmp_path / "config.json").write_text((FIXTURES / "llama-3.1-8b" / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1234)
    _, weights = read_model_dir(tmp_path)
    assert weights == 1234


def test_missing_weights_and_bad_configs_are_errors(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelConfigError, match="safetensors"):
        read_model_dir(tmp_path)
    with pytest.raises(ModelConfigError, match="architectures"):
        model_shape({})
    mla_without_rank = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "hidden_size": 7168,
    }
    with pytest.raises(ModelConfigError, match="kv_lora_rank"):
        model_shape(mla_without_rank)


def test_mla_is_decided_by_architecture_like_sglang():
    # A model with kv_lora_rank but an architecture SGLang does not treat as MLA is MHA.
    config = json.loads((FIXTURES / "deepseek-v3" / "config.json").read_text())
    config["architectures"] = ["SomeNewForCausalLM"]
    assert model_shape(config).attention == "MHA"


# --- cell size --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        # kv_heads/tp * (head_dim + v_head_dim) * layers * bytes = 8 * 256 * 32 * 2
        ("auto", 8 * (128 + 128) * 32 * 2),  # 131072
        ("bf16", 131072),
        ("fp8_e4m3", 8 * 256 * 32 * 1),  # 65536
        ("fp8_e5m2", 65536),
        # mxfp8 adds one scale byte per 32 elements: 65536 + 65536 // 32 = 67584
        ("mxfp8", 65536 + 65536 // 32),
        # fp4: K and V at half a byte (8 * 64 * 32 * 2 = 32768) + one scale byte per 16
        # values (8 * 8 * 32 * 2 = 4096) = 36864
        ("nvfp4", 8 * (128 // 2) * 32 * 2 + 8 * (128 // 16) * 32 * 2),
        ("fp4_mx_block16", 36864),
    ],
)
def test_mha_cell_size_llama_tp1(dtype: str, expected: int):
    assert kv_cache.cell_size_bytes(LLAMA, dtype, tp_size=1) == expected


def test_mha_cell_size_splits_kv_heads_over_tp_but_keeps_one():
    # tp=2: 8 // 2 = 4 heads -> 4 * 256 * 32 * 2 = 65536
    assert kv_cache.cell_size_bytes(LLAMA, "bf16", tp_size=2) == 4 * 256 * 32 * 2
    # tp=8: one head per rank -> 1 * 256 * 32 * 2 = 16384; tp=16 still one head (replicated)
    assert kv_cache.cell_size_bytes(LLAMA, "bf16", tp_size=8) == 16384
    assert kv_cache.cell_size_bytes(LLAMA, "bf16", tp_size=16) == 16384


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        # (kv_lora_rank + qk_rope_head_dim) * layers * bytes = 576 * 61 * 2
        ("bf16", (512 + 64) * 61 * 2),  # 70272
        ("fp8_e4m3", 576 * 61 * 1),  # 35136
        ("fp8_e5m2", 35136),
        ("mxfp8", 35136),
        # fp4: 576 * 61 // 2 = 17568 data + 576 // 16 * 61 = 2196 scale bytes = 19764
        ("nvfp4", 576 * 61 // 2 + (576 // 16) * 61),
    ],
)
def test_mla_cell_size_deepseek_is_not_divided_by_tp(dtype: str, expected: int):
    assert kv_cache.cell_size_bytes(DSV3, dtype, tp_size=1) == expected
    assert kv_cache.cell_size_bytes(DSV3, dtype, tp_size=8) == expected


def test_unknown_kv_dtype_is_rejected():
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        kv_cache.cell_size_bytes(LLAMA, "int3", 1)


# --- token budget -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fraction", "rest", "tokens_bf16"),
    [
        # rest = post - pre * (1 - f) with pre = 80, post = 65 GiB
        (0.9, 65 - 80 * 0.1, 57 * GIB // 131072),  # 57 GiB -> 57 * 8192 = 466944
        (0.85, 65 - 80 * 0.15, 53 * 8192),  # 53 GiB -> 434176
        (0.8125, 65 - 80 * 0.1875, 50 * 8192),  # 50 GiB -> 409600
    ],
)
def test_mha_token_budget_at_several_fractions(fraction: float, rest: float, tokens_bf16: int):
    got_rest = kv_cache.rest_gib(80.0, 65.0, fraction)
    assert got_rest == pytest.approx(rest)
    bf16 = kv_cache.max_total_num_tokens(got_rest, kv_cache.cell_size_bytes(LLAMA, "bf16", 1))
    fp8 = kv_cache.max_total_num_tokens(got_rest, kv_cache.cell_size_bytes(LLAMA, "fp8_e4m3", 1))
    assert bf16 == tokens_bf16
    assert fp8 == 2 * tokens_bf16  # half the bytes per element


def test_mla_token_budget_bf16_and_fp8():
    # 57 GiB / 70272 B = 61203283968 // 70272 = 870948 (bf16); / 35136 = 1741896 (fp8)
    assert kv_cache.max_total_num_tokens(57.0, 70272) == 61203283968 // 70272 == 870948
    assert kv_cache.max_total_num_tokens(57.0, 35136) == 61203283968 // 35136 == 1741896


def test_token_budget_rounds_down_to_page_size():
    # 466944 tokens rounded to pages of 64: 466944 // 64 * 64 = 466944; 57.001 GiB adds 8 tokens
    assert kv_cache.max_total_num_tokens(57.001, 131072, page_size=64) == 466944


def test_rest_at_or_below_zero_means_not_enough_memory():
    # pre 80, post 10 (weights took 70), f = 0.85: rest = 10 - 80 * 0.15 = -2 GiB
    rest = kv_cache.rest_gib(80.0, 10.0, 0.85)
    assert rest == pytest.approx(-2.0)
    assert kv_cache.max_total_num_tokens(rest, 131072) == 0
    # SGLang's hint: above 1 - post / pre = 1 - 10 / 80 = 0.875
    assert kv_cache.min_mem_fraction_for_kv(80.0, 10.0) == pytest.approx(0.875)


def test_headroom_is_what_the_fraction_keeps_outside():
    # 94.19 GiB free before weights, f = 0.88: 94.19 * 0.12 = 11.30 GiB outside the pool
    assert kv_cache.headroom_gib(94.19, 0.88) == pytest.approx(11.3028)


# --- SGLang's default mem_fraction_static -------------------------------------------------
def test_prefill_graph_buckets_up_to_8192():
    # 8 (4..32 by 4) + 14 (48..256 by 16) + 8 (288..512 by 32) + 8 (576..1024 by 64)
    # + 12 (1280..4096 by 256) + 8 (4608..8192 by 512) = 58
    assert len(kv_cache.prefill_graph_token_buckets(8192)) == 58


def test_default_fraction_llama_tp1_on_rtx_pro_6000():
    d = kv_cache.sglang_default_mem_fraction(97887, LLAMA, tp_size=1)
    # 96 GB class (90..160 GiB): chunked_prefill 8192, decode graph max_bs 256 (tp < 4).
    # reserve = 512 + 8192 * 1.5 + 1/8 * 1024 + 256 * 2 + 58 * 8 = 13904 MiB (> 10 GiB floor)
    assert (d.chunked_prefill_size, d.decode_cuda_graph_max_bs) == (8192, 256)
    assert d.reserved_mib == 512 + 12288 + 128 + 512 + 464 == 13904
    # round((97887 - 13904) / 97887, 3) = round(0.85796, 3)
    assert d.mem_fraction_static == 0.858


def test_default_fraction_deepseek_tp8_mla():
    d = kv_cache.sglang_default_mem_fraction(97887, DSV3, tp_size=8)
    # reserve = 512 + 12288 + 8/8 * 1024 + 512 * 2 (max_bs 512 at tp >= 4) + 1536 (MLA) = 16384
    assert d.reserved_mib == 16384
    # round((97887 - 16384) / 97887, 3) = round(0.83262, 3)
    assert d.mem_fraction_static == 0.833


def test_default_fraction_shrinks_for_kimi_vision_tower():
    d = kv_cache.sglang_default_mem_fraction(97887, KIMI, tp_size=8)
    # ViT complexity = 27 * 1152^2 / (24 * 1024^2) = 1.423828125;
    # factor = 0.95 * (1 - 0.1 * 0.423828125) = 0.95 * 0.9576171875
    assert d.mem_fraction_static == pytest.approx(0.833 * 0.95 * 0.9576171875)


def test_default_fraction_on_a_small_gpu_has_no_10gib_floor():
    d = kv_cache.sglang_default_mem_fraction(15360, LLAMA, tp_size=1)
    # < 20 GiB: chunk 2048, max_bs 8; buckets up to 2048 = 8 + 14 + 8 + 8 + 4 = 42
    # reserve = 512 + 2048 * 1.5 + 128 + 8 * 2 + 42 * 8 = 4064 MiB; round(11296 / 15360, 3)
    assert d.reserved_mib == 4064
    assert d.mem_fraction_static == 0.735


def test_default_fraction_follows_explicit_chunk_and_running_cap():
    d = kv_cache.sglang_default_mem_fraction(
        97887, DSV3, tp_size=8, chunked_prefill_size=16384, max_running_requests=128
    )
    # 512 + 16384 * 1.5 + 1024 + 128 * 2 + 1536 = 27904 MiB
    assert d.reserved_mib == 27904
    assert d.mem_fraction_static == round((97887 - 27904) / 97887, 3)


# --- HiCache host pool ------------------------------------------------------------------
def test_hicache_size_is_decimal_gb_per_rank():
    # 48 GB = 48e9 / 2^30 = 44.70 GiB per rank
    assert kv_cache.hicache_host_gib_per_rank(48, None, 10.0, 400.0, 8) == pytest.approx(
        44.7035, 1e-4
    )


def test_hicache_ratio_scales_the_device_pool():
    assert kv_cache.hicache_host_gib_per_rank(None, 3.0, 10.0, 400.0, 8) == pytest.approx(30.0)


def test_hicache_default_ratio_shrinks_to_fit_the_host():
    # ratio 2 x 10 GiB = 20 GiB fits 0.8 * (400 - 10) / 8 = 39 GiB per rank
    assert kv_cache.hicache_host_gib_per_rank(None, None, 10.0, 400.0, 8) == pytest.approx(20.0)
    # a 50 GiB host: 0.8 * (50 - 10) / 8 = 4 GiB per rank
    assert kv_cache.hicache_host_gib_per_rank(None, None, 10.0, 50.0, 8) == pytest.approx(4.0)


def test_default_max_running_requests():
    # 150000 tokens / 262144 context * 512 = 292 -> clamped to 2048; tokens // 2 = 75000
    assert kv_cache.sglang_default_max_running_requests(150000, 262144) == 2048
    # a tiny pool: tokens // 2 caps it
    assert kv_cache.sglang_default_max_running_requests(3000, 4096) == 1500
