"""The server's /metrics around and during the run: read, sampled for peaks and a
timeline, and summed up as the result's ``server_metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any

from sglang_fleet.smoke.smoke_client.http_client import Clock, HttpClient
from sglang_fleet.smoke.smoke_client.prometheus_text import parse_prometheus, parse_series

# /metrics names (SGLang's collector); values are summed over label sets (tp/dp ranks).
_M_RUNNING = "sglang:num_running_reqs"
_M_QUEUE = "sglang:num_queue_reqs"
_M_TOKEN_USAGE = "sglang:token_usage"
_M_GEN_THROUGHPUT = "sglang:gen_throughput"
_M_GEN_TOKENS = "sglang:generation_tokens_total"
_M_PROMPT_TOKENS = "sglang:prompt_tokens_total"
_M_MAX_TOTAL_TOKENS = "sglang:max_total_num_tokens"
# Speculative decoding's accepted tokens per verify and accepted share of the drafts (0 without).
_M_SPEC_ACCEPT_LENGTH = "sglang:spec_accept_length"
_M_SPEC_ACCEPT_RATE = "sglang:spec_accept_rate"
_SPEC_GAUGES = (_M_SPEC_ACCEPT_LENGTH, _M_SPEC_ACCEPT_RATE)


async def read_metrics(
    client: HttpClient, left_out: set[str] | None = None
) -> dict[str, float] | None:
    """The server's metrics, or None when /metrics is not served (no --enable-metrics)."""
    status, body = await client.get("/metrics")
    if status != 200:
        return None
    text = body.decode("utf-8", "replace")
    values = parse_prometheus(text, left_out)
    # A gauge of a rate or a length is not summed over the schedulers that report it: their mean.
    spec = [(n, v) for n, _labels, v in parse_series(text) if n in _SPEC_GAUGES]
    for name in _SPEC_GAUGES:
        found = [v for n, v in spec if n == name]
        if found:
            values[name] = sum(found) / len(found)
    return values


class MetricsSampler:
    """Samples /metrics gauges during the run for peaks and a timeline."""

    def __init__(self, client: HttpClient, interval: float, clock: Clock, t0: float) -> None:
        self.client = client
        self.interval = interval
        self.clock = clock
        self.t0 = t0
        self.samples: list[dict[str, float]] = []
        self.max_total_num_tokens: float | None = None
        self.left_out: set[str] = set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)

    async def sample(self) -> None:
        try:
            values = await read_metrics(self.client, self.left_out)
        except (OSError, asyncio.TimeoutError):
            return  # a missed sample is not worth failing the run for
        if values is None:
            return
        if _M_MAX_TOTAL_TOKENS in values:
            self.max_total_num_tokens = values[_M_MAX_TOTAL_TOKENS]
        row = {
            "t": round(self.clock() - self.t0, 3),
            "num_running_reqs": values.get(_M_RUNNING, 0.0),
            "num_queue_reqs": values.get(_M_QUEUE, 0.0),
            "token_usage": values.get(_M_TOKEN_USAGE, 0.0),
            "gen_throughput": values.get(_M_GEN_THROUGHPUT, 0.0),
        }
        if values.get(_M_SPEC_ACCEPT_LENGTH):
            row["spec_accept_length"] = values[_M_SPEC_ACCEPT_LENGTH]
            row["spec_accept_rate"] = values.get(_M_SPEC_ACCEPT_RATE, 0.0)
        self.samples.append(row)


def server_summary(
    before: dict[str, float], after: dict[str, float] | None, sampler: MetricsSampler
) -> dict[str, Any]:
    after = after or before
    samples = sampler.samples

    left_out = set(sampler.left_out)

    def delta(name: str) -> float | None:
        if name not in before or name not in after:
            return None
        difference = after[name] - before[name]
        if not math.isfinite(difference):  # two finite sums far apart
            left_out.add(name)
            return None
        return difference

    def peak(key: str) -> float | None:
        return max((s[key] for s in samples), default=None)

    max_tokens = sampler.max_total_num_tokens
    if max_tokens is None:
        max_tokens = after.get(_M_MAX_TOTAL_TOKENS)
    return {
        "generation_tokens_delta": delta(_M_GEN_TOKENS),
        "prompt_tokens_delta": delta(_M_PROMPT_TOKENS),
        "peak_num_running_reqs": peak("num_running_reqs"),
        "peak_num_queue_reqs": peak("num_queue_reqs"),
        "peak_token_usage": peak("token_usage"),
        "max_total_num_tokens": max_tokens,
        "samples": samples,
        "left_out": sorted(left_out),
    }
