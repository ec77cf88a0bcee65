"""Attention data parallelism and the decode roofline (docs/ATTENTION-DP.md).

Attention DP (SGLang 0.5.23 `--attn-dp-size N`, N dividing tp) splits the tp GPUs of a
server into N attention-DP ranks of attn_tp = tp / N GPUs. Each rank has its own scheduler
and its own KV pool for its own requests, so an MLA model (whose latent KV every GPU of a
plain-TP server holds for every request) gets N pools instead of one. The price is weights:
the attention projections that plain TP splits over tp GPUs are split over attn_tp only.

This module computes, from config.json alone:

- `weight_layout`: the checkpoint's bytes by how SGLang places them (docs/ATTENTION-DP.md,
  "Where the weights go"): replicated everywhere (`fused_qkv_a_proj_with_mqa`), split over
  attn_tp (`q_b_proj`, `kv_b_proj`, `o_proj`, the input embedding), split over tp (`lm_head`,
  dense MLPs, shared and routed experts).
- `extra_weight_gib`: GiB more per GPU than plain TP holds, for one attention-DP size. The
  planner adds it to measured (calibrated) or estimated weights: a TP run's log plans every
  layout.
- `decode_roofline`: the bytes one decode step must read per GPU (weights it touches and the
  batch's KV) over the GPU's memory bandwidth, as tokens per second at a batch size.
- `resolve_layout`: both spellings of the flag, as SGLang 0.5.23 resolves them.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from sglang_fleet.capacity.model_config import MAX_DIMENSION, ModelShape, text_config

GIB = 1 << 30

# SGLang 0.5.23's own warning for the deprecated spelling (srt/arg_groups/argparse_actions.py
# DeprecatedStoreTrueAction, new_flag of --enable-dp-attention in srt/server_args.py).
DEPRECATED_DP_ATTENTION_WARNING = (
    "'--enable-dp-attention' is deprecated and will be removed in a future release. "
    "Use '--attn-dp-size <dp-size>' instead."
)
# srt/arg_groups/parallel_hook.py: the two checks SGLang makes on the layout.
NOT_DIVISIBLE = "tp_size must be divisible by attn_dp_size * attn_cp_size"
REPLICAS_WITH_ATTN_DP = (
    "data-parallel replicas combined with attention data parallelism are not supported."
)

# Memory bandwidth (GB/s, 1e9 bytes) of common GPUs, from the vendors' data sheets. Keys are
# matched as whole words of nvidia-smi's name, the longest first (so "A100" never matches
# "A10"). `gpu_memory_bandwidth_gbs` overrides the table for any GPU.
GPU_BANDWIDTH_GBS: dict[str, float] = {
    "RTX PRO 6000 Blackwell": 1792.0,
    "RTX 6000 Ada": 960.0,
    "RTX 5090": 1792.0,
    "RTX 4090": 1008.0,
    "H200": 4800.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,  # SXM5, HBM3
    "H20": 4000.0,
    "GH200": 4000.0,
    "B200": 8000.0,
    "GB200": 8000.0,
    "B300": 8000.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,  # the 40 GB cards
    "A10G": 600.0,
    "A10": 600.0,
    "L40S": 864.0,
    "L40": 864.0,
    "L4": 300.0,
    "MI300X": 5300.0,
    "MI325X": 6000.0,
}


class LayoutError(ValueError):
    """The attention-DP layout is not one SGLang accepts; argument names the flag."""

    def __init__(self, message: str, argument: str) -> None:
        super().__init__(message)
        self.argument = argument


@dataclass(frozen=True)
class Layout:
    """How a server's GPUs are arranged, as SGLang resolves the flags."""

    tp_size: int
    attn_dp_size: int
    dp_size: int
    deprecated_spelling: bool

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.attn_dp_size

    @property
    def pools(self) -> int:
        """KV pools (one per attention-DP rank per replica)."""
        return self.attn_dp_size * self.dp_size


def resolve_layout(
    tp_size: int, dp_size: int, attn_dp_size: int | None, enable_dp_attention: bool
) -> Layout:
    """SGLang 0.5.23's resolution: `--dp-size N --enable-dp-attention` is `--attn-dp-size N`
    with `dp_size 1` (parallel_hook `_handle_deprecated_dp_attention`); then tp % attn_dp == 0
    and no replicas next to attention DP."""
    attn = attn_dp_size or 1
    # SGLang reports enable_dp_attention true whenever attention DP runs (server_args,
    # /server_info): only a layout the old spelling decides is the deprecated one.
    deprecated = bool(enable_dp_attention) and attn == 1
    if deprecated and attn == 1:
        attn, dp_size = dp_size, 1
    if attn > 1 and dp_size > 1:
        raise LayoutError(
            f"--dp-size {dp_size} with --attn-dp-size {attn}: {REPLICAS_WITH_ATTN_DP}", "dp_size"
        )
    if tp_size % attn:
        sizes = ", ".join(str(n) for n in attn_dp_sizes(tp_size))
        raise LayoutError(
            f"{NOT_DIVISIBLE}: tp_size {tp_size} is not divisible by {attn} (one of {sizes})",
            "attn_dp_size",
        )
    return Layout(tp_size, attn, dp_size, deprecated)


def deprecation_message(layout: Layout) -> str:
    """SGLang's warning and the spelling that replaces the operator's flags."""
    new = f"--attn-dp-size {layout.attn_dp_size}" if layout.attn_dp_size > 1 else "nothing"
    return (
        f"{DEPRECATED_DP_ATTENTION_WARNING} For this server: {new} (and no --dp-size) instead "
        "of --enable-dp-attention --dp-size; SGLang 0.5.23 still accepts the old spelling and "
        "drops it after 2026-12-31."
    )


def attn_dp_sizes(tp_size: int) -> list[int]:
    """Every attention-DP size SGLang accepts for tp_size (the divisors of tp)."""
    return [n for n in range(1, tp_size + 1) if tp_size % n == 0]


# --- where the weights go -----------------------------------------------------------------
@dataclass(frozen=True)
class WeightLayout:
    """Checkpoint bytes by placement (all layers together)."""

    # Whole on every GPU under any layout: MLA's fused_qkv_a_proj_with_mqa (ReplicatedLinear)
    # and the MoE router (MoEGate.weight and its e_score_correction_bias, plain parameters).
    replicated: int
    attn_split: int  # split over attn_tp: q_b_proj, kv_b_proj, o_proj (MHA: qkv, o)
    embedding: int  # input embedding, split over attn_tp
    lm_head: int  # split over tp (unless --enable-dp-lm-head)
    dense_mlp: int  # dense layers' MLP and shared experts, split over tp
    routed_experts: int  # the rest of the checkpoint, split over tp
    routed_experts_per_layer: int
    moe_layers: int
    n_routed_experts: int
    experts_per_tok: int
    attention_elem_bytes: int
    # MLA: w_kc and w_vc, which post_load_weights cuts from kv_b_proj's weight (model dtype) and
    # keeps beside it: split over attn_tp like kv_b_proj, but not in the checkpoint.
    kv_b_copy: int = 0
    # The checkpoint's bytes beyond the parts config.json describes (a dense model's norms, an
    # encoder); negative when the config overstates the checkpoint (a quantization this
    # layout does not read): the GPUs' share then falls back to checkpoint / tp.
    unlaid: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _dim(cfg: dict[str, Any], key: str, default: int = 0) -> int:
    value = cfg.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_DIMENSION:
        return value
    return default


def attention_elem_bytes(config: dict[str, Any]) -> int:
    """Bytes per attention/embedding weight: 1 for fp8 checkpoints (DeepSeek-V3 quantizes its
    attention projections), else 2 (int4 recipes such as Kimi-K2.5's keep `self_attn` in
    bf16: their quantization_config lists it under `ignore`)."""
    quant = config.get("quantization_config") or text_config(config).get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return 1 if method == "fp8" else 2


def attention_params(text: dict[str, Any], shape: ModelShape) -> tuple[int, int]:
    """(replicated, attn_split) parameters of one layer's attention."""
    hidden = _dim(text, "hidden_size")
    heads = _dim(text, "num_attention_heads", 1)
    if shape.is_mla:
        q_lora = _dim(text, "q_lora_rank")
        nope = _dim(text, "qk_nope_head_dim", 128)
        qk = nope + shape.qk_rope_head_dim
        replicated = hidden * (q_lora + shape.kv_lora_rank + shape.qk_rope_head_dim)
        q_b = q_lora * heads * qk if q_lora else hidden * heads * qk
        kv_b = shape.kv_lora_rank * heads * (nope + shape.v_head_dim)
        o_proj = heads * shape.v_head_dim * hidden
        if not q_lora:  # no q LoRA: q_proj is split with the rest, q_a is absent
            replicated = hidden * (shape.kv_lora_rank + shape.qk_rope_head_dim)
        return replicated, q_b + kv_b + o_proj
    q = hidden * heads * shape.head_dim
    kv = hidden * shape.num_kv_heads * (shape.head_dim + shape.v_head_dim)
    o_proj = heads * shape.v_head_dim * hidden
    return 0, q + kv + o_proj


def weight_layout(config: dict[str, Any], shape: ModelShape, weight_bytes: int) -> WeightLayout:
    """Split the checkpoint's bytes by placement; the routed experts are what is left once
    the parts config.json describes are counted (so their quantization need not be known)."""
    text = text_config(config)
    elem = attention_elem_bytes(config)
    layers = shape.num_layers
    hidden = _dim(text, "hidden_size")
    vocab = _dim(text, "vocab_size")
    replicated, split = attention_params(text, shape)
    experts = _dim(text, "n_routed_experts") or _dim(text, "num_experts")
    dense_layers = min(_dim(text, "first_k_dense_replace"), layers) if experts else layers
    moe_layers = layers - dense_layers
    dense = dense_layers * 3 * hidden * _dim(text, "intermediate_size")
    shared = (
        moe_layers
        * 3
        * hidden
        * _dim(text, "moe_intermediate_size")
        * _dim(text, "n_shared_experts")
    )
    embedding = vocab * hidden * elem
    lm_head = 0 if text.get("tie_word_embeddings") else vocab * hidden * elem
    router = moe_layers * experts * hidden * 2  # MoEGate.weight, the model dtype (bf16)
    if text.get("topk_method") == "noaux_tc":
        router += moe_layers * experts * 4  # its fp32 e_score_correction_bias
    counted = (replicated + split) * layers * elem + embedding + lm_head + (dense + shared) * elem
    counted += router
    routed = max(0, weight_bytes - counted) if experts else 0
    unlaid = weight_bytes - counted
    dense_rest = max(0, unlaid) if not experts else 0  # split over tp with the dense MLP
    kv_b_copy = 0
    if shape.is_mla:
        heads, nope = _dim(text, "num_attention_heads", 1), _dim(text, "qk_nope_head_dim", 128)
        kv_b_copy = shape.kv_lora_rank * heads * (nope + shape.v_head_dim) * layers * 2
    return WeightLayout(
        replicated=replicated * layers * elem + router,
        attn_split=split * layers * elem,
        embedding=embedding,
        lm_head=lm_head,
        dense_mlp=(dense + shared) * elem + dense_rest,
        routed_experts=routed,
        routed_experts_per_layer=routed // moe_layers if moe_layers else 0,
        moe_layers=moe_layers,
        n_routed_experts=experts,
        experts_per_tok=_dim(text, "num_experts_per_tok", 1) if experts else 0,
        attention_elem_bytes=elem,
        kv_b_copy=kv_b_copy,
        unlaid=unlaid,
    )


def weights_per_gpu_bytes(w: WeightLayout, tp_size: int, attn_dp_size: int) -> float:
    """What one GPU holds under a layout (model weights only; no buffers)."""
    attn_tp = tp_size // attn_dp_size
    over_tp = w.lm_head + w.dense_mlp + w.routed_experts
    return w.replicated + (w.attn_split + w.embedding) / attn_tp + over_tp / tp_size


def resident_bytes_per_gpu(w: WeightLayout, tp_size: int, attn_dp_size: int) -> float:
    """What one GPU holds once weights are loaded: its weights and the copies SGLang makes of
    them after loading (MLA's w_kc/w_vc). What "Load weight end ... mem usage" reports."""
    attn_tp = tp_size // attn_dp_size
    if w.unlaid < 0:
        checkpoint = w.replicated + w.attn_split + w.embedding + w.lm_head + w.dense_mlp
        checkpoint += w.routed_experts + w.unlaid  # the fields count what was laid out
        return checkpoint / tp_size + extra_weight_gib(w, tp_size, attn_dp_size) * GIB
    return weights_per_gpu_bytes(w, tp_size, attn_dp_size) + w.kv_b_copy / attn_tp


def extra_weight_gib(w: WeightLayout, tp_size: int, attn_dp_size: int) -> float:
    """GiB more per GPU than the same tp holds without attention DP: the attention parts
    (and MLA's w_kc/w_vc copy) split over attn_tp instead of tp."""
    attn_tp = tp_size // attn_dp_size
    return (w.attn_split + w.embedding + w.kv_b_copy) * (1 / attn_tp - 1 / tp_size) / GIB


# --- decode roofline ------------------------------------------------------------------------
def table_lookup(table: dict[str, float], gpu_name: str | None) -> tuple[float | None, str | None]:
    """(value, the key that matched) of a table keyed by GPU model, for an nvidia-smi GPU name:
    keys match as whole words, the longest first (so "A100" never matches "A10")."""
    if not gpu_name:
        return None, None
    for key in sorted(table, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", gpu_name, re.I):
            return table[key], key
    return None, None


def gpu_bandwidth_gbs(gpu_name: str | None) -> tuple[float | None, str | None]:
    """(GB/s, the table key that matched) for an nvidia-smi GPU name; (None, None) if unknown."""
    return table_lookup(GPU_BANDWIDTH_GBS, gpu_name)


def experts_touched(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a layer reads for `tokens` tokens, each routed to top_k of
    n_experts, assuming uniform routing: n * (1 - (1 - k/n)^tokens)."""
    if n_experts <= 0 or tokens <= 0:
        return 0.0
    return n_experts * (1 - (1 - min(top_k, n_experts) / n_experts) ** tokens)


def step_bytes(
    w: WeightLayout,
    layout: Layout,
    *,
    tokens: int,
    requests: int,
    context_tokens: int,
    cell_size_bytes: int,
) -> float:
    """Bytes one forward step reads on one GPU: the weights of its layout except routed experts
    none of the step's `tokens` chose (the MoE layers see the whole replica's tokens, gathered
    over attention-DP ranks), and the KV of its attention-DP rank's share of `requests`, each
    holding `context_tokens`. A decode step has one token per request; a speculative verify
    step has num_draft_tokens per request and reads each request's KV once."""
    per_replica_tokens = math.ceil(tokens / layout.dp_size)
    full = weights_per_gpu_bytes(w, layout.tp_size, layout.attn_dp_size)
    idle = 0.0
    if w.n_routed_experts and w.routed_experts:
        touched = experts_touched(w.n_routed_experts, w.experts_per_tok, per_replica_tokens)
        idle = w.routed_experts * (1 - touched / w.n_routed_experts) / layout.tp_size
    per_rank = math.ceil(math.ceil(requests / layout.dp_size) / layout.attn_dp_size)
    return full - idle + per_rank * context_tokens * cell_size_bytes


@dataclass(frozen=True)
class Roofline:
    batch: int
    context_tokens: int
    weight_bytes_per_gpu: float
    kv_bytes_per_gpu: float
    bandwidth_gbs: float
    bandwidth_source: str
    step_ms: float
    tok_s: float

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("weight_bytes_per_gpu", "kv_bytes_per_gpu"):
            out[name.replace("_bytes", "_gib")] = round(out.pop(name) / GIB, 3)
        out["step_ms"] = round(self.step_ms, 3)
        out["tok_s"] = round(self.tok_s, 1)
        return out


def decode_roofline(
    w: WeightLayout,
    layout: Layout,
    *,
    batch: int,
    context_tokens: int,
    cell_size_bytes: int,
    bandwidth_gbs: float,
    bandwidth_source: str,
) -> Roofline | None:
    """The fastest one decode step can be on one GPU: every byte it must read, read once at
    full memory bandwidth (compute, communication and kernel overheads are not counted).

    batch: requests decoding at once in the whole server (each replica gets batch / dp).
    Per GPU a step reads the weights of its layout except routed experts no token of the
    step chose (the MoE layers see the whole replica's batch, gathered over attention-DP
    ranks), and the KV of the requests of its own attention-DP rank (batch / attn_dp).
    context_tokens: the average tokens a decoding request holds (input + half the output).
    """
    if batch <= 0 or bandwidth_gbs <= 0:
        return None
    weights = step_bytes(
        w, layout, tokens=batch, requests=batch, context_tokens=0, cell_size_bytes=0
    )
    kv = (
        step_bytes(
            w,
            layout,
            tokens=batch,
            requests=batch,
            context_tokens=context_tokens,
            cell_size_bytes=cell_size_bytes,
        )
        - weights
    )
    step_s = (weights + kv) / (bandwidth_gbs * 1e9)
    return Roofline(
        batch=batch,
        context_tokens=context_tokens,
        weight_bytes_per_gpu=weights,
        kv_bytes_per_gpu=kv,
        bandwidth_gbs=bandwidth_gbs,
        bandwidth_source=bandwidth_source,
        step_ms=step_s * 1000,
        tok_s=batch / step_s,
    )


def attn_dp_of(flags: Any) -> int:
    """The attention-DP size a flag set runs (both spellings, as SGLang resolves them); its own
    attn_dp_size (or 1) when the layout is no layout SGLang runs: the planner names that."""
    try:
        return resolve_layout(
            int(flags.get("tp_size") or 1),
            int(flags.get("dp_size") or 1),
            int(flags.get("attn_dp_size") or 1),
            str(flags.get("enable_dp_attention")).lower() in ("true", "1", "yes"),
        ).attn_dp_size
    except (LayoutError, TypeError, ValueError):
        return int(flags.get("attn_dp_size") or 1)
