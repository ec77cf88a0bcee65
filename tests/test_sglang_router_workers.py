"""Tests for plugins/modules/sglang_router_workers.py and the router launcher of the sglang_router
role.

The module runs against a fake router on loopback that answers like sglang-router 0.3.2 did when
measured (docs/ROUTER.md: 202 for queued additions and removals, the list changing a moment
later, 401 without the key, 400/404 for bad or unknown ids, a duplicate addition accepted then
failed). The slow tests start the real router from the sglang-router wheel in front of two
gpusim doubles and go through remove, drain and re-add with an API key.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import load_plugin, module_argv

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "roles" / "sglang_router" / "files" / "sglang-router-launch.py"
KEY = "router-key-7f3a"


mod = load_plugin("plugins/modules/sglang_router_workers.py")


# --------------------------------------------------------------------------- fake router


@dataclass
class FakeRouter:
    """The worker API of sglang-router 0.3.2 as measured, with the delays made small."""

    api_key: str | None = None
    delay: float = 0.05
    # URLs whose registration job fails (as for a worker the router cannot reach).
    failing: dict[str, str] = field(default_factory=dict)
    # URLs that register but never turn healthy.
    unhealthy: set[str] = field(default_factory=set)
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, url: str, healthy: bool = True) -> str:
        worker_id = str(uuid.uuid4())
        self.workers[worker_id] = _entry(worker_id, url, healthy)
        return worker_id

    def urls(self) -> list[str]:
        with self.lock:
            return [w["url"] for w in self.workers.values()]

    def calls(self, method: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == method]

    def later(self, action: Any) -> None:
        timer = threading.Timer(self.delay, action)
        timer.daemon = True
        timer.start()


def _entry(worker_id: str, url: str, healthy: bool) -> dict[str, Any]:
    return {
        "id": worker_id,
        "url": url,
        "model_id": "llama",
        "priority": 50,
        "cost": 1.0,
        "worker_type": "regular",
        "is_healthy": healthy,
        "load": 0,
        "connection_mode": "HTTP",
    }


def _handler(router: FakeRouter) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _start(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            router.requests.append(
                {
                    "method": self.command,
                    "path": self.path,
                    "body": body,
                    "auth": self.headers.get("Authorization"),
                }
            )
            if router.api_key and self.headers.get("Authorization") != f"Bearer {router.api_key}":
                self._send(401, {"error": "Unauthorized"})
                return None
            return body if body is not None else {}

        def do_GET(self) -> None:
            if self._start() is None:
                return
            with router.lock:
                if self.path == "/workers":
                    listed = list(router.workers.values())
                    self._send(200, {"workers": listed, "total": len(listed)})
                    return
                worker_id = self.path.removeprefix("/workers/")
                if worker_id in router.workers:
                    self._send(200, router.workers[worker_id])
                elif worker_id in router.jobs:
                    self._send(200, router.jobs[worker_id])
                else:
                    self._send(404, {"error": f"Worker {worker_id} not found"})

        def do_POST(self) -> None:
            body = self._start()
            if body is None:
                return
            url = body.get("url")
            if not url:
                self._send(422, "missing field `url`")
                return
            with router.lock:
                existing = next((w for w in router.workers.values() if w["url"] == url), None)
                worker_id = existing["id"] if existing else str(uuid.uuid4())
                job = {"job_type": "AddWorker", "worker_url": url, "status": "processing"}
                if not existing:
                    router.jobs[worker_id] = {"id": worker_id, "url": url, "job_status": job}
            self._send(202, {"status": "accepted", "worker_id": worker_id, "url": url})
            if existing:
                return

            def register() -> None:
                with router.lock:
                    if url in router.failing:
                        job.update(status="failed", message=router.failing[url])
                        return
                    del router.jobs[worker_id]
                    router.workers[worker_id] = _entry(worker_id, url, url not in router.unhealthy)

            router.later(register)

        def do_DELETE(self) -> None:
            if self._start() is None:
                return
            worker_id = self.path.removeprefix("/workers/")
            try:
                uuid.UUID(worker_id)
            except ValueError:
                self._send(400, {"error": f"Invalid worker_id '{worker_id}' (expected UUID)"})
                return
            with router.lock:
                if worker_id not in router.workers:
                    self._send(404, {"error": f"Worker {worker_id} not found"})
                    return
            self._send(202, {"status": "accepted", "worker_id": worker_id})

            def remove() -> None:
                with router.lock:
                    router.workers.pop(worker_id, None)

            router.later(remove)

    return Handler


@contextlib.contextmanager
def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def router() -> Iterator[tuple[FakeRouter, str]]:
    fake = FakeRouter(api_key=KEY)
    with serve(_handler(fake)) as url:
        yield fake, url


@dataclass
class FakeMetrics:
    """A replica's /metrics whose in-flight count follows a script, then stays at its end."""

    running: list[float]
    queued: float = 0.0
    status: int = 200
    text: str | None = None
    reads: int = 0

    def body(self) -> str:
        if self.text is not None:
            return self.text
        value = self.running[min(self.reads, len(self.running) - 1)]
        self.reads += 1
        labels = 'model_name="/m{odd}",engine_type="unified",tp_rank="0"'
        return (
            "# HELP sglang:num_running_reqs The number of running requests.\n"
            "# TYPE sglang:num_running_reqs gauge\n"
            f"sglang:num_running_reqs{{{labels}}} {value}\n"
            f"sglang:num_queue_reqs{{{labels}}} {self.queued}\n"
            f"sglang:num_requests_total{{{labels}}} 42.0\n"
        )


def _metrics_handler(metrics: FakeMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            data = metrics.body().encode() if metrics.status == 200 else b"404: Not Found"
            self.send_response(metrics.status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def request(**kwargs: Any) -> Any:
    defaults = {"poll_interval": 0.02, "timeout": 5.0, "drain_timeout": 5.0}
    return mod.Request(**{**defaults, **kwargs})


def client(url: str, key: str | None = KEY) -> Any:
    return mod.RouterClient(url, key, timeout=5.0)


W1, W2, W3 = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


# --------------------------------------------------------------------------- list and auth


def test_list_reads_the_workers_with_the_router_key(router: tuple[FakeRouter, str]) -> None:
    fake, url = router
    first = fake.add(W1)
    fake.add(W2, healthy=False)
    result = mod.run(client(url), request(state="list"))
    assert result["changed"] is False
    assert result["workers"] == [
        {"id": first, "url": W1, "is_healthy": True, "load": 0, "model_id": "llama"},
        {
            "id": result["workers"][1]["id"],
            "url": W2,
            "is_healthy": False,
            "load": 0,
            "model_id": "llama",
        },
    ]
    assert fake.requests[0]["auth"] == f"Bearer {KEY}"


def test_a_missing_key_is_named_as_the_cause(router: tuple[FakeRouter, str]) -> None:
    _, url = router
    with pytest.raises(mod.RouterError, match=r"answered 401 .*set api_key"):
        mod.run(client(url, key=None), request(state="list"))


def test_an_unreachable_router_says_where_it_looked() -> None:
    with serve(_handler(FakeRouter())) as url:
        pass  # the port is closed again
    with pytest.raises(mod.RouterError, match=rf"cannot reach the router at {url}/workers"):
        mod.run(client(url), request(state="list"))


# --------------------------------------------------------------------------- present


def test_present_adds_with_the_worker_key_and_waits_until_healthy(
    router: tuple[FakeRouter, str],
) -> None:
    fake, url = router
    fake.add(W1)
    result = mod.run(
        client(url), request(state="present", worker_url=W2, worker_api_key="worker-key")
    )
    assert result["changed"] is True
    assert result["worker"]["url"] == W2
    assert result["worker"]["is_healthy"] is True
    (post,) = fake.calls("POST")
    assert post["body"] == {"url": W2, "api_key": "worker-key"}
    assert sorted(fake.urls()) == [W1, W2]


def test_present_without_a_worker_key_sends_none(router: tuple[FakeRouter, str]) -> None:
    fake, url = router
    mod.run(client(url), request(state="present", worker_url=W2, worker_api_key=""))
    assert fake.calls("POST")[0]["body"] == {"url": W2}


def test_present_is_idempotent(router: tuple[FakeRouter, str]) -> None:
    fake, url = router
    fake.add(W1)
    result = mod.run(client(url), request(state="present", worker_url=W1))
    assert result["changed"] is False
    assert fake.calls("POST") == []


def test_present_compares_scheme_and_host_case_insensitively(
    router: tuple[FakeRouter, str],
) -> None:
    fake, url = router
    fake.add("http://gpu-node-01:8000")
    result = mod.run(client(url), request(state="present", worker_url="HTTP://GPU-Node-01:8000"))
    assert result["changed"] is False


def test_present_in_check_mode_adds_nothing(router: tuple[FakeRouter, str]) -> None:
    fake, url = router
    result = mod.run(client(url), request(state="present", worker_url=W2, check_mode=True))
    assert result["changed"] is True
    assert result["worker"] is None
    assert fake.calls("POST") == []


def test_a_failed_registration_job_fails_with_the_routers_reason(
    router: tuple[FakeRouter, str],
) -> None:
    fake, url = router
    fake.failing[W3] = "Workflow failed at step detect_connection_mode: health checks failed"
    with pytest.raises(mod.RouterError, match=r"could not register .*detect_connection_mode"):
        mod.run(client(url), request(state="present", worker_url=W3, timeout=30))


def test_a_worker_that_never_gets_healthy_times_out(router: tuple[FakeRouter, str]) -> None:
    fake, url = router
    fake.unhealthy.add(W3)
    with pytest.raises(mod.RouterError, match=r"not a healthy worker .* after 0.5 s \(listed"):
        mod.run(client(url), request(state="present", worker_url=W3, timeout=0.5))


def test_present_without_wait_returns_after_queueing(router: tuple[FakeRouter, str]) -> None:
    fake, url = router
    fake.unhealthy.add(W3)
    result = mod.run(client(url), request(state="present", worker_url=W3, wait=False))
    assert result["changed"] is True
    assert len(fake.calls("POST")) == 1


@pytest.mark.parametrize(
    "bad",
    ["http://10.0.0.1:8000/", "http://10.0.0.1:8000/v1", "10.0.0.1:8000", "grpc://h:1", "http://"],
)
def test_worker_urls_the_router_cannot_use_are_refused_before_any_call(
    router: tuple[FakeRouter, str], bad: str
) -> None:
    fake, url = router
    with pytest.raises(mod.RouterError, match="no path and no trailing slash"):
        mod.run(client(url), request(state="present", worker_url=bad))
    assert fake.requests == []


@pytest.mark.parametrize(
    "good", ["http://10.0.0.1:8000", "https://gw.example:443", "http://[::1]:30000"]
)
def test_plain_worker_urls_are_accepted(good: str) -> None:
    assert mod.check_worker_url(good) is None


# --------------------------------------------------------------------------- absent


def test_absent_removes_by_id_and_waits_until_the_list_drops_it(
    router: tuple[FakeRouter, str],
) -> None:
    fake, url = router
    fake.add(W1)
    second = fake.add(W2)
    result = mod.run(client(url), request(state="absent", worker_url=W2))
    assert result["changed"] is True
    assert result["worker"] is None
    assert result["drained"] is None
    assert [c["path"] for c in fake.calls("DELETE")] == [f"/workers/{second}"]
    assert fake.urls() == [W1]


def test_absent_is_idempotent(router: tuple[FakeRouter, str]) -> None:
    fake, url = router
    fake.add(W1)
    result = mod.run(client(url), request(state="absent", worker_url=W2))
    assert result["changed"] is False
    assert fake.calls("DELETE") == []


def test_absent_refuses_to_take_out_the_last_healthy_worker(
    router: tuple[FakeRouter, str],
) -> None:
    fake, url = router
    fake.add(W1)
    fake.add(W2, healthy=False)
    with pytest.raises(mod.RouterError, match=r"refusing to remove .*10.0.0.1.*0 other healthy"):
        mod.run(client(url), request(state="absent", worker_url=W1))
    assert fake.calls("DELETE") == []
    # A single-replica fleet says so explicitly.
    result = mod.run(client(url), request(state="absent", worker_url=W1, min_healthy_others=0))
    assert result["changed"] is True


def test_absent_in_check_mode_removes_and_drains_nothing(
    router: tuple[FakeRouter, str],
) -> None:
    fake, url = router
    fake.add(W1)
    fake.add(W2)
    metrics = FakeMetrics(running=[5])
    with serve(_metrics_handler(metrics)) as replica:
        result = mod.run(
            client(url),
            request(
                state="absent", worker_url=W2, check_mode=True, drain_metrics_url=replica + "/m"
            ),
        )
    assert result["changed"] is True
    assert result["drained"] is None
    assert fake.calls("DELETE") == []
    assert metrics.reads == 0


# --------------------------------------------------------------------------- drain


def test_absent_then_drain_until_nothing_runs(router: tuple[FakeRouter, str]) -> None:
    fake, url = router
    fake.add(W1)
    fake.add(W2)
    metrics = FakeMetrics(running=[4, 2, 1, 0])
    with serve(_metrics_handler(metrics)) as replica:
        result = mod.run(
            client(url),
            request(state="absent", worker_url=W2, drain_metrics_url=replica + "/metrics"),
        )
    assert result["drained"] is True
    assert result["running_reqs"] == 0
    # 4, 2, 1 and two zeros in a row.
    assert metrics.reads == 5


def test_queued_requests_count_as_in_flight() -> None:
    metrics = FakeMetrics(running=[0], queued=3)
    with serve(_metrics_handler(metrics)) as replica:
        result = mod.drain(
            request(state="absent", drain_metrics_url=replica + "/metrics", drain_timeout=0.2),
            mod.Clock(),
            mod.request,
        )
    assert result["drained"] is False
    assert result["running_reqs"] == 3


def test_a_drain_that_does_not_finish_gives_up_without_failing() -> None:
    metrics = FakeMetrics(running=[7])
    with serve(_metrics_handler(metrics)) as replica:
        result = mod.drain(
            request(state="absent", drain_metrics_url=replica + "/metrics", drain_timeout=0.3),
            mod.Clock(),
            mod.request,
        )
    assert result == {"drained": False, "running_reqs": 7, "drain_seconds": result["drain_seconds"]}
    assert result["drain_seconds"] >= 0.3


def test_a_replica_without_metrics_is_named_as_the_cause() -> None:
    metrics = FakeMetrics(running=[0], status=404)
    with (
        serve(_metrics_handler(metrics)) as replica,
        pytest.raises(mod.RouterError, match=r"answered 404: .*--enable-metrics"),
    ):
        mod.read_in_flight(replica + "/metrics", 5)


def test_metrics_without_the_gauges_are_refused() -> None:
    metrics = FakeMetrics(running=[0], text="process_cpu_seconds_total 1.5\n")
    with (
        serve(_metrics_handler(metrics)) as replica,
        pytest.raises(mod.RouterError, match="has neither sglang:num_running_reqs"),
    ):
        mod.read_in_flight(replica + "/metrics", 5)


def test_parse_in_flight_sums_every_rank_and_skips_lookalikes() -> None:
    text = "\n".join(
        [
            "# TYPE sglang:num_running_reqs gauge",
            'sglang:num_running_reqs{model_name="a}b",tp_rank="0"} 3.0',
            'sglang:num_running_reqs{model_name="a}b",tp_rank="1"} 2.0',
            'sglang:num_queue_reqs{model_name="a\\"b",tp_rank="0"} 1.0',
            'sglang:num_running_reqs_total{tp_rank="0"} 100.0',
            "sglang:num_queue_reqs 4",
        ]
    )
    assert mod.parse_in_flight(text) == 10.0
    assert mod.parse_in_flight("sglang:token_usage 0.5\n") is None


# --------------------------------------------------------------------------- the packaged module


def run_module(args: dict[str, Any], tmp_path: Path) -> tuple[int, dict[str, Any]]:
    """The module as Ansible runs it: a file with ANSIBLE_MODULE_ARGS, JSON on stdout."""
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}), encoding="utf-8")
    done = subprocess.run(
        module_argv("plugins/modules/sglang_router_workers.py", str(args_file)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, json.loads(done.stdout)


def test_module_keeps_both_keys_out_of_its_output(
    router: tuple[FakeRouter, str], tmp_path: Path
) -> None:
    fake, url = router
    fake.add(W1)
    rc, out = run_module(
        {
            "router_url": url,
            "api_key": KEY,
            "worker_url": W2,
            "worker_api_key": "worker-secret-9",
            "poll_interval": 0.02,
        },
        tmp_path,
    )
    assert rc == 0, out
    assert out["changed"] is True
    assert fake.calls("POST")[0]["body"]["api_key"] == "worker-secret-9"
    dumped = json.dumps(out)
    assert KEY not in dumped
    assert "worker-secret-9" not in dumped


def test_module_worker_key_defaults_to_the_router_key(
    router: tuple[FakeRouter, str], tmp_path: Path
) -> None:
    fake, url = router
    fake.add(W1)
    rc, out = run_module(
        {"router_url": url, "api_key": KEY, "worker_url": W2, "poll_interval": 0.02}, tmp_path
    )
    assert rc == 0, out
    assert fake.calls("POST")[0]["body"] == {"url": W2, "api_key": KEY}


def test_module_fails_with_the_message_and_warns_on_a_slow_drain(
    router: tuple[FakeRouter, str], tmp_path: Path
) -> None:
    fake, url = router
    fake.add(W1)
    rc, out = run_module({"router_url": url, "worker_url": W1, "state": "absent"}, tmp_path)
    assert rc == 1
    assert "401" in out["msg"]
    fake.add(W2)
    metrics = FakeMetrics(running=[2])
    with serve(_metrics_handler(metrics)) as replica:
        rc, out = run_module(
            {
                "router_url": url,
                "api_key": KEY,
                "worker_url": W2,
                "state": "absent",
                "drain_metrics_url": replica + "/metrics",
                "drain_timeout": 0.2,
                "poll_interval": 0.05,
            },
            tmp_path,
        )
    assert rc == 0, out
    assert out["drained"] is False
    # ansible-core 2.21 returns warnings as structured events: look into their text.
    assert "still had 2 running or queued requests" in json.dumps(out["warnings"])


def test_module_requires_worker_url_unless_listing(tmp_path: Path) -> None:
    rc, out = run_module({"router_url": "http://127.0.0.1:1", "state": "absent"}, tmp_path)
    assert rc == 1
    assert "worker_url" in out["msg"]


# --------------------------------------------------------------------------- the launcher


def router_python() -> str | None:
    """A python that can import sglang_router: this one, or SGLANG_ROUTER_PYTHON."""
    if importlib.util.find_spec("sglang_router") is not None:
        return sys.executable
    return os.environ.get("SGLANG_ROUTER_PYTHON") or None


needs_router = pytest.mark.skipif(
    router_python() is None,
    reason="sglang-router is not installed in this venv (requirements.txt pins it; make venv)",
)


def launcher(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    python = router_python()
    assert python
    return subprocess.run(
        [python, str(LAUNCHER), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


@needs_router
def test_launcher_check_reports_what_the_router_parsed() -> None:
    done = launcher(
        "--check", "--port", "30100", "--worker-urls", W1, W2, "--policy", "round_robin"
    )
    assert done.returncode == 0, done.stderr
    parsed = json.loads(done.stdout)
    assert parsed["worker_urls"] == [W1, W2]
    assert parsed["policy"] == "round_robin"
    assert parsed["port"] == 30100


@needs_router
@pytest.mark.parametrize("flag", ["--api-key", "--api"])
def test_launcher_refuses_a_key_on_the_command_line(flag: str) -> None:
    done = launcher("--check", flag, "secret-on-argv")
    assert done.returncode == 2
    assert "refusing --api-key on the command line" in done.stderr


@needs_router
def test_launcher_check_fails_on_a_bad_flag_with_the_routers_message() -> None:
    done = launcher("--check", "--policy", "fastest")
    assert done.returncode == 2
    assert "invalid choice: 'fastest'" in done.stderr


@needs_router
def test_launcher_needs_its_credential(tmp_path: Path) -> None:
    env = {"CREDENTIALS_DIRECTORY": ""}
    done = launcher("--api-key-credential", "api-key", env=env)
    assert done.returncode == 1
    assert "$CREDENTIALS_DIRECTORY is not set" in done.stderr
    (tmp_path / "api-key").write_text("\n", encoding="utf-8")
    done = launcher("--api-key-credential", "api-key", env={"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert done.returncode == 1
    assert "is empty" in done.stderr


# --------------------------------------------------------------------------- the real router


def _gpusim_helpers() -> ModuleType:
    import gpusim_helpers  # noqa: PLC0415  (only the real-router tests start doubles)

    return gpusim_helpers


@dataclass
class RealRouter:
    proc: subprocess.Popen[str]
    url: str
    log_path: Path

    def log(self) -> str:
        # The router colours its console log even into a file (docs/ROUTER.md).
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(encoding="utf-8"))


def start_real_router(tmp_path: Path, workers: list[str], key: str) -> RealRouter:
    helpers = _gpusim_helpers()
    port, metrics_port = helpers.free_port(), helpers.free_port()
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "api-key").write_text(key + "\n", encoding="utf-8")
    log_path = tmp_path / "router.log"
    python = router_python()
    assert python
    argv = [
        python, str(LAUNCHER), "--api-key-credential", "api-key",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--policy", "round_robin", "--health-check-interval-secs", "2",
        "--worker-urls", *workers,
    ]  # fmt: skip
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "CREDENTIALS_DIRECTORY": str(creds)},
        )
    return RealRouter(proc, f"http://127.0.0.1:{port}", log_path)


def http(method: str, url: str, body: Any = None, key: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def metrics_text(worker: Any) -> str:
    with urllib.request.urlopen(worker.url + "/metrics", timeout=10) as response:
        return response.read().decode()


def requests_served(worker: Any) -> float:
    text = metrics_text(worker)
    match = re.search(r"^sglang:num_requests_total\{[^}]*\} (\S+)$", text, re.M)
    assert match, text
    return float(match.group(1))


@pytest.fixture
def real_fleet(tmp_path: Path) -> Iterator[tuple[RealRouter, list[Any]]]:
    helpers = _gpusim_helpers()
    root = tmp_path / "gpusim"
    # Instant start-up, but decoding takes real time, so requests are in flight while a
    # worker is taken out.
    timing = helpers.Timing(load_weights_s=0, kv_alloc_s=0, graph_capture_s=0, decode_step_s=0.02)
    helpers.state.init_state(helpers.Hardware(timing=timing), root)
    workers = [
        helpers.start_server(
            root, tmp_path, "--model-path", helpers.LLAMA, "--enable-metrics",
            "--skip-server-warmup", "--api-key", KEY, "--base-gpu-id", str(gpu),
        )
        for gpu in (0, 1)
    ]  # fmt: skip
    real = None
    try:
        for worker in workers:
            worker.wait_ready()
        real = start_real_router(tmp_path, [w.url for w in workers], KEY)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert real.proc.poll() is None, real.log()
            with contextlib.suppress(OSError):
                status, body = http("GET", real.url + "/readiness")
                if status == 200 and body.get("healthy_workers") == 2:
                    break
            time.sleep(0.2)
        else:
            raise AssertionError(f"router not ready:\n{real.log()}")
        yield real, workers
    finally:
        if real is not None and real.proc.poll() is None:
            real.proc.terminate()
            real.proc.wait(30)
        for worker in workers:
            helpers.stop_server(worker)


@needs_router
@pytest.mark.slow
def test_real_router_remove_drain_and_re_add(real_fleet: tuple[RealRouter, list[Any]]) -> None:
    real, (first, second) = real_fleet
    api = client(real.url)
    listed = mod.run(api, request(state="list"))["workers"]
    assert sorted(w["url"] for w in listed) == sorted([first.url, second.url])

    # Requests in flight on both workers while the first one is taken out.
    results: list[tuple[int, Any]] = []

    def generate(tokens: int) -> None:
        body = {"text": "hello", "sampling_params": {"max_new_tokens": tokens}}
        results.append(http("POST", real.url + "/generate", body, key=KEY))

    slow = [threading.Thread(target=generate, args=(100,)) for _ in range(6)]
    for thread in slow:
        thread.start()
    deadline = time.monotonic() + 20
    while mod.parse_in_flight(metrics_text(first)) == 0:
        assert time.monotonic() < deadline, "no request reached the first worker"
        time.sleep(0.05)

    removed = mod.run(
        api,
        request(
            state="absent",
            worker_url=first.url,
            drain_metrics_url=first.url + "/metrics",
            drain_timeout=60,
            timeout=30,
        ),
    )
    assert removed["changed"] is True
    assert removed["drained"] is True
    assert [w["url"] for w in removed["workers"]] == [second.url]

    # New requests go to the other worker only.
    served_before = requests_served(first)
    fresh = [threading.Thread(target=generate, args=(2,)) for _ in range(4)]
    for thread in fresh:
        thread.start()
    for thread in fresh + slow:
        thread.join(60)
    assert requests_served(first) == served_before
    # Every request, the ones the removed worker was running included, finished in full.
    assert [status for status, _ in results] == [200] * 10, results
    assert sorted(len(body["output_ids"]) for _, body in results) == [2] * 4 + [100] * 6

    added = mod.run(api, request(state="present", worker_url=first.url, worker_api_key=KEY))
    assert added["changed"] is True
    assert added["worker"]["is_healthy"] is True
    # Registered with the key, the router read the worker's model (not "unknown").
    assert added["worker"]["model_id"] == _gpusim_helpers().LLAMA
    again = mod.run(api, request(state="present", worker_url=first.url, worker_api_key=KEY))
    assert again["changed"] is False
    assert KEY not in real.log()
