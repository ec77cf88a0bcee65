"""Every role's defaults/main.yml, meta/argument_specs.yml and README.md agree.

For each role under roles/ (so roles added later are covered without a change here):
- the variables in defaults/main.yml are exactly the options of its entry points (an option
  marked ``required: true`` needs no default), with equal default values;
- every public variable carries the role's name as prefix;
- the README lists every variable with its default: between the markers below it must be the
  table this file generates (regenerate with ``.venv/bin/python tests/test_argument_specs.py
  roles/<role>``); a README without the markers must still name each variable and its default.

It also checks, through ansible-playbook, that a wrong type or an unknown choice stops the
provisioning roles before any task runs, naming the variable.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import run_local_play

ROOT = Path(__file__).resolve().parent.parent
ROLES = sorted(p for p in (ROOT / "roles").iterdir() if (p / "tasks").is_dir())
BEGIN = "<!-- BEGIN VARIABLES (generated from meta/argument_specs.yml) -->"
END = "<!-- END VARIABLES -->"


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def defaults_of(role: Path) -> dict[str, Any]:
    path = role / "defaults" / "main.yml"
    return (load_yaml(path) or {}) if path.is_file() else {}


def options_of(role: Path) -> dict[str, dict[str, Any]]:
    """Every entry point's options, main's first: each entry point takes only what it needs
    (roles/sglang_server), so a variable may belong to another entry point than main, and a
    role may have no main at all (roles/fleet_lock)."""
    specs = load_yaml(role / "meta" / "argument_specs.yml")["argument_specs"]
    options: dict[str, dict[str, Any]] = {}
    for name in sorted(specs, key=lambda entry: (entry != "main", entry)):
        for option, spec in (specs[name].get("options") or {}).items():
            options.setdefault(option, spec)
    return options


def render_default(value: Any) -> str:
    """A default as it reads in YAML: "580", [], true, 0 (JSON is a YAML subset)."""
    return json.dumps(value)


def default_renderings(spec: dict[str, Any]) -> list[str]:
    """Ways a hand-written README may show a default: JSON or YAML flow style."""
    value = spec.get("default")
    flow = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return [render_default(value), flow.removesuffix("...").strip()]


def _one_line(text: str | list[str]) -> str:
    """Description lines joined, Ansible markup (C(x), I(x)) as Markdown code, pipes escaped."""
    parts = text if isinstance(text, list) else [text]
    joined = " ".join(" ".join(p.split()) for p in parts).replace("|", "\\|")
    return re.sub(r"\b[CI]\(([^)]*)\)", r"`\1`", joined)


def render_table(options: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| Variable | Type | Default | Description |",
        "| --- | --- | --- | --- |",
    ]
    for name, spec in options.items():
        kind = spec.get("type", "str")
        if spec.get("elements"):
            kind = f"{kind} of {spec['elements']}"
        if spec.get("choices"):
            kind = f"{kind}: {' / '.join(str(c) for c in spec['choices'])}"
        default = "required" if spec.get("required") else f"`{render_default(spec.get('default'))}`"
        description = _one_line(spec.get("description", ""))
        lines.append(f"| `{name}` | {kind} | {default} | {description} |")
    return "\n".join(lines)


def generated_section(role: Path) -> str:
    return f"{BEGIN}\n{render_table(options_of(role))}\n{END}"


def write_readme_section(role: Path) -> None:
    """Replace the generated section of the role's README (the markers must be there)."""
    readme = role / "README.md"
    text = readme.read_text(encoding="utf-8")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    readme.write_text(text[:start] + generated_section(role) + text[end:], encoding="utf-8")


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_defaults_and_argument_specs_name_the_same_variables(role: Path) -> None:
    defaults = defaults_of(role)
    options = options_of(role)
    optional = {n for n, s in options.items() if not s.get("required")}
    assert set(defaults) - set(options) == set(), "in defaults/main.yml, not in argument_specs"
    assert optional - set(defaults) == set(), "in argument_specs with a default, not in defaults"


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_defaults_equal_argument_spec_defaults(role: Path) -> None:
    defaults = defaults_of(role)
    differing = {
        name: (defaults[name], spec.get("default"))
        for name, spec in options_of(role).items()
        if name in defaults and defaults[name] != spec.get("default")
    }
    assert differing == {}, "defaults/main.yml value vs argument_specs default"


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_public_variables_carry_the_role_prefix(role: Path) -> None:
    names = set(defaults_of(role)) | set(options_of(role))
    assert [n for n in names if not n.startswith(f"{role.name}_")] == []


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_every_option_is_described_and_typed(role: Path) -> None:
    incomplete = [
        name
        for name, spec in options_of(role).items()
        if not spec.get("description") or not spec.get("type")
    ]
    assert incomplete == []


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_readme_lists_every_variable_with_its_default(role: Path) -> None:
    readme = role / "README.md"
    assert readme.is_file(), f"{role.name} has no README.md"
    text = readme.read_text(encoding="utf-8")
    if BEGIN in text:
        section = text[text.index(BEGIN) : text.index(END) + len(END)]
        assert section == generated_section(role), (
            "README out of date: run .venv/bin/python tests/test_argument_specs.py "
            f"roles/{role.name}"
        )
        return
    lines = text.splitlines()
    missing = [
        name
        for name, spec in options_of(role).items()
        if not any(
            f"`{name}`" in line
            and (spec.get("required") or any(r in line for r in default_renderings(spec)))
            for line in lines
        )
    ]
    assert missing == [], "variables (or their defaults) not in the README"


def test_table_rendering() -> None:
    table = render_table(
        {
            "x_mode": {
                "type": "str",
                "choices": ["open", "proprietary"],
                "default": "open",
                "description": ["A | B", "second  line C(code)"],
            },
            "x_list": {"type": "list", "elements": "int", "default": [], "description": "d"},
            "x_needed": {"type": "int", "required": True, "description": "n"},
        }
    )
    assert table.splitlines()[2:] == [
        '| `x_mode` | str: open / proprietary | `"open"` | A \\| B second line `code` |',
        "| `x_list` | list of int | `[]` | d |",
        "| `x_needed` | int | required | n |",
    ]


# --------------------------------------------------------------------------- validation at run time

BAD_VALUES = [
    ("nvidia_driver", "nvidia_driver_kernel_module", "closed"),
    ("nvidia_driver", "nvidia_driver_expected_gpu_count", "eight"),
    ("ml_env", "ml_env_sglang_install_deps", "sometimes"),
    ("ml_env", "ml_env_extra_packages", {"gpusim": "1.0"}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("role", "variable", "value"), BAD_VALUES)
def test_bad_value_fails_before_any_task_naming_the_variable(
    tmp_path: Path, role: str, variable: str, value: Any
) -> None:
    play = {
        "hosts": "localhost",
        "gather_facts": False,
        "roles": [{"role": role, "vars": {variable: value}}],
    }
    done = run_local_play(tmp_path, play, timeout=120)
    assert done.returncode != 0
    tasks = [line for line in done.stdout.splitlines() if line.startswith("TASK [")]
    # The argument validation is the only task that ran, and its error names the variable.
    assert len(tasks) == 1, tasks
    assert "Validating arguments against arg spec 'main'" in tasks[0]
    assert re.search(rf"argument_errors:\n\s+- .*\b{variable}\b", done.stdout), done.stdout


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        write_readme_section(Path(arg).resolve())
        print(f"updated {arg}/README.md")
