"""The health probe's verdicts: what ends the wait at once, and what keeps it waiting."""

from __future__ import annotations

import pytest
from conftest import load_plugin

probe = load_plugin("plugins/modules/sglang_health_probe.py")

RUNNING = {"ActiveState": "active", "SubState": "running", "NRestarts": "0"}


@pytest.mark.parametrize(
    "line",
    [
        "[2026-11-29 10:00:01 TP3] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate",
        "ValueError: Loaded weights leave no GPU memory for the KV cache under "
        "--mem-fraction-static=0.7. Raise --mem-fraction-static above 0.730",
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
        "[... TP0] Scheduler hit an exception: Traceback (most recent call last):",
        "torch.distributed.DistBackendError: NCCL error in: ../ProcessGroupNCCL.cpp",
        "[Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): "
        "address already in use",
    ],
)
def test_fatal_start_up_lines_of_sglang_end_the_wait(line):
    lines = ["Load weight begin. avail mem=94.84 GB", line, "later noise"]
    fatal = probe.first_fatal(lines, probe.DEFAULT_FATAL)
    assert fatal == line.strip()
    assert probe.classify(RUNNING, 503, fatal) == ("failed", line.strip())


def test_ordinary_start_up_lines_keep_waiting():
    lines = [
        "[2026-11-29 10:00:00 TP0] Load weight end. elapsed=3.1 s, avail mem=24.1 GB",
        "[2026-11-29 10:00:01 TP0] KV Cache is allocated. #tokens: 209000, KV size: 13.7 GB",
    ]
    assert probe.first_fatal(lines, probe.DEFAULT_FATAL) is None
    assert probe.classify(RUNNING, None, None) == ("starting", "")
    assert probe.classify(RUNNING, 503, None) == ("starting", "")


def test_health_200_is_healthy():
    assert probe.classify(RUNNING, 200, None) == ("healthy", "")


def test_a_restart_since_this_start_is_a_failure_but_older_restarts_are_not():
    restarted = {**RUNNING, "NRestarts": "3", "ExecMainStatus": "1"}
    state, cause = probe.classify(restarted, 503, None, restarts_baseline=2)
    assert state == "failed"
    assert "restarts 1" in cause
    assert probe.classify(restarted, 503, None, restarts_baseline=3) == ("starting", "")


@pytest.mark.parametrize("active", ["failed", "inactive"])
def test_a_dead_unit_is_a_failure_with_its_exit_status(active):
    dead = {"ActiveState": active, "SubState": "dead", "NRestarts": "0", "ExecMainStatus": "9"}
    state, cause = probe.classify(dead, None, None)
    assert state == "failed"
    assert "exit status 9" in cause
