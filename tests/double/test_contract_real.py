"""Contract: the double (gpusim) against the real SGLang 0.5.23, started with the same flags.

One real CPU server (SGLANG_USE_CPU_ENGINE=1, the tiny Llama of gpusim/tools/make_tiny_llama.py)
and one double run for this module; every test asks both the same thing. Covered: endpoints,
/metrics family names and label keys, the start-up log lines sglang_fleet's parsers read,
/server_info fields, error shapes (bad request, over-long prompt, unknown path), SSE framing,
and the smoke client and live diagnosis against both. What stays different is listed in
KNOWN_DIFFERENCES with the reason, and in gpusim/README.md ("Against the real SGLang").

Needs the SGLang reference venv (scripts/sglang-reference-env.sh, which `make pytest` builds;
SGLANG_REF_VENV points elsewhere); without it the real half skips, saying so.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpusim_helpers import init_root, start_server, stop_server, tiny_model
from prometheus_client.parser import text_string_to_metric_families

from gpusim import resolved_args
from sglang_fleet.capacity import calibration_record
from sglang_fleet.capacity.server_log import parse_log
from sglang_fleet.smoke.smoke_client.benchmark import Benchmark
from sglang_fleet.smoke.smoke_client.workload import Config, vocab_size_of

REPO = Path(__file__).resolve().parents[2]
REF_VENV = Path(os.environ.get("SGLANG_REF_VENV", REPO / ".cache" / "sglang-ref" / "venv"))
CONTEXT = 2048
FLAGS = (
    *("--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule"),
    *("--max-total-tokens", "4096", "--context-length", str(CONTEXT), "--enable-metrics"),
    "--sleep-on-idle",
)
REAL_START_TIMEOUT_S = 600
# The real server's start-up (imports, mostly) is in the first test's time: 20 s on an idle
# machine, over 250 s on 2 shared busy cores.
pytestmark = pytest.mark.timeout(REAL_START_TIMEOUT_S + 300)
# The double serves at least this share of the real server's /metrics families (issue 18).
MIN_METRIC_SHARE = 0.9
# Differences that stay, by what differs; each is explained in gpusim/README.md.
KNOWN_DIFFERENCES = {
    # The real server (prometheus_client multiprocess mode) shows a labelled series only once it
    # was first incremented or observed: aborts, prefix-cache hits, a second streamed token.
    # The double creates them at start. By the end of this module's traffic the real server
    # shows the last two as well.
    "extra_metric_families": {
        "sglang:num_aborted_requests",
        "sglang:cached_tokens",
        "sglang:inter_token_latency_seconds",
    },
}


def _get(url: str, path: str, timeout: float = 30) -> tuple[int, bytes, Any]:
    try:
        with urllib.request.urlopen(url + path, timeout=timeout) as response:
            return response.status, response.read(), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


def _post(url: str, path: str, body: bytes, timeout: float = 120) -> tuple[int, bytes, Any]:
    request = urllib.request.Request(
        url + path, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


def _post_json(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any, Any]:
    status, raw, headers = _post(url, path, json.dumps(body).encode())
    return status, raw, headers


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(OSError):
            if _get(url, "/health", timeout=5)[0] == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"server not healthy in {timeout} s:\n{log.read_text()[-4000:]}")


class Real:
    """The real SGLang server: its own process group, so teardown reaches every child."""

    def __init__(self, tmp: Path) -> None:
        python = REF_VENV / "bin" / "python"
        self.model = tiny_model(python)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "real.log"
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}
        cmd = [str(python), "-m", "sglang.launch_server", "--model-path", str(self.model)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [*cmd, *FLAGS, "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # children left in the group, if any


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Real]:
    if not (REF_VENV / "bin" / "python").exists():
        pytest.skip(
            f"no SGLang reference venv at {REF_VENV}: build it with "
            "scripts/sglang-reference-env.sh (make pytest does), or set SGLANG_REF_VENV"
        )
    server = Real(tmp_path_factory.mktemp("real"))
    try:
        _wait_healthy(server.url, server.proc, server.log_path, REAL_START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def double(real: Real, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("double")
    server = start_server(init_root(tmp / "gpusim"), tmp, "--model-path", str(real.model), *FLAGS)
    try:
        server.wait_ready(60)
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def both(real: Real, double: Any) -> dict[str, Any]:
    """Both servers after the same warm traffic (one generation of each kind)."""
    for server in (real, double):
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4}}
        assert _post_json(server.url, "/generate", body)[0] == 200
    return {"real": real, "double": double}


# ------------------------------------------------------------------------------ endpoints


@pytest.mark.parametrize(
    "path",
    [
        "/health",
        "/health_generate",
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
        "/v1/models",
        "/metrics",
    ],
)
def test_get_endpoints_answer_200_on_both(both: dict[str, Any], path: str) -> None:
    statuses = {name: _get(server.url, path)[0] for name, server in both.items()}
    assert statuses == {"real": 200, "double": 200}


def test_generate_counts_are_exact_on_both(both: dict[str, Any]) -> None:
    body = {
        "input_ids": [11, 12, 13],
        "sampling_params": {"max_new_tokens": 7, "ignore_eos": True, "temperature": 0},
    }
    for server in both.values():
        status, raw, _ = _post_json(server.url, "/generate", body)
        answer = json.loads(raw)
        assert status == 200
        assert len(answer["output_ids"]) == 7
        assert answer["meta_info"]["completion_tokens"] == 7
        assert answer["meta_info"]["prompt_tokens"] == 3
        assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 7}


# ------------------------------------------------------------------------------ /metrics


def _families(url: str) -> dict[str, set[str]]:
    status, raw, _ = _get(url, "/metrics")
    assert status == 200
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(raw.decode()):
        keys: set[str] = set()
        for sample in family.samples:
            keys |= set(sample.labels) - {"le"}
        out[family.name] = keys
    return out


def test_live_diagnosis_uses_realtime_tokens_on_both(both: dict[str, Any]) -> None:
    from sglang_fleet.diagnosis import diagnose  # noqa: PLC0415 (heavy; only this test needs it)

    for server in both.values():
        code = diagnose.main(["--url", server.url, "--window", "2", "--interval", "0.5", "--json"])
        assert code in (0, 1)
    for name, server in both.items():
        raw = _get(server.url, "/metrics")[1]
        assert b"sglang:realtime_tokens_total{" in raw, name


# ------------------------------------------------------------------------------ start-up log


def test_startup_lines_our_parsers_read(both: dict[str, Any]) -> None:
    real_log, double_log = both["real"].log(), both["double"].log()
    for name, text in (("real", real_log), ("double", double_log)):
        cal = parse_log(text)
        assert cal.device == "cpu", name
        assert cal.max_total_num_tokens == 4096, name
        assert cal.kv_tokens == 4096, name
        assert cal.context_len == CONTEXT, name
        assert cal.pre_gib is not None and cal.post_gib is not None, name
        assert cal.startup_avail_gib is not None, name
        assert cal.graph_end_avail_gib is None, name  # no CUDA graphs with torch_native
        assert cal.tp_size == 1, name
        record = calibration_record.build_record(text, None, {})
        assert record["key"]["device"] == "cpu", name
        assert "The server is fired up and ready to roll!" in text, name


# ------------------------------------------------------------------------------ /server_info


def test_server_info_fields_the_project_reads(both: dict[str, Any]) -> None:
    for name, server in both.items():
        info = json.loads(_get(server.url, "/server_info")[1])
        assert info["version"] == "0.5.23", name
        assert info["max_total_num_tokens"] == 4096, name
        assert info["device"] == "cpu", name
        assert info["attention_backend"] == "torch_native", name
        assert info["context_length"] == CONTEXT, name
        usage = info["internal_states"][0]["memory_usage"]
        assert {"weight", "kvcache", "token_capacity", "graph"} <= set(usage), name
        assert usage["token_capacity"] == 4096, name
        for key in ("tp_size", "dp_size", "mem_fraction_static", "kv_cache_dtype", "page_size"):
            assert key in info, (name, key)


def test_model_info_names_the_model_directory(both: dict[str, Any]) -> None:
    for name, server in both.items():
        info = json.loads(_get(server.url, "/model_info")[1])
        assert info["model_path"] == str(both["real"].model), name
        assert vocab_size_of(info["model_path"]) == 32000, name


# ------------------------------------------------------------------------------ errors


def _error_shape(status: int, raw: bytes) -> tuple[int, str]:
    """(status, shape): which JSON layout the error body has."""
    body = json.loads(raw)
    if "error" in body:
        return status, "error.message"
    if body.get("object") == "error":
        return status, "object=error"
    return status, "detail" if "detail" in body else f"other: {sorted(body)}"


def test_unknown_path_is_a_json_404(both: dict[str, Any]) -> None:
    shapes = {n: _error_shape(*_get(s.url, "/no-such-path")[:2]) for n, s in both.items()}
    assert shapes == {"real": (404, "detail"), "double": (404, "detail")}


def test_over_long_prompt_is_refused_with_sglangs_message(both: dict[str, Any]) -> None:
    body = {"input_ids": list(range(5, 5 + CONTEXT + 52)), "sampling_params": {"max_new_tokens": 4}}
    for name, server in both.items():
        status, raw, _ = _post_json(server.url, "/generate", body)
        assert _error_shape(status, raw) == (400, "error.message"), name
        message = json.loads(raw)["error"]["message"]
        assert message == (
            f"The input ({CONTEXT + 52} tokens) is longer than the model's context length "
            f"({CONTEXT} tokens)."
        ), name


def test_bad_json_is_a_400_on_both(both: dict[str, Any]) -> None:
    for name, server in both.items():
        status, raw, _ = _post(server.url, "/generate", b"{bad json")
        assert _error_shape(status, raw) == (400, "object=error"), name


def test_negative_max_new_tokens_is_refused(both: dict[str, Any]) -> None:
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": -3}}
    for name, server in both.items():
        status, raw, _ = _post_json(server.url, "/generate", body)
        assert _error_shape(status, raw) == (400, "error.message"), name
        assert json.loads(raw)["error"]["message"] == "max_new_tokens must be at least 0, got -3."


# ------------------------------------------------------------------------------ SSE framing


def _events(raw: bytes) -> list[bytes]:
    text = raw.replace(b"\r\n", b"\n")
    assert text.endswith(b"\n\n")
    return [e for e in text.split(b"\n\n") if e]


def test_generate_stream_framing(both: dict[str, Any]) -> None:
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        "stream": True,
    }
    for name, server in both.items():
        status, raw, headers = _post_json(server.url, "/generate", body)
        assert status == 200, name
        assert headers.get("Content-Type", "").startswith("text/event-stream"), name
        events = _events(raw)
        assert events[-1] == b"data: [DONE]", name
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
        assert all(e.startswith(b"data: ") for e in events), name
        assert [len(c["output_ids"]) for c in chunks][-1] == 3, name
        assert chunks[-1]["meta_info"]["completion_tokens"] == 3, name
        texts = [c["text"] for c in chunks]
        assert all(b.startswith(a) for a, b in itertools.pairwise(texts)), name


def test_completions_stream_with_usage(both: dict[str, Any]) -> None:
    body = {
        "model": "default",
        "prompt": "a b c",
        "max_tokens": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for name, server in both.items():
        status, raw, _ = _post_json(server.url, "/v1/completions", body)
        assert status == 200, name
        events = _events(raw)
        assert events[-1] == b"data: [DONE]", name
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 3, name
        assert chunks[-1]["choices"] == [], name


# ------------------------------------------------------------------------------ smoke client


def test_smoke_client_exact_counts_on_both(both: dict[str, Any]) -> None:
    import asyncio  # noqa: PLC0415

    for name, server in both.items():
        config = Config(
            url=server.url,
            num_prompts=4,
            max_concurrency=2,
            random_input_len=32,
            random_output_len=8,
            warmup_requests=1,
        )
        result = asyncio.run(Benchmark(config).run())
        assert (result["completed"], result["failed"]) == (4, 0), (name, result["errors"])
        assert result["total_output_tokens"] == 32, name
        assert result["server_metrics"]["generation_tokens_delta"] == 32, name


# ------------------------------------------------------------------------------ /metrics, last


def test_metric_families_and_label_keys(both: dict[str, Any]) -> None:
    real, double = _families(both["real"].url), _families(both["double"].url)
    served = set(real) & set(double)
    assert len(served) >= MIN_METRIC_SHARE * len(real), sorted(set(real) - set(double))
    assert set(double) - set(real) <= KNOWN_DIFFERENCES["extra_metric_families"]
    differing = {name: (real[name], double[name]) for name in served if real[name] != double[name]}
    assert differing == {}
    for name in ("sglang:realtime_tokens", "sglang:num_retracted_reqs", "sglang:kv_used_tokens"):
        assert name in served


# ------------------------------------------------------------------------------ last: a fatal id


# ------------------------------------------------------------------ memory and server_args
SERVER_ARGS_LINE = re.compile(r"server_args=(\{.*\})")
LOAD_END = re.compile(r"Load weight end\..*?mem usage=(-?\d+\.\d+) GB")
KV_ALLOCATED = re.compile(
    r"KV Cache is allocated\. dtype: (\S+), #tokens: (\d+), K size: (\S+) GB, V size: (\S+) GB"
)
# server_args fields the double leaves as the parser set them, and why.
UNRESOLVED_BY_THE_DOUBLE = {
    # The capture lists (the CPU engine resolves decode max_bs 32 and its own list even with
    # graphs disabled); the double models GPU capture in gpusim/memory.py, not this field.
    "cuda_graph_config",
}


def _logged_server_args(log: str) -> dict[str, Any]:
    found = SERVER_ARGS_LINE.search(log)
    assert found is not None
    return ast.literal_eval(found[1])


def test_server_args_are_logged_resolved_on_both(both: dict[str, Any]) -> None:
    """The real engine logs server_args after post-init resolved its defaults (issue 47:
    mem_fraction_static, not None); so does the double, with the same keys and, for the
    defaults that depend on nothing the double models, the same values."""
    logged = {name: _logged_server_args(server.log()) for name, server in both.items()}
    for name, args in logged.items():
        info = json.loads(_get(both[name].url, "/server_info")[1])
        assert isinstance(args["mem_fraction_static"], float), name
        assert args["mem_fraction_static"] == info["mem_fraction_static"], name
        assert args["chunked_prefill_size"] == info["chunked_prefill_size"] > 0, name
        assert args["page_size"] == 1, name
        assert args["tokenizer_path"] == args["served_model_name"] == args["model_path"], name
        assert isinstance(args["random_seed"], int), name
    real, double = logged["real"], logged["double"]
    assert set(real) <= set(double)
    constants = resolved_args.POST_INIT_CONSTANTS | resolved_args.UNFLAGGED_FIELDS
    assert {key: double[key] for key in constants} == {key: real[key] for key in constants}
    left = {k for k, v in real.items() if v is not None and double[k] is None}
    assert left == UNRESOLVED_BY_THE_DOUBLE


def test_weight_and_kv_pool_lines_agree(both: dict[str, Any]) -> None:
    """What the CPU engine can show of memory placement: one rank of the tiny Llama holds the
    whole checkpoint (a few MB: 0.00 GB on both, the real one's reading moves by +-0.01 with
    the host), and the KV pool line for the same --max-total-tokens. Replication across ranks
    (fused_qkv_a_proj_with_mqa, the router, KV heads past tp) needs tp > 1 of an MLA model on
    GPUs: the CPU engine runs neither, so tests/double/test_gpusim_placement.py holds it to
    the wheel's code instead."""
    real_log, double_log = both["real"].log(), both["double"].log()
    real_load = float(LOAD_END.findall(real_log)[-1])
    double_load = float(LOAD_END.findall(double_log)[-1])
    assert abs(real_load - double_load) <= 0.02
    assert KV_ALLOCATED.findall(real_log) == KV_ALLOCATED.findall(double_log) != []


def test_a_token_id_past_the_vocabulary_takes_the_whole_server_down(both: dict[str, Any]) -> None:
    """SGLang does not check input_ids: the embedding lookup fails in the scheduler and the
    server dies (why the smoke client draws ids below the vocabulary). Runs last: it ends both."""
    body = {"input_ids": [5, 32000], "sampling_params": {"max_new_tokens": 2}}
    for name, server in both.items():
        with contextlib.suppress(OSError):
            _post_json(server.url, "/generate", body)
        proc = server.proc
        proc.wait(60)
        assert proc.returncode != 0, name
        assert "IndexError" in server.log(), name
