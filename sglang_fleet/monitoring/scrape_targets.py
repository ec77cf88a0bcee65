"""What Prometheus scrapes, worked out from the inventory (docs/MONITORING.md).

The monitoring role hands this module one plain mapping per host: its name, the address the
monitoring host reaches it at, its servers (``sglang_server_instances`` as written), its router
(``sglang_router_workers`` and ``sglang_router_prometheus_host/port``) and its SLOs; and one per
job host (``monitoring_job_hosts``) with the job runner's metrics address and port
(``sglang_job_metrics_address/port``, roles/sglang_job). Out come the scrape targets with the
labels every alert and panel groups by (host, server, model), the files
that hold the servers' keys (a separate call, for a task that logs nothing), and the SLO and
router-size constants the alert rules compare against.

A server or router that listens on loopback only can be scraped by a Prometheus on its own host
alone: that is an error naming the server, not a target that is silently down.

Everything that becomes a label value, a target or a file name is checked first, naming the host,
the server and the field: text Prometheus can hold (UTF-8, no control characters), addresses
that are a host name or an IP address, ports 1..65535, SLOs that are finite numbers in range
(docs/MONITORING.md, "Settings"). A key file's name is one-to-one with its (host, server) pair
(key_file_name()), and the templates quote every string with yaml_string().
"""

from __future__ import annotations

import ipaddress
import posixpath
import unicodedata
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from sglang_fleet.module_utils.fleet_http import HttpError, check_url
from sglang_fleet.module_utils.typed_number import Range
from sglang_fleet.monitoring.settings import MAX_SLO_MS, SettingError, number, port

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# A file name is at most 255 bytes; the longest name key_file_name() may give.
MAX_KEY_FILE_NAME = 255
SLO_RANGE = Range(0, MAX_SLO_MS, low_open=True)


class MonitoringError(ValueError):
    """An inventory that Prometheus cannot scrape as written."""


def _text(value: Any, what: str) -> str:
    """A label value or name as Prometheus and YAML can hold it, or MonitoringError naming it."""
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise MonitoringError(f"{what} must be text, got a {type(value).__name__}")
    text = str(value)
    if not text:
        raise MonitoringError(f"{what} is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise MonitoringError(f"{what} is not valid UTF-8 text: {text!r}") from None
    if any(unicodedata.category(c) in ("Cc", "Cs") for c in text):
        raise MonitoringError(f"{what} holds a control character: {text!r}")
    return text


def _address(value: Any, what: str) -> str:
    """A host name or IP address the monitoring host reaches, as a target writes it."""
    text = _text(value, what)
    try:
        ip = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        ip = None
    shown = f"[{ip}]" if ip is not None and ip.version == 6 else text
    try:
        check_url(f"http://{shown}:1/", what)
    except HttpError:
        raise MonitoringError(f"{what} {text!r} is not a host name or an IP address") from None
    return shown


def _port(value: Any, what: str) -> int:
    try:
        return port(value, what)
    except SettingError as exc:
        raise MonitoringError(f"{what} {exc.message}") from None


def _reach(host: Mapping[str, Any], listen: str, monitoring_host: str, what: str) -> str:
    """The address the monitoring host uses for something listening on ``listen`` on ``host``."""
    if listen not in LOOPBACK:
        return _address(host["address"], f"host {host['name']}: monitoring_scrape_address")
    if host["name"] == monitoring_host:
        return "127.0.0.1"
    raise MonitoringError(
        f"{what} on {host['name']} listens on {listen} only, so Prometheus on {monitoring_host} "
        "cannot scrape it: give it host: 0.0.0.0 (or the address the monitoring host reaches), "
        "or run Prometheus on that host (monitoring_host)"
    )


def yaml_string(value: Any) -> str:
    """value as one YAML double-quoted scalar, on one line: PyYAML's emitter escapes what YAML
    cannot hold raw (\\x7F, \\L, \\U0001F600), which Prometheus's YAML reader parses back to
    the same text (Jinja's tojson writes an emoji as a JSON surrogate pair, which it refuses).
    Text that cannot be UTF-8 (a lone surrogate) raises ValueError."""
    text = str(value)
    text.encode("utf-8")  # UnicodeEncodeError, a ValueError, for a lone surrogate
    dumped = yaml.safe_dump(text, default_style='"', allow_unicode=True, width=float("inf"))
    return dumped.rstrip("\n")


def _scraped_here(server: Mapping[str, Any], host: str) -> bool:
    """A server across hosts serves HTTP (and /metrics) from its node 0 only."""
    nodes = server.get("nodes") or []
    return not nodes or nodes[0] == host


def _where(host: Mapping[str, Any], server: Mapping[str, Any]) -> str:
    return f"server {server.get('name')!r} on {host['name']}"


def _model(server: Mapping[str, Any], where: str) -> str:
    """The model label: the served name, else the model folder's name."""
    if server.get("served_model_name"):
        return _text(server["served_model_name"], f"{where}: served_model_name")
    path = _text(server.get("model_path"), f"{where}: model_path")
    return _text(posixpath.basename(path.rstrip("/")) or path, f"{where}: model_path")


def key_file_name(host: str, server: str) -> str:
    """The key file of (host, server): `<host>@<server>`, the host percent-encoded (RFC 3986:
    letters, digits and -._~ stay as they are, everything else, '@' and '%' included, becomes
    %XX). No two pairs share a name: the encoded host holds no '@', so the first '@' splits the
    name back into its pair; and no name is '.', '..' or holds a '/'."""
    name = f"{urllib.parse.quote(host, safe='-._~')}@{urllib.parse.quote(server, safe='-._~')}"
    if len(name.encode()) > MAX_KEY_FILE_NAME:
        raise MonitoringError(
            f"host {host!r}: its name is too long for a key file name ({len(name)} > "
            f"{MAX_KEY_FILE_NAME} bytes once encoded)"
        )
    return name


def _key_file(key_dir: str, host: str, server: str) -> str:
    return posixpath.join(key_dir, key_file_name(host, server))


def _check_hosts(hosts: Sequence[Mapping[str, Any]]) -> None:
    """Host names are label values and key file names: text, and each one once."""
    if not isinstance(hosts, Sequence) or isinstance(hosts, str):
        raise MonitoringError("the scraped hosts must be a list")
    seen = set()
    for host in hosts:
        if not isinstance(host, Mapping):
            raise MonitoringError("each scraped host must be a mapping")
        name = _text(host.get("name"), "a scraped host's name")
        if name in seen:
            raise MonitoringError(f"host {name} is listed twice in monitoring_scrape_hosts")
        seen.add(name)
        servers = host.get("servers") or []
        if not isinstance(servers, list) or not all(isinstance(s, Mapping) for s in servers):
            raise MonitoringError(
                f"host {name}: sglang_server_instances must be a list of mappings"
            )
        for server in servers:
            _text(server.get("name"), f"a server on {name}: name")


def server_targets(
    hosts: Sequence[Mapping[str, Any]], monitoring_host: str, key_dir: str
) -> list[dict[str, Any]]:
    """One scrape target per server: {host, server, model, target, credentials_file}.

    ``credentials_file`` is the path of the file holding the server's key ("" without a key);
    the key itself never appears here, so this list may be logged and templated freely.
    """
    _check_hosts(hosts)
    targets = []
    for host in hosts:
        for server in host.get("servers") or []:
            if not _scraped_here(server, host["name"]):
                continue
            what = f"server {server['name']!r}"
            where = _where(host, server)
            address = _reach(host, str(server.get("host") or "127.0.0.1"), monitoring_host, what)
            has_key = bool(server.get("api_key"))
            targets.append(
                {
                    "host": host["name"],
                    "server": str(server["name"]),
                    "model": _model(server, where),
                    "target": f"{address}:{_port(server.get('port'), f'{where}: port')}",
                    "credentials_file": (
                        _key_file(key_dir, host["name"], str(server["name"])) if has_key else ""
                    ),
                }
            )
    return targets


def server_credentials(hosts: Sequence[Mapping[str, Any]], key_dir: str) -> list[dict[str, str]]:
    """[{path, key}] for the servers with a key: only for a task with no_log."""
    _check_hosts(hosts)
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
        where = f"host {host['name']}: sglang_router_prometheus_port"
        targets.append(
            {
                "host": host["name"],
                "target": f"{address}:{_port(router.get('prometheus_port'), where)}",
                "workers": len(router["workers"]),
            }
        )
    return targets


def job_targets(
    job_hosts: Sequence[Mapping[str, Any]], monitoring_host: str
) -> list[dict[str, Any]]:
    """One target per job host: {host, target}, the job runner's metrics port there
    (sglang_job_metrics_port, roles/sglang_job; 0: the host's jobs serve none). A job's runner
    serves sglang_job_* only while it runs: the target is down between jobs, which no alert
    reads as a fault (the stall alert reads the job's own series)."""
    if not isinstance(job_hosts, Sequence) or isinstance(job_hosts, str):
        raise MonitoringError("monitoring_job_hosts must be a list of inventory names")
    targets, seen = [], set()
    for host in job_hosts:
        if not isinstance(host, Mapping):
            raise MonitoringError("each job host must be a mapping")
        name = _text(host.get("name"), "a job host's name (monitoring_job_hosts)")
        if name in seen:
            raise MonitoringError(f"host {name} is listed twice in monitoring_job_hosts")
        seen.add(name)
        job = host.get("job") or {}
        where = f"host {name}: sglang_job_metrics_port"
        if job.get("metrics_port") in (0, "0"):
            continue
        listen = str(job.get("metrics_address") or "127.0.0.1")
        if listen in LOOPBACK and name != monitoring_host:
            raise MonitoringError(
                f"host {name}: sglang_job_metrics_address is {listen}, so Prometheus on "
                f"{monitoring_host} cannot scrape the job runner there: set it to 0.0.0.0 (or "
                "the address the monitoring host reaches), or leave the host out of "
                "monitoring_job_hosts"
            )
        address = _reach({**host, "name": name}, listen, monitoring_host, "the job runner")
        targets.append(
            {"host": name, "target": f"{address}:{_port(job.get('metrics_port'), where)}"}
        )
    return targets


def slo_seconds(
    hosts: Sequence[Mapping[str, Any]], default_ttft_ms: float, default_tpot_ms: float
) -> list[dict[str, Any]]:
    """Per scraped server its TTFT and TPOT objectives in seconds: {host, server, ttft, tpot}.

    A host's smoke-gate SLO (smoke_gate_workload.slo_ttft_ms / slo_tpot_ms) wins over the
    monitoring defaults, so the alert and the rollout gate hold the server to one number. Unset
    (null or "") means the default; any other value must be a finite number of milliseconds in
    (0, 3600000]: 0, -5 and NaN are refused, not read as the default, "always" or "never".
    """
    ttft_default = _slo(default_ttft_ms, "monitoring_slo_ttft_ms")
    tpot_default = _slo(default_tpot_ms, "monitoring_slo_tpot_ms")
    rows = []
    for host in hosts:
        field = f"host {host['name']}: smoke_gate_workload"
        ttft = _slo(host.get("slo_ttft_ms"), f"{field}.slo_ttft_ms", ttft_default)
        tpot = _slo(host.get("slo_tpot_ms"), f"{field}.slo_tpot_ms", tpot_default)
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


def _slo(value: Any, what: str, default: float | None = None) -> float:
    if value in (None, "") and default is not None:
        return default
    try:
        return float(number(value, what, SLO_RANGE))
    except SettingError as exc:
        raise MonitoringError(f"{what} {exc.message} (unset: the default)") from None


def targets(  # noqa: PLR0917 (the filter passes them by position)
    hosts: Sequence[Mapping[str, Any]],
    monitoring_host: str,
    key_dir: str,
    default_ttft_ms: float,
    default_tpot_ms: float,
    job_hosts: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """What the Prometheus configuration and the rules print: servers, routers, nodes, SLOs and
    the job runners' metrics ports."""
    _check_hosts(hosts)
    return {
        "jobs": job_targets(job_hosts, monitoring_host),
        "servers": server_targets(hosts, monitoring_host, key_dir),
        "routers": router_targets(hosts, monitoring_host),
        "nodes": [
            {
                "host": h["name"],
                "address": _address(h["address"], f"host {h['name']}: monitoring_scrape_address"),
                "dcgm": bool(h.get("dcgm")),
            }
            for h in hosts
        ],
        "slos": slo_seconds(hosts, default_ttft_ms, default_tpot_ms),
    }
