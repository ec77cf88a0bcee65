"""The planner's two calibration paths (sglang_fleet/capacity/planner_calibration.py): the
store path reads the host's records once by the store's rule, the log path builds one record
from a start-up log, and both meet once in calibration_apply.apply, which does not read them
again. Run alone: .venv/bin/pytest -q tests/test_planner_calibration.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kimi_job import GPU, KIMI_LOG, KIMI_RUN_FLAGS
from test_calibration import HOST as CALIBRATION_HOST
from test_calibration import KEY

from sglang_fleet.capacity import calibration_apply, calibration_record, calibration_store, planner
from sglang_fleet.capacity.model_config import model_shape, read_model_dir

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CONFIG, WEIGHTS = read_model_dir(FIXTURES / "models" / "kimi-k2.5-int4")
HOST = {"gpu_memory_mib": 97887, "gpu_name": GPU, "host_ram_gib": 1000, "gpu_count": 8}
BASE = {"tp_size": 8, "sglang_version": "0.5.23", "plan_layouts": False}


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every call of the store's reader, wherever it is called from."""
    calls: list[Any] = []
    real = calibration_store.read_store

    def counting(text: Any) -> calibration_store.StoreRead:
        calls.append(text)
        return real(text)

    monkeypatch.setattr(calibration_store, "read_store", counting)
    monkeypatch.setattr(calibration_apply, "read_store", counting)
    return calls


def test_the_store_path_reads_the_store_once(monkeypatch: pytest.MonkeyPatch) -> None:
    record = calibration_record.build_record(KIMI_LOG, None, KEY)
    calls = _reads(monkeypatch)
    args = BASE | {"calibration": [record, {"schema": 1}], "server_flags": dict(KIMI_RUN_FLAGS)}
    result = planner.plan(CONFIG, WEIGHTS, args, HOST)
    assert len(calls) == 1, "the planner's store path reads the store once, apply never again"
    assert result["details"]["calibrated"]
    assert len(result["details"]["calibration_set_aside"]) == 1  # the damaged entry, named


def test_the_log_path_builds_its_record_and_reads_no_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _reads(monkeypatch)
    result = planner.plan(CONFIG, WEIGHTS, BASE | {"calibration_log": KIMI_LOG}, HOST)
    assert calls == [None], "only the (absent) store is read; the log's record is not reread"
    assert result["details"]["calibrated"]
    assert result["details"]["calibration_log_flags"], "the logged run's flags are named"


def test_both_paths_plan_as_either_alone() -> None:
    """A stored record and the same start's log: the plan is the one either gives."""
    record = calibration_record.build_record(KIMI_LOG, None, KEY)
    stored = planner.plan(CONFIG, WEIGHTS, BASE | {"calibration": [record]}, HOST)
    both = planner.plan(
        CONFIG, WEIGHTS, BASE | {"calibration": [record], "calibration_log": KIMI_LOG}, HOST
    )
    assert both["details"]["free_after_graph_gib"] == stored["details"]["free_after_graph_gib"]
    assert both["max_total_num_tokens"] == stored["max_total_num_tokens"]


def test_apply_reads_records_given_as_data_but_not_a_store_read() -> None:
    """Records handed over as data still pass the store's rule; a StoreRead has passed it."""
    shape = model_shape(CONFIG)
    record = calibration_record.build_record(KIMI_LOG, None, KEY)
    host = CALIBRATION_HOST
    damaged = {**record, "measured": {**record["measured"], "pre_gib": -1.0}}
    as_data = calibration_apply.apply([damaged], dict(KIMI_RUN_FLAGS), host, shape)
    assert as_data.record is None and "no calibration usable" in as_data.reason
    as_read = calibration_apply.apply(
        calibration_store.StoreRead([record], []), dict(KIMI_RUN_FLAGS), host, shape
    )
    assert as_read.record is not None and as_read.prediction is not None
