"""Why a request or the run fails: the reasons a result counts in ``failure_reasons``,
what parsing a response that is not what it should be can raise, the end of a run
whose server is not there, and an OS error in words."""

from __future__ import annotations

import os

# Why a request failed: the keys of the result's ``failure_reasons`` (plus http_<status>).
SHORT_OUTPUT = "short_output"
LONG_OUTPUT = "long_output"
NO_FINAL_RECORD = "no_final_record"
TIMEOUT = "timeout"
CONNECT_FAILED = "connect_failed"
CONNECTION_CLOSED = "connection_closed"
MALFORMED = "malformed_response"
SERVER_ERROR = "server_error"
# What parsing a response that is not HTTP + SSE + JSON as expected can raise (json raises
# RecursionError for deeply nested arrays).
PARSE_ERRORS = (ValueError, IndexError, KeyError, TypeError, AttributeError, RecursionError)


class ServerUnreachable(Exception):
    """The server did not accept a connection at all, or stopped answering before the run
    (exit status 1)."""


def os_reason(err: BaseException) -> str:
    """An exception as words, also when the system gave none (str(err) is then empty)."""
    text = str(err).strip()
    errno = getattr(err, "errno", None)
    if not text and errno:
        text = os.strerror(errno)
    name = type(err).__name__
    return f"{name}: {text}" if text else f"{name} (no reason given by the system)"
