"""Attention data parallelism in the planner, the calibration across layouts, the regression of
a log without `server_args=`, and the decode roofline (docs/ATTENTION-DP.md).

Kimi-K2.5 int4 (tests/fixtures/models/kimi-k2.5-int4): hidden 7168, 64 heads, q_lora_rank
1536, kv_lora_rank 512, qk_rope 64, qk_nope 128, v_head 128, 61 layers, vocab 163840,
attention kept in bf16 (its quantization_config ignores self_attn). The figures below are
worked out here from those numbers, not read back from the code under test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from kimi_job import GPU, KIMI_LOG, KIMI_RUN_FLAGS

from sglang_fleet.capacity import attention_dp, calibration_record
from sglang_fleet.capacity.model_config import model_shape, read_model_dir
from sglang_fleet.capacity.planner import main, plan
from sglang_fleet.capacity.planner_inputs import PlanInputError
from sglang_fleet.diagnosis.run_diagnosis import diagnose
from sglang_fleet.tuning import autotune_inputs, autotune_state

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
KIMI_DIR = FIXTURES / "models" / "kimi-k2.5-int4"
EXCERPT_088 = FIXTURES / "logs" / "constructed-kimi-k2.5-tp8-mf088-bf16-excerpt.log"
CONFIG, WEIGHTS = read_model_dir(KIMI_DIR)
SHAPE = model_shape(CONFIG)
HOST = {"gpu_memory_mib": 97887, "host_ram_gib": 400, "gpu_count": 8, "gpu_name": GPU}
GIB = 2**30
LAYERS = 61
# Per layer: fused_qkv_a_proj_with_mqa (replicated), q_b + kv_b + o (split over attn_tp).
QKV_A = 7168 * (1536 + 512 + 64)
SPLIT = 1536 * 64 * (128 + 64) + 512 * 64 * (128 + 128) + 64 * 128 * 7168
EMBED = 163840 * 7168 * 2
ATTN_SPLIT_BYTES = SPLIT * LAYERS * 2
# The MoE router of each of the 60 MoE layers, a plain parameter (replicated): MoEGate.weight
# (384 experts x 7168, bf16) and its fp32 e_score_correction_bias (noaux_tc).
ROUTER = (384 * 7168 * 2 + 384 * 4) * 60
# w_kc + w_vc, which post_load_weights cuts from kv_b_proj and keeps beside it (bf16).
KV_B_COPY = 512 * 64 * (128 + 128) * LAYERS * 2
FP8_CELL = (512 + 64) * 61
BF16_CELL = FP8_CELL * 2
# The 0.85 bf16 log: 149800 tokens of 70272 B, pre 94.19 GiB.
LOGGED_KV_BYTES = 149800 * BF16_CELL
PRE = 94.19


def extra_gib(attn_dp: int, tp: int = 8) -> float:
    return (ATTN_SPLIT_BYTES + EMBED + KV_B_COPY) * (attn_dp / tp - 1 / tp) / GIB


def kimi(**args: Any) -> dict[str, Any]:
    base = {
        "tp_size": 8,
        "mem_fraction_static": 0.90,
        "kv_cache_dtype": "fp8_e4m3",
        "avg_input_len": 2000,
        "avg_output_len": 2000,
        "calibration_log": KIMI_LOG,
    }
    return plan(CONFIG, WEIGHTS, base | args, HOST)


# --- where the weights go ---------------------------------------------------------------
def test_weight_layout_of_kimi_from_config():
    w = attention_dp.weight_layout(CONFIG, SHAPE, WEIGHTS)
    assert w.replicated == QKV_A * LAYERS * 2 + ROUTER
    assert w.kv_b_copy == KV_B_COPY
    assert w.attn_split == ATTN_SPLIT_BYTES
    assert w.embedding == EMBED
    assert w.lm_head == EMBED  # untied, same shape
    assert w.attention_elem_bytes == 2
    assert w.n_routed_experts == 384 and w.experts_per_tok == 8 and w.moe_layers == 60
    # Everything config.json does not describe is the routed experts (int4 here).
    assert w.replicated + w.attn_split + w.embedding + w.lm_head + w.dense_mlp + (
        w.routed_experts
    ) == pytest.approx(WEIGHTS)


def test_fp8_checkpoint_counts_one_byte_per_attention_weight():
    config, weights = read_model_dir(FIXTURES / "models" / "deepseek-v3")
    w = attention_dp.weight_layout(config, model_shape(config), weights)
    assert w.attention_elem_bytes == 1
    assert w.embedding == 129280 * 7168


@pytest.mark.parametrize("attn_dp", [1, 2, 4, 8])
def test_extra_weights_per_gpu(attn_dp: int):
    w = attention_dp.weight_layout(CONFIG, SHAPE, WEIGHTS)
    assert attention_dp.extra_weight_gib(w, 8, attn_dp) == pytest.approx(extra_gib(attn_dp))


# --- the planner ------------------------------------------------------------------------
def test_attention_dp_8_plans_eight_pools_from_a_tp_calibration():
    result = kimi(attn_dp_size=8, cuda_graph_max_bs_decode=32)
    # Measured KV bytes at 0.85 + the fraction's growth - the replicated attention weights.
    kv_bytes = LOGGED_KV_BYTES + (0.90 - 0.85) * PRE * GIB - extra_gib(8) * GIB
    per_rank = int(kv_bytes) // FP8_CELL
    assert result["max_total_num_tokens"] == pytest.approx(per_rank, abs=1)
    assert result["kv_tokens_per_rank"] == result["max_total_num_tokens"]
    assert result["total_kv_tokens"] == 8 * result["max_total_num_tokens"]
    assert result["max_concurrent_requests"] == 8 * (result["max_total_num_tokens"] // 4000)
    layout = result["layout"]
    assert (layout["attn_dp_size"], layout["attn_tp_size"], layout["kv_pools"]) == (8, 1, 8)
    # Measured weights (24.03 GiB after loading out of 94.19) plus the computed difference.
    assert layout["weights_per_gpu_gib"] == pytest.approx(94.19 - 24.03 + extra_gib(8), abs=0.01)
    assert result["details"]["calibrated"] is True
    assert any("attention DP 1 -> 8" in n for n in result["details"]["calibration_notes"])
    assert layout["oom_margin_gib_per_rank"] == pytest.approx(
        layout["free_after_graph_gib_per_rank"] - 5.0, abs=0.01
    )


def test_uncalibrated_estimate_subtracts_the_extra_weights():
    one = kimi(calibration_log=None, mem_fraction_static=0.85)
    eight = kimi(calibration_log=None, mem_fraction_static=0.85, attn_dp_size=8)
    assert one["details"]["post_gib"] - eight["details"]["post_gib"] == pytest.approx(
        extra_gib(8), abs=0.01
    )


def test_a_record_at_one_attention_dp_size_plans_another():
    """Measured weights at attention DP 2 + the difference to 8, not the difference to TP."""
    record = calibration_record.build_record(KIMI_LOG, None, {})
    record["key"]["attn_dp_size"] = 2
    result = kimi(calibration_log=None, calibration=[record], attn_dp_size=8)
    kv_bytes = LOGGED_KV_BYTES + (0.90 - 0.85) * PRE * GIB - (extra_gib(8) - extra_gib(2)) * GIB
    assert result["max_total_num_tokens"] == pytest.approx(int(kv_bytes) // FP8_CELL, abs=1)


def test_deprecated_spelling_plans_the_same_and_warns_with_sglangs_text():
    new = kimi(attn_dp_size=4, cuda_graph_max_bs_decode=80)
    old = kimi(dp_size=4, enable_dp_attention=True, cuda_graph_max_bs_decode=80)
    assert old["total_kv_tokens"] == new["total_kv_tokens"]
    assert old["layout"]["dp_size"] == 1 and old["layout"]["attn_dp_size"] == 4
    warning = next(w for w in old["warnings"] if w["code"] == "deprecated_enable_dp_attention")
    assert attention_dp.DEPRECATED_DP_ATTENTION_WARNING in warning["message"]
    assert "'--enable-dp-attention' is deprecated" in warning["message"]
    assert "--attn-dp-size 4" in warning["message"]
    assert not any(w["code"] == "deprecated_enable_dp_attention" for w in new["warnings"])


def test_cli_understands_both_spellings(capsys: pytest.CaptureFixture[str]):
    common = [
        "--model-path",
        str(KIMI_DIR),
        "--tp-size",
        "8",
        "--mem-fraction-static",
        "0.88",
        "--gpu-memory-mib",
        "97887",
        "--cuda-graph-max-bs-decode",
        "64",
        "--json",
    ]
    main([*common, "--attn-dp-size", "4"])
    new = json.loads(capsys.readouterr().out)
    main([*common, "--dp-size", "4", "--enable-dp-attention"])
    old = json.loads(capsys.readouterr().out)
    assert new["layout"]["attn_dp_size"] == old["layout"]["attn_dp_size"] == 4
    assert new["total_kv_tokens"] == old["total_kv_tokens"]


@pytest.mark.parametrize(
    ("args", "argument", "words"),
    [
        ({"attn_dp_size": 3}, "attn_dp_size", "tp_size must be divisible by attn_dp_size"),
        ({"attn_dp_size": 2, "dp_size": 2}, "dp_size", "are not supported"),
        ({"attn_dp_size": 0}, "attn_dp_size", "integer from 1"),
    ],
)
def test_layouts_sglang_refuses_are_bad_input(args: dict, argument: str, words: str):
    with pytest.raises(PlanInputError) as info:
        kimi(**args)
    assert info.value.argument == argument
    assert words in info.value.message


def test_default_graph_batch_under_attention_dp_is_flagged():
    result = kimi(attn_dp_size=4)
    assert any(w["code"] == "attn_dp_graph_batch" for w in result["warnings"])
    # SGLang's estimate for 512 x 4 x 4.5 MiB more graphs: 9 GiB less free than TP plans.
    tp = kimi()
    drop = tp["details"]["free_after_graph_gib"] - result["details"]["free_after_graph_gib"]
    assert drop == pytest.approx(512 * 4 * 4.5 / 1024, abs=0.01)


def test_layout_table_covers_every_divisor_and_recommends_the_highest():
    result = kimi()
    rows = result["attention_dp_layouts"]
    assert [r["attn_dp_size"] for r in rows] == [1, 2, 4, 8]
    for row in rows:
        alone = kimi(
            attn_dp_size=row["attn_dp_size"],
            cuda_graph_max_bs_decode=row["cuda_graph_max_bs_decode"],
        )
        assert row["total_kv_tokens"] == alone["total_kv_tokens"]
        if row["attn_dp_size"] > 1:  # covers the rank's planned batch
            per_rank = math.ceil(row["max_concurrent_requests"] / row["attn_dp_size"])
            assert per_rank <= row["cuda_graph_max_bs_decode"] < per_rank + 8
    bound = {
        r["attn_dp_size"]: min(r["kv_bound_output_tok_s"], r["decode_roofline_tok_s"]) for r in rows
    }
    pick = result["recommended_layout"]
    assert bound[pick["attn_dp_size"]] >= max(bound.values()) * 0.98
    assert pick["attn_dp_size"] > 1  # more pools beat one for this MLA model
    assert pick["gain_over_current"] > 1.5


def test_no_layout_table_for_one_gpu_or_replicas():
    assert "attention_dp_layouts" not in kimi(tp_size=8, dp_size=1, plan_layouts=False)
    one = plan(CONFIG, WEIGHTS, {"tp_size": 1}, {"gpu_memory_mib": 2_000_000})
    assert "attention_dp_layouts" not in one


# --- regression: a log excerpt without server_args= -------------------------------------
def test_excerpt_of_the_088_start_plans_what_sglang_reported():
    """The job's 0.88 start (an excerpt without server_args=): its own lines say it ran at
    tp 8, 0.88, bf16 KV (sglang_fleet.capacity.logged_flags), so the plan is calibrated and
    exact."""
    text = EXCERPT_088.read_text()
    assert "server_args=" not in text
    reported = int(text.split("max_total_num_tokens=")[1].split(",")[0])
    assert reported == 192976
    result = plan(
        CONFIG,
        WEIGHTS,
        {"tp_size": 8, "mem_fraction_static": 0.88, "calibration_log": text},
        HOST,
    )
    codes = {w["code"] for w in result["warnings"]}
    assert "calibration_mismatch" not in codes
    assert "calibration_flags_assumed" not in codes
    assert result["details"]["calibrated"] is True
    assert result["max_total_num_tokens"] == reported
    assert result["details"]["free_after_graph_gib"] == pytest.approx(8.17, abs=0.005)
    inferred = " | ".join(result["details"]["calibration_log_flags"])
    assert "mem_fraction_static 0.88 (from: KV Cache is allocated" in inferred
    assert "tp_size 8 (from: Load weight end" in inferred


def test_excerpt_record_takes_tp_from_the_logged_flags():
    text = EXCERPT_088.read_text()
    record = calibration_record.build_record(text, None, {"logged_flags": {"tp_size": 8}})
    assert record["key"]["tp_size"] == 8
    assert record["key"]["mem_fraction_static"] == pytest.approx(0.879, abs=0.001)


# --- the decode roofline ----------------------------------------------------------------
def test_roofline_at_the_planned_concurrency_by_hand():
    result = kimi(per_request_tok_s=12.0)
    roof = result["decode_roofline"]
    batch = result["max_concurrent_requests"]
    assert roof["batch"] == batch
    w = attention_dp.weight_layout(CONFIG, SHAPE, WEIGHTS)
    touched = 384 * (1 - (1 - 8 / 384) ** batch)
    weights = (
        QKV_A * LAYERS * 2
        + ROUTER  # every step reads each MoE layer's whole router
        + (ATTN_SPLIT_BYTES + EMBED + w.lm_head + w.dense_mlp) / 8
        + w.routed_experts * touched / 384 / 8
    )
    kv = batch * (2000 + 1000) * FP8_CELL  # every GPU reads every request's latent KV
    step = (weights + kv) / 1792e9
    assert roof["tok_s"] == pytest.approx(batch / step, rel=1e-3)
    assert roof["bandwidth_source"] == "table: RTX PRO 6000 Blackwell"


def test_roofline_under_attention_dp_reads_one_ranks_kv():
    at_8 = kimi(attn_dp_size=8, cuda_graph_max_bs_decode=32)["decode_roofline"]
    assert at_8["kv_gib_per_gpu"] == pytest.approx(
        math.ceil(at_8["batch"] / 8) * 3000 * FP8_CELL / GIB, abs=0.001
    )


def test_roofline_bandwidth_override_and_unknown_gpu():
    fast = kimi(gpu_memory_bandwidth_gbs=3584)["decode_roofline"]
    slow = kimi()["decode_roofline"]
    assert fast["tok_s"] == pytest.approx(2 * slow["tok_s"], rel=1e-3)
    assert fast["bandwidth_source"] == "gpu_memory_bandwidth_gbs"
    unknown = plan(
        CONFIG,
        WEIGHTS,
        {"tp_size": 8, "mem_fraction_static": 0.85},
        HOST | {"gpu_name": "Some Future GPU"},
    )["decode_roofline"]
    assert unknown["tok_s"] is None
    assert "gpu_memory_bandwidth_gbs" in unknown["reason"]


@pytest.mark.parametrize(
    ("name", "gbs"),
    [
        ("NVIDIA A100-SXM4-80GB", 2039.0),
        ("NVIDIA A100-PCIE-40GB", 1555.0),
        ("NVIDIA A10", 600.0),
        ("NVIDIA L4", 300.0),
        ("NVIDIA L40S", 864.0),
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA H200", 4800.0),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 1792.0),
    ],
)
def test_bandwidth_table_matches_whole_words(name: str, gbs: float):
    assert attention_dp.gpu_bandwidth_gbs(name)[0] == gbs


def test_experts_touched_grows_to_all():
    assert attention_dp.experts_touched(384, 8, 1) == pytest.approx(8)
    assert attention_dp.experts_touched(384, 8, 1000) == pytest.approx(384, rel=1e-6)


# --- diagnosis ----------------------------------------------------------------------------
def _kv_bound(args: dict[str, Any], config: dict | None = None, weights: int = 0) -> dict:
    ctx = {
        "model_config": config or CONFIG,
        "weight_bytes": weights or WEIGHTS,
        "args": {"avg_input_len": 2000, "avg_output_len": 2000} | args,
        "host": HOST,
    }
    return diagnose(log_text=KIMI_LOG, concurrency=150, plan_context=ctx)


def test_kv_bound_mla_server_with_fp8_gets_attention_dp_first():
    result = _kv_bound({"mem_fraction_static": 0.88, "kv_cache_dtype": "fp8_e4m3"})
    assert result["verdict"] == "kv_cache_bound"
    first = result["levers"][0]
    assert first["code"] == "attention_dp"
    # The numbers are the planner's for the recommended layout, calibrated by the log.
    planned = plan(
        CONFIG,
        WEIGHTS,
        {
            "tp_size": 8,
            "mem_fraction_static": 0.88,
            "kv_cache_dtype": "fp8_e4m3",
            "avg_input_len": 2000,
            "avg_output_len": 2000,
            "calibration_log": KIMI_LOG,
        },
        HOST,
    )
    pick = planned["recommended_layout"]
    row = next(
        r for r in planned["attention_dp_layouts"] if r["attn_dp_size"] == pick["attn_dp_size"]
    )
    assert f"--attn-dp-size {row['attn_dp_size']}" in first["message"]
    assert f"{row['total_kv_tokens']} KV tokens in all" in first["message"]
    assert f"about {row['max_concurrent_requests']} concurrent requests" in first["message"]
    for lever in result["levers"]:
        assert "hicache" not in lever["message"].lower()
        assert "hierarchical" not in lever["message"].lower()


def test_kv_bound_mla_server_with_bf16_gets_fp8_then_attention_dp():
    result = _kv_bound({"mem_fraction_static": 0.85})
    codes = [lever["code"] for lever in result["levers"]]
    assert codes[:2] == ["kv_cache_dtype_fp8", "attention_dp"]


def test_no_attention_dp_lever_for_an_mha_model():
    config, weights = read_model_dir(FIXTURES / "models" / "llama-3.1-8b")
    ctx = {
        "model_config": config,
        "weight_bytes": weights,
        "args": {"tp_size": 2},
        "host": HOST,
    }
    result = diagnose(log_text=KIMI_LOG, concurrency=150, plan_context=ctx)
    assert "attention_dp" not in [lever["code"] for lever in result["levers"]]


# --- flags that do nothing --------------------------------------------------------------
def test_the_logs_noop_flag_is_warned_about():
    assert "'num_continuous_decode_steps': 4" in KIMI_LOG
    notes = diagnose(log_text=KIMI_LOG)["notes"]
    noop = [n for n in notes if n.startswith("noop_flag")]
    assert len(noop) == 1
    assert "--num-continuous-decode-steps 4 does nothing in SGLang 0.5.23" in noop[0]


def test_the_inventorys_noop_flag_is_a_plan_warning():
    def noop(flags: dict, version: str | None) -> list[str]:
        result = plan(
            CONFIG,
            WEIGHTS,
            {"tp_size": 8, "server_flags": flags, "sglang_version": version},
            HOST,
        )
        return [w["message"] for w in result["warnings"] if w["code"] == "noop_flag"]

    assert noop({"num_continuous_decode_steps": 4}, "0.5.23") == [
        "--num-continuous-decode-steps 4 does nothing in SGLang 0.5.23: the flag is declared "
        "in srt/arg_groups/fields/schedule.py, read by no module. Drop it from the flag set; "
        "it is not a tuning lever."
    ]
    assert noop({"num_continuous_decode_steps": 1}, "0.5.23") == []  # the default
    assert noop({"num_continuous_decode_steps": 4}, "0.5.10") == []  # not checked there


# --- autotune -----------------------------------------------------------------------------
def _record() -> dict[str, Any]:
    key = {
        "model_config": CONFIG,
        "weight_bytes": WEIGHTS,
        "gpu_name": GPU,
        "gpu_memory_mib": 97887,
        "sglang_version": "0.5.23",
        "flags": KIMI_RUN_FLAGS,
        "recorded_at": "2026-11-29T10:05:00Z",
    }
    return calibration_record.build_record(KIMI_LOG, None, key)


def _search(space: dict, base: dict | None = None, **work: int) -> dict[str, Any]:
    return autotune_state.new_state(
        server="kimi",
        base_flags=base or KIMI_RUN_FLAGS,
        space=space,
        workload={"input_len": 2000, "output_len": 2000, "concurrency": 150} | work,
        context={
            "model_config": CONFIG,
            "weight_bytes": WEIGHTS,
            "host": HOST,
            "sglang_version": "0.5.23",
            "calibration": [_record()],
        },
        kv_cache_dtypes_allowed=["auto", "fp8_e4m3"],
    )


def _by(state: dict, **tuned: Any) -> dict[str, Any]:
    return next(
        c for c in state["candidates"] if all(c["tuned"].get(k) == v for k, v in tuned.items())
    )


def test_noop_flag_is_refused_in_the_space():
    with pytest.raises(autotune_inputs.AutotuneInputError) as info:
        autotune_inputs.validate_space({"num_continuous_decode_steps": [1, 4]})
    assert "num_continuous_decode_steps does nothing in SGLang 0.5.23" in str(info.value)
    assert "num_continuous_decode_steps" not in autotune_inputs.SPACE_FLAGS


def test_per_rank_chunk_becomes_the_flag_sglang_divides():
    state = _search(
        {
            "mem_fraction_static": [0.90],
            "kv_cache_dtype": ["fp8_e4m3"],
            "attn_dp_size": [1, 4],
            "cuda_graph_max_bs_decode": [80],
            "chunked_prefill_size_per_rank": [2048],
        }
    )
    one, four = _by(state, attn_dp_size=1), _by(state, attn_dp_size=4)
    assert one["tuned"]["chunked_prefill_size"] == 2048
    assert four["tuned"]["chunked_prefill_size"] == 8192
    assert "chunked_prefill_size_per_rank" not in four["tuned"]
    adjusts = four["predicted"]["sglang_adjusts"]
    assert adjusts["chunked_prefill_size_per_rank"] == 2048
    assert adjusts["schedule_conservativeness"] == 0.3
    assert one["predicted"]["sglang_adjusts"] == {}
    # Four pools hold more than one: the planner's total, per rank x 4.
    assert four["predicted"]["total_kv_tokens"] > one["predicted"]["total_kv_tokens"]
    with pytest.raises(autotune_inputs.AutotuneInputError, match="not both"):
        autotune_inputs.validate_space(
            {"chunked_prefill_size": [8192], "chunked_prefill_size_per_rank": [1]}
        )


def test_running_cap_is_per_rank_and_deprecated_base_is_replaced():
    base = KIMI_RUN_FLAGS | {"enable_dp_attention": True, "dp_size": 2}
    state = _search(
        {
            "mem_fraction_static": [0.90],
            "kv_cache_dtype": ["fp8_e4m3"],
            "attn_dp_size": [4],
            "max_running_requests": [160],
            "cuda_graph_max_bs_decode": [48],
        },
        base=base,
        concurrency=400,
    )
    cand = state["candidates"][0]
    assert cand["tuned"]["enable_dp_attention"] is False and cand["tuned"]["dp_size"] == 1
    assert cand["predicted"]["sglang_adjusts"]["max_running_requests_per_rank"] == 40
    # SGLang caps each rank at 160 // 4 = 40 requests: 4 x 40 in all.
    assert cand["predicted"]["concurrency"] == 160


def test_pruning_is_per_rank():
    state = _search(
        {
            "mem_fraction_static": [0.90],
            "kv_cache_dtype": ["fp8_e4m3"],
            "attn_dp_size": [1, 3, 8],
            "cuda_graph_max_bs_decode": [8, 64],
        },
        input_len=70000,
        output_len=70000,
        concurrency=16,
    )
    # One pool of ~443k tokens holds a 140k-token request; one rank's ~124k at 8 does not.
    assert _by(state, attn_dp_size=1, cuda_graph_max_bs_decode=64)["status"] == "pending"
    eight = _by(state, attn_dp_size=8, cuda_graph_max_bs_decode=64)
    assert eight["prune"]["code"] == "cannot_fit"
    assert "per attention-DP rank (x 8)" in eight["prune"]["reason"]
    assert _by(state, attn_dp_size=3)["prune"]["code"] == "invalid"


def test_a_graph_batch_below_a_ranks_batch_is_pruned():
    state = _search(
        {"kv_cache_dtype": ["fp8_e4m3"], "attn_dp_size": [4], "cuda_graph_max_bs_decode": [8, 48]},
        concurrency=150,
    )
    assert _by(state, cuda_graph_max_bs_decode=8)["prune"]["code"] == "graph_batch_short"
    assert _by(state, cuda_graph_max_bs_decode=48)["status"] == "pending"
