"""The smoke gate's verdict: does one benchmark result meet the inventory's thresholds?
The fleet summary's rows are sglang_fleet/rollout/fleet_summary.py; the client's command line
is sglang_fleet/smoke/smoke_argv.py.

    evaluate(result, thresholds, baseline) -> {passed, failures, summary}

Pure: `result` is the JSON of ``sglang_fleet.smoke.smoke_client --json``
(docs/CONTRACTS.md), `thresholds` the inventory's limits (a missing or null limit is not
checked), and `baseline` the compact result the last-known-good configuration passed with (see
`compact`), or None. Each failure
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

from dataclasses import dataclass
from typing import Any

from sglang_fleet.module_utils import typed_number
from sglang_fleet.module_utils.typed_number import Range, finite_or_none, shown

COUNT = Range(0, integer=True)

# The workload keys two results must share for their throughput to be comparable.
WORKLOAD_KEYS = (
    "backend",
    "num_prompts",
    "max_concurrency",
    "request_rate",
    "random_input_len",
    "random_output_len",
    "lengths",  # a job's shape (its digest): runs of another shape are another workload
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


def count(result: dict[str, Any], name: str) -> int | None:
    """A request count of the result (0 when absent); None when it is no count at all, which
    fails the gate as "sent nothing" does: a count the gate cannot read proves nothing."""
    found = finite_or_none(result.get(name) or 0, COUNT)
    return None if found is None else int(found)


def failure_rate(result: dict[str, Any]) -> float | None:
    """Failed share of the requests sent (warm-up excluded); None when none was sent, or when
    either count cannot be read."""
    completed, failed = count(result, "completed"), count(result, "failed")
    if completed is None or failed is None:
        return None
    sent = completed + failed
    return failed / sent if sent else None


def _metric(result: dict[str, Any], name: str) -> float | None:
    value = failure_rate(result) if name == "failure_rate" else result.get(name)
    # NaN, infinity and integers past any figure are not measurements (a result file can carry
    # them: JSON reads them): they count as not measured, which fails the gate, never as a
    # figure that passes it.
    return finite_or_none(value)


def _unmeasured(result: dict[str, Any], name: str) -> str:
    """Why a metric has no value: "was not measured", or "is not a finite number (inf)"."""
    raw = None if name == "failure_rate" else result.get(name)
    if raw is not None and finite_or_none(raw) is None:
        return f"is not a finite number ({shown(raw)})"
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
    ordered = sorted(
        reasons.items(), key=lambda item: (-(finite_or_none(item[1]) or 0), str(item[0]))
    )
    return ", ".join(f"{reason} {count}" for reason, count in ordered)


def _failed_text(result: dict[str, Any]) -> str:
    """ "16 of 16 requests failed: short_output 16", or "" when none failed."""
    failed = count(result, "failed")
    if not failed:
        return ""
    sent = failed + (count(result, "completed") or 0)
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
        # A NaN limit would pass every result it is compared with: refused like any non-number.
        try:
            out[name] = float(typed_number.read(value, f"threshold {name}"))
        except typed_number.NumberError as exc:
            raise GateInputError(str(exc)) from None
    return out


def measured_line(result: dict[str, Any]) -> str:
    """The figures an operator wants beside any verdict."""
    failed = count(result, "failed")
    completed = count(result, "completed")
    sent = "?" if failed is None or completed is None else completed + failed
    rate = failure_rate(result)
    reasons = reasons_text(result)
    parts = [
        f"output {figure(result.get('output_throughput') or 0, 1)} tok/s",
        f"p99 TTFT {figure(result.get('p99_ttft_ms'), 1)} ms",
        f"p99 TPOT {figure(result.get('p99_tpot_ms'), 2)} ms",
        f"failed {'?' if failed is None else failed}/{sent}"
        + (f" ({rate * 100:.1f} %)" if rate is not None else "")
        + (f" [{reasons}]" if reasons else ""),
    ]
    if result.get("goodput") is not None:
        parts.append(f"goodput {figure(result['goodput'], 3)}")
    return ", ".join(parts)


def figure(value: Any, digits: int) -> str:
    """A measured figure with `digits` decimals, "n/a" when it was not measured."""
    number = finite_or_none(value)
    return "n/a" if number is None else f"{number:.{digits}f}"


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
