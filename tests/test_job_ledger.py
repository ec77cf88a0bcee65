"""The job's ledger (sglang_fleet/job/ledger.py) and input checks (rows.py), without a server:
what a kill, a reboot or a full disk leaves is reconciled so that every row is in exactly one
file once, and inputs and outputs the job must not touch are refused by name."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

from sglang_fleet.job import ledger as ledger_mod
from sglang_fleet.job import rows
from sglang_fleet.job import shape as shape_mod
from sglang_fleet.job.command_line import main
from sglang_fleet.job.ledger import Ledger, LedgerError

IDENTITY = {"input_sha256": "abc", "input_path": "/in.jsonl", "rows": 100, "settings": {"a": 1}}


def line(key: str) -> bytes:
    return rows.dumps({"id": key, "status": "success", "text": f"answer of {key}"})


def open_ledger(tmp_path: Path, **kw: Any) -> Ledger:
    ledger = Ledger(str(tmp_path / "out.jsonl"), kw.pop("identity", IDENTITY), **kw)
    ledger.open()
    return ledger


def abandon(ledger: Ledger) -> None:
    """What a SIGKILL does to a run: its descriptors and lock go, nothing is synced."""
    for fd in ledger._fds.values():
        os.close(fd)
    ledger._fds.clear()
    if ledger._lock_fd is not None:
        os.close(ledger._lock_fd)
        ledger._lock_fd = None


def keys_in_files(tmp_path: Path) -> list[str]:
    paths = ledger_mod.file_paths(str(tmp_path / "out.jsonl"))
    found = []
    for name in ledger_mod.FILES:
        path = Path(paths[name])
        if path.exists():
            found += [json.loads(raw)["id"] for raw in path.read_bytes().splitlines()]
    return found


def test_a_reopened_ledger_holds_what_was_written(tmp_path: Path) -> None:
    ledger = open_ledger(tmp_path, sync_every=2)
    for n in range(5):
        ledger.record(f"r{n}", "error" if n == 3 else "output", line(f"r{n}"))
    ledger.close()
    again = open_ledger(tmp_path)
    assert sorted(again.entries) == [f"r{n}" for n in range(5)]
    assert again.counts == {"output": 4, "error": 1, "skipped": 0}
    assert again.reconciled.redone == 0 and not again.reconciled.cut_bytes
    with pytest.raises(LedgerError, match="already written"):
        again.record("r1", "output", line("r1"))
    again.close()
    assert ledger_mod.read_counts(str(tmp_path / "out.jsonl")) == {
        "output": 4, "error": 1, "skipped": 0, "total": 100,
    }  # fmt: skip


def test_a_kill_between_the_ledger_line_and_the_row_runs_the_row_again(tmp_path: Path) -> None:
    ledger = open_ledger(tmp_path, sync_every=100)
    ledger.record("r0", "output", line("r0"))
    ledger.sync()
    ledger.record("r1", "output", line("r1"))
    out = tmp_path / "out.jsonl"
    # The kill came after r1's ledger line, in the middle of its row's write.
    data = out.read_bytes()
    out.write_bytes(data[: -len(line("r1")) // 2])
    abandon(ledger)
    again = open_ledger(tmp_path)
    assert sorted(again.entries) == ["r0"]
    assert again.reconciled.redone == 1 and again.reconciled.cut_bytes["output"] > 0
    again.record("r1", "output", line("r1"))
    again.close()
    assert sorted(keys_in_files(tmp_path)) == ["r0", "r1"]


def test_a_reboot_that_lost_unsynced_lines_runs_those_rows_again(tmp_path: Path) -> None:
    ledger = open_ledger(tmp_path, sync_every=100)
    for n in range(3):
        ledger.record(f"r{n}", "output", line(f"r{n}"))
    ledger.sync()
    for n in range(3, 6):
        ledger.record(f"r{n}", "output", line(f"r{n}"))
    abandon(ledger)
    # The machine went down: the output's last two lines never reached the disk, and a zero-filled
    # block stands where the first of them was (what some file systems leave).
    out = tmp_path / "out.jsonl"
    data = out.read_bytes()
    cut = len(line("r4")) + len(line("r5"))
    out.write_bytes(data[:-cut] + b"\0" * 10)
    again = open_ledger(tmp_path)
    assert sorted(again.entries) == ["r0", "r1", "r2", "r3"]
    assert again.reconciled.redone == 2
    for n in (4, 5):
        again.record(f"r{n}", "output", line(f"r{n}"))
    again.close()
    assert sorted(keys_in_files(tmp_path)) == [f"r{n}" for n in range(6)]


def test_a_torn_ledger_line_is_cut(tmp_path: Path) -> None:
    ledger = open_ledger(tmp_path)
    ledger.record("r0", "output", line("r0"))
    ledger.close()
    with open(tmp_path / "out.jsonl.ledger", "ab") as handle:
        handle.write(b'{"key": "r1", "fi')
    again = open_ledger(tmp_path)
    assert sorted(again.entries) == ["r0"] and again.reconciled.cut_bytes["ledger"] == 17
    again.close()


def test_a_full_disk_writes_nothing_half_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = open_ledger(tmp_path)
    ledger.record("r0", "output", line("r0"))
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    real_write = os.write
    written = []

    def full(fd: int, data: Any) -> int:
        if written:  # the ledger line went in; the row's line meets a full disk half way
            real_write(fd, bytes(data)[:5])
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(fd)
        return real_write(fd, data)

    monkeypatch.setattr(ledger_mod.os, "write", full)
    with pytest.raises(LedgerError, match="the disk is full; nothing was half-written"):
        ledger.record("r1", "output", line("r1"))
    monkeypatch.setattr(ledger_mod.os, "write", real_write)
    assert {p.name: p.stat().st_size for p in tmp_path.iterdir()} == sizes
    ledger.close()
    again = open_ledger(tmp_path)
    assert sorted(again.entries) == ["r0"] and again.reconciled.redone == 0
    again.close()


def test_another_input_or_other_settings_are_refused(tmp_path: Path) -> None:
    open_ledger(tmp_path).close()
    with pytest.raises(LedgerError, match="holds the rows of another input"):
        open_ledger(tmp_path, identity={**IDENTITY, "input_sha256": "def"})
    with pytest.raises(LedgerError, match="written with other job settings"):
        open_ledger(tmp_path, identity={**IDENTITY, "settings": {"a": 2}})


def test_rows_without_a_ledger_are_not_ours(tmp_path: Path) -> None:
    (tmp_path / "out.jsonl").write_text('{"id": "x"}\n')
    with pytest.raises(LedgerError, match="says nothing of them: not this job's output"):
        open_ledger(tmp_path)


def test_one_run_of_a_job_at_a_time(tmp_path: Path) -> None:
    first = open_ledger(tmp_path)
    with pytest.raises(LedgerError, match="another run of this job holds"):
        open_ledger(tmp_path)
    first.close()


def test_a_file_shorter_than_its_sync_mark_is_refused(tmp_path: Path) -> None:
    ledger = open_ledger(tmp_path)
    ledger.record("r0", "output", line("r0"))
    ledger.close()
    (tmp_path / "out.jsonl").write_bytes(b"")
    with pytest.raises(LedgerError, match="changed by something else"):
        open_ledger(tmp_path)


# --- inputs and outputs the job must not touch ---------------------------------------------


def run_main(*argv: str) -> int:
    return main(["run", *argv, "--server", "http://127.0.0.1:9"])


def test_inputs_that_are_no_regular_files_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text("{}\n")
    folder = tmp_path / "jobs"
    folder.mkdir()
    (folder / "link.jsonl").symlink_to(outside)
    for path, said in (
        (fifo, "not a regular file"),
        ("/dev/zero", "not a regular file"),
        (tmp_path, "not a regular file"),
        (folder / "link.jsonl", "a link out of its folder"),
        (tmp_path / "missing.jsonl", "cannot read it"),
    ):
        assert run_main(str(path), "--output", str(tmp_path / "o.jsonl")) == 2
        assert said in capsys.readouterr().err, path


def test_the_output_may_not_be_the_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "a", "conversations": [{"role": "user", "content": "x"}]}\n')
    assert run_main(str(source), "--output", str(source)) == 2
    assert "its output file would be the input itself" in capsys.readouterr().err
    (tmp_path / "o_error.jsonl").symlink_to(source)
    assert run_main(str(source), "--output", str(tmp_path / "o.jsonl")) == 2
    assert "its error file would be the input itself" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--api-key", "--api-key=", "--api-k", "--api"])
def test_the_key_is_never_an_argument(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An abbreviation would have read the key as --api-key-file's path; an unknown option
    would have been echoed with its value."""
    words = [f"{option}sk-canary"] if option.endswith("=") else [option, "sk-canary"]
    with pytest.raises(SystemExit) as stopped:
        main(["run", "in", "--output", "o", "--server", "http://x", *words])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "sk-canary" not in err
    assert "is not accepted" in err or "not shown: one may be a secret" in err


def test_a_long_row_is_skipped_without_being_held(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    with source.open("wb") as handle:
        handle.write(b'{"id": "big", "x": "' + b"y" * (rows.MAX_ROW_BYTES + 10) + b'"}\n')
        handle.write(b'{"id": "small", "conversations": [{"role": "user", "content": "x"}]}')
    index = rows.scan(str(source))
    assert [(line.key, line.skip is None) for line in index.lines] == [
        ("line:1", False),
        ("small", True),
    ]


# --- the job's shape ------------------------------------------------------------------------


def test_a_shape_is_measured_from_the_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = open_ledger(tmp_path)
    ledger.record("a", "output", line("a"), usage=[(120, 40), (300, 40)])
    ledger.record("b", "output", line("b"), usage=[(80, 12)])
    ledger.record("c", "error", line("c"), why="row")
    ledger.close()
    assert main(["shape", str(tmp_path / "out.jsonl"), "--json"]) == 0
    shape = json.loads(capsys.readouterr().out)
    assert shape["source"].startswith("measured")
    assert shape["lengths"] == "120:40,300:40,80:12"
    assert (shape["pairs"], shape["mean_prompt_tokens"], shape["mean_output_tokens"]) == (
        3,
        167,
        31,
    )


def test_a_shape_is_estimated_from_an_input_before_any_row_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "in.jsonl"
    talk = [
        {"role": "system", "content": "s" * 40},
        {"role": "user", "content": "u" * 400},
        {"role": "assistant", "content": "old"},
        {"role": "user", "content": "v" * 80},
    ]
    batch = {
        "custom_id": "b", "url": "/v1/completions", "body": {"prompt": "p" * 20, "max_tokens": 7}
    }  # fmt: skip
    source.write_text(json.dumps({"id": "a", "conversations": talk}) + "\n" + json.dumps(batch))
    assert main(["shape", str(source), "--max-tokens", "50"]) == 0
    # 10 + 100 tokens, then that plus its answer (50) and 20 more; the batch line's own 7.
    assert capsys.readouterr().out.strip() == "110:50,180:50,5:7"
    open_ledger(tmp_path, identity={**IDENTITY, "input_path": str(source)}).close()
    assert main(["shape", str(tmp_path / "out.jsonl"), "--max-tokens", "50", "--json"]) == 0
    assert "estimated from the input" in json.loads(capsys.readouterr().out)["source"]


def test_a_large_shape_is_sampled_the_same_way_each_time() -> None:
    pairs = [(n, n % 7 + 1) for n in range(1, 10_000)]
    first = shape_mod.sample(pairs, 256)
    assert first == shape_mod.sample(pairs, 256) and len(first) == 256
    assert len(shape_mod.sample(pairs, 10**6)) == 4096
