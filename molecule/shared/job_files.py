"""A job's input for a scenario, and what the job left on its host (playbooks/job.yml,
roles/sglang_job, docs/JOB.md): test infrastructure for the fleet and real_sglang scenarios.

    rows = conversation_rows(2400, words)
    write_input(path, rows, ["not json"])
    job = JobOnHost("fleet-gpu1", "fleet")
    job.status()                 # the runner's `status --json`
    ended = job.ended()          # {"output": [...], "error": [...], "skipped": [...]}

Reads go through `docker exec` on the scenario's container (named as its platform): a polling
thread reads the job's status several times a second, and testinfra's ansible backend starts an
ansible process for every command.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

STATE_DIR = "/var/lib/sglang-job"
PYTHON = "/opt/sglang-job/bin/python"
PROGRAM = "/usr/local/lib/sglang-fleet/job.pyz"


def conversation_rows(
    count: int, words: Sequence[str], prefix: str = "row"
) -> list[dict[str, Any]]:
    """SpecForge rows, each asking its own prompt (random words, seeded by its number)."""
    rows = []
    for number in range(count):
        rng = random.Random(number)
        rows.append(
            {
                "id": f"{prefix}-{number}",
                "conversations": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": " ".join(rng.choices(list(words), k=8))},
                    {"role": "assistant", "content": "an old answer, regenerated"},
                ],
                "source": "scenario",
            }
        )
    return rows


def write_input(path: Path, rows: list[dict[str, Any]], bad_lines: Sequence[str] = ()) -> Path:
    """One JSON line per row, then the bad lines (which the job skips with their reason)."""
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
        for line in bad_lines:
            handle.write(line + "\n")
    return path


class JobOnHost:
    """The job NAME on a test host's container: its status, unit and files."""

    def __init__(self, container: str, name: str) -> None:
        self.container, self.name = container, name
        self.unit = f"sglang-job@{name}.service"
        self.output = f"{STATE_DIR}/{name}/output/{name}.jsonl"

    def run(self, *argv: str, check: bool = True) -> str:
        done = subprocess.run(
            ["docker", "exec", self.container, *argv], capture_output=True, text=True, check=False
        )
        if check:
            assert done.returncode == 0, f"{argv}: {done.stderr}"
        return done.stdout

    def status(self) -> dict[str, Any]:
        """The runner's status (the ledger's counts, and its figures while it runs)."""
        return json.loads(self.run(PYTHON, PROGRAM, "status", self.output, "--json"))

    def left(self) -> int:
        return int(self.status()["rows"]["left"])

    def unit_state(self) -> dict[str, str]:
        out = self.run(
            "systemctl", "show", "-p", "ActiveState", "-p", "SubState", "-p", "NRestarts",
            "-p", "UnitFileState", "-p", "MainPID", "-p", "InvocationID", self.unit,
        )  # fmt: skip
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def kill(self) -> None:
        """SIGKILL to the runner, as the kernel's OOM killer or a lost host would end it."""
        self.run("systemctl", "kill", "--signal=SIGKILL", self.unit)

    def journal(self) -> str:
        return self.run("journalctl", "--no-pager", "-o", "cat", "-u", self.unit)

    def wait(self, check: Callable[[], bool], timeout: float, what: str) -> float:
        began = time.monotonic()
        while not check():
            assert time.monotonic() - began < timeout, f"not within {timeout} s: {what}"
            time.sleep(0.5)
        return time.monotonic() - began

    def ended(self) -> dict[str, list[dict[str, Any]]]:
        """Every line of the output, error and skipped files, parsed."""
        stem = self.output.removesuffix(".jsonl")
        files = {"output": self.output, "error": f"{stem}_error.jsonl",
                 "skipped": f"{stem}_skipped.jsonl"}  # fmt: skip
        return {
            name: [json.loads(line) for line in self.run("cat", path).splitlines() if line]
            for name, path in files.items()
        }


def row_key(record: dict[str, Any]) -> str:
    """A row's id as its output, error or skipped line carries it: a batch line's custom_id, a
    conversation row's id, a skipped line that is not JSON by its line number."""
    if "custom_id" in record:
        return str(record["custom_id"])
    return str(record.get("id", f"line:{record.get('line')}"))


def where_each_row_ended(ended: dict[str, list[dict[str, Any]]]) -> Counter[str]:
    """How often each row appears across the three files."""
    return Counter(row_key(record) for records in ended.values() for record in records)
