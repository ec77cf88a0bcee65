"""What a running job says about itself (docs/JOB.md, "Progress"): rows done, failed, skipped
and left, output tokens per second, an ETA, errors and retries by class, the servers in
service. Three readers:
- a person at a terminal: a tqdm bar on stderr (a line every 30 s without a terminal, as under
  systemd, where the journal keeps them);
- Ansible and `status`: OUT.status.json, replaced in one rename every second while rows finish
  (every STATUS_EVERY_S while none does);
- Prometheus: prometheus_client's registry served on --metrics-port (`sglang_job_*`), which the
  monitoring role scrapes and alerts on when the rows stop moving.
No figure holds the API key or a row's text.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client import Counter as PromCounter

from sglang_fleet.job.ledger import FILES
from sglang_fleet.job.servers import Pool

STATUS_EVERY_S = 5.0
# The most often the status file, the metrics and the bar are brought up to date.
REPORT_EVERY_S = 1.0
LOG_EVERY_S = 30.0
# Output tokens per second over this window (the ETA's speed): long enough to span a restart.
SPEED_WINDOW_S = 300.0


@dataclass
class Progress:
    """The job's counters; `rows` and `errors` are what the ledger holds (this run's and
    earlier runs'), the rest this run's."""

    job: str
    total: int
    rows: dict[str, int]
    started_at: float = field(default_factory=time.time)
    tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    retries: Counter[str] = field(default_factory=Counter)
    state: str = "running"
    message: str = ""
    _marks: list[tuple[float, int, int]] = field(default_factory=list)
    _last_row_at: float = field(default_factory=time.time)

    def left(self) -> int:
        return max(0, self.total - sum(self.rows.values()))

    def finished(self, file: str, tokens: int, error_class: str | None = None) -> None:
        self.rows[file] += 1
        self.tokens += tokens
        if error_class:
            self.errors[error_class] += 1
        self._last_row_at = time.time()

    def speed(self) -> tuple[float, float]:
        """(output tokens/s, rows/s) over the last SPEED_WINDOW_S."""
        now = time.time()
        done = sum(self.rows.values())
        self._marks.append((now, self.tokens, done))
        while len(self._marks) > 2 and now - self._marks[0][0] > SPEED_WINDOW_S:
            self._marks.pop(0)
        then, tokens, rows = self._marks[0]
        span = now - then
        return ((self.tokens - tokens) / span, (done - rows) / span) if span > 0 else (0.0, 0.0)

    def snapshot(self, pool: Pool | None) -> dict[str, Any]:
        tok_s, rows_s = self.speed()
        left = self.left()
        return {
            "job": self.job,
            "state": self.state,
            "message": self.message,
            "pid": os.getpid(),
            "updated_at": time.time(),
            "started_at": self.started_at,
            "rows": {"total": self.total, **self.rows, "left": left},
            "output_tok_s": round(tok_s, 1),
            "rows_per_s": round(rows_s, 3),
            "eta_s": round(left / rows_s) if rows_s > 0 else None,
            "seconds_since_last_row": round(time.time() - self._last_row_at, 1),
            "errors_by_class": dict(self.errors),
            "retries_by_class": dict(self.retries),
            "servers": [
                {
                    "url": s.url,
                    "in_service": s.in_service,
                    "in_flight": s.in_flight,
                    "capacity": s.capacity,
                    "taken_out": s.taken_out,
                    "last_problem": s.last_problem,
                }
                for s in (pool.servers if pool else [])
            ],
        }


def write_status(path: str, snapshot: dict[str, Any]) -> None:
    """The status file, replaced in one rename (a reader sees a whole one)."""
    folder = os.path.dirname(path) or "."
    fd, temp = tempfile.mkstemp(dir=folder, prefix=".status-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(snapshot, handle, indent=1, sort_keys=True)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise


class Metrics:
    """sglang_job_* in a registry of its own, served on a port when one is given."""

    def __init__(self, job: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["job_name"]
        self.rows = Gauge(
            "sglang_job_rows", "Rows of the job by where they ended (output, error, skipped), "
            "or left.", [*labels, "state"], registry=self.registry,
        )  # fmt: skip
        self.tokens = PromCounter(
            "sglang_job_generated_tokens", "Output tokens generated by this run.", labels,
            registry=self.registry,
        )  # fmt: skip
        self.errors = Gauge(
            "sglang_job_errors", "Rows of the job in the error file, by the class of their last "
            "call's outcome (calls.py: row, timeout, connection, server, rate_limited).",
            [*labels, "class"], registry=self.registry,
        )  # fmt: skip
        self.retries = PromCounter(
            "sglang_job_retries", "Calls retried, by class.", [*labels, "class"],
            registry=self.registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "sglang_job_in_flight", "Calls in flight.", labels, registry=self.registry
        )
        self.servers = Gauge(
            "sglang_job_servers_in_service", "Servers the job sends to now.", labels,
            registry=self.registry,
        )  # fmt: skip
        self.last_row = Gauge(
            "sglang_job_last_row_timestamp_seconds", "When the last row ended (Unix time).",
            labels, registry=self.registry,
        )  # fmt: skip
        self.running = Gauge(
            "sglang_job_running", "1 while the job runs.", labels, registry=self.registry
        )
        self.job = job
        self._tokens_seen = 0
        self._retries_seen: Counter[str] = Counter()

    def serve(self, port: int, address: str) -> None:
        start_http_server(port, address, registry=self.registry)

    def update(self, progress: Progress, pool: Pool) -> None:
        job = self.job
        for state in FILES:
            self.rows.labels(job, state).set(progress.rows[state])
        self.rows.labels(job, "left").set(progress.left())
        for kind, count in progress.errors.items():
            self.errors.labels(job, kind).set(count)
        self.tokens.labels(job).inc(progress.tokens - self._tokens_seen)
        self._tokens_seen = progress.tokens
        for kind, count in progress.retries.items():
            self.retries.labels(job, kind).inc(count - self._retries_seen[kind])
            self._retries_seen[kind] = count
        self.in_flight.labels(job).set(pool.in_flight())
        self.servers.labels(job).set(sum(s.in_service for s in pool.servers))
        self.last_row.labels(job).set(progress._last_row_at)
        self.running.labels(job).set(1 if progress.state == "running" else 0)


class Display:
    """A tqdm bar at a terminal, a line every LOG_EVERY_S elsewhere (the journal)."""

    def __init__(self, progress: Progress, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.tqdm_bar = None
        self._logged = 0.0
        if self.stream.isatty():
            try:
                from tqdm import tqdm  # noqa: PLC0415 (only at a terminal; optional)
            except ImportError:
                tqdm = None
            if tqdm is not None:
                done = progress.total - progress.left()
                self.tqdm_bar = tqdm(
                    total=progress.total, initial=done, unit="row", file=self.stream,
                    desc=progress.job, dynamic_ncols=True,
                )  # fmt: skip

    def update(self, snapshot: dict[str, Any], force: bool = False) -> None:
        rows = snapshot["rows"]
        done = rows["total"] - rows["left"]
        if self.tqdm_bar is not None:
            self.tqdm_bar.n = done
            self.tqdm_bar.set_postfix(
                tok_s=snapshot["output_tok_s"], errors=rows["error"], skipped=rows["skipped"],
                refresh=False,
            )  # fmt: skip
            self.tqdm_bar.refresh()
            return
        now = time.monotonic()
        if force or now - self._logged >= LOG_EVERY_S:
            self._logged = now
            print(line(snapshot), file=self.stream, flush=True)

    def close(self) -> None:
        if self.tqdm_bar is not None:
            self.tqdm_bar.close()


def line(snapshot: dict[str, Any]) -> str:
    """One line of progress, as the journal and `status` print it (a job no run holds has no
    speed, ETA or servers to show)."""
    rows = snapshot["rows"]
    eta = snapshot.get("eta_s")
    servers = snapshot.get("servers") or []
    in_service = sum(1 for s in servers if s["in_service"])
    errors = ", ".join(f"{k} {v}" for k, v in sorted(snapshot["errors_by_class"].items()))
    text = (
        f"{snapshot['job']}: {snapshot['state']}, {rows['total'] - rows['left']}/{rows['total']} "
        f"rows (output {rows['output']}, error {rows['error']}, skipped {rows['skipped']}, "
        f"left {rows['left']})"
    )
    if snapshot.get("running", True):
        text += (
            f", {snapshot['output_tok_s']} tok/s, "
            f"ETA {_duration(eta) if eta is not None else 'unknown'}, "
            f"{in_service}/{len(servers)} servers in service"
        )
    return text + (f", errors: {errors}" if errors else "")


def status_text(snapshot: dict[str, Any], now: float | None = None) -> str:
    """What `status` prints: the progress line, then, for a job no run holds, why it ended and
    when, and the last error on record."""
    lines = [line(snapshot)]
    if snapshot.get("message"):
        lines.append(f"  {snapshot['message']}")
    updated = snapshot.get("updated_at")
    if not snapshot.get("running") and isinstance(updated, (int, float)):
        ago = max(0.0, (now if now is not None else time.time()) - updated)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(updated))
        lines.append(f"  last heard of at {stamp} ({_duration(ago)} ago)")
    last = snapshot.get("last_error")
    if last:
        lines.append(f"  last error: row {last['row']}: {last['error']}")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"
