"""A calibration record built from one start of a server: its start-up log lines and
`/server_info` measured, the flags it ran with as its key (`build_record`), and the views of
a record, its flags and /server_info with every secret left out (docs/CALIBRATION.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sglang_fleet import server_secrets
from sglang_fleet.capacity import kv_cache, logged_flags
from sglang_fleet.capacity.calibration import (
    SCHEMA,
    CalibrationError,
    as_dict,
    count_or_none,
    first_given,
    is_secret,
    norm,
    text_or_none,
    timestamp,
)
from sglang_fleet.capacity.calibration_rule import (
    KEY_FIELDS,
    MEASURED_FIELDS,
    RECORD_FIELDS,
    REQUIRED,
    figures_problem,
    log_problem,
    record_problem,
    said,
)
from sglang_fleet.capacity.server_log import StartupLog, parse_log
from sglang_fleet.module_utils.typed_number import Range, finite_or_none, shown
from sglang_fleet.module_utils.typed_number import read as read_number


# --- building a record ------------------------------------------------------------------
def model_fingerprint(config: Mapping[str, Any], weight_bytes: int) -> str:
    """Identity of a checkpoint: config.json (canonical JSON) and its tensor bytes."""
    size = read_number(weight_bytes, "weight_bytes", _COUNT)
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(f"{text}\n{size}".encode()).hexdigest()
    return f"sha256:{digest[:32]}"


def public_flags(flags: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The flag set without secrets (a record is stored in clear on the host): the one rule is
    sglang_fleet/server_secrets.py's public_flags, applied at every depth of a value, JSON text
    included (a text that holds a secret is redacted whole)."""
    return None if flags is None else server_secrets.public_flags(flags)


def without_values(value: Any, secrets: tuple[str, ...], depth: int = 0) -> Any:
    """value with every string that holds one of `secrets` (the server's own keys, as the
    record step knows them) redacted, whatever its place: the by-value half of the cleaning."""
    if not secrets:
        return value
    if depth > server_secrets.MAX_DEPTH:
        return server_secrets.REDACTED
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, server_secrets.REDACTED)
        return value
    if isinstance(value, Mapping):
        return {
            without_values(name, secrets, depth + 1): without_values(item, secrets, depth + 1)
            for name, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [without_values(item, secrets, depth + 1) for item in value]
    return value


def _public_fields(fields: Mapping[str, Any], known: Iterable[str]) -> dict[str, Any]:
    """A record's mapping with the secrets redacted: its own fields (`known`, never secrets
    whatever their names say) keep their names, every other entry is judged by its name."""
    own = set(known)
    return {
        name: (
            server_secrets.REDACTED
            if name not in own and is_secret(name)
            else server_secrets.redact(value)
        )
        for name, value in fields.items()
    }


def public_record(record: Any, secrets: Iterable[str] = ()) -> Any:
    """A record (or a set-aside entry) as the world-readable store may hold it: the flags
    without secret flags, every entry named like a secret redacted at every depth (flag values
    that are JSON text included), and every string holding one of `secrets` redacted. A record
    written before a flag joined server_secrets.SECRET_FLAGS is cleaned so on the next write."""
    values = tuple(s for s in secrets if isinstance(s, str) and s)
    if not isinstance(record, Mapping):
        return without_values(server_secrets.redact(record), values)
    public = _public_fields(record, RECORD_FIELDS)
    key, measured = record.get("key"), record.get("measured")
    if isinstance(key, Mapping):
        public["key"] = _public_fields(key, KEY_FIELDS)
        if isinstance(key.get("flags"), Mapping):
            public["key"]["flags"] = public_flags(key["flags"])
    if isinstance(measured, Mapping):
        public["measured"] = _public_fields(measured, MEASURED_FIELDS)
    return without_values(public, values)


# What a record reads of /server_info. The endpoint lists every server argument, the API key
# among them: a caller keeps only these before the answer goes anywhere it could be printed.
SERVER_INFO_FIELDS = (
    "version",
    "model_path",
    "tp_size",
    "dp_size",
    "pp_size",
    "nnodes",
    "mem_fraction_static",
    "kv_cache_dtype",
    "page_size",
    "chunked_prefill_size",
    "max_total_num_tokens",
    "max_running_requests",
    "context_length",
)


def _memory_usage(info: Mapping[str, Any]) -> Mapping[str, Any]:
    """Rank 0's memory_usage of /server_info ({} when the answer has none of that shape)."""
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], Mapping):
        usage = states[0].get("memory_usage")
        if isinstance(usage, Mapping):
            return usage
    return {}


def public_server_info(info: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The part of /server_info a record uses: SERVER_INFO_FIELDS and rank 0's memory_usage."""
    if not isinstance(info, Mapping):
        return None
    kept: dict[str, Any] = {name: info[name] for name in SERVER_INFO_FIELDS if name in info}
    usage = _memory_usage(info)
    if usage:
        kept["internal_states"] = [{"memory_usage": dict(usage)}]
    return kept


# Any integer a record, a log or /server_info gives (typed_number refuses past 2**63).
_COUNT = Range(0, integer=True)


def _graph_total_gib(memory_usage: Mapping[str, Any]) -> float | None:
    graph = memory_usage.get("graph")
    if isinstance(graph, Mapping):
        parts = [finite_or_none(v) for v in graph.values()]
        return sum(p for p in parts if p is not None)
    return finite_or_none(graph)


def _memory_from_server_info(info: Mapping[str, Any]) -> dict[str, float | None]:
    """/server_info's figures (rank 0 only). SGLang reports no pre-load free memory there:
    post ~ KV + graphs + what was still free, pre ~ post + weights (both a little low).
    A figure that is no finite number is left out (the record's rule judges the rest)."""
    usage = _memory_usage(info)
    weight, kv = finite_or_none(usage.get("weight")), finite_or_none(usage.get("kvcache"))
    if weight is not None and weight < 0:
        weight = None  # the log's negative "mem usage": free memory rose, no weights measured
    free, graph = finite_or_none(usage.get("startup_available")), _graph_total_gib(usage)
    post = None
    if kv is not None and free is not None and graph is not None:
        post = kv + free + graph
    return {
        "weight_gib": weight,
        "kv_size_gib": kv,
        "free_after_graph_gib": free,
        "graph_gib": graph,
        "post_gib": post,
        "pre_gib": None if post is None or weight is None else post + weight,
        "max_total_num_tokens": count_or_none(usage.get("token_capacity")),
    }


def _measured(startup: StartupLog, info: Mapping[str, Any]) -> dict[str, Any]:
    """Memory figures: the log's (minimum over ranks) first, /server_info's where it lacks."""
    from_info = _memory_from_server_info(info) if info else {}
    graph_from_log = None
    if startup.pool_end_avail_gib is not None and startup.graph_end_avail_gib is not None:
        graph_from_log = round(startup.pool_end_avail_gib - startup.graph_end_avail_gib, 3)
    tokens = first_given(
        startup.max_total_num_tokens, count_or_none(info.get("max_total_num_tokens"))
    )
    tokens = first_given(tokens, count_or_none(from_info.get("max_total_num_tokens")))
    kv_size = first_given(startup.kv_size_gib, from_info.get("kv_size_gib"))
    return {
        "pre_gib": first_given(startup.pre_gib, from_info.get("pre_gib")),
        "post_gib": first_given(startup.post_gib, from_info.get("post_gib")),
        "weight_gib": first_given(startup.weight_gib, from_info.get("weight_gib")),
        "kv_size_gib": kv_size,
        "max_total_num_tokens": tokens,
        "pool_end_free_gib": startup.pool_end_avail_gib,
        "free_after_graph_gib": first_given(
            startup.graph_end_avail_gib,
            startup.startup_avail_gib,
            from_info.get("free_after_graph_gib"),
        ),
        "graph_gib": first_given(graph_from_log, from_info.get("graph_gib")),
        "max_running_requests": first_given(
            startup.max_running_requests, count_or_none(info.get("max_running_requests"))
        ),
        "context_len": first_given(startup.context_len, count_or_none(info.get("context_length"))),
        "chunked_prefill_size": first_given(
            startup.chunked_prefill_size, count_or_none(info.get("chunked_prefill_size"))
        ),
        "post_capture_kv_sizing": startup.post_capture_kv_sizing,
    }


def _resolved(name: str, info: Mapping[str, Any], startup: StartupLog, flags: Mapping) -> Any:
    """A flag's value for this start: /server_info (resolved) > log server_args > flags."""
    return first_given(info.get(name), startup.server_args.get(name), flags.get(name))


def _requested(name: str, flags: Mapping | None, startup: StartupLog) -> Any:
    """What the operator asked for (None: SGLang chose); the log's args when flags are unknown."""
    if flags is not None:
        return flags.get(name)
    return startup.server_args.get(name)


def _given(value: Any, typed: Callable[[Any], Any]) -> Any:
    """value typed (a count, a figure), or as given when it is none: the record's rule then
    names it, so that a damaged input refuses the record rather than changing its meaning."""
    number = typed(value)
    return value if number is None else number


def _given_count(value: Any, default: int | None = None) -> Any:
    return default if value is None else _given(value, count_or_none)


def _record_key(
    startup: StartupLog, info: Mapping[str, Any], key: Mapping[str, Any], measured: dict
) -> dict[str, Any]:
    flags = dict(key["flags"]) if isinstance(key.get("flags"), Mapping) else None
    # logged_flags: the logged run's flags as the caller found them
    # (sglang_fleet.capacity.logged_flags:
    # stated by the operator, or inferred from the log's own lines); the start's own flag set
    # beats them, and what the log or /server_info says beats both.
    known = as_dict(key.get("logged_flags")) | (flags or {})
    # Then what the lines alone show (no config.json here: the KV line's own size).
    try:
        known = logged_flags.infer(startup, stated=known).flags | known
    except (ArithmeticError, ValueError) as exc:  # a figure of the lines past its reader
        raise CalibrationError(f"the start-up lines cannot be read: {said(exc)}") from None
    fingerprint = key.get("model_fingerprint")
    if fingerprint is None and key.get("model_config") is not None:
        try:
            fingerprint = model_fingerprint(key["model_config"], key.get("weight_bytes"))
        except (TypeError, ValueError) as exc:
            raise CalibrationError(f"the model's fingerprint: {said(exc)}") from None
    # The fraction SGLang reports beats the flags.
    fraction = finite_or_none(
        first_given(
            info.get("mem_fraction_static"),
            startup.server_args.get("mem_fraction_static"),
            known.get("mem_fraction_static"),
        )
    )
    return {
        "model_path": first_given(
            key.get("model_path"), text_or_none(_resolved("model_path", info, startup, known))
        ),
        "model_fingerprint": fingerprint,
        "architecture": startup.architecture,
        # cpu for SGLang's CPU engine (its "avail mem" is host RAM, docs/CPU-SERVERS.md).
        "device": startup.device or "cuda",
        "gpu_name": key.get("gpu_name"),
        "gpu_memory_mib": _given(key.get("gpu_memory_mib"), finite_or_none),
        "sglang_version": first_given(key.get("sglang_version"), text_or_none(info.get("version"))),
        "tp_size": _given_count(_resolved("tp_size", info, startup, known), 1),
        **_attn_dp_key(info, startup, known),
        "pp_size": _given_count(_resolved("pp_size", info, startup, known), 1),
        "nnodes": _given_count(_resolved("nnodes", info, startup, known), 1),
        "mem_fraction_static": first_given(
            fraction, _given(known.get("mem_fraction_static"), finite_or_none)
        ),
        "kv_cache_dtype": _resolved("kv_cache_dtype", info, startup, known) or "auto",
        "page_size": _given_count(_resolved("page_size", info, startup, known), 1),
        "chunked_prefill_size": measured["chunked_prefill_size"],
        "max_running_requests": _given_count(_requested("max_running_requests", flags, startup)),
        "cuda_graph_max_bs_decode": _given_count(
            first_given(
                _requested("cuda_graph_max_bs_decode", flags, startup),
                _requested("cuda_graph_max_bs", flags, startup),
            )
        ),
        "context_length": _given_count(_requested("context_length", flags, startup)),
        "max_total_tokens": _given_count(_requested("max_total_tokens", flags, startup)),
        "flags": public_flags(flags),
    }


def _attn_dp_key(info: Mapping[str, Any], startup: StartupLog, known: Mapping) -> dict[str, Any]:
    """dp_size and attn_dp_size as SGLang resolves them: the deprecated `--enable-dp-attention
    --dp-size N` is attn_dp_size N with dp_size 1 (docs/ATTENTION-DP.md)."""
    dp = _given_count(_resolved("dp_size", info, startup, known), 1)
    attn = _given_count(_resolved("attn_dp_size", info, startup, known), 1)
    if norm(_resolved("enable_dp_attention", info, startup, known)) is True and attn == 1:
        attn, dp = dp, 1
    return {"dp_size": dp, "attn_dp_size": attn}


def _parsed(log_text: str | StartupLog | None) -> StartupLog:
    if isinstance(log_text, StartupLog):
        return log_text
    if log_text is not None and not isinstance(log_text, str):
        raise CalibrationError(f"the start-up log must be text, got {shown(log_text)}")
    try:
        return parse_log(log_text or "")
    except (ArithmeticError, ValueError) as exc:  # a number in a line past its reader
        raise CalibrationError(f"the start-up lines cannot be read: {said(exc)}") from None


def build_record(
    log_text: str | StartupLog | None,
    server_info: Mapping[str, Any] | None,
    key: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A calibration record from one start's log lines (or the log already parsed, as the
    planner has it) and/or its /server_info.

    key: what the start depends on that neither source says: model_path,
    model_fingerprint (or model_config + weight_bytes to compute it), gpu_name,
    gpu_memory_mib, sglang_version, flags (the requested flag set; secrets are dropped),
    and optionally server, config_hash, recorded_at. Raises CalibrationError (and nothing
    else) when the sources lack the memory figures a plan needs or give ones the store's rule
    (record_problem) refuses: every figure is typed before any arithmetic.
    """
    key, info = as_dict(key), as_dict(server_info)
    startup = _parsed(log_text)
    problem = log_problem(startup)
    if problem:
        raise CalibrationError(f"this start's figures are no calibration: {problem}")
    measured = _measured(startup, info)
    missing = [name for name in REQUIRED if measured[name] is None]
    if missing:
        skipped = startup.long_lines_note()
        raise CalibrationError(
            "the start-up log and /server_info lack " + ", ".join(missing)
            + (f" ({skipped})" if skipped else "")
            + " (need SGLang's 'Load weight begin/end', 'Capture ... CUDA graph end' and "
            "'max_total_num_tokens=' lines, or /server_info internal_states[0].memory_usage)"
        )  # fmt: skip
    problem = figures_problem(measured)
    if problem:
        raise CalibrationError(f"this start's figures are no calibration: {problem}")
    record_key = _record_key(startup, info, key, measured)
    # The CPU engine's pool does not follow the fraction (docs/CPU-SERVERS.md): a CPU record
    # may go without one; a GPU record is its fraction's measurement.
    if record_key["mem_fraction_static"] is None and record_key["device"] != "cpu":
        raise CalibrationError("neither /server_info nor the log says mem_fraction_static")
    # Typed and bounded above (figures_problem): the arithmetic below cannot overflow.
    tokens = int(measured["max_total_num_tokens"])
    if measured["kv_size_gib"] and tokens:
        measured["cell_size_bytes"] = round(measured["kv_size_gib"] * kv_cache.GIB / tokens)
    else:
        measured["cell_size_bytes"] = None
    rise = float(measured["post_gib"]) - float(measured["pre_gib"])
    if rise > 0:
        measured["free_rose_during_load_gib"] = round(rise, 3)
    sources = [
        name for name, given in (("log", startup.has_memory), ("server_info", info)) if given
    ]
    record = {
        "schema": SCHEMA,
        "recorded_at": key.get("recorded_at") or timestamp(),
        "server": key.get("server"),
        "config_hash": key.get("config_hash"),
        "sources": sources,
        "key": record_key,
        "measured": measured,
    }
    problem = record_problem(record)
    if problem:
        raise CalibrationError(f"this start's figures are no calibration: {problem}")
    return record
