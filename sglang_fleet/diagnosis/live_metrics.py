"""Sample a running SGLang server without touching it: /metrics over a window, /server_info once.

Standard library only, Python >= 3.9: it runs on a GPU host (servers listen on loopback there)
with the host's python3, as one file: the diagnosis role ships it as a zipapp
(sglang_fleet/host_zipapp.py) holding this module, the one HTTP reader
(plugins/module_utils/fleet_http.py) and the one Prometheus text parser
(sglang_fleet/smoke/smoke_client/prometheus_text.py). On the host, and from the repo:

    python3 live.pyz --url http://127.0.0.1:30000 [--window 30] [--interval 1] \\
        [--api-key-file FILE] [--json OUT]
    python3 -m sglang_fleet.diagnosis.live_metrics --url http://127.0.0.1:30000

It only reads: GET /metrics every --interval seconds for --window seconds, and GET /server_info
once. /metrics is exempt from SGLang's API key, /server_info is not: the key comes from
--api-key-file (``/dev/stdin`` works) or the SGLANG_API_KEY environment variable, never from
the command line (visible to every user of the host in ``ps``).

Prints (and with --json also writes) one JSON object, the "live sample" of docs/DIAGNOSIS.md:
``server_metrics`` in the shape the smoke result has (docs/CONTRACTS.md), ``server_info`` (the
resolved flags the levers need, never the key), ``warnings`` and ``error``. Exit status: 0
sampled; 1 the server could not be sampled (``error.code``: unreachable, timeout, too_large,
redirect, no_metrics, unauthorized, http_error, bad_response); 2 bad usage. Every request is
bounded as a whole (HTTP_TIMEOUT_S), redirects are never followed (the key stays on the host it
was given for), and a URL is printed without its ``user:password@``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import stat
import sys
import time
from typing import Any, Callable

from sglang_fleet import server_secrets
from sglang_fleet.module_utils import fleet_http, typed_number
from sglang_fleet.module_utils.typed_number import Range
from sglang_fleet.smoke.smoke_client.prometheus_text import parse_series

HttpError, redact_url, request = fleet_http.HttpError, fleet_http.redact_url, fleet_http.request
check_http_url = fleet_http.check_url

DEFAULT_WINDOW_S = 30.0
DEFAULT_INTERVAL_S = 1.0
HTTP_TIMEOUT_S = 10.0  # one whole request: connect, headers and body
MIN_INTERVAL_S = 0.1  # each reading is a scrape the server serves; 10 a second is plenty
MAX_METRICS_BYTES = 16 << 20

# Scheduler gauges (docs/DIAGNOSIS.md, "What /metrics holds"): one series per scheduler that
# reports, labelled tp_rank, pp_rank, moe_ep_rank and, with data parallelism, dp_rank.
M_RUNNING = "sglang:num_running_reqs"
M_QUEUE = "sglang:num_queue_reqs"
M_TOKEN_USAGE = "sglang:token_usage"
M_GEN_THROUGHPUT = "sglang:gen_throughput"
M_MAX_TOTAL_TOKENS = "sglang:max_total_num_tokens"
# Speculative decoding (0.5.23 observability/metrics_collector.py): accepted tokens per verify
# (drafts accepted + the bonus token) and the accepted share of the drafts, over the last
# decode log interval; 0 without speculation.
M_SPEC_ACCEPT_LENGTH = "sglang:spec_accept_length"
M_SPEC_ACCEPT_RATE = "sglang:spec_accept_rate"
# Counters of the tokenizer process, one series per label set (is_streaming): summed. SGLang
# adds a request's tokens when it finishes, so over a window shorter than a request they lag.
M_GEN_TOKENS = "sglang:generation_tokens_total"
M_PROMPT_TOKENS = "sglang:prompt_tokens_total"
M_RETRACTED = "sglang:num_retracted_requests_total"
# A scheduler counter, labelled mode=decode|prefill_compute|prefill_cache, that grows with
# every forward pass: the measure of tokens made during the window, where a server has it.
M_REALTIME = "sglang:realtime_tokens_total"
DECODE_TOKENS = "decode_tokens"
PREFILL_TOKENS = "prefill_tokens"
_REALTIME_MODES = {
    "decode": DECODE_TOKENS,
    "prefill_compute": PREFILL_TOKENS,
    "prefill_cache": PREFILL_TOKENS,
}

# How the data-parallel groups combine: requests and throughput add up; usage and pool size
# are per replica, and the fullest replica is the one that bounds.
_SUMMED_OVER_GROUPS = (M_RUNNING, M_QUEUE, M_GEN_THROUGHPUT)
_MAX_OVER_GROUPS = (M_TOKEN_USAGE, M_MAX_TOTAL_TOKENS)
# Speculation's figures: the groups' mean (each reports its own batches).
_MEAN_OVER_GROUPS = (M_SPEC_ACCEPT_LENGTH, M_SPEC_ACCEPT_RATE)
_COUNTERS = (M_GEN_TOKENS, M_PROMPT_TOKENS, M_RETRACTED)

# /server_info fields the diagnosis uses. A whitelist: /server_info carries every server
# argument, the API key among them, and none of that may reach a report.
SERVER_INFO_FIELDS = (
    "version",
    "model_path",
    "served_model_name",
    "tp_size",
    "dp_size",
    "pp_size",
    "enable_dp_attention",
    "mem_fraction_static",
    "kv_cache_dtype",
    "enable_hierarchical_cache",
    "hicache_size",
    "hicache_ratio",
    "max_total_num_tokens",
    "max_running_requests",
    "chunked_prefill_size",
    "context_length",
    "page_size",
    "cuda_graph_max_bs_decode",
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_draft_model_path",
    "disable_radix_cache",
)
_MEMORY_USAGE_FIELDS = ("weight", "kvcache", "token_capacity")

Fetch = Callable[[str], tuple[int, bytes]]


class UsageError(Exception):
    """Bad command-line input (exit status 2)."""


class SampleError(Exception):
    """The server could not be sampled (exit status 1); ``code`` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------------------------
# Prometheus text: read by the smoke client's parse_series, the project's one parser of it
# --------------------------------------------------------------------------------------------


def aggregate(series: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """One value per metric the diagnosis reads, plus ``schedulers`` (data-parallel groups).

    Scheduler gauges come once per reporting scheduler: by default the first tensor-parallel
    rank of each data-parallel group; with --enable-metrics-for-all-schedulers every rank, all
    with the same values, so they are de-duplicated by taking the largest within a group.
    With priority scheduling the total is the series labelled priority="" and the others are
    a breakdown of it.
    """
    groups: dict[str, dict[str, float]] = {}
    counters: dict[str, float] = {}
    for name, labels, value in series:
        if name in _COUNTERS:
            counters[name] = counters.get(name, 0.0) + value
            continue
        if name == M_REALTIME and labels.get("mode") in _REALTIME_MODES:
            name = f"{M_REALTIME}:{labels['mode']}"  # noqa: PLW2901 (one series per mode)
        elif name not in _SUMMED_OVER_GROUPS + _MAX_OVER_GROUPS + _MEAN_OVER_GROUPS or labels.get(
            "priority", ""
        ):
            continue
        group = groups.setdefault(labels.get("dp_rank", ""), {})
        group[name] = max(group.get(name, value), value)
    values: dict[str, float] = dict(counters)

    def per_group(name: str) -> list[float]:
        return [g[name] for g in groups.values() if name in g]

    for name in _SUMMED_OVER_GROUPS:
        if per_group(name):
            values[name] = sum(per_group(name))
    for name in _MAX_OVER_GROUPS:
        if per_group(name):
            values[name] = max(per_group(name))
    for name in _MEAN_OVER_GROUPS:
        if per_group(name):
            values[name] = sum(per_group(name)) / len(per_group(name))
    for mode, key in _REALTIME_MODES.items():
        if per_group(f"{M_REALTIME}:{mode}"):
            values[key] = values.get(key, 0.0) + sum(per_group(f"{M_REALTIME}:{mode}"))
    values["schedulers"] = float(sum(1 for g in groups.values() if M_RUNNING in g))
    return values


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------


def check_url(url: str) -> str:
    """The base URL without a trailing slash; UsageError (the URL shown without credentials)
    for anything the reader refuses (plugins/module_utils/fleet_http.py, check_url)."""
    try:
        check_http_url(url, "--url")
    except HttpError as exc:
        raise UsageError(str(exc)) from None
    return url.rstrip("/")


def http_fetcher(
    base_url: str,
    api_key: str | None,
    timeout: float = HTTP_TIMEOUT_S,
    max_bytes: int = MAX_METRICS_BYTES,
) -> Fetch:
    """GET base_url + path -> (status, body), the whole exchange within ``timeout`` seconds,
    at most ``max_bytes`` of body, no redirect followed, no proxy from the environment: the
    server is reached directly, as the smoke client does."""
    headers = {"User-Agent": "sglang-fleet-live"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"

    def fetch(path: str) -> tuple[int, bytes]:
        try:
            answer = request(
                base_url + path, headers=headers, deadline_s=timeout, max_bytes=max_bytes
            )
        except HttpError as exc:
            raise SampleError(exc.code, str(exc)) from None
        return answer.status, answer.body

    return fetch


def read_metrics(fetch: Fetch, base_url: str) -> dict[str, float]:
    status, body = fetch("/metrics")
    if status == 404:
        raise SampleError(
            "no_metrics",
            f"{base_url}/metrics answered 404: the server runs without --enable-metrics "
            "(add it to the server's flags and restart it to diagnose it live)",
        )
    if status != 200:
        raise SampleError("http_error", f"{base_url}/metrics answered HTTP {status}")
    values = aggregate(parse_series(body.decode("utf-8", "replace")))
    if M_RUNNING not in values:
        raise SampleError(
            "bad_response",
            f"{base_url}/metrics has no {M_RUNNING}: not an SGLang server, or not ready yet",
        )
    return values


def read_server_info(
    fetch: Fetch, base_url: str, has_key: bool
) -> tuple[dict[str, Any] | None, list[str]]:
    """The whitelisted /server_info fields, and warnings. /get_server_info is the older name."""
    for path in ("/server_info", "/get_server_info"):
        status, body = fetch(path)
        if status in (401, 403):
            hint = (
                "the API key given was refused"
                if has_key
                else "the server has an API key: give it with --api-key-file or SGLANG_API_KEY"
            )
            raise SampleError("unauthorized", f"{base_url}{path} answered {status}: {hint}")
        if status == 404:
            continue
        if status != 200:
            return None, [f"{path} answered HTTP {status}: levers without the server's flags"]
        try:
            info = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nested past Python's stack
            return None, [f"{path} is not JSON: levers without the server's flags"]
        return pick_server_info(info), []
    return None, ["the server has no /server_info: levers without the server's flags"]


def pick_server_info(info: Any) -> dict[str, Any]:
    if not isinstance(info, dict):
        return {}
    picked = {k: info.get(k) for k in SERVER_INFO_FIELDS if k in info}
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        memory = states[0].get("memory_usage")
        if isinstance(memory, dict):
            picked["memory_usage"] = {k: memory.get(k) for k in _MEMORY_USAGE_FIELDS}
    return picked


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def _sample_row(t: float, values: dict[str, float]) -> dict[str, float]:
    row = {
        "t": round(t, 3),
        "num_running_reqs": values.get(M_RUNNING, 0.0),
        "num_queue_reqs": values.get(M_QUEUE, 0.0),
        "token_usage": values.get(M_TOKEN_USAGE, 0.0),
        "gen_throughput": values.get(M_GEN_THROUGHPUT, 0.0),
    }
    # Only a speculating server's readings carry these (0 means none measured yet).
    if values.get(M_SPEC_ACCEPT_LENGTH):
        row["spec_accept_length"] = round(values[M_SPEC_ACCEPT_LENGTH], 3)
        row["spec_accept_rate"] = round(values.get(M_SPEC_ACCEPT_RATE, 0.0), 3)
    return row


def _whole(value: float | None) -> float | int | None:
    """Prometheus writes every value as a float; a token count reads better whole."""
    return int(value) if value is not None and value.is_integer() else value


def summarize(
    readings: list[tuple[float, dict[str, float]]], warnings: list[str]
) -> dict[str, Any]:
    """``server_metrics`` in the smoke result's shape, from (time, values) readings."""
    (t_first, first), (t_last, last) = readings[0], readings[-1]
    samples = [_sample_row(t - t_first, v) for t, v in readings]

    def delta(name: str) -> float | None:
        if name not in first or name not in last:
            return None
        if last[name] < first[name]:
            warnings.append(f"{name} went backwards: the server restarted during the window")
            return None
        return last[name] - first[name]

    def peak(key: str) -> float | None:
        return max((s[key] for s in samples), default=None)

    return {
        "generation_tokens_delta": delta(M_GEN_TOKENS),
        "prompt_tokens_delta": delta(M_PROMPT_TOKENS),
        "decode_tokens_delta": delta(DECODE_TOKENS),
        "prefill_tokens_delta": delta(PREFILL_TOKENS),
        "retracted_requests_delta": delta(M_RETRACTED),
        "peak_num_running_reqs": peak("num_running_reqs"),
        "peak_num_queue_reqs": peak("num_queue_reqs"),
        "peak_token_usage": peak("token_usage"),
        "max_total_num_tokens": _whole(last.get(M_MAX_TOTAL_TOKENS)),
        "schedulers": int(last.get("schedulers") or 1),
        "window_s": round(t_last - t_first, 3),
        "samples": samples,
    }


def sample_server(
    url: str,
    window: float = DEFAULT_WINDOW_S,
    interval: float = DEFAULT_INTERVAL_S,
    api_key: str | None = None,
    *,
    fetch: Fetch | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """The live sample (docs/DIAGNOSIS.md). Raises SampleError when the first reading fails;
    later readings that fail are counted and skipped (a busy server may answer late)."""
    base = check_url(url)
    shown = redact_url(base)
    fetch = fetch or http_fetcher(base, api_key)
    start = clock()
    readings = [(start, read_metrics(fetch, shown))]
    info, warnings = read_server_info(fetch, shown, bool(api_key))
    missed, skipped, last_error = 0, 0, ""
    step, steps = 1, int(window / interval + 1e-9)
    while step <= steps:
        sleep(max(0.0, start + step * interval - clock()))
        try:
            readings.append((clock(), read_metrics(fetch, shown)))
        except SampleError as exc:
            missed += 1
            last_error = str(exc)
        # A reading that took longer than the interval is not made up for with a burst: the
        # readings it overran are skipped, so the window bounds the time and the count.
        late = max(step + 1, math.ceil((clock() - start) / interval - 1e-9))
        skipped += max(0, min(late, steps + 1) - step - 1)
        step = late
    if missed:
        warnings.append(f"{missed} of {steps + 1} readings failed (last: {last_error})")
    if skipped:
        warnings.append(f"{skipped} of {steps + 1} readings skipped: the server answered slowly")
    if len(readings) < 2:
        raise SampleError("bad_response", f"only one reading of {shown}/metrics succeeded")
    return {
        "url": shown,
        "interval_s": interval,
        "server_info": info,
        "server_metrics": summarize(readings, warnings),
        "warnings": warnings,
        "error": None,
    }


def error_sample(url: str, code: str, message: str) -> dict[str, Any]:
    return {
        "url": redact_url(url),
        "server_info": None,
        "server_metrics": None,
        "warnings": [],
        "error": {"code": code, "message": message},
    }


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _positive(text: str) -> float:
    try:
        return float(typed_number.read(text, "seconds", Range(0, low_open=True)))
    except typed_number.NumberError as exc:
        raise argparse.ArgumentTypeError(f"{exc.message} (seconds)") from None


def __call__(
    self,
    parser: argparse.ArgumentParser,
    namespace: argparse.Namespace,
    values: Any,
    option_string: str | None = None,
) -> None:
    parser.error(
        "--api-key is not accepted: a command line is visible to every user of the host; "
        "use --api-key-file FILE (or /dev/stdin) or the SGLANG_API_KEY environment variable"
    )


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """--url, --api-key-file, --window, --interval (shared with sglang_fleet.diagnosis.diagnose)."""
    parser.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:30000")
    server_secrets.refuse_key_in_argv(
        parser, "--api-key-file FILE (or /dev/stdin) or the SGLANG_API_KEY environment variable"
    )
    parser.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="file holding the server's API key (/dev/stdin works; default: $SGLANG_API_KEY)",
    )
    parser.add_argument(
        "--window",
        type=_positive,
        default=DEFAULT_WINDOW_S,
        help=f"seconds to sample /metrics (default {DEFAULT_WINDOW_S:g})",
    )
    parser.add_argument(
        "--interval",
        type=_positive,
        default=DEFAULT_INTERVAL_S,
        help=f"seconds between readings (default {DEFAULT_INTERVAL_S:g})",
    )


API_KEY_FILE_LIMIT = 4096
# A pipe (the key on stdin: --api-key-file /dev/stdin) must bring its line within this.
API_KEY_PIPE_DEADLINE_S = 10.0


def read_api_key(path: str | None) -> str | None:
    """The key from the file, else from SGLANG_API_KEY; None when neither gives one."""
    if path is None:
        return os.environ.get("SGLANG_API_KEY") or None
    try:
        data = _read_key_bytes(path)
        key = data.decode("utf-8").split("\n", 1)[0].rstrip("\r")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--api-key-file {path}: cannot read it ({exc})") from exc
    if not key:
        raise UsageError(f"--api-key-file {path}: the first line is empty")
    return key


def _read_key_bytes(path: str) -> bytes:
    """The first line of a regular file or a pipe, bounded in size and, for a pipe, in time:
    a device (/dev/zero) or a pipe nobody writes to never holds the tool."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            with os.fdopen(os.dup(fd), "rb") as handle:
                data = handle.read(API_KEY_FILE_LIMIT + 1)
        elif stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            data = _read_pipe_line(fd, path)
        else:
            raise UsageError(f"--api-key-file {path}: not a regular file or a pipe")
    finally:
        os.close(fd)
    if len(data) > API_KEY_FILE_LIMIT:
        raise UsageError(f"--api-key-file {path}: no key line within {API_KEY_FILE_LIMIT} bytes")
    return data


def _read_pipe_line(fd: int, path: str) -> bytes:
    deadline = time.monotonic() + API_KEY_PIPE_DEADLINE_S
    data = b""
    while b"\n" not in data and len(data) <= API_KEY_FILE_LIMIT:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise UsageError(
                f"--api-key-file {path}: no key line within {API_KEY_PIPE_DEADLINE_S:g} s"
            )
        try:
            chunk = os.read(fd, API_KEY_FILE_LIMIT + 1 - len(data))
        except BlockingIOError:
            continue
        if not chunk:
            break  # the writer closed: what came is all there is
        data += chunk
    return data


def check_window(window: float, interval: float) -> None:
    if interval < MIN_INTERVAL_S:
        raise UsageError(
            f"--interval {interval:g} is below {MIN_INTERVAL_S:g} s: every reading is a "
            "/metrics scrape the server has to serve"
        )
    if interval > window:
        raise UsageError(f"--interval {interval:g} must not exceed --window {window:g}")


def _write_json(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=1)
        handle.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="live.pyz",
        description=(__doc__ or "").splitlines()[0],
        # An abbreviation would let "--api-key SECRET" pass as --api-key-file and print it.
        allow_abbrev=False,
    )
    add_sampling_arguments(parser)
    parser.add_argument("--json", dest="json_out", help="also write the sample JSON here")
    ns = parser.parse_args(argv)
    if not ns.url:
        parser.error("--url is required")
    try:
        check_url(ns.url)
        check_window(ns.window, ns.interval)
        api_key = read_api_key(ns.api_key_file)
    except UsageError as exc:
        parser.error(str(exc))
    try:
        result = sample_server(ns.url, ns.window, ns.interval, api_key)
        status = 0
    except SampleError as exc:
        result, status = error_sample(ns.url, exc.code, str(exc)), 1
        print(f"live.pyz: {exc}", file=sys.stderr)
    if ns.json_out:
        try:
            _write_json(ns.json_out, result)
        except OSError as exc:
            print(f"live.pyz: --json {ns.json_out}: {exc}", file=sys.stderr)
            return 2
    print(json.dumps(result))
    return status


if __name__ == "__main__":
    sys.exit(main())
