"""The fleet summary that closes a rollout (playbooks/deploy.yml): one row per server of each host,
with what the rollout did to it, its figures and its downtime, and the table an operator reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_fleet.module_utils.typed_number import Range, finite_or_none
from sglang_fleet.smoke import downtime as stops
from sglang_fleet.smoke.gate import figure

# "refused (calibrated)": the pre-flight refused the flag set on the host's calibration
# (docs/CALIBRATION.md); the running server was not touched.
REFUSED = "refused (calibrated)"
# "would restart": --check, where nothing restarts (docs/INVENTORY.md).
WOULD_RESTART = "would restart"
OUTCOMES = ("passed", "rolled back", REFUSED, "failed", WOULD_RESTART, "unchanged", "not reached")


def rollout_rows(hosts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per server of each host: what the rollout did to it.

    Each host: {host, servers: [{name, config_hash}] (None when the host never got as far as
    reading them), results: [{server, config_hash, outcome, output_throughput, p99_ttft_ms,
    message}] as the restart recorded them, error: the host's failure message or None,
    refused: {server name: message} of flag sets the pre-flight refused on a calibration,
    would_restart: names a rollout would restart, given under --check where nothing restarts}.
    """
    rows = []
    for entry in hosts:
        done = {r["server"]: r for r in entry.get("results") or []}  # the last one counts
        refused = dict(entry.get("refused") or {})
        would_restart = set(entry.get("would_restart") or ())
        servers = entry.get("servers")
        if servers is None:
            outcome = "failed" if entry.get("error") else "not reached"
            rows.append(_row(entry["host"], "-", None, outcome, message=entry.get("error")))
            continue
        for server in servers:
            name = server["name"]
            if name in done:
                rows.append({"host": entry["host"], **done[name]})
            elif name in refused:
                rows.append(
                    _row(entry["host"], name, server.get("config_hash"), REFUSED, refused[name])
                )
            else:
                outcome = WOULD_RESTART if name in would_restart else "unchanged"
                rows.append(_row(entry["host"], name, server.get("config_hash"), outcome))
        # A failure the restart or a calibrated refusal recorded already has its row; others
        # (a held lock, a failed pre-flight) get one of their own.
        restart_failed = any(r.get("outcome") in ("failed", "rolled back") for r in done.values())
        if entry.get("error") and not restart_failed and not refused:
            rows.append(_row(entry["host"], "-", None, "failed", message=entry["error"]))
    return rows


def rollout_row(
    server: Mapping[str, Any],
    outcome: str,
    *,
    smoke: Mapping[str, Any] | None = None,
    restarted: Mapping[str, Any] | None = None,
    staged: Mapping[str, Any] | None = None,
    message: str | None = None,
) -> dict[str, Any]:
    """One server's result as roll_out_server.yml notes it for the fleet summary (rollout_rows).

    smoke: the smoke gate's result (registered, or the failed task's), whose `measured` gives
    the figures; node 0 of a server across hosts alone is benchmarked, so another node's (an
    earlier server's result) is not read. restarted: the restart action's result, for the
    downtime and a drain that ran out of time (a passed restart). staged: model_stage's results
    by model_path, for the weights' copy time. message: why it failed (else the gate's summary).
    """
    if outcome not in ("passed", "failed"):
        raise ValueError(f"a restart's outcome is passed or failed, not {outcome!r}")
    benchmarked = not server.get("nodes") or not server.get("node_rank")
    measured = (smoke or {}).get("measured") if benchmarked else None
    measured = measured if isinstance(measured, Mapping) else {}
    row = {
        "server": server["name"],
        "config_hash": server["config_hash"],
        "outcome": outcome,
        "output_throughput": measured.get("output_throughput"),
        "p99_ttft_ms": measured.get("p99_ttft_ms"),
        "message": message
        if outcome == "failed"
        else measured.get("summary") or "healthy (no smoke gate)",
    }
    if outcome == "passed":
        down = (restarted or {}).get("downtime")
        copy = ((staged or {}).get(server.get("model_path")) or {}).get("copy_seconds")
        row.update(
            downtime_seconds=stops.downtime_seconds(down),
            copy_seconds=copy,
            drain_note=stops.drain_note((restarted or {}).get("drain"), down),
        )
    return row


def _row(host: str, server: str, config_hash: str | None, outcome: str, message=None) -> dict:
    return {
        "host": host,
        "server": server,
        "config_hash": config_hash,
        "outcome": outcome,
        "output_throughput": None,
        "p99_ttft_ms": None,
        "message": message,
    }


def _seconds_cell(value: Any) -> str:
    number = finite_or_none(value, Range(0))
    return "-" if number is None else f"{number:.1f}"


def format_rollout_table(rows: list[dict[str, Any]]) -> list[str]:
    """The table as lines (a debug task prints a list one line per row). A rollout that
    restarted servers adds DOWN s (stop to healthy) and COPY s (the weights' staging, before the
    stop: docs/STAGING.md); a drain that ran out of time gets a line under the table."""
    timed = any(
        _seconds_cell(r.get(k)) != "-" for r in rows for k in ("downtime_seconds", "copy_seconds")
    )
    header = ("HOST", "SERVER", "CONFIG", "TOK/S", "P99 TTFT ms", "OUTCOME")
    if timed:
        header = (*header[:5], "DOWN s", "COPY s", *header[5:])
    cells = [header] + [
        (
            str(r["host"]),
            str(r["server"]),
            str(r.get("config_hash") or "-"),
            figure(r.get("output_throughput"), 1).replace("n/a", "-"),
            figure(r.get("p99_ttft_ms"), 1).replace("n/a", "-"),
        )
        + (
            (_seconds_cell(r.get("downtime_seconds")), _seconds_cell(r.get("copy_seconds")))
            if timed
            else ()
        )
        + (str(r["outcome"]),)
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    counts = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}
    lines.append(", ".join(f"{n} {o}" for o, n in counts.items() if n))
    lines += [f"{r['host']} {r['server']}: {r['drain_note']}" for r in rows if r.get("drain_note")]
    return lines
