"""Where SGLang 0.5.23 puts each weight tensor, and what a GPU holds of it.

Read from the wheel, one module at a time (paths under `srt/`):

- `models/deepseek_v2.py` `DeepseekV2AttentionMLA`: `fused_qkv_a_proj_with_mqa` (or, without a
  q LoRA, `kv_a_proj_with_mqa`) is a `ReplicatedLinear`: whole on every GPU under any layout.
  `q_b_proj` / `q_proj`, `kv_b_proj` (`ColumnParallelLinear`) and `o_proj` (`RowParallelLinear`)
  take `parallel_group="attn_tp"`: split over tp / attn_dp GPUs.
- `models/deepseek_common/deepseek_weight_loader.py` `post_load_weights`: `w_kc` and `w_vc` are
  new contiguous tensors cut from `kv_b_proj`'s weight, which stays loaded: a second copy of it.
- `DeepseekV2MoE`: `MoEGate.weight` (experts x hidden, the default dtype) and its fp32
  `e_score_correction_bias` (noaux_tc) are plain parameters: replicated. Shared experts are a
  `DeepseekV2MLP` over "tp" (or fused into the MoE kernel, split the same way); the routed experts
  are a FusedMoE whose intermediate dimension is split over tp (with EP, whole experts over ep:
  the same bytes per GPU).
- `DeepseekV2DecoderLayer`: the first `first_k_dense_replace` layers have a dense
  `DeepseekV2MLP` over "tp" (replicated only with `--moe-dense-tp-size 1`).
- `layers/vocab_parallel_embedding.py`: the vocabulary is padded to a multiple of 64; the input
  embedding is split over the attention-TP group (`get_embedding_tp_kwargs`), `lm_head` over tp
  (`ParallelLMHead`, attention TP only with `--enable-dp-lm-head`).
- `layers/layernorm.py` RMSNorm: a replicated vector.
- `layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16*.py`: an N-bit
  weight is packed into int32 (N/8 bytes a weight) with one scale of the model dtype per group;
  modules the checkpoint's `ignore` list names stay in the model dtype.
- `models/llama.py`: `QKVParallelLinear` splits the query heads over tp and gives each GPU
  max(1, kv_heads / tp) key/value heads (replicas when tp exceeds them); `o_proj` and the MLP
  split over tp.
- `models/kimi_k25.py`: MoonViT's MLP (`MLP2`) and the projector are `ReplicatedLinear`.

The double builds the tensor list from config.json alone. What the checkpoint holds beyond it
(a vision tower, tensors of an architecture the double does not lay out) is placed whole on
every GPU for a multimodal model (its encoder) and split over tp otherwise; a checkpoint
smaller than the list (a quantization the double does not read) falls back to an even split.
No code here comes from sglang_fleet: tests/double/test_gpusim_matches_planner.py compares.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

VOCAB_PADDING = 64  # DEFAULT_VOCAB_PADDING_SIZE
FP32_BYTES = 4
# How a tensor is divided: whole everywhere, over attn_tp = tp / attn_dp, over tp, or
# key/value heads (each GPU holds max(1, heads / tp) of them).
REPLICATED, ATTN_TP, TP, KV_HEADS = "replicated", "attn_tp", "tp", "kv_heads"


@dataclass(frozen=True)
class Tensor:
    """One kind of weight, all layers together."""

    name: str  # SGLang's module path, layer index 0 standing for every layer
    nbytes: int
    group: str
    per_layer: bool = True  # spread over pipeline stages with the layers
    heads: int = 0  # KV_HEADS only: the model's key/value heads
    derived: bool = False  # made after loading, not in the checkpoint (w_kc, w_vc)


def _int(cfg: Mapping[str, Any], key: str, default: int = 0) -> int:
    value = cfg.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


class Quantization:
    """Bytes of a linear layer's weight as its quantization scheme stores it."""

    def __init__(self, config: Mapping[str, Any], dtype_bytes: int) -> None:
        self.dtype_bytes = dtype_bytes
        quant = config.get("quantization_config")
        quant = quant if isinstance(quant, Mapping) else {}
        self.method = str(quant.get("quant_method") or "")
        self.ignore = [str(p) for p in quant.get("ignore") or []]
        self.bits, self.group = 0, 0
        groups = quant.get("config_groups")
        if self.method == "compressed-tensors" and isinstance(groups, Mapping):
            for scheme in groups.values():
                weights = scheme.get("weights") if isinstance(scheme, Mapping) else None
                if isinstance(weights, Mapping) and weights.get("type") == "int":
                    self.bits = _int(weights, "num_bits")
                    self.group = _int(weights, "group_size")

    def _ignored(self, module: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif module == pattern or module.endswith("." + pattern):
                return True
        return False

    def linear_bytes(self, module: str, numel: int) -> int:
        """Bytes of `numel` weights of `module` (its scale groups run along the input)."""
        if self._ignored(module):
            return numel * self.dtype_bytes
        if self.bits and self.group:
            packed = numel * self.bits // 8
            return packed + numel // self.group * self.dtype_bytes
        if self.method == "fp8":
            return numel  # one byte a weight (block scales left out: 1/16384 of it)
        return numel * self.dtype_bytes


def _mla_attention(cfg: Mapping[str, Any], q: Quantization, dtype: int) -> list[Tensor]:
    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads", 1)
    q_lora, kv_lora = _int(cfg, "q_lora_rank"), _int(cfg, "kv_lora_rank")
    nope = _int(cfg, "qk_nope_head_dim", 128)
    rope, v_head = _int(cfg, "qk_rope_head_dim", 64), _int(cfg, "v_head_dim", 128)
    at = "model.layers.0.self_attn."
    out = []
    if q_lora:
        out += [
            Tensor(
                at + "fused_qkv_a_proj_with_mqa",
                q.linear_bytes(at + "q_a_proj", hidden * (q_lora + kv_lora + rope)),
                REPLICATED,
            ),
            Tensor(at + "q_a_layernorm", q_lora * dtype, REPLICATED),
            Tensor(
                at + "q_b_proj",
                q.linear_bytes(at + "q_b_proj", q_lora * heads * (nope + rope)),
                ATTN_TP,
            ),
        ]
    else:
        out += [
            Tensor(
                at + "kv_a_proj_with_mqa",
                q.linear_bytes(at + "kv_a_proj_with_mqa", hidden * (kv_lora + rope)),
                REPLICATED,
            ),
            Tensor(
                at + "q_proj",
                q.linear_bytes(at + "q_proj", hidden * heads * (nope + rope)),
                ATTN_TP,
            ),
        ]
    kv_b = kv_lora * heads * (nope + v_head)
    return [
        *out,
        Tensor(at + "kv_b_proj", q.linear_bytes(at + "kv_b_proj", kv_b), ATTN_TP),
        # post_load_weights: w_kc and w_vc, the model dtype, beside kv_b_proj.
        Tensor(at + "w_kc+w_vc", kv_b * dtype, ATTN_TP, derived=True),
        Tensor(at + "o_proj", q.linear_bytes(at + "o_proj", heads * v_head * hidden), ATTN_TP),
        Tensor(at + "kv_a_layernorm", kv_lora * dtype, REPLICATED),
    ]


def _mha_attention(cfg: Mapping[str, Any], q: Quantization) -> list[Tensor]:
    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads", 1)
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    head_dim = _int(cfg, "head_dim", hidden // max(1, heads))
    at = "model.layers.0.self_attn."
    return [
        Tensor(at + "qkv_proj.q", q.linear_bytes(at + "q_proj", hidden * heads * head_dim), TP),
        Tensor(
            at + "qkv_proj.kv",
            q.linear_bytes(at + "k_proj", 2 * hidden * kv_heads * head_dim),
            KV_HEADS,
            heads=kv_heads,
        ),
        Tensor(at + "o_proj", q.linear_bytes(at + "o_proj", heads * head_dim * hidden), TP),
    ]


def _mlp(cfg: Mapping[str, Any], q: Quantization, dtype: int) -> list[Tensor]:
    """Dense layers' MLP; for MoE layers the gate, shared and routed experts (all layers)."""
    hidden, layers = _int(cfg, "hidden_size"), _int(cfg, "num_hidden_layers")
    experts = _int(cfg, "n_routed_experts")
    dense = min(_int(cfg, "first_k_dense_replace"), layers) if experts else layers
    moe = layers - dense
    out = []
    if dense:
        at = "model.layers.0.mlp."
        numel = 3 * hidden * _int(cfg, "intermediate_size")
        dense_bytes = q.linear_bytes(at + "gate_proj", numel) * dense
        out.append(Tensor(at + "gate_up_proj+down_proj", dense_bytes, TP))
    if moe:
        at = "model.layers.0.mlp."
        inter = _int(cfg, "moe_intermediate_size")
        gate = experts * hidden * dtype
        if cfg.get("topk_method") == "noaux_tc":
            gate += experts * FP32_BYTES  # e_score_correction_bias
        shared = 3 * hidden * inter * _int(cfg, "n_shared_experts")
        routed = q.linear_bytes(at + "experts.0.gate_proj", 3 * hidden * inter) * experts
        out += [
            Tensor(at + "gate", gate * moe, REPLICATED),
            Tensor(
                at + "shared_experts",
                q.linear_bytes(at + "shared_experts.gate_proj", shared) * moe,
                TP,
            ),
            Tensor(at + "experts", routed * moe, TP),
        ]
    return out


def tensor_list(cfg: Mapping[str, Any], *, is_mla: bool, dtype_bytes: int) -> list[Tensor]:
    """The model's tensors from its text config, each all layers together."""
    layers = _int(cfg, "num_hidden_layers")
    hidden = _int(cfg, "hidden_size")
    vocab = padded_vocab(_int(cfg, "vocab_size", 32000))
    q = Quantization(cfg, dtype_bytes)
    attention = _mla_attention(cfg, q, dtype_bytes) if is_mla else _mha_attention(cfg, q)
    norms = Tensor("model.layers.0.layernorms", 2 * hidden * dtype_bytes, REPLICATED)
    out = [
        Tensor(t.name, t.nbytes * layers, t.group, True, t.heads, t.derived)
        for t in [*attention, norms]
    ]
    out += _mlp(cfg, q, dtype_bytes)
    out += [
        Tensor("model.embed_tokens", vocab * hidden * dtype_bytes, ATTN_TP, per_layer=False),
        Tensor("model.norm", hidden * dtype_bytes, REPLICATED, per_layer=False),
    ]
    if not cfg.get("tie_word_embeddings"):
        out.append(Tensor("lm_head", vocab * hidden * dtype_bytes, TP, per_layer=False))
    return out


def _share(t: Tensor, tp: int, attn_tp: int) -> float:
    if t.group == REPLICATED:
        return float(t.nbytes)
    if t.group == ATTN_TP:
        return t.nbytes / attn_tp
    if t.group == KV_HEADS:
        return t.nbytes / t.heads * max(1, t.heads // tp)
    return t.nbytes / tp


@dataclass(frozen=True)
class RankWeights:
    """What one GPU holds, and how: bytes by placement group."""

    by_group: dict[str, float]
    listed_bytes: int  # the checkpoint's tensors config.json describes, whole
    unlisted_bytes: int  # the checkpoint beyond them
    fallback: bool  # the checkpoint is smaller than the list: an even split instead

    @property
    def total(self) -> float:
        return sum(self.by_group.values())


def rank_weights(
    tensors: list[Tensor],
    checkpoint_bytes: int,
    *,
    tp: int,
    attn_dp: int = 1,
    pp: int = 1,
    stage_layer_share: float = 1.0,
    multimodal: bool = False,
) -> RankWeights:
    """Bytes one GPU holds. stage_layer_share: the largest stage's layers / all layers (the
    double sizes every rank like that stage); what is not per layer is spread over the stages."""
    attn_tp = max(1, tp // max(1, attn_dp))
    listed = sum(t.nbytes for t in tensors if not t.derived)
    unlisted = checkpoint_bytes - listed
    if unlisted < 0:
        even = checkpoint_bytes / (tp * pp)
        return RankWeights({TP: even}, listed, unlisted, fallback=True)
    by_group: dict[str, float] = {}
    for t in tensors:
        part = stage_layer_share if t.per_layer else 1 / pp
        by_group[t.group] = by_group.get(t.group, 0.0) + _share(t, tp, attn_tp) * part
    rest_group = REPLICATED if multimodal else TP
    rest = unlisted / pp if multimodal else unlisted / (tp * pp)
    by_group[rest_group] = by_group.get(rest_group, 0.0) + rest
    return RankWeights(by_group, listed, unlisted, fallback=False)
