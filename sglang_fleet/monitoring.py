"""What Prometheus scrapes, worked out from the inventory (docs/MONITORING.md).

The monitoring role hands this module one plain mapping per host: its name, the address the
monitoring host reaches it at, its servers (``sglang_server_instances`` as written), its router
(``sglang_router_workers`` and ``sglang_router_prometheus_host/port``) and its SLOs. Out come the
scrape targets with the labels every alert and panel groups by (host, server, model), the files
that hold the servers' keys (a separate call, for a task that logs nothing), and the SLO and
router-size constants the alert rules compare against.

A server or router that listens on loopback only can be scraped by a Prometheus on its own host
alone: that is an error naming the server, not a target that is silently down.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class MonitoringError(ValueError):
    """An inventory that Prometheus cannot scrape as written."""


def _reach(host: Mapping[str, Any], listen: str, monitoring_host: str, what: str) -> str:
    """The address the monitoring host uses for something listening on ``listen`` on ``host``."""
    if listen not in LOOPBACK:
        return str(host["address"])
    if host["name"] == monitoring_host:
        return "127.0.0.1"
    raise MonitoringError(
        f"{what} on {host['name']} listens on {listen} only, so Prometheus on {monitoring_host} "
        "cannot scrape it: give it host: 0.0.0.0 (or the address the monitoring host reaches), "
        "or run Prometheus on that host (monitoring_host)"
    )


def _scraped_here(server: Mapping[str, Any], host: str) -> bool:
    """A server across hosts serves HTTP (and /metrics) from its node 0 only."""
    nodes = server.get("nodes") or []
    return not nodes or nodes[0] == host


def _model(server: Mapping[str, Any]) -> str:
    return str(server.get("served_model_name") or posixpath.basename(str(server["model_path"])))


def _key_file(key_dir: str, host: str, server: str) -> str:
    return posixpath.join(key_dir, f"{host}--{server}")


def server_targets(
    hosts: Sequence[Mapping[str, Any]], monitoring_host: str, key_dir: str
) -> list[dict[str, Any]]:
    """One scrape target per server: {host, server, model, target, credentials_file}.

    ``credentials_file`` is the path of the file holding the server's key ("" without a key);
    the key itself never appears here, so this list may be logged and templated freely.
    """
    targets = []
    for host in hosts:
        for server in host.get("servers") or []:
            if not _scraped_here(server, host["name"]):
                continue
            what = f"server {server['name']!r}"
            address = _reach(host, str(server.get("host") or "127.0.0.1"), monitoring_host, what)
            has_key = bool(server.get("api_key"))
            targets.append(
                {
                    "host": host["name"],
                    "server": str(server["name"]),
                    "model": _model(server),
                    "target": f"{address}:{server['port']}",
                    "credentials_file": (
                        _key_file(key_dir, host["name"], str(server["name"])) if has_key else ""
                    ),
                }
            )
    return targets


def server_credentials(hosts: Sequence[Mapping[str, Any]], key_dir: str) -> list[dict[str, str]]:
    """[{path, key}] for the servers with a key: only for a task with no_log."""
    return [
        {
            "path": _key_file(key_dir, host["name"], str(server["name"])),
            "key": str(server["api_key"]),
        }
        for host in hosts
        for server in host.get("servers") or []
        if server.get("api_key") and _scraped_here(server, host["name"])
    ]


def router_targets(
    hosts: Sequence[Mapping[str, Any]], monitoring_host: str
) -> list[dict[str, Any]]:
    """One target per router: {host, target, workers} (workers: how many it should have)."""
    targets = []
    for host in hosts:
        router = host.get("router") or {}
        if not router.get("workers"):
            continue
        listen = str(router.get("prometheus_host") or "127.0.0.1")
        address = _reach(host, listen, monitoring_host, "the router's metrics endpoint")
        targets.append(
            {
                "host": host["name"],
                "target": f"{address}:{router['prometheus_port']}",
                "workers": len(router["workers"]),
            }
        )
    return targets


def slo_seconds(
    hosts: Sequence[Mapping[str, Any]], default_ttft_ms: float, default_tpot_ms: float
) -> list[dict[str, Any]]:
    """Per scraped server its TTFT and TPOT objectives in seconds: {host, server, ttft, tpot}.

    A host's smoke-gate SLO (smoke_gate_workload.slo_ttft_ms / slo_tpot_ms) wins over the
    monitoring defaults, so the alert and the rollout gate hold the server to one number.
    """
    rows = []
    for host in hosts:
        ttft = host.get("slo_ttft_ms") or default_ttft_ms
        tpot = host.get("slo_tpot_ms") or default_tpot_ms
        for server in host.get("servers") or []:
            if _scraped_here(server, host["name"]):
                rows.append(
                    {
                        "host": host["name"],
                        "server": str(server["name"]),
                        "ttft": float(ttft) / 1000.0,
                        "tpot": float(tpot) / 1000.0,
                    }
                )
    return rows


def scrape_plan(
    hosts: Sequence[Mapping[str, Any]],
    monitoring_host: str,
    key_dir: str,
    default_ttft_ms: float,
    default_tpot_ms: float,
) -> dict[str, Any]:
    """What the Prometheus configuration and the rules print: servers, routers, nodes, SLOs."""
    return {
        "servers": server_targets(hosts, monitoring_host, key_dir),
        "routers": router_targets(hosts, monitoring_host),
        "nodes": [
            {"host": h["name"], "address": str(h["address"]), "dcgm": bool(h.get("dcgm"))}
            for h in hosts
        ],
        "slos": slo_seconds(hosts, default_ttft_ms, default_tpot_ms),
    }
