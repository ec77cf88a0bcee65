"""The capacity planner, with the Kimi job as the main worked example.

The Kimi job: Kimi-K2.5 int4 (MLA) on 8 x RTX PRO 6000 (nvidia-smi: 97887 MiB each), 400 GiB host
RAM. The calibration log (tests/fixtures/logs/constructed-kimi-k2.5-tp8-mf085-bf16.log) is a
start-up of that model at --mem-fraction-static 0.85, bf16 KV, tp 8, in SGLang 0.5.23's log format:
pre = 94.19 GiB (min over ranks), post = 24.03 GiB, 149800 KV tokens, and 11.00 GiB free
after CUDA graph capture (min over ranks). Its numbers are constructed to match the Kimi job's
outcomes (docs/THE-JOB.md), not measured on hardware.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError
from conftest import load_plugin

from sglang_fleet.capacity import logged_flags, planner
from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.capacity.planner import plan
from sglang_fleet.capacity.planner_inputs import MIN_FREE_AFTER_GRAPH_GIB, PlanInputError
from sglang_fleet.capacity.server_log import parse_log

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
KIMI_DIR = FIXTURES / "models" / "kimi-k2.5-int4"
LLAMA_DIR = FIXTURES / "models" / "llama-3.1-8b"
KIMI_LOG = FIXTURES / "logs" / "constructed-kimi-k2.5-tp8-mf085-bf16.log"
GIB = 2**30
KIMI_HOST = {"gpu_memory_mib": 97887, "host_ram_gib": 400, "gpu_count": 8}
REQUIRED_KEYS = {
    "cell_size_bytes",
    "max_total_num_tokens",
    "max_concurrent_requests",
    "kv_bound_output_tok_s",
    "headroom_gib",
    "hicache_host_gib_total",
    "warnings",
    "errors",
    "kv_tokens_per_rank",
    "total_kv_tokens",
    "layout",
    "decode_roofline",
    "speculative",
}

KIMI_CONFIG, KIMI_WEIGHTS = read_model_dir(KIMI_DIR)
LLAMA_CONFIG, LLAMA_WEIGHTS = read_model_dir(LLAMA_DIR)


def kimi(calibrated: bool = False, **args: Any) -> dict[str, Any]:
    full = {"tp_size": 8, **args}
    if calibrated:
        full["calibration_log"] = KIMI_LOG.read_text()
    return plan(KIMI_CONFIG, KIMI_WEIGHTS, full, KIMI_HOST)


def codes(items: list[dict[str, str]]) -> set[str]:
    return {i["code"] for i in items}


def find(items: list[dict[str, str]], code: str) -> dict[str, str]:
    return next(i for i in items if i["code"] == code)


# --- output shape -----------------------------------------------------------------------
def test_output_has_exactly_the_contract_keys_plus_details():
    result = kimi(mem_fraction_static=0.85)
    # tp > 1 without replicas: the table of attention-DP layouts and its pick.
    assert set(result) == REQUIRED_KEYS | {"details", "attention_dp_layouts", "recommended_layout"}
    for issue in result["warnings"] + result["errors"]:
        assert set(issue) == {"code", "message"}


# --- the Kimi job --------------------------------------------------------------------------
def test_kimi_job_hicache_300gb_per_rank_is_an_error():
    result = kimi(mem_fraction_static=0.85, enable_hierarchical_cache=True, hicache_size=300)
    # 300 GB x 8 ranks = 2400e9 B = 2235.17 GiB; + 10 GiB reserve > 400 GiB of RAM
    assert result["hicache_host_gib_total"] == pytest.approx(300e9 * 8 / GIB, abs=0.01)
    error = find(result["errors"], "hicache_host_ram")
    assert "per rank" in error["message"]
    # What fits: (400 - 10) GiB / 8 ranks = 48.75 GiB = 52.3 GB per rank
    assert "At most 52 GB per rank" in error["message"]


def test_kimi_job_hicache_48gb_per_rank_fits_but_adds_no_decode_slots():
    result = kimi(mem_fraction_static=0.85, enable_hierarchical_cache=True, hicache_size=48)
    # 48 GB x 8 = 384e9 B = 357.63 GiB; + 10 GiB = 367.63 GiB <= 400 GiB
    assert result["hicache_host_gib_total"] == pytest.approx(357.63, abs=0.01)
    assert result["errors"] == []
    assert "no decode slots" in find(result["warnings"], "hicache_no_decode_slots")["message"]
    # Same KV capacity with or without HiCache: it is not a concurrency lever.
    without = kimi(mem_fraction_static=0.85)
    assert result["max_concurrent_requests"] == without["max_concurrent_requests"]


@pytest.mark.parametrize("calibrated", [False, True])
def test_kimi_job_fp8_doubles_max_total_num_tokens(calibrated: bool):
    bf16 = kimi(calibrated, mem_fraction_static=0.88, kv_cache_dtype="bf16")
    fp8 = kimi(calibrated, mem_fraction_static=0.88, kv_cache_dtype="fp8_e4m3")
    # MLA cell: 576 * 61 * 2 = 70272 B (bf16) vs 576 * 61 * 1 = 35136 B (fp8)
    assert (bf16["cell_size_bytes"], fp8["cell_size_bytes"]) == (70272, 35136)
    # floor(R / 35136) is 2 * floor(R / 70272) or one more
    assert fp8["max_total_num_tokens"] in {
        2 * bf16["max_total_num_tokens"],
        2 * bf16["max_total_num_tokens"] + 1,
    }
    assert fp8["max_concurrent_requests"] >= 2 * bf16["max_concurrent_requests"]
    assert "quality" in find(fp8["warnings"], "kv_dtype_quality")["message"]
    assert "kv_dtype_quality" not in codes(bf16["warnings"])


@pytest.mark.parametrize(
    ("fraction", "free_after_graph", "fails"),
    [
        # free = 11.00 - (f - 0.85) * 94.19; margin MIN_FREE_AFTER_GRAPH_GIB = 5 GiB
        (0.85, 11.00, False),
        (0.88, 11.00 - 0.03 * 94.19, False),  # 8.17 GiB: ran in the Kimi job
        (0.90, 11.00 - 0.05 * 94.19, False),  # 6.29 GiB: the final configuration
        (0.93, 11.00 - 0.08 * 94.19, True),  # 3.46 GiB: OOM in a large prefill
    ],
)
def test_kimi_job_calibrated_oom_risk(fraction: float, free_after_graph: float, fails: bool):
    result = kimi(True, mem_fraction_static=fraction, kv_cache_dtype="fp8_e4m3")
    assert result["details"]["free_after_graph_gib"] == pytest.approx(free_after_graph, abs=0.01)
    # Calibrated, the finding is an error: the deploy stops before anything stops.
    assert ("oom_risk_mem_fraction" in codes(result["errors"])) is fails
    assert "oom_risk_mem_fraction" not in codes(result["warnings"])
    if fails:
        message = find(result["errors"], "oom_risk_mem_fraction")["message"]
        assert "CUDA graph capture" in message
        assert "large prefill" in message
        assert f"predicted {free_after_graph:.2f} GiB free" in message
        assert "5.0 GiB margin" in message
        assert "highest fraction that keeps the margin is 0.913" in message
    # Highest safe fraction: 0.85 + (11.00 - 5) / 94.19 = 0.9137, floored to 0.913
    assert result["details"]["max_safe_mem_fraction_static"] == 0.913


def test_kimi_job_calibrated_oom_error_can_be_overruled():
    result = kimi(True, mem_fraction_static=0.93, calibration_mode="warn")
    assert result["errors"] == []
    message = find(result["warnings"], "oom_risk_mem_fraction")["message"]
    assert "calibration_mode is 'warn'" in message
    ignored = kimi(True, mem_fraction_static=0.93, calibration_mode="ignore")
    assert not ignored["details"]["calibrated"]
    with pytest.raises(PlanInputError, match="calibration_mode: must be one of enforce, warn"):
        kimi(True, mem_fraction_static=0.93, calibration_mode="off")


def test_kimi_job_margin_is_the_documented_constant():
    assert MIN_FREE_AFTER_GRAPH_GIB == 5.0
    # A caller may demand more room: with 7 GiB, 0.90 (6.29 GiB free) fails too.
    result = kimi(True, mem_fraction_static=0.90, min_free_after_graph_gib=7.0)
    assert "oom_risk_mem_fraction" in codes(result["errors"])


def test_kimi_job_uncalibrated_warns_above_sglangs_own_default():
    # SGLang 0.5.23 for Kimi-K2.5 at tp 8 on 97887 MiB: round(1 - 16384 / 97887, 3) = 0.833,
    # times the ViT factor 0.95 * 0.9576171875 = 0.7578. Its estimate is conservative:
    # without calibration, 0.85 and 0.88 warn.
    default = 0.833 * 0.95 * 0.9576171875
    for fraction in (0.85, 0.88):
        result = kimi(mem_fraction_static=fraction)
        message = find(result["warnings"], "oom_risk_mem_fraction")["message"]
        assert "0.758" in message
        assert "CUDA graph capture" in message
        assert "large prefill" in message
    # Below it, and with the flag unset (SGLang's own choice), no warning.
    assert "oom_risk_mem_fraction" not in codes(kimi(mem_fraction_static=0.75)["warnings"])
    unset = kimi()
    assert unset["details"]["mem_fraction_static"] == pytest.approx(default, abs=1e-4)
    assert "oom_risk_mem_fraction" not in codes(unset["warnings"])


def test_kimi_job_uncalibrated_numbers():
    result = kimi(mem_fraction_static=0.85, kv_cache_dtype="bf16", avg_output_len=1800)
    # pre = 97887 / 1024 - 0.75 (CUDA context) = 94.8428 GiB
    pre = 97887 / 1024 - 0.75
    # Weights per GPU as SGLang 0.5.23 places them (models/deepseek_v2.py): whole on every GPU
    # fused_qkv_a_proj_with_mqa (7168 x 2112 per layer, bf16, 61 layers) and the MoE router
    # (60 layers of MoEGate.weight 384 x 7168 bf16 + e_score_correction_bias 384 fp32); the
    # w_kc/w_vc copy of kv_b_proj (512 x 64 x 256 per layer) and the rest over 8 GPUs.
    whole = 7168 * 2112 * 61 * 2 + 60 * (384 * 7168 * 2 + 384 * 4)
    weights = whole + (595142880788 - whole) / 8 + 512 * 64 * 256 * 61 * 2 / 8
    # post = pre - 71.1772 GiB = 23.6656 GiB (checkpoint / 8 gave 69.2838 and 25.5590)
    post = pre - weights / GIB
    # rest = post - pre * 0.15 - 100/1024 (SGLang's VLM cache reserve) = 9.3415 GiB
    rest = post - pre * 0.15 - 100 / 1024
    tokens = int(rest * GIB) // 70272
    assert result["max_total_num_tokens"] == tokens == 142736  # 171667 with checkpoint / 8
    # one request holds 1024 + 1800 = 2824 tokens: 142736 // 2824 = 50 at once
    assert result["max_concurrent_requests"] == tokens // 2824
    # 50 x 12.0 tok/s (the documented per-request default) = 600 tok/s
    assert result["kv_bound_output_tok_s"] == pytest.approx(tokens // 2824 * 12.0)
    assert result["headroom_gib"] == pytest.approx(pre * 0.15, abs=0.01)  # 14.23


def test_kimi_job_calibration_replaces_the_estimates():
    result = kimi(True, mem_fraction_static=0.85, kv_cache_dtype="auto")
    d = result["details"]
    assert d["calibrated"]
    assert (d["pre_gib"], d["post_gib"]) == (94.19, 24.03)
    # Same fraction and KV dtype as the calibrated run: SGLang's own count, not the formula.
    assert result["max_total_num_tokens"] == 149800
    # headroom = 94.19 * 0.15 = 14.13 GiB
    assert result["headroom_gib"] == pytest.approx(14.13, abs=0.01)
    # Per-request speed = median(gen throughput / running) of the log's Decode batch lines.
    assert d["per_request_tok_s_source"] == "calibration log"
    speed = parse_log(KIMI_LOG.read_text()).per_request_tok_s()
    assert 11.5 <= speed <= 13.0
    assert result["kv_bound_output_tok_s"] == pytest.approx(
        result["max_concurrent_requests"] * speed, abs=0.1
    )


def test_kimi_job_calibrated_other_fraction_uses_measured_memory():
    result = kimi(True, mem_fraction_static=0.88, kv_cache_dtype="fp8_e4m3")
    # The KV pool SGLang allocated (149800 x 70272 B, exact) grows by 0.03 x pre = 0.03 x
    # 94.19 GiB: 12.6295 GiB -> / 35136 B. The log's GiB figures carry two decimals only.
    kv_bytes = 149800 * 70272 + round(0.03 * 94.19 * GIB)
    assert result["max_total_num_tokens"] == kv_bytes // 35136
    # The same, within rounding, as SGLang's formula on the log's pre/post (24.03, 94.19).
    rest = 24.03 - 94.19 * 0.12 - 100 / 1024
    assert abs(result["max_total_num_tokens"] - int(rest * GIB) // 35136) <= 3


def test_calibration_from_another_tp_is_ignored():
    result = plan(
        KIMI_CONFIG,
        KIMI_WEIGHTS,
        {"tp_size": 4, "mem_fraction_static": 0.85, "calibration_log": KIMI_LOG.read_text()},
        {"gpu_memory_mib": 97887, "gpu_count": 8},
    )
    assert "calibration_mismatch" in codes(result["warnings"])
    assert not result["details"]["calibrated"]


# --- errors -----------------------------------------------------------------------------
def test_rest_at_or_below_zero_is_an_error():
    # Kimi on 4 GPUs: 595142880788 / 4 / 2^30 = 138.57 GiB of weights per 95.6 GiB GPU.
    result = plan(KIMI_CONFIG, KIMI_WEIGHTS, {"tp_size": 4, "mem_fraction_static": 0.9}, KIMI_HOST)
    error = find(result["errors"], "not_enough_memory")
    assert "Not enough memory" in error["message"]
    assert result["max_total_num_tokens"] == 0
    assert result["max_concurrent_requests"] == 0


def test_low_fraction_leaves_no_kv_memory():
    # Llama tp 1: post = 94.84 - 14.96 = 79.89 GiB; at 0.1 rest = 79.89 - 94.84 * 0.9 < 0,
    # and SGLang's hint is 1 - post / pre = 1 - 79.89 / 94.84 = 0.158
    result = plan(LLAMA_CONFIG, LLAMA_WEIGHTS, {"mem_fraction_static": 0.1}, KIMI_HOST)
    message = find(result["errors"], "not_enough_memory")["message"]
    pre = 97887 / 1024 - 0.75
    post = pre - 16060522496 / GIB
    assert f"{1 - post / pre:.3f}" in message


def test_more_ranks_than_gpus_is_an_error():
    result = kimi(mem_fraction_static=0.85, dp_size=2)
    assert "16 GPUs" in find(result["errors"], "not_enough_gpus")["message"]
    assert "not_enough_gpus" not in codes(kimi(mem_fraction_static=0.85)["errors"])


def test_bad_inputs_raise():
    with pytest.raises(PlanInputError, match="gpu_memory_mib"):
        plan(LLAMA_CONFIG, LLAMA_WEIGHTS, {}, {})
    with pytest.raises(PlanInputError, match="unknown planner argument"):
        plan(LLAMA_CONFIG, LLAMA_WEIGHTS, {"tp": 2}, KIMI_HOST)
    with pytest.raises(PlanInputError, match="between 0 and 1"):
        plan(LLAMA_CONFIG, LLAMA_WEIGHTS, {"mem_fraction_static": 1.2}, KIMI_HOST)
    with pytest.raises(PlanInputError, match="kv-cache-dtype"):
        plan(LLAMA_CONFIG, LLAMA_WEIGHTS, {"kv_cache_dtype": "int2"}, KIMI_HOST)


# --- MHA worked example, concurrency and dp ---------------------------------------------
def test_llama_tp1_numbers_and_sglang_default():
    result = plan(
        LLAMA_CONFIG,
        LLAMA_WEIGHTS,
        {"mem_fraction_static": 0.85, "avg_input_len": 512, "avg_output_len": 512},
        KIMI_HOST,
    )
    pre = 97887 / 1024 - 0.75
    post = pre - 16060522496 / GIB  # 94.84 - 14.96 = 79.89 GiB
    rest = post - pre * 0.15  # 65.66 GiB
    tokens = int(rest * GIB) // 131072  # 8 heads * 256 * 32 layers * 2 B
    assert result["max_total_num_tokens"] == tokens
    # t = 65.66 * 8192 = 537877 tokens; 512 + 512 per request: t // 1024 = 525 at once.
    # SGLang's default cap, max(min(t / 131072 * 512, 4096), 2048) = 2094, does not bind.
    assert result["max_concurrent_requests"] == tokens // 1024 == 525
    # 0.85 is under SGLang's own 0.858 for this GPU: no OOM warning; 0.86 warns.
    assert result["warnings"] == []
    high = plan(LLAMA_CONFIG, LLAMA_WEIGHTS, {"mem_fraction_static": 0.86}, KIMI_HOST)
    assert "oom_risk_mem_fraction" in codes(high["warnings"])


def test_dp_replicas_multiply_and_max_running_requests_caps():
    base = {"mem_fraction_static": 0.85, "avg_input_len": 512, "avg_output_len": 512}
    one = plan(LLAMA_CONFIG, LLAMA_WEIGHTS, base, KIMI_HOST)
    two = plan(LLAMA_CONFIG, LLAMA_WEIGHTS, base | {"dp_size": 2}, KIMI_HOST)
    # Each replica has its own pool: same per-replica tokens, twice the requests.
    assert two["max_total_num_tokens"] == one["max_total_num_tokens"]
    assert two["max_concurrent_requests"] == 2 * one["max_concurrent_requests"]
    capped = plan(LLAMA_CONFIG, LLAMA_WEIGHTS, base | {"max_running_requests": 100}, KIMI_HOST)
    assert capped["max_concurrent_requests"] == 100


def test_request_longer_than_context_warns():
    result = plan(
        LLAMA_CONFIG,
        LLAMA_WEIGHTS,
        {"avg_input_len": 120000, "avg_output_len": 20000},
        KIMI_HOST,
    )
    assert "exceeds_context_length" in codes(result["warnings"])


# --- calibration log parsing ------------------------------------------------------------
def test_parse_kimi_job_log():
    cal = parse_log(KIMI_LOG.read_text())
    assert (cal.pre_gib, cal.post_gib, cal.weight_gib) == (94.19, 24.03, 70.16)
    assert (cal.kv_tokens, cal.kv_size_gib, cal.max_total_num_tokens) == (149800, 9.80, 149800)
    assert (cal.pool_end_avail_gib, cal.graph_end_avail_gib) == (14.13, 11.00)
    assert (cal.mem_fraction_static, cal.tp_size, cal.kv_cache_dtype) == (0.85, 8, "auto")
    assert (cal.chunked_prefill_size, cal.context_len) == (8192, 262144)
    assert len(cal.decode_samples) == 12
    assert all(40 <= s.num_running_reqs <= 55 for s in cal.decode_samples)


def test_parse_older_log_forms_and_derives_the_fraction():
    log = "\n".join(
        [
            "[2025-06-01 10:00:00 TP0] Load weight begin. avail mem=78.50 GB",
            "[2025-06-01 10:00:30 TP0] Load weight end. type=LlamaForCausalLM, dtype=torch."
            "bfloat16, avail mem=63.54 GB, mem usage=14.96 GB.",
            "[2025-06-01 10:00:31 TP0] KV Cache is allocated. #tokens: 433000, "
            "K size: 26.43 GB, V size: 26.43 GB",
            "[2025-06-01 10:00:31 TP0] Memory pool end. avail mem=10.60 GB",
            "[2025-06-01 10:00:42 TP0] Capture cuda graph end. Time elapsed: 11.05 s. "
            "mem usage=1.54 GB. avail mem=9.06 GB.",
        ]
    )
    cal = parse_log(log)
    assert cal.kv_size_gib == pytest.approx(52.86)  # K + V
    assert cal.graph_end_avail_gib == 9.06
    # No server_args line: the parser states nothing; the lines fix the fraction
    # (sglang_fleet.capacity.logged_flags): f = 1 - (post - kv) / pre = 1 - (63.54 - 52.86) / 78.50.
    assert cal.mem_fraction_static is None
    run = logged_flags.infer(cal)
    assert run.flags["mem_fraction_static"] == round(1 - (63.54 - 52.86) / 78.50, 3) == 0.864


def test_log_without_memory_lines_is_not_a_calibration():
    result = kimi(mem_fraction_static=0.85, calibration_log="nothing useful\n")
    assert "calibration_incomplete" in codes(result["warnings"])
    assert not result["details"]["calibrated"]


# --- command line -----------------------------------------------------------------------
def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = planner.main(list(argv))
    except SystemExit as exc:  # argparse
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


KIMI_FLAGS = (
    "--model-path",
    str(KIMI_DIR),
    "--tp-size",
    "8",
    "--gpu-memory-mib",
    "97887",
    "--host-ram-gib",
    "400",
    "--gpu-count",
    "8",
)


def test_cli_exit_codes(capsys: pytest.CaptureFixture[str]):
    rc, out, _ = run_cli(capsys, *KIMI_FLAGS, "--mem-fraction-static", "0.80", "--json")
    assert rc == 0
    assert json.loads(out)["errors"] == []
    rc, out, _ = run_cli(
        capsys, *KIMI_FLAGS, "--enable-hierarchical-cache", "--hicache-size", "300", "--json"
    )
    assert rc == 1
    assert "hicache_host_ram" in codes(json.loads(out)["errors"])
    rc, _, err = run_cli(capsys, "--model-path", str(KIMI_DIR), "--json")  # no GPU facts
    assert rc == 2
    assert "argument --gpu-memory-mib: is required" in err
    rc, _, _ = run_cli(capsys, *KIMI_FLAGS, "--kv-cache-dtype", "int2")
    assert rc == 2
    rc, _, err = run_cli(capsys, "--model-path", "/nonexistent", "--gpu-memory-mib", "1000")
    assert rc == 2
    assert "argument --model-path: model path /nonexistent is not a directory" in err


def test_cli_calibrate_from(capsys: pytest.CaptureFixture[str]):
    rc, out, _ = run_cli(
        capsys,
        *KIMI_FLAGS,
        "--mem-fraction-static",
        "0.93",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--calibrate-from",
        str(KIMI_LOG),
    )
    assert rc == 1  # calibrated, 0.93 leaves 3.46 GiB: an error
    assert "ERROR oom_risk_mem_fraction" in out
    assert "WARNING kv_dtype_quality" in out


def test_module_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_fleet.capacity.planner", *KIMI_FLAGS, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout)) >= REQUIRED_KEYS


# --- Ansible filter ---------------------------------------------------------------------
def load_filter_module():
    return load_plugin("plugins/filter/sglang_plan.py")


def test_filter_takes_slurped_json_and_matches_plan():
    filters = load_filter_module().FilterModule().filters()
    config_text = (KIMI_DIR / "config.json").read_text()
    index_text = (KIMI_DIR / "model.safetensors.index.json").read_text()
    args = {"tp_size": 8, "mem_fraction_static": 0.85}
    got = filters["sglang_plan"](config_text, index_text, args, KIMI_HOST)
    assert got == plan(KIMI_CONFIG, KIMI_WEIGHTS, args, KIMI_HOST)


def test_filter_turns_bad_input_into_a_filter_error():
    sglang_plan = load_filter_module().sglang_plan
    with pytest.raises(AnsibleFilterError, match="gpu_memory_mib"):
        sglang_plan(KIMI_CONFIG, KIMI_WEIGHTS, {}, {})
    with pytest.raises(AnsibleFilterError, match="not valid JSON"):
        sglang_plan("{not json", KIMI_WEIGHTS, {}, KIMI_HOST)


@pytest.mark.slow
def test_filter_works_inside_ansible_from_any_directory(tmp_path: Path):
    ansible = Path(sys.executable).parent / "ansible"
    if not ansible.exists():
        pytest.skip("ansible is not installed in this venv")
    expr = (
        "{{ (lookup('file', cfg) | sglang_plan(lookup('file', idx), "
        "{'tp_size': 8, 'mem_fraction_static': 0.85}, "
        "{'gpu_memory_mib': 97887, 'gpu_count': 8})).max_total_num_tokens }}"
    )
    env = os.environ | {
        "ANSIBLE_FILTER_PLUGINS": str(ROOT / "plugins" / "filter"),
        # The plugin's own collection (its plugin_utils), from this checkout (docs/COLLECTION.md).
        "ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"),
        "ANSIBLE_LOCALHOST_WARNING": "false",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false",
    }
    proc = subprocess.run(
        [
            str(ansible),
            "localhost",
            "-m",
            "ansible.builtin.debug",
            "-a",
            f"msg={expr}",
            "-e",
            f"cfg={KIMI_DIR / 'config.json'} idx={KIMI_DIR / 'model.safetensors.index.json'}",
        ],
        cwd=tmp_path,  # outside the repository: the plugin must find sglang_fleet itself
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = plan(
        KIMI_CONFIG,
        KIMI_WEIGHTS,
        {"tp_size": 8, "mem_fraction_static": 0.85},
        {"gpu_memory_mib": 97887},
    )["max_total_num_tokens"]
    # JSON or YAML result format, whichever ansible.cfg the caller's environment names.
    assert re.search(rf'"?msg"?:\s*"?{expected}"?\s*$', proc.stdout, re.MULTILINE), proc.stdout


def test_tokens_formula_matches_floor_division_everywhere():
    # Guard against float drift: the planner's token count is floor(rest * 2^30) // cell.
    result = kimi(mem_fraction_static=0.9, kv_cache_dtype="fp8_e4m3")
    rest = result["details"]["kv_pool_gib"]
    assert math.isclose(result["max_total_num_tokens"] * 35136 / GIB, rest, abs_tol=0.01)


def test_string_inputs_from_ansible_extra_vars_are_converted():
    as_text = {
        "tp_size": "8",
        "mem_fraction_static": "0.85",
        "enable_hierarchical_cache": "true",
        "hicache_size": "48",
    }
    host = {"gpu_memory_mib": "97887", "host_ram_gib": "400", "gpu_count": "8"}
    got = plan(KIMI_CONFIG, KIMI_WEIGHTS, as_text, host)
    assert got == kimi(mem_fraction_static=0.85, enable_hierarchical_cache=True, hicache_size=48)
    with pytest.raises(PlanInputError, match="tp_size"):
        plan(KIMI_CONFIG, KIMI_WEIGHTS, {"tp_size": "eight"}, KIMI_HOST)


@pytest.mark.parametrize(
    ("flags", "argument"),
    [
        (["--gpu-memory-mib", "nan"], "--gpu-memory-mib"),
        (["--gpu-memory-mib", "97887", "--per-request-tok-s", "0"], "--per-request-tok-s"),
        (["--gpu-memory-mib", "97887", "--context-length", "0"], "--context-length"),
    ],
)
def test_entry_point_exits_2_naming_the_argument_without_a_traceback(
    flags: list[str], argument: str
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_fleet.capacity.planner",
            "--model-path",
            str(LLAMA_DIR),
            *flags,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"error: argument {argument}: must be" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_filter_reports_hostile_numbers_as_filter_errors():
    sglang_plan = load_filter_module().sglang_plan
    for host in ({"gpu_memory_mib": math.nan}, {"gpu_memory_mib": 97887, "host_ram_gib": -1}):
        with pytest.raises(AnsibleFilterError, match=r"sglang_plan: (gpu_memory_mib|host_ram_gib)"):
            sglang_plan(LLAMA_CONFIG, LLAMA_WEIGHTS, {}, host)
    with pytest.raises(AnsibleFilterError, match="num_attention_heads"):
        sglang_plan({**LLAMA_CONFIG, "num_attention_heads": 0}, LLAMA_WEIGHTS, {}, KIMI_HOST)
