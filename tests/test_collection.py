"""The repository as the collection sglang_fleet.fleet (galaxy.yml, docs/COLLECTION.md): the
tarball `ansible-galaxy collection build` makes holds the collection and nothing of the
repository's tooling; installed into an empty project, its roles, plugins and playbooks resolve
by FQCN and run; a controller without the package sglang_fleet is told the command that installs
it; roles and playbooks name the project's own content by FQCN only.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, load_plugin

from sglang_fleet.collection import fqcn
from sglang_fleet.rollout.verb_action import VerbAction

NAMESPACE, NAME = "sglang_fleet", "fleet"
FQCN = f"{NAMESPACE}.{NAME}"
BIN = Path(sys.executable).parent
GALAXY = yaml.safe_load((ROOT / "galaxy.yml").read_text(encoding="utf-8"))
TARBALL_NAME = f"{NAMESPACE}-{NAME}-{GALAXY['version']}.tar.gz"

# What the repository keeps out of the collection (galaxy.yml's build_ignore), by top folder.
NOT_SHIPPED = (
    "tests/", "molecule/", "gpusim/", "bench/", "scripts/", "inventory/", "collections/",
    ".venv/", ".cache/", ".config/", ".ci/", "reports/",
)  # fmt: skip
# What an installed collection needs to run a rollout, by path inside the tarball.
SHIPPED = (
    "MANIFEST.json", "FILES.json", "README.md", "meta/runtime.yml",
    "meta/execution-environment.yml", "meta/ee-requirements.txt",
    "plugins/modules/sglang_host_state.py", "plugins/module_utils/host_read.py",
    "plugins/action/sglang_preflight.py", "plugins/filter/sglang_server.py",
    "plugins/plugin_utils/controller_package.py",
    "roles/sglang_server/tasks/main.yml", "roles/sglang_server/meta/argument_specs.yml",
    "playbooks/deploy.yml", "playbooks/site.yml", "templates/sglang@.service.j2",
    "sglang_fleet/__init__.py", "pyproject.toml", "changelogs/config.yaml",
)  # fmt: skip


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of an operator's own project: no setting of this checkout (the Makefile
    exports ANSIBLE_CONFIG; Molecule and some tests set ANSIBLE_LIBRARY and friends)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["ANSIBLE_LOCALHOST_WARNING"] = "false"
    return {**env, **extra}


@pytest.fixture(scope="module")
def tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The collection built from this checkout, as `ansible-galaxy collection build` makes it."""
    out = tmp_path_factory.mktemp("build")
    subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "build", "--output-path", str(out), str(ROOT)],
        cwd=out,  # not this checkout, whose ansible.cfg would be read
        check=True,
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=300,
    )
    built = out / TARBALL_NAME
    assert built.is_file(), sorted(out.iterdir())
    return built


@pytest.fixture(scope="module")
def installed(tarball: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty project's collections folder with the tarball installed in it."""
    project = tmp_path_factory.mktemp("project")
    collections = project / "collections"
    subprocess.run(
        [
            str(BIN / "ansible-galaxy"),
            "collection",
            "install",
            "-p",
            str(collections),
            str(tarball),
        ],
        # From the empty project: in this checkout, ansible.cfg's collections_path finds the
        # collection "installed" already (its link), and nothing would be installed.
        cwd=project,
        check=True,
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=300,
    )
    assert (collections / "ansible_collections" / NAMESPACE / NAME / "MANIFEST.json").is_file()
    return collections


def _members(tarball: Path) -> list[str]:
    with tarfile.open(tarball) as archive:
        return [member.name for member in archive.getmembers() if not member.isdir()]


@pytest.mark.slow
def test_the_tarball_is_the_collection_and_nothing_of_the_repository(tarball: Path) -> None:
    members = _members(tarball)
    missing = [path for path in SHIPPED if path not in members]
    assert not missing, missing
    # A hidden file or folder at the root is a tool's, never the collection's (a checkout that
    # ran the tests has .hypothesis/, .pytest_cache/, ...).
    leaked = [
        m for m in members if m.startswith(NOT_SHIPPED) or "__pycache__" in m or m.startswith(".")
    ]
    assert not leaked, leaked[:20]
    with tarfile.open(tarball) as archive:
        extracted = archive.extractfile("MANIFEST.json")
        assert extracted is not None
        info = json.load(extracted)["collection_info"]
    assert (info["namespace"], info["name"], info["version"]) == (
        NAMESPACE,
        NAME,
        GALAXY["version"],
    )
    # The figures docs/COLLECTION.md gives, in the output of `pytest -s`.
    print(f"{tarball.name}: {tarball.stat().st_size} bytes, {len(members)} files")


def _project(tmp_path: Path, play: list[dict[str, object]]) -> list[str]:
    """An operator's own project: an inventory with one local host and a playbook of a few lines;
    the argv of ansible-playbook run from it."""
    (tmp_path / "hosts.yml").write_text(
        yaml.safe_dump(
            {"gpu_hosts": {"hosts": {"localhost": {"ansible_connection": "local"}}}},
        ),
        encoding="utf-8",
    )
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False), encoding="utf-8")
    return [
        str(BIN / "ansible-playbook"),
        "-i",
        str(tmp_path / "hosts.yml"),
        str(tmp_path / "play.yml"),
    ]


SERVER = {
    "name": "kimi",
    "model_path": "/models/kimi",
    "port": 8000,
    "gpus": [0, 1],
    "flags": {"mem_fraction_static": 0.88},
}
# The collection's sglang_server role describes a server (its filter, its package) and the
# playbook shows the ExecStart= it would write: no host is touched.
DESCRIBE = [
    {
        "hosts": "gpu_hosts",
        "gather_facts": False,
        "vars": {"sglang_server_instances": [SERVER]},
        "tasks": [
            {
                "name": "Describe the servers with the collection's role",
                "ansible.builtin.include_role": {
                    "name": f"{FQCN}.sglang_server",
                    "tasks_from": "resolve",
                },
            },
            {
                "name": "Show the launch line",
                "ansible.builtin.debug": {"msg": "EXEC {{ sglang_server_servers[0].exec_start }}"},
            },
        ],
    }
]


@pytest.mark.slow
def test_an_empty_project_runs_the_installed_collection_by_fqcn(
    installed: Path, tmp_path: Path
) -> None:
    argv = _project(tmp_path, DESCRIBE)
    env = _clean_env(ANSIBLE_COLLECTIONS_PATH=str(installed))
    done = subprocess.run(
        argv, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--mem-fraction-static 0.88" in done.stdout, done.stdout
    # The role ran from the installed copy, not from this checkout.
    assert str(ROOT / "roles") not in done.stdout + done.stderr


@pytest.mark.slow
def test_the_collection_playbooks_import_by_fqcn(installed: Path, tmp_path: Path) -> None:
    """A five-line playbook that imports the collection's deploy: every play and task resolves
    (modules, actions, roles, filters by FQCN) without this checkout's ansible.cfg."""
    argv = _project(tmp_path, [{"ansible.builtin.import_playbook": f"{FQCN}.deploy"}])
    env = _clean_env(ANSIBLE_COLLECTIONS_PATH=str(installed))
    done = subprocess.run(
        [*argv, "--list-tasks"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Stage the weights while the running servers serve" in done.stdout


@pytest.mark.slow
def test_a_controller_without_the_package_is_told_the_command(
    installed: Path, tmp_path: Path
) -> None:
    # sglang_fleet as a controller without it sees it: an import that fails.
    hidden = tmp_path / "hidden" / "sglang_fleet"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'sglang_fleet'\", name='sglang_fleet')\n",
        encoding="utf-8",
    )
    argv = _project(tmp_path, DESCRIBE)
    env = _clean_env(ANSIBLE_COLLECTIONS_PATH=str(installed), PYTHONPATH=str(hidden.parent))
    done = subprocess.run(
        argv, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    root = installed / "ansible_collections" / NAMESPACE / NAME
    assert f"-m pip install {root.resolve()}" in " ".join(output.split()), output


def test_the_message_names_the_python_and_the_folder() -> None:
    package = load_plugin("plugins/plugin_utils/controller_package.py")
    message = package.missing_message(
        ModuleNotFoundError("No module named 'sglang_fleet'"), "/opt/ee/bin/python3", Path("/c")
    )
    assert "/opt/ee/bin/python3 -m pip install /c" in message
    assert "No module named 'sglang_fleet'" in message
    assert package.COLLECTION_ROOT == ROOT


# Every action and filter plugin imported as Ansible imports it (its collection loader, this
# checkout's collections/ link), in a Python where the package sglang_fleet cannot be imported;
# then each action run and each filter called. Prints {plugin: what happened} as JSON.
PLUGINS = f"{FQCN}.plugins"
_WITHOUT_PACKAGE = """
import importlib, importlib.abc, json, sys
from unittest import mock

class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "sglang_fleet":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hidden())
from ansible.utils.collection_loader._collection_finder import _AnsibleCollectionFinder
_AnsibleCollectionFinder(paths=[sys.argv[1]])._install()
seen = {}
for name in sys.argv[3:]:
    kind, stem = name.split("/")
    try:
        plugin = importlib.import_module(f"ansible_collections.{sys.argv[2]}.{kind}.{stem}")
    except Exception as exc:
        seen[name] = {"import": f"{type(exc).__name__}: {exc}"}
        continue
    if kind == "action":
        calls = {"run": lambda: plugin.ActionModule(*[mock.MagicMock()] * 6).run(task_vars={})}
    else:
        calls = {f: (lambda fn=fn: fn(None)) for f, fn in plugin.FilterModule().filters().items()}
    seen[name] = {}
    for call, function in calls.items():
        try:
            function()
            seen[name][call] = "returned"
        except Exception as exc:
            seen[name][call] = f"{type(exc).__name__}: {exc}"
print(json.dumps(seen))
"""


def _imports_the_package(path: Path) -> bool:
    return any(
        isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang_fleet"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
    )


def test_every_plugin_imports_without_the_package_and_fails_when_used() -> None:
    """ansible-doc and ansible-test's import test load every plugin without third-party
    packages: a plugin imports without sglang_fleet, lists all its filters, and fails only when
    used, with the command that installs it (plugins/plugin_utils/controller_package.py)."""
    files = sorted([*ROOT.glob("plugins/action/*.py"), *ROOT.glob("plugins/filter/*.py")])
    names = [f"{path.parent.name}/{path.stem}" for path in files]
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_PACKAGE, str(ROOT / "collections"), PLUGINS, *names],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(done.stdout)
    needing = {f"{p.parent.name}/{p.stem}" for p in files if _imports_the_package(p)}
    assert len(needing) >= 20, needing  # the check below must not pass on an empty set
    problems = [f"{name}: {seen[name]['import']}" for name in names if "import" in seen[name]]
    command = f"-m pip install {ROOT}"
    for name in sorted(needing):
        calls = seen[name]
        assert calls, name  # an action's run, or at least one filter
        if "import" in calls:
            continue  # said above
        if name.startswith("filter/"):  # every filter, as with the package
            with_package = load_plugin(f"plugins/{name}.py").FilterModule().filters()
            if sorted(calls) != sorted(with_package):
                problems.append(f"{name}: filters {sorted(calls)}, not {sorted(with_package)}")
        problems += [
            f"{name} {call}: {what}" for call, what in calls.items() if command not in what
        ]
    assert not problems, problems
    # With the package, the filters are the plugin's own functions.
    gate = load_plugin("plugins/filter/sglang_gate.py")
    assert gate.FilterModule().filters()["sglang_rollout_table"] is gate.sglang_rollout_table


def test_every_sanity_ignore_says_why() -> None:
    """ansible-test reads `path test:code  # why` and drops the comment: a line without its
    reason is a finding silenced for no stated cause (issue 48)."""
    ignores = sorted((ROOT / "tests" / "sanity").glob("ignore-*.txt"))
    assert ignores  # the check below must not pass on no file
    problems = []
    for path in ignores:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            entry, _hash, why = line.partition("  # ")
            if not line.strip() or len(entry.split()) != 2 or len(why.strip()) < 10:
                problems.append(f"{path.name}:{number}: {line!r}")
            elif not (ROOT / entry.split()[0]).is_file():
                problems.append(f"{path.name}:{number}: no file {entry.split()[0]}")
    assert not problems, problems


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.\[\]-]+)==(\S+)", line.strip())
        if match:
            pins[match[1].split("[")[0].lower()] = match[2]
    return pins


def test_the_execution_environment_pins_what_the_project_pins() -> None:
    project = _pins(ROOT / "requirements.txt")
    ee = _pins(ROOT / "meta" / "ee-requirements.txt")
    assert ee, "meta/ee-requirements.txt pins nothing"
    assert {name: project.get(name) for name in ee} == ee
    definition = yaml.safe_load((ROOT / "execution-environment.yml").read_text(encoding="utf-8"))
    deps = definition["dependencies"]
    assert deps["ansible_core"]["package_pip"] == f"ansible-core=={project['ansible-core']}"
    assert deps["ansible_runner"]["package_pip"] == f"ansible-runner=={project['ansible-runner']}"
    # The tarball it installs is the one this version builds.
    assert [f["src"] for f in definition["additional_build_files"]] == [TARBALL_NAME]


def test_one_version_for_the_collection_and_its_package() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'version = "{GALAXY["version"]}"' in pyproject
    assert (GALAXY["namespace"], GALAXY["name"]) == (NAMESPACE, NAME)


def test_the_checkout_finds_itself_as_the_collection() -> None:
    link = ROOT / "collections" / "ansible_collections" / NAMESPACE / NAME
    assert link.is_symlink() and link.resolve() == ROOT


# The project's own content, by short name (what FQCN replaces in roles and playbooks).
_PLUGIN_NAMES = {
    path.stem
    for folder in ("plugins/modules", "plugins/action")
    for path in (ROOT / folder).glob("*.py")
}
_ROLE_NAMES = {path.name for path in (ROOT / "roles").iterdir() if path.is_dir()}


def _filter_names() -> set[str]:
    names: set[str] = set()
    for path in sorted((ROOT / "plugins" / "filter").glob("*.py")):
        names |= set(load_plugin(path.relative_to(ROOT).as_posix()).FilterModule().filters())
    return names


def _short_names(node: object, in_list: bool, key: str | None, found: list[str]) -> None:
    if isinstance(node, dict):
        if in_list:
            found.extend(name for name in node if name in _PLUGIN_NAMES)
            for keyword in ("ansible.builtin.include_role", "ansible.builtin.import_role"):
                role = node.get(keyword)
                if isinstance(role, dict) and role.get("name") in _ROLE_NAMES:
                    found.append(f"role {role['name']}")
            if key == "roles" and node.get("role") in _ROLE_NAMES:
                found.append(f"role {node['role']}")
        for name, value in node.items():
            _short_names(value, False, str(name), found)
    elif isinstance(node, list):
        for item in node:
            if key == "roles" and isinstance(item, str) and item in _ROLE_NAMES:
                found.append(f"role {item}")
            _short_names(item, True, key, found)


def _short_names_in(text: str, yaml_file: bool) -> list[str]:
    """The project's own modules, actions, roles and filters a file names by short name."""
    filters = re.compile(r"\|\s*(" + "|".join(sorted(_filter_names())) + r")\b(?!\.)")
    problems = [f"filter {match[1]}" for match in filters.finditer(text)]
    if yaml_file:
        found: list[str] = []
        for document in yaml.safe_load_all(text):
            _short_names(document, False, None, found)
        problems += found
    return problems


def test_the_fqcn_check_finds_short_names() -> None:
    play = """
- hosts: gpu_hosts
  roles: [sglang_server, {role: autotune}]
  tasks:
    - sglang_preflight: {servers: []}
    - ansible.builtin.include_role: {name: fleet_lock, tasks_from: acquire}
    - ansible.builtin.debug: {msg: "{{ servers | sglang_server_describe }}"}
    - sglang_fleet.fleet.sglang_restart: {server: "{{ s | sglang_fleet.fleet.sglang_yaml_string }}"}
"""
    assert sorted(_short_names_in(play, yaml_file=True)) == [
        "filter sglang_server_describe",
        "role autotune",
        "role fleet_lock",
        "role sglang_server",
        "sglang_preflight",
    ]


def test_roles_and_playbooks_name_the_projects_own_content_by_fqcn() -> None:
    problems = []
    files = [*ROOT.glob("roles/*/*/*.yml"), *ROOT.glob("playbooks/*.yml")]
    files += [*ROOT.glob("roles/*/templates/*.j2"), *ROOT.glob("templates/*.j2")]
    for path in sorted(set(files)):
        relative = path.relative_to(ROOT)
        found = _short_names_in(path.read_text(encoding="utf-8"), path.suffix == ".yml")
        problems += [f"{relative}: {name}" for name in found]
    assert not problems, problems


def _doc_blocks(path: Path) -> dict[str, str]:
    blocks = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id in ("DOCUMENTATION", "EXAMPLES", "RETURN"):
            blocks[target.id] = ast.literal_eval(node.value)
    return blocks


def test_every_module_and_action_is_documented_in_yaml_ansible_reads() -> None:
    """ansible-doc and validate-modules read these blocks; one that YAML cannot read (a ': '
    inside a plain line) breaks both. An action is documented by the module file of its name."""
    problems = []
    for path in sorted((ROOT / "plugins" / "modules").glob("*.py")):
        blocks = _doc_blocks(path)
        if sorted(blocks) != ["DOCUMENTATION", "EXAMPLES", "RETURN"]:
            problems.append(f"{path.name}: has {sorted(blocks)}")
        for name, text in blocks.items():
            try:
                document = yaml.safe_load(text)
            except yaml.YAMLError as error:
                problems.append(f"{path.name} {name}: {error}")
                continue
            if name == "DOCUMENTATION" and document.get("module") != path.stem:
                problems.append(f"{path.name}: documents {document.get('module')!r}")
    modules = {path.stem for path in (ROOT / "plugins" / "modules").glob("*.py")}
    actions = {path.stem for path in (ROOT / "plugins" / "action").glob("*.py")}
    problems += [f"action {name}: no module file documents it" for name in actions - modules]
    assert not problems, problems


def _short_plugin_names(source: str) -> list[str]:
    """Names without a dot that code hands to Ansible directly: `_execute_module(module_name=)`
    and a plugin loader's `get()`. (VerbAction's `_module` and `_action` pass every name through
    fqcn(): test_the_verb_helpers_pass_fqcn.)"""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        named = [kw.value for kw in node.keywords if kw.arg == "module_name"]
        loader = node.func.value
        if (
            node.func.attr == "get"
            and isinstance(loader, ast.Attribute)
            and loader.attr.endswith("_loader")
        ):
            named += node.args[:1]
        found += [
            value.value
            for value in named
            if isinstance(value, ast.Constant)
            and isinstance(value.value, str)
            and "." not in value.value
        ]
    return found


def test_actions_hand_ansible_the_collections_plugins_by_fqcn() -> None:
    """An installed collection has no library folder: a short module or action name handed to
    Ansible fails there ("not found in configured module paths"), though a checkout finds it."""
    files = [*(ROOT / "plugins" / "action").glob("*.py"), *(ROOT / "sglang_fleet").rglob("*.py")]
    short = {
        str(path.relative_to(ROOT)): names
        for path in files
        if (names := _short_plugin_names(path.read_text(encoding="utf-8")))
    }
    assert short == {}


def test_the_fqcn_reader_finds_a_short_name() -> None:
    source = (
        'self._execute_module(module_name="fleet_lock", module_args={})\n'
        'self._execute_module(module_name=fqcn("fleet_lock"), module_args={})\n'
        'self._execute_module(module_name="ansible.legacy.command", module_args={})\n'
        'self._shared_loader_obj.action_loader.get("sglang_restart", task=t)\n'
        'options.get("unit")\n'
    )
    assert _short_plugin_names(source) == ["fleet_lock", "sglang_restart"]


def test_the_verb_helpers_pass_fqcn() -> None:
    asked: list[str] = []

    class Probe(VerbAction):
        def __init__(self) -> None:  # no Ansible task: only the name handed on is read
            self._vars = {}

        def _execute_module(self, module_name: str, module_args: dict, task_vars: dict) -> dict:
            asked.append(module_name)
            return {}

        def run(self, tmp: None = None, task_vars: None = None) -> dict:
            return {}

    Probe()._module("gpu_cleanup", {})
    Probe()._module("ansible.legacy.command", {})
    assert asked == ["sglang_fleet.fleet.gpu_cleanup", "ansible.legacy.command"]
    assert fqcn("sglang_fleet.fleet.fleet_lock") == "sglang_fleet.fleet.fleet_lock"
