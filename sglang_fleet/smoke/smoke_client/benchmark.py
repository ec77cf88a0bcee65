"""The Benchmark driver: first contact with the server, the warm-up, the requests sent as
the rate and concurrency limit allow, and their records turned into the result JSON."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

from sglang_fleet.smoke.smoke_client import server_json
from sglang_fleet.smoke.smoke_client.failures import PARSE_ERRORS, ServerUnreachable, os_reason
from sglang_fleet.smoke.smoke_client.http_client import Clock, HttpClient, shown_url
from sglang_fleet.smoke.smoke_client.server_metrics import (
    MetricsSampler,
    read_metrics,
    server_summary,
)
from sglang_fleet.smoke.smoke_client.streams import (
    CompletionsStream,
    GenerateStream,
    RequestRecord,
    SseStream,
    Timeline,
)
from sglang_fleet.smoke.smoke_client.summary import summarize
from sglang_fleet.smoke.smoke_client.workload import (
    Config,
    VocabularyUnknown,
    request_bodies,
    token_ids,
    vocab_size_of,
)

T = TypeVar("T")


class Benchmark:
    """Runs the workload against one server and turns the records into the result JSON."""

    def __init__(self, cfg: Config, clock: Clock = time.perf_counter) -> None:
        self.cfg = cfg
        self.clock = clock
        self.client = HttpClient(cfg.url, cfg.api_key, clock, cfg.timeout)
        if cfg.backend == "sglang":
            self.path = "/generate"
            self.stream_class: type[SseStream] = GenerateStream
        else:
            self.path = "/v1/completions"
            self.stream_class = CompletionsStream

    async def run(self) -> dict[str, Any]:
        try:
            return await self._run()
        except (OSError, asyncio.TimeoutError) as err:
            # Request failures are recorded per request; anything else that loses the server
            # ends the run with its name, never a traceback.
            raise ServerUnreachable(
                f"lost the server at {shown_url(self.cfg.url)}: {os_reason(err)}"
            ) from None
        finally:
            self.client.close()

    async def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        left_out: set[str] = set()
        metrics_before = await self._first_contact("/metrics", read_metrics(self.client, left_out))
        model = await self._first_contact("/v1/models", self._model_name())
        ids_from = await self._first_contact("/model_info", self._token_ids())
        if cfg.warmup_requests > 0:
            warmup = request_bodies(cfg, cfg.seed + 2, model, cfg.warmup_requests, ids_from)
            await self._dispatch(warmup, None, math.inf, None, None)
            if metrics_before is not None:
                # The warm-up can take a server down (a bad request, out of memory).
                metrics_before = await self._first_contact(
                    "/metrics after the warm-up", read_metrics(self.client, left_out)
                )

        t0 = self.clock()
        timeline = Timeline(t0)
        sampler = MetricsSampler(self.client, cfg.metrics_interval, self.clock, t0)
        sampler.left_out = left_out
        stop = asyncio.Event()
        sampling = None
        if metrics_before is not None:
            sampling = asyncio.ensure_future(sampler.run(stop))
        deadline = t0 + cfg.duration if cfg.duration is not None else None
        bodies = request_bodies(cfg, cfg.seed, model, cfg.num_prompts, ids_from)
        records = await self._dispatch(
            bodies, cfg.max_concurrency, cfg.request_rate, deadline, timeline
        )
        duration = self.clock() - t0
        server = None
        if sampling is not None and metrics_before is not None:
            stop.set()
            await sampling
            try:
                metrics_after = await read_metrics(self.client, left_out)
            except (OSError, asyncio.TimeoutError):
                metrics_after = None
            server = server_summary(metrics_before, metrics_after, sampler)
        return summarize(cfg, records, duration, timeline, server)

    async def _first_contact(self, path: str, call: Awaitable[T]) -> T:
        """The requests before the benchmark: failing them means the server is not there."""
        try:
            return await call
        except (OSError, asyncio.TimeoutError) as err:
            where = shown_url(self.cfg.url)
            raise ServerUnreachable(
                f"cannot reach the server at {where} (GET {path}): {os_reason(err)}"
            ) from None

    async def _token_ids(self) -> range:
        """Where random prompt ids come from (package docstring); /model_info names the model."""
        if self.cfg.backend != "sglang":
            return range(0)  # the OpenAI backend sends words
        if self.cfg.vocab_size:
            return token_ids(self.cfg.vocab_size)
        status, body = await self.client.get("/model_info")
        info: Any = None
        if status == 200:
            with contextlib.suppress(*PARSE_ERRORS):
                info = server_json.loads(body)
        paths = []
        if isinstance(info, dict):
            paths = [info.get(k) for k in ("tokenizer_path", "model_path")]
        named = [p for p in paths if isinstance(p, str) and p]
        for path in named:
            size = vocab_size_of(path)
            if size:
                return token_ids(size)
        where = shown_url(self.cfg.url)
        source = (
            f"/model_info names {', '.join(sorted(set(named)))}"
            if named
            else (f"/model_info answered {status} without a model path")
        )
        raise VocabularyUnknown(
            f"cannot tell the vocabulary size of the model served at {where}: {source}, and no "
            "config.json or tokenizer.json with it is readable here; pass --vocab-size (token "
            "ids at or above it would take the server down)"
        )

    async def _model_name(self) -> str:
        """The OpenAI backend needs a model name: --model, else the server's first one."""
        if self.cfg.model or self.cfg.backend == "sglang":
            return self.cfg.model or ""
        status, body = await self.client.get("/v1/models")
        if status != 200:
            return "default"
        try:
            models = server_json.loads(body).get("data") or []
            return str(models[0].get("id", "default"))
        except PARSE_ERRORS:
            return "default"  # a list the server cannot describe: its default model answers

    async def _dispatch(
        self,
        bodies: Iterator[tuple[bytes, int]],
        max_concurrency: int | None,
        request_rate: float,
        deadline: float | None,
        timeline: Timeline | None,
    ) -> list[RequestRecord]:
        """Send requests as the rate and concurrency limit allow; wait for all of them."""
        loop = asyncio.get_running_loop()
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        arrivals = random.Random(self.cfg.seed + 1)
        next_arrival = loop.time()
        tasks = []
        for body, expected in bodies:
            if math.isfinite(request_rate):
                # Poisson arrivals, as bench_serving draws them
                next_arrival += arrivals.expovariate(request_rate)
                await asyncio.sleep(max(0.0, next_arrival - loop.time()))
            if limit is not None:
                await limit.acquire()
            if deadline is not None and self.clock() >= deadline:
                if limit is not None:
                    limit.release()
                break
            tasks.append(loop.create_task(self._one(body, expected, limit, timeline)))
        return list(await asyncio.gather(*tasks))

    async def _one(
        self,
        body: bytes,
        expected: int,
        limit: asyncio.Semaphore | None,
        timeline: Timeline | None,
    ) -> RequestRecord:
        record = RequestRecord()
        stream = self.stream_class(record, timeline, expected)
        clock = self.clock

        def stamp_start() -> None:
            record.start = clock()

        try:
            request = self.client.request_bytes("POST", self.path, body)
            await self.client.send(request, stream, stamp_start)
            record.error = stream.error
            record.reason = stream.reason
        finally:
            if limit is not None:
                limit.release()
        return record
