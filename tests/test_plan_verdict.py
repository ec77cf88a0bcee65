"""What a capacity plan means for the rollout (sglang_fleet.capacity.verdict, the
sglang_plan_verdict
filter): the line the pre-flight shows, a refusal on this host's calibration, and the message
that fails the host. Plans are the planner's own, for the Kimi job (tests/test_plan.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError
from conftest import load_plugin

from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.capacity.planner import plan
from sglang_fleet.capacity.verdict import OVERRULE_HINT, verdict

FIXTURES = Path(__file__).resolve().parent / "fixtures"
KIMI_CONFIG, KIMI_WEIGHTS = read_model_dir(FIXTURES / "models" / "kimi-k2.5-int4")
KIMI_LOG = (FIXTURES / "logs" / "constructed-kimi-k2.5-tp8-mf085-bf16.log").read_text()
KIMI_HOST = {"gpu_memory_mib": 97887, "host_ram_gib": 400, "gpu_count": 8}
WORKLOAD = {"avg_input_len": 1024, "avg_output_len": 1024}


def kimi(calibrated: bool, **args: Any) -> dict[str, Any]:
    full = {"tp_size": 8, **args, **({"calibration_log": KIMI_LOG} if calibrated else {})}
    return plan(KIMI_CONFIG, KIMI_WEIGHTS, full, KIMI_HOST)


def test_the_bounds_line_names_every_figure_of_the_plan():
    result = kimi(False, mem_fraction_static=0.85)
    said = verdict(result, "kimi", WORKLOAD, warnings_fatal=False)
    assert said["bounds"].startswith(
        f"kimi: {result['max_total_num_tokens']} KV tokens ({result['cell_size_bytes']} B/token),"
        f" about {result['max_concurrent_requests']} concurrent requests of 1024+1024 tokens,"
    )
    assert f"KV-bound output about {result['kv_bound_output_tok_s']} tok/s" in said["bounds"]
    assert f"{result['headroom_gib']} GiB outside the static pool" in said["bounds"]
    assert "Not calibrated: estimates only." in said["bounds"]
    for warning in result["warnings"]:
        assert f"WARNING {warning['code']}: {warning['message']}" in said["bounds"]
    assert "  " not in said["bounds"] and said["bounds"] == said["bounds"].strip()


def test_a_calibrated_plan_that_fits_says_so_and_blocks_nothing():
    result = kimi(True, mem_fraction_static=0.90, kv_cache_dtype="fp8_e4m3")
    said = verdict(result, "kimi", WORKLOAD, warnings_fatal=False)
    assert "GiB free after CUDA graph capture predicted" in said["bounds"]
    assert "highest safe mem_fraction_static 0.913." in said["bounds"]
    assert said["refusal"] == ""
    assert said["blocking"] == ""


def test_a_calibrated_refusal_blocks_with_the_way_to_overrule_it():
    result = kimi(True, mem_fraction_static=0.93, kv_cache_dtype="fp8_e4m3")
    said = verdict(result, "kimi", WORKLOAD, warnings_fatal=False)
    assert "highest fraction that keeps the margin is 0.913" in said["refusal"]
    assert said["blocking"].startswith("sglang_server_instances[kimi]: ")
    assert said["refusal"] in said["blocking"]
    assert said["blocking"].endswith(OVERRULE_HINT)
    assert "sglang_server_calibration_mode: warn" in said["blocking"]


def test_warn_mode_turns_the_refusal_into_a_warning_unless_warnings_are_fatal():
    result = kimi(True, mem_fraction_static=0.93, calibration_mode="warn")
    assert verdict(result, "kimi", WORKLOAD, warnings_fatal=False)["blocking"] == ""
    fatal = verdict(result, "kimi", WORKLOAD, warnings_fatal=True)
    assert fatal["refusal"] == ""  # a warning, not the calibration's refusal
    assert fatal["blocking"].startswith("sglang_server_instances[kimi]: ")
    assert "calibration_mode is 'warn'" in fatal["blocking"]
    assert not fatal["blocking"].endswith(OVERRULE_HINT)


def test_an_error_without_a_calibration_blocks_without_the_overrule_hint():
    result = kimi(False, mem_fraction_static=0.85, enable_hierarchical_cache=True, hicache_size=900)
    said = verdict(result, "kimi", WORKLOAD, warnings_fatal=False)
    assert result["errors"], result
    assert said["refusal"] == ""
    assert said["blocking"] == "sglang_server_instances[kimi]: " + " | ".join(
        e["message"] for e in result["errors"]
    )


def test_the_filter_refuses_what_is_not_a_plan_or_a_boolean():
    filters = load_plugin("plugins/filter/sglang_plan.py").FilterModule().filters()
    result = kimi(False, mem_fraction_static=0.85)
    assert filters["sglang_plan_verdict"](result, "kimi", WORKLOAD, False) == verdict(
        result, "kimi", WORKLOAD, warnings_fatal=False
    )
    with pytest.raises(AnsibleFilterError, match="warnings_fatal must be true or false"):
        filters["sglang_plan_verdict"](result, "kimi", WORKLOAD, "false")
    with pytest.raises(AnsibleFilterError, match="not a plan"):
        filters["sglang_plan_verdict"]({"errors": []}, "kimi", WORKLOAD, False)
