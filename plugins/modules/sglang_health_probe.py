#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module: one look at an SGLang systemd unit: health endpoint, unit state, journal."""

from __future__ import annotations

DOCUMENTATION = r"""
module: sglang_health_probe
short_description: Probe an SGLang server once (health endpoint, unit state, fatal log lines)
description:
  - Asks C(/health_generate) once (a real one-token generation), reads the systemd unit's state and
    scans the unit's journal since a given time for fatal start-up errors (out of memory, "Not
    enough memory", tracebacks, NCCL errors).
  - Read-only. The C(sglang_wait_healthy) action calls it in a loop and prints progress.
options:
  unit:
    description: systemd unit of the server.
    type: str
    required: true
  url:
    description: Health URL (C(/health_generate) on the server's port).
    type: str
    required: true
  since:
    description: Unix time; only journal lines from then on are read.
    type: float
    required: true
  request_timeout:
    description: Seconds one health request may take (SGLang answers within 20 s or says 503).
    type: float
    default: 25
  restarts_baseline:
    description: The unit's NRestarts before this start (systemd keeps counting across starts).
    type: int
    default: 0
  fatal_patterns:
    description: Regular expressions that mark a start as failed when a log line matches.
    type: list
    elements: str
    default: []
author: sglang-fleet maintainers (@sglang-fleet)
"""

EXAMPLES = r"""
- name: Probe once
  sglang_fleet.fleet.sglang_health_probe:
    unit: sglang@kimi.service
    url: http://127.0.0.1:8000/health_generate
    since: "{{ ansible_date_time.epoch }}"
"""

RETURN = r"""
state:
  description: C(healthy) (HTTP 200), C(starting) (no answer or 503 while the unit runs) or
    C(failed) (unit dead, restarted, or a fatal log line).
  type: str
  returned: always
http_status:
  description: HTTP status of the health request, or null when no answer.
  type: int
  returned: always
active_state:
  description: The unit's ActiveState/SubState.
  type: str
  returned: always
n_restarts:
  description: How often systemd restarted the unit since this start (NRestarts minus the baseline).
  type: int
  returned: always
cause:
  description: Why the start failed (the first fatal line, or the unit's exit status).
  type: str
  returned: when state is failed
last_log_line:
  description: The latest journal line of the unit (start-up progress).
  type: str
  returned: always
log_tail:
  description: The last 25 journal lines since C(since).
  type: list
  returned: always
"""

import re

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.fleet_http import (
    HttpError,
    request,
)

DEFAULT_FATAL = [
    r"CUDA out of memory",
    r"OutOfMemoryError",
    r"Not enough memory",
    r"Not enough host memory",
    r"Traceback \(most recent call last\)",
    r"NCCL error",
    r"RuntimeError:",
    r"Loaded weights leave no GPU memory",
    r"(?i)address already in use",
]

# A journal line is cut here: a start-up line is a few hundred characters.
MAX_LINE_CHARS = 64 * 1024


def unit_state(module: AnsibleModule, unit: str) -> dict[str, str]:
    props = "ActiveState,SubState,NRestarts,ExecMainStatus,Result"
    _rc, out, _err = module.run_command(["systemctl", "show", unit, f"--property={props}"])
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def log_lines(text: str) -> list[str]:
    """The lines of a journal's text that are not blank, each cut to MAX_LINE_CHARS (what a
    fatal pattern reads of a line, and what the result shows of it, is bounded)."""
    return [line[:MAX_LINE_CHARS] for line in text.splitlines() if line.strip()]


def journal_lines(module: AnsibleModule, unit: str, since: float) -> list[str]:
    _rc, out, _err = module.run_command(
        ["journalctl", "-u", unit, "--since", f"@{int(since)}", "-o", "cat", "--no-pager"]
    )
    return log_lines(out)


def http_status(url: str, timeout: float) -> int | None:
    """The status of GET url within timeout (all of it), or None; a redirect is no health."""
    try:
        return request(url, deadline_s=timeout, max_bytes=1 << 20).status
    except HttpError:
        return None


def first_fatal(lines: list[str], patterns: list[str]) -> str | None:
    compiled = [re.compile(p) for p in patterns]
    for line in lines:
        if any(p.search(line) for p in compiled):
            return line.strip()
    return None


def classify(
    state: dict[str, str], status: int | None, fatal: str | None, restarts_baseline: int = 0
) -> tuple[str, str]:
    """Return (state, cause). A fatal log line or a dead/restarted unit ends the wait at once."""
    active = state.get("ActiveState", "unknown")
    restarts = int(state.get("NRestarts", "0") or 0) - restarts_baseline
    if fatal:
        return "failed", fatal
    if active in ("failed", "inactive") or restarts > 0:
        exit_status = state.get("ExecMainStatus", "?")
        return "failed", (
            f"unit is {active}/{state.get('SubState', '?')} "
            f"(exit status {exit_status}, restarts {restarts}, result {state.get('Result', '?')})"
        )
    if status == 200:
        return "healthy", ""
    return "starting", ""


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "unit": {"type": "str", "required": True},
            "url": {"type": "str", "required": True},
            "since": {"type": "float", "required": True},
            "request_timeout": {"type": "float", "default": 25.0},
            "restarts_baseline": {"type": "int", "default": 0},
            "fatal_patterns": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    params = module.params
    state = unit_state(module, params["unit"])
    lines = journal_lines(module, params["unit"], params["since"])
    status = None
    if state.get("ActiveState") in ("active", "activating", "reloading"):
        status = http_status(params["url"], params["request_timeout"])
    patterns = params["fatal_patterns"] or DEFAULT_FATAL
    baseline = params["restarts_baseline"]
    verdict, cause = classify(state, status, first_fatal(lines, patterns), baseline)
    result = {
        "changed": False,
        "state": verdict,
        "http_status": status,
        "active_state": f"{state.get('ActiveState', '?')}/{state.get('SubState', '?')}",
        "n_restarts": int(state.get("NRestarts", "0") or 0) - baseline,
        "last_log_line": lines[-1] if lines else "",
        "log_tail": lines[-25:],
    }
    if verdict == "failed":
        result["cause"] = cause
    module.exit_json(**result)


if __name__ == "__main__":
    main()
