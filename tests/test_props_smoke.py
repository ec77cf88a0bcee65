"""Property-based tests of the smoke client (Hypothesis; profiles in tests/conftest.py): its
stream parsers fed generated server bytes in generated reads, its /metrics parser, its JSON
reader and its command line. Invariants (issue 33): a right answer or a failure with a reason,
never an exception; the stream's bookkeeping bounded by what the request asked for; every number
in a result finite; the API key in no message."""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import math
import os
from typing import Any
from unittest import mock

from hypothesis import given
from hypothesis import strategies as st

from sglang_fleet.smoke.smoke_client import server_json, streams
from sglang_fleet.smoke.smoke_client.command_line import build_parser, config_from_args
from sglang_fleet.smoke.smoke_client.failures import (
    LONG_OUTPUT,
    MALFORMED,
    NO_FINAL_RECORD,
    PARSE_ERRORS,
    SERVER_ERROR,
    SHORT_OUTPUT,
)
from sglang_fleet.smoke.smoke_client.prometheus_text import parse_prometheus
from sglang_fleet.smoke.smoke_client.server_metrics import MetricsSampler, server_summary
from sglang_fleet.smoke.smoke_client.streams import (
    CompletionsStream,
    GenerateStream,
    RequestRecord,
    Timeline,
)
from sglang_fleet.smoke.smoke_client.workload import Config

REASONS = {SHORT_OUTPUT, LONG_OUTPUT, NO_FINAL_RECORD, MALFORMED, SERVER_ERROR}
counts = st.one_of(
    st.integers(-5, 80),
    st.sampled_from([10**6, 10**11, 2**63, 10**400]),
)
meta = st.fixed_dictionaries(
    {"completion_tokens": counts},
    optional={"prompt_tokens": counts, "id": st.text(max_size=4)},
)
_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3),
                                                                         inner, max_size=3)),
    max_leaves=10,
)  # fmt: skip
events = st.one_of(
    meta.map(lambda m: {"text": "t", "meta_info": m}),
    st.fixed_dictionaries({"error": st.text(max_size=8)}, optional={"meta_info": meta}),
    st.fixed_dictionaries(
        {"choices": st.lists(st.fixed_dictionaries({"text": st.text(max_size=3)}), max_size=2)},
        optional={"usage": meta},
    ),
    _json_values,
)


def _sse(item: Any) -> bytes:
    if isinstance(item, bytes):
        return item
    return b"data: " + json.dumps(item).encode() + b"\n\n"


stream_items = st.lists(
    st.one_of(
        events,
        st.binary(max_size=12),
        st.sampled_from(
            [b"data: [DONE]\n\n", b": ping\n\n", b"data: " + b"[" * 5000 + b"\n\n",
             b"data: {\"meta_info\": {\"completion_tokens\": " + b"9" * 40 + b"}}\n\n"]
        ),
    ),
    max_size=8,
)  # fmt: skip


def _reads(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


@given(
    items=stream_items,
    cuts=st.lists(st.integers(0, 10**6), max_size=6),
    expected=st.integers(1, 64),
    completions=st.booleans(),
    newline=st.sampled_from([b"\n", b"\r\n", b"\r"]),
)
def test_any_stream_is_a_right_answer_or_a_failure_with_a_reason(
    items: list[Any], cuts: list[int], expected: int, completions: bool, newline: bytes
) -> None:
    data = b"".join(_sse(item) for item in items).replace(b"\n", newline)
    kind = CompletionsStream if completions else GenerateStream

    async def main() -> Any:
        record = RequestRecord()
        stream = kind(record, Timeline(0.0), expected)
        stream.on_head(200, 0.0)
        for index, piece in enumerate(_reads(data, cuts)):
            try:
                stream.on_body(piece, 0.01 * (index + 1))
            except PARSE_ERRORS as err:  # what _Connection catches and reports
                stream.on_error(f"malformed response: {err}", MALFORMED)
        stream.on_end(1.0)
        return stream

    stream = asyncio.run(main())
    record = stream.record
    assert len(record.itl) <= expected + streams._TOKEN_ALLOWANCE
    assert sum(stream.timeline.counts) <= 2 * (expected + streams._TOKEN_ALLOWANCE)
    if stream.error is None:
        assert record.output_tokens == expected
        assert 0 <= record.prompt_tokens <= streams._MAX_PROMPT_TOKENS
    else:
        assert stream.reason in REASONS, (stream.reason, stream.error)


samples = st.lists(
    st.tuples(
        st.sampled_from(["sglang:generation_tokens_total", "sglang:num_running_reqs", "x"]),
        st.sampled_from(['{tp_rank="0"}', '{tp_rank="1"}', "", '{a="}"}']),
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True).map(repr),
            st.sampled_from(["1.7e308", "-1.7e308", "+Inf", "NaN", "1e400", "abc", "0x10"]),
        ),
    ),
    max_size=8,
)


@given(before=samples, after=samples)
def test_metrics_sums_and_differences_are_finite_or_left_out_by_name(
    before: list[tuple[str, str, str]], after: list[tuple[str, str, str]]
) -> None:
    def text(lines: list[tuple[str, str, str]]) -> str:
        return "".join(f"{name}{labels} {value}\n" for name, labels, value in lines)

    left_out: set[str] = set()
    first = parse_prometheus(text(before), left_out)
    second = parse_prometheus(text(after), left_out)
    assert all(math.isfinite(v) for v in [*first.values(), *second.values()])
    sampler = MetricsSampler(None, 1.0, lambda: 0.0, 0.0)  # type: ignore[arg-type]
    sampler.left_out = left_out
    summary = server_summary(first, second, sampler)
    json.dumps(summary, allow_nan=False)
    assert set(summary["left_out"]) >= left_out


@given(
    text=st.one_of(
        st.text(max_size=40),
        st.integers(0, 3000).map(lambda n: "[" * n + "]" * n),
        st.integers(0, 3000).map(lambda n: '{"a":' * n + "1" + "}" * n),
        _json_values.map(json.dumps),
    )
)
def test_the_clients_json_reader_answers_or_refuses(text: str) -> None:
    with contextlib.suppress(ValueError):
        server_json.loads(text)


flags = st.sampled_from(
    ["--url", "--num-prompts", "--duration", "--max-concurrency", "--request-rate",
     "--random-input-len", "--random-output-len", "--seed", "--warmup-requests", "--api-key",
     "--timeout", "--vocab-size", "--backend", "--metrics-interval", "--slo-ttft-ms", "--json"]
)  # fmt: skip
values = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["0", "-1", "inf", "nan", "1e400", "9" * 40, "http://h:0", "http://u:p@h:1",
                     "http://[::1", "/nonexistent/out.json"]),
)  # fmt: skip
KEY = "sk-prop-secret-key"


@given(argv=st.lists(st.tuples(flags, values), max_size=5), key_in_env=st.booleans())
def test_the_command_line_gives_a_config_or_exit_2_and_never_shows_the_key(
    argv: list[tuple[str, str]], key_in_env: bool
) -> None:
    words = [word for pair in argv for word in pair]
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_API_KEY"}
    if key_in_env:
        env["SGLANG_API_KEY"] = KEY + "\n"  # a key no header can carry
    out, err = io.StringIO(), io.StringIO()
    parser = build_parser()
    with (
        mock.patch.dict(os.environ, env, clear=True),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            cfg = config_from_args(parser.parse_args(words), parser)
        except SystemExit as done:
            assert done.code == 2
        else:
            assert isinstance(cfg, Config)
    assert KEY not in out.getvalue() + err.getvalue()
