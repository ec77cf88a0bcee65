"""SGLang's HTTP API on aiohttp: native endpoints, OpenAI-compatible ones, metrics.

Shapes follow sglang 0.5.23 `srt/entrypoints/http_server.py` and its OpenAI serving
classes; only the fields clients read are filled with meaning, the rest carry SGLang's
defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpusim.engine import Request, Scheduler
from gpusim.faults import STALL, Fault, FaultFileError, FaultSwitch
from gpusim.memory import MemoryPlan
from gpusim.sglang_metrics import SchedulerExtras, http_middleware
from gpusim.state import state_dir
from gpusim.tokenizer import WordTokenizer

HEALTH_POLL_S = 0.05
STALL_POLL_S = 0.2
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's completions default, as SGLang's protocol
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class ServerState:
    """What the HTTP layer shares with the launcher."""

    server_args: dict[str, Any]
    # The SGLang version served in /server_info: the installed distribution's (gpusim.version).
    version: str
    served_model_name: str
    model_info: dict[str, Any]
    tokenizer: WordTokenizer
    scheduler: Scheduler | None = None
    plan: MemoryPlan | None = None
    starting: bool = True
    gracefully_exit: bool = False
    startup_time: float = field(default_factory=time.time)
    metrics: Metrics | None = None
    faults: FaultSwitch = field(default_factory=lambda: FaultSwitch(state_dir()))
    # The model's embedding size, and how the launcher dies of a scheduler exception
    # (exception type, message): SGLang does not check input_ids, and an id outside the
    # embedding kills its scheduler and with it the whole server.
    vocab_size: int = 0
    fatal: Callable[[str, str], None] | None = None


class Metrics:
    """The sglang: Prometheus series a deployment watches (names/labels of SGLang); the rest of
    what SGLang 0.5.23 serves is in gpusim/sglang_metrics.py."""

    def __init__(
        self,
        model_name: str,
        page_size: int = 1,
        *,
        attn_dp: int = 1,
        all_schedulers: bool = False,
        tp_size: int = 1,
    ) -> None:
        self.registry = CollectorRegistry()
        sched = {
            "model_name": model_name,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        # Attention DP (0.5.23 scheduler.py / metrics_collector.py): every attention-DP rank's
        # first scheduler reports, labelled with its dp_rank; with
        # --enable-metrics-for-all-schedulers every TP rank does (the ranks of one
        # attention-TP group repeat their group's figures).
        self.attn_dp, self.all_schedulers, self.tp_size = attn_dp, all_schedulers, tp_size
        if attn_dp > 1:
            sched["dp_rank"] = "0"
        tok = {"model_name": model_name, "engine_type": "unified"}
        self.sched_labels, self.tok_labels = sched, tok
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(sched), registry=r)

        def counter(name: str, doc: str) -> Counter:
            # Counted per finished request, split by streaming (as SGLang's tokenizer manager).
            return Counter(name, doc, [*tok, "is_streaming"], registry=r)

        self.running = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.queue = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.used = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.usage = gauge("sglang:token_usage", "The token usage.")
        self.gen = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.hit = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.max_tokens = gauge("sglang:max_total_num_tokens", "Maximum total number of tokens.")
        # The client counts "_total" itself: prometheus_client appends it to counter names.
        self.prompt = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation = counter("sglang:generation_tokens", "Number of generation tokens.")
        self.requests = counter("sglang:num_requests", "Number of requests processed.")
        self.aborted = Counter(
            "sglang:num_aborted_requests", "Number of requests aborted.", list(tok), registry=r
        )
        buckets = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            [*tok, "is_streaming"],
            registry=r,
            buckets=buckets,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            list(tok),
            registry=r,
            buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.0),
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            [*tok, "is_streaming"],
            registry=r,
            buckets=(*buckets, 600, 1200, 1800, 2400),
        )
        self.queue_time = Histogram(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            list(sched),
            registry=r,
            buckets=buckets,
        )
        self._synced: dict[str, int] = {}
        for streaming in ("false", "true"):
            for metric in (self.prompt, self.generation, self.requests):
                metric.labels(**tok, is_streaming=streaming)
        self.extras = SchedulerExtras(r, sched, tok)
        self.page_size = page_size
        self._startup_published = False

    def _sync_counter(self, metric: Counter, key: str, value: int) -> None:
        delta = value - self._synced.get(key, 0)
        if delta > 0:
            metric.labels(**self.tok_labels).inc(delta)
            self._synced[key] = value

    def middleware(self) -> Any:
        return http_middleware(self.extras)

    def refresh_ranks(self, ranks: list[Scheduler], leaders: list[int]) -> None:
        """One series per reporting scheduler of an attention-DP server; counters total."""
        attn_tp = self.tp_size // len(ranks)
        for dp_rank, (rank, leader) in enumerate(zip(ranks, leaders, strict=True)):
            members = range(leader, leader + attn_tp) if self.all_schedulers else [leader]
            for tp_rank in members:
                labels = self.sched_labels | {"tp_rank": str(tp_rank), "dp_rank": str(dp_rank)}
                self._gauges(rank, labels)

    def refresh(self, scheduler: Scheduler) -> None:
        s, labels = scheduler.stats, self.sched_labels
        ranks = getattr(scheduler, "ranks", None)  # attention DP: one scheduler per rank
        if ranks:
            self.refresh_ranks(ranks, scheduler.leaders)
        else:
            self._gauges(scheduler, labels)
        self._sync_counter(self.aborted, "aborted", s.num_aborted_requests_total)
        if not self._startup_published:
            self.extras.set_startup(scheduler.plan, scheduler, self.page_size)
            self._startup_published = True
        self.extras.refresh(scheduler)

    def _gauges(self, scheduler: Scheduler, labels: dict[str, str]) -> None:
        s = scheduler.stats
        self.running.labels(**labels).set(len(scheduler.running))
        self.queue.labels(**labels).set(len(scheduler.waiting))
        self.used.labels(**labels).set(scheduler.reserved)
        self.usage.labels(**labels).set(round(scheduler.token_usage, 2))
        self.gen.labels(**labels).set(s.gen_throughput)
        hit = s.cached_tokens_total / s.prompt_tokens_total if s.prompt_tokens_total else 0.0
        self.hit.labels(**labels).set(hit)
        self.max_tokens.labels(**labels).set(scheduler.max_total)

    def observe_finished(self, req: Request) -> None:
        streaming = str(req.stream).lower()
        self.prompt.labels(**self.tok_labels, is_streaming=streaming).inc(req.prompt_tokens)
        self.generation.labels(**self.tok_labels, is_streaming=streaming).inc(req.generated)
        self.requests.labels(**self.tok_labels, is_streaming=streaming).inc()
        self.extras.observe_finished(req)
        if req.first_token_at is None or req.finished_at is None:
            return
        self.ttft.labels(**self.tok_labels, is_streaming=streaming).observe(
            req.first_token_at - req.created
        )
        self.e2e.labels(**self.tok_labels, is_streaming=streaming).observe(
            req.finished_at - req.created
        )
        if req.admitted is not None:
            self.queue_time.labels(**self.sched_labels).observe(req.admitted - req.created)
        if req.generated > 1:
            gap = (req.finished_at - req.first_token_at) / (req.generated - 1)
            self.itl.labels(**self.tok_labels).observe(gap)


# -- helpers ------------------------------------------------------------------------------


def _state(request: web.Request) -> ServerState:
    return request.app["state"]


def _error(status: int, message: str) -> web.Response:
    body = {
        "object": "error",
        "message": message,
        "type": "BadRequestError",
        "param": None,
        "code": status,
    }
    return web.json_response(body, status=status)


def _generate_error(message: str) -> web.Response:
    """The shape SGLang's /generate gives a request it refuses: {"error": {"message": ...}}."""
    return web.json_response({"error": {"message": message}}, status=400)


class _NotJson(web.HTTPBadRequest):
    """A body that is no JSON: SGLang (FastAPI) answers a 400 in its OpenAI error layout."""

    def __init__(self, message: str) -> None:
        body = {"object": "error", "message": message, "type": "Bad Request", "param": None}
        super().__init__(text=json.dumps({**body, "code": 400}), content_type="application/json")


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _NotJson(f"1 validation error: JSON decode error: {exc}") from exc
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="Request body must be a JSON object")
    return body


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _scheduler(state: ServerState) -> Scheduler:
    if state.scheduler is None:
        raise web.HTTPServiceUnavailable(text="The server is starting")
    return state.scheduler


# -- faults a test switches on (gpusim/faults.py) -------------------------------------------


@contextlib.contextmanager
def _generation(state: ServerState) -> Iterator[Fault | None]:
    """Counts a generation request while it runs; yields the fault in force for it."""
    try:
        fault = state.faults.current(state.server_args)
    except FaultFileError as exc:
        raise web.HTTPInternalServerError(text=f"gpusim: {exc}") from exc
    switch = state.faults
    switch.received += 1
    switch.in_flight += 1
    try:
        reason = fault.crash_reason(switch.received, switch.in_flight) if fault else None
        if reason is not None:
            _crash(state, reason)
        yield fault
    finally:
        switch.in_flight -= 1


def _check_ids(state: ServerState, ids: list[int]) -> None:
    """An id outside the vocabulary: the real scheduler's embedding lookup raises IndexError and
    the whole server goes down (SGLang 0.5.23 does not validate input_ids)."""
    if not ids or not state.vocab_size or state.fatal is None:
        return
    if min(ids) >= 0 and max(ids) < state.vocab_size:
        return
    state.fatal("IndexError", "index out of range in self")
    os.kill(os.getpid(), signal.SIGKILL)


def _crash(state: ServerState, reason: str) -> None:
    """Die as a scheduler that runs out of memory under load does: the whole tree, SIGKILL."""
    message = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. "
        f"(gpusim fault crash, {state.faults.path}: {reason})"
    )
    scheduler = state.scheduler
    if scheduler is not None and scheduler.on_crash is not None:
        scheduler.crashed = True
        scheduler.on_crash(message)  # the launcher's: logs SGLang's lines, kills its tree
    os.kill(os.getpid(), signal.SIGKILL)


async def _stall(request: web.Request, state: ServerState) -> web.StreamResponse:
    """200 and the event-stream headers, then nothing until the client gives up."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    transport = request.transport
    while not state.gracefully_exit and transport is not None and not transport.is_closing():
        await asyncio.sleep(STALL_POLL_S)
    return response


def _max_new(fault: Fault | None, asked: int) -> int:
    return fault.max_new_tokens(asked) if fault is not None else asked


# The sampling settings the double's text depends on (max_tokens not: a longer answer begins
# with the shorter one, as a greedy server's does).
SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "sampling_seed", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "stop", "n",
)  # fmt: skip


def output_seed(prompt: Any, sampling: dict[str, Any]) -> int:
    """The seed of a request's text: a function of its prompt as sent (text, token ids or chat
    messages: the double's word tokenizer reads every unknown word as one id, so the ids alone
    would tell few prompts apart) and its sampling settings only. The same prompt asked the same
    way gets the same text, on any replica, in any run: the job scenario checks every row's
    output against it (docs/JOB.md)."""
    settings = sorted((k, repr(sampling[k])) for k in SAMPLING_KEYS if k in sampling)
    digest = hashlib.blake2b(repr((prompt, settings)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0xFFFF


class TextStream:
    """Spells out a request's generated tokens as words, incrementally."""

    def __init__(self, tokenizer: WordTokenizer, seed: int) -> None:
        self.tokenizer, self.seed = tokenizer, seed
        self.ids: list[int] = []
        self.ids_csv = ""  # the ids as JSON array content, kept for the fast streaming path
        self.text = ""

    def advance(self, generated: int) -> str:
        """Extend to `generated` tokens; return the new text (the delta)."""
        start = len(self.text)
        vocab = self.tokenizer.vocab
        while len(self.ids) < generated:
            token = self.tokenizer.output_token(len(self.ids), self.seed)
            sep = "," if self.ids else ""
            self.ids.append(token)
            self.ids_csv += f"{sep}{token}"
            self.text += (" " if self.text else "") + vocab[token]
        return self.text[start:]


async def _follow(req: Request) -> AsyncIterator[int]:
    """Yield the generated-token count each time the scheduler makes progress."""
    seen = 0
    while True:
        await req.progress.wait()
        req.progress.clear()
        if req.generated > seen or req.finished:
            seen = req.generated
            yield seen
        if req.finished:
            return


def _new_request(
    prompt_ids: list[int] | None,
    prompt_tokens: int,
    max_new: int,
    *,
    stream: bool,
    rid: str | None = None,
) -> Request:
    return Request(
        rid=rid or uuid.uuid4().hex,
        prompt_tokens=max(1, prompt_tokens),
        max_new_tokens=max(0, int(max_new)),
        input_ids=prompt_ids,
        stream=stream,
    )


def _finish(state: ServerState, req: Request) -> None:
    if state.metrics is not None:
        state.metrics.observe_finished(req)


def _prompt_of(state: ServerState, value: Any) -> tuple[list[int], int]:
    """Token ids and count of a text prompt or a list of token ids."""
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value), len(value)
    if isinstance(value, list) and len(value) == 1:
        return _prompt_of(state, value[0])
    if isinstance(value, str):
        ids = state.tokenizer.encode(value)
        return ids, len(ids)
    raise web.HTTPBadRequest(text="gpusim serves one prompt per request (text or input_ids)")


# -- native endpoints ---------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    """Like SGLang: 503 while starting or draining, else a one-token generation must run."""
    state = _state(request)
    if state.gracefully_exit or state.starting or state.scheduler is None:
        return web.Response(status=503)
    scheduler = state.scheduler
    tic = time.perf_counter()
    req = _new_request([0], 1, 1, stream=False, rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
    scheduler.submit(req)
    timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
    try:
        while time.perf_counter() < tic + timeout:
            # Any output from the scheduler since tic proves it is alive, as in SGLang.
            if req.finished or scheduler.last_progress > tic:
                return web.Response(status=200)
            await asyncio.sleep(HEALTH_POLL_S)
    finally:
        scheduler.abort(req)
    return web.Response(status=503)


async def server_info(request: web.Request) -> web.Response:
    state = _state(request)
    scheduler, plan = _scheduler(state), state.plan
    assert plan is not None
    memory_usage = {
        "weight": round(plan.weight_gib, 3),
        "kvcache": round(plan.kv_gib, 3),
        "startup_available": round(plan.post_gib - plan.kv_gib - plan.graph_total_mib / 1024, 3),
        "token_capacity": plan.max_total_num_tokens,
        "token_capacity_swa": None,
        "graph": {
            "prefill": round(plan.graph_mib["prefill"] / 1024, 3),
            "decode": 0.0,
            "target_verify": 0.0,
            "draft_prefill": 0.0,
            "draft_decode": 0.0,
            "draft_extend": 0.0,
        },
    }
    # With speculation the target's decode graph is its verify graph (cuda_graph_setup.py).
    memory_usage["graph"][plan.decode_graph_phase] = round(plan.graph_mib["decode"] / 1024, 3)
    internal = {
        "memory_usage": memory_usage,
        "world_size": state.server_args.get("tp_size", 1) * state.server_args.get("pp_size", 1),
        "startup_time": state.startup_time,
        "effective_max_running_requests_per_dp": plan.max_running_requests,
        "last_gen_throughput": scheduler.stats.gen_throughput,
    }
    body = {
        **state.server_args,
        "mem_fraction_static": plan.mem_fraction_static,
        "chunked_prefill_size": plan.chunked_prefill_size,
        "max_running_requests": plan.max_running_requests,
        "max_total_num_tokens": plan.max_total_num_tokens,
        "max_req_input_len": min(plan.context_len - 1, plan.max_total_num_tokens - 1),
        "startup_time": state.startup_time,
        "internal_states": [internal],
        "version": state.version,
        "frontend": "python",
    }
    return web.json_response(body)


async def model_info(request: web.Request) -> web.Response:
    state = _state(request)
    _scheduler(state)  # 503 while starting, like every endpoint but /health*
    return web.json_response(state.model_info)


async def list_models(request: web.Request) -> web.Response:
    state = _state(request)
    _scheduler(state)
    card = {
        "id": state.served_model_name,
        "object": "model",
        "created": int(state.startup_time),
        "owned_by": "sglang",
        "root": state.served_model_name,
        "parent": None,
        "max_model_len": state.model_info["context_len"],
    }
    return web.json_response({"object": "list", "data": [card]})


async def flush_cache(request: web.Request) -> web.Response:
    if _scheduler(_state(request)).flush_cache():
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n"
        )
    return web.Response(status=400, text="Cache not flushed: requests are running or queued.\n")


def _generate_chunk(req: Request, text: TextStream, prompt_tokens: int) -> dict[str, Any]:
    meta = {
        "id": req.rid,
        "finish_reason": req.finish_reason if req.finished else None,
        "prompt_tokens": prompt_tokens,
        "weight_version": "default",
        "completion_tokens": req.generated,
        "cached_tokens": req.cached_tokens,
        "e2e_latency": time.perf_counter() - req.created,
    }
    return {"text": text.text, "output_ids": list(text.ids), "meta_info": meta}


def _generate_event(req: Request, text: TextStream, prompt_tokens: int, rid_json: str) -> bytes:
    """One /generate SSE event. Unfinished chunks are the hot path of a benchmark: with
    escape-free words they are formatted directly, byte-identical to json.dumps output."""
    if req.finished or not text.tokenizer.json_safe:
        return _sse(_generate_chunk(req, text, prompt_tokens))
    return (
        f'data: {{"text":"{text.text}","output_ids":[{text.ids_csv}],"meta_info":{{'
        f'"id":{rid_json},"finish_reason":null,"prompt_tokens":{prompt_tokens},'
        f'"weight_version":"default","completion_tokens":{req.generated},'
        f'"cached_tokens":{req.cached_tokens},'
        f'"e2e_latency":{time.perf_counter() - req.created!r}}}}}\n\n'
    ).encode()


async def generate(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    _scheduler(state)
    with _generation(state) as fault:
        if fault is not None and fault.mode == STALL:
            return await _stall(request, state)
        return await _generate(request, state, fault)


async def _generate(
    request: web.Request, state: ServerState, fault: Fault | None
) -> web.StreamResponse:
    scheduler = _scheduler(state)
    body = await _json_body(request)
    source = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
    if source is None:
        return _error(400, "Either text or input_ids should be provided.")
    ids, count = _prompt_of(state, source)
    _check_ids(state, ids)
    params = body.get("sampling_params") or {}
    max_new = params.get("max_new_tokens")
    if max_new is not None and int(max_new) < 0:
        return _generate_error(f"max_new_tokens must be at least 0, got {int(max_new)}.")
    context = int(state.model_info.get("context_len") or 0)
    if context and count > context:
        # SGLang's tokenizer manager refuses it before scheduling (0.5.23 wording).
        return _generate_error(
            f"The input ({count} tokens) is longer than the model's context length "
            f"({context} tokens)."
        )
    stream = bool(body.get("stream", False))
    req = _new_request(
        ids,
        count,
        _max_new(fault, DEFAULT_MAX_NEW_TOKENS if max_new is None else int(max_new)),
        stream=stream,
        rid=body.get("rid"),
    )
    text = TextStream(state.tokenizer, output_seed(source, params))
    scheduler.submit(req)
    if not stream:
        return await _collect(state, request, req, lambda: _generate_chunk(req, text, count), text)
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    rid_json = json.dumps(req.rid)
    try:
        async for generated in _follow(req):
            text.advance(generated)
            await response.write(_generate_event(req, text, count, rid_json))
        await response.write(_sse("[DONE]"))
    except (ConnectionResetError, asyncio.CancelledError):
        scheduler.abort(req)
        raise
    _finish(state, req)
    return response


async def _collect(
    state: ServerState,
    request: web.Request,
    req: Request,
    render: Callable[[], dict[str, Any]],
    text: TextStream,
) -> web.Response:
    try:
        async for generated in _follow(req):
            text.advance(generated)
    except asyncio.CancelledError:
        _scheduler(state).abort(req)
        raise
    _finish(state, req)
    if req.aborted and req.error:
        return _error(400, req.error)
    return web.json_response(render())


# -- OpenAI-compatible endpoints ----------------------------------------------------------


def _usage(req: Request) -> dict[str, Any]:
    return {
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": req.generated,
        "total_tokens": req.prompt_tokens + req.generated,
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens}
        if req.cached_tokens
        else None,
        "reasoning_tokens": 0,
    }


def _openai_max_tokens(body: dict[str, Any], default: int) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    return default if value is None else int(value)


async def completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    body = await _json_body(request)
    if "prompt" not in body:
        return _error(400, "prompt is required")
    ids, count = _prompt_of(state, body["prompt"])
    max_new = _openai_max_tokens(body, DEFAULT_COMPLETION_MAX_TOKENS)
    return await _openai(request, state, body, (ids, count), max_new, chat=False)


def _chat_prompt(state: ServerState, messages: list[dict[str, Any]]) -> tuple[list[int], int]:
    """The fixture chat template: 'role : content' per message, then 'assistant :'."""
    parts = []
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{message.get('role', 'user')} : {content}")
    ids = state.tokenizer.encode("\n".join([*parts, "assistant :"]))
    return ids, len(ids)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    body = await _json_body(request)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return _error(400, "messages must be a non-empty list")
    ids, count = _chat_prompt(state, messages)
    max_new = _openai_max_tokens(body, DEFAULT_MAX_NEW_TOKENS)
    return await _openai(request, state, body, (ids, count), max_new, chat=True)


def _choice(chat: bool, delta: str | None, req: Request, stream: bool) -> dict[str, Any]:
    finish = "length" if req.finished and not req.aborted else ("abort" if req.aborted else None)
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": None,
        "finish_reason": finish,
        "matched_stop": None,
    }
    if not chat:
        choice["text"] = delta or ""
    elif stream:
        choice["delta"] = {"role": "assistant", "content": delta}
    else:
        choice["message"] = {
            "role": "assistant",
            "content": delta,
            "reasoning_content": None,
            "tool_calls": None,
        }
    return choice


async def _openai(
    request: web.Request,
    state: ServerState,
    body: dict[str, Any],
    prompt: tuple[list[int], int],
    max_new: int,
    *,
    chat: bool,
) -> web.StreamResponse:
    _scheduler(state)
    with _generation(state) as fault:
        if fault is not None and fault.mode == STALL:
            return await _stall(request, state)
        return await _openai_answer(
            request, state, body, prompt, _max_new(fault, max_new), chat=chat
        )


async def _openai_answer(
    request: web.Request,
    state: ServerState,
    body: dict[str, Any],
    prompt: tuple[list[int], int],
    max_new: int,
    *,
    chat: bool,
) -> web.StreamResponse:
    ids, count = prompt
    scheduler = _scheduler(state)
    stream = bool(body.get("stream", False))
    req = _new_request(ids, count, max_new, stream=stream)
    text = TextStream(state.tokenizer, output_seed(body.get("messages", body.get("prompt")), body))
    prefix = "chatcmpl-" if chat else "cmpl-"
    base = {
        "id": prefix + req.rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.get("model") or state.served_model_name,
    }
    scheduler.submit(req)
    if not stream:
        obj = "chat.completion" if chat else "text_completion"

        def render() -> dict[str, Any]:
            choice = _choice(chat, text.text, req, stream=False)
            return {**base, "object": obj, "choices": [choice], "usage": _usage(req)}

        return await _collect(state, request, req, render, text)
    options = body.get("stream_options") or {}
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        if chat:
            first = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            await response.write(_sse({**base, "choices": [first]}))
        async for generated in _follow(req):
            delta = text.advance(generated)
            if delta or req.finished:
                choice = _choice(chat, delta, req, stream=True)
                await response.write(_sse({**base, "choices": [choice]}))
        if options.get("include_usage"):
            await response.write(_sse({**base, "choices": [], "usage": _usage(req)}))
        await response.write(_sse("[DONE]"))
    except (ConnectionResetError, asyncio.CancelledError):
        scheduler.abort(req)
        raise
    _finish(state, req)
    return response


# -- metrics, auth, app -------------------------------------------------------------------


async def metrics(request: web.Request) -> web.Response:
    state = _state(request)
    if state.metrics is None:
        raise web.HTTPNotFound()
    if state.scheduler is not None:
        state.metrics.refresh(state.scheduler)
    body = generate_latest(state.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _auth_middleware(api_key: str) -> Callable[[web.Request, Handler], Awaitable[Any]]:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        # SGLang exempts health checks and Prometheus scrapes from the API key.
        if request.path.startswith(("/health", "/metrics")):
            return await handler(request)
        if request.headers.get("Authorization", "") != f"Bearer {api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


@web.middleware
async def _json_not_found(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An unknown path: FastAPI's JSON 404, as SGLang answers it."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)


def build_app(state: ServerState, api_key: str | None) -> web.Application:
    middlewares = [_json_not_found]
    if api_key:
        middlewares.append(_auth_middleware(api_key))
    if state.metrics is not None:
        # Outermost, so that refused (401) and unknown (404) requests are counted too.
        middlewares.insert(0, state.metrics.middleware())
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app["state"] = state
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/v1/models", list_models)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_route("POST", "/flush_cache", flush_cache)
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/metrics", metrics)
    return app
