"""The HTTP/1.1 client: keep-alive connections that parse responses as bytes arrive
(chunked transfer decoding included), the server's URL and API key checked, and bounds
on what a server can make it hold."""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
from typing import Any, Callable
from urllib.parse import urlsplit

from sglang_fleet.module_utils.fleet_http import HttpError, check_url, redact_url
from sglang_fleet.smoke.smoke_client.failures import (
    CONNECT_FAILED,
    CONNECTION_CLOSED,
    MALFORMED,
    PARSE_ERRORS,
    TIMEOUT,
    os_reason,
)

Clock = Callable[[], float]

_READ_BUFFER_BYTES = 64 * 1024
_GET_TIMEOUT_S = 10.0
# Bounds on what a server can make this client hold: a response head, a GET document
# (/metrics). A stream's own bounds are in streams.py.
_MAX_HEAD_BYTES = 64 * 1024
_MAX_DOCUMENT_BYTES = 16 * 1024 * 1024
# A base path goes into every request line: segments of RFC 3986 path characters and %XX
# escapes only (used with fullmatch; segments are split by `/`, so matching is linear).
_BASE_PATH = re.compile(r"(?:/(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})*)*")


class Exchange:
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


def _line_after_chunk(state: int, blank: bool) -> int:
    """The CRLF that ends a chunk, or a trailer line (a blank one ends the response)."""
    if state == _CHUNK_CRLF:
        if not blank:
            raise ValueError("chunk not followed by CRLF")
        return _CHUNK_SIZE
    return _DONE if blank else _TRAILER


class _Connection:
    """An HTTP/1.1 connection that parses responses as bytes arrive (no pipelining).

    The parsing half: how bytes reach it and leave it is a subclass's (_SocketConnection for
    plain HTTP, _TlsConnection for HTTPS), which calls data_received with each read's bytes and
    connection_lost once when the connection ends.
    """

    def __init__(self, clock: Clock) -> None:
        self._read_buffer = memoryview(bytearray(_READ_BUFFER_BYTES))
        self.clock = clock
        self.exchange: Exchange | None = None
        self.closed = False
        self.keep_alive = True
        self._state = _HEAD
        self._buf = b""
        self._remaining = 0

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        exchange = self.exchange
        if exchange is None:
            return
        if self._state == _UNTIL_CLOSE:
            try:
                self._finish(self.clock())
            except PARSE_ERRORS as err:  # never leave the request waiting for its timeout
                exchange.on_error(f"malformed response: {type(err).__name__}: {err}", MALFORMED)
        elif exchange.got_bytes:
            exchange.on_error("connection closed mid-response", CONNECTION_CLOSED)
        else:
            exchange.on_error("connection closed before a response", CONNECTION_CLOSED)

    def data_received(self, data: bytes) -> None:
        t = self.clock()
        exchange = self.exchange
        if exchange is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        exchange.got_bytes = True
        try:
            if self._state == _CHUNK_SIZE and not self._buf and self._whole_chunks(data, t):
                return  # the usual read of a stream: whole chunks
            if self._state == _HEAD:
                data = self._parse_head(data, t)
            if data and self.exchange is not None:
                self._feed_body(data, t)
        except PARSE_ERRORS as err:
            # whatever the server sent cannot be read as HTTP + SSE + JSON: fail this request
            exchange.on_error(f"malformed response: {type(err).__name__}: {err}", MALFORMED)
            self.exchange = None
            self.close()

    # transport: a subclass's -------------------------------------------------------------
    def write(self, data: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.closed = True  # a subclass also lets go of its socket or transport

    # requests --------------------------------------------------------------------------
    def start(self, request: bytes, exchange: Exchange) -> None:
        self.exchange = exchange
        self._state = _HEAD
        self._buf = b""
        self.write(request)

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
            name, _colon, value = line.partition(":")
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

    def _whole_chunks(self, data: bytes, t: float) -> bool:
        """Hand over the body of a read that is whole chunks only (streamed events, one
        chunk each, as a server that keeps up sends them; the last chunk may end the read),
        without the general decoder's bookkeeping; False for anything else (a chunk cut by the
        read, an extension, a trailer, a size line int() refuses), left untouched for the
        decoder, which raises what a bad size line raises."""
        find, startswith = data.find, data.startswith
        pos, size, pieces = 0, len(data), []
        while pos < size:
            eol = find(b"\r\n", pos)
            if eol <= pos:
                return False
            try:
                length = int(data[pos:eol], 16)
            except ValueError:
                return False
            pos = eol + 2
            end = pos + length
            if length > 0 and startswith(b"\r\n", end):
                pieces.append(data[pos:end])
                pos = end + 2
            elif length == 0 and pos + 2 == size and startswith(b"\r\n", pos):
                self._state = _DONE  # the last chunk, no trailer: the response ends here
                break
            else:
                return False
        self._deliver(pieces, t)
        return True

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
                # Chunk extensions carry nothing we need. Inline: once per streamed event.
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
                if size < 0:
                    raise ValueError("negative chunk size")
                pos = eol + 2
                end = pos + size
                if size == 0:
                    state = _TRAILER
                elif end + 2 <= size_of:  # the whole chunk is here: the usual case
                    if not buf.startswith(b"\r\n", end):
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


class _SocketConnection(_Connection):
    """Plain HTTP on the socket itself: the event loop's selector calls back when it is
    readable, and one recv_into fills the connection's buffer.

    asyncio's transport adds its read handler, get_buffer, buffer_updated and their checks to
    every read: about 0.2 us a read here (bench/README.md), at one streamed event a read.
    """

    def __init__(self, clock: Clock, sock: socket.socket) -> None:
        super().__init__(clock)
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._sending: asyncio.Future[None] | None = None
        self._loop.add_reader(self._fd, self._readable)

    def _readable(self) -> None:
        """Read until a read comes back short: the selector is level-triggered, so what
        arrives after that calls back again, and a read that would only say EAGAIN (one more
        system call and an exception per read) is not made."""
        buffer = self._read_buffer
        while not self.closed:
            try:
                n = self._sock.recv_into(buffer)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                self._lost(err)
                return
            if n == 0:
                self._lost(None)
                return
            try:
                self.data_received(buffer[:n].tobytes())
            except Exception as err:
                # a fault past what parsing reports: end the connection as asyncio's transport
                # does (the request fails now, not at its timeout), and let the loop log it
                self._lost(err)
                raise
            if n < _READ_BUFFER_BYTES:
                return

    def write(self, data: bytes) -> None:
        """Send at once what the kernel takes; the rest (a request larger than the socket's
        send buffer) in the background, and a failure to send ends the connection as a
        transport's would."""
        try:
            sent = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as err:
            self._loop.call_soon(self._lost, err)  # as a transport reports it: not from write
            return
        if sent < len(data):
            rest = data[sent:]
            self._sending = asyncio.ensure_future(self._loop.sock_sendall(self._sock, rest))
            self._sending.add_done_callback(self._sent)

    def _sent(self, sending: asyncio.Future[None]) -> None:
        self._sending = None
        if not sending.cancelled() and sending.exception() is not None:
            self._lost(sending.exception())  # type: ignore[arg-type]

    def _finish(self, t: float) -> None:
        if self._sending is not None:
            # answered before the whole request went out: never reused, or the next request's
            # bytes would go out between the rest of this one's
            self.keep_alive = False
        super()._finish(t)

    def _lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.close()
            self.connection_lost(exc)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._sending is not None:
            self._sending.cancel()
        self._loop.remove_reader(self._fd)
        self._sock.close()


class _TlsConnection(_Connection, asyncio.BufferedProtocol):
    """HTTPS through asyncio's TLS transport (TLS needs its record layer; this client's
    CPU targets are measured on plain HTTP). A buffered protocol, because a plain one makes
    asyncio allocate a fresh 256 KiB bytes object for every read."""

    transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._read_buffer[:nbytes].tobytes())

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


async def _addresses(loop: asyncio.AbstractEventLoop, host: str, port: int) -> list[Any]:
    """The host's addresses. A numeric one is read without a resolver, as asyncio's
    create_connection does: loop.getaddrinfo runs in the loop's thread pool, whose first call
    starts a thread, which a loaded machine makes longer than a short request timeout."""
    try:
        numeric = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=numeric)
    except socket.gaierror:
        return await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)


async def open_socket(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to the first of the host's addresses that
    accepts, as asyncio's create_connection finds one: its error when every address fails
    the same way, all of them named when they differ."""
    loop = asyncio.get_running_loop()
    infos = await _addresses(loop, host, port)
    if not infos:
        raise OSError(f"getaddrinfo({host!r}) returned no address")
    errors: list[OSError] = []
    for family, kind, proto, _canonname, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            # as asyncio's transports do: a request goes out in one write, never delayed
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
        except OSError as err:
            sock.close()
            errors.append(err)
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    if len({str(err) for err in errors}) == 1:
        raise errors[0]
    raise OSError("Multiple exceptions: " + ", ".join(str(err) for err in errors))


def shown_url(url: str) -> str:
    """The URL as messages print it: a password in it is never shown, however the URL is
    spelt (without `://`, all before its last `@` is hidden)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***@" + url.rpartition("@")[2] if "@" in url else url
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return f"{scheme}{sep}{netloc}{slash}{path}"


def split_url(url: str) -> tuple[Any, int]:
    """(urlsplit result, port); ValueError with a message that names --url.

    The project's one URL rule (plugins/module_utils/fleet_http.py, check_url: http(s), a host name
    or address, a port 1..65535, no ``user:password@``), then what a base URL of this client may
    not have: a query (it would land between the path and /generate) or a path with
    characters a request line cannot carry."""
    shown = shown_url(url)
    if not url.isascii() or not url.isprintable():
        raise ValueError(
            f"--url must be printable ASCII (an international host name in its xn-- form), "
            f"got {shown!r}"
        )
    try:
        _scheme, _host, port, _path = check_url(url, "--url")
    except HttpError as err:  # its message shows the URL as this client does
        raise ValueError(str(err).replace(repr(redact_url(url)), repr(shown))) from None
    parts = urlsplit(url)
    if parts.query or url.endswith("?"):
        raise ValueError(f"--url {shown!r} has a query: give the server's base URL")
    if not _BASE_PATH.fullmatch(parts.path):
        raise ValueError(
            f"--url {shown!r}: its path may hold letters, digits, -._~!$&'()*+,;=:@/ and "
            "%XX escapes only"
        )
    return parts, port


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

    def __init__(
        self,
        url: str,
        api_key: str | None,
        clock: Clock,
        timeout: float,
        user_agent: str = "sglang-fleet-smoke",
    ) -> None:
        parts, port = split_url(url)
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
        self._common_headers = f"Host: {host_header}\r\n{auth}User-Agent: {user_agent}\r\n"

    async def _connect(self) -> _Connection:
        """A new connection; a host that never answers the SYN fails at the request timeout."""
        try:
            return await asyncio.wait_for(self._open(), self.timeout)
        except asyncio.TimeoutError:
            raise OSError(f"no connection within {self.timeout:g} s") from None

    async def _open(self) -> _Connection:
        if self.ssl is None:
            return _SocketConnection(self.clock, await open_socket(self.host, self.port))
        loop = asyncio.get_running_loop()
        _transport, conn = await loop.create_connection(
            lambda: _TlsConnection(self.clock), self.host, self.port, ssl=self.ssl
        )
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
        self,
        request: bytes,
        exchange: Exchange,
        before_send: Callable[[], None],
        timeout: float | None = None,
    ) -> None:
        """Run one exchange; sets ``exchange.error`` instead of raising for request failures.
        `timeout`: this exchange's limit (the client's own when None; the job runner sizes one
        per row from its max_tokens).

        A reused keep-alive connection that the server closed meanwhile fails before any byte
        comes back: that request is sent once more on a fresh connection.
        """
        limit = self.timeout if timeout is None else timeout
        for attempt in range(2):
            try:
                conn, reused = await self._connection()
            except OSError as err:
                exchange.on_error(f"connect failed: {os_reason(err)}", CONNECT_FAILED)
                return
            before_send()
            conn.start(request, exchange)
            timer = asyncio.get_running_loop().call_later(limit, self._expire, conn, exchange)
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

    def _expire(self, conn: _Connection, exchange: Exchange) -> None:
        conn.exchange = None
        conn.close()
        exchange.on_error("timeout", TIMEOUT)

    async def get(self, path: str) -> tuple[int, bytes]:
        """GET a small document; raises OSError (with a reason) when that fails."""
        conn = await self._connect()
        exchange = Exchange()
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
