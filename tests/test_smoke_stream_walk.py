"""The smoke client's one-walk readers judge exactly as the general ones do: a read of
/generate events taken at a glance (streams._token_counts) against the same read event by
event, and a read of whole HTTP chunks (http_client._Connection._whole_chunks) against the
general chunked decoder. Properties over SGLang-shaped events whose text holds quotes,
escaped quotes, backslashes and error keys where a byte search could be fooled."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any
from unittest import mock

from conftest import stream_fed_in_reads
from hypothesis import example, given
from hypothesis import strategies as st

from sglang_fleet.smoke.smoke_client import http_client, streams
from sglang_fleet.smoke.smoke_client.http_client import Exchange

# Text pieces that put quotes, backslashes and the error key where they can mislead a scan.
_TEXT_PIECES = ["w", " ", '"', "\\", '"error"', "error", '\\"error', ":", ",", "}", "\u00e9"]
_MEMBER_AFTER = [None, ("error", "boom"), ("error", ""), ("error", None), ("x", '"error"')]


@st.composite
def _event(draw: Any, count: int) -> bytes:
    """One /generate event: SGLang's own (text, output_ids, meta_info), or bent."""
    text = "".join(draw(st.lists(st.sampled_from(_TEXT_PIECES), max_size=6)))
    meta: dict[str, Any] = {"id": "r", "prompt_tokens": 3, "completion_tokens": count}
    if draw(st.booleans()):
        meta[draw(st.sampled_from(["error", "note"]))] = draw(st.sampled_from(["x", 0, None]))
    chunk: dict[str, Any] = {"text": text, "output_ids": list(range(count % 4)), "meta_info": meta}
    shape = draw(st.sampled_from(["sglang", "sglang", "no-text", "member-after", "error-first"]))
    if shape == "no-text":
        del chunk["text"]
    elif shape == "member-after":
        member = draw(st.sampled_from(_MEMBER_AFTER))
        if member is not None:
            chunk[member[0]] = member[1]
    elif shape == "error-first":
        chunk = {"error": {"message": "boom"}, **chunk}
    spaced = draw(st.booleans())
    body = json.dumps(chunk, separators=(", ", ": ") if spaced else (",", ":"))
    return b"data: " + body.encode() + b"\n\n"


@st.composite
def _stream(draw: Any, expected: int) -> bytes:
    # up to past the allowance: a long output fails at the event that first exceeds it
    top = expected + streams._TOKEN_ALLOWANCE + 3
    counts = draw(st.lists(st.integers(0, draw(st.sampled_from([expected + 2, top]))),
                           min_size=1, max_size=6))  # fmt: skip
    events = [draw(_event(count)) for count in sorted(counts)]
    if draw(st.booleans()):  # a count that goes back
        events.insert(draw(st.integers(0, len(events))), draw(_event(0)))
    meta = {"prompt_tokens": 3, "completion_tokens": expected}
    final = {"text": "w", "output_ids": [], "meta_info": meta}
    events.append(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
    return b"".join(events)


def _judged(data: bytes, cuts: list[int], expected: int, *, walk: bool) -> tuple[Any, ...]:
    """The stream's verdict and bookkeeping, reads cut at ``cuts``; ``walk=False`` reads every
    read event by event (the one-walk reader refuses every read)."""
    if walk:
        stream = stream_fed_in_reads(data, cuts, expected)
    else:
        with mock.patch.object(streams, "_token_counts", lambda block: None):
            stream = stream_fed_in_reads(data, cuts, expected)
    record = stream.record
    counts = (record.output_tokens, record.prompt_tokens, stream.tokens)
    timings = (record.itl, stream.timeline.counts, record.ttft, stream.end_t)
    return stream.error, stream.reason, counts, timings


@given(data=st.data(), cuts=st.lists(st.integers(0, 10**6), max_size=4),
       expected=st.integers(1, 8))  # fmt: skip
def test_a_read_walked_once_is_judged_as_event_by_event(
    data: st.DataObject, cuts: list[int], expected: int
) -> None:
    """Same verdict, message, counts, gaps and timeline, whatever the text holds and however
    the bytes are cut into reads."""
    stream = data.draw(_stream(expected))
    walked = _judged(stream, cuts, expected, walk=True)
    assert walked == _judged(stream, cuts, expected, walk=False)


def test_a_long_output_is_named_at_the_event_that_first_passes_the_allowance() -> None:
    """Three counts in one read, two past what was asked plus the allowance: the message
    names the first of them, as when the events come one by one."""
    limit = 1 + streams._TOKEN_ALLOWANCE

    def event(count: int) -> bytes:
        chunk = {"text": "a", "output_ids": [1], "meta_info": {"completion_tokens": count}}
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    stream = event(3) + event(limit + 1) + event(limit + 2)
    error, reason, _, _ = _judged(stream, [], 1, walk=True)
    assert reason == "long_output" and f"counts {limit + 1} completion" in str(error)
    assert _judged(stream, [], 1, walk=True) == _judged(stream, [], 1, walk=False)


def test_the_walk_takes_sglangs_own_events_and_leaves_the_rest() -> None:
    def event(count: int, text: str = "a b", **extra: Any) -> bytes:
        chunk = {"text": text, "output_ids": [1, 2], "meta_info": {"completion_tokens": count}}
        body = json.dumps({**chunk, **extra}, separators=(",", ":"))
        return b"data: " + body.encode() + b"\n\n"

    assert streams._token_counts(event(3) + event(5) + event(5)) == (3, 5, False)
    assert streams._token_counts(event(3) + b"data: [DONE]\n\n") == (3, 3, True)
    assert streams._token_counts(event(3, text='say "hi"')) == (3, 3, False)
    for refused in (
        event(5) + event(3),  # goes back
        event(3, error="boom"),  # an error key beside the count
        event(3, text='\\"error'),  # the key's bytes end at the text's closing quote
        event(3) + b": ping\n\n",  # a comment
        b"data: [DONE]\n\n",  # no count at all
        event(3).replace(b'":3', b'":  3'),  # a count written another way
        event(3)[:-1] + b"data: x\n\n",  # two lines in one event
    ):
        assert streams._token_counts(refused) is None, refused


# --------------------------------------------------------------------------- HTTP chunks


class _Body(Exchange):
    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[bytes] = []
        self.ended = False

    def on_body(self, data: bytes, t: float) -> None:
        self.pieces.append(data)

    def on_end(self, t: float) -> None:
        self.ended = True
        super().on_end(t)


_size_lines = st.sampled_from(["{:x}", "{:X}", "{:x};ext=1", "0{:x}", " {:x}", "-{:x}", "zz"])


@st.composite
def _chunked(draw: Any) -> tuple[bytes, list[int]]:
    bodies = draw(st.lists(st.binary(min_size=1, max_size=20), max_size=4))
    out = []
    for body in bodies:
        size = draw(_size_lines).format(len(body))
        tail = draw(st.sampled_from([b"\r\n", b"\r\n", b"\n", b"xx"]))
        out.append(size.encode() + b"\r\n" + body + tail)
    out.append(b"0\r\n\r\n")
    data = b"".join(out)
    # reads: one per chunk as a streaming server writes them, several whole chunks a read (a
    # client that fell behind), or cut anywhere
    ends = [len(c) for c in itertools.accumulate(out)]
    every = draw(st.integers(1, 3))
    cuts = draw(st.one_of(st.just(ends), st.just(ends[every - 1 :: every]),
                          st.lists(st.integers(0, len(data)), max_size=4)))  # fmt: skip
    return data, cuts


def _decoded(data: bytes, cuts: list[int], *, whole_chunks: bool) -> tuple[Any, ...]:
    async def run() -> tuple[Any, ...]:
        conn = http_client._Connection(lambda: 0.0)
        exchange = _Body()
        conn.exchange = exchange
        conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
        for a, b in itertools.pairwise(points):
            if b > a and conn.exchange is not None:
                conn.data_received(data[a:b])
        return b"".join(exchange.pieces), exchange.error, exchange.ended

    if whole_chunks:
        return asyncio.run(run())
    with mock.patch.object(http_client._Connection, "_whole_chunks", lambda *_: False):
        return asyncio.run(run())


@given(case=_chunked())
@example(case=(b"3\r\nabcxx0\r\n\r\n", [8]))  # a chunk not followed by CRLF
@example(case=(b"3;x=1\r\nabc\r\n0\r\n\r\n", [10]))  # an extension
@example(case=(b"-3\r\nabc\r\n0\r\n\r\n", [9]))  # a negative size
@example(case=(b"zz\r\nabc\r\n0\r\n\r\n", [9]))  # not hexadecimal
@example(case=(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n", [15]))  # two chunks in one read
@example(case=(b"3\r\nabc\r\n0\r\n\r\n", [4, 6]))  # a chunk over two reads
@example(case=(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n", []))  # the whole answer in one read
@example(case=(b"3\r\nabc\r\n2\r\nde\r\n0\r\nx: 1\r\n\r\n", []))  # and a trailer
@example(case=(b"3\r\nabc\r\n\r\nde\r\n0\r\n\r\n", []))  # an empty size line
@example(case=(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\nHTTP", []))  # bytes after the end
def test_a_read_of_whole_chunks_decodes_as_the_general_decoder_does(
    case: tuple[bytes, list[int]],
) -> None:
    """Same body bytes, same error message, same end, for good and bad size lines and
    chunk endings, read one chunk at a time, several whole chunks at a time or cut anywhere."""
    data, cuts = case
    assert _decoded(data, cuts, whole_chunks=True) == _decoded(data, cuts, whole_chunks=False)
