"""Shared by every test: the one loader of the project's Ansible plugins, and the fixtures for
tests that run the GPU-less double (helpers in gpusim_helpers.py).

Ansible loads modules, action plugins and filter plugins by path, not as a package; tests do
the same through load_plugin(), which also registers plugins/module_utils/ the way Ansible packages
it (ansible_collections.sglang_fleet.fleet.plugins.module_utils.<name>), so a module's own imports
work unchanged:

    from conftest import load_plugin
    gpu_cleanup = load_plugin("plugins/modules/gpu_cleanup.py")
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from gpusim_helpers import Server, collect_servers, make_state_dir
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

ROOT = Path(__file__).resolve().parent.parent

# Property-based tests (tests/test_props_*.py, Hypothesis; docs/TESTING.md). Two profiles:
# `short`, the default: few examples, the same ones every run (derandomized, no example
# database), so that `make check` stays fast and never flakes; `long`
# (HYPOTHESIS_PROFILE=long, what `make bench` runs): many random examples, the failures it finds
# kept in .cache/hypothesis and tried first next time. No deadline in either: on 2 shared cores
# one example's time says nothing.
settings.register_profile(
    "short",
    max_examples=20,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=1000,
    database=DirectoryBasedExampleDatabase(str(ROOT / ".cache" / "hypothesis")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "short"))


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_plugin(relative_path: str) -> ModuleType:
    """A plugin file of this repository (plugins/modules/x.py, plugins/filter/y.py, ...), loaded
    once.

    Registered as `<folder>.<name>` (for example `modules.gpu_cleanup`), so a test that patches
    it and the code under test see the same module.
    """
    path = ROOT / relative_path
    name = f"{path.parent.name}.{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    return _load(name, path)


# The package a module imports plugins/module_utils/ as, in the collection (galaxy.yml) and from
# a checkout (ansible.cfg's collections_path): what AnsiballZ ships beside a module.
COLLECTION_UTILS = "ansible_collections.sglang_fleet.fleet.plugins.module_utils"
# How one part imports another: by that package, or relatively (a part both sides import).
_UTIL_IMPORT = re.compile(
    r"^\s*from (?:ansible_collections\.sglang_fleet\.fleet\.plugins\.module_utils|)\.(\w+) import",
    re.MULTILINE,
)


def module_utils_in_import_order() -> list[Path]:
    """plugins/module_utils/*.py, each after the module_utils files it imports.

    AnsiballZ finds a module's module_utils by reading their import lines; reading them the
    same way here lets one part import another (gpu_cleanup_plan imports procfs).
    """
    folder = ROOT / "plugins" / "module_utils"
    files = {path.stem: path for path in sorted(folder.glob("[!_]*.py"))}
    ordered: list[Path] = []

    def visit(name: str) -> None:
        path = files[name]
        if path in ordered:
            return
        for used in _UTIL_IMPORT.findall(path.read_text(encoding="utf-8")):
            if used in files:
                visit(used)
        ordered.append(path)

    for name in files:
        visit(name)
    return ordered


# What Ansible ships to the host beside a module: plugins/module_utils/<name>.py as
# ansible_collections.sglang_fleet.fleet.plugins.module_utils.<name>.
for _util in module_utils_in_import_order():
    load_plugin(f"plugins/module_utils/{_util.name}")
    sys.modules[f"{COLLECTION_UTILS}.{_util.stem}"] = sys.modules[f"module_utils.{_util.stem}"]

# What Ansible's collection loader gives a plugin in a run (ansible.cfg's collections_path finds
# this checkout as sglang_fleet.fleet): plugins/plugin_utils/ as a package of that name.
_PLUGIN_UTILS = ModuleType("ansible_collections.sglang_fleet.fleet.plugins.plugin_utils")
_PLUGIN_UTILS.__path__ = [str(ROOT / "plugins" / "plugin_utils")]
sys.modules[_PLUGIN_UTILS.__name__] = _PLUGIN_UTILS

# The same in a process of its own, for a module run as Ansible runs it (an arguments file):
# plugins/module_utils/<name>.py registered under the collection's name, then the module as
# __main__.
_MODULE_BOOT = f"""
import importlib.util, os, pathlib, runpy, sys
for path in map(pathlib.Path, sys.argv[1].split(os.pathsep)):
    spec = importlib.util.spec_from_file_location("{COLLECTION_UTILS}." + path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def module_argv(relative_path: str, *args: str) -> list[str]:
    """argv that runs plugins/modules/<module>.py as Ansible would, its module_utils imports
    working."""
    return [
        sys.executable,
        "-c",
        _MODULE_BOOT,
        os.pathsep.join(str(path) for path in module_utils_in_import_order()),
        str(ROOT / relative_path),
        *args,
    ]


def run_local_play(
    tmp_path: Path, play: dict[str, Any], *options: str, timeout: int = 180
) -> subprocess.CompletedProcess[str]:
    """ansible-playbook of one play against localhost, with this repository's roles and modules."""
    playbook = tmp_path / "play.yml"
    playbook.write_text(json.dumps([play]), encoding="utf-8")
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_ROLES_PATH": str(ROOT / "roles"),
        "ANSIBLE_LIBRARY": str(ROOT / "plugins" / "modules"),
        "ANSIBLE_LOCALHOST_WARNING": "false",
        "ANSIBLE_CONNECTION": "local",
    }
    playbook_bin = str(ROOT / ".venv" / "bin" / "ansible-playbook")
    return subprocess.run(
        [playbook_bin, "-i", "localhost,", *options, str(playbook)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def collection_with_modules(where: Path, modules: dict[str, str]) -> Path:
    """A collections folder whose sglang_fleet.fleet is this checkout with some modules replaced.

    The actions run the collection's modules by FQCN (sglang_fleet/collection.py), which no
    library path can shadow: a test that stands in for a host's module lays out the collection
    again, every entry a link to the checkout's but plugins/modules/<name>.py for each of
    `modules` (name -> source). Point ANSIBLE_COLLECTIONS_PATH at the folder returned.
    """
    root = where / "ansible_collections" / "sglang_fleet" / "fleet"
    (root / "plugins" / "modules").mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name not in ("plugins", "collections"):
            (root / entry.name).symlink_to(entry)
    for folder in (ROOT / "plugins").iterdir():
        if folder.name != "modules":
            (root / "plugins" / folder.name).symlink_to(folder)
    for module in (ROOT / "plugins" / "modules").iterdir():
        if module.stem not in modules:
            (root / "plugins" / "modules" / module.name).symlink_to(module)
    for name, text in modules.items():
        (root / "plugins" / "modules" / f"{name}.py").write_text(text, encoding="utf-8")
    return where


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private gpusim state directory (GPUSIM_STATE_DIR) for this test."""
    return make_state_dir(tmp_path, monkeypatch)


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    """Double servers a test starts; each is stopped when the test ends."""
    yield from collect_servers()


def stream_fed_in_reads(data: bytes, cuts: list[int], expected: int) -> Any:
    """A /generate stream of ``expected`` tokens fed ``data`` in reads cut at ``cuts`` (each
    taken modulo the length), a parse error recorded as the client records it, then ended: the
    smoke client's GenerateStream as its connection drives it, without a socket."""
    import asyncio  # noqa: PLC0415
    import itertools  # noqa: PLC0415

    from sglang_fleet.smoke.smoke_client.failures import MALFORMED, PARSE_ERRORS  # noqa: PLC0415
    from sglang_fleet.smoke.smoke_client.streams import (  # noqa: PLC0415
        GenerateStream,
        RequestRecord,
        Timeline,
    )

    async def run() -> Any:
        stream = GenerateStream(RequestRecord(), Timeline(0.0), expected)
        stream.on_head(200, 0.0)
        points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
        for index, (a, b) in enumerate(itertools.pairwise(points)):
            try:
                stream.on_body(data[a:b], 0.01 * (index + 1))
            except PARSE_ERRORS as err:
                stream.on_error(f"malformed response: {err}", MALFORMED)
        stream.on_end(1.0)
        return stream

    return asyncio.run(run())
