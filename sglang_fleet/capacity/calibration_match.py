"""Which stored calibration record a flag set may be planned from: the same model, GPU, SGLang
and topology, and flag changes the prediction knows how to carry (docs/CALIBRATION.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sglang_fleet.capacity import speculative
from sglang_fleet.capacity.calibration import (
    NO_MEMORY_EFFECT_FLAGS,
    PREDICTED_FLAGS,
    TOPOLOGY_FLAGS,
    as_dict,
    first_given,
    is_secret,
    norm,
)
from sglang_fleet.capacity.calibration_rule import dtype_known, record_problem
from sglang_fleet.module_utils.typed_number import finite_or_none, shown


def _say(value: Any) -> str:
    """A value in a reason: as str() writes it when that is short and safe, else shown()."""
    if isinstance(value, str) and len(value) <= 40:
        return value
    if finite_or_none(value) is not None or value is None or isinstance(value, bool):
        return str(value)
    return shown(value)


def _identity_problems(key: Mapping[str, Any], host: Mapping[str, Any], notes: list[str]) -> list:
    problems = []
    for name, what in (
        ("model_fingerprint", "model (config.json + weights)"),
        ("architecture", "model architecture"),
        ("gpu_name", "GPU model"),
        ("gpu_memory_mib", "GPU memory"),
        ("sglang_version", "SGLang version"),
    ):
        mine, theirs = key.get(name), host.get(name)
        if mine is None or theirs is None:
            if name in ("model_fingerprint", "gpu_name", "sglang_version"):
                notes.append(f"{what} not verified")
            continue
        if norm(mine) != norm(theirs):
            problems.append(f"{what} differs ({_say(mine)} vs {_say(theirs)})")
    sizes = {finite_or_none(side.get("gpu_memory_mib")) for side in (key, host)}
    if sizes == {None}:  # predict() needs one of them
        problems.append("GPU memory known on neither side")
    return problems


def _flag_problems(
    key: Mapping[str, Any], flags: Mapping[str, Any], notes: list[str], complete: bool
) -> list[str]:
    problems = []
    for name in TOPOLOGY_FLAGS:
        mine, theirs = key.get(name) or 1, flags.get(name) or 1
        if norm(mine) != norm(theirs):
            problems.append(f"{name} differs ({_say(mine)} vs {_say(theirs)})")
    for dtype in (key.get("kv_cache_dtype") or "auto", flags.get("kv_cache_dtype") or "auto"):
        if not dtype_known(dtype):
            problems.append(f"kv_cache_dtype {_say(dtype)} has no known cell size")
    recorded = key.get("flags")
    if recorded is None or not complete:
        notes.append("other flags not " + ("recorded" if recorded is None else "given"))
        problems += _speculation_problems(recorded, flags)
        return problems
    skip = PREDICTED_FLAGS | NO_MEMORY_EFFECT_FLAGS | set(TOPOLOGY_FLAGS) | {"enable_dp_attention"}
    for name in sorted(set(recorded) | set(flags), key=str):
        if name in skip or is_secret(name):
            continue
        if norm(recorded.get(name)) != norm(flags.get(name)):
            problems.append(
                f"{name} differs ({shown(recorded.get(name))} vs {shown(flags.get(name))})"
            )
    return problems


_FLAG_DEFAULTS: dict[str, Any] = {"kv_cache_dtype": "auto", "page_size": 1, "attn_dp_size": 1}


def _changes(key: Mapping[str, Any], flags: Mapping[str, Any]) -> list[str]:
    """The predicted-across differences, for the reason text."""
    changes = []
    for name in sorted(PREDICTED_FLAGS):
        default = _FLAG_DEFAULTS.get(name)
        mine = first_given(key.get(name), default)
        theirs = first_given(flags.get(name), default)
        if theirs is None and name in ("mem_fraction_static", "chunked_prefill_size"):
            continue  # SGLang resolves it; compared after resolution by predict()
        if norm(mine) != norm(theirs):
            changes.append(f"{name} {_say(mine)} -> {_say(theirs)}")
    return changes


def _speculation_problems(recorded: Any, flags: Mapping[str, Any]) -> list[str]:
    """A record is not predicted across a change of speculative decoding: the draft's weights
    and KV change what the static pool holds (sglang_fleet.capacity.speculative). A record
    that does not say its flags matches only a flag set without speculation."""
    wanted = {name: flags.get(name) for name in speculative.FLAGS}
    if isinstance(recorded, Mapping):
        had = {name: recorded.get(name) for name in speculative.FLAGS}
        if speculative.algorithm_of(had) is None and speculative.algorithm_of(wanted) is None:
            return []
        if {k: norm(v) for k, v in had.items()} != {k: norm(v) for k, v in wanted.items()}:
            return ["speculative decoding differs: a calibration is not predicted across a "
                    "draft model's memory"]  # fmt: skip
        return []
    if speculative.algorithm_of(wanted) is not None:
        return ["the calibration does not record whether it ran speculative decoding: not "
                "used to plan a flag set with a draft model"]  # fmt: skip
    return []


def check_record(
    record: Mapping[str, Any],
    flags: Mapping[str, Any],
    host: Mapping[str, Any],
    flags_complete: bool = True,
) -> tuple[list[str], list[str]]:
    """(problems that make the record unusable, notes) for one record and flag set. A record
    the store's rule refuses (record_problem) is unusable whoever hands it over."""
    notes: list[str] = []
    problem = record_problem(record)
    if problem:
        return [problem], notes
    key, measured = record["key"], record["measured"]
    if measured.get("post_capture_kv_sizing"):
        return ["KV pool sized after CUDA graph capture: another memory model"], notes
    problems = _identity_problems(key, host, notes)
    problems += _flag_problems(key, flags, notes, flags_complete)
    return problems, notes


def _describe(record: Any) -> str:
    if not isinstance(record, Mapping):
        return f"an entry that is no record (JSON {type(record).__name__})"
    key = record.get("key") if isinstance(record.get("key"), Mapping) else {}
    made = _say(record.get("recorded_at"))
    fraction = finite_or_none(key.get("mem_fraction_static"))
    if fraction is None:
        return f"calibration of {made}"
    return (
        f"calibration of {made} (tp {_say(key.get('tp_size'))}, "
        f"{_say(key.get('kv_cache_dtype'))} at {fraction:.3f})"
    )


def match(
    records: Mapping[str, Any] | Iterable[Mapping[str, Any]] | None,
    flags: Mapping[str, Any],
    host: Mapping[str, Any] | None = None,
    *,
    flags_complete: bool = True,
) -> tuple[dict[str, Any] | None, str]:
    """The usable record closest to this flag set (fewest predicted changes, then newest).

    flags_complete: `flags` is the server's whole flag set, so every flag outside the
    predicted and memory-neutral lists must equal the record's; False compares only
    topology, dtype and identity (the planner's command line knows no more).
    Returns (record, reason): the reason says what is predicted across and what could not
    be verified, or, with no record usable, why each was rejected.
    """
    host = as_dict(host)
    if records is None:
        return None, "no calibration recorded"
    if isinstance(records, Mapping):
        records = [records]
    usable: list[tuple[int, int, dict[str, Any], list[str], list[str]]] = []
    rejected: list[str] = []
    for order, record in enumerate(records):
        problems, notes = check_record(record, flags, host, flags_complete)
        if problems:
            rejected.append(f"{_describe(record)}: {'; '.join(problems)}")
            continue
        changes = _changes(record.get("key") or {}, flags)
        usable.append((len(changes), -order, dict(record), changes, notes))
    if not usable:
        if not rejected:
            return None, "no calibration recorded"
        more = f" (and {len(rejected) - 3} more)" if len(rejected) > 3 else ""
        return None, "no calibration matches: " + " | ".join(rejected[:3]) + more
    # Stores keep the newest first, so a lower position wins ties.
    usable.sort(key=lambda item: (item[0], -item[1]))
    _count, _order, record, changes, notes = usable[0]
    reason = _describe(record)
    reason += ": predicts across " + ", ".join(changes) if changes else ": same flag set"
    if notes:
        reason += " (" + ", ".join(notes) + ")"
    return record, reason
