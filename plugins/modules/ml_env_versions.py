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
  - Who uses a version, proven from the host, never guessed; a running C(sglang@) unit whose main
    process was started by that virtualenv's python (C(/proc/<pid>/cmdline)); a unit whose launch
    drop-in (C(<units_dir>/sglang@*.service.d/*.conf)) names it; a server's last-known-good
    launch line (C(<state_dir>/*/lkg/*.conf)). C(ExecStart=) is read as systemd reads it
    (plugins/module_utils/server_configs.py) and paths are compared after the same normalisation on
    both sides (normpath, links resolved).
  - What cannot be read or understood (a drop-in, an C(ExecStart=) line, a folder listing cut
    at its bound, a failed or timed-out systemctl, a main process's command line) is listed in
    C(unknown); I(state=installed) and I(state=pruned) then refuse, before removing anything,
    whatever would remove a version, naming it.
  - I(state=read) changes nothing. I(state=installed) puts C(.building-<wanted>) in place of
    C(<wanted>), refusing when the old folder is used by anything. I(state=pruned) removes the
    versions I(remove) names, refusing (before removing anything) any that is used, then the
    oldest unused versions beyond I(keep); I(wanted) and every used version are always kept.
    Leftover C(.building-*) folders of interrupted builds are removed by installed and pruned.
  - An older layout, one virtualenv at I(root) itself (C(<root>/pyvenv.cfg)), is reported as
    C(legacy) and never changed.
version_added: "0.6.0"
author: sglang-fleet maintainers (@sglang-fleet)
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
  sglang_fleet.fleet.ml_env_versions:
    root: /opt/ml-env
    wanted: "0.5.23"
    wanted_key: 3f2a9c1d0b7e
  register: versions
"""

RETURN = r"""
versions:
  description: Each version folder, oldest first, {name, python, ready, key, problem, used_by}
    (problem says why its marker is not a complete version's, "" when it is).
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
unknown:
  description: What could not be read or understood, so who uses the versions is not proven
    (nothing is removed while it is not empty).
  returned: always
  type: list
  elements: str
building_used_by:
  description: Unfinished builds (C(.building-*)) a unit names, with who names them.
  returned: always
  type: dict
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

import errno
import os
import re

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_file import read_regular
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_json import (
    loads as bounded_loads,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.owned_folder import OwnedFolder
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.server_configs import (
    Command,
    NotUnderstood,
    launch_commands,
    launched,
    listing,
    program_path,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.timed_command import (
    Runner,
    run_command,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.typed_number import Range
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.typed_number import (
    read as read_number,
)

VERSIONS = "versions"
BUILDING = ".building-"
MARKER = "sglang-fleet-env.json"
# The version folder's name is the version as pip spells it: no slash, no leading dot. Whole
# strings only (fullmatch): "0.5.23\n" is no version.
NAME_RE = re.compile(r"[0-9][0-9A-Za-z.+!_-]{0,63}")
KEY_RE = re.compile(r"[0-9A-Za-z._+-]{0,128}")
SMALL = 256 * 1024  # a marker or a cmdline is a few hundred bytes
SYSTEMCTL_TIMEOUT_S = 30
MAX_UNITS = 4096
MAX_LINKS = 40  # the kernel's own bound on links followed in one lookup
PID = Range(0, 1 << 22, integer=True)  # the kernel's pid_max at most
# States in which a unit may have processes; its main process is read in each.
UNIT_STATES = "active,reloading,activating,deactivating"
_UNIT_RE = re.compile(r"sglang@[^/\s]*\.service")


class Unplaced(ValueError):
    """A path whose place relative to the root cannot be proven (the message says why)."""


class Users:
    """Who uses each entry of <root>/versions ("" for the older layout at root itself), proven
    from the host, and what could not be read (`unknown`): the places a path may lead to are
    compared after the same normalisation on both sides (normpath, links resolved)."""

    def __init__(self, root: str) -> None:
        self.roots = sorted({os.path.normpath(os.path.abspath(root)), os.path.realpath(root)})
        self.by_entry: dict[str, list[str]] = {}
        self.unknown: list[str] = []

    def add(self, entry: str, who: str) -> None:
        self.by_entry.setdefault(entry, []).append(who)

    def of(self, entry: str) -> list[str]:
        return sorted(set(self.by_entry.get(entry, [])))

    def entries_of_path(self, path: str) -> set[str]:
        """The entries a path lies in, each spelling it may take (as written, normalised, every
        link on the way resolved); empty when it lies outside the root."""
        entries: set[str] = set()
        for spelling in _spellings(path):
            for root in self.roots:
                if spelling == root or spelling.startswith(root + "/"):
                    parts = spelling[len(root) + 1 :].split("/")
                    if parts[0] == VERSIONS and len(parts) > 1 and parts[1]:
                        entries.add(parts[1])
                    elif parts[0] == VERSIONS:
                        raise Unplaced(f"{path} is the versions folder itself")
                    else:
                        entries.add("")  # the older layout: a virtualenv at the root itself
        return entries

    def mentions_root(self, word: str) -> bool:
        return any(root + "/" in word or word.endswith(root) for root in self.roots)

    def take_argv(self, words: list[str], who: str, program: str, mentions: bool = True) -> None:
        """A command: the program it runs, and every other word that is a path (or a path after
        `=`: the interpreter numactl, taskset or nice wrap, --python=...); with mentions, a word
        that names the root but is no path (a shell's script) cannot be placed."""
        values = [program] + [v for w in words for v in (w, w.partition("=")[2]) if v]
        for value in values:
            try:
                if value.startswith("/"):
                    for entry in self.entries_of_path(value):
                        self.add(entry, who)
                elif mentions and self.mentions_root(value):
                    raise Unplaced(f"{value[:200]!r} names the root but is no path")
            except Unplaced as err:
                self.unknown.append(f"{who}: {err}")


def _spellings(path: str) -> list[str]:
    """path normalised as written, and each path its links lead to with the folders on the way
    resolved; Unplaced for one that is relative, holds a NUL, or links on past MAX_LINKS."""
    if not path.startswith("/") or "\0" in path:
        raise Unplaced(f"{path!r} is not an absolute path")
    found = [os.path.normpath(path)]
    current = path
    for _link in range(MAX_LINKS):
        current = os.path.normpath(
            os.path.join(os.path.realpath(os.path.dirname(current)), os.path.basename(current))
        )
        found.append(current)
        try:
            target = os.readlink(current)
        except OSError as err:
            if err.errno in (errno.ENOENT, errno.EINVAL, errno.ENOTDIR):
                return found  # not a link (or not there): its place is its path
            raise Unplaced(f"{current} cannot be read ({err.strerror})") from None
        current = os.path.join(os.path.dirname(current), target)
        found.append(os.path.normpath(current))
    raise Unplaced(f"{path} links on more than {MAX_LINKS} times")


def _command_users(users: Users, command: Command, who: str) -> None:
    try:
        program = launched(command)
        path = program_path(program)
    except NotUnderstood as err:
        users.unknown.append(f"{who}: {err}")
        return
    users.take_argv(list(program.argv[1:]), who, path)
    if program is not command:
        # env's own words: its assignments' paths count; its -S text was read by launched().
        users.take_argv(list(command.argv), who, path, mentions=False)


def _dropin_users(users: Users, units_dir: str, state_dir: str) -> None:
    """The users the written drop-ins and the last-known-good copies name."""
    found, problems = launch_commands(units_dir, state_dir)
    users.unknown += problems
    for launch, commands in found:
        for command in commands:
            _command_users(users, command, launch.who)


def _main_pid(unit: str, run: Runner) -> int:
    rc, out, err = run(["systemctl", "show", "-p", "MainPID", "--value", unit], SYSTEMCTL_TIMEOUT_S)
    if rc != 0:
        raise ValueError(f"systemctl show {unit} failed (rc {rc}): {err.strip()[:200]}")
    return int(read_number(out.strip(), f"{unit}'s MainPID", PID))


def _argv_of(pid: int, unit: str) -> tuple[list[str], str | None]:
    """(a process's argv, its working directory when argv[0] needs it)."""
    data = read_regular(f"/proc/{pid}/cmdline", SMALL)
    if data is None:
        raise ValueError(f"{unit}'s main process {pid} ended while it was read")
    argv = [w.decode("utf-8", errors="surrogateescape") for w in data.split(b"\0")]
    argv = argv[:-1] if argv and argv[-1] == "" else argv
    if not argv or not argv[0]:
        raise ValueError(f"{unit}'s main process {pid} has no command line")
    cwd = None
    if not argv[0].startswith("/"):
        if "/" not in argv[0]:
            raise ValueError(
                f"{unit}'s main process {pid} was started as {argv[0]!r}, found on a PATH not "
                "known here"
            )
        cwd = os.readlink(f"/proc/{pid}/cwd")
    return argv, cwd


def _running_users(users: Users, run: Runner) -> None:
    """The users each sglang@ unit with processes is, from its main process's command line."""
    rc, out, err = run(
        ["systemctl", "list-units", "--type=service", f"--state={UNIT_STATES}", "--plain",
         "--no-legend", "--no-pager", "sglang@*"], SYSTEMCTL_TIMEOUT_S
    )  # fmt: skip
    if rc != 0:
        users.unknown.append(f"systemctl list-units failed (rc {rc}): {err.strip()[:200]}")
        return
    lines = [line.split() for line in out.splitlines() if line.strip()]
    if len(lines) > MAX_UNITS:
        users.unknown.append(f"systemctl lists {len(lines)} sglang@ units, more than {MAX_UNITS}")
    for line in lines[:MAX_UNITS]:
        fields = line[1:] if line[0] == "\u25cf" else line  # the mark of a failed unit
        if len(fields) < 3 or not _UNIT_RE.fullmatch(fields[0]):
            users.unknown.append(f"systemctl list-units printed {' '.join(fields)[:200]!r}")
            continue
        unit, state = fields[0], fields[2]
        try:
            pid = _main_pid(unit, run)
            if pid == 0:
                if state in ("active", "reloading"):
                    raise ValueError(f"{unit} is {state} without a main process (MainPID 0)")
                continue  # starting again or stopping: no main process now
            argv, cwd = _argv_of(pid, unit)
        except OSError as exc:
            users.unknown.append(f"{unit}'s main process cannot be read ({exc.strerror})")
            continue
        except ValueError as exc:  # NumberError is one
            users.unknown.append(str(exc))
            continue
        program = argv[0] if cwd is None else os.path.join(cwd, argv[0])
        users.take_argv(argv[1:], f"{unit} (running)", program)


def _marker(path: str, name: str) -> tuple[dict, str]:
    """({version, key} of a version's marker, or {}; why it is not one, "" when it is)."""
    file = os.path.join(path, MARKER)
    try:
        data = read_regular(file, SMALL)
        if data is None:
            return {}, f"no {MARKER}"
        meta = bounded_loads(data, file)
    except (OSError, ValueError) as err:
        return {}, f"{file} cannot be read ({getattr(err, 'strerror', None) or err})"
    if not isinstance(meta, dict):
        return {}, f"{file} is not a JSON object"
    version, key = meta.get("version"), meta.get("key", "")
    if not isinstance(version, str) or version != name:
        return {}, f"{file} names another version"
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        return {}, f"{file}: its key is not a package set's key"
    return {"version": version, "key": key}, ""


def survey(root: str, wanted_key: str, run: Runner, units_dir: str, state_dir: str) -> dict:
    """What the module reports: every version folder with its users, the legacy one, and what
    could not be read (`unknown`: then nothing may be removed)."""
    users = Users(root)
    _dropin_users(users, units_dir, state_dir)
    _running_users(users, run)
    versions, building = [], []
    folder = os.path.join(root, VERSIONS)
    if os.path.isdir(folder) and not os.path.islink(folder):
        names, problem = listing(folder, "the versions folder")
        users.unknown += [problem] if problem else []
        entries = []
        for name in names:
            path = os.path.join(folder, name)
            if name.startswith(BUILDING):
                building.append(name)
            elif NAME_RE.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
                entries.append((os.lstat(path).st_mtime, name))
        for _mtime, name in sorted(entries):
            path = os.path.join(folder, name)
            meta, problem = _marker(path, name)
            python = os.path.join(path, "bin", "python")
            versions.append({
                "name": name, "python": python, "ready": bool(meta) and os.path.exists(python),
                "key": meta.get("key", ""), "problem": problem, "used_by": users.of(name),
            })  # fmt: skip
    legacy = os.path.isfile(os.path.join(root, "pyvenv.cfg"))
    return {
        "versions": versions,
        "building": sorted(building),
        "building_used_by": {name: users.of(name) for name in building if users.of(name)},
        "legacy": {"present": legacy, "used_by": users.of("")},
        "wanted_key": wanted_key,
        "unknown": users.unknown,
    }


def _unknown_refusal(found: dict, doing: str) -> ValueError:
    shown = found["unknown"][:5]
    more = len(found["unknown"]) - len(shown)
    return ValueError(
        f"nothing was {doing}: who uses the SGLang versions cannot be proven, because "
        + "; ".join(shown)
        + (f"; and {more} more" if more > 0 else "")
        + " (a version a server runs, is configured with or would roll back to is never removed)"
    )


def _wanted(found: dict, wanted: str) -> dict | None:
    return next((v for v in found["versions"] if v["name"] == wanted), None)


def install(root: str, wanted: str, found: dict, check: bool) -> list[str]:
    """.building-<wanted> renamed to <wanted>; an unused old <wanted> removed first, only when
    who uses the versions is proven (found["unknown"] empty)."""
    old = _wanted(found, wanted)
    if old and old["used_by"]:
        raise ValueError(
            f"{root}/{VERSIONS}/{wanted} is used by {', '.join(old['used_by'])}: a version a "
            "server runs, is configured with or would roll back to is never changed in place"
        )
    if old and found["unknown"]:
        raise _unknown_refusal(found, f"replaced ({root}/{VERSIONS}/{wanted} is there)")
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
    """Versions removed: those `remove` names, then the oldest unused beyond `keep`, and the
    leftovers of interrupted builds; nothing at all when one of them is used or who uses the
    versions cannot be proven (found["unknown"])."""
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
    building_used = found.get("building_used_by") or {}
    if building_used:
        raise ValueError(
            "nothing was removed: an unfinished build is named as a server's interpreter: "
            + "; ".join(f"{name} (used by {', '.join(who)})" for name, who in building_used.items())
        )
    gone = [name for name in remove if name in names]
    left = [n for n in names if n not in gone]
    spare = [n for n in left if n != wanted and n not in used]
    while len(left) > keep and spare:
        oldest = spare.pop(0)
        gone.append(oldest)
        left.remove(oldest)
    if (gone or found["building"]) and found["unknown"]:
        raise _unknown_refusal(found, "removed")
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
            # The hash of a package set (the role's), not a secret.
            "wanted_key": {"type": "str", "default": "", "no_log": False},
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
        if not NAME_RE.fullmatch(name):
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
    if found["unknown"]:
        module.warn(str(_unknown_refusal(found, "removed this run")))
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
