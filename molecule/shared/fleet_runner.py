"""Run the project's playbooks against a Molecule scenario's hosts and read the events.

Verifiers assert on ansible-runner's structured events (which host changed, which task failed
and with what message), never on scraped text.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ansible_runner

REPO = Path(os.environ.get("SGLANG_FLEET_REPO", Path(__file__).resolve().parents[2]))


@dataclass
class PlaybookRun:
    """What one ansible-playbook run did, from its events."""

    rc: int
    status: str
    events: list[dict[str, Any]] = field(repr=False)

    @property
    def task_headers(self) -> int:
        """Tasks the run started, each once per play however many hosts ran it (what
        bench/rollout_overhead.py counts as task headers)."""
        return sum(1 for e in self.events if e.get("event") == "playbook_on_task_start")

    def _results(self, event_name: str) -> list[dict[str, Any]]:
        return [e["event_data"] for e in self.events if e.get("event") == event_name]

    @property
    def failures(self) -> list[tuple[str, str, str]]:
        """(host, task, message) of every failed task or loop item not ignored.

        A failed loop reports "One or more items failed": the items' own messages are what an
        operator reads, so they are listed instead.
        """
        out = []
        for kind in ("runner_on_failed", "runner_item_on_failed"):
            for data in self._results(kind):
                if data.get("ignore_errors"):
                    continue
                res = data.get("res", {})
                if kind == "runner_on_failed" and res.get("results"):
                    continue  # its items are reported one by one
                out.append((data.get("host", ""), data.get("task", ""), str(res.get("msg", res))))
        return out

    def changed_tasks(self, host: str | None = None) -> list[str]:
        names = []
        for data in self._results("runner_on_ok"):
            if data.get("res", {}).get("changed") and host in (None, data.get("host")):
                names.append(data.get("task", ""))
        for data in self._results("runner_item_on_ok"):
            if data.get("res", {}).get("changed") and host in (None, data.get("host")):
                names.append(data.get("task", ""))
        return names

    def failed_results(self) -> list[dict[str, Any]]:
        """The result of every failed task, rescued or not, in order."""
        return [d.get("res", {}) for d in self._results("runner_on_failed")]

    def task_results(self, task: str) -> list[dict[str, Any]]:
        return [
            d.get("res", {})
            for kind in ("runner_on_ok", "runner_on_failed", "runner_on_skipped")
            for d in self._results(kind)
            if d.get("task") == task
        ]

    def diffs(self) -> list[dict[str, Any]]:
        out = []
        for kind in ("runner_on_ok", "runner_item_on_ok"):
            for data in self._results(kind):
                diff = data.get("res", {}).get("diff")
                if diff:
                    out.extend(diff if isinstance(diff, list) else [diff])
        return out

    def text(self) -> str:
        """Everything the run showed and reported: its output at the verbosity it ran with, and
        every event's data (task results, arguments, warnings), as one string to search."""
        return "\n".join(
            [e.get("stdout", "") for e in self.events]
            + [json.dumps(e.get("event_data", {}), default=str) for e in self.events]
        )

    def stats(self) -> dict[str, Any]:
        for event in reversed(self.events):
            if event.get("event") == "playbook_on_stats":
                return event["event_data"]
        return {}


def run_playbook(
    playbook: str,
    extravars: dict[str, Any] | None = None,
    cmdline: str = "",
    *,
    limit: str | None = None,
    timeout: int = 600,
    env_overrides: dict[str, str] | None = None,
    interrupt_after: Callable[[dict[str, Any]], bool] | None = None,
) -> PlaybookRun:
    """Run playbooks/<playbook> against the scenario's inventory, as an operator would.

    env_overrides: environment for this run only (an inventory's env lookups read it).
    interrupt_after: a test of each event; once it holds, the run is killed as an operator's
    Ctrl-C or a lost controller would end it (status "canceled").
    """
    inventory = os.environ["MOLECULE_INVENTORY_FILE"]
    # PYTHONPATH too: the scenario deploy finds the controller package in its installed
    # collection's project (molecule/deploy/molecule.yml).
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("ANSIBLE_", "MOLECULE_")) or k == "PYTHONPATH"
    }
    env.update(env_overrides or {})
    env.setdefault("ANSIBLE_CONFIG", str(REPO / "ansible.cfg"))
    seen = {"stop": False}

    def watch(event: dict[str, Any]) -> bool:
        if interrupt_after is not None and interrupt_after(event):
            seen["stop"] = True
        return True  # keep every event

    # Without interrupt_after, ansible-runner keeps its own handler (Ctrl-C cancels the run).
    cancel = {"cancel_callback": lambda: seen["stop"]} if interrupt_after else {}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fleet-runner-") as private:
        result = ansible_runner.run(
            private_data_dir=private,
            playbook=str(REPO / "playbooks" / playbook),
            inventory=inventory,
            extravars=extravars or {},
            cmdline=cmdline or None,
            limit=limit,
            envvars=env,
            quiet=True,
            timeout=timeout,
            event_handler=watch,
            **cancel,
        )
        events = list(result.events)
    run = PlaybookRun(rc=result.rc, status=result.status, events=events)
    _keep_profile(playbook, extravars, run, time.monotonic() - began)
    return run


def _keep_profile(playbook: str, extravars: Any, run: PlaybookRun, wall_s: float) -> None:
    """One line per run in .cache/molecule-logs/<scenario>.runs.jsonl: the playbook, its wall
    time, task headers and its slowest tasks (where a verify's minutes go; docs/TESTING.md)."""
    scenario = os.environ.get("MOLECULE_SCENARIO_NAME")
    if not scenario:
        return
    tasks = [
        (float(d.get("duration") or 0), d.get("host", ""), d.get("task", ""))
        for kind in ("runner_on_ok", "runner_on_failed", "runner_on_skipped")
        for d in run._results(kind)
    ]
    line = {
        "playbook": playbook,
        "extravars": sorted(extravars or {}),
        "rc": run.rc,
        "wall_s": round(wall_s, 1),
        "task_headers": run.task_headers,
        "slowest": [[round(t, 1), h, n] for t, h, n in sorted(tasks, reverse=True)[:8]],
    }
    logs = REPO / ".cache" / "molecule-logs"
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / f"{scenario}.runs.jsonl").open("a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def generate(host: Any, port: int, key: str | None = None) -> dict[str, Any]:
    """Ask the server on the test host for 4 tokens, as a client there would (testinfra host).

    Raises AssertionError (testinfra's check_output) when the request fails, e.g. 401.
    """
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
    script = (
        "import json, sys, urllib.request;"
        f"r = urllib.request.Request('http://127.0.0.1:{port}/generate',"
        f" data=json.dumps({body!r}).encode(), headers={headers!r});"
        "print(urllib.request.urlopen(r, timeout=30).read().decode())"
    )
    return json.loads(host.check_output("python3 -c %s", script))
