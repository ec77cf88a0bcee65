"""The capacity plan of a GPU server: KV pool, out-of-memory risk, HiCache, throughput bound.

Memory model (SGLang 0.5.23, see kv_cache.py): pre = free GiB before weights load, post =
free GiB after; rest = post - pre * (1 - mem_fraction_static); max_total_num_tokens =
rest / cell_size. Without a calibration pre = GPU total - CUDA_CONTEXT_GIB and
post = pre - weights / tp. A calibration (args `calibration`: records the deploy stored on
the host, see sglang_fleet/capacity/calibration_apply.py and docs/CALIBRATION.md; or
`calibration_log`: the text of an earlier server log) that matches the flag set replaces the
estimates with what SGLang measured; one that does not match is a `calibration_mismatch` warning.

Out-of-memory risk of a high mem_fraction_static (the memory left outside the static pool
must hold CUDA graphs and the activations of the largest prefill):
- without calibration: warn above the fraction SGLang 0.5.23 would choose for this GPU size,
  model and tp (its own reserve estimate; conservative by design);
- with calibration: free memory after CUDA graph capture is predicted from the measured
  figure (the static pool grows by (new - calibrated fraction) * pre; graph memory by
  SGLang's estimate when batch sizes change), and below MIN_FREE_AFTER_GRAPH_GIB
  (planner_inputs.py) it is an **error** naming the prediction, the margin and the highest
  fraction that keeps it. `calibration_mode: warn` makes it a warning (the operator overrules
  it), `ignore` plans with estimates only.

Its calibration paths are planner_calibration.py's, its speculative decoding (the draft, the 48
reset, the speed-up) planner_speculation.py's: both mixins of GpuPlanner.

GpuPlanner is also the CPU planner's base (cpu_planner.py): the layout, dtype, context and
throughput checks are the same on both devices.
"""

from __future__ import annotations

from typing import Any

from sglang_fleet.capacity import attention_dp, kv_cache
from sglang_fleet.capacity.model_config import ModelConfigError, model_shape
from sglang_fleet.capacity.noop_flags import noop_flag_issues
from sglang_fleet.capacity.plan_issues import issue
from sglang_fleet.capacity.planner_calibration import PlannerCalibration
from sglang_fleet.capacity.planner_inputs import (
    PlanInputError,
    check_inputs,
    check_weight_bytes,
    merge_args,
    parse_startup_log,
    typed_host,
)
from sglang_fleet.capacity.planner_speculation import PlannerSpeculation

# Decode speed of one request when neither the caller nor a calibration log says: the
# Kimi job's server decoded ~600 tok/s over ~50 running requests. A guess for other models.
DEFAULT_PER_REQUEST_TOK_S = 12.0


class GpuPlanner(PlannerCalibration, PlannerSpeculation):
    """One planning run of a GPU server; collects warnings and errors while it computes."""

    def __init__(
        self, config: dict[str, Any], weight_bytes: int, args: dict[str, Any], host: dict[str, Any]
    ):
        self.args = merge_args(args)
        self.host = typed_host(host)
        check_inputs(self.args)
        try:
            self.shape = model_shape(config)
        except ModelConfigError as exc:
            raise PlanInputError(str(exc), "model_config") from exc
        self.weight_bytes = check_weight_bytes(weight_bytes)
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
        self.dtype = str(self.args["kv_cache_dtype"])
        self.config = config
        self.target_cell = kv_cache.cell_size_bytes(
            self.shape, self.dtype, self.layout.attn_tp_size
        )
        self.spec, self.draft = self._speculation(config)
        self.gpu_mib = float(self.host["gpu_memory_mib"])
        self.startup_log = parse_startup_log(self.args)
        if self.startup_log is not None and (skipped := self.startup_log.long_lines_note()):
            self.warnings.append(issue("calibration_log_long_lines", skipped))
        self.defaults = kv_cache.sglang_default_mem_fraction(
            self.gpu_mib,
            self.shape,
            self.tp,
            chunked_prefill_size=self.args["chunked_prefill_size"],
            max_running_requests=self.args["max_running_requests"],
            attn_dp_size=self.attn_dp,
            cuda_graph_max_bs_decode=self.args["cuda_graph_max_bs_decode"]
            if self.attn_dp > 1
            else None,
        )
        given = self.args["mem_fraction_static"]
        self.fraction = float(given) if given is not None else self.defaults.mem_fraction_static
        self.calibration = self._apply_calibration(config, weight_bytes)
        self.prediction = self.calibration.prediction if self.calibration else None
        self.pre, self.post = self._free_memory()

    def _layout(self) -> attention_dp.Layout:
        """tp, attention DP and replicas as SGLang resolves them (both flag spellings)."""
        args = self.args
        try:
            layout = attention_dp.resolve_layout(
                int(args["tp_size"]),
                int(args["dp_size"]),
                args["attn_dp_size"],
                args["enable_dp_attention"],
            )
        except attention_dp.LayoutError as exc:
            raise PlanInputError(str(exc), exc.argument) from exc
        if layout.attn_dp_size > 1 and args["cuda_graph_max_bs_decode"] is None:
            self.warnings.append(
                issue(
                    "attn_dp_graph_batch",
                    f"Attention DP {layout.attn_dp_size} without --cuda-graph-max-bs-decode: "
                    "SGLang captures decode graphs up to its default batch (512 on a GPU of "
                    "this class) and reserves batch x attn_dp x 4.5 MiB for them. Set it to the "
                    "batch one rank runs (attention_dp_layouts gives one per layout).",
                )
            )
        if layout.deprecated_spelling:
            self.warnings.append(
                issue("deprecated_enable_dp_attention", attention_dp.deprecation_message(layout))
            )
        return layout

    def _free_memory(self) -> tuple[float, float]:
        if self.prediction is not None:
            return self.prediction.pre_gib, self.prediction.post_gib
        pre = kv_cache.estimate_pre_gib(self.gpu_mib)
        # Each GPU's weights as SGLang places them (replicated projections whole; issue 47).
        weights = attention_dp.resident_bytes_per_gpu(self.weights, self.tp, self.attn_dp)
        # The draft's weights are loaded before SGLang measures what is left for KV.
        draft = self.draft.weights_per_gpu_bytes / kv_cache.GIB if self.draft else 0.0
        return pre, pre - weights / kv_cache.GIB - draft

    # --- KV budget -------------------------------------------------------------------
    def kv_tokens(self, cell: int) -> tuple[float, int]:
        if self.prediction is not None:
            rest = self.prediction.kv_budget_gib
            tokens = self.prediction.max_total_num_tokens
        else:
            reserve = kv_cache.multimodal_reserve_gib(self.shape)
            rest = kv_cache.rest_gib(self.pre, self.post, self.fraction, reserve)
            tokens = kv_cache.max_total_num_tokens(rest, cell, int(self.args["page_size"]))
        if self.args["max_total_tokens"] is not None:
            # SGLang caps the pool it computed at --max-total-tokens.
            tokens = min(tokens, int(self.args["max_total_tokens"]))
        if rest <= 0:
            self._not_enough_memory(rest)
        return rest, tokens

    def _not_enough_memory(self, rest: float) -> None:
        needed = kv_cache.min_mem_fraction_for_kv(self.pre, self.post)
        self.errors.append(
            issue(
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
            return  # calibration_apply.apply judged the measured figure (error or warning)
        default = self.defaults.mem_fraction_static
        if self.fraction > default + 1e-9:
            self.warnings.append(
                issue(
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
        args = self.args
        if not args["enable_hierarchical_cache"]:
            return 0.0
        host_ram = self.host.get("host_ram_gib")
        ranks = self.tp * self.dp
        per_rank = kv_cache.hicache_host_gib_per_rank(
            args["hicache_size"] or None,
            args["hicache_ratio"],
            max(device_pool_gib, 0.0),
            float(host_ram or 0),
            ranks,
        )
        total = per_rank * ranks
        self.warnings.append(
            issue(
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
                issue(
                    "host_ram_unknown",
                    "host_ram_gib is not known: the HiCache host pool is not checked.",
                )
            )
        elif total + kv_cache.HICACHE_HOST_RESERVE_GIB > float(host_ram):
            size_note = (
                f"{args['hicache_size']} GB per rank" if args["hicache_size"] else "the pool size"
            )
            self.errors.append(
                issue(
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
                issue(
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
                issue(
                    "not_enough_gpus",
                    f"tp_size {self.tp} x dp_size {self.dp} = {self.tp * self.dp} GPUs, "
                    f"but the host has {count}.",
                )
            )

    def check_dtype(self) -> None:
        if self.dtype in kv_cache.FP8_DTYPES or self.dtype in kv_cache.FP4_DTYPES:
            ratio = kv_cache.elem_bytes("bf16") / kv_cache.elem_bytes(self.dtype)
            self.warnings.append(
                issue(
                    "kv_dtype_quality",
                    f"--kv-cache-dtype {self.dtype} stores KV in fewer bits: about "
                    f"{float(ratio):g}x "
                    "the tokens of bf16 (more concurrent decodes), at some cost in output "
                    "quality. A trade-off the operator chooses: check quality on your task.",
                )
            )
        if self.dtype in kv_cache.FP4_DTYPES and not self.shape.is_mla:
            self.warnings.append(
                issue(
                    "fp4_cell_size_estimate",
                    "FP4 KV for MHA models keeps recipe-specific scale buffers; the planned "
                    "token count is an upper estimate.",
                )
            )

    def check_context(self) -> None:
        context = self.args["context_length"] or self.shape.context_length
        per_request = self.args["avg_input_len"] + self.args["avg_output_len"]
        if context and per_request > context:
            self.warnings.append(
                issue(
                    "exceeds_context_length",
                    f"avg_input_len + avg_output_len = {per_request} exceeds the context "
                    f"length {context}.",
                )
            )

    # --- throughput ------------------------------------------------------------------
    def per_request_tok_s(self) -> tuple[float, str]:
        if self.args["per_request_tok_s"]:
            return float(self.args["per_request_tok_s"]), "argument"
        if self.startup_log is not None and (speed := self.startup_log.per_request_tok_s()):
            return speed, "calibration log"
        return DEFAULT_PER_REQUEST_TOK_S, "default guess"

    def concurrency(self, tokens: int, *, reset: bool = True) -> int:
        """Concurrent decodes of the whole server; `tokens` is one rank's pool. reset=False:
        as if speculation's 48 reset did not apply (what the operator should set instead)."""
        tokens_per_request = self.args["avg_input_len"] + self.args["avg_output_len"]
        fit = tokens // tokens_per_request
        context = self.args["context_length"] or self.shape.context_length
        asked = self.max_running_requests() if reset else self.args["max_running_requests"]
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
        given = self.args["gpu_memory_bandwidth_gbs"]
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
        context = self.args["avg_input_len"] + self.args["avg_output_len"] // 2
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
            "cuda_graph_max_bs_decode": self.args["cuda_graph_max_bs_decode"],
            "chunked_prefill_size_per_rank": self.chunk_per_rank(),
        }

    def post_weights_gib(self) -> float:
        """Weights per GPU: measured (calibrated) or the checkpoint's share, plus the layout's."""
        return self.pre - self.post

    def chunk_per_rank(self) -> int:
        """SGLang divides chunked_prefill_size by the attention-DP size."""
        chunk = self.args["chunked_prefill_size"] or self.defaults.chunked_prefill_size
        return chunk // self.attn_dp if chunk > 0 else chunk

    def bandwidth(self) -> tuple[float | None, str]:
        given = self.args["gpu_memory_bandwidth_gbs"]
        if given:
            return float(given), "gpu_memory_bandwidth_gbs"
        found, key = attention_dp.gpu_bandwidth_gbs(self.host.get("gpu_name"))
        if found is None:
            return None, (
                f"memory bandwidth of GPU {self.host.get('gpu_name')!r} unknown: "
                "set gpu_memory_bandwidth_gbs (--gpu-memory-bandwidth-gbs)"
            )
        return found, f"{found:g} GB/s (table: {key})"

    def run(self) -> dict[str, Any]:
        cell = self.target_cell
        rest, tokens = self.kv_tokens(cell + self.draft_budget_cell())
        self.check_gpus()
        self.check_oom_risk()
        hicache_total = self.check_hicache(rest)
        self.check_dtype()
        self.check_context()
        self.warnings += noop_flag_issues(self.args["server_flags"], self.args["sglang_version"])
        concurrent = self.concurrency(tokens)
        plain_speed, speed_source = self.per_request_tok_s()
        speculation = self.speculation(tokens, concurrent, plain_speed)
        # With speculation a request decodes `speedup` times as fast at this concurrency.
        gain = (speculation or {}).get("speedup_at_planned_concurrency") or 1.0
        speed = plain_speed * gain
        free_after_graph = self.free_after_graph()
        row = self.layout_row(tokens, concurrent, speed, rest)
        headroom = kv_cache.headroom_gib(self.pre, self.fraction)
        if self.draft is not None:
            headroom -= self.draft.beyond_budget_bytes(tokens) / kv_cache.GIB
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
            "headroom_gib": round(headroom, 2),
            "hicache_host_gib_total": round(hicache_total, 2),
            "speculative": speculation,
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
                "tokens_per_request": self.args["avg_input_len"] + self.args["avg_output_len"],
                "per_request_tok_s": round(plain_speed, 2),
                "per_request_tok_s_source": speed_source,
                "speculative_speedup": None if speculation is None else gain,
                "dp_size": self.dp,
                "attn_dp_size": self.attn_dp,
            },
        }
