"""The tuning loop's brain: candidates, pruning, order, early stop (docs/AUTOTUNE.md).

A run is a JSON *state* that the playbook drives one trial at a time:

    python3 -m sglang_fleet.tuning.autotune init   --spec SPEC.json --context CTX.json --state
    S.json
    python3 -m sglang_fleet.tuning.autotune next   --state S.json          # prints a trial or null
    python3 -m sglang_fleet.tuning.autotune record --state S.json --result RESULT.json
    python3 -m sglang_fleet.tuning.autotune report --state S.json --out-dir reports/HOST/SERVER

or, from Python, `autotune_state.new_state`, `trial_choice.next_trial`,
`trial_outcome.record_trial`, `autotune_report.write_report`. This module is the command line;
each step lives in its own module of sglang_fleet.tuning, named below.

- Candidates are the grid of the operator's lists (SPACE_FLAGS, typed in autotune_inputs.py) over
  the server's flags (autotune_candidates.py).
- The calibrated planner (sglang_fleet.capacity.planner with the host's calibration records,
  candidate_planning.py) prunes those that cannot start (no KV memory, too few GPUs, HiCache
  over RAM), that risk running out of memory (free after CUDA graph capture below the margin),
  and those whose KV pool cannot hold one request of the workload.
- The rest are ordered by predicted output tok/s (speed_model.py). The prediction is the planner's
  KV-bound concurrency B = min(KV pool / (input + output), max_running_requests, client
  concurrency) times per-request decode speed 1 / t(B), with t(B) = a + b * B (a step of a
  larger batch takes longer). With fixed request lengths the N requests of the job run in
  ceil(N / B) waves, so the job takes  out * (a * waves + b * N) + prefill  seconds:
  duration = A * waves + K, and A, K are fitted to the trials measured so far.
- Early stop: once the best measured trial that passed the SLOs reaches the best remaining
  prediction x (1 - tolerance), no untried candidate is expected to beat it by more than the
  tolerance, and the search ends (trial_choice.py).
- Before any calibration exists, the first trial is the server's current flag set (it
  serves today): its start calibrates the host, and every later candidate is planned with
  measured memory (trial_outcome.py records a trial and plans the candidates again).
- The state file is autotune_state.py's; the report, picture and winner profile are
  autotune_report.py's (and autotune_picture.py's).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sglang_fleet import input_files
from sglang_fleet.capacity.planner_inputs import MIN_FREE_AFTER_GRAPH_GIB
from sglang_fleet.module_utils import bounded_json
from sglang_fleet.tuning.autotune_inputs import DEFAULT_TOLERANCE, AutotuneInputError
from sglang_fleet.tuning.autotune_report import write_report
from sglang_fleet.tuning.autotune_state import load_state, new_state, save_state, utc_stamp
from sglang_fleet.tuning.trial_choice import next_trial, winner
from sglang_fleet.tuning.trial_outcome import record_trial


def _read_json(path: str) -> Any:
    """A JSON file the role wrote: a regular file, bounded in size and nesting."""
    try:
        raw = input_files.read_bytes(path, input_files.JSON_LIMIT, "")
        return bounded_json.loads(raw, str(path))
    except ValueError as exc:
        raise AutotuneInputError(str(exc).strip()) from None


def _old_state(path: str, force: bool) -> dict[str, Any] | None:
    """The state a rerun finds: checked, unless --force replaces it whatever it holds."""
    if not Path(path).exists():
        return None
    try:
        return load_state(path, digest_may_differ=True)
    except AutotuneInputError:
        if not force:
            raise
        return {"started_at": None, "done": None, "stop_reason": "unreadable", "trials": []}


def _cmd_init(ns: argparse.Namespace) -> Any:
    spec, ctx = _read_json(ns.spec), _read_json(ns.context)
    state = new_state(
        server=spec["server"],
        base_flags=spec["base_flags"],
        space=spec.get("space"),
        workload=spec.get("workload"),
        context=ctx,
        slo=spec.get("slo"),
        kv_cache_dtypes_allowed=spec.get("kv_cache_dtypes_allowed"),
        tolerance=spec.get("tolerance", DEFAULT_TOLERANCE),
        max_trials=spec.get("max_trials"),
        margin_gib=spec.get("margin_gib", MIN_FREE_AFTER_GRAPH_GIB),
    )
    old = _old_state(ns.state, ns.force)
    if old is not None and not ns.force and old.get("spec_digest") == state["spec_digest"]:
        return load_summary(old) | {"resumed": True, "replaced": None}  # a rerun goes on
    save_state(state, ns.state)
    replaced = None
    if old is not None:
        replaced = {k: old.get(k) for k in ("started_at", "done", "stop_reason")}
        replaced["trials"] = len(old.get("trials") or [])
    return load_summary(state) | {"resumed": False, "replaced": replaced}


def trials_at_most(state: Mapping[str, Any]) -> int:
    """How many trials this search may still run, at most: the length of the tuning loop
    (roles/autotune/tasks/main.yml), which ends earlier when next_trial() says done. The trial in
    flight, a baseline start, and every candidate not tried yet (a pruned one may come back
    after a calibration), within what is left of the trial budget."""
    in_flight = 1 if state["in_flight"] is not None else 0
    if state["done"]:
        return in_flight
    bound = in_flight + 1 + sum(1 for c in state["candidates"] if c["status"] != "tried")
    if state["max_trials"] is not None:
        left = max(0, state["max_trials"] - len(state["trials"]))
        bound = min(bound, in_flight + 1 + left)
    return bound


def load_summary(state: Mapping[str, Any]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for c in state["candidates"]:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    return {
        "trials_at_most": trials_at_most(state),
        "server": state["server"],
        "started_at": state.get("started_at"),
        "candidates": len(state["candidates"]),
        "by_status": counts,
        "trials": len(state["trials"]),
        "done": state["done"],
        "stop_reason": state["stop_reason"],
        "winner": winner(state),
    }


def _cmd_next(ns: argparse.Namespace) -> Any:
    state = load_state(ns.state)
    trial = next_trial(state)
    save_state(state, ns.state)
    return trial


def _cmd_record(ns: argparse.Namespace) -> Any:
    state = load_state(ns.state)
    if state["in_flight"] is None:
        raise AutotuneInputError("no trial is in flight: call next first")
    row = record_trial(state, state["in_flight"], _read_json(ns.result))
    save_state(state, ns.state)
    return row


def _cmd_report(ns: argparse.Namespace) -> Any:
    state = load_state(ns.state)
    return write_report(state, ns.out_dir, ns.stamp or state.get("started_at") or utc_stamp())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m sglang_fleet.tuning.autotune", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="plan the candidates (a rerun keeps an existing state)")
    init.add_argument("--spec", required=True, help="JSON: server, base_flags, space, ...")
    init.add_argument("--context", required=True, help="JSON: model_config, weight_bytes, ...")
    init.add_argument(
        "--force",
        action="store_true",
        help="start over (by default a state of the same inputs is resumed, one of other "
        "inputs is replaced)",
    )
    sub.add_parser("next", help="print the next trial as JSON, or null when done")
    record = sub.add_parser("record", help="record the trial in flight")
    record.add_argument("--result", required=True, help="JSON: smoke, calibration, error, phase")
    report = sub.add_parser("report", help="write the table, picture and winner profile")
    report.add_argument("--out-dir", required=True)
    report.add_argument(
        "--stamp", default=None, help="file name stamp (default: when the search started)"
    )
    for command in sub.choices.values():
        command.add_argument("--state", required=True, help="the search's JSON state file")
    ns = parser.parse_args(argv)
    handlers = {"init": _cmd_init, "next": _cmd_next, "record": _cmd_record, "report": _cmd_report}
    try:
        output = handlers[ns.command](ns)
    except (AutotuneInputError, OSError, json.JSONDecodeError, KeyError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(output, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
