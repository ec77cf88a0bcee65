"""URLs and host names at their edges, for the project's one URL rule
(plugins/module_utils/fleet_http.py, check_url) and the smoke client's --url, which now goes through
it (issue 44: the readers the docs call bounded). Each is a clean usage error naming the flag
(exit 2 for the client, before any request) or a correct connection: never credentials sent,
never a port or host guessed, never a trailing newline let by.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import threading
from collections.abc import Iterator

import pytest
from sglang_fleet.module_utils.fleet_http import HttpError, check_url

from sglang_fleet.smoke.smoke_client.command_line import build_parser, config_from_args
from sglang_fleet.smoke.smoke_client.http_client import HttpClient

PASSWORD = "hunter2-url-secret"
LONG_LABEL = "a" * 64
LONG_NAME = ".".join(["a" * 63] * 4)  # 255 characters

# (url, what the message says): refused by both the URL rule and the smoke client.
REFUSED = [
    ("http://h..:8000", "host 'h..' is not a host name"),
    (f"http://{LONG_LABEL}:8000", "is not a host name"),
    (f"http://{LONG_NAME}:8000", "is not a host name"),
    ("http://1.2.3.4.5:8000", "is not a host name"),
    ("http://127.1:8000", "is not a host name"),
    ("http://0x7f.1:8000", "is not a host name"),
    ("http://017.0.0.1:8000", "is not a host name"),
    ("http://%68ost:8000", "is not a host name"),
    ("http://-h:8000", "is not a host name"),
    ("http://[fe80::1%eth0]:8000", "is not an IPv6 address without a zone"),
    ("http://[fe80::1%25eth0]:8000", "is not an IPv6 address without a zone"),
    ("http://[v1.x]:8000", "is not an IPv6 address"),
    # urlsplit refuses it itself from Python 3.11 (read as a bad port); 3.9 hands it over.
    ("http://[1.2.3.4]:8000", "is not an IPv6 address|bad port"),
    ("http://[::1]]:8000", "is not one host and at most one port"),
    ("http://h:", "is not one host and at most one port"),
    ("http://::1:8000", "bad port"),
    ("http://h:0", "bad port"),
    ("http://h:65536", "bad port"),
    ("http://h:8x", "bad port"),
    ("http://h:+80", "bad port"),
    ("http://h:080", "bad port"),
    ("http://h:80#frag", "#fragment"),
    ("http://evil#@h:80", "#fragment"),
    ("http://h:80/a b", "a space"),
    (" http://h:80", "a space"),
    ("http://h :80", "a space"),
    (f"http://user:{PASSWORD}@h:80", "carries user:password@"),
    ("http://@h:80", "carries user:password@"),
    (f"http://h:{PASSWORD}\\@evil:80", "carries user:password@"),
    ("http://h:8000\n", "printable ASCII"),
    ("http://h:8000\r", "printable ASCII"),
    ("http://h\t:8000", "printable ASCII"),
    ("http://h:\uff18\uff10", "printable ASCII"),  # fullwidth digits
    ("ftp://h:80", "must look like http://HOST:PORT"),
    ("file:///etc/passwd", "must look like http://HOST:PORT"),
    ("http://:80", "must look like http://HOST:PORT"),
    ("http:h:80", "must look like http://HOST:PORT"),
    ("h:80", "must look like http://HOST:PORT"),
    ("", "must look like http://HOST:PORT"),
]
# Refused by the smoke client only: a base URL has no query, its path only what a request line
# carries. (The URL rule keeps queries: Prometheus's API reads them.)
REFUSED_BY_THE_CLIENT = [
    ("http://h:80?q=1", "has a query"),
    ("http://h:80/?", "has a query"),
    ("http://h:80/a%zz", "its path may hold"),
    ('http://h:80/a"b', "its path may hold"),
    ("http://h:80/a{b}", "its path may hold"),
]
# (url, host, port, the Host header, the base path): what the client connects to.
ACCEPTED = [
    ("http://127.0.0.1:30000", "127.0.0.1", 30000, "127.0.0.1:30000", ""),
    ("http://[::1]:8000", "::1", 8000, "[::1]:8000", ""),
    ("http://[::ffff:10.0.0.1]:8000", "::ffff:10.0.0.1", 8000, "[::ffff:10.0.0.1]:8000", ""),
    ("HTTP://GPU-Node-1:8000/", "gpu-node-1", 8000, "GPU-Node-1:8000", ""),
    ("http://gpu-1.example.:8000", "gpu-1.example.", 8000, "gpu-1.example.:8000", ""),
    ("http://node_1", "node_1", 80, "node_1", ""),
    ("https://h.example", "h.example", 443, "h.example", ""),
    (f"http://{'a' * 63}:1", "a" * 63, 1, f"{'a' * 63}:1", ""),
    (f"http://{LONG_NAME[:253]}:65535", LONG_NAME[:253], 65535, f"{LONG_NAME[:253]}:65535", ""),
    ("http://h:8000/sglang/v1%2Fx", "h", 8000, "h:8000", "/sglang/v1%2Fx"),
]  # fmt: skip


def _says(message: str, said: str) -> bool:
    """Whether the message says one of the |-separated texts."""
    return any(text in message for text in said.split("|"))


def _usage_error(url: str) -> str:
    """What config_from_args says for --url url (SystemExit 2), or '' when it accepts it."""
    parser = build_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            config_from_args(parser.parse_args(["--url", url]), parser)
        except SystemExit as done:
            assert done.code == 2
            return err.getvalue()
    return ""


@pytest.mark.parametrize(("url", "said"), REFUSED + REFUSED_BY_THE_CLIENT)
def test_the_smoke_client_refuses_the_url_naming_the_flag(url: str, said: str) -> None:
    message = _usage_error(url)
    assert "--url" in message and _says(message, said), message
    assert PASSWORD not in message


@pytest.mark.parametrize(("url", "said"), REFUSED)
def test_the_url_rule_refuses_the_same(url: str, said: str) -> None:
    with pytest.raises(HttpError) as caught:
        check_url(url, "router_url")
    assert caught.value.code == "bad_url"
    assert "router_url" in str(caught.value) and _says(str(caught.value), said)
    assert PASSWORD not in str(caught.value)


@pytest.mark.parametrize(("url", "host", "port", "header", "path"), ACCEPTED)
def test_an_accepted_url_connects_where_it_says(
    url: str, host: str, port: int, header: str, path: str
) -> None:
    assert _usage_error(url) == ""
    client = HttpClient(url, None, lambda: 0.0, 5.0)
    assert (client.host, client.port, client.base_path) == (host, port, path)
    assert f"Host: {header}\r\n" in client.request_bytes("GET", "/health", None).decode()
    assert check_url(url, "x")[1:3] == (host, port)


def test_a_trailing_newline_never_passes_a_validator() -> None:
    """`$` matches before a trailing newline; every pattern here is used with fullmatch."""
    for url in ("http://h:8000\n", "http://[::1]:8000\n", "http://h\n:8000"):
        assert "--url" in _usage_error(url)
        with pytest.raises(HttpError):
            check_url(url)


@contextlib.contextmanager
def _ipv6_server() -> Iterator[int]:
    """A loopback IPv6 listener that answers one GET with 200 'ok'."""
    try:
        server = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        server.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        thread.join(5)
        server.close()


def test_a_bracketed_ipv6_url_reaches_the_server() -> None:
    with _ipv6_server() as port:
        client = HttpClient(f"http://[::1]:{port}", None, lambda: 0.0, 5.0)
        assert asyncio.run(client.get("/health")) == (200, b"ok")
