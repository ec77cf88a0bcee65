"""The smoke client's plain-HTTP connection reads its socket itself (http_client.
_SocketConnection: the loop's add_reader, recv_into the connection's buffer, send with
sock_sendall for what the kernel did not take): what asyncio's transport did for it, it does
too. Partial reads, a read that fills the buffer, a wake-up with nothing to read (EAGAIN), a
peer that closes mid-chunk or resets, the bounds on a head and a document, a request larger
than the socket's send buffer, and the arrival times a summary reads."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from sglang_fleet.smoke.smoke_client import http_client
from sglang_fleet.smoke.smoke_client.failures import CONNECTION_CLOSED, MALFORMED

Body = tuple[int, bytes, str | None, str | None]


class _Recorder(http_client.Exchange):
    """An exchange that also keeps each body delivery's time."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self.ended = False

    def on_body(self, data: bytes, t: float) -> None:
        self.times.append(t)
        super().on_body(data, t)

    def on_end(self, t: float) -> None:
        self.ended = True
        super().on_end(t)


def _pair() -> tuple[http_client._SocketConnection, socket.socket, list[float]]:
    """A connection on one end of a socket pair (the test is the server on the other), with
    a clock that counts its reads."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    ticks: list[float] = []

    def clock() -> float:
        ticks.append(float(len(ticks)))
        return ticks[-1]

    return http_client._SocketConnection(clock, ours), theirs, ticks


def _run(test: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(test(), 10))


async def _settle() -> None:
    """Let the loop run the reader's callbacks for what the peer wrote."""
    for _ in range(5):
        await asyncio.sleep(0.01)


_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_a_response_in_pieces_of_one_byte_is_read_whole_each_piece_at_its_own_time() -> None:
    async def test() -> tuple[bytes, bool, list[float], int]:
        conn, peer, ticks = _pair()
        exchange = _Recorder()
        conn.start(b"GET / HTTP/1.1\r\n\r\n", exchange)
        assert peer.recv(100) == b"GET / HTTP/1.1\r\n\r\n"
        for byte in _HEAD + b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n":
            peer.send(bytes([byte]))
            await _settle()
        await exchange.done
        peer.close()
        return bytes(exchange.body), exchange.ended, exchange.times, len(ticks)

    body, ended, times, reads = _run(test)
    assert (body, ended) == (b"hello world", True)
    assert reads == len(_HEAD) + len(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")  # one per byte
    assert times == sorted(set(times)) and len(times) == len(b"hello world")


def test_a_read_that_fills_the_buffer_reads_on_and_a_wakeup_with_nothing_is_no_error() -> None:
    size = http_client._READ_BUFFER_BYTES * 3 + 17

    async def test() -> tuple[Any, ...]:
        conn, peer, ticks = _pair()
        exchange = _Recorder()
        conn.start(b"GET / HTTP/1.1\r\n\r\n", exchange)
        peer.recv(100)
        conn._readable()  # woken with nothing to read: EAGAIN, nothing happens
        assert (conn.closed, exchange.error, exchange.got_bytes, ticks) == (False, None, False, [])
        peer.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size)
        await exchange.done
        after = len(ticks)
        conn._readable()  # and again after the answer: still nothing, still open
        peer.close()
        return exchange.error, len(exchange.body), exchange.ended, conn.closed, len(ticks), after

    error, got, ended, closed, reads, reads_before = _run(test)
    assert (error, got, ended, closed) == (None, size, True, False)
    assert reads == reads_before >= 4  # no read is larger than the buffer


def test_a_peer_that_closes_mid_chunk_fails_the_request_and_lets_go_of_the_socket() -> None:
    async def test() -> tuple[Any, ...]:
        conn, peer, _ = _pair()
        exchange = _Recorder()
        conn.start(b"GET / HTTP/1.1\r\n\r\n", exchange)
        peer.recv(100)
        peer.sendall(_HEAD + b"a\r\nhalf")
        await _settle()
        peer.close()
        await exchange.done
        return exchange.error, exchange.reason, bytes(exchange.body), conn.closed, conn._sock

    error, reason, body, closed, sock = _run(test)
    assert (error, reason) == ("connection closed mid-response", CONNECTION_CLOSED)
    assert (body, closed, sock.fileno()) == (b"half", True, -1)


def test_a_peer_that_resets_before_answering_fails_the_request_by_name() -> None:
    async def test() -> tuple[Any, ...]:
        conn, peer, _ = _pair()
        exchange = _Recorder()
        peer.close()  # gone before the request: the send or the first read fails
        conn.start(b"GET / HTTP/1.1\r\n\r\n", exchange)
        await exchange.done
        return exchange.error, exchange.reason, conn.closed

    assert _run(test) == ("connection closed before a response", CONNECTION_CLOSED, True)


def test_an_idle_connection_the_server_closes_is_marked_closed_without_a_request() -> None:
    async def test() -> tuple[bool, int]:
        conn, peer, ticks = _pair()
        peer.close()
        await _settle()
        return conn.closed, len(ticks)

    assert _run(test) == (True, 0)


def test_bytes_nobody_asked_for_close_the_connection() -> None:
    async def test() -> bool:
        conn, peer, _ = _pair()
        peer.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
        await _settle()
        peer.close()
        return conn.closed

    assert _run(test) is True


_DOCUMENT = 17 * 1024 * 1024  # over _MAX_DOCUMENT_BYTES


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * (64 * 1024 + 1), "response head larger than 65536"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % _DOCUMENT + b"z" * _DOCUMENT,
            "response larger than 16777216 bytes",
        ),
    ],
    ids=["head", "document"],
)
def test_the_bounds_hold_on_what_arrives_in_reads(answer: bytes, message: str) -> None:
    async def test() -> tuple[Any, ...]:
        conn, peer, _ = _pair()
        exchange = http_client.Exchange()
        conn.start(b"GET / HTTP/1.1\r\n\r\n", exchange)
        peer.recv(100)
        sending = asyncio.get_running_loop().run_in_executor(None, _send_until_closed, peer, answer)
        await exchange.done
        conn.close()
        await sending
        return exchange.error, exchange.reason, conn.closed

    error, reason, closed = _run(test)
    assert message in error and (reason, closed) == (MALFORMED, True)


def _send_until_closed(peer: socket.socket, data: bytes) -> None:
    try:
        peer.sendall(data)
    except OSError:
        pass  # the client stopped reading: what the bound is for
    finally:
        peer.close()


def test_a_request_larger_than_the_send_buffer_goes_out_whole() -> None:
    """The kernel takes part of it: the rest goes with sock_sendall, and the answer comes."""
    body = bytes(range(256)) * (16 * 1024)  # 4 MiB

    async def test() -> tuple[Any, ...]:
        got = bytearray()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            got.extend(await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = http_client.HttpClient(f"http://127.0.0.1:{port}", None, lambda: 0.0, 10)
        try:
            conn = await client._connect()
            assert isinstance(conn, http_client._SocketConnection)
            conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            client._idle.append(conn)  # the request goes on this connection
            exchange = http_client.Exchange()
            await client.send(client.request_bytes("POST", "/x", body), exchange, lambda: None)
        finally:
            client.close()
            server.close()
            await server.wait_closed()
        return exchange.error, exchange.status, bytes(exchange.body), bytes(got) == body

    assert _run(test) == (None, 200, b"ok", True)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl for a certificate")
def test_https_goes_through_the_tls_transport_and_reads_the_same(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
         "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    answer = _HEAD + b"5\r\nhello\r\n0\r\n\r\n"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def test() -> tuple[Any, ...]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=served)
        port = server.sockets[0].getsockname()[1]
        client = http_client.HttpClient(f"https://127.0.0.1:{port}", None, lambda: 0.0, 5)
        assert client.ssl is not None
        client.ssl.load_verify_locations(cert)
        try:
            conn = await client._connect()
            conn.close()
            return type(conn), await client.get("/x")
        finally:
            client.close()
            server.close()
            await server.wait_closed()

    assert _run(test) == (http_client._TlsConnection, (200, b"hello"))


def test_a_host_whose_every_address_refuses_names_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Like asyncio's create_connection: one reason when every address gives it, all of them
    when they differ."""

    async def two(*args: Any, **kwargs: Any) -> list[Any]:
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 9)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", 9)),
        ]

    reasons = iter([ConnectionRefusedError(111, "refused"), TimeoutError(110, "timed out")])

    async def refuse(*args: Any, **kwargs: Any) -> None:
        raise next(reasons)

    monkeypatch.setattr(asyncio.selector_events.BaseSelectorEventLoop, "getaddrinfo", two)
    monkeypatch.setattr(asyncio.selector_events.BaseSelectorEventLoop, "sock_connect", refuse)

    async def test() -> str:
        with pytest.raises(OSError) as err:
            await http_client.open_socket("h", 9)
        return str(err.value)

    assert _run(test) == "Multiple exceptions: [Errno 111] refused, [Errno 110] timed out"


def test_a_request_when_the_kernel_takes_nothing_waits_for_room_then_goes_out() -> None:
    """EAGAIN on the first send (the socket's buffer full): nothing lost, nothing doubled."""

    async def test() -> tuple[bytes, bytes]:
        conn, peer, _ = _pair()
        filler = bytearray()
        with pytest.raises(BlockingIOError):
            while True:  # fill the kernel's buffers while the peer reads nothing
                filler += b"f" * conn._sock.send(b"f" * 65536)
        exchange = _Recorder()
        conn.start(b"GET /after HTTP/1.1\r\n\r\n", exchange)
        loop = asyncio.get_running_loop()
        peer.setblocking(False)
        got = bytearray()
        while len(got) < len(filler) + 23:
            got += await loop.sock_recv(peer, 1 << 20)
        peer.close()
        await exchange.done
        return bytes(got[: len(filler)]).replace(b"f", b""), bytes(got[len(filler) :])

    assert _run(test) == (b"", b"GET /after HTTP/1.1\r\n\r\n")


def test_a_fault_in_reading_ends_the_request_at_once_not_at_its_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(self: Any, data: bytes) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(http_client._SocketConnection, "data_received", broken)

    async def test() -> tuple[Any, ...]:
        loop = asyncio.get_running_loop()
        logged: list[Any] = []
        loop.set_exception_handler(lambda _, context: logged.append(context["exception"]))
        conn, peer, _ = _pair()
        exchange = _Recorder()
        conn.start(b"GET / HTTP/1.1\r\n\r\n", exchange)
        peer.recv(100)
        peer.sendall(_HEAD)
        await exchange.done
        peer.close()
        return exchange.error, exchange.reason, conn.closed, [str(err) for err in logged]

    assert _run(test) == ("connection closed before a response", CONNECTION_CLOSED, True, ["a bug"])


def test_a_connection_answered_before_its_request_went_out_is_not_reused() -> None:
    """A server that answers (keep-alive) before reading a large request's body: the rest of
    the body is still going out, so the next request must not share the connection."""
    body = b"b" * (32 * 1024 * 1024)  # more than the kernel buffers on both sides hold

    async def test() -> tuple[Any, ...]:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 413 Too Large\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.5)  # reads nothing more: the client's send stays pending
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = http_client.HttpClient(f"http://127.0.0.1:{port}", None, lambda: 0.0, 5)
        try:
            conn = await client._connect()
            assert isinstance(conn, http_client._SocketConnection)
            conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            client._idle.append(conn)
            exchange = http_client.Exchange()
            await client.send(client.request_bytes("POST", "/x", body), exchange, lambda: None)
            return exchange.status, exchange.error, conn.closed, client._idle
        finally:
            client.close()
            server.close()
            await server.wait_closed()

    assert _run(test) == (413, None, True, [])


def test_a_numeric_address_connects_without_the_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    """127.0.0.1 needs no resolver thread (a fresh-clone run at load 11 spent more than a 0.1 s
    request timeout starting one); a name still goes through loop.getaddrinfo."""
    asked: list[str] = []

    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        resolve = loop.getaddrinfo

        async def counted(host: str, *args: Any, **kwargs: Any) -> Any:
            asked.append(host)
            return await resolve(host, *args, **kwargs)

        monkeypatch.setattr(loop, "getaddrinfo", counted)
        async with server:
            for host in ("127.0.0.1", "localhost"):
                sock = await http_client.open_socket(host, port)
                sock.close()

    asyncio.run(main())
    assert asked == ["localhost"]
