"""What a calibration record predicts for a new flag set: the KV pool and the memory free after
CUDA graph capture, scaled from the measured start (docs/CALIBRATION.md, the model).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from sglang_fleet.capacity import kv_cache
from sglang_fleet.capacity.calibration import (
    DECODE_GRAPH_MIB_PER_BS,
    MARGIN_CHUNK_TOKENS,
    MHA_PREFILL_GRAPH_MIB_PER_BUCKET,
    MLA_PREFILL_GRAPH_MIB,
    REQ_TO_TOKEN_BYTES,
    SAME_FRACTION,
    count_or_none,
    first_given,
)
from sglang_fleet.capacity.model_config import ModelShape
from sglang_fleet.module_utils.typed_number import finite_or_none


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
    requested_mrr = count_or_none(values.get("max_running_requests"))
    chunk = count_or_none(first_given(values.get("chunked_prefill_size"), chunk_hint))
    defaults = kv_cache.sglang_default_mem_fraction(
        gpu_mib, shape, tp, chunked_prefill_size=chunk, max_running_requests=requested_mrr
    )
    explicit_bs = count_or_none(
        first_given(values.get("cuda_graph_max_bs_decode"), values.get("cuda_graph_max_bs"))
    )
    fraction = finite_or_none(values.get("mem_fraction_static"))
    attn_dp = count_or_none(values.get("attn_dp_size")) or 1
    dtype = values.get("kv_cache_dtype") or "auto"
    return _Setting(
        fraction=defaults.mem_fraction_static if fraction is None else fraction,
        dtype=dtype if isinstance(dtype, str) else "auto",  # match() refused any other
        chunk=defaults.chunked_prefill_size,
        decode_bs=explicit_bs if explicit_bs is not None else defaults.decode_cuda_graph_max_bs,
        page=count_or_none(values.get("page_size")) or 1,
        context=count_or_none(values.get("context_length")) or shape.context_length,
        requested_mrr=requested_mrr,
        max_total_tokens=count_or_none(values.get("max_total_tokens")),
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
    tp = int(count_or_none(flags.get("tp_size")) or 1)
    gpu_mib = float(
        first_given(
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
    old_mrr = count_or_none(measured.get("max_running_requests"))
    old_context = count_or_none(measured.get("context_len")) or old.context
    if old_mrr is None or tokens <= 0:
        return 0.0
    new_mrr = _resolved_mrr(new, tokens)
    growth = (new_mrr + 1) * new.context - (old_mrr + 1) * old_context
    return max(0.0, growth * REQ_TO_TOKEN_BYTES / kv_cache.GIB)
