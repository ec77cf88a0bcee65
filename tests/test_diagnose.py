"""Bottleneck diagnosis: one synthetic run per verdict, from /metrics samples and from logs.

Samples follow docs/CONTRACTS.md (smoke result `server_metrics.samples`); log lines follow
SGLang 0.5.23's Decode batch format
(`managers/scheduler_components/metrics_reporter.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import load_plugin

from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.diagnosis import diagnose as diagnose_mod
from sglang_fleet.diagnosis.evidence import samples_from_log
from sglang_fleet.diagnosis.run_diagnosis import diagnose

ROOT = Path(__file__).resolve().parent.parent
KIMI_LOG = ROOT / "tests" / "fixtures" / "logs" / "constructed-kimi-k2.5-tp8-mf085-bf16.log"
KIMI_DIR = ROOT / "tests" / "fixtures" / "models" / "kimi-k2.5-int4"
MAX_TOKENS = 149800


# Each scenario: (running, queue, token_usage) per sample, what the client asked for and
# what it achieved (bench_serving's mean concurrency).
SCENARIOS: dict[str, dict[str, Any]] = {
    # The Kimi job (docs/THE-JOB.md): ~50 of 150 running, ~100 queued, usage 0.85-0.96.
    "kv_cache_bound": {
        "rows": [(46, 104, 0.91), (52, 98, 0.95), (41, 109, 0.86), (55, 95, 0.96), (49, 100, 0.9)],
        "asked": 150,
        "achieved": 149.2,
    },
    # Everything the client sends runs, but requests still queue with the KV cache half
    # empty: the batch or the GPU is the limit, not KV memory.
    "compute_bound": {
        "rows": [(128, 22, 0.42), (128, 22, 0.45), (128, 21, 0.47), (128, 20, 0.5)],
        "asked": 150,
        "achieved": 149.0,
    },
    # The client asked for 150 but only ever had ~30 in flight; the server never queued.
    "client_bound": {
        "rows": [(31, 0, 0.2), (28, 0, 0.19), (33, 0, 0.22), (30, 0, 0.2)],
        "asked": 150,
        "achieved": 30.5,
    },
    "healthy": {
        "rows": [(60, 0, 0.4), (64, 0, 0.45), (63, 0, 0.44), (64, 0, 0.47)],
        "asked": 64,
        "achieved": 63.1,
    },
}


def smoke_result(name: str, with_metrics: bool = True) -> dict[str, Any]:
    s = SCENARIOS[name]
    samples = [
        {
            "t": float(i),
            "num_running_reqs": r,
            "num_queue_reqs": q,
            "token_usage": u,
            "gen_throughput": r * 12.0,
        }
        for i, (r, q, u) in enumerate(s["rows"])
    ]
    metrics = {
        "generation_tokens_delta": 100000,
        "prompt_tokens_delta": 150000,
        "peak_num_running_reqs": max(r for r, _, _ in s["rows"]),
        "peak_num_queue_reqs": max(q for _, q, _ in s["rows"]),
        "peak_token_usage": max(u for _, _, u in s["rows"]),
        "max_total_num_tokens": MAX_TOKENS,
        "samples": samples,
    }
    return {
        "completed": 300,
        "failed": 0,
        "duration": 120.0,
        "output_throughput": 600.0,
        "max_concurrency": s["asked"],
        "concurrency": s["achieved"],
        "server_metrics": metrics if with_metrics else None,
    }


def decode_log(name: str) -> str:
    """The scenario as SGLang would log it: one Decode batch line per sample."""
    lines = [
        "[2026-11-29 10:00:00 TP0] Prefill batch, #new-seq: 1, #new-token: 1024, "
        "#cached-token: 0, token usage: 0.01, #running-req: 0, #queue-req: 0, "
        "#pending-token: 0, cuda graph: False, input throughput (token/s): 0.00"
    ]
    for i, (r, q, u) in enumerate(SCENARIOS[name]["rows"]):
        lines.append(
            f"[2026-11-29 10:00:{i + 1:02d} TP0] Decode batch, #running-req: {r}, "
            f"#token: {int(u * MAX_TOKENS)}, token usage: {u:.2f}, cuda graph: True, "
            f"gen throughput (token/s): {r * 12.0:.2f}, #queue-req: {q}"
        )
    return "\n".join(lines) + "\n"


def lever_codes(result: dict[str, Any]) -> list[str]:
    return [lv["code"] for lv in result["levers"]]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_verdict_from_metric_samples(name: str):
    result = diagnose(smoke_result(name))
    assert result["verdict"] == name
    assert result["evidence"]["source"] == "server_metrics"
    assert result["levers"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_verdict_from_decode_batch_log(name: str):
    s = SCENARIOS[name]
    result = diagnose(log_text=decode_log(name), concurrency=s["asked"])
    # client_bound needs the client's side or a shortfall the server can see: here the
    # server saw at most 33 + 0 of the 150 asked for.
    assert result["verdict"] == name
    assert result["evidence"]["source"] == "log"
    assert result["evidence"]["busy_samples"] == len(s["rows"])


def test_decode_batch_lines_parse_every_field():
    samples, schedulers = samples_from_log(decode_log("kv_cache_bound"))
    assert schedulers == 1
    assert [(x.running, x.queue, x.token_usage) for x in samples] == SCENARIOS["kv_cache_bound"][
        "rows"
    ]
    assert samples[0].gen_throughput == 46 * 12.0


def test_kv_bound_evidence_numbers():
    ev = diagnose(smoke_result("kv_cache_bound"))["evidence"]
    # running 41, 46, 49, 52, 55 -> median 49; queue 95..109 -> median 100
    assert (ev["median_running_reqs"], ev["median_queue_reqs"]) == (49, 100)
    assert ev["queued_share"] == 1.0
    # usage 0.86, 0.90, 0.91, 0.95, 0.96 -> median 0.91
    assert ev["median_token_usage"] == 0.91
    assert ev["peak_token_usage"] == 0.96
    assert (ev["client_concurrency_asked"], ev["client_concurrency_achieved"]) == (150, 149.2)
    assert ev["max_total_num_tokens"] == MAX_TOKENS
    # 49 <= 0.7 * 150 = 105 (far below), 0.91 >= 0.8 (high), queue always non-empty


def test_kv_bound_levers_without_a_model_and_never_hicache():
    result = diagnose(smoke_result("kv_cache_bound"))
    assert lever_codes(result) == ["kv_cache_dtype_fp8", "mem_fraction_static", "more_gpus"]
    for lever in result["levers"]:
        assert "hicache" not in lever["message"].lower()
        assert "hierarchical" not in lever["message"].lower()
    assert any("adds no" in n or "Not a lever" in n for n in result["notes"])


def test_kv_bound_levers_carry_the_planners_capacity():
    config, weights = read_model_dir(KIMI_DIR)
    ctx = {
        "model_config": config,
        "weight_bytes": weights,
        "args": {"avg_input_len": 1024, "avg_output_len": 1800},
        "host": {"gpu_memory_mib": 97887, "host_ram_gib": 400, "gpu_count": 8},
    }
    # The Kimi job's log: start-up at 0.85 bf16 tp 8, then KV-bound Decode batch lines.
    result = diagnose(log_text=KIMI_LOG.read_text(), concurrency=150, plan_context=ctx)
    assert result["verdict"] == "kv_cache_bound"
    levers = {lv["code"]: lv["message"] for lv in result["levers"]}
    # fp8 halves the cell (70272 -> 35136 B): the pool SGLang allocated, 149800 x 70272 B,
    # holds 2 x 149800 = 299600 tokens (now 149800)
    assert "max_total_num_tokens 299600 (now 149800)" in levers["kv_cache_dtype_fp8"]
    # 149800 // 2824 = 53 requests now; 299600 // 2824 = 106 with fp8
    assert "about 106 concurrent requests (now 53)" in levers["kv_cache_dtype_fp8"]
    # safe limit 0.85 + (11.00 - 5) / 94.19 = 0.9137 -> suggested 0.910 (0.005 steps)
    assert "from 0.85 to 0.910" in levers["mem_fraction_static"]
    assert "measured free memory after CUDA graph capture" in levers["mem_fraction_static"]
    assert "latent KV cache is replicated" in levers["more_gpus"]


def test_kv_bound_at_the_fraction_limit_and_already_fp8():
    config, weights = read_model_dir(KIMI_DIR)
    ctx = {
        "model_config": config,
        "weight_bytes": weights,
        "args": {"mem_fraction_static": 0.91, "kv_cache_dtype": "fp8_e4m3"},
        "host": {"gpu_memory_mib": 97887, "gpu_count": 8},
    }
    result = diagnose(smoke_result("kv_cache_bound"), KIMI_LOG.read_text(), plan_context=ctx)
    codes = lever_codes(result)
    assert "kv_cache_dtype_fp8" not in codes
    assert "mem_fraction_static_at_limit" in codes
    assert "more_gpus" in codes


def test_metrics_win_over_the_log_when_both_are_given():
    result = diagnose(smoke_result("healthy"), decode_log("kv_cache_bound"))
    assert result["verdict"] == "healthy"
    assert result["evidence"]["source"] == "server_metrics"
    # The log still fills in what the samples lack.
    fallback = diagnose(smoke_result("kv_cache_bound", with_metrics=False), KIMI_LOG.read_text())
    assert fallback["evidence"]["source"] == "log"
    assert fallback["evidence"]["max_total_num_tokens"] == MAX_TOKENS


def test_compute_bound_from_slo_without_queue():
    smoke = smoke_result("healthy") | {
        "mean_tpot_ms": 80.0,
        "slo": {"ttft_ms": 2000, "tpot_ms": 50},
    }
    result = diagnose(smoke)
    assert result["verdict"] == "compute_bound"
    assert (result["evidence"]["mean_tpot_ms"], result["evidence"]["slo_tpot_ms"]) == (80.0, 50)


def test_client_bound_without_server_samples():
    result = diagnose(smoke_result("client_bound", with_metrics=False))
    assert result["verdict"] == "client_bound"
    assert "30.5 of 150" in result["levers"][0]["message"]


@pytest.mark.parametrize("with_metrics", [True, False], ids=["idle-samples", "no-samples"])
def test_a_run_where_every_request_failed_is_not_blamed_on_the_client(with_metrics: bool):
    # The smoke client computes its achieved concurrency from successful requests only: with
    # none, it reads 0 of 150 in flight, which looked like a client that could not keep up.
    failed = smoke_result("client_bound", with_metrics=with_metrics) | {
        "completed": 0,
        "failed": 150,
        "concurrency": 0.0,
        "output_throughput": 0.0,
    }
    if with_metrics:
        idle = {"t": 0.0, "num_running_reqs": 0, "num_queue_reqs": 0, "token_usage": 0.0}
        failed["server_metrics"]["samples"] = [idle] * 5
    before_the_fix = failed | {"completed": 1}
    assert diagnose(before_the_fix)["verdict"] == "client_bound"
    result = diagnose(failed)
    assert result["verdict"] == "unknown"
    assert lever_codes(result) == ["requests_failed"]
    assert "150 of 150" in result["levers"][0]["message"]
    assert (result["evidence"]["completed"], result["evidence"]["failed"]) == (0, 150)


def test_nothing_to_judge_is_unknown():
    result = diagnose({"completed": 10})
    assert result["verdict"] == "unknown"
    assert lever_codes(result) == ["collect_data"]


def test_idle_samples_are_ignored():
    smoke = smoke_result("kv_cache_bound")
    idle = {"t": 99.0, "num_running_reqs": 0, "num_queue_reqs": 0, "token_usage": 0.0}
    smoke["server_metrics"]["samples"] += [idle] * 20
    result = diagnose(smoke)
    assert result["verdict"] == "kv_cache_bound"
    assert result["evidence"]["samples"] == 25
    assert result["evidence"]["busy_samples"] == 5


def test_samples_of_a_server_with_nothing_to_do_are_idle():
    rows = [
        {"t": float(i), "num_running_reqs": 0, "num_queue_reqs": 0, "token_usage": 0.3}
        for i in range(5)
    ]
    quiet = {"server_metrics": {"samples": rows}}
    result = diagnose(quiet)
    assert result["verdict"] == "idle"
    assert lever_codes(result) == ["sample_under_load"]
    # A benchmark that says it kept 60 requests in flight while the server showed none is a
    # measurement gone wrong, not an idle server.
    sent = quiet | {"max_concurrency": 64, "concurrency": 60.0}
    assert diagnose(sent)["verdict"] == "unknown"


# --- command line and filter ------------------------------------------------------------
def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = diagnose_mod.main(list(argv))
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_with_log_and_smoke_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    log = tmp_path / "server.log"
    log.write_text(decode_log("kv_cache_bound"))
    rc, out, _ = run_cli(capsys, "--log", str(log), "--concurrency", "150", "--json")
    assert rc == 0
    assert json.loads(out)["verdict"] == "kv_cache_bound"

    result_file = tmp_path / "result.json"
    result_file.write_text(json.dumps(smoke_result("client_bound")))
    rc, out, _ = run_cli(capsys, "--smoke-result", str(result_file), "--json")
    assert rc == 0
    assert json.loads(out)["verdict"] == "client_bound"


def test_cli_with_model_sizes_the_levers(capsys: pytest.CaptureFixture[str]):
    rc, out, _ = run_cli(
        capsys,
        "--log",
        str(KIMI_LOG),
        "--concurrency",
        "150",
        "--model-path",
        str(KIMI_DIR),
        "--gpu-memory-mib",
        "97887",
        "--avg-input-len",
        "1024",
        "--avg-output-len",
        "1800",
    )
    assert rc == 0
    assert "verdict: kv_cache_bound" in out
    assert "299600" in out


def test_cli_bad_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert run_cli(capsys, "--json")[0] == 2
    assert run_cli(capsys, "--log", str(tmp_path / "missing.log"), "--json")[0] == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert run_cli(capsys, "--smoke-result", str(bad))[0] == 2
    # A model without the GPU size cannot be planned.
    assert run_cli(capsys, "--log", str(KIMI_LOG), "--model-path", str(KIMI_DIR))[0] == 2


def test_filter_wraps_diagnose():
    module = load_plugin("plugins/filter/sglang_diagnose.py")
    sglang_diagnose = module.FilterModule().filters()["sglang_diagnose"]
    as_text = json.dumps(smoke_result("kv_cache_bound"))  # slurped result file
    assert sglang_diagnose(as_text)["verdict"] == "kv_cache_bound"
    assert sglang_diagnose(None, decode_log("client_bound"), "150")["verdict"] == "client_bound"


def test_data_parallel_log_compares_each_scheduler_with_its_share():
    # Two DP schedulers, each with 60 running of its 75-request share and nothing queued:
    # healthy. Compared with the whole 150 it would look like a client shortfall.
    lines = [
        f"[2026-11-29 10:00:{i:02d} DP{dp} TP0] Decode batch, #running-req: 60, #token: 40000, "
        "token usage: 0.40, cuda graph: True, gen throughput (token/s): 720.00, #queue-req: 0"
        for i in range(4)
        for dp in (0, 1)
    ]
    result = diagnose(log_text="\n".join(lines), concurrency=150)
    assert result["evidence"]["schedulers"] == 2
    assert result["verdict"] == "healthy"
