"""The smoke gate's verdict (sglang_fleet.smoke.gate) and its Ansible filter wrapper.

Results follow docs/CONTRACTS.md (smoke result JSON); each test changes one figure of a
passing result and checks the failure names the threshold, the measured value and the gap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError
from conftest import load_plugin

from sglang_fleet.rollout.fleet_summary import format_rollout_table, rollout_rows
from sglang_fleet.smoke import gate
from sglang_fleet.smoke.gate import (
    GateInputError,
    compact,
    evaluate,
    failure_rate,
    same_workload,
)
from sglang_fleet.smoke.smoke_argv import smoke_argv
from sglang_fleet.smoke.smoke_client.command_line import build_parser

ROOT = Path(__file__).resolve().parent.parent


def smoke_result(**overrides: Any) -> dict[str, Any]:
    result: dict[str, Any] = {
        "backend": "sglang",
        "num_prompts": 16,
        "max_concurrency": 8,
        "request_rate": None,
        "random_input_len": 128,
        "random_output_len": 64,
        "seed": 42,
        "completed": 16,
        "failed": 0,
        "duration": 1.2,
        "output_throughput": 1200.0,
        "request_throughput": 13.3,
        "p99_ttft_ms": 40.0,
        "median_ttft_ms": 20.0,
        "p99_tpot_ms": 6.0,
        "median_tpot_ms": 5.5,
        "p99_itl_ms": 7.0,
        "concurrency": 7.8,
        "goodput": 1.0,
    }
    return result | overrides


ALL_LIMITS = {
    "min_output_tok_s": 800,
    "max_p99_ttft_ms": 100,
    "max_p99_tpot_ms": 10,
    "max_failure_rate": 0.0,
    "min_goodput": 0.9,
}


def test_a_result_within_every_limit_passes() -> None:
    verdict = evaluate(smoke_result(), ALL_LIMITS, None)
    assert verdict["passed"] is True
    assert verdict["failures"] == []
    assert verdict["summary"].startswith("PASS")
    assert "output 1200.0 tok/s" in verdict["summary"]


def test_low_throughput_says_which_threshold_and_by_how_much() -> None:
    verdict = evaluate(smoke_result(output_throughput=412.3), ALL_LIMITS, None)
    assert verdict["passed"] is False
    (failure,) = verdict["failures"]
    assert failure["code"] == "min_output_tok_s"
    assert (failure["metric"], failure["value"], failure["limit"]) == (
        "output_throughput",
        412.3,
        800,
    )
    assert failure["message"] == (
        "output_throughput 412.3 tok/s is below the minimum 800 (-48.5 %)"
    )
    assert failure["message"] in verdict["summary"]


@pytest.mark.parametrize(
    ("overrides", "code", "message"),
    [
        (
            {"p99_ttft_ms": 150.0},
            "max_p99_ttft_ms",
            "p99_ttft_ms 150.0 ms is above the maximum 100 (+50.0 %)",
        ),
        (
            {"p99_tpot_ms": 12.5},
            "max_p99_tpot_ms",
            "p99_tpot_ms 12.50 ms is above the maximum 10 (+25.0 %)",
        ),
        ({"goodput": 0.45}, "min_goodput", "goodput 0.450 is below the minimum 0.9 (-50.0 %)"),
        # A limit of 0 has no relative gap to show.
        (
            {"completed": 12, "failed": 4},
            "max_failure_rate",
            "failure_rate 0.250 is above the maximum 0 (4 of 16 requests failed)",
        ),
    ],
    ids=["ttft", "tpot", "goodput", "failures"],
)
def test_each_limit_fails_on_its_own(overrides: dict, code: str, message: str) -> None:
    verdict = evaluate(smoke_result(**overrides), ALL_LIMITS, None)
    assert [f["code"] for f in verdict["failures"]] == [code]
    assert verdict["failures"][0]["message"] == message


def test_several_failures_are_all_reported() -> None:
    result = smoke_result(output_throughput=100.0, p99_ttft_ms=900.0)
    verdict = evaluate(result, ALL_LIMITS, None)
    assert [f["code"] for f in verdict["failures"]] == ["min_output_tok_s", "max_p99_ttft_ms"]
    assert verdict["summary"].startswith("FAIL: output_throughput 100.0 tok/s")


def test_unset_limits_are_not_checked() -> None:
    result = smoke_result(output_throughput=1.0, p99_ttft_ms=1e6, goodput=None)
    verdict = evaluate(result, {"min_output_tok_s": None, "max_p99_ttft_ms": ""}, None)
    assert verdict["passed"] is True


def test_goodput_limit_without_slos_fails_with_a_hint() -> None:
    verdict = evaluate(smoke_result(goodput=None), {"min_goodput": 0.9}, None)
    (failure,) = verdict["failures"]
    assert failure["code"] == "metric_missing"
    assert "slo_ttft_ms" in failure["message"]


def test_a_run_that_sent_nothing_never_passes() -> None:
    verdict = evaluate(smoke_result(completed=0, failed=0), {}, None)
    assert verdict["passed"] is False
    assert verdict["failures"][0]["code"] == "no_requests"


def test_all_requests_failed_reads_as_failure_rate_one() -> None:
    result = smoke_result(completed=0, failed=16, output_throughput=0.0, p99_ttft_ms=None)
    assert failure_rate(result) == 1.0
    verdict = evaluate(result, {"max_failure_rate": 0.01, "max_p99_ttft_ms": 100}, None)
    codes = [f["code"] for f in verdict["failures"]]
    assert codes == ["no_output", "max_failure_rate", "metric_missing"]
    assert "p99 TTFT n/a ms" in verdict["summary"]


# What the smoke client reports for a server whose streams end cleanly after 1 of 64 tokens.
TRUNCATED = {
    "completed": 0,
    "failed": 16,
    "failure_reasons": {"short_output": 16},
    "output_throughput": 0.0,
    "total_output_tokens": 0,
    "p99_ttft_ms": 0.0,
    "p99_tpot_ms": 0.0,
    "goodput": None,
}


@pytest.mark.parametrize(
    "thresholds",
    [{}, {"max_failure_rate": None, "min_output_tok_s": None}, {"max_failure_rate": 1.0}],
    ids=["none", "all-null", "failures-allowed"],
)
def test_no_output_fails_whatever_the_thresholds(thresholds: dict[str, Any]) -> None:
    verdict = evaluate(smoke_result(**TRUNCATED), thresholds, None)
    assert verdict["passed"] is False
    (failure,) = verdict["failures"]
    assert failure["code"] == "no_output"
    assert failure["message"] == (
        "output_throughput is 0.0 tok/s: no request got the completion tokens it asked for "
        "(16 of 16 requests failed: short_output 16)"
    )
    assert "failed 16/16 (100.0 %) [short_output 16]" in verdict["summary"]


def test_missing_output_throughput_fails_too() -> None:
    result = smoke_result()
    del result["output_throughput"]
    (failure,) = evaluate(result, {}, None)["failures"]
    assert failure["code"] == "no_output"
    assert failure["value"] is None
    assert "output_throughput was not measured" in failure["message"]
    nan = evaluate(smoke_result(output_throughput=float("nan")), {}, None)
    assert [f["code"] for f in nan["failures"]] == ["no_output"]


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_figure_that_is_not_finite_never_passes_a_limit(value: float) -> None:
    # An infinite throughput would clear every minimum; an infinite latency is not a reading.
    output = evaluate(smoke_result(output_throughput=value), {"min_output_tok_s": 1}, None)
    assert {f["code"] for f in output["failures"]} == {"no_output", "metric_missing"}
    assert all(f["value"] is None for f in output["failures"])
    assert f"output_throughput is not a finite number ({value})" in output["failures"][0]["message"]
    ttft = evaluate(smoke_result(p99_ttft_ms=value), {"max_p99_ttft_ms": 500}, None)
    (failure,) = ttft["failures"]
    assert failure["code"] == "metric_missing"
    assert "p99_ttft_ms is not a finite number" in failure["message"]


def test_wrong_answers_count_in_the_failure_rate_with_their_reasons() -> None:
    result = smoke_result(
        completed=12, failed=4, failure_reasons={"short_output": 1, "no_final_record": 3}
    )
    verdict = evaluate(result, {"max_failure_rate": 0.0}, None)
    (failure,) = verdict["failures"]
    assert failure["code"] == "max_failure_rate"
    assert failure["message"] == (
        "failure_rate 0.250 is above the maximum 0 "
        "(4 of 16 requests failed: no_final_record 3, short_output 1)"
    )


def test_regression_against_last_known_good_of_the_same_workload() -> None:
    baseline = compact(smoke_result(output_throughput=1000.0))
    verdict = evaluate(smoke_result(output_throughput=700.0), {"max_regression_pct": 20}, baseline)
    (failure,) = verdict["failures"]
    assert failure["code"] == "regression"
    assert failure["message"] == (
        "output_throughput 700.0 tok/s is 30.0 % below the last-known-good 1000.0 tok/s of the "
        "same workload (allowed: 20 %)"
    )


def test_small_regression_passes_and_is_noted() -> None:
    baseline = compact(smoke_result(output_throughput=1000.0))
    verdict = evaluate(smoke_result(output_throughput=900.0), {"max_regression_pct": 20}, baseline)
    assert verdict["passed"] is True
    assert "-10.0 % vs last-known-good 1000.0 tok/s" in verdict["summary"]


def test_regression_is_not_judged_across_different_workloads() -> None:
    baseline = compact(smoke_result(output_throughput=5000.0, max_concurrency=64))
    verdict = evaluate(smoke_result(output_throughput=700.0), {"max_regression_pct": 5}, baseline)
    assert verdict["passed"] is True
    assert "another workload" in verdict["summary"]
    assert evaluate(smoke_result(), {"max_regression_pct": 5}, None)["passed"] is True


def test_same_workload_reads_full_and_compact_results() -> None:
    assert same_workload(smoke_result(), smoke_result(output_throughput=1.0))
    assert same_workload(smoke_result(), compact(smoke_result()))
    assert not same_workload(smoke_result(), compact(smoke_result(seed=7)))


def test_bad_thresholds_raise_naming_them() -> None:
    with pytest.raises(GateInputError, match="min_tok_s"):
        evaluate(smoke_result(), {"min_tok_s": 1}, None)
    with pytest.raises(GateInputError, match="max_p99_ttft_ms"):
        evaluate(smoke_result(), {"max_p99_ttft_ms": "fast"}, None)


def test_compact_keeps_metrics_workload_verdict_and_report() -> None:
    kept = compact(smoke_result(), {"verdict": "healthy", "levers": []}, "reports/h/s/t.json")
    assert kept["metrics"]["output_throughput"] == 1200.0
    assert kept["workload"]["max_concurrency"] == 8
    assert (kept["verdict"], kept["report"]) == ("healthy", "reports/h/s/t.json")
    assert "ttft_ms_all" not in kept["metrics"]


def _filter_module() -> Any:
    return load_plugin("plugins/filter/sglang_gate.py")


def test_a_restart_row_carries_its_figures_downtime_and_copy() -> None:
    filters = _filter_module().FilterModule().filters()
    server = {"name": "llama", "config_hash": "abc123", "model_path": "/srv/m"}
    smoke = {"measured": {"output_throughput": 900.0, "p99_ttft_ms": 40.0, "summary": "ok"}}
    restarted = {
        "downtime": {"was_running": True, "stop_result": "timeout", "downtime_seconds": 12.5},
        "drain": {"drained": False, "running_reqs": 3, "drain_seconds": 30},
    }
    row = filters["sglang_rollout_row"](
        server, "passed", smoke, restarted, {"/srv/m": {"copy_seconds": 7.0}}
    )
    assert (row["output_throughput"], row["p99_ttft_ms"], row["message"]) == (900.0, 40.0, "ok")
    assert (row["downtime_seconds"], row["copy_seconds"]) == (12.5, 7.0)
    assert "drain ran out of time after 30 s with 3 request(s)" in row["drain_note"]
    assert "systemd killed the server" in row["drain_note"]
    bare = filters["sglang_rollout_row"](server, "passed", {"skipped": True}, {}, None)
    assert bare["message"] == "healthy (no smoke gate)" and bare["downtime_seconds"] is None


def test_a_failed_row_says_why_and_a_node_other_than_0_has_no_figures() -> None:
    filters = _filter_module().FilterModule().filters()
    failed = {"failed": True, "msg": "too slow", "measured": {"output_throughput": 10.0}}
    server = {"name": "big", "config_hash": "abc123", "nodes": ["a", "b"], "node_rank": 0}
    row = filters["sglang_rollout_row"](server, "failed", failed, None, None, "too slow")
    assert (row["outcome"], row["message"], row["output_throughput"]) == (
        "failed",
        "too slow",
        10.0,
    )
    assert "downtime_seconds" not in row
    other = filters["sglang_rollout_row"](
        server | {"node_rank": 1}, "failed", failed, None, None, "x"
    )
    assert other["output_throughput"] is None
    with pytest.raises(AnsibleFilterError, match="passed or failed, not 'rolled back'"):
        filters["sglang_rollout_row"](server, "rolled back")


def _outcome(server: str, outcome: str, tok_s: float | None = None) -> dict[str, Any]:
    return {
        "server": server,
        "config_hash": "abc123def456",
        "outcome": outcome,
        "output_throughput": tok_s,
        "p99_ttft_ms": 12.0 if tok_s else None,
        "message": "m",
    }


def test_rollout_rows_cover_every_server_and_host() -> None:
    hosts = [
        {
            "host": "gpu1",
            "servers": [{"name": "a", "config_hash": "h-a"}, {"name": "b", "config_hash": "h-b"}],
            "results": [_outcome("a", "rolled back", 180.0)],
            "error": "a: the new configuration failed",
        },
        {"host": "gpu2", "servers": None, "results": [], "error": None},
        {"host": "gpu3", "servers": None, "results": [], "error": "gpu3 is being deployed by x"},
    ]
    rows = rollout_rows(hosts)
    assert [(r["host"], r["server"], r["outcome"]) for r in rows] == [
        ("gpu1", "a", "rolled back"),
        ("gpu1", "b", "unchanged"),
        ("gpu2", "-", "not reached"),
        ("gpu3", "-", "failed"),
    ]
    assert rows[1]["config_hash"] == "h-b"
    assert rows[3]["message"] == "gpu3 is being deployed by x"


def test_rollout_table_aligns_columns_and_counts_outcomes() -> None:
    rows = rollout_rows(
        [
            {
                "host": "gpu1",
                "servers": [{"name": "a", "config_hash": "x"}],
                "results": [_outcome("a", "passed", 1207.14)],
            }
        ]
    )
    lines = format_rollout_table(rows)
    assert lines[0].split() == ["HOST", "SERVER", "CONFIG", "TOK/S", "P99", "TTFT", "ms", "OUTCOME"]
    assert lines[1].split() == ["gpu1", "a", "abc123def456", "1207.1", "12.0", "passed"]
    assert lines[0].index("OUTCOME") == lines[1].index("passed")
    assert lines[-1] == "1 passed"


def test_fleet_summary_reads_hosts_the_check_play_grouped_but_the_rollout_never_reached() -> None:
    gate = load_plugin("plugins/filter/sglang_gate.py")
    servers = [{"name": "llama", "config_hash": "c"}]
    hostvars = {
        # checked, nothing to do
        "gpu1": {"sglang_server_servers": servers, "sglang_server_rollout_needed": False},
        # checked, rolled out
        "gpu2": {
            "sglang_server_servers": servers,
            "sglang_server_rollout_needed": True,
            "sglang_server_rollout_reached": True,
            "sglang_server_rollout_results": [_outcome("llama", "passed", 900.0)],
        },
        # checked, would change, the rollout stopped before it
        "gpu3": {"sglang_server_servers": servers, "sglang_server_rollout_needed": True},
    }
    lines = gate.sglang_rollout_table(["gpu1", "gpu2", "gpu3"], hostvars)
    # The last word of each row: "not reached" reads "reached".
    outcomes = {line.split()[0]: line.split()[-1] for line in lines[1:-1]}
    assert outcomes == {"gpu1": "unchanged", "gpu2": "passed", "gpu3": "reached"}
    assert lines[-1] == "1 passed, 1 unchanged, 1 not reached"


def test_under_check_the_fleet_summary_says_which_servers_would_restart() -> None:
    gate = load_plugin("plugins/filter/sglang_gate.py")
    servers = [{"name": "a", "config_hash": "h-a"}, {"name": "b", "config_hash": "h-b"}]
    hostvars = {
        "gpu1": {
            "sglang_server_servers": servers,
            "sglang_server_rollout_needed": True,
            "sglang_server_rollout_reached": True,
            "sglang_server_restart_names": ["a"],
        }
    }
    checked = gate.sglang_rollout_table(["gpu1"], hostvars, True)
    assert [line.split()[-1] for line in checked[1:3]] == ["restart", "unchanged"]
    assert checked[1].split()[-2:] == ["would", "restart"]
    assert checked[-1] == "1 would restart, 1 unchanged"
    # A real run that restarted nothing (its results are empty) does not pretend it would.
    assert gate.sglang_rollout_table(["gpu1"], hostvars)[-1] == "2 unchanged"


REFUSAL = (
    "mem_fraction_static 0.970 leaves a predicted 1.26 GiB free after CUDA graph capture, "
    "below the 5.0 GiB margin"
)


def test_a_calibrated_refusal_is_its_own_outcome_without_a_second_failure_row() -> None:
    rows = rollout_rows(
        [
            {
                "host": "gpu1",
                "servers": [
                    {"name": "a", "config_hash": "h-a"},
                    {"name": "b", "config_hash": "h-b"},
                ],
                "results": [],
                "error": f"sglang_server_instances[a]: {REFUSAL}",
                "refused": {"a": REFUSAL},
            }
        ]
    )
    assert [(r["server"], r["outcome"]) for r in rows] == [
        ("a", "refused (calibrated)"),
        ("b", "unchanged"),
    ]
    assert rows[0]["message"] == REFUSAL
    assert format_rollout_table(rows)[-1] == "1 refused (calibrated), 1 unchanged"


def test_the_fleet_summary_filter_reads_the_preflights_refusal() -> None:
    table = load_plugin("plugins/filter/sglang_gate.py").FilterModule().filters()
    hostvars = {
        "gpu1": {
            "sglang_server_servers": [{"name": "a", "config_hash": "h-a"}],
            "sglang_server_failure": f"sglang_server_instances[a]: {REFUSAL}",
            "sglang_server_preflight": {"calibration_refused": {"a": REFUSAL}},
        },
        "gpu2": {"sglang_server_servers": [{"name": "a", "config_hash": "h-a"}]},
    }
    lines = table["sglang_rollout_table"](["gpu1", "gpu2"], hostvars)
    assert lines[1].split()[-2:] == ["refused", "(calibrated)"]
    assert lines[2].split()[-1] == "unchanged"
    assert len(lines) == 4  # header, two rows, counts: no extra "failed" row for gpu1


def test_smoke_argv_is_the_clients_command_with_the_key_from_stdin() -> None:
    workload = {"backend": "sglang", "num_prompts": 64, "max_concurrency": 16,
                "random_output_len": 128, "slo_ttft_ms": None, "request_rate": 2.5}  # fmt: skip
    argv = smoke_argv(workload, python="/usr/bin/python3", client="/x/smoke.py", port=30000,
                           json_path="/s/r.json", timeout=600)  # fmt: skip
    assert argv[:6] == ["timeout", "--kill-after=10", "600", "/bin/sh", "-c", argv[5]]
    assert "read -r SGLANG_API_KEY" in argv[5] and 'exec "$0" "$@"' in argv[5]
    assert argv[6:] == [
        "/usr/bin/python3", "/x/smoke.py", "--url", "http://127.0.0.1:30000", "--json",
        "/s/r.json", "--timeout", "600", "--backend", "sglang", "--num-prompts", "64",
        "--max-concurrency", "16", "--random-output-len", "128", "--request-rate", "2.5",
    ]  # fmt: skip
    # What the client parses is what the workload asked for (the SLO left out was null).
    parsed = build_parser().parse_args(argv[8:])
    assert (parsed.num_prompts, parsed.max_concurrency, parsed.request_rate) == (64, 16, 2.5)
    assert parsed.slo_ttft_ms is None


@pytest.mark.parametrize("key", ["num_promptz", "url", "api_key", "json"])
def test_smoke_argv_refuses_a_key_the_client_does_not_take_from_a_workload(key: str) -> None:
    with pytest.raises(gate.GateInputError, match=f"smoke_gate_workload.{key}: not a workload"):
        smoke_argv({key: 1}, python="p", client="c", port=1, json_path="j", timeout=1)
