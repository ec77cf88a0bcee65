"""The one file a GPU host runs: a zipapp of an entry module and the sglang_fleet modules it
imports (docs/ARCHITECTURE.md, "Host-side programs").

A program that runs on a GPU host (the smoke client, the diagnosis sampler) is written as
several files of this package; the host gets one file, a zip archive that python3 runs as it
runs a script (``python3 smoke.pyz --url ...``, the standard library's zipimport). What goes in
is found by reading the sources, not by running them (only the packages on the way are imported,
to find their folders): the entry module, every module of ``sglang_fleet`` it imports (at any
depth), and the ``__init__.py`` of each package on the way.
Anything else a host program imports must be the standard library: a host has nothing else,
and an import of anything more is refused here, on the control node, with the file that has it.

The archive is the same bytes for the same sources (fixed names order, timestamps and
permissions), so writing it to a host changes the host only when a source changed.

    python -m sglang_fleet.host_zipapp sglang_fleet.bench.smoke_client.command_line -o smoke.pyz
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import sys
import zipfile
from pathlib import Path

PACKAGE = "sglang_fleet"
SHEBANG = b"#!/usr/bin/env python3\n"
# zip's earliest time; a fixed one keeps the bytes independent of the files' mtimes.
FIXED_TIME = (1980, 1, 1, 0, 0, 0)
# The closure of a host program is a handful of files; far more means an import went astray.
MAX_MODULES = 64


class ZipappError(ValueError):
    """A host program that cannot be built: an import outside the standard library and
    sglang_fleet, or a module that is not there."""


def _source(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ZipappError(f"{module} is not a module of plain Python source")
    return Path(spec.origin)


def _is_package_module(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _imports(module: str, path: Path) -> set[str]:
    """The absolute module names a file imports: `from a.b import c` gives a.b, and a.b.c
    when that is a module of this package. Relative imports are refused (one rule for all)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise ZipappError(f"{path}: a relative import (write `from {PACKAGE}...`)")
            base = node.module or ""
            found.add(base)
            if _is_package_module(base):
                found.update(filter(None, (_submodule(base, a.name) for a in node.names)))
    return found


def _submodule(package: str, name: str) -> str | None:
    """package.name when that is a module of the package (`from a import b`: b may be a module
    of a, or a name in a), else None. Only the package's folders are looked at: no module of it
    is imported to find out."""
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / f"{name}.py").is_file() or (
            Path(folder) / name / "__init__.py"
        ).is_file():
            return f"{package}.{name}"
    return None


def closure(entry: str) -> dict[str, Path]:
    """{module name: source file} of the entry module and every sglang_fleet module it
    imports, with the packages around them; ZipappError for an import that a bare host lacks."""
    if not _is_package_module(entry):
        raise ZipappError(f"the entry {entry!r} is not a module of {PACKAGE}")
    found: dict[str, Path] = {}
    todo = [entry]
    while todo:
        module = todo.pop()
        if module in found:
            continue
        path = _source(module)
        found[module] = path
        if len(found) > MAX_MODULES:
            raise ZipappError(f"{entry} imports more than {MAX_MODULES} modules")
        parent = module.rpartition(".")[0]
        if parent:
            todo.append(parent)  # the package's __init__.py runs before the module
        for name in _imports(module, path):
            top = name.partition(".")[0]
            if _is_package_module(name):
                todo.append(name)
            elif top != "__future__" and top not in sys.stdlib_module_names:
                raise ZipappError(
                    f"{path} imports {name}, which is neither the standard library nor "
                    f"{PACKAGE}: a GPU host has nothing else"
                )
    return found


def _archive_name(module: str, path: Path) -> str:
    parts = module.split(".")
    if path.name == "__init__.py":
        return "/".join([*parts, "__init__.py"])
    return "/".join(parts) + ".py"


def _entry_main(entry: str) -> bytes:
    return (
        f'"""Built by sglang_fleet.host_zipapp from {entry}: edit the sources, not this."""\n'
        "import sys\n\n"
        f"from {entry} import main\n\n"
        "sys.exit(main())\n"
    ).encode()


def build(entry: str) -> bytes:
    """The zipapp's bytes: runs ``main()`` of the entry module, which returns an exit status."""
    found = closure(entry)
    files = {_archive_name(module, path): path.read_bytes() for module, path in found.items()}
    files["__main__.py"] = _entry_main(entry)
    buffer = io.BytesIO()
    buffer.write(SHEBANG)
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, files[name], compresslevel=9)
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("entry", help="the module whose main() the zipapp runs")
    parser.add_argument("-o", "--output", required=True, type=Path, help="the .pyz to write")
    args = parser.parse_args(argv)
    try:
        data = build(args.entry)
    except ZipappError as exc:
        parser.error(str(exc))
    args.output.write_bytes(data)
    args.output.chmod(0o755)
    print(f"{args.output}: {len(data)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
