"""Property-based tests of the surfaces that take a number from outside (Hypothesis; profiles in
tests/conftest.py; issue 44, item 2). Invariant: every value a JSON document, a log, a command
line or an inventory can hold (integers of any size, 5,000-digit text, NaN, infinities,
booleans, containers) is a number in range or the surface's own error naming the input, never
another exception and never the value echoed whole."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from sglang_fleet.module_utils import model_stage_args, typed_number
from sglang_fleet.module_utils.typed_number import finite_or_none
from test_gate import smoke_result
from test_plan import KIMI_CONFIG, KIMI_HOST, KIMI_LOG, KIMI_WEIGHTS

from sglang_fleet.capacity import logged_flags, planner_inputs
from sglang_fleet.capacity.planner import plan
from sglang_fleet.capacity.planner_inputs import PlanInputError
from sglang_fleet.diagnosis.run_diagnosis import diagnose
from sglang_fleet.monitoring.settings import NUMBERS, SettingError, check_settings
from sglang_fleet.rollout import restart
from sglang_fleet.smoke.gate import GateInputError, evaluate
from sglang_fleet.tuning import autotune_inputs
from sglang_fleet.tuning.autotune_inputs import AutotuneInputError

numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**500), max_value=10**500),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["nan", "inf", "-Infinity", "1e999", "9" * 5000, "0x10", "", " 8 ", "8\n"]),
    st.text(alphabet="0123456789.eE+- ", max_size=80),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)


def _short(message: str, limit: int = 600) -> None:
    assert "9" * 100 not in message and len(message) < limit, message[:200]


NUMERIC_ARGS = sorted(
    (planner_inputs._INT_RANGES.keys() | planner_inputs._FLOAT_RANGES.keys())
    - set(planner_inputs.HOST_KEYS)
)


@given(key=st.sampled_from(NUMERIC_ARGS), value=numbers)
def test_a_planner_argument_is_typed_or_named(key: str, value: Any) -> None:
    try:
        typed = planner_inputs.merge_args({key: value})
    except PlanInputError as exc:
        assert exc.argument == key
        _short(str(exc))
        return
    got = typed[key]
    if value is not None:
        assert isinstance(got, int | float) and math.isfinite(got)


@given(name=st.sampled_from(sorted(logged_flags.STATABLE)), value=numbers.map(str))
def test_a_logged_flag_is_typed_or_named(name: str, value: str) -> None:
    """--logged-flag NAME=VALUE beside a calibration log: a plan, or bad usage naming it."""
    args = {
        "tp_size": 8,
        "calibration_log": KIMI_LOG.read_text(encoding="utf-8"),
        "calibration_log_flags": {name: value},
    }
    try:
        plan(KIMI_CONFIG, KIMI_WEIGHTS, args, KIMI_HOST)
    except PlanInputError as exc:
        assert exc.argument == "calibration_log_flags", str(exc)
        _short(str(exc))


@given(name=st.sampled_from(sorted(NUMBERS)), value=numbers)
def test_a_monitoring_number_is_in_range_or_named(name: str, value: Any) -> None:
    try:
        checked = check_settings({name: value})[name]
    except SettingError as exc:
        assert exc.variable == name
        _short(str(exc))
        return
    assert NUMBERS[name].holds(checked)


@given(name=st.sampled_from(sorted(restart.NUMBERS)), value=numbers)
def test_a_cleanup_setting_is_in_range_or_named(name: str, value: Any) -> None:
    try:
        typed = restart.cleanup_settings({name: value})
    except restart.SettingsError as exc:
        assert f"gpu_cleanup_{name}" in str(exc)
        _short(str(exc))
        return
    assert value is None or restart.NUMBERS[name].holds(typed[name])


@given(key=st.sampled_from(sorted(model_stage_args.NUMBER_RANGES)), value=numbers)
def test_a_staging_number_is_in_range_or_named(key: str, value: Any) -> None:
    try:
        got = model_stage_args.number(value, f"model_stage_{key}", key)
    except model_stage_args.ArgError as exc:
        assert exc.variable == f"model_stage_{key}"
        _short(str(exc))
        return
    assert model_stage_args.NUMBER_RANGES[key].holds(got)


@given(
    where=st.sampled_from(["tolerance", "max_trials", "slo"]),
    value=numbers,
)
def test_an_autotune_input_is_typed_or_named(where: str, value: Any) -> None:
    inputs: dict[str, Any] = {
        "space": {"mem_fraction_static": [0.8]},
        "workload": {"input_len": 8, "output_len": 8, "concurrency": 1, "num_prompts": 1},
    }
    inputs[where] = {"p99_ttft_ms": value, "max_failures": value} if where == "slo" else value
    try:
        autotune_inputs.validate_inputs(**inputs)
    except AutotuneInputError as exc:
        _short(str(exc))


@given(
    name=st.sampled_from(["min_output_tok_s", "max_p99_ttft_ms", "max_failure_rate"]), value=numbers
)
def test_a_gate_threshold_is_a_number_or_refused(name: str, value: Any) -> None:
    try:
        verdict = evaluate(smoke_result(), {name: value}, None)
    except GateInputError as exc:
        assert name in str(exc)
        _short(str(exc))
        return
    assert isinstance(verdict["passed"], bool)


@given(
    name=st.sampled_from(["output_throughput", "p99_ttft_ms", "completed", "failed", "goodput"]),
    value=numbers,
)
def test_a_hostile_figure_never_passes_a_limit_it_cannot_read(name: str, value: Any) -> None:
    limits = {"min_output_tok_s": 1, "max_p99_ttft_ms": 1000, "max_failure_rate": 0.5}
    verdict = evaluate(smoke_result(**{name: value}), limits, None)
    _short(verdict["summary"], 2000)  # a finite float such as -1e87 is printed in full
    if finite_or_none(value) is None and name in ("output_throughput", "p99_ttft_ms"):
        assert verdict["passed"] is False


@given(
    name=st.sampled_from(["max_concurrency", "concurrency", "output_throughput", "duration"]),
    value=numbers,
)
def test_a_diagnosis_takes_any_figure(name: str, value: Any) -> None:
    verdict = diagnose(smoke_result(**{name: value}))
    assert isinstance(verdict["verdict"], str)


@given(
    st.one_of(
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=200),
        st.booleans(),
        st.none(),
        st.lists(st.integers(), max_size=2),
        st.integers(min_value=-(10**600), max_value=10**600),
    )
)
def test_any_value_is_a_number_in_range_or_a_number_error(value: Any) -> None:
    """plugins/module_utils/typed_number.py itself: a number in range or NumberError, nothing
    else."""
    try:
        got = typed_number.read(value, "x", typed_number.Range(1, 4096, integer=True))
    except typed_number.NumberError as exc:
        assert exc.what == "x"
        return
    assert isinstance(got, int) and 1 <= got <= 4096
