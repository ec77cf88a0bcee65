"""The job's loop: every row not yet in the ledger through the servers, until none is left or
the run is stopped (docs/JOB.md).

Rows start while the servers in service have room (pool.capacity(), plus a few so that a
finished call's slot never waits for a row to be read); a conversation row holds one slot at a
time, turn after turn. A row ends in exactly one file: output when every call of it answered,
error when a call came back with the row's own fault or the row ran out of attempts, skipped
when the scan found it unusable. A stop (SIGTERM, SIGINT) starts no new row, lets the rows in
flight finish for `drain_s`, and leaves the rest to the next run; the ledger is synced either
way. A write that fails (a full disk) stops the run at once with the reason.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from sglang_fleet.job import calls, rows
from sglang_fleet.job.calls import Outcome
from sglang_fleet.job.ledger import Ledger, LedgerError
from sglang_fleet.job.progress import (
    REPORT_EVERY_S,
    STATUS_EVERY_S,
    Display,
    Metrics,
    Progress,
    write_status,
)
from sglang_fleet.job.rows import InputIndex, Line
from sglang_fleet.job.servers import Pool

# Rows read ahead of the free slots: a slot that frees finds its next row ready.
READ_AHEAD = 4
# The speed a request's time limit assumes before any call of this run has measured one.
FIRST_TOK_S = 1.0


@dataclass(frozen=True)
class Settings:
    """How the job asks: what every row's calls carry (its identity in the ledger), and the
    retry and time rules, which may change between runs of a job."""

    model: str = "default"
    max_tokens: int = 2048
    sampling: dict[str, Any] = field(default_factory=dict)
    max_attempts: int = 8
    backoff_s: float = 1.0
    backoff_cap_s: float = 60.0
    base_timeout_s: float = 60.0
    drain_s: float = 30.0

    def identity(self) -> dict[str, Any]:
        """What makes two runs' rows alike: kept in the ledger's first line."""
        return {"model": self.model, "max_tokens": self.max_tokens, "sampling": self.sampling}


@dataclass
class _Finished:
    """Where a row ends, its line, each call's (prompt, completion) tokens, and the error's
    class (None for a row that succeeded)."""

    file: str
    record: dict[str, Any]
    usage: list[tuple[int, int]]
    error: str | None = None


@dataclass
class _Speed:
    """Output tokens per second of one request, a moving average over the calls so far."""

    tok_s: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            now = tokens / seconds
            self.tok_s = now if not self.tok_s else 0.9 * self.tok_s + 0.1 * now


class Runner:
    def __init__(
        self,
        index: InputIndex,
        ledger: Ledger,
        pool: Pool,
        settings: Settings,
        progress: Progress,
        *,
        status_path: str | None = None,
        metrics: Metrics | None = None,
        display: Display | None = None,
    ) -> None:
        self.index, self.ledger, self.pool, self.settings = index, ledger, pool, settings
        self.progress = progress
        self.status_path, self.metrics, self.display = status_path, metrics, display
        self.speed = _Speed()
        self.fatal: str | None = None
        self._reported: float | None = None

    # --- the loop -------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> str:
        """finished, stopped (resume later) or failed (self.fatal says why)."""
        probe = asyncio.create_task(self.pool.probe_forever())
        stopped = asyncio.create_task(stop.wait())
        active: set[asyncio.Task[Any]] = set()
        try:
            self._record_skipped()
            self.tick()  # the status file is this run's from its start
            pending = [
                line for line in self.index.lines
                if line.skip is None and not self.ledger.done(line.key)
            ]  # fmt: skip
            pending.reverse()
            while pending or active:
                while pending and not stop.is_set() and len(active) < self._room():
                    active.add(asyncio.create_task(self._row(pending.pop())))
                if stop.is_set():
                    break
                done, active = await asyncio.wait(
                    active | {stopped}, timeout=STATUS_EVERY_S, return_when=asyncio.FIRST_COMPLETED
                )
                active.discard(stopped)
                _raise_failures(done - {stopped})
                self.tick()
            await self._drain(active)
        except LedgerError as exc:
            self.fatal = str(exc)
            await _cancel(active)
        finally:
            probe.cancel()
            stopped.cancel()
        state = "failed" if self.fatal else "finished" if not self.progress.left() else "stopped"
        self.progress.state, self.progress.message = state, self.fatal or ""
        return state

    def _room(self) -> int:
        return self.pool.capacity() + READ_AHEAD

    async def _drain(self, active: set[asyncio.Task[Any]]) -> None:
        """Rows in flight at a stop get drain_s to finish; the rest run again next time."""
        if active:
            done, active = await asyncio.wait(active, timeout=self.settings.drain_s)
            _raise_failures(done)
        await _cancel(active)

    def tick(self) -> None:
        """report(), at most every REPORT_EVERY_S: the loop wakes at every finished row, and
        the status file would be written and renamed for each (about 0.2 ms of CPU each on the
        development machine, more than the rest of a row's handling)."""
        now = time.monotonic()
        if self._reported is None or now - self._reported >= REPORT_EVERY_S:
            self._reported = now
            self.report()

    def report(self, force: bool = False) -> dict[str, Any]:
        snapshot = self.progress.snapshot(self.pool)
        if self.status_path:
            write_status(self.status_path, snapshot)
        if self.metrics:
            self.metrics.update(self.progress, self.pool)
        if self.display:
            self.display.update(snapshot, force)
        return snapshot

    def _record_skipped(self) -> None:
        for line in self.index.lines:
            if line.skip is not None and not self.ledger.done(line.key):
                record = rows.skipped_record(self.index.path, line)
                self.ledger.record(line.key, "skipped", rows.dumps(record))
                self.progress.finished("skipped", 0)

    # --- one row --------------------------------------------------------------------------
    async def _row(self, line: Line) -> None:
        row = rows.read_row(self.index.path, line)
        if line.kind == "batch":
            done = await self._batch(row, line.key)
        else:
            done = await self._conversation(row)
        self.ledger.record(
            line.key, done.file, rows.dumps(done.record), usage=done.usage, why=done.error
        )
        self.progress.finished(done.file, sum(out for _prompt, out in done.usage), done.error)

    async def _conversation(self, row: dict[str, Any]) -> _Finished:
        """After each user turn, the assistant turn the server generates from the turns before
        it (the row's own assistant turns left out, as SpecForge does)."""
        messages: list[dict[str, Any]] = []
        usage: list[tuple[int, int]] = []
        for turn in row["conversations"]:
            if turn["role"] == "assistant":
                continue
            messages.append(turn)
            if turn["role"] != "user":
                continue
            body = {
                **self.settings.sampling,
                "model": self.settings.model,
                "messages": messages,
                "max_tokens": self.settings.max_tokens,
                "stream": False,
            }
            outcome, text = await self._call("/v1/chat/completions", body, chat=True)
            if text is None:
                error = f"{outcome.kind}: {outcome.message}"
                record = {**row, "status": "error", "error": error}
                return _Finished("error", record, usage, outcome.kind)
            usage.append(calls.usage(outcome.answer or {}))
            messages = [*messages, {"role": "assistant", "content": text}]
        record = {**row, "conversations": messages, "status": "success"}
        return _Finished("output", record, usage)

    async def _batch(self, row: dict[str, Any], key: str) -> _Finished:
        body = row["body"]
        url = row["url"]
        outcome, text = await self._call(url, body, chat=url.endswith("/chat/completions"))
        if text is None:
            message = outcome.message or outcome.kind
            line = rows.batch_error_line(row, key, outcome.kind, message)
            if outcome.status:
                line["response"] = {"status_code": outcome.status, "request_id": None, "body": None}
            return _Finished("error", line, [], outcome.kind)
        answer = outcome.answer or {}
        line = {
            "id": rows.batch_request_id(key),
            "custom_id": row["custom_id"],
            "response": {
                "status_code": outcome.status,
                "request_id": answer.get("id"),
                "body": answer,
            },
            "error": None,
        }
        return _Finished("output", line, [calls.usage(answer)])

    async def _call(
        self, path: str, body: dict[str, Any], *, chat: bool
    ) -> tuple[Outcome, str | None]:
        """One call of the row, retried by class within its budget: (the last outcome, the
        generated text or None when the row must go to the error file)."""
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        limit = self._time_limit(max_tokens if isinstance(max_tokens, int) else None)
        spent = tries = 0
        while True:
            tries += 1
            server = await self.pool.acquire()
            started = time.monotonic()
            try:
                outcome = await calls.post(server.client, path, body, limit)
            except BaseException:
                await self.pool.release(server, calls.OK)  # cancelled: no fault of the server
                raise
            await self.pool.release(server, outcome.kind, outcome.message)
            if outcome.kind == calls.OK:
                text = calls.generated_text(outcome.answer or {}, chat)
                if text is not None:
                    tokens = calls.completion_tokens(outcome.answer or {})
                    self.speed.add(tokens, time.monotonic() - started)
                    return outcome, text
                outcome = Outcome(calls.SERVER, outcome.status, message="an answer with no text")
            if outcome.kind == calls.ROW:
                return outcome, None
            self.progress.retries[outcome.kind] += 1
            spent += outcome.spends_budget()
            if spent >= self.settings.max_attempts:
                outcome.message = f"{outcome.message} (after {tries} attempts)"
                return outcome, None
            await asyncio.sleep(self._backoff(tries))

    def _time_limit(self, max_tokens: int | None) -> float:
        """A call's time limit: the base plus its tokens at a quarter of the speed measured so
        far (FIRST_TOK_S before any), so that a slow but working server is never cut off."""
        tokens = max_tokens if max_tokens and max_tokens > 0 else self.settings.max_tokens
        speed = max(self.speed.tok_s / 4, FIRST_TOK_S) if self.speed.tok_s else FIRST_TOK_S
        return self.settings.base_timeout_s + tokens / speed

    def _backoff(self, tries: int) -> float:
        ceiling = min(self.settings.backoff_cap_s, self.settings.backoff_s * 2 ** (tries - 1))
        return ceiling * random.uniform(0.5, 1.0)


def _raise_failures(done: set[asyncio.Task[Any]]) -> None:
    """A row task that raised ends the run with its exception (a LedgerError: a full disk)."""
    for task in done:
        if not task.cancelled() and (exc := task.exception()) is not None:
            raise exc


async def _cancel(tasks: set[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
