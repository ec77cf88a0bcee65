"""A job's input, read and typed (docs/JOB.md, "Input and output").

Two formats, told apart line by line:
- SpecForge's conversation rows, `{"id": ..., "conversations": [{"role", "content"}, ...]}`:
  after each user turn an assistant turn is generated from the turns before it, the
  conversation's own assistant turns left out, as SpecForge's regenerate_train_data.py does;
- OpenAI batch lines, `{"custom_id", "method": "POST", "url", "body"}`, the body sent as it is
  to /v1/chat/completions or /v1/completions.

The input is scanned once before anything is sent (`scan`): every line's key, byte offset and
whether it can run, and the file's SHA-256, which ties the output files to this input. A row's
key is its id (a batch line's custom_id); a row without one is keyed by a hash of its bytes; a
key seen before makes the later row a duplicate, skipped and named. A line is read with a bound
(MAX_ROW_BYTES): a longer one is skipped without being held in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sglang_fleet.module_utils.bounded_json import loads as bounded_loads

MAX_ROW_BYTES = 8 << 20
_CHUNK = 1 << 20
ROLES = ("system", "user", "assistant")
BATCH_URLS = ("/v1/chat/completions", "/v1/completions")
# A skipped row's text kept in the skipped file: enough to find it, never the whole 8 MiB.
SHOWN_TEXT = 2000


class InputError(ValueError):
    """The input cannot be used at all (the message names the path and why)."""


@dataclass(frozen=True)
class Line:
    """One input line as scanned: where it is, its key, and why it is skipped (or None)."""

    number: int  # 1-based
    offset: int
    length: int  # bytes without the newline; over MAX_ROW_BYTES for a line that was too long
    key: str
    kind: str  # "conversation", "batch" or "" (not a row)
    skip: str | None = None


@dataclass
class InputIndex:
    """The scanned input: its identity and every line."""

    path: str
    size: int
    sha256: str
    lines: list[Line] = field(default_factory=list)
    duplicates: int = 0


def check_input_path(path: str) -> os.stat_result:
    """The input's stat; InputError for anything but a regular file (a FIFO, a device, a
    directory) and for a link that leaves its own folder."""
    try:
        link = os.lstat(path)
    except OSError as exc:
        raise InputError(f"input {path}: cannot read it ({exc.strerror})") from None
    if stat.S_ISLNK(link.st_mode):
        folder = os.path.dirname(os.path.abspath(path))
        target = os.path.realpath(path)
        if os.path.commonpath([folder, target]) != os.path.realpath(folder):
            raise InputError(f"input {path}: a link out of its folder (to {target}) is refused")
    try:
        found = os.stat(path)
    except OSError as exc:
        raise InputError(f"input {path}: cannot read it ({exc.strerror})") from None
    if not stat.S_ISREG(found.st_mode):
        raise InputError(f"input {path}: not a regular file")
    return found


def _raw_lines(path: str) -> Iterator[tuple[int, bytes | None, int, str]]:
    """(offset, line or None when over MAX_ROW_BYTES, length, running sha256) per line; the
    file opened without blocking (a FIFO that appeared meanwhile is refused, not waited on)."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise InputError(f"input {path}: not a regular file")
        offset, start, pending, over = 0, 0, bytearray(), False
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            position = 0
            while (newline := chunk.find(b"\n", position)) >= 0:
                piece = chunk[position:newline]
                length = offset + newline - start
                if over or len(pending) + len(piece) > MAX_ROW_BYTES:
                    yield start, None, length, ""
                else:
                    yield start, bytes(pending + piece), length, ""
                pending, over = bytearray(), False
                position = newline + 1
                start = offset + position
            rest = chunk[position:]
            if not over and len(pending) + len(rest) > MAX_ROW_BYTES:
                over, pending = True, bytearray()
            elif not over:
                pending += rest
            offset += len(chunk)
        if offset > start:
            yield start, None if over else bytes(pending), offset - start, ""
        yield offset, b"", -1, digest.hexdigest()


def content_key(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()[:32]


def scan(path: str) -> InputIndex:
    """Every line of the input with its key and whether it runs (see the module docstring)."""
    found = check_input_path(path)
    index = InputIndex(path=path, size=found.st_size, sha256="")
    seen: dict[str, int] = {}
    number = 0
    for offset, raw, length, digest in _raw_lines(path):
        if length < 0:
            index.sha256 = digest
            break
        number += 1
        if raw is not None and not raw.strip():
            continue  # blank lines carry no row
        line = _typed_line(number, offset, length, raw)
        if line.key in seen:
            index.duplicates += 1
            first = seen[line.key]
            line = Line(
                number, offset, length, f"{line.key}#line{number}", line.kind,
                f"duplicate id {line.key!r}: the row on line {first} has it",
            )  # fmt: skip
        else:
            seen[line.key] = number
        index.lines.append(line)
    return index


def _typed_line(number: int, offset: int, length: int, raw: bytes | None) -> Line:
    if raw is None:
        reason = f"the row is {length} bytes, over the {MAX_ROW_BYTES >> 20} MiB a row may hold"
        return Line(number, offset, length, f"line:{number}", "", reason)
    try:
        value = bounded_loads(raw, f"line {number}")
    except ValueError as exc:
        return Line(number, offset, length, content_key(raw), "", f"not JSON: {exc}")
    kind, key, reason = _kind(value)
    return Line(number, offset, length, key or content_key(raw), kind, reason)


def _key_of(value: Any) -> str | None:
    if isinstance(value, str) and value and len(value) <= 1024 and value.isprintable():
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def _kind(value: Any) -> tuple[str, str | None, str | None]:
    """(kind, key, reason it is skipped) of one parsed line."""
    if not isinstance(value, dict):
        return "", None, f"not a row (JSON {type(value).__name__})"
    if "custom_id" in value or "body" in value:
        return "batch", _key_of(value.get("custom_id")), batch_problem(value)
    return "conversation", _key_of(value.get("id")), conversation_problem(value)


def conversation_problem(row: dict[str, Any]) -> str | None:
    """Why a conversation row cannot be regenerated, or None."""
    turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        return "no conversation (a non-empty list under 'conversations')"
    for position, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return f"conversations[{position}] is not a mapping"
        role = turn.get("role")
        if role not in ROLES:
            return f"conversations[{position}] has an unknown role {str(role)[:40]!r}"
        if not isinstance(turn.get("content"), str):
            return f"conversations[{position}] has no text content"
    roles = [turn["role"] for turn in turns if turn["role"] != "system"]
    if not roles or roles[0] != "user":
        return "the conversation does not start with a user turn"
    return None


def batch_problem(row: dict[str, Any]) -> str | None:
    """Why a batch line cannot be sent, or None."""
    if _key_of(row.get("custom_id")) is None:
        return "custom_id must be a non-empty string"
    if str(row.get("method", "POST")).upper() != "POST":
        return f"method {str(row.get('method'))[:20]!r}: only POST"
    if row.get("url") not in BATCH_URLS:
        return f"url {str(row.get('url'))[:80]!r}: one of {', '.join(BATCH_URLS)}"
    if not isinstance(row.get("body"), dict):
        return "body must be a mapping"
    if row["body"].get("stream"):
        return "stream: a batch line's answer is one JSON document, not a stream"
    return None


def read_row(path: str, line: Line) -> Any:
    """The parsed row of a scanned line (read again by its offset, not kept in memory)."""
    with open(path, "rb") as handle:
        handle.seek(line.offset)
        raw = handle.read(line.length)
    return bounded_loads(raw, f"line {line.number}")


def skipped_record(path: str, line: Line) -> dict[str, Any]:
    """What the skipped file holds for a line: the row with its status and reason, or (not a
    mapping, not JSON, too long) the line's number and the start of its text."""
    if line.kind and line.length <= MAX_ROW_BYTES:
        row = read_row(path, line)
        if line.kind == "batch":
            return batch_error_line(row, line.key, "invalid_request", str(line.skip))
        return {**row, "status": "skipped", "error": line.skip}
    text = ""
    if line.length <= MAX_ROW_BYTES:
        with open(path, "rb") as handle:
            handle.seek(line.offset)
            text = handle.read(min(line.length, SHOWN_TEXT)).decode("utf-8", errors="replace")
    return {"status": "skipped", "error": line.skip, "line": line.number, "data": text}


def batch_request_id(key: str) -> str:
    """A batch output line's id: the same for a row whatever run wrote it."""
    return "batch_req_" + hashlib.sha256(key.encode()).hexdigest()[:24]


def batch_error_line(row: dict[str, Any], key: str, code: str, message: str) -> dict[str, Any]:
    return {
        "id": batch_request_id(key),
        "custom_id": row.get("custom_id") if isinstance(row, dict) else None,
        "response": None,
        "error": {"code": code, "message": message},
    }


def dumps(record: dict[str, Any]) -> bytes:
    """One output line: JSON as SpecForge and OpenAI's batch readers take it."""
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
