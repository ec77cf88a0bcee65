"""Ansible filters for the ml_env role: requirement specifiers read once, with `packaging`
(PEP 508 requirements, PEP 440 versions: what pip itself reads), bounded.

{{ ml_env_extra_packages | ml_env_requirements }}        [{name, version, spec}] per requirement
{{ lines | ml_env_requirements(skip=['sglang']) }}      the same without the named packages
{{ reqs | ml_env_unmet(installed) }}                     those the installed {name: version} lacks
{{ python_version | ml_env_python_misses(clauses) }}     the [operator, version] clauses it misses

The role accepts a narrow form (name, name[extras], name==version; its preflight checks each
string against the role's pattern and names the variable); anything else fails here too.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

# Bounds on what is read: a requirement line is short, a lock has some hundreds of lines.
MAX_SPEC_CHARS = 200
MAX_SPECS = 2000
COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
}


def _strings(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise AnsibleFilterError(f"{what}: expected a list of strings, got {value!r:.200}")
    if len(value) > MAX_SPECS:
        raise AnsibleFilterError(f"{what}: {len(value)} entries, at most {MAX_SPECS}")
    return list(value)


def requirement(spec: str) -> dict[str, Any]:
    """{name (PEP 503, as installed distributions are looked up), version (the exact pin, or
    None for any), spec (as given, what pip gets)}; a spec that is not name[extras][==version]
    fails naming it."""
    if len(spec) > MAX_SPEC_CHARS:
        raise AnsibleFilterError(
            f"ml_env_requirements: {spec[:60]!r}... is over {MAX_SPEC_CHARS} characters"
        )
    try:
        req = Requirement(spec)
    except InvalidRequirement as exc:
        raise AnsibleFilterError(
            f"ml_env_requirements: {spec!r} is not a requirement: {exc}"
        ) from None
    pins = list(req.specifier)
    if req.url or req.marker or len(pins) > 1 or (pins and pins[0].operator != "=="):
        raise AnsibleFilterError(f"ml_env_requirements: {spec!r} must be name or name==version")
    return {
        "name": canonicalize_name(req.name),
        "version": pins[0].version if pins else None,
        "spec": spec,
    }


def ml_env_requirements(specs: Any, skip: Any = None) -> list[dict[str, Any]]:
    """Each requirement string read (see requirement), those named in skip left out."""
    skipped = {canonicalize_name(name) for name in _strings(skip, "ml_env_requirements skip")}
    reqs = [requirement(spec) for spec in _strings(specs, "ml_env_requirements")]
    return [req for req in reqs if req["name"] not in skipped]


def ml_env_unmet(reqs: Any, installed: Any) -> list[dict[str, Any]]:
    """The requirements the installed distributions ({PEP 503 name: version}) do not meet: not
    installed, or installed at another version than the pin."""
    if not isinstance(installed, Mapping):
        raise AnsibleFilterError("ml_env_unmet: the installed distributions must be a mapping")
    unmet = []
    for req in reqs or []:
        have = installed.get(req["name"])
        if have is None or (req.get("version") and have != req["version"]):
            unmet.append(req)
    return unmet


def ml_env_python_misses(python_version: Any, clauses: Any) -> list[str]:
    """The Requires-Python clauses ([operator, version] pairs) the interpreter's version does
    not satisfy, each as written (">=3.11"); an unreadable version misses every clause."""
    try:
        have = Version(str(python_version).strip())
    except InvalidVersion:
        have = None
    misses = []
    for clause in clauses or []:
        if not isinstance(clause, list | tuple) or len(clause) != 2 or clause[0] not in COMPARE:
            raise AnsibleFilterError(f"ml_env_python_misses: {clause!r} is not [operator, version]")
        op, version = str(clause[0]), str(clause[1])
        try:
            met = have is not None and COMPARE[op](have, Version(version))
        except InvalidVersion:
            met = False
        if not met:
            misses.append(op + version)
    return misses


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "ml_env_requirements": ml_env_requirements,
            "ml_env_unmet": ml_env_unmet,
            "ml_env_python_misses": ml_env_python_misses,
        }
