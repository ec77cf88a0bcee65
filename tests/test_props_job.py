"""Property-based test of the job's ledger (Hypothesis; profiles in tests/conftest.py; issue
45): runs stopped at any instant, by a kill or a reboot, and resumed, leave every row in the
files exactly once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from test_job_ledger import abandon, keys_in_files, line, open_ledger


def durable_points(folder: Path) -> tuple[int, int]:
    """(ledger bytes up to and with its last sync mark, output bytes that mark vouches for):
    what is on disk whatever the machine did since."""
    data = (folder / "out.jsonl.ledger").read_bytes()
    ledger_end, output_end, offset = 0, 0, 0
    for raw in data.splitlines(keepends=True):
        offset += len(raw)
        if raw.endswith(b"\n") and raw.startswith(b'{"synced"'):
            ledger_end, output_end = offset, json.loads(raw)["synced"]["output"]
    return ledger_end, output_end


@given(
    runs=st.lists(
        st.tuples(st.integers(1, 9), st.floats(0, 1), st.floats(0, 1), st.booleans()),
        min_size=1,
        max_size=5,
    )
)
def test_any_kill_or_reboot_leaves_each_row_once(tmp_path_factory: Any, runs: list) -> None:
    """Runs stopped at any instant: a kill leaves every byte written (the tail of a line
    cut where the write stopped), a reboot may lose anything after the last sync mark of each
    file, independently, or leave zeros there. Resumed each time, then finished: every row is
    in the files once, none lost, none twice."""
    folder = tmp_path_factory.mktemp("kills")
    everything = [f"r{n}" for n in range(25)]
    for rows_now, ledger_at, output_at, zeros in runs:
        ledger = open_ledger(folder, sync_every=4)
        todo = [key for key in everything if key not in ledger.entries][:rows_now]
        for key in todo:
            ledger.record(key, "output", line(key))
        abandon(ledger)
        keep_ledger, keep_output = durable_points(folder)
        for name, durable, at in (
            ("out.jsonl.ledger", keep_ledger, ledger_at),
            ("out.jsonl", keep_output, output_at),
        ):
            path = folder / name
            size = path.stat().st_size
            cut = durable + int((size - durable) * at)
            with open(path, "r+b") as handle:
                handle.truncate(cut)
                if zeros and cut < size:
                    handle.seek(cut)
                    handle.write(b"\0" * min(16, size - cut))
    ledger = open_ledger(folder)
    for key in [key for key in everything if key not in ledger.entries]:
        ledger.record(key, "output", line(key))
    ledger.close()
    assert sorted(keys_in_files(folder)) == sorted(everything)
