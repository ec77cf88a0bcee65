"""One call of a server for a row, and what its answer means (docs/JOB.md, "Retries").

A call is a POST of JSON through the project's bounded HTTP client
(sglang_fleet/smoke/smoke_client/http_client.py: keep-alive, a size bound on every answer).
Its outcome falls in one class, and the class decides what happens next:
- ok: the answer is the JSON the endpoint promises, with the text it generated;
- row: the row's own fault (a 4xx other than 408 and 429: a prompt over the model's context,
  a body the server refuses): the row goes to the error file at once, never retried;
- rate_limited (429), server (5xx, or a 200 that is not the promised JSON), timeout and
  connection (refused, reset, closed before the answer): retried with backoff, on whichever
  server is free, within the row's budget of attempts; the last two count against the server
  (servers.py takes out one that keeps failing them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sglang_fleet.module_utils.bounded_json import loads as bounded_loads
from sglang_fleet.smoke.smoke_client.failures import CONNECT_FAILED, TIMEOUT
from sglang_fleet.smoke.smoke_client.http_client import Exchange, HttpClient

OK, ROW, RATE_LIMITED, SERVER, TIMEOUT_CLASS, CONNECTION = (
    "ok",
    "row",
    "rate_limited",
    "server",
    "timeout",
    "connection",
)
RETRIED = (RATE_LIMITED, SERVER, TIMEOUT_CLASS, CONNECTION)
# Classes that say the server (not the row, not the load) is in trouble.
SERVER_FAULTS = (TIMEOUT_CLASS, CONNECTION)
MESSAGE_CHARS = 300


@dataclass
class Outcome:
    """What a call came to: its class, the parsed answer (ok) and what to say otherwise."""

    kind: str
    status: int = 0
    answer: dict[str, Any] | None = None
    message: str = ""
    reason: str | None = None  # the HTTP client's reason for a failed exchange

    def spends_budget(self) -> bool:
        """Whether this attempt counts against the row's budget: not when the server was not
        there to ask (no connection at all) or asked to be asked later (429), since those say
        nothing of the row; a row that kills its server each time runs out of attempts."""
        return self.kind != RATE_LIMITED and self.reason != CONNECT_FAILED


def classify(status: int, body: bytes, error: str | None, reason: str | None) -> Outcome:
    """The class of one exchange (see the module docstring)."""
    if error is not None:
        if reason == TIMEOUT:
            return Outcome(TIMEOUT_CLASS, message="no answer within the request's time limit")
        return Outcome(CONNECTION, status, message=error[:MESSAGE_CHARS], reason=reason)
    if status != 200:
        return Outcome(_status_class(status), status, message=f"HTTP {status}: {_said(body)}")
    try:
        answer = bounded_loads(bytes(body), "the answer")
    except ValueError as exc:
        return Outcome(SERVER, status, message=str(exc)[:MESSAGE_CHARS])
    if not isinstance(answer, dict):
        return Outcome(SERVER, status, message="the answer is not a JSON object")
    return Outcome(OK, status, answer=answer)


def _status_class(status: int) -> str:
    if status == 429:
        return RATE_LIMITED
    if 400 <= status < 500 and status != 408:
        return ROW
    return SERVER  # 5xx, 408, and anything a JSON endpoint does not answer


def _said(body: bytes) -> str:
    """A server's error message (SGLang: {"object": "error", "message": ...}), shortened."""
    try:
        parsed = json.loads(bytes(body[:65536]))
    except ValueError:
        return bytes(body[:MESSAGE_CHARS]).decode("utf-8", errors="replace")
    if isinstance(parsed, dict):
        detail = parsed.get("message") or parsed.get("error") or parsed.get("detail")
        if isinstance(detail, dict):
            detail = detail.get("message")
        if detail:
            return str(detail)[:MESSAGE_CHARS]
    return json.dumps(parsed)[:MESSAGE_CHARS]


def generated_text(answer: dict[str, Any], chat: bool) -> str | None:
    """The text an answer of /v1/chat/completions (chat) or /v1/completions generated; None
    when it holds none, which a server that works never answers."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    if chat:
        message = choices[0].get("message")
        content = message.get("content") if isinstance(message, dict) else None
    else:
        content = choices[0].get("text")
    return content if isinstance(content, str) else None


def completion_tokens(answer: dict[str, Any]) -> int:
    return usage(answer)[1]


def usage(answer: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, completion tokens) the answer's usage counts; 0 for a count it lacks
    (what `python -m sglang_fleet.job shape` samples: the job's real lengths)."""
    counts = answer.get("usage")
    return _count(counts, "prompt_tokens"), _count(counts, "completion_tokens")


def _count(counts: Any, name: str) -> int:
    tokens = counts.get(name) if isinstance(counts, dict) else None
    ok = isinstance(tokens, int) and not isinstance(tokens, bool) and 0 <= tokens < 1 << 31
    return tokens if ok else 0


async def post(client: HttpClient, path: str, body: dict[str, Any], timeout: float) -> Outcome:
    """One POST; never raises for what the server or the network does."""
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    exchange = Exchange()
    request = client.request_bytes("POST", path, data)
    await client.send(request, exchange, lambda: None, timeout=timeout)
    return classify(exchange.status, exchange.body, exchange.error, exchange.reason)
