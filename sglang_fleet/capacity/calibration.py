"""Calibration: what one start of a server measured, and plans made from it (the model, its
constants, CalibrationError and the value readers the calibration_* modules share).

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

This module holds the model's constants, CalibrationError and the value readers every
calibration module shares. The rest, one job a module (the deploy's filters and the autotune
loop use these):

    calibration_record.build_record(log_text, server_info, key) -> record (dict, JSON-safe)
    calibration_rule.record_problem(record) -> reason | None  (the rule every record passes)
    calibration_store.read_store(text) / store_update(...) / add_record / dump_store
    calibration_match.match(records, flags, host) -> (record | None, reason)
    calibration_predict.predict(record, flags, host, shape, margin_gib=...) -> Prediction
    calibration_apply.apply(records, flags, host, shape, ...) -> Applied  (the planner's entry)

`flags` are SGLang field names as the server is launched with (tp_size, mem_fraction_static,
kv_cache_dtype, ...); `host` holds gpu_name, gpu_memory_mib, sglang_version and the
model's fingerprint (`calibration_record.model_fingerprint(config, weight_bytes)`).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from sglang_fleet import server_secrets
from sglang_fleet.module_utils.typed_number import NumberError, Range, finite_or_none
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


def is_secret(name: str) -> bool:
    return server_secrets.is_secret(name)


_INTEGER = Range(integer=True)


def count_or_none(value: Any) -> int | None:
    """A count as a record, a flag or /server_info holds it: an integer (or its text), else
    None (a fraction, a boolean, NaN, a huge integer, anything else)."""
    try:
        return int(read_number(value, "a count", _INTEGER))
    except NumberError:
        return None


def text_or_none(value: Any) -> str | None:
    """A name (model path, GPU, version) as a record holds it: text, else nothing."""
    return value if isinstance(value, str) else None


def first_given(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def as_dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def timestamp() -> str:
    """Now, as records and side files are stamped (UTC, seconds)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def norm(value: Any) -> Any:
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
