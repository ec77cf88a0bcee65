#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module ml_env_versions: the SGLang virtualenvs of a host, one per version side by side
(docs/UPGRADES.md), which servers use each, and the only changes made to them: a finished build
put in place, and old versions pruned. Runs on the GPU host: standard library only."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: ml_env_versions
short_description: Side-by-side SGLang virtualenvs - read, put a finished build in place, prune
description:
  - Each SGLang version lives in its own virtualenv, C(<root>/versions/<version>), built beside the
    others in C(<root>/versions/.building-<version>) and renamed into place only when it is
    complete, with C(sglang-fleet-env.json) (version, key of the package set) inside it. A
    version's folder without that file, or with another key, is not ready.
  - Who uses a version, proven from the host, never guessed: a running C(sglang@) unit whose main
    process was started by that virtualenv's python (C(/proc/<pid>/cmdline)); a unit whose launch
    drop-in (C(<units_dir>/sglang@*.service.d/*.conf)) names it; a server's last-known-good
    launch line (C(<state_dir>/*/lkg/10-launch.conf)).
  - I(state=read) changes nothing. I(state=installed) puts C(.building-<wanted>) in place of
    C(<wanted>), refusing when the old folder is used by anything. I(state=pruned) removes the
    versions I(remove) names, refusing (before removing anything) any that is used, then the
    oldest unused versions beyond I(keep); I(wanted) and every used version are always kept.
    Leftover C(.building-*) folders of interrupted builds are removed by installed and pruned.
  - An older layout, one virtualenv at I(root) itself (C(<root>/pyvenv.cfg)), is reported as
    C(legacy) and never changed.
version_added: "0.6.0"
author: sglang-fleet
options:
  root:
    description: The folder the role owns (ml_env_path); versions live in C(<root>/versions).
    type: path
    required: true
  wanted:
    description: The version the inventory asks for (ml_env_sglang_version).
    type: str
    required: true
  wanted_key:
    description: Key of the package set the wanted version must hold (the role's hash).
    type: str
    default: ""
  state:
    description: read, installed or pruned.
    type: str
    choices: [read, installed, pruned]
    default: read
  keep:
    description: How many versions are kept at most when pruning (used ones are kept beyond it).
    type: int
    default: 3
  remove:
    description: Versions to remove when pruning (ml_env_remove_versions); a used one is refused.
    type: list
    elements: str
    default: []
  units_dir:
    description: Where the sglang@ units' drop-ins are.
    type: path
    default: /etc/systemd/system
  state_dir:
    description: The sglang_server role's state folder (last-known-good copies).
    type: path
    default: /var/lib/sglang-fleet
"""

EXAMPLES = r"""
- name: Read the versions and who uses them
  ml_env_versions:
    root: /opt/ml-env
    wanted: "0.5.23"
    wanted_key: 3f2a9c1d0b7e
  register: versions
"""

RETURN = r"""
versions:
  description: Each version folder, oldest first, {name, python, ready, key, used_by}.
  returned: always
  type: list
  elements: dict
wanted_ready:
  description: The wanted version is built, complete and holds the wanted package set.
  returned: always
  type: bool
wanted_used_by:
  description: Who uses the wanted version's folder (what a rebuild in place would change).
  returned: always
  type: list
  elements: str
legacy:
  description: I(root) itself is a virtualenv of the older layout (left alone), with its users.
  returned: always
  type: dict
removed:
  description: Versions removed (pruned) or replaced (installed).
  returned: always
  type: list
  elements: str
"""

import json
import os
import re

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.bounded_file import read_regular
from ansible.module_utils.owned_folder import OwnedFolder
from ansible.module_utils.server_configs import exec_start_lines, launch_files, read_conf
from ansible.module_utils.timed_command import Runner, run_command

VERSIONS = "versions"
BUILDING = ".building-"
MARKER = "sglang-fleet-env.json"
# The version folder's name is the version as pip spells it: no slash, no leading dot.
NAME_RE = re.compile(r"^[0-9][0-9A-Za-z.+!_-]{0,63}$")
SMALL = 256 * 1024  # a drop-in, a marker or a cmdline is a few hundred bytes
SYSTEMCTL_TIMEOUT_S = 30
MAX_UNITS = 4096


def _python_of_line(text: str) -> str | None:
    """The interpreter of the last non-empty ExecStart= of a drop-in, None without one."""
    lines = exec_start_lines(text)
    return lines[-1][0] if lines else None


def _version_of_python(python: str, root: str) -> str | None:
    """`<root>/versions/<name>/bin/python...` -> name; `<root>/bin/python...` -> "" (legacy)."""
    base = os.path.normpath(root)
    if python.startswith(f"{base}/{VERSIONS}/"):
        name = python[len(f"{base}/{VERSIONS}/") :].split("/", 1)[0]
        return name if NAME_RE.match(name) else None
    if python.startswith(f"{base}/bin/"):
        return ""
    return None


def _read_small(path: str) -> str | None:
    try:
        data = read_regular(path, SMALL)
    except (OSError, ValueError):
        return None
    return None if data is None else data.decode("utf-8", errors="replace")


def _dropin_users(root: str, units_dir: str, state_dir: str) -> dict[str, list[str]]:
    """{version name ("" legacy): [who]} from the written drop-ins and the last-known-good
    copies."""
    users: dict[str, list[str]] = {}

    def add(python: str | None, who: str) -> None:
        if python:
            name = _version_of_python(python, root)
            if name is not None:
                users.setdefault(name, []).append(who)

    for who, path in launch_files(units_dir, state_dir):
        add(_python_of_line(read_conf(path) or ""), who)
    return users


def _running_users(root: str, run: Runner) -> dict[str, list[str]]:
    """{version name: [unit (running)]} from each active sglang@ unit's main process."""
    users: dict[str, list[str]] = {}
    rc, out, _err = run(
        ["systemctl", "list-units", "--type=service", "--state=active", "--plain",
         "--no-legend", "--no-pager", "sglang@*"], SYSTEMCTL_TIMEOUT_S
    )  # fmt: skip
    if rc != 0:
        return users
    units = [line.split()[0] for line in out.splitlines() if line.strip()][:MAX_UNITS]
    for unit in units:
        rc, pid, _err = run(
            ["systemctl", "show", "-p", "MainPID", "--value", unit], SYSTEMCTL_TIMEOUT_S
        )
        if rc != 0 or not pid.strip().isdigit() or int(pid) == 0:
            continue
        try:
            data = read_regular(f"/proc/{int(pid)}/cmdline", SMALL)
        except (OSError, ValueError):
            continue
        argv0 = (data or b"").split(b"\0", 1)[0].decode("utf-8", errors="replace")
        name = _version_of_python(argv0, root)
        if name is not None:
            users.setdefault(name, []).append(f"{unit} (running)")
    return users


def survey(root: str, wanted_key: str, run: Runner, units_dir: str, state_dir: str) -> dict:
    """What the module reports: every version folder with its users, and the legacy one."""
    users = _dropin_users(root, units_dir, state_dir)
    for name, who in _running_users(root, run).items():
        users.setdefault(name, []).extend(who)
    versions, building = [], []
    folder = os.path.join(root, VERSIONS)
    if os.path.isdir(folder) and not os.path.islink(folder):
        entries = []
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.startswith(BUILDING):
                building.append(name)
            elif NAME_RE.match(name) and os.path.isdir(path) and not os.path.islink(path):
                entries.append((os.lstat(path).st_mtime, name))
        for _mtime, name in sorted(entries):
            path = os.path.join(folder, name)
            marker = _read_small(os.path.join(path, MARKER))
            try:
                meta = json.loads(marker) if marker else {}
            except ValueError:
                meta = {}
            meta = meta if isinstance(meta, dict) else {}
            python = os.path.join(path, "bin", "python")
            ready = bool(meta) and meta.get("version") == name and os.path.exists(python)
            versions.append({
                "name": name, "python": python, "ready": ready, "key": meta.get("key", ""),
                "used_by": sorted(set(users.get(name, []))),
            })  # fmt: skip
    legacy = os.path.isfile(os.path.join(root, "pyvenv.cfg"))
    return {
        "versions": versions,
        "building": sorted(building),
        "legacy": {"present": legacy, "used_by": sorted(set(users.get("", [])))},
        "wanted_key": wanted_key,
    }


def _wanted(found: dict, wanted: str) -> dict | None:
    return next((v for v in found["versions"] if v["name"] == wanted), None)


def install(root: str, wanted: str, found: dict, check: bool) -> list[str]:
    """.building-<wanted> renamed to <wanted>; an unused old <wanted> removed first."""
    old = _wanted(found, wanted)
    if old and old["used_by"]:
        raise ValueError(
            f"{root}/{VERSIONS}/{wanted} is used by {', '.join(old['used_by'])}: a version a "
            "server runs, is configured with or would roll back to is never changed in place"
        )
    if check:
        return [wanted] if old else []
    with OwnedFolder(os.path.join(root, VERSIONS)) as folder:
        if folder.lstat(BUILDING + wanted) is None:
            raise ValueError(
                f"{root}/{VERSIONS}/{BUILDING}{wanted} is not there: nothing to install"
            )
        if old:
            folder.remove_entry(wanted)
        folder.rename(BUILDING + wanted, wanted)
    return [wanted] if old else []


def prune(  # noqa: PLR0917 (the module's parameters, in its order)
    root: str, wanted: str, found: dict, keep: int, remove: list[str], check: bool
) -> list[str]:
    """Versions removed: those `remove` names, then the oldest unused beyond `keep`."""
    names = [v["name"] for v in found["versions"]]
    used = {v["name"]: v["used_by"] for v in found["versions"] if v["used_by"]}
    refused = [f"{name} (used by {', '.join(used[name])})" for name in remove if name in used]
    if wanted in remove:
        refused.append(f"{wanted} (it is ml_env_sglang_version, the version this run installs)")
    if refused:
        raise ValueError(
            "ml_env_remove_versions names versions in use, so nothing was removed: "
            + "; ".join(refused)
        )
    gone = [name for name in remove if name in names]
    left = [n for n in names if n not in gone]
    spare = [n for n in left if n != wanted and n not in used]
    while len(left) > keep and spare:
        oldest = spare.pop(0)
        gone.append(oldest)
        left.remove(oldest)
    if not check and (gone or found["building"]):
        with OwnedFolder(os.path.join(root, VERSIONS)) as folder:
            for name in gone + found["building"]:
                folder.remove_entry(name)
    return gone


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "root": {"type": "path", "required": True},
            "wanted": {"type": "str", "required": True},
            "wanted_key": {"type": "str", "default": ""},
            "state": {"type": "str", "default": "read", "choices": ["read", "installed", "pruned"]},
            "keep": {"type": "int", "default": 3},
            "remove": {"type": "list", "elements": "str", "default": []},
            "units_dir": {"type": "path", "default": "/etc/systemd/system"},
            "state_dir": {"type": "path", "default": "/var/lib/sglang-fleet"},
        },
        supports_check_mode=True,
    )
    p = module.params
    root = os.path.normpath(p["root"])
    for name in [p["wanted"], *p["remove"]]:
        if not NAME_RE.match(name):
            module.fail_json(
                msg=f"{name!r} is not a version (ml_env_sglang_version, ml_env_remove_versions)"
            )
    if p["keep"] < 1:
        module.fail_json(msg=f"ml_env_keep_versions must be at least 1 (got {p['keep']})")

    found = survey(root, p["wanted_key"], run_command, p["units_dir"], p["state_dir"])
    removed: list[str] = []
    try:
        if p["state"] == "installed":
            removed = install(root, p["wanted"], found, module.check_mode)
        elif p["state"] == "pruned":
            removed = prune(root, p["wanted"], found, p["keep"], p["remove"], module.check_mode)
    except ValueError as exc:
        module.fail_json(msg=str(exc), **found)
    changed = (
        p["state"] == "installed"
        or bool(removed)
        or (p["state"] == "pruned" and bool(found["building"]))
    )
    if changed and not module.check_mode:
        found = survey(root, p["wanted_key"], run_command, p["units_dir"], p["state_dir"])
    wanted = _wanted(found, p["wanted"])
    module.exit_json(
        changed=changed,
        removed=removed,
        wanted_ready=bool(wanted and wanted["ready"] and wanted["key"] == p["wanted_key"]),
        wanted_used_by=wanted["used_by"] if wanted else [],
        **found,
    )


if __name__ == "__main__":
    main()
