"""The capacity planner's inputs, typed: its arguments and host facts checked and converted.

Every argument (ARG_DEFAULTS) and host fact (HOST_KEYS) is typed here before any arithmetic:
Ansible extra-vars arrive as strings ("8"), so numbers are converted; an input outside its
range (NaN, infinite, negative, zero where zero means nothing, see _INT_RANGES/_FLOAT_RANGES),
an unknown name or a value of the wrong kind raises PlanInputError naming the argument (the
command line's exit status 2, the Ansible filter's failed task).
"""

from __future__ import annotations

from typing import Any

from sglang_fleet.capacity import (
    calibration_apply,
    kv_cache,
    logged_flags,
    speculative,
)
from sglang_fleet.capacity.server_log import StartupLog, parse_log
from sglang_fleet.module_utils import typed_number
from sglang_fleet.module_utils.typed_number import Range, shown

# Flags of a server this planner reads (a server's plan_args); the rest do not change its
# arithmetic.
PLANNER_FLAGS = (
    "tp_size",
    "dp_size",
    "attn_dp_size",
    "enable_dp_attention",
    "mem_fraction_static",
    "kv_cache_dtype",
    "enable_hierarchical_cache",
    "hicache_size",
    "hicache_ratio",
    "chunked_prefill_size",
    "max_running_requests",
    "context_length",
    "page_size",
    "device",
    "max_total_tokens",
    # Speculative decoding (sglang_fleet.capacity.speculative, docs/SPECULATIVE.md): the draft's
    # config.json and checkpoint size come with the plan (speculative_draft_config and
    # speculative_draft_weight_bytes), read from speculative_draft_model_path by the caller.
    *speculative.FLAGS,
)
DEVICES = ("cuda", "cpu")
# What a flag set that turns speculation on without --max-running-requests gets (SGLang resets
# it to 48): a warning, or an error that blocks the rollout (sglang_server_speculation_reset).
SPECULATION_RESET_MODES = ("warn", "refuse")

# Free GPU memory that must remain after CUDA graph capture for a large prefill to run:
# its activations (a few GiB for an 8k-token chunk of a 7k-hidden MoE) plus allocator
# fragmentation. Chosen against the Kimi job's runs (docs/THE-JOB.md: Kimi-K2.5 int4, 8 GPUs,
# calibrated at 0.85 with 11.0 GiB free after capture, pre = 94.19 GiB): 0.88 and 0.90
# ran (8.2 and 6.3 GiB predicted free), 0.93 ran out of memory in a large prefill
# (3.5 GiB). Any margin in (3.5, 6.3) separates them; 5 GiB sits in the middle.
MIN_FREE_AFTER_GRAPH_GIB = 5.0
DEFAULT_AVG_INPUT_LEN = 1024
DEFAULT_AVG_OUTPUT_LEN = 1024

ARG_DEFAULTS: dict[str, Any] = {
    "tp_size": 1,
    "dp_size": 1,
    # Attention data parallelism (docs/ATTENTION-DP.md); enable_dp_attention is the
    # deprecated spelling (with dp_size as the attention-DP size).
    "attn_dp_size": 1,
    "enable_dp_attention": False,
    "mem_fraction_static": None,
    "kv_cache_dtype": "auto",
    "enable_hierarchical_cache": False,
    "hicache_size": 0,
    "hicache_ratio": None,
    "chunked_prefill_size": None,
    "max_running_requests": None,
    "context_length": None,
    "page_size": 1,
    "avg_input_len": DEFAULT_AVG_INPUT_LEN,
    "avg_output_len": DEFAULT_AVG_OUTPUT_LEN,
    "per_request_tok_s": None,
    "calibration_log": None,
    # The calibration log's run's flags where its log does not say them (logged_flags.STATABLE):
    # never taken from the flags being planned.
    "calibration_log_flags": None,
    "min_free_after_graph_gib": MIN_FREE_AFTER_GRAPH_GIB,
    # Calibration records (sglang_fleet.capacity.calibration): one, a list, the host's store file as
    # parsed or as JSON text. server_flags: the server's whole flag set, so that every flag
    # a record depends on is compared; sglang_version: the installed version.
    "calibration": None,
    "calibration_mode": "enforce",
    "server_flags": None,
    "sglang_version": None,
    "cuda_graph_max_bs_decode": None,
    "device": "cuda",
    "max_total_tokens": None,
    # Memory bandwidth per GPU for the decode roofline; None: attention_dp.GPU_BANDWIDTH_GBS by
    # name.
    "gpu_memory_bandwidth_gbs": None,
    # False: leave out the table of every attention-DP size (the table's own plans).
    "plan_layouts": True,
    "speculative_algorithm": None,
    "speculative_draft_model_path": None,
    "speculative_num_steps": None,
    "speculative_eagle_topk": None,
    "speculative_num_draft_tokens": None,
    "speculative_ngram_max_bfs_breadth": None,
    # The draft model: its config.json (a mapping) and its checkpoint's bytes (the index's
    # metadata.total_size), read from speculative_draft_model_path by whoever plans.
    "speculative_draft_config": None,
    "speculative_draft_weight_bytes": None,
    # Accepted tokens per verify (SGLang's accept len, sglang:spec_accept_length); None: the
    # calibration log's Decode batch lines, else no speed-up is planned.
    "speculative_accept_length": None,
    "speculation_reset": "warn",
    # The job's concurrent requests (what the 48 reset caps), when known.
    "job_concurrency": None,
    # Peak dense BF16 TFLOPS per GPU for the speed-up model; None: speculative.GPU_BF16_TFLOPS.
    "gpu_bf16_tflops": None,
}
HOST_KEYS = ("gpu_memory_mib", "host_ram_gib", "gpu_count", "gpu_name")


class PlanInputError(ValueError):
    """The inputs cannot describe a deployment (bad usage, exit status 2).

    argument: the planner argument or host fact at fault (its ARG_DEFAULTS/HOST_KEYS name,
    "model_config" or "weight_bytes"), or None when the problem is not one argument's.
    """

    def __init__(self, message: str, argument: str | None = None) -> None:
        super().__init__(f"{argument}: {message}" if argument else message)
        self.argument = argument
        self.message = message


# Ranges of the numeric inputs, read by the one reader of numbers
# (plugins/module_utils/typed_number.py): Ansible extra-vars arrive as strings ("8"), so number text
# is read; booleans, NaN, infinities, fractional counts, huge integers and long text are refused,
# never coerced. The upper bounds lie beyond any real machine or setting and keep the arithmetic
# finite.
_MAX_COUNT = 2**31 - 1
_MAX_AMOUNT = 1e12
# Parallel sizes as sglang_fleet.servers.host_checks bounds them (MAX_PARALLEL: far past any
# cluster):
# a tp of 2**31 - 1 would have the layout table walk every divisor candidate for minutes.
_MAX_PARALLEL = 4096
_INT_RANGES: dict[str, Range] = {
    "tp_size": Range(1, _MAX_PARALLEL, integer=True),
    "dp_size": Range(1, _MAX_PARALLEL, integer=True),
    "attn_dp_size": Range(1, _MAX_PARALLEL, integer=True),
    "page_size": Range(1, _MAX_COUNT, integer=True),
    # -1 (and 0) disable chunked prefill
    "chunked_prefill_size": Range(-1, _MAX_COUNT, integer=True),
    "max_running_requests": Range(1, _MAX_COUNT, integer=True),
    "context_length": Range(1, _MAX_COUNT, integer=True),
    "avg_input_len": Range(0, _MAX_COUNT, integer=True),
    "avg_output_len": Range(0, _MAX_COUNT, integer=True),
    "gpu_count": Range(0, _MAX_COUNT, integer=True),  # 0: a host without GPUs, a plan error
    "cuda_graph_max_bs_decode": Range(1, _MAX_COUNT, integer=True),
    "max_total_tokens": Range(1, _MAX_COUNT, integer=True),
    "speculative_num_steps": Range(1, _MAX_PARALLEL, integer=True),
    "speculative_eagle_topk": Range(1, _MAX_PARALLEL, integer=True),
    "speculative_num_draft_tokens": Range(1, _MAX_PARALLEL, integer=True),
    "speculative_ngram_max_bfs_breadth": Range(1, _MAX_PARALLEL, integer=True),
    "speculative_draft_weight_bytes": Range(1, 2**62, integer=True),
    "job_concurrency": Range(1, _MAX_COUNT, integer=True),
}
_FLOAT_RANGES: dict[str, Range] = {
    "mem_fraction_static": Range(0.0, 1.0, low_open=True, high_open=True),
    "hicache_size": Range(0.0, _MAX_AMOUNT),
    "hicache_ratio": Range(0.0, _MAX_AMOUNT, low_open=True),
    "per_request_tok_s": Range(0.0, _MAX_AMOUNT, low_open=True),
    "min_free_after_graph_gib": Range(0.0, _MAX_AMOUNT),
    # Less than the CUDA context leaves nothing to plan with.
    "gpu_memory_mib": Range(kv_cache.CUDA_CONTEXT_GIB * 1024, _MAX_AMOUNT, low_open=True),
    "host_ram_gib": Range(0.0, _MAX_AMOUNT),
    "gpu_memory_bandwidth_gbs": Range(0.0, _MAX_AMOUNT, low_open=True),
    # An accept length counts the verify's own token: at least 1.
    "speculative_accept_length": Range(1.0, float(_MAX_PARALLEL)),
    "gpu_bf16_tflops": Range(0.0, _MAX_AMOUNT, low_open=True),
}
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})


def _as_number(key: str, value: Any, allowed: Range) -> int | float:
    try:
        number = typed_number.read(value, key, allowed)
    except typed_number.NumberError as exc:
        raise PlanInputError(exc.message, key) from None
    return number if allowed.integer else float(number)


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    word = value.strip().lower() if isinstance(value, str) else None
    if word in _TRUE_WORDS or word in _FALSE_WORDS:
        return word in _TRUE_WORDS
    raise PlanInputError(f"must be true or false, got {shown(value)}", key)


def _as_text(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise PlanInputError(f"must be a string, got {shown(value)}", key)
    return value


def _as_structure(key: str, value: Any) -> Any:
    """calibration: a record, a list or the store (as data or JSON text; calibration_store.py
    reads it); server_flags: the whole flag mapping."""
    mapping = key in ("server_flags", "speculative_draft_config")
    allowed = (dict,) if mapping else (dict, list, str)
    if not isinstance(value, allowed):
        kinds = "a mapping" if mapping else "a record, a list of records or JSON text"
        raise PlanInputError(f"must be {kinds}, got {shown(value)}", key)
    return value


def _as_logged_flags(value: Any) -> dict[str, Any]:
    """calibration_log_flags: the logged run's flags, typed as the planner's own."""
    key = "calibration_log_flags"
    if not isinstance(value, dict):
        raise PlanInputError(f"must be a mapping of flag to value, got {shown(value)}", key)
    unknown = sorted(str(name) for name in value if name not in logged_flags.STATABLE)
    if unknown:
        raise PlanInputError(
            f"unknown flag(s) {', '.join(unknown)}: one of {', '.join(logged_flags.STATABLE)}", key
        )
    try:
        typed = _typed(dict(value))
    except PlanInputError as exc:
        raise PlanInputError(f"{exc.argument}: {exc.message}", key) from None
    if "kv_cache_dtype" in typed:
        try:
            kv_cache.elem_bytes(typed["kv_cache_dtype"])
        except ValueError as exc:
            raise PlanInputError(str(exc), key) from None
    return typed


_CHOICES = {
    "calibration_mode": calibration_apply.MODES,
    "device": DEVICES,
    "speculation_reset": SPECULATION_RESET_MODES,
}


def _as_choice(key: str, value: Any) -> str:
    allowed = _CHOICES[key]
    if value not in allowed:
        raise PlanInputError(f"must be one of {', '.join(allowed)}, got {shown(value)}", key)
    return str(value)


def _typed(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if value is None:
            continue
        if key in ("calibration", "server_flags", "speculative_draft_config"):
            out[key] = _as_structure(key, value)
        elif key == "calibration_log_flags":
            out[key] = _as_logged_flags(value)
        elif key in _CHOICES:
            out[key] = _as_choice(key, value)
        elif key in _INT_RANGES:
            out[key] = _as_number(key, value, _INT_RANGES[key])
        elif key in _FLOAT_RANGES:
            out[key] = _as_number(key, value, _FLOAT_RANGES[key])
        elif key in ("enable_hierarchical_cache", "enable_dp_attention", "plan_layouts"):
            out[key] = _as_bool(key, value)
        else:
            out[key] = _as_text(key, value)
    return out


def merge_args(args: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise PlanInputError(f"planner arguments must be a mapping, got {shown(args)}")
    unknown = sorted(map(str, set(args) - set(ARG_DEFAULTS)))
    if unknown:
        raise PlanInputError(f"unknown planner argument(s): {', '.join(unknown)}")
    return dict(ARG_DEFAULTS) | _typed(args)


def typed_host(host: dict[str, Any], device: str = "cuda") -> dict[str, Any]:
    if not isinstance(host, dict):
        raise PlanInputError(f"host facts must be a mapping, got {shown(host)}")
    unknown = sorted(map(str, set(host) - set(HOST_KEYS)))
    if unknown:
        raise PlanInputError(f"unknown host fact(s): {', '.join(unknown)}")
    if device == "cuda" and host.get("gpu_memory_mib") is None:
        raise PlanInputError(
            "is required: the host's memory per GPU in MiB, as nvidia-smi reports it",
            "gpu_memory_mib",
        )
    return _typed(host)


def check_weight_bytes(weight_bytes: Any) -> int:
    if (
        not isinstance(weight_bytes, int)
        or isinstance(weight_bytes, bool)
        or not 0 < weight_bytes < 2**63
    ):
        raise PlanInputError(
            f"must be a positive byte count (metadata.total_size), got {shown(weight_bytes)}",
            "weight_bytes",
        )
    return weight_bytes


def check_inputs(args: dict[str, Any]) -> None:
    if args["avg_input_len"] + args["avg_output_len"] <= 0:
        raise PlanInputError("avg_input_len + avg_output_len must be positive", "avg_input_len")
    try:
        kv_cache.elem_bytes(args["kv_cache_dtype"])
    except ValueError as exc:
        raise PlanInputError(str(exc), "kv_cache_dtype") from exc


def parse_startup_log(args: dict[str, Any]) -> StartupLog | None:
    """The calibration log (`calibration_log`) parsed: a StartupLog (its Decode batch lines
    give the per-request speed), None without one."""
    return parse_log(args["calibration_log"]) if args["calibration_log"] else None
