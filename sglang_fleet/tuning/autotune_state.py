"""An autotune search's state: a fresh one from its inputs, the digest that tells a rerun of
the same search from a new one, and the state file written atomically and read back whole or
refused.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sglang_fleet import input_files
from sglang_fleet.capacity import calibration_record, calibration_store
from sglang_fleet.capacity.planner_inputs import MIN_FREE_AFTER_GRAPH_GIB
from sglang_fleet.module_utils import bounded_json
from sglang_fleet.module_utils.typed_number import Range, shown
from sglang_fleet.tuning.autotune_candidates import grid
from sglang_fleet.tuning.autotune_inputs import (
    DEFAULT_TOLERANCE,
    AutotuneInputError,
    as_float,
    check_context,
    draft_paths,
    validate_inputs,
)
from sglang_fleet.tuning.candidate_planning import replan

STATE_SCHEMA = "sglang-fleet/autotune/1"
# The inputs that make a search: a rerun with the same ones resumes the state, other ones
# start a new search (spec_digest). The context is the checkpoint (model_config, weight_bytes),
# the GPUs (model, memory, count) and the SGLang version: a GPU swap or an upgrade is a new
# search, never a resumed one whose winner was measured on something else.
SPEC_KEYS = (
    "server",
    "base_flags",
    "space",
    "workload",
    "slo",
    "tolerance",
    "max_trials",
    "margin_gib",
    "context",
)


def spec_digest(state: Mapping[str, Any]) -> str:
    """What makes two searches the same search: server, current flags, typed inputs."""
    spec = {name: state.get(name) for name in SPEC_KEYS}
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def utc_stamp() -> str:
    """Now in UTC as file names and the state carry it: 20250131T235959Z."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")


def new_state(
    *,
    server: str,
    base_flags: Mapping[str, Any],
    space: Mapping[str, Any],
    workload: Mapping[str, Any],
    context: Mapping[str, Any],
    slo: Mapping[str, Any] | None = None,
    kv_cache_dtypes_allowed: Iterable[str] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    max_trials: int | None = None,
    margin_gib: float = MIN_FREE_AFTER_GRAPH_GIB,
) -> dict[str, Any]:
    """A fresh search. context: {model_config, weight_bytes, host {gpu_memory_mib,
    host_ram_gib, gpu_count, gpu_name}, sglang_version, calibration (the host's store), drafts
    (the draft models the space may start, as the canary's read gave them: {path: {config,
    weight_bytes, error}}, autotune_inputs.draft_paths)}."""
    typed = validate_inputs(
        space=space,
        workload=workload,
        slo=slo,
        kv_cache_dtypes_allowed=kv_cache_dtypes_allowed,
        tolerance=tolerance,
        max_trials=max_trials,
    )
    for name in ("model_config", "weight_bytes", "host"):
        if context.get(name) is None:
            raise AutotuneInputError(f"autotune context lacks {name}")
    check_context(context, typed["workload"])
    margin = as_float(margin_gib, Range(0))
    if margin is None:
        raise AutotuneInputError(f"autotune margin_gib: {shown(margin_gib)} is not a number >= 0")
    typed_space = typed["space"]
    store = calibration_store.read_store(context.get("calibration"))
    state: dict[str, Any] = {
        "schema": STATE_SCHEMA,
        "started_at": utc_stamp(),
        "server": server,
        "base_flags": calibration_record.public_flags(base_flags),
        "space": typed_space,
        "workload": typed["workload"],
        "slo": typed["slo"],
        "tolerance": typed["tolerance"],
        "max_trials": typed["max_trials"],
        "margin_gib": margin,
        "context": {
            "model_config": context["model_config"],
            "weight_bytes": int(context["weight_bytes"]),
            "host": dict(context["host"]),
            "sglang_version": context.get("sglang_version"),
            "drafts": _drafts(context.get("drafts"), draft_paths(typed["space"], base_flags)),
        },
        "calibrations": store.records,
        # Entries of the host's store no plan may use: named here, never planned with.
        "calibrations_set_aside": [entry.describe() for entry in store.set_aside],
        "candidates": grid(base_flags, typed_space, typed["workload"]["concurrency"]),
        "trials": [],
        "speed_model": None,
        "in_flight": None,
        "done": False,
        "stop_reason": None,
    }
    state["spec_digest"] = spec_digest(state)
    replan(state)
    return state


def _drafts(read: Any, wanted: list[str]) -> dict[str, Any]:
    """The draft models of the search, each {config (parsed), weight_bytes}; one the canary does
    not have refuses the search before any trial, naming it."""
    read = read if isinstance(read, Mapping) else {}
    drafts = {}
    for path in wanted:
        found = read.get(path) if isinstance(read.get(path), Mapping) else {}
        where = f"autotune_space.speculative: the draft model {path}"
        if found.get("error") or found.get("config") is None:
            why = found.get("error") or "config.json does not exist"
            raise AutotuneInputError(f"{where} cannot be read on the canary: {why}")
        config = found["config"]
        try:
            config = (
                bounded_json.loads(config, "config.json") if isinstance(config, str) else config
            )
        except ValueError as exc:
            raise AutotuneInputError(f"{where}: config.json is not JSON ({exc})") from None
        weights = as_float(found.get("weight_bytes"), Range(1))
        if not isinstance(config, Mapping) or weights is None:
            raise AutotuneInputError(f"{where}: no config.json object or no checkpoint size")
        drafts[path] = {"config": dict(config), "weight_bytes": int(weights)}
    return drafts


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


_STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "server": str,
    "base_flags": dict,
    "space": dict,
    "workload": dict,
    "slo": dict,
    "tolerance": (int, float),
    "margin_gib": (int, float),
    "context": dict,
    "calibrations": (dict, list),
    "candidates": list,
    "trials": list,
    "done": bool,
    "spec_digest": str,
}


_DIGEST_MISMATCH = "its inputs do not match its spec_digest (edited by hand?)"


def _state_problem(state: Any) -> str:
    """Why a parsed state file is not a whole autotune state of this schema ('' when it is)."""
    if not isinstance(state, dict):
        return f"not an autotune state (JSON {type(state).__name__})"
    if state.get("schema") != STATE_SCHEMA:
        return f"schema {state.get('schema')!r}, not {STATE_SCHEMA!r}"
    bad = [k for k, kind in _STATE_TYPES.items() if not isinstance(state.get(k), kind)]
    if not isinstance(state.get("in_flight"), dict | None):
        bad.append("in_flight")
    if not all(
        isinstance(c, dict) and {"id", "tuned", "status"} <= set(c)
        for c in state.get("candidates") or [None]
    ):
        bad.append("candidates[]")
    if not all(
        isinstance(t, dict) and "candidate" in t and "outcome" in t
        for t in state.get("trials") or []
    ):
        bad.append("trials[]")
    if bad:
        return f"missing or bad: {', '.join(sorted(set(bad)))}"
    if state["spec_digest"] != spec_digest(state):
        return _DIGEST_MISMATCH
    return ""


def load_state(path: str | Path, digest_may_differ: bool = False) -> dict[str, Any]:
    """The state file, checked: AutotuneInputError naming the file and the server otherwise.

    digest_may_differ: for init, which never resumes such a state (its stored digest is not
    what its inputs give) but replaces it as a search of other inputs, as it does a state an
    older sglang-fleet wrote with a digest that covered less."""
    try:
        raw = input_files.read_bytes(path, input_files.JSON_LIMIT, "")
        state = bounded_json.loads(raw, "the state file", parse_constant=_no_constant)
    except ValueError as exc:  # not a regular file, too large, not JSON, nested too deep
        state, problem = None, f"not JSON ({str(exc).strip()})"
    else:
        problem = _state_problem(state)
    if problem == _DIGEST_MISMATCH and digest_may_differ:
        return {**state, "spec_digest": None}
    if problem:
        server = state.get("server") if isinstance(state, dict) else None
        raise AutotuneInputError(
            f"autotune state {path} (server {server if isinstance(server, str) else '?'}): "
            f"{problem}; move it away, or run init --force to start a new search"
        )
    return state


def save_state(state: Mapping[str, Any], path: str | Path) -> None:
    """Write atomically: an interrupted run must find a whole state file."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, target)
