#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module sglang_start_facts: what one start of a server measured, read in one run on
the host (the calibrate verb's read, docs/CALIBRATION.md). Runs on the GPU host: standard
library only."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_start_facts
short_description: Read what the current start of an SGLang server logged and reports, read-only
description:
  - The journal lines of the unit's current start (its InvocationID) that match
    C(line_pattern), at most C(max_lines) of them, read within C(timeout).
  - The server's C(/server_info) on 127.0.0.1, with C(api_key) as a bearer token, within
    C(timeout) and at most 1 MiB; only the C(server_info_paths) come back, so a key the answer
    holds never leaves the host.
  - The server's calibration store, C(store_name) inside C(folder) (a regular file, at most
    64 MiB; missing is null).
  - Changes nothing; runs in check mode too.
version_added: "0.6.0"
author: sglang-fleet maintainers (@sglang-fleet)
options:
  unit:
    description: The server's systemd unit.
    type: str
    required: true
  port:
    description: The server's port on this host.
    type: int
    required: true
  api_key:
    description: The server's API key, sent as a bearer token (never returned).
    type: str
    default: ""
  line_pattern:
    description: Regular expression (case-insensitive) of the journal lines to return.
    type: str
    required: true
  max_lines:
    description: At most this many matching lines come back (the first ones).
    type: int
    default: 2000
  server_info_paths:
    description:
      - The parts of /server_info to return, each a dotted path of keys and list indexes
        (C(internal_states.0.memory_usage)); anything else is dropped on the host.
    type: list
    elements: str
    required: true
  folder:
    description: The server's state folder.
    type: path
    required: true
  store_name:
    description: The calibration store's file name inside C(folder).
    type: str
    required: true
  timeout:
    description: Seconds each read (the journal, /server_info) may take.
    type: int
    default: 30
"""

EXAMPLES = r"""
- name: What this start measured (the sglang_calibrate action calls this)
  sglang_fleet.fleet.sglang_start_facts:
    unit: sglang@llama.service
    port: 30000
    line_pattern: "kv cache is allocated|max_total_num_tokens="
    server_info_paths: [version, max_total_num_tokens, internal_states.0.memory_usage]
    folder: /var/lib/sglang-fleet/llama
    store_name: calibration.json
  no_log: true
"""

RETURN = r"""
invocation_id:
  description: The unit's current InvocationID (empty when it has none).
  returned: always
  type: str
lines:
  description: The matching journal lines of that start, newline-separated.
  returned: always
  type: str
server_info:
  description: The asked parts of /server_info; null when it did not answer with a JSON object.
  returned: always
  type: dict
server_info_error:
  description: Why /server_info gave nothing (its status, or what failed); empty when it did.
  returned: always
  type: str
store:
  description: The calibration store's text; null when it does not exist.
  returned: always
  type: str
"""

import itertools
import os
import re
import selectors
import subprocess
import time
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_file import (
    inside,
    read_regular,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_json import TooDeep
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_json import (
    loads as bounded_loads,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.fleet_http import (
    HttpError,
    request,
    without_secrets,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.timed_command import run_command

MAX_STORE_BYTES = 64 * 1024 * 1024
MAX_INFO_BYTES = 1 << 20
MAX_LINE_CHARS = 4096  # a start-up line is a few hundred characters; a longer one is cut


def invocation_id(unit: str, timeout: float) -> str:
    rc, out, _err = run_command(
        ["systemctl", "show", "--property=InvocationID", "--value", unit], timeout
    )
    return out.strip() if rc == 0 else ""


def matching_lines(invocation: str, pattern: str, max_lines: int, timeout: float) -> list[str]:
    """The first `max_lines` lines of that invocation matching `pattern`, read as the journal
    streams them: a long journal is never held whole, and the read stops at the deadline."""
    if not invocation or max_lines <= 0:
        return []
    wanted = re.compile(pattern, re.IGNORECASE)
    argv = ["journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_INVOCATION_ID={invocation}"]
    found: list[str] = []
    deadline = time.monotonic() + timeout
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as proc:
        stdout = proc.stdout
        if stdout is None:  # never with stdout=PIPE; said for the type checker
            return found
        os.set_blocking(stdout.fileno(), False)
        selector = selectors.DefaultSelector()
        selector.register(stdout, selectors.EVENT_READ)
        pending = b""
        try:
            while len(found) < max_lines:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    break
                chunk = stdout.read(65536)
                if not chunk:
                    break
                *whole, pending = (pending + chunk).split(b"\n")
                pending = pending[-MAX_LINE_CHARS:]
                for raw in whole:
                    line = raw[:MAX_LINE_CHARS].decode("utf-8", errors="replace")
                    if wanted.search(line):
                        found.append(line)
        finally:
            selector.close()
            proc.kill()
    return found[:max_lines]


def pick(document: Any, paths: list[str]) -> dict[str, Any]:
    """Only the given dotted paths of a JSON document, in their nesting (a list index keeps
    its place as the only item: `a.0.b` of {"a": [{"b": 1, "c": 2}, ...]} is {"a": [{"b": 1}]})."""
    kept: dict[str, Any] = {}
    for path in paths:
        parts = path.split(".")
        value, found = document, True
        for part in parts:
            if isinstance(value, dict) and part in value:
                value = value[part]
            elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                value = value[int(part)]
            else:
                found = False
                break
        if not found:
            continue
        node: Any = kept
        for part, following in itertools.pairwise(parts):
            default: Any = [{}] if following.isdigit() else {}
            node = node.setdefault(part, default) if isinstance(node, dict) else node[0]
        last = parts[-1]
        if isinstance(node, list):
            node[0] = value
        else:
            node[last] = value
    return kept


def server_info(port: int, api_key: str, paths: list[str], timeout: float) -> tuple[Any, str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"http://127.0.0.1:{port}/server_info"
    try:
        answer = request(url, headers=headers, deadline_s=timeout, max_bytes=MAX_INFO_BYTES)
    except HttpError as exc:
        return None, str(exc)
    if answer.status != 200:
        return None, f"/server_info answered {answer.status}"
    try:
        document = bounded_loads(answer.body, "/server_info")
    except TooDeep as exc:
        return None, str(exc)
    except ValueError:
        return None, "/server_info did not answer JSON"
    if not isinstance(document, dict):
        return None, "/server_info did not answer a JSON object"
    return pick(document, paths), ""


def read(params: dict[str, Any]) -> dict[str, Any]:
    timeout = max(1, int(params["timeout"]))
    invocation = invocation_id(params["unit"], timeout)
    lines = matching_lines(invocation, params["line_pattern"], params["max_lines"], timeout)
    key = params["api_key"] or ""
    info, info_error = server_info(params["port"], key, list(params["server_info_paths"]), timeout)
    store = read_regular(inside(params["folder"], params["store_name"]), MAX_STORE_BYTES)
    return {
        "changed": False,
        "invocation_id": invocation,
        # SGLang logs its arguments as Python text: a key escaped there escapes no_log too.
        "lines": without_secrets("\n".join(lines), [key]),
        "server_info": info,
        "server_info_error": without_secrets(info_error, [key]),
        "store": None if store is None else store.decode("utf-8", errors="replace"),
    }


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "unit": {"type": "str", "required": True},
            "port": {"type": "int", "required": True},
            "api_key": {"type": "str", "default": "", "no_log": True},
            "line_pattern": {"type": "str", "required": True},
            "max_lines": {"type": "int", "default": 2000},
            "server_info_paths": {"type": "list", "elements": "str", "required": True},
            "folder": {"type": "path", "required": True},
            "store_name": {"type": "str", "required": True},
            "timeout": {"type": "int", "default": 30},
        },
        supports_check_mode=True,
    )
    try:
        re.compile(module.params["line_pattern"])
    except re.error as exc:
        module.fail_json(msg=f"line_pattern: {exc}")
    try:
        module.exit_json(**read(module.params))
    except (OSError, ValueError) as err:
        # A message never carries the key, escaped or not (no_log masks it only as written).
        module.fail_json(msg=without_secrets(f"start facts: {err}", [module.params["api_key"]]))


if __name__ == "__main__":
    main()
