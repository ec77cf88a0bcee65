"""Diagnosis of a speculating server (docs/SPECULATIVE.md, docs/DIAGNOSIS.md), and the levers of
a KV-bound server whose fraction is past the planner's margin.

/metrics and log lines are SGLang 0.5.23's: the gauges sglang:spec_accept_length and
sglang:spec_accept_rate (observability/metrics_collector.py) and the Decode batch line's
"accept len: X, accept rate: Y, " (managers/scheduler_components/metrics_reporter.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimi_job import GPU

from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.diagnosis import live_metrics as live
from sglang_fleet.diagnosis.live_diagnosis import diagnose_live
from sglang_fleet.diagnosis.run_diagnosis import diagnose

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "fixtures" / "models"
KIMI_LOG = ROOT / "tests" / "fixtures" / "logs" / "constructed-kimi-k2.5-tp8-mf085-bf16.log"
KIMI_CONFIG, KIMI_WEIGHTS = read_model_dir(MODELS / "kimi-k2.5-int4")
DRAFT_CONFIG, DRAFT_WEIGHTS = read_model_dir(MODELS / "kimi-k2.5-eagle3")
HOST = {"gpu_memory_mib": 97887, "gpu_count": 8, "gpu_name": GPU}
SPEC_INFO = {
    "model_path": "/shared/kimi-k2.5-int4",
    "served_model_name": "kimi",
    "tp_size": 8,
    "mem_fraction_static": 0.88,
    "kv_cache_dtype": "fp8_e4m3",
    "max_total_num_tokens": 400751,
    "max_running_requests": 48,  # resolved: SGLang's reset
    "speculative_algorithm": "EAGLE3",
    "speculative_draft_model_path": "/shared/kimi-k2.5-eagle3",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
    "version": "0.5.23",
}


def codes(result: dict[str, Any]) -> list[str]:
    return [lever["code"] for lever in result["levers"]]


def lever(result: dict[str, Any], code: str) -> str:
    return next(item["message"] for item in result["levers"] if item["code"] == code)


def sample(rows: list[tuple], info: dict[str, Any]) -> dict[str, Any]:
    """A live sample (docs/DIAGNOSIS.md) of (running, queued, usage, accept length) readings."""
    samples = []
    for i, (running, queue, usage, accept) in enumerate(rows):
        row = {"t": float(i), "num_running_reqs": running, "num_queue_reqs": queue}
        row |= {"token_usage": usage, "gen_throughput": 0.0}
        if accept:
            row |= {"spec_accept_length": accept, "spec_accept_rate": (accept - 1) / 3}
        samples.append(row)
    return {
        "url": "http://127.0.0.1:8000",
        "interval_s": 1.0,
        "server_info": live.pick_server_info(info),
        "server_metrics": {
            "generation_tokens_delta": None,
            "prompt_tokens_delta": 0.0,
            "decode_tokens_delta": 4000.0,
            "prefill_tokens_delta": 0.0,
            "retracted_requests_delta": None,
            "max_total_num_tokens": info["max_total_num_tokens"],
            "schedulers": 1,
            "window_s": float(len(rows) - 1),
            "samples": samples,
        },
        "warnings": [],
        "error": None,
    }


# --- the levers of a KV-bound server past the margin ------------------------------------------
def test_kv_bound_at_a_fraction_past_the_margin_plans_its_levers_at_the_highest_safe_one():
    """The story's KV-bound load at mem_fraction_static 0.90 with fp8 KV, on a host whose start
    at 0.85 left 8.34 GiB free after CUDA graph capture (the Kimi log with that one figure):
    0.90 is predicted at 8.34 - 0.05 x 94.19 = 3.63 GiB, under the 5 GiB margin. The plan of
    the current flags has that error, and so has every lever planned at 0.90: before, the
    diagnosis said only "at the safe limit" and "add GPUs". The levers are planned at the
    highest safe fraction, 0.85 + (8.34 - 5) / 94.19 = 0.8855, in steps of 0.005: 0.885."""
    log = KIMI_LOG.read_text()
    log = log.replace("avail mem=11.02 GB.", "avail mem=8.36 GB.")
    log = log.replace("avail mem=11.00 GB.", "avail mem=8.34 GB.")
    assert round(8.34 - 0.05 * 94.19, 2) == 3.63
    assert int((0.85 + (8.34 - 5) / 94.19) * 200) / 200 == 0.885
    ctx = {
        "model_config": KIMI_CONFIG,
        "weight_bytes": KIMI_WEIGHTS,
        "args": {
            "tp_size": 8,
            "mem_fraction_static": 0.90,
            "kv_cache_dtype": "fp8_e4m3",
            "avg_input_len": 2000,
            "avg_output_len": 2000,
        },
        "host": HOST,
    }
    rows = [(46, 104, 0.91), (52, 98, 0.95), (41, 109, 0.86), (55, 95, 0.96), (49, 100, 0.9)]
    smoke = {
        "completed": 300,
        "failed": 0,
        "max_concurrency": 150,
        "concurrency": 149.2,
        "output_throughput": 600.0,
        "server_metrics": {
            "max_total_num_tokens": 443520,
            "samples": [
                {
                    "t": float(i),
                    "num_running_reqs": r,
                    "num_queue_reqs": q,
                    "token_usage": u,
                    "gen_throughput": 12.0 * r,
                }
                for i, (r, q, u) in enumerate(rows)
            ],
        },
    }
    result = diagnose(smoke, log, plan_context=ctx)
    assert result["verdict"] == "kv_cache_bound"
    assert codes(result) == ["mem_fraction_static_above_limit", "attention_dp", "more_gpus"]
    lowered = lever(result, "mem_fraction_static_above_limit")
    assert "from 0.9 to 0.885" in lowered
    assert "a predicted 3.63 GiB free after CUDA graph capture, under the 5.0 GiB margin" in lowered
    assert "The other levers are planned at 0.885" in lowered
    assert "--attn-dp-size" in lever(result, "attention_dp")


# --- accept length and rate --------------------------------------------------------------------
def test_the_sampler_reads_the_accept_gauges_as_the_mean_of_the_schedulers():
    text = "\n".join(
        [
            'sglang:num_running_reqs{tp_rank="0",dp_rank="0"} 20',
            'sglang:num_running_reqs{tp_rank="0",dp_rank="1"} 28',
            'sglang:spec_accept_length{tp_rank="0",dp_rank="0"} 2.5',
            'sglang:spec_accept_length{tp_rank="0",dp_rank="1"} 3.0',
            'sglang:spec_accept_rate{tp_rank="0",dp_rank="0"} 0.5',
            'sglang:spec_accept_rate{tp_rank="0",dp_rank="1"} 0.6',
        ]
    )
    from sglang_fleet.smoke.smoke_client.prometheus_text import parse_series  # noqa: PLC0415

    values = live.aggregate(parse_series(text))
    assert values[live.M_RUNNING] == 48
    assert values[live.M_SPEC_ACCEPT_LENGTH] == 2.75
    assert round(values[live.M_SPEC_ACCEPT_RATE], 3) == 0.55
    row = live.summarize([(0.0, values), (1.0, values)], [])["samples"][0]
    assert (row["spec_accept_length"], row["spec_accept_rate"]) == (2.75, 0.55)
    # A server without speculation reports 0: no figure in its rows.
    plain = live.aggregate(parse_series(text.replace("2.5", "0").replace("3.0", "0")))
    assert (
        "spec_accept_length" not in live.summarize([(0.0, plain), (1.0, plain)], [])["samples"][0]
    )


def test_accept_length_and_rate_are_read_from_the_metrics_and_from_the_log():
    rows = [(30, 0, 0.3, 2.4), (31, 0, 0.31, 2.6), (32, 0, 0.32, 2.5)]
    live_result = diagnose_live(sample(rows, SPEC_INFO | {"max_running_requests": 64}))
    assert live_result["evidence"]["spec_accept_length"] == 2.5
    assert live_result["evidence"]["spec_accept_rate"] == 0.5
    assert any(
        n.startswith("Speculative decoding: accept length 2.5") for n in live_result["notes"]
    )
    lines = "".join(
        f"[2026-12-01 10:00:0{i} TP0] Decode batch, #running-req: {r}, #token: 90000, token "
        f"usage: 0.30, accept len: {a:.2f}, accept rate: 0.50, cuda graph: True, gen throughput "
        f"(token/s): 600.00, #queue-req: 0\n"
        for i, (r, _, _, a) in enumerate(rows)
    )
    from_log = diagnose(log_text=lines, concurrency=32)
    assert from_log["evidence"]["source"] == "log"
    assert from_log["evidence"]["spec_accept_length"] == 2.5


# --- the 48 reset ------------------------------------------------------------------------------
def test_a_server_sitting_at_the_reset_cap_with_a_queue_is_named():
    rows = [(48, 102, 0.2, 2.5), (48, 101, 0.2, 2.6), (48, 102, 0.21, 2.5)]
    result = diagnose_live(sample(rows, SPEC_INFO))
    assert codes(result)[0] == "speculative_reset_cap"
    said = lever(result, "speculative_reset_cap")
    assert "Running requests sit at 48 with 102 queued" in said
    assert "resets --max-running-requests to 48 for speculative decoding" in said
    # 0.2 x 400751 tokens / 48 running = 1670 tokens each; the pool holds 400751 // 1670.
    assert f"max_running_requests: {400751 // 1670} (what the KV pool holds" in said
    # Not speculating, or not at 48, or no queue: nothing said.
    plain = {k: v for k, v in SPEC_INFO.items() if not k.startswith("speculative")}
    no_accept = [(r, q, u, None) for r, q, u, _ in rows]
    assert "speculative_reset_cap" not in codes(diagnose_live(sample(no_accept, plain)))
    below = [(40, 0, 0.2, 2.5)] * 3
    assert "speculative_reset_cap" not in codes(diagnose_live(sample(below, SPEC_INFO)))


def test_the_reset_cap_from_a_log_names_the_value_the_planner_gives():
    """A log whose scheduler line says max_running_requests=48 and whose Decode batch lines
    sit at 48 with a queue; with the model and the draft, the planner sizes the value."""
    head = (
        "[2026-12-01 09:59:00 TP0] max_total_num_tokens=343821, chunked_prefill_size=8192, "
        "max_prefill_tokens=16384, max_running_requests=48, context_len=262144, "
        "available_gpu_mem=11.02 GB\n"
    )
    lines = "".join(
        f"[2026-12-01 10:00:0{i} TP0] Decode batch, #running-req: 48, #token: 190000, token "
        "usage: 0.47, accept len: 2.50, accept rate: 0.50, cuda graph: True, gen throughput "
        "(token/s): 900.00, #queue-req: 102\n"
        for i in range(3)
    )
    ctx = {
        "model_config": KIMI_CONFIG,
        "weight_bytes": KIMI_WEIGHTS,
        "args": {
            "tp_size": 8,
            "mem_fraction_static": 0.88,
            "kv_cache_dtype": "fp8_e4m3",
            "avg_input_len": 2000,
            "avg_output_len": 2000,
            "speculative_algorithm": "EAGLE3",
            "speculative_draft_model_path": "/d",
            "speculative_draft_config": DRAFT_CONFIG,
            "speculative_draft_weight_bytes": DRAFT_WEIGHTS,
        },
        "host": HOST,
    }
    result = diagnose(log_text=head + lines, concurrency=150, plan_context=ctx)
    assert codes(result)[0] == "speculative_reset_cap"
    # The planner's pool at 0.88 fp8 with the draft holds 343821 tokens (tests/
    # test_speculative_plan.py): 85 requests of 4000.
    assert "max_running_requests: 85 (what the planner says" in result["levers"][0]["message"]


# --- does it pay at this load -----------------------------------------------------------------
def _speculating(rows: list[tuple]) -> dict[str, Any]:
    ctx = {
        "model_config": KIMI_CONFIG,
        "weight_bytes": KIMI_WEIGHTS,
        "args": {
            "speculative_draft_config": DRAFT_CONFIG,
            "speculative_draft_weight_bytes": DRAFT_WEIGHTS,
        },
        "host": HOST,
    }
    info = SPEC_INFO | {"max_running_requests": 160}
    return diagnose_live(sample(rows, info), ctx)


def test_speculation_that_costs_at_the_load_seen_is_a_lever():
    """Kimi-K2.5 (a MoE of 384 experts, 8 per token) at 8 running requests: a verify of 4
    tokens per request reads about four times the experts a decode step reads, so at accept
    length 2.5 the planner's model expects less output than without speculation."""
    result = _speculating([(8, 0, 0.05, 2.5)] * 4)
    said = lever(result, "speculation_costs")
    assert "at 8 running requests and accept length 2.5" in said
    assert "Turn it off" in said


def test_speculation_that_pays_at_the_load_seen_is_a_note():
    result = _speculating([(150, 0, 0.9, 2.5)] * 4)
    assert "speculation_costs" not in codes(result)
    assert any(n.startswith("Speculation pays at this load") for n in result["notes"])


def test_without_the_draft_the_levers_are_planned_without_it_and_say_so():
    rows = [(30, 0, 0.3, 2.5)] * 3
    ctx = {"model_config": KIMI_CONFIG, "weight_bytes": KIMI_WEIGHTS, "args": {}, "host": HOST}
    result = diagnose_live(sample(rows, SPEC_INFO | {"max_running_requests": 64}), ctx)
    assert any("is not judged" in n for n in result["notes"])


def test_the_smoke_clients_samples_carry_the_accept_figures():
    """The gate's benchmark samples /metrics too: the accept gauges as the schedulers' mean."""
    import asyncio  # noqa: PLC0415

    from sglang_fleet.smoke.smoke_client.server_metrics import MetricsSampler  # noqa: PLC0415

    text = (
        'sglang:num_running_reqs{dp_rank="0"} 20\nsglang:num_running_reqs{dp_rank="1"} 28\n'
        'sglang:spec_accept_length{dp_rank="0"} 2.5\nsglang:spec_accept_length{dp_rank="1"} 3.0\n'
        'sglang:spec_accept_rate{dp_rank="0"} 0.5\nsglang:spec_accept_rate{dp_rank="1"} 0.6\n'
    )

    class Client:
        async def get(self, path: str) -> tuple[int, bytes]:
            assert path == "/metrics"
            return 200, text.encode()

    sampler = MetricsSampler(Client(), 1.0, lambda: 5.0, 0.0)  # type: ignore[arg-type]
    asyncio.run(sampler.sample())
    [row] = sampler.samples
    assert row["num_running_reqs"] == 48  # summed over the schedulers
    assert row["spec_accept_length"] == 2.75
    assert round(row["spec_accept_rate"], 3) == 0.55


def test_the_command_line_reads_the_draft_to_size_the_levers(tmp_path: Path, capsys):
    import json  # noqa: PLC0415

    from sglang_fleet.diagnosis.diagnose import main  # noqa: PLC0415

    log = tmp_path / "server.log"
    log.write_text(
        "[2026-12-01 09:59:00 TP0] max_total_num_tokens=343821, chunked_prefill_size=8192, "
        "max_prefill_tokens=16384, max_running_requests=48, context_len=262144, "
        "available_gpu_mem=11.02 GB\n"
        + "".join(
            f"[2026-12-01 10:00:0{i} TP0] Decode batch, #running-req: 48, #token: 190000, token "
            "usage: 0.47, accept len: 2.50, accept rate: 0.50, cuda graph: True, gen throughput "
            "(token/s): 900.00, #queue-req: 102\n"
            for i in range(3)
        )
    )
    code = main(
        ["--log", str(log), "--concurrency", "150", "--json",
         "--model-path", str(MODELS / "kimi-k2.5-int4"), "--gpu-memory-mib", "97887",
         "--gpu-name", GPU, "--tp-size", "8", "--mem-fraction-static", "0.88",
         "--kv-cache-dtype", "fp8_e4m3", "--avg-input-len", "2000", "--avg-output-len", "2000",
         "--speculative-algorithm", "EAGLE3",
         "--speculative-draft-model-path", str(MODELS / "kimi-k2.5-eagle3")]
    )  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["levers"][0]["code"] == "speculative_reset_cap"
    assert "max_running_requests: 85 (what the planner says" in result["levers"][0]["message"]
    # At 48 running and accept length 2.5 the planner's model says it pays (x1.56).
    assert any(n.startswith("Speculation pays at this load") for n in result["notes"])
