"""Capacity planner: will a flag set fit, and what bounds its throughput?

    python3 -m sglang_fleet.capacity.planner --model-path DIR --tp-size 8 --mem-fraction-static
    0.88 \
        --kv-cache-dtype fp8_e4m3 --gpu-memory-mib 97887 --host-ram-gib 400 --gpu-count 8 \
        [--calibrate-from server.log] [--json]

`plan()` is the pure function behind it; the deploy's pre-flight (filter `sglang_plan`)
calls it with facts slurped from the host. Exit status: 0 no errors, 1 errors (the plan
does not fit), 2 bad usage: an input outside its range (NaN, infinite, negative, zero where
zero means nothing, see _INT_RANGES/_FLOAT_RANGES) or a model directory that cannot be read,
with one message on stderr naming the argument. plan() raises PlanInputError for the same
inputs, so the Ansible filter reports them as such.

Memory model (SGLang 0.5.23, see kv_cache.py): pre = free GiB before weights load, post =
free GiB after; rest = post - pre * (1 - mem_fraction_static); max_total_num_tokens =
rest / cell_size. Without a calibration pre = GPU total - CUDA_CONTEXT_GIB and
post = pre - weights / tp. A calibration (args `calibration`: records the deploy stored on
the host, see sglang_fleet/capacity/calibration.py and docs/CALIBRATION.md; or `calibration_log`:
the
text of an earlier server log) that matches the flag set replaces the estimates with what
SGLang measured; one that does not match is a `calibration_mismatch` warning.

Out-of-memory risk of a high mem_fraction_static (the memory left outside the static pool
must hold CUDA graphs and the activations of the largest prefill):
- without calibration: warn above the fraction SGLang 0.5.23 would choose for this GPU size,
  model and tp (its own reserve estimate; conservative by design);
- with calibration: free memory after CUDA graph capture is predicted from the measured
  figure (the static pool grows by (new - calibrated fraction) * pre; graph memory by
  SGLang's estimate when batch sizes change), and below MIN_FREE_AFTER_GRAPH_GIB it is an
  **error** naming the prediction, the margin and the highest fraction that keeps it.
  `calibration_mode: warn` makes it a warning (the operator overrules it), `ignore` plans
  with estimates only.

CPU servers (`device: cpu`, docs/CPU-SERVERS.md): SGLang's CPU engine sizes the KV pool from
the host's free RAM unless --max-total-tokens caps it, so the plan is of host RAM instead of GPU
memory: weights + max_total_tokens x cell size x ranks + process overhead must fit
host_ram_gib x CPU_RAM_FRACTION. Without max_total_tokens it is an error that names the cap
that fits; no GPU fact is needed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

from sglang_fleet import input_files
from sglang_fleet.capacity import attention_dp, calibration, kv_cache, logged_flags
from sglang_fleet.capacity.model_config import ModelConfigError, model_shape, read_model_dir
from sglang_fleet.capacity.noop_flags import noop_flag_issues
from sglang_fleet.capacity.server_log import Calibration, parse_log

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
)
DEVICES = ("cuda", "cpu")

# Free GPU memory that must remain after CUDA graph capture for a large prefill to run:
# its activations (a few GiB for an 8k-token chunk of a 7k-hidden MoE) plus allocator
# fragmentation. Chosen against the Kimi job's runs (docs/THE-JOB.md: Kimi-K2.5 int4, 8 GPUs,
# calibrated at 0.85 with 11.0 GiB free after capture, pre = 94.19 GiB): 0.88 and 0.90
# ran (8.2 and 6.3 GiB predicted free), 0.93 ran out of memory in a large prefill
# (3.5 GiB). Any margin in (3.5, 6.3) separates them; 5 GiB sits in the middle.
MIN_FREE_AFTER_GRAPH_GIB = 5.0
# Decode speed of one request when neither the caller nor a calibration log says: the
# Kimi job's server decoded ~600 tok/s over ~50 running requests. A guess for other models.
DEFAULT_PER_REQUEST_TOK_S = 12.0
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


def _issue(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


# Ranges of the numeric inputs. Ansible extra-vars arrive as strings ("8"), so numbers are
# converted first; booleans, NaN, infinities and fractional counts are refused, never coerced.
# The upper bounds lie beyond any real machine or setting and keep the arithmetic finite.
_MAX_COUNT = 2**31 - 1
_MAX_AMOUNT = 1e12
# Parallel sizes as sglang_fleet.servers.host_checks bounds them (MAX_PARALLEL: far past any
# cluster):
# a tp of 2**31 - 1 would have the layout table walk every divisor candidate for minutes.
_MAX_PARALLEL = 4096
_INT_RANGES: dict[str, tuple[int, int]] = {
    "tp_size": (1, _MAX_PARALLEL),
    "dp_size": (1, _MAX_PARALLEL),
    "attn_dp_size": (1, _MAX_PARALLEL),
    "page_size": (1, _MAX_COUNT),
    "chunked_prefill_size": (-1, _MAX_COUNT),  # -1 (and 0) disable chunked prefill
    "max_running_requests": (1, _MAX_COUNT),
    "context_length": (1, _MAX_COUNT),
    "avg_input_len": (0, _MAX_COUNT),
    "avg_output_len": (0, _MAX_COUNT),
    "gpu_count": (0, _MAX_COUNT),  # 0 is a host without GPUs: a plan error, not bad usage
    "cuda_graph_max_bs_decode": (1, _MAX_COUNT),
    "max_total_tokens": (1, _MAX_COUNT),
}


@dataclass(frozen=True)
class _FloatRange:
    low: float
    high: float
    low_open: bool = False  # the lowest value itself is refused
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.low_open and self.high_open:
            return f"a number between {self.low:g} and {self.high:g} (both excluded)"
        low = ">" if self.low_open else ">="
        high = "<" if self.high_open else "<="
        return f"a number {low} {self.low:g} and {high} {self.high:g}"


_FLOAT_RANGES: dict[str, _FloatRange] = {
    "mem_fraction_static": _FloatRange(0.0, 1.0, low_open=True, high_open=True),
    "hicache_size": _FloatRange(0.0, _MAX_AMOUNT),
    "hicache_ratio": _FloatRange(0.0, _MAX_AMOUNT, low_open=True),
    "per_request_tok_s": _FloatRange(0.0, _MAX_AMOUNT, low_open=True),
    "min_free_after_graph_gib": _FloatRange(0.0, _MAX_AMOUNT),
    # Less than the CUDA context leaves nothing to plan with.
    "gpu_memory_mib": _FloatRange(kv_cache.CUDA_CONTEXT_GIB * 1024, _MAX_AMOUNT, low_open=True),
    "host_ram_gib": _FloatRange(0.0, _MAX_AMOUNT),
    "gpu_memory_bandwidth_gbs": _FloatRange(0.0, _MAX_AMOUNT, low_open=True),
}
_INTEGER_TEXT = re.compile(r"\s*[+-]?[0-9]+\s*")
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})


def _shown(value: Any) -> str:
    """A value for a message: short, and never the conversion of a huge integer."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"a {value.bit_length()}-bit integer"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _integral(value: Any) -> bool:
    """A float without a fraction, or the text of an integer (as Ansible hands it over)."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, str) and bool(_INTEGER_TEXT.fullmatch(value))


def _as_int(key: str, value: Any) -> int:
    low, high = _INT_RANGES[key]
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif _integral(value):
        number = int(value)
    if number is None or not low <= number <= high:
        raise PlanInputError(f"must be an integer from {low} to {high}, got {_shown(value)}", key)
    return number


def _as_float(key: str, value: Any) -> float:
    allowed = _FLOAT_RANGES[key]
    number: float | None = None
    try:
        if isinstance(value, int | float | str) and not isinstance(value, bool):
            number = float(value)
    except (ValueError, OverflowError):
        number = None
    if number is None or not math.isfinite(number) or number not in allowed:
        raise PlanInputError(f"must be {allowed}, got {_shown(value)}", key)
    return number


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    word = value.strip().lower() if isinstance(value, str) else None
    if word in _TRUE_WORDS or word in _FALSE_WORDS:
        return word in _TRUE_WORDS
    raise PlanInputError(f"must be true or false, got {_shown(value)}", key)


def _as_text(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise PlanInputError(f"must be a string, got {_shown(value)}", key)
    return value


def _as_structure(key: str, value: Any) -> Any:
    """calibration: a record, a list or the store (as data or JSON text; calibration.py reads
    it); server_flags: the whole flag mapping."""
    allowed = (dict,) if key == "server_flags" else (dict, list, str)
    if not isinstance(value, allowed):
        kinds = "a mapping" if key == "server_flags" else "a record, a list of records or JSON text"
        raise PlanInputError(f"must be {kinds}, got {_shown(value)}", key)
    return value


def _as_logged_flags(value: Any) -> dict[str, Any]:
    """calibration_log_flags: the logged run's flags, typed as the planner's own."""
    key = "calibration_log_flags"
    if not isinstance(value, dict):
        raise PlanInputError(f"must be a mapping of flag to value, got {_shown(value)}", key)
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


def _as_choice(key: str, value: Any) -> str:
    if value not in calibration.MODES:
        raise PlanInputError(
            f"must be one of {', '.join(calibration.MODES)}, got {_shown(value)}", key
        )
    return str(value)


def _typed(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if value is None:
            continue
        if key in ("calibration", "server_flags"):
            out[key] = _as_structure(key, value)
        elif key == "calibration_log_flags":
            out[key] = _as_logged_flags(value)
        elif key == "calibration_mode":
            out[key] = _as_choice(key, value)
        elif key == "device":
            if value not in DEVICES:
                raise PlanInputError(
                    f"must be one of {', '.join(DEVICES)}, got {_shown(value)}", key
                )
            out[key] = str(value)
        elif key in _INT_RANGES:
            out[key] = _as_int(key, value)
        elif key in _FLOAT_RANGES:
            out[key] = _as_float(key, value)
        elif key in ("enable_hierarchical_cache", "enable_dp_attention", "plan_layouts"):
            out[key] = _as_bool(key, value)
        else:
            out[key] = _as_text(key, value)
    return out


def _merge_args(args: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise PlanInputError(f"planner arguments must be a mapping, got {_shown(args)}")
    unknown = sorted(map(str, set(args) - set(ARG_DEFAULTS)))
    if unknown:
        raise PlanInputError(f"unknown planner argument(s): {', '.join(unknown)}")
    return dict(ARG_DEFAULTS) | _typed(args)


def _typed_host(host: dict[str, Any], device: str = "cuda") -> dict[str, Any]:
    if not isinstance(host, dict):
        raise PlanInputError(f"host facts must be a mapping, got {_shown(host)}")
    unknown = sorted(map(str, set(host) - set(HOST_KEYS)))
    if unknown:
        raise PlanInputError(f"unknown host fact(s): {', '.join(unknown)}")
    if device == "cuda" and host.get("gpu_memory_mib") is None:
        raise PlanInputError(
            "is required: the host's memory per GPU in MiB, as nvidia-smi reports it",
            "gpu_memory_mib",
        )
    return _typed(host)


def _check_weight_bytes(weight_bytes: Any) -> int:
    if (
        not isinstance(weight_bytes, int)
        or isinstance(weight_bytes, bool)
        or not 0 < weight_bytes < 2**63
    ):
        raise PlanInputError(
            f"must be a positive byte count (metadata.total_size), got {_shown(weight_bytes)}",
            "weight_bytes",
        )
    return weight_bytes


def _check_inputs(a: dict[str, Any]) -> None:
    if a["avg_input_len"] + a["avg_output_len"] <= 0:
        raise PlanInputError("avg_input_len + avg_output_len must be positive", "avg_input_len")
    try:
        kv_cache.elem_bytes(a["kv_cache_dtype"])
    except ValueError as exc:
        raise PlanInputError(str(exc), "kv_cache_dtype") from exc


def _log_calibration(a: dict[str, Any]) -> Calibration | None:
    """The calibration log parsed (its Decode batch lines give the per-request speed)."""
    return parse_log(a["calibration_log"]) if a["calibration_log"] else None


class _Planner:
    """One planning run; collects warnings and errors while it computes."""

    def __init__(
        self, config: dict[str, Any], weight_bytes: int, args: dict[str, Any], host: dict[str, Any]
    ):
        self.a = _merge_args(args)
        self.host = _typed_host(host)
        _check_inputs(self.a)
        try:
            self.shape = model_shape(config)
        except ModelConfigError as exc:
            raise PlanInputError(str(exc), "model_config") from exc
        self.weight_bytes = _check_weight_bytes(weight_bytes)
        self.warnings: list[dict[str, str]] = []
        self.errors: list[dict[str, str]] = []
        # Store entries no plan may use (damaged, or no calibration): named, not a warning,
        # so a damaged store never blocks a deploy whose warnings are fatal.
        self.calibration_set_aside: list[str] = []
        # The calibration log's own flags, each with the line it came from.
        self.calibration_log_flags: list[str] = []
        self.layout = self._layout()
        self.tp = self.layout.tp_size
        self.dp = self.layout.dp_size
        self.attn_dp = self.layout.attn_dp_size
        self.weights = attention_dp.weight_layout(config, self.shape, self.weight_bytes)
        self.extra_weight_gib = attention_dp.extra_weight_gib(self.weights, self.tp, self.attn_dp)
        self.dtype = str(self.a["kv_cache_dtype"])
        self.gpu_mib = float(self.host["gpu_memory_mib"])
        self.cal = _log_calibration(self.a)
        self.defaults = kv_cache.sglang_default_mem_fraction(
            self.gpu_mib,
            self.shape,
            self.tp,
            chunked_prefill_size=self.a["chunked_prefill_size"],
            max_running_requests=self.a["max_running_requests"],
            attn_dp_size=self.attn_dp,
            cuda_graph_max_bs_decode=self.a["cuda_graph_max_bs_decode"]
            if self.attn_dp > 1
            else None,
        )
        given = self.a["mem_fraction_static"]
        self.fraction = float(given) if given is not None else self.defaults.mem_fraction_static
        self.calibration = self._apply_calibration(config, weight_bytes)
        self.prediction = self.calibration.prediction if self.calibration else None
        self.pre, self.post = self._free_memory()

    def _layout(self) -> attention_dp.Layout:
        """tp, attention DP and replicas as SGLang resolves them (both flag spellings)."""
        a = self.a
        try:
            layout = attention_dp.resolve_layout(
                int(a["tp_size"]), int(a["dp_size"]), a["attn_dp_size"], a["enable_dp_attention"]
            )
        except attention_dp.LayoutError as exc:
            raise PlanInputError(str(exc), exc.argument) from exc
        if layout.attn_dp_size > 1 and a["cuda_graph_max_bs_decode"] is None:
            self.warnings.append(
                _issue(
                    "attn_dp_graph_batch",
                    f"Attention DP {layout.attn_dp_size} without --cuda-graph-max-bs-decode: "
                    "SGLang captures decode graphs up to its default batch (512 on a GPU of "
                    "this class) and reserves batch x attn_dp x 4.5 MiB for them. Set it to the "
                    "batch one rank runs (attention_dp_layouts gives one per layout).",
                )
            )
        if layout.deprecated_spelling:
            self.warnings.append(
                _issue("deprecated_enable_dp_attention", attention_dp.deprecation_message(layout))
            )
        return layout

    # --- calibration -----------------------------------------------------------------
    def _calibration_flags(self) -> dict[str, Any]:
        """The flag set as SGLang will see it: the server's flags under the planner's."""
        flags = dict(self.a["server_flags"] or {})
        for key in (
            "tp_size",
            "dp_size",
            "kv_cache_dtype",
            "chunked_prefill_size",
            "max_running_requests",
            "context_length",
            "page_size",
            "cuda_graph_max_bs_decode",
        ):
            if self.a[key] is not None:
                flags[key] = self.a[key]
        flags.pop("enable_dp_attention", None)
        flags |= {"dp_size": self.dp, "attn_dp_size": self.attn_dp}
        flags["mem_fraction_static"] = self.fraction
        return flags

    def _calibration_records(self) -> list[dict]:
        """Records given as data, plus one built from the calibration log (parsed once, in
        self.cal); the entries of the store no plan may use are named in
        calibration_set_aside (calibration.read_store)."""
        read = calibration.read_store(self.a["calibration"])
        records = read.records
        self.calibration_set_aside += [entry.describe() for entry in read.set_aside]
        if self.cal is not None:
            logged = {"logged_flags": self._logged_run_flags(self.cal)}
            try:
                records.append(calibration.build_record(self.cal, None, logged))
            except calibration.CalibrationError as exc:
                self.warnings.append(
                    _issue(
                        "calibration_incomplete",
                        f"The calibration log is incomplete: {exc}; using estimates instead.",
                    )
                )
        return records

    def _logged_run_flags(self, cal: Calibration) -> dict[str, Any]:
        """The logged run's own flags (sglang_fleet.capacity.logged_flags): what the log or the
        operator
        states (`calibration_log_flags`), checked against its lines, the rest inferred from
        them, each named with its source in calibration_log_flags; never the flags being
        planned. A flag that matters and that nothing fixes refuses the log."""
        if not cal.has_memory:
            return {}  # build_record names what is missing
        stated = self.a["calibration_log_flags"] or {}
        run = logged_flags.infer(cal, self.shape, self.weights, stated=stated)
        if run.unknown:
            names = ", ".join(run.unknown)
            raise PlanInputError(
                f"the calibration log does not say which {names} it ran with, and its lines "
                "cannot fix it: give the logged run's value with --logged-flag NAME=VALUE (the "
                "planner's own flags describe the plan, not the log)",
                "calibration_log",
            )
        for problem in run.disagreements:
            self.warnings.append(
                _issue("calibration_flags_disagree", f"The calibration log disagrees: {problem}.")
            )
        self.calibration_log_flags += run.describe()
        return run.flags

    def _apply_calibration(
        self, config: dict[str, Any], weight_bytes: int
    ) -> calibration.Applied | None:
        records = self._calibration_records()
        if not records:
            return None
        host = {
            "gpu_memory_mib": self.gpu_mib,
            "gpu_name": self.host.get("gpu_name"),
            "sglang_version": self.a["sglang_version"],
            "model_fingerprint": calibration.model_fingerprint(config, weight_bytes),
            "architecture": self.shape.architecture,
        }
        try:
            applied = calibration.apply(
                records,
                self._calibration_flags(),
                host,
                self.shape,
                margin_gib=float(self.a["min_free_after_graph_gib"]),
                mode=str(self.a["calibration_mode"]),
                flags_complete=self.a["server_flags"] is not None,
                extra_weight_gib=lambda n: attention_dp.extra_weight_gib(self.weights, self.tp, n),
            )
        except calibration.CalibrationError as exc:
            raise PlanInputError(str(exc)) from exc
        self.warnings += applied.warnings
        self.errors += applied.errors
        return applied

    def _free_memory(self) -> tuple[float, float]:
        if self.prediction is not None:
            return self.prediction.pre_gib, self.prediction.post_gib
        pre = kv_cache.estimate_pre_gib(self.gpu_mib)
        post = kv_cache.estimate_post_gib(pre, self.weight_bytes, self.tp)
        return pre, post - self.extra_weight_gib

    # --- KV budget -------------------------------------------------------------------
    def kv_tokens(self, cell: int) -> tuple[float, int]:
        if self.prediction is not None:
            rest = self.prediction.kv_budget_gib
            tokens = self.prediction.max_total_num_tokens
        else:
            reserve = kv_cache.multimodal_reserve_gib(self.shape)
            rest = kv_cache.rest_gib(self.pre, self.post, self.fraction, reserve)
            tokens = kv_cache.max_total_num_tokens(rest, cell, int(self.a["page_size"]))
        if self.a["max_total_tokens"] is not None:
            # SGLang caps the pool it computed at --max-total-tokens.
            tokens = min(tokens, int(self.a["max_total_tokens"]))
        if rest <= 0:
            self._not_enough_memory(rest)
        return rest, tokens

    def _not_enough_memory(self, rest: float) -> None:
        needed = kv_cache.min_mem_fraction_for_kv(self.pre, self.post)
        self.errors.append(
            _issue(
                "not_enough_memory",
                f"Not enough memory. Please try to increase --mem-fraction-static: at "
                f"{self.fraction:.3f} the KV cache gets {rest:.2f} GiB per GPU (weights leave "
                f"{self.post:.2f} of {self.pre:.2f} GiB free); it must be above {needed:.3f}, "
                "or use more GPUs (tp) or a smaller model.",
            )
        )

    # --- out-of-memory risk ----------------------------------------------------------
    def free_after_graph(self) -> float | None:
        return None if self.prediction is None else self.prediction.free_after_graph_gib

    def max_safe_fraction(self) -> float:
        if self.prediction is None:
            return self.defaults.mem_fraction_static
        return self.prediction.max_safe_mem_fraction_static

    def check_oom_risk(self) -> None:
        if self.prediction is not None:
            return  # calibration.apply judged the measured figure (error or warning)
        default = self.defaults.mem_fraction_static
        if self.fraction > default + 1e-9:
            self.warnings.append(
                _issue(
                    "oom_risk_mem_fraction",
                    f"mem_fraction_static {self.fraction:.3f} is above {default:.3f}, the fraction "
                    f"SGLang 0.5.23 would choose itself for a {self.gpu_mib:.0f} MiB GPU with this "
                    f"model at tp={self.tp} (it keeps {self.defaults.reserved_mib:.0f} MiB for "
                    "activations and CUDA graphs): risk of CUDA out of memory during CUDA graph "
                    "capture or a large prefill. SGLang's estimate is conservative; calibrate "
                    "with a run of this model (--calibration or --calibrate-from) for a "
                    "measured limit.",
                )
            )

    # --- HiCache, GPUs, dtype, context ----------------------------------------------
    def check_hicache(self, device_pool_gib: float) -> float:
        a = self.a
        if not a["enable_hierarchical_cache"]:
            return 0.0
        host_ram = self.host.get("host_ram_gib")
        ranks = self.tp * self.dp
        per_rank = kv_cache.hicache_host_gib_per_rank(
            a["hicache_size"] or None,
            a["hicache_ratio"],
            max(device_pool_gib, 0.0),
            float(host_ram or 0),
            ranks,
        )
        total = per_rank * ranks
        self.warnings.append(
            _issue(
                "hicache_no_decode_slots",
                "HiCache spills evicted prefix-cache entries to host RAM; it adds no decode "
                "slots (a running request's KV must be on the GPU). To decode more requests at "
                "once use a smaller KV dtype (fp8), more GPU memory for KV, more GPUs, or "
                "for an MLA model attention data parallelism (--attn-dp-size: one KV pool per "
                "rank; attention_dp_layouts).",
            )
        )
        if host_ram is None:
            self.warnings.append(
                _issue(
                    "host_ram_unknown",
                    "host_ram_gib is not known: the HiCache host pool is not checked.",
                )
            )
        elif total + kv_cache.HICACHE_HOST_RESERVE_GIB > float(host_ram):
            size_note = f"{a['hicache_size']} GB per rank" if a["hicache_size"] else "the pool size"
            self.errors.append(
                _issue(
                    "hicache_host_ram",
                    f"HiCache host pool is per rank: {size_note} x {ranks} ranks = "
                    f"{total:.1f} GiB, "
                    f"plus SGLang's {kv_cache.HICACHE_HOST_RESERVE_GIB:.0f} GiB reserve, exceeds "
                    "the "
                    f"host's {float(host_ram):.1f} GiB RAM (Not enough host memory available). "
                    f"At most {self._max_hicache_gb(float(host_ram), ranks)} GB per rank fits.",
                )
            )
        if 0 < per_rank <= device_pool_gib:
            self.warnings.append(
                _issue(
                    "hicache_smaller_than_device",
                    f"The HiCache host pool ({per_rank:.1f} GiB per rank) is not larger than the "
                    f"GPU KV pool ({device_pool_gib:.1f} GiB): it can hold little beyond what the "
                    "GPU already caches.",
                )
            )
        return total

    @staticmethod
    def _max_hicache_gb(host_ram_gib: float, ranks: int) -> int:
        spare = max(0.0, host_ram_gib - kv_cache.HICACHE_HOST_RESERVE_GIB)
        return int(spare * kv_cache.GIB / ranks // kv_cache.GB)

    def check_gpus(self) -> None:
        count = self.host.get("gpu_count")
        if count is not None and self.tp * self.dp > int(count):
            self.errors.append(
                _issue(
                    "not_enough_gpus",
                    f"tp_size {self.tp} x dp_size {self.dp} = {self.tp * self.dp} GPUs, "
                    f"but the host has {count}.",
                )
            )

    def check_dtype(self) -> None:
        if self.dtype in kv_cache.FP8_DTYPES or self.dtype in kv_cache.FP4_DTYPES:
            ratio = kv_cache.elem_bytes("bf16") / kv_cache.elem_bytes(self.dtype)
            self.warnings.append(
                _issue(
                    "kv_dtype_quality",
                    f"--kv-cache-dtype {self.dtype} stores KV in fewer bits: about "
                    f"{float(ratio):g}x "
                    "the tokens of bf16 (more concurrent decodes), at some cost in output "
                    "quality. A trade-off the operator chooses: check quality on your task.",
                )
            )
        if self.dtype in kv_cache.FP4_DTYPES and not self.shape.is_mla:
            self.warnings.append(
                _issue(
                    "fp4_cell_size_estimate",
                    "FP4 KV for MHA models keeps recipe-specific scale buffers; the planned "
                    "token count is an upper estimate.",
                )
            )

    def check_context(self) -> None:
        context = self.a["context_length"] or self.shape.context_length
        per_request = self.a["avg_input_len"] + self.a["avg_output_len"]
        if context and per_request > context:
            self.warnings.append(
                _issue(
                    "exceeds_context_length",
                    f"avg_input_len + avg_output_len = {per_request} exceeds the context "
                    f"length {context}.",
                )
            )

    # --- throughput ------------------------------------------------------------------
    def per_request_tok_s(self) -> tuple[float, str]:
        if self.a["per_request_tok_s"]:
            return float(self.a["per_request_tok_s"]), "argument"
        if self.cal is not None and (speed := self.cal.per_request_tok_s()):
            return speed, "calibration log"
        return DEFAULT_PER_REQUEST_TOK_S, "default guess"

    def concurrency(self, tokens: int) -> int:
        """Concurrent decodes of the whole server; `tokens` is one rank's pool."""
        tokens_per_request = self.a["avg_input_len"] + self.a["avg_output_len"]
        fit = tokens // tokens_per_request
        context = self.a["context_length"] or self.shape.context_length
        asked = self.a["max_running_requests"]
        # SGLang divides --max-running-requests over the attention-DP ranks.
        cap = (
            max(1, asked // self.attn_dp)
            if asked
            else kv_cache.sglang_default_max_running_requests(tokens, context)
        )
        # Each attention-DP rank and each data-parallel replica has its own KV pool and
        # scheduler.
        return min(fit, cap) * self.layout.pools

    def roofline(self, concurrent: int, cell: int) -> dict[str, Any]:
        """The decode roofline at the planned concurrency (docs/ATTENTION-DP.md)."""
        given = self.a["gpu_memory_bandwidth_gbs"]
        if given:
            bandwidth, source = float(given), "gpu_memory_bandwidth_gbs"
        else:
            bandwidth, key = attention_dp.gpu_bandwidth_gbs(self.host.get("gpu_name"))
            source = f"table: {key}" if key else ""
        if bandwidth is None:
            return {
                "tok_s": None,
                "reason": f"memory bandwidth of GPU {self.host.get('gpu_name')!r} unknown: "
                "set gpu_memory_bandwidth_gbs (--gpu-memory-bandwidth-gbs)",
            }
        context = self.a["avg_input_len"] + self.a["avg_output_len"] // 2
        line = attention_dp.decode_roofline(
            self.weights,
            self.layout,
            batch=concurrent,
            context_tokens=context,
            cell_size_bytes=cell,
            bandwidth_gbs=bandwidth,
            bandwidth_source=source,
        )
        if line is None:
            return {"tok_s": None, "reason": "no request fits: no decode step to bound"}
        return line.as_dict()

    def layout_row(self, tokens: int, concurrent: int, speed: float, rest: float) -> dict:
        free = self.free_after_graph()
        margin = None if self.prediction is None else self.prediction.margin_gib
        return {
            "tp_size": self.tp,
            "attn_dp_size": self.attn_dp,
            "attn_tp_size": self.layout.attn_tp_size,
            "dp_size": self.dp,
            "kv_pools": self.layout.pools,
            "weights_per_gpu_gib": round(self.post_weights_gib(), 2),
            "extra_weights_per_gpu_gib": round(self.extra_weight_gib, 2),
            "kv_pool_per_rank_gib": round(max(rest, 0.0), 2),
            "kv_tokens_per_rank": tokens,
            "total_kv_tokens": tokens * self.layout.pools,
            "max_concurrent_requests": concurrent,
            "kv_bound_output_tok_s": round(concurrent * speed, 1),
            "free_after_graph_gib_per_rank": None if free is None else round(free, 2),
            "oom_margin_gib_per_rank": None
            if free is None or margin is None
            else round(free - margin, 2),
            "cuda_graph_max_bs_decode": self.a["cuda_graph_max_bs_decode"],
            "chunked_prefill_size_per_rank": self.chunk_per_rank(),
        }

    def post_weights_gib(self) -> float:
        """Weights per GPU: measured (calibrated) or the checkpoint's share, plus the layout's."""
        return self.pre - self.post

    def chunk_per_rank(self) -> int:
        """SGLang divides chunked_prefill_size by the attention-DP size."""
        chunk = self.a["chunked_prefill_size"] or self.defaults.chunked_prefill_size
        return chunk // self.attn_dp if chunk > 0 else chunk

    def run(self) -> dict[str, Any]:
        cell = kv_cache.cell_size_bytes(self.shape, self.dtype, self.layout.attn_tp_size)
        rest, tokens = self.kv_tokens(cell)
        self.check_gpus()
        self.check_oom_risk()
        hicache_total = self.check_hicache(rest)
        self.check_dtype()
        self.check_context()
        self.warnings += noop_flag_issues(self.a["server_flags"], self.a["sglang_version"])
        concurrent = self.concurrency(tokens)
        speed, speed_source = self.per_request_tok_s()
        free_after_graph = self.free_after_graph()
        row = self.layout_row(tokens, concurrent, speed, rest)
        return {
            "cell_size_bytes": cell,
            # One attention-DP rank's pool (what SGLang logs as max_total_num_tokens).
            "max_total_num_tokens": tokens,
            "kv_tokens_per_rank": tokens,
            "total_kv_tokens": row["total_kv_tokens"],
            "layout": row,
            "decode_roofline": self.roofline(concurrent, cell),
            "max_concurrent_requests": concurrent,
            "kv_bound_output_tok_s": round(concurrent * speed, 1),
            "headroom_gib": round(kv_cache.headroom_gib(self.pre, self.fraction), 2),
            "hicache_host_gib_total": round(hicache_total, 2),
            "warnings": self.warnings,
            "errors": self.errors,
            "details": {
                "attention": self.shape.attention,
                "architecture": self.shape.architecture,
                "kv_cache_dtype": self.dtype,
                "mem_fraction_static": round(self.fraction, 4),
                "sglang_default_mem_fraction_static": round(self.defaults.mem_fraction_static, 4),
                "max_safe_mem_fraction_static": round(self.max_safe_fraction(), 4),
                "pre_gib": round(self.pre, 2),
                "post_gib": round(self.post, 2),
                "kv_pool_gib": round(max(rest, 0.0), 2),
                "free_after_graph_gib": None
                if free_after_graph is None
                else round(free_after_graph, 2),
                "calibrated": self.prediction is not None,
                "calibration": None if self.calibration is None else self.calibration.reason,
                "calibration_notes": [] if self.prediction is None else self.prediction.notes,
                "calibration_set_aside": self.calibration_set_aside,
                "calibration_log_flags": self.calibration_log_flags,
                "free_after_graph_margin_gib": None
                if self.prediction is None
                else round(self.prediction.margin_gib, 2),
                "tokens_per_request": self.a["avg_input_len"] + self.a["avg_output_len"],
                "per_request_tok_s": round(speed, 2),
                "per_request_tok_s_source": speed_source,
                "dp_size": self.dp,
                "attn_dp_size": self.attn_dp,
            },
        }


class _CpuPlanner(_Planner):
    """A CPU server's plan (docs/CPU-SERVERS.md): host RAM and --max-total-tokens."""

    def __init__(
        self, config: dict[str, Any], weight_bytes: int, args: dict[str, Any], host: dict[str, Any]
    ):
        self.a = _merge_args(args)
        self.host = _typed_host(host, "cpu")
        _check_inputs(self.a)
        try:
            self.shape = model_shape(config)
        except ModelConfigError as exc:
            raise PlanInputError(str(exc), "model_config") from exc
        self.weight_bytes = _check_weight_bytes(weight_bytes)
        self.warnings = []
        self.errors = []
        self.layout = self._layout()
        self.tp = self.layout.tp_size
        self.dp = self.layout.dp_size
        self.attn_dp = self.layout.attn_dp_size
        self.dtype = str(self.a["kv_cache_dtype"])
        self.cal = _log_calibration(self.a)
        ram = self.host.get("host_ram_gib")
        self.ram_gib = None if ram is None else float(ram)

    def _tokens(self, cell: int) -> tuple[int, int | None]:
        """(tokens planned, the cap that fits host RAM or None when RAM is unknown)."""
        page = int(self.a["page_size"])
        fitting = None
        if self.ram_gib is not None:
            budget = self.ram_gib * kv_cache.CPU_RAM_FRACTION
            fitting = kv_cache.cpu_tokens_fitting(
                budget,
                self.weight_bytes,
                cell_size=cell,
                tp_size=self.tp,
                dp_size=self.dp,
                page_size=page,
            )
        given = self.a["max_total_tokens"]
        if given is not None:
            return int(given) // page * page, fitting
        hint = f" ({fitting} fit in {kv_cache.CPU_RAM_FRACTION:.0%} of host RAM)" if fitting else ""
        self.errors.append(
            _issue(
                "cpu_max_total_tokens",
                "A CPU server needs --max-total-tokens: SGLang's CPU engine sizes the KV pool "
                f"from the host's free RAM unless it is capped, taking most of it{hint}; cap it "
                "at what the workload needs.",
            )
        )
        return fitting or 0, fitting

    def check_ram(self, tokens: int, needed_gib: float, fitting: int | None) -> None:
        if self.ram_gib is None:
            self.warnings.append(
                _issue("host_ram_unknown", "host_ram_gib is not known: host RAM is not checked.")
            )
            return
        budget = self.ram_gib * kv_cache.CPU_RAM_FRACTION
        if needed_gib > budget:
            self.errors.append(
                _issue(
                    "cpu_host_ram",
                    f"max_total_tokens {tokens} needs {needed_gib:.2f} GiB of host RAM (weights "
                    f"{self.weight_bytes * self.dp / kv_cache.GIB:.2f} GiB, KV and process "
                    f"overhead), more than {kv_cache.CPU_RAM_FRACTION:.0%} of the host's "
                    f"{self.ram_gib:.1f} GiB; at most {fitting or 0} tokens fit.",
                )
            )

    def check_ignored(self) -> None:
        ignored = [k for k in ("mem_fraction_static", "enable_hierarchical_cache") if self.a[k]]
        if self.a["calibration"] or self.a["calibration_log"]:
            ignored.append("calibration (GPU memory records)")
        if ignored:
            self.warnings.append(
                _issue(
                    "cpu_ignored",
                    f"Not planned for a CPU server: {', '.join(ignored)}; the CPU plan is of "
                    "host RAM and max_total_tokens.",
                )
            )

    def run(self) -> dict[str, Any]:
        cell = kv_cache.cell_size_bytes(self.shape, self.dtype, self.tp)
        tokens, fitting = self._tokens(cell)
        kv_bytes = kv_cache.cpu_kv_bytes(cell, self.tp, self.dp, tokens)
        needed = kv_cache.cpu_host_ram_gib(self.weight_bytes, kv_bytes, self.tp, self.dp)
        self.check_ram(tokens, needed, fitting)
        self.check_ignored()
        self.check_dtype()
        self.check_context()
        concurrent = self.concurrency(tokens)
        speed, speed_source = self.per_request_tok_s()
        headroom = None if self.ram_gib is None else self.ram_gib - needed
        return {
            "cell_size_bytes": cell,
            "max_total_num_tokens": tokens,
            "max_concurrent_requests": concurrent,
            "kv_bound_output_tok_s": round(concurrent * speed, 1),
            # Host RAM left once the server is up (GPU plans: outside the static pool).
            "headroom_gib": None if headroom is None else round(headroom, 2),
            "hicache_host_gib_total": 0.0,
            "warnings": self.warnings,
            "errors": self.errors,
            "details": {
                "device": "cpu",
                "attention": self.shape.attention,
                "architecture": self.shape.architecture,
                "kv_cache_dtype": self.dtype,
                "kv_pool_gib": round(kv_bytes / kv_cache.GIB, 3),
                "weights_gib": round(self.weight_bytes * self.dp / kv_cache.GIB, 3),
                "host_ram_needed_gib": round(needed, 3),
                "host_ram_gib": self.ram_gib,
                "max_total_tokens_fitting": fitting,
                "calibrated": False,
                "calibration": None,
                "tokens_per_request": self.a["avg_input_len"] + self.a["avg_output_len"],
                "per_request_tok_s": round(speed, 2),
                "per_request_tok_s_source": speed_source,
                "dp_size": self.dp,
            },
        }


def plan(model_config: dict, weight_bytes: int, args: dict, host: dict) -> dict:
    """Plan one flag set. Pure: every input is data (the pre-flight slurps it from the host).

    model_config: config.json as a dict; weight_bytes: safetensors index metadata.total_size;
    args: SGLang flag values by field name (tp_size, mem_fraction_static, ...) plus workload
    (avg_input_len, avg_output_len, per_request_tok_s) and calibration_log (log text);
    host: gpu_memory_mib, host_ram_gib, gpu_count. Raises PlanInputError on bad input.
    args device "cpu" plans a CPU server (host RAM and max_total_tokens; no GPU fact needed).
    """
    device = args.get("device", "cuda") if isinstance(args, dict) else "cuda"
    if device == "cpu":
        return _CpuPlanner(model_config, weight_bytes, args, host).run()
    planner = _Planner(model_config, weight_bytes, args, host)
    result = planner.run()
    if planner.a["plan_layouts"] and planner.dp == 1 and planner.tp > 1:
        rows = [
            _layout_plan(model_config, weight_bytes, args, host, n)
            for n in attention_dp.attn_dp_sizes(planner.tp)
        ]
        result["attention_dp_layouts"] = rows
        result["recommended_layout"] = _recommend(rows, planner.attn_dp)
    return result


# A layout's CUDA graphs are captured for batch sizes up to this (SGLang's largest default).
_MAX_GRAPH_BS = 512


def _graph_bs_for(per_rank: int) -> int:
    """cuda_graph_max_bs_decode that covers a rank's planned batch (a multiple of 8): SGLang's
    default (512 on this GPU class) would reserve bs x attn_dp x 4.5 MiB under attention DP."""
    return max(8, min(_MAX_GRAPH_BS, math.ceil(per_rank / 8) * 8))


def _layout_plan(
    config: dict, weight_bytes: int, args: dict, host: dict, attn_dp: int
) -> dict[str, Any]:
    """One row of the attention-DP table: the flag set at attn_dp_size `attn_dp`."""
    layout_args = dict(args) | {
        "attn_dp_size": attn_dp,
        "enable_dp_attention": False,
        "dp_size": 1,
        "plan_layouts": False,
    }
    result = plan(config, weight_bytes, layout_args, host)
    given = args.get("cuda_graph_max_bs_decode")
    if attn_dp > 1 and given is None and result["max_concurrent_requests"] > 0:
        per_rank = math.ceil(result["max_concurrent_requests"] / attn_dp)
        layout_args["cuda_graph_max_bs_decode"] = _graph_bs_for(per_rank)
        result = plan(config, weight_bytes, layout_args, host)
    row = dict(result["layout"])
    row["cuda_graph_max_bs_decode"] = layout_args.get("cuda_graph_max_bs_decode")
    row["decode_roofline_tok_s"] = result["decode_roofline"].get("tok_s")
    row["decode_roofline"] = result["decode_roofline"]
    row["errors"] = [e["code"] for e in result["errors"]]
    return row


def _bound(row: dict[str, Any]) -> float:
    """A layout's planned throughput, capped by its decode roofline."""
    roof = row.get("decode_roofline_tok_s")
    kv = float(row["kv_bound_output_tok_s"])
    return kv if roof is None else min(kv, float(roof))


def _recommend(rows: list[dict[str, Any]], current: int) -> dict[str, Any] | None:
    """The attention-DP size with the highest planned throughput (KV-bound, capped by the
    roofline) among those that fit; within 2 % of it, the fewer ranks (less replication)."""
    fit = [row for row in rows if not row["errors"] and row["max_concurrent_requests"] > 0]
    if not fit:
        return None
    top = max(_bound(row) for row in fit)
    best = min((row for row in fit if _bound(row) >= top * 0.98), key=lambda r: r["attn_dp_size"])
    now = next((row for row in rows if row["attn_dp_size"] == current), None)
    gain = _bound(best) / _bound(now) if now and _bound(now) > 0 else None
    return {
        "attn_dp_size": best["attn_dp_size"],
        "cuda_graph_max_bs_decode": best["cuda_graph_max_bs_decode"],
        "planned_output_tok_s": round(_bound(best), 1),
        "gain_over_current": None if gain is None else round(gain, 2),
        "reason": (
            f"attention DP {best['attn_dp_size']}: {best['total_kv_tokens']} KV tokens in "
            f"{best['kv_pools']} pool(s), {best['max_concurrent_requests']} concurrent requests, "
            f"~{_bound(best):.0f} tok/s planned (KV-bound, capped by the decode roofline), with "
            f"{best['weights_per_gpu_gib']} GiB of weights per GPU; the highest of the layouts "
            "that fit (fewer ranks win within 2 %)"
        ),
    }


# --- command line ----------------------------------------------------------------------
def add_plan_arguments(parser: argparse.ArgumentParser, *, model_required: bool) -> None:
    """The planner's flags (shared with diagnose, which plans the levers it suggests)."""
    parser.add_argument(
        "--model-path", required=model_required, help="model directory (config.json)"
    )
    parser.add_argument("--tp-size", type=int, default=None)
    parser.add_argument("--dp-size", type=int, default=None)
    parser.add_argument("--attn-dp-size", type=int, default=None, help="attention-DP ranks")
    parser.add_argument(
        "--enable-dp-attention",
        action="store_true",
        default=None,
        help="deprecated: --dp-size N --enable-dp-attention means --attn-dp-size N",
    )
    parser.add_argument("--cuda-graph-max-bs-decode", type=int, default=None)
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument("--kv-cache-dtype", default=None, choices=sorted(kv_cache.KV_ELEM_BYTES))
    parser.add_argument("--enable-hierarchical-cache", action="store_true", default=None)
    parser.add_argument("--hicache-size", type=float, default=None, help="GB per rank")
    parser.add_argument("--hicache-ratio", type=float, default=None)
    parser.add_argument("--chunked-prefill-size", type=int, default=None)
    parser.add_argument("--max-running-requests", type=int, default=None)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--page-size", type=int, default=None)
    parser.add_argument(
        "--device", choices=DEVICES, default=None, help="cpu: plan host RAM (docs/CPU-SERVERS.md)"
    )
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument(
        "--gpu-memory-mib", type=float, default=None, help="per GPU, as nvidia-smi reports"
    )
    parser.add_argument("--host-ram-gib", type=float, default=None)
    parser.add_argument("--gpu-count", type=int, default=None)
    parser.add_argument("--gpu-name", default=None, help="as nvidia-smi names it")
    parser.add_argument(
        "--gpu-memory-bandwidth-gbs",
        type=float,
        default=None,
        help="per GPU, GB/s, for the decode roofline (default: a table of GPU models)",
    )
    parser.add_argument("--avg-input-len", type=int, default=None)
    parser.add_argument("--avg-output-len", type=int, default=None)
    parser.add_argument("--per-request-tok-s", type=float, default=None)
    parser.add_argument(
        "--calibrate-from", metavar="LOG", default=None, help="server log of an earlier run"
    )
    parser.add_argument(
        "--calibration",
        metavar="JSON",
        default=None,
        help="calibration record(s) or the host's store file (sglang_fleet.capacity.calibration)",
    )
    parser.add_argument(
        "--logged-flag",
        metavar="NAME=VALUE",
        action="append",
        default=None,
        help="a flag the --calibrate-from run used that its log does not say (repeatable; "
        f"one of {', '.join(logged_flags.STATABLE)}); the flags above describe the plan",
    )
    parser.add_argument("--calibration-mode", choices=calibration.MODES, default=None)
    parser.add_argument("--sglang-version", default=None)
    parser.add_argument("--min-free-after-graph-gib", type=float, default=None)


def _logged_flag_words(words: list[str]) -> dict[str, str]:
    flags = {}
    for word in words:
        name, sep, value = word.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or not name or not value.strip():
            raise PlanInputError(f"must be NAME=VALUE, got {_shown(word)}", "calibration_log_flags")
        flags[name] = value.strip()
    return flags


def split_namespace(ns: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(planner args, host facts) from parsed flags; reads the calibration log file."""
    values = vars(ns)
    args = {k: values[k] for k in ARG_DEFAULTS if k in values and values[k] is not None}
    for option, key, limit in (
        ("calibrate_from", "calibration_log", input_files.LOG_LIMIT),
        ("calibration", "calibration", input_files.JSON_LIMIT),
    ):
        if values.get(option):
            try:
                args[key] = input_files.read_text(values[option], limit, "")
            except ValueError as exc:
                raise PlanInputError(str(exc).strip(), key) from None
    if values.get("logged_flag"):
        args["calibration_log_flags"] = _logged_flag_words(values["logged_flag"])
    host = {k: values[k] for k in HOST_KEYS if values.get(k) is not None}
    return args, host


def _cpu_summary(result: dict[str, Any]) -> list[str]:
    d = result["details"]
    return [
        f"{d['architecture']} ({d['attention']}) on CPU, KV {d['kv_cache_dtype']}",
        f"cell size {result['cell_size_bytes']} B/token, "
        f"max_total_num_tokens {result['max_total_num_tokens']} "
        f"(fitting host RAM: {d['max_total_tokens_fitting']})",
        f"concurrent requests {result['max_concurrent_requests']}, "
        f"KV-bound output ~{result['kv_bound_output_tok_s']} tok/s "
        f"({d['per_request_tok_s']} tok/s per request, {d['per_request_tok_s_source']})",
        f"host RAM needed {d['host_ram_needed_gib']} GiB of {d['host_ram_gib']} GiB "
        f"(weights {d['weights_gib']}, KV {d['kv_pool_gib']}), left {result['headroom_gib']} GiB",
    ]


def _summary(result: dict[str, Any]) -> str:
    d = result["details"]
    if d.get("device") == "cpu":
        lines = _cpu_summary(result)
        lines += [f"ERROR {e['code']}: {e['message']}" for e in result["errors"]]
        lines += [f"WARNING {w['code']}: {w['message']}" for w in result["warnings"]]
        return "\n".join(lines)
    lines = [
        f"{d['architecture']} ({d['attention']}), KV {d['kv_cache_dtype']}, "
        f"mem_fraction_static {d['mem_fraction_static']} "
        f"(SGLang default {d['sglang_default_mem_fraction_static']})",
        f"cell size {result['cell_size_bytes']} B/token, "
        f"max_total_num_tokens {result['max_total_num_tokens']}",
        f"concurrent requests {result['max_concurrent_requests']}, "
        f"KV-bound output ~{result['kv_bound_output_tok_s']} tok/s "
        f"({d['per_request_tok_s']} tok/s per request, {d['per_request_tok_s_source']})",
        f"headroom outside the static pool {result['headroom_gib']} GiB, "
        f"HiCache host total {result['hicache_host_gib_total']} GiB",
        _roofline_line(result["decode_roofline"]),
    ]
    for row in result.get("attention_dp_layouts") or []:
        lines.append(
            f"attention DP {row['attn_dp_size']}: {row['weights_per_gpu_gib']} GiB weights/GPU, "
            f"{row['kv_tokens_per_rank']} KV tokens/rank x {row['kv_pools']} = "
            f"{row['total_kv_tokens']}, {row['max_concurrent_requests']} concurrent, "
            f"~{row['kv_bound_output_tok_s']} tok/s KV-bound, roofline "
            f"{row['decode_roofline_tok_s']} tok/s, OOM margin/rank "
            f"{row['oom_margin_gib_per_rank']} GiB"
            + (
                f" (cuda_graph_max_bs_decode {row['cuda_graph_max_bs_decode']})"
                if row["cuda_graph_max_bs_decode"]
                else ""
            )
            + (f" ERRORS {', '.join(row['errors'])}" if row["errors"] else "")
        )
    if result.get("recommended_layout"):
        lines.append(f"recommended: {result['recommended_layout']['reason']}")
    lines += [f"ERROR {e['code']}: {e['message']}" for e in result["errors"]]
    lines += [f"WARNING {w['code']}: {w['message']}" for w in result["warnings"]]
    return "\n".join(lines)


def _roofline_line(roof: dict[str, Any]) -> str:
    if roof.get("tok_s") is None:
        return f"decode roofline: {roof.get('reason')}"
    return (
        f"decode roofline {roof['tok_s']} tok/s at {roof['batch']} requests: "
        f"{roof['weight_gib_per_gpu']} GiB weights + {roof['kv_gib_per_gpu']} GiB KV per GPU "
        f"per step at {roof['bandwidth_gbs']:g} GB/s ({roof['bandwidth_source']})"
    )


# The command-line option behind each PlanInputError.argument that is not `--<name>`.
_CLI_OPTIONS = {
    "calibration_log": "--calibrate-from",
    "calibration_log_flags": "--logged-flag",
    "model_config": "--model-path",
    "weight_bytes": "--model-path",
}


def cli_message(exc: PlanInputError) -> str:
    """The error as argparse words it: `argument --tp-size: must be ...`."""
    if exc.argument is None:
        return exc.message
    option = _CLI_OPTIONS.get(exc.argument, "--" + exc.argument.replace("_", "-"))
    return f"argument {option}: {exc.message}"


def _plan_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    try:
        config, weight_bytes = read_model_dir(ns.model_path)
    except ModelConfigError as exc:
        raise PlanInputError(str(exc), "model_path") from exc
    args, host = split_namespace(ns)
    return plan(config, weight_bytes, args, host)


def main(argv: list[str] | None = None) -> int:
    # No abbreviations: `--tp 8` meaning --tp-size today could mean another flag tomorrow.
    parser = argparse.ArgumentParser(
        prog="python3 -m sglang_fleet.capacity.planner",
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
    )
    add_plan_arguments(parser, model_required=True)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args(argv)
    try:
        result = _plan_from_namespace(ns)
    except PlanInputError as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {cli_message(exc)}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if ns.json else _summary(result))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
