"""The one HTTP reader of every client sglang-fleet ships (docs/ARCHITECTURE.md, "HTTP clients").

Standard library only, Python >= 3.9: Ansible ships it beside a module as
``ansible_collections.sglang_fleet.fleet.plugins.module_utils.fleet_http``; the control-node package
reaches the same file as ``sglang_fleet.module_utils.fleet_http`` (pyproject.toml), and the diagnose
role copies it beside live.py on a GPU host.

What urllib does not give, and every caller here needs:
- one deadline for the whole exchange (connect, send, status line, headers, body): urllib's
  timeout is per socket read, so a peer that trickles a byte a second holds it forever;
- a cap on the body, chunked or not (an endless /metrics must not grow without bound);
- no redirects: a 3xx is an error, so a key sent in a header never reaches another host and
  a redirect never makes a client quietly read another server;
- no proxies from the environment (servers are reached directly), and no credentials in a
  URL: ``user:password@`` is refused, and every URL a message prints goes through
  redact_url() first;
- no header value in a message: a header whose name is not an HTTP token or whose value holds a
  line break, a control or a non-ASCII character is refused before anything is sent, naming the
  header, never quoting the value (http.client sends most control characters, and quotes a value
  with a line break in its error, escaped, where Ansible's no_log cannot mask it). A message
  that quotes foreign text (a router's answer) goes through without_secrets() first.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import json
import re
import socket
import ssl
import time
from collections.abc import Callable, Iterable
from urllib.parse import quote, urlsplit

DEFAULT_DEADLINE_S = 10.0
DEFAULT_MAX_BYTES = 16 << 20  # a busy /metrics is a few hundred KiB; a worker list less

# `scheme://user:password@`, the scheme starting at the first letter of a run of scheme
# characters that begins a word. The run is matched from its start (group 1 keeps what precedes
# that letter), never from inside it: `\b[a-z][a-z0-9+.-]*://` tried at every letter of a long
# run of such characters costs the run's square.
_USERINFO = re.compile(
    r"(?i)(?<![a-z0-9+.-])((?:[0-9+.-]|\B[a-z])*)\b([a-z][a-z0-9+.-]*://)[^/\s@]*@"
)
# Used with fullmatch only (a `$` lets a trailing newline by).
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
# The host and port of a netloc without userinfo: one bracketed IPv6 literal or one name, then
# at most one port of digits (urlsplit reads `[::1]]:80` and `h:` too, and guesses).
_HOST_PORT = re.compile(r"(?:\[[^\[\]]+\]|[^\[\]:]+)(?::[0-9]+)?")
_MAX_NAME = 253
# An HTTP field name (RFC 9110 5.6.2: a token), and the values this reader sends: visible ASCII,
# spaces and tabs (RFC 9110 5.5 field-value, minus obs-text, which clients encode differently).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE = re.compile(r"[\t -~]*")
REDACTED = "<redacted>"

Clock = Callable[[], float]


class HttpError(Exception):
    """The exchange did not give a usable answer; ``code`` says why, the message is safe to print.

    Codes: bad_url, bad_header, unreachable, timeout, too_large, redirect, bad_response.
    """

    def __init__(self, code: str, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason or message


class Response:
    """A complete answer: status, reason, headers (lower-case names) and the whole body."""

    def __init__(self, status: int, reason: str, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body


def redact_url(url: object) -> str:
    """The text with ``user:password@`` removed from every URL in it (``scheme://***@host``)."""
    return _USERINFO.sub(r"\1\2***@", str(url))


def without_secrets(text: object, secrets: Iterable[str | None]) -> str:
    """The text with each secret replaced by <redacted>, as written and as Python, JSON and URLs
    escape it (no_log masks only the first): what a message quoting foreign text may say."""
    shown = str(text)
    for secret in secrets:
        if not isinstance(secret, str) or not secret:
            continue
        forms = {
            secret,
            repr(secret)[1:-1],
            repr(secret.encode("utf-8", "backslashreplace"))[2:-1],
            json.dumps(secret)[1:-1],
            json.dumps(secret, ensure_ascii=False)[1:-1],
            quote(secret, safe=""),
        }
        for form in sorted(forms, key=len, reverse=True):
            shown = shown.replace(form, REDACTED)
    return shown


def header_problem(name: object, value: object) -> str | None:
    """Why a header cannot be sent as written, or None; names the header, never quotes its
    value (it may be a key)."""
    if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
        return "a header name is not an HTTP token (letters, digits and !#$%&'*+.^_`|~-)"
    if not isinstance(value, str):
        return f"header {name}: its value is not text"
    if not _HEADER_VALUE.fullmatch(value):
        return (
            f"header {name}: its value holds a line break, a control character or a non-ASCII "
            "character, which a header cannot carry as written (the value is not shown)"
        )
    return None


def _numeric_name(name: str) -> bool:
    """A name the resolver reads as an IPv4 address in a short, octal or hex form (`127.1`,
    `0x7f.1`, `017.0.0.1`, `1`), or with an all-digit last label, which no DNS name has."""
    if name.rpartition(".")[2].isdigit():
        return True
    try:
        socket.inet_aton(name)
    except (OSError, ValueError):
        return False
    return True


def _host_problem(host: str, netloc: str = "") -> str | None:
    """Why host (urlsplit's hostname of netloc) is neither an IP address nor a host name: labels
    of 1..63 letters, digits, - or _, at most 253 characters in all, one trailing dot at most."""
    host_port = netloc.rpartition("@")[2]
    if netloc and not _HOST_PORT.fullmatch(host_port):
        return f"{host_port!r} is not one host and at most one port"
    if host_port.startswith("["):
        if "%" in host or not isinstance(_ip(host), ipaddress.IPv6Address):
            return f"host [{host}] is not an IPv6 address without a zone"
        return None
    if _ip(host) is not None:
        return None
    name = host[:-1] if host.endswith(".") else host  # one trailing dot: a fully qualified name
    labels = name.split(".")
    if (
        len(name) > _MAX_NAME
        or not all(_DNS_LABEL.fullmatch(label) for label in labels)
        or _numeric_name(name)
    ):
        return f"host {host!r} is not a host name or an IP address"
    return None


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def check_url(url: str, what: str = "URL") -> tuple[str, str, int, str]:
    """(scheme, host, port, path+query) of an http(s) URL, or HttpError("bad_url") saying why.

    Refused: other schemes, ``user:password@`` (never sent anywhere, never printed), a host
    that is not a name or an address (an IPv6 zone, a bracketed non-IPv6, a name of 254 or more
    characters or a label of 64, a numeric name the resolver would read as IPv4), a port
    outside 1..65535, written with a leading zero (a router matches worker URLs as text:
    ``:08000`` is not ``:8000`` to it) or empty, a space or a ``#fragment``.
    """
    shown = redact_url(url)
    if not isinstance(url, str) or not url.isascii() or not url.isprintable():
        raise HttpError("bad_url", f"{what} must be printable ASCII, got {shown!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise HttpError("bad_url", f"{what} {shown!r} has a bad port (1..65535)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HttpError("bad_url", f"{what} must look like http://HOST:PORT, got {shown!r}")
    if "@" in parts.netloc:
        raise HttpError(
            "bad_url",
            f"{what} {shown!r} carries user:password@: credentials in a URL are never sent "
            "(the servers and the router take an API key)",
        )
    if " " in url or "#" in url:  # urlsplit drops a leading space; a fragment is never sent
        raise HttpError("bad_url", f"{what} {shown!r} has a space or a #fragment")
    problem = _host_problem(parts.hostname, parts.netloc)
    if problem:
        raise HttpError("bad_url", f"{what} {shown!r}: {problem}")
    written_port = parts.netloc.rsplit("]", 1)[-1].partition(":")[2]
    if port is not None and (port == 0 or written_port != str(port)):
        raise HttpError("bad_url", f"{what} {shown!r} has a bad port (1..65535, no leading zero)")
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.scheme, parts.hostname, port, path


class _DeadlineReader(io.RawIOBase):
    """Socket reads that each wait at most until the exchange's deadline."""

    def __init__(self, sock: socket.socket, deadline: float, clock: Clock) -> None:
        super().__init__()
        self._sock, self._deadline, self._clock = sock, deadline, clock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray) -> int:  # type: ignore[override]
        left = self._deadline - self._clock()
        if left <= 0:
            raise socket.timeout("the deadline passed")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _DeadlineSocket:
    """What http.client sees as its socket: every send and read bounded by one deadline."""

    def __init__(self, sock: socket.socket, deadline: float, clock: Clock) -> None:
        self._sock, self._deadline, self._clock = sock, deadline, clock

    def _left(self) -> float:
        left = self._deadline - self._clock()
        if left <= 0:
            raise socket.timeout("the deadline passed")
        return left

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(self._left())
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *_args: object, **_kwargs: object) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline, self._clock))

    def close(self) -> None:
        """http.client closes its socket while the response may still read from it (a
        ``Connection: close`` answer); request() closes the real socket when done."""


def _connection(scheme: str, host: str, port: int, timeout: float) -> http.client.HTTPConnection:
    if scheme == "https":
        return http.client.HTTPSConnection(
            host, port, timeout=timeout, context=ssl.create_default_context()
        )
    return http.client.HTTPConnection(host, port, timeout=timeout)


def _read_body(response: http.client.HTTPResponse, max_bytes: int, shown: str) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = response.read(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes:
            raise HttpError("too_large", f"{shown} answered more than {max_bytes} bytes")
        chunks.append(chunk)


def request(
    url: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    max_bytes: int = DEFAULT_MAX_BYTES,
    clock: Clock = time.monotonic,
) -> Response:
    """One exchange, all of it within ``deadline_s``. Any status but 3xx is returned (the
    caller says what a 401 or a 404 means); a 3xx raises HttpError("redirect"), not followed."""
    scheme, host, port, path = check_url(url)
    shown = redact_url(url)
    for name, value in (headers or {}).items():
        problem = header_problem(name, value)
        if problem:
            raise HttpError("bad_header", f"{method} {shown} not sent: {problem}")
    deadline = clock() + deadline_s
    conn = _connection(scheme, host, port, max(deadline_s, 0.001))
    raw: socket.socket | None = None
    try:
        conn.connect()
        raw = conn.sock
        conn.sock = _DeadlineSocket(raw, deadline, clock)  # type: ignore[assignment]
        try:
            conn.request(method, path, body=body, headers=dict(headers or {}))
        except ValueError:  # http.client quotes what it refuses: say what, never the text
            raise HttpError(
                "bad_header",
                f"{method} {shown} not sent: a header or the method cannot be "
                "sent as written (not shown)",
            ) from None
        response = conn.getresponse()
        if 300 <= response.status < 400:
            target = redact_url(response.getheader("Location", "nowhere"))
            raise HttpError(
                "redirect",
                f"{method} {shown} answered {response.status} to {target}: redirects are not "
                "followed (a key never goes to another host); give the final URL",
            )
        data = _read_body(response, max_bytes, shown)
        names = {name.lower(): value for name, value in response.getheaders()}
        return Response(response.status, response.reason, names, data)
    except socket.timeout:
        raise HttpError(
            "timeout", f"{method} {shown} did not answer in full within {deadline_s:g} s"
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        reason = redact_url(exc)
        raise HttpError("unreachable", f"cannot reach {shown}: {reason}", reason) from None
    finally:
        conn.close()
        if raw is not None:
            raw.close()
