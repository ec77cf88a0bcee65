"""sglang_fleet's layers (docs/ARCHITECTURE.md, "Package map"): each subpackage imports only from
the floor (the package's own top-level modules and module_utils) and from subpackages of a lower
layer, never upward or sideways; no import circle between modules; every module is listed in the
map with one line. A module of a nested package (smoke/smoke_client/) counts as its subpackage's
and is listed by its own path; a package's __init__.py is left out (it holds the package's
docstring), a __main__.py is a module like any other and is listed. Run it alone:
.venv/bin/pytest -q tests/test_package_layers.py
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sglang_fleet"
# Lower layers first; a subpackage may import from a layer below its own, and from the floor.
LAYERS = {
    "capacity": 1,
    "servers": 2,
    "smoke": 2,
    "monitoring": 2,
    "diagnosis": 3,
    "tuning": 3,
    "job": 3,
    "rollout": 4,
}
MAP_START = "## Package map"


def modules() -> dict[str, Path]:
    """{dotted name below sglang_fleet: file}, package __init__ files left out (nested packages'
    modules included, __main__.py too: smoke.smoke_client.__main__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py" or "__pycache__" in path.parts:
            continue
        found[".".join(path.relative_to(PACKAGE).with_suffix("").parts)] = path
    return found


def imports(path: Path) -> set[str]:
    """The sglang_fleet modules a file imports (function-level imports too), below the package
    name: `from sglang_fleet.capacity import planner` gives capacity.planner."""
    names = set(modules())
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "sglang_fleet" and not node.module.startswith("sglang_fleet."):
                continue
            base = node.module.removeprefix("sglang_fleet").lstrip(".")
            for alias in node.names:
                candidate = f"{base}.{alias.name}" if base else alias.name
                found.add(candidate if candidate in names else base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("sglang_fleet."):
                    found.add(alias.name.removeprefix("sglang_fleet."))
    return {name for name in found if name and not name.startswith("module_utils")}


def layer(module: str) -> tuple[str, int]:
    """(subpackage, its layer); the floor is ("", 0)."""
    package = module.split(".", 1)[0] if "." in module else ""
    return package, LAYERS.get(package, 0)


def test_every_subpackage_has_a_layer() -> None:
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert packages == set(LAYERS), "add the subpackage to LAYERS and to the map"


def test_no_import_goes_upward_or_sideways() -> None:
    wrong = []
    for name, path in modules().items():
        package, rank = layer(name)
        for target in imports(path):
            target_package, target_rank = layer(target)
            if target_package in ("", package):  # the floor, or its own subpackage
                continue
            if package and target_rank < rank:  # a lower layer
                continue
            wrong.append(f"{name} imports {target}")
    assert wrong == [], wrong


def test_the_floor_imports_no_subpackage() -> None:
    wrong = [
        f"{name} imports {target}"
        for name, path in modules().items()
        if "." not in name
        for target in imports(path)
        if "." in target
    ]
    assert wrong == [], wrong


def test_no_import_circle() -> None:
    graph = {name: imports(path) for name, path in modules().items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            raise AssertionError("import circle: " + " -> ".join([*trail, name]))
        if name in done or name not in graph:
            return
        for target in sorted(graph[name]):
            visit(target, [*trail, name])
        done.add(name)

    for name in graph:
        visit(name, [])


def test_the_map_lists_every_module_with_one_line() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert MAP_START in text
    section = text.split(MAP_START, 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- `sglang_fleet/([a-z_/]+)\.py`: \S", section, re.M)
    on_disk = {str(path.relative_to(PACKAGE).with_suffix("")) for path in modules().values()}
    assert sorted(listed) == sorted(on_disk)
    assert len(listed) == len(set(listed))


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    """The reader sees the import forms the package uses (so the checks above can fail)."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from sglang_fleet.capacity import planner as plan\n"
        "from sglang_fleet.servers.describe import SERVERS_VAR\n"
        "from sglang_fleet import ansible_values\n"
        "def late():\n"
        "    from sglang_fleet.smoke.smoke_client.prometheus_text import parse_series\n"
        "from sglang_fleet.smoke.smoke_client import server_json\n"
        "from sglang_fleet.module_utils import fleet_http\n",
        encoding="utf-8",
    )
    assert imports(sample) == {
        "capacity.planner",
        "servers.describe",
        "ansible_values",
        "smoke.smoke_client.prometheus_text",
        "smoke.smoke_client.server_json",
    }
    assert layer("rollout.restart") == ("rollout", 4) and layer("ansible_values") == ("", 0)
    # A nested package's __main__.py is a module (listed in the map); its __init__.py is not.
    assert "smoke.smoke_client.__main__" in modules() and "smoke.smoke_client" not in modules()
