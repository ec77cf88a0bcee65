"""gpu_cleanup's ownership rules: whether a process is a leftover of the SGLang service.

Reads what procfs.py found (cgroup path, uids, command line, process title) and applies the
rules of docs/GPU-CLEANUP.md, in their order: containers, logins of other users, systemd units,
then titles and launch modules under an owner uid; a port only adds evidence. Decides only:
sends no signal. Standard library only: it runs on GPU hosts.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.sglang_fleet.fleet.plugins.module_utils.procfs import ProcInfo, user_name

_UNIT_SUFFIXES = (".service", ".scope")
# The names below are matched whole, with fullmatch (`$` would take a name ending in a newline).
# How container runtimes name their cgroups (docs/GPU-CLEANUP.md, "Containers"): a systemd scope
# per container (systemd cgroup driver) ...
_CONTAINER_SCOPE = re.compile(r"(docker|cri-containerd|crio|containerd|libpod|machine)-.+\.scope")
# ... or a runtime directory holding one directory per container (cgroupfs driver) ...
_CONTAINER_DIRS = frozenset({"docker", "containerd", "crio", "lxc", "libpod_parent"})
# ... or whole subtrees that hold nothing but containers, pods and virtual machines.
_CONTAINER_TREES = ("kubepods", "lxc.payload.", "lxc.monitor.", "machine.slice")
_KUBE_POD = re.compile(r"pod[0-9a-fA-F_-]+")
# logind puts every login of user N (its session scopes, its user manager) under user-N.slice.
_USER_SLICE = re.compile(r"user-(\d+)\.slice")


class OwnerError(ValueError):
    """ours.users names a user this host does not know."""


def _parts(cgroup_path: str) -> list[str]:
    return [part for part in cgroup_path.split("/") if part]


def owning_unit(cgroup_path: str) -> str | None:
    """The innermost systemd unit (service or scope) in a cgroup path, or None.

    Sub-cgroups a delegated unit makes for itself carry no unit suffix and are skipped.
    """
    for part in reversed(_parts(cgroup_path)):
        if part.endswith(_UNIT_SUFFIXES):
            return part
    return None


def _is_container_part(parts: list[str], i: int) -> bool:
    part = parts[i]
    if part in _CONTAINER_DIRS:
        return i + 1 < len(parts)
    return bool(_CONTAINER_SCOPE.fullmatch(part)) or part.startswith(_CONTAINER_TREES)


def container_cgroup(cgroup_path: str) -> str | None:
    """The path from the first container cgroup on (``docker-ID.scope``, ``docker/ID``,
    ``kubepods.slice/...``), or None when the path is in no container."""
    parts = _parts(cgroup_path)
    for i in range(len(parts)):
        if _is_container_part(parts, i):
            return "/".join(parts[i:])
    return None


def container_root(cgroup_path: str) -> str:
    """The cgroup of the innermost container that cgroup_path lies in; "" outside containers.

    Applied to this module's own cgroup: run inside a container (a system container, a test
    host), the module sees that container's processes as a host sees its own. A path whose
    container cannot be delimited gives "", so that everything in it stays foreign.
    """
    parts = _parts(cgroup_path)
    end, i, in_kubepods = 0, 0, False
    while i < len(parts):
        part = parts[i]
        in_kubepods = in_kubepods or part.startswith("kubepods")
        if part in _CONTAINER_DIRS or (in_kubepods and _KUBE_POD.fullmatch(part)):
            # The next part is the container (cgroupfs: docker/ID, kubepods/QOS/podUID/ID).
            if i + 1 < len(parts):
                end = i + 2
            i += 2
            continue
        if _CONTAINER_SCOPE.fullmatch(part) or part.startswith(("lxc.payload.", "lxc.monitor.")):
            end = i + 1
        i += 1
    return "/" + "/".join(parts[:end]) if end else ""


def relative_cgroup(cgroup_path: str, root: str) -> str:
    """cgroup_path below root when it lies there (root "" leaves it as it is)."""
    if root and (cgroup_path == root or cgroup_path.startswith(root + "/")):
        return cgroup_path[len(root) :] or "/"
    return cgroup_path


def login_uid(cgroup_path: str) -> int | None:
    """N when the path lies in user-N.slice (a login of user N), else None."""
    for part in _parts(cgroup_path):
        if matched := _USER_SLICE.fullmatch(part):
            return int(matched.group(1))
    return None


@dataclass
class OursRules:
    units: list[str] = field(default_factory=list)
    process_titles: list[str] = field(default_factory=list)
    launch_modules: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    users: list[str] = field(default_factory=lambda: ["root"])

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> OursRules:
        params = params or {}
        units = [u if "." in u else f"{u}.service" for u in params.get("units") or []]
        users = params.get("users")
        return cls(
            units=units,
            process_titles=list(params.get("process_titles") or []),
            launch_modules=list(params.get("launch_modules") or []),
            ports=[int(p) for p in params.get("ports") or []],
            users=["root"] if users is None else [str(u) for u in users],
        )


def resolve_owner_uids(users: Iterable[str]) -> set[int]:
    """uids of ours.users (names or numeric uids); an unknown name is an error, not a skip."""
    uids, unknown = set(), []
    for user in users:
        text = str(user).strip()
        if text.isdigit():
            uids.add(int(text))
            continue
        try:
            uids.add(pwd.getpwnam(text).pw_uid)
        except KeyError:
            unknown.append(text)
    if unknown:
        raise OwnerError(
            f"ours.users: no user {', '.join(repr(u) for u in unknown)} on this host. List the "
            "users whose leftover SGLang processes may be killed, as user names or numeric uids "
            "(the gpu_cleanup role's gpu_cleanup_owner_users: root and the service user)."
        )
    return uids


def runs_module(argv: list[str], module: str) -> bool:
    """True when argv runs ``python ... -m module`` (also ``-mmodule``)."""
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv):
            return argv[i + 1] == module
        if arg.startswith("-m") and not arg.startswith("--"):
            return arg[2:] == module
    return False


def has_title(info: ProcInfo, prefix: str) -> bool:
    """Process title match; the kernel's comm keeps only 15 bytes of a title."""
    joined = " ".join(info.cmdline)
    return joined.startswith(prefix) or (bool(info.comm) and info.comm.startswith(prefix[:15]))


Verdict = tuple[bool, list[str]]


@dataclass
class Ownership:
    """Decides whether a process is a leftover of the service; rules in docs/GPU-CLEANUP.md.

    In order: a container cgroup makes it foreign; a login slice (user-N.slice) of a user who is
    not an owner makes it foreign; one of ours.units makes it ours, whatever its uid; any other
    systemd unit makes it foreign. Then a title or launch-module match makes it ours only when
    its real and effective uids are owner uids. A port of ours only adds evidence: alone it
    proves nothing, since anything may listen on a free port.
    """

    rules: OursRules
    owner_uids: set[int]
    # Cgroup of the container this module runs in ("" on a host): see container_root().
    own_container: str = ""

    def classify(self, info: ProcInfo, ports: Iterable[int] = ()) -> Verdict:
        """(ours, reasons): the rule that matched, or why the process is foreign."""
        port_reasons = [f"port:{p}" for p in sorted(set(ports))]
        by_scope = self._by_scope(relative_cgroup(info.cgroup, self.own_container))
        if by_scope is not None:
            return by_scope
        matched = [f"process_title:{p}" for p in self.rules.process_titles if has_title(info, p)]
        matched += [
            f"launch_module:{m}" for m in self.rules.launch_modules if runs_module(info.cmdline, m)
        ]
        if not matched and port_reasons:
            listed = ", ".join(r.removeprefix("port:") for r in port_reasons)
            return False, [
                f"listens on port {listed} of ours but has no title or launch module of ours "
                "(a port alone proves nothing)"
            ]
        if not matched:
            return False, ["matches no rule of ours"]
        stranger = self._not_owner(info)
        if stranger:
            return False, [f"looks like ours ({', '.join(matched + port_reasons)}) but {stranger}"]
        return True, matched + port_reasons

    def _by_scope(self, cgroup_path: str) -> Verdict | None:
        """The verdict the cgroup alone gives, or None when it leaves the question open."""
        container = container_cgroup(cgroup_path)
        if container:
            return False, [f"inside container {container}"]
        unit = owning_unit(cgroup_path)
        uid = login_uid(cgroup_path)
        if uid is not None:
            # A login of an owner (root's ssh session that ran nohup) proves nothing either
            # way; a login of anyone else is theirs, whatever uid the process runs as.
            if uid in self.owner_uids:
                return None
            where = unit or f"user-{uid}.slice"
            return False, [
                f"inside {where} of user {user_name(uid)} (uid {uid}), not an owner user"
            ]
        if unit in self.rules.units:
            return True, [f"unit:{unit}"]
        if unit:
            return False, [f"inside systemd unit {unit}, not one of ours.units"]
        return None

    def _not_owner(self, info: ProcInfo) -> str:
        """Why the process's uids disqualify it, or "" when both are owner uids."""
        if info.uid is None:
            return "its uid could not be read"
        if info.uid not in self.owner_uids:
            return f"runs as {info.user} (uid {info.uid}), not an owner user"
        if info.euid is not None and info.euid not in self.owner_uids:
            name = user_name(info.euid)
            return f"runs with effective uid {info.euid} ({name}), not an owner user"
        return ""


def is_ignored(info: ProcInfo, ignore_names: list[str]) -> bool:
    first = os.path.basename(info.cmdline[0]) if info.cmdline else ""
    return any(name in (info.comm, first) or info.comm == name[:15] for name in ignore_names)
