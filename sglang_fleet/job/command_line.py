"""The job runner's command line (docs/JOB.md):

    python -m sglang_fleet.job run INPUT --output OUT --server URL [--server URL ...]
        [--concurrency N [--concurrency N ...]] [--max-tokens N] [--temperature T] [--sampling JSON]
        [--api-key-file FILE] [--metrics-port PORT] [--name NAME]
    python -m sglang_fleet.job status OUT [--json]
    python -m sglang_fleet.job shape OUT|INPUT [--sample N] [--max-tokens N] [--json]

`run` resumes by default: a second run with the same input and output sends only the rows the
ledger does not hold. The API key comes from --api-key-file (`-` for standard input), the
systemd credential `api-key`, or SGLANG_API_KEY, never from argv. Exit status: 0 every row
ended, 3 stopped (run again to resume), 1 the run failed (a full disk: the message says), 2 bad
usage (nothing was sent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

from sglang_fleet import server_secrets
from sglang_fleet.job import ledger as ledger_mod
from sglang_fleet.job import progress as progress_mod
from sglang_fleet.job import rows
from sglang_fleet.job import shape as shape_mod
from sglang_fleet.job.ledger import Ledger, LedgerError
from sglang_fleet.job.runner import Runner, Settings
from sglang_fleet.job.servers import Pool, Server
from sglang_fleet.module_utils import typed_number
from sglang_fleet.module_utils.bounded_json import loads as bounded_loads
from sglang_fleet.module_utils.typed_number import Range
from sglang_fleet.smoke.smoke_client.http_client import HttpClient, api_key_problem, shown_url
from sglang_fleet.smoke.smoke_client.workload import MAX_LENGTH_PAIRS, format_lengths

EXIT = {"finished": 0, "failed": 1, "stopped": 3}
USAGE = 2
CONCURRENCY = 16
MAX_KEY_BYTES = 4096
# The HTTP client's own limit covers a connection's set-up and a probe; a call's limit is set
# per call from its tokens (runner.Runner._time_limit).
CONNECT_TIMEOUT_S = 30.0


class UsageError(ValueError):
    """Bad usage (exit status 2): the message names the argument."""


def _number(allowed: Range, what: str) -> Any:
    def read(text: str) -> int | float:
        try:
            return typed_number.read(text, what, allowed)
        except typed_number.NumberError as exc:
            raise argparse.ArgumentTypeError(exc.message) from None

    return read


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m sglang_fleet.job",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --api-key must never pass as --api-key-file (server_secrets)
    )
    verbs = top.add_subparsers(dest="verb", required=True)
    run = verbs.add_parser(
        "run", help="send every row not yet done (resumes by default)", allow_abbrev=False
    )
    run.add_argument("input", help="JSON lines: SpecForge conversation rows or OpenAI batch lines")
    run.add_argument("--output", required=True, help="the rows that succeeded (JSON lines)")
    run.add_argument(
        "--server", action="append", required=True, metavar="URL",
        help="a replica, or the router in front of them (repeatable)",
    )  # fmt: skip
    run.add_argument(
        "--concurrency", type=_number(Range(1, 1 << 16, integer=True), "--concurrency"),
        action="append", help="requests each --server holds at once (the planner's "
        "max_concurrent_requests for the job's lengths; a router: the sum over its replicas): "
        f"once for every server, or once per --server in their order (default {CONCURRENCY})",
    )  # fmt: skip
    run.add_argument("--name", help="the job's name in metrics and status (default: OUT's stem)")
    run.add_argument("--model", default="default", help="the model field of each request")
    run.add_argument(
        "--max-tokens", type=_number(Range(1, 1 << 24, integer=True), "--max-tokens"),
        default=2048, help="per generated turn",
    )  # fmt: skip
    run.add_argument("--temperature", type=_number(Range(0, 100), "--temperature"))
    run.add_argument("--top-p", type=_number(Range(0, 1, low_open=True), "--top-p"))
    run.add_argument(
        "--sampling", default="{}", metavar="JSON",
        help="more sampling fields for every conversation request (top_k, seed, ...)",
    )  # fmt: skip
    run.add_argument("--api-key-file", metavar="FILE", help="the servers' key ('-': stdin)")
    server_secrets.refuse_key_in_argv(
        run,
        "--api-key-file FILE ('-': standard input), the systemd credential api-key or the "
        "SGLANG_API_KEY environment variable",
        top,
    )
    run.add_argument(
        "--max-attempts", type=_number(Range(1, 1000, integer=True), "--max-attempts"),
        default=8,
    )  # fmt: skip
    run.add_argument(
        "--drain-seconds", type=_number(Range(0, 86400), "--drain-seconds"), default=30.0,
        help="how long rows in flight may finish after a stop",
    )  # fmt: skip
    run.add_argument(
        "--sync-every", type=_number(Range(1, 1 << 20, integer=True), "--sync-every"),
        default=64, help="rows between two fsyncs of the output files and the ledger",
    )  # fmt: skip
    run.add_argument("--health-path", default="/health")
    run.add_argument(
        "--metrics-port", type=_number(Range(0, 65535, integer=True), "--metrics-port"),
        default=0, help="serve sglang_job_* for Prometheus here (0: not served)",
    )  # fmt: skip
    run.add_argument("--metrics-address", default="127.0.0.1")
    run.add_argument("--json", action="store_true", help="print the final status as JSON")
    shape = verbs.add_parser(
        "shape", help="the job's lengths, sampled, for smoke_gate_workload.lengths and autotune",
        allow_abbrev=False,
    )  # fmt: skip
    shape.add_argument(
        "source", help="the job's output (its ledger: measured) or its input (estimated)"
    )
    shape.add_argument(
        "--sample", type=_number(Range(1, MAX_LENGTH_PAIRS, integer=True), "--sample"),
        default=shape_mod.DEFAULT_SAMPLE,
    )  # fmt: skip
    shape.add_argument(
        "--max-tokens", type=_number(Range(1, 1 << 21, integer=True), "--max-tokens"),
        default=2048, help="an input's output tokens per call (its estimate)",
    )  # fmt: skip
    shape.add_argument("--json", action="store_true", help="the shape with where it came from")
    status = verbs.add_parser("status", help="where a job stands (its ledger and status file)")
    status.add_argument("output")
    status.add_argument("--json", action="store_true")
    return top


def _api_key(path: str | None) -> str:
    """The key, from the file, the systemd credential or the environment; never argv."""
    credential = os.path.join(os.environ.get("CREDENTIALS_DIRECTORY", ""), "api-key")
    if path is None and os.environ.get("CREDENTIALS_DIRECTORY") and os.path.isfile(credential):
        path = credential
    if path is None:
        key = os.environ.get("SGLANG_API_KEY", "")
    elif path == "-":
        key = sys.stdin.readline(MAX_KEY_BYTES)
    else:
        try:
            with open(path, encoding="utf-8") as handle:
                key = handle.read(MAX_KEY_BYTES)
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--api-key-file {path}: cannot read it ({exc})") from None
    key = key.strip()
    if key and (problem := api_key_problem(key)):
        raise UsageError(f"the API key {problem}")
    return key


def _outputs_apart_from_input(input_path: str, output: str) -> None:
    paths = ledger_mod.file_paths(output)
    inside = os.path.realpath(input_path)
    for name, path in paths.items():
        if os.path.realpath(path) == inside:
            raise UsageError(f"--output {output}: its {name} file would be the input itself")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise UsageError(f"--output {output}: the folder {folder} does not exist")


def _sampling(ns: argparse.Namespace) -> dict[str, Any]:
    try:
        extra = bounded_loads(ns.sampling, "--sampling")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not isinstance(extra, dict):
        raise UsageError("--sampling must be a JSON object of sampling fields")
    reserved = sorted(set(extra) & {"model", "messages", "max_tokens", "stream"})
    if reserved:
        raise UsageError(f"--sampling cannot set {', '.join(reserved)} (the runner's own fields)")
    for name in ("temperature", "top_p"):
        value = getattr(ns, name)
        if value is not None:
            extra[name] = value
    return dict(sorted(extra.items()))


def _capacities(ns: argparse.Namespace) -> list[int]:
    """Each --server's requests at once: one --concurrency for all, or one per --server."""
    given = [int(n) for n in ns.concurrency or [CONCURRENCY]]
    if len(given) == 1:
        return given * len(ns.server)
    if len(given) != len(ns.server):
        raise UsageError(
            f"--concurrency given {len(given)} times for {len(ns.server)} --server: once for "
            "every server, or once per --server in their order"
        )
    return given


def _pool(ns: argparse.Namespace, key: str) -> Pool:
    servers = []
    for url, capacity in zip(ns.server, _capacities(ns), strict=True):
        try:
            client = HttpClient(
                url, key or None, time.monotonic, CONNECT_TIMEOUT_S, user_agent="sglang-fleet-job"
            )
        except ValueError as exc:
            raise UsageError(f"--server {shown_url(url)}: {exc}") from None
        servers.append(Server(shown_url(url), capacity, client))
    return Pool(servers, health_path=ns.health_path)


def run(ns: argparse.Namespace) -> int:
    try:
        index = rows.scan(ns.input)
    except (rows.InputError, OSError) as exc:
        raise UsageError(str(exc)) from None
    _outputs_apart_from_input(ns.input, ns.output)
    settings = Settings(
        model=ns.model, max_tokens=int(ns.max_tokens), sampling=_sampling(ns),
        max_attempts=int(ns.max_attempts), drain_s=float(ns.drain_seconds),
    )  # fmt: skip
    key = _api_key(ns.api_key_file)
    pool = _pool(ns, key)
    identity = {
        "input_path": os.path.abspath(ns.input),
        "input_size": index.size,
        "input_sha256": index.sha256,
        "rows": len(index.lines),
        "settings": settings.identity(),
    }
    ledger = Ledger(ns.output, identity, sync_every=int(ns.sync_every))
    name = ns.name or os.path.basename(ns.output).rsplit(".", 1)[0]
    try:
        found = ledger.open()
    except LedgerError as exc:
        raise UsageError(str(exc)) from None
    progress = progress_mod.Progress(name, len(index.lines), dict(ledger.counts))
    progress.errors.update(ledger.error_classes)
    metrics = progress_mod.Metrics(name)
    if ns.metrics_port:
        metrics.serve(int(ns.metrics_port), ns.metrics_address)
    print(_opening(name, index, found, pool), file=sys.stderr, flush=True)
    display = progress_mod.Display(progress)  # after that line: a bar drawn first is broken by it
    runner = Runner(
        index, ledger, pool, settings, progress, status_path=ns.output + ".status.json",
        metrics=metrics, display=display,
    )  # fmt: skip
    try:
        asyncio.run(_until_signal(runner, pool))
    finally:
        try:
            ledger.close()
        except LedgerError as exc:
            runner.fatal = runner.fatal or str(exc)
            progress.state, progress.message = "failed", runner.fatal
    snapshot = runner.report(force=True)
    display.close()
    if ns.json:
        print(json.dumps(snapshot, indent=1, sort_keys=True))
    if runner.fatal:
        print(f"job {name}: {runner.fatal}", file=sys.stderr)
    return EXIT[progress.state]


async def _until_signal(runner: Runner, pool: Pool) -> str:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(number, stop.set)
    try:
        return await runner.run(stop)
    finally:
        pool.close()  # inside the loop: its connections close with it


def _opening(name: str, index: rows.InputIndex, found: Any, pool: Pool) -> str:
    skipped = sum(1 for line in index.lines if line.skip)
    parts = [
        f"job {name}: {len(index.lines)} rows in {index.path} (sha256 {index.sha256[:12]}), "
        f"{skipped} unusable, {index.duplicates} duplicate ids",
        f"{found.done} already done" + (f", {found.redone} to run again" if found.redone else ""),
        f"{len(pool.servers)} server(s), {pool.capacity()} calls at once",
    ]
    if found.cut_bytes:
        cut = ", ".join(f"{n} {b} bytes" for n, b in sorted(found.cut_bytes.items()))
        parts.append(f"cut what a stop left half-written ({cut})")
    return "; ".join(parts)


def status(ns: argparse.Namespace) -> int:
    """Where a job stands, running or not: the rows on record in its ledger (what is on disk),
    its errors by class and the last one, whether a run holds it now (its lock), and the last
    status its runs wrote: a live run's speed and ETA, or how the last run ended and when."""
    record = ledger_mod.read_record(ns.output)
    if record is None:
        raise UsageError(f"{ns.output}: no job ledger beside it ({ns.output}.ledger)")
    snapshot = _status_file(ns.output + ".status.json")
    running = ledger_mod.held(ns.output)
    if running is None:  # the lock cannot be tried by this user: the pid, as the file says
        running = snapshot.get("state") == "running" and _alive(snapshot.get("pid"))
    if not snapshot:
        snapshot = progress_mod.Progress(
            os.path.basename(ns.output), record.total, dict.fromkeys(ledger_mod.FILES, 0)
        ).snapshot(None)
        snapshot.update(state="running" if running else "not running", updated_at=None)
    done = sum(record.counts.values())
    snapshot["rows"] = {**record.counts, "total": record.total, "left": record.total - done}
    snapshot["running"] = running
    snapshot["errors_by_class"] = dict(sorted(record.errors_by_class.items()))
    snapshot["last_error"] = _last_error(ns.output, record)
    snapshot["input"] = {k: record.identity.get(f"input_{k}") for k in ("path", "size", "sha256")}
    snapshot["settings"] = record.identity.get("settings")
    if running and snapshot.get("state") != "running":
        snapshot["state"], snapshot["message"] = "running", "starting"
    elif not running:
        _not_running(snapshot)
    print(
        json.dumps(snapshot, indent=1, sort_keys=True)
        if ns.json
        else progress_mod.status_text(snapshot)
    )
    return 0


def _status_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            snapshot = bounded_loads(handle.read(1 << 20), path)
    except (OSError, ValueError):
        return {}
    return snapshot if isinstance(snapshot, dict) and "rows" in snapshot else {}


def _not_running(snapshot: dict[str, Any]) -> None:
    """No run holds the job: no speed, no ETA, nothing in flight; a run that said it was
    running ended without a word."""
    if snapshot.get("state") == "running":
        snapshot["state"] = "not running"
        snapshot["message"] = (
            "the last run ended without a word (killed, crashed, or its host went down); "
            "its rows on record are kept: run it again with the same input and output to resume"
        )
    elif snapshot.get("state") == "stopped" and not snapshot.get("message"):
        snapshot["message"] = "stopped: run it again with the same input and output to resume"
    snapshot.update(output_tok_s=0.0, rows_per_s=0.0, eta_s=None)
    for server in snapshot.get("servers") or []:
        if isinstance(server, dict):
            server["in_flight"] = 0


def _last_error(output: str, record: ledger_mod.OnRecord) -> dict[str, Any] | None:
    """The last row on record in the error file: its id, class and what went wrong."""
    entry = record.last_error
    if entry is None:
        return None
    row = ledger_mod.read_line(output, entry) or {}
    said = row.get("error")
    if isinstance(said, dict):  # a batch line: {"code", "message"}
        said = f"{said.get('code')}: {said.get('message')}"
    shown = row.get("custom_id") or row.get("id") or entry.key  # a batch line's own id is ours
    return {
        "row": str(shown)[:200],
        "class": entry.why,
        "error": str(said)[:500] if said is not None else "(its line is not on disk yet)",
    }


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shape(ns: argparse.Namespace) -> int:
    """The job's shape: measured from its ledger when `source` is an output whose rows ran,
    else estimated from its input (the one the ledger names, or `source` itself as an input;
    sglang_fleet/job/shape.py)."""
    pairs = shape_mod.measured(ns.source)
    source = "measured: the servers' usage counts in the job's ledger"
    if not pairs:
        identity = ledger_mod.read_identity(ns.source)
        path = str(identity.get("input_path")) if identity else ns.source
        try:
            index = rows.scan(path)
        except (rows.InputError, OSError) as exc:
            raise UsageError(str(exc)) from None
        pairs = shape_mod.estimated(index, int(ns.max_tokens))
        source = (
            f"estimated from the input {path}: {shape_mod.CHARS_PER_TOKEN} characters a token, "
            f"{ns.max_tokens} output tokens a call"
        )
    if not pairs:
        raise UsageError(f"{ns.source}: no call of the job to take a shape from")
    picked = shape_mod.sample(pairs, int(ns.sample))
    lengths = format_lengths(picked)
    if ns.json:
        print(json.dumps({**shape_mod.describe(picked, source), "lengths": lengths}, indent=1))
    else:
        print(lengths)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    verbs = {"run": run, "status": status, "shape": shape}
    try:
        return verbs[args.verb](args)
    except UsageError as exc:
        print(f"python -m sglang_fleet.job {args.verb}: {exc}", file=sys.stderr)
        return USAGE
