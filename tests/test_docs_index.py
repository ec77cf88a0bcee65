"""The map a newcomer reads: a short README, and an index of docs/ that links every page.

- README.md is at most 150 lines and names `make test` as the test command (.ci/run runs "the
  README's test command");
- every role under roles/ is a row of the README's role table, every playbook under playbooks/
  a row of its playbook table;
- every docs/*.md page is linked from docs/README.md;
- every relative Markdown link, and every `docs/NAME.md` named in the text, of README.md and
  docs/*.md points to a file that exists;
- the README's inventory example is a valid inventory: the roles' argument specs accept it and
  the sglang_server role describes its server.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
INDEX = DOCS / "README.md"
MAX_README_LINES = 150
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "tasks").is_dir())
PLAYBOOKS = sorted(p.name for p in (ROOT / "playbooks").glob("*.yml"))
PAGES = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
CHECKED = [README, *sorted(DOCS.glob("*.md"))]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS_NAMED = re.compile(r"(?<![\w./-])docs/[\w.-]+\.md\b")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def _prose(path: Path) -> str:
    """The file without its fenced code blocks (examples, not links)."""
    return FENCE.sub("", _text(path))


def _relative_links(path: Path) -> list[str]:
    """Link targets that point into this checkout (no URL scheme, no bare #anchor)."""
    found = []
    for target in LINK.findall(_prose(path)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        found.append(target.split("#", 1)[0])
    return found


def _table_names(text: str, header: str) -> set[str]:
    """The backquoted names in the column headed `header` of the README's Markdown tables."""
    names: set[str] = set()
    column = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            column = None
        elif header in cells:
            column = cells.index(header)
        elif column is not None and column < len(cells):
            names.update(re.findall(r"`([^`]+)`", cells[column]))
    return names


def test_readme_is_short() -> None:
    lines = len(_text(README).splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move the detail to docs/ "
        "and link it from docs/README.md"
    )


def test_readme_names_the_test_command() -> None:
    """.ci/run is "the README's test command": the README shows it as a command line."""
    commands = re.findall(r"^```sh\n(.*?)^```", _text(README), re.S | re.M)
    assert any(re.match(r"make test\b", line) for block in commands for line in block.splitlines())


@pytest.mark.parametrize("role", ROLES)
def test_role_in_readme_table(role: str) -> None:
    assert role in _table_names(_text(README), "role"), (
        f"roles/{role} is not a row of the README's role table (| role | ... |)"
    )


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_playbook_in_readme_table(playbook: str) -> None:
    assert playbook in _table_names(_text(README), "playbook"), (
        f"playbooks/{playbook} is not a row of the README's playbook table (| playbook | ... |)"
    )


@pytest.mark.parametrize("page", PAGES)
def test_page_linked_from_docs_index(page: str) -> None:
    linked = {(INDEX.parent / t).resolve() for t in _relative_links(INDEX)}
    assert (DOCS / page).resolve() in linked, f"docs/{page} is not linked from docs/README.md"


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    broken = [t for t in _relative_links(path) if not (path.parent / t).exists()]
    broken += [n for n in DOCS_NAMED.findall(_prose(path)) if not (ROOT / n).is_file()]
    assert broken == [], f"{path.relative_to(ROOT)} points to files that do not exist: {broken}"


@pytest.mark.slow
def test_readme_inventory_example_is_valid(tmp_path: Path) -> None:
    """The README's one inventory example (files marked `# <path>.yml` in its first YAML block)
    passes the provisioning roles' argument specs, and the sglang_server role describes it."""
    block = re.search(r"^```yaml\n(.*?)^```", _text(README), re.S | re.M)
    assert block, "README.md has no YAML inventory example"
    parts = re.split(r"^# (\S+\.yml)\n", block.group(1), flags=re.M)
    files = dict(zip(parts[1::2], parts[2::2], strict=True))
    assert "hosts.yml" in files, files.keys()
    for name, body in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("---\n" + body, encoding="utf-8")
    specs = (
        "{{ (lookup('file', '" + str(ROOT / "roles") + "/' ~ item ~ '/meta/argument_specs.yml')"
        " | from_yaml).argument_specs.main.options }}"
    )
    play = {
        "name": "The README's inventory example",
        "hosts": "gpu_hosts",
        "gather_facts": False,
        "connection": "local",
        "tasks": [
            {
                "name": "The provisioning variables against their roles' argument specs",
                "ansible.builtin.validate_argument_spec": {"argument_spec": specs},
                "loop": ["nvidia_driver", "ml_env"],
            },
            {
                "name": "Describe the servers",
                "ansible.builtin.include_role": {"name": "sglang_server", "tasks_from": "resolve"},
            },
            {
                "name": "Show the argv",
                "ansible.builtin.debug": {
                    "msg": "{{ sglang_server_servers | map(attribute='argv') | list | to_json }}"
                },
            },
        ],
    }
    (tmp_path / "play.yml").write_text(json.dumps([play]), encoding="utf-8")
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_ROLES_PATH": str(ROOT / "roles"),
        "SGLANG_API_KEY": "readme-example-key",
    }
    done = subprocess.run(
        [
            str(ROOT / ".venv" / "bin" / "ansible-playbook"),
            "-i",
            str(tmp_path / "hosts.yml"),
            str(tmp_path / "play.yml"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sglang.launch_server" in done.stdout and "--model-path" in done.stdout, done.stdout
