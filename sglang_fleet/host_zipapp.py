"""The one file a GPU host runs: a zipapp of an entry module and the sglang_fleet modules it
imports (docs/ARCHITECTURE.md, "Host-side programs").

A program that runs on a GPU host (the smoke client, the diagnosis sampler) is written as
several files of this package; the host gets one file, a zip archive that python3 runs as it
runs a script (``python3 smoke.pyz --url ...``, the standard library's zipimport). What goes in
is found by reading the sources, not by running them (only the packages on the way are imported,
to find their folders): the entry module, every module of ``sglang_fleet`` it imports (at any
depth), and the ``__init__.py`` of each package on the way.
Anything else a host program imports must be the standard library (a GPU host has nothing
else), or a third-party package the program names as one it needs (``requires``: the job runner
needs prometheus_client, which its role installs in a virtualenv on the job's host beside the
archive). An import inside ``try: ... except ImportError`` is optional: the program runs without
it (the job runner's progress bar, tqdm, only at a terminal), so it is allowed and not packed. Any
other import is refused here, on the control node, with the file that has it.

The archive is the same bytes for the same sources (fixed names order, timestamps and
permissions), so writing it to a host changes the host only when a source changed.

What it reads and writes is bounded and its own: an entry is a dotted name of this package
whose module defines main(); each source is read only as a regular file in its package's own
folder (no link followed, no FIFO waited on, at most MAX_SOURCE_BYTES); the output is written
beside its name and renamed over it, and only where the name is a regular file or nothing (a
folder, a link, a FIFO or a missing folder is refused, naming -o). Every refusal is a usage
error (exit 2), never a traceback.

    python -m sglang_fleet.host_zipapp sglang_fleet.smoke.smoke_client.command_line -o smoke.pyz
    python -m sglang_fleet.host_zipapp sglang_fleet.job.command_line --requires prometheus_client \
        -o job.pyz
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import os
import re
import stat
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_fleet.module_utils.bounded_file import read_regular, write_atomic

PACKAGE = "sglang_fleet"
SHEBANG = b"#!/usr/bin/env python3\n"
# zip's earliest time; a fixed one keeps the bytes independent of the files' mtimes.
FIXED_TIME = (1980, 1, 1, 0, 0, 0)
# The closure of a host program is a handful of files; far more means an import went astray.
MAX_MODULES = 64
# The largest module of the package is a few dozen KiB.
MAX_SOURCE_BYTES = 1 << 20
# A dotted module name (used with fullmatch): identifiers of ASCII letters, digits and _.
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_MAX_NAME_CHARS = 200
# What an `except` must name for an import in its `try` to count as optional.
IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError"})


class ZipappError(ValueError):
    """A host program that cannot be built: an import outside the standard library, sglang_fleet
    and the packages it names, or a module that is not there."""


@dataclass
class Program:
    """What a host program is made of: its modules ({name: source file}), and the third-party
    packages (top-level import names) it imports: `required` ones, which the host must have, and
    `optional` ones, imported inside try/except ImportError."""

    modules: dict[str, Path] = field(default_factory=dict)
    required: set[str] = field(default_factory=set)
    optional: set[str] = field(default_factory=set)


def _find_spec(module: str) -> Any:
    """importlib's spec of module, None when there is none (a missing parent package included:
    find_spec raises then, and for names like `a..b`)."""
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _source(module: str) -> Path:
    """The module's source file: a package's __init__.py in its own folder, a module's file in
    its package's folder under its own name (so no finder hands over a file from elsewhere)."""
    spec = _find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ZipappError(f"{module} is not a module of plain Python source")
    path = Path(spec.origin)
    parent, _dot, leaf = module.rpartition(".")
    if spec.submodule_search_locations is not None:
        places = [str(Path(p)) for p in spec.submodule_search_locations]
        wanted = "__init__.py"
    else:
        places, wanted = _folders(parent) if parent else [], f"{leaf}.py"
    if path.name != wanted or str(path.parent) not in places:
        raise ZipappError(f"{module}: its source {path} is not in its package's folder")
    return path


def _folders(package: str) -> list[str]:
    """The folders the import system looks in for the package's modules (its __path__ once
    imported, which find_spec of a submodule imports it to read)."""
    spec = _find_spec(package)
    imported = sys.modules.get(package)
    folders = getattr(imported, "__path__", None) or (spec and spec.submodule_search_locations)
    return [str(Path(p)) for p in folders or []]


def _read_source(path: Path) -> bytes:
    """A source's bytes: a regular file only (no link, no FIFO), at most MAX_SOURCE_BYTES."""
    try:
        data = read_regular(str(path), MAX_SOURCE_BYTES)
    except (OSError, ValueError) as err:
        raise ZipappError(f"{path} cannot be packed: {err}") from None
    if data is None:
        raise ZipappError(f"{path} is gone")
    return data


def _parse(path: Path) -> ast.Module:
    try:
        return ast.parse(_read_source(path), filename=str(path))
    except (SyntaxError, ValueError, RecursionError) as err:
        raise ZipappError(f"{path} is not Python source this builder can read: {err}") from None


def _is_package_module(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    """`except ImportError` or `except (ImportError, ...)` (ModuleNotFoundError alike)."""
    caught = handler.type
    names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
    return any(isinstance(name, ast.Name) and name.id in IMPORT_ERRORS for name in names)


class _ImportFinder(ast.NodeVisitor):
    """Every import of a file, each as required or optional: optional when it sits in the body
    of a `try` whose handlers catch ImportError (the program goes on without it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.required: set[str] = set()
        self.optional: set[str] = set()
        self._guarded = 0

    def _add(self, names: Iterable[str]) -> None:
        (self.optional if self._guarded else self.required).update(names)

    def visit_Try(self, node: ast.Try) -> None:
        guarded = any(_catches_import_error(h) for h in node.handlers)
        self._guarded += guarded
        for statement in node.body:
            self.visit(statement)
        self._guarded -= guarded
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    visit_TryStar = visit_Try

    def visit_Import(self, node: ast.Import) -> None:
        self._add(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            raise ZipappError(f"{self.path}: a relative import (write `from {PACKAGE}...`)")
        base = node.module or ""
        found = {base}
        if _is_package_module(base):
            found.update(filter(None, (_submodule(base, a.name) for a in node.names)))
        self._add(found)


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(required, optional): the absolute module names a file imports. `from a.b import c`
    gives a.b, and a.b.c when that is a module of this package. Relative imports are refused
    (one rule for all)."""
    finder = _ImportFinder(path)
    try:
        finder.visit(_parse(path))
    except RecursionError:
        raise ZipappError(f"{path} nests deeper than this builder reads") from None
    return finder.required, finder.optional - finder.required


def _submodule(package: str, name: str) -> str | None:
    """package.name when that is a module of the package (`from a import b`: b may be a module
    of a, or a name in a), else None. Only the package's folders are looked at: no module of it
    is imported to find out."""
    for folder in _folders(package):
        if (Path(folder) / f"{name}.py").is_file() or (
            Path(folder) / name / "__init__.py"
        ).is_file():
            return f"{package}.{name}"
    return None


def _has_main(path: Path) -> bool:
    """Whether the module defines main() at its top level (what __main__.py calls)."""
    return any(
        isinstance(node, ast.FunctionDef) and node.name == "main" for node in _parse(path).body
    )


def _check_requires(requires: Iterable[str]) -> frozenset[str]:
    names = frozenset(requires)
    for name in sorted(names):
        if not name.isidentifier() or name in sys.stdlib_module_names or name == PACKAGE:
            raise ZipappError(
                f"requires {name!r}: name the top-level import of a third-party package "
                f"(prometheus_client), not the standard library or {PACKAGE}"
            )
    return names


def scan(entry: str, requires: Iterable[str] = ()) -> Program:
    """The entry module and every sglang_fleet module it imports, with the packages around them,
    and the third-party packages it imports; ZipappError for an import that the host lacks
    (neither the standard library, nor named in `requires`, nor optional)."""
    if (
        not isinstance(entry, str)
        or len(entry) > _MAX_NAME_CHARS
        or not _MODULE_NAME.fullmatch(entry)
        or not _is_package_module(entry)
    ):
        raise ZipappError(f"the entry {entry!r} is not a module of {PACKAGE}")
    if not _has_main(_source(entry)):
        raise ZipappError(f"the entry {entry} has no main() at its top level to run")
    allowed = _check_requires(requires)
    program = Program()
    todo = [entry]
    while todo:
        module = todo.pop()
        if module in program.modules:
            continue
        path = _source(module)
        program.modules[module] = path
        if len(program.modules) > MAX_MODULES:
            raise ZipappError(f"{entry} imports more than {MAX_MODULES} modules")
        parent = module.rpartition(".")[0]
        if parent:
            todo.append(parent)  # the package's __init__.py runs before the module
        required, optional = _imports(path)
        for name, needed in [*((n, True) for n in required), *((n, False) for n in optional)]:
            top = name.partition(".")[0]
            if _is_package_module(name):
                todo.append(name)
            elif top == "__future__" or top in sys.stdlib_module_names:
                continue
            elif not needed:
                program.optional.add(top)
            elif top in allowed:
                program.required.add(top)
            else:
                raise ZipappError(
                    f"{path} imports {name}, which is neither the standard library nor "
                    f"{PACKAGE}: a GPU host has nothing else (a program that needs it names it "
                    "in requires, and its host must install it)"
                )
    program.optional -= program.required
    return program


def closure(entry: str, requires: Iterable[str] = ()) -> dict[str, Path]:
    """{module name: source file} of the entry module and every sglang_fleet module it
    imports, with the packages around them; ZipappError for an import that the host lacks."""
    return scan(entry, requires).modules


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


def build(entry: str, requires: Iterable[str] = ()) -> bytes:
    """The zipapp's bytes: runs ``main()`` of the entry module, which returns an exit status.
    `requires`: the third-party packages (top-level import names) the host provides."""
    found = closure(entry, requires)
    files = {_archive_name(module, path): _read_source(path) for module, path in found.items()}
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


def output_problem(output: str) -> str | None:
    """Why the archive cannot be written at output (-o), or None: it must name a regular file
    or nothing, in a folder that exists. A folder, a link (even to a file: its target is not
    this builder's to change), a FIFO or a device there is refused, not replaced."""
    if not output or "\0" in output or output.endswith("/"):
        return f"-o {output!r} is not a file name"
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        return f"-o {output!r}: the folder {folder} does not exist"
    try:
        info = os.lstat(output)
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"-o {output!r} cannot be looked at: {err.strerror}"
    if not stat.S_ISREG(info.st_mode):
        return (
            f"-o {output!r} exists and is not a regular file (a folder, a link, a FIFO): "
            "not replaced"
        )
    return None


def write(output: str, data: bytes) -> None:
    """The archive at output, mode 0755, replaced in one rename (a reader sees the old or the
    new file; a link put there meanwhile is replaced, never written through)."""
    write_atomic(output, data, 0o755)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("entry", help="the module whose main() the zipapp runs")
    parser.add_argument("-o", "--output", required=True, help="the .pyz to write")
    parser.add_argument(
        "--requires", action="append", default=[], metavar="PACKAGE",
        help="a third-party package (its top-level import name) the host provides (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    problem = output_problem(args.output)
    if problem:
        parser.error(problem)
    try:
        data = build(args.entry, args.requires)
    except ZipappError as exc:
        parser.error(str(exc))
    try:
        write(args.output, data)
    except OSError as err:
        parser.error(f"-o {args.output!r} cannot be written: {err.strerror or err}")
    print(f"{args.output}: {len(data)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
