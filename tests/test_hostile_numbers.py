"""Numbers that are JSON but not floats (issue 44, item 2): big integers, 5,000-digit text, NaN
and 1e999 reach every surface that takes a number from outside (docs/ARCHITECTURE.md,
"Numbers"). Each test fed them to a surface that let OverflowError, Python's 4,300-digit
ValueError or an IndexError escape, or echoed the whole value back; now each is a clean error
naming the input, or a figure left unmeasured."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest
from test_gate import smoke_result
from test_plan import KIMI_CONFIG, KIMI_HOST, KIMI_LOG, KIMI_WEIGHTS

from sglang_fleet.capacity.planner import plan
from sglang_fleet.capacity.planner_inputs import PlanInputError
from sglang_fleet.capacity.server_log import parse_log
from sglang_fleet.diagnosis.run_diagnosis import diagnose
from sglang_fleet.monitoring.settings import SettingError, check_settings
from sglang_fleet.rollout import restart
from sglang_fleet.rollout.fleet_summary import format_rollout_table
from sglang_fleet.servers.host_checks import server_errors
from sglang_fleet.smoke.gate import GateInputError, evaluate
from sglang_fleet.tuning import autotune_inputs, trial_outcome
from sglang_fleet.tuning.autotune_inputs import AutotuneInputError

HUGE = 10**400  # legal JSON; float() of it raises OverflowError
DIGITS = "9" * 5000  # int() of it raises ValueError past Python's 4,300-digit limit
HOSTILE = [HUGE, -HUGE, DIGITS, "1e999", math.nan, math.inf, True]


def _short(message: str) -> None:
    assert "9" * 100 not in message and len(message) < 400, message[:200]


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
@pytest.mark.parametrize(
    "key", ["tp_size", "context_length", "mem_fraction_static", "hicache_size"]
)
def test_the_planner_names_the_argument(key: str, value: Any) -> None:
    with pytest.raises(PlanInputError) as info:
        plan(KIMI_CONFIG, KIMI_WEIGHTS, {"tp_size": 8, key: value}, KIMI_HOST)
    assert info.value.argument == key
    _short(str(info.value))


@pytest.mark.parametrize("value", [HUGE, DIGITS, "nan"], ids=repr)
def test_the_planner_names_a_host_fact(value: Any) -> None:
    with pytest.raises(PlanInputError) as info:
        plan(KIMI_CONFIG, KIMI_WEIGHTS, {"tp_size": 8}, {**KIMI_HOST, "gpu_memory_mib": value})
    assert info.value.argument == "gpu_memory_mib"


@pytest.mark.parametrize(("flag", "value"), [("--tp-size", DIGITS), ("--hicache-size", "1e999")])
def test_the_planners_command_line_refuses_without_echoing(flag: str, value: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sglang_fleet.capacity.planner", "--model-path", "x", flag, value],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 2
    error = done.stderr.strip().splitlines()[-1]
    assert f"argument {flag}: must be" in error
    _short(error)


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
@pytest.mark.parametrize(
    "name",
    ["monitoring_alert_kv_cache_usage", "monitoring_slo_ttft_ms", "monitoring_prometheus_port"],
)
def test_a_monitoring_setting_names_itself(name: str, value: Any) -> None:
    with pytest.raises(SettingError) as info:
        check_settings({name: value})
    assert info.value.variable == name
    _short(str(info.value))


@pytest.mark.parametrize("value", [HUGE, DIGITS, "1e999", math.nan], ids=repr)
@pytest.mark.parametrize(
    "where",
    ["tolerance", "max_trials", "slo.p99_ttft_ms", "slo.max_failures", "space.mem_fraction_static"],
)
def test_autotune_inputs_name_the_variable(where: str, value: Any) -> None:
    inputs: dict[str, Any] = {
        "space": {"mem_fraction_static": [0.8]},
        "workload": {"input_len": 128, "output_len": 128, "concurrency": 4, "num_prompts": 8},
    }
    section, _, key = where.partition(".")
    if section == "slo":
        inputs["slo"] = {key: value}
    elif section == "space":
        inputs["space"] = {key: [value]}
    else:
        inputs[section] = value
    with pytest.raises(AutotuneInputError) as info:
        autotune_inputs.validate_inputs(**inputs)
    assert f"autotune_{where}" in str(info.value)
    _short(str(info.value))


@pytest.mark.parametrize("value", [HUGE, -HUGE, DIGITS], ids=repr)
def test_an_autotune_host_fact_that_is_no_count(value: Any) -> None:
    with pytest.raises(AutotuneInputError, match=r"host\.gpu_memory_mib"):
        autotune_inputs.check_context(
            {"host": {"gpu_memory_mib": value, "gpu_count": 8}, "model_config": {}},
            {"input_len": 1, "output_len": 1},
        )


@pytest.mark.parametrize("key", ["mem_fraction_static", "hicache_size"])
def test_the_cross_flag_checks_take_a_big_integer(key: str) -> None:
    flags = {"tp_size": 1, "mem_fraction_static": 0.8, "enable_hierarchical_cache": True, key: HUGE}
    server = {"name": "a", "port": 30000, "gpus": [0], "flags": flags}
    problems = server_errors(server, {"gpu_count": 1, "ram_mib": 1 << 20})
    assert any(p["variable"].endswith(f".{key}") for p in problems) or key == "hicache_size"


def test_the_fleet_summary_shows_a_figure_it_cannot_read_as_a_dash() -> None:
    row = {"host": "h", "server": "s", "config_hash": "c", "outcome": "passed"}
    lines = format_rollout_table([{**row, "downtime_seconds": HUGE, "copy_seconds": DIGITS}])
    assert all("9" * 20 not in line for line in lines)


@pytest.mark.parametrize(
    ("before", "after"), [("", "1.0"), ("x active", "1.0"), ("1.0 active", "nan"), ("1 a", DIGITS)]
)
def test_a_clock_that_is_no_number_leaves_the_downtime_unmeasured(before: str, after: str) -> None:
    assert restart.downtime(before, after)["downtime_seconds"] is None


@pytest.mark.parametrize("limit", [math.nan, "nan", HUGE, DIGITS], ids=repr)
def test_a_gate_threshold_that_is_no_number_is_refused(limit: Any) -> None:
    """A NaN minimum passed every result it was compared with; a huge one raised."""
    with pytest.raises(GateInputError, match="threshold min_output_tok_s must be a finite number"):
        evaluate(smoke_result(), {"min_output_tok_s": limit}, None)


def test_a_huge_figure_fails_the_gate_as_unmeasured() -> None:
    verdict = evaluate(smoke_result(output_throughput=HUGE), {"min_output_tok_s": 1}, None)
    assert verdict["passed"] is False
    assert "output_throughput is not a finite number (a 401-digit integer)" in str(verdict)


def test_the_diagnosis_leaves_a_huge_figure_out() -> None:
    result = smoke_result(max_concurrency=HUGE, concurrency=HUGE, output_throughput=-HUGE)
    verdict = diagnose(result)
    assert any("not finite numbers were left out" in note for note in verdict["notes"])


def test_a_trial_with_a_huge_figure_fails() -> None:
    """math.isfinite() of a 401-digit integer raised OverflowError inside the autotune record."""
    assert trial_outcome._not_finite({"output_throughput": HUGE, "completed": -HUGE}) == [
        "completed",
        "output_throughput",
    ]


def test_a_logged_layout_sglang_would_refuse_is_named() -> None:
    """--logged-flag attn_dp_size=9 beside a tp-8 log divided by zero in the prediction."""
    args = {
        "tp_size": 8,
        "calibration_log": KIMI_LOG.read_text(encoding="utf-8"),
        "calibration_log_flags": {"attn_dp_size": "9"},
    }
    with pytest.raises(PlanInputError, match=r"attn_dp_size 9 .* does not divide its tp_size 8"):
        plan(KIMI_CONFIG, KIMI_WEIGHTS, args, KIMI_HOST)


@pytest.mark.parametrize("value", ["x", [1], {"a": 1}], ids=repr)
def test_a_smoke_result_figure_of_the_wrong_kind_is_left_out(value: Any) -> None:
    """A smoke result read from a file (diagnose --smoke-result) raised ValueError."""
    verdict = diagnose(smoke_result(concurrency=value, max_concurrency=value, completed=value))
    assert verdict["evidence"]["client_concurrency_achieved"] is None


@pytest.mark.parametrize(
    "line",
    [
        "[2026-11-29 10:00:00 TP0] Load weight begin. avail mem=" + DIGITS + ".5 GB",
        "[2026-11-29 10:00:00 TP0] KV Cache is allocated. #tokens: " + DIGITS + ", KV size: 1 GB",
        "[2026-11-29 10:00:00] max_total_num_tokens=" + DIGITS + ", chunked_prefill_size=1, "
        "max_prefill_tokens=1, max_running_requests=1, context_len=1, available_gpu_mem=1 GB",
        "[2026-11-29 10:00:00] server_args=ServerArgs(tp_size=" + "9" * 400 + ", dp_size=1)",
    ],
    ids=["load-begin", "kv-tokens", "scheduler", "server-args-tp"],
)
def test_a_log_figure_no_sglang_prints_skips_its_line(line: str) -> None:
    """parse_log raised OverflowError (a 400-digit figure) or ValueError (5,000 digits)."""
    cal = parse_log(line)
    assert cal.pre_gib is None and cal.kv_tokens is None and cal.tp_size is None
    if "server_args" not in line:
        assert cal.unreadable_lines == 1
        assert "hold figures no SGLang prints" in (cal.long_lines_note() or "")
