"""The smoke client's bookkeeping follows what it asked for, never what a server claims, and its
result is finite whatever the server's counters say (issue 33; docs/ARCHITECTURE.md, "HTTP
clients"). Each test is an example of the issue: a 4-token request answered with a count of
millions (memory, then a MemoryError), counters that sum past the float maximum (NaN in the
result), a prompt count no float can divide, a model file that is a FIFO."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from test_smoke_client import (
    DONE,
    LAST_CHUNK,
    METRICS_TEMPLATE,
    SSE_CHUNKED,
    Step,
    chunk,
    gen_event,
    generate_script,
    oai_event,
    run_against,
    scripted,
    sse,
)

from sglang_fleet.smoke.smoke_client import streams
from sglang_fleet.smoke.smoke_client.failures import LONG_OUTPUT
from sglang_fleet.smoke.smoke_client.server_metrics import MetricsSampler, server_summary
from sglang_fleet.smoke.smoke_client.streams import (
    CompletionsStream,
    GenerateStream,
    RequestRecord,
    Timeline,
)
from sglang_fleet.smoke.smoke_client.summary import format_summary
from sglang_fleet.smoke.smoke_client.workload import vocab_size_of


def _feed(stream_class: type, expected: int, events: list[bytes]) -> tuple[Any, int]:
    """A stream of the client fed the given SSE bytes one read each, then ended: the stream and
    the peak memory its parsing took (bytes)."""

    async def main() -> Any:
        record = RequestRecord()
        stream = stream_class(record, Timeline(0.0), expected)
        stream.on_head(200, 0.0)
        for index, data in enumerate(events):
            stream.on_body(data, 0.1 * (index + 1))
        stream.on_end(1.0)
        return stream

    tracemalloc.start()
    try:
        stream = asyncio.run(main())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return stream, peak


@pytest.mark.parametrize("claimed", [5_000_000, 10**11])
def test_a_4_token_request_answered_with_millions_fails_without_the_memory(claimed: int) -> None:
    claim = sse(
        {"text": "tok tok", "meta_info": {"prompt_tokens": 7, "completion_tokens": claimed}}
    )
    stream, peak = _feed(GenerateStream, 4, [gen_event(1), claim, DONE])
    assert stream.reason == LONG_OUTPUT, stream.error
    assert f"counts {claimed} completion tokens, 4 asked for" in str(stream.error)
    assert len(stream.record.itl) <= 4 + streams._TOKEN_ALLOWANCE
    assert peak < 4 * 1024 * 1024, peak


def test_completion_chunks_beyond_the_request_fail_at_once() -> None:
    stream, _ = _feed(CompletionsStream, 4, [oai_event("x") * 1000, DONE])
    assert stream.reason == LONG_OUTPUT, stream.error
    assert len(stream.record.itl) <= 4 + streams._TOKEN_ALLOWANCE


def test_a_prompt_count_no_float_can_hold_is_a_wrong_answer_not_a_traceback() -> None:
    result, _ = run_against(
        scripted(generate_script([0.1, 0.2], prompt_tokens=10**400)),
        num_prompts=1,
        random_output_len=2,
    )
    assert result["failed"] == 1 and result["failure_reasons"] == {"malformed_response": 1}
    assert "prompt_tokens" in result["errors"][0]
    json.dumps(result, allow_nan=False)


def test_counters_that_sum_past_the_float_maximum_are_left_out_by_name() -> None:
    metrics = METRICS_TEMPLATE.format(
        running=0, queued=0, usage=0.0, generated=1.7e308, prompted=1.0
    ) + (
        'sglang:generation_tokens_total{model_name="m",tp_rank="1"} 1.7e308\n'
        'sglang:huge_total{tp_rank="0"} 1.7e308\nsglang:huge_total{tp_rank="1"} 1.7e308\n'
    )
    result, _ = run_against(
        scripted(generate_script([0.1, 0.2])), metrics, num_prompts=1, random_output_len=2
    )
    json.dumps(result, allow_nan=False)  # no NaN, no Infinity
    server = result["server_metrics"]
    assert server["generation_tokens_delta"] is None
    assert "sglang:generation_tokens_total" in server["left_out"]
    assert "sglang:huge_total" in server["left_out"]
    assert "Left out" in format_summary(result)


def test_a_difference_of_two_finite_sums_past_the_maximum_is_left_out() -> None:
    sampler = MetricsSampler(None, 1.0, lambda: 0.0, 0.0)  # type: ignore[arg-type]
    name = "sglang:generation_tokens_total"
    summary = server_summary({name: -1.7e308}, {name: 1.7e308}, sampler)
    assert summary["generation_tokens_delta"] is None and summary["left_out"] == [name]
    assert all(not isinstance(v, float) or math.isfinite(v) for v in summary.values())


def test_a_model_file_that_is_a_fifo_does_not_hold_the_run(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "config.json")
    found: list[Any] = []
    worker = threading.Thread(target=lambda: found.append(vocab_size_of(str(tmp_path))))
    worker.daemon = True
    worker.start()
    worker.join(10)
    if not found:  # the old client waits for a writer: give it one so the thread ends
        with open(tmp_path / "config.json", "wb"):
            pass
    assert found == [None]


def test_a_count_of_many_digits_is_a_malformed_answer() -> None:
    body = b'data: {"text": "x", "meta_info": {"completion_tokens": ' + b"9" * 5000 + b"}}\n\n"
    script = [Step(SSE_CHUNKED), Step(chunk(body) + chunk(DONE) + LAST_CHUNK, 0.1)]
    result, _ = run_against(scripted(script), num_prompts=1, random_output_len=2)
    assert result["failure_reasons"] == {"malformed_response": 1}, result["errors"]
