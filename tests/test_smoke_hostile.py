"""Hostile inputs to the smoke client (sglang_fleet/smoke.py), as a table.

Each row: an id, the input (command-line arguments, environment, and how the server answers),
and the expected outcome:
- "refused": exit status 2, an "error:" line containing the given text, no traceback, no
  request reached the server, and the row's secret (if any) appears in no output;
- "handled": exit status 0 and a result JSON whose keys have the given values (a wrong answer
  is a failed request with its reason, never a crash or a hang).

The client runs as the role runs it: `python -m sglang_fleet.smoke` in its own process, against
a loopback server that writes the row's bytes and closes the connection (the response is framed
by the close). Every request asks for 8 tokens; two are sent.
"""

from __future__ import annotations

import json
import os
import socketserver
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
# The client runs on GPU hosts with their python3 (>= 3.9): SMOKE_PYTHON=python3.9 checks that.
PYTHON = os.environ.get("SMOKE_PYTHON", sys.executable)
KEY = "s3cret-k\u00e9y-\u4e2d"  # not Latin-1: no HTTP header can carry it
PASSWORD = "hunter2"

ROWS: list[tuple[str, dict[str, Any], str, Any]] = [
    # ---- the API key ---------------------------------------------------------------------
    ("api-key-not-latin1-env", {"env": {"SGLANG_API_KEY": KEY}, "secret": KEY}, "refused",
     "the API key from SGLANG_API_KEY has a character at position 12"),
    ("api-key-not-latin1-flag", {"argv": ["--api-key", KEY], "secret": KEY}, "refused",
     "the API key from --api-key has a character at position 12"),
    ("api-key-header-injection", {"env": {"SGLANG_API_KEY": "k\r\nX-Evil: 1"},
                                  "secret": "X-Evil"}, "refused",
     "the API key from SGLANG_API_KEY has a character at position 2"),
    ("api-key-trailing-space", {"env": {"SGLANG_API_KEY": "k3y "}, "secret": "k3y"}, "refused",
     "begins or ends with white space"),
    ("api-key-latin1", {"env": {"SGLANG_API_KEY": "cl\u00e9"}}, "handled", {"completed": 2}),
    # ---- the URL -------------------------------------------------------------------------
    ("url-not-ascii", {"argv": ["--url", "http://h\u00f6st\u4e2d:8000"]}, "refused",
     "--url must be printable ASCII"),
    ("url-control-char", {"argv": ["--url", "http://host\x1b[31m:8000"]}, "refused",
     "--url must be printable ASCII"),
    ("url-port-out-of-range", {"argv": ["--url", "http://127.0.0.1:99999"]}, "refused",
     "--url 'http://127.0.0.1:99999' cannot be read"),
    ("url-unclosed-ipv6", {"argv": ["--url", "http://[::1:8000"]}, "refused",
     "cannot be read"),
    ("url-other-scheme-with-password", {"argv": ["--url", f"ftp://u:{PASSWORD}@host/"],
                                        "secret": PASSWORD}, "refused",
     "--url must look like http://HOST:PORT, got 'ftp://***@host/'"),
    # ---- numbers -------------------------------------------------------------------------
    ("timeout-inf", {"argv": ["--timeout", "inf"]}, "refused",
     "argument --timeout: must be a positive finite number"),
    ("timeout-nan", {"argv": ["--timeout", "nan"]}, "refused",
     "argument --timeout: must be a positive finite number"),
    ("num-prompts-word", {"argv": ["--num-prompts", "all"]}, "refused",
     "argument --num-prompts: must be a positive integer, got 'all'"),
    ("output-len-absurd", {"argv": ["--random-output-len", "10000000000"]}, "refused",
     "argument --random-output-len: must be at most"),
    ("seed-not-whole", {"argv": ["--seed", "1.5"]}, "refused",
     "argument --seed: must be a whole number, got '1.5'"),
    ("duration-unbounded", {"argv": ["--duration", "5"]}, "refused",
     "--duration needs --max-concurrency or a finite --request-rate"),
    # ---- the result file -----------------------------------------------------------------
    ("json-in-missing-folder", {"json": "missing-folder/r.json"}, "refused",
     "does not exist"),
    ("json-is-a-folder", {"json": "."}, "refused", "is a directory"),
    # ---- what the server sends back (8 tokens asked for, 2 requests) ---------------------
    ("server-right", {"server": "exact"}, "handled",
     {"completed": 2, "failed": 0, "total_output_tokens": 16, "failure_reasons": {}}),
    ("server-1-of-8", {"server": "one"}, "handled",
     {"completed": 0, "output_throughput": 0.0, "failure_reasons": {"short_output": 2}}),
    ("server-0-of-8", {"server": "zero"}, "handled",
     {"completed": 0, "failure_reasons": {"short_output": 2}}),
    ("server-9-of-8", {"server": "nine"}, "handled",
     {"completed": 0, "failure_reasons": {"long_output": 2}}),
    ("server-no-meta", {"server": "no_meta"}, "handled",
     {"completed": 0, "failure_reasons": {"no_final_record": 2}}),
    ("server-only-done", {"server": "only_done"}, "handled",
     {"completed": 0, "failure_reasons": {"no_final_record": 2}}),
    # With --timeout 60: a client that waited for it would make this row take two minutes.
    ("server-close-after-non-json-event", {"server": "cut_json", "argv": ["--timeout", "60"]},
     "handled", {"completed": 0, "failure_reasons": {"no_final_record": 2}}),
    ("server-html-instead-of-events", {"server": "html"}, "handled",
     {"completed": 0, "failure_reasons": {"malformed_response": 2}}),
    ("server-deeply-nested-json", {"server": "deep"}, "handled",
     {"completed": 0, "failure_reasons": {"no_final_record": 2}}),
    ("server-one-4mib-event", {"server": "huge"}, "handled",
     {"completed": 2, "total_output_tokens": 16}),
    ("server-500", {"server": "http_500"}, "handled",
     {"completed": 0, "failure_reasons": {"http_500": 2}}),
]  # fmt: skip


# ------------------------------------------------------------------------------------------
# The loopback server: one response per connection, framed by closing it
# ------------------------------------------------------------------------------------------


def _event(tokens: int) -> bytes:
    meta = {"prompt_tokens": 3, "completion_tokens": tokens, "finish_reason": None}
    return b"data: " + json.dumps({"text": "w " * tokens, "meta_info": meta}).encode() + b"\n\n"


def _events(tokens: int) -> bytes:
    return b"".join(_event(n) for n in range(1, tokens + 1)) + b"data: [DONE]\n\n"


_SSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
BODIES = {
    "exact": _SSE + _events(8),
    "one": _SSE + _events(1),
    "zero": _SSE + _event(0) + b"data: [DONE]\n\n",
    "nine": _SSE + _events(9),
    "no_meta": _SSE + b'data: {"text": "w"}\n\ndata: [DONE]\n\n',
    "only_done": _SSE + b"data: [DONE]\n\n",
    "cut_json": _SSE + _events(7)[:-14] + b'data: {"meta_info": {"completion_tokens": 8, "pro\n\n',
    "html": _SSE + b"data: <html>502 Bad Gateway</html>\n\n",
    "huge": _SSE + _event(8).replace(b'"w ', b'"' + b"w " * (2 << 20), 1) + b"data: [DONE]\n\n",
    "deep": _SSE
    + b'data: {"x": '
    + b"[" * 100_000
    + b"]" * 100_000
    + b', "meta_info": {"completion_tokens": 8}}\n\ndata: [DONE]\n\n',
    "http_500": b"HTTP/1.1 500 Internal Server Error\r\nConnection: close\r\n\r\nboom",
}
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = self.request.recv(65536)
            if not data:
                return
            head += data
        self.server.requests.append(head.split(b"\r\n", 1)[0])  # type: ignore[attr-defined]
        path = head.split(b" ", 2)[1]
        body = BODIES[self.server.behaviour] if path == b"/generate" else NOT_FOUND  # type: ignore[attr-defined]
        self.request.sendall(body)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, behaviour: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.behaviour = behaviour
        self.requests: list[bytes] = []


# ------------------------------------------------------------------------------------------
# The runner
# ------------------------------------------------------------------------------------------


def run_row(given: dict[str, Any], outcome: str, expect: Any, tmp_path: Path) -> None:
    """Run the client on one row's input and check the row's outcome."""
    server = _Server(given.get("server", "exact"))
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    out = tmp_path / given.get("json", "result.json")
    argv = [
        *("--url", f"http://127.0.0.1:{server.server_address[1]}"),
        *("--num-prompts", "2", "--random-output-len", "8", "--warmup-requests", "0"),
        *("--json", str(out), "--timeout", "20"),
        *given.get("argv", []),
    ]
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_API_KEY"}
    env.update(given.get("env", {}), PYTHONPATH=str(REPO))
    try:
        proc = subprocess.run(
            [PYTHON, "-m", "sglang_fleet.smoke", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        server.shutdown()
        server.server_close()
    shown = proc.stdout + proc.stderr
    assert "Traceback" not in shown, shown
    if given.get("secret"):
        assert given["secret"] not in shown, shown
    if outcome == "refused":
        assert proc.returncode == 2, shown
        assert "error: " in proc.stderr and expect in proc.stderr, proc.stderr
        assert server.requests == [], "a refused input must stop before any request"
        return
    assert outcome == "handled"
    assert proc.returncode == 0, shown
    result = json.loads(out.read_text())
    assert {key: result[key] for key in expect} == expect, result["errors"]


@pytest.mark.parametrize(
    ("given", "outcome", "expect"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_hostile_input(given: dict[str, Any], outcome: str, expect: Any, tmp_path: Path) -> None:
    run_row(given, outcome, expect, tmp_path)


def test_the_table_ids_are_unique_and_outcomes_known() -> None:
    assert len({row[0] for row in ROWS}) == len(ROWS)
    assert {row[2] for row in ROWS} == {"refused", "handled"}
