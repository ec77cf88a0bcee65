"""Where playbooks/job.yml sends a job's rows and how many at once, the runner's command line in
its unit, and what the play says about a running job (roles/sglang_job, docs/JOB.md).

Targets: the job's model is served by some servers of the inventory; those behind a router are
reached through it (one target per router, holding the sum of its replicas' in-flight requests),
the others each on their own URL. A server's in-flight requests are the capacity planner's
max_concurrent_requests for the job's lengths (the role plans each server on its own host);
sglang_job_concurrency, when set, is every target's instead. The API key is the servers' (the
router's is the same key, docs/ROUTER.md) or sglang_job_api_key; it goes to the unit as a
credential, never into what this module returns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sglang_fleet.job.play_inputs import JobSettingError, sampling
from sglang_fleet.job.progress import line as progress_line
from sglang_fleet.module_utils.fleet_http import HttpError, check_url
from sglang_fleet.servers.launch_line import exec_start

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
WILDCARD = ("0.0.0.0", "::", "[::]", "")


def served_model(server: Mapping[str, Any]) -> str:
    """The model name a server answers to: its served_model_name, else its model path (as
    SGLang names it)."""
    return str(server.get("served_model_name") or server.get("model_path") or "")


def serves_here(server: Mapping[str, Any], host: str) -> bool:
    """A server across hosts answers HTTP on its node 0 only."""
    nodes = server.get("nodes") or []
    return not nodes or nodes[0] == host


def _server_url(entry: Mapping[str, Any], job_host: str) -> str:
    """The URL the job's host reaches a server without a router at."""
    host, listen, port = entry["host"], str(entry.get("listen") or "127.0.0.1"), entry["port"]
    if host == job_host:
        address = "127.0.0.1" if listen in (*LOOPBACK, *WILDCARD) else listen
    elif listen in LOOPBACK or listen.startswith("127."):
        raise JobSettingError(
            "sglang_job_host",
            f"{job_host}: server {entry['name']} on {host} listens on {listen} only, so the job "
            f"cannot reach it from {job_host}: give it host: 0.0.0.0, put it behind a router, or "
            f"run the job on {host}",
        )
    else:
        address = host if listen in WILDCARD else listen
    if ":" in address and not address.startswith("["):
        address = f"[{address}]"
    url = f"http://{address}:{port}"
    try:
        check_url(url, f"server {entry['name']} on {host}")
    except HttpError as exc:
        raise JobSettingError("sglang_job_host", str(exc)) from None
    return url


def _chosen_model(entries: Sequence[Mapping[str, Any]], model: str | None) -> str:
    models = sorted({e["model"] for e in entries})
    if not models:
        raise JobSettingError(
            "sglang_job_model", "names no server: the inventory's gpu_hosts describe none"
        )
    if model:
        if model not in models:
            raise JobSettingError(
                "sglang_job_model", f"{model!r}: no server serves it (served: {', '.join(models)})"
            )
        return model
    if len(models) > 1:
        raise JobSettingError(
            "sglang_job_model",
            f"is not set and the servers serve {len(models)} models ({', '.join(models)}): "
            "name the job's",
        )
    return models[0]


def targets(
    entries: Sequence[Mapping[str, Any]],
    job_host: str,
    model: str | None,
    concurrency: int | None,
) -> dict[str, Any]:
    """{model, targets: [{url, concurrency, planned, servers, via}], lines}.

    entries: one per server that answers HTTP on its host (what the role's plan step left on
    each host): {host, name, port, listen, router_url, model, planned, problem}; planned is the
    planner's max_concurrent_requests (None when it could not plan: problem says why)."""
    chosen = _chosen_model(entries, model)
    mine = [e for e in entries if e["model"] == chosen]
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for entry in mine:
        url = entry.get("router_url") or _server_url(entry, job_host)
        groups.setdefault(url, []).append(entry)
    found, lines, unplanned = [], [], []
    for url, servers in groups.items():
        names = [f"{s['name']} on {s['host']}" for s in servers]
        unplanned += [
            f"{n}: {s.get('problem') or 'not planned'}"
            for n, s in zip(names, servers, strict=True)
            if s.get("planned") is None
        ]
        planned = (
            None
            if any(s.get("planned") is None for s in servers)
            else sum(int(s["planned"]) for s in servers)
        )
        via = "router" if servers[0].get("router_url") else "server"
        found.append({"url": url, "concurrency": concurrency or planned, "planned": planned,
                      "servers": names, "via": via})  # fmt: skip
        said = (
            f"sglang_job_concurrency (the planner: {planned if planned is not None else 'no plan'})"
            if concurrency
            else "the planner's max_concurrent_requests for the job's lengths"
            + (f" ({' + '.join(str(s['planned']) for s in servers)})" if len(servers) > 1 else "")
        )
        what = f"the router of {', '.join(names)}" if via == "router" else names[0]
        lines.append(f"{url} ({what}): {concurrency or planned} requests in flight, from {said}")
    if unplanned and not concurrency:
        raise JobSettingError(
            "sglang_job_concurrency",
            "is not set and the planner could not size every server of the job: "
            + "; ".join(unplanned)
            + ". Set it (requests in flight per target) or fix the plan",
        )
    return {"model": chosen, "targets": found, "lines": lines}


def api_key(keys: Mapping[str, Any], servers: Sequence[str], override: str = "") -> str:
    """The key the job sends: sglang_job_api_key, else the one key its servers share ("" when
    none has one). keys: {"NAME on HOST": key or ""}. Never quotes a key."""
    if override:
        return override
    found = {str(keys.get(name) or "") for name in servers}
    if len(found) > 1:
        raise JobSettingError(
            "sglang_job_api_key",
            f"is not set and the job's servers ({', '.join(servers)}) do not share one API key: "
            "a job sends one key to every target; set it",
        )
    return found.pop() if found else ""


def command(
    settings: Mapping[str, Any], chosen: Mapping[str, Any], paths: Mapping[str, str]
) -> dict[str, Any]:
    """The runner's command line in the job's unit: {argv, exec_start}. paths: {python,
    program, input, output}. No key: the runner reads it from the unit's credential."""
    argv = [
        paths["python"], paths["program"], "run", paths["input"], "--output", paths["output"],
        "--name", settings["sglang_job_name"], "--model", chosen["model"],
        "--max-tokens", str(settings["sglang_job_max_tokens"]),
        "--sampling", json.dumps(sampling(settings), sort_keys=True, separators=(",", ":")),
        "--max-attempts", str(settings["sglang_job_max_attempts"]),
        "--drain-seconds", _number(settings["sglang_job_drain_seconds"]),
        "--sync-every", str(settings["sglang_job_sync_every"]),
    ]  # fmt: skip
    if settings.get("sglang_job_metrics_port"):
        argv += [
            "--metrics-port", str(settings["sglang_job_metrics_port"]),
            "--metrics-address", str(settings["sglang_job_metrics_address"]),
        ]  # fmt: skip
    for target in chosen["targets"]:
        argv += ["--server", target["url"], "--concurrency", str(target["concurrency"])]
    return {"argv": argv, "exec_start": exec_start(argv)}


def _number(value: Any) -> str:
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


def status_lines(name: str, snapshot: Any, unit: Mapping[str, Any]) -> list[str]:
    """What `status` shows: the runner's own progress line (rows done, failed and left, tok/s,
    ETA, servers in service, errors by class) and the unit's state."""
    lines = []
    if isinstance(snapshot, Mapping) and "rows" in snapshot:
        lines.append(progress_line(dict(snapshot)))
        retries = snapshot.get("retries_by_class") or {}
        if retries:
            lines.append(
                "retries by class: " + ", ".join(f"{k} {v}" for k, v in sorted(retries.items()))
            )
        if snapshot.get("message"):
            lines.append(f"the runner said: {snapshot['message']}")
    else:
        lines.append(f"job {name}: no ledger yet (never started here)")
    state = unit.get("ActiveState") or "unknown"
    sub = unit.get("SubState") or ""
    result = unit.get("Result") or ""
    lines.append(
        f"unit sglang-job@{name}.service: {state}/{sub}, {unit.get('UnitFileState') or 'unknown'}"
        f" at boot, restarted {unit.get('NRestarts') or 0} time(s)"
        + (
            f", last exit status {unit.get('ExecMainStatus')}"
            if state != "active" and unit.get("ExecMainStatus") not in (None, "", "0")
            else ""
        )
        + (f" ({result})" if result not in ("", "success") else "")
    )
    return lines
