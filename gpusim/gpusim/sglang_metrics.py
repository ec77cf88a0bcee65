"""The rest of SGLang 0.5.23's /metrics: every family the real server serves with
`--enable-metrics` that http_api.Metrics does not model itself.

Names, types, label keys and label values are the real server's (scraped from SGLang 0.5.23 on
CPU, tests/fixtures/real-sglang-0.5.23-cpu/metrics.txt; tests/double/test_contract_real.py holds
the double to it). Values come from the double's scheduler and memory plan where it has them
(KV slots, memory, startup phases, realtime token counts, HTTP traffic); features the double does
not simulate (SWA/mamba pools, disaggregation queues, routing keys, DP attention) are served at
0, which is what the real server reports when they are off. Speculative decoding's gauges carry
the scheduler's last published figures (engine.SpecStats; 0 without speculation).
gpusim/README.md lists what stays different and why.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from gpusim.engine import Request, Scheduler
from gpusim.memory import MemoryPlan

SCHED_KEYS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
GRAPH_PHASES = (
    "prefill",
    "decode",
    "target_verify",
    "draft_prefill",
    "draft_decode",
    "draft_extend",
)
STARTUP_PHASES = ("load_weight", "kv_cache_allocation", "scheduler_e2e", "tokenizer_e2e")
ROUTING_GT = ("0", "1", "2", "3", "5", "7", "10", "20", "50", "100", "200")
STAGE_CATEGORIES = (
    "get_next_batch_to_run",
    "idle",
    "other",
    "process_batch_result",
    "process_input_requests",
    "process_queue",
    "recv_requests",
    "run_batch",
    "sanity_check_cache",
)
# Scheduler gauges the double has no feature for: the real server serves them at 0 when off.
ZERO_GAUGES = {
    "sglang:num_grammar_queue_reqs": "The number of requests in the grammar waiting queue.",
    "sglang:swa_token_usage": "The token usage for SWA layers.",
    "sglang:mamba_usage": "The token usage for Mamba layers.",
    "sglang:swa_available_tokens": "Number of free token slots in the SWA pool (hybrid-SWA only).",
    "sglang:swa_evictable_tokens": "Number of evictable token slots in the SWA pool.",
    "sglang:swa_used_tokens": "Number of actively used token slots in the SWA pool.",
    "sglang:mamba_available_tokens": "Number of free state slots in the mamba SSM pool.",
    "sglang:mamba_evictable_tokens": "Number of evictable state slots in the mamba SSM pool.",
    "sglang:mamba_used_tokens": "Number of actively used state slots in the mamba SSM pool.",
    "sglang:spec_cap_length": "Mean DSpark confidence-scheduled verify window per verify step.",
    "sglang:spec_block_accept_length": "Mean uncapped full-block accept length per verify step.",
    "sglang:num_prefill_bootstrap_queue_reqs": "Requests in the prefill bootstrap queue.",
    "sglang:num_prefill_inflight_queue_reqs": "Requests in the prefill inflight queue.",
    "sglang:num_decode_prealloc_queue_reqs": "Requests in the decode prealloc queue.",
    "sglang:num_decode_transfer_queue_reqs": "Requests in the decode transfer queue.",
    "sglang:num_decode_host_receive_queue_reqs": "Decode transfer requests receiving into host.",
    "sglang:num_decode_deferred_kv_release_reqs": "Failed decode requests whose KV release waits.",
    "sglang:pending_prealloc_token_usage": "The token usage for pending preallocated tokens.",
    "sglang:prealloc_full_token_usage": "Share of the full-attention KV pool held by prealloc.",
    "sglang:prealloc_swa_token_usage": "Share of the SWA KV pool held by prealloc.",
    # 0.5.23 never sets it (metrics_reporter.py: "sglang:utilization stuck at 0").
    "sglang:utilization": "The utilization.",
    "sglang:fwd_occupancy": "Forward pass GPU occupancy percentage.",
    "sglang:new_token_ratio": "The new token ratio.",
    "sglang:num_unique_running_routing_keys": "Number of unique routing keys in running batch.",
}
# Speculative decoding's gauges (0.5.23 `srt/observability/metrics_collector.py`: Gauge, the
# scheduler's labels, multiprocess_mode "mostrecent"), set from engine.SpecStats: what the
# metrics reporter published at its last decode log interval (all 0 without speculation and
# before the first decode line). Help texts are the wheel's.
SPEC_GAUGES = {
    "sglang:spec_accept_length": (
        "Mean acceptance length of speculative decoding (accepted drafts + bonus token per "
        "forward).",
        "accept_length",
    ),
    "sglang:spec_accept_rate": (
        "Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).",
        "accept_rate",
    ),
    "sglang:spec_num_steps": ("Currently active speculative_num_steps.", "num_steps"),
    "sglang:spec_num_draft_tokens": (
        "Currently active speculative_num_draft_tokens (decouples from steps under topk>1).",
        "num_draft_tokens",
    ),
}
TPOT_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06)
TPOT_BUCKETS += (0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)
LENGTH_BUCKETS = (100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000, 8000)
LENGTH_BUCKETS += (9000, 10000, 12500, 15000, 17500, 20000, 22500, 25000, 27500, 30000, 35000)
LENGTH_BUCKETS += (40000, 60000, 80000, 100000, 200000, 300000, 400000, 600000, 800000, 1e6, 1.1e6)
STAGE_BUCKETS = tuple(0.001 * 1.62**i for i in range(30))


class SchedulerExtras:
    """Registers the families and refreshes them from the scheduler on each scrape."""

    def __init__(  # noqa: PLR0915 (one statement per family: a table would hide the labels)
        self, registry: CollectorRegistry, sched: dict[str, str], tok: dict[str, str]
    ) -> None:
        # SGLang serves its metrics in prometheus_client's multiprocess mode, which has no
        # `_created` series.
        disable_created_metrics()
        self.sched, self.tok = sched, tok
        self.started = time.time()
        self._synced: dict[tuple[str, str], float] = {}
        r = registry
        keys = list(sched)

        def gauge(name: str, doc: str, *extra: str) -> Gauge:
            return Gauge(name, doc, [*keys, *extra], registry=r)

        def counter(name: str, doc: str, *extra: str, labels: Iterable[str] = keys) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=r)

        self.zero = {name: gauge(name, doc) for name, doc in ZERO_GAUGES.items()}
        self.spec = {name: gauge(name, doc) for name, (doc, _) in SPEC_GAUGES.items()}
        self.retracted = gauge(
            "sglang:num_retracted_reqs", "The number of retracted requests.", "pid"
        )
        self.paused = gauge("sglang:num_paused_reqs", "The number of paused requests.", "pid")
        self.weight_gb = gauge(
            "sglang:weight_memory_usage_gb", "Memory used by model weights in GB."
        )
        self.kv_gb = gauge("sglang:kv_cache_memory_usage_gb", "Memory used by the KV cache in GB.")
        self.graph_gb = gauge(
            "sglang:graph_memory_usage_gb", "Memory used by graphs in GB.", "phase"
        )
        self.page_size = gauge("sglang:page_size", "KV cache page size in tokens.")
        self.num_pages = gauge("sglang:num_pages", "Number of KV cache pages.")
        self.context_len = gauge("sglang:context_len", "Maximum context length.")
        self.startup_free = gauge(
            "sglang:startup_available_gpu_memory_gb", "Available GPU memory in GB at startup."
        )
        self.seq_lens = gauge(
            "sglang:decode_sum_seq_lens", "The sum of sequence lengths in decode."
        )
        self.full_usage = gauge("sglang:full_token_usage", "The token usage for full attention.")
        self.kv_available = gauge("sglang:kv_available_tokens", "Free token slots in the KV pool.")
        self.kv_evictable = gauge(
            "sglang:kv_evictable_tokens", "Evictable token slots in the pool."
        )
        self.kv_used = gauge("sglang:kv_used_tokens", "Actively used token slots in the KV pool.")
        self.is_graph = gauge("sglang:is_cuda_graph", "Whether the batch is using CUDA graph.")
        self.routing_running = gauge(
            "sglang:routing_key_running_req_count", "Routing keys by running request count.", "gt"
        )
        self.routing_all = gauge(
            "sglang:routing_key_all_req_count", "Routing keys by running+waiting requests.", "gt"
        )
        self.routing_active = Gauge(
            "sglang:routing_keys_active", "Number of unique routing keys with active requests",
            registry=r,
        )  # fmt: skip
        self.startup = Gauge(
            "sglang:startup_time_seconds", "Engine startup duration by phase in seconds.",
            ["model_name", "engine_type", "phase"], registry=r,
        )  # fmt: skip
        self.startup_graph = Gauge(
            "sglang:startup_cuda_graph_time_seconds", "CUDA graph capture duration by phase.",
            ["model_name", "engine_type", "phase"], registry=r,
        )  # fmt: skip
        self.realtime = counter(
            "sglang:realtime_tokens", "Total number of tokens processed.", "mode"
        )
        self.effective = counter(
            "sglang:prefill_effective_tokens", "Effective prefill tokens.", "mode"
        )
        self.graph_passes = counter(
            "sglang:cuda_graph_passes", "Forward passes categorized by CUDA graph.", "mode"
        )
        self.idle = counter("sglang:scheduler_idle_seconds", "Scheduler wall time while idle.")
        self.sched_cpu = counter("sglang:scheduler_process_cpu_seconds", "Scheduler CPU time.")
        self.stage = counter(
            "sglang:scheduler_stage_seconds", "Scheduler-loop wall time by stage.",
            "category", "forward_overlap",
        )  # fmt: skip
        self.dp_tokens = counter("sglang:dp_attention_tokens", "DP attention tokens.", "kind")
        self.dp_steps = counter("sglang:dp_attention_steps", "DP attention steps.", "rank_state")
        self.dp_pairs = counter("sglang:dp_attention_pairs", "DP attention pairs.", "kind")
        self.dp_imbalance = Histogram(
            "sglang:dp_attention_token_imbalance_ratio", "Max over mean tokens across DP ranks.",
            keys, registry=r, buckets=(1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0),
        )  # fmt: skip
        self.dp_wait = Histogram(
            "sglang:dp_attention_sync_wait_seconds", "MLP-sync all-gather wait per step.",
            keys, registry=r, buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01),
        )  # fmt: skip
        self.stage_latency = Histogram(
            "sglang:per_stage_req_latency_seconds", "The latency of each stage of requests.",
            [*keys, "stage"], registry=r, buckets=STAGE_BUCKETS,
        )  # fmt: skip
        tok_keys = list(tok)
        self.cached = Counter(
            "sglang:cached_tokens", "Number of cached prompt tokens by source.",
            [*tok_keys, "cache_source"], registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "sglang:request_time_per_output_token_seconds", "Per-request TPOT in seconds.",
            [*tok_keys, "is_streaming"], registry=r, buckets=TPOT_BUCKETS,
        )  # fmt: skip
        self.prompt_len = Histogram(
            "sglang:prompt_tokens_histogram", "Histogram of prompt token length.",
            tok_keys, registry=r, buckets=LENGTH_BUCKETS,
        )  # fmt: skip
        self.uncached_len = Histogram(
            "sglang:uncached_prompt_tokens_histogram", "Histogram of uncached prompt token length.",
            tok_keys, registry=r, buckets=LENGTH_BUCKETS,
        )  # fmt: skip
        self.generation_len = Histogram(
            "sglang:generation_tokens_histogram", "Histogram of generation token length.",
            tok_keys, registry=r, buckets=LENGTH_BUCKETS,
        )  # fmt: skip
        self.process_cpu = Counter(
            "sglang:process_cpu_seconds", "Total CPU time consumed by this process",
            ["component"], registry=r,
        )  # fmt: skip
        http = ["endpoint", "method"]
        self.http_requests = Counter(
            "sglang:http_requests", "Total number of HTTP requests by endpoint and method",
            http, registry=r,
        )  # fmt: skip
        self.http_responses = Counter(
            "sglang:http_responses", "Total number of HTTP responses by endpoint and status code",
            [*http, "status_code"], registry=r,
        )  # fmt: skip
        self.http_active = Gauge(
            "sglang:http_requests_active", "Number of currently active HTTP requests",
            http, registry=r,
        )  # fmt: skip
        self._create_series()

    def _create_series(self) -> None:
        """Every labelled series the real server shows from its first scrape."""
        s = self.sched
        for metric in (*self.zero.values(), *self.spec.values()):
            metric.labels(**s).set(0)
        pid = str(os.getpid())
        self.retracted.labels(**s, pid=pid).set(0)
        self.paused.labels(**s, pid=pid).set(0)
        for gt in ROUTING_GT:
            self.routing_running.labels(**s, gt=gt).set(0)
            self.routing_all.labels(**s, gt=gt).set(0)
        self.routing_active.set(0)
        for mode in ("decode", "prefill_compute", "prefill_cache"):
            self.realtime.labels(**s, mode=mode)
        for mode in ("device_hit", "host_hit", "input", "storage_hit"):
            self.effective.labels(**s, mode=mode)
        for mode in ("decode_none", "prefill_none"):
            self.graph_passes.labels(**s, mode=mode)
        self.idle.labels(**s)
        self.sched_cpu.labels(**s)
        for category in STAGE_CATEGORIES:
            self.stage.labels(**s, category=category, forward_overlap="none")
        for kind in ("imbalance", "scheduled"):
            self.dp_tokens.labels(**s, kind=kind)
            self.dp_pairs.labels(**s, kind=kind)
        for state in ("active", "idle"):
            self.dp_steps.labels(**s, rank_state=state)
        self.dp_imbalance.labels(**s)
        self.dp_wait.labels(**s)
        self.cached.labels(**self.tok, cache_source="device")
        for component in ("tokenizer", "detokenizer"):
            self.process_cpu.labels(component=component)

    def set_startup(self, plan: MemoryPlan, scheduler: Scheduler, page_size: int) -> None:
        """The figures the real server publishes once start-up is done."""
        s, t = self.sched, scheduler.timing
        self.weight_gb.labels(**s).set(round(plan.weight_gib, 3))
        self.kv_gb.labels(**s).set(round(plan.kv_gib, 3))
        # With speculation the target's decode graph is its verify graph ("target_verify").
        by_phase = {
            "prefill": plan.graph_mib.get("prefill", 0.0),
            plan.decode_graph_phase: plan.graph_mib.get("decode", 0.0),
        }
        for phase in GRAPH_PHASES:
            mib = by_phase.get(phase, 0.0)
            self.graph_gb.labels(**s, phase=phase).set(round(mib / 1024, 3))
            capture = t.graph_capture_s if phase == plan.decode_graph_phase and mib else 0.0
            self.startup_graph.labels(**self._tok_only(), phase=phase).set(capture)
        self.page_size.labels(**s).set(page_size)
        self.num_pages.labels(**s).set(plan.max_total_num_tokens // max(1, page_size))
        self.context_len.labels(**s).set(plan.context_len)
        self.startup_free.labels(**s).set(round(plan.headroom_mib / 1024, 3))
        phases = {
            "load_weight": t.load_weights_s,
            "kv_cache_allocation": t.kv_alloc_s,
            "scheduler_e2e": t.load_weights_s + t.kv_alloc_s + t.graph_capture_s,
            "tokenizer_e2e": time.time() - self.started,
        }
        for phase in STARTUP_PHASES:
            self.startup.labels(**self._tok_only(), phase=phase).set(round(phases[phase], 3))

    def _tok_only(self) -> dict[str, str]:
        return {"model_name": self.tok["model_name"], "engine_type": self.tok["engine_type"]}

    def _sync(self, metric: Counter, labels: dict[str, str], key: str, value: float) -> None:
        step = value - self._synced.get((metric._name, key), 0.0)
        if step > 0:
            metric.labels(**labels).inc(step)
            self._synced[(metric._name, key)] = value

    def refresh(self, scheduler: Scheduler) -> None:
        s, stats = self.sched, scheduler.stats
        for name, (_, attribute) in SPEC_GAUGES.items():
            self.spec[name].labels(**s).set(getattr(scheduler.spec_stats, attribute))
        used = scheduler.reserved
        self.kv_used.labels(**s).set(used)
        self.kv_available.labels(**s).set(max(0, scheduler.max_total - used))
        cached_blocks = len(scheduler.prefix_cache.blocks) * 64
        self.kv_evictable.labels(**s).set(min(cached_blocks, max(0, scheduler.max_total - used)))
        self.full_usage.labels(**s).set(round(scheduler.token_usage, 2))
        lens = sum(r.prompt_tokens + r.generated for r in scheduler.running)
        self.seq_lens.labels(**s).set(lens)
        graph = 0 < len(scheduler.running) <= scheduler.plan.decode_graph_max_bs
        self.is_graph.labels(**s).set(1 if graph else 0)
        computed = stats.prompt_tokens_total - stats.cached_tokens_total
        self._sync(self.realtime, {**s, "mode": "decode"}, "d", stats.generation_tokens_total)
        self._sync(self.realtime, {**s, "mode": "prefill_compute"}, "c", computed)
        self._sync(self.realtime, {**s, "mode": "prefill_cache"}, "h", stats.cached_tokens_total)
        self._sync(self.effective, {**s, "mode": "input"}, "i", stats.prompt_tokens_total)
        self._sync(self.effective, {**s, "mode": "device_hit"}, "dh", stats.cached_tokens_total)
        self._sync(
            self.cached, {**self.tok, "cache_source": "device"}, "cs", stats.cached_tokens_total
        )
        cpu = os.times()
        self._sync(self.process_cpu, {"component": "tokenizer"}, "p", cpu.user + cpu.system)

    def observe_finished(self, req: Request) -> None:
        streaming = str(req.stream).lower()
        self.prompt_len.labels(**self.tok).observe(req.prompt_tokens)
        self.uncached_len.labels(**self.tok).observe(req.prompt_tokens - req.cached_tokens)
        self.generation_len.labels(**self.tok).observe(req.generated)
        if req.first_token_at is not None and req.finished_at is not None and req.generated > 1:
            tpot = (req.finished_at - req.first_token_at) / (req.generated - 1)
            self.tpot.labels(**self.tok, is_streaming=streaming).observe(tpot)
        if req.admitted is not None:
            self.stage_latency.labels(**self.sched, stage="request_process").observe(
                req.admitted - req.created
            )
            if req.first_token_at is not None:
                self.stage_latency.labels(**self.sched, stage="prefill_forward").observe(
                    req.first_token_at - req.admitted
                )


def http_middleware(extras: SchedulerExtras) -> Any:
    """SGLang's HTTP metrics (srt/observability/http_request_metrics.py): requests, responses by
    status and requests in flight, labelled with the path asked for and the method."""
    from aiohttp import web  # noqa: PLC0415 (the HTTP layer's dependency, not this module's)

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        labels = {"endpoint": request.path, "method": request.method}
        extras.http_requests.labels(**labels).inc()
        active = extras.http_active.labels(**labels)
        active.inc()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            active.dec()
            extras.http_responses.labels(**labels, status_code=str(status)).inc()

    return count
