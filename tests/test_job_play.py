"""playbooks/job.yml's decisions on the control node (roles/sglang_job, docs/JOB.md): the
sglang_job_* settings typed, the input read, the job's record, the targets and their in-flight
requests, the unit's command line and what `status` shows; and the runner's per-server
concurrency that the unit's command line uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_fleet.job import command_line


def write_rows(path: Path, count: int, words: int = 8) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        for number in range(count):
            row = {
                "id": f"row-{number}",
                "conversations": [{"role": "user", "content": " ".join(["word"] * words)}],
            }
            handle.write(json.dumps(row) + "\n")
    return path


# --- the runner: one --concurrency, or one per --server -------------------------------------
def _capacities(*argv: str) -> list[int]:
    ns = command_line.parser().parse_args(["run", "in.jsonl", "--output", "out.jsonl", *argv])
    return [server.capacity for server in command_line._pool(ns, "").servers]


def test_one_concurrency_holds_for_every_server_and_one_each_pairs_in_order() -> None:
    a, b = "http://a:1", "http://b:1"
    assert _capacities("--server", a, "--server", b) == [16, 16]
    assert _capacities("--server", a, "--server", b, "--concurrency", "3") == [3, 3]
    assert _capacities(
        "--server", a, "--concurrency", "422", "--server", b, "--concurrency", "7"
    ) == [422, 7]


def test_a_concurrency_count_that_matches_no_rule_is_bad_usage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = write_rows(tmp_path / "in.jsonl", 2)
    argv = ["run", str(rows), "--output", str(tmp_path / "out.jsonl")]
    for url in ("http://127.0.0.1:9", "http://127.0.0.1:10"):
        argv += ["--server", url]
    code = command_line.main(
        [*argv, "--concurrency", "1", "--concurrency", "2", "--concurrency", "3"]
    )
    assert code == command_line.USAGE
    assert "--concurrency given 3 times for 2 --server" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
