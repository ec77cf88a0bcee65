"""Speculative decoding as SGLang 0.5.23 resolves, places and runs it (README, "Speculative
decoding").

Resolution (what `--speculative-*` become before anything loads), from the 0.5.23 wheel:
- `srt/arg_groups/speculative_hook.py` `handle_speculative_decoding`: the name upper-cased,
  NEXTN (and EAGLE) resolved to EAGLE by `_resolve_speculative_algorithm_alias`;
  `srt/speculative/spec_info.py` `SpeculativeAlgorithm.from_string` refuses other names
  ("Unknown speculative algorithm name: X") and dispatches EAGLE, EAGLE3 and STANDALONE to
  `_handle_eagle_family`, NGRAM to `_handle_ngram`.
- Both handlers: `--max-running-requests` unset -> 48, with SGLang's warning; STANDALONE and
  NGRAM refuse attention DP; NGRAM's top-k is `--speculative-ngram-max-bfs-breadth` and its
  draft tokens default to 12; EAGLE's steps/top-k/draft tokens come from
  `_auto_choose_speculative_params` when none is set (setting top-k or draft tokens without steps
  trips its bare `assert`), and top-k 1 forces draft tokens = steps + 1.
- The hook runs after `handle_gpu_memory_settings` (`srt/arg_groups/pipeline.py`), so the
  default `--mem-fraction-static` and decode CUDA-graph size are chosen before the reset to 48.

Placement (the draft's memory), from `srt/managers/scheduler.py` `init_model_worker`,
`srt/model_executor/model_runner_components/spec_aux_hidden_state.py` and
`srt/model_executor/pool_configurator.py` `DefaultPoolConfigurator`: see `DraftPlacement`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Any

from gpusim.logs import SPECULATIVE_HOOK
from gpusim.memory import StartupFailure, cell_size_bytes
from gpusim.model import ModelShape, load_model
from gpusim.state import Timing

# The value `_handle_eagle_family` / `_handle_ngram` give --max-running-requests when unset.
RESET_MAX_RUNNING_REQUESTS = 48
RESET_WARNING = (
    "Max running requests is reset to 48 for speculative decoding. You can override this by "
    "explicitly setting --max-running-requests."
)
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "STANDALONE")
# Algorithms 0.5.23 knows that the double does not model (it refuses them, naming itself).
UNMODELLED = ("DFLASH", "DSPARK", "UNO", "FROZEN_KV_MTP")
NGRAM_DEFAULT_DRAFT_TOKENS = 12
# Targets whose checkpoint carries its own MTP head: without --speculative-draft-model-path,
# `_handle_eagle_family` makes the target's directory the draft's.
MTP_ARCHITECTURES = (
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
)
# `_auto_choose_speculative_params`: (steps, top-k, draft tokens) by target architecture.
AUTO_PARAMS_5_4_8 = ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM")
# Page-size > 1 with top-k > 1: the attention backends that can draft a tree on pages.
PAGE_TREE_BACKENDS = ("flashinfer", "fa3", "triton")


@dataclass(frozen=True)
class DraftPlacement:
    """What speculation changes in start-up's memory decisions (memory.plan_memory).

    - `max_running_requests`: the 48 reset, applied after the memory defaults were chosen.
    - The draft's weights load after the target's and before the target's KV budget is
      profiled, so they come out of the same free memory (`init_target_memory_pool` adds the
      draft's bytes; the "no GPU memory for the KV cache" error says "draft weights are now
      counted"). One draft worker per rank, split over the same TP group.
    - EAGLE/EAGLE3/STANDALONE: the target's per-token budget grows by
      int(target cell x draft KV layers / target layers): the draft's KV is priced at the
      *target's* per-layer size (the wheel's comment: "assumes the draft shares the target's
      per-layer KV size"). The draft pool then gets the target's token count and its own cell
      (its layers, heads, head size, KV dtype), sharing the request-to-token pool and the
      allocator. When its own cell is larger than what was priced, the difference comes out of
      the memory outside the static pool (`DraftPlacement.draft_cell_size` vs the budget).
    - NGRAM: no draft model, no draft KV.
    """

    max_running_requests: int | None
    draft_weight_bytes_per_rank: float = 0.0
    draft_budget_layers: int = 0
    draft_cell_size: float = 0.0
    draft_architecture: str = ""
    draft_kv_dtype: str = "auto"
    # Tokens per request the target's verify graph runs (num_draft_tokens; cuda_graph_setup.py).
    verify_tokens_per_req: int = 1


@dataclass
class Speculation:
    """A resolved `--speculative-*` flag set: what SGLang's hook leaves in server_args."""

    algorithm: str
    num_steps: int
    eagle_topk: int
    num_draft_tokens: int
    max_running_requests: int | None
    draft: ModelShape | None
    draft_path: str | None
    draft_kv_layers: int
    placement: DraftPlacement
    # The draft's weights, whole (before the TP split); 0 for NGRAM.
    draft_weight_bytes: float = 0.0
    # The warnings `sglang.srt.arg_groups.speculative_hook` logged, in SGLang's order.
    warnings: list[str] = field(default_factory=list)
    # Server arguments the hook changed, by SGLang's dest names (for server_args and
    # /server_info, which show resolved values).
    resolved: dict[str, Any] = field(default_factory=dict)

    @property
    def max_accept_length(self) -> int:
        """Tokens one verify step can accept per request: the drafted chain plus the bonus
        token. EAGLE trees accept at most one branch of num_steps drafts; NGRAM's trie can
        hand over all its draft tokens."""
        if self.algorithm == "NGRAM":
            return self.num_draft_tokens
        return self.num_steps + 1


def _arg(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def _attn_dp(args: argparse.Namespace) -> int:
    attn = _arg(args, "attn_dp_size", 1)
    if getattr(args, "enable_dp_attention", False) and attn == 1:
        return _arg(args, "dp_size", 1)
    return attn


def _warn(spec: Speculation, message: str) -> None:
    """Log as SGLang's hook does, when it does (before any error that follows)."""
    spec.warnings.append(message)
    SPECULATIVE_HOOK.warning(message)


def _fail(exc_type: str, message: str) -> StartupFailure:
    return StartupFailure(exc_type, message, "args")


def resolve(args: argparse.Namespace, model: ModelShape) -> Speculation | None:
    """`handle_speculative_decoding` for the algorithms the double models; None without
    `--speculative-algorithm`. Raises StartupFailure (phase "args") where SGLang raises."""
    name = getattr(args, "speculative_algorithm", None)
    if name is None:
        return None
    algorithm = name.upper()
    if algorithm == "NEXTN":
        algorithm = "EAGLE"  # _resolve_speculative_algorithm_alias (no Gemma-4 drafts here)
    if algorithm in UNMODELLED:
        raise _fail(
            "ValueError",
            f"gpusim: --speculative-algorithm {algorithm} is accepted by SGLang 0.5.23 but not "
            f"modelled by the double (it models {', '.join((*EAGLE_FAMILY, 'NGRAM'))} and "
            "NEXTN)",
        )
    if algorithm not in (*EAGLE_FAMILY, "NGRAM"):
        raise _fail("ValueError", f"Unknown speculative algorithm name: {algorithm}")
    if algorithm == "NGRAM":
        return _ngram(args)
    return _eagle_family(args, model, algorithm)


def _disable_overlap_for_cpu(args: argparse.Namespace, spec: Speculation) -> bool:
    """`_disable_overlap_schedule_for_cpu`; returns whether overlap is (now) disabled."""
    disabled = bool(getattr(args, "disable_overlap_schedule", False))
    if getattr(args, "device", None) == "cpu" and not disabled:
        spec.resolved["disable_overlap_schedule"] = True
        _warn(spec, "Overlap schedule is not implemented for speculative decoding on CPU.")
        return True
    return disabled


def _reset_max_running(args: argparse.Namespace, spec: Speculation) -> None:
    if getattr(args, "max_running_requests", None) is None:
        spec.max_running_requests = RESET_MAX_RUNNING_REQUESTS
        spec.resolved["max_running_requests"] = RESET_MAX_RUNNING_REQUESTS
        _warn(spec, RESET_WARNING)


def _ngram(args: argparse.Namespace) -> Speculation:
    """`_handle_ngram`."""
    device = getattr(args, "device", None)
    if device not in (None, "cuda", "cpu", "xpu"):
        raise _fail(
            "ValueError", "Ngram speculative decoding only supports CUDA, CPU, or XPU devices."
        )
    spec = Speculation(
        algorithm="NGRAM",
        num_steps=0,
        eagle_topk=0,
        num_draft_tokens=0,
        max_running_requests=getattr(args, "max_running_requests", None),
        draft=None,
        draft_path=None,
        draft_kv_layers=0,
        placement=DraftPlacement(max_running_requests=None),
    )
    _disable_overlap_for_cpu(args, spec)
    _reset_max_running(args, spec)
    topk = _arg(args, "speculative_ngram_max_bfs_breadth", 10)
    draft_tokens = getattr(args, "speculative_num_draft_tokens", None)
    if draft_tokens is None:
        draft_tokens = NGRAM_DEFAULT_DRAFT_TOKENS
        _warn(
            spec,
            "speculative_num_draft_tokens is set to 12 by default for ngram speculative "
            "decoding. You can override this by explicitly setting "
            "--speculative-num-draft-tokens.",
        )
    steps = getattr(args, "speculative_num_steps", None)
    if steps is None:
        steps = draft_tokens // topk
    _warn(
        spec,
        "The mixed chunked prefill are disabled because of using ngram speculative decoding.",
    )
    page = _arg(args, "page_size", 1)
    backend = getattr(args, "attention_backend", None)
    if topk > 1 and page > 1 and backend is not None and backend != "flashinfer":
        raise _fail(
            "ValueError",
            f"speculative_eagle_topk({topk}) > 1 with page_size({page}) > 1 is unstable and "
            "produces incorrect results for paged attention backends. This combination is "
            "only supported for the 'flashinfer' backend.",
        )
    if _attn_dp(args) > 1:
        raise _fail(
            "ValueError", "Currently ngram speculative decoding does not support dp attention."
        )
    spec.num_steps, spec.eagle_topk, spec.num_draft_tokens = steps, topk, draft_tokens
    spec.resolved |= {
        "speculative_algorithm": "NGRAM",
        "enable_mixed_chunk": False,
        "speculative_num_steps": steps,
        "speculative_eagle_topk": topk,
        "speculative_num_draft_tokens": draft_tokens,
    }
    spec.placement = DraftPlacement(
        max_running_requests=spec.max_running_requests,
        verify_tokens_per_req=spec.num_draft_tokens,
    )
    return spec


def auto_params(algorithm: str, architecture: str) -> tuple[int, int, int]:
    """`_auto_choose_speculative_params`: (steps, top-k, draft tokens)."""
    if algorithm == "STANDALONE":
        return (3, 1, 4)
    if architecture in AUTO_PARAMS_5_4_8:
        return (5, 4, 8)
    return (3, 1, 4)


def _eagle_family(args: argparse.Namespace, model: ModelShape, algorithm: str) -> Speculation:
    """`_handle_eagle_family` (EAGLE, EAGLE3, STANDALONE; NEXTN arrives as EAGLE)."""
    if algorithm == "STANDALONE" and _attn_dp(args) > 1:
        raise _fail(
            "ValueError",
            "Currently standalone speculative decoding does not support dp attention.",
        )
    spec = Speculation(
        algorithm=algorithm,
        num_steps=0,
        eagle_topk=0,
        num_draft_tokens=0,
        max_running_requests=getattr(args, "max_running_requests", None),
        draft=None,
        draft_path=getattr(args, "speculative_draft_model_path", None),
        draft_kv_layers=0,
        placement=DraftPlacement(max_running_requests=None),
    )
    _reset_max_running(args, spec)
    if _disable_overlap_for_cpu(args, spec):
        _warn(
            spec,
            "Non-overlap (synchronous) spec v2 is used for eagle/eagle3/standalone "
            "speculative decoding.",
        )
    if getattr(args, "enable_mixed_chunk", False) and algorithm not in ("EAGLE", "EAGLE3"):
        spec.resolved["enable_mixed_chunk"] = False
        _warn(
            spec,
            f"Mixed chunked prefill is disabled: {algorithm} speculative decoding does not "
            "support it.",
        )
    _draft_model_path(spec, model)
    _steps_topk_draft_tokens(args, spec, model)
    _load_draft(args, spec, model)
    spec.resolved |= {
        "speculative_algorithm": algorithm,
        "speculative_draft_model_path": spec.draft_path,
        "speculative_num_steps": spec.num_steps,
        "speculative_eagle_topk": spec.eagle_topk,
        "speculative_num_draft_tokens": spec.num_draft_tokens,
    }
    return spec


def _draft_model_path(spec: Speculation, model: ModelShape) -> None:
    """An MTP target is its own draft; any other target needs a draft directory."""
    if model.architecture in MTP_ARCHITECTURES:
        if spec.draft_path is None:
            spec.draft_path = model.path
        elif model.architecture not in (
            "MistralLarge3ForCausalLM",
            "PixtralForConditionalGeneration",
        ):
            _warn(spec, "DeepSeek MTP does not require setting speculative_draft_model_path.")
    elif spec.draft_path is None:
        # SGLang would go on and load the target's checkpoint as the draft; the double does not
        # guess what that costs.
        raise _fail(
            "ValueError",
            f"gpusim: --speculative-algorithm {spec.algorithm} without "
            f"--speculative-draft-model-path is modelled only for targets that carry their own "
            f"MTP layers ({', '.join(MTP_ARCHITECTURES[:3])}, ...); {model.architecture} does "
            "not",
        )


def _steps_topk_draft_tokens(
    args: argparse.Namespace, spec: Speculation, model: ModelShape
) -> None:
    steps = getattr(args, "speculative_num_steps", None)
    topk = getattr(args, "speculative_eagle_topk", None)
    draft_tokens = getattr(args, "speculative_num_draft_tokens", None)
    if steps is None:
        if topk is not None or draft_tokens is not None:
            # SGLang's `assert speculative_eagle_topk is None and ...num_draft_tokens is None`.
            raise _fail("AssertionError", "")
        steps, topk, draft_tokens = auto_params(spec.algorithm, model.architecture)
    if topk is None:
        # SGLang compares the unset top-k with an int a few lines on.
        raise _fail("TypeError", "'>' not supported between instances of 'NoneType' and 'int'")
    if topk == 1 and draft_tokens != steps + 1:
        _warn(
            spec,
            "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
            "speculative_eagle_topk == 1",
        )
        draft_tokens = steps + 1
    page = _arg(args, "page_size", 1)
    backend = getattr(args, "attention_backend", None)
    if topk > 1 and page > 1 and backend is not None and backend not in PAGE_TREE_BACKENDS:
        raise _fail(
            "ValueError",
            "speculative_eagle_topk > 1 with page_size > 1 is only supported on "
            f"{PAGE_TREE_BACKENDS}; got attention_backend={backend!r}. Use page_size == 1 or "
            "one of those backends.",
        )
    spec.num_steps, spec.eagle_topk, spec.num_draft_tokens = steps, topk, draft_tokens


def _load_draft(args: argparse.Namespace, spec: Speculation, model: ModelShape) -> None:
    """The draft's shape, its KV layer count and its placement (DraftPlacement)."""
    assert spec.draft_path is not None
    own_mtp = spec.draft_path == model.path and model.architecture in MTP_ARCHITECTURES
    draft = model if own_mtp else load_model(spec.draft_path)
    spec.draft = draft
    # spec_aux_hidden_state.py: num_nextn_predict_layers when the draft config has it (0
    # included: then nothing is priced for the draft's KV), else the draft's layer count.
    layers = draft.nextn_layers if draft.nextn_layers is not None else draft.num_layers
    spec.draft_kv_layers = layers
    tp = _arg(args, "tp_size", 1)
    if own_mtp:
        # The MTP layers are part of the target's checkpoint: the double prices them as their
        # share of its layers (an estimate; SGLang loads just those weights).
        weight_bytes = model.weight_bytes * layers / (model.num_layers + layers)
    else:
        weight_bytes = draft.weight_bytes
    spec.draft_weight_bytes = weight_bytes
    kv_dtype = getattr(args, "speculative_draft_kv_cache_dtype", None) or _arg(
        args, "kv_cache_dtype", "auto"
    )
    attn_tp = max(1, tp // max(1, _attn_dp(args)))
    own_cell = cell_size_bytes(_with_layers(draft, layers), attn_tp, kv_dtype)
    spec.placement = DraftPlacement(
        max_running_requests=spec.max_running_requests,
        draft_weight_bytes_per_rank=weight_bytes / tp,
        draft_budget_layers=layers,
        draft_cell_size=own_cell,
        draft_architecture=draft.architecture,
        draft_kv_dtype=kv_dtype,
        verify_tokens_per_req=spec.num_draft_tokens,
    )


def _with_layers(shape: ModelShape, layers: int) -> ModelShape:
    return replace(shape, num_layers=layers)


# -- decode speed --------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecDecode:
    """What one speculative decode step does in the double's throughput model (README,
    "Speculative decoding"): every running request gains `accept_length` tokens on average;
    the step costs a verify of batch x num_draft_tokens token rows plus num_steps draft
    forwards, each `draft_cost` of a target step."""

    algorithm: str
    accept_length: float
    num_steps: int
    num_draft_tokens: int
    draft_cost: float

    def step_factor(self, batch: int, batch_slowdown: float) -> float:
        """A step's time in units of decode_step_s (a plain decode step of one request is
        1.0; of a batch B, 1 + batch_slowdown x (B - 1))."""
        verify = 1 + batch_slowdown * (batch * self.num_draft_tokens - 1)
        draft = self.draft_cost * self.num_steps * (1 + batch_slowdown * (batch - 1))
        return verify + draft

    def speedup(self, batch: int, batch_slowdown: float) -> float:
        """Tokens per second with speculation over tokens per second without, at batch B."""
        plain = 1 + batch_slowdown * (batch - 1)
        return self.accept_length * plain / self.step_factor(batch, batch_slowdown)

    def breakeven_batch(self, batch_slowdown: float) -> float:
        """The running batch above which speculation makes fewer tokens per second than plain
        decoding (speedup = 1): with s = batch_slowdown, L = accept length, D = draft tokens,
        c k = draft cost x steps, B* = (1 - s)(L - c k - 1) / (s (D - L + c k)).
        0 when it never pays, infinity when it always does (s = 0)."""
        net = self.accept_length - self.draft_cost * self.num_steps
        if net <= 1:
            return 0.0
        if batch_slowdown <= 0 or self.num_draft_tokens <= net:
            return float("inf")
        return (1 - batch_slowdown) * (net - 1) / (batch_slowdown * (self.num_draft_tokens - net))


def decode_model(spec: Speculation, timing: Timing, target: ModelShape) -> SpecDecode:
    """The decode model of a resolved flag set: the accept length is the state directory's
    knob (`timing.spec_accept_length`), capped at what one step can accept; a draft forward
    costs what reading its weights costs next to the target's (decode is memory-bound), none
    for NGRAM."""
    accept = min(max(1.0, timing.spec_accept_length), float(spec.max_accept_length))
    cost = spec.draft_weight_bytes / target.weight_bytes if target.weight_bytes else 0.0
    return SpecDecode(spec.algorithm, accept, spec.num_steps, spec.num_draft_tokens, cost)
