"""Parsing bounded in time as well as bytes (issue 44, item 5).

Each parser below once held a regular expression whose backtracking cost time quadratic or
cubic in a line's length: the log parser's graph and KV lines (cubic: one line of 16 KiB took
5 to 20 CPU seconds), the Prometheus label reader, URL redaction, nvidia-smi's header, and the
flag check's help reader (quadratic). Each test feeds the line that triggered it and bounds the
CPU time per KiB, far above what the linear code needs (well under 1 ms per KiB) and far below
what the old code took; CPU time (process_time), so that a busy machine does not flake them.
Lines past a generous length are skipped (logs, /metrics) or cut (the health probe's journal).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import load_plugin
from kimi_job import FIXTURES, GPU, KIMI_LOG
from sglang_fleet.module_utils import fleet_http, nvidia_smi

from sglang_fleet.capacity import server_log
from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.capacity.planner import plan
from sglang_fleet.diagnosis.run_diagnosis import diagnose
from sglang_fleet.smoke.smoke_client import prometheus_text

PREFIX = "[2026-11-29 10:00:00 TP0] "
KIMI_DIR = FIXTURES / "models" / "kimi-k2.5-int4"
HOST = {"gpu_memory_mib": 97887, "host_ram_gib": 400, "gpu_count": 8, "gpu_name": GPU}


def repeated(piece: str, kib: int) -> str:
    return (piece * (kib * 1024 // len(piece) + 1))[: kib * 1024]


def cpu_seconds(parse: Callable[[Any], Any], text: Any) -> float:
    start = time.process_time()
    parse(text)
    return time.process_time() - start


def assert_bounded(parse: Callable[[Any], Any], text: str, ms_per_kib: float) -> None:
    kib = len(text) / 1024
    spent = cpu_seconds(parse, text)
    assert spent <= ms_per_kib * kib / 1000, f"{spent:.3f} CPU s for {kib:.0f} KiB"


# --------------------------------------------------------------------------- the log parser


@pytest.mark.parametrize(
    ("piece", "kib"),
    [
        # `Capture .*graph end\..*?avail mem=`: cubic; 8 KiB took 2.6 s, 16 KiB 20 s.
        ("Capture graph end.", 8),
        ("Capture cuda graph end. ", 8),
        # `KV Cache is allocated\.(?:.*?dtype: ...,)?.*?#tokens:`: cubic; 16 KiB took 5.4 s.
        ("KV Cache is allocated.dtype: a,", 16),
    ],
)
def test_a_repeated_memory_line_parses_in_bounded_time(piece: str, kib: int) -> None:
    assert_bounded(server_log.parse_log, PREFIX + repeated(piece, kib), ms_per_kib=50)


def test_the_memory_lines_still_read_what_they_read() -> None:
    cal = server_log.parse_log(KIMI_LOG)
    assert (cal.pre_gib, cal.post_gib, cal.kv_tokens) == (94.19, 24.03, 149800)
    assert cal.graph_end_avail_gib is not None and cal.decode_graph_max_bs is not None
    assert cal.kv_torch_dtype == "torch.bfloat16" and cal.long_lines == 0


def test_a_log_line_over_the_bound_is_skipped_and_said() -> None:
    line = PREFIX + "Load weight begin. avail mem=93.00 GB " + "x" * server_log.MAX_LINE_CHARS
    cal = server_log.parse_log(f"{line}\n{PREFIX}Load weight begin. avail mem=94.19 GB\n")
    assert (cal.pre_gib, cal.long_lines) == (94.19, 1)
    assert "1 line(s) of the log are longer than 64 KiB" in str(cal.long_lines_note())
    decode = PREFIX + "Decode batch, #running-req: 1, #token: 9, token usage: 0.01, "
    decode += "gen throughput (token/s): 50.0, #queue-req: 0"
    assert server_log.parse_decode_line(decode) is not None
    assert server_log.parse_decode_line(decode + " " * server_log.MAX_LINE_CHARS) is None


def test_the_planner_and_the_diagnosis_say_a_log_line_was_skipped() -> None:
    config, weights = read_model_dir(KIMI_DIR)
    log = KIMI_LOG + PREFIX + "x" * (server_log.MAX_LINE_CHARS + 1) + "\n"
    args = {"tp_size": 8, "mem_fraction_static": 0.85, "calibration_log": log}
    codes = [w["code"] for w in plan(config, weights, args, HOST)["warnings"]]
    assert "calibration_log_long_lines" in codes
    notes = diagnose({}, log)["notes"]
    assert any("longer than 64 KiB and were not read" in note for note in notes)


# --------------------------------------------------------------------------- other readers


def test_a_long_label_set_parses_in_bounded_time() -> None:
    # `([A-Za-z_][A-Za-z0-9_]*)="` tried at every letter of a run: 60 KiB took 11 s.
    line = "m{" + repeated("a", 60) + "} 1"
    assert_bounded(prometheus_text.parse_series, line, ms_per_kib=5)
    assert prometheus_text.parse_series(line) == [("m", {}, 1.0)]


def test_a_metrics_line_over_the_bound_is_skipped() -> None:
    long_value = "x" * prometheus_text.MAX_LINE_CHARS
    text = f'a{{l="{long_value}"}} 1\nb{{l="x"}} 2\n'
    assert prometheus_text.parse_series(text) == [("b", {"l": "x"}, 2.0)]


def test_a_long_url_is_redacted_in_bounded_time() -> None:
    # `\b([a-z][a-z0-9+.-]*://)` tried at every word start of a run: 60 KiB took 7.5 s.
    text = repeated(".a", 60)
    assert_bounded(fleet_http.redact_url, text, ms_per_kib=5)
    assert fleet_http.redact_url(text + "://u:p@h") == text + "://***@h"


def test_a_long_nvidia_smi_header_parses_in_bounded_time() -> None:
    # `\s*\[[^\]]*\]$` searched in a cell of 60 KiB of "[": 1.4 s.
    text = repeated("[", 60) + "\n0\n"
    assert_bounded(lambda t: nvidia_smi.parse_csv(t, ["index"]), text, ms_per_kib=5)


def test_a_help_text_with_an_unclosed_brace_parses_in_bounded_time() -> None:
    # The joined option line was counted again after each line it took: 512 KiB took 20 s.
    flags_check = load_plugin("plugins/modules/sglang_flags_check.py")
    text = "options:\n  --x {\n" + repeated("a\n", 512)
    assert_bounded(flags_check.parse_help, text, ms_per_kib=5)


def test_the_health_probe_cuts_a_long_journal_line() -> None:
    probe = load_plugin("plugins/modules/sglang_health_probe.py")
    journal = "x" * (probe.MAX_LINE_CHARS + 10) + " CUDA out of memory\nready\n"

    class Module:
        def run_command(self, argv: list[str]) -> tuple[int, str, str]:
            return 0, journal, ""

    lines = probe.journal_lines(Module(), "sglang@a.service", 0.0)
    assert [len(line) for line in lines] == [probe.MAX_LINE_CHARS, 5]
