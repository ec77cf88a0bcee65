#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module sglang_host_state: is the host exactly as a rollout would leave it? One
read-only pass over files, directories, users, units, records and routers. Runs on the GPU
host: standard library only."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_host_state
short_description: Compare a host with the state a rollout would leave, in one read-only call
description:
  - Checks, without changing anything, that every file has the wanted content (SHA-1, computed
    on the control node from the same templates the rollout writes), owner, group and mode,
    that files which must not exist do not, that directories, the group and the user are as
    wanted, that units are enabled and running, that JSON records (last-known-good) hold the
    wanted value, and that routers list the wanted workers.
  - Returns every difference found, in words. An empty list means a rollout would change
    nothing on this host (playbooks/deploy.yml's first play then leaves it out of the rollout;
    docs/FLEET.md).
  - >-
    One call instead of one task per file: on a fleet, the check of a host that needs nothing
    costs one module run.
version_added: "0.3.0"
author: sglang-fleet maintainers (@sglang-fleet)
options:
  files:
    description:
      - Files as they must be, each {path, content, owner, group, mode} (or C(sha1), the SHA-1 of
        the content, in place of C(content)); or {path, absent=true} for a file that must not
        exist. Other keys are ignored.
    type: list
    elements: dict
    default: []
  secret_files:
    description: Like C(files), for files whose content is secret (their SHA-1 is not logged).
    type: list
    elements: dict
    default: []
  directories:
    description: Directories as they must be, each {path, owner, group, mode}.
    type: list
    elements: dict
    default: []
  groups:
    description: Groups that must exist.
    type: list
    elements: str
    default: []
  users:
    description: Users that must exist, each {name, group, shell, home}.
    type: list
    elements: dict
    default: []
  units:
    description: systemd units that must be enabled and running.
    type: list
    elements: str
    default: []
  records:
    description:
      - JSON files that must hold a value, each {label, path, key, value}, for example a
        server's last-known-good record and the configuration hash the inventory asks for.
    type: list
    elements: dict
    default: []
  routers:
    description:
      - Workers that a router must list, each {label, router_url, worker_url}
        (sglang-router's C(GET /workers), docs/ROUTER.md). A router that does not answer is
        reported in C(unknown), not as a difference.
    type: list
    elements: dict
    default: []
  router_keys:
    description: API keys by router label (Authorization Bearer), for routers with a key.
    type: dict
    default: {}
  lock_path:
    description:
      - The host's rollout lock file, which must not exist (a lock another run holds or left
        behind is a difference); not one of the rollout's own writes.
    type: str
    default: ""
  read:
    description:
      - What a pre-flight reads besides (plugins/module_utils/host_read.py), returned as C(read);
        C(units) are read alike (C(running)). Keys, each optional; C(nvidia_smi) the GPUs,
        C(python) the installed SGLang's interpreter (its version too, unless C(version) is
        false), C(user) the service user (whether it exists), C(ports) a list of {label, ours}
        (who listens on each port, by the cleanup's ownership rules), C(models) model folders
        (config.json and the weights' bytes), C(files) small files to read as text
        (calibration stores, records).
      - Every file is read with a size bound, no symlink followed, nothing but regular files.
    type: dict
  timeout:
    description: Seconds each systemctl call and each router request may take.
    type: int
    default: 10
"""

EXAMPLES = r"""
- name: Read whether the host is as the rollout would leave it
  sglang_fleet.fleet.sglang_host_state:
    files:
      - {path: /etc/sglang/kimi.env, content: "{{ env_text }}", owner: root, group: root,
         mode: "0644"}
      - {path: /run/lock/sglang-fleet.lock, absent: true}
    units: [sglang@kimi.service]
    records:
      - {label: kimi, path: /var/lib/sglang-fleet/kimi/lkg/meta.json, key: config_hash,
         value: 0497c9a094be}
  register: state
"""

RETURN = r"""
differences:
  description: Every way the host differs from the wanted state, one sentence each.
  returned: always
  type: list
  elements: str
converged:
  description: No difference was found.
  returned: always
  type: bool
unknown:
  description: What could not be checked (a router that did not answer), one sentence each.
  returned: always
  type: list
  elements: str
changed_paths:
  description:
    - The files of C(files) and C(secret_files) that differ in any way (content, owner, group,
      mode, missing, or present where they must be absent), what a rollout's writes change.
  returned: always
  type: list
  elements: str
running:
  description: The units of C(units) that are active now.
  returned: always
  type: list
  elements: str
router_missing:
  description:
    - The labels of C(routers) whose router answered without listing the worker (a router that
      did not answer is in C(unknown) instead).
  returned: always
  type: list
  elements: str
read:
  description:
    - >-
      With the C(read) option: gpus ({gpus, gpu_count} or {error}), python_exists,
      sglang_version, user_exists, port_holders ({label: [holder]}), models ({folder:
      {config, weight_bytes, error}}), files ({path: text or null or {error}}).
  returned: when read is given
  type: dict
would_write:
  description:
    - A rollout would write something (a file, a directory, the group, the user, a unit's
      enablement); units that do not run and records are not writes.
  returned: always
  type: bool
in_place:
  description:
    - >-
      What this read proved exactly as wanted, by kind, for a caller that skips the writes of
      what is in place (roles/sglang_server/tasks/configure.yml): C(files) the paths of
      C(files) and C(secret_files) with no difference (an absent file's path when it is
      absent), C(directories) their paths, C(groups) and C(users) their names, C(enabled)
      the units of C(units) that are enabled. Whatever is not listed was not proven.
  returned: always
  type: dict
"""

import grp
import hashlib
import os
import pwd
import stat
import subprocess
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_file import read_regular
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_json import (
    loads as bounded_loads,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.fleet_http import (
    HttpError,
    redact_url,
    request,
    without_secrets,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.host_read import read as read_host
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.router_workers import (
    parse_workers,
    url_key,
)

MAX_RECORD_BYTES = 1 << 20  # a last-known-good record: a few kilobytes


def _sha1(path: str) -> str:
    digest = hashlib.sha1()  # the checksum Ansible itself uses for files, not a security use
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 16), b""):
            digest.update(block)
    return digest.hexdigest()


def _owner(info: os.stat_result) -> tuple[str, str]:
    try:
        user = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        user = str(info.st_uid)
    try:
        group = grp.getgrgid(info.st_gid).gr_name
    except KeyError:
        group = str(info.st_gid)
    return user, group


def _attributes(path: str, info: os.stat_result, want: dict[str, Any]) -> list[str]:
    found = []
    user, group = _owner(info)
    if want.get("owner") and want["owner"] != user:
        found.append(f"{path}: owner {user}, wanted {want['owner']}")
    if want.get("group") and want["group"] != group:
        found.append(f"{path}: group {group}, wanted {want['group']}")
    if want.get("mode") and int(str(want["mode"]), 8) != stat.S_IMODE(info.st_mode):
        found.append(f"{path}: mode {stat.S_IMODE(info.st_mode):04o}, wanted {want['mode']}")
    return found


def check_file(want: dict[str, Any]) -> list[str]:
    path = want["path"]
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return [] if want.get("absent") else [f"{path}: missing"]
    if want.get("absent"):
        return [f"{path}: present, wanted absent"]
    if not stat.S_ISREG(info.st_mode):
        return [f"{path}: not a regular file"]
    found = _attributes(path, info, want)
    expected = want.get("sha1")
    if "content" in want:  # the checksum Ansible itself uses for files, not a security use
        expected = hashlib.sha1(str(want["content"]).encode()).hexdigest()
    if expected and _sha1(path) != expected:
        found.append(f"{path}: content differs")
    return found


def check_directory(want: dict[str, Any]) -> list[str]:
    path = want["path"]
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return [f"{path}: missing"]
    if not stat.S_ISDIR(info.st_mode):
        return [f"{path}: not a directory"]
    return _attributes(path, info, want)


def check_group(name: str) -> list[str]:
    try:
        grp.getgrnam(name)
    except KeyError:
        return [f"group {name}: missing"]
    return []


def check_user(want: dict[str, Any]) -> list[str]:
    name = want["name"]
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return [f"user {name}: missing"]
    found = []
    try:
        group = grp.getgrgid(entry.pw_gid).gr_name
    except KeyError:
        group = str(entry.pw_gid)
    for field, have in (("group", group), ("shell", entry.pw_shell), ("home", entry.pw_dir)):
        if want.get(field) and want[field] != have:
            found.append(f"user {name}: {field} {have}, wanted {want[field]}")
    return found


def _systemctl(args: list[str], timeout: int) -> list[str]:
    done = subprocess.run(
        ["systemctl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    return done.stdout.splitlines()


def check_units(
    units: list[str], timeout: int
) -> tuple[list[str], list[str], list[str], list[str]]:
    """(not enabled, not running, running, enabled): one `systemctl is-enabled` and one
    `is-active` for all units."""
    if not units:
        return [], [], [], []
    disabled, stopped, running, enabled_units = [], [], [], []
    enabled = _systemctl(["is-enabled", *units], timeout)
    active = _systemctl(["is-active", *units], timeout)
    for index, unit in enumerate(units):
        state = enabled[index] if index < len(enabled) else "unknown"
        if state != "enabled":
            disabled.append(f"{unit}: {state or 'unknown'}, wanted enabled")
        else:
            enabled_units.append(unit)
        state = active[index] if index < len(active) else "unknown"
        if state != "active":
            stopped.append(f"{unit}: {state or 'unknown'}, wanted running")
        else:
            running.append(unit)
    return disabled, stopped, running, enabled_units


def check_record(want: dict[str, Any]) -> list[str]:
    path, key, label = want["path"], want["key"], want.get("label") or want["path"]
    try:
        raw = read_regular(path, MAX_RECORD_BYTES)
        if raw is None:
            return [f"{label}: no record at {path}"]
        have = bounded_loads(raw, path).get(key)
    except (OSError, ValueError, AttributeError) as err:
        return [f"{label}: {path} is unreadable ({err})"]
    if have != want["value"]:
        return [f"{label}: {path} holds {key} {have!r}, wanted {want['value']!r}"]
    return []


def check_router(want: dict[str, Any], key: str | None, timeout: int) -> tuple[list, list]:
    """(differences, unknown) for one worker its router must list. A list that is not read
    whole (plugins/module_utils/router_workers.py) is unknown, never "does not list": that
    difference
    would put a replica back on a list nobody understood."""
    label, url = want.get("label") or want["worker_url"], want["router_url"].rstrip("/")
    headers = {"Accept": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    shown = redact_url(url)
    try:
        answer = request(f"{url}/workers", headers=headers, deadline_s=timeout)
        if answer.status != 200:
            raise ValueError(f"HTTP {answer.status}")
        where = f"{shown}/workers"
        workers = parse_workers(bounded_loads(answer.body, where), where)
        listed = {url_key(worker["url"]) for worker in workers}
        wanted = url_key(want["worker_url"])
    except (HttpError, ValueError) as err:
        why = without_secrets(redact_url(err), [key])  # no key, escaped or not
        return [], [f"{label}: router {shown} did not answer a worker list ({why})"]
    if wanted not in listed:
        return [f"{label}: router {shown} does not list {redact_url(want['worker_url'])}"], []
    return [], []


def _sorted(checks: list[tuple[str, list[str]]]) -> tuple[list[str], list[str]]:
    """(the keys whose every check found nothing, once each; every difference found). A key
    asked for twice is in place only when both are: a write of either would change it."""
    differ = {key for key, found in checks if found}
    in_place = list(dict.fromkeys(key for key, _found in checks if key not in differ))
    return in_place, [line for _key, found in checks for line in found]


def run(params: dict[str, Any]) -> dict[str, Any]:
    unknown: list[str] = []
    files = [(want["path"], check_file(want)) for want in params["files"] + params["secret_files"]]
    in_place_files, differences = _sorted(files)
    changed_paths = [path for path, found in files if found]
    in_place: dict[str, list[str]] = {"files": in_place_files}
    for kind, checks in (
        ("directories", [(want["path"], check_directory(want)) for want in params["directories"]]),
        ("groups", [(name, check_group(name)) for name in params["groups"]]),
        ("users", [(want["name"], check_user(want)) for want in params["users"]]),
    ):
        in_place[kind], found = _sorted(checks)
        differences += found
    disabled, stopped, running, in_place["enabled"] = check_units(
        params["units"], params["timeout"]
    )
    differences += disabled
    # What the rollout's own writes (files, directories, group, user, enabled units) would
    # change; units that do not run and records are the restart decision's.
    would_write = bool(differences)
    differences += stopped
    if params["lock_path"]:
        differences += check_file({"path": params["lock_path"], "absent": True})
    for want in params["records"]:
        differences += check_record(want)
    keys = params["router_keys"] or {}
    router_missing = []
    for want in params["routers"]:
        found, missing = check_router(want, keys.get(want.get("label")), params["timeout"])
        if found:
            router_missing.append(want.get("label") or want["worker_url"])
        differences += found
        unknown += missing
    answer = {"changed": False, "differences": differences, "converged": not differences,
              "unknown": unknown, "changed_paths": changed_paths, "would_write": would_write,
              "running": running, "router_missing": router_missing,
              "in_place": in_place}  # fmt: skip
    if params.get("read"):
        answer["read"] = read_host(params["read"], params["timeout"])
    return answer


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "files": {"type": "list", "elements": "dict", "default": []},
            "secret_files": {"type": "list", "elements": "dict", "default": [], "no_log": True},
            "directories": {"type": "list", "elements": "dict", "default": []},
            "groups": {"type": "list", "elements": "str", "default": []},
            "users": {"type": "list", "elements": "dict", "default": []},
            "units": {"type": "list", "elements": "str", "default": []},
            "records": {"type": "list", "elements": "dict", "default": []},
            "routers": {"type": "list", "elements": "dict", "default": []},
            "router_keys": {"type": "dict", "default": {}, "no_log": True},
            "lock_path": {"type": "str", "default": ""},
            "read": {"type": "dict", "default": None},
            "timeout": {"type": "int", "default": 10},
        },
        supports_check_mode=True,
    )
    try:
        module.exit_json(**run(module.params))
    except (subprocess.SubprocessError, OSError) as err:
        module.fail_json(msg=f"cannot read the host's state: {err}")


if __name__ == "__main__":
    main()
