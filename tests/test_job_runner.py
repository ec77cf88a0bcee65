"""The job runner (sglang_fleet/job/, docs/JOB.md) against the GPU-less double: both input
formats in and out, bad rows skipped with their reason, every row exactly once through
SIGKILLs at random instants, a server killed and back, retries by class, a full disk, the key
kept out of argv, status and metrics."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from gpusim.http_api import TextStream, output_seed
from gpusim.tokenizer import WordTokenizer
from gpusim_helpers import LLAMA, Server, start_server, stop_server

from gpusim import state
from sglang_fleet.job import ledger as ledger_mod
from sglang_fleet.job import rows

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
KEY = "sk-job-canary-7f3e"
WORDS = WordTokenizer.from_dir(None).vocab[40:400]


def conversation(number: int, turns: int = 1) -> dict[str, Any]:
    """A row whose prompts are words of the double's vocabulary (so that each asks its own)."""
    rng = random.Random(number)
    talk: list[dict[str, str]] = [{"role": "system", "content": "be brief"}]
    for _ in range(turns):
        talk.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=6))})
        talk.append({"role": "assistant", "content": "an old answer"})
    return {"id": f"row-{number}", "conversations": talk, "source": "test"}


def write_input(path: Path, lines: list[Any]) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        for line in lines:
            handle.write(line if isinstance(line, str) else json.dumps(line))
            handle.write("\n")
    return path


def expected_text(messages: list[dict[str, Any]], sampling: dict[str, Any]) -> str:
    """What the double answers a chat request: its text is a function of the prompt and the
    sampling settings (gpusim.http_api.output_seed), MAX_TOKENS words long."""
    stream = TextStream(WordTokenizer.from_dir(LLAMA), output_seed(messages, sampling))
    stream.advance(MAX_TOKENS)
    return stream.text


def expected_conversation(row: dict[str, Any], sampling: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for turn in row["conversations"]:
        if turn["role"] == "assistant":
            continue
        messages.append(turn)
        if turn["role"] == "user":
            body = {**sampling, "model": "default", "messages": messages}
            messages = [*messages, {"role": "assistant", "content": expected_text(messages, body)}]
    return messages


def job(
    tmp_path: Path, server_urls: list[str], *extra: str, key: str | None = None
) -> subprocess.Popen[str]:
    args = [
        sys.executable, "-m", "sglang_fleet.job", "run", str(tmp_path / "in.jsonl"),
        "--output", str(tmp_path / "out.jsonl"), "--max-tokens", str(MAX_TOKENS),
        "--temperature", "0", "--sync-every", "8", *extra,
    ]  # fmt: skip
    for url in server_urls:
        args += ["--server", url]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stdin = None
    if key is not None:
        args += ["--api-key-file", "-"]
        stdin = subprocess.PIPE
    proc = subprocess.Popen(
        args, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    if key is not None:
        assert proc.stdin is not None
        proc.stdin.write(key + "\n")
        proc.stdin.close()
        proc.stdin = None  # communicate() would flush the closed pipe
    return proc


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def outcome(tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    paths = ledger_mod.file_paths(str(tmp_path / "out.jsonl"))
    return {name: read_lines(Path(paths[name])) for name in ledger_mod.FILES}


@pytest.fixture
def slow_double(state_dir: Path, tmp_path: Path, servers: list[Server]) -> Server:
    """A double whose decode steps take time, so a run can be stopped in the middle."""
    hardware = state.load_hardware(state_dir)
    hardware.timing.decode_step_s = 0.02
    state.save_hardware(hardware, state_dir)
    server = start_server(state_dir, tmp_path, "--model-path", LLAMA, "--enable-metrics")
    servers.append(server)
    server.wait_ready(60)
    return server


def test_both_formats_and_every_bad_row(tmp_path: Path, slow_double: Server) -> None:
    good = [conversation(n, turns=1 + n % 2) for n in range(6)]
    batch = {
        "custom_id": "b-1", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "kasa nu"}],
                 "max_tokens": 5},
    }  # fmt: skip
    lines = [
        *good,
        batch,
        "not json {",
        {"id": "no-talk"},
        {"id": "robot", "conversations": [{"role": "robot", "content": "beep"}]},
        {"id": "row-1", "conversations": [{"role": "user", "content": "again"}]},  # duplicate
        {"custom_id": "b-2", "method": "POST", "url": "/v1/embeddings", "body": {}},
        {"custom_id": "b-3", "url": "/v1/completions", "body": {"prompt": "x", "stream": True}},
        {"id": "big", "conversations": [{"role": "user", "content": "x" * (rows.MAX_ROW_BYTES)}]},
    ]
    write_input(tmp_path / "in.jsonl", lines)
    code, out = finish(job(tmp_path, [slow_double.url]))
    assert code == 0, out
    found = outcome(tmp_path)
    by_id = {row["id"]: row for row in found["output"] if "id" in row and "custom_id" not in row}
    for row in good:
        written = by_id[row["id"]]
        assert written["status"] == "success" and written["source"] == "test"
        assert written["conversations"] == expected_conversation(row, {"temperature": 0})
    [batch_out] = [r for r in found["output"] if r.get("custom_id") == "b-1"]
    assert batch_out["error"] is None and batch_out["response"]["status_code"] == 200
    assert batch_out["response"]["body"]["usage"]["completion_tokens"] == 5
    assert batch_out["id"] == rows.batch_request_id("b-1")
    reasons = {
        r.get("custom_id") or r.get("id") or r.get("line"): r.get("error") for r in found["skipped"]
    }
    assert "not JSON" in reasons[len(good) + 2]
    assert "no conversation" in reasons["no-talk"]
    assert "unknown role 'robot'" in reasons["robot"]
    assert "duplicate id 'row-1'" in reasons["row-1"]
    assert "url '/v1/embeddings'" in str(reasons["b-2"])
    assert "stream" in str(reasons["b-3"])
    assert "over the 8 MiB a row may hold" in reasons[len(lines)]
    assert found["error"] == []
    assert len(found["output"]) + len(found["skipped"]) == len(lines)
    # Each call's lengths as the server counted them: the job's shape (job shape).
    usage = ledger_mod.read_usage(str(tmp_path / "out.jsonl"))
    turns = sum(1 + n % 2 for n in range(6))
    assert sorted(c for _, c in usage) == sorted([MAX_TOKENS] * turns + [5])
    assert all(prompt > 0 for prompt, _ in usage)


def test_every_row_exactly_once_through_sigkills(tmp_path: Path, slow_double: Server) -> None:
    """SIGKILL at random instants, then resume, until the job is done: each input row is in
    exactly one file once, and every output is what the server generates for its prompt."""
    source = [conversation(n) for n in range(120)]
    write_input(tmp_path / "in.jsonl", source)
    rng = random.Random(44)
    kills = 0
    for _ in range(4):
        proc = job(tmp_path, [slow_double.url], "--concurrency", "8")
        time.sleep(rng.uniform(0.3, 1.5))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.communicate(timeout=60)
    code, out = finish(job(tmp_path, [slow_double.url], "--concurrency", "8"))
    assert code == 0, out
    assert kills >= 2
    found = outcome(tmp_path)
    ids = [row["id"] for file in found.values() for row in file]
    assert sorted(ids) == sorted(row["id"] for row in source)  # each once, none lost
    for row in found["output"]:
        assert row["conversations"] == expected_conversation(
            source[int(row["id"].split("-")[1])], {"temperature": 0}
        )


def test_a_sigterm_stops_cleanly_and_a_rerun_finishes(tmp_path: Path, slow_double: Server) -> None:
    write_input(tmp_path / "in.jsonl", [conversation(n) for n in range(80)])
    proc = job(tmp_path, [slow_double.url], "--concurrency", "4", "--drain-seconds", "5")
    # The stop under test is the runner's: wait until it runs rows (its status file is written
    # from the loop that handles SIGTERM), not a fixed second that a loaded machine spends
    # starting Python.
    status = tmp_path / "out.jsonl.status.json"
    deadline = time.monotonic() + 60
    while not status.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == 3, out
    assert "stopped" in out
    left = json.loads((tmp_path / "out.jsonl.status.json").read_text())["rows"]["left"]
    assert 0 < left < 80
    code, out = finish(job(tmp_path, [slow_double.url]))
    assert code == 0, out
    assert f"{80 - left} already done" in out
    assert len(outcome(tmp_path)["output"]) == 80


def test_a_killed_server_is_taken_out_and_its_rows_go_elsewhere(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    hardware = state.load_hardware(state_dir)
    hardware.timing.decode_step_s = 0.02
    state.save_hardware(hardware, state_dir)
    doubles = [
        start_server(state_dir, tmp_path, "--model-path", LLAMA, CUDA_VISIBLE_DEVICES=str(gpu))
        for gpu in range(2)
    ]
    servers.extend(doubles)
    for server in doubles:
        server.wait_ready(60)
    write_input(tmp_path / "in.jsonl", [conversation(n) for n in range(60)])
    proc = job(tmp_path, [s.url for s in doubles], "--concurrency", "4")
    time.sleep(1.0)
    stop_server(doubles[0])
    code, out = finish(proc)
    assert code == 0, out
    found = outcome(tmp_path)
    assert len(found["output"]) == 60 and found["error"] == []
    status = json.loads((tmp_path / "out.jsonl.status.json").read_text())
    [dead] = [s for s in status["servers"] if s["url"] == doubles[0].url]
    assert dead["taken_out"] == 1 and not dead["in_service"]
    assert status["retries_by_class"].get("connection", 0) >= 1


def test_the_key_stays_out_of_argv_status_and_metrics(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    hardware = state.load_hardware(state_dir)
    hardware.timing.decode_step_s = 0.02
    state.save_hardware(hardware, state_dir)
    server = start_server(state_dir, tmp_path, "--model-path", LLAMA, "--api-key", KEY)
    servers.append(server)
    server.wait_ready(60)
    write_input(tmp_path / "in.jsonl", [conversation(n) for n in range(40)])
    port = _free_port()
    proc = job(tmp_path, [server.url], "--metrics-port", str(port), key=KEY)
    argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    metrics = ""
    deadline = time.monotonic() + 30
    while "sglang_job_rows{" not in metrics and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                metrics = r.read().decode()
        except OSError:
            time.sleep(0.05)
    code, out = finish(proc)
    assert code == 0, out
    assert len(outcome(tmp_path)["output"]) == 40  # the key reached the server
    status = (tmp_path / "out.jsonl.status.json").read_text()
    ledger = (tmp_path / "out.jsonl.ledger").read_text()
    for text in (argv.decode(), out, status, ledger, metrics):
        assert KEY not in text
    assert "sglang_job_rows" in metrics


def test_a_wrong_key_is_the_rows_fault_and_goes_to_the_error_file(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    server = start_server(state_dir, tmp_path, "--model-path", LLAMA, "--api-key", KEY)
    servers.append(server)
    server.wait_ready(60)
    write_input(tmp_path / "in.jsonl", [conversation(n) for n in range(3)])
    code, out = finish(job(tmp_path, [server.url], key="not-the-key"))
    assert code == 0, out
    errors = outcome(tmp_path)["error"]
    assert [e["status"] for e in errors] == ["error"] * 3
    assert all(e["error"].startswith("row: HTTP 401") for e in errors)


def _free_port() -> int:
    import socket  # noqa: PLC0415 (one use)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
