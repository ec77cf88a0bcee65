"""plugins/modules/sglang_start_facts.py, run for real: the journal read through stand-in
`systemctl` and `journalctl` programs on PATH, /server_info from a loopback HTTP server, the store
from a temporary folder. What is checked: only the matching lines of the current start come back, at
most max_lines and within the time bound; only the asked parts of /server_info leave the host,
the key goes as a bearer token; the store is read inside its folder and never through a
symlink."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import load_plugin

module = load_plugin("plugins/modules/sglang_start_facts.py")
KEY = "sk-start-facts-secret"
INFO = {
    "version": "0.5.23",
    "api_key": KEY,
    "max_total_num_tokens": 4096,
    "internal_states": [{"memory_usage": {"weight": 1.5, "kvcache": 2.0}, "other": 1}, {"x": 2}],
}
PATHS = ["version", "max_total_num_tokens", "internal_states.0.memory_usage", "missing.key"]


@pytest.fixture
def journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Stand-ins for systemctl and journalctl; journal.txt holds what journalctl prints for
    the invocation `inv-1` (and nothing for any other)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text("#!/bin/sh\necho inv-1\n")
    text = tmp_path / "journal.txt"
    (bin_dir / "journalctl").write_text(
        '#!/bin/sh\ncase "$*" in *_SYSTEMD_INVOCATION_ID=inv-1*) '
        f"cat {text}; [ -f {tmp_path}/hang ] && exec sleep 30 ;; esac\n"
    )
    for name in ("systemctl", "journalctl"):
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return text


@pytest.fixture
def server() -> Iterator[dict[str, Any]]:
    seen: dict[str, Any] = {"info": INFO, "headers": []}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen["headers"].append(self.headers.get("Authorization"))
            body = json.dumps(seen["info"]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    seen["port"] = httpd.server_address[1]
    yield seen
    httpd.shutdown()
    httpd.server_close()


def params(folder: Path, port: int, **change: Any) -> dict[str, Any]:
    return {
        "unit": "sglang@tiny.service",
        "port": port,
        "api_key": KEY,
        "line_pattern": r"kv cache is allocated|max_total_num_tokens=",
        "max_lines": 2000,
        "server_info_paths": PATHS,
        "folder": str(folder),
        "store_name": "calibration.json",
        "timeout": 5,
    } | change


def test_one_read_gives_the_lines_the_asked_server_info_and_the_store(
    tmp_path: Path, journal: Path, server: dict[str, Any]
) -> None:
    journal.write_text(
        "server_args=ServerArgs(api_key='sk-start-facts-secret')\n"
        "KV Cache is allocated. #tokens: 4096, K size: 0.01 GB\n"
        "unrelated line\n"
        "max_total_num_tokens=4096, chunked_prefill_size=2048\n"
    )
    (tmp_path / "calibration.json").write_text('{"records": []}\n')
    done = module.read(params(tmp_path, server["port"]))
    assert done["invocation_id"] == "inv-1" and done["changed"] is False
    assert done["lines"].splitlines() == [
        "KV Cache is allocated. #tokens: 4096, K size: 0.01 GB",
        "max_total_num_tokens=4096, chunked_prefill_size=2048",
    ]
    assert done["server_info"] == {
        "version": "0.5.23",
        "max_total_num_tokens": 4096,
        "internal_states": [{"memory_usage": {"weight": 1.5, "kvcache": 2.0}}],
    }
    assert server["headers"] == [f"Bearer {KEY}"]
    assert KEY not in json.dumps(done)
    assert done["store"] == '{"records": []}\n'


def test_the_lines_are_bounded_in_count_and_time(
    tmp_path: Path, journal: Path, server: dict[str, Any]
) -> None:
    journal.write_text("max_total_num_tokens=1\n" * 50_000)
    done = module.read(params(tmp_path, server["port"], max_lines=7))
    assert len(done["lines"].splitlines()) == 7
    journal.write_text("max_total_num_tokens=1\n" * 3)
    (tmp_path / "hang").touch()  # journalctl prints, then never ends
    started = time.monotonic()
    done = module.read(params(tmp_path, server["port"], timeout=1))
    assert time.monotonic() - started < 10
    assert len(done["lines"].splitlines()) == 3


def test_a_server_that_does_not_answer_leaves_the_rest(tmp_path: Path, journal: Path) -> None:
    journal.write_text("max_total_num_tokens=1\n")
    done = module.read(params(tmp_path, 9, timeout=1))  # nothing listens on port 9
    assert done["server_info"] is None and "cannot reach" in done["server_info_error"]
    assert done["lines"] == "max_total_num_tokens=1" and done["store"] is None


def test_the_store_is_never_read_through_a_symlink_or_outside_its_folder(
    tmp_path: Path, journal: Path, server: dict[str, Any]
) -> None:
    journal.write_text("")
    secret = tmp_path / "elsewhere"
    secret.write_text("not ours")
    folder = tmp_path / "state"
    folder.mkdir()
    (folder / "calibration.json").symlink_to(secret)
    with pytest.raises(ValueError, match="not a regular file"):
        module.read(params(folder, server["port"]))
    with pytest.raises(ValueError, match="is not a file name inside"):
        module.read(params(folder, server["port"], store_name="../elsewhere"))


@pytest.mark.parametrize(
    ("paths", "kept"),
    [
        (["a"], {"a": [1, 2]}),
        (["a.1"], {"a": [2]}),
        (["b.c", "b.d.0"], {"b": {"c": 3, "d": [4]}}),
        (["a.5", "b.x", "z"], {}),
    ],
)
def test_pick_keeps_only_the_asked_paths(paths: list[str], kept: dict[str, Any]) -> None:
    document = {"a": [1, 2], "b": {"c": 3, "d": [4, 5], "key": "secret"}}
    assert module.pick(document, paths) == kept
