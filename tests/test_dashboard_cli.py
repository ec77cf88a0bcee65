"""`python -m sglang_fleet.monitoring.dashboard` reads Prometheus through the one HTTP reader
(fleet_http).

Each case is what the hostile review of issue 33 found: a redirect was followed, a proxy from
the environment was used, a slow answer held it without a deadline, a huge answer was read
whole, and an answer that is not JSON ended in a traceback. Now each ends in one line naming
what was wrong and exit status 1; a good answer still draws the PNG.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sglang_fleet.monitoring import dashboard

Handler = Callable[[BaseHTTPRequestHandler], None]
GOOD = {
    "status": "success",
    "data": {
        "resultType": "matrix",
        "result": [{"metric": {"host": "gpu1", "server": "llama"}, "values": [[1, "1"], [2, "3"]]}],
    },
}


def answer(status: int, body: bytes, headers: dict[str, str] | None = None) -> Handler:
    def handle(request: BaseHTTPRequestHandler) -> None:
        request.send_response(status)
        for name, value in (headers or {}).items():
            request.send_header(name, value)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

    return handle


class Server:
    """A local HTTP server whose every GET runs `handler`; `paths` records what was asked."""

    def __init__(self, handler: Handler) -> None:
        self.paths: list[str] = []
        outer = self

        class _Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.paths.append(self.path)
                handler(self)

            def log_message(self, *_args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[[Handler], Server]]:
    started: list[Server] = []

    def start(handler: Handler) -> Server:
        started.append(Server(handler))
        return started[-1]

    yield start
    for server in started:
        server.close()


def run(url: str, png: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = dashboard.main(["--prometheus", url, "--minutes", "1", str(png)])
    return code, capsys.readouterr().err


def test_a_good_prometheus_draws_the_png(serve, tmp_path: Path, capsys) -> None:
    server = serve(answer(200, json.dumps(GOOD).encode()))
    code, err = run(server.url, tmp_path / "p.png", capsys)
    assert code == 0, err
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert all(p.startswith("/api/v1/query_range?") for p in server.paths)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"<html>proxy error</html>", "is not JSON"),
        (b"[" * 100_000, "nests too deep"),
        (b'{"status": "success", "data": {"result": [{"metric": {}, "values": [["x"]]}]}}',
         "not [time, number] pairs"),
        (b'{"status": "success", "data": {"result": {}}}', "no result list"),
        (b'{"status": "success", "data": {"result": [{"metric": {"a": [1]}, "values": []}]}}',
         "not text"),
        (b'"just a string"', "not an object"),
    ],
)  # fmt: skip
def test_an_answer_that_is_not_prometheus_json_is_one_clean_line(
    serve, tmp_path: Path, capsys, body: bytes, said: str
) -> None:
    server = serve(answer(200, body))
    code, err = run(server.url, tmp_path / "p.png", capsys)
    assert code == 1 and said in err and "Traceback" not in err
    assert err.startswith("dashboard: ") and err.count("\n") == 1


def test_an_error_answer_names_the_status(serve, tmp_path: Path, capsys) -> None:
    body = json.dumps({"status": "error", "error": "parse error at char 3"}).encode()
    server = serve(answer(400, body))
    code, err = run(server.url, tmp_path / "p.png", capsys)
    assert code == 1 and "HTTP 400: parse error at char 3" in err


def test_a_redirect_is_not_followed(serve, tmp_path: Path, capsys) -> None:
    elsewhere = serve(answer(200, json.dumps(GOOD).encode()))
    server = serve(answer(302, b"", {"Location": f"{elsewhere.url}/api/v1/query_range"}))
    code, err = run(server.url, tmp_path / "p.png", capsys)
    assert code == 1 and "redirects are not followed" in err
    assert elsewhere.paths == []


def test_a_proxy_from_the_environment_is_not_used(serve, tmp_path: Path) -> None:
    """The CLI in a process of its own (urllib builds its proxy table once per process)."""
    proxy = serve(answer(502, b"proxied"))
    server = serve(answer(200, json.dumps(GOOD).encode()))
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env |= {"http_proxy": proxy.url, "HTTP_PROXY": proxy.url, "all_proxy": proxy.url}
    done = subprocess.run(
        [sys.executable, "-m", "sglang_fleet.monitoring.dashboard", "--prometheus", server.url,
         "--minutes", "1", str(tmp_path / "p.png")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert proxy.paths == [] and server.paths


def test_an_answer_over_the_size_cap_is_refused(
    serve, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dashboard, "MAX_ANSWER_BYTES", 10_000, raising=False)
    big = dict(GOOD, padding="x" * 50_000)
    server = serve(answer(200, json.dumps(big).encode()))
    code, err = run(server.url, tmp_path / "p.png", capsys)
    assert code == 1 and "10000" in err


def test_a_slow_answer_ends_at_the_deadline(
    serve, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dashboard, "DEADLINE_S", 1.0, raising=False)
    body = json.dumps(GOOD).encode()

    def trickle(request: BaseHTTPRequestHandler) -> None:
        request.send_response(200)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        try:
            for byte in body[:20]:
                request.wfile.write(bytes([byte]))
                request.wfile.flush()
                time.sleep(0.25)
        except OSError:  # the client gave up at its deadline
            pass

    server = serve(trickle)
    started = time.monotonic()
    code, err = run(server.url, tmp_path / "p.png", capsys)
    assert code == 1 and "within 1 s" in err
    assert time.monotonic() - started < 4


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--prometheus", "http://user:pw@gw:9090"], "user:password@"),
        (["--prometheus", "ftp://gw"], "http://HOST:PORT"),
        (["--prometheus", "http://gw:99999"], "bad port"),
    ],
)
def test_a_bad_url_is_refused_without_printing_credentials(
    tmp_path: Path, capsys, argv: list[str], said: str
) -> None:
    code = dashboard.main([*argv, str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert code == 1 and said in err and "pw@" not in err


@pytest.mark.parametrize(
    "option", [["--minutes", "nan"], ["--minutes", "-5"], ["--minutes", "1e400"],
               ["--rate-interval", "5m\n"], ["--rate-interval", "0"]]
)  # fmt: skip
def test_bad_options_are_usage_errors(tmp_path: Path, capsys, option: list[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        dashboard.main(["--prometheus", "http://gw:9090", *option, str(tmp_path / "p.png")])
    assert raised.value.code == 2
    assert option[0] in capsys.readouterr().err


def test_a_bad_dashboard_file_is_one_clean_line(tmp_path: Path, capsys) -> None:
    for content, said in ((b"{not json", "is not JSON"), (b"[]", "no list of panels")):
        board = tmp_path / "board.json"
        board.write_bytes(content)
        code = dashboard.main(["--prometheus", "http://127.0.0.1:9", "--dashboard", str(board),
                               str(tmp_path / "p.png")])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 1 and said in err and "Traceback" not in err
