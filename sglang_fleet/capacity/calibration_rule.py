"""The rule a calibration record passes before any plan reads it: its shape, its key, figures
typed and bounded, a pool and a free figure that physics allows (`record_problem`).

Whoever hands a record over (the host's store, a filter's argument, a record built from a
log), what this rule refuses never plans. docs/CALIBRATION.md, "The store".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sglang_fleet.capacity import kv_cache
from sglang_fleet.capacity.calibration import SCHEMA, TOPOLOGY_FLAGS
from sglang_fleet.capacity.server_log import StartupLog
from sglang_fleet.module_utils import bounded_json
from sglang_fleet.module_utils.typed_number import NumberError, Range, finite_or_none, shown
from sglang_fleet.module_utils.typed_number import read as read_number

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
RECORD_FIELDS = ("schema", "recorded_at", "server", "config_hash", "sources", "key", "measured")
KEY_FIELDS = (
    *_KEY_COUNTS, *_KEY_NAMES, "device", "gpu_memory_mib", "mem_fraction_static",
    "kv_cache_dtype", "flags",
)  # fmt: skip
MEASURED_FIELDS = (*_GIB_FIGURES, *_COUNT_FIGURES, "post_capture_kv_sizing")
# How far a GPU record's KV pool may exceed what its fraction leaves for it (_pool_problem):
# the figures' two decimals, and a fraction inferred from those figures rounded down.
POOL_SLACK_FRACTION = 0.01


def no_constant(name: str) -> Any:
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


def figures_problem(measured: Mapping[str, Any], what: str = "measured") -> str | None:
    problems = (
        *(_figure_problem(f"{what}.{n}", measured.get(n), MAX_GPU_GIB) for n in _GIB_FIGURES),
        *(
            _figure_problem(f"{what}.{n}", measured.get(n), MAX_POOL_TOKENS, integer=True)
            for n in _COUNT_FIGURES
        ),
    )
    return next((p for p in problems if p), None)


# The parsed log's figures (server_log.StartupLog) a record or its key reads, by kind.
_LOG_GIB = ("pre_gib", "post_gib", "weight_gib", "kv_size_gib", "pool_end_avail_gib",
            "graph_end_avail_gib", "startup_avail_gib", "multimodal_reserve_gib")  # fmt: skip
_LOG_COUNTS = ("kv_tokens", "max_total_num_tokens", "chunked_prefill_size",
               "max_running_requests", "context_len", "decode_graph_max_bs")  # fmt: skip


def log_problem(startup: StartupLog) -> str | None:
    """Why the log's own figures are no measurement (a line's number past any device: a
    400-digit count, 1e999 GiB), before any arithmetic is done with them."""
    problems = (
        *(_figure_problem(f"the log's {n}", getattr(startup, n), MAX_GPU_GIB) for n in _LOG_GIB),
        *(
            _figure_problem(f"the log's {n}", getattr(startup, n), MAX_POOL_TOKENS, integer=True)
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
    missing = [name for name in REQUIRED if record["measured"].get(name) is None]
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
    if dtype is not None and not dtype_known(dtype):
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
    problem = figures_problem(measured) or _key_problem(key)
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
        return f"the record is no JSON the store can hold ({said(exc, 120)})"
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


def said(exc: BaseException, limit: int = 300) -> str:
    """An exception as a reason: its message, bounded (a message can hold a long value, and
    the str() of an exception that carries a huge integer can itself raise)."""
    try:
        text = str(exc)
    except Exception:  # its message is the one thing it cannot give
        text = ""
    text = text or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


REQUIRED = ("pre_gib", "post_gib", "max_total_num_tokens", "free_after_graph_gib")


def dtype_known(dtype: Any) -> bool:
    return isinstance(dtype, str) and dtype in kv_cache.KV_ELEM_BYTES
