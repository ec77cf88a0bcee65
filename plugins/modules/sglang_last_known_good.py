#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module sglang_last_known_good: keep the files and the record of a configuration
that passed its gates, or put them back, in one run on the host (the action of the same name
sequences it). Runs on the GPU host: standard library only."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_last_known_good
short_description: Keep a passing server's files and record as last-known-good, or restore them
description:
  - With C(state=kept), makes the folder (root only, 0700), copies each file into it (0600,
    atomically, only when its content differs), removes the files named in C(absent), and
    writes C(record) as meta.json (0600) when it differs.
  - With C(state=restored), reads meta.json and copies each file named in C(files) from the
    folder back to its C(dest) (atomically, with C(mode), only when its content differs; the
    secrets file only when the record says the kept set had a key), then reloads systemd when
    anything was written. Without meta.json, C(found=false) and nothing changes.
  - Every path stays inside C(lkg_dir); a name with a slash, or a symlink in place of a file,
    is refused; each file read is bounded.
  - Returns the record (the one there before, for C(kept)), never a file's content.
  - Changes nothing in check mode; says what would change.
version_added: "0.4.0"
author: sglang-fleet maintainers (@sglang-fleet)
options:
  lkg_dir:
    description: The server's last-known-good folder (<state dir>/<server>/lkg).
    type: path
    required: true
  state:
    description: C(kept) records a passing configuration; C(restored) puts the recorded one back.
    type: str
    choices: [kept, restored]
    default: kept
  files:
    description:
      - C(kept) - files to keep, each {name, src}; the secrets file among them.
      - C(restored) - files to put back, each {name, dest, mode}; C(secrets.yaml) is put back
        only when the record's api_key_set is true or its secrets_set names a secret.
    type: list
    elements: dict
    default: []
  absent:
    description: Names to remove from the folder (a secrets file the passing set did not have).
    type: list
    elements: str
    default: []
  record:
    description:
      - What meta.json says (server, config_hash, flags, api_key_set, version, result).
      - Required with C(state=kept).
    type: dict
"""

EXAMPLES = r"""
- name: Keep what passed (the sglang_last_known_good action calls this)
  sglang_fleet.fleet.sglang_last_known_good:
    lkg_dir: /var/lib/sglang-fleet/llama/lkg
    files:
      - {name: 10-launch.conf, src: /etc/systemd/system/sglang@llama.service.d/10-launch.conf}
      - {name: server.env, src: /etc/sglang/llama.env}
    absent: [secrets.yaml]
    record: {server: llama, config_hash: abc123, flags: {}, api_key_set: false}

- name: Put it back (the rollback)
  sglang_fleet.fleet.sglang_last_known_good:
    lkg_dir: /var/lib/sglang-fleet/llama/lkg
    state: restored
    files:
      - name: 10-launch.conf
        dest: /etc/systemd/system/sglang@llama.service.d/10-launch.conf
        mode: "0644"
      - {name: server.env, dest: /etc/sglang/llama.env, mode: "0644"}
      - {name: secrets.yaml, dest: /etc/sglang/llama.secrets.yaml, mode: "0600"}
"""

RETURN = r"""
previous:
  description: The record meta.json held before, or null (none, or unreadable).
  returned: with state kept
  type: dict
found:
  description: Whether a record exists to go back to.
  returned: with state restored
  type: bool
record:
  description: The record that was put back (null when none was found).
  returned: with state restored
  type: dict
written:
  description: The names written or removed (meta.json among them when the record changed).
  returned: always
  type: list
  elements: str
"""

import json
import os
from collections.abc import Callable

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_file import (
    inside,
    read_regular,
    write_atomic,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_json import (
    loads as bounded_loads,
)

META = "meta.json"
SECRETS = "secrets.yaml"
MAX_BYTES = 16 * 1024 * 1024  # a drop-in, an env file, a secrets file, a record: far less


def _read(path: str) -> bytes | None:
    return read_regular(path, MAX_BYTES)


def _folder(folder: str, check_mode: bool) -> dict | None:
    """The folder made (root only); the record it held, None when none or unreadable."""
    if os.path.lexists(folder) and (os.path.islink(folder) or not os.path.isdir(folder)):
        raise ValueError(f"{folder} exists and is not a folder")
    if not check_mode:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
    old = _read(os.path.join(folder, META)) if os.path.isdir(folder) else None
    try:
        previous = bounded_loads(old, f"{folder}/{META}") if old else None
    except ValueError:
        return None
    return previous if isinstance(previous, dict) else None


def _files(folder: str, params: dict, check_mode: bool) -> list[str]:
    """The files copied in (where they differ) and the stale ones removed: their names."""
    written = []
    for item in params["files"]:
        target = inside(folder, str(item["name"]))
        data = _read(str(item["src"]))
        if data is None:
            raise ValueError(f"{item['src']} does not exist: nothing to keep as {item['name']}")
        if _read(target) != data:
            written.append(str(item["name"]))
            if not check_mode:
                write_atomic(target, data, 0o600)
    for name in params["absent"]:
        target = inside(folder, name)
        if os.path.lexists(target):
            written.append(name)
            if not check_mode:
                os.unlink(target)
    return written


def keep(params: dict, check_mode: bool) -> dict:
    folder = params["lkg_dir"]
    previous = _folder(folder, check_mode)
    written = _files(folder, params, check_mode)
    record = (json.dumps(params["record"], indent=4, sort_keys=True) + "\n").encode()
    meta = os.path.join(folder, META)
    if (_read(meta) if os.path.isdir(folder) else None) != record:
        written.append(META)
        if not check_mode:
            write_atomic(meta, record, 0o600)
    return {"changed": bool(written), "written": written, "previous": previous}


def restore(params: dict, check_mode: bool, reload: Callable[[], None]) -> dict:
    """The kept files back where the server reads them; systemd reloaded when one changed."""
    folder = params["lkg_dir"]
    if os.path.islink(folder):
        raise ValueError(f"{folder} is a symlink, not the last-known-good folder")
    raw = _read(os.path.join(folder, META)) if os.path.isdir(folder) else None
    if raw is None:
        return {"changed": False, "found": False, "record": None, "written": []}
    record = bounded_loads(raw, f"{folder}/{META}")
    if not isinstance(record, dict):
        raise ValueError(f"{folder}/{META} is not a record")
    written = []
    for item in params["files"]:
        name = str(item["name"])
        if name == SECRETS and not (record.get("api_key_set") or record.get("secrets_set")):
            continue  # the kept set had no secret: the secrets file is not the record's
        data = _read(inside(folder, name))
        if data is None:
            raise ValueError(f"{folder}/{name} is missing: the record cannot be put back")
        dest = str(item["dest"])
        if _read(dest) != data:
            written.append(dest)
            if not check_mode:
                write_atomic(dest, data, int(str(item.get("mode") or "0644"), 8))
    if written and not check_mode:
        reload()
    return {"changed": bool(written), "found": True, "record": record, "written": written}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "lkg_dir": {"type": "path", "required": True},
            "state": {"type": "str", "choices": ["kept", "restored"], "default": "kept"},
            "files": {"type": "list", "elements": "dict", "default": []},
            "absent": {"type": "list", "elements": "str", "default": []},
            "record": {"type": "dict"},
        },
        required_if=[("state", "kept", ["record"])],
        supports_check_mode=True,
    )

    def reload() -> None:
        rc, _out, err = module.run_command(["systemctl", "daemon-reload"])
        if rc != 0:
            raise OSError(f"systemctl daemon-reload: {err.strip()}")

    try:
        if module.params["state"] == "restored":
            module.exit_json(**restore(module.params, module.check_mode, reload))
        module.exit_json(**keep(module.params, module.check_mode))
    except (OSError, ValueError) as err:
        module.fail_json(msg=f"last-known-good: {err}")


if __name__ == "__main__":
    main()
