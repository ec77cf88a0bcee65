"""A role's inside stays inside it (docs/ARCHITECTURE.md, "Roles and their interface").

- A `_`- or `__`-prefixed name of a role (`_<role>_*`, `__<role>_*`) is read or set only in that
  role's own files (a template the role links to from the shared templates/ is its own): not in
  playbooks, other roles, or Python that reads hostvars (sglang_fleet/, plugins/action/,
  plugins/filter/). What a caller needs is a documented `<role>_*` result or an argument.
  Molecule's verify steps are tests, like tests/: they may look inside.
- Every task file another role, a playbook or a molecule scenario calls (`include_role` /
  `import_role` with `tasks_from`) has an argument spec named after the file, and every spec
  names a task file (a spec without one validates nothing).
- Inside sglang_server, the results its entry points publish are listed in its README.
The checks read the files as they are, so a name or an entry point added later is covered.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "tasks").is_dir())
# Where a role's inside could be read from outside it.
OUTSIDE = [
    *sorted((ROOT / "playbooks").glob("**/*.yml")),
    *sorted((ROOT / "templates").glob("*.j2")),
    *sorted((ROOT / "sglang_fleet").glob("**/*.py")),
    *sorted((ROOT / "plugins" / "action").glob("*.py")),
    *sorted((ROOT / "plugins" / "filter").glob("*.py")),
]
# The results sglang_server publishes for its callers (README "Outputs").
PUBLISHED = ("sglang_server_restarted", "sglang_server_rollback", "sglang_server_router_out")


def internal_names(role: str, text: str) -> set[str]:
    return set(re.findall(rf"(?<![A-Za-z0-9_])_{{1,2}}{re.escape(role)}_[a-z0-9_]+", text))


def inside(role: str, path: Path) -> bool:
    """The role's own file: under roles/<role>/, or a template its templates/ links to."""
    templates = ROOT / "roles" / role / "templates"
    return path.is_relative_to(ROOT / "roles" / role) or (
        templates.is_symlink() and path.resolve().is_relative_to(templates.resolve())
    )


def role_files(role: str) -> Iterator[Path]:
    yield from (p for p in (ROOT / "roles" / role).rglob("*") if p.is_file() and not p.is_symlink())


def leaks(role: str, files: list[Path]) -> dict[str, list[str]]:
    """{file: the role's internal names it reads or sets} for files outside the role."""
    found = {}
    for path in files:
        if inside(role, path):
            continue
        names = internal_names(role, path.read_text(encoding="utf-8", errors="replace"))
        if names:
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            found[str(shown)] = sorted(names)
    return found


def outside_files(role: str) -> list[Path]:
    others = [p for r in ROLES if r != role for p in role_files(r) if p.suffix in (".yml", ".j2")]
    return [*OUTSIDE, *others]


@pytest.mark.parametrize("role", ROLES)
def test_no_internal_name_of_a_role_is_read_or_set_outside_it(role: str) -> None:
    assert leaks(role, outside_files(role)) == {}


def test_the_leak_check_catches_a_playbook_that_sets_an_internal_name(tmp_path: Path) -> None:
    playbook = tmp_path / "play.yml"
    playbook.write_text("- hosts: all\n  vars:\n    _sglang_server_locked_by_caller: true\n")
    python = tmp_path / "reader.py"
    python.write_text('facts.get("__sglang_server_lock")\nfacts.get("sglang_server_restarted")\n')
    assert leaks("sglang_server", [playbook, python]) == {
        str(playbook): ["_sglang_server_locked_by_caller"],
        str(python): ["__sglang_server_lock"],
    }


def _tasks(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, list):
        for item in node:
            yield from _tasks(item)
    elif isinstance(node, dict):
        yield node
        for key in ("block", "rescue", "always", "tasks", "pre_tasks", "post_tasks", "handlers"):
            yield from _tasks(node.get(key))


def called_entry_points(files: list[Path]) -> set[tuple[str, str]]:
    """(role, task file) for every include_role / import_role with tasks_from in files."""
    called = set()
    for path in files:
        for task in _tasks(yaml.safe_load(path.read_text(encoding="utf-8"))):
            for key in ("ansible.builtin.include_role", "ansible.builtin.import_role",
                        "include_role", "import_role"):  # fmt: skip
                args = task.get(key)
                if isinstance(args, dict) and args.get("tasks_from"):
                    # Roles by FQCN (sglang_fleet.fleet.<role>, docs/COLLECTION.md) or short name.
                    role = str(args["name"]).removeprefix("sglang_fleet.fleet.")
                    called.add((role, str(args["tasks_from"]).removesuffix(".yml")))
    return called


def specs_of(role: str) -> set[str]:
    path = ROOT / "roles" / role / "meta" / "argument_specs.yml"
    if not path.is_file():
        return set()
    return set((yaml.safe_load(path.read_text(encoding="utf-8")) or {})["argument_specs"])


def yaml_callers() -> list[Path]:
    return [
        *sorted((ROOT / "playbooks").glob("**/*.yml")),
        *sorted((ROOT / "molecule").glob("**/*.yml")),
        *sorted((ROOT / "roles").glob("*/tasks/*.yml")),
    ]


def unspecified(called: set[tuple[str, str]]) -> list[str]:
    return sorted(f"{role}:{entry}" for role, entry in called if entry not in specs_of(role))


def test_every_entry_point_another_file_calls_has_a_spec() -> None:
    called = called_entry_points(yaml_callers())
    assert ("sglang_server", "rollback_server") in called  # the walk finds the calls
    assert unspecified(called) == []


def test_the_spec_check_catches_an_entry_point_without_one(tmp_path: Path) -> None:
    caller = tmp_path / "caller.yml"
    caller.write_text(
        "- name: x\n  block:\n    - name: y\n      ansible.builtin.include_role:\n"
        "        name: sglang_server\n        tasks_from: clean_gpus\n"
    )
    assert unspecified(called_entry_points([caller])) == ["sglang_server:clean_gpus"]


@pytest.mark.parametrize("role", ROLES)
def test_every_spec_names_a_task_file(role: str) -> None:
    tasks = {p.stem for p in (ROOT / "roles" / role / "tasks").glob("*.yml")}
    assert sorted(specs_of(role) - tasks) == []


def test_the_results_sglang_server_publishes_are_documented() -> None:
    readme = (ROOT / "roles" / "sglang_server" / "README.md").read_text(encoding="utf-8")
    architecture = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    tasks = "".join(
        p.read_text(encoding="utf-8") for p in (ROOT / "roles/sglang_server/tasks").glob("*.yml")
    )
    for name in PUBLISHED:
        assert re.search(rf"(register|{name}):\s", tasks) and name in tasks, name
        assert f"`{name}`" in readme, f"{name} not in the role's README"
        assert name in architecture, f"{name} not in docs/ARCHITECTURE.md"
