#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module sglang_smoke_run: the host's part of the smoke gate, in one run (the
sglang_smoke_gate action sequences it). Runs on the GPU host: standard library only."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_smoke_run
short_description: Put the smoke client on the host, run it against a server, return its result
description:
  - Writes the smoke client (a zipapp built on the control node by sglang_fleet.host_zipapp,
    given base64-encoded; written only when it differs, atomically, root only writable) and
    makes the result folder.
  - Runs the client's command (C(argv), built on the control node by
    sglang_fleet.smoke.smoke_argv;
    bounded by coreutils' timeout, the key read from stdin) with the API key on stdin, never in
    argv or in the environment of this module's caller.
  - Returns the result file's text (bounded by C(max_result_bytes)), how the client ended, the
    tail of its error output, and the lines of the server's journal since its current start
    (bounded by C(journal_lines)), which the diagnosis falls back to without /metrics.
  - Changes nothing in check mode (and runs nothing).
version_added: "0.4.0"
author: sglang-fleet maintainers (@sglang-fleet)
options:
  client_zipapp:
    description: The client, a zipapp (the package sglang_fleet/smoke/smoke_client/ of the control
      node in one file), base64-encoded.
    type: str
    required: true
  client_path:
    description: Where the client goes on the host.
    type: path
    required: true
  result_path:
    description: The result file the command writes (its folder is made when missing).
    type: path
    required: true
  argv:
    description: The client's whole command.
    type: list
    elements: str
    required: true
  api_key:
    description: The server's API key, written to the command's stdin ("" when it has none).
    type: str
    default: ""
  max_result_bytes:
    description: The largest result file read back.
    type: int
    default: 67108864
  journal_unit:
    description: The server's unit, whose journal of its current start is read ("" for none).
    type: str
    default: ""
  journal_lines:
    description: How many of that journal's last lines are read (0 for none).
    type: int
    default: 0
  baseline_path:
    description:
      - >-
        A file read back after the run ("" for none), bounded by C(max_baseline_bytes): the
        last-known-good record whose result the relative gate compares with, read in this run
        rather than in a module run of its own.
    type: str
    default: ""
  max_baseline_bytes:
    description: The largest C(baseline_path) read back.
    type: int
    default: 1048576
"""

EXAMPLES = r"""
- name: Benchmark the server (the sglang_smoke_gate action calls this)
  sglang_fleet.fleet.sglang_smoke_run:
    client_zipapp: "{{ lookup('file', 'smoke.pyz.b64') }}"
    client_path: /usr/local/lib/sglang-fleet/smoke.pyz
    result_path: /var/lib/sglang-fleet/llama/smoke/20261203T120000Z.json
    argv: [timeout, "600", /usr/bin/python3, /usr/local/lib/sglang-fleet/smoke.pyz, --url, "..."]
  no_log: true
"""

RETURN = r"""
rc:
  description: The command's exit status (124 or 137 when its timeout killed it).
  returned: unless in check mode
  type: int
stderr_tail:
  description: The last 2000 characters of the command's error output.
  returned: unless in check mode
  type: str
result:
  description: The result file's text, or null when the command wrote none.
  returned: unless in check mode
  type: str
journal:
  description: The server's journal lines of its current start (bounded).
  returned: unless in check mode
  type: str
client_changed:
  description: The client was written (it was missing or differed).
  returned: always
  type: bool
baseline:
  description:
    - The text of C(baseline_path), null when it is missing, or {error} when it cannot be read
      (not a regular file, larger than C(max_baseline_bytes)).
  returned: when baseline_path is given, unless in check mode
  type: raw
"""

import base64
import binascii
import os
import subprocess

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_file import (
    read_regular,
    write_atomic,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.fleet_http import without_secrets

STDERR_TAIL = 2000
# The journal is read through a pipe: its output is bounded by what is read, not by trust.
JOURNAL_MAX_BYTES = 4 * 1024 * 1024
JOURNAL_TIMEOUT_S = 60


def write_if_changed(path: str, data: bytes, mode: int) -> bool:
    """The file holds `data` afterwards; written (atomically) only when it differed."""
    try:
        same = read_regular(path, len(data)) == data
    except ValueError:  # longer, or not a regular file: replaced
        same = False
    if same:
        os.chmod(path, mode)
        return False
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    write_atomic(path, data, mode)
    return True


def read_bounded(path: str, limit: int) -> str | None:
    """A regular file's text, None when missing; ValueError past `limit` bytes."""
    data = read_regular(path, limit)
    return None if data is None else data.decode("utf-8", errors="replace")


def journal(unit: str, lines: int) -> str:
    """The unit's journal lines of its current start (its invocation), at most `lines`."""
    if not unit or lines <= 0:
        return ""
    shown = subprocess.run(
        ["systemctl", "show", "--property=InvocationID", "--value", unit],
        capture_output=True, text=True, timeout=JOURNAL_TIMEOUT_S, check=False,
    )  # fmt: skip
    invocation = shown.stdout.strip()
    if shown.returncode != 0 or not invocation:
        return ""
    argv = ["journalctl", "--no-pager", "-o", "cat", "-n", str(int(lines)),
            f"_SYSTEMD_INVOCATION_ID={invocation}"]  # fmt: skip
    read = subprocess.run(argv, capture_output=True, timeout=JOURNAL_TIMEOUT_S, check=False)
    return read.stdout[:JOURNAL_MAX_BYTES].decode("utf-8", errors="replace")


def run(params: dict, check_mode: bool) -> dict:
    if check_mode:
        return {"changed": False, "client_changed": False}
    try:
        client = base64.b64decode(params["client_zipapp"], validate=True)
    except binascii.Error as err:
        raise ValueError(f"client_zipapp is not base64: {err}") from None
    client_changed = write_if_changed(params["client_path"], client, 0o755)
    os.makedirs(os.path.dirname(params["result_path"]), mode=0o755, exist_ok=True)
    done = subprocess.run(
        params["argv"],
        input=(params["api_key"] or "") + "\n",
        stdout=subprocess.DEVNULL,  # the result goes to its file; progress is not kept
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )  # bounded by the command's own `timeout` (smoke_argv)
    key = [params["api_key"]]  # out of what comes back, escaped or not, before any cut
    answer = {
        "changed": True,  # a new result file on the host
        "client_changed": client_changed,
        "rc": done.returncode,
        "stderr_tail": without_secrets(done.stderr, key)[-STDERR_TAIL:],
        "result": read_bounded(params["result_path"], params["max_result_bytes"]),
        "journal": without_secrets(journal(params["journal_unit"], params["journal_lines"]), key),
    }
    if params.get("baseline_path"):
        answer["baseline"] = baseline(params["baseline_path"], params["max_baseline_bytes"])
    return answer


def baseline(path: str, limit: int) -> str | dict | None:
    """The record the relative gate compares with: its text, None when missing, {error} when it
    cannot be read (the gate then has no baseline, as with a missing record)."""
    try:
        return read_bounded(path, limit)
    except (OSError, ValueError) as err:
        return {"error": str(err)}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "client_zipapp": {"type": "str", "required": True},
            "client_path": {"type": "path", "required": True},
            "result_path": {"type": "path", "required": True},
            "argv": {"type": "list", "elements": "str", "required": True},
            "api_key": {"type": "str", "default": "", "no_log": True},
            "max_result_bytes": {"type": "int", "default": 64 * 1024 * 1024},
            "journal_unit": {"type": "str", "default": ""},
            "journal_lines": {"type": "int", "default": 0},
            "baseline_path": {"type": "str", "default": ""},
            "max_baseline_bytes": {"type": "int", "default": 1 << 20},
        },
        supports_check_mode=True,
    )
    try:
        module.exit_json(**run(module.params, module.check_mode))
    except (OSError, ValueError, subprocess.SubprocessError) as err:
        msg = f"the smoke run on the host failed: {err}"
        module.fail_json(msg=without_secrets(msg, [module.params["api_key"]]))


if __name__ == "__main__":
    main()
