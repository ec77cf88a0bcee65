#!/usr/bin/env python3
"""Smoke throughput benchmark for one SGLang server, standard library only.

The smoke_gate role copies this single file to a GPU host and runs it there with the host's
python3 (>= 3.9), so it must not import anything outside the standard library. From the repo:

    python3 -m sglang_fleet.smoke --url http://127.0.0.1:30000 --num-prompts 200 \\
        --max-concurrency 32 --random-input-len 512 --random-output-len 128 --json out.json

Flags and metric names follow SGLang's own benchmark client (``sglang.bench_serving``) where they
mean the same thing. Pass the API key through the environment (``SGLANG_API_KEY``) rather than
``--api-key``: a command line is visible to every user of the host in ``ps``.

Exit status: 0 when the run completed (even with failed requests: the gate judges), 1 when the
server could not be reached at all, 2 on bad usage.

Speed matters more than usual here: the gate must measure the server, never this client. The
HTTP/1.1 client is therefore written on ``asyncio.BufferedProtocol`` (the layer under asyncio
streams): bytes are parsed as they arrive, without waking a coroutine per network read, and
/generate chunks are not JSON-decoded one by one (their text is cumulative, so decoding each
would cost O(n^2) per request): the server's token count is found with a byte search, and only
the last chunk of a request is decoded. bench/README.md says how the cost is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import ssl
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any, Callable
from urllib.parse import urlsplit

Clock = Callable[[], float]

# Token ids drawn for random prompts stay below the smallest vocabulary in common use (32000,
# Llama 2) and above the ids tokenizers reserve for special tokens.
_TOKEN_IDS = range(100, 32000)
_WORDS = (  # noqa: SIM905 (a paragraph reads better than a hundred one-word lines)
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no what "
    "up out who them some could more into only time other than then about two may first any new "
    "very these like well over such after most also made many before must through back years "
    "where much your way down should because each just those people how too little state good"
).split()
_READ_BUFFER_BYTES = 64 * 1024
_GET_TIMEOUT_S = 10.0
_MAX_DISTRIBUTION_SAMPLES = 10000
_MAX_ERRORS = 10
_ERROR_TEXT_LIMIT = 300
_PERCENTILE = 99

# Found with rfind: a quote inside generated text is escaped (\"), so the key cannot match there.
_COMPLETION_TOKENS_KEY = b'"completion_tokens"'

# /metrics names (SGLang's collector); values are summed over label sets (tp/dp ranks).
_M_RUNNING = "sglang:num_running_reqs"
_M_QUEUE = "sglang:num_queue_reqs"
_M_TOKEN_USAGE = "sglang:token_usage"
_M_GEN_THROUGHPUT = "sglang:gen_throughput"
_M_GEN_TOKENS = "sglang:generation_tokens_total"
_M_PROMPT_TOKENS = "sglang:prompt_tokens_total"
_M_MAX_TOTAL_TOKENS = "sglang:max_total_num_tokens"


class ServerUnreachable(Exception):
    """The server did not accept a connection at all (exit status 1)."""


# --------------------------------------------------------------------------------------------
# Configuration and workload
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    """What to run, resolved from the command line (see ``build_parser`` for meanings)."""

    url: str
    backend: str = "sglang"
    num_prompts: int | None = 1000
    duration: float | None = None
    max_concurrency: int | None = None
    request_rate: float = math.inf
    random_input_len: int = 1024
    random_output_len: int = 128
    seed: int = 42
    warmup_requests: int = 1
    api_key: str | None = None
    model: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    metrics_interval: float = 0.5
    timeout: float = 600.0


def _generate_body(cfg: Config, rng: random.Random, model: str) -> bytes:
    """One request body; a fixed seed gives the same workload on every run."""
    if cfg.backend == "sglang":
        ids = rng.choices(_TOKEN_IDS, k=cfg.random_input_len)
        payload: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": cfg.random_output_len,
                "ignore_eos": True,
                "temperature": 0,
            },
            "stream": True,
        }
    else:
        # Common words are about one token each; the server's usage gives the exact count.
        words = [rng.choice(_WORDS) for _ in range(cfg.random_input_len)]
        payload = {
            "model": model,
            "prompt": " ".join(words),
            "max_tokens": cfg.random_output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    return json.dumps(payload, separators=(",", ":")).encode()


def _bodies(cfg: Config, seed: int, model: str, count: int | None) -> Iterator[bytes]:
    """Request bodies in a fixed order; endless when ``count`` is None (duration mode)."""
    rng = random.Random(seed)
    sent = 0
    while count is None or sent < count:
        yield _generate_body(cfg, rng, model)
        sent += 1


# --------------------------------------------------------------------------------------------
# Minimal HTTP/1.1 client: keep-alive, chunked transfer decoding, SSE
# --------------------------------------------------------------------------------------------


def _number_after(payload: bytes, key: int) -> int:
    """The integer after the JSON key at index ``key``: ``"name": 12`` or ``"name":12``."""
    start = payload.find(b":", key + 2) + 1
    end = payload.find(b",", start)
    brace = payload.find(b"}", start)
    if end < 0 or 0 <= brace < end:
        end = brace
    return int(payload[start:end])


class _Exchange:
    """One request/response on a connection; collects the body unless a subclass streams it."""

    def __init__(self) -> None:
        self.status = 0
        self.body = bytearray()
        self.error: str | None = None
        self.got_bytes = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_head(self, status: int, t: float) -> None:
        self.status = status

    def on_body(self, data: bytes, t: float) -> None:
        self.body += data

    def on_end(self, t: float) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def on_error(self, message: str) -> None:
        if self.error is None:
            self.error = message
        if not self.done.done():
            self.done.set_result(None)


_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _DONE, _LENGTH, _UNTIL_CLOSE = range(8)


def _chunk_size(line: bytes) -> int:
    size = int(line.split(b";", 1)[0], 16)  # chunk extensions carry nothing we need
    if size < 0:
        raise ValueError("negative chunk size")
    return size


def _line_after_chunk(state: int, blank: bool) -> int:
    """The CRLF that ends a chunk, or a trailer line (a blank one ends the response)."""
    if state == _CHUNK_CRLF:
        if not blank:
            raise ValueError("chunk not followed by CRLF")
        return _CHUNK_SIZE
    return _DONE if blank else _TRAILER


class _Connection(asyncio.BufferedProtocol):
    """An HTTP/1.1 connection that parses responses as bytes arrive (no pipelining).

    A buffered protocol, because a plain one makes asyncio allocate a fresh 256 KiB bytes
    object for every read: that alone costs several times the parsing of a streamed token.
    """

    def __init__(self, clock: Clock) -> None:
        self._read_buffer = memoryview(bytearray(_READ_BUFFER_BYTES))
        self.clock = clock
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.closed = False
        self.keep_alive = True
        self._state = _HEAD
        self._buf = b""
        self._remaining = 0

    # asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        exchange = self.exchange
        if exchange is None:
            return
        if self._state == _UNTIL_CLOSE:
            self._finish(self.clock())
        elif exchange.got_bytes:
            exchange.on_error("connection closed mid-response")
        else:
            exchange.on_error("connection closed before a response")

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._read_buffer[:nbytes].tobytes())

    def data_received(self, data: bytes) -> None:
        t = self.clock()
        exchange = self.exchange
        if exchange is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        exchange.got_bytes = True
        try:
            if self._state == _HEAD:
                data = self._parse_head(data, t)
            if data and self.exchange is not None:
                self._feed_body(data, t)
        except (ValueError, IndexError, KeyError, TypeError, AttributeError) as err:
            # whatever the server sent cannot be read as HTTP + SSE + JSON: fail this request
            exchange.on_error(f"malformed response: {type(err).__name__}: {err}")
            self.exchange = None
            self.close()

    # requests --------------------------------------------------------------------------
    def start(self, request: bytes, exchange: _Exchange) -> None:
        self.exchange = exchange
        self._state = _HEAD
        self._buf = b""
        assert self.transport is not None
        self.transport.write(request)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # parsing ---------------------------------------------------------------------------
    def _parse_head(self, data: bytes, t: float) -> bytes:
        buf = self._buf + data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            self._buf = buf
            return b""
        lines = buf[:end].decode("latin-1").split("\r\n")
        version, status = lines[0].split(" ", 2)[:2]
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        connection = headers.get("connection", "").lower()
        self.keep_alive = version == "HTTP/1.1" and connection != "close"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _CHUNK_SIZE
        elif "content-length" in headers:
            self._state = _LENGTH
            self._remaining = int(headers["content-length"])
        else:
            self._state = _UNTIL_CLOSE
            self.keep_alive = False
        self._buf = b""
        assert self.exchange is not None
        self.exchange.on_head(int(status), t)
        rest = buf[end + 4 :]
        if self._state == _LENGTH and self._remaining == 0:
            self._finish(t)
        return rest

    def _feed_body(self, data: bytes, t: float) -> None:
        state = self._state
        if state == _LENGTH:
            take = data[: self._remaining]
            self._remaining -= len(take)
            assert self.exchange is not None
            self.exchange.on_body(take, t)
            if self._remaining == 0:
                self._finish(t)
        elif state == _UNTIL_CLOSE:
            assert self.exchange is not None
            self.exchange.on_body(data, t)
        else:
            self._feed_chunked(data, t)

    def _feed_chunked(self, data: bytes, t: float) -> None:
        buf = self._buf + data if self._buf else data
        size_of = len(buf)
        pos = 0
        pieces = []
        state = self._state
        while pos < size_of and state != _DONE:
            if state == _CHUNK_SIZE:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = _chunk_size(buf[pos:eol])
                pos = eol + 2
                end = pos + size
                if size == 0:
                    state = _TRAILER
                elif end + 2 <= size_of:  # the whole chunk is here: the usual case
                    if buf[end : end + 2] != b"\r\n":
                        raise ValueError("chunk not followed by CRLF")
                    pieces.append(buf[pos:end])
                    pos = end + 2
                else:
                    self._remaining = size
                    state = _CHUNK_DATA
            elif state == _CHUNK_DATA:
                take = min(self._remaining, size_of - pos)
                pieces.append(buf[pos : pos + take])
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    state = _CHUNK_CRLF
            else:  # the CRLF after a chunk, or trailer lines up to a blank one
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                state = _line_after_chunk(state, blank=eol == pos)
                pos = eol + 2
        self._state = state
        self._buf = buf[pos:]
        self._deliver(pieces, t)

    def _deliver(self, pieces: list[bytes], t: float) -> None:
        """Hand the body bytes of one read over at once, then end the response if it ended."""
        if pieces:
            assert self.exchange is not None
            self.exchange.on_body(pieces[0] if len(pieces) == 1 else b"".join(pieces), t)
        if self._state == _DONE:
            self._finish(t)

    def _finish(self, t: float) -> None:
        exchange = self.exchange
        self.exchange = None
        self._state = _HEAD
        if not self.keep_alive:
            self.close()
        if exchange is not None:
            exchange.on_end(t)


class HttpClient:
    """Connection pool for one server: connections are reused while the server keeps them."""

    def __init__(self, url: str, api_key: str | None, clock: Clock, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url must look like http://HOST:PORT, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.base_path = parts.path.rstrip("/")
        self.clock = clock
        self.timeout = timeout
        self._idle: list[_Connection] = []
        host_header = parts.netloc.rpartition("@")[2]
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self._common_headers = f"Host: {host_header}\r\n{auth}User-Agent: sglang-fleet-smoke\r\n"

    def request_bytes(self, method: str, path: str, body: bytes | None) -> bytes:
        head = f"{method} {self.base_path}{path} HTTP/1.1\r\n{self._common_headers}"
        if body is None:
            return (head + "\r\n").encode("latin-1")
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        return head.encode("latin-1") + body

    async def _connection(self) -> tuple[_Connection, bool]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn, True
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: _Connection(self.clock), self.host, self.port, ssl=self.ssl
        )
        return conn, False

    async def send(
        self, request: bytes, exchange: _Exchange, before_send: Callable[[], None]
    ) -> None:
        """Run one exchange; sets ``exchange.error`` instead of raising for request failures.

        A reused keep-alive connection that the server closed meanwhile fails before any byte
        comes back: that request is sent once more on a fresh connection.
        """
        for attempt in range(2):
            try:
                conn, reused = await self._connection()
            except OSError as err:
                exchange.on_error(f"connect failed: {err}")
                return
            before_send()
            conn.start(request, exchange)
            timer = asyncio.get_running_loop().call_later(
                self.timeout, self._expire, conn, exchange
            )
            try:
                await exchange.done
            finally:
                timer.cancel()
            stale = reused and exchange.error is not None and not exchange.got_bytes
            if stale and attempt == 0 and exchange.error != "timeout":
                exchange.error = None
                exchange.done = asyncio.get_running_loop().create_future()
                continue
            if exchange.error is None and conn.keep_alive and not conn.closed:
                self._idle.append(conn)
            elif not conn.closed:
                conn.close()
            return

    def _expire(self, conn: _Connection, exchange: _Exchange) -> None:
        conn.exchange = None
        conn.close()
        exchange.on_error("timeout")

    async def get(self, path: str) -> tuple[int, bytes]:
        """GET a small document; raises OSError when the server cannot be reached."""
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: _Connection(self.clock), self.host, self.port, ssl=self.ssl
        )
        exchange = _Exchange()
        conn.start(self.request_bytes("GET", path, None), exchange)
        try:
            # small documents; a server that sits on one must not hold up the run's end
            await asyncio.wait_for(exchange.done, min(self.timeout, _GET_TIMEOUT_S))
        finally:
            conn.close()
        if exchange.error is not None:
            raise OSError(exchange.error)
        return exchange.status, bytes(exchange.body)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


# --------------------------------------------------------------------------------------------
# One streamed request
# --------------------------------------------------------------------------------------------


class RequestRecord:
    """Timings and server-side token counts of one request (seconds, clock units)."""

    __slots__ = ("error", "itl", "latency", "output_tokens", "prompt_tokens", "start", "ttft")

    def __init__(self) -> None:
        self.start = 0.0
        self.ttft = 0.0
        self.latency = 0.0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.itl: list[float] = []
        self.error: str | None = None


class Timeline:
    """Output tokens per whole second since the benchmark started (for the picture)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.counts: list[int] = []

    def add(self, t: float, tokens: int) -> None:
        second = int(t - self.t0)
        if second < 0:
            return
        counts = self.counts
        if second >= len(counts):
            counts.extend([0] * (second + 1 - len(counts)))
        counts[second] += tokens


class _SseStream(_Exchange):
    """Turns a 200 event stream into a RequestRecord; other statuses are collected as text."""

    def __init__(self, record: RequestRecord, timeline: Timeline | None) -> None:
        super().__init__()
        self.record = record
        self.timeline = timeline
        self.partial = b""
        self.tokens = 0
        self.last_t = 0.0
        self.end_t: float | None = None

    def on_body(self, data: bytes, t: float) -> None:
        if self.status != 200:
            self.body += data
            return
        if self.partial:
            data = self.partial + data
        if b"\r" in data:  # SSE lines may end in CRLF
            data = data.replace(b"\r\n", b"\n")
        cut = data.rfind(b"\n\n") + 2  # complete events end with a blank line
        if cut < 2:
            self.partial = data
            return
        self.partial = data[cut:]
        if self.error is None:
            self.on_events(data[:cut] if cut < len(data) else data, t)

    def on_events(self, block: bytes, t: float) -> None:
        """Complete events that arrived together at ``t``, one at a time."""
        for line in block.split(b"\n"):
            if line[:5] != b"data:":
                continue  # blank separators, comments (keep-alive pings), event: lines
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.end_t = t
            elif self.error is None:
                self.on_event(payload, t)

    def on_event(self, payload: bytes, t: float) -> None:
        raise NotImplementedError

    def add_tokens(self, new: int, t: float) -> None:
        """Record ``new`` tokens that arrived at ``t`` (TTFT, then ITL like bench_serving)."""
        record = self.record
        if self.tokens == 0:
            record.ttft = t - record.start
        elif new == 1:
            record.itl.append(t - self.last_t)
        else:  # a chunk with several tokens: spread its gap over them, as bench_serving does
            record.itl.extend([(t - self.last_t) / new] * new)
        self.last_t = t
        self.tokens += new
        timeline = self.timeline
        if timeline is not None:
            timeline.add(t, new)

    def fail_if_error(self, payload: bytes) -> bool:
        """SGLang reports errors inside the stream as ``data: {"error": ...}``."""
        if b'"error"' not in payload:
            return False
        try:
            obj = json.loads(payload)
        except ValueError:
            return False
        if isinstance(obj, dict) and obj.get("error"):
            self.on_error("server error in stream: {}".format(json.dumps(obj["error"])[:200]))
            return True
        return False

    def on_end(self, t: float) -> None:
        if self.status == 200 and self.error is None:
            self.record.latency = (self.end_t if self.end_t is not None else t) - self.record.start
            self.finish_counts()
        elif self.status != 200 and self.error is None:
            text = bytes(self.body[:_ERROR_TEXT_LIMIT]).decode("utf-8", "replace")
            self.error = f"HTTP {self.status}: {text.strip()}"
        super().on_end(t)

    def finish_counts(self) -> None:
        raise NotImplementedError


class _GenerateStream(_SseStream):
    """SGLang native /generate: cumulative text, server counts in meta_info."""

    def __init__(self, record: RequestRecord, timeline: Timeline | None) -> None:
        super().__init__(record, timeline)
        self.last_payload = b""

    def on_events(self, block: bytes, t: float) -> None:
        """Events that arrived in one read share one time, so with nothing but token chunks
        in the block (the usual case) only its first and last counts matter: the first gives
        the gap since the previous read, the later ones add zero gaps, exactly as handling them
        one by one would. Anything else (errors, comments, zero-token chunks) goes one by one.
        Events start at a line start, and JSON text cannot hold a raw newline."""
        if block.find(b"\n") == len(block) - 2 and block.startswith(b"data: {"):
            self.on_event(block[6:-2], t)  # the usual read of a server that keeps up: one event
            return
        events = block.count(b"\ndata:") + block.startswith(b"data:")
        done = block.count(b"\ndata: [DONE]") + block.startswith(b"data: [DONE]")
        first = block.find(_COMPLETION_TOKENS_KEY)
        if first < 0 or events != block.count(_COMPLETION_TOKENS_KEY) + done:
            super().on_events(block, t)
            return
        first_count = _number_after(block, first)
        if first_count <= self.tokens:
            super().on_events(block, t)
            return
        last_count = _number_after(block, block.rfind(_COMPLETION_TOKENS_KEY))
        self.add_tokens(first_count - self.tokens, t)
        if last_count > first_count:
            self.add_tokens(last_count - first_count, t)
        self.last_payload = block
        if done:
            self.end_t = t

    def on_event(self, payload: bytes, t: float) -> None:
        key = payload.rfind(_COMPLETION_TOKENS_KEY)
        if key < 0:
            if not self.fail_if_error(payload):
                self.on_error("stream chunk without meta_info.completion_tokens")
            return
        self.last_payload = payload
        new = _number_after(payload, key) - self.tokens
        if new > 0:
            self.add_tokens(new, t)

    def finish_counts(self) -> None:
        if not self.last_payload:
            self.error = "stream ended without any token"
            return
        # the line of the last count: one payload, or a block of events that came together
        last = self.last_payload
        key = last.rfind(_COMPLETION_TOKENS_KEY)
        end = last.find(b"\n", key)
        line = last[last.rfind(b"\n", 0, key) + 1 : end if end >= 0 else len(last)]
        final = json.loads(line[5:] if line.startswith(b"data:") else line)
        meta = (final.get("meta_info") if isinstance(final, dict) else None) or {}
        self.record.prompt_tokens = int(meta.get("prompt_tokens", 0))
        self.record.output_tokens = int(meta.get("completion_tokens", self.tokens))


class _CompletionsStream(_SseStream):
    """OpenAI-compatible /v1/completions: text deltas, then a usage-only chunk."""

    def __init__(self, record: RequestRecord, timeline: Timeline | None) -> None:
        super().__init__(record, timeline)
        self.usage: dict[str, Any] | None = None

    def on_event(self, payload: bytes, t: float) -> None:
        try:
            obj = json.loads(payload)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            self.on_error(f"malformed stream chunk: {payload[:100]!r}")
            return
        if obj.get("error"):
            self.on_error("server error in stream: {}".format(json.dumps(obj["error"])[:200]))
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
        choices = obj.get("choices")
        if choices and choices[0].get("text"):
            self.add_tokens(1, t)  # a delta chunk; the exact count comes from usage

    def finish_counts(self) -> None:
        if self.tokens == 0:
            self.error = "stream ended without any token"
            return
        usage = self.usage or {}
        record = self.record
        record.prompt_tokens = int(usage.get("prompt_tokens", 0))
        record.output_tokens = int(usage.get("completion_tokens", self.tokens))
        # Chunks can carry several tokens: put the ones the server counted beyond the chunks at
        # the last arrival so the timeline adds up to the server's count.
        extra = record.output_tokens - self.tokens
        if extra > 0 and self.timeline is not None:
            self.timeline.add(self.last_t, extra)


# --------------------------------------------------------------------------------------------
# Server /metrics (Prometheus text format, parsed by hand)
# --------------------------------------------------------------------------------------------


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample values by metric name, summed over label sets (one per tp/dp rank)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            rest = line[line.rfind("}") + 1 :]
        elif space != -1:
            name, rest = line[:space], line[space:]
        else:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if not math.isnan(value):
            totals[name] = totals.get(name, 0.0) + value
    return totals


async def read_metrics(client: HttpClient) -> dict[str, float] | None:
    """The server's metrics, or None when /metrics is not served (no --enable-metrics)."""
    status, body = await client.get("/metrics")
    if status != 200:
        return None
    return parse_prometheus(body.decode("utf-8", "replace"))


class MetricsSampler:
    """Samples /metrics gauges during the run for peaks and a timeline."""

    def __init__(self, client: HttpClient, interval: float, clock: Clock, t0: float) -> None:
        self.client = client
        self.interval = interval
        self.clock = clock
        self.t0 = t0
        self.samples: list[dict[str, float]] = []
        self.max_total_num_tokens: float | None = None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)

    async def sample(self) -> None:
        try:
            values = await read_metrics(self.client)
        except (OSError, asyncio.TimeoutError):
            return  # a missed sample is not worth failing the run for
        if values is None:
            return
        if _M_MAX_TOTAL_TOKENS in values:
            self.max_total_num_tokens = values[_M_MAX_TOTAL_TOKENS]
        self.samples.append(
            {
                "t": round(self.clock() - self.t0, 3),
                "num_running_reqs": values.get(_M_RUNNING, 0.0),
                "num_queue_reqs": values.get(_M_QUEUE, 0.0),
                "token_usage": values.get(_M_TOKEN_USAGE, 0.0),
                "gen_throughput": values.get(_M_GEN_THROUGHPUT, 0.0),
            }
        )


def _server_summary(
    before: dict[str, float], after: dict[str, float] | None, sampler: MetricsSampler
) -> dict[str, Any]:
    after = after or before
    samples = sampler.samples

    def delta(name: str) -> float | None:
        if name not in before or name not in after:
            return None
        return after[name] - before[name]

    def peak(key: str) -> float | None:
        return max((s[key] for s in samples), default=None)

    max_tokens = sampler.max_total_num_tokens
    if max_tokens is None:
        max_tokens = after.get(_M_MAX_TOTAL_TOKENS)
    return {
        "generation_tokens_delta": delta(_M_GEN_TOKENS),
        "prompt_tokens_delta": delta(_M_PROMPT_TOKENS),
        "peak_num_running_reqs": peak("num_running_reqs"),
        "peak_num_queue_reqs": peak("num_queue_reqs"),
        "peak_token_usage": peak("token_usage"),
        "max_total_num_tokens": max_tokens,
        "samples": samples,
    }


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------


class Benchmark:
    """Runs the workload against one server and turns the records into the result JSON."""

    def __init__(self, cfg: Config, clock: Clock = time.perf_counter) -> None:
        self.cfg = cfg
        self.clock = clock
        self.client = HttpClient(cfg.url, cfg.api_key, clock, cfg.timeout)
        if cfg.backend == "sglang":
            self.path = "/generate"
            self.stream_class: type[_SseStream] = _GenerateStream
        else:
            self.path = "/v1/completions"
            self.stream_class = _CompletionsStream

    async def run(self) -> dict[str, Any]:
        try:
            return await self._run()
        finally:
            self.client.close()

    async def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        try:
            metrics_before = await read_metrics(self.client)
        except (OSError, asyncio.TimeoutError) as err:
            raise ServerUnreachable(f"cannot reach {cfg.url}: {err or type(err).__name__}") from err
        model = await self._model_name()
        if cfg.warmup_requests > 0:
            warmup = _bodies(cfg, cfg.seed + 2, model, cfg.warmup_requests)
            await self._dispatch(warmup, None, math.inf, None, None)
            if metrics_before is not None:
                metrics_before = await read_metrics(self.client)

        t0 = self.clock()
        timeline = Timeline(t0)
        sampler = MetricsSampler(self.client, cfg.metrics_interval, self.clock, t0)
        stop = asyncio.Event()
        sampling = None
        if metrics_before is not None:
            sampling = asyncio.ensure_future(sampler.run(stop))
        deadline = t0 + cfg.duration if cfg.duration is not None else None
        bodies = _bodies(cfg, cfg.seed, model, cfg.num_prompts)
        records = await self._dispatch(
            bodies, cfg.max_concurrency, cfg.request_rate, deadline, timeline
        )
        duration = self.clock() - t0
        server = None
        if sampling is not None and metrics_before is not None:
            stop.set()
            await sampling
            try:
                metrics_after = await read_metrics(self.client)
            except (OSError, asyncio.TimeoutError):
                metrics_after = None
            server = _server_summary(metrics_before, metrics_after, sampler)
        return summarize(cfg, records, duration, timeline, server)

    async def _model_name(self) -> str:
        """The OpenAI backend needs a model name: --model, else the server's first one."""
        if self.cfg.model or self.cfg.backend == "sglang":
            return self.cfg.model or ""
        status, body = await self.client.get("/v1/models")
        if status == 200:
            models = json.loads(body).get("data") or []
            if models:
                return str(models[0].get("id", "default"))
        return "default"

    async def _dispatch(
        self,
        bodies: Iterator[bytes],
        max_concurrency: int | None,
        request_rate: float,
        deadline: float | None,
        timeline: Timeline | None,
    ) -> list[RequestRecord]:
        """Send requests as the rate and concurrency limit allow; wait for all of them."""
        loop = asyncio.get_running_loop()
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        arrivals = random.Random(self.cfg.seed + 1)
        next_arrival = loop.time()
        tasks = []
        for body in bodies:
            if math.isfinite(request_rate):
                # Poisson arrivals, as bench_serving draws them
                next_arrival += arrivals.expovariate(request_rate)
                await asyncio.sleep(max(0.0, next_arrival - loop.time()))
            if limit is not None:
                await limit.acquire()
            if deadline is not None and self.clock() >= deadline:
                if limit is not None:
                    limit.release()
                break
            tasks.append(loop.create_task(self._one(body, limit, timeline)))
        return list(await asyncio.gather(*tasks))

    async def _one(
        self, body: bytes, limit: asyncio.Semaphore | None, timeline: Timeline | None
    ) -> RequestRecord:
        record = RequestRecord()
        stream = self.stream_class(record, timeline)
        clock = self.clock

        def stamp_start() -> None:
            record.start = clock()

        try:
            request = self.client.request_bytes("POST", self.path, body)
            await self.client.send(request, stream, stamp_start)
            record.error = stream.error
        finally:
            if limit is not None:
                limit.release()
        return record


# --------------------------------------------------------------------------------------------
# Metrics, as SGLang's bench_serving computes them
# --------------------------------------------------------------------------------------------


def percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy.percentile's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _stats_ms(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [value * 1000.0 for value in seconds]
    return {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"p99_{name}_ms": percentile(ms, _PERCENTILE),
    }


def _capped(values: list[float], cap: int = _MAX_DISTRIBUTION_SAMPLES) -> list[float]:
    """An evenly spaced subsample, so a long run's plot still shows the whole run."""
    if len(values) <= cap:
        return values
    step = len(values) / cap
    return [values[int(i * step)] for i in range(cap)]


def _tpot(record: RequestRecord) -> float | None:
    if record.output_tokens <= 1:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def _goodput(cfg: Config, records: list[RequestRecord]) -> float | None:
    """Share of all requests sent that completed within every SLO given (bench_serving's
    slo_attainment); a one-token answer has no TPOT and so meets that SLO."""
    if (cfg.slo_ttft_ms is None and cfg.slo_tpot_ms is None) or not records:
        return None
    good = 0
    for record in records:
        if record.error is not None:
            continue
        if cfg.slo_ttft_ms is not None and record.ttft * 1000.0 > cfg.slo_ttft_ms:
            continue
        tpot = _tpot(record) or 0.0
        if cfg.slo_tpot_ms is not None and tpot * 1000.0 > cfg.slo_tpot_ms:
            continue
        good += 1
    return good / len(records)


def summarize(
    cfg: Config,
    records: list[RequestRecord],
    duration: float,
    timeline: Timeline,
    server: dict[str, Any] | None,
) -> dict[str, Any]:
    """The result JSON (docs/CONTRACTS.md, "Smoke result JSON")."""
    done = [r for r in records if r.error is None]
    errors = [r.error for r in records if r.error is not None]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    ttfts = [r.ttft for r in done]
    itls = [gap for r in done for gap in r.itl]
    tpots = [t for t in (_tpot(r) for r in done) if t is not None]
    latencies = [r.latency for r in done]
    per_second = duration if duration > 0 else math.inf
    result: dict[str, Any] = {
        "backend": cfg.backend,
        "completed": len(done),
        "failed": len(errors),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / per_second,
        "input_throughput": input_tokens / per_second,
        "output_throughput": output_tokens / per_second,
    }
    for name, values in (
        ("ttft", ttfts),
        ("tpot", tpots),
        ("itl", itls),
        ("e2e_latency", latencies),
    ):
        result.update(_stats_ms(name, values))
    result.update(
        {
            "concurrency": sum(latencies) / per_second,
            "max_concurrency": cfg.max_concurrency,
            # JSON has no infinity: null means "all at once", as fast as the limit allows
            "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else None,
            "num_prompts": len(records),
            "seed": cfg.seed,
            "random_input_len": cfg.random_input_len,
            "random_output_len": cfg.random_output_len,
            "goodput": _goodput(cfg, records),
            "slo": {"ttft_ms": cfg.slo_ttft_ms, "tpot_ms": cfg.slo_tpot_ms},
            "server_metrics": server,
            "timeline": [{"t": i, "output_tokens": n} for i, n in enumerate(timeline.counts)],
            "ttft_ms_all": [t * 1000.0 for t in _capped(ttfts)],
            "itl_ms_all": [t * 1000.0 for t in _capped(itls)],
            "errors": errors[:_MAX_ERRORS],
        }
    )
    return result


def format_summary(result: dict[str, Any]) -> str:
    """A short human summary, laid out like bench_serving's."""
    rows = [
        ("Backend", result["backend"]),
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Benchmark duration (s)", "{:.2f}".format(result["duration"])),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", "{:.2f}".format(result["request_throughput"])),
        ("Output token throughput (tok/s)", "{:.2f}".format(result["output_throughput"])),
        ("Concurrency", "{:.2f}".format(result["concurrency"])),
        (
            "Median / P99 TTFT (ms)",
            "{:.2f} / {:.2f}".format(result["median_ttft_ms"], result["p99_ttft_ms"]),
        ),
        (
            "Median / P99 TPOT (ms)",
            "{:.2f} / {:.2f}".format(result["median_tpot_ms"], result["p99_tpot_ms"]),
        ),
        (
            "Median / P99 ITL (ms)",
            "{:.2f} / {:.2f}".format(result["median_itl_ms"], result["p99_itl_ms"]),
        ),
    ]
    if result["goodput"] is not None:
        rows.append(("Goodput (share within SLO)", "{:.3f}".format(result["goodput"])))
    server = result["server_metrics"]
    if server is not None:
        rows.append(("Server generated tokens (delta)", server["generation_tokens_delta"]))
        rows.append(
            (
                "Peak running / queued requests",
                "{} / {}".format(server["peak_num_running_reqs"], server["peak_num_queue_reqs"]),
            )
        )
        rows.append(("Peak token usage", server["peak_token_usage"]))
    lines = ["{:=^60}".format(" Smoke Benchmark Result ")]
    lines += ["{:<40} {}".format(label + ":", value) for label, value in rows]
    lines += [f"error: {e}" for e in result["errors"][:3]]
    lines.append("=" * 60)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Smoke throughput benchmark for an SGLang server (standard library only).",
        epilog="Prefer the SGLANG_API_KEY environment variable to --api-key: the command line "
        "of a process is visible to every user of the host.",
    )
    add = parser.add_argument
    add("--url", default="http://127.0.0.1:30000", help="server base URL")
    add("--backend", choices=("sglang", "sglang-oai"), default="sglang",
        help="sglang: /generate with token ids; sglang-oai: /v1/completions with text")  # fmt: skip
    add("--num-prompts", type=_positive_int, default=None,
        help="requests to send (default 1000, or no limit with --duration)")  # fmt: skip
    add("--duration", type=_positive_float, default=None,
        help="send requests for this many seconds instead of a fixed count")  # fmt: skip
    add("--max-concurrency", type=_positive_int, default=None, help="requests in flight at most")
    add("--request-rate", type=_positive_float, default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)")  # fmt: skip
    add("--random-input-len", type=_positive_int, default=1024, help="prompt tokens per request")
    add("--random-output-len", type=_positive_int, default=128, help="output tokens per request")
    add("--seed", type=int, default=42, help="workload seed (same seed, same requests)")
    add("--warmup-requests", type=int, default=1, help="requests sent first and not counted")
    add("--api-key", default=None, help="bearer token (default: $SGLANG_API_KEY)")
    add("--model", default=None, help="model name for sglang-oai (default: the server's first)")
    add("--slo-ttft-ms", type=_positive_float, default=None, help="TTFT SLO for goodput")
    add("--slo-tpot-ms", type=_positive_float, default=None, help="TPOT SLO for goodput")
    add("--metrics-interval", type=_positive_float, default=0.5,
        help="seconds between /metrics samples")  # fmt: skip
    add("--timeout", type=_positive_float, default=600.0, help="seconds allowed per request")
    add("--json", dest="json_out", default=None, help="write the result JSON here")
    return parser


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Config:
    if args.warmup_requests < 0:
        parser.error("--warmup-requests must not be negative")
    unbounded = math.isinf(args.request_rate) and args.max_concurrency is None
    if args.duration is not None and unbounded:
        parser.error("--duration needs --max-concurrency or a finite --request-rate")
    num_prompts = args.num_prompts
    if num_prompts is None and args.duration is None:
        num_prompts = 1000
    try:
        HttpClient(args.url, None, time.perf_counter, 1.0)
    except ValueError as err:
        parser.error(str(err))
    return Config(
        url=args.url,
        backend=args.backend,
        num_prompts=num_prompts,
        duration=args.duration,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        seed=args.seed,
        warmup_requests=args.warmup_requests,
        api_key=args.api_key or os.environ.get("SGLANG_API_KEY") or None,
        model=args.model,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        metrics_interval=args.metrics_interval,
        timeout=args.timeout,
    )


def _write_json(path: str, result: dict[str, Any]) -> None:
    """Write atomically: the gate must never read half a result."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
        handle.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args, parser)
    try:
        result = asyncio.run(Benchmark(cfg).run())
    except ServerUnreachable as err:
        print(f"smoke: {err}", file=sys.stderr)
        return 1
    if args.json_out:
        _write_json(args.json_out, result)
    print(format_summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
