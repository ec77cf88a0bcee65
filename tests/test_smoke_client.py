"""The smoke client against a scripted in-process HTTP server.

The server writes exact bytes (so chunk boundaries, chunked encoding and connection handling are
under the test's control) and drives a fake clock that the client reads: every byte a script
writes is stamped with the time the script chose, so TTFT, ITL, TPOT and throughput come out
exactly, independent of how busy the machine is.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sglang_fleet.smoke.smoke_client import command_line
from sglang_fleet.smoke.smoke_client.benchmark import Benchmark
from sglang_fleet.smoke.smoke_client.prometheus_text import parse_prometheus, parse_series
from sglang_fleet.smoke.smoke_client.streams import GenerateStream, RequestRecord
from sglang_fleet.smoke.smoke_client.summary import percentile
from sglang_fleet.smoke.smoke_client.workload import (
    Config,
    lengths_digest,
    parse_lengths,
    vocab_size_of,
)

# The model /model_info names: the double's fixture (config.json and a word-level tokenizer.json),
# whose vocabulary bounds the token ids the client draws.
MODEL_DIR = (
    Path(__file__).resolve().parents[1] / "gpusim" / "gpusim" / "fixtures" / "llama-3.1-8b-instruct"
)

# Long enough for the client's event loop to read what the server just wrote before the server
# moves the clock on; only the count of these sleeps adds to the test time.
SETTLE_S = 0.005


class FakeClock:
    """The client's clock; only the scripted server moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: int

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Step:
    """Bytes the server writes, and the request-relative time the clock shows when they land."""

    data: bytes
    at: float | None = None


# ------------------------------------------------------------------------------------------
# Byte builders
# ------------------------------------------------------------------------------------------


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def head(status: int = 200, *headers: str) -> bytes:
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}.get(status, "X")
    lines = [f"HTTP/1.1 {status} {reason}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


SSE_CHUNKED = head(200, "Content-Type: text/event-stream", "Transfer-Encoding: chunked")


def gen_event(tokens: int, prompt_tokens: int = 7) -> bytes:
    """A /generate stream chunk as SGLang sends it: cumulative text and the server's counts."""
    return sse(
        {
            "text": "tok" * tokens,
            "output_ids": list(range(tokens)),
            "meta_info": {
                "id": "r1",
                "finish_reason": None,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": tokens,
                "cached_tokens": 0,
            },
        }
    )


def oai_event(text: str) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
    return sse({"id": "c1", "object": "text_completion", "choices": [choice], "usage": None})


def oai_usage(prompt_tokens: int, completion_tokens: int) -> bytes:
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    return sse({"id": "c1", "object": "text_completion", "choices": [], "usage": usage})


def generate_script(times: list[float], prompt_tokens: int = 7) -> list[Step]:
    """One token per chunk at the given request-relative times, [DONE] with the last one."""
    steps = [Step(SSE_CHUNKED, None)]
    for n, at in enumerate(times, start=1):
        data = chunk(gen_event(n, prompt_tokens))
        if n == len(times):
            data += chunk(DONE) + LAST_CHUNK
        steps.append(Step(data, at))
    return steps


# ------------------------------------------------------------------------------------------
# The scripted server
# ------------------------------------------------------------------------------------------

Handler = Callable[[Request, "ScriptedServer"], Awaitable[list[Step] | None]]


@dataclass
class ScriptedServer:
    """HTTP/1.1 server whose responses are byte scripts; records every request it reads."""

    clock: FakeClock
    handler: Handler
    metrics_text: str | None = None
    requests: list[Request] = field(default_factory=list)
    close_after_response: bool = False
    port: int = 0
    _connections: int = 0
    _server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    def generate_requests(self) -> list[Request]:
        return [r for r in self.requests if r.path in ("/generate", "/v1/completions")]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        connection = self._connections
        try:
            while True:
                request = await self._read_request(reader, connection)
                if request is None:
                    return
                self.requests.append(request)
                steps = await self._route(request)
                if steps is None:  # the script drops the connection without an answer
                    return
                await self._play(steps, writer)
                if self.close_after_response:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def _read_request(self, reader: asyncio.StreamReader, connection: int) -> Request | None:
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        lines = raw.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ")
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return Request(method, path, headers, body, connection)

    async def _route(self, request: Request) -> list[Step] | None:
        if request.path == "/metrics":
            if self.metrics_text is None:
                return [Step(head(404, "Content-Length: 9") + b"not found")]
            body = self.metrics_text.encode()
            return [Step(head(200, f"Content-Length: {len(body)}") + body)]
        if request.path == "/model_info":
            body = json.dumps({"model_path": str(MODEL_DIR)}).encode()
            return [Step(head(200, f"Content-Length: {len(body)}") + body)]
        if request.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "served-model"}]}).encode()
            return [Step(head(200, f"Content-Length: {len(body)}") + body)]
        return await self.handler(request, self)

    async def _play(self, steps: list[Step], writer: asyncio.StreamWriter) -> None:
        start = self.clock.now
        for step in steps:
            if step.at is not None:
                self.clock.now = start + step.at
            writer.write(step.data)
            await writer.drain()
            await asyncio.sleep(SETTLE_S)


def scripted(*scripts: list[Step] | None) -> Handler:
    """A handler that answers the n-th streaming request with the n-th script."""
    queue: Iterator[list[Step] | None] = iter(scripts)

    async def handler(request: Request, server: ScriptedServer) -> list[Step] | None:
        return next(queue)

    return handler


def run_against(
    handler: Handler,
    metrics_text: str | None = None,
    close_after_response: bool = False,
    **config: Any,
) -> tuple[dict[str, Any], ScriptedServer]:
    """Run the benchmark against a scripted server in one event loop, on the fake clock."""
    clock = FakeClock()
    server = ScriptedServer(clock, handler, metrics_text, close_after_response=close_after_response)

    async def main() -> dict[str, Any]:
        url = await server.start()
        try:
            # a short timeout turns a hang into a failed request the test reports
            settings = {"warmup_requests": 0, "max_concurrency": 1, "timeout": 10.0, **config}
            return await Benchmark(Config(url=url, **settings), clock).run()
        finally:
            await server.stop()

    return asyncio.run(main()), server


# ------------------------------------------------------------------------------------------
# Metrics computed exactly
# ------------------------------------------------------------------------------------------


def test_generate_metrics_are_exact() -> None:
    first = generate_script([0.100, 0.120, 0.150, 0.200])
    second = generate_script([0.300, 0.310, 0.320, 0.330, 0.340, 0.400], prompt_tokens=9)
    result, server = run_against(
        scripted(first, second), num_prompts=2, random_input_len=5, random_output_len=6
    )
    # asked for 6 tokens, the first answer has 4: failed, and counted nowhere else
    assert result["completed"] == 1
    assert result["failed"] == 1
    assert result["failure_reasons"] == {"short_output": 1}
    assert result["errors"] == ["short output: 4 of the 6 completion tokens asked for"]

    first = generate_script([0.100, 0.120, 0.150, 0.200, 0.210, 0.300])
    result, server = run_against(
        scripted(first, second), num_prompts=2, random_input_len=5, random_output_len=6
    )
    assert result["completed"] == 2
    assert result["failed"] == 0
    assert result["failure_reasons"] == {}
    assert result["duration"] == pytest.approx(0.7)
    # token counts are the server's (7 + 9 prompt tokens), not the 5 ids the client sent
    assert result["total_input_tokens"] == 16
    assert result["total_output_tokens"] == 12
    assert result["request_throughput"] == pytest.approx(2 / 0.7)
    assert result["input_throughput"] == pytest.approx(16 / 0.7)
    assert result["output_throughput"] == pytest.approx(12 / 0.7)
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["median_ttft_ms"] == pytest.approx(200.0)
    assert result["p99_ttft_ms"] == pytest.approx(100 + 200 * 0.99)
    tpots = [(0.3 - 0.1) / 5 * 1000, (0.4 - 0.3) / 5 * 1000]
    assert result["mean_tpot_ms"] == pytest.approx(sum(tpots) / 2)
    itls = [20, 30, 50, 10, 90, 10, 10, 10, 10, 60]
    assert sorted(result["itl_ms_all"]) == pytest.approx(sorted(itls))
    assert result["mean_itl_ms"] == pytest.approx(sum(itls) / len(itls))
    assert result["median_itl_ms"] == pytest.approx(15.0)  # (10 + 20) / 2
    assert result["mean_e2e_latency_ms"] == pytest.approx(350.0)
    assert result["concurrency"] == pytest.approx((0.3 + 0.4) / 0.7)
    assert result["ttft_ms_all"] == pytest.approx([100.0, 300.0])
    assert result["server_metrics"] is None
    assert result["goodput"] is None
    assert result["errors"] == []
    # one connection, kept alive for both requests
    assert len({r.connection for r in server.generate_requests()}) == 1


def test_several_tokens_in_one_chunk_spread_the_gap_like_bench_serving() -> None:
    steps = [
        Step(SSE_CHUNKED),
        Step(chunk(gen_event(1)), 0.1),
        Step(chunk(gen_event(4)), 0.4),  # three tokens at once: 0.3 s spread over them
        Step(chunk(gen_event(4)) + chunk(DONE) + LAST_CHUNK, 0.5),  # no new token: no gap
    ]
    result, _ = run_against(scripted(steps), num_prompts=1, random_output_len=4)
    assert result["total_output_tokens"] == 4
    assert result["itl_ms_all"] == pytest.approx([100.0, 100.0, 100.0])
    assert result["mean_e2e_latency_ms"] == pytest.approx(500.0)
    assert result["mean_tpot_ms"] == pytest.approx((0.5 - 0.1) / 3 * 1000)


def test_timeline_counts_tokens_per_second_of_the_run() -> None:
    script = generate_script([0.5, 0.9, 1.2, 1.4, 2.5])
    result, _ = run_against(scripted(script), num_prompts=1, random_output_len=5)
    assert result["timeline"] == [
        {"t": 0, "output_tokens": 2},
        {"t": 1, "output_tokens": 2},
        {"t": 2, "output_tokens": 1},
    ]


def test_goodput_is_the_share_of_all_requests_within_the_slos() -> None:
    fast = generate_script([0.05, 0.06, 0.07])  # TTFT 50 ms, TPOT 10 ms
    slow_first = generate_script([0.30, 0.31, 0.32])  # misses the TTFT SLO
    slow_decode = generate_script([0.05, 0.15, 0.25])  # misses the TPOT SLO
    failed = [Step(head(500, "Content-Length: 4") + b"oops")]
    result, _ = run_against(
        scripted(fast, slow_first, slow_decode, failed),
        num_prompts=4,
        random_output_len=3,
        slo_ttft_ms=100,
        slo_tpot_ms=50,
    )
    assert result["completed"] == 3
    assert result["failed"] == 1
    assert result["goodput"] == pytest.approx(1 / 4)
    assert result["slo"] == {"ttft_ms": 100, "tpot_ms": 50}


def test_percentile_matches_numpy_linear_interpolation() -> None:
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 99) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)


# ------------------------------------------------------------------------------------------
# SSE and HTTP edge cases
# ------------------------------------------------------------------------------------------


def test_event_split_across_reads_counts_when_it_completes() -> None:
    first = chunk(gen_event(1))
    second = gen_event(2)
    steps = [
        Step(SSE_CHUNKED),
        Step(first[:9], 0.05),  # part of the chunk-size line and payload
        Step(first[9:], 0.10),  # the event completes here: TTFT 100 ms
        Step(chunk(second[:20]), 0.15),  # the event split across two HTTP chunks
        Step(chunk(second[20:]), 0.25),
        Step(chunk(DONE)[:3], 0.26),
        Step(chunk(DONE)[3:] + LAST_CHUNK[:2], 0.27),
        Step(LAST_CHUNK[2:], 0.28),
    ]
    result, _ = run_against(scripted(steps), num_prompts=1, random_output_len=2)
    assert result["failed"] == 0, result["errors"]
    assert result["ttft_ms_all"] == pytest.approx([100.0])
    assert result["itl_ms_all"] == pytest.approx([150.0])
    # latency ends with [DONE], as bench_serving measures it
    assert result["mean_e2e_latency_ms"] == pytest.approx(270.0)


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_any_split_of_the_stream_gives_the_same_result(seed: int, newline: bytes) -> None:
    """Reads that cut events, chunk headers and CRLFs anywhere: an event counts at the read
    that completes it, and TTFT plus the ITLs add up to the time of the last token."""
    events = [gen_event(n).replace(b"\n", newline) for n in range(1, 21)]
    done = DONE.replace(b"\n", newline)
    stream = SSE_CHUNKED + b"".join(chunk(e) for e in events) + chunk(done) + LAST_CHUNK
    rng = random.Random(seed)
    # and one read that ends between the CR and the LF of the blank line ending an event
    between = stream.index(events[seed]) + len(events[seed]) - 1
    cuts = sorted({*rng.sample(range(1, len(stream)), 25), between})
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    steps = [Step(piece, 0.01 * (i + 1)) for i, piece in enumerate(pieces)]

    def arrival(offset: int) -> float:
        """The clock when the byte at ``offset`` arrives."""
        return 0.01 * (1 + sum(1 for cut in cuts if cut <= offset))

    def event_end(index: int) -> int:
        return stream.index(events[index]) + len(events[index]) - 1

    result, _ = run_against(scripted(steps), num_prompts=1, random_output_len=20)
    assert result["completed"] == 1, result["errors"]
    assert result["total_output_tokens"] == 20
    assert len(result["itl_ms_all"]) == 19
    ttft = result["ttft_ms_all"][0]
    assert ttft == pytest.approx(arrival(event_end(0)) * 1000)
    assert ttft + sum(result["itl_ms_all"]) == pytest.approx(arrival(event_end(19)) * 1000)
    done_end = stream.index(done) + len(done) - 1
    assert result["mean_e2e_latency_ms"] == pytest.approx(arrival(done_end) * 1000)


def test_several_events_in_one_read() -> None:
    events = b"".join(gen_event(n) for n in (1, 2, 3))
    steps = [
        Step(SSE_CHUNKED + chunk(events), 0.2),  # three events in one HTTP chunk
        Step(chunk(gen_event(4)) + chunk(gen_event(5)), 0.3),  # two chunks in one read
        Step(chunk(gen_event(6) + DONE) + LAST_CHUNK, 0.4),
    ]
    result, _ = run_against(scripted(steps), num_prompts=1, random_output_len=6)
    assert result["total_output_tokens"] == 6
    assert result["ttft_ms_all"] == pytest.approx([200.0])
    # tokens that arrive in one read arrive at the same time
    assert result["itl_ms_all"] == pytest.approx([0.0, 0.0, 100.0, 0.0, 100.0])


@pytest.mark.parametrize(
    "framing",
    ["content-length", "until-close", "crlf-events"],
)
def test_streams_without_chunked_encoding(framing: str) -> None:
    newline = b"\r\n" if framing == "crlf-events" else b"\n"
    body = b"".join(gen_event(n).replace(b"\n\n", newline * 2) for n in (1, 2, 3)) + DONE.replace(
        b"\n", newline
    )
    if framing == "content-length":
        response = head(200, f"Content-Length: {len(body)}") + body
    elif framing == "until-close":
        response = head(200, "Connection: close") + body
    else:
        response = SSE_CHUNKED + chunk(body) + LAST_CHUNK
    result, _ = run_against(
        scripted([Step(response, 0.1)]),
        num_prompts=1,
        random_output_len=3,
        close_after_response=framing == "until-close",
    )
    assert result["completed"] == 1, result["errors"]
    assert result["total_output_tokens"] == 3


def test_keep_alive_reuses_one_connection_per_concurrent_stream() -> None:
    scripts = [generate_script([0.01, 0.02]) for _ in range(6)]
    result, server = run_against(
        scripted(*scripts), num_prompts=6, max_concurrency=2, random_output_len=2
    )
    assert result["completed"] == 6
    connections = [r.connection for r in server.generate_requests()]
    assert len(set(connections)) == 2
    # the metrics probe is not on a stream connection; the server saw HTTP/1.1 keep-alive
    assert all("close" not in r.headers.get("connection", "") for r in server.requests)


def test_server_closing_idle_connections_does_not_fail_requests() -> None:
    scripts = [generate_script([0.01, 0.02]) for _ in range(3)]
    result, server = run_against(
        scripted(*scripts), num_prompts=3, close_after_response=True, random_output_len=2
    )
    assert result["completed"] == 3
    assert result["failed"] == 0
    assert len({r.connection for r in server.generate_requests()}) == 3


def test_completions_usage_chunk_gives_counts_but_no_token_time() -> None:
    steps = [
        Step(SSE_CHUNKED + chunk(oai_event("")), 0.05),  # an empty delta is no token
        Step(chunk(oai_event("Hello")), 0.1),
        Step(chunk(oai_event(" world")), 0.2),
        Step(chunk(oai_event("!")), 0.25),
        Step(chunk(oai_usage(11, 5)), 0.4),  # usage only: counts, not a token arrival
        Step(chunk(DONE) + LAST_CHUNK, 0.5),
    ]
    result, server = run_against(
        scripted(steps),
        backend="sglang-oai",
        num_prompts=1,
        random_input_len=8,
        random_output_len=5,
    )
    assert result["completed"] == 1, result["errors"]
    assert result["total_input_tokens"] == 11
    assert result["total_output_tokens"] == 5  # the server's count, not the 3 chunks
    assert result["ttft_ms_all"] == pytest.approx([100.0])
    assert result["itl_ms_all"] == pytest.approx([100.0, 50.0])
    assert result["mean_e2e_latency_ms"] == pytest.approx(500.0)
    assert result["mean_tpot_ms"] == pytest.approx((0.5 - 0.1) / 4 * 1000)
    # the two tokens the chunks did not show are put at the last arrival
    assert sum(b["output_tokens"] for b in result["timeline"]) == 5
    body = server.generate_requests()[0].json()
    assert body["model"] == "served-model"  # asked from /v1/models
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 5
    assert body["ignore_eos"] is True
    assert len(body["prompt"].split()) == 8


# ------------------------------------------------------------------------------------------
# Failed requests
# ------------------------------------------------------------------------------------------


def test_failed_requests_are_counted_with_their_reasons() -> None:
    good = generate_script([0.1, 0.2])
    http_500 = [Step(head(500, "Content-Length: 12") + b"server broke", 0.05)]
    cut_mid_stream = [Step(SSE_CHUNKED + chunk(gen_event(1)), 0.1)]
    error_in_stream = [
        Step(SSE_CHUNKED + chunk(gen_event(1)), 0.1),
        Step(chunk(sse({"error": {"message": "out of memory"}})), 0.2),
        Step(chunk(DONE) + LAST_CHUNK, 0.3),
    ]
    no_token = [Step(SSE_CHUNKED + chunk(DONE) + LAST_CHUNK, 0.1)]

    class CutHandler:
        def __init__(self) -> None:
            self.scripts = iter([good, http_500, cut_mid_stream, error_in_stream, no_token, good])

        async def __call__(self, request: Request, server: ScriptedServer) -> list[Step] | None:
            script = next(self.scripts)
            # the server drops the connection after the first token of this one
            server.close_after_response = script is cut_mid_stream
            return script

    result, _ = run_against(CutHandler(), num_prompts=6, random_output_len=2)
    assert result["completed"] == 2
    assert result["failed"] == 4
    assert result["total_output_tokens"] == 4
    assert result["failure_reasons"] == {
        "connection_closed": 1,
        "http_500": 1,
        "no_final_record": 1,
        "server_error": 1,
    }
    errors = result["errors"]
    assert len(errors) == 4
    assert errors[0] == "HTTP 500: server broke"
    assert errors[1] == "connection closed mid-response"
    assert "out of memory" in errors[2]
    assert errors[3] == "stream ended without a meta_info record (no token count)"
    # failed requests add nothing to the latency figures
    assert result["ttft_ms_all"] == pytest.approx([100.0, 100.0])


def _zero_token_generate() -> list[Step]:
    return [Step(SSE_CHUNKED + chunk(gen_event(0)) + chunk(DONE) + LAST_CHUNK, 0.1)]


def _completions(deltas: int, usage: int | None) -> list[Step]:
    """An OpenAI stream of ``deltas`` one-word chunks and a usage record counting ``usage``."""
    steps = [Step(SSE_CHUNKED)]
    steps += [Step(chunk(oai_event(f" w{i}")), 0.1 * (i + 1)) for i in range(deltas)]
    tail = (chunk(oai_usage(4, usage)) if usage is not None else b"") + chunk(DONE) + LAST_CHUNK
    return [*steps, Step(tail, 0.1 * (deltas + 1))]


@pytest.mark.parametrize(
    ("backend", "script", "reason", "message"),
    [
        (
            "sglang",
            generate_script([0.1]),
            "short_output",
            "short output: 1 of the 8 completion tokens asked for",
        ),
        (
            "sglang",
            _zero_token_generate(),
            "short_output",
            "short output: 0 of the 8 completion tokens asked for",
        ),
        (
            "sglang",
            generate_script([0.1 * n for n in range(1, 10)]),
            "long_output",
            "long output: 9 completion tokens, 8 asked for",
        ),
        (
            "sglang",
            [Step(SSE_CHUNKED + chunk(sse({"text": "tok"})) + chunk(DONE) + LAST_CHUNK, 0.1)],
            "no_final_record",
            "stream chunk without meta_info.completion_tokens",
        ),
        (
            "sglang-oai",
            _completions(1, 1),
            "short_output",
            "short output: 1 of the 8 completion tokens asked for",
        ),
        (
            "sglang-oai",
            _completions(0, 0),
            "short_output",
            "short output: 0 of the 8 completion tokens asked for",
        ),
        (
            "sglang-oai",
            _completions(9, 9),
            "long_output",
            "long output: 9 completion tokens, 8 asked for",
        ),
        (
            "sglang-oai",
            _completions(8, None),
            "no_final_record",
            "stream ended without a usage record (include_usage)",
        ),
    ],
    ids=[
        "generate-1-of-8",
        "generate-0-of-8",
        "generate-9-of-8",
        "generate-no-meta",
        "oai-1-of-8",
        "oai-0-of-8",
        "oai-9-of-8",
        "oai-no-usage",
    ],
)
def test_a_clean_stream_with_the_wrong_count_is_a_failure(
    backend: str, script: list[Step], reason: str, message: str
) -> None:
    """Every request asks for exactly 8 tokens (ignore_eos): any other count is wrong output."""
    result, server = run_against(
        scripted(script), backend=backend, num_prompts=1, random_output_len=8
    )
    assert (result["completed"], result["failed"]) == (0, 1)
    assert result["failure_reasons"] == {reason: 1}
    assert result["errors"] == [message]
    assert result["total_output_tokens"] == 0
    assert result["output_throughput"] == 0.0
    body = server.generate_requests()[0].json()
    asked = body["sampling_params"] if backend == "sglang" else body
    assert asked["ignore_eos"] is True
    assert asked.get("max_new_tokens", asked.get("max_tokens")) == 8


@pytest.mark.parametrize(
    ("last_event", "reason"),
    [
        (b'data: {"text":"x","meta_info":{"completion_tokens":8,"prompt_to\n\n', "no_final_record"),
        (b"data: <html>upstream timed out</html>\n\n", "malformed_response"),
    ],
    ids=["truncated-json", "not-json"],
)
def test_connection_close_stream_whose_last_event_is_not_json_ends_at_once(
    last_event: bytes, reason: str
) -> None:
    """Framed by the connection's end: the close is the end of the answer, and a final record
    that cannot be read fails the request then, not when the timeout runs out."""
    body = b"".join(gen_event(n) for n in range(1, 8)) + last_event
    response = head(200, "Content-Type: text/event-stream", "Connection: close") + body
    result, _ = run_against(
        scripted([Step(response, 0.1)]),
        num_prompts=1,
        random_output_len=8,
        close_after_response=True,
        timeout=30.0,
    )
    assert result["failure_reasons"] == {reason: 1}, result["errors"]
    assert result["errors"] != ["timeout"]


def test_one_huge_event_is_read_correctly() -> None:
    """A 4 MiB event (a long answer's cumulative text) split across many reads."""
    big = sse(
        {
            "text": "word " * (4 << 18),
            "meta_info": {"prompt_tokens": 3, "completion_tokens": 8, "finish_reason": None},
        }
    )
    stream = SSE_CHUNKED + chunk(big) + chunk(DONE) + LAST_CHUNK
    steps = [Step(stream[i : i + 300_000], 0.1) for i in range(0, len(stream), 300_000)]
    result, _ = run_against(scripted(steps), num_prompts=1, random_output_len=8)
    assert result["completed"] == 1, result["errors"]
    assert result["total_output_tokens"] == 8
    assert result["total_input_tokens"] == 3


def _parse_cpu_seconds(event_bytes: int, read_bytes: int = 4096) -> float:
    """CPU time the /generate stream parser spends on one event of ``event_bytes``, fed in
    reads of ``read_bytes`` (the best of five, to shed scheduling noise)."""
    event = sse({"text": "x" * event_bytes, "meta_info": {"completion_tokens": 1}})
    reads = [event[i : i + read_bytes] for i in range(0, len(event), read_bytes)]

    async def parse() -> float:
        stream = GenerateStream(RequestRecord(), None, expected=1)
        stream.on_head(200, 0.0)
        tic = time.process_time()
        for data in reads:
            stream.on_body(data, 0.0)
        stream.on_end(0.0)
        spent = time.process_time() - tic
        assert stream.error is None and stream.record.output_tokens == 1
        return spent

    return min(asyncio.run(parse()) for _ in range(5))


def test_parsing_one_event_is_linear_in_its_size() -> None:
    """Four times the bytes costs about four times the work; the parser that re-joined and
    re-searched everything kept so far on every read cost fifteen times (measured: 3.2-3.9
    against 14.4-15.1). A ratio measured in one process, so the machine's speed cancels out;
    sizes small enough to stay in the CPU caches, so their size does not bend it."""
    small, large = _parse_cpu_seconds(256 << 10), _parse_cpu_seconds(1 << 20)
    assert large / small < 8, (small, large)


def test_request_timeout_fails_the_request() -> None:
    async def silent(request: Request, server: ScriptedServer) -> list[Step] | None:
        await asyncio.sleep(1.0)  # longer than the client waits
        return None

    result, _ = run_against(silent, num_prompts=1, timeout=0.1)
    assert result["failed"] == 1
    assert result["errors"] == ["timeout"]


# ------------------------------------------------------------------------------------------
# Workload
# ------------------------------------------------------------------------------------------


def test_generate_workload_is_exact_and_repeatable() -> None:
    def bodies(seed: int) -> list[dict[str, Any]]:
        scripts = [generate_script([0.01]) for _ in range(3)]
        _, server = run_against(
            scripted(*scripts),
            num_prompts=3,
            seed=seed,
            random_input_len=37,
            random_output_len=5,
        )
        return [r.json() for r in server.generate_requests()]

    first, again, other = bodies(3), bodies(3), bodies(4)
    assert first == again
    assert first != other
    for body in first:
        assert len(body["input_ids"]) == 37
        assert body["sampling_params"] == {
            "max_new_tokens": 5,
            "ignore_eos": True,
            "temperature": 0,
        }
        assert body["stream"] is True
    assert len({tuple(b["input_ids"]) for b in first}) == 3


def test_warmup_requests_are_sent_first_and_not_counted() -> None:
    scripts = [generate_script([0.01, 0.02]) for _ in range(5)]
    result, server = run_against(
        scripted(*scripts), num_prompts=3, warmup_requests=2, random_output_len=2
    )
    assert len(server.generate_requests()) == 5
    assert result["completed"] == 3
    assert result["num_prompts"] == 3
    assert result["total_output_tokens"] == 6


# ------------------------------------------------------------------------------------------
# /metrics cross-check
# ------------------------------------------------------------------------------------------

METRICS_TEMPLATE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{model_name="m",tp_rank="0"}} {running}
sglang:num_running_reqs{{model_name="m",tp_rank="1"}} {running}
sglang:num_queue_reqs{{model_name="m",tp_rank="0"}} {queued}
sglang:token_usage{{model_name="m",tp_rank="0"}} {usage}
sglang:gen_throughput{{model_name="m",tp_rank="0"}} 123.5
sglang:max_total_num_tokens{{model_name="m",tp_rank="0"}} 65536.0
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{model_name="m",tp_rank="0"}} {generated}
sglang:generation_tokens_created{{model_name="m",tp_rank="0"}} 1.7e9
sglang:prompt_tokens_total{{model_name="m",tp_rank="0"}} {prompted}
sglang:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} 3.0
sglang:cache_hit_rate{{model_name="m"}} NaN
"""


class MetricsServer:
    """Streams /generate while keeping /metrics in step with what it served."""

    def __init__(self) -> None:
        self.generated = 1000.0
        self.prompted = 50.0
        self.running = 0
        self.streams = 0
        self.sampled_while_running = asyncio.Event()

    def scrape(self) -> str:
        if self.running:
            self.sampled_while_running.set()
        return METRICS_TEMPLATE.format(
            running=self.running,
            queued=2 * self.running,
            usage=0.25 * self.running,
            generated=self.generated,
            prompted=self.prompted,
        )

    async def __call__(self, request: Request, server: ScriptedServer) -> list[Step] | None:
        self.streams += 1
        self.running += 1
        self.sampled_while_running.clear()
        if self.streams > 1:  # the first is the warm-up, when the client does not sample
            # hold the stream until the client has sampled /metrics during it
            await asyncio.wait_for(self.sampled_while_running.wait(), 5.0)
        self.running -= 1
        self.generated += 3
        self.prompted += 7
        return generate_script([0.1, 0.2, 0.3])


class LiveMetricsServer(ScriptedServer):
    async def _route(self, request: Request) -> list[Step] | None:
        if request.path == "/metrics":
            assert isinstance(self.handler, MetricsServer)
            self.metrics_text = self.handler.scrape()
        return await super()._route(request)


def test_metrics_cross_check_and_samples() -> None:
    clock = FakeClock()
    server = LiveMetricsServer(clock, MetricsServer())

    async def main() -> dict[str, Any]:
        url = await server.start()
        try:
            config = Config(
                url=url,
                num_prompts=3,
                max_concurrency=1,
                warmup_requests=1,
                metrics_interval=0.01,
                random_output_len=3,
            )
            return await Benchmark(config, clock).run()
        finally:
            await server.stop()

    result = asyncio.run(main())
    assert result["completed"] == 3
    sm = result["server_metrics"]
    # the warm-up's tokens are before the "before" reading: the deltas match the client's count
    assert sm["generation_tokens_delta"] == result["total_output_tokens"] == 9
    assert sm["prompt_tokens_delta"] == result["total_input_tokens"] == 21
    # gauges are summed over ranks (two tp ranks report num_running_reqs)
    assert sm["peak_num_running_reqs"] == 2.0
    assert sm["peak_num_queue_reqs"] == 2.0
    assert sm["peak_token_usage"] == 0.25
    assert sm["max_total_num_tokens"] == 65536.0
    sample = sm["samples"][0]
    assert set(sample) == {
        "t",
        "num_running_reqs",
        "num_queue_reqs",
        "token_usage",
        "gen_throughput",
    }
    assert sample["gen_throughput"] == 123.5
    assert [s["t"] for s in sm["samples"]] == sorted(s["t"] for s in sm["samples"])


def test_parse_prometheus_sums_label_sets_and_skips_comments() -> None:
    values = parse_prometheus(
        METRICS_TEMPLATE.format(running=3, queued=1, usage=0.5, generated=10, prompted=4)
        + "plain_metric 4 1700000000000\n"
        + 'odd{path="/a b}"} 2\n'
    )
    assert values["sglang:num_running_reqs"] == 6.0
    assert values["sglang:generation_tokens_total"] == 10.0
    assert values["sglang:time_to_first_token_seconds_bucket"] == 3.0
    assert "sglang:cache_hit_rate" not in values  # NaN carries no information
    assert values["plain_metric"] == 4.0
    assert values["odd"] == 2.0


def test_parse_prometheus_reads_tabs_and_a_value_right_after_the_labels() -> None:
    values = parse_prometheus('m\t3 1700000000000\ng{a="x}"}2\ng{a="y"} 1\n')
    assert values == {"m": 3.0, "g": 3.0}
    assert parse_series('g{a="x}"}2\n') == [("g", {"a": "x}"}, 2.0)]


def test_parse_prometheus_skips_infinities() -> None:
    """+Inf is legal Prometheus text but no count: it would reach the result as Infinity."""
    values = parse_prometheus('g{r="0"} +Inf\ng{r="1"} 2\nh -Inf\nk 1e400\n')
    assert values == {"g": 2.0}


# ------------------------------------------------------------------------------------------
# Command line: exit codes, API key, JSON file (server in a thread, real clock)
# ------------------------------------------------------------------------------------------


class ThreadedServer:
    """The scripted server on its own event loop, for driving command_line.main()."""

    def __init__(self, handler: Handler, metrics_text: str | None = None) -> None:
        self.server = ScriptedServer(FakeClock(), handler, metrics_text)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(5)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


async def always_two_tokens(request: Request, server: ScriptedServer) -> list[Step]:
    return generate_script([0.0, 0.0])


TWO = ["--random-output-len", "2"]  # what always_two_tokens answers


def test_main_writes_json_and_sends_the_api_key_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SGLANG_API_KEY", "s3cret")
    out = tmp_path / "result.json"
    with ThreadedServer(always_two_tokens) as srv:
        code = command_line.main(["--url", srv.url, "--num-prompts", "4", "--json", str(out), *TWO])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 4
    assert result["request_rate"] is None  # inf is not JSON
    assert {r.headers["authorization"] for r in srv.server.requests} == {"Bearer s3cret"}
    assert "Successful requests:" in capsys.readouterr().out


def test_api_key_flag_wins_over_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    with ThreadedServer(always_two_tokens) as srv:
        assert (
            command_line.main(["--url", srv.url, "--num-prompts", "1", "--api-key", "k1", *TWO])
            == 0
        )
    assert srv.server.generate_requests()[0].headers["authorization"] == "Bearer k1"


def test_no_api_key_sends_no_authorization(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    with ThreadedServer(always_two_tokens) as srv:
        assert command_line.main(["--url", srv.url, "--num-prompts", "1", *TWO]) == 0
    assert all("authorization" not in r.headers for r in srv.server.requests)


def test_exit_code_zero_even_when_requests_fail(tmp_path: Path) -> None:
    async def broken(request: Request, server: ScriptedServer) -> list[Step]:
        return [Step(head(500, "Content-Length: 2") + b"no")]

    out = tmp_path / "r.json"
    with ThreadedServer(broken) as srv:
        code = command_line.main(["--url", srv.url, "--num-prompts", "3", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 0
    assert result["failed"] == 3
    assert result["errors"] == ["HTTP 500: no"] * 3


def test_duration_mode_stops_sending_and_counts_everything_it_sent() -> None:
    with ThreadedServer(always_two_tokens) as srv:
        config = Config(
            url=srv.url,
            num_prompts=None,
            duration=0.3,
            max_concurrency=2,
            warmup_requests=0,
            random_output_len=2,
        )
        result = asyncio.run(Benchmark(config).run())
    sent = len(srv.server.generate_requests())
    assert sent > 0
    assert result["completed"] == sent
    assert result["num_prompts"] == sent
    assert result["total_output_tokens"] == 2 * sent


def test_request_rate_sends_every_request() -> None:
    with ThreadedServer(always_two_tokens) as srv:
        config = Config(
            url=srv.url, num_prompts=5, request_rate=500.0, warmup_requests=0, random_output_len=2
        )
        result = asyncio.run(Benchmark(config).run())
    assert result["completed"] == 5
    assert result["request_rate"] == 500.0


def test_unreachable_server_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with ThreadedServer(always_two_tokens) as srv:
        url = srv.url  # the port is free again once the server stops
    assert command_line.main(["--url", url, "--num-prompts", "1"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach the server at {url} (GET /metrics): ConnectionRefusedError" in err


def test_unreachable_with_no_reason_from_the_system_still_says_what_and_where(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionRefusedError()  # str() of it is empty

    # plain HTTP connects with the loop's sock_connect (http_client.open_socket)
    monkeypatch.setattr(asyncio.selector_events.BaseSelectorEventLoop, "sock_connect", refuse)
    assert command_line.main(["--url", "http://10.9.8.7:31234", "--num-prompts", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "smoke: cannot reach the server at http://10.9.8.7:31234 (GET /metrics): "
        "ConnectionRefusedError (no reason given by the system)"
    )


def test_a_server_that_accepts_but_never_answers_is_unreachable_with_a_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)
        writer.close()

    async def main() -> int:
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            argv = ["--url", f"http://127.0.0.1:{port}", "--num-prompts", "1", "--timeout", "0.3"]
            return await asyncio.get_running_loop().run_in_executor(None, command_line.main, argv)
        finally:
            server.close()

    assert asyncio.run(main()) == 1
    err = capsys.readouterr().err
    assert "cannot reach the server at http://127.0.0.1:" in err
    assert "(GET /metrics): OSError: no answer within 0.3 s" in err


@pytest.mark.parametrize(
    ("key", "source"),
    [("clé-€uro", "env"), ("k\u00e9y\u4e2d", "flag"), ("line\r\nX-Injected: 1", "env")],
    ids=["non-latin1-env", "non-latin1-flag", "header-injection"],
)
def test_an_api_key_no_header_can_carry_is_refused_before_any_request(
    key: str, source: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    argv = ["--num-prompts", "1", *TWO]
    if source == "env":
        monkeypatch.setenv("SGLANG_API_KEY", key)
    else:
        argv += ["--api-key", key]
    with ThreadedServer(always_two_tokens) as srv, pytest.raises(SystemExit) as exc:
        command_line.main(["--url", srv.url, *argv])
    assert exc.value.code == 2
    assert srv.server.requests == []
    out = capsys.readouterr()
    named = "--api-key" if source == "flag" else "SGLANG_API_KEY"
    assert f"error: the API key from {named} has a character at position" in out.err
    assert "Traceback" not in out.err
    for shown in (out.err, out.out):
        assert key not in shown and key[:4] not in shown


def test_a_latin1_api_key_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_API_KEY", "clé")
    with ThreadedServer(always_two_tokens) as srv:
        assert command_line.main(["--url", srv.url, "--num-prompts", "1", *TWO]) == 0
    # the scripted server reads headers as Latin-1, as SGLang's (uvicorn's) does
    assert srv.server.generate_requests()[0].headers["authorization"] == "Bearer clé"


@pytest.mark.parametrize(
    "argv",
    [
        ["--backend", "vllm"],
        ["--num-prompts", "0"],
        ["--duration", "5"],  # neither a concurrency limit nor a rate: unbounded
        ["--url", "ftp://host"],
        ["--warmup-requests", "-1"],
        ["--url", "http://host:99999"],
        ["--url", "http://[::1"],
        ["--url", "http://h\u00f6st\u4e2d:80"],
        ["--timeout", "inf"],
        ["--num-prompts", "many"],
        ["--random-output-len", "99999999999"],
        ["--json", "/nonexistent-folder/r.json"],
    ],
)
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        command_line.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: " in err and "Traceback" not in err


def test_json_keys_follow_the_contract() -> None:
    result, _ = run_against(
        scripted(generate_script([0.1, 0.2])), num_prompts=1, random_output_len=2
    )
    contract = Path(__file__).parent.parent / "docs" / "CONTRACTS.md"
    section = contract.read_text().split("## Smoke result JSON")[1].split("\n## ")[0]
    for key in [
        "completed",
        "failed",
        "duration",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "concurrency",
        *(
            f"{stat}_{name}_ms"
            for stat in ("mean", "median", "p99")
            for name in ("ttft", "tpot", "itl", "e2e_latency")
        ),
    ]:
        assert key in result
    for key in (
        "max_concurrency",
        "request_rate",
        "num_prompts",
        "backend",
        "seed",
        "random_input_len",
        "random_output_len",
        "goodput",
        "slo",
        "server_metrics",
        "timeline",
        "ttft_ms_all",
        "itl_ms_all",
        "failure_reasons",
        "errors",
    ):
        assert f"`{key}`" in section
        assert key in result


# ------------------------------------------------------------------------------------------
# Token ids below the model's vocabulary; a server that dies during the run
# ------------------------------------------------------------------------------------------


def write_model(folder: Path, vocab_size: int, tokenizer_ids: int | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    if tokenizer_ids is not None:
        vocab = {f"w{i}": i for i in range(tokenizer_ids - 1)}
        added = [{"id": tokenizer_ids - 1, "content": "</s>"}]
        tokenizer = {"model": {"type": "WordLevel", "vocab": vocab}, "added_tokens": added}
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def test_vocab_size_is_the_smaller_of_config_and_tokenizer(tmp_path: Path) -> None:
    assert vocab_size_of(str(write_model(tmp_path / "a", 1000))) == 1000
    assert vocab_size_of(str(write_model(tmp_path / "b", 1000, 600))) == 600
    assert vocab_size_of(str(write_model(tmp_path / "c", 500, 600))) == 500
    assert vocab_size_of(str(tmp_path / "missing")) is None
    wrapped = tmp_path / "d"
    wrapped.mkdir()
    (wrapped / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 77}}))
    assert vocab_size_of(str(wrapped)) == 77


def test_token_ids_stay_below_a_small_vocabulary(tmp_path: Path) -> None:
    """A 1000-token model: every id drawn is < 1000 (SGLang dies on one that is not)."""
    model = write_model(tmp_path / "tiny", 1000)

    async def handler(request: Request, server: ScriptedServer) -> list[Step] | None:
        if request.path == "/model_info":
            body = json.dumps({"model_path": str(model)}).encode()
            return [Step(head(200, f"Content-Length: {len(body)}") + body)]
        return generate_script([0.01])

    async def main() -> tuple[dict[str, Any], ScriptedServer]:
        server = ScriptedServer(FakeClock(), handler)
        server._route = handler_first(server, handler)  # type: ignore[method-assign]
        url = await server.start()
        try:
            config = Config(
                url=url, num_prompts=4, warmup_requests=0, random_input_len=500, random_output_len=1
            )
            return await Benchmark(config, server.clock).run(), server
        finally:
            await server.stop()

    result, server = asyncio.run(main())
    assert result["completed"] == 4
    ids = [i for r in server.generate_requests() for i in r.json()["input_ids"]]
    assert len(ids) == 2000
    assert max(ids) < 1000
    assert max(ids) > 900  # drawn across the whole vocabulary, not a fixed small range


def handler_first(server: ScriptedServer, handler: Handler) -> Callable[[Request], Any]:
    """Route /model_info to the test's handler before the scripted server's own answer."""
    own = ScriptedServer._route

    async def route(request: Request) -> list[Step] | None:
        if request.path == "/model_info":
            return await handler(request, server)
        return await own(server, request)

    return route


def test_vocab_size_flag_needs_no_model_info() -> None:
    result, server = run_against(
        scripted(generate_script([0.01])), num_prompts=1, random_output_len=1, vocab_size=300
    )
    assert result["completed"] == 1
    assert max(server.generate_requests()[0].json()["input_ids"]) < 300
    assert all(r.path != "/model_info" for r in server.requests)


def test_unknown_vocabulary_is_refused_before_any_generation(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    async def nowhere(request: Request, server: ScriptedServer) -> list[Step] | None:
        body = json.dumps({"model_path": str(tmp_path / "not-here")}).encode()
        return [Step(head(200, f"Content-Length: {len(body)}") + body)]

    with ThreadedServer(always_two_tokens) as srv:
        srv.server._route = handler_first(srv.server, nowhere)  # type: ignore[method-assign]
        code = command_line.main(["--url", srv.url, "--num-prompts", "1", *TWO])
    assert code == 2
    assert srv.server.generate_requests() == []
    err = capsys.readouterr().err
    assert f"cannot tell the vocabulary size of the model served at {srv.url}" in err
    assert "pass --vocab-size" in err
    assert "Traceback" not in err


def test_a_server_that_dies_in_the_warmup_ends_with_its_name_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What the real SGLang does on an out-of-range id: the whole server goes away."""

    async def die(request: Request, server: ScriptedServer) -> list[Step] | None:
        assert server._server is not None
        server._server.close()  # nothing listens any more
        return None  # and this connection closes without an answer

    with ThreadedServer(die, metrics_text="sglang:num_running_reqs 0\n") as srv:
        code = command_line.main(["--url", srv.url, "--num-prompts", "2", *TWO])
    assert code == 1
    err = capsys.readouterr().err
    assert f"cannot reach the server at {srv.url} (GET /metrics after the warm-up)" in err
    assert "Traceback" not in err


def test_a_jobs_shape_sends_its_lengths_in_turn_and_judges_each() -> None:
    """--lengths (a job's shape): each request asks for its pair's prompt and output tokens,
    and is judged against its own count; the result says the shape's means and identity."""
    shape = ((30, 2), (5, 4), (12, 3))
    scripts = [generate_script([0.01] * out) for _, out in shape * 2]
    scripts[4] = generate_script([0.01] * 2)  # the 5th request (pair 2, 4 tokens) is short
    result, server = run_against(scripted(*scripts), num_prompts=6, lengths=shape)
    bodies = [r.json() for r in server.generate_requests()]
    assert [(len(b["input_ids"]), b["sampling_params"]["max_new_tokens"]) for b in bodies] == [
        *shape,
        *shape,
    ]
    assert (result["completed"], result["failed"]) == (5, 1)
    assert result["failure_reasons"] == {"short_output": 1}
    assert (result["random_input_len"], result["random_output_len"]) == (16, 3)
    assert result["lengths"] == {"pairs": 3, "digest": lengths_digest(shape)}


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("12:4,5", "pair 2 ('5') is not PROMPT:OUTPUT"),
        ("0:4", "counts go from 1 to"),
        ("1:-4", "is not PROMPT:OUTPUT"),
        ("1:4;2:3", "is not PROMPT:OUTPUT"),
        (",".join(["1:1"] * 4097), "4097 pairs, more than 4096"),
        ("9" * 500 + ":1", "is not PROMPT:OUTPUT"),
    ],
)
def test_a_shape_that_is_no_list_of_lengths_is_refused(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        parse_lengths(text)
    assert parse_lengths(" 12:4, 5:6 ") == ((12, 4), (5, 6))
