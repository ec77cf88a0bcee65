"""Speculative decoding in the capacity plan (docs/SPECULATIVE.md), worked out by hand.

The numbers each test expects are computed here from SGLang 0.5.23's placement (paths inside the
wheel), not by calling the planner's helpers:
- the draft's weights are loaded before SGLang measures what is left for KV
  (`mem_cache/kv_cache_configurator.py` `_profile_available_bytes`: "Loaded weights (target +
  draft) can exceed the static budget");
- for EAGLE, EAGLE3 and STANDALONE the target's bytes per KV token grow by
  int(target cell x draft layers / target layers) (`model_executor/pool_configurator.py`
  `DefaultPoolConfigurator`), and the draft worker allocates its own pool of the target's token
  count with its own cell (`managers/scheduler.py` `init_memory_pools`);
- `--max-running-requests` not given: 48 (`arg_groups/speculative_hook.py`).

The story's job (docs/THE-JOB.md): Kimi-K2.5 int4 at tp 8 on 97887 MiB GPUs, fp8 KV,
mem_fraction_static 0.88, requests of 2000 + 2000 tokens, 150 concurrent. Its EAGLE-3 draft
(tests/fixtures/models/kimi-k2.5-eagle3) has the shape of a public one: one MLA decoder layer
with the target's hidden size (Eagle3DeepseekV2ForCausalLM).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kimi_job import GPU

from sglang_fleet.capacity import calibration_record
from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.capacity.planner import plan
from sglang_fleet.capacity.planner_inputs import PlanInputError
from sglang_fleet.capacity.server_log import parse_decode_line, parse_log
from sglang_fleet.servers import host_checks

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "fixtures" / "models"
KIMI_LOG = ROOT / "tests" / "fixtures" / "logs" / "constructed-kimi-k2.5-tp8-mf085-bf16.log"
KIMI_CONFIG, KIMI_WEIGHTS = read_model_dir(MODELS / "kimi-k2.5-int4")
DRAFT_CONFIG, DRAFT_WEIGHTS = read_model_dir(MODELS / "kimi-k2.5-eagle3")
LLAMA_DRAFT_CONFIG, LLAMA_DRAFT_WEIGHTS = read_model_dir(MODELS / "kimi-k2.5-eagle3-llama")
LLAMA_CONFIG, LLAMA_WEIGHTS = read_model_dir(MODELS / "llama-3.1-8b")
GIB = 2**30
HOST = {"gpu_memory_mib": 97887, "host_ram_gib": 400, "gpu_count": 8, "gpu_name": GPU}
STORY = {
    "tp_size": 8,
    "mem_fraction_static": 0.88,
    "kv_cache_dtype": "fp8_e4m3",
    "avg_input_len": 2000,
    "avg_output_len": 2000,
    "plan_layouts": False,
}
EAGLE3 = {
    "speculative_algorithm": "EAGLE3",
    "speculative_draft_model_path": "/shared/kimi-k2.5-eagle3",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
    "speculative_draft_config": DRAFT_CONFIG,
    "speculative_draft_weight_bytes": DRAFT_WEIGHTS,
}
# Kimi-K2.5's text config and its draft's.
H, VOCAB, Q_LORA, KV_LORA, ROPE, HEADS, NOPE, V_HEAD = 7168, 163840, 1536, 512, 64, 64, 128, 128
LAYERS = 61


def kimi(**args: Any) -> dict[str, Any]:
    return plan(KIMI_CONFIG, KIMI_WEIGHTS, STORY | args, HOST)


def codes(items: list[dict[str, str]]) -> list[str]:
    return [item["code"] for item in items]


def message(items: list[dict[str, str]], code: str) -> str:
    return next(item["message"] for item in items if item["code"] == code)


# --- the draft's memory ----------------------------------------------------------------------
def test_the_draft_fixture_holds_the_tensors_of_its_shape():
    """The fixture's index total is the bf16 bytes of the tensors its config.json describes
    (models/kimi_k25_eagle3.py: embedding, lm_head, fc over three captured layers, one MLA
    decoder layer whose fused_qkv_a takes [embedding, hidden], a dense MLP, RMSNorms)."""
    params = (
        2 * VOCAB * H  # embed_tokens, lm_head (draft_vocab_size = vocab_size)
        + 3 * H * H  # fc: three of the target's hidden states -> hidden
        + 2 * H * Q_LORA  # q_a_proj over 2 x hidden
        + 2 * H * (KV_LORA + ROPE)  # kv_a_proj_with_mqa over 2 x hidden
        + Q_LORA * HEADS * (NOPE + ROPE)  # q_b_proj
        + KV_LORA * HEADS * (NOPE + V_HEAD)  # kv_b_proj
        + HEADS * V_HEAD * H  # o_proj
        + 3 * H * 18432  # gate, up, down
        + 4 * H
        + Q_LORA
        + KV_LORA  # four norms over hidden, q_a and kv_a layernorms
    )
    assert DRAFT_WEIGHTS == 2 * params == 6_031_208_448


# The target's weights per GPU at tp 8 as SGLang places them (tests/test_plan.py works it out):
# fused_qkv_a_proj_with_mqa and the MoE router whole, w_kc/w_vc (a copy of kv_b_proj) and the
# rest of the checkpoint over the 8 GPUs. 71.18 GiB; the checkpoint / 8 would be 69.28.
TARGET_WHOLE = H * (Q_LORA + KV_LORA + ROPE) * LAYERS * 2 + 60 * (384 * H * 2 + 384 * 4)
TARGET_PER_GPU = (
    TARGET_WHOLE
    + (KIMI_WEIGHTS - TARGET_WHOLE) / 8
    + KV_LORA * HEADS * (NOPE + V_HEAD) * LAYERS * 2 / 8
)


def _story_pool(fraction: float, draft_gib: float, budget_cell: int) -> int:
    """The planner's uncalibrated estimate of free memory (GPU total less the CUDA context before
    weights; the target's weights as SGLang places them after), with SGLang's placement of the
    draft."""
    pre = 97887 / 1024 - 0.75
    post = pre - TARGET_PER_GPU / GIB - draft_gib
    rest = post - pre * (1 - fraction) - 100 / 1024  # SGLang's VLM cache reserve (Kimi is VLM)
    return int(rest * GIB) // budget_cell


def test_an_eagle3_draft_of_the_story_model_comes_out_of_the_static_pool():
    result = kimi(max_running_requests=150, **EAGLE3)
    section = result["speculative"]
    target_cell = (KV_LORA + ROPE) * LAYERS * 1  # MLA, fp8: the latent on every rank
    budget = int(target_cell * 1 / LAYERS)  # one draft layer of the target's per-layer size
    assert (target_cell, budget) == (35136, 576)
    # The MLA draft's replicated fused_qkv_a (2 x hidden inputs) stays whole on every GPU; the
    # rest is split over the 8 GPUs of its TP group.
    replicated = 2 * H * (Q_LORA + KV_LORA + ROPE) * 2
    per_gpu = replicated + (DRAFT_WEIGHTS - replicated) / 8
    assert section["draft"]["weights_per_gpu_gib"] == round(per_gpu / GIB, 3) == 0.751
    assert section["draft"]["budget_cell_bytes"] == budget
    assert section["draft"]["cell_bytes"] == (KV_LORA + ROPE) * 1 * 1  # its own 1-layer pool
    assert section["kv_budget_cell_bytes"] == target_cell + budget
    tokens = _story_pool(0.88, per_gpu / GIB, target_cell + budget)
    without = _story_pool(0.88, 0.0, target_cell)
    assert result["max_total_num_tokens"] == tokens == 343_821
    assert kimi(max_running_requests=150)["max_total_num_tokens"] == without == 372_422
    # The same pool holds 8 % fewer tokens: 85 requests of 4000 tokens instead of 93.
    assert result["max_concurrent_requests"] == tokens // 4000 == 85
    assert kimi(max_running_requests=150)["max_concurrent_requests"] == without // 4000 == 93
    assert section["draft_kv_beyond_budget_gib"] == 0.0  # an MLA draft: its share is exact
    assert result["cell_size_bytes"] == target_cell  # what the target's own KV costs


def test_a_draft_larger_than_its_budgeted_share_takes_from_the_headroom():
    """An MHA EAGLE-3 draft (LlamaForCausalLMEagle3, 64 KV heads of 128) of the same target:
    0.5.23 budgets one target layer's share (576 B/token) but the draft allocates its own cell,
    64 / 8 heads x (128 + 128) x 1 layer x 1 byte = 2048 B/token per GPU."""
    draft = {
        "speculative_draft_config": LLAMA_DRAFT_CONFIG,
        "speculative_draft_weight_bytes": LLAMA_DRAFT_WEIGHTS,
    }
    result = kimi(max_running_requests=150, **(EAGLE3 | draft))
    section = result["speculative"]
    assert section["draft"]["cell_bytes"] == 64 // 8 * (128 + 128) * 1 * 1 == 2048
    tokens = _story_pool(0.88, LLAMA_DRAFT_WEIGHTS / 8 / GIB, 35136 + 576)
    assert result["max_total_num_tokens"] == tokens
    beyond = (2048 - 576) * tokens / GIB
    assert section["draft_kv_beyond_budget_gib"] == round(beyond, 3)
    pre = 97887 / 1024 - 0.75
    assert result["headroom_gib"] == round(pre * 0.12 - beyond, 2)
    assert "speculative_draft_kv_beyond_budget" in codes(result["warnings"])


# --- the 48 reset ----------------------------------------------------------------------------
def test_the_48_reset_is_found_in_a_flag_set_without_max_running_requests():
    result = kimi(job_concurrency=150, **EAGLE3)
    tokens = result["max_total_num_tokens"]
    fits = tokens // 4000  # what the pool holds without the reset: the value to set
    assert result["max_concurrent_requests"] == 48
    assert result["speculative"]["max_running_requests"] == 48
    said = message(result["warnings"], "speculative_max_running_requests_reset")
    assert "--max-running-requests is not given" in said
    assert "the job's 150 concurrent requests would run 48 at a time" in said
    assert f"Set --max-running-requests {fits} (max_running_requests: {fits})" in said
    assert result["errors"] == []
    # The inventory chooses: refuse makes it an error, and the same words.
    refused = kimi(job_concurrency=150, speculation_reset="refuse", **EAGLE3)
    assert message(refused["errors"], "speculative_max_running_requests_reset") == said
    # Given, nothing is said; without speculation, nothing either.
    given = kimi(max_running_requests=fits, **EAGLE3)
    assert "speculative_max_running_requests_reset" not in codes(given["warnings"])
    assert given["max_concurrent_requests"] == fits
    assert kimi()["speculative"] is None
    assert "speculative_max_running_requests_reset" not in codes(kimi()["warnings"])


def test_the_reset_without_a_job_concurrency_says_what_waits():
    said = message(kimi(**EAGLE3)["warnings"], "speculative_max_running_requests_reset")
    assert "any load above 48 concurrent requests waits in the queue" in said


def test_ngram_has_no_draft_model_and_is_reset_too():
    result = kimi(speculative_algorithm="NGRAM")
    found = result["speculative"]["settings"]
    # _handle_ngram: top-k = --speculative-ngram-max-bfs-breadth (10), 12 draft tokens,
    # steps 12 // 10 = 1.
    assert (found["eagle_topk"], found["num_draft_tokens"], found["num_steps"]) == (10, 12, 1)
    assert result["speculative"]["draft"] is None
    assert result["max_total_num_tokens"] == kimi()["max_total_num_tokens"]
    assert result["max_concurrent_requests"] == 48


# --- what SGLang refuses, fails on or changes --------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "flag", "words"),
    [
        (
            {"speculative_eagle_topk": None, "speculative_num_draft_tokens": None},
            "speculative_eagle_topk",
            "set all three or none",
        ),
        (
            {
                "speculative_num_steps": 3,
                "speculative_eagle_topk": 1,
                "speculative_num_draft_tokens": 6,
            },
            "speculative_num_draft_tokens",
            "replaces it by steps + 1 = 4",
        ),
        (
            # topk 2, steps 2: 2 + 1 x 4 = 6 candidates, so at most 7 draft tokens
            {
                "speculative_num_steps": 2,
                "speculative_eagle_topk": 2,
                "speculative_num_draft_tokens": 8,
            },
            "speculative_num_draft_tokens",
            "at most 7",
        ),
        ({"speculative_algorithm": "MEDUSA"}, "speculative_algorithm", "is not one of"),
        ({"speculative_algorithm": "DFLASH"}, "speculative_algorithm", "models the memory"),
        (
            {"speculative_algorithm": "STANDALONE", "attn_dp_size": 8},
            "speculative_algorithm",
            "does not support dp attention",
        ),
        (
            {"speculative_algorithm": "NGRAM", "dp_size": 4, "enable_dp_attention": True},
            "speculative_algorithm",
            "ngram speculative decoding does not support dp attention",
        ),
        (
            {"speculative_draft_model_path": None},
            "speculative_draft_model_path",
            "needs a draft model",
        ),
    ],
)
def test_flags_sglang_refuses_or_changes_are_refused_naming_the_flag(flags, flag, words):
    with pytest.raises(PlanInputError) as caught:
        kimi(**(EAGLE3 | flags))
    assert caught.value.argument == flag
    assert words in caught.value.message
    # The descriptions' check says the same before any model is read (except what needs the
    # target's architecture: an EAGLE start that may run an MTP target's own layers).
    server = {"name": "kimi", "flags": STORY | EAGLE3 | flags}
    found = [p for p in host_checks.server_errors(server, {}) if p["code"] == "speculative_flags"]
    assert [p["variable"] for p in found] == [f"sglang_server_instances[kimi].flags.{flag}"]
    assert words in found[0]["message"]


def test_eagle3_settings_left_out_are_sglangs_choice_and_eagle_runs_an_mtp_targets_layers():
    unset = {
        "speculative_num_steps": None,
        "speculative_eagle_topk": None,
        "speculative_num_draft_tokens": None,
    }
    found = kimi(max_running_requests=100, **(EAGLE3 | unset))
    settings = found["speculative"]["settings"]
    # _auto_choose_speculative_params: (3, 1, 4) for an architecture not in its lists.
    assert (settings["num_steps"], settings["eagle_topk"], settings["num_draft_tokens"]) == (
        3,
        1,
        4,
    )
    assert settings["source"] == "SGLang's choice for KimiK25ForConditionalGeneration"
    # DeepSeek-V3 with EAGLE and no draft path: its own NextN layer, already in its checkpoint.
    config, weights = read_model_dir(MODELS / "deepseek-v3")
    result = plan(config, weights, {"tp_size": 8, "speculative_algorithm": "NEXTN",
                                    "max_running_requests": 64}, HOST)  # fmt: skip
    draft = result["speculative"]["draft"]
    assert draft["weight_bytes"] == 0 and draft["budget_layers"] == 1
    assert draft["budget_cell_bytes"] == (512 + 64) * 61 * 2 // 61


@pytest.mark.parametrize(
    ("algorithm", "draft", "words"),
    [
        ("EAGLE3", (LLAMA_CONFIG, LLAMA_WEIGHTS), "EAGLE3 needs an EAGLE-3 draft"),
        ("EAGLE", (DRAFT_CONFIG, DRAFT_WEIGHTS), "run it with speculative_algorithm EAGLE3"),
        (
            "EAGLE3",
            (LLAMA_DRAFT_CONFIG | {"hidden_size": 4096}, LLAMA_DRAFT_WEIGHTS),
            "hidden states of size 4096",
        ),
        ("STANDALONE", (LLAMA_CONFIG, LLAMA_WEIGHTS), "the draft's vocab_size is 128256"),
    ],
)
def test_a_draft_sglang_cannot_run_with_the_target_is_refused(algorithm, draft, words):
    with pytest.raises(PlanInputError) as caught:
        kimi(
            max_running_requests=100,
            **(
                EAGLE3
                | {
                    "speculative_algorithm": algorithm,
                    "speculative_draft_config": draft[0],
                    "speculative_draft_weight_bytes": draft[1],
                }
            ),
        )
    assert caught.value.argument == "speculative_draft_model_path"
    assert words in caught.value.message


def test_the_command_line_reads_the_draft_and_names_a_missing_one(tmp_path: Path):
    base = [sys.executable, "-m", "sglang_fleet.capacity.planner", "--model-path",
            str(MODELS / "kimi-k2.5-int4"), "--tp-size", "8", "--gpu-memory-mib", "97887",
            "--mem-fraction-static", "0.88", "--kv-cache-dtype", "fp8_e4m3",
            "--speculative-algorithm", "EAGLE3", "--max-running-requests", "100"]  # fmt: skip
    done = subprocess.run(
        [*base, "--speculative-draft-model-path", str(tmp_path / "absent")],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2
    assert "argument --speculative-draft-model-path:" in done.stderr
    done = subprocess.run(
        [*base, "--speculative-draft-model-path", str(MODELS / "kimi-k2.5-eagle3"), "--json"],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["speculative"]["draft"]["budget_cell_bytes"] == 576


# --- the speed-up ------------------------------------------------------------------------------
def _llama_eagle3_draft(hidden: int = 4096) -> dict[str, Any]:
    """The shape of SpecForge's Llama-3.1-8B EAGLE-3 draft config (one Llama layer)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": hidden,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 1,
        "vocab_size": 128256,
        "draft_vocab_size": 32000,
        "max_position_embeddings": 2048,
    }


def test_the_speed_up_of_a_dense_model_worked_by_hand():
    """Llama-3.1-8B at tp 1, an EAGLE-3 draft of 1e9 bytes, 1000 GB/s, 100 TFLOPS, requests
    holding 1000 tokens, accept length 2.5, 3 steps of top-k 1, 4 draft tokens. A step costs the
    bytes it reads over the bandwidth plus its tokens' FLOPs over the peak; a speculative cycle
    is 3 draft steps and one verify of 4 tokens per request, and yields 2.5 tokens each."""
    args = {
        "tp_size": 1,
        "mem_fraction_static": 0.85,
        "max_running_requests": 64,
        "avg_input_len": 1000,
        "avg_output_len": 0,
        "plan_layouts": False,
        "gpu_memory_bandwidth_gbs": 1000,
        "gpu_bf16_tflops": 100,
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": "/d",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
        "speculative_draft_config": _llama_eagle3_draft(),
        "speculative_draft_weight_bytes": 10**9,
        "speculative_accept_length": 2.5,
    }
    result = plan(LLAMA_CONFIG, LLAMA_WEIGHTS, args, {"gpu_memory_mib": 81559})
    hidden, heads, kv_heads, dim, layers, inter, vocab = 4096, 32, 8, 128, 32, 14336, 128256
    cell = kv_heads * (dim + dim) * layers * 2  # bf16 KV of the target
    draft_cell = kv_heads * (dim + dim) * 1 * 2  # the draft's one layer
    params = (
        layers
        * (
            hidden * heads * dim
            + hidden * kv_heads * 2 * dim
            + heads * dim * hidden
            + 3 * hidden * inter
        )
        + vocab * hidden
    )
    flops = 2 * params + 2 * 1000 * (dim + dim) * heads * layers  # + attention over 1000
    draft_flops = 10**9  # 2 FLOPs per bf16 parameter of 2 bytes

    def gain(b: int) -> float:
        plain = (LLAMA_WEIGHTS + b * 1000 * cell) / 1e12 + b * flops / 1e14
        draft = (10**9 + b * 1000 * draft_cell) / 1e12 + b * draft_flops / 1e14
        verify = (LLAMA_WEIGHTS + b * 1000 * cell) / 1e12 + 4 * b * flops / 1e14
        return 2.5 * plain / (3 * draft + verify)

    points = {p["batch"]: p["speedup"] for p in result["speculative"]["speedup"]["points"]}
    for batch in (1, 16, 150, 512):
        assert points[batch] == pytest.approx(gain(batch), abs=0.001)
    assert points[1] > 1 > points[512]  # memory-bound pays, compute-bound does not
    ranges = result["speculative"]["speedup"]["pays_at_batches"]
    [[first, last]] = ranges
    assert first == 1 and gain(last) >= 1 > gain(last + 1)
    assert result["speculative"]["speedup"]["stops_paying_at_batch"] == last + 1


def test_the_story_moe_pays_at_its_load_and_says_where_it_does_not():
    """Kimi-K2.5's verify of 4 tokens per request reads more experts than a decode step while few
    are touched: at a handful of requests speculation costs, from a few dozen on it pays."""
    result = kimi(max_running_requests=150, job_concurrency=150, speculative_accept_length=2.5,
                  **EAGLE3)  # fmt: skip
    section = result["speculative"]
    points = {p["batch"]: p["speedup"] for p in section["speedup"]["points"]}
    assert points[8] < 1 < points[150]
    assert section["speedup_at_job_concurrency"] == points[150]
    ranges = section["speedup"]["pays_at_batches"]
    assert any(low <= 150 <= high for low, high in ranges)
    assert not any(low <= 8 <= high for low, high in ranges)
    # The KV-bound throughput of the plan carries the speed-up at its concurrency.
    concurrent = result["max_concurrent_requests"]
    assert result["kv_bound_output_tok_s"] == pytest.approx(
        concurrent * 12.0 * section["speedup_at_planned_concurrency"], abs=0.2
    )


def test_the_accept_length_comes_from_the_logs_decode_lines():
    line = (
        "[2026-12-01 10:00:00 TP0] Decode batch, #running-req: 16, #token: 50000, token usage: "
        "0.12, accept len: 2.75, accept rate: 0.58, cuda graph: True, gen throughput (token/s): "
        "500.00, #queue-req: 0"
    )
    sample = parse_decode_line(line)
    assert (sample.num_running_reqs, sample.accept_length, sample.accept_rate) == (16, 2.75, 0.58)
    assert sample.gen_throughput == 500.0 and sample.num_queue_reqs == 0
    assert parse_log(line + "\n").accept_length() == 2.75
    result = kimi(max_running_requests=100, calibration_log=line + "\n", **EAGLE3)
    assert result["speculative"]["accept_length"] == 2.75
    assert result["speculative"]["accept_length_source"] == "calibration log (accept len)"
    without = kimi(max_running_requests=100, **EAGLE3)["speculative"]
    assert without["speedup"] is None and "no accept length" in without["speedup_reason"]


# --- calibration across speculation -----------------------------------------------------------
def test_a_calibration_without_speculation_does_not_plan_a_draft():
    result = kimi(max_running_requests=100, calibration_log=KIMI_LOG.read_text(), **EAGLE3)
    assert result["details"]["calibrated"] is False
    said = message(result["warnings"], "calibration_mismatch")
    assert "does not record whether it ran speculative decoding" in said


def test_a_calibration_of_the_same_speculation_predicts_with_the_drafts_cell():
    """A record of the Kimi log at 0.85 bf16 as if it ran this EAGLE-3 draft: its 149800
    tokens were sized with the draft's share in the cell, so fp8 holds
    149800 x (70272 + 1152) / (35136 + 576) = 299600 tokens at the same fraction."""
    flags = {"tp_size": 8, "mem_fraction_static": 0.85, "kv_cache_dtype": "auto"} | {
        k: v for k, v in EAGLE3.items() if k.startswith("speculative_") and "config" not in k
        and "weight" not in k
    }  # fmt: skip
    record = calibration_record.build_record(
        parse_log(KIMI_LOG.read_text()), None, {"flags": flags}
    )
    args = {"calibration": [record], "server_flags": flags | {"kv_cache_dtype": "fp8_e4m3",
            "max_running_requests": 100}}  # fmt: skip
    result = kimi(mem_fraction_static=0.85, max_running_requests=100, **(EAGLE3 | args))
    assert result["details"]["calibrated"] is True
    assert result["max_total_num_tokens"] == 149800 * (70272 + 1152) // (35136 + 576) == 299600
