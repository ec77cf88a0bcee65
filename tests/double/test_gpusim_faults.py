"""Faults switched on through the state directory (gpusim/faults.py), against running doubles.

One running server takes truncate, zero_tokens, stall_after_headers and a bad file in turn,
without a restart; the crash modes each end a server of their own. The smoke client and the
gate read each fault as an operator would see it.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpusim.faults import FaultFileError, parse_faults
from gpusim_helpers import LLAMA, Server, init_root, start_server, stop_server

from gpusim import state
from sglang_fleet.smoke import gate
from sglang_fleet.smoke.smoke_client.benchmark import Benchmark
from sglang_fleet.smoke.smoke_client.workload import Config

ARGS = {"port": 30000, "chunked_prefill_size": None, "served_model_name": "llama"}


# ------------------------------------------------------------------------------------------
# The file
# ------------------------------------------------------------------------------------------


def test_every_mode_parses() -> None:
    text = """
faults:
  - {mode: truncate, tokens: 1, when: {port: 30000}}
  - {mode: zero_tokens}
  - {mode: stall_after_headers, when: {served_model_name: llama}}
  - {mode: crash, after_requests: 5, at_concurrency: 4}
"""
    truncate, zero, stall, crash = parse_faults(text, ARGS)
    assert (truncate.mode, truncate.tokens, truncate.max_new_tokens(64)) == ("truncate", 1, 1)
    assert zero.max_new_tokens(64) == 0
    assert stall.mode == "stall_after_headers" and stall.matches(ARGS)
    assert crash.crash_reason(received=5, in_flight=1) is None
    assert crash.crash_reason(received=6, in_flight=1) == "generation request 6 after 5 served"
    assert crash.crash_reason(received=2, in_flight=4) == "4 generation requests in flight"
    assert parse_faults("", ARGS) == []
    assert parse_faults("faults: []", ARGS) == []


def test_when_limits_a_fault_to_one_configuration() -> None:
    (fault,) = parse_faults(
        "faults: [{mode: zero_tokens, when: {chunked_prefill_size: 3072}}]", ARGS
    )
    assert not fault.matches(ARGS)
    assert fault.matches({**ARGS, "chunked_prefill_size": 3072})
    assert fault.matches({**ARGS, "chunked_prefill_size": "3072"})  # a str flag, an int in YAML


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("faults: [{mode: slow}]", "faults[0].mode must be one of truncate, zero_tokens"),
        ("faults: [{mode: truncate}]", "faults[0]: truncate needs tokens"),
        ("faults: [{mode: truncate, tokens: -1}]", "faults[0].tokens must be an integer >= 0"),
        ("faults: [{mode: truncate, tokens: yes}]", "faults[0].tokens must be an integer >= 0"),
        ("faults: [{mode: crash}]", "faults[0]: crash needs after_requests or at_concurrency"),
        ("faults: [{mode: crash, at_concurrency: 0}]", "faults[0].at_concurrency must be"),
        ("faults: [{mode: zero_tokens, tokens: 3}]", "faults[0] has unknown key(s) ['tokens']"),
        ("faults: [{mode: zero_tokens, when: {prot: 1}}]", "faults[0].when names ['prot']"),
        ("faults: [{mode: zero_tokens, when: [port]}]", "faults[0].when must be a mapping"),
        ("- mode: zero_tokens", "the top level must be a mapping with one key, faults"),
        ("faults: {mode: zero_tokens}", "faults must be a list of entries"),
        ("faults: [zero_tokens]", "faults[0] must be a mapping with a mode"),
        ("faults: [", "not YAML"),
    ],
)
def test_a_bad_file_says_which_entry_and_key(text: str, message: str) -> None:
    with pytest.raises(FaultFileError) as info:
        parse_faults(text, ARGS)
    assert message in str(info.value)


# ------------------------------------------------------------------------------------------
# One running server, switched between faults
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("faults")
    server = start_server(init_root(tmp / "gpusim"), tmp, "--model-path", LLAMA)
    try:
        server.wait_ready()
        yield server
    finally:
        stop_server(server)


def set_faults(server: Server, text: str | None) -> None:
    path = server.root / "faults.yaml"
    if text is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(text)


@pytest.fixture
def faults(llama: Server) -> Iterator[Any]:
    """Write faults.yaml for the shared server; removed again after the test."""
    yield lambda text: set_faults(llama, text)
    set_faults(llama, None)


def stream(server: Server, path: str, body: dict[str, Any]) -> list[Any]:
    """The events of one streamed answer, [DONE] as the string."""
    request = urllib.request.Request(
        server.url + path,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def generate(server: Server, tokens: int) -> list[Any]:
    return stream(
        server, "/generate", {"text": "a b c", "sampling_params": {"max_new_tokens": tokens}}
    )


def smoke_run(server: Server, **config: Any) -> dict[str, Any]:
    settings = {
        "num_prompts": 4,
        "max_concurrency": 2,
        "random_input_len": 16,
        "random_output_len": 8,
        "warmup_requests": 0,
        **config,
    }
    return asyncio.run(Benchmark(Config(url=server.url, **settings)).run())


@pytest.mark.slow
def test_truncate_ends_every_answer_cleanly_after_n_tokens(llama: Server, faults: Any) -> None:
    faults("faults: [{mode: truncate, tokens: 2}]")
    events = generate(llama, 8)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["completion_tokens"] == 2
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"
    usage = stream(
        llama,
        "/v1/completions",
        {"prompt": "a b", "max_tokens": 8, "stream_options": {"include_usage": True}},
    )[-2]["usage"]
    assert usage["completion_tokens"] == 2

    result = smoke_run(llama)
    assert (result["completed"], result["failed"]) == (0, 4)
    assert result["failure_reasons"] == {"short_output": 4}
    verdict = gate.evaluate(result, {"max_failure_rate": None}, None)
    assert [f["code"] for f in verdict["failures"]] == ["no_output"]
    assert "short_output 4" in verdict["summary"]
    assert "gpusim fault in force" in llama.log()


@pytest.mark.slow
def test_zero_tokens_ends_every_answer_with_none(llama: Server, faults: Any) -> None:
    faults("faults: [{mode: zero_tokens}]")
    events = generate(llama, 8)
    assert [e for e in events if e != "[DONE]"][-1]["meta_info"]["completion_tokens"] == 0
    result = smoke_run(llama)
    assert result["failure_reasons"] == {"short_output": 4}
    assert result["output_throughput"] == 0.0


@pytest.mark.slow
def test_stall_sends_headers_then_nothing(llama: Server, faults: Any) -> None:
    faults("faults: [{mode: stall_after_headers}]")
    body = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 8}, "stream": True})
    request = (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    with socket.create_connection(("127.0.0.1", llama.port), timeout=10) as sock:
        sock.sendall(request)
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert b"text/event-stream" in head
        assert head.endswith(b"\r\n\r\n")  # nothing after the headers
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(4096)
    result = smoke_run(llama, num_prompts=2, timeout=0.5)
    assert result["failure_reasons"] == {"timeout": 2}
    assert llama.status("/health") == 200  # the health check does not see it


@pytest.mark.slow
def test_a_fault_follows_its_when_and_goes_away_without_a_restart(
    llama: Server, faults: Any
) -> None:
    pid = llama.proc.pid
    faults(f"faults: [{{mode: truncate, tokens: 1, when: {{port: {llama.port + 1}}}}}]")
    assert generate(llama, 8)[-2]["meta_info"]["completion_tokens"] == 8  # another server's
    faults(f"faults: [{{mode: truncate, tokens: 1, when: {{port: {llama.port}}}}}]")
    assert generate(llama, 8)[-2]["meta_info"]["completion_tokens"] == 1
    faults(None)
    assert generate(llama, 8)[-2]["meta_info"]["completion_tokens"] == 8
    assert smoke_run(llama)["completed"] == 4
    assert llama.proc.pid == pid and llama.proc.poll() is None
    assert "gpusim fault cleared" in llama.log()


@pytest.mark.slow
def test_an_unreadable_file_fails_generation_loudly(llama: Server, faults: Any) -> None:
    faults("faults: [{mode: truncate, tokens: many}]")
    with pytest.raises(urllib.error.HTTPError) as info:
        generate(llama, 8)
    assert info.value.code == 500
    assert "faults[0].tokens must be an integer >= 0, got 'many'" in info.value.read().decode()
    assert llama.status("/health") == 200
    assert "gpusim fault file unreadable" in llama.log()


# ------------------------------------------------------------------------------------------
# Crashes: each ends its own server
# ------------------------------------------------------------------------------------------


def _crashed(server: Server) -> None:
    assert server.proc.wait(20) == -signal.SIGKILL  # SGLang's kill_process_tree on itself
    log = server.log()
    assert "Scheduler hit an exception" in log
    assert "torch.OutOfMemoryError: CUDA out of memory." in log
    assert "gpusim fault crash" in log
    assert state.live_procs(server.root) == []  # the ranks went with it


@pytest.mark.slow
def test_crash_after_k_requests_read_at_start_up(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    # Written before the start: a restart keeps a fault.
    (state_dir / "faults.yaml").write_text("faults: [{mode: crash, after_requests: 2}]\n")
    server = start_server(state_dir, tmp_path, "--model-path", LLAMA)
    servers.append(server)
    server.wait_ready()
    assert server.status("/health_generate") == 200  # health checks do not count
    for _ in range(2):
        assert generate(server, 4)[-2]["meta_info"]["completion_tokens"] == 4
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        generate(server, 4)
    _crashed(server)
    assert "generation request 3 after 2 served" in server.log()


@pytest.mark.slow
def test_crash_under_load_at_k_concurrent_requests(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    hardware = state.load_hardware(state_dir)
    hardware.timing.decode_step_s = 0.02  # 200 tokens: 4 s, long enough to overlap
    state.save_hardware(hardware, state_dir)
    (state_dir / "faults.yaml").write_text("faults: [{mode: crash, at_concurrency: 3}]\n")
    server = start_server(state_dir, tmp_path, "--model-path", LLAMA)
    servers.append(server)
    server.wait_ready()
    started = threading.Barrier(3, timeout=20)
    errors: list[BaseException] = []

    def long_stream() -> None:
        body = {"text": "go", "sampling_params": {"max_new_tokens": 200}, "stream": True}
        request = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode())
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                response.readline()  # the first event: this request is in flight
                started.wait()
                response.read()
        except (OSError, http.client.HTTPException) as exc:  # reset, or a cut chunk
            errors.append(exc)

    workers = [threading.Thread(target=long_stream) for _ in range(2)]
    for worker in workers:
        worker.start()
    started.wait()
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        generate(server, 4)
    for worker in workers:
        worker.join(30)
    _crashed(server)
    assert "3 generation requests in flight" in server.log()
    assert len(errors) == 2  # the two running streams died with it
