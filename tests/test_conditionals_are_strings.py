"""Every conditional in the roles, playbooks and scenarios is a string (or a bool) once YAML has
read it.

A plain YAML scalar that holds ``: `` is a mapping, not text: ``- x | default({'a': true}) is
skipped`` reads as ``{"x | default({'a'": "true}) is skipped"}``, which yamllint and ansible-lint
accept and Ansible refuses only when the task runs ("Conditional expressions must be strings"),
in a handler perhaps only one scenario reaches (issue 47's merge found one that way).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("when", "changed_when", "failed_when", "until")
FILES = sorted(
    p
    for pattern in ("roles/**/*.yml", "playbooks/*.yml", "molecule/**/*.yml")
    for p in ROOT.glob(pattern)
    if ".cache" not in p.parts
)


def _not_strings(node: Any) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in KEYS:
                for item in value if isinstance(value, list) else [value]:
                    if not isinstance(item, (str, bool)):
                        found.append((key, item))
            found += _not_strings(value)
    elif isinstance(node, list):
        for item in node:
            found += _not_strings(item)
    return found


def test_there_are_files_to_read() -> None:
    assert len(FILES) > 50


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_conditional_is_a_string(path: Path) -> None:
    assert _not_strings(yaml.safe_load(path.read_text())) == []


def test_a_plain_scalar_with_a_colon_is_caught() -> None:
    text = "- name: x\n  when:\n    - _r | default({'skipped': true}) is skipped\n"
    assert _not_strings(yaml.safe_load(text)) == [
        ("when", {"_r | default({'skipped'": "true}) is skipped"})
    ]
