#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module sglang_state_files: write a server's small state files (its calibration store
and what is set aside beside it) in one run on the host, inside its own state folder.
Runs on the GPU host: standard library only."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_state_files
short_description: Write small text files inside a server's state folder, atomically
description:
  - Makes C(folder) (root, 0755) when it is missing, then writes each of C(files) into it,
    atomically (a reader sees the old content or the new), with its C(mode), only when its
    content differs.
  - Every name stays inside C(folder) (no slash, no C(..)); a symlink, a FIFO or a device where
    a file or the folder must be is refused; each file read to compare is bounded.
  - Returns the names written, never a file's content. Changes nothing in check mode.
version_added: "0.4.0"
author: sglang-fleet maintainers (@sglang-fleet)
options:
  folder:
    description: The server's state folder (<state dir>/<server>), owned by root.
    type: path
    required: true
  files:
    description: Each file to write, {name, content, mode}; C(mode) defaults to 0644.
    type: list
    elements: dict
    required: true
"""

EXAMPLES = r"""
- name: Keep the calibration store (the sglang_calibrate action calls this)
  sglang_fleet.fleet.sglang_state_files:
    folder: /var/lib/sglang-fleet/llama
    files:
      - {name: calibration.json, content: "{}\n", mode: "0644"}
"""

RETURN = r"""
written:
  description: The names written (their content differed, or they were missing).
  returned: always
  type: list
  elements: str
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_file import (
    inside,
    read_regular,
    write_atomic,
)

MAX_BYTES = 64 * 1024 * 1024  # a calibration store is kilobytes; a bound, not a size


def write(folder: str, files: list[dict], check_mode: bool) -> dict:
    """The files written where their content differs; the folder made when it is missing."""
    if os.path.lexists(folder) and (os.path.islink(folder) or not os.path.isdir(folder)):
        raise ValueError(f"{folder} exists and is not a folder")
    written = []
    for item in files:
        name = str(item.get("name") or "")
        target = inside(folder, name)
        data = str(item.get("content") or "").encode()
        mode = int(str(item.get("mode") or "0644"), 8)
        current = read_regular(target, MAX_BYTES) if os.path.isdir(folder) else None
        if current == data and (os.stat(target).st_mode & 0o7777) == mode:
            continue
        written.append(name)
        if not check_mode:
            os.makedirs(folder, mode=0o755, exist_ok=True)
            write_atomic(target, data, mode)
    return {"changed": bool(written), "written": written}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "folder": {"type": "path", "required": True},
            "files": {"type": "list", "elements": "dict", "required": True},
        },
        supports_check_mode=True,
    )
    try:
        module.exit_json(
            **write(module.params["folder"], module.params["files"], module.check_mode)
        )
    except (OSError, ValueError) as err:
        module.fail_json(msg=f"state files: {err}")


if __name__ == "__main__":
    main()
