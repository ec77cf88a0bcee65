"""`python3 -m gpusim.sglang_server <SGLang flags>`: stands in for `python -m sglang.launch_server`.

The launcher parses SGLang's flags, binds the HTTP port, spawns one process per TP rank
(gpusim.rank, which inherits the listening socket), simulates start-up with SGLang's log
lines while registering each rank's GPU memory, then serves SGLang's HTTP API with a
simulated scheduler. Failures SGLang raises in a scheduler end the way SGLang's do: the
rank logs "Scheduler hit an exception", the launcher kills its tree and itself (SIGKILL).

Multi-node (`--nnodes/--node-rank/--dist-init-addr`): each node runs this launcher with its
own ranks; they meet on the dist-init port first (gpusim.distributed). Node 0 serves the API;
the other nodes answer only SGLang's dummy /health once their ranks are up, ignore SIGTERM
(they stop on node 0's ShutdownReq) and go down with any node of the group.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from gpusim import distributed, flags, logs, resolved_args, speculative, state
from gpusim.distributed import GroupConfig, Leader, Member
from gpusim.engine import AttentionDPSchedulers, Request, Scheduler
from gpusim.http_api import Metrics, ServerState, build_app
from gpusim.logs import LoggingConfigMissing
from gpusim.memory import (
    CUDA_CONTEXT_MIB,
    GIB,
    MemoryArgs,
    MemoryPlan,
    StartupFailure,
    capture_oom,
    check_args,
    draft_kv_oom,
    plan_memory,
    prefill_graph_buckets,
    weight_gib_per_rank,
)
from gpusim.model import ModelDirError, ModelShape, load_model
from gpusim.rank import spawn as spawn_rank
from gpusim.speculative import SpecDecode, Speculation
from gpusim.tokenizer import WordTokenizer
from gpusim.version import installed_sglang_version

DRAIN_POLL_S = 0.05
DRAIN_LOG_EVERY_S = 1.0
CHILD_TERM_WAIT_S = 5.0
RANK_POLL_S = 0.05
# When one of a node's schedulers dies, how long its siblings get to die too (systemd's
# SIGTERM reaches all of them at once) before the survivors count as crashed.
SIBLING_EXIT_GRACE_S = 1.0
KV_DTYPE_NAMES = {
    "auto": "torch.bfloat16",
    "bf16": "torch.bfloat16",
    "bfloat16": "torch.bfloat16",
    "fp8_e4m3": "torch.float8_e4m3fn",
    "fp8_e5m2": "torch.float8_e5m2",
    "mxfp8": "torch.float8_e4m3fn",
    "nvfp4": "torch.float4_e2m1fn_x2",
    "fp4_mx_block16": "torch.float4_e2m1fn_x2",
}


def print_traceback(exc_type: str, message: str, where: str) -> None:
    """A Python-shaped traceback for failures SGLang raises in the launcher process."""
    print("Traceback (most recent call last):", file=sys.stderr)
    print(f'  File "<frozen runpy>", line 198, in _run_module_as_main\n  {where}', file=sys.stderr)
    print(f"{exc_type}: {message}", file=sys.stderr, flush=True)


def _memory_args(args: argparse.Namespace) -> MemoryArgs:
    names = MemoryArgs.__dataclass_fields__
    values = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    graph_bs = getattr(args, "cuda_graph_max_bs_decode", None)
    if graph_bs is not None:
        values["cuda_graph_max_bs"] = graph_bs
    return MemoryArgs(**values)


@dataclass
class RankProc:
    tp_rank: int
    pp_rank: int
    gpu: int
    title: str
    pid: int
    used_mib: int = 0


class Launcher:
    def __init__(
        self, args: argparse.Namespace, argv: Sequence[str], version: str | None = None
    ) -> None:
        self.args = args
        self.argv = list(argv)
        # The SGLang version this server is (the installed distribution's; README, "Versions").
        self.version = installed_sglang_version() if version is None else version
        self.hardware = state.load_hardware()
        self.timing = self.hardware.timing
        self.version_slowdown = self.hardware.slowdown_for(self.version)
        self.ranks: list[RankProc] = []
        self.server: ServerState | None = None
        self.runner: web.AppRunner | None = None
        self.shutdown = asyncio.Event()
        self.exit_code = 0
        self.tp_size, self.pp_size = args.tp_size, getattr(args, "pp_size", 1)
        self.attn_dp = _attn_dp_size(args)
        self.node_rank = getattr(args, "node_rank", 0)
        nnodes = getattr(args, "nnodes", 1)
        # Node n holds world ranks [n*L, (n+1)*L), world rank = tp_size * pp_rank + tp_rank
        # (SGLang's _calculate_rank_ranges gives each node whole stages or a TP slice).
        self.local_ranks = max(1, self.tp_size * self.pp_size // max(1, nnodes))
        self.first_rank = self.node_rank * self.local_ranks
        self.rank_prefix = self._prefix(self.first_rank)
        # Until main() resolves address and timeout (distributed.configure): no network yet.
        self.group = GroupConfig(
            self.node_rank,
            nnodes,
            self.tp_size * self.pp_size,
            self.local_ranks,
            distributed.DEFAULT_DIST_TIMEOUT_S,
        )
        self.leader: Leader | None = None
        self.member: Member | None = None
        # Speculative decoding (gpusim/speculative.py): the resolved flag set, its decode model.
        self.speculation: Speculation | None = None
        # server_args as SGLang logs them once its defaults resolved (gpusim/resolved_args.py).
        self.resolved_args: dict[str, object] = {}
        self.spec_decode: SpecDecode | None = None

    # -- process tree ----------------------------------------------------------------------
    def _gpu_of(self, local_rank: int) -> int:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        base = getattr(self.args, "base_gpu_id", 0) or 0
        index = base + local_rank
        if visible:
            return int(visible.split(",")[index])
        return index

    def _prefix(self, world_rank: int) -> str:
        """SGLang's scheduler prefix: " PP<p>" with pipeline stages, " DP<d>" with attention
        DP, " TP<t>" with TP."""
        prefix = f" PP{world_rank // self.tp_size}" if self.pp_size > 1 else ""
        if self.attn_dp > 1:
            prefix += f" DP{world_rank % self.tp_size // (self.tp_size // self.attn_dp)}"
        return prefix + (f" TP{world_rank % self.tp_size}" if self.tp_size > 1 else "")

    def spawn_ranks(self) -> None:
        """Fork one process per local rank; each inherits the sockets bound so far."""
        for local in range(self.local_ranks):
            world_rank = self.first_rank + local
            gpu = self._gpu_of(local)
            title = f"sglang::scheduler{self._prefix(world_rank).replace(' ', '_')}"
            tp_rank, pp_rank = world_rank % self.tp_size, world_rank // self.tp_size
            proc = RankProc(tp_rank, pp_rank, gpu, title, spawn_rank(gpu, title))
            self.ranks.append(proc)
            self._register(proc, CUDA_CONTEXT_MIB)

    def _register(self, proc: RankProc, used_mib: float) -> None:
        proc.used_mib = round(used_mib)
        with contextlib.suppress(ProcessLookupError):
            state.register(proc.pid, proc.gpu, proc.used_mib, proc.title)

    def kill_ranks(self, sig: int) -> None:
        for proc in self.ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)

    def reap_ranks(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.ranks:
            while not _reaped(proc.pid):
                if time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)
                    os.waitpid(proc.pid, 0)
                    break
                time.sleep(0.01)
            state.unregister(proc.pid)

    def die_with_tree(self) -> None:
        """SGLang's kill_process_tree(os.getpid()): children, then SIGKILL to itself."""
        self.kill_ranks(signal.SIGKILL)
        self.reap_ranks(5)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    # -- failures --------------------------------------------------------------------------
    def scheduler_exception(self, exc_type: str, message: str, running: bool) -> None:
        logs.SCHEDULER.error(
            "Scheduler hit an exception: Traceback (most recent call last):\n"
            '  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", '
            "line 6363, in run_scheduler_process\n"
            "    scheduler = Scheduler(server_args, port_args)\n"
            f"{exc_type}: {message}\n"
        )
        if running:
            logs.TOKENIZER_MANAGER.error(
                "SIGQUIT received. signum=None, frame=None. It usually means one child failed."
            )
        else:
            logs.ENGINE.error(
                "Received sigquit from a child process. It usually means the child failed."
            )
        self.die_with_tree()

    # -- start-up --------------------------------------------------------------------------
    def _rank_extra(self, rank: RankProc) -> dict[str, str]:
        return {"prefix": self._prefix(rank.pp_rank * self.tp_size + rank.tp_rank)}

    def _free_mib_per_rank(self) -> list[int]:
        """Free memory per rank's GPU before this server allocates anything."""
        mine = {r.pid for r in self.ranks}
        procs = [p for p in state.live_procs() if p.pid not in mine]
        used = state.used_mib_by_gpu(self.hardware, procs)
        return [self.hardware.gpu_memory_mib - used[r.gpu] for r in self.ranks]

    def _avail_gib(self, rank: RankProc) -> float:
        others = sum(
            p.used_mib
            for p in state.live_procs(prune=False)
            if p.gpu_index == rank.gpu and p.pid != rank.pid
        )
        return (self.hardware.gpu_memory_mib - others - rank.used_mib) / 1024

    async def startup(self, model: ModelShape, mem_args: MemoryArgs) -> MemoryPlan:
        free = self._free_mib_per_rank()
        group_min_free = await self._init_parallel(min(free))
        host_bytes = self.hardware.host_ram_gib * GIB
        failure: StartupFailure | None = None
        plan: MemoryPlan | None = None
        gpu_mib = self.hardware.gpu_memory_mib
        draft = self.speculation.placement if self.speculation is not None else None
        try:
            plan = plan_memory(
                model,
                mem_args,
                gpu_mib,
                free,
                host_bytes,
                group_min_free_mib=group_min_free,
                draft=draft,
            )
        except StartupFailure as exc:
            failure = exc
        self._fail_if(failure, "init")
        await self._load_weights(model, mem_args, failure)
        self._fail_if(failure, "kv_cache")
        assert plan is not None
        await asyncio.sleep(self.timing.kv_alloc_s)
        self._allocate_kv(plan, mem_args)
        await self._capture_graphs(plan)
        self._fail_if(plan.hicache_failure, "hicache")
        if plan.host_pool_tokens:
            logs.HOST_POOL.info(
                f"Allocating kv hierarchical KV host pool: {plan.host_pool_tokens} tokens, "
                f"{plan.host_pool_bytes_per_rank / 1e9:.2f} GB host memory."
            )
        for warning in plan.warnings:
            logs.HOST_POOL.warning(warning)
        return plan

    def _fail_if(self, failure: StartupFailure | None, phase: str) -> None:
        if failure is not None and failure.phase == phase:
            self.scheduler_exception(failure.exc_type, failure.message, running=False)

    # -- the group (multi-node) --------------------------------------------------------------
    async def _init_parallel(self, local_min_free: int) -> int | None:
        """SGLang's init_parallel_runtime: rendezvous, gloo and NCCL groups, per local rank.

        Returns the group's least free MiB (None on a single node without a store port).
        """
        for rank in self.ranks:
            logs.BOOTSTRAP.info("Init parallel begin.", extra=self._rank_extra(rank))
        tic = time.perf_counter()
        self._fail_if(self.group.failure, "init")
        group_min_free: int | None = None
        try:
            if self.node_rank == 0 and self.group.listener is not None:
                self.leader = Leader(self.group)
                group_min_free = await self.leader.gather(local_min_free)
            elif self.node_rank > 0:
                self.member = Member(self.group)
                group_min_free = await self.member.join(local_min_free)
        except StartupFailure as exc:
            self._fail_if(exc, "init")
        self._watch_group()
        self._fail_if(self._socket_interface_failure(), "init")
        for rank in self.ranks:
            logs.BOOTSTRAP.info(
                f"Init parallel ends. elapsed={time.perf_counter() - tic:.2f} s",
                extra=self._rank_extra(rank),
            )
        return group_min_free

    def _watch_group(self) -> None:
        if self.leader is not None:
            self.leader.watch(self._peer_lost)
        if self.member is not None:
            self.member.watch(self._peer_lost, self._group_shutdown)

    def _socket_interface_failure(self) -> StartupFailure | None:
        """gloo's CPU group always, NCCL when the world has more than one rank."""
        env = dict(os.environ)
        addresses = distributed.interface_addresses()
        failure = distributed.gloo_failure(env, addresses)
        if failure is not None or self.group.world_size <= 1:
            return failure
        choice = distributed.nccl_bootstrap(env, addresses)
        for device, rank in enumerate(self.ranks):
            for line in distributed.nccl_debug_lines(env, choice, rank.pid, device):
                print(line, flush=True)
        return distributed.nccl_failure() if choice is None else None

    def _peer_lost(self, host: str, port: int) -> None:
        """A node of the group went away: the next gloo broadcast fails on every rank."""
        running = self.server is not None and not self.server.starting and self.node_rank == 0
        exc_type, message = distributed.peer_closed(host, port)
        self.scheduler_exception(exc_type, message, running=running)

    def _group_shutdown(self) -> None:
        """Node 0 broadcast ShutdownReq: this node's schedulers leave their loops."""
        self.shutdown.set()

    async def _load_weights(
        self, model: ModelShape, mem_args: MemoryArgs, failure: StartupFailure | None
    ) -> None:
        for rank in self.ranks:
            logs.MODEL_RUNNER.info(
                f"Load weight begin. avail mem={self._avail_gib(rank):.2f} GB",
                extra=self._rank_extra(rank),
            )
        tic = time.perf_counter()
        await asyncio.sleep(self.timing.load_weights_s)
        self._fail_if(failure, "load_weights")
        weight_gib = weight_gib_per_rank(model, mem_args)
        for rank in self.ranks:
            self._register(rank, CUDA_CONTEXT_MIB + weight_gib * 1024)
            logs.MODEL_RUNNER.info(
                f"Load weight end. elapsed={time.perf_counter() - tic:.2f} s, "
                f"type={model.architecture}, "
                f"avail mem={self._avail_gib(rank):.2f} GB, mem usage={weight_gib:.2f} GB.",
                extra=self._rank_extra(rank),
            )
        self._load_draft_weights()

    def _load_draft_weights(self) -> None:
        """The draft worker's own ModelRunner loads next, with the same lines (scheduler.py
        `maybe_init_draft_worker`, before any KV pool exists)."""
        spec = self.speculation
        if spec is None or spec.draft is None:
            return
        placement = spec.placement
        draft_gib = placement.draft_weight_bytes_per_rank / GIB
        for rank in self.ranks:
            logs.MODEL_RUNNER.info(
                f"Load weight begin. avail mem={self._avail_gib(rank):.2f} GB",
                extra=self._rank_extra(rank),
            )
        for rank in self.ranks:
            self._register(rank, rank.used_mib + draft_gib * 1024)
            logs.MODEL_RUNNER.info(
                f"Load weight end. elapsed=0.00 s, type={_draft_class(spec)}, "
                f"avail mem={self._avail_gib(rank):.2f} GB, mem usage={draft_gib:.2f} GB.",
                extra=self._rank_extra(rank),
            )

    def _allocate_kv(self, plan: MemoryPlan, mem_args: MemoryArgs) -> None:
        dtype = KV_DTYPE_NAMES.get(mem_args.kv_cache_dtype, "torch.bfloat16")
        kv_gb = plan.kv_gib
        for rank in self.ranks:
            if plan.multimodal_reserve_gib > 0:
                logs.KV_CACHE_CONFIGURATOR.info(
                    "Reserving %.2f GB of the KV budget for post-sizing multimodal "
                    "allocations (feature-transport pools + embedding cache).",
                    plan.multimodal_reserve_gib,
                    extra=self._rank_extra(rank),
                )
            mla = bool(self.server is not None and self.server.model_info.get("is_mla"))
            self._allocate_pool(rank, dtype, plan.max_total_num_tokens, kv_gb, mla)
        self._allocate_draft_kv(plan)

    def _allocate_pool(
        self, rank: RankProc, dtype: str, tokens: int, kv_gb: float, mla: bool
    ) -> None:
        """One rank's KV pool taken from its memory, with SGLang's two lines for it (the
        target's, and a draft's after it)."""
        self._register(rank, rank.used_mib + kv_gb * 1024)
        if mla:
            sizes = f"KV size: {kv_gb:.2f} GB"
        else:
            sizes = f"K size: {kv_gb / 2:.2f} GB, V size: {kv_gb / 2:.2f} GB"
        logs.MEMORY_POOL.info(
            f"KV Cache is allocated. dtype: {dtype}, #tokens: {tokens}, " + sizes,
            extra=self._rank_extra(rank),
        )
        logs.KV_CACHE_CONFIGURATOR.info(
            f"Memory pool end. avail mem={self._avail_gib(rank):.2f} GB",
            extra=self._rank_extra(rank),
        )

    def _allocate_draft_kv(self, plan: MemoryPlan) -> None:
        """The draft's pool: the target's token count, the draft's own cell (scheduler.py
        `init_memory_pools`); what it takes beyond its price comes out of the headroom."""
        spec = self.speculation
        if spec is None or spec.draft is None:
            return
        oom = draft_kv_oom(plan)
        if oom is not None:
            self.scheduler_exception(oom.exc_type, oom.message, running=False)
        dtype = KV_DTYPE_NAMES.get(spec.placement.draft_kv_dtype, "torch.bfloat16")
        kv_gb = plan.draft_kv_gib
        for rank in self.ranks:
            self._allocate_pool(rank, dtype, plan.max_total_num_tokens, kv_gb, spec.draft.is_mla)

    async def _capture_graphs(self, plan: MemoryPlan) -> None:
        if getattr(self.args, "attention_backend", None) == "torch_native":
            # SGLang 0.5.23 captures no CUDA graph with torch_native attention (the CPU engine's).
            logs.SCHEDULER.info(
                "Cuda graph is disabled because of using torch native attention backend"
            )
            return
        oom = capture_oom(plan)
        for phase in ("decode", "prefill"):
            mib = plan.graph_mib[phase]
            name = phase
            if phase == "decode" and self.speculation is not None:
                # cuda_graph_setup.py: with speculation the target's decode graph verifies
                # num_draft_tokens tokens per request.
                name = "verify"
                detail = (
                    "CUDA graph begin. backend=full, "
                    f"num_tokens_per_req={self.speculation.num_draft_tokens}"
                )
            elif phase == "decode":
                detail = "CUDA graph begin. backend=full, num_tokens_per_req=1"
            else:
                detail = "CUDA graph begin. backend=breakable, " + (
                    f"num_tokens={prefill_graph_buckets(plan.chunked_prefill_size)[-1:]}"
                )
            for rank in self.ranks:
                logs.CUDA_GRAPH_SETUP.info(
                    f"Capture target {name} {detail}, avail mem={self._avail_gib(rank):.2f} GB",
                    extra=self._rank_extra(rank),
                )
            tic = time.perf_counter()
            await asyncio.sleep(self.timing.graph_capture_s / 2)
            if oom is not None:
                self.scheduler_exception(oom.exc_type, oom.message, running=False)
            for rank in self.ranks:
                extra = mib + (plan.runtime_mib if phase == "decode" else 0)
                self._register(rank, rank.used_mib + extra)
                logs.CUDA_GRAPH_SETUP.info(
                    f"Capture target {name} CUDA graph end. elapsed="
                    f"{time.perf_counter() - tic:.2f} s, mem usage={mib / 1024:.2f} GB, "
                    f"avail mem={self._avail_gib(rank):.2f} GB.",
                    extra=self._rank_extra(rank),
                )

    async def warmup(self, scheduler: Scheduler) -> None:
        """SGLang sends one short generation before it declares itself ready."""
        req = Request(rid="warmup", prompt_tokens=6, max_new_tokens=8)
        scheduler.submit(req)
        while not req.finished:
            await req.progress.wait()
            req.progress.clear()

    # -- shutdown --------------------------------------------------------------------------
    def on_sigterm(self) -> None:
        logs.TOKENIZER_MANAGER.info(
            "SIGTERM received. signum=<Signals.SIGTERM: 15> frame=None. "
            "Draining requests and shutting down..."
        )
        if self.server is not None:
            self.server.gracefully_exit = True
        self.shutdown.set()

    async def drain(self) -> None:
        scheduler = self.server.scheduler if self.server else None
        if os.environ.get("SGL_FORCE_SHUTDOWN", "").lower() in ("1", "true", "yes"):
            logs.TOKENIZER_MANAGER.error(
                "Signal SIGTERM received while force shutdown flag set. Force exiting."
            )
            return
        last_log = 0.0
        while scheduler is not None:
            remaining = [r.rid for r in (*scheduler.running, *scheduler.waiting)]
            now = time.monotonic()
            if now - last_log >= DRAIN_LOG_EVERY_S or not remaining:
                logs.TOKENIZER_MANAGER.info(
                    f"Gracefully exiting... Remaining number of requests {len(remaining)}. "
                    f"Remaining requests remaining_rids={remaining}."
                )
                last_log = now
            if not remaining:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        await asyncio.sleep(DRAIN_POLL_S)  # let handlers write their last chunks

    # -- main ------------------------------------------------------------------------------
    def _server_state(self, model: ModelShape) -> ServerState:
        args = self.args
        served = getattr(args, "served_model_name", None) or args.model_path
        tokenizer_dir = getattr(args, "tokenizer_path", None) or args.model_path
        info = {
            "model_path": args.model_path,
            "served_model_name": served,
            "tokenizer_path": tokenizer_dir,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": getattr(args, "load_format", "auto"),
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": model.model_type,
            "architectures": [model.architecture],
            "context_len": model.context_len,
            "is_mla": model.is_mla,
        }
        # As SGLang's resolved_dict: the values post-init resolved (the attention-DP spelling
        # included), what server_args= logged.
        server_args = dict(self.resolved_args or _server_args_dict(args))
        server_args["served_model_name"] = served
        if self.attn_dp > 1:  # enable_dp_attention reported true whenever attention DP runs
            server_args |= {"attn_dp_size": self.attn_dp, "dp_size": 1, "enable_dp_attention": True}
        return ServerState(
            server_args=server_args,
            version=self.version,
            served_model_name=served,
            model_info=info,
            tokenizer=WordTokenizer.from_dir(tokenizer_dir),
            metrics=Metrics(
                served,
                page_size=getattr(args, "page_size", None) or 1,
                attn_dp=self.attn_dp,
                all_schedulers=bool(getattr(args, "enable_metrics_for_all_schedulers", False)),
                tp_size=self.tp_size,
            )
            if getattr(args, "enable_metrics", False)
            else None,
        )

    async def serve(self, model: ModelShape, mem_args: MemoryArgs, sock: socket.socket) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.on_sigterm)
        loop.add_signal_handler(signal.SIGINT, self.on_sigterm)
        if self.speculation is not None:
            self.spec_decode = speculative.decode_model(self.speculation, self.timing, model)
        self.server = self._server_state(model)
        self.server.vocab_size = model.vocab_size
        self.server.fatal = lambda kind, message: self.scheduler_exception(kind, message, True)
        if self.node_rank > 0:
            return await self._serve_follower(model, mem_args, sock)
        app = build_app(self.server, getattr(self.args, "api_key", None))
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        await web.SockSite(self.runner, sock).start()
        startup = asyncio.create_task(self.startup(model, mem_args))
        stop = asyncio.create_task(self.shutdown.wait())
        await asyncio.wait({startup, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not startup.done():
            startup.cancel()  # SIGTERM during start-up: nothing to drain
            return await self._stop()
        plan = startup.result()
        await self._run_ready(plan)
        await stop
        await self.drain()
        return await self._stop()

    def _scheduler(self, plan: MemoryPlan) -> Scheduler | AttentionDPSchedulers:
        """One scheduler, or one per attention-DP rank, each with its own pool."""

        def one(prefix: str | None = None, factor: float = 1.0) -> Scheduler:
            return Scheduler(
                plan,
                self.timing,
                decode_log_interval=getattr(self.args, "decode_log_interval", 40),
                radix_cache=not getattr(self.args, "disable_radix_cache", False),
                on_crash=lambda msg: self.scheduler_exception("torch.OutOfMemoryError", msg, True),
                log_prefix=prefix,
                step_factor=factor,
                version_slowdown=self.version_slowdown,
                spec=self.spec_decode,
            )

        if self.attn_dp <= 1:
            return one()
        attn_tp = self.tp_size // self.attn_dp
        leaders = [d * attn_tp for d in range(self.attn_dp)]
        factor = self.timing.attn_dp_step_factor
        return AttentionDPSchedulers([one(self._prefix(t), factor) for t in leaders], leaders)

    async def _run_ready(self, plan: MemoryPlan) -> None:
        assert self.server is not None
        scheduler = self._scheduler(plan)
        self._scheduler_task = asyncio.create_task(scheduler.run())
        self.server.plan = plan
        logs.SCHEDULER.info(
            f"max_total_num_tokens={plan.max_total_num_tokens}, "
            f"chunked_prefill_size={plan.chunked_prefill_size}, "
            f"max_prefill_tokens={getattr(self.args, 'max_prefill_tokens', 16384)}, "
            f"max_running_requests={plan.max_running_requests}, "
            f"context_len={plan.context_len}, "
            f"available_{'cpu' if getattr(self.args, 'device', None) == 'cpu' else 'gpu'}_mem="
            f"{self._avail_gib(self.ranks[0]):.2f} GB"
        )
        self.server.scheduler = scheduler
        if not getattr(self.args, "skip_server_warmup", False):
            await self.warmup(scheduler)
        self.server.starting = False
        logs.HTTP_SERVER.info("The server is fired up and ready to roll!")

    # -- nodes >= 1 -------------------------------------------------------------------------
    async def _serve_follower(
        self, model: ModelShape, mem_args: MemoryArgs, sock: socket.socket
    ) -> int:
        """Node ranks >= 1 (0.5.23 engine.py): start up with the group, then a dummy /health.

        They stop when node 0 sends ShutdownReq (exit 0) or when their own schedulers have
        all exited (exit 0, the group goes down with them); SIGTERM alone changes nothing.
        """
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._follower_sigterm)
        loop.add_signal_handler(signal.SIGINT, self.shutdown.set)  # an operator's Ctrl-C
        startup = asyncio.create_task(self.startup(model, mem_args))
        stop = asyncio.create_task(self.shutdown.wait())
        await asyncio.wait({startup, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not startup.done():
            startup.cancel()
            return await self._stop_follower()
        startup.result()
        await self._start_dummy_health(sock)
        ranks_gone = asyncio.create_task(self._until_ranks_exit())
        await asyncio.wait({stop, ranks_gone}, return_when=asyncio.FIRST_COMPLETED)
        if ranks_gone.done():
            if self.runner is not None:
                await self.runner.cleanup()
            return self.exit_code
        ranks_gone.cancel()
        return await self._stop_follower()

    def _follower_sigterm(self) -> None:
        logs.ENGINE.warning(
            f"SIGTERM received on node_rank {self.node_rank}; waiting for the rank-0 "
            "ShutdownReq broadcast to stop the schedulers."
        )

    async def _start_dummy_health(self, sock: socket.socket) -> None:
        """`launch_dummy_health_check_server`: 200 on /health, /health_generate and /ping."""
        app = web.Application()
        for path in ("/health", "/health_generate", "/ping"):
            app.router.add_get(path, _ok)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        await web.SockSite(self.runner, sock).start()  # starts listening only now
        host = f"[{self.args.host}]" if ":" in self.args.host else self.args.host
        logs.COMMON_UTILS.info(
            f"Dummy health check server started in background thread at {host}:{self.args.port}"
        )

    async def _until_ranks_exit(self) -> None:
        """`block_until_scheduler_exits`: log each scheduler's exit; a lone death is a crash."""
        loop = asyncio.get_running_loop()
        codes: dict[int, int] = {}
        grace_until: float | None = None
        while True:
            self._collect_exits(codes)
            if len(codes) == len(self.ranks):
                self._log_exits(codes)
                return
            if codes:
                grace_until = grace_until or loop.time() + SIBLING_EXIT_GRACE_S
                if loop.time() >= grace_until:
                    self._log_exits(codes)
                    link = self.member.link if self.member is not None else None
                    host, port = link.local if link is not None else ("127.0.0.1", 0)
                    self.scheduler_exception(*distributed.peer_closed(host, port), running=False)
            await asyncio.sleep(RANK_POLL_S)

    def _collect_exits(self, codes: dict[int, int]) -> None:
        for rank in self.ranks:
            if rank.pid not in codes:
                code = _exit_code(rank.pid)
                if code is not None:
                    codes[rank.pid] = code

    def _log_exits(self, codes: dict[int, int]) -> None:
        for rank in self.ranks:
            if rank.pid in codes:
                logs.ENGINE.error(
                    f"Scheduler or DataParallelController {rank.pid} "
                    f"terminated with {codes[rank.pid]}"
                )

    async def _stop_follower(self) -> int:
        """ShutdownReq: schedulers leave their loops and exit 0 (SIGINT to the ranks here)."""
        self.kill_ranks(signal.SIGINT)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CHILD_TERM_WAIT_S
        codes: dict[int, int] = {}
        while len(codes) < len(self.ranks) and loop.time() < deadline:
            self._collect_exits(codes)
            await asyncio.sleep(RANK_POLL_S)
        self.reap_ranks(0)  # stragglers: SIGKILL
        self._log_exits(codes)
        if self.runner is not None:
            await self.runner.cleanup()
        return self.exit_code

    async def _stop(self) -> int:
        if self.leader is not None:
            await self.leader.shutdown()
        self.kill_ranks(signal.SIGTERM)
        self.reap_ranks(CHILD_TERM_WAIT_S)
        if self.runner is not None:
            await self.runner.cleanup()
        return self.exit_code


def _draft_class(spec: Speculation) -> str:
    """The draft model's class: its architecture, or the target's own MTP head in draft mode
    (configs/model_config.py `_config_draft_model`)."""
    assert spec.draft is not None
    arch = spec.draft.architecture
    if spec.draft_path != spec.draft.path or arch not in speculative.MTP_ARCHITECTURES:
        return arch
    if arch in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"):
        return "DeepseekV3ForCausalLMNextN"
    return f"{arch}NextN"


def _reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


def _exit_code(pid: int) -> int | None:
    """A child's exit code as multiprocessing reports it (-N: killed by signal N); None: alive."""
    try:
        reaped, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return 0
    return os.waitstatus_to_exitcode(status) if reaped else None


async def _ok(request: web.Request) -> web.Response:
    return web.Response(status=200)


def bind(host: str, port: int, listen: bool = True) -> socket.socket:
    """The HTTP port. Unlistened (nodes >= 1 until ready), it refuses connections but is ours."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # SO_REUSEADDR as uvicorn: TIME_WAIT sockets do not block a restart, live listeners do.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _attn_dp_size(args: argparse.Namespace) -> int:
    """The attention-DP size SGLang resolves (the deprecated spelling: dp_size)."""
    attn = getattr(args, "attn_dp_size", 1) or 1
    if getattr(args, "enable_dp_attention", False) and attn == 1:
        return getattr(args, "dp_size", 1) or 1
    return attn


def _entrypoint_warning() -> None:
    print(
        f"{__file__}:1: UserWarning: 'python -m sglang.launch_server' is still supported, but "
        "'sglang serve' is the recommended entrypoint.\n"
        "  Example: sglang serve --model-path <model> [options]\n  warnings.warn(",
        file=sys.stderr,
    )


def _log_version(launcher: Launcher) -> None:
    """The double's own start-up line: which SGLang it stands in for, and any regression it
    simulates for that version (a warning, so that it shows at every --log-level)."""
    line = f"gpusim: sglang {launcher.version} (the installed sglang distribution)"
    if launcher.version_slowdown == 1.0:
        logs.ENGINE.info(line)
    else:
        logs.ENGINE.warning(
            f"{line}; hardware.yaml sglang_version_slowdown for {launcher.version}: decode and "
            f"prefill are simulated {launcher.version_slowdown:g}x slower"
        )


def _server_args_dict(args: argparse.Namespace) -> dict[str, object]:
    """The fields `ServerArgs.resolved_dict()` logs (SGLang's own --config is merged away)."""
    return {key: value for key, value in vars(args).items() if key != "config"}


def _resolved_server_args(args: argparse.Namespace, spec: Speculation | None) -> dict[str, object]:
    """server_args after post-init's defaults, as the real engine logs them."""
    try:
        model: ModelShape | None = load_model(
            args.model_path, getattr(args, "context_length", None)
        )
    except (ModelDirError, KeyError, ValueError):
        model = None  # _prepare reports it right after the line
    mem_args = _memory_args(args)
    if spec is not None and spec.placement.max_running_requests is not None:
        mem_args.max_running_requests = None  # the reset to 48 comes after the defaults
    gpu_mib = state.load_hardware().gpu_memory_mib
    try:
        return resolved_args.resolve(_server_args_dict(args), model, mem_args, gpu_mib)
    except (StartupFailure, ZeroDivisionError, ValueError):
        return _server_args_dict(args)  # flags post-init refuses: _prepare reports them


def _resolve_speculation(args: argparse.Namespace) -> Speculation | int | None:
    """SGLang resolves `--speculative-*` with the other server arguments, before it logs
    server_args= (its warnings come first); the resolved values replace the flags' in args.
    An int is the exit code of a failure already reported."""
    if getattr(args, "speculative_algorithm", None) is None:
        return None
    try:
        model = load_model(args.model_path, getattr(args, "context_length", None))
    except (ModelDirError, KeyError, ValueError):
        return None  # _prepare reports the model directory
    try:
        spec = speculative.resolve(args, model)
    except StartupFailure as exc:
        print_traceback(exc.exc_type, exc.message, "ServerArgs.__post_init__()")
        return 1
    except (ModelDirError, KeyError, ValueError) as exc:
        # The draft's directory: SGLang reads its config while resolving the algorithm.
        print_traceback("OSError", str(exc), "get_config(speculative_draft_model_path)")
        return 1
    assert spec is not None
    for key, value in spec.resolved.items():
        setattr(args, key, value)
    return spec


def _prepare(
    args: argparse.Namespace, spec: Speculation | None = None
) -> tuple[ModelShape, MemoryArgs] | int:
    """Launcher-side checks; an int is the exit code of a failure already reported."""
    hardware = state.load_hardware()
    if not hardware.driver_loaded:
        print_traceback(
            "RuntimeError",
            "Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU "
            "and installed a driver from http://www.nvidia.com/Download/index.aspx",
            "torch.cuda.device_count()",
        )
        return 1
    try:
        model = load_model(args.model_path, getattr(args, "context_length", None))
    except (ModelDirError, KeyError, ValueError) as exc:
        print_traceback("OSError", str(exc), "AutoConfig.from_pretrained(model_path)")
        return 1
    mem_args = _memory_args(args)
    if spec is not None and spec.placement.max_running_requests is not None:
        # The reset to 48 comes after the memory defaults (plan_memory applies it there).
        mem_args.max_running_requests = None
    try:
        check_args(mem_args)
    except StartupFailure as exc:
        print_traceback(exc.exc_type, exc.message, "ServerArgs.__post_init__()")
        return 1
    node_rank = getattr(args, "node_rank", 0)
    if not 0 <= node_rank < mem_args.nnodes:
        # SGLang does not check this itself; its ranks would fail in torch.distributed.
        print_traceback(
            "ValueError",
            f"gpusim: --node-rank {node_rank} is not in 0..{mem_args.nnodes - 1} "
            f"(--nnodes {mem_args.nnodes})",
            "ServerArgs.__post_init__()",
        )
        return 1
    needed = mem_args.tp_size * mem_args.pp_size // max(1, mem_args.nnodes)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    available = len(visible.split(",")) if visible else hardware.gpu_count
    if needed > available:
        print_traceback(
            "RuntimeError", "CUDA error: invalid device ordinal", "torch.cuda.set_device"
        )
        return 1
    return model, mem_args


def _resolve_and_prepare(
    args: argparse.Namespace, launcher: Launcher
) -> tuple[ModelShape, MemoryArgs] | int:
    """Resolve the arguments (speculation's first, as SGLang's warnings precede server_args=),
    log them, then the launcher-side checks; an int is the exit code of a reported failure."""
    speculation = _resolve_speculation(args)
    if isinstance(speculation, int):
        return speculation
    launcher.speculation = speculation
    launcher.resolved_args = _resolved_server_args(args, speculation)
    # As 0.5.23's engine.py, secrets included: a logging config keeps them out of the journal.
    logs.ENGINE.info(f"server_args={launcher.resolved_args}")
    _log_version(launcher)
    return _prepare(args, speculation)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _entrypoint_warning()
    version = installed_sglang_version()
    try:
        args = flags.parse_server_args(argv, version)
    except ValueError as exc:
        print_traceback("ValueError", str(exc), "prepare_server_args(sys.argv[1:])")
        return 1
    try:
        launcher = Launcher(args, argv, version)
    except state.HardwareFileError as exc:
        print_traceback("ValueError", str(exc), "gpusim.state.load_hardware()")
        return 1
    try:
        logs.configure(args.log_level, launcher.rank_prefix)
    except LoggingConfigMissing as exc:
        print_traceback("Exception", str(exc), "configure_logger(server_args)")
        return 1
    prepared = _resolve_and_prepare(args, launcher)
    if isinstance(prepared, int):
        return prepared
    model, mem_args = prepared
    try:
        sock = bind(args.host, args.port, listen=launcher.node_rank == 0)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        logs.UVICORN_ERROR.error(
            f"[Errno 98] error while attempting to bind on address ('{args.host}', {args.port}): "
            "address already in use"
        )
        return 1
    # Node 0's store port is bound before the ranks fork, so they hold it as TP0 would.
    launcher.group = distributed.configure(args, launcher.local_ranks)
    launcher.spawn_ranks()
    return asyncio.run(launcher.serve(model, mem_args, sock))


if __name__ == "__main__":
    sys.exit(main())
