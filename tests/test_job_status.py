"""What a job says about itself when its operator comes back to it (sglang_fleet/job/
command_line.py `status`, progress.py, docs/JOB.md "Progress"): whether a run holds it now (its
lock, not a pid that another process may have taken since), what is done and left, its errors
by class over every run and the last one, and, for a run that is gone, no speed or ETA but how
it ended and when; the status file and metrics brought up to date at most once a second."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gpusim_helpers import LLAMA, Server, start_server
from prometheus_client import generate_latest
from test_job_ledger import IDENTITY, abandon, line, open_ledger
from test_job_runner import conversation, finish, job, outcome, write_input

from gpusim import state
from sglang_fleet.job import command_line, ledger, progress, rows, runner
from sglang_fleet.job.ledger import FILES, Ledger, LedgerError
from sglang_fleet.job.servers import Pool

OUT = "out.jsonl"


def status(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> Any:
    assert command_line.main(["status", str(tmp_path / OUT), *extra]) == 0
    said = capsys.readouterr().out
    return json.loads(said) if "--json" in extra else said


def error_row(key: str, error: str) -> bytes:
    return rows.dumps({"id": key, "conversations": [], "status": "error", "error": error})


def a_status_file(tmp_path: Path, state: str, pid: int, updated_at: float) -> None:
    snapshot = progress.Progress("out", 100, dict.fromkeys(FILES, 0)).snapshot(None)
    snapshot.update(
        state=state, pid=pid, updated_at=updated_at, output_tok_s=812.5, rows_per_s=0.4, eta_s=7200
    )
    progress.write_status(str(tmp_path / (OUT + ".status.json")), snapshot)


def test_a_killed_run_is_told_by_its_lock_not_its_pid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The status file of a SIGKILLed run still says running, and its pid is alive (here: this
    test's own, as a pid reused after a reboot would be): no run holds the lock, so the job is
    not running; no speed, no ETA; the ledger's counts, the errors by class of every run and
    the last error stand."""
    first = open_ledger(tmp_path)
    first.record("a", "output", line("a"))
    first.record("b", "error", error_row("b", "row: HTTP 400: the prompt is too long"), why="row")
    first.close()
    second = open_ledger(tmp_path)
    second.record("c", "output", line("c"))
    second.record(
        "d", "error", error_row("d", "timeout: no answer (after 8 attempts)"), why="timeout"
    )
    a_status_file(tmp_path, "running", os.getpid(), time.time() - 3 * 3600)
    abandon(second)  # SIGKILL: nothing more is written, the lock goes
    found = status(tmp_path, capsys, "--json")
    assert found["running"] is False and found["state"] == "not running"
    assert "ended without a word" in found["message"] and "resume" in found["message"]
    assert found["eta_s"] is None and found["output_tok_s"] == 0
    assert found["rows"] == {"output": 2, "error": 2, "skipped": 0, "total": 100, "left": 96}
    assert found["errors_by_class"] == {"row": 1, "timeout": 1}
    assert found["last_error"] == {
        "row": "d",
        "class": "timeout",
        "error": "timeout: no answer (after 8 attempts)",
    }
    assert found["input"]["sha256"] == IDENTITY["input_sha256"]
    text = status(tmp_path, capsys)
    assert text.startswith("out: not running, 4/100 rows (output 2, error 2, skipped 0, left 96)")
    assert "tok/s" not in text and "ETA" not in text
    assert "errors: row 1, timeout 1" in text
    assert "(3 h 00 min ago)" in text
    assert "last error: row d: timeout: no answer (after 8 attempts)" in text


def test_a_run_that_holds_the_lock_is_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    held = open_ledger(tmp_path)
    held.record("a", "output", line("a"))
    a_status_file(tmp_path, "running", os.getpid(), time.time())
    try:
        found = status(tmp_path, capsys, "--json")
        text = status(tmp_path, capsys)
    finally:
        held.close()
    assert found["running"] is True and found["state"] == "running"
    assert found["eta_s"] == 7200 and found["output_tok_s"] == 812.5
    assert "812.5 tok/s, ETA 2 h 00 min" in text and "last heard of" not in text


def test_a_stopped_or_failed_run_says_how_it_ended(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    open_ledger(tmp_path).close()
    a_status_file(tmp_path, "failed", os.getpid(), time.time())
    path = tmp_path / (OUT + ".status.json")
    snapshot = json.loads(path.read_text())
    snapshot["message"] = "out.jsonl: the disk is full; nothing was half-written"
    path.write_text(json.dumps(snapshot))
    found = status(tmp_path, capsys, "--json")
    assert found["state"] == "failed" and found["running"] is False
    assert found["message"].startswith("out.jsonl: the disk is full")
    assert found["last_error"] is None
    snapshot.update(state="stopped", message="")
    path.write_text(json.dumps(snapshot))
    assert "stopped: run it again" in status(tmp_path, capsys)


def test_the_last_error_of_a_batch_job_names_its_custom_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    written = open_ledger(tmp_path)
    failed = rows.batch_error_line({"custom_id": "req-7"}, "req-7", "row", "HTTP 400: too long")
    written.record("req-7", "error", rows.dumps(failed), why="row")
    written.close()
    found = status(tmp_path, capsys, "--json")
    assert found["last_error"] == {
        "row": "req-7",
        "class": "row",
        "error": "row: HTTP 400: too long",
    }


def test_a_job_never_reported_on_is_not_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    open_ledger(tmp_path).close()
    found = status(tmp_path, capsys, "--json")
    assert found["state"] == "not running" and found["running"] is False
    assert found["rows"]["left"] == 100 and found["updated_at"] is None


def test_error_classes_survive_a_reopen_and_older_entries_count_as_unknown(
    tmp_path: Path,
) -> None:
    first = open_ledger(tmp_path)
    first.record("a", "error", error_row("a", "x"), why="connection")
    first.record("b", "error", error_row("b", "y"))  # an entry as an older runner wrote it
    first.record("c", "output", line("c"), why="timeout")  # only error rows have a class
    first.close()
    again = open_ledger(tmp_path)
    assert again.error_classes == {"connection": 1, "unknown": 1}
    again.close()
    on_record = ledger.read_record(str(tmp_path / OUT))
    assert on_record is not None
    assert on_record.errors_by_class == {"connection": 1, "unknown": 1}
    assert on_record.counts == {"output": 1, "error": 2, "skipped": 0}
    entries = [json.loads(raw) for raw in (tmp_path / (OUT + ".ledger")).read_text().splitlines()]
    classes = {e["key"]: e.get("class") for e in entries if "key" in e}
    assert classes == {"a": "connection", "b": None, "c": None}


def test_a_status_probe_never_refuses_a_run_that_starts(tmp_path: Path) -> None:
    """`status` takes the lock shared for an instant; a run starting then waits for it, and
    another run that holds it for good is still refused."""
    lock = tmp_path / (OUT + ".ledger.lock")
    lock.touch()
    fd = os.open(lock, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    threading.Timer(0.3, os.close, [fd]).start()
    open_ledger(tmp_path).close()  # waited for the probe, then opened
    first = open_ledger(tmp_path)
    assert ledger.held(str(tmp_path / OUT)) is True
    with pytest.raises(LedgerError, match="one run of a job at a time"):
        Ledger(str(tmp_path / OUT), IDENTITY).open()
    first.close()
    assert ledger.held(str(tmp_path / OUT)) is False


def test_the_status_file_is_written_at_most_once_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[dict[str, Any]] = []
    monkeypatch.setattr(runner, "write_status", lambda path, snapshot: written.append(snapshot))
    clock = [1000.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: clock[0])
    job_progress = progress.Progress("out", 10, dict.fromkeys(FILES, 0))
    loop = runner.Runner(
        None, None, Pool([]), runner.Settings(), job_progress,  # type: ignore[arg-type]
        status_path=str(tmp_path / "status.json"),
    )  # fmt: skip
    for _ in range(50):
        loop.tick()
    assert len(written) == 1
    clock[0] += progress.REPORT_EVERY_S
    loop.tick()
    loop.tick()
    assert len(written) == 2
    loop.report(force=True)
    assert len(written) == 3


def test_metrics_hold_the_errors_by_class() -> None:
    job_progress = progress.Progress("job", 10, dict.fromkeys(FILES, 0))
    job_progress.errors.update({"timeout": 2})
    job_progress.finished("error", 0, "row")
    metrics = progress.Metrics("job")
    metrics.update(job_progress, Pool([]))
    text = generate_latest(metrics.registry).decode()
    assert 'sglang_job_errors{class="timeout",job_name="job"} 2.0' in text
    assert 'sglang_job_errors{class="row",job_name="job"} 1.0' in text


@pytest.fixture
def paced_double(state_dir: Path, tmp_path: Path, servers: list[Server]) -> Server:
    """A double whose decode steps take time, so that a run can be seen and killed midway."""
    hardware = state.load_hardware(state_dir)
    hardware.timing.decode_step_s = 0.02
    state.save_hardware(hardware, state_dir)
    server = start_server(state_dir, tmp_path, "--model-path", LLAMA)
    servers.append(server)
    server.wait_ready(60)
    return server


@pytest.mark.slow
def test_status_of_a_run_killed_against_the_double(
    tmp_path: Path, paced_double: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real run: status says running with a speed while it runs; SIGKILLed, not running,
    with what is done; resumed to the end, finished with nothing left."""
    write_input(tmp_path / "in.jsonl", [conversation(n) for n in range(60)])
    proc = job(tmp_path, [paced_double.url], "--concurrency", "4")
    deadline = time.monotonic() + 30
    while not (tmp_path / (OUT + ".status.json")).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)
    live = status(tmp_path, capsys, "--json")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert live["running"] is True and live["state"] == "running"
    gone = status(tmp_path, capsys, "--json")
    assert gone["running"] is False and gone["state"] == "not running"
    assert gone["eta_s"] is None and 0 < gone["rows"]["left"] <= 60
    code, out = finish(job(tmp_path, [paced_double.url]))
    assert code == 0, out
    done = status(tmp_path, capsys, "--json")
    assert done["state"] == "finished" and done["rows"]["left"] == 0
    assert len(outcome(tmp_path)["output"]) == 60


@pytest.mark.slow
def test_a_terminal_gets_the_opening_line_then_a_bar(tmp_path: Path, paced_double: Server) -> None:
    """On a terminal (a pseudo-terminal of 120 columns here) the run prints its opening line,
    then a tqdm bar with rows, rows/s, errors and tok/s, which ends at every row."""
    write_input(tmp_path / "in.jsonl", [conversation(n) for n in range(24)])
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    args = [
        sys.executable, "-m", "sglang_fleet.job", "run", str(tmp_path / "in.jsonl"),
        "--output", str(tmp_path / OUT), "--server", paced_double.url, "--max-tokens", "12",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=follower, stderr=follower)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the run closed its end
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    text = shown.decode(errors="replace")
    assert text.startswith("job out: 24 rows in "), text[:300]
    assert "\rout: 100%|" in text and "24/24 [" in text
    assert "row/s" in text and "errors=0" in text and "tok_s=" in text
