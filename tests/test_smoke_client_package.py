"""The smoke client package (sglang_fleet/smoke/smoke_client/) runs on GPU hosts with the host's
python3 as one zipapp built from its files: every file imports only the standard library, the
package's own modules (absolute imports) and the project's one URL rule (plugins/module_utils/
fleet_http.py, standard library only, packed beside them), importing the package imports none
of them, and `python -m sglang_fleet.smoke.smoke_client` still runs. Run it alone:
.venv/bin/pytest -q tests/test_smoke_client_package.py
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sglang_fleet" / "smoke" / "smoke_client"
NAME = "sglang_fleet.smoke.smoke_client"
# One job per module; other code imports them by these names.
MODULES = {
    "__init__",
    "__main__",
    "failures",
    "server_json",
    "workload",
    "http_client",
    "streams",
    "prometheus_text",
    "server_metrics",
    "benchmark",
    "summary",
    "command_line",
}
# What the package imports from outside itself: the one URL rule (check_url), standard library
# only, which the zipapp packs beside the package.
SHARED = {"sglang_fleet.module_utils.fleet_http"}


def _files() -> list[Path]:
    return sorted(PACKAGE.glob("*.py"))


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module imported, relative level) for every import in a file, nested ones too; for
    `from PACKAGE import name` both PACKAGE and PACKAGE.name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            found.append((module, node.level))
            if module == NAME:
                found += [(f"{module}.{alias.name}", node.level) for alias in node.names]
    return found


def test_the_package_has_its_modules_and_no_other() -> None:
    assert {path.stem for path in _files()} == MODULES
    assert not (PACKAGE.parent / "smoke_client.py").exists()


def test_every_file_imports_only_the_standard_library_and_the_package() -> None:
    own = {f"{NAME}.{name}" for name in MODULES}
    wrong = []
    for path in _files():
        for module, level in _imports(path):
            top = module.split(".", 1)[0]
            if level:
                wrong.append(f"{path.name}: relative import (level {level}) of {module!r}")
            elif module == "__future__" or top in sys.stdlib_module_names:
                continue
            elif module not in own and module != NAME and module not in SHARED:
                wrong.append(f"{path.name}: imports {module}")
    assert wrong == [], wrong


def test_every_file_has_a_docstring_and_future_annotations() -> None:
    """Python 3.9 on the host: annotations stay strings (`int | None`)."""
    for path in _files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert ast.get_docstring(tree), path.name
        assert ("__future__", 0) in _imports(path), path.name


def test_the_package_itself_imports_none_of_its_modules() -> None:
    assert [module for module, _ in _imports(PACKAGE / "__init__.py")] == ["__future__"]
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys, {NAME}; print([m for m in sys.modules if m.startswith('{NAME}.')])",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_python_m_help_exits_0() -> None:
    run = subprocess.run(
        [sys.executable, "-m", NAME, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: ") and "--vocab-size" in run.stdout, run.stdout
