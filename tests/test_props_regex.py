"""Property tests: every parser of outside text costs bounded time per KiB, and the linear
expressions match what the old backtracking ones matched (issue 44, item 5).

Three kinds of test:
- each parser entry point (the log parser and the logged flags read from it, /metrics, the live
  sampler, the router's in-flight count, nvidia-smi's CSV, SGLang's help and argparse error, URL
  redaction and checks, the health probe's fatal lines, the monitoring settings) is fed lines
  Hypothesis builds from the parser's own literal fragments, digits, blanks and separators,
  repeated to many KiB: a correct result or the parser's own clean error, within MS_PER_KIB;
- each rewritten expression is compared with the one it replaced (kept below as it was at
  a8010cc) on short strings, where the old one is fast: the same matches;
- every compiled expression of the product (tests/product_regexes.py) is timed, as the product
  calls it, against strings repeated from its own literal pieces: a cheap detector of the next
  backtracking expression. At a8010cc it flags all seven that were: the log's graph-end, KV
  and load-end (two) lines, /metrics labels, URL redaction and nvidia-smi's header unit.

Bounds are CPU time (process_time), far above what linear parsing needs (under 0.5 ms per KiB
here) and far below quadratic or cubic backtracking on the same strings; a call over its bound
is timed once more and the faster run counts, so that one pause does not fail a run.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import load_plugin
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from product_regexes import adversarial_units, literal_pieces, product_regexes, repeated
from sglang_fleet.module_utils import fleet_http, nvidia_smi

from sglang_fleet.capacity import logged_flags, server_log
from sglang_fleet.diagnosis import live_metrics
from sglang_fleet.monitoring import settings as monitoring_settings
from sglang_fleet.smoke.smoke_client import prometheus_text

flags_check = load_plugin("plugins/modules/sglang_flags_check.py")
router_workers = load_plugin("plugins/modules/sglang_router_workers.py")
health_probe = load_plugin("plugins/modules/sglang_health_probe.py")

LONG = hypothesis_settings.default.max_examples > 100
MAX_KIB = 32 if LONG else 12
MS_PER_KIB = 20
# The detector times single expressions, the cheapest work there is: a tighter bound.
DETECTOR_KIB = 32 if LONG else 8
DETECTOR_MS_PER_KIB = 2


def cpu_seconds(call: Callable[[], Any]) -> float:
    start = time.process_time()
    call()
    return time.process_time() - start


def assert_bounded(call: Callable[[], Any], chars: int, ms_per_kib: float, what: str) -> None:
    bound = ms_per_kib * chars / 1024 / 1000
    spent = cpu_seconds(call)
    if spent > bound:
        spent = min(spent, cpu_seconds(call))
    assert spent <= bound, f"{what}: {spent:.4f} CPU s for {chars / 1024:.1f} KiB"


# --------------------------------------------------------------------------- entry points

SERVER_LOG = "sglang_fleet/capacity/server_log.py"
PROMETHEUS = "sglang_fleet/smoke/smoke_client/prometheus_text.py"
ROUTER_WORKERS = "plugins/modules/sglang_router_workers.py"
LOG = [
    "[2026-11-29 10:00:00 TP0] ", "[", "]", " DP1", " TP3", "Load weight begin. ",
    "Load weight end.", " elapsed=3.1 s,", " avail mem=", "94.19", " GB", ", mem usage=",
    "-0.01", " type=", "DeepseekV3ForCausalLM", "KV Cache is allocated.", " dtype: ",
    "torch.bfloat16", ",", " #tokens: ", "149800", "KV size: ", "K size: ", ", V size: ",
    "Reserving ", " GB of the KV budget", "Memory pool end.", "Capture ", "cuda ", "target ",
    "decode ", "graph end.", " bs=[", "1, 2, 4", "]", "max_total_num_tokens=",
    ", chunked_prefill_size=", ", max_prefill_tokens=", ", max_running_requests=",
    ", context_len=", ", available_gpu_mem=", "Decode batch", " [3]", ", #running-req: ",
    ", #token: ", ", token usage: ", "0.5", ", cuda graph: True, ",
    "gen throughput (token/s): ", ", #queue-req: ", "server_args=", "{", "}",
    "'tp_size': ", "mem_fraction_static=", "model_path=", "'kv_cache_dtype': ", "device=",
    "ServerArgs(", "(", ")", "'", '"', " ", "  ", "=", ":", "x", "\t",
    "KV Cache VA upper bound", "Post-capture KV sizing",
]  # fmt: skip
METRICS = [
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput", "{", "}",
    'tp_rank="0"', "model_name=", '"', "\\", '\\"', ",", "a", "_", "9", " ", "\t", "1.5",
    "NaN", "+Inf", "# HELP ", "=", "le=", "\n",
]  # fmt: skip
NVIDIA_SMI = [
    "index", "pid", "process_name", "used_memory", "used_gpu_memory", " [MiB]", "[", "]",
    ", ", ",", "97", " MiB", "[N/A]", "[Not Supported]", "N/A", "python3", " ", "-1.5",
    "%", "W", "\n",
]  # fmt: skip
HELP = [
    "usage: launch_server.py [-h]", "options:", "\n", "  ", "--tp-size", "--tp", ", ", " ",
    "TP_SIZE", "{", "}", "auto,fp8_e5m2", "[", "]", "...", "-h", "--help", "  help text",
    "error: argument ", "--kv-cache-dtype", ": ", "invalid choice: 'x'",
]  # fmt: skip
URLS = [
    "http", "https", "://", "user", ":", "secret", "@", "host", ".", "-", "+", "/", "a",
    "0", " ", "[::1]", "8000", "?", "_", "é",
]  # fmt: skip
SETTINGS = ["0", "1", "30", "s", "m", "ms", "h", "d", "w", "y", "min", " ", ".", "5", "e", "-"]


def _fetch_body(text: str) -> Callable[[str], tuple[int, bytes]]:
    return lambda _path: (200, text.encode())


def _live_metrics(text: str) -> None:
    with contextlib.suppress(live_metrics.SampleError):
        live_metrics.read_metrics(_fetch_body(text), "http://127.0.0.1:30000")


def _in_flight(text: str) -> None:
    with contextlib.suppress(ValueError):  # a reading that is no count: the caller's RouterError
        router_workers.parse_in_flight(text)


def _nvidia_smi(text: str) -> None:
    for value in text.split(",")[:64]:
        nvidia_smi.parse_value(value)
    with contextlib.suppress(nvidia_smi.NvidiaSmiError):
        nvidia_smi.parse_csv(text, ["pid", "process_name", "used_memory"])


def _help(text: str) -> None:
    flags_check.parse_help(text)
    flags_check.parser_error(text)


def _url(text: str) -> None:
    fleet_http.redact_url(text)  # what it redacts: the comparison with the old expression below
    with contextlib.suppress(fleet_http.HttpError):
        fleet_http.check_url(text)


def _settings(text: str) -> None:
    checks = (
        lambda: monitoring_settings.duration_ms(text, "v", positive=False),
        lambda: monitoring_settings.systemd_span(text, "v"),
        lambda: monitoring_settings.number(text, "v", monitoring_settings.Range(0, 10)),
    )
    for check in checks:
        with contextlib.suppress(monitoring_settings.SettingError):
            check()


def _fatal(text: str) -> None:
    health_probe.first_fatal(health_probe.log_lines(text), health_probe.DEFAULT_FATAL)


def _logged_flags(text: str) -> None:
    logged_flags.infer(server_log.parse_log(text), None, None, stated={})


# Each entry point: the parser, the files whose expressions it runs, fragments of its input.
ENTRY_POINTS: dict[str, tuple[Callable[[str], Any], tuple[str, ...], list[str]]] = {
    "server_log.parse_log": (server_log.parse_log, (SERVER_LOG,), LOG),
    "server_log.parse_decode_line": (server_log.parse_decode_line, (SERVER_LOG,), LOG),
    "logged_flags.infer": (_logged_flags, (SERVER_LOG,), LOG),
    "prometheus_text.parse_series": (prometheus_text.parse_series, (PROMETHEUS,), METRICS),
    "prometheus_text.parse_prometheus": (prometheus_text.parse_prometheus, (PROMETHEUS,), METRICS),
    "live_metrics.read_metrics": (_live_metrics, (PROMETHEUS,), METRICS),
    "sglang_router_workers.parse_in_flight": (_in_flight, (ROUTER_WORKERS,), METRICS),
    "nvidia_smi": (_nvidia_smi, ("plugins/module_utils/nvidia_smi.py",), NVIDIA_SMI),
    "sglang_flags_check": (_help, ("plugins/modules/sglang_flags_check.py",), HELP),
    "fleet_http": (_url, ("plugins/module_utils/fleet_http.py",), URLS),
    "sglang_health_probe.first_fatal": (_fatal, (), LOG),
    "monitoring.settings": (_settings, ("sglang_fleet/monitoring/settings.py",), SETTINGS),
}


def _words(files: tuple[str, ...]) -> tuple[str, ...]:
    """The literal runs of three characters or more of the expressions these files hold."""
    pieces = [p for r in product_regexes() if r.file in files for p in literal_pieces(r.pattern)]
    return tuple(sorted({piece for piece in pieces if len(piece) >= 3}))


def _units(fragments: list[str], words: tuple[str, ...] = ()) -> st.SearchStrategy[str]:
    """A few fragments (half of them, on average, the expressions' own words) joined."""
    one = st.sampled_from(fragments)
    if words:
        one = st.one_of(st.sampled_from(words), one)
    return st.lists(one, min_size=1, max_size=5).map("".join)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@given(data=st.data())
def test_each_parser_costs_bounded_time_per_kib(entry: str, data: st.DataObject) -> None:
    parse, files, fragments = ENTRY_POINTS[entry]
    unit = data.draw(_units(fragments, _words(files)), label="unit")
    head = data.draw(st.sampled_from(["", fragments[0]]), label="head")
    text = head + repeated(unit, 1024 * data.draw(st.integers(1, MAX_KIB), label="kib"))
    assert_bounded(lambda: parse(text), len(text), MS_PER_KIB, entry)


# --------------------------------------------------------------------------- same matches

# The expressions as they were at a8010cc (backtracking, fast on short strings).
OLD_NUM = r"(\d+(?:\.\d+)?)"
OLD_PREFIX = re.compile(r"^\[(?P<head>[^\]]*)\]\s*(?P<msg>.*)$")
OLD_LOAD_END = re.compile(
    rf"Load weight end\..*?avail mem={OLD_NUM} GB, mem usage=(-?\d+(?:\.\d+)?) GB"
)
OLD_LOAD_TYPE = re.compile(r"Load weight end\..*?type=(\w+)")
OLD_KV_ALLOC = re.compile(
    rf"KV Cache is allocated\.(?:.*?dtype: ([\w.]+),)?.*?#tokens: (\d+), "
    rf"(?:KV size: {OLD_NUM} GB|K size: {OLD_NUM} GB, V size: {OLD_NUM} GB)"
)
OLD_GRAPH_END = re.compile(rf"Capture .*graph end\..*?avail mem={OLD_NUM} GB", re.IGNORECASE)
OLD_GRAPH_BS = re.compile(
    r"Capture (?:target )?decode .*graph end\. bs=\[([\d, ]+)\]", re.IGNORECASE
)
OLD_DECODE = re.compile(
    r"Decode batch(?: \[\d+\])?, #running-req: (\d+), #token: (\d+), token usage: "
    rf"{OLD_NUM}, .*?gen throughput \(token/s\): {OLD_NUM}, #queue-req: (\d+)"
)
OLD_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
OLD_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]*@")
OLD_HEADER_UNIT = re.compile(r"\s*\[[^\]]*\]$")


def old_split(line: str) -> tuple[str, str]:
    match = OLD_PREFIX.match(line.strip())
    if not match:
        return "", line.strip()
    return " ".join(server_log._RANK.findall(match["head"])), match["msg"]


def old_invocation_lines(text: str) -> list[str]:
    lines = text.splitlines()
    if lines and lines[0].lower().startswith("usage:"):
        end = next((i for i, line in enumerate(lines) if not line.strip()), len(lines))
        lines = lines[end:]
    indents = [len(line) - len(line.lstrip()) for line in lines if line.lstrip().startswith("-")]
    if not indents:
        return []
    indent = min(indents)
    result: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if len(line) - len(line.lstrip()) != indent or not line.lstrip().startswith("-"):
            continue
        joined = line.strip()
        while joined.count("{") > joined.count("}") and index < len(lines):
            joined += lines[index].strip()
            index += 1
        result.append(joined)
    return result


def _groups(match: re.Match[str] | None) -> tuple[Any, ...] | None:
    return None if match is None else match.groups()


# Distinct figures, so that a match of the wrong figure shows.
SHORT_LOG = [*LOG, "1", "2.5", "30", " GB, mem usage=", "CAPTURE ", "Graph End.", "\n", "\x0b"]


@given(_units(SHORT_LOG).flatmap(lambda a: _units(SHORT_LOG).map(lambda b: a + b)))
def test_the_log_lines_match_what_the_old_expressions_matched(msg: str) -> None:
    assert server_log._split(msg) == old_split(msg)
    load_end = server_log._head_then(msg, server_log._LOAD_END, server_log._LOAD_END_MEMORY)
    assert _groups(load_end) == _groups(OLD_LOAD_END.search(msg))
    load_type = server_log._head_then(msg, server_log._LOAD_END, server_log._LOAD_END_TYPE)
    assert _groups(load_type) == _groups(OLD_LOAD_TYPE.search(msg))
    kv = server_log._kv_allocated(msg)
    assert (None if kv is None else (kv[0], *kv[1].groups())) == _groups(OLD_KV_ALLOC.search(msg))
    assert _groups(server_log._graph_avail(msg)) == _groups(OLD_GRAPH_END.search(msg))
    assert _groups(server_log._graph_batch_sizes(msg)) == _groups(OLD_GRAPH_BS.search(msg))
    decode = server_log._decode_batch(msg)
    new_decode = None if decode is None else decode[0].groups() + decode[1].groups()
    assert new_decode == _groups(OLD_DECODE.search(msg))


LABELS = ['a="1"', "a", "Z", "_", "9", "=", '"', "\\", '\\"', ",", " ", "le", '="', "é", "x="]


@given(st.lists(st.sampled_from(LABELS), max_size=14).map("".join))
def test_labels_are_read_as_the_old_expression_read_them(text: str) -> None:
    assert prometheus_text._LABEL.findall(text) == OLD_LABEL.findall(text)


# The Kelvin sign and the long s are letters [a-z] takes under IGNORECASE.
URL_PIECES = [*URLS, "\u212a", "\u017f", "9", "_http", "HTTP", "a.b", "\n", "://u:p@h"]


@given(st.lists(st.sampled_from(URL_PIECES), max_size=14).map("".join))
def test_urls_are_redacted_as_the_old_expression_redacted_them(text: str) -> None:
    assert fleet_http.redact_url(text) == OLD_USERINFO.sub(r"\1***@", text)


@given(st.lists(st.sampled_from(["memory", " ", "[", "]", "MiB", "\t", "x", "\n"]), max_size=10))
def test_header_units_are_cut_as_the_old_expression_cut_them(pieces: list[str]) -> None:
    cell = "".join(pieces)
    assert nvidia_smi._header_name(cell) == OLD_HEADER_UNIT.sub("", cell.strip())


@given(st.lists(st.sampled_from(HELP), max_size=20).map("".join))
def test_help_lines_are_joined_as_before(text: str) -> None:
    assert flags_check._invocation_lines(text) == old_invocation_lines(text)


# --------------------------------------------------------------------------- every expression


@pytest.mark.parametrize("regex", product_regexes(), ids=str)
def test_no_product_expression_backtracks_on_its_own_pieces(regex: Any) -> None:
    chars = DETECTOR_KIB * 1024
    for unit in adversarial_units(regex.pattern):
        text = repeated(unit, chars)
        if isinstance(regex.pattern.pattern, bytes):  # a bytes pattern reads bytes
            text = text.encode("utf-8", "surrogateescape")
        for call in regex.calls:
            run = functools.partial(getattr(regex.pattern, call), text)
            assert_bounded(run, chars, DETECTOR_MS_PER_KIB, f"{regex} {call} {unit!r}")
