"""Each server's in-flight requests for a job's lengths, planned on its own host's read
(playbooks/job.yml, the sglang_job role's `plan` step; docs/JOB.md).

The same plan the rollout's pre-flight makes (preflight_inputs.server_plan: the model's
description, the server's GPUs and the host's RAM, with the host's calibration records), with
the job's lengths as the workload: its max_concurrent_requests is how many of the job's
requests the server holds at once. No flag check and no lock: the servers run, and nothing on
the host changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_fleet.ansible_values import plain, plain_mapping
from sglang_fleet.job.play_targets import served_model, serves_here
from sglang_fleet.rollout.preflight_inputs import server_plan

CALIBRATION_MODES = ("enforce", "warn", "ignore")


def read_request(servers: Any, host: str, nvidia_smi: str, calibration_mode: str) -> dict[str, Any]:
    """What sglang_host_state's `read` must read for these servers: GPUs (unless every one runs
    on the CPU engine), model descriptions and calibration stores."""
    mine = [s for s in plain(servers) or [] if serves_here(s, host)]
    gpu = any(s.get("device") != "cpu" for s in mine)
    return {
        "nvidia_smi": nvidia_smi if gpu and mine else "",
        "models": sorted({s["model_path"] for s in mine}),
        "files": (
            sorted({s["paths"]["calibration_file"] for s in mine})
            if calibration_mode != "ignore"
            else []
        ),
    }


def _calibration(found: Mapping[str, Any], server: Mapping[str, Any], mode: str) -> Any:
    if mode == "ignore":
        return None
    store = (found.get("files") or {}).get(server["paths"]["calibration_file"])
    if not isinstance(store, str):
        store = None  # missing or unreadable: planned as uncalibrated
    return {"store": store or "", "mode": mode, "sglang_version": None}


def _plan(
    server: Mapping[str, Any],
    found: Mapping[str, Any],
    workload: Mapping[str, Any],
    host_ram_mib: Any,
    mode: str,
) -> tuple[int | None, str | None]:
    """(max_concurrent_requests, None) or (None, why it could not be planned)."""
    read = (found.get("models") or {}).get(server["model_path"]) or {}
    if read.get("error") or read.get("config") is None or read.get("weight_bytes") is None:
        why = read.get("error") or "no config.json with weights beside it"
        return None, f"{server['model_path']}: {why}"
    gpus = found.get("gpus") or []
    if isinstance(gpus, Mapping):  # nvidia-smi's list, or why it could not be read
        if gpus.get("error"):
            return None, f"the host's GPUs could not be read: {gpus['error']}"
        gpus = gpus.get("gpus") or []
    ram = host_ram_mib if host_ram_mib not in (None, "") else found.get("mem_total_mib")
    try:
        planned = server_plan(
            server, read["config"], read["weight_bytes"], gpus, ram, workload,
            _calibration(found, server, mode),
        )  # fmt: skip
    except ValueError as exc:
        return None, f"cannot plan: {exc}"
    concurrent = planned.get("max_concurrent_requests")
    if not isinstance(concurrent, int) or concurrent < 1:
        return None, f"the planner fits no request of {_lengths(workload)} tokens"
    return concurrent, None


def _lengths(workload: Mapping[str, Any]) -> str:
    return f"{workload.get('avg_input_len')}+{workload.get('avg_output_len')}"


def entries(
    servers: Any,
    host: str,
    found: Any,
    workload: Any,
    *,
    host_ram_mib: Any = None,
    calibration_mode: str = "enforce",
) -> list[dict[str, Any]]:
    """One entry per server that answers HTTP on this host: {host, name, port, listen,
    router_url, model, planned, problem} (what play_targets.targets takes)."""
    if calibration_mode not in CALIBRATION_MODES:
        raise ValueError(
            f"sglang_server_calibration_mode must be one of {', '.join(CALIBRATION_MODES)}, "
            f"got {calibration_mode!r}"
        )
    work = plain_mapping(workload or {}, "the job's lengths")
    work = {k: work[k] for k in ("avg_input_len", "avg_output_len") if k in work}
    read = plain_mapping(found or {}, "the host's read")
    out = []
    for server in plain(servers) or []:
        if not serves_here(server, host):
            continue
        planned, problem = _plan(server, read, work, host_ram_mib, calibration_mode)
        router = server.get("router") or {}
        out.append(
            {
                "host": host,
                "name": server["name"],
                "port": server["port"],
                "listen": server.get("host"),
                "router_url": router.get("url"),
                "model": served_model(server),
                "planned": planned,
                "problem": problem,
            }
        )
    return out
