"""Faults a test switches on through the state directory: `<state dir>/faults.yaml`.

The file is read again whenever it changes (one stat() per generation request), so a test can
turn a running server faulty and healthy again without a restart, and a restart keeps the
fault. Each entry may name the server arguments it applies to (`when:`, SGLang's dest names as
in /server_info), so a fault can follow one configuration: a rollout to `chunked_prefill_size:
3072` gets it, the rollback to the old flags does not, and no role needs to know. The first
entry that matches the server applies. Layout and modes: README, "Faults".

    faults:
      - mode: truncate          # every answer stops cleanly after `tokens` tokens
        tokens: 1
        when: {port: 30000, chunked_prefill_size: 3072}
      - mode: zero_tokens       # every answer ends cleanly with no token at all
      - mode: stall_after_headers   # 200 and SSE headers, then nothing until the client leaves
      - mode: crash             # dies like a scheduler OOM (whole tree, SIGKILL) when a
        after_requests: 5       #   generation request arrives after 5 were received, or
        at_concurrency: 4       #   when it is the 4th one in flight at once

Only generation endpoints (/generate, /v1/completions, /v1/chat/completions) are affected:
the health checks keep passing, as they do on a server that is up but answers wrongly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpusim import logs

FAULTS_FILE = "faults.yaml"
TRUNCATE, ZERO_TOKENS, STALL, CRASH = "truncate", "zero_tokens", "stall_after_headers", "crash"
MODES = (TRUNCATE, ZERO_TOKENS, STALL, CRASH)
_KEYS = {
    TRUNCATE: {"tokens"},
    ZERO_TOKENS: set(),
    STALL: set(),
    CRASH: {"after_requests", "at_concurrency"},
}


class FaultFileError(ValueError):
    """faults.yaml cannot be read as faults: the message names the entry and the key."""


@dataclass(frozen=True)
class Fault:
    """One entry of faults.yaml."""

    mode: str
    when: tuple[tuple[str, Any], ...] = ()
    tokens: int | None = None
    after_requests: int | None = None
    at_concurrency: int | None = None

    def matches(self, server_args: dict[str, Any]) -> bool:
        return all(_same(server_args.get(key), value) for key, value in self.when)

    def max_new_tokens(self, asked: int) -> int:
        """How many tokens an answer gets under this fault."""
        if self.mode == ZERO_TOKENS:
            return 0
        if self.mode == TRUNCATE and self.tokens is not None:
            return min(asked, self.tokens)
        return asked

    def crash_reason(self, received: int, in_flight: int) -> str | None:
        """Why the request that made the counts `received` and `in_flight` kills the server."""
        if self.mode != CRASH:
            return None
        if self.after_requests is not None and received > self.after_requests:
            return f"generation request {received} after {self.after_requests} served"
        if self.at_concurrency is not None and in_flight >= self.at_concurrency:
            return f"{in_flight} generation requests in flight"
        return None


def _same(actual: Any, wanted: Any) -> bool:
    # YAML gives 3072 where the parser gave "3072" for a str flag, and the other way round.
    return actual == wanted or str(actual) == str(wanted)


def _count(where: str, entry: dict[str, Any], key: str, minimum: int) -> int | None:
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise FaultFileError(f"{where}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _when(where: str, entry: dict[str, Any], server_args: dict[str, Any]) -> tuple:
    when = entry.get("when") or {}
    if not isinstance(when, dict):
        raise FaultFileError(f"{where}.when must be a mapping of server arguments, got {when!r}")
    not_args = sorted(str(key) for key in when if key not in server_args)
    if not_args:
        raise FaultFileError(
            f"{where}.when names {not_args}, which are not server arguments (use SGLang's dest "
            "names as /server_info shows them, e.g. port, chunked_prefill_size)"
        )
    return tuple(sorted(when.items()))


def _parse_entry(index: int, entry: Any, server_args: dict[str, Any]) -> Fault:
    where = f"faults[{index}]"
    if not isinstance(entry, dict):
        raise FaultFileError(f"{where} must be a mapping with a mode, got {entry!r}")
    mode = entry.get("mode")
    if mode not in MODES:
        raise FaultFileError(f"{where}.mode must be one of {', '.join(MODES)}, got {mode!r}")
    unknown = set(entry) - {"mode", "when"} - _KEYS[mode]
    if unknown:
        allowed = ", ".join(sorted({"mode", "when"} | _KEYS[mode]))
        raise FaultFileError(
            f"{where} has unknown key(s) {sorted(unknown)}; {mode} takes: {allowed}"
        )
    if mode == TRUNCATE and entry.get("tokens") is None:
        raise FaultFileError(f"{where}: truncate needs tokens (the count every answer stops at)")
    if (
        mode == CRASH
        and entry.get("after_requests") is None
        and entry.get("at_concurrency") is None
    ):
        raise FaultFileError(f"{where}: crash needs after_requests or at_concurrency")
    return Fault(
        mode=mode,
        when=_when(where, entry, server_args),
        tokens=_count(where, entry, "tokens", 0),
        after_requests=_count(where, entry, "after_requests", 0),
        at_concurrency=_count(where, entry, "at_concurrency", 1),
    )


def parse_faults(text: str, server_args: dict[str, Any]) -> list[Fault]:
    """The entries of a faults.yaml text; raises FaultFileError naming what is wrong."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FaultFileError(f"not YAML: {exc}") from exc
    if data is None:
        return []
    if not isinstance(data, dict) or set(data) != {"faults"}:
        raise FaultFileError("the top level must be a mapping with one key, faults: [ ... ]")
    entries = data["faults"] or []
    if not isinstance(entries, list):
        raise FaultFileError(f"faults must be a list of entries, got {entries!r}")
    return [_parse_entry(i, entry, server_args) for i, entry in enumerate(entries)]


class FaultSwitch:
    """The fault in force for one server, re-read whenever faults.yaml changes."""

    def __init__(self, root: Path) -> None:
        self.path = root / FAULTS_FILE
        self._seen: tuple[int, int, int] | None = None
        self._faults: list[Fault] = []
        self._error: str | None = None
        self._announced: Fault | str | None = None
        self.received = 0  # generation requests since start-up
        self.in_flight = 0

    def current(self, server_args: dict[str, Any]) -> Fault | None:
        """The first entry that applies to this server; raises FaultFileError for a bad file."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self._faults, self._error = None, [], None
            self._announce(None)
            return None
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key != self._seen:
            self._seen = key
            try:
                self._faults, self._error = parse_faults(self.path.read_text(), server_args), None
            except (FaultFileError, OSError, UnicodeDecodeError) as exc:
                self._faults, self._error = [], f"{self.path}: {exc}"
        if self._error is not None:
            self._announce(self._error)
            raise FaultFileError(self._error)
        fault = next((f for f in self._faults if f.matches(server_args)), None)
        self._announce(fault)
        return fault

    def _announce(self, now: Fault | str | None) -> None:
        """One log line whenever what is in force changes, so a test's log shows it."""
        if now == self._announced:
            return
        self._announced = now
        if isinstance(now, str):
            logs.HTTP_SERVER.error(f"gpusim fault file unreadable, generation answers 500: {now}")
        elif now is None:
            logs.HTTP_SERVER.warning(f"gpusim fault cleared ({self.path})")
        else:
            logs.HTTP_SERVER.warning(f"gpusim fault in force ({self.path}): {now}")
