"""The planner and the calibration for CPU servers (docs/CPU-SERVERS.md), with the start-up log,
/metrics and /server_info of a real SGLang 0.5.23 CPU server (tests/fixtures/real-sglang-0.5.23-cpu:
the tiny test Llama of gpusim/tools/make_tiny_llama.py, vocab 32000, --max-total-tokens 4096,
--context-length 2048, on this project's 2-core test machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_fleet.capacity import calibration_record, kv_cache
from sglang_fleet.capacity.planner import main as plan_main
from sglang_fleet.capacity.planner import plan
from sglang_fleet.capacity.server_log import parse_log

REAL = Path(__file__).resolve().parent / "fixtures" / "real-sglang-0.5.23-cpu"
STARTUP_LOG = (REAL / "startup.log").read_text()
# make_tiny_llama.py's shape: hidden 64, 2 layers, 4 heads, 2 KV heads (head_dim 16), vocab 32000.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}
TINY_WEIGHTS = 4_244_096  # bytes of bf16 tensors in its model.safetensors
CPU_ARGS = {"device": "cpu", "max_total_tokens": 4096, "avg_input_len": 64, "avg_output_len": 64}


def test_the_real_cpu_start_up_log_parses() -> None:
    cal = parse_log(STARTUP_LOG)
    assert cal.device == "cpu"
    assert (cal.pre_gib, cal.post_gib) == (21.27, 21.27)
    assert cal.kv_tokens == 4096
    assert cal.max_total_num_tokens == 4096
    assert cal.context_len == 2048
    assert cal.startup_avail_gib == 21.22  # available_cpu_mem, not available_gpu_mem
    assert cal.graph_end_avail_gib is None  # no CUDA graph capture on CPU
    assert cal.tp_size == 1
    assert cal.architecture == "LlamaForCausalLM"


def test_a_load_that_freed_memory_meanwhile_still_parses() -> None:
    # Real SGLang 0.5.23 on its CPU engine, while other work on the machine freed memory: the
    # "mem usage" across the weight load came out negative (tests/double/test_contract_real.py
    # read this line from the reference server and, before the fix, found no post-load figure).
    line = (
        "[2026-12-01 19:25:28] Load weight end. elapsed=0.05 s, type=LlamaForCausalLM, "
        "avail mem=20.96 GB, mem usage=-0.01 GB."
    )
    log = STARTUP_LOG.replace(_load_end_line(STARTUP_LOG), line)
    cal = parse_log(log)
    assert cal.post_gib == 20.96
    assert cal.weight_gib is None  # free memory rose: no weights measured, never a negative one
    assert (
        calibration_record.build_record(log, None, {})["measured"]["max_total_num_tokens"] == 4096
    )


def _load_end_line(log: str) -> str:
    [line] = [line for line in log.splitlines() if "Load weight end." in line]
    return line


def test_the_real_cpu_start_up_log_calibrates_rather_than_incomplete() -> None:
    record = calibration_record.build_record(STARTUP_LOG, None, {})
    assert record["key"]["device"] == "cpu"
    assert record["key"]["max_total_tokens"] == 4096
    assert record["measured"]["max_total_num_tokens"] == 4096
    assert record["measured"]["free_after_graph_gib"] == 21.22


def test_a_gpu_log_line_still_says_cuda() -> None:
    line = (
        "[2026-11-29 10:00:00] max_total_num_tokens=149800, chunked_prefill_size=8192, "
        "max_prefill_tokens=16384, max_running_requests=48, context_len=262144, "
        "available_gpu_mem=11.00 GB"
    )
    cal = parse_log(line)
    assert (cal.device, cal.startup_avail_gib) == ("cuda", 11.0)


def test_real_server_info_matches_the_log() -> None:
    info = json.loads((REAL / "server_info.json").read_text())
    assert info["device"] == "cpu"
    assert info["max_total_num_tokens"] == parse_log(STARTUP_LOG).max_total_num_tokens
    assert info["internal_states"][0]["memory_usage"]["token_capacity"] == 4096


def test_cpu_plan_is_of_host_ram_and_the_token_cap() -> None:
    result = plan(TINY_CONFIG, TINY_WEIGHTS, CPU_ARGS, {"host_ram_gib": 24})
    assert result["errors"] == []
    assert result["max_total_num_tokens"] == 4096  # the cap, not millions from free RAM
    # 2 KV heads x (16 + 16) x 2 layers x 2 bytes
    assert result["cell_size_bytes"] == 256
    assert result["max_concurrent_requests"] == 4096 // 128
    needed = kv_cache.cpu_host_ram_gib(TINY_WEIGHTS, 256 * 4096, 1, 1)
    assert result["details"]["host_ram_needed_gib"] == round(needed, 3)
    assert result["details"]["device"] == "cpu"
    assert result["headroom_gib"] == round(24 - needed, 2)


def test_cpu_plan_needs_no_gpu_fact() -> None:
    assert (
        plan(TINY_CONFIG, TINY_WEIGHTS, CPU_ARGS, {})["warnings"][0]["code"] == "host_ram_unknown"
    )


def test_cpu_plan_without_a_cap_is_an_error_naming_what_fits() -> None:
    args = {k: v for k, v in CPU_ARGS.items() if k != "max_total_tokens"}
    result = plan(TINY_CONFIG, TINY_WEIGHTS, args, {"host_ram_gib": 24})
    [error] = result["errors"]
    assert error["code"] == "cpu_max_total_tokens"
    fitting = result["details"]["max_total_tokens_fitting"]
    assert f"{fitting} fit in 80% of host RAM" in error["message"]
    # what fits really fits, one page more does not
    budget = 24 * kv_cache.CPU_RAM_FRACTION
    assert kv_cache.cpu_host_ram_gib(TINY_WEIGHTS, 256 * fitting, 1, 1) <= budget
    assert kv_cache.cpu_host_ram_gib(TINY_WEIGHTS, 256 * (fitting + 1), 1, 1) > budget


def test_cpu_plan_refuses_a_cap_over_host_ram() -> None:
    args = CPU_ARGS | {"max_total_tokens": 200_000_000, "tp_size": 2}
    result = plan(TINY_CONFIG, TINY_WEIGHTS, args, {"host_ram_gib": 24})
    [error] = result["errors"]
    assert error["code"] == "cpu_host_ram"
    assert "max_total_tokens 200000000 needs" in error["message"]
    # tp 2: each rank holds one KV head, so the cell per rank halves and the total is the same
    assert result["cell_size_bytes"] == 128


def test_gpu_plan_is_capped_by_max_total_tokens_too() -> None:
    host = {"gpu_memory_mib": 24000, "host_ram_gib": 24, "gpu_count": 1}
    uncapped = plan(TINY_CONFIG, TINY_WEIGHTS, {}, host)["max_total_num_tokens"]
    capped = plan(TINY_CONFIG, TINY_WEIGHTS, {"max_total_tokens": 4096}, host)
    assert uncapped > 4096
    assert capped["max_total_num_tokens"] == 4096


def test_plan_command_line_for_a_cpu_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    index = {"metadata": {"total_size": TINY_WEIGHTS}, "weight_map": {}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    argv = ["--model-path", str(model), "--device", "cpu", "--host-ram-gib", "24"]
    assert plan_main([*argv, "--max-total-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "on CPU" in out
    assert "max_total_num_tokens 4096 " in out
    assert plan_main(argv) == 1
    assert "ERROR cpu_max_total_tokens" in capsys.readouterr().out


def test_the_role_filter_plans_a_described_cpu_server_without_gpus() -> None:
    from conftest import load_plugin  # noqa: PLC0415 (tests/conftest.py, as the other tests)

    from sglang_fleet.servers.describe import describe_servers  # noqa: PLC0415

    runtime = {
        "python": "/opt/ml-env/bin/python",
        "launch_module": "sglang.launch_server",
        "config_dir": "/etc/sglang",
        "state_dir": "/var/lib/sglang-fleet",
    }
    tiny = {
        "name": "tiny",
        "model_path": "/models/tiny",
        "port": 30000,
        "device": "cpu",
        "flags": {"max_total_tokens": 4096},
    }
    [server] = describe_servers([tiny], {}, {}, {}, runtime=runtime)
    assert server["plan_args"]["device"] == "cpu"
    index = json.dumps({"metadata": {"total_size": TINY_WEIGHTS}})
    filters = load_plugin("plugins/filter/sglang_plan.py")
    result = filters.sglang_server_plan(server, json.dumps(TINY_CONFIG), index, [], 24 * 1024)
    assert result["errors"] == []
    assert result["max_total_num_tokens"] == 4096
