"""Every JSON reader of host or server data has a depth bound (issue 33: deeply nested
/server_info or last-known-good JSON ended in RecursionError). One helper,
plugins/module_utils/bounded_json.py, used by the modules, action plugins, filters and the package;
each
reader below used to end in a traceback on the same few kilobytes of brackets."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import load_plugin

from sglang_fleet import ansible_values as plain_mod
from sglang_fleet.smoke import smoke_picture as report

bounded = load_plugin("plugins/module_utils/bounded_json.py")
DEEP = "[" * 100_000 + "]" * 100_000
NESTED_40 = "[" * 40 + "]" * 40


def test_the_helper_refuses_deep_json_naming_what_was_read() -> None:
    for text in (DEEP, NESTED_40, '{"a": ' * 50 + "1" + "}" * 50):
        with pytest.raises(bounded.TooDeep, match=r"^lkg/meta\.json: nested deeper than 32"):
            bounded.loads(text, "lkg/meta.json")
    assert bounded.loads("[" * 32 + "]" * 32, "x") is not None
    with pytest.raises(ValueError, match=r"^x: not JSON"):
        bounded.loads("{", "x")
    with pytest.raises(ValueError, match=r"^x: not UTF-8"):
        bounded.loads(b"\xff\xfe\xfd", "x")


def test_the_last_known_good_module_reads_a_deep_record_as_an_error(tmp_path: Path) -> None:
    lkg = load_plugin("plugins/modules/sglang_last_known_good.py")
    folder = tmp_path / "lkg"
    folder.mkdir()
    (folder / "meta.json").write_text(DEEP)
    with pytest.raises(ValueError, match="nested deeper"):
        lkg.restore({"lkg_dir": str(folder), "files": []}, True, lambda: None)
    kept = lkg.keep({"lkg_dir": str(folder), "files": [], "absent": [], "record": {"a": 1}}, True)
    assert kept["previous"] is None


def test_the_host_state_reads_a_deep_record_as_a_difference(tmp_path: Path) -> None:
    state = load_plugin("plugins/modules/sglang_host_state.py")
    record = tmp_path / "meta.json"
    record.write_text(DEEP)
    found = state.check_record({"path": str(record), "key": "config_hash", "value": "x"})
    assert len(found) == 1 and "unreadable" in found[0] and "nested deeper" in found[0]


def test_the_check_mode_filter_reads_a_deep_record_as_none() -> None:
    server_filters = load_plugin("plugins/filter/sglang_server.py")
    assert server_filters._lkg_record(DEEP) is None


def test_a_deep_lock_file_is_a_damaged_lock() -> None:
    lock = load_plugin("plugins/modules/fleet_lock.py")
    found = lock.parse(DEEP.encode(), 0.0)
    assert found.record is None and "nested too deep" in found.problem


def test_a_deep_router_answer_is_text_not_a_traceback() -> None:
    workers = load_plugin("plugins/modules/sglang_router_workers.py")
    assert workers._decode(DEEP.encode()) == DEEP


def test_a_deep_safetensors_index_is_a_read_error(tmp_path: Path) -> None:
    host_read = load_plugin("plugins/module_utils/host_read.py")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(DEEP)
    found = host_read.read_model(str(tmp_path))
    assert found["weight_bytes"] is None and "nested deeper" in found["error"]


@pytest.fixture
def deep_server_info() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = DEEP.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_deep_server_info_is_a_named_error(deep_server_info: int) -> None:
    facts = load_plugin("plugins/modules/sglang_start_facts.py")
    info, error = facts.server_info(deep_server_info, "", ["max_total_num_tokens"], 5.0)
    assert info is None and error == "/server_info: nested deeper than 32 levels"


def test_json_text_handed_to_a_filter_is_bounded() -> None:
    with pytest.raises(ValueError, match=r"lkg record is not valid JSON: .*nested deeper"):
        plain_mod.plain_mapping(DEEP, "lkg record")


def test_the_report_of_a_deep_or_broken_result_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for text in (DEEP, "{", json.dumps([1])):
        result = tmp_path / "result.json"
        result.write_text(text)
        with pytest.raises(SystemExit) as done:
            report.main([str(result), str(tmp_path / "out.png")])
        assert done.value.code == 2
        assert str(result) in capsys.readouterr().err
