"""GPU and host memory model, after SGLang 0.5.23's own arithmetic.

Sources in the sglang 0.5.23 wheel: `srt/arg_groups/memory_hook.py` (default
mem_fraction_static), `srt/mem_cache/kv_cache_configurator.py` (`_profile_available_bytes`,
`resolve_max_num_reqs`), `srt/model_executor/pool_configurator.py` (the "Not enough memory"
check), `srt/mem_cache/pool_host/base.py` (HiCache host pool), `srt/distributed/utils.py`
(`get_pp_indices`, the pipeline layer split). The headroom model (what the
memory outside mem_fraction_static must hold) is the double's own and is documented in
README.md with its constants below.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpusim.model import ModelShape
from gpusim.placement import RankWeights, tensor_list
from gpusim.placement import rank_weights as rank_weights_of

if TYPE_CHECKING:
    from gpusim.speculative import DraftPlacement

MIB = 1 << 20
GIB = 1 << 30

# Memory a CUDA context (+ NCCL communicators) takes on every GPU before weights load.
CUDA_CONTEXT_MIB = 768
# Headroom model: what lives outside the static pool (weights + KV) once the server runs.
RUNTIME_BASE_MIB = 512  # allocator/attention metadata, as SGLang's 512 MiB constant
RUNTIME_PER_8_RANKS_MIB = 1024  # NCCL/custom all-reduce buffers: tp*pp/8 GiB, as SGLang
# What the default fraction reserves for CUDA graphs: arg_groups/memory_hook.py
# `reserve_for_graph_mb`, an estimate (sglang_graph_reserve_mib below).
RESERVE_DECODE_MIB_PER_BS = 2
RESERVE_ATTN_DP_MIB_PER_BS_RANK = 3  # x max_bs x attn_dp ("DP attention needs more padding")
RESERVE_ATTN_DP_LARGE_BS = 300  # above it, 1.5 MiB more per max_bs x attn_dp
RESERVE_ATTN_DP_LARGE_MIB = 1.5
RESERVE_MLA_PREFILL_MIB = 1536  # "MLA backend overhead is much higher than expected"
RESERVE_PREFILL_MIB_PER_SIZE = 8  # non-MLA: per prefill capture size
# What capture allocates in the double (captured_graph_mib below): the double's own model of
# the decode runner's allocations (model_executor/runner/decode_cuda_graph_runner.py), not
# SGLang's reserve. Per captured batch size one graph (its executable and the attention
# backend's per-graph metadata); one private pool, shared by every graph, holding the largest
# batch's live activations; the shared fp32 logits buffer (graph_shared_output.py,
# max rows x vocab); under attention DP the gather and combine buffers of every rank's tokens
# (layers/dp_attention.py, rows x hidden).
GRAPH_MIB_PER_CAPTURED_BS = 8
DECODE_LIVE_ACTIVATIONS_PER_TOKEN = 16  # hidden-sized tensors alive at once in a decode layer
DP_GATHER_BUFFERS = 2
# Prefill graphs (breakable, prefill_cuda_graph_runner.py): torch memory is reused from the
# activations; what stays is per capture size for a non-MLA backend, a workspace for MLA.
MLA_PREFILL_GRAPH_MIB = 1536
MHA_PREFILL_GRAPH_MIB_PER_BUCKET = 8
# Real activation memory per prefill token. SGLang's reserve estimate uses 1.5 MiB/token,
# which is deliberately conservative; the double uses 0.5 so a fraction above SGLang's
# default still works up to a point, then OOMs in a large prefill (as in the Kimi job,
# docs/THE-JOB.md).
ACTIVATION_MIB_PER_TOKEN = 0.5
# SGLang keeps 10 GiB of host RAM for itself before sizing a HiCache host pool.
HICACHE_HOST_RESERVE_BYTES = 10 * GIB
DEFAULT_HICACHE_RATIO = 2.0
DEFAULT_HICACHE_HOST_MEMORY_FRACTION = 0.8
# Multimodal models: SGLang takes SGLANG_VLM_CACHE_SIZE_MB (default 100) out of the KV budget
# for the embedding cache, plus SGLANG_MM_FEATURE_CACHE_MB (default 1024) with a GPU feature
# transport (kv_cache_configurator.py mm_runtime_reservation_gb).
VLM_CACHE_SIZE_MB_DEFAULT = 100
MM_FEATURE_CACHE_MB_DEFAULT = 1024
GPU_FEATURE_TRANSPORTS = ("cuda_ipc", "cuda_vmm")
# SGLang refuses to start when the least-free GPU has under 90% of this rank's free memory.
TP_BALANCE_RATIO = 0.9

KV_ELEMENT_BYTES = {
    "bf16": 2.0,
    "bfloat16": 2.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
    "mxfp8": 1.0,
    "nvfp4": 0.5,
    "fp4_mx_block16": 0.5,
    "fp4_e2m1": 0.5,
}


class StartupFailure(Exception):
    """A failure SGLang would raise during start-up: exception type, message and phase."""

    def __init__(self, exc_type: str, message: str, phase: str) -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.message = message
        self.phase = phase


@dataclass
class MemoryArgs:
    """The server flags the memory model reads (SGLang names)."""

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    # Attention data parallelism (README, "Attention DP"); enable_dp_attention is the
    # deprecated spelling, resolved by resolve_attn_dp before anything reads the layout.
    attn_dp_size: int = 1
    enable_dp_attention: bool = False
    schedule_conservativeness: float = 1.0
    nnodes: int = 1
    mem_fraction_static: float | None = None
    kv_cache_dtype: str = "auto"
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int = 16384
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    page_size: int | None = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    enable_hierarchical_cache: bool = False
    disable_radix_cache: bool = False
    hicache_size: int = 0
    hicache_ratio: float | None = None
    language_only: bool = False
    language_model_only: bool = False
    mm_feature_transport: str | None = None


@dataclass
class MemoryPlan:
    """Everything start-up decides about memory, per rank unless named otherwise."""

    gpu_total_mib: int
    mem_fraction_static: float
    chunked_prefill_size: int
    decode_graph_max_bs: int
    pre_gib: float
    weight_gib: float
    post_gib: float
    rest_gib: float
    multimodal_reserve_gib: float
    cell_size: float
    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    kv_gib: float
    graph_mib: dict[str, float]
    runtime_mib: float
    headroom_mib: float
    max_prefill_activation_tokens: int
    host_pool_tokens: int = 0
    host_pool_bytes_per_rank: int = 0
    warnings: list[str] = field(default_factory=list)
    hicache_failure: StartupFailure | None = None
    # Speculative decoding (gpusim/speculative.py DraftPlacement): the draft's weights and its
    # KV pool per rank, the bytes per token the target's budget priced for the draft, and what
    # the draft pool takes beyond that price out of the memory outside the static pool.
    draft_weight_gib: float = 0.0
    draft_kv_gib: float = 0.0
    draft_cell_size: float = 0.0
    draft_budget_cell_size: float = 0.0
    draft_kv_overrun_mib: float = 0.0
    # The largest decode batch with a captured CUDA graph: the configured max bs, within the
    # request slots (SGLang captures no batch larger than its req_to_token pool).
    captured_decode_bs: int = 0
    # The target's decode graph phase: "target_verify" with speculation (cuda_graph_setup.py).
    decode_graph_phase: str = "decode"

    @property
    def graph_total_mib(self) -> float:
        return sum(self.graph_mib.values())

    @property
    def rank_used_mib(self) -> int:
        """What one rank holds on its GPU once serving (what nvidia-smi shows)."""
        return round(
            CUDA_CONTEXT_MIB
            + (self.weight_gib + self.draft_weight_gib + self.kv_gib + self.draft_kv_gib) * 1024
            + self.graph_total_mib
            + self.runtime_mib
        )


def kv_element_bytes(kv_cache_dtype: str, model: ModelShape) -> float:
    if kv_cache_dtype == "auto":
        return float(model.dtype_bytes)
    return KV_ELEMENT_BYTES[kv_cache_dtype]


def stage_layers(num_layers: int, pp_size: int) -> int:
    """Layers of the largest pipeline stage: SGLang's `get_pp_indices` gives the remainder
    to the last stages, one layer each. The double sizes every rank like that stage."""
    return math.ceil(num_layers / max(1, pp_size))


def cell_size_bytes(
    model: ModelShape, tp_size: int, kv_cache_dtype: str, pp_size: int = 1
) -> float:
    """KV bytes per token on one rank (SGLang's cell_size over this stage's layers)."""
    elem = kv_element_bytes(kv_cache_dtype, model)
    layers = stage_layers(model.num_layers, pp_size)
    if model.is_mla:
        # The latent cache is replicated on every rank, not split by TP.
        assert model.kv_lora_rank is not None and model.qk_rope_head_dim is not None
        return (model.kv_lora_rank + model.qk_rope_head_dim) * layers * elem
    kv_heads = max(1, model.num_kv_heads // tp_size)
    return kv_heads * (model.head_dim + model.v_head_dim) * layers * elem


def rank_weights(model: ModelShape, args: MemoryArgs) -> RankWeights:
    """What one GPU holds of the model, tensor by tensor as SGLang places them
    (gpusim/placement.py): replicated projections whole, the rest over attn_tp or tp, a
    pipeline stage's layers. A rank holds the same share whatever node it runs on."""
    tensors = tensor_list(model.text_config, is_mla=model.is_mla, dtype_bytes=model.dtype_bytes)
    return rank_weights_of(
        tensors,
        model.weight_bytes,
        tp=args.tp_size,
        attn_dp=args.attn_dp_size,
        pp=args.pp_size,
        stage_layer_share=stage_layers(model.num_layers, args.pp_size) / model.num_layers,
        multimodal=model.is_multimodal,
    )


def weight_gib_per_rank(model: ModelShape, args: MemoryArgs) -> float:
    return rank_weights(model, args).total / GIB


def resolve_attn_dp(args: MemoryArgs) -> None:
    """0.5.23 `_handle_deprecated_dp_attention`: `--dp-size N --enable-dp-attention` is
    `--attn-dp-size N` with dp_size 1."""
    if args.enable_dp_attention and args.attn_dp_size == 1:
        args.attn_dp_size, args.dp_size = args.dp_size, 1
    args.enable_dp_attention = False


def default_chunk_and_graph_bs(gpu_mem_mib: float, tp_size: int) -> tuple[int, int]:
    """SGLang's GPU-size tiers for chunked_prefill_size and the decode CUDA-graph max bs."""
    tiers = (  # (upper bound MiB, chunk, max_bs tp<4, max_bs tp>=4)
        (20 * 1024, 2048, 8, 8),
        (35 * 1024, 4096, 48, 160),
        (60 * 1024, 4096, 32, 160),
        (90 * 1024, 8192, 256, 512),
        (160 * 1024, 8192, 256, 512),
    )
    for bound, chunk, small, large in tiers:
        if gpu_mem_mib < bound:
            return chunk, small if tp_size < 4 else large
    return 16384, 512


def prefill_graph_buckets(max_tokens: int) -> list[int]:
    """SGLang's prefill CUDA-graph capture sizes (token buckets) up to max_tokens."""
    sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1025, 64))
        + list(range(1280, 4097, 256))
        + list(range(4608, max_tokens + 1, 512))
    )
    return [s for s in sizes if s <= max_tokens]


def decode_capture_sizes(max_bs: int, speculative: bool) -> list[int]:
    """arg_groups/cuda_graph_hook.py `generate_decode_cuda_graph_batch_sizes`: the batch
    sizes the decode runner captures up to max_bs (max_bs itself always)."""
    if speculative:
        sizes = [
            *range(1, 9),
            *range(10, 33, 2),
            *range(40, 65, 4),
            *range(72, 257, 8),
            *range(272, max_bs + 1, 16),
        ]
    else:
        sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16)]
        sizes += list(range(512, max_bs + 1, 32))
    sizes = [s for s in sizes if s <= max_bs]
    if max_bs > 0 and max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


def sglang_graph_reserve_mib(
    model: ModelShape, chunk: int, decode_max_bs: int, disabled: bool, attn_dp_size: int = 1
) -> float:
    """memory_hook.py `reserve_for_graph_mb` with CUDA graphs on (full decode, breakable
    prefill, no DeepEP): what the default mem_fraction_static keeps out for graphs."""
    if disabled:
        return 0.0
    reserve = float(decode_max_bs * RESERVE_DECODE_MIB_PER_BS)
    if attn_dp_size > 1:
        reserve += decode_max_bs * attn_dp_size * RESERVE_ATTN_DP_MIB_PER_BS_RANK
        if decode_max_bs > RESERVE_ATTN_DP_LARGE_BS:
            reserve += decode_max_bs * attn_dp_size * RESERVE_ATTN_DP_LARGE_MIB
    if model.is_mla:
        return reserve + RESERVE_MLA_PREFILL_MIB
    return reserve + len(prefill_graph_buckets(chunk)) * RESERVE_PREFILL_MIB_PER_SIZE


def graph_memory_mib(
    model: ModelShape,
    chunk: int,
    decode_max_bs: int,
    disabled: bool,
    attn_dp_size: int = 1,
    *,
    tokens_per_req: int = 1,
    speculative: bool = False,
) -> dict[str, float]:
    """MiB capture allocates per rank, by phase, in the double's own model (see the
    constants): decode graphs up to decode_max_bs requests of tokens_per_req tokens each."""
    if disabled:
        return {"decode": 0.0, "prefill": 0.0}
    if model.is_mla:
        prefill = float(MLA_PREFILL_GRAPH_MIB)
    else:
        prefill = float(len(prefill_graph_buckets(chunk)) * MHA_PREFILL_GRAPH_MIB_PER_BUCKET)
    graphs = len(decode_capture_sizes(decode_max_bs, speculative)) * GRAPH_MIB_PER_CAPTURED_BS
    hidden = int(model.text_config.get("hidden_size") or model.num_heads * model.head_dim)
    rows = decode_max_bs * tokens_per_req
    logits = rows * model.vocab_size * 4
    live = rows * hidden * model.dtype_bytes * DECODE_LIVE_ACTIVATIONS_PER_TOKEN
    gathered = 0
    if attn_dp_size > 1:
        gathered = rows * attn_dp_size * hidden * model.dtype_bytes * DP_GATHER_BUFFERS
    decode = graphs + (logits + live + gathered) / MIB
    return {"decode": decode, "prefill": prefill}


def default_mem_fraction_static(
    model: ModelShape, args: MemoryArgs, gpu_mem_mib: float, chunk: int, decode_max_bs: int
) -> float:
    """SGLang 0.5.23 `handle_gpu_memory_settings`: total minus an activation/graph reserve."""
    activation_tokens = max(chunk, 2048) if chunk > 0 else max(args.max_prefill_tokens, 2048)
    reserved = 512 + activation_tokens * 1.5
    reserved += args.tp_size * args.pp_size / 8 * 1024
    reserved += sglang_graph_reserve_mib(
        model, chunk, decode_max_bs, args.disable_cuda_graph, args.attn_dp_size
    )
    if gpu_mem_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    fraction = round((gpu_mem_mib - reserved) / gpu_mem_mib, 3)
    if model.is_multimodal and not (args.language_only or args.language_model_only):
        fraction *= vlm_fraction_factor(model)
    return fraction


def vlm_fraction_factor(model: ModelShape) -> float:
    """`adjust_mem_fraction_for_vlm` (MLA models, which never size KV after graph capture):
    0.95 x a factor that falls 10% per doubling of the ViT's size over a ViT-L/14."""
    complexity = model.vit_layers * model.vit_hidden_size**2 / (24 * 1024**2)
    return 0.95 * max(0.8, min(1.05, 1.0 - 0.1 * (complexity - 1.0)))


def multimodal_reserve_gib(model: ModelShape, args: MemoryArgs) -> float:
    """`mm_runtime_reservation_gb`: GiB a multimodal model keeps out of the KV budget."""
    if not model.is_multimodal or args.language_model_only:
        return 0.0
    reserved_mb = int(os.environ.get("SGLANG_VLM_CACHE_SIZE_MB", VLM_CACHE_SIZE_MB_DEFAULT))
    if args.mm_feature_transport in GPU_FEATURE_TRANSPORTS:
        reserved_mb += int(
            os.environ.get("SGLANG_MM_FEATURE_CACHE_MB", MM_FEATURE_CACHE_MB_DEFAULT)
        )
    return reserved_mb / 1024


def check_args(args: MemoryArgs) -> None:
    """Flag combinations SGLang rejects before any GPU work (0.5.23 validation_hook.py)."""
    resolve_attn_dp(args)
    if args.nnodes == 0:
        # SGLang's check is `(tp_size * pp_size) % nnodes == 0`: zero nodes divide by zero.
        raise StartupFailure("ZeroDivisionError", "integer modulo by zero", "args")
    if (args.tp_size * args.pp_size) % args.nnodes != 0:
        raise StartupFailure(
            "AssertionError", "tp_size must be divisible by number of nodes", "args"
        )
    if args.dp_size > 1 and args.nnodes != 1:
        raise StartupFailure(
            "AssertionError",
            "multi-node data-parallel replicas are not supported; use attention DP "
            "(--attn-dp-size) across nodes",
            "args",
        )
    if args.attn_dp_size < 1:
        raise StartupFailure(
            "ValueError", f"--attn-dp-size must be positive (got {args.attn_dp_size}).", "args"
        )
    if args.attn_dp_size > 1 and args.dp_size > 1:
        raise StartupFailure(
            "ValueError",
            f"--dp-size {args.dp_size} with --attn-dp-size {args.attn_dp_size}: data-parallel "
            "replicas combined with attention data parallelism are not supported.",
            "args",
        )
    if args.tp_size % args.attn_dp_size:
        raise StartupFailure(
            "AssertionError", "tp_size must be divisible by attn_dp_size * attn_cp_size", "args"
        )
    if args.enable_hierarchical_cache and args.disable_radix_cache:
        raise StartupFailure(
            "ValueError",
            "The arguments enable-hierarchical-cache and disable-radix-cache are mutually "
            "exclusive and cannot be used at the same time. Please use only one of them.",
            "args",
        )


def resolve_defaults(args: MemoryArgs, model: ModelShape, gpu_mem_mib: int) -> tuple[int, int]:
    """Fill chunked_prefill_size/mem_fraction_static like SGLang; return (chunk, decode bs)."""
    chunk, decode_bs = default_chunk_and_graph_bs(gpu_mem_mib, args.tp_size)
    if args.chunked_prefill_size is not None:
        chunk = args.chunked_prefill_size
    if args.cuda_graph_max_bs is not None:
        decode_bs = args.cuda_graph_max_bs
    elif args.max_running_requests is not None:
        decode_bs = min(decode_bs, args.max_running_requests)
    if args.mem_fraction_static is None:
        args.mem_fraction_static = default_mem_fraction_static(
            model, args, gpu_mem_mib, chunk, decode_bs
        )
    if args.attn_dp_size > 1:
        # `_handle_data_parallelism` runs after the memory settings: each rank prefills
        # its own chunk, and the scheduler admits more eagerly.
        chunk //= args.attn_dp_size
        args.schedule_conservativeness *= 0.3
    return chunk, decode_bs


def check_balance(free_mib_per_rank: list[int], least: int) -> None:
    """Each rank compares the group's least free memory (a MIN over all ranks) with its own."""
    for local in free_mib_per_rank:
        if least < local * TP_BALANCE_RATIO:
            pre, loc = least / 1024, local / 1024
            raise StartupFailure(
                "RuntimeError",
                "The memory capacity is unbalanced. Some GPUs may be occupied by other "
                f"processes. pre_model_load_memory={pre!r}, local_gpu_memory={loc!r}, "
                f"local_gpu_memory * 0.9={loc * 0.9!r}",
                "init",
            )


def draft_budget_bytes(
    cell: float, model: ModelShape, args: MemoryArgs, draft: DraftPlacement | None
) -> int:
    """`DefaultPoolConfigurator` (EAGLE/EAGLE3/STANDALONE): the target's bytes per token grow
    by int(cell x draft KV layers / this stage's layers), the draft priced at the target's
    per-layer size whatever its own attention is. 0 without a draft (NGRAM included)."""
    if draft is None or draft.draft_budget_layers <= 0:
        return 0
    layers = stage_layers(model.num_layers, args.pp_size)
    return int(cell * draft.draft_budget_layers / layers)


def plan_memory(
    model: ModelShape,
    args: MemoryArgs,
    gpu_total_mib: int,
    free_mib_per_rank: list[int],
    host_ram_bytes: float,
    *,
    group_min_free_mib: int | None = None,
    draft: DraftPlacement | None = None,
) -> MemoryPlan:
    """Run start-up's memory decisions; raise StartupFailure where SGLang would fail.

    free_mib_per_rank are this node's ranks; group_min_free_mib is the least over every node
    of a multi-node group (SGLang reduces it over all ranks, so all nodes size alike).
    draft: speculative decoding's share (gpusim/speculative.py), None without it.
    """
    check_args(args)
    chunk, decode_bs = resolve_defaults(args, model, gpu_total_mib)
    if draft is not None and draft.max_running_requests is not None:
        # speculative_hook.py runs after memory_hook.py: the reset to 48 changes neither the
        # default fraction nor the configured decode graph size, only the request slots.
        args.max_running_requests = draft.max_running_requests
    mfs = args.mem_fraction_static
    assert mfs is not None
    least = min([*free_mib_per_rank, *([] if group_min_free_mib is None else [group_min_free_mib])])
    check_balance(free_mib_per_rank, least)
    pre_gib = (least - CUDA_CONTEXT_MIB) / 1024
    target_weight_gib = weight_gib_per_rank(model, args)
    draft_weight_gib = draft.draft_weight_bytes_per_rank / GIB if draft is not None else 0.0
    # The draft loads right after the target, before the KV budget is profiled.
    weight_gib = target_weight_gib + draft_weight_gib
    if weight_gib > pre_gib:
        raise StartupFailure(
            "torch.OutOfMemoryError",
            _oom_message(weight_gib - pre_gib, gpu_total_mib, pre_gib),
            "load_weights",
        )
    post_gib = pre_gib - weight_gib
    mm_reserve_gib = multimodal_reserve_gib(model, args)
    rest_gib = post_gib - pre_gib * (1 - mfs) - mm_reserve_gib
    if rest_gib <= 0:
        # SGLang's suggestion ignores the multimodal reserve; so does the double's.
        minimum = 1 - post_gib / pre_gib
        raise StartupFailure(
            "ValueError",
            "Loaded weights leave no GPU memory for the KV cache under "
            f"--mem-fraction-static={mfs}. Raise --mem-fraction-static above "
            f"{math.ceil(minimum * 1000) / 1000:.3f} (minimum viable = 1 - available/pre = "
            f"{minimum:.4f}). If using speculative decoding, draft weights are now counted.",
            "kv_cache",
        )
    cell = cell_size_bytes(model, args.tp_size, args.kv_cache_dtype, args.pp_size)
    budget_cell = cell + draft_budget_bytes(cell, model, args, draft)
    tokens = int(rest_gib * GIB // budget_cell)
    if args.max_total_tokens is not None:
        tokens = min(tokens, args.max_total_tokens)
    page = args.page_size or 1
    tokens = tokens // page * page
    if tokens <= 0:
        raise StartupFailure(
            "RuntimeError",
            "Not enough memory. Please try to increase --mem-fraction-static. "
            f"Current value: mem_fraction_static={mfs}",
            "kv_cache",
        )
    max_running = max_running_requests(tokens, model.context_len, args)
    # SGLang captures decode graphs only up to its request slots (get_batch_sizes_to_capture
    # clamps to req_to_token_pool.size). The double applies that where speculation's reset to
    # 48 put the slots under the graph size chosen before it; elsewhere it keeps charging the
    # configured size (README, "Speculative decoding").
    captured_bs = min(decode_bs, max_running) if draft is not None else decode_bs
    graph = graph_memory_mib(
        model,
        chunk,
        captured_bs,
        args.disable_cuda_graph,
        args.attn_dp_size,
        tokens_per_req=draft.verify_tokens_per_req if draft is not None else 1,
        speculative=draft is not None,
    )
    runtime = RUNTIME_BASE_MIB + args.tp_size * args.pp_size / 8 * RUNTIME_PER_8_RANKS_MIB
    headroom = pre_gib * 1024 * (1 - mfs)
    draft_cell = draft.draft_cell_size if draft is not None else 0.0
    # What the draft pool holds beyond the bytes the budget priced for it (negative: less).
    overrun_mib = tokens * (draft_cell - (budget_cell - cell)) / MIB
    spare = headroom - sum(graph.values()) - runtime - overrun_mib
    plan = MemoryPlan(
        gpu_total_mib=gpu_total_mib,
        mem_fraction_static=mfs,
        chunked_prefill_size=chunk,
        decode_graph_max_bs=decode_bs,
        pre_gib=pre_gib,
        weight_gib=target_weight_gib,
        post_gib=post_gib,
        rest_gib=rest_gib,
        multimodal_reserve_gib=mm_reserve_gib,
        cell_size=cell,
        max_total_num_tokens=tokens,
        max_running_requests=max_running,
        context_len=model.context_len,
        kv_gib=tokens * cell / GIB,
        graph_mib=graph,
        runtime_mib=runtime,
        headroom_mib=headroom,
        max_prefill_activation_tokens=max(0, int(spare / ACTIVATION_MIB_PER_TOKEN)),
        draft_weight_gib=draft_weight_gib,
        draft_kv_gib=tokens * draft_cell / GIB,
        draft_cell_size=draft_cell,
        draft_budget_cell_size=budget_cell - cell,
        draft_kv_overrun_mib=overrun_mib if draft is not None else 0.0,
        captured_decode_bs=captured_bs,
        decode_graph_phase="target_verify" if draft is not None else "decode",
    )
    if args.enable_hierarchical_cache:
        # The host pool is sized after the device pool and graphs exist: fail at that point.
        try:
            plan_host_pool(plan, args, host_ram_bytes)
        except StartupFailure as exc:
            plan.hicache_failure = exc
    return plan


def max_running_requests(tokens: int, context_len: int, args: MemoryArgs) -> int:
    """SGLang's `resolve_max_num_reqs`, per attention-DP rank (the flag is divided over them)."""
    if args.max_running_requests is not None:
        return min(max(1, args.max_running_requests // args.attn_dp_size), tokens // 2)
    estimated = max(min(int(tokens / context_len * 512), 4096), 2048)
    return min(estimated, tokens // 2)


def plan_host_pool(plan: MemoryPlan, args: MemoryArgs, host_ram_bytes: float) -> None:
    """HiCache host pool per rank; every rank on the host checks its share of free RAM."""
    ranks_per_host = max(1, args.tp_size * args.pp_size // args.nnodes)
    budget = int((host_ram_bytes - HICACHE_HOST_RESERVE_BYTES) // ranks_per_host)
    if args.hicache_size > 0:
        size = int(args.hicache_size * 1e9 // plan.cell_size)
    elif args.hicache_ratio is not None:
        size = int(plan.max_total_num_tokens * args.hicache_ratio)
    else:
        # Neither set: the default ratio shrinks until all ranks fit 80% of the budget.
        size = int(plan.max_total_num_tokens * DEFAULT_HICACHE_RATIO)
        size = min(size, int(budget * DEFAULT_HICACHE_HOST_MEMORY_FRACTION // plan.cell_size))
    page = args.page_size or 1
    size = (size // page + 1) * page  # SGLang reserves one padding page
    if size <= plan.max_total_num_tokens:
        plan.warnings.append(
            f"HiCache kv host pool ({size} tokens) is smaller than the device pool "
            f"({plan.max_total_num_tokens} tokens);L2 cache effectiveness is reduced."
            "Consider increasing --hicache-ratio (or --hicache-size) for higher L2 cache "
            "hit rate."
        )
    requested = int(size * plan.cell_size)
    if requested > budget:
        raise StartupFailure(
            "ValueError",
            f"Not enough host memory available. Requesting {requested / 1e9:.2f} GB but only "
            f"have {budget / 1e9:.2f} GB free. Please reduce the size of the hierarchical cache.",
            "hicache",
        )
    plan.host_pool_tokens = size
    plan.host_pool_bytes_per_rank = requested


def _oom_message(short_gib: float, total_mib: int, free_gib: float) -> str:
    return (
        f"CUDA out of memory. Tried to allocate {max(short_gib, 0.01):.2f} GiB. GPU 0 has a "
        f"total capacity of {total_mib / 1024:.2f} GiB of which {max(free_gib, 0):.2f} GiB is "
        "free. Of the allocated memory, PyTorch has reserved memory that is in use. If reserved "
        "but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )


def capture_oom(plan: MemoryPlan) -> StartupFailure | None:
    """CUDA-graph capture fails when the headroom cannot even hold graphs + runtime buffers."""
    need = plan.graph_total_mib + plan.runtime_mib + plan.draft_kv_overrun_mib
    if need <= plan.headroom_mib:
        return None
    return StartupFailure(
        "torch.OutOfMemoryError",
        _oom_message(
            (need - plan.headroom_mib) / 1024, plan.gpu_total_mib, plan.headroom_mib / 1024
        ),
        "graph_capture",
    )


def draft_kv_oom(plan: MemoryPlan) -> StartupFailure | None:
    """The draft pool, allocated after the target's, needs more than its price and more than
    the memory outside the static pool holds."""
    if plan.draft_kv_overrun_mib <= plan.headroom_mib:
        return None
    return StartupFailure(
        "torch.OutOfMemoryError",
        _oom_message(
            (plan.draft_kv_overrun_mib - plan.headroom_mib) / 1024,
            plan.gpu_total_mib,
            plan.headroom_mib / 1024,
        ),
        "draft_kv",
    )


def prefill_oom_message(plan: MemoryPlan, new_tokens: int) -> str | None:
    """A prefill batch whose activations do not fit in what graphs left of the headroom."""
    if new_tokens <= plan.max_prefill_activation_tokens:
        return None
    need_gib = new_tokens * ACTIVATION_MIB_PER_TOKEN / 1024
    have_gib = plan.max_prefill_activation_tokens * ACTIVATION_MIB_PER_TOKEN / 1024
    return _oom_message(need_gib - have_gib, plan.gpu_total_mib, have_gib)
