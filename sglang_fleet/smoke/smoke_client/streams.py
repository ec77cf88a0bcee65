"""One streamed request: its record (timings, the server's token counts), the output
timeline, and the SSE streams of /generate and /v1/completions that turn an answer's bytes
into a record and judge it: the right answer, or a failure with a reason."""

from __future__ import annotations

import json
import re
from typing import Any

from sglang_fleet.smoke.smoke_client import server_json
from sglang_fleet.smoke.smoke_client.failures import (
    LONG_OUTPUT,
    MALFORMED,
    NO_FINAL_RECORD,
    SERVER_ERROR,
    SHORT_OUTPUT,
)
from sglang_fleet.smoke.smoke_client.http_client import Exchange

# Bounds on what a server can make this client hold in a stream: one SSE event (a long
# /generate answer repeats its cumulative text in every event: megabytes, not gigabytes),
# an error body (only its start is shown).
_MAX_EVENT_BYTES = 64 * 1024 * 1024
_MAX_ERROR_BODY_BYTES = 4096
# A stream's bookkeeping (one gap per token) follows what the request asked for, never what the
# server claims: a count beyond the tokens asked plus this allowance fails the request at once
# as a long output. A count has at most this many digits, and a prompt at most this many tokens
# (SGLang's own context limit is a 32-bit count).
_TOKEN_ALLOWANCE = 16
_MAX_COUNT_DIGITS = 12
_MAX_PROMPT_TOKENS = 1 << 31
_ERROR_TEXT_LIMIT = 300

# Found with rfind: a quote inside generated text is escaped (\"), so the key cannot match there.
_COMPLETION_TOKENS_KEY = b'"completion_tokens"'
_ERROR_KEY = b'"error"'
# A count as SGLang writes it, matched where rfind found its key (anchored: a bounded run of
# digits, no backtracking). A count written any other way does not match, and the read goes
# event by event (_number_after).
_COUNT_AT = re.compile(rb'"completion_tokens": ?([0-9]{1,12})[,}]')
_EVENT_START = b"data: {"
_DONE_EVENT = b"data: [DONE]\n\n"


_TEXT_START = b'data: {"text":"'
_IDS_START = b'","output_ids":['


def _token_counts(block: bytes) -> tuple[int, int, bool] | None:
    """The completion_tokens of the first and the last event of a read of whole events, and
    whether [DONE] ends the read; None unless every event is a plain token chunk: one
    ``data: {`` line without an error key, its count written as SGLang writes it, never lower
    than the one before. Anything else is left to the event-by-event reader.

    The read is walked once, with memchr (the fastest scan there is) over nearly all of its
    bytes: an event repeats the text and token ids so far, so bytes, not events, are the
    cost. Each event's end is its only newline (JSON text holds no raw one). In SGLang's own
    event, ``data: {"text":"...","output_ids":[...],"meta_info":{...}}``, the error key, like
    any key, begins at a quote: the text's closing quote is the first one when the text holds
    none, the ids hold none, so only the short rest from the next quote on is searched for it,
    and for the count (meta_info is the last member). Any other event is searched whole."""
    find, rfind, startswith = block.find, block.rfind, block.startswith
    pos, size, first, last = 0, len(block), -1, 0
    while pos < size:
        end = find(b"\n", pos)
        rest = pos  # where the error key may still begin
        if startswith(_TEXT_START, pos):
            quote = find(b'"', pos + len(_TEXT_START), end)
            if quote > 0 and startswith(_IDS_START, quote, end):
                rest = find(b'"', quote + len(_IDS_START), end)
        elif not startswith(_EVENT_START, pos):
            if first >= 0 and pos + len(_DONE_EVENT) == size and startswith(_DONE_EVENT, pos):
                return first, last, True
            return None
        if rest < 0 or not startswith(b"\n\n", end) or find(_ERROR_KEY, rest, end) >= 0:
            return None
        key = rfind(_COMPLETION_TOKENS_KEY, rest, end)
        count = _COUNT_AT.match(block, key, end) if key >= 0 else None
        if count is None:
            return None
        value = int(count[1])
        if value < last:
            return None  # a count that goes back: judged event by event
        if first < 0:
            first = value
        last = value
        pos = end + 2
    return (first, last, False) if first >= 0 else None


def _number_after(payload: bytes, key: int) -> int:
    """The integer after the JSON key at index ``key``: ``"name": 12`` or ``"name":12``."""
    start = payload.find(b":", key + 2) + 1
    end = payload.find(b",", start)
    brace = payload.find(b"}", start)
    if end < 0 or 0 <= brace < end:
        end = brace
    digits = payload[start:end].strip()
    if len(digits) > _MAX_COUNT_DIGITS:
        raise ValueError(f"a token count of {len(digits)} characters")
    return int(digits)


class RequestRecord:
    """Timings and server-side token counts of one request (seconds, clock units)."""

    __slots__ = (
        "error",
        "itl",
        "latency",
        "output_tokens",
        "prompt_tokens",
        "reason",
        "start",
        "ttft",
    )

    def __init__(self) -> None:
        self.start = 0.0
        self.ttft = 0.0
        self.latency = 0.0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.itl: list[float] = []
        self.error: str | None = None
        self.reason: str | None = None  # a failure_reasons key when error is set


class Timeline:
    """Output tokens per whole second since the benchmark started (for the picture)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.counts: list[int] = []

    def add(self, t: float, tokens: int) -> None:
        second = int(t - self.t0)
        if second < 0:
            return
        counts = self.counts
        if second >= len(counts):
            counts.extend([0] * (second + 1 - len(counts)))
        counts[second] += tokens


class _NoFinalRecord(Exception):
    """A stream that ended without the server's final count (its message says what is missing)."""


def _count_in(record: dict[str, Any], key: str) -> int | None:
    value = record.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class SseStream(Exchange):
    """Turns a 200 event stream into a RequestRecord; other statuses are collected as text.

    ``expected`` is the completion-token count the request asked for (with ``ignore_eos``):
    an answer with another count is a failure, whatever the stream looked like.
    """

    def __init__(self, record: RequestRecord, timeline: Timeline | None, expected: int) -> None:
        super().__init__()
        self.record = record
        self.timeline = timeline
        self.expected = expected
        self.partial = bytearray()
        self.held_cr = False
        self.tokens = 0
        self.last_t = 0.0
        self.end_t: float | None = None

    def on_body(self, data: bytes, t: float) -> None:
        """Cut complete events (a blank line ends one) off the bytes that arrived so far.

        Linear in the bytes received, however large an event is: only the new bytes are
        searched for its end, and no byte is copied more than a fixed number of times.
        """
        if self.status != 200:
            room = _MAX_ERROR_BODY_BYTES - len(self.body)
            if room > 0:
                self.body += data[:room]
            return
        if self.held_cr or data.find(b"\r") >= 0:  # find: the fastest scan for one byte
            data = self._lf_only(data)
        partial = self.partial
        if partial:
            start = len(partial) - 1  # a blank line may begin with the last byte kept
            partial += data
            cut = partial.rfind(b"\n\n", start) + 2
            if cut < 2:
                if len(partial) > _MAX_EVENT_BYTES:
                    self.on_error(f"an SSE event larger than {_MAX_EVENT_BYTES} bytes", MALFORMED)
                return
            block = bytes(partial[:cut])
            del partial[:cut]
        else:
            cut = data.rfind(b"\n\n") + 2
            if cut < 2:
                partial += data
                return
            if cut < len(data):
                block = data[:cut]
                partial += data[cut:]
            else:  # the usual read: whole events only
                block = data
        if self.error is None:
            self.on_events(block, t)

    def _lf_only(self, data: bytes) -> bytes:
        """SSE lines may end in CRLF, LF or a bare CR, and one CRLF can straddle two reads."""
        if self.held_cr:
            data = b"\r" + data
            self.held_cr = False
        if data[-1:] == b"\r":
            data, self.held_cr = data[:-1], True
        return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def on_events(self, block: bytes, t: float) -> None:
        """Complete events that arrived together at ``t``, one at a time."""
        for line in block.split(b"\n"):
            if line[:5] != b"data:":
                continue  # blank separators, comments (keep-alive pings), event: lines
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.end_t = t
            elif self.error is None:
                self.on_event(payload, t)

    def on_event(self, payload: bytes, t: float) -> None:
        raise NotImplementedError

    def add_tokens(self, new: int, t: float) -> None:
        """Record ``new`` tokens that arrived at ``t`` (TTFT, then ITL like bench_serving).
        More than the request asked for (plus _TOKEN_ALLOWANCE) fails it as a long output
        before anything is recorded: the bookkeeping never follows the server's claim."""
        if self.error is not None:
            return
        if self.tokens + new > self.expected + _TOKEN_ALLOWANCE:
            self.on_error(
                f"long output: the server counts {self.tokens + new} completion tokens, "
                f"{self.expected} asked for",
                LONG_OUTPUT,
            )
            return
        record = self.record
        if self.tokens == 0:
            record.ttft = t - record.start
        elif new == 1:
            record.itl.append(t - self.last_t)
        else:  # a chunk with several tokens: spread its gap over them, as bench_serving does
            record.itl.extend([(t - self.last_t) / new] * new)
        self.last_t = t
        self.tokens += new
        timeline = self.timeline
        if timeline is not None:
            timeline.add(t, new)

    def fail_if_error(self, payload: bytes) -> bool:
        """SGLang reports errors inside the stream as ``data: {"error": ...}``."""
        if payload.find(_ERROR_KEY) < 0:
            return False
        try:
            obj = server_json.loads(payload)
        except ValueError:
            return False
        if isinstance(obj, dict) and obj.get("error"):
            self.fail_with_server_error(obj["error"])
            return True
        return False

    def fail_with_server_error(self, error: Any) -> None:
        self.on_error(f"server error in stream: {json.dumps(error)[:200]}", SERVER_ERROR)

    def on_end(self, t: float) -> None:
        if self.error is None and self.status == 200:
            self.record.latency = (self.end_t if self.end_t is not None else t) - self.record.start
            self.judge()
        elif self.error is None:
            text = bytes(self.body[:_ERROR_TEXT_LIMIT]).decode("utf-8", "replace")
            self.on_error(f"HTTP {self.status}: {text.strip()}", f"http_{self.status}")
        super().on_end(t)

    def judge(self) -> None:
        """Right answer or failure: the final record must count exactly what was asked for."""
        try:
            count = self.final_counts()
        except _NoFinalRecord as missing:
            self.on_error(str(missing), NO_FINAL_RECORD)
            return
        prompt = self.record.prompt_tokens
        if not 0 <= prompt <= _MAX_PROMPT_TOKENS:
            self.on_error(f"prompt_tokens {prompt} is not a token count", MALFORMED)
        elif count < self.expected:
            self.on_error(
                f"short output: {count} of the {self.expected} completion tokens asked for",
                SHORT_OUTPUT,
            )
        elif count > self.expected:
            self.on_error(
                f"long output: {count} completion tokens, {self.expected} asked for", LONG_OUTPUT
            )

    def final_counts(self) -> int:
        """Fill the record's token counts from the final record; return completion tokens."""
        raise NotImplementedError


class GenerateStream(SseStream):
    """SGLang native /generate: cumulative text, server counts in meta_info."""

    def __init__(self, record: RequestRecord, timeline: Timeline | None, expected: int) -> None:
        super().__init__(record, timeline, expected)
        self.last_payload = b""

    def on_events(self, block: bytes, t: float) -> None:
        """Events that arrived in one read share one time, so with nothing but token chunks
        in the read (the usual case) only its first and last counts matter: the first gives
        the gap since the previous read, the later ones add zero gaps, exactly as handling them
        one by one would. They are counted where they lie (no copy of their text). Anything
        else (errors, comments, counts that stay or go back, a count past what was asked plus
        the allowance, whose message names the event that first passed it) goes one by one."""
        found = _token_counts(block)
        if (
            found is None
            or found[0] <= self.tokens
            or found[1] > self.expected + _TOKEN_ALLOWANCE  # the long output's own message
        ):
            super().on_events(block, t)  # one by one: each event is judged on its own
            return
        first, last, done = found
        self._add_read(first, last, t)
        self.last_payload = block  # final_counts reads the line around the last count
        if done:
            self.end_t = t

    def _add_read(self, first: int, last: int, t: float) -> None:
        """add_tokens for the first count of a read, then for the rest, in one call: what
        the two calls record (the rest's gaps are zero: they came with the first), once per
        read instead of twice. on_events has checked what add_tokens checks."""
        record = self.record
        new = first - self.tokens
        if self.tokens == 0:
            record.ttft = t - record.start
        elif new == 1:
            record.itl.append(t - self.last_t)
        else:
            record.itl.extend([(t - self.last_t) / new] * new)
        if last > first:
            record.itl.extend([0.0] * (last - first))
        self.last_t = t
        new = last - self.tokens
        self.tokens = last
        if self.timeline is not None:
            self.timeline.add(t, new)

    def on_event(self, payload: bytes, t: float) -> None:
        key = payload.rfind(_COMPLETION_TOKENS_KEY)
        if self.fail_if_error(payload):
            return  # an error fails the request, whatever count rides beside it
        if key < 0:
            if payload[:1] != b"{":
                self.on_error(f"stream chunk is not JSON: {payload[:100]!r}", MALFORMED)
            else:
                self.on_error("stream chunk without meta_info.completion_tokens", NO_FINAL_RECORD)
            return
        self.last_payload = payload
        new = _number_after(payload, key) - self.tokens
        if new > 0:
            self.add_tokens(new, t)
        elif new < 0:
            self.on_error(
                f"completion_tokens went backwards: {self.tokens + new} after {self.tokens}",
                MALFORMED,
            )

    def final_counts(self) -> int:
        if not self.last_payload:
            raise _NoFinalRecord("stream ended without a meta_info record (no token count)")
        # the line of the last count: one payload, or a block of events that came together
        last = self.last_payload
        key = last.rfind(_COMPLETION_TOKENS_KEY)
        end = last.find(b"\n", key)
        line = last[last.rfind(b"\n", 0, key) + 1 : end if end >= 0 else len(last)]
        try:
            final = server_json.loads(line[5:] if line.startswith(b"data:") else line)
        except ValueError:
            raise _NoFinalRecord("the last meta_info record is not JSON") from None
        meta = final.get("meta_info") if isinstance(final, dict) else None
        count = _count_in(meta, "completion_tokens") if isinstance(meta, dict) else None
        if count is None:
            raise _NoFinalRecord("the last record has no meta_info.completion_tokens count")
        assert isinstance(meta, dict)
        self.record.prompt_tokens = _count_in(meta, "prompt_tokens") or 0
        self.record.output_tokens = count
        return count


class CompletionsStream(SseStream):
    """OpenAI-compatible /v1/completions: text deltas, then a usage-only chunk."""

    def __init__(self, record: RequestRecord, timeline: Timeline | None, expected: int) -> None:
        super().__init__(record, timeline, expected)
        self.usage: dict[str, Any] | None = None

    def on_event(self, payload: bytes, t: float) -> None:
        try:
            obj = server_json.loads(payload)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            self.on_error(f"malformed stream chunk: {payload[:100]!r}", MALFORMED)
            return
        if obj.get("error"):
            self.fail_with_server_error(obj["error"])
            return
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        choices = obj.get("choices")
        if choices and isinstance(choices[0], dict) and choices[0].get("text"):
            self.add_tokens(1, t)  # a delta chunk; the exact count comes from usage

    def final_counts(self) -> int:
        usage = self.usage
        if usage is None:
            raise _NoFinalRecord("stream ended without a usage record (include_usage)")
        count = _count_in(usage, "completion_tokens")
        if count is None:
            raise _NoFinalRecord("the usage record has no completion_tokens count")
        record = self.record
        record.prompt_tokens = _count_in(usage, "prompt_tokens") or 0
        record.output_tokens = count
        # Chunks can carry several tokens: put the ones the server counted beyond the chunks at
        # the last arrival so the timeline adds up to the server's count.
        extra = count - self.tokens
        if 0 < extra <= self.expected and self.timeline is not None:
            self.timeline.add(self.last_t, extra)
        return count
