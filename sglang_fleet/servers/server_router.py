"""A server's router, checked: the router's URL and the server's worker URL as sglang-router
compares them (docs/ROUTER.md), and where the server's own host reaches it.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from sglang_fleet.module_utils.fleet_http import HttpError, check_url, redact_url
from sglang_fleet.servers.router_settings import ROUTER_URL_RE, ROUTER_URL_RULE, url_port
from sglang_fleet.servers.server_values import ServerConfigError, check_keys, checked_mapping

ROUTER_KEYS = ("url", "worker_url")
# Addresses that mean "every interface": the host itself reaches such a server on loopback.
WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]", "[::]": "[::1]"}


def local_address(host: str) -> str:
    """Where the server's own host reaches it: loopback for a wildcard address, else the address
    (bracketed when it is IPv6)."""
    if host in WILDCARD_HOSTS:
        return WILDCARD_HOSTS[host]
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _readable_url(url: str, variable: str) -> None:
    """What the modules' HTTP reader refuses (port 0 or above 65535, a leading zero, a host
    like '..'), refused here first, before any host is touched."""
    try:
        check_url(url, variable)
    except HttpError as exc:
        raise ServerConfigError(variable, str(exc).removeprefix(f"{variable} ")) from None


def check_router(
    value: Any, where: str, port: int, host: str, hostname: str | None
) -> dict[str, str] | None:
    """The server's router: {url, worker_url, metrics_url}, or None when it has none."""
    if value is None:
        return None
    variable = f"{where}.router"
    router = checked_mapping(value, variable)
    check_keys(router, variable, ROUTER_KEYS)
    url = router.get("url")
    if not isinstance(url, str) or not ROUTER_URL_RE.fullmatch(url):
        raise ServerConfigError(
            f"{variable}.url",
            f"{redact_url(repr(url))} must be the router's URL as this host reaches it, "
            f"{ROUTER_URL_RULE}",
        )
    _readable_url(url, f"{variable}.url")
    worker_url = router.get("worker_url")
    if worker_url is None:
        if not hostname:
            raise ServerConfigError(
                f"{variable}.worker_url",
                "is required here: no host name to build http://<host>:<port> from",
            )
        worker_url = f"http://{hostname}:{port}"
    match = ROUTER_URL_RE.fullmatch(worker_url) if isinstance(worker_url, str) else None
    if match is None:
        raise ServerConfigError(
            f"{variable}.worker_url",
            f"{redact_url(repr(worker_url))} must be {ROUTER_URL_RULE} (sglang-router compares "
            "worker URLs as written: 'http://host:port/' never becomes healthy)",
        )
    _readable_url(worker_url, f"{variable}.worker_url")
    if _url_key(url) == _url_key(worker_url):
        raise ServerConfigError(
            f"{variable}.url",
            f"{url} is the server's own worker URL: a server cannot be routed through itself",
        )
    if url_port(match) != port:
        raise ServerConfigError(
            f"{variable}.worker_url",
            f"{worker_url!r} names port {url_port(match)}, but the server listens on port {port}",
        )
    return {
        "url": url,
        "worker_url": worker_url,
        # Read on the server's own host while it drains (needs enable_metrics, host_checks.py).
        "metrics_url": f"http://{local_address(host)}:{port}/metrics",
    }


def _url_key(url: str) -> str:
    """A worker URL as sglang-router compares it: scheme and host case-insensitive, the rest as
    written (docs/ROUTER.md, "Worker API")."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(
        (parts.scheme.lower(), parts.netloc.lower(), parts.path, parts.query, parts.fragment)
    )
