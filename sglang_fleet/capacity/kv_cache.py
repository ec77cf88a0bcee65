"""SGLang's GPU memory arithmetic: KV cell size, KV token budget, default static fraction.

Each function reproduces one piece of SGLang 0.5.23 (paths are inside the wheel, `srt/...`):

- `cell_size_bytes`: `model_executor/pool_configurator.py` `_compute_cell_size`.
- `rest_gib` / `max_total_num_tokens`: `mem_cache/kv_cache_configurator.py`
  `_profile_available_bytes` (rest = post - pre * (1 - mem_fraction_static) - multimodal
  reserve) and `pool_configurator.calculate_pool_sizes` (floor, then page rounding).
- `sglang_default_mem_fraction`: `arg_groups/memory_hook.py` `handle_gpu_memory_settings`
  (registered as `_handle_gpu_memory_settings`), its `reserve_for_graph_mb` and
  `adjust_mem_fraction_for_vlm`.
- HiCache host pool: `mem_cache/pool_host/base.py` (per-rank pool, 10 GiB host reserve).

Units follow SGLang: its "GB" in logs and in the KV budget is GiB (bytes / 2**30); GPU
capacity from nvidia-smi is MiB; `--hicache-size` is decimal GB (1e9 bytes) per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from sglang_fleet.capacity.model_config import ModelShape
from sglang_fleet.module_utils.typed_number import shown

GIB = 1 << 30
MIB = 1 << 20
GB = 10**9

# Bytes per stored element of the KV cache, by --kv-cache-dtype. "auto" follows the model
# dtype, which SGLang serves in bf16/fp16 (2 bytes) for every checkpoint dtype we plan for.
KV_ELEM_BYTES: dict[str, Fraction] = {
    "auto": Fraction(2),
    "bf16": Fraction(2),
    "bfloat16": Fraction(2),
    "fp16": Fraction(2),
    "float16": Fraction(2),
    "fp8_e4m3": Fraction(1),
    "fp8_e5m2": Fraction(1),
    "mxfp8": Fraction(1),
    "fp4_e2m1": Fraction(1, 2),
    "nvfp4": Fraction(1, 2),
    "fp4_mx_block16": Fraction(1, 2),
}
FP8_DTYPES = frozenset({"fp8_e4m3", "fp8_e5m2", "mxfp8"})
FP4_DTYPES = frozenset({"fp4_e2m1", "nvfp4", "fp4_mx_block16"})
# Block sizes of the per-block scale bytes SGLang stores next to quantized KV.
_FP4_SCALE_BLOCK = 16
_MXFP8_SCALE_BLOCK = 32

# Free GPU memory lost before weights load: the CUDA context (768 MiB, the same constant as
# the gpusim double). An estimate: a calibration log's "Load weight begin. avail mem"
# replaces it (the Kimi job's (docs/THE-JOB.md) log shows 1.4 GiB gone at tp 8, with NCCL buffers).
CUDA_CONTEXT_GIB = 0.75
# SGLANG_VLM_CACHE_SIZE_MB default: reserved out of the KV budget for multimodal models.
VLM_CACHE_RESERVE_GIB = 100 / 1024
# HICACHE_HOST_MEMORY_RESERVE_BYTES: host RAM SGLang keeps free before sizing host pools.
HICACHE_HOST_RESERVE_GIB = 10.0
# --hicache-ratio default in cache mode, and --hicache-host-memory-fraction: with neither
# --hicache-size nor --hicache-ratio SGLang shrinks the ratio until all pools fit this share.
DEFAULT_HICACHE_RATIO = 2.0
HICACHE_HOST_MEMORY_FRACTION = 0.8


def elem_bytes(kv_cache_dtype: str) -> Fraction:
    """Bytes per KV element; raises ValueError for a dtype SGLang does not accept."""
    try:
        return KV_ELEM_BYTES[kv_cache_dtype]
    except (KeyError, TypeError):  # TypeError: a list or mapping from JSON is no dtype
        choices = ", ".join(sorted(KV_ELEM_BYTES))
        raise ValueError(
            f"unknown --kv-cache-dtype {shown(kv_cache_dtype)} (one of {choices})"
        ) from None


def kv_heads_per_rank(shape: ModelShape, tp_size: int) -> int:
    """SGLang's get_num_kv_heads: heads split over tp, at least one per rank."""
    return max(1, shape.num_kv_heads // tp_size)


def _mla_cell(shape: ModelShape, kv_cache_dtype: str) -> int:
    dim = shape.kv_lora_rank + shape.qk_rope_head_dim
    if kv_cache_dtype in FP4_DTYPES:
        # float4_e2m1fn_x2 packs two values per byte, plus one fp8 scale per 16 values.
        return (dim * shape.num_layers) // 2 + (dim // _FP4_SCALE_BLOCK) * shape.num_layers
    # The latent cache is replicated on every rank: not divided by tp.
    return int(dim * shape.num_layers * elem_bytes(kv_cache_dtype))


def _mha_cell(shape: ModelShape, kv_cache_dtype: str, tp_size: int) -> int:
    heads = kv_heads_per_rank(shape, tp_size)
    if kv_cache_dtype in FP4_DTYPES:
        # K and V, half a byte per value, one scale byte per 16 values (one scale layout;
        # recipes that also keep native scales hold a second copy, which we do not model).
        data = heads * (shape.head_dim // 2) * shape.num_layers * 2
        scales = heads * (shape.head_dim // _FP4_SCALE_BLOCK) * shape.num_layers * 2
        return data + scales
    elements = heads * (shape.head_dim + shape.v_head_dim) * shape.num_layers
    cell = int(elements * elem_bytes(kv_cache_dtype))
    if kv_cache_dtype == "mxfp8":
        cell += elements // _MXFP8_SCALE_BLOCK
    return cell


def cell_size_bytes(shape: ModelShape, kv_cache_dtype: str, tp_size: int) -> int:
    """KV-cache bytes per token on one GPU."""
    elem_bytes(kv_cache_dtype)  # validates the dtype name
    if shape.is_mla:
        return _mla_cell(shape, kv_cache_dtype)
    return _mha_cell(shape, kv_cache_dtype, tp_size)


def multimodal_reserve_gib(shape: ModelShape) -> float:
    return VLM_CACHE_RESERVE_GIB if shape.is_multimodal else 0.0


def rest_gib(
    pre_gib: float, post_gib: float, mem_fraction_static: float, reserve_gib: float = 0.0
) -> float:
    """GiB left for the KV pool: free after weights minus what the fraction keeps outside."""
    return post_gib - pre_gib * (1 - mem_fraction_static) - reserve_gib


def max_total_num_tokens(rest: float, cell_size: int, page_size: int = 1) -> int:
    """SGLang's token budget for `rest` GiB; 0 means "Not enough memory"."""
    if rest <= 0:
        return 0
    tokens = int(rest * GIB) // cell_size
    return tokens // page_size * page_size


def min_mem_fraction_for_kv(pre_gib: float, post_gib: float) -> float:
    """The fraction below which weights leave no KV memory (SGLang's own suggestion)."""
    return 1 - post_gib / pre_gib


def headroom_gib(pre_gib: float, mem_fraction_static: float) -> float:
    """Memory outside the static pool: activations, CUDA graphs, prefill of large batches."""
    return pre_gib * (1 - mem_fraction_static)


def estimate_pre_gib(gpu_memory_mib: float) -> float:
    """Free GiB before weights load, estimated from nvidia-smi's memory.total."""
    return gpu_memory_mib / 1024 - CUDA_CONTEXT_GIB


def estimate_post_gib(pre_gib: float, weight_bytes: int, tp_size: int) -> float:
    """Free GiB after weights load: each rank holds 1/tp of the checkpoint."""
    return pre_gib - weight_bytes / tp_size / GIB


def sglang_default_max_running_requests(tokens: int, context_length: int) -> int:
    """resolve_max_num_reqs without --max-running-requests: 2048..4096, at most tokens/2."""
    if context_length <= 0:
        return tokens // 2
    estimated = max(min(int(tokens / context_length * 512), 4096), 2048)
    return min(estimated, tokens // 2)


@dataclass(frozen=True)
class SglangDefaults:
    """What SGLang resolves by itself from the GPU size when the flags are unset."""

    chunked_prefill_size: int
    decode_cuda_graph_max_bs: int
    reserved_mib: float
    mem_fraction_static: float


def _capacity_defaults(gpu_memory_mib: float, tp_size: int) -> tuple[int, int]:
    """(chunked_prefill_size, decode CUDA graph max_bs) by GPU size class."""
    small_tp = tp_size < 4
    if gpu_memory_mib < 20 * 1024:  # T4, 4080
        return 2048, 8
    if gpu_memory_mib < 35 * 1024:  # A10, 4090, 5090
        return 4096, 48 if small_tp else 160
    if gpu_memory_mib < 60 * 1024:  # A100-40G, L40
        return 4096, 32 if small_tp else 160
    if gpu_memory_mib < 160 * 1024:  # H100, H200, RTX PRO 6000 (the 90 GiB split is equal)
        return 8192, 256 if small_tp else 512
    return 16384, 512  # B200, MI300


def prefill_graph_token_buckets(max_tokens: int) -> list[int]:
    """generate_prefill_cuda_graph_batch_sizes: the token counts captured for prefill."""
    sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1024 + 1, 64))
        + list(range(1280, 4096 + 1, 256))
        + list(range(4608, max_tokens + 1, 512))
    )
    return [s for s in sizes if s <= max_tokens]


def attn_dp_graph_mib(decode_max_bs: int, attn_dp_size: int) -> float:
    """What reserve_for_graph_mb adds under attention DP: max_bs x attn_dp x 3 MiB, and
    x 1.5 more above max_bs 300 ("DP attention needs more padding")."""
    if attn_dp_size <= 1:
        return 0.0
    extra = decode_max_bs * attn_dp_size * 3.0
    if decode_max_bs > 300:
        extra += decode_max_bs * attn_dp_size * 1.5
    return extra


def _graph_reserve_mib(
    shape: ModelShape, decode_max_bs: int, chunked_prefill_size: int, attn_dp_size: int = 1
) -> float:
    """reserve_for_graph_mb with SGLang's defaults on CUDA (decode: full graphs, prefill:
    breakable graphs, no DeepEP)."""
    reserve = decode_max_bs * 2.0 + attn_dp_graph_mib(decode_max_bs, attn_dp_size)
    if shape.is_mla:
        return reserve + 1.5 * 1024  # "MLA backend overhead is much higher than expected"
    return reserve + len(prefill_graph_token_buckets(chunked_prefill_size)) * 8


def _vlm_factor(shape: ModelShape) -> float:
    """adjust_mem_fraction_for_vlm: shrink the fraction with the ViT's size."""
    complexity = shape.vit_layers * shape.vit_hidden_size**2 / (24 * 1024**2)
    dynamic = max(0.8, min(1.05, 1.0 - 0.1 * (complexity - 1.0)))
    return 0.95 * dynamic


def sglang_default_mem_fraction(
    gpu_memory_mib: float,
    shape: ModelShape,
    tp_size: int,
    *,
    chunked_prefill_size: int | None = None,
    max_running_requests: int | None = None,
    pp_size: int = 1,
    attn_dp_size: int = 1,
    cuda_graph_max_bs_decode: int | None = None,
) -> SglangDefaults:
    """The mem_fraction_static SGLang 0.5.23 picks when the flag is unset.

    reserved_mem (MiB) = 512 + max(chunked_prefill_size, 2048) * 1.5 + tp*pp/8 * 1024
    + CUDA graph reserve, at least 10 GiB on GPUs above 60 GiB; fraction =
    round((gpu_mem - reserved_mem) / gpu_mem, 3), then scaled down for vision models.
    SGLang itself calls this estimate conservative: it is a fallback, not a measurement.
    """
    default_chunk, max_bs = _capacity_defaults(gpu_memory_mib, tp_size)
    chunk = chunked_prefill_size if chunked_prefill_size is not None else default_chunk
    if cuda_graph_max_bs_decode is not None:
        max_bs = cuda_graph_max_bs_decode
    if max_running_requests is not None:
        max_bs = min(max_bs, max_running_requests)
    # A disabled chunked prefill (-1) prefills the whole max_prefill_tokens (16384 default).
    activation_tokens = max(chunk if chunk > 0 else 16384, 2048)
    reserved = 512 + activation_tokens * 1.5 + tp_size * pp_size / 8 * 1024
    reserved += _graph_reserve_mib(shape, max_bs, chunk, attn_dp_size)
    if gpu_memory_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    fraction = round((gpu_memory_mib - reserved) / gpu_memory_mib, 3)
    if shape.is_multimodal:
        fraction *= _vlm_factor(shape)
    return SglangDefaults(
        chunked_prefill_size=chunk,
        decode_cuda_graph_max_bs=max_bs,
        reserved_mib=reserved,
        mem_fraction_static=fraction,
    )


def hicache_host_gib_per_rank(
    hicache_size_gb: float | None,
    hicache_ratio: float | None,
    device_pool_gib: float,
    host_ram_gib: float,
    ranks_on_host: int,
) -> float:
    """Host RAM one rank's HiCache pool takes (GiB).

    --hicache-size wins (decimal GB per rank); else --hicache-ratio x the device KV pool;
    with neither, SGLang starts at ratio 2.0 and shrinks it until the pools of all ranks fit
    HICACHE_HOST_MEMORY_FRACTION of (host RAM - reserve), so that case never overflows.
    """
    if hicache_size_gb:
        return hicache_size_gb * GB / GIB
    if hicache_ratio is not None:
        return hicache_ratio * device_pool_gib
    fit = HICACHE_HOST_MEMORY_FRACTION * (host_ram_gib - HICACHE_HOST_RESERVE_GIB) / ranks_on_host
    return max(0.0, min(DEFAULT_HICACHE_RATIO * device_pool_gib, fit))


def floor_to(value: float, step: float) -> float:
    """Round down to a multiple of step (suggested fractions must not exceed a limit)."""
    return math.floor(value / step + 1e-9) * step


# --- CPU engine (docs/CPU-SERVERS.md) ---------------------------------------------------
# On CPU SGLang sizes the KV pool from the host's free RAM (per NUMA node) unless
# --max-total-tokens caps it, so the planner plans host RAM: weights + KV + process overhead.
# Overhead measured with SGLang 0.5.23 on the tiny test Llama (tp 1, docs/CPU-SERVERS.md):
# launcher, scheduler and detokenizer together held about 1.3 GB RSS with a few MB of weights
# and KV; per extra rank a scheduler process of about 0.8 GB.
CPU_SERVER_OVERHEAD_GIB = 0.5
CPU_RANK_OVERHEAD_GIB = 0.8
# What a CPU plan leaves free of the host's RAM for the OS, page cache and other processes.
CPU_RAM_FRACTION = 0.8


def cpu_kv_bytes(cell_size: int, tp_size: int, dp_size: int, tokens: int) -> int:
    """Host bytes of a CPU server's KV pools: every rank holds `cell_size` bytes per token (its
    share of the heads for MHA, the whole latent for MLA), and each DP replica has its pool."""
    return cell_size * tp_size * dp_size * tokens


def cpu_host_ram_gib(weight_bytes: int, kv_bytes: int, tp_size: int, dp_size: int) -> float:
    """Host RAM a CPU server needs: weights once per DP replica, its KV, process overhead."""
    ranks = tp_size * dp_size
    overhead = CPU_SERVER_OVERHEAD_GIB + CPU_RANK_OVERHEAD_GIB * ranks
    return (weight_bytes * dp_size + kv_bytes) / GIB + overhead


def cpu_tokens_fitting(
    ram_gib: float,
    weight_bytes: int,
    *,
    cell_size: int,
    tp_size: int,
    dp_size: int,
    page_size: int = 1,
) -> int:
    """The largest --max-total-tokens whose server needs at most `ram_gib` of host RAM."""
    spare = ram_gib - cpu_host_ram_gib(weight_bytes, 0, tp_size, dp_size)
    per_token = cell_size * tp_size * dp_size
    if spare <= 0 or per_token <= 0:
        return 0
    return max_total_num_tokens(spare, per_token, page_size)
