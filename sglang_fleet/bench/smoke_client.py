#!/usr/bin/env python3
"""Smoke throughput benchmark for one SGLang server, standard library only.

The smoke_gate role copies this single file to a GPU host and runs it there with the host's
python3 (>= 3.9), so it must not import anything outside the standard library. From the repo:

    python3 -m sglang_fleet.bench.smoke_client --url http://127.0.0.1:30000 --num-prompts 200 \\
        --max-concurrency 32 --random-input-len 512 --random-output-len 128 --json out.json

Flags and metric names follow SGLang's own benchmark client (``sglang.bench_serving``) where they
mean the same thing. Pass the API key through the environment (``SGLANG_API_KEY``) rather than
``--api-key``: a command line is visible to every user of the host in ``ps``.

Exit status: 0 when the run completed (even with failed requests: the gate judges), 1 when the
server could not be reached at all or stopped answering before the run (a message naming the
server, no traceback), 2 on bad usage (a message naming the flag, no traceback).

Random token ids (backend sglang) are drawn below the model's vocabulary size, as SGLang's own
benchmark draws them from its tokenizer: SGLang does not check input_ids, and one id at or above
the embedding's size kills its scheduler and the whole server. The size is --vocab-size, else
read from the model directory the server names in /model_info (config.json's vocab_size, and
tokenizer.json's ids where present: the smaller); when neither says, the run is refused.

A request counts as completed only when its answer is right: a 200 stream that ends with the
server's final record (``meta_info`` on /generate, ``usage`` on /v1/completions) reporting
exactly the completion tokens asked for (every request sets ``ignore_eos``). Anything else is
a failure with a reason (``failure_reasons`` in the result: short_output, long_output,
no_final_record, http_<status>, timeout, connect_failed, connection_closed,
malformed_response, server_error).

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
import re
import ssl
import stat
import statistics
import sys
import time
from collections.abc import Awaitable, Iterator
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

Clock = Callable[[], float]
T = TypeVar("T")

# Token ids drawn for random prompts start above the ids tokenizers reserve for special tokens
# and stay below the model's vocabulary size (module docstring).
_FIRST_TOKEN_ID = 100
_MODEL_FILE_LIMIT_BYTES = 64 * 1024 * 1024
_WORDS = (  # noqa: SIM905 (a paragraph reads better than a hundred one-word lines)
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no what "
    "up out who them some could more into only time other than then about two may first any new "
    "very these like well over such after most also made many before must through back years "
    "where much your way down should because each just those people how too little state good"
).split()
_READ_BUFFER_BYTES = 64 * 1024
_GET_TIMEOUT_S = 10.0
# Bounds on what a server can make this client hold: a response head, one SSE event (a long
# /generate answer repeats its cumulative text in every event: megabytes, not gigabytes), a
# GET document (/metrics), an error body (only its start is shown).
_MAX_HEAD_BYTES = 64 * 1024
_MAX_EVENT_BYTES = 64 * 1024 * 1024
_MAX_DOCUMENT_BYTES = 16 * 1024 * 1024
_MAX_ERROR_BODY_BYTES = 4096
# Limits on the workload, far above any real one, so a typo fails here, not as a MemoryError.
_MAX_TOKENS_PER_REQUEST = 1 << 21
# A stream's bookkeeping (one gap per token) follows what the request asked for, never what the
# server claims: a count beyond the tokens asked plus this allowance fails the request at once
# as a long output. A count has at most this many digits, and a prompt at most this many tokens
# (SGLang's own context limit is a 32-bit count).
_TOKEN_ALLOWANCE = 16
_MAX_COUNT_DIGITS = 12
_MAX_PROMPT_TOKENS = 1 << 31
# JSON from a server nests a few levels; deeper is not what it claims to be (the project's
# readers bound it with module_utils/bounded_json.py; this file runs alone, so it has its own).
_MAX_JSON_DEPTH = 32
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


# Why a request failed: the keys of the result's ``failure_reasons`` (plus http_<status>).
SHORT_OUTPUT = "short_output"
LONG_OUTPUT = "long_output"
NO_FINAL_RECORD = "no_final_record"
TIMEOUT = "timeout"
CONNECT_FAILED = "connect_failed"
CONNECTION_CLOSED = "connection_closed"
MALFORMED = "malformed_response"
SERVER_ERROR = "server_error"
# What parsing a response that is not HTTP + SSE + JSON as expected can raise (json raises
# RecursionError for deeply nested arrays).
_PARSE_ERRORS = (ValueError, IndexError, KeyError, TypeError, AttributeError, RecursionError)


class ServerUnreachable(Exception):
    """The server did not accept a connection at all, or stopped answering before the run
    (exit status 1)."""


class VocabularyUnknown(Exception):
    """The model's vocabulary size cannot be found (exit status 2: pass --vocab-size)."""


def _os_reason(err: BaseException) -> str:
    """An exception as words, also when the system gave none (str(err) is then empty)."""
    text = str(err).strip()
    errno = getattr(err, "errno", None)
    if not text and errno:
        text = os.strerror(errno)
    name = type(err).__name__
    return f"{name}: {text}" if text else f"{name} (no reason given by the system)"


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
    vocab_size: int | None = None


def token_ids(vocab_size: int) -> range:
    """The ids random prompts are drawn from: below vocab_size, above the special tokens."""
    return range(min(_FIRST_TOKEN_ID, vocab_size // 4), vocab_size)


def _generate_body(cfg: Config, rng: random.Random, model: str, ids_from: range) -> bytes:
    """One request body; a fixed seed gives the same workload on every run."""
    if cfg.backend == "sglang":
        ids = rng.choices(ids_from, k=cfg.random_input_len)
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


def _bodies(
    cfg: Config, seed: int, model: str, count: int | None, ids_from: range
) -> Iterator[bytes]:
    """Request bodies in a fixed order; endless when ``count`` is None (duration mode)."""
    rng = random.Random(seed)
    sent = 0
    while count is None or sent < count:
        yield _generate_body(cfg, rng, model, ids_from)
        sent += 1


def _read_json_file(path: str) -> Any:
    """A model file as JSON, or None when it is absent, unreadable, too big or not JSON."""
    try:
        # Without blocking, then only a regular file: a FIFO or a device never holds the run.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = handle.read(_MODEL_FILE_LIMIT_BYTES + 1)
        return _json(data) if len(data) <= _MODEL_FILE_LIMIT_BYTES else None
    except (OSError, ValueError):
        return None


def _config_vocab(config: Any) -> int | None:
    """config.json's vocab_size (a multimodal wrapper keeps it in text_config)."""
    if not isinstance(config, dict):
        return None
    for holder in (config, config.get("text_config")):
        if isinstance(holder, dict):
            size = holder.get("vocab_size")
            if isinstance(size, int) and not isinstance(size, bool) and size > 0:
                return size
    return None


def _tokenizer_vocab(tokenizer: Any) -> int | None:
    """One past the highest id tokenizer.json knows (its model's vocab and added tokens)."""
    if not isinstance(tokenizer, dict):
        return None
    ids: list[int] = []
    vocab = (
        (tokenizer.get("model") or {}).get("vocab")
        if isinstance(tokenizer.get("model"), dict)
        else None
    )
    if isinstance(vocab, dict):
        ids += [v for v in vocab.values() if isinstance(v, int)]
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], ids are positions
        ids.append(len(vocab) - 1)
    for token in tokenizer.get("added_tokens") or []:
        if isinstance(token, dict) and isinstance(token.get("id"), int):
            ids.append(token["id"])
    return max(ids) + 1 if ids else None


def vocab_size_of(directory: str) -> int | None:
    """The vocabulary size of a model directory on this host: the smaller of config.json's
    vocab_size and tokenizer.json's ids (a token id must be valid for both), or None."""
    sizes = [
        _config_vocab(_read_json_file(os.path.join(directory, "config.json"))),
        _tokenizer_vocab(_read_json_file(os.path.join(directory, "tokenizer.json"))),
    ]
    known = [size for size in sizes if size]
    return min(known) if known else None


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
    digits = payload[start:end].strip()
    if len(digits) > _MAX_COUNT_DIGITS:
        raise ValueError(f"a token count of {len(digits)} characters")
    return int(digits)


def _json(payload: bytes | bytearray | str) -> Any:
    """A server's JSON, nested at most _MAX_JSON_DEPTH levels; ValueError for anything else
    (json itself ends deeper nesting in RecursionError)."""
    try:
        value = json.loads(payload)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {_MAX_JSON_DEPTH} levels") from None
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        )
        if children and depth > _MAX_JSON_DEPTH:
            raise ValueError(f"JSON nested deeper than {_MAX_JSON_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)
    return value


class _Exchange:
    """One request/response on a connection; collects the body unless a subclass streams it."""

    def __init__(self) -> None:
        self.status = 0
        self.body = bytearray()
        self.error: str | None = None
        self.reason: str | None = None
        self.got_bytes = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_head(self, status: int, t: float) -> None:
        self.status = status

    def on_body(self, data: bytes, t: float) -> None:
        self.body += data
        if len(self.body) > _MAX_DOCUMENT_BYTES:
            self.on_error(f"response larger than {_MAX_DOCUMENT_BYTES} bytes", MALFORMED)

    def on_end(self, t: float) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def on_error(self, message: str, reason: str) -> None:
        if self.error is None:
            self.error = message
            self.reason = reason
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
            try:
                self._finish(self.clock())
            except _PARSE_ERRORS as err:  # never leave the request waiting for its timeout
                exchange.on_error(f"malformed response: {type(err).__name__}: {err}", MALFORMED)
        elif exchange.got_bytes:
            exchange.on_error("connection closed mid-response", CONNECTION_CLOSED)
        else:
            exchange.on_error("connection closed before a response", CONNECTION_CLOSED)

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
        except _PARSE_ERRORS as err:
            # whatever the server sent cannot be read as HTTP + SSE + JSON: fail this request
            exchange.on_error(f"malformed response: {type(err).__name__}: {err}", MALFORMED)
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
            if len(buf) > _MAX_HEAD_BYTES:
                raise ValueError(f"response head larger than {_MAX_HEAD_BYTES} bytes")
            self._buf = buf
            return b""
        lines = buf[:end].decode("latin-1").split("\r\n")
        version, status = lines[0].split(" ", 2)[:2]
        if status.startswith("1") and status != "101":
            # An interim answer (100 Continue, 103 Early Hints): the response follows it.
            self._buf = b""
            return self._parse_head(buf[end + 4 :], t)
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


def shown_url(url: str) -> str:
    """The URL as messages print it: a password in it is never shown."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return f"{scheme}{sep}{netloc}{slash}{path}" if sep else url


def _split_url(url: str) -> tuple[Any, int]:
    """(urlsplit result, port); ValueError with a message that names --url."""
    shown = shown_url(url)
    if not url.isascii() or not url.isprintable():
        raise ValueError(
            f"--url must be printable ASCII (an international host name in its xn-- form), "
            f"got {shown!r}"
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise ValueError(f"--url {shown!r} cannot be read: {err}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url must look like http://HOST:PORT, got {shown!r}")
    return parts, port or (443 if parts.scheme == "https" else 80)


def api_key_problem(key: str) -> str | None:
    """What keeps the key out of an HTTP header, or None. Never quotes the key."""
    if key != key.strip():
        return "begins or ends with white space, which HTTP drops from a header"
    for position, char in enumerate(key, start=1):
        code = ord(char)
        if code > 0xFF or code < 0x20 or 0x7F <= code <= 0x9F:
            return (
                f"has a character at position {position} that an HTTP header cannot carry "
                "(allowed: printable Latin-1 characters)"
            )
    return None


class HttpClient:
    """Connection pool for one server: connections are reused while the server keeps them."""

    def __init__(self, url: str, api_key: str | None, clock: Clock, timeout: float) -> None:
        parts, port = _split_url(url)
        problem = api_key_problem(api_key) if api_key else None
        if problem:
            raise ValueError(f"the API key {problem}")
        self.host = parts.hostname or ""
        self.port = port
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.base_path = parts.path.rstrip("/")
        self.clock = clock
        self.timeout = timeout
        self._idle: list[_Connection] = []
        host_header = parts.netloc.rpartition("@")[2]
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self._common_headers = f"Host: {host_header}\r\n{auth}User-Agent: sglang-fleet-smoke\r\n"

    async def _connect(self) -> _Connection:
        """A new connection; a host that never answers the SYN fails at the request timeout."""
        loop = asyncio.get_running_loop()
        connecting = loop.create_connection(
            lambda: _Connection(self.clock), self.host, self.port, ssl=self.ssl
        )
        try:
            _, conn = await asyncio.wait_for(connecting, self.timeout)
        except asyncio.TimeoutError:
            raise OSError(f"no connection within {self.timeout:g} s") from None
        return conn

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
        return await self._connect(), False

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
                exchange.on_error(f"connect failed: {_os_reason(err)}", CONNECT_FAILED)
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
            if stale and attempt == 0 and exchange.reason != TIMEOUT:
                exchange.error = exchange.reason = None
                exchange.done = asyncio.get_running_loop().create_future()
                continue
            # A wrong answer that ended cleanly (short output, ...) leaves a usable connection.
            if conn.exchange is None and conn.keep_alive and not conn.closed:
                self._idle.append(conn)
            elif not conn.closed:
                conn.close()
            return

    def _expire(self, conn: _Connection, exchange: _Exchange) -> None:
        conn.exchange = None
        conn.close()
        exchange.on_error("timeout", TIMEOUT)

    async def get(self, path: str) -> tuple[int, bytes]:
        """GET a small document; raises OSError (with a reason) when that fails."""
        conn = await self._connect()
        exchange = _Exchange()
        conn.start(self.request_bytes("GET", path, None), exchange)
        # small documents; a server that sits on one must not hold up the run's end
        wait = min(self.timeout, _GET_TIMEOUT_S)
        try:
            await asyncio.wait_for(exchange.done, wait)
        except asyncio.TimeoutError:
            raise OSError(f"no answer within {wait:g} s") from None
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

    __slots__ = (
        "error",
        "itl",
        "latency",
        "output_tokens",
        "prompt_tokens",
        "reason",
        "start",
        "ttft",
    )

    def __init__(self) -> None:
        self.start = 0.0
        self.ttft = 0.0
        self.latency = 0.0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.itl: list[float] = []
        self.error: str | None = None
        self.reason: str | None = None  # a failure_reasons key when error is set


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


class _NoFinalRecord(Exception):
    """A stream that ended without the server's final count (its message says what is missing)."""


def _count_in(record: dict[str, Any], key: str) -> int | None:
    value = record.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _SseStream(_Exchange):
    """Turns a 200 event stream into a RequestRecord; other statuses are collected as text.

    ``expected`` is the completion-token count the request asked for (with ``ignore_eos``):
    an answer with another count is a failure, whatever the stream looked like.
    """

    def __init__(self, record: RequestRecord, timeline: Timeline | None, expected: int) -> None:
        super().__init__()
        self.record = record
        self.timeline = timeline
        self.expected = expected
        self.partial = bytearray()
        self.held_cr = False
        self.tokens = 0
        self.last_t = 0.0
        self.end_t: float | None = None

    def on_body(self, data: bytes, t: float) -> None:
        """Cut complete events (a blank line ends one) off the bytes that arrived so far.

        Linear in the bytes received, however large an event is: only the new bytes are
        searched for its end, and no byte is copied more than a fixed number of times.
        """
        if self.status != 200:
            room = _MAX_ERROR_BODY_BYTES - len(self.body)
            if room > 0:
                self.body += data[:room]
            return
        if self.held_cr or b"\r" in data:
            data = self._lf_only(data)
        partial = self.partial
        if partial:
            start = len(partial) - 1  # a blank line may begin with the last byte kept
            partial += data
            cut = partial.rfind(b"\n\n", start) + 2
            if cut < 2:
                if len(partial) > _MAX_EVENT_BYTES:
                    self.on_error(f"an SSE event larger than {_MAX_EVENT_BYTES} bytes", MALFORMED)
                return
            block = bytes(partial[:cut])
            del partial[:cut]
        else:
            cut = data.rfind(b"\n\n") + 2
            if cut < 2:
                partial += data
                return
            if cut < len(data):
                block = data[:cut]
                partial += data[cut:]
            else:  # the usual read: whole events only
                block = data
        if self.error is None:
            self.on_events(block, t)

    def _lf_only(self, data: bytes) -> bytes:
        """SSE lines may end in CRLF, LF or a bare CR, and one CRLF can straddle two reads."""
        if self.held_cr:
            data = b"\r" + data
            self.held_cr = False
        if data[-1:] == b"\r":
            data, self.held_cr = data[:-1], True
        return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

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
        """Record ``new`` tokens that arrived at ``t`` (TTFT, then ITL like bench_serving).
        More than the request asked for (plus _TOKEN_ALLOWANCE) fails it as a long output
        before anything is recorded: the bookkeeping never follows the server's claim."""
        if self.error is not None:
            return
        if self.tokens + new > self.expected + _TOKEN_ALLOWANCE:
            self.on_error(
                f"long output: the server counts {self.tokens + new} completion tokens, "
                f"{self.expected} asked for",
                LONG_OUTPUT,
            )
            return
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
            obj = _json(payload)
        except ValueError:
            return False
        if isinstance(obj, dict) and obj.get("error"):
            self.fail_with_server_error(obj["error"])
            return True
        return False

    def fail_with_server_error(self, error: Any) -> None:
        self.on_error(f"server error in stream: {json.dumps(error)[:200]}", SERVER_ERROR)

    def on_end(self, t: float) -> None:
        if self.error is None and self.status == 200:
            self.record.latency = (self.end_t if self.end_t is not None else t) - self.record.start
            self.judge()
        elif self.error is None:
            text = bytes(self.body[:_ERROR_TEXT_LIMIT]).decode("utf-8", "replace")
            self.on_error(f"HTTP {self.status}: {text.strip()}", f"http_{self.status}")
        super().on_end(t)

    def judge(self) -> None:
        """Right answer or failure: the final record must count exactly what was asked for."""
        try:
            count = self.final_counts()
        except _NoFinalRecord as missing:
            self.on_error(str(missing), NO_FINAL_RECORD)
            return
        prompt = self.record.prompt_tokens
        if not 0 <= prompt <= _MAX_PROMPT_TOKENS:
            self.on_error(f"prompt_tokens {prompt} is not a token count", MALFORMED)
        elif count < self.expected:
            self.on_error(
                f"short output: {count} of the {self.expected} completion tokens asked for",
                SHORT_OUTPUT,
            )
        elif count > self.expected:
            self.on_error(
                f"long output: {count} completion tokens, {self.expected} asked for", LONG_OUTPUT
            )

    def final_counts(self) -> int:
        """Fill the record's token counts from the final record; return completion tokens."""
        raise NotImplementedError


class _GenerateStream(_SseStream):
    """SGLang native /generate: cumulative text, server counts in meta_info."""

    def __init__(self, record: RequestRecord, timeline: Timeline | None, expected: int) -> None:
        super().__init__(record, timeline, expected)
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
        last_count = _rising_counts(block, first, first_count)
        if first_count <= self.tokens or last_count is None or b'"error"' in block:
            super().on_events(block, t)  # one by one: each event is judged on its own
            return
        self.add_tokens(first_count - self.tokens, t)
        if last_count > first_count:
            self.add_tokens(last_count - first_count, t)
        self.last_payload = block
        if done:
            self.end_t = t

    def on_event(self, payload: bytes, t: float) -> None:
        key = payload.rfind(_COMPLETION_TOKENS_KEY)
        if self.fail_if_error(payload):
            return  # an error fails the request, whatever count rides beside it
        if key < 0:
            if payload[:1] != b"{":
                self.on_error(f"stream chunk is not JSON: {payload[:100]!r}", MALFORMED)
            else:
                self.on_error("stream chunk without meta_info.completion_tokens", NO_FINAL_RECORD)
            return
        self.last_payload = payload
        new = _number_after(payload, key) - self.tokens
        if new > 0:
            self.add_tokens(new, t)
        elif new < 0:
            self.on_error(
                f"completion_tokens went backwards: {self.tokens + new} after {self.tokens}",
                MALFORMED,
            )

    def final_counts(self) -> int:
        if not self.last_payload:
            raise _NoFinalRecord("stream ended without a meta_info record (no token count)")
        # the line of the last count: one payload, or a block of events that came together
        last = self.last_payload
        key = last.rfind(_COMPLETION_TOKENS_KEY)
        end = last.find(b"\n", key)
        line = last[last.rfind(b"\n", 0, key) + 1 : end if end >= 0 else len(last)]
        try:
            final = _json(line[5:] if line.startswith(b"data:") else line)
        except ValueError:
            raise _NoFinalRecord("the last meta_info record is not JSON") from None
        meta = final.get("meta_info") if isinstance(final, dict) else None
        count = _count_in(meta, "completion_tokens") if isinstance(meta, dict) else None
        if count is None:
            raise _NoFinalRecord("the last record has no meta_info.completion_tokens count")
        assert isinstance(meta, dict)
        self.record.prompt_tokens = _count_in(meta, "prompt_tokens") or 0
        self.record.output_tokens = count
        return count


def _rising_counts(block: bytes, pos: int, count: int) -> int | None:
    """The last completion_tokens count of a block of events if no count is below the one
    before it (a stream that goes back is judged event by event), else None."""
    while True:
        pos = block.find(_COMPLETION_TOKENS_KEY, pos + 1)
        if pos < 0:
            return count
        following = _number_after(block, pos)
        if following < count:
            return None
        count = following


class _CompletionsStream(_SseStream):
    """OpenAI-compatible /v1/completions: text deltas, then a usage-only chunk."""

    def __init__(self, record: RequestRecord, timeline: Timeline | None, expected: int) -> None:
        super().__init__(record, timeline, expected)
        self.usage: dict[str, Any] | None = None

    def on_event(self, payload: bytes, t: float) -> None:
        try:
            obj = _json(payload)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            self.on_error(f"malformed stream chunk: {payload[:100]!r}", MALFORMED)
            return
        if obj.get("error"):
            self.fail_with_server_error(obj["error"])
            return
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        choices = obj.get("choices")
        if choices and isinstance(choices[0], dict) and choices[0].get("text"):
            self.add_tokens(1, t)  # a delta chunk; the exact count comes from usage

    def final_counts(self) -> int:
        usage = self.usage
        if usage is None:
            raise _NoFinalRecord("stream ended without a usage record (include_usage)")
        count = _count_in(usage, "completion_tokens")
        if count is None:
            raise _NoFinalRecord("the usage record has no completion_tokens count")
        record = self.record
        record.prompt_tokens = _count_in(usage, "prompt_tokens") or 0
        record.output_tokens = count
        # Chunks can carry several tokens: put the ones the server counted beyond the chunks at
        # the last arrival so the timeline adds up to the server's count.
        extra = count - self.tokens
        if 0 < extra <= self.expected and self.timeline is not None:
            self.timeline.add(self.last_t, extra)
        return count


# --------------------------------------------------------------------------------------------
# Server /metrics (Prometheus text format): the project's one parser of it, also what
# sglang_fleet/diagnosis/live_metrics.py reads a running server's metrics with
# --------------------------------------------------------------------------------------------

# Blanks (spaces or tabs) end the name; after a label set's "}" the value may follow at once.
_SERIES = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\}\s*|\s+)(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_series(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample line as (name, labels, value); comments and values that are not finite
    numbers (NaN, +Inf, -Inf: legal Prometheus, but no count or gauge here; +Inf would reach a
    result file as JSON's Infinity) are skipped. A timestamp after the value is ignored."""
    series = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        match = _SERIES.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        series.append((match.group(1), labels, value))
    return series


def parse_prometheus(text: str, left_out: set[str] | None = None) -> dict[str, float]:
    """Finite sample values by metric name, summed over label sets (one per tp/dp rank). A
    name whose sum runs past the largest float is left out (and added to left_out): a sum of
    finite counters must not reach a result as infinity, nor a difference of two as NaN."""
    totals: dict[str, float] = {}
    overflowed: set[str] = set()
    for name, _labels, value in parse_series(text):
        total = totals.get(name, 0.0) + value
        if math.isfinite(total):
            totals[name] = total
        else:
            overflowed.add(name)
    for name in overflowed:
        totals.pop(name, None)
    if left_out is not None:
        left_out.update(overflowed)
    return totals


async def read_metrics(
    client: HttpClient, left_out: set[str] | None = None
) -> dict[str, float] | None:
    """The server's metrics, or None when /metrics is not served (no --enable-metrics)."""
    status, body = await client.get("/metrics")
    if status != 200:
        return None
    return parse_prometheus(body.decode("utf-8", "replace"), left_out)


class MetricsSampler:
    """Samples /metrics gauges during the run for peaks and a timeline."""

    def __init__(self, client: HttpClient, interval: float, clock: Clock, t0: float) -> None:
        self.client = client
        self.interval = interval
        self.clock = clock
        self.t0 = t0
        self.samples: list[dict[str, float]] = []
        self.max_total_num_tokens: float | None = None
        self.left_out: set[str] = set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)

    async def sample(self) -> None:
        try:
            values = await read_metrics(self.client, self.left_out)
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

    left_out = set(sampler.left_out)

    def delta(name: str) -> float | None:
        if name not in before or name not in after:
            return None
        difference = after[name] - before[name]
        if not math.isfinite(difference):  # two finite sums far apart
            left_out.add(name)
            return None
        return difference

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
        "left_out": sorted(left_out),
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
        except (OSError, asyncio.TimeoutError) as err:
            # Request failures are recorded per request; anything else that loses the server
            # ends the run with its name, never a traceback.
            raise ServerUnreachable(
                f"lost the server at {shown_url(self.cfg.url)}: {_os_reason(err)}"
            ) from None
        finally:
            self.client.close()

    async def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        left_out: set[str] = set()
        metrics_before = await self._first_contact("/metrics", read_metrics(self.client, left_out))
        model = await self._first_contact("/v1/models", self._model_name())
        ids_from = await self._first_contact("/model_info", self._token_ids())
        if cfg.warmup_requests > 0:
            warmup = _bodies(cfg, cfg.seed + 2, model, cfg.warmup_requests, ids_from)
            await self._dispatch(warmup, None, math.inf, None, None)
            if metrics_before is not None:
                # The warm-up can take a server down (a bad request, out of memory).
                metrics_before = await self._first_contact(
                    "/metrics after the warm-up", read_metrics(self.client, left_out)
                )

        t0 = self.clock()
        timeline = Timeline(t0)
        sampler = MetricsSampler(self.client, cfg.metrics_interval, self.clock, t0)
        sampler.left_out = left_out
        stop = asyncio.Event()
        sampling = None
        if metrics_before is not None:
            sampling = asyncio.ensure_future(sampler.run(stop))
        deadline = t0 + cfg.duration if cfg.duration is not None else None
        bodies = _bodies(cfg, cfg.seed, model, cfg.num_prompts, ids_from)
        records = await self._dispatch(
            bodies, cfg.max_concurrency, cfg.request_rate, deadline, timeline
        )
        duration = self.clock() - t0
        server = None
        if sampling is not None and metrics_before is not None:
            stop.set()
            await sampling
            try:
                metrics_after = await read_metrics(self.client, left_out)
            except (OSError, asyncio.TimeoutError):
                metrics_after = None
            server = _server_summary(metrics_before, metrics_after, sampler)
        return summarize(cfg, records, duration, timeline, server)

    async def _first_contact(self, path: str, call: Awaitable[T]) -> T:
        """The requests before the benchmark: failing them means the server is not there."""
        try:
            return await call
        except (OSError, asyncio.TimeoutError) as err:
            where = shown_url(self.cfg.url)
            raise ServerUnreachable(
                f"cannot reach the server at {where} (GET {path}): {_os_reason(err)}"
            ) from None

    async def _token_ids(self) -> range:
        """Where random prompt ids come from (module docstring); /model_info names the model."""
        if self.cfg.backend != "sglang":
            return range(0)  # the OpenAI backend sends words
        if self.cfg.vocab_size:
            return token_ids(self.cfg.vocab_size)
        status, body = await self.client.get("/model_info")
        info: Any = None
        if status == 200:
            with contextlib.suppress(*_PARSE_ERRORS):
                info = _json(body)
        paths = []
        if isinstance(info, dict):
            paths = [info.get(k) for k in ("tokenizer_path", "model_path")]
        named = [p for p in paths if isinstance(p, str) and p]
        for path in named:
            size = vocab_size_of(path)
            if size:
                return token_ids(size)
        where = shown_url(self.cfg.url)
        source = (
            f"/model_info names {', '.join(sorted(set(named)))}"
            if named
            else (f"/model_info answered {status} without a model path")
        )
        raise VocabularyUnknown(
            f"cannot tell the vocabulary size of the model served at {where}: {source}, and no "
            "config.json or tokenizer.json with it is readable here; pass --vocab-size (token "
            "ids at or above it would take the server down)"
        )

    async def _model_name(self) -> str:
        """The OpenAI backend needs a model name: --model, else the server's first one."""
        if self.cfg.model or self.cfg.backend == "sglang":
            return self.cfg.model or ""
        status, body = await self.client.get("/v1/models")
        if status != 200:
            return "default"
        try:
            models = _json(body).get("data") or []
            return str(models[0].get("id", "default"))
        except _PARSE_ERRORS:
            return "default"  # a list the server cannot describe: its default model answers

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
        stream = self.stream_class(record, timeline, self.cfg.random_output_len)
        clock = self.clock

        def stamp_start() -> None:
            record.start = clock()

        try:
            request = self.client.request_bytes("POST", self.path, body)
            await self.client.send(request, stream, stamp_start)
            record.error = stream.error
            record.reason = stream.reason
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
    reasons: dict[str, int] = {}
    for record in records:
        if record.error is not None:
            reason = record.reason or MALFORMED
            reasons[reason] = reasons.get(reason, 0) + 1
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
            "failure_reasons": dict(sorted(reasons.items())),
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
        if server.get("left_out"):
            rows.append(("Left out (sum past the float maximum)", ", ".join(server["left_out"])))
    if result["failure_reasons"]:
        reasons = ", ".join(f"{k} {v}" for k, v in result["failure_reasons"].items())
        rows.append(("Failure reasons", reasons))
    lines = ["{:=^60}".format(" Smoke Benchmark Result ")]
    lines += ["{:<40} {}".format(label + ":", value) for label, value in rows]
    lines += [f"error: {e}" for e in result["errors"][:3]]
    lines.append("=" * 60)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _token_count(text: str) -> int:
    value = _positive_int(text)
    if value > _MAX_TOKENS_PER_REQUEST:
        raise argparse.ArgumentTypeError(
            f"must be at most {_MAX_TOKENS_PER_REQUEST} tokens per request, got {text!r}"
        )
    return value


def _positive_number(text: str, allow_inf: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or (math.isinf(value) and not allow_inf):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    return _positive_number(text)


def _rate(text: str) -> float:
    return _positive_number(text, allow_inf=True)


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


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
    add("--request-rate", type=_rate, default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)")  # fmt: skip
    add("--random-input-len", type=_token_count, default=1024, help="prompt tokens per request")
    add("--random-output-len", type=_token_count, default=128,
        help="output tokens per request; an answer with another count fails")  # fmt: skip
    add("--seed", type=_whole_number, default=42, help="workload seed (same seed, same requests)")
    add("--warmup-requests", type=_whole_number, default=1,
        help="requests sent first and not counted")  # fmt: skip
    add("--api-key", default=None, help="bearer token (default: $SGLANG_API_KEY)")
    add("--model", default=None, help="model name for sglang-oai (default: the server's first)")
    add("--slo-ttft-ms", type=_positive_float, default=None, help="TTFT SLO for goodput")
    add("--slo-tpot-ms", type=_positive_float, default=None, help="TPOT SLO for goodput")
    add("--metrics-interval", type=_positive_float, default=0.5,
        help="seconds between /metrics samples")  # fmt: skip
    add("--timeout", type=_positive_float, default=600.0, help="seconds allowed per request")
    add("--vocab-size", type=_positive_int, default=None,
        help="draw token ids below this (default: from the model /model_info names)")  # fmt: skip
    add("--json", dest="json_out", default=None, help="write the result JSON here")
    return parser


def _api_key(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """--api-key, else $SGLANG_API_KEY; refused (never printed) when a header cannot carry it."""
    source = "--api-key" if args.api_key else "SGLANG_API_KEY"
    key = args.api_key or os.environ.get("SGLANG_API_KEY") or None
    problem = api_key_problem(key) if key else None
    if problem:
        parser.error(f"the API key from {source} {problem}; the key itself is not shown")
    return key


def _check_json_path(path: str, parser: argparse.ArgumentParser) -> None:
    """Fail before the run, not after minutes of benchmarking, when the result cannot be kept."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"--json {path!r} is a directory; name a file")
    if not os.path.isdir(folder):
        parser.error(f"--json {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"--json {path!r}: the folder {folder!r} is not writable")


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
        _split_url(args.url)
    except ValueError as err:
        parser.error(str(err))
    if args.json_out:
        _check_json_path(args.json_out, parser)
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
        api_key=_api_key(args, parser),
        model=args.model,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        metrics_interval=args.metrics_interval,
        timeout=args.timeout,
        vocab_size=args.vocab_size,
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
    except VocabularyUnknown as err:
        print(f"smoke: error: {err}", file=sys.stderr)
        return 2
    if args.json_out:
        try:
            _write_json(args.json_out, result)
        except OSError as err:
            print(
                f"smoke: cannot write --json {args.json_out!r}: {_os_reason(err)}", file=sys.stderr
            )
            return 2
    print(format_summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
