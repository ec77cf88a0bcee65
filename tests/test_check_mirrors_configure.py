"""The `check` entry point's first pass must look at everything configure.yml writes.

roles/sglang_server/tasks/check.yml decides that a host needs no rollout when the host holds
what a rollout would write; a file, directory, mode or user setting that configure.yml manages
and check.yml does not compare would let a drifted host pass as converged. This test reads both
files and fails when configure.yml manages something check.yml does not name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROLE = Path(__file__).resolve().parent.parent / "roles" / "sglang_server" / "tasks"
WRITERS = ("ansible.builtin.template", "ansible.builtin.copy", "ansible.builtin.file")


def configure_tasks() -> list[dict[str, Any]]:
    return yaml.safe_load((ROLE / "configure.yml").read_text())


def check_text() -> str:
    return (ROLE / "check.yml").read_text()


def core(expression: str) -> str:
    """`{{ item.paths.dropin }}` -> `item.paths.dropin`; a literal path stays as it is."""
    match = re.fullmatch(r"\{\{\s*(.+?)\s*\}\}", expression.strip())
    return match.group(1) if match else expression.strip()


def managed() -> list[tuple[str, str, dict[str, Any]]]:
    """(task name, module, arguments) of every task of configure.yml that writes something."""
    out = []
    for task in configure_tasks():
        for module in (*WRITERS, "ansible.builtin.user", "ansible.builtin.group",
                       "ansible.builtin.systemd_service"):  # fmt: skip
            if module in task:
                out.append((task["name"], module, task[module] or {}))
    return out


def test_configure_yml_is_read_as_expected() -> None:
    modules = [module for _, module, _ in managed()]
    assert modules.count("ansible.builtin.template") >= 5
    assert "ansible.builtin.user" in modules and "ansible.builtin.group" in modules


def test_every_written_path_template_and_mode_is_compared() -> None:
    text = check_text()
    tasks = {task["name"]: task for task in configure_tasks()}
    missing = []
    for name, module, args in managed():
        if module not in WRITERS:
            continue
        target = args.get("dest") or args.get("path")
        paths = [core(target)] if target != "{{ item }}" else tasks[name]["loop"]
        for path in paths:
            if core(path) not in text:
                missing.append(f"{name}: {path}")
        if "src" in args and args["src"] not in text:
            missing.append(f"{name}: template {args['src']}")
        if (
            "mode" in args
            and f"'mode': '{args['mode']}'" not in text
            and (f'mode: "{args["mode"]}"' not in text)
        ):
            missing.append(f"{name}: mode {args['mode']}")
        if args.get("state") == "absent" and "'absent': true" not in text:
            missing.append(f"{name}: absent")
    assert missing == [], "configure.yml manages what check.yml does not compare"


def test_the_service_user_group_and_units_are_compared() -> None:
    text = check_text()
    [user] = [args for _, module, args in managed() if module == "ansible.builtin.user"]
    for field in ("shell", "home"):
        assert f"{field}: {user[field]}" in text, field
    assert 'groups: ["{{ sglang_server_group }}"]' in text
    assert "units: \"{{ sglang_server_servers | map(attribute='unit') }}\"" in text
