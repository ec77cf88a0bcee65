"""The filters the roles use for calibration and autotune (docs/CALIBRATION.md, AUTOTUNE.md).

- sglang_server_plan with the host's calibration: the pre-flight's refusal before anything
  stops, its overrule (warn), a calibration of another GPU (mismatch: estimates, a warning).
- the autotune filters: inputs checked before a host is touched, the trial's benchmark and the
  result `autotune record` reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError
from conftest import load_plugin
from kimi_job import GPU, KIMI_LOG, KIMI_RUN_FLAGS

from sglang_fleet.capacity import calibration_record, calibration_store
from sglang_fleet.capacity.model_config import read_model_dir

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
KIMI_CONFIG, KIMI_WEIGHTS = read_model_dir(FIXTURES / "models" / "kimi-k2.5-int4")
INDEX = json.dumps({"metadata": {"total_size": KIMI_WEIGHTS}})
FLAGS = {
    **KIMI_RUN_FLAGS,
    "model_path": "/shared/kimi-k2.5-int4",
    "host": "127.0.0.1",
    "port": 8000,
}


def plan_filter() -> Any:
    return (
        load_plugin("plugins/filter/sglang_plan.py").FilterModule().filters()["sglang_server_plan"]
    )


def autotune_filters() -> dict[str, Any]:
    return load_plugin("plugins/filter/sglang_autotune.py").FilterModule().filters()


def store_text() -> str:
    """The host's calibration.json after the Kimi job's start at 0.85 (bf16), as slurped."""
    key = {
        "model_config": KIMI_CONFIG,
        "weight_bytes": KIMI_WEIGHTS,
        "gpu_name": GPU,
        "gpu_memory_mib": 97887,
        "sglang_version": "0.5.23",
        "flags": FLAGS,
        "server": "kimi",
    }
    record = calibration_record.build_record(KIMI_LOG, None, key)
    return json.dumps(calibration_store.dump_store([record]))


def server(**flag_changes: Any) -> dict[str, Any]:
    flags = FLAGS | flag_changes
    planner = ("tp_size", "mem_fraction_static", "kv_cache_dtype", "chunked_prefill_size")
    return {
        "name": "kimi",
        "gpus": list(range(8)),
        "flags": flags,
        "plan_args": {k: flags[k] for k in planner},
    }


def gpus(name: str = GPU, mib: int = 97887) -> list[dict[str, Any]]:
    return [{"index": i, "name": name, "memory_total_mib": mib} for i in range(8)]


def plan(srv: dict, gpu_list: list, mode: str = "enforce", store: str | None = None) -> dict:
    cal = {"store": store_text() if store is None else store, "mode": mode}
    cal["sglang_version"] = "0.5.23"
    workload = {"avg_input_len": 2000, "avg_output_len": 2000}
    return plan_filter()(srv, json.dumps(KIMI_CONFIG), INDEX, gpu_list, 409600, workload, cal)


# --- the pre-flight plan with the host's calibration ----------------------------------------
def test_a_calibrated_flag_set_that_leaves_too_little_free_memory_is_refused():
    result = plan(server(mem_fraction_static=0.93), gpus())
    assert result["details"]["calibrated"]
    [error] = [e for e in result["errors"] if e["code"] == "oom_risk_mem_fraction"]
    assert "leaves a predicted 3.46 GiB free after CUDA graph capture" in error["message"]
    assert "below the 5.0 GiB margin" in error["message"]
    assert "The highest fraction that keeps the margin is 0.913" in error["message"]


def test_a_calibrated_flag_set_within_the_margin_is_planned_from_the_measurement():
    result = plan(server(mem_fraction_static=0.90, kv_cache_dtype="fp8_e4m3"), gpus())
    assert result["errors"] == []
    details = result["details"]
    assert details["calibrated"] and "predicts across" in details["calibration"]
    assert details["free_after_graph_gib"] == pytest.approx(11.00 - 0.05 * 94.19, abs=0.01)
    uncalibrated = plan(
        server(mem_fraction_static=0.90, kv_cache_dtype="fp8_e4m3"), gpus(), "ignore"
    )
    assert not uncalibrated["details"]["calibrated"]
    assert uncalibrated["max_total_num_tokens"] != result["max_total_num_tokens"]


def test_warn_mode_lets_the_operator_overrule_the_refusal():
    result = plan(server(mem_fraction_static=0.93), gpus(), mode="warn")
    assert result["errors"] == []
    [warning] = [w for w in result["warnings"] if w["code"] == "oom_risk_mem_fraction"]
    assert "Reported as a warning because calibration_mode is 'warn'" in warning["message"]


def test_a_calibration_of_another_gpu_falls_back_to_estimates_with_a_warning():
    result = plan(server(mem_fraction_static=0.93), gpus(name="NVIDIA H200", mib=143771))
    assert not result["details"]["calibrated"]
    assert "oom_risk_mem_fraction" not in {e["code"] for e in result["errors"]}
    [mismatch] = [w for w in result["warnings"] if w["code"] == "calibration_mismatch"]
    assert "GPU model differs" in mismatch["message"]
    assert "falls back to estimates" in mismatch["message"]


def test_no_calibration_on_the_host_plans_as_before_without_a_warning():
    result = plan(server(mem_fraction_static=0.90), gpus(), store="")
    assert not result["details"]["calibrated"]
    assert "calibration_mismatch" not in {w["code"] for w in result["warnings"]}


def test_the_servers_own_gpus_give_the_memory_and_the_name():
    # GPU 8 is another, smaller card the server does not use: the calibration still matches.
    mixed = [*gpus(), {"index": 8, "name": "NVIDIA L40S", "memory_total_mib": 46068}]
    result = plan(server(mem_fraction_static=0.90), mixed)
    assert result["details"]["calibrated"], result["warnings"]
    assert result["details"]["pre_gib"] == pytest.approx(94.19)
    with pytest.raises(AnsibleFilterError, match="unknown calibration key"):
        plan_filter()(server(), KIMI_CONFIG, KIMI_WEIGHTS, gpus(), 409600, None, {"mod": "warn"})


# --- autotune -------------------------------------------------------------------------------
def test_autotune_inputs_name_the_variable_before_any_host():
    check = autotune_filters()["sglang_autotune_inputs"]
    workload = {"input_len": 100, "output_len": 100, "concurrency": 150}
    with pytest.raises(AnsibleFilterError, match="autotune_kv_cache_dtypes_allowed"):
        check({"kv_cache_dtype": ["fp8_e4m3"]}, workload, None, ["auto"], 0.05, None)
    typed = check({"mem_fraction_static": ["0.9"]}, workload, {"max_failures": 0}, None, "0.1", 3)
    assert typed["space"] == {"mem_fraction_static": [0.9]}
    assert (typed["tolerance"], typed["max_trials"], typed["workload"]["num_prompts"]) == (
        0.1,
        3,
        150,
    )


def test_the_trials_benchmark_is_the_search_workload_at_fixed_lengths():
    smoke = autotune_filters()["sglang_autotune_smoke_workload"](
        {"input_len": 100, "output_len": 50, "concurrency": 150, "num_prompts": None}
    )
    assert smoke == {
        "backend": "sglang",
        "seed": 42,
        "warmup_requests": 1,
        "num_prompts": 150,
        "max_concurrency": 150,
        "random_input_len": 100,
        "random_output_len": 50,
        "lengths": None,
        "slo_ttft_ms": None,
        "slo_tpot_ms": None,
    }


def test_a_jobs_shape_is_the_trials_benchmark():
    """autotune_workload.lengths (python -m sglang_fleet.job shape): the trials run the job's
    lengths, and the plans read their means."""
    workload = {"lengths": "100:20, 300:60", "concurrency": 8, "num_prompts": None}
    smoke = autotune_filters()["sglang_autotune_smoke_workload"](workload)
    assert smoke["lengths"] == "100:20,300:60"
    assert (smoke["random_input_len"], smoke["random_output_len"]) == (200, 40)
    with pytest.raises(AnsibleFilterError, match=r"autotune_workload\.lengths: pair 2"):
        autotune_filters()["sglang_autotune_smoke_workload"]({**workload, "lengths": "1:1,x"})


def test_the_trial_result_for_autotune_record():
    to_result = autotune_filters()["sglang_autotune_trial_result"]
    smoke = {"completed": 150, "failed": 0, "output_throughput": 1990.5}
    passed = {"outcome": "passed", "phase": None, "error": None, "calibration": {"schema": 1}}
    assert to_result(passed, json.dumps(smoke)) == {
        "smoke": smoke,
        "calibration": {"schema": 1},
        "error": None,
        "phase": None,
    }
    crashed = {
        "outcome": "failed",
        "phase": "smoke",
        "error": "CUDA out of memory",
        "calibration": None,
    }
    assert to_result(crashed, "") == {
        "smoke": None,
        "calibration": None,
        "error": "CUDA out of memory",
        "phase": "smoke",
    }
