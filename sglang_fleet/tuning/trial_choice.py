"""Which autotune trial runs next: the server's current flag set first while no calibration
matched, then the best predicted candidate left; when the search stops (early stop, budget,
nothing left); the best trial measured and the winner.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_fleet.tuning.autotune_candidates import candidate_flags

# The trial of the server's current flag set (the first while no calibration matched).
BASELINE_ID = "base"
# Prune codes a calibration can lift: only then is the baseline trial worth a restart.
_CALIBRATION_REVISES = ("cannot_start", "oom_risk", "cannot_fit")


def _order_key(candidate: Mapping[str, Any]) -> tuple:
    p = candidate["predicted"]
    return (
        not p["calibrated"] and p["oom_warning"],  # uncalibrated risk last
        -p["output_tok_s"],
        -p["concurrency"],  # ties: the steady-state KV-bound model prefers more concurrency
        candidate["changes"],  # then the flag set closest to what serves today
        candidate["id"],
    )


def pending(state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Untried, unpruned candidates, best predicted first."""
    todo = [c for c in state["candidates"] if c["status"] == "pending"]
    return sorted(todo, key=_order_key)


def best_trial(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """The eligible trial (whole job done, SLOs met) with the most output tok/s."""
    ok = [t for t in state["trials"] if t.get("outcome") == "ok"]
    return max(ok, key=lambda t: (t["output_throughput"], -t["n"])) if ok else None


def _stop_reason(state: Mapping[str, Any]) -> str | None:
    todo = pending(state)
    if not todo:
        return "every candidate was tried or pruned"
    limit = state["max_trials"]
    if limit is not None and len(state["trials"]) >= limit:
        return f"the trial budget ({limit}) is spent"
    best = best_trial(state)
    if best is None:
        return None
    if any(c["predicted"].get("speedup_unknown") for c in todo):
        # Speculation's gain is not known until a trial measures its accept length: no
        # prediction can say it is not worth trying.
        return None
    top = todo[0]["predicted"]["output_tok_s"]
    threshold = top * (1 - state["tolerance"])
    if best["output_throughput"] >= threshold:
        return (
            f"early stop: trial {best['n']} measured {best['output_throughput']:.1f} tok/s, at "
            f"least the best remaining prediction {top:.1f} tok/s x (1 - {state['tolerance']:g})"
        )
    return None


def _needs_baseline(state: Mapping[str, Any]) -> bool:
    """No calibration matched yet and the current flag set has not run in this search."""
    if any(t["candidate"] == BASELINE_ID for t in state["trials"]):
        return False
    return not any(c["predicted"] and c["predicted"]["calibrated"] for c in state["candidates"])


def _calibration_may_help(state: Mapping[str, Any]) -> bool:
    """A candidate left, or one pruned for a reason measured memory can lift: otherwise a
    baseline start would restart the server for a search that cannot run any trial."""
    return any(
        c["status"] == "pending" or (c["prune"] or {}).get("code") in _CALIBRATION_REVISES
        for c in state["candidates"]
    )


def next_trial(state: dict[str, Any]) -> dict[str, Any] | None:
    """The next flag set to try ({n, candidate, flags, tuned, predicted}), or None when done.

    Marks it in flight: calling again before record_trial returns the same trial, so an
    interrupted run resumes where it stopped.
    """
    if state["in_flight"] is not None:
        return state["in_flight"]
    if state["done"]:
        return None
    if _needs_baseline(state) and _calibration_may_help(state):
        trial = {
            "n": len(state["trials"]) + 1,
            "candidate": BASELINE_ID,
            "tuned": {},
            "flags": dict(state["base_flags"]),
            "predicted": None,
            "why": "calibrate: the server's current flag set starts first",
        }
        state["in_flight"] = trial
        return trial
    reason = _stop_reason(state)
    if reason is not None:
        state.update(done=True, stop_reason=reason)
        return None
    chosen = pending(state)[0]
    trial = {
        "n": len(state["trials"]) + 1,
        "candidate": chosen["id"],
        "tuned": dict(chosen["tuned"]),
        "flags": candidate_flags(state, chosen),
        "predicted": dict(chosen["predicted"]),
        "why": "best predicted of the candidates left",
    }
    state["in_flight"] = trial
    return trial


def winner(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """The best eligible trial with its whole flag set, or None."""
    best = best_trial(state)
    if best is None:
        return None
    return dict(best) | {"flags": dict(state["base_flags"]) | dict(best["tuned"])}
