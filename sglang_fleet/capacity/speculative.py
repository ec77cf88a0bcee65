"""Speculative decoding in the capacity plan (docs/SPECULATIVE.md): SGLang 0.5.23's rules for the
`--speculative-*` flags, the draft model's memory, the 48 reset, and the expected speed-up.

Read from the 0.5.23 wheel (paths inside it):

- `srt/arg_groups/speculative_hook.py`: NEXTN is EAGLE; EAGLE, EAGLE3 and STANDALONE take
  steps, top-k and draft tokens together (`_handle_eagle_family`: all three or none; none picks
  them by the target's architecture, `_auto_choose_speculative_params`), and with top-k 1 the
  draft tokens are set to steps + 1; NGRAM takes top-k from
  `--speculative-ngram-max-bfs-breadth` and 12 draft tokens by default; STANDALONE and NGRAM
  refuse attention DP; every one of them sets `--max-running-requests` to 48 when it is not
  given ("Max running requests is reset to 48 for speculative decoding").
- `srt/speculative/eagle_utils.py` `organize_draft_results`: the verify tree takes the best
  num_draft_tokens - 1 of topk + (num_steps - 1) x topk^2 candidates (torch.topk: more fails).
- `srt/model_executor/pool_configurator.py` (`DefaultPoolConfigurator`): for EAGLE, EAGLE3 and
  STANDALONE the *target's* bytes per KV token grow by int(target cell x draft layers / target
  layers) ("assumes the draft shares the target's per-layer KV size"), so the draft's KV comes
  out of the static pool as a share of the target's token budget; the draft worker then
  allocates its own pool with the target's token count and its own cell
  (`scheduler.init_memory_pools`), sharing the request-to-token pool. Draft layers:
  `spec_aux_hidden_state.py` (num_nextn_predict_layers when the draft's config says it, else
  its layer count) and `layer_setup.py` (0 nextn layers allocate its layer count anyway).
  NGRAM has no draft KV (`has_draft_kv`).
- `srt/mem_cache/kv_cache_configurator.py` `_profile_available_bytes`: the KV budget is measured
  once target *and* draft weights are loaded ("Loaded weights (target + draft) can exceed the
  static budget"): the draft's weights come out of the static pool too.
- `srt/arg_groups/memory_hook.py`: speculative_num_draft_tokens enters the static reserve only
  when --mem-fraction-static is unset *and* the server is a disaggregated decode server; a
  server like the job's (fraction given, no disaggregation) reserves nothing for it.
- Draft architectures: the EAGLE-3 drafts 0.5.23 registers (`models/llama_eagle3.py`,
  `models/kimi_k25_eagle3.py`) take the target's hidden states (`target_hidden_size`, else
  `hidden_size`, x the captured layers) into their `fc`; STANDALONE refuses a draft whose
  vocabulary differs from the target's (`standalone_worker_v2.py`).

The speed-up model (`speedup`, docs/SPECULATIVE.md "The model"): a step costs the bytes it reads
over the memory bandwidth (the decode roofline, attention_dp.step_bytes, at an efficiency a
calibration log measures, else 1) plus the FLOPs of its tokens over the GPU's peak BF16 rate. A
speculative cycle is num_steps draft steps and one verify of num_draft_tokens per request, and
yields accept_length tokens per request; plain decode yields one per step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from sglang_fleet.capacity import attention_dp, kv_cache
from sglang_fleet.capacity.model_config import (
    ModelConfigError,
    ModelShape,
    model_shape,
    text_config,
)
from sglang_fleet.module_utils import typed_number
from sglang_fleet.module_utils.typed_number import shown

# Built-in algorithms of 0.5.23 (arg_groups/fields/spec.py); NEXTN is EAGLE.
BUILTIN_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO")
ALIASES = {"NEXTN": "EAGLE"}
# Those whose memory and flags this planner models.
MODELED = ("EAGLE", "EAGLE3", "STANDALONE", "NGRAM")
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "STANDALONE")
# "Currently standalone/ngram speculative decoding does not support dp attention."
NO_ATTENTION_DP = ("STANDALONE", "NGRAM")
# What 0.5.23 sets --max-running-requests to when speculation is on and the flag is not given.
RESET_MAX_RUNNING_REQUESTS = 48
NGRAM_DEFAULT_DRAFT_TOKENS = 12
NGRAM_DEFAULT_MAX_BFS_BREADTH = 10
# The EAGLE-3 draft classes 0.5.23 registers (EntryClass of llama_eagle3.py, kimi_k25_eagle3.py).
EAGLE3_DRAFT_ARCHITECTURES = frozenset({"LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"})
# EAGLE-3 MLA drafts whose replicated fused_qkv_a_proj_with_mqa takes [embedding, hidden]:
# 2 x hidden_size inputs (models/kimi_k25_eagle3.py, Eagle3MLADecoderLayer).
DOUBLED_QKV_A = frozenset({"Eagle3DeepseekV2ForCausalLM"})
# Targets whose own MTP layers are the draft when no draft path is given (_handle_eagle_family).
MTP_TARGET_ARCHITECTURES = frozenset(
    {
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV4ForCausalLM",
        "Glm4MoeForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "GlmMoeDsaForCausalLM",
        "BailingMoeForCausalLM",
        "BailingMoeV2ForCausalLM",
        "BailingMoeV2_5ForCausalLM",
        "MistralLarge3ForCausalLM",
        "PixtralForConditionalGeneration",
        "HYV3ForCausalLM",
        "HYV4ForCausalLM",
        "Qwen4ExpForConditionalGeneration",
    }
)
# _auto_choose_speculative_params: (steps, topk, draft tokens) when none is given.
_AUTO_5_4_8 = frozenset({"LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM"})
FLAGS = (
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_ngram_max_bfs_breadth",
)
RESET_CODE = "speculative_max_running_requests_reset"
_COUNT = typed_number.Range(1, 4096, integer=True)

# Peak dense BF16 tensor throughput per GPU (TFLOPS, 1e12/s), from the vendors' data sheets;
# matched like attention_dp.GPU_BANDWIDTH_GBS. The RTX PRO 6000's is its data sheet's 4000 FP4
# TOPS (with sparsity) / 8: FP4 -> FP8 -> BF16 halve, sparsity doubles. `gpu_bf16_tflops`
# overrides the table.
GPU_BF16_TFLOPS: dict[str, float] = {
    "RTX PRO 6000 Blackwell": 500.0,
    "H200": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10": 125.0,
    "MI300X": 1307.0,
}
# Batches the speed-up is listed at (and the search for where it stops paying ends at).
CURVE_BATCHES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 150, 192, 256, 384, 512)
MAX_SCAN_BATCH = 4096


class SpeculationError(ValueError):
    """A speculative flag set SGLang 0.5.23 refuses or silently changes; `flag` names it."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag
        self.message = message


def algorithm_of(flags: Mapping[str, Any]) -> str | None:
    """The algorithm as SGLang resolves its name (upper case, NEXTN -> EAGLE); None when off."""
    value = flags.get("speculative_algorithm")
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    name = str(value).strip().upper()
    return ALIASES.get(name, name)


@dataclass(frozen=True)
class Settings:
    """The speculative settings a start resolves (steps, top-k, draft tokens per request)."""

    algorithm: str
    draft_path: str | None
    num_steps: int
    eagle_topk: int
    num_draft_tokens: int
    source: str  # "flags", or whose defaults SGLang picks

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(flags: Mapping[str, Any], name: str) -> int | None:
    """A count flag (its text too, as Ansible may hand it over); None when not given."""
    value = flags.get(name)
    if value is None:
        return None
    try:
        return int(typed_number.read(value, name, _COUNT, text=True))
    except typed_number.NumberError:
        raise SpeculationError(
            name, f"must be a whole number from 1 to {_COUNT.high:g}, got {shown(value)}"
        ) from None


def _eagle_counts(flags: Mapping[str, Any], target_arch: str | None, algorithm: str) -> Settings:
    steps = _int(flags, "speculative_num_steps")
    topk = _int(flags, "speculative_eagle_topk")
    draft = _int(flags, "speculative_num_draft_tokens")
    path = flags.get("speculative_draft_model_path") or None
    if steps is None and topk is None and draft is None:
        if algorithm == "STANDALONE":
            auto, whose = (3, 1, 4), "STANDALONE"
        elif target_arch in _AUTO_5_4_8:
            auto, whose = (5, 4, 8), str(target_arch)
        else:
            auto, whose = (3, 1, 4), str(target_arch or "this target")
        return Settings(algorithm, path, *auto, source=f"SGLang's choice for {whose}")
    if steps is None or topk is None or (draft is None and topk > 1):
        raise SpeculationError(
            "speculative_num_steps"
            if steps is None
            else "speculative_eagle_topk"
            if topk is None
            else "speculative_num_draft_tokens",
            f"{algorithm} takes speculative_num_steps, speculative_eagle_topk and "
            "speculative_num_draft_tokens together: set all three or none (SGLang 0.5.23 "
            f"asserts it, or fails later); got steps {steps}, topk {topk}, draft tokens {draft}",
        )
    if topk == 1:
        if draft is not None and draft != steps + 1:
            raise SpeculationError(
                "speculative_num_draft_tokens",
                f"{draft} with speculative_eagle_topk 1 and speculative_num_steps {steps}: "
                f"SGLang 0.5.23 replaces it by steps + 1 = {steps + 1} (its warning "
                "'speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
                f"speculative_eagle_topk == 1'); set {steps + 1}",
            )
        return Settings(algorithm, path, steps, topk, steps + 1, "flags")
    assert draft is not None  # topk > 1 without draft tokens was refused above
    candidates = topk + (steps - 1) * topk * topk
    if draft - 1 > candidates:
        raise SpeculationError(
            "speculative_num_draft_tokens",
            f"{draft} with speculative_eagle_topk {topk} and speculative_num_steps {steps}: the "
            f"verify tree picks num_draft_tokens - 1 = {draft - 1} of the topk + (steps - 1) x "
            f"topk^2 = {candidates} tokens the draft proposes, which fails at the first decode "
            f"(torch.topk in organize_draft_results); at most {candidates + 1}",
        )
    return Settings(algorithm, path, steps, topk, draft, "flags")


def _ngram_counts(flags: Mapping[str, Any]) -> Settings:
    breadth = _int(flags, "speculative_ngram_max_bfs_breadth") or NGRAM_DEFAULT_MAX_BFS_BREADTH
    draft = _int(flags, "speculative_num_draft_tokens") or NGRAM_DEFAULT_DRAFT_TOKENS
    steps = _int(flags, "speculative_num_steps") or max(1, draft // breadth)
    source = "flags" if flags.get("speculative_num_draft_tokens") else "SGLang's NGRAM defaults"
    return Settings("NGRAM", None, steps, breadth, draft, source)


def settings(flags: Mapping[str, Any], target_arch: str | None = None) -> Settings | None:
    """The speculative settings of a flag set, None without speculation; SpeculationError
    names the flag SGLang 0.5.23 refuses, fails on or silently changes.

    target_arch: the target's config.json architectures[0] (what picks SGLang's defaults and
    whether an MTP target is its own draft); None when the target is not known yet (the
    descriptions' check, before the model is read): the draft path is then not required."""
    algorithm = algorithm_of(flags)
    if algorithm is None:
        return None
    if algorithm not in BUILTIN_ALGORITHMS:
        raise SpeculationError(
            "speculative_algorithm",
            f"{flags.get('speculative_algorithm')!r} is not one of SGLang 0.5.23's algorithms "
            f"({', '.join(BUILTIN_ALGORITHMS)})",
        )
    if algorithm not in MODELED:
        raise SpeculationError(
            "speculative_algorithm",
            f"{algorithm}: the planner models the memory of {', '.join(MODELED)} (and NEXTN) "
            "only; what it cannot plan it does not let through (docs/SPECULATIVE.md)",
        )
    ranks = attention_dp.attn_dp_of(flags)
    if algorithm in NO_ATTENTION_DP and ranks > 1:
        raise SpeculationError(
            "speculative_algorithm",
            f"{algorithm} with attention DP {ranks} (attn_dp_size, or dp_size with "
            f"enable_dp_attention): SGLang 0.5.23 refuses it ('Currently "
            f"{'standalone' if algorithm == 'STANDALONE' else 'ngram'} speculative decoding "
            "does not support dp attention'); use EAGLE/EAGLE3, or no attention DP",
        )
    if algorithm == "NGRAM":
        return _ngram_counts(flags)
    found = _eagle_counts(flags, target_arch, algorithm)
    needs_path = algorithm != "EAGLE" or (
        target_arch is not None and target_arch not in MTP_TARGET_ARCHITECTURES
    )
    if found.draft_path is None and needs_path:
        raise SpeculationError(
            "speculative_draft_model_path",
            f"{algorithm} needs a draft model: set speculative_draft_model_path (only an EAGLE "
            "(NEXTN) start of an MTP model such as DeepSeek-V3 uses the target's own MTP layers; "
            f"this target is {target_arch or 'unknown'})",
        )
    return found


def reset_applies(flags: Mapping[str, Any]) -> bool:
    """SGLang sets --max-running-requests to 48: speculation on, the flag not given."""
    return algorithm_of(flags) is not None and flags.get("max_running_requests") is None


# --- the draft model ---------------------------------------------------------------------------
def _text_hidden(config: Mapping[str, Any]) -> int | None:
    value = text_config(dict(config)).get("hidden_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def draft_problems(
    algorithm: str, target_config: Mapping[str, Any], draft_config: Mapping[str, Any]
) -> list[str]:
    """Why SGLang 0.5.23 cannot run this draft with this target (empty when it can)."""
    try:
        draft_arch = model_shape(dict(draft_config)).architecture
    except ModelConfigError as exc:
        return [f"the draft's config.json cannot be read as SGLang reads it: {exc}"]
    problems = []
    if algorithm == "EAGLE3" and draft_arch not in EAGLE3_DRAFT_ARCHITECTURES:
        problems.append(
            f"EAGLE3 needs an EAGLE-3 draft ({', '.join(sorted(EAGLE3_DRAFT_ARCHITECTURES))} "
            f"in SGLang 0.5.23); this draft is {draft_arch}"
        )
    if algorithm == "EAGLE" and draft_arch in EAGLE3_DRAFT_ARCHITECTURES:
        problems.append(
            f"{draft_arch} is an EAGLE-3 draft (it reads three of the target's layers): run it "
            "with speculative_algorithm EAGLE3"
        )
    target_hidden = _text_hidden(target_config)
    if algorithm in ("EAGLE", "EAGLE3") and target_hidden is not None:
        text = text_config(dict(draft_config))
        wanted = text.get("target_hidden_size") or text.get("hidden_size")
        if isinstance(wanted, int) and wanted != target_hidden:
            problems.append(
                f"the draft reads the target's hidden states of size {wanted} "
                f"(target_hidden_size or hidden_size in its config.json), but the target's "
                f"hidden_size is {target_hidden}: a draft trained for another model"
            )
    if algorithm == "STANDALONE":
        mine = text_config(dict(draft_config)).get("vocab_size")
        theirs = text_config(dict(target_config)).get("vocab_size")
        if mine != theirs:
            problems.append(
                f"STANDALONE needs the target's vocabulary: the draft's vocab_size is {mine}, "
                f"the target's {theirs} (SGLang 0.5.23 refuses it at start)"
            )
    return problems


@dataclass(frozen=True)
class DraftMemory:
    """What the draft takes on one GPU: weights, and KV per token of the target's pool."""

    architecture: str
    attention: str
    budget_layers: int  # what the target's cell is grown by (0.5.23's share)
    layers: int  # what the draft worker allocates
    weight_bytes: int  # the draft checkpoint
    weights_per_gpu_bytes: float
    budget_cell_bytes: int  # added to the target's bytes per token of its KV budget
    cell_bytes: int  # the draft pool's own bytes per token

    def beyond_budget_bytes(self, tokens: int) -> int:
        """Bytes the draft's own pool takes beyond the share the budget gave it (> 0: they come
        out of the memory outside the static pool)."""
        return max(0, self.cell_bytes - self.budget_cell_bytes) * tokens

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["weights_per_gpu_gib"] = round(out.pop("weights_per_gpu_bytes") / kv_cache.GIB, 3)
        return out


def _draft_layers(draft_config: Mapping[str, Any], shape: ModelShape) -> tuple[int, int]:
    """(layers the budget counts, layers the draft worker allocates)."""
    nextn = text_config(dict(draft_config)).get("num_nextn_predict_layers")
    if isinstance(nextn, int) and not isinstance(nextn, bool) and nextn >= 0:
        return nextn, nextn or shape.num_layers
    return shape.num_layers, shape.num_layers


def draft_memory(
    found: Settings,
    target: ModelShape,
    target_cell: int,
    target_config: Mapping[str, Any],
    draft: tuple[Mapping[str, Any], int] | None,
    *,
    kv_cache_dtype: str,
    attn_tp_size: int,
) -> DraftMemory | None:
    """The draft's memory on one GPU, as 0.5.23 places it; None for NGRAM (no draft model).

    draft: the draft's (config.json, checkpoint bytes). An EAGLE start of an MTP target without
    a draft path runs the target's own NextN layers, loaded from the target's checkpoint, whose
    bytes the plan already counts: no weights are added, the budget grows by its
    num_nextn_predict_layers.
    """
    if found.algorithm == "NGRAM":
        return None
    if draft is None:
        nextn = _params(target_config, "num_nextn_predict_layers")
        return DraftMemory(
            architecture=f"{target.architecture} (its own NextN layers)",
            attention=target.attention,
            budget_layers=nextn,
            layers=max(nextn, 1),
            weight_bytes=0,
            weights_per_gpu_bytes=0.0,
            budget_cell_bytes=int(target_cell * nextn / target.num_layers),
            cell_bytes=int(target_cell * max(nextn, 1) / target.num_layers),
        )
    draft_config, weights = dict(draft[0]), int(draft[1])
    shape = model_shape(draft_config)
    budget_layers, layers = _draft_layers(draft_config, shape)
    draft_shape = ModelShape(**(asdict(shape) | {"num_layers": layers}))
    layout = attention_dp.weight_layout(draft_config, shape, max(weights, 1))
    replicated = layout.replicated
    if shape.architecture in DOUBLED_QKV_A:
        replicated *= 2
    replicated = min(replicated, weights)
    return DraftMemory(
        architecture=shape.architecture,
        attention=shape.attention,
        budget_layers=budget_layers,
        layers=layers,
        weight_bytes=weights,
        # One TP group with the target's attention TP (draft_parallel.resolve_draft_parallel_
        # layout); the parts MLA replicates stay whole, the rest is split.
        weights_per_gpu_bytes=replicated + (weights - replicated) / attn_tp_size,
        budget_cell_bytes=int(target_cell * budget_layers / target.num_layers),
        cell_bytes=kv_cache.cell_size_bytes(draft_shape, kv_cache_dtype, attn_tp_size),
    )


# --- the speed-up model -------------------------------------------------------------------------
def gpu_bf16_tflops(gpu_name: str | None) -> tuple[float | None, str | None]:
    """(TFLOPS, the table key) for an nvidia-smi GPU name; (None, None) if unknown."""
    return attention_dp.table_lookup(GPU_BF16_TFLOPS, gpu_name)


def _params(config: Mapping[str, Any], key: str) -> int:
    value = text_config(dict(config)).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def flops_per_token(
    config: Mapping[str, Any], shape: ModelShape, layout: attention_dp.Layout, context: int
) -> float:
    """FLOPs one token costs one GPU in a forward pass: 2 x the parameters it multiplies (the
    attention projections split over attention TP, the rest over TP; of the routed experts only
    the top-k it is routed to) plus its attention over `context` tokens of KV."""
    text = text_config(dict(config))
    hidden = _params(config, "hidden_size")
    heads = _params(config, "num_attention_heads") or 1
    replicated, split = attention_dp.attention_params(text, shape)
    layers = shape.num_layers
    experts = _params(config, "n_routed_experts") or _params(config, "num_experts")
    dense_layers = min(_params(config, "first_k_dense_replace"), layers) if experts else layers
    moe_layers = layers - dense_layers
    moe_inter = _params(config, "moe_intermediate_size")
    routed = moe_layers * _params(config, "num_experts_per_tok") * 3 * hidden * moe_inter
    shared = moe_layers * _params(config, "n_shared_experts") * 3 * hidden * moe_inter
    dense = dense_layers * 3 * hidden * _params(config, "intermediate_size")
    head = _params(config, "vocab_size") * hidden
    attn_tp, tp = layout.attn_tp_size, layout.tp_size
    params = replicated * layers + split * layers / attn_tp + (routed + shared + dense + head) / tp
    if shape.is_mla:  # absorbed MLA: scores over kv_lora + rope, values over kv_lora
        per_head = shape.kv_lora_rank * 2 + shape.qk_rope_head_dim
    else:
        per_head = shape.head_dim + shape.v_head_dim
    attention = 2 * context * per_head * max(1, heads // attn_tp) * layers
    return 2 * params + attention


@dataclass(frozen=True)
class StepCosts:
    """What the speed-up model needs of one server (all per GPU)."""

    weights: attention_dp.WeightLayout
    layout: attention_dp.Layout
    cell_bytes: int
    context_tokens: int
    bandwidth_gbs: float
    tflops: float
    flops_per_token: float
    draft_weights_per_gpu_bytes: float
    draft_cell_bytes: int
    draft_flops_per_token: float
    efficiency: float  # share of the memory bandwidth a step reaches (1: the roofline)

    def memory_s(self, tokens: int, requests: int) -> float:
        read = attention_dp.step_bytes(
            self.weights,
            self.layout,
            tokens=tokens,
            requests=requests,
            context_tokens=self.context_tokens,
            cell_size_bytes=self.cell_bytes,
        )
        return read / (self.bandwidth_gbs * 1e9 * self.efficiency)

    def compute_s(self, tokens: int, flops: float) -> float:
        return tokens * flops / (self.tflops * 1e12)

    def plain_step_s(self, batch: int) -> float:
        return self.memory_s(batch, batch) + self.compute_s(batch, self.flops_per_token)

    def draft_step_s(self, batch: int, topk: int) -> float:
        per_rank = math.ceil(batch / self.layout.pools)
        read = self.draft_weights_per_gpu_bytes + per_rank * self.context_tokens * (
            self.draft_cell_bytes
        )
        memory = read / (self.bandwidth_gbs * 1e9 * self.efficiency)
        return memory + self.compute_s(batch * topk, self.draft_flops_per_token)

    def verify_step_s(self, batch: int, draft_tokens: int) -> float:
        tokens = batch * draft_tokens
        return self.memory_s(tokens, batch) + self.compute_s(tokens, self.flops_per_token)


def speedup(costs: StepCosts, found: Settings, accept_length: float, batch: int) -> float:
    """Output tokens/s with speculation over without, at `batch` running requests."""
    cycle = found.num_steps * costs.draft_step_s(batch, found.eagle_topk) + costs.verify_step_s(
        batch, found.num_draft_tokens
    )
    if found.algorithm == "NGRAM":  # its draft is a lookup, not a model
        cycle = costs.verify_step_s(batch, found.num_draft_tokens)
    return accept_length * costs.plain_step_s(batch) / cycle


def efficiency_from(costs: StepCosts, batch: float, per_request_tok_s: float) -> float | None:
    """The share of the memory roofline a measured decode reached: the measured step (one token
    per request) less its compute, against the bytes it read. None when it says nothing."""
    b = max(1, round(batch))
    step = 1.0 / per_request_tok_s
    busy = step - costs.compute_s(b, costs.flops_per_token)
    if busy <= 0:
        return None
    ideal = costs.memory_s(b, b) * costs.efficiency
    return max(0.01, min(1.0, ideal / busy))


def _scan_batches() -> list[int]:
    """Every batch to 64, then steps of about 5 % to MAX_SCAN_BATCH."""
    batches = list(range(1, 65))
    while batches[-1] < MAX_SCAN_BATCH:
        batches.append(min(MAX_SCAN_BATCH, max(batches[-1] + 1, round(batches[-1] * 1.05))))
    return batches


def curve(
    costs: StepCosts, found: Settings, accept_length: float, extra: list[int]
) -> dict[str, Any]:
    """The speed-up at the listed batches (and `extra` ones), and the ranges of running batches
    (1..MAX_SCAN_BATCH) where it pays (>= 1): a grid, each change between two of its points
    found by bisection. A MoE target can pay at a large batch and not at a small one: its
    verify's extra tokens read more experts while few are read."""

    def pays(batch: int) -> bool:
        return speedup(costs, found, accept_length, batch) >= 1

    def first_change(low: int, high: int) -> int:
        """The first batch in (low, high] whose answer differs from low's."""
        start = pays(low)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if pays(mid) == start else (low, mid)
        return high

    scan = _scan_batches()
    ranges: list[list[int]] = []
    begin = 1 if pays(1) else None
    for low, high in itertools.pairwise(scan):
        if pays(low) == pays(high):
            continue
        change = first_change(low, high)
        if begin is None:
            begin = change
        else:
            ranges.append([begin, change - 1])
            begin = None
    if begin is not None:
        ranges.append([begin, MAX_SCAN_BATCH])
    listed = sorted({*CURVE_BATCHES, *(b for b in extra if 0 < b <= MAX_SCAN_BATCH)})
    return {
        "points": [
            {"batch": b, "speedup": round(speedup(costs, found, accept_length, b), 3)}
            for b in listed
        ],
        "pays_at_batches": ranges,
        "stops_paying_at_batch": ranges[-1][1] + 1
        if ranges and ranges[-1][1] < MAX_SCAN_BATCH
        else None,
        "scanned_to_batch": MAX_SCAN_BATCH,
    }
