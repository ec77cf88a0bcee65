"""The smoke gate's verdict: does one benchmark result meet the inventory's thresholds?

    evaluate(result, thresholds, baseline) -> {passed, failures, summary}

Pure: `result` is the JSON of ``sglang_fleet.smoke --json`` (docs/CONTRACTS.md), `thresholds`
the inventory's limits (a missing or null limit is not checked), and `baseline` the compact
result the last-known-good configuration passed with (see `compact`), or None. Each failure
says which limit failed and by how much, with the measured figure, because that message is
what an operator reads when the rollout rolls a host back.

Thresholds: min_output_tok_s, max_p99_ttft_ms, max_p99_tpot_ms, max_failure_rate (0..1),
min_goodput (0..1), max_regression_pct (output throughput at most this many percent below the
baseline's, compared only when both ran the same workload).

Whatever the thresholds, a run fails when it sent nothing (`no_requests`) or when its output
throughput is 0 or missing (`no_output`): the smoke client counts only right answers (exactly
the tokens asked for), so a server whose streams end early or empty produces none, however
clean its streams look. Failed requests count with their reasons (`failure_reasons`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sglang_fleet import downtime as stops

# The workload keys two results must share for their throughput to be comparable.
WORKLOAD_KEYS = (
    "backend",
    "num_prompts",
    "max_concurrency",
    "request_rate",
    "random_input_len",
    "random_output_len",
    "seed",
)
# Metrics kept in the compact result (what last-known-good stores and the summary prints).
COMPACT_METRICS = (
    "completed",
    "failed",
    "duration",
    "output_throughput",
    "request_throughput",
    "p99_ttft_ms",
    "median_ttft_ms",
    "p99_tpot_ms",
    "median_tpot_ms",
    "p99_itl_ms",
    "concurrency",
    "goodput",
)


@dataclass(frozen=True)
class Limit:
    """One absolute threshold: which metric, which direction, how it reads."""

    metric: str
    kind: str  # "min" or "max"
    unit: str
    digits: int


LIMITS: dict[str, Limit] = {
    "min_output_tok_s": Limit("output_throughput", "min", "tok/s", 1),
    "max_p99_ttft_ms": Limit("p99_ttft_ms", "max", "ms", 1),
    "max_p99_tpot_ms": Limit("p99_tpot_ms", "max", "ms", 2),
    "max_failure_rate": Limit("failure_rate", "max", "", 3),
    "min_goodput": Limit("goodput", "min", "", 3),
}
REGRESSION = "max_regression_pct"
KNOWN_THRESHOLDS = frozenset((*LIMITS, REGRESSION))


class GateInputError(ValueError):
    """Thresholds that cannot be evaluated (unknown name, not a number)."""


def failure_rate(result: dict[str, Any]) -> float | None:
    """Failed share of the requests sent (warm-up excluded); None when none was sent."""
    completed, failed = int(result.get("completed") or 0), int(result.get("failed") or 0)
    sent = completed + failed
    return failed / sent if sent else None


def _metric(result: dict[str, Any], name: str) -> float | None:
    value = failure_rate(result) if name == "failure_rate" else result.get(name)
    if value is None:
        return None
    value = float(value)
    # NaN and infinity are not measurements (a result file can carry either: JSON reads them):
    # they count as not measured, which fails the gate, never as a figure that passes it.
    return value if math.isfinite(value) else None


def _unmeasured(result: dict[str, Any], name: str) -> str:
    """Why a metric has no value: "was not measured", or "is not a finite number (inf)"."""
    raw = None if name == "failure_rate" else result.get(name)
    if isinstance(raw, (int, float)) and not math.isfinite(raw):
        return f"is not a finite number ({raw})"
    return "was not measured"


def _figure(value: float, limit: Limit) -> str:
    text = f"{value:.{limit.digits}f}"
    return f"{text} {limit.unit}" if limit.unit else text


def _limit_text(value: float) -> str:
    """A limit as the operator wrote it: 800, not 800.0."""
    return f"{value:g}"


def _off_by(value: float, limit: float) -> str:
    if limit == 0:
        return ""
    return f" ({(value - limit) / limit * 100:+.1f} %)"


def _failure(code: str, metric: str, value: float | None, limit: float, message: str) -> dict:
    return {"code": code, "metric": metric, "value": value, "limit": limit, "message": message}


def reasons_text(result: dict[str, Any]) -> str:
    """The failure reasons of a result, most frequent first: "short_output 16, timeout 2"."""
    reasons = result.get("failure_reasons")
    if not isinstance(reasons, dict) or not reasons:
        return ""
    ordered = sorted(reasons.items(), key=lambda item: (-int(item[1]), str(item[0])))
    return ", ".join(f"{reason} {count}" for reason, count in ordered)


def _failed_text(result: dict[str, Any]) -> str:
    """ "16 of 16 requests failed: short_output 16", or "" when none failed."""
    failed = int(result.get("failed") or 0)
    if not failed:
        return ""
    sent = failed + int(result.get("completed") or 0)
    reasons = reasons_text(result)
    return f"{failed} of {sent} requests failed" + (f": {reasons}" if reasons else "")


def _check_output(result: dict[str, Any]) -> dict | None:
    """No output at all fails every gate: the thresholds judge how good, not whether."""
    value = _metric(result, "output_throughput")
    if value is not None and value > 0:
        return None
    failed = _failed_text(result)
    detail = f" ({failed})" if failed else ""
    if value is None:
        message = (
            f"output_throughput {_unmeasured(result, 'output_throughput')}, so the server's "
            f"output cannot be judged{detail}"
        )
    else:
        message = (
            f"output_throughput is {value:.1f} tok/s: no request got the completion tokens it "
            f"asked for{detail}"
        )
    return _failure("no_output", "output_throughput", value, 0, message)


def _check_limit(name: str, limit_value: float, result: dict[str, Any]) -> dict | None:
    limit = LIMITS[name]
    value = _metric(result, limit.metric)
    if value is None:
        hint = " (set slo_ttft_ms/slo_tpot_ms in the workload)" if limit.metric == "goodput" else ""
        return _failure(
            "metric_missing",
            limit.metric,
            None,
            limit_value,
            f"{limit.metric} {_unmeasured(result, limit.metric)}{hint}, so {name} "
            f"{_limit_text(limit_value)} "
            "cannot be met",
        )
    below = limit.kind == "min" and value < limit_value
    above = limit.kind == "max" and value > limit_value
    if not (below or above):
        return None
    side = "below the minimum" if below else "above the maximum"
    failed = _failed_text(result) if limit.metric == "failure_rate" else ""
    return _failure(
        name,
        limit.metric,
        value,
        limit_value,
        f"{limit.metric} {_figure(value, limit)} is {side} {_limit_text(limit_value)}"
        f"{_off_by(value, limit_value)}" + (f" ({failed})" if failed else ""),
    )


def same_workload(result: dict[str, Any], baseline: dict[str, Any]) -> bool:
    """Both runs sent the same requests (a compact baseline keeps them under `workload`)."""
    base = baseline.get("workload") or baseline
    return all(result.get(key) == base.get(key) for key in WORKLOAD_KEYS)


def _check_regression(
    max_pct: float, result: dict, baseline: dict | None
) -> tuple[dict | None, str]:
    """(failure or None, a note for the summary)."""
    if not baseline:
        return None, "no last-known-good result to compare with"
    if not same_workload(result, baseline):
        return None, "last-known-good result ran another workload: not compared"
    base = _metric(baseline.get("metrics") or baseline, "output_throughput")
    value = _metric(result, "output_throughput")
    if not base or value is None:
        return None, "last-known-good result has no output throughput: not compared"
    drop = (base - value) / base * 100
    note = f"{-drop:+.1f} % vs last-known-good {base:.1f} tok/s"
    if drop <= max_pct:
        return None, note
    message = (
        f"output_throughput {value:.1f} tok/s is {drop:.1f} % below the last-known-good "
        f"{base:.1f} tok/s of the same workload (allowed: {_limit_text(max_pct)} %)"
    )
    return _failure("regression", "output_throughput", value, max_pct, message), note


def _numbers(thresholds: dict[str, Any]) -> dict[str, float]:
    unknown = set(thresholds) - KNOWN_THRESHOLDS
    if unknown:
        raise GateInputError(
            f"unknown threshold(s) {sorted(unknown)}; known: {sorted(KNOWN_THRESHOLDS)}"
        )
    out = {}
    for name, value in thresholds.items():
        if value is None or value == "":
            continue
        try:
            out[name] = float(value)
        except (TypeError, ValueError) as exc:
            raise GateInputError(f"threshold {name} must be a number, got {value!r}") from exc
    return out


def measured_line(result: dict[str, Any]) -> str:
    """The figures an operator wants beside any verdict."""
    failed = int(result.get("failed") or 0)
    sent = int(result.get("completed") or 0) + failed
    rate = failure_rate(result)
    reasons = reasons_text(result)
    parts = [
        f"output {float(result.get('output_throughput') or 0):.1f} tok/s",
        f"p99 TTFT {_opt(result.get('p99_ttft_ms'), 1)} ms",
        f"p99 TPOT {_opt(result.get('p99_tpot_ms'), 2)} ms",
        f"failed {failed}/{sent}"
        + (f" ({rate * 100:.1f} %)" if rate is not None else "")
        + (f" [{reasons}]" if reasons else ""),
    ]
    if result.get("goodput") is not None:
        parts.append(f"goodput {float(result['goodput']):.3f}")
    return ", ".join(parts)


def _opt(value: Any, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{float(value):.{digits}f}"


def evaluate(
    result: dict[str, Any], thresholds: dict[str, Any], baseline: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Judge one smoke result; see the module docstring."""
    limits = _numbers(thresholds or {})
    failures: list[dict] = []
    if _metric(result, "failure_rate") is None:
        failures.append(
            _failure("no_requests", "completed", 0, 0, "the benchmark sent no request at all")
        )
    else:
        no_output = _check_output(result)
        if no_output:
            failures.append(no_output)
    for name, value in limits.items():
        if name in LIMITS:
            failure = _check_limit(name, value, result)
            if failure:
                failures.append(failure)
    note = ""
    if REGRESSION in limits:
        failure, note = _check_regression(limits[REGRESSION], result, baseline)
        if failure:
            failures.append(failure)
    verdict = "FAIL: " + "; ".join(f["message"] for f in failures) if failures else "PASS"
    summary = f"{verdict} (measured: {measured_line(result)}{'; ' + note if note else ''})"
    return {"passed": not failures, "failures": failures, "summary": summary}


def compact(
    result: dict[str, Any],
    diagnosis: dict[str, Any] | None = None,
    report: str | None = None,
) -> dict[str, Any]:
    """What last-known-good keeps of a passing run: metrics, workload, verdict, report path."""
    return {
        "metrics": {key: result.get(key) for key in COMPACT_METRICS},
        "workload": {key: result.get(key) for key in WORKLOAD_KEYS},
        "verdict": (diagnosis or {}).get("verdict"),
        "report": report,
    }


# --- fleet summary (playbooks/deploy.yml) ----------------------------------------------------
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
    """One server's result as restart.yml notes it for the fleet summary (rollout_rows).

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
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "-"
    return f"{number:.1f}" if math.isfinite(number) and number >= 0 else "-"


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
            _opt(r.get("output_throughput"), 1).replace("n/a", "-"),
            _opt(r.get("p99_ttft_ms"), 1).replace("n/a", "-"),
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


# The client reads the API key from stdin into its environment: never on its command line,
# where every user of the host sees it (ps). exec keeps timeout's exit status (124/137).
_KEY_FROM_STDIN = (
    'IFS= read -r SGLANG_API_KEY; [ -n "$SGLANG_API_KEY" ] && export SGLANG_API_KEY; exec "$0" "$@"'
)
# The client's flags the role sets itself, never from the workload.
_SET_BY_THE_ROLE = {"--url", "--json", "--timeout", "--api-key", "--help"}


def smoke_argv(
    workload: dict[str, Any],
    *,
    python: str,
    client: str,
    port: int,
    json_path: str,
    timeout: int,
) -> list[str]:
    """The smoke client's whole command on the host (roles/smoke_gate/tasks/run.yml): bounded by
    coreutils' timeout, the key read from stdin, the workload as the client's flags (a key with
    a null value is left out). A key the client does not take is refused, naming it."""
    from sglang_fleet.smoke import build_parser  # noqa: PLC0415 (the client is only read here)

    flags = {
        option
        for action in build_parser()._actions
        for option in action.option_strings
        if option.startswith("--") and option not in _SET_BY_THE_ROLE
    }
    argv = [client, "--url", f"http://127.0.0.1:{port}", "--json", json_path,
            "--timeout", str(timeout)]  # fmt: skip
    for key, value in workload.items():
        if value is None:
            continue
        flag = "--" + str(key).replace("_", "-")
        if flag not in flags:
            allowed = ", ".join(sorted(f[2:].replace("-", "_") for f in flags))
            raise GateInputError(
                f"smoke_gate_workload.{key}: not a workload setting of the smoke client ({allowed})"
            )
        argv += [flag, str(value)]
    timeout_argv = ["timeout", "--kill-after=10", str(timeout)]
    return [*timeout_argv, "/bin/sh", "-c", _KEY_FROM_STDIN, python, *argv]
