"""An autotune search's inputs, typed: the operator's space, workload, SLOs, tolerance and
trial budget (docs/AUTOTUNE.md), and the host context every candidate's plan needs.

Each problem raises AutotuneInputError naming the variable and what it allows; nothing here needs
a host, so the playbook checks the inputs before it touches one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from sglang_fleet.capacity import kv_cache, speculative
from sglang_fleet.capacity.noop_flags import NOOP_FLAGS
from sglang_fleet.module_utils import typed_number
from sglang_fleet.module_utils.typed_number import Range, shown
from sglang_fleet.smoke.smoke_client.workload import format_lengths, parse_lengths

SPACE_FLAGS = (
    "mem_fraction_static",
    "max_running_requests",
    "chunked_prefill_size",
    "kv_cache_dtype",
    # Attention DP (docs/ATTENTION-DP.md) and the decode CUDA graph batch its ranks need.
    "attn_dp_size",
    "cuda_graph_max_bs_decode",
    # The prefill chunk one attention-DP rank runs: the candidate's chunked_prefill_size is
    # this x attn_dp_size, because SGLang divides the flag by the attention-DP size.
    "chunked_prefill_size_per_rank",
    # Speculative decoding (docs/SPECULATIVE.md): a list of settings, null for none; each one
    # a candidate beside the same flags without speculation.
    "speculative",
)
PER_RANK_CHUNK = "chunked_prefill_size_per_rank"
SPECULATIVE = "speculative"
# An autotune_space.speculative item's keys: SGLang's --speculative-<key> flags, and the
# accept length the operator expects before a trial measures one.
SPECULATIVE_KEYS = (
    "algorithm",
    "draft_model_path",
    "num_steps",
    "eagle_topk",
    "num_draft_tokens",
    "ngram_max_bfs_breadth",
    "accept_length",
)
_OFF = ("", "none", "off")
# KV dtypes that store as many bits as the model: no quality trade-off to opt into.
LOSSLESS_KV_DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16")
DEFAULT_TOLERANCE = 0.05
MAX_CANDIDATES = 1024
WORKLOAD_KEYS = ("input_len", "output_len", "concurrency", "num_prompts", "lengths")
# Bounds that keep every figure of a plan finite: no request is longer than 16 Mi tokens and no
# job has more prompts or concurrency than that.
MAX_WORKLOAD_VALUE = 1 << 24


INTEGER = Range(integer=True)
FRACTION = Range(0, 1, low_open=True, high_open=True)
POSITIVE = Range(0, low_open=True)


class AutotuneInputError(ValueError):
    """The autotune inputs are invalid; the message names the variable and allowed values."""


def _positive_int(value: Any, where: str, allow_minus_one: bool = False) -> int:
    extra = " or -1 (disabled)" if allow_minus_one else ""
    try:
        number = int(typed_number.read(value, where, INTEGER))
    except typed_number.NumberError:
        number = 0
    if not (number >= 1 or (allow_minus_one and number == -1)):
        raise AutotuneInputError(f"{where}: {shown(value)} is not a positive integer{extra}")
    return number


def _number(value: Any, where: str, allowed: Range, *, text: bool = True) -> float:
    """value as a number in `allowed` (plugins/module_utils/typed_number.py), or the inputs' error
    in
    this module's words: '<where>: <value> is not <allowed>'."""
    try:
        return float(typed_number.read(value, where, allowed, text=text))
    except typed_number.NumberError:
        raise AutotuneInputError(f"{where}: {shown(value)} is not {allowed}") from None


def _fraction(value: Any, where: str) -> float:
    return _number(value, where, FRACTION)


def _kv_dtype(value: Any, where: str, allowed: list[str]) -> str:
    text = str(value)
    if text not in kv_cache.KV_ELEM_BYTES:
        choices = ", ".join(sorted(kv_cache.KV_ELEM_BYTES))
        raise AutotuneInputError(f"{where}: {text!r} is not a KV cache dtype ({choices})")
    if text not in allowed:
        raise AutotuneInputError(
            f"{where}: {text} is not in autotune_kv_cache_dtypes_allowed "
            f"({', '.join(allowed)}). fp8 and fp4 KV caches trade output quality for capacity: "
            "add the dtype there to opt in."
        )
    return text


def speculative_flags(item: Mapping[str, Any] | None) -> dict[str, Any]:
    """An autotune_space.speculative item as SGLang's flags (the accept length is no flag)."""
    return {
        f"speculative_{key}": value
        for key, value in (item or {}).items()
        if key != "accept_length" and value is not None
    }


def _speculative_item(value: Any, where: str) -> dict[str, Any] | None:
    """One speculative setting typed, checked by SGLang 0.5.23's rules (the draft path may come
    from the server's flags, so it is not required here); None: no speculation."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _OFF):
        return None
    if not isinstance(value, Mapping):
        raise AutotuneInputError(
            f"{where}: {shown(value)} is neither null (no speculation) nor a mapping with keys "
            f"among {', '.join(SPECULATIVE_KEYS)}"
        )
    unknown = sorted(str(key) for key in value if key not in SPECULATIVE_KEYS)
    if unknown:
        raise AutotuneInputError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(SPECULATIVE_KEYS)}"
        )
    if not value.get("algorithm"):
        raise AutotuneInputError(f"{where}.algorithm is required (EAGLE, EAGLE3, NEXTN, ...)")
    item = {key: value[key] for key in SPECULATIVE_KEYS if value.get(key) is not None}
    try:
        speculative.settings(speculative_flags(item), None)
    except speculative.SpeculationError as exc:
        key = exc.flag.removeprefix("speculative_")
        raise AutotuneInputError(f"{where}.{key}: {exc.message}") from None
    item["algorithm"] = speculative.algorithm_of(speculative_flags(item))
    for key in ("num_steps", "eagle_topk", "num_draft_tokens", "ngram_max_bfs_breadth"):
        if key in item:
            item[key] = _positive_int(item[key], f"{where}.{key}")
    if "accept_length" in item:
        item["accept_length"] = _number(item["accept_length"], f"{where}.accept_length", Range(1))
    if "draft_model_path" in item and not isinstance(item["draft_model_path"], str):
        raise AutotuneInputError(f"{where}.draft_model_path must be a directory's path")
    return item


def draft_paths(space: Mapping[str, Any], base_flags: Mapping[str, Any]) -> list[str]:
    """The draft models a search may start (read on the canary before any trial): each
    speculative item's, or the server's own, where the algorithm has one (NGRAM has none)."""
    paths = set()
    for item in space.get(SPECULATIVE) or []:
        flags = dict(base_flags) | speculative_flags(item)
        path = flags.get("speculative_draft_model_path")
        if item is not None and path and item["algorithm"] != "NGRAM":
            paths.add(str(path))
    own = base_flags.get("speculative_draft_model_path")
    if own and speculative.algorithm_of(base_flags) not in (None, "NGRAM"):
        paths.add(str(own))
    return sorted(paths)


def _space_values(name: str, values: Any, allowed_dtypes: list[str]) -> list[Any]:
    where = f"autotune_space.{name}"
    if not isinstance(values, list) or not values:
        raise AutotuneInputError(f"{where} must be a non-empty list")
    if name == SPECULATIVE:
        items = [_speculative_item(v, f"{where}[{i}]") for i, v in enumerate(values)]
        unique = {json.dumps(item, sort_keys=True): item for item in items}
        return list(unique.values())
    if name == "mem_fraction_static":
        out: list[Any] = [_fraction(v, where) for v in values]
    elif name == "kv_cache_dtype":
        out = [_kv_dtype(v, where, allowed_dtypes) for v in values]
    else:
        chunk = name in ("chunked_prefill_size", PER_RANK_CHUNK)
        out = [_positive_int(v, where, chunk) for v in values]
    return list(dict.fromkeys(out))  # keep the operator's order, drop repeats


def validate_space(space: Any, allowed_dtypes: Iterable[str] | None = None) -> dict[str, list]:
    """The candidate space as typed lists; raises AutotuneInputError naming the variable."""
    allowed = list(allowed_dtypes) if allowed_dtypes is not None else list(LOSSLESS_KV_DTYPES)
    if not isinstance(space, Mapping) or not space:
        raise AutotuneInputError(
            f"autotune_space must be a mapping of lists, keys among {', '.join(SPACE_FLAGS)}"
        )
    noop = sorted(set(space) & set(NOOP_FLAGS))
    if noop:
        raise AutotuneInputError(
            f"autotune_space: {', '.join(noop)} does nothing in SGLang 0.5.23 (declared, read "
            "by no module; docs/SGLANG.md): trials over it would measure noise. Remove it; "
            f"allowed keys: {', '.join(SPACE_FLAGS)}"
        )
    if PER_RANK_CHUNK in space and "chunked_prefill_size" in space:
        raise AutotuneInputError(
            f"autotune_space: give chunked_prefill_size or {PER_RANK_CHUNK}, not both (the "
            "second is the first divided by attn_dp_size, as SGLang divides it)"
        )
    unknown = sorted(set(space) - set(SPACE_FLAGS))
    if unknown:
        raise AutotuneInputError(
            f"autotune_space: unknown key(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(SPACE_FLAGS)}"
        )
    typed = {
        name: _space_values(name, space[name], allowed) for name in SPACE_FLAGS if name in space
    }
    size = math.prod(len(v) for v in typed.values())
    if size > MAX_CANDIDATES:
        raise AutotuneInputError(
            f"autotune_space spans {size} candidates; at most {MAX_CANDIDATES} are planned"
        )
    return typed


def validate_workload(workload: Any) -> dict[str, Any]:
    """The search's workload typed: fixed lengths (input_len, output_len), or a job's shape
    (lengths: `I:O,...` from `python -m sglang_fleet.job shape`), whose means stand for the
    lengths the planner reads where they are not given."""
    if not isinstance(workload, Mapping):
        raise AutotuneInputError(
            "autotune_workload must be a mapping {input_len, output_len, concurrency, num_prompts}"
            " or {lengths, concurrency, num_prompts}"
        )
    unknown = sorted(str(key) for key in workload if key not in WORKLOAD_KEYS)
    if unknown:
        raise AutotuneInputError(
            f"autotune_workload: unknown key(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(WORKLOAD_KEYS)}"
        )
    out: dict[str, Any] = {}
    shape = workload.get("lengths")
    if shape is not None:
        try:
            pairs = parse_lengths(str(shape))
        except ValueError as exc:
            raise AutotuneInputError(f"autotune_workload.lengths: {exc}") from None
        out["lengths"] = format_lengths(pairs)
        for which, name in enumerate(("input_len", "output_len")):
            mean = round(sum(pair[which] for pair in pairs) / len(pairs))
            out[name] = mean if workload.get(name) is None else None
    for name in ("input_len", "output_len", "concurrency"):
        if out.get(name) is not None:
            continue
        if workload.get(name) is None:
            raise AutotuneInputError(f"autotune_workload.{name} is required")
        out[name] = _bounded_int(workload[name], f"autotune_workload.{name}")
    prompts = workload.get("num_prompts")
    out["num_prompts"] = (
        out["concurrency"]
        if prompts is None
        else _bounded_int(prompts, "autotune_workload.num_prompts")
    )
    return out


def _bounded_int(value: Any, where: str) -> int:
    number = _positive_int(value, where)
    if number > MAX_WORKLOAD_VALUE:
        raise AutotuneInputError(f"{where}: {value!r} is above {MAX_WORKLOAD_VALUE}")
    return number


def validate_slo(slo: Any) -> dict[str, float | None]:
    slo = dict(slo or {})
    unknown = sorted(set(slo) - {"p99_ttft_ms", "p99_tpot_ms", "max_failures"})
    if unknown:
        raise AutotuneInputError(
            f"autotune_slo: unknown key(s) {', '.join(unknown)}; "
            "allowed: p99_ttft_ms, p99_tpot_ms, max_failures"
        )
    out: dict[str, float | None] = {}
    for name in ("p99_ttft_ms", "p99_tpot_ms"):
        value = slo.get(name)
        out[name] = None if value is None else _number(value, f"autotune_slo.{name}", POSITIVE)
    failures = slo.get("max_failures", 0)
    out["max_failures"] = int(
        _number(failures, "autotune_slo.max_failures", Range(0, integer=True), text=False)
    )
    return out


def validate_inputs(
    *,
    space: Any,
    workload: Any,
    slo: Any = None,
    kv_cache_dtypes_allowed: Iterable[str] | None = None,
    tolerance: Any = DEFAULT_TOLERANCE,
    max_trials: Any = None,
) -> dict[str, Any]:
    """Every operator input of a search, typed; raises AutotuneInputError naming the variable
    and what it allows. Needs no host: the playbook calls it before touching one."""
    tol = _number(tolerance, "autotune_tolerance", Range(0, 1, high_open=True))
    allowed = None if kv_cache_dtypes_allowed is None else [str(d) for d in kv_cache_dtypes_allowed]
    for dtype in allowed or []:
        if dtype not in kv_cache.KV_ELEM_BYTES:
            choices = ", ".join(sorted(kv_cache.KV_ELEM_BYTES))
            raise AutotuneInputError(
                f"autotune_kv_cache_dtypes_allowed: {dtype!r} is not a KV cache dtype ({choices})"
            )
    return {
        "space": validate_space(space, allowed),
        "workload": validate_workload(workload),
        "slo": validate_slo(slo),
        "tolerance": tol,
        "max_trials": None
        if max_trials is None
        else _positive_int(max_trials, "autotune_max_trials"),
    }


def check_context(context: Mapping[str, Any], workload: Mapping[str, int]) -> None:
    """What every candidate's plan needs from the host and the model, before any trial."""
    host = context["host"]
    if not isinstance(host, Mapping):
        raise AutotuneInputError("autotune context host must be a mapping")
    for name in ("gpu_memory_mib", "gpu_count"):
        if as_float(host.get(name), POSITIVE) is None:
            raise AutotuneInputError(
                f"autotune context host.{name}: {shown(host.get(name))} is not a positive number "
                "(read from the host's GPUs)"
            )
    model = context["model_config"]
    window = model.get("max_position_embeddings") if isinstance(model, Mapping) else None
    need = workload["input_len"] + workload["output_len"]
    if isinstance(window, int) and not isinstance(window, bool) and 0 < window < need:
        raise AutotuneInputError(
            f"autotune_workload: input_len + output_len = {need} tokens, more than the model's "
            f"context window (max_position_embeddings {window})"
        )


def as_float(value: Any, allowed: Range = typed_number.ANY) -> float | None:
    """The value as a finite number in `allowed`, or None when it is not one (never an
    exception)."""
    return typed_number.finite_or_none(value, allowed)
