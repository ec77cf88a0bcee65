"""The fleet scenario's traffic client (molecule/shared/traffic.py) against a loopback stand-in
for the router: every failed, refused or short answer is counted, and capacity is sampled."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-test-traffic"


def load_client() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fleet_traffic", ROOT / "molecule/shared/traffic.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class Router(BaseHTTPRequestHandler):
    """Answers /generate by the script in the server's `answers` list (then full answers), and
    /readiness with the next entry of `healthy` (then 2 of 2)."""

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        with self.server.lock:
            healthy = self.server.healthy.pop(0) if self.server.healthy else 2
            self.server.probes += 1
            if self.server.stop_after == self.server.probes:
                self.server.stop_file.touch()  # the run ends after this many samples, not seconds
        self._send(200 if healthy else 503, {"healthy_workers": healthy, "total_workers": 2})

    def do_POST(self) -> None:
        asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            self._send(401, {"error": "unauthorized"})
            return
        tokens = asked["sampling_params"]["max_new_tokens"]
        with self.server.lock:
            self.server.seen += 1
            answer = self.server.answers.pop(0) if self.server.answers else "full"
        if answer == "error":
            self._send(503, {"error": "no_available_workers"})
        else:
            got = tokens - 1 if answer == "short" else tokens
            self._send(200, {"text": "x", "meta_info": {"completion_tokens": got}})


@pytest.fixture
def router() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Router)
    server.lock = threading.Lock()
    server.answers, server.healthy, server.seen = [], [], 0
    server.probes, server.stop_after, server.stop_file = 0, None, None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def run_client(router: ThreadingHTTPServer, tmp_path: Path, *extra: str) -> dict:
    client = load_client()
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    out = tmp_path / "out.json"
    url = f"http://127.0.0.1:{router.server_address[1]}"
    args = ["--url", url, "--key-file", str(key_file), "--out", str(out), "--tokens", "8"]
    client.main([*args, "--sample-every", "0.01", *extra])
    return json.loads(out.read_text())


def test_every_request_is_counted_and_wrong_answers_are_failures(router, tmp_path) -> None:
    router.answers = ["full", "short", "error", "full"]
    result = run_client(router, tmp_path, "--threads", "1", "--max-requests", "40")
    assert result["requests"] == 40 == router.seen
    assert result["failed"] == 2
    assert result["tokens"] == {"expected": 8, "short": 1}
    assert [(f["status"], f["tokens"]) for f in result["failures"]] == [(200, 7), (503, None)]
    assert result["stopped_by"] == "max_requests"


def test_a_wrong_key_fails_every_request(router, tmp_path) -> None:
    client = load_client()
    out = tmp_path / "out.json"
    url = f"http://127.0.0.1:{router.server_address[1]}"
    client.main(["--url", url, "--out", str(out), "--max-requests", "5", "--threads", "2"])
    result = json.loads(out.read_text())
    assert result["requests"] == 5 and result["failed"] == 5
    assert {f["status"] for f in result["failures"]} == {401}


def test_capacity_samples_catch_a_dip_and_an_unready_router(router, tmp_path) -> None:
    # Ended by the router after its sixth /readiness answer, not by a time a loaded machine can
    # spend on three samples (a fresh-clone run at load 11 did).
    router.healthy = [2, 1, 0, 2]
    router.stop_file, router.stop_after = tmp_path / "stop", 6
    stop = ("--stop-file", str(router.stop_file), "--max-seconds", "60")
    result = run_client(router, tmp_path, *stop, "--threads", "1")
    healthy = [sample[1] for sample in result["samples"]]
    assert healthy[:4] == [2, 1, 0, 2]
    assert result["min_healthy"] == 0
    assert result["stopped_by"] == "stop_file"


def test_max_seconds_ends_the_run(router, tmp_path) -> None:
    result = run_client(router, tmp_path, "--max-seconds", "0.3", "--threads", "1")
    assert result["stopped_by"] == "max_seconds"
    assert result["elapsed_s"] >= 0.3


def test_a_stop_file_ends_the_run(router, tmp_path) -> None:
    stop = tmp_path / "stop"
    stop.touch()
    result = run_client(router, tmp_path, "--stop-file", str(stop), "--max-seconds", "30")
    assert result["stopped_by"] == "stop_file"
    assert result["elapsed_s"] < 5
    assert result["failed"] == 0


def test_an_unreachable_router_counts_as_failures_and_zero_capacity(tmp_path) -> None:
    client = load_client()
    out = tmp_path / "out.json"
    # Port 9 (discard) on loopback: nothing listens there in a test run.
    args = ["--url", "http://127.0.0.1:9", "--out", str(out), "--max-requests", "3"]
    client.main([*args, "--threads", "1", "--request-timeout", "2"])
    result = json.loads(out.read_text())
    assert result["failed"] == 3
    assert result["failures"][0]["status"] is None and "Error" in result["failures"][0]["error"]
    assert result["min_healthy"] == 0
