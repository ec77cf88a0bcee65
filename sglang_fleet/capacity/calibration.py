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
import math
import posixpath
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from sglang_fleet import server_secrets
from sglang_fleet.ansible_values import finite_number
from sglang_fleet.capacity import kv_cache, logged_flags
from sglang_fleet.capacity.model_config import ModelShape
from sglang_fleet.capacity.server_log import Calibration, parse_log
from sglang_fleet.module_utils import bounded_json

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
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(f"{text}\n{int(weight_bytes)}".encode()).hexdigest()
    return f"sha256:{digest[:32]}"


def _is_secret(name: str) -> bool:
    return server_secrets.is_secret(name)


def public_flags(flags: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The flag set without secrets (a record is stored in clear on the host): the one list
    of secret flags is sglang_fleet/server_secrets.py's."""
    if flags is None:
        return None
    return server_secrets.public_flags(flags)


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


def public_server_info(info: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The part of /server_info a record uses: SERVER_INFO_FIELDS and rank 0's memory_usage."""
    if not isinstance(info, Mapping):
        return None
    kept: dict[str, Any] = {name: info[name] for name in SERVER_INFO_FIELDS if name in info}
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], Mapping):
        usage = states[0].get("memory_usage")
        if isinstance(usage, Mapping):
            kept["internal_states"] = [{"memory_usage": dict(usage)}]
    return kept


def _int(value: Any) -> int | None:
    number = finite_number(value)
    return None if number is None else int(number)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _graph_total_gib(memory_usage: Mapping[str, Any]) -> float | None:
    graph = memory_usage.get("graph")
    if isinstance(graph, Mapping):
        parts = [finite_number(v) for v in graph.values()]
        return sum(p for p in parts if p is not None)
    return finite_number(graph)


def _memory_from_server_info(info: Mapping[str, Any]) -> dict[str, float | None]:
    """/server_info's figures (rank 0 only). SGLang reports no pre-load free memory there:
    post ~ KV + graphs + what was still free, pre ~ post + weights (both a little low)."""
    states = info.get("internal_states") or [{}]
    usage = (states[0] if isinstance(states[0], Mapping) else {}).get("memory_usage") or {}
    weight, kv = finite_number(usage.get("weight")), finite_number(usage.get("kvcache"))
    if weight is not None and weight < 0:
        weight = None  # the log's negative "mem usage": free memory rose, no weights measured
    free, graph = finite_number(usage.get("startup_available")), _graph_total_gib(usage)
    post = None
    if None not in (kv, free, graph):
        post = kv + free + graph  # type: ignore[operator]
    return {
        "weight_gib": weight,
        "kv_size_gib": kv,
        "free_after_graph_gib": free,
        "graph_gib": graph,
        "post_gib": post,
        "pre_gib": None if post is None or weight is None else post + weight,
        "max_total_num_tokens": finite_number(usage.get("token_capacity")),
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


def _record_key(
    cal: Calibration, info: Mapping[str, Any], key: Mapping[str, Any], measured: dict
) -> dict[str, Any]:
    flags = key.get("flags")
    # logged_flags: the logged run's flags as the caller found them
    # (sglang_fleet.capacity.logged_flags:
    # stated by the operator, or inferred from the log's own lines); the start's own flag set
    # beats them, and what the log or /server_info says beats both.
    known = dict(key.get("logged_flags") or {}) | dict(flags or {})
    # Then what the lines alone show (no config.json here: the KV line's own size).
    known = logged_flags.infer(cal, stated=known).flags | known
    fingerprint = key.get("model_fingerprint")
    if fingerprint is None and key.get("model_config") is not None:
        fingerprint = model_fingerprint(key["model_config"], int(key["weight_bytes"]))
    # The fraction SGLang reports beats the flags.
    fraction = finite_number(
        _first(
            info.get("mem_fraction_static"),
            cal.server_args.get("mem_fraction_static"),
            known.get("mem_fraction_static"),
        )
    )
    return {
        "model_path": _first(key.get("model_path"), _resolved("model_path", info, cal, known)),
        "model_fingerprint": fingerprint,
        "architecture": cal.architecture,
        # cpu for SGLang's CPU engine (its "avail mem" is host RAM, docs/CPU-SERVERS.md).
        "device": cal.device or "cuda",
        "gpu_name": key.get("gpu_name"),
        "gpu_memory_mib": finite_number(key.get("gpu_memory_mib")),
        "sglang_version": _first(key.get("sglang_version"), info.get("version")),
        "tp_size": _int(_resolved("tp_size", info, cal, known)) or 1,
        **_attn_dp_key(info, cal, known),
        "pp_size": _int(_resolved("pp_size", info, cal, known)) or 1,
        "nnodes": _int(_resolved("nnodes", info, cal, known)) or 1,
        "mem_fraction_static": _first(fraction, finite_number(known.get("mem_fraction_static"))),
        "kv_cache_dtype": str(_resolved("kv_cache_dtype", info, cal, known) or "auto"),
        "page_size": _int(_resolved("page_size", info, cal, known)) or 1,
        "chunked_prefill_size": measured["chunked_prefill_size"],
        "max_running_requests": _int(_requested("max_running_requests", flags, cal)),
        "cuda_graph_max_bs_decode": _int(
            _first(
                _requested("cuda_graph_max_bs_decode", flags, cal),
                _requested("cuda_graph_max_bs", flags, cal),
            )
        ),
        "context_length": _int(_requested("context_length", flags, cal)),
        "max_total_tokens": _int(_requested("max_total_tokens", flags, cal)),
        "flags": public_flags(flags),
    }


def _attn_dp_key(info: Mapping[str, Any], cal: Calibration, known: Mapping) -> dict[str, int]:
    """dp_size and attn_dp_size as SGLang resolves them: the deprecated `--enable-dp-attention
    --dp-size N` is attn_dp_size N with dp_size 1 (docs/ATTENTION-DP.md)."""
    dp = _int(_resolved("dp_size", info, cal, known)) or 1
    attn = _int(_resolved("attn_dp_size", info, cal, known)) or 1
    if _norm(_resolved("enable_dp_attention", info, cal, known)) is True and attn == 1:
        attn, dp = dp, 1
    return {"dp_size": dp, "attn_dp_size": attn}


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
    and optionally server, config_hash, recorded_at. Raises CalibrationError when the
    sources lack the memory figures a plan needs.
    """
    key = dict(key or {})
    info = dict(server_info or {})
    cal = log_text if isinstance(log_text, Calibration) else parse_log(log_text or "")
    measured = _measured(cal, info)
    missing = [name for name in _REQUIRED if measured[name] is None]
    if missing:
        raise CalibrationError(
            "the start-up log and /server_info lack " + ", ".join(missing) + " (need SGLang's "
            "'Load weight begin/end', 'Capture ... CUDA graph end' and 'max_total_num_tokens=' "
            "lines, or /server_info internal_states[0].memory_usage)"
        )
    record_key = _record_key(cal, info, key, measured)
    # The CPU engine's pool does not follow the fraction (docs/CPU-SERVERS.md): a CPU record
    # may go without one; a GPU record is its fraction's measurement.
    if record_key["mem_fraction_static"] is None and record_key["device"] != "cpu":
        raise CalibrationError("neither /server_info nor the log says mem_fraction_static")
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


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _figure_problem(name: str, value: Any, limit: float) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return f"measured.{name} is {value!r}, not a finite number"
    if not -1 <= value <= limit:  # chunked_prefill_size -1 means disabled
        return f"measured.{name} {value:g} is outside -1..{limit:g}"
    return None


def _shape_problem(record: Any) -> str | None:
    if not isinstance(record, Mapping):
        return f"not a record (JSON {type(record).__name__})"
    if record.get("schema") != SCHEMA:
        return f"record schema {record.get('schema')!r}, not {SCHEMA}"
    if not isinstance(record.get("key"), Mapping) or not isinstance(
        record.get("measured"), Mapping
    ):
        return "a record holds a key and measured figures (mappings)"
    missing = [name for name in _REQUIRED if record["measured"].get(name) is None]
    return f"measured.{missing[0]} is missing" if missing else None


def _physical_problem(key: Mapping[str, Any], measured: Mapping[str, Any]) -> str | None:
    problems = [_figure_problem(n, measured.get(n), MAX_GPU_GIB) for n in _GIB_FIGURES]
    problems += [_figure_problem(n, measured.get(n), MAX_POOL_TOKENS) for n in _COUNT_FIGURES]
    problem = next((p for p in problems if p), None)
    if problem:
        return problem
    pre, post = float(measured["pre_gib"]), float(measured["post_gib"])
    free = float(measured["free_after_graph_gib"])
    gpu_mib = finite_number(key.get("gpu_memory_mib"))
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


def record_problem(record: Any) -> str | None:
    """Why an entry is not a record this version can plan with (None: it is). The one rule
    for both sides of the store: build_record and add_record refuse what read_store would set
    aside, so nothing is written that the next read refuses."""
    return _shape_problem(record) or _physical_problem(record["key"], record["measured"])


# What a set-aside entry keeps of what it replaced: enough for the operator to see it, bounded.
SET_ASIDE_TEXT_CHARS = 65536


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
            where += f" (recorded {made})" if isinstance(made, str) else ""
        return f"{where}: {self.problem}"


@dataclass(frozen=True)
class StoreRead:
    """The store as read: the records a plan may use, and the entries set aside."""

    records: list[dict[str, Any]]
    set_aside: list[SetAside]

    def problems(self) -> str:
        """One line naming every entry set aside ("" when none)."""
        return "; ".join(s.describe() for s in self.set_aside)


def _whole_file(problem: str, text: Any) -> StoreRead:
    content = text.decode(errors="replace") if isinstance(text, bytes) else text
    if isinstance(content, str):
        content = content[:SET_ASIDE_TEXT_CHARS]
    else:
        content = repr(content)[:SET_ASIDE_TEXT_CHARS]
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
            return _whole_file(f"store schema {data.get('schema')!r}, not {STORE_SCHEMA!r}", text)
        data = data["records"]
    elif isinstance(data, Mapping):
        data = [data]
    if not isinstance(data, list):
        return _whole_file("a calibration store holds {schema, records: [...]}", text)
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
    """The side file that keeps what the store set aside, for the operator to look at."""
    return {
        "schema": SET_ASIDE_SCHEMA,
        "store": store_path,
        "set_aside_at": when or timestamp(),
        "entries": [
            {"entry": s.entry, "problem": s.problem, "content": s.content} for s in read.set_aside
        ],
    }


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


def store_update(
    store: Any, record: Mapping[str, Any], path: str = "calibration.json", server: str = "?"
) -> dict[str, Any]:
    """What the record step of a healthy start writes (docs/CALIBRATION.md, "The store"):

    {store: the store with `record` first, to write to `path`;
     set_aside: the side file's content (dump_set_aside), or None;
     set_aside_path: where it goes, beside the store;
     warning: which entries were set aside and why (naming the file and the server), or None}.

    Entries of the file on the host that no plan may use are moved to the side file, the good
    ones kept: the step never fails the start, and never drops what it cannot read unseen."""
    read = read_store(store if store not in (None, "") else None)
    problems = [] if not read.set_aside else [read.problems()]
    try:
        records = add_record(read.records, record)
    except CalibrationError as exc:
        records = read.records
        problems.append(f"this start's record is not kept: {exc}")
    set_aside, side_path = None, None
    if read.set_aside:
        stamp = timestamp().replace("-", "").replace(":", "")
        folder, name = posixpath.split(path)
        side_path = posixpath.join(folder, f"{posixpath.splitext(name)[0]}.set-aside-{stamp}.json")
        set_aside = dump_set_aside(read, path)
    warning = None
    if problems:
        moved = f"; set aside in {side_path}" if side_path else ""
        warning = (
            f"{path} (calibrations of server {server}): {' | '.join(problems)}{moved}; "
            f"{len(records)} record(s) kept"
        )
    return {
        "store": dump_store(records),
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
        number = finite_number(text)
        return number if number is not None else text
    number = finite_number(value)
    return number if number is not None else value


def _dtype_known(dtype: str) -> bool:
    return dtype in kv_cache.KV_ELEM_BYTES


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
            problems.append(f"{what} differs ({mine} vs {theirs})")
    return problems


def _flag_problems(
    key: Mapping[str, Any], flags: Mapping[str, Any], notes: list[str], complete: bool
) -> list[str]:
    problems = []
    for name in TOPOLOGY_FLAGS:
        mine, theirs = _norm(key.get(name) or 1), _norm(flags.get(name) or 1)
        if mine != theirs:
            problems.append(f"{name} differs ({key.get(name) or 1} vs {flags.get(name) or 1})")
    for dtype in (
        str(key.get("kv_cache_dtype") or "auto"),
        str(flags.get("kv_cache_dtype") or "auto"),
    ):
        if not _dtype_known(dtype):
            problems.append(f"kv_cache_dtype {dtype} has no known cell size")
    recorded = key.get("flags")
    if recorded is None or not complete:
        notes.append("other flags not " + ("recorded" if recorded is None else "given"))
        return problems
    skip = PREDICTED_FLAGS | NO_MEMORY_EFFECT_FLAGS | set(TOPOLOGY_FLAGS) | {"enable_dp_attention"}
    for name in sorted(set(recorded) | set(flags)):
        if name in skip or _is_secret(name):
            continue
        if _norm(recorded.get(name)) != _norm(flags.get(name)):
            problems.append(f"{name} differs ({recorded.get(name)!r} vs {flags.get(name)!r})")
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
            changes.append(f"{name} {mine} -> {theirs}")
    return changes


def check_record(
    record: Mapping[str, Any],
    flags: Mapping[str, Any],
    host: Mapping[str, Any],
    flags_complete: bool = True,
) -> tuple[list[str], list[str]]:
    """(problems that make the record unusable, notes) for one record and flag set."""
    notes: list[str] = []
    if record.get("schema") != SCHEMA:
        return [f"record schema {record.get('schema')!r} is not {SCHEMA}"], notes
    key, measured = record.get("key") or {}, record.get("measured") or {}
    if any(measured.get(name) is None for name in _REQUIRED):
        return ["record lacks memory figures"], notes
    if measured.get("post_capture_kv_sizing"):
        return ["KV pool sized after CUDA graph capture: another memory model"], notes
    problems = _identity_problems(key, host, notes)
    problems += _flag_problems(key, flags, notes, flags_complete)
    return problems, notes


def _describe(record: Mapping[str, Any]) -> str:
    key = record.get("key") or {}
    fraction = key.get("mem_fraction_static")
    return (
        f"calibration of {record.get('recorded_at')} (tp {key.get('tp_size')}, "
        f"{key.get('kv_cache_dtype')} at {fraction:.3f})"
        if isinstance(fraction, int | float)
        else f"calibration of {record.get('recorded_at')}"
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
    host = dict(host or {})
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
    fraction = finite_number(values.get("mem_fraction_static"))
    attn_dp = _int(values.get("attn_dp_size")) or 1
    return _Setting(
        fraction=defaults.mem_fraction_static if fraction is None else fraction,
        dtype=str(values.get("kv_cache_dtype") or "auto"),
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
) -> Prediction:
    """Predict max_total_num_tokens and free memory after CUDA graph capture for `flags`.

    The record must have passed `match` for these flags (same model, GPUs, topology).
    extra_weight_gib(attn_dp_size): GiB per GPU the layout holds beyond plain TP
    (sglang_fleet.capacity.attention_dp); a record at another attention-DP size is its measured
    weights
    plus the difference, which comes out of the KV pool (the fraction fixes weights + KV).
    """
    key, measured = record["key"], record["measured"]
    tp = int(_int(flags.get("tp_size")) or 1)
    gpu_mib = float(
        _first(finite_number(host.get("gpu_memory_mib")), finite_number(key.get("gpu_memory_mib")))
    )
    old = _resolve(key, shape, gpu_mib, tp, measured.get("chunked_prefill_size"))
    new = _resolve(flags, shape, gpu_mib, tp, None)
    pre, post = float(measured["pre_gib"]), float(measured["post_gib"])
    cell_old = kv_cache.cell_size_bytes(shape, old.dtype, tp)
    cell_new = kv_cache.cell_size_bytes(shape, new.dtype, tp)
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
) -> Applied:
    """Match, predict and judge: the planner's use of the host's calibration records.

    mode: 'enforce' (a flag set predicted below the margin is an error), 'warn' (the same
    finding as a warning: the operator overrules it) or 'ignore' (estimates only).
    """
    if mode not in MODES:
        raise CalibrationError(f"calibration_mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "ignore":
        return Applied(None, None, "calibration_mode is 'ignore'")
    found = read_store(records).records if _is_text(records) else records
    record, reason = match(found, flags, host, flags_complete=flags_complete)
    if record is None:
        warning = _issue(
            "calibration_mismatch",
            f"{reason}. The plan falls back to estimates from the GPU size and the checkpoint.",
        )
        return Applied(None, None, reason, warnings=[warning])
    prediction = predict(record, flags, host, shape, margin_gib, extra_weight_gib=extra_weight_gib)
    applied = Applied(prediction, record, reason)
    issue = oom_issue(prediction, mode) if prediction.can_start else None
    if issue is not None:
        (applied.errors if mode == "enforce" else applied.warnings).append(issue)
    return applied


def _is_text(value: Any) -> bool:
    return isinstance(value, str | bytes)
