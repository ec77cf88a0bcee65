"""Calibration records: what one start of a server measured, and plans made from it.

After the health gate passes, the deploy reads this start's start-up lines (and
`/server_info`) and stores a *record* on the host. Pre-flight plans every later flag set
with the matching record instead of estimates. docs/CALIBRATION.md explains the model; in
short (SGLang 0.5.23, GiB):

    static pool   = pre * mem_fraction_static          (weights + KV pool)
    KV budget     = measured KV bytes + (f_new - f_old) * pre
    max_total_num_tokens = floor(KV budget / cell size), rounded to page_size
    free after CUDA graph capture
                  = measured free - (f_new - f_old) * pre - (graph_new - graph_old)
                    - (request table growth)

Interface (the deploy's filters and the autotune loop use these):

    build_record(log_text, server_info, key) -> record (dict, JSON-safe)
    match(records, flags, host) -> (record | None, reason)
    predict(record, flags, host, shape, margin_gib=...) -> Prediction
    apply(records, flags, host, shape, ...) -> Applied  (the planner's entry point)
    add_record(records, record) / read_store(text) / dump_store(records)

`flags` are SGLang field names as the server is launched with (tp_size, mem_fraction_static,
kv_cache_dtype, ...); `host` holds gpu_name, gpu_memory_mib, sglang_version and the
model's fingerprint (`model_fingerprint(config, weight_bytes)`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import posixpath
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from sglang_fleet import server_secrets
from sglang_fleet.capacity import kv_cache, logged_flags, speculative
from sglang_fleet.capacity.model_config import ModelShape
from sglang_fleet.capacity.server_log import Calibration, parse_log
from sglang_fleet.module_utils import bounded_json
from sglang_fleet.module_utils.typed_number import NumberError, Range, finite_or_none, shown
from sglang_fleet.module_utils.typed_number import read as read_number

SCHEMA = 1
STORE_SCHEMA = "sglang-fleet/calibrations/1"
# Records kept per server on the host: one per distinct flag set, newest first.
STORE_LIMIT = 16
# Two fractions closer than this are the same setting (SGLang logs 3 decimals).
SAME_FRACTION = 5e-4
# The 5 GiB margin was set for an 8192-token prefill chunk (docs/CALIBRATION.md):
# activations grow with the chunk, so a larger chunk needs a proportionally larger margin.
MARGIN_CHUNK_TOKENS = 8192
# SGLang's own per-graph estimates (srt/arg_groups/memory_hook.py reserve_for_graph_mb),
# used only for the *difference* between two CUDA graph settings.
DECODE_GRAPH_MIB_PER_BS = 2.0
MLA_PREFILL_GRAPH_MIB = 1536.0
MHA_PREFILL_GRAPH_MIB_PER_BUCKET = 8.0
# ReqToTokenPool: (max_running_requests + 1) x context_len int32 entries on every GPU,
# allocated after the KV pool (srt/mem_cache/memory_pool.py ReqToTokenPool).
REQ_TO_TOKEN_BYTES = 4

# Differences a record cannot predict across: they change what each GPU holds.
TOPOLOGY_FLAGS = ("tp_size", "dp_size", "pp_size", "nnodes")
# Differences a record predicts across (docs/CALIBRATION.md, "What matches").
PREDICTED_FLAGS = frozenset(
    {
        "mem_fraction_static",
        "max_running_requests",
        "kv_cache_dtype",
        "chunked_prefill_size",
        "cuda_graph_max_bs_decode",
        "cuda_graph_max_bs",
        "page_size",
        "context_length",
        "max_total_tokens",
        # Attention DP: the attention weights per GPU change by what config.json says
        # (sglang_fleet.capacity.attention_dp, docs/ATTENTION-DP.md), the rest of the start stays
        # measured.
        "attn_dp_size",
    }
)
# Flags that do not change GPU memory at start-up: compared never.
NO_MEMORY_EFFECT_FLAGS = frozenset(
    {
        "model_path",
        "tokenizer_path",
        "tokenizer_mode",
        "trust_remote_code",
        "served_model_name",
        "host",
        "port",
        "api_key",
        "admin_api_key",
        "log_level",
        "log_level_http",
        "log_requests",
        "log_requests_level",
        "decode_log_interval",
        "enable_metrics",
        "enable_cache_report",
        "num_continuous_decode_steps",
        "schedule_policy",
        "schedule_conservativeness",
        "stream_interval",
        "stream_output",
        "skip_server_warmup",
        "watchdog_timeout",
        "dist_timeout",
        "dist_init_addr",
        "node_rank",
        "nccl_port",
        "random_seed",
        "chat_template",
        "reasoning_parser",
        "tool_call_parser",
        "max_queued_requests",
        "disable_radix_cache",
        # HiCache lives in host RAM; the planner checks that separately.
        "enable_hierarchical_cache",
        "hicache_size",
        "hicache_ratio",
        "hicache_write_policy",
        "hicache_io_backend",
        "hicache_mem_layout",
        "hicache_storage_backend",
        "base_gpu_id",
        "config",
    }
)


class CalibrationError(ValueError):
    """The inputs cannot make a calibration record (the reason says which is missing)."""


# --- building a record ------------------------------------------------------------------
def model_fingerprint(config: Mapping[str, Any], weight_bytes: int) -> str:
    """Identity of a checkpoint: config.json (canonical JSON) and its tensor bytes."""
    size = read_number(weight_bytes, "weight_bytes", _COUNT)
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(f"{text}\n{size}".encode()).hexdigest()
    return f"sha256:{digest[:32]}"


def _is_secret(name: str) -> bool:
    return server_secrets.is_secret(name)


def public_flags(flags: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The flag set without secrets (a record is stored in clear on the host): the one rule is
    sglang_fleet/server_secrets.py's public_flags, applied at every depth of a value, JSON text
    included (a text that holds a secret is redacted whole)."""
    return None if flags is None else server_secrets.public_flags(flags)


def _without_values(value: Any, secrets: tuple[str, ...], depth: int = 0) -> Any:
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
            _without_values(name, secrets, depth + 1): _without_values(item, secrets, depth + 1)
            for name, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_without_values(item, secrets, depth + 1) for item in value]
    return value


def _public_fields(fields: Mapping[str, Any], known: Iterable[str]) -> dict[str, Any]:
    """A record's mapping with the secrets redacted: its own fields (`known`, never secrets
    whatever their names say) keep their names, every other entry is judged by its name."""
    own = set(known)
    return {
        name: (
            server_secrets.REDACTED
            if name not in own and _is_secret(name)
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
        return _without_values(server_secrets.redact(record), values)
    public = _public_fields(record, _RECORD_FIELDS)
    key, measured = record.get("key"), record.get("measured")
    if isinstance(key, Mapping):
        public["key"] = _public_fields(key, _KEY_FIELDS)
        if isinstance(key.get("flags"), Mapping):
            public["key"]["flags"] = public_flags(key["flags"])
    if isinstance(measured, Mapping):
        public["measured"] = _public_fields(measured, _MEASURED_FIELDS)
    return _without_values(public, values)


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
_INTEGER = Range(integer=True)


def _int(value: Any) -> int | None:
    """A count as a record, a flag or /server_info holds it: an integer (or its text), else
    None (a fraction, a boolean, NaN, a huge integer, anything else)."""
    try:
        return int(read_number(value, "a count", _INTEGER))
    except NumberError:
        return None


def _text(value: Any) -> str | None:
    """A name (model path, GPU, version) as a record holds it: text, else nothing."""
    return value if isinstance(value, str) else None


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


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
        "max_total_num_tokens": _int(usage.get("token_capacity")),
    }


def _measured(cal: Calibration, info: Mapping[str, Any]) -> dict[str, Any]:
    """Memory figures: the log's (minimum over ranks) first, /server_info's where it lacks."""
    from_info = _memory_from_server_info(info) if info else {}
    graph_from_log = None
    if cal.pool_end_avail_gib is not None and cal.graph_end_avail_gib is not None:
        graph_from_log = round(cal.pool_end_avail_gib - cal.graph_end_avail_gib, 3)
    tokens = _first(cal.max_total_num_tokens, _int(info.get("max_total_num_tokens")))
    tokens = _first(tokens, _int(from_info.get("max_total_num_tokens")))
    kv_size = _first(cal.kv_size_gib, from_info.get("kv_size_gib"))
    return {
        "pre_gib": _first(cal.pre_gib, from_info.get("pre_gib")),
        "post_gib": _first(cal.post_gib, from_info.get("post_gib")),
        "weight_gib": _first(cal.weight_gib, from_info.get("weight_gib")),
        "kv_size_gib": kv_size,
        "max_total_num_tokens": tokens,
        "pool_end_free_gib": cal.pool_end_avail_gib,
        "free_after_graph_gib": _first(
            cal.graph_end_avail_gib, cal.startup_avail_gib, from_info.get("free_after_graph_gib")
        ),
        "graph_gib": _first(graph_from_log, from_info.get("graph_gib")),
        "max_running_requests": _first(
            cal.max_running_requests, _int(info.get("max_running_requests"))
        ),
        "context_len": _first(cal.context_len, _int(info.get("context_length"))),
        "chunked_prefill_size": _first(
            cal.chunked_prefill_size, _int(info.get("chunked_prefill_size"))
        ),
        "post_capture_kv_sizing": cal.post_capture_kv_sizing,
    }


def _resolved(name: str, info: Mapping[str, Any], cal: Calibration, flags: Mapping) -> Any:
    """A flag's value for this start: /server_info (resolved) > log server_args > flags."""
    return _first(info.get(name), cal.server_args.get(name), flags.get(name))


def _requested(name: str, flags: Mapping | None, cal: Calibration) -> Any:
    """What the operator asked for (None: SGLang chose); the log's args when flags are unknown."""
    if flags is not None:
        return flags.get(name)
    return cal.server_args.get(name)


def _mapping(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def _given(value: Any, typed: Callable[[Any], Any]) -> Any:
    """value typed (a count, a figure), or as given when it is none: the record's rule then
    names it, so that a damaged input refuses the record rather than changing its meaning."""
    number = typed(value)
    return value if number is None else number


def _given_count(value: Any, default: int | None = None) -> Any:
    return default if value is None else _given(value, _int)


def _record_key(
    cal: Calibration, info: Mapping[str, Any], key: Mapping[str, Any], measured: dict
) -> dict[str, Any]:
    flags = dict(key["flags"]) if isinstance(key.get("flags"), Mapping) else None
    # logged_flags: the logged run's flags as the caller found them
    # (sglang_fleet.capacity.logged_flags:
    # stated by the operator, or inferred from the log's own lines); the start's own flag set
    # beats them, and what the log or /server_info says beats both.
    known = _mapping(key.get("logged_flags")) | (flags or {})
    # Then what the lines alone show (no config.json here: the KV line's own size).
    try:
        known = logged_flags.infer(cal, stated=known).flags | known
    except (ArithmeticError, ValueError) as exc:  # a figure of the lines past its reader
        raise CalibrationError(f"the start-up lines cannot be read: {_said(exc)}") from None
    fingerprint = key.get("model_fingerprint")
    if fingerprint is None and key.get("model_config") is not None:
        try:
            fingerprint = model_fingerprint(key["model_config"], key.get("weight_bytes"))
        except (TypeError, ValueError) as exc:
            raise CalibrationError(f"the model's fingerprint: {_said(exc)}") from None
    # The fraction SGLang reports beats the flags.
    fraction = finite_or_none(
        _first(
            info.get("mem_fraction_static"),
            cal.server_args.get("mem_fraction_static"),
            known.get("mem_fraction_static"),
        )
    )
    return {
        "model_path": _first(
            key.get("model_path"), _text(_resolved("model_path", info, cal, known))
        ),
        "model_fingerprint": fingerprint,
        "architecture": cal.architecture,
        # cpu for SGLang's CPU engine (its "avail mem" is host RAM, docs/CPU-SERVERS.md).
        "device": cal.device or "cuda",
        "gpu_name": key.get("gpu_name"),
        "gpu_memory_mib": _given(key.get("gpu_memory_mib"), finite_or_none),
        "sglang_version": _first(key.get("sglang_version"), _text(info.get("version"))),
        "tp_size": _given_count(_resolved("tp_size", info, cal, known), 1),
        **_attn_dp_key(info, cal, known),
        "pp_size": _given_count(_resolved("pp_size", info, cal, known), 1),
        "nnodes": _given_count(_resolved("nnodes", info, cal, known), 1),
        "mem_fraction_static": _first(
            fraction, _given(known.get("mem_fraction_static"), finite_or_none)
        ),
        "kv_cache_dtype": _resolved("kv_cache_dtype", info, cal, known) or "auto",
        "page_size": _given_count(_resolved("page_size", info, cal, known), 1),
        "chunked_prefill_size": measured["chunked_prefill_size"],
        "max_running_requests": _given_count(_requested("max_running_requests", flags, cal)),
        "cuda_graph_max_bs_decode": _given_count(
            _first(
                _requested("cuda_graph_max_bs_decode", flags, cal),
                _requested("cuda_graph_max_bs", flags, cal),
            )
        ),
        "context_length": _given_count(_requested("context_length", flags, cal)),
        "max_total_tokens": _given_count(_requested("max_total_tokens", flags, cal)),
        "flags": public_flags(flags),
    }


def _attn_dp_key(info: Mapping[str, Any], cal: Calibration, known: Mapping) -> dict[str, Any]:
    """dp_size and attn_dp_size as SGLang resolves them: the deprecated `--enable-dp-attention
    --dp-size N` is attn_dp_size N with dp_size 1 (docs/ATTENTION-DP.md)."""
    dp = _given_count(_resolved("dp_size", info, cal, known), 1)
    attn = _given_count(_resolved("attn_dp_size", info, cal, known), 1)
    if _norm(_resolved("enable_dp_attention", info, cal, known)) is True and attn == 1:
        attn, dp = dp, 1
    return {"dp_size": dp, "attn_dp_size": attn}


def _said(exc: BaseException, limit: int = 300) -> str:
    """An exception as a reason: its message, bounded (a message can hold a long value, and
    the str() of an exception that carries a huge integer can itself raise)."""
    try:
        text = str(exc)
    except Exception:  # its message is the one thing it cannot give
        text = ""
    text = text or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _parsed(log_text: str | Calibration | None) -> Calibration:
    if isinstance(log_text, Calibration):
        return log_text
    if log_text is not None and not isinstance(log_text, str):
        raise CalibrationError(f"the start-up log must be text, got {shown(log_text)}")
    try:
        return parse_log(log_text or "")
    except (ArithmeticError, ValueError) as exc:  # a number in a line past its reader
        raise CalibrationError(f"the start-up lines cannot be read: {_said(exc)}") from None


_REQUIRED = ("pre_gib", "post_gib", "max_total_num_tokens", "free_after_graph_gib")


def build_record(
    log_text: str | Calibration | None,
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
    key, info = _mapping(key), _mapping(server_info)
    cal = _parsed(log_text)
    problem = _log_problem(cal)
    if problem:
        raise CalibrationError(f"this start's figures are no calibration: {problem}")
    measured = _measured(cal, info)
    missing = [name for name in _REQUIRED if measured[name] is None]
    if missing:
        skipped = cal.long_lines_note()
        raise CalibrationError(
            "the start-up log and /server_info lack " + ", ".join(missing)
            + (f" ({skipped})" if skipped else "")
            + " (need SGLang's 'Load weight begin/end', 'Capture ... CUDA graph end' and "
            "'max_total_num_tokens=' lines, or /server_info internal_states[0].memory_usage)"
        )  # fmt: skip
    problem = _figures_problem(measured)
    if problem:
        raise CalibrationError(f"this start's figures are no calibration: {problem}")
    record_key = _record_key(cal, info, key, measured)
    # The CPU engine's pool does not follow the fraction (docs/CPU-SERVERS.md): a CPU record
    # may go without one; a GPU record is its fraction's measurement.
    if record_key["mem_fraction_static"] is None and record_key["device"] != "cpu":
        raise CalibrationError("neither /server_info nor the log says mem_fraction_static")
    # Typed and bounded above (_figures_problem): the arithmetic below cannot overflow.
    tokens = int(measured["max_total_num_tokens"])
    if measured["kv_size_gib"] and tokens:
        measured["cell_size_bytes"] = round(measured["kv_size_gib"] * kv_cache.GIB / tokens)
    else:
        measured["cell_size_bytes"] = None
    rise = float(measured["post_gib"]) - float(measured["pre_gib"])
    if rise > 0:
        measured["free_rose_during_load_gib"] = round(rise, 3)
    sources = [name for name, given in (("log", cal.has_memory), ("server_info", info)) if given]
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


def timestamp() -> str:
    """Now, as records and side files are stamped (UTC, seconds)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- the store on the host ----------------------------------------------------------------
# What no GPU start measures: bounds past which a figure is damage, not a measurement (the
# largest GPUs hold a few hundred GiB; a KV pool of 2^40 tokens would need petabytes).
MAX_GPU_GIB = 4096.0
MAX_POOL_TOKENS = 1 << 40
_GIB_FIGURES = ("pre_gib", "post_gib", "weight_gib", "kv_size_gib", "pool_end_free_gib",
                "free_after_graph_gib", "graph_gib", "free_rose_during_load_gib")  # fmt: skip
# How far free memory may rise across the weight load and the start still describe its
# device (docs/CALIBRATION.md, "Noise"). SGLang reads free memory before and after the load;
# anything else that frees memory meanwhile raises the second reading. On the CPU engine "free"
# is the host's RAM, which every process on the host moves; on a GPU only a process that
# releases its memory late moves it. Within the noise the start's KV pool and free memory are
# what SGLang sized and measured; beyond it `pre` understates the device, and a plan scaled
# by it would promise KV tokens the next start does not get.
LOAD_NOISE_MIN_GIB = 0.05  # SGLang prints these figures with two decimals
LOAD_NOISE_FRACTION = {"cuda": 0.005, "cpu": 0.05}
_COUNT_FIGURES = ("max_total_num_tokens", "max_running_requests", "context_len",
                  "chunked_prefill_size", "cell_size_bytes")  # fmt: skip


# The rule's bounds on a record's key, as the planner bounds the same flags
# (capacity/planner_inputs.py): a parallel size past any cluster, a count past any setting.
MAX_PARALLEL = 4096
MAX_COUNT = 2**31 - 1
MAX_NAME_CHARS = 4096
_KEY_COUNTS: dict[str, Range] = {
    **{name: Range(1, MAX_PARALLEL, integer=True) for name in (*TOPOLOGY_FLAGS, "attn_dp_size")},
    "page_size": Range(1, MAX_COUNT, integer=True),
    "chunked_prefill_size": Range(-1, MAX_COUNT, integer=True),  # -1 (and 0): no chunking
    "max_running_requests": Range(1, MAX_COUNT, integer=True),
    "cuda_graph_max_bs_decode": Range(0, MAX_COUNT, integer=True),
    "context_length": Range(1, MAX_COUNT, integer=True),
    "max_total_tokens": Range(1, MAX_COUNT, integer=True),
}
_KEY_NAMES = ("model_path", "model_fingerprint", "architecture", "gpu_name", "sglang_version")
FRACTION = Range(0, 1, low_open=True, high_open=True)
DEVICE_MIB = Range(0, 1e12, low_open=True)
DEVICES = ("cuda", "cpu")
# A record's own fields: never judged a secret by their names (the record's "key" would be).
_RECORD_FIELDS = ("schema", "recorded_at", "server", "config_hash", "sources", "key", "measured")
_KEY_FIELDS = (*_KEY_COUNTS, *_KEY_NAMES, "device", "gpu_memory_mib", "mem_fraction_static",
               "kv_cache_dtype", "flags")  # fmt: skip
_MEASURED_FIELDS = (*_GIB_FIGURES, *_COUNT_FIGURES, "post_capture_kv_sizing")
# How far a GPU record's KV pool may exceed what its fraction leaves for it (_pool_problem):
# the figures' two decimals, and a fraction inferred from those figures rounded down.
POOL_SLACK_FRACTION = 0.01


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _figure_problem(name: str, value: Any, limit: float, integer: bool = False) -> str | None:
    """Why a measured figure is none (None: it is one, or absent): a finite number (never a
    boolean, text or an integer past typed_number's bound) from -1 to limit."""
    if value is None:
        return None
    try:
        number = read_number(value, name, text=False)
    except NumberError:
        kind = "outside" if isinstance(value, int) and not isinstance(value, bool) else "not"
        what = f"-1..{limit:g}" if kind == "outside" else "a finite number"
        return f"{name} is {shown(value)}, {kind} {what}"
    if not -1 <= number <= limit:  # chunked_prefill_size -1 means disabled
        return f"{name} {number:g} is outside -1..{limit:g}"
    if integer and number != int(number):
        return f"{name} {number:g} is not a whole number"
    return None


def _figures_problem(measured: Mapping[str, Any], what: str = "measured") -> str | None:
    problems = (
        *(_figure_problem(f"{what}.{n}", measured.get(n), MAX_GPU_GIB) for n in _GIB_FIGURES),
        *(
            _figure_problem(f"{what}.{n}", measured.get(n), MAX_POOL_TOKENS, integer=True)
            for n in _COUNT_FIGURES
        ),
    )
    return next((p for p in problems if p), None)


# The parsed log's figures (server_log.Calibration) a record or its key reads, by kind.
_LOG_GIB = ("pre_gib", "post_gib", "weight_gib", "kv_size_gib", "pool_end_avail_gib",
            "graph_end_avail_gib", "startup_avail_gib", "multimodal_reserve_gib")  # fmt: skip
_LOG_COUNTS = ("kv_tokens", "max_total_num_tokens", "chunked_prefill_size",
               "max_running_requests", "context_len", "decode_graph_max_bs")  # fmt: skip


def _log_problem(cal: Calibration) -> str | None:
    """Why the log's own figures are no measurement (a line's number past any device: a
    400-digit count, 1e999 GiB), before any arithmetic is done with them."""
    problems = (
        *(_figure_problem(f"the log's {n}", getattr(cal, n), MAX_GPU_GIB) for n in _LOG_GIB),
        *(
            _figure_problem(f"the log's {n}", getattr(cal, n), MAX_POOL_TOKENS, integer=True)
            for n in _LOG_COUNTS
        ),
    )
    return next((p for p in problems if p), None)


def _shape_problem(record: Any) -> str | None:
    if not isinstance(record, Mapping):
        return f"not a record (JSON {type(record).__name__})"
    if record.get("schema") != SCHEMA:
        return f"record schema {shown(record.get('schema'))}, not {SCHEMA}"
    if not isinstance(record.get("key"), Mapping) or not isinstance(
        record.get("measured"), Mapping
    ):
        return "a record holds a key and measured figures (mappings)"
    made = record.get("recorded_at")
    if made is not None and not (isinstance(made, str) and len(made) <= 64):
        return f"recorded_at must be a time stamp, got {shown(made)}"
    missing = [name for name in _REQUIRED if record["measured"].get(name) is None]
    return f"measured.{missing[0]} is missing" if missing else None


def _key_problem(key: Mapping[str, Any]) -> str | None:
    """Why a record's key cannot anchor a prediction (None: it can). Every field a match or a
    prediction reads is checked: counts in the planner's own ranges, the fraction in (0, 1)
    (a GPU record's is required: it is that fraction's measurement), a dtype with a known cell
    size, the device, names as text, the flags a mapping."""
    return _key_numbers_problem(key) or _key_words_problem(key)


def _key_numbers_problem(key: Mapping[str, Any]) -> str | None:
    try:
        for name, allowed in _KEY_COUNTS.items():
            if key.get(name) is not None:
                read_number(key[name], f"key.{name}", allowed, text=False)
        if key.get("gpu_memory_mib") is not None:
            read_number(key["gpu_memory_mib"], "key.gpu_memory_mib", DEVICE_MIB, text=False)
        if key.get("mem_fraction_static") is not None:
            read_number(key["mem_fraction_static"], "key.mem_fraction_static", FRACTION, text=False)
    except NumberError as exc:
        return str(exc)
    if key.get("mem_fraction_static") is None and key.get("device") != "cpu":
        return "key.mem_fraction_static is missing (a GPU record measures one fraction)"
    return None


def _key_words_problem(key: Mapping[str, Any]) -> str | None:
    device, dtype, flags = key.get("device"), key.get("kv_cache_dtype"), key.get("flags")
    problems = [
        f"key.{name} must be text of at most {MAX_NAME_CHARS} characters, got {shown(value)}"
        for name, value in ((n, key.get(n)) for n in _KEY_NAMES)
        if value is not None and not (isinstance(value, str) and len(value) <= MAX_NAME_CHARS)
    ]
    if device is not None and device not in DEVICES:
        problems.append(f"key.device must be one of {', '.join(DEVICES)}, got {shown(device)}")
    if dtype is not None and not _dtype_known(dtype):
        known = ", ".join(sorted(kv_cache.KV_ELEM_BYTES))
        problems.append(
            f"key.kv_cache_dtype {shown(dtype)} has no known cell size (one of {known})"
        )
    if flags is not None and not (
        isinstance(flags, Mapping) and all(isinstance(name, str) for name in flags)
    ):
        problems.append(f"key.flags must be a mapping of flag names, got {shown(flags)}")
    return problems[0] if problems else None


def _pool_problem(record: Mapping[str, Any]) -> str | None:
    """Whether a GPU record's fraction holds its KV pool. SGLang sizes the pool from what the
    fraction leaves (kv_cache.rest_gib: post - pre x (1 - f)); a pool larger than that, past
    the figures' rounding, was not measured at this fraction, and a prediction scaled from it
    would refuse flag sets a good record passes. A pool smaller is legitimate (capped by
    --max-total-tokens, a multimodal reserve, another pool beside it). Only the log's own
    pre and post say this: /server_info's leave out the request table and runtime buffers
    (docs/CALIBRATION.md), which can be GiB."""
    key, measured = record["key"], record["measured"]
    kv = measured.get("kv_size_gib")
    sources = record.get("sources")
    if (
        kv is None
        or not isinstance(sources, list)
        or "log" not in sources
        or key.get("device") == "cpu"
        or measured.get("post_capture_kv_sizing")
    ):
        return None
    pre, post = float(measured["pre_gib"]), float(measured["post_gib"])
    fraction = float(key["mem_fraction_static"])
    rest = kv_cache.rest_gib(pre, post, fraction)
    slack = max(LOAD_NOISE_MIN_GIB, POOL_SLACK_FRACTION * pre)
    if kv > rest + slack:
        return (
            f"key.mem_fraction_static {fraction:g} leaves {rest:.2f} GiB for the KV pool "
            f"(post_gib {post:g} - pre_gib {pre:g} x (1 - {fraction:g})), less than the "
            f"measured kv_size_gib {kv:g}: the figures are not this fraction's"
        )
    return None


def _physical_problem(key: Mapping[str, Any], measured: Mapping[str, Any]) -> str | None:
    problem = _figures_problem(measured) or _key_problem(key)
    if problem:
        return problem
    pre, post = float(measured["pre_gib"]), float(measured["post_gib"])
    free = float(measured["free_after_graph_gib"])
    gpu_mib = finite_or_none(key.get("gpu_memory_mib"))
    gpu_gib = gpu_mib / 1024 if gpu_mib and gpu_mib > 0 else MAX_GPU_GIB
    if not (0 < pre <= gpu_gib * 1.01 and 0 < post <= gpu_gib * 1.01 and 0 <= free <= gpu_gib):
        return (
            f"measured pre_gib {pre:g}, post_gib {post:g}, free_after_graph_gib {free:g} are "
            f"not 0 < pre, post <= the device's {gpu_gib:g} GiB with 0 <= free <= it"
        )
    noise = load_noise_gib(pre, str(key.get("device") or "cuda"))
    if post - pre > noise:
        return (
            f"free memory rose {post - pre:.2f} GiB during the weight load (pre_gib {pre:g}, "
            f"post_gib {post:g}), more than the {noise:.2f} GiB of measurement noise: something "
            "else freed memory meanwhile, so pre_gib understates the device"
        )
    if measured["max_total_num_tokens"] < 1:
        return "measured.max_total_num_tokens is below 1"
    return None


def load_noise_gib(pre_gib: float, device: str) -> float:
    """How far free memory may rise across the weight load as noise (LOAD_NOISE_FRACTION)."""
    return max(
        LOAD_NOISE_MIN_GIB, LOAD_NOISE_FRACTION.get(device, LOAD_NOISE_FRACTION["cuda"]) * pre_gib
    )


def _json_problem(record: Mapping[str, Any]) -> str | None:
    """Whether the record, written into the store, reads back as JSON: no NaN or infinity
    anywhere (its flags included), nesting within what the reader parses (the store adds two
    levels), nothing JSON cannot hold."""
    deep = bounded_json.depth_problem(record, bounded_json.MAX_DEPTH - 2)
    if deep:
        return f"the record is {deep}"
    try:
        json.dumps(record, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        return f"the record is no JSON the store can hold ({_said(exc, 120)})"
    return None


def record_problem(record: Any) -> str | None:
    """Why an entry is not a record this version can plan with (None: it is). The one rule
    for both sides of the store, over the whole record (its key and its measured figures):
    build_record and add_record refuse what read_store would set aside, so nothing is written
    that the next read refuses, and what the reader keeps plans like a record just built."""
    return (
        _shape_problem(record)
        or _physical_problem(record["key"], record["measured"])
        or _pool_problem(record)
        or _json_problem(record)
    )


# What a set-aside entry keeps of what it replaced: enough for the operator to see it, bounded.
SET_ASIDE_TEXT_CHARS = 65536
# A store holds STORE_LIMIT records; a file of more entries than this is no store this project
# wrote, and is set aside whole rather than entry by entry. A warning names this many entries.
MAX_STORE_ENTRIES = 1024
PROBLEMS_NAMED = 8


@dataclass(frozen=True)
class SetAside:
    """One entry of the store that no plan may use, and why (`entry`: its index, or None when
    the file as a whole is no store)."""

    entry: int | None
    problem: str
    content: Any

    def describe(self) -> str:
        where = "the whole file" if self.entry is None else f"record {self.entry}"
        if isinstance(self.content, Mapping):
            made = self.content.get("recorded_at")
            where += f" (recorded {made[:64]})" if isinstance(made, str) else ""
        return f"{where}: {self.problem}"


@dataclass(frozen=True)
class StoreRead:
    """The store as read: the records a plan may use, and the entries set aside."""

    records: list[dict[str, Any]]
    set_aside: list[SetAside]

    def problems(self) -> str:
        """One line naming the entries set aside ("" when none), the first
        PROBLEMS_NAMED of them."""
        named = "; ".join(s.describe() for s in self.set_aside[:PROBLEMS_NAMED])
        more = len(self.set_aside) - PROBLEMS_NAMED
        return named + (f"; and {more} more" if more > 0 else "")


def _whole_file(problem: str, text: Any) -> StoreRead:
    content = text.decode(errors="replace") if isinstance(text, bytes) else text
    content = content[:SET_ASIDE_TEXT_CHARS] if isinstance(content, str) else _said_repr(content)
    return StoreRead([], [SetAside(None, problem, content)])


def read_store(text: str | bytes | Mapping | list | None) -> StoreRead:
    """The records of the store file (JSON text, parsed, or empty/missing = none).

    Every entry must be a record of this schema with finite, physical figures
    (record_problem). One that is not is set aside and named, never dropped quietly; the good
    entries stay usable, so one damaged entry is never why a healthy host cannot be deployed.
    A file that is no store at all (not JSON, another schema) is set aside whole."""
    if text is None or (isinstance(text, str | bytes) and not text.strip()):
        return StoreRead([], [])
    try:
        data = (
            bounded_json.loads(text, "the calibration store", parse_constant=_no_constant)
            if isinstance(text, str | bytes)
            else text
        )
    except ValueError as exc:  # bounded_json: not JSON, or nested past its depth
        problem = str(exc).removeprefix("the calibration store: ")
        if not problem.startswith("not JSON"):
            problem = f"not JSON ({problem})"
        return _whole_file(problem[:200], text)
    if isinstance(data, Mapping) and "records" in data:
        if data.get("schema") != STORE_SCHEMA:
            schema = shown(data.get("schema"))
            return _whole_file(f"store schema {schema}, not {STORE_SCHEMA!r}", text)
        data = data["records"]
    elif isinstance(data, Mapping):
        data = [data]
    if not isinstance(data, list):
        return _whole_file("a calibration store holds {schema, records: [...]}", text)
    if len(data) > MAX_STORE_ENTRIES:
        return _whole_file(
            f"{len(data)} entries, more than a store holds ({MAX_STORE_ENTRIES})", text
        )
    records, set_aside = [], []
    for index, entry in enumerate(data):
        problem = record_problem(entry)
        if problem:
            set_aside.append(SetAside(index, problem, entry))
        else:
            records.append(dict(entry))
    return StoreRead(records, set_aside)


def dump_store(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    return {"schema": STORE_SCHEMA, "records": [dict(r) for r in records]}


SET_ASIDE_SCHEMA = "sglang-fleet/calibrations-set-aside/1"


def dump_set_aside(read: StoreRead, store_path: str, when: str | None = None) -> dict[str, Any]:
    """The side file that keeps what the store set aside, for the operator to look at (an
    entry JSON cannot hold, a NaN in a record given as data, is kept as its text)."""
    return {
        "schema": SET_ASIDE_SCHEMA,
        "store": store_path,
        "set_aside_at": when or timestamp(),
        "entries": [
            {"entry": s.entry, "problem": s.problem, "content": _as_json(s.content)}
            for s in read.set_aside
        ],
    }


def _as_json(content: Any) -> Any:
    if bounded_json.depth_problem(content, bounded_json.MAX_DEPTH - 4):
        return shown(content)
    try:
        json.dumps(content, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return _said_repr(content)
    return content


def _said_repr(content: Any) -> str:
    try:
        return repr(content)[:SET_ASIDE_TEXT_CHARS]
    except (ValueError, RecursionError):  # a huge integer inside, or nesting repr gives up on
        return shown(content)


def _same_setting(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.get("server") == b.get("server") and a.get("key") == b.get("key")


def add_record(
    records: Iterable[Mapping[str, Any]], record: Mapping[str, Any], limit: int = STORE_LIMIT
) -> list[dict[str, Any]]:
    """The newest record first; an older one of the same flag set is replaced. A record the
    store's reader would set aside is refused (CalibrationError), never written."""
    problem = record_problem(record)
    if problem:
        raise CalibrationError(f"the record would not be read back: {problem}")
    kept = [dict(r) for r in records if not _same_setting(r, record)]
    return [dict(record), *kept][:limit]


# A secret value shorter than this is not looked for inside other text: the server's key is
# long, and a short one ("a") would be found in every name ("auto") and damage the record.
MIN_SECRET_VALUE_CHARS = 8


def _cleaned(read: StoreRead, secrets: tuple[str, ...]) -> StoreRead:
    """The store as read, its secrets removed (public_record) from every record kept and every
    entry set aside; a record that the cleaning leaves unusable is set aside and named."""
    records, set_aside = [], []
    for index, record in enumerate(read.records):
        public = public_record(record, secrets)
        problem = record_problem(public)
        if problem:
            set_aside.append(SetAside(index, f"after its secrets were removed: {problem}", public))
        else:
            records.append(public)
    for entry in read.set_aside:
        content = entry.content
        if isinstance(content, str):
            content = _without_values(content, secrets)
        else:
            content = public_record(content, secrets)
        set_aside.append(SetAside(entry.entry, entry.problem, content))
    return StoreRead(records, set_aside)


def store_update(
    store: Any,
    record: Mapping[str, Any],
    path: str = "calibration.json",
    server: str = "?",
    secrets: Iterable[str] = (),
) -> dict[str, Any]:
    """What the record step of a healthy start writes (docs/CALIBRATION.md, "The store"):

    {store: the store with `record` first, to write to `path`;
     record: `record` as the store holds it (cleaned of secrets), or None when it is not kept;
     set_aside: the side file's content (dump_set_aside), or None;
     set_aside_path: where it goes, beside the store;
     warning: which entries were set aside and why (naming the file and the server), or None}.

    Entries of the file on the host that no plan may use are moved to the side file, the good
    ones kept: the step never fails the start, and never drops what it cannot read unseen.
    Every record kept, written before or now, is cleaned of secrets (public_record: secret
    flags, entries named like a secret at any depth, and the `secrets` values themselves,
    the server's key as the record step knows it): the store is world-readable."""
    values = tuple(s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET_VALUE_CHARS)
    read = _cleaned(read_store(store if store not in (None, "") else None), values)
    problems = [] if not read.set_aside else [read.problems()]
    kept: dict[str, Any] | None = public_record(record, values)
    try:
        records = add_record(read.records, kept)
    except CalibrationError as exc:
        records, kept = read.records, None
        problems.append(f"this start's record is not kept: {exc}")
    set_aside, side_path = None, None
    if read.set_aside:
        stamp = timestamp().replace("-", "").replace(":", "")
        folder, name = posixpath.split(str(path))
        side_path = posixpath.join(folder, f"{posixpath.splitext(name)[0]}.set-aside-{stamp}.json")
        set_aside = dump_set_aside(read, str(path))
    warning = None
    if problems:
        moved = f"; set aside in {side_path}" if side_path else ""
        warning = _without_values(
            f"{path} (calibrations of server {server}): {' | '.join(problems)}{moved}; "
            f"{len(records)} record(s) kept",
            values,
        )
    return {
        "store": dump_store(records),
        "record": kept,
        "set_aside": set_aside,
        "set_aside_path": side_path,
        "warning": warning,
    }


# --- matching -----------------------------------------------------------------------------
def _norm(value: Any) -> Any:
    """Flag values compare by meaning: "8" == 8, "true" == True, 0.90 == "0.9"."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in {"true", "yes", "on"}:
            return True
        if text in {"false", "no", "off"}:
            return False
        if text in {"", "none", "null"}:
            return None
        number = finite_or_none(text)
        return number if number is not None else text
    number = finite_or_none(value)
    return number if number is not None else value


def _say(value: Any) -> str:
    """A value in a reason: as str() writes it when that is short and safe, else shown()."""
    if isinstance(value, str) and len(value) <= 40:
        return value
    if finite_or_none(value) is not None or value is None or isinstance(value, bool):
        return str(value)
    return shown(value)


def _dtype_known(dtype: Any) -> bool:
    return isinstance(dtype, str) and dtype in kv_cache.KV_ELEM_BYTES


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
        if _norm(mine) != _norm(theirs):
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
        if _norm(mine) != _norm(theirs):
            problems.append(f"{name} differs ({_say(mine)} vs {_say(theirs)})")
    for dtype in (key.get("kv_cache_dtype") or "auto", flags.get("kv_cache_dtype") or "auto"):
        if not _dtype_known(dtype):
            problems.append(f"kv_cache_dtype {_say(dtype)} has no known cell size")
    recorded = key.get("flags")
    if recorded is None or not complete:
        notes.append("other flags not " + ("recorded" if recorded is None else "given"))
        problems += _speculation_problems(recorded, flags)
        return problems
    skip = PREDICTED_FLAGS | NO_MEMORY_EFFECT_FLAGS | set(TOPOLOGY_FLAGS) | {"enable_dp_attention"}
    for name in sorted(set(recorded) | set(flags), key=str):
        if name in skip or _is_secret(name):
            continue
        if _norm(recorded.get(name)) != _norm(flags.get(name)):
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
        mine = _first(key.get(name), default)
        theirs = _first(flags.get(name), default)
        if theirs is None and name in ("mem_fraction_static", "chunked_prefill_size"):
            continue  # SGLang resolves it; compared after resolution by predict()
        if _norm(mine) != _norm(theirs):
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
        if {k: _norm(v) for k, v in had.items()} != {k: _norm(v) for k, v in wanted.items()}:
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
    host = _mapping(host)
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


# --- prediction -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    """A flag set's memory as predicted from a calibration record (GiB unless named)."""

    max_total_num_tokens: int
    kv_budget_gib: float
    free_after_graph_gib: float
    margin_gib: float
    max_safe_mem_fraction_static: float
    mem_fraction_static: float
    calibrated_mem_fraction_static: float
    pre_gib: float
    post_gib: float
    graph_delta_gib: float
    req_to_token_delta_gib: float
    cell_size_bytes: int
    recorded_at: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.free_after_graph_gib >= self.margin_gib

    @property
    def can_start(self) -> bool:
        return self.kv_budget_gib > 0 and self.max_total_num_tokens > 0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name, value in out.items():
            if isinstance(value, float):
                out[name] = round(value, 4)
        return out


def margin_for(margin_gib: float, chunked_prefill_size: int | None) -> float:
    """The free-memory margin for a prefill chunk (scaled up above 8192 tokens)."""
    chunk = chunked_prefill_size or MARGIN_CHUNK_TOKENS
    if chunk <= 0:  # chunked prefill disabled: a whole max_prefill_tokens (16384) batch
        chunk = 16384
    return margin_gib * max(1.0, chunk / MARGIN_CHUNK_TOKENS)


def graph_estimate_mib(shape: ModelShape, decode_bs: int, chunk: int, attn_dp: int = 1) -> float:
    """SGLang's graph reserve estimate: decode 2 MiB per batch size, prefill by buckets;
    attention DP adds bs x attn_dp x 3 MiB (x 4.5 above bs 300) for its padding."""
    decode = decode_bs * DECODE_GRAPH_MIB_PER_BS + kv_cache.attn_dp_graph_mib(decode_bs, attn_dp)
    if shape.is_mla:
        return decode + MLA_PREFILL_GRAPH_MIB
    buckets = kv_cache.prefill_graph_token_buckets(chunk) if chunk > 0 else []
    return decode + len(buckets) * MHA_PREFILL_GRAPH_MIB_PER_BUCKET


@dataclass(frozen=True)
class _Setting:
    """What SGLang resolves for one flag set (the parts memory depends on)."""

    fraction: float
    dtype: str
    chunk: int
    decode_bs: int
    page: int
    context: int
    requested_mrr: int | None
    max_total_tokens: int | None
    attn_dp: int = 1


def _resolve(
    values: Mapping[str, Any], shape: ModelShape, gpu_mib: float, tp: int, chunk_hint: Any
) -> _Setting:
    requested_mrr = _int(values.get("max_running_requests"))
    chunk = _int(_first(values.get("chunked_prefill_size"), chunk_hint))
    defaults = kv_cache.sglang_default_mem_fraction(
        gpu_mib, shape, tp, chunked_prefill_size=chunk, max_running_requests=requested_mrr
    )
    explicit_bs = _int(
        _first(values.get("cuda_graph_max_bs_decode"), values.get("cuda_graph_max_bs"))
    )
    fraction = finite_or_none(values.get("mem_fraction_static"))
    attn_dp = _int(values.get("attn_dp_size")) or 1
    dtype = values.get("kv_cache_dtype") or "auto"
    return _Setting(
        fraction=defaults.mem_fraction_static if fraction is None else fraction,
        dtype=dtype if isinstance(dtype, str) else "auto",  # match() refused any other
        chunk=defaults.chunked_prefill_size,
        decode_bs=explicit_bs if explicit_bs is not None else defaults.decode_cuda_graph_max_bs,
        page=_int(values.get("page_size")) or 1,
        context=_int(values.get("context_length")) or shape.context_length,
        requested_mrr=requested_mrr,
        max_total_tokens=_int(values.get("max_total_tokens")),
        attn_dp=attn_dp,
    )


def _resolved_mrr(setting: _Setting, tokens: int) -> int:
    if setting.requested_mrr is not None:
        return min(max(1, setting.requested_mrr), tokens // 2)
    return kv_cache.sglang_default_max_running_requests(tokens, setting.context)


def _recorded_kv_bytes(
    measured: Mapping[str, Any], old: _Setting, cell_old: int, shape: ModelShape
) -> float:
    """KV bytes the recorded start allocated: its token count is exact, its GiB figures are
    rounded to 0.01, so the count wins unless --max-total-tokens capped it."""
    tokens = int(measured["max_total_num_tokens"])
    if old.max_total_tokens is None and tokens > 0:
        return float(tokens * cell_old)
    rest = kv_cache.rest_gib(
        float(measured["pre_gib"]),
        float(measured["post_gib"]),
        old.fraction,
        kv_cache.multimodal_reserve_gib(shape),
    )
    return rest * kv_cache.GIB


def predict(
    record: Mapping[str, Any],
    flags: Mapping[str, Any],
    host: Mapping[str, Any],
    shape: ModelShape,
    margin_gib: float = 5.0,
    *,
    extra_weight_gib: Callable[[int], float] | None = None,
    draft_budget_layers: int = 0,
) -> Prediction:
    """Predict max_total_num_tokens and free memory after CUDA graph capture for `flags`.

    The record must have passed `match` for these flags (same model, GPUs, topology).
    extra_weight_gib(attn_dp_size): GiB per GPU the layout holds beyond plain TP
    (sglang_fleet.capacity.attention_dp); a record at another attention-DP size is its measured
    weights
    plus the difference, which comes out of the KV pool (the fraction fixes weights + KV).
    draft_budget_layers: the draft layers speculative decoding adds to the target's bytes per
    KV token, each of the target's per-layer size (speculative.DraftMemory.budget_layers);
    match() let through only a record of the same speculative flags, so both sides carry it.
    """
    key, measured = record["key"], record["measured"]
    tp = int(_int(flags.get("tp_size")) or 1)
    gpu_mib = float(
        _first(
            finite_or_none(host.get("gpu_memory_mib")), finite_or_none(key.get("gpu_memory_mib"))
        )
    )
    old = _resolve(key, shape, gpu_mib, tp, measured.get("chunked_prefill_size"))
    new = _resolve(flags, shape, gpu_mib, tp, None)
    pre, post = float(measured["pre_gib"]), float(measured["post_gib"])
    cell_old = _with_draft(
        kv_cache.cell_size_bytes(shape, old.dtype, tp), draft_budget_layers, shape
    )
    cell_new = _with_draft(
        kv_cache.cell_size_bytes(shape, new.dtype, tp), draft_budget_layers, shape
    )
    notes = []
    same = abs(new.fraction - old.fraction) < SAME_FRACTION
    grow = 0.0 if same else (new.fraction - old.fraction) * pre
    weight_delta = 0.0
    if extra_weight_gib is not None and new.attn_dp != old.attn_dp:
        weight_delta = extra_weight_gib(new.attn_dp) - extra_weight_gib(old.attn_dp)
        notes.append(
            f"weights {weight_delta:+.2f} GiB per GPU (attention DP {old.attn_dp} -> "
            f"{new.attn_dp}, computed from config.json)"
        )
    kv_bytes = (
        _recorded_kv_bytes(measured, old, cell_old, shape) + (grow - weight_delta) * kv_cache.GIB
    )
    tokens = kv_cache.max_total_num_tokens(kv_bytes / kv_cache.GIB, cell_new, new.page)
    if new.max_total_tokens is not None:
        tokens = min(tokens, new.max_total_tokens // new.page * new.page)
    if cell_new != cell_old:
        notes.append(f"cell size {cell_old} -> {cell_new} B/token ({old.dtype} -> {new.dtype})")
    graph_delta = (
        graph_estimate_mib(shape, new.decode_bs, new.chunk, new.attn_dp)
        - graph_estimate_mib(shape, old.decode_bs, old.chunk, old.attn_dp)
    ) / 1024
    if graph_delta:
        notes.append(
            f"CUDA graphs {graph_delta:+.2f} GiB (decode bs {old.decode_bs} -> {new.decode_bs},"
            f" prefill chunk {old.chunk} -> {new.chunk}; SGLang's estimate)"
        )
    req_delta = _req_to_token_growth(measured, old, new, tokens)
    free = float(measured["free_after_graph_gib"]) - grow - graph_delta - req_delta
    # SGLang divides the prefill chunk by the attention-DP size (each rank prefills its own).
    margin = margin_for(
        margin_gib, max(1, new.chunk // new.attn_dp) if new.chunk > 0 else new.chunk
    )
    safe = (
        old.fraction
        + (float(measured["free_after_graph_gib"]) - graph_delta - req_delta - margin) / pre
    )
    return Prediction(
        max_total_num_tokens=tokens,
        kv_budget_gib=kv_bytes / kv_cache.GIB,
        free_after_graph_gib=free,
        margin_gib=margin,
        max_safe_mem_fraction_static=kv_cache.floor_to(safe, 0.001),
        mem_fraction_static=new.fraction,
        calibrated_mem_fraction_static=old.fraction,
        pre_gib=pre,
        post_gib=post - weight_delta,
        graph_delta_gib=graph_delta,
        req_to_token_delta_gib=req_delta,
        cell_size_bytes=cell_new,
        recorded_at=record.get("recorded_at"),
        notes=notes,
    )


def _with_draft(cell: int, draft_layers: int, shape: ModelShape) -> int:
    """The target's bytes per KV token with 0.5.23's share for a draft of `draft_layers`."""
    return cell + int(cell * draft_layers / shape.num_layers)


def _req_to_token_growth(
    measured: Mapping[str, Any], old: _Setting, new: _Setting, tokens: int
) -> float:
    """GiB more the request table takes. Only growth is counted: memory a smaller table
    would free is not relied on (the double, for one, does not model the table)."""
    old_mrr = _int(measured.get("max_running_requests"))
    old_context = _int(measured.get("context_len")) or old.context
    if old_mrr is None or tokens <= 0:
        return 0.0
    new_mrr = _resolved_mrr(new, tokens)
    growth = (new_mrr + 1) * new.context - (old_mrr + 1) * old_context
    return max(0.0, growth * REQ_TO_TOKEN_BYTES / kv_cache.GIB)


# --- the planner's entry point ----------------------------------------------------------------
MODES = ("enforce", "warn", "ignore")


@dataclass
class Applied:
    """What calibration contributes to one plan."""

    prediction: Prediction | None
    record: dict[str, Any] | None
    reason: str
    warnings: list[dict[str, str]] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)


def _issue(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def oom_issue(prediction: Prediction, mode: str) -> dict[str, str] | None:
    """The free-after-graph finding when the prediction is below the margin, else None."""
    if prediction.fits:
        return None
    overruled = (
        " Reported as a warning because calibration_mode is 'warn'." if mode == "warn" else ""
    )
    return _issue(
        "oom_risk_mem_fraction",
        f"mem_fraction_static {prediction.mem_fraction_static:.3f} leaves a predicted "
        f"{prediction.free_after_graph_gib:.2f} GiB free after CUDA graph capture, below the "
        f"{prediction.margin_gib:.1f} GiB margin (calibrated: "
        f"{prediction.calibrated_mem_fraction_static:.3f} on {prediction.recorded_at}): expect "
        "CUDA out of memory during CUDA graph capture or a large prefill. The highest fraction "
        f"that keeps the margin is {prediction.max_safe_mem_fraction_static:.3f}.{overruled}",
    )


def apply(
    records: Any,
    flags: Mapping[str, Any],
    host: Mapping[str, Any],
    shape: ModelShape,
    *,
    margin_gib: float = 5.0,
    mode: str = "enforce",
    flags_complete: bool = True,
    extra_weight_gib: Callable[[int], float] | None = None,
    draft_budget_layers: int = 0,
) -> Applied:
    """Match, predict and judge: the planner's use of the host's calibration records.

    mode: 'enforce' (a flag set predicted below the margin is an error), 'warn' (the same
    finding as a warning: the operator overrules it) or 'ignore' (estimates only).
    """
    if mode not in MODES:
        raise CalibrationError(f"calibration_mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "ignore":
        return Applied(None, None, "calibration_mode is 'ignore'")
    # Records given as data pass the store's rule too: whoever hands them over, what the rule
    # refuses never plans (and never refuses a flag set).
    found = read_store(records)
    record, reason = match(found.records, flags, host, flags_complete=flags_complete)
    if record is None and found.set_aside and not found.records:
        reason = f"no calibration usable: {found.problems()}"
    if record is None:
        warning = _issue(
            "calibration_mismatch",
            f"{reason}. The plan falls back to estimates from the GPU size and the checkpoint.",
        )
        return Applied(None, None, reason, warnings=[warning])
    prediction = predict(
        record,
        flags,
        host,
        shape,
        margin_gib,
        extra_weight_gib=extra_weight_gib,
        draft_budget_layers=draft_budget_layers,
    )
    applied = Applied(prediction, record, reason)
    issue = oom_issue(prediction, mode) if prediction.can_start else None
    if issue is not None:
        (applied.errors if mode == "enforce" else applied.warnings).append(issue)
    return applied
