"""What a stop cost: downtime (stop to healthy), drains that ran out of time, and the fleet
summary's columns for them (sglang_fleet/smoke/downtime.py, sglang_fleet/smoke/gate.py)."""

from __future__ import annotations

import pytest

from sglang_fleet.rollout.fleet_summary import format_rollout_table, rollout_rows
from sglang_fleet.smoke.downtime import downtime_seconds, drain_note, killed_at_stop, stop_notes

RUNNING = {"was_running": True, "stop_result": "success", "downtime_seconds": 21.34}


def test_downtime_counts_only_a_server_that_was_running() -> None:
    assert downtime_seconds(RUNNING) == pytest.approx(21.34)
    assert downtime_seconds({**RUNNING, "was_running": False}) is None
    assert downtime_seconds(None) is None


@pytest.mark.parametrize("bad", [None, "nan", float("inf"), -1.0, "x", True])
def test_a_broken_downtime_reading_is_no_figure(bad: object) -> None:
    assert downtime_seconds({**RUNNING, "downtime_seconds": bad}) is None


def test_a_clean_drain_says_nothing() -> None:
    assert drain_note({"drained": True, "running_reqs": 0, "drain_seconds": 3.2}, RUNNING) is None
    assert drain_note(None, RUNNING) is None


def test_a_drain_out_of_time_that_sigterm_finished_is_not_called_cut() -> None:
    note = drain_note({"drained": False, "running_reqs": 3, "drain_seconds": 300.2}, RUNNING)
    assert note == (
        "drain ran out of time after 300 s with 3 request(s) still running; "
        "they finished in SGLang's own SIGTERM drain (not killed)"
    )


def test_a_drain_killed_by_systemd_names_the_requests_cut() -> None:
    killed = {**RUNNING, "stop_result": "timeout"}
    assert killed_at_stop(killed)
    note = drain_note({"drained": False, "running_reqs": 2.0, "drain_seconds": 30}, killed)
    assert note is not None
    assert note.endswith(
        "systemd killed the server at the end of TimeoutStopSec: up to 2 request(s) cut"
    )


def test_a_kill_without_a_router_drain_is_still_reported() -> None:
    note = drain_note(None, {**RUNNING, "stop_result": "timeout"})
    assert note == "systemd killed the server at the end of TimeoutStopSec: requests cut"


def test_a_stopped_server_that_was_not_running_was_not_killed() -> None:
    assert not killed_at_stop({"was_running": False, "stop_result": "timeout"})


def test_stop_notes_one_line_per_stopped_server() -> None:
    lines = stop_notes(
        ["a", "b", "c"],
        {"a": RUNNING, "b": {**RUNNING, "stop_result": "timeout", "downtime_seconds": 40}},
        {"b": {"drained": False, "running_reqs": 1, "drain_seconds": 5}},
    )
    assert lines[0] == "a: down 21.3 s (stop to healthy)"
    assert lines[1].startswith("b: down 40.0 s (stop to healthy), drain ran out of time after 5 s")
    assert len(lines) == 2  # c has no record: no line


def _result(name: str, **extra: object) -> dict:
    return {
        "server": name,
        "config_hash": "abc123def456",
        "outcome": "passed",
        "output_throughput": 100.0,
        "p99_ttft_ms": 12.0,
        "message": "m",
        **extra,
    }


def test_the_table_shows_downtime_apart_from_copy_time_and_drain_notes() -> None:
    rows = rollout_rows(
        [
            {
                "host": "gpu1",
                "servers": [{"name": "a", "config_hash": "x"}, {"name": "b", "config_hash": "y"}],
                "results": [
                    _result("a", downtime_seconds=21.34, copy_seconds=312.0),
                    _result("b", downtime_seconds="20.0", copy_seconds=None, drain_note="cut 2"),
                ],
            }
        ]
    )
    lines = format_rollout_table(rows)
    assert lines[0].split()[7:10] == ["DOWN", "s", "COPY"]
    assert lines[1].split() == [
        "gpu1",
        "a",
        "abc123def456",
        "100.0",
        "12.0",
        "21.3",
        "312.0",
        "passed",
    ]
    assert lines[2].split()[5:7] == ["20.0", "-"]
    assert lines[-2] == "2 passed"
    assert lines[-1] == "gpu1 b: cut 2"


def test_the_table_without_restarts_keeps_its_columns() -> None:
    rows = rollout_rows(
        [{"host": "gpu1", "servers": [{"name": "a", "config_hash": "x"}], "results": []}]
    )
    assert "DOWN" not in format_rollout_table(rows)[0]
