"""plugins/modules/sglang_smoke_run.py: the host's part of the smoke gate in one module run.

Run for real in a temporary folder: the client is written once and left alone while it is the
same, the key reaches the command on stdin only, the result comes back as text and a result
past the bound is refused, and check mode writes and runs nothing.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest
from conftest import load_plugin

smoke_run = load_plugin("plugins/modules/sglang_smoke_run.py")
KEY = "sk-very-secret"
CLIENT = b"PK\x05\x06" + bytes(18)  # the bytes of an empty zip archive stand in for the client


def params(tmp_path: Path, **change: object) -> dict:
    result = tmp_path / "state" / "llama" / "smoke" / "run.json"
    # Stands in for the client: reads the key from stdin, writes the key's length as the result.
    code = (
        "import json, sys; key = sys.stdin.readline().strip(); "
        f"open({str(result)!r}, 'w').write(json.dumps({{'key_length': len(key)}}))"
    )
    return {
        "client_zipapp": base64.b64encode(CLIENT).decode(),
        "client_path": str(tmp_path / "lib" / "smoke.pyz"),
        "result_path": str(result),
        "argv": [sys.executable, "-c", code],
        "api_key": KEY,
        "max_result_bytes": 1024,
        "journal_unit": "",
        "journal_lines": 0,
    } | change


def test_the_client_runs_with_the_key_on_stdin_and_its_result_comes_back(tmp_path: Path) -> None:
    given = params(tmp_path)
    done = smoke_run.run(given, check_mode=False)
    assert done["rc"] == 0 and done["client_changed"] is True
    assert json.loads(done["result"]) == {"key_length": len(KEY)}
    assert KEY not in " ".join(given["argv"])
    client = Path(given["client_path"])
    assert client.read_bytes() == CLIENT and client.stat().st_mode & 0o777 == 0o755
    assert smoke_run.run(given, check_mode=False)["client_changed"] is False


def test_a_client_that_is_not_base64_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="client_zipapp is not base64"):
        smoke_run.run(params(tmp_path, client_zipapp="not base64!"), check_mode=False)
    assert not (tmp_path / "lib" / "smoke.pyz").exists()


def test_a_failing_command_says_how_it_ended(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"]
    done = smoke_run.run(params(tmp_path, argv=argv), check_mode=False)
    assert (done["rc"], done["stderr_tail"], done["result"]) == (3, "boom", None)


def test_a_result_past_the_bound_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="over 8 bytes"):
        smoke_run.run(params(tmp_path, max_result_bytes=8), check_mode=False)


def test_check_mode_writes_and_runs_nothing(tmp_path: Path) -> None:
    given = params(tmp_path)
    assert smoke_run.run(given, check_mode=True) == {"changed": False, "client_changed": False}
    assert not Path(given["client_path"]).exists()
    assert not Path(given["result_path"]).exists()


def test_the_baseline_record_comes_back_in_the_same_run(tmp_path: Path) -> None:
    """The relative gate's last-known-good record is read in the benchmark's own module run (no
    slurp of its own): its text, None when there is none, an error past the bound."""
    record = tmp_path / "state" / "llama" / "lkg" / "meta.json"
    record.parent.mkdir(parents=True)
    record.write_text('{"smoke_result": {"output_throughput": 100.0}}')
    given = params(tmp_path, baseline_path=str(record), max_baseline_bytes=1024)
    assert smoke_run.run(given, check_mode=False)["baseline"] == record.read_text()
    assert "baseline" not in smoke_run.run(params(tmp_path), check_mode=False)
    missing = params(
        tmp_path, baseline_path=str(record.with_name("no.json")), max_baseline_bytes=1024
    )
    assert smoke_run.run(missing, check_mode=False)["baseline"] is None
    small = params(tmp_path, baseline_path=str(record), max_baseline_bytes=8)
    assert "error" in smoke_run.run(small, check_mode=False)["baseline"]
