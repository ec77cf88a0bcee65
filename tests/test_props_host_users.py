"""Property-based tests of who uses a SGLang version or a model revision (Hypothesis; profiles
in tests/conftest.py): plugins/module_utils/server_configs.py's reader of ExecStart=,
plugins/modules/ml_env_versions.py's survey and prune, plugins/module_utils/model_in_use.py with
model_stage's prune. Generated drop-ins in every ExecStart= form systemd runs, interpreter paths in
every spelling, links, and things that cannot be read. Invariants (issue 44): a version or model a
server runs, is configured with or would roll back to is never removed; what cannot be read
refuses, naming it; the reader gives the argv systemd would, or NotUnderstood, never another
exception, in bounded time."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from conftest import load_plugin
from hypothesis import given
from hypothesis import strategies as st

from sglang_fleet.servers.launch_line import exec_start, systemd_quote

configs = load_plugin("plugins/module_utils/server_configs.py")
versions = load_plugin("plugins/modules/ml_env_versions.py")
stage_mod = load_plugin("plugins/modules/model_stage.py")
ms = load_plugin("plugins/module_utils/model_stage.py")
owned = load_plugin("plugins/module_utils/owned_folder.py")

# Words a launch line carries: plain ones and every character systemd's parser treats specially.
_word_chars = st.sampled_from(list("abcXYZ019-_=./:@%$;#'\"\\ \t\n\r\x01\x7f\x85é€{}"))
words = st.text(_word_chars, max_size=12)
prefixes = st.sampled_from(["", "-", "@", ":", "+", "!", "!!", "-@", "@-:", ":+", "!!-", "-:!"])


def _dropin(lines: list[str], section: bool = True) -> str:
    return ("[Service]\n" if section else "") + "".join(line + "\n" for line in lines)


LINES = st.fixed_dictionaries(
    {
        "program": st.lists(
            st.sampled_from(["opt", "ml env", "%", "é", "v.1", "a;b"]), min_size=1, max_size=4
        ),
        "argv": st.lists(words, max_size=6),
        "prefix": prefixes,
        "argv0": words.filter(bool),
        "cut": st.integers(min_value=0, max_value=8),
        "comment": st.booleans(),
        "spaced": st.booleans(),
    }
)


@given(case=LINES)
def test_the_reader_gives_back_the_argv_launch_line_writes(case: dict[str, Any]) -> None:
    """launch_line's quoting, a prefix, `ExecStart =`, and the line continued at a word
    boundary (a comment line between): the reader gives the argv systemd passes."""
    path, prefix, argv = "/" + "/".join(case["program"]), case["prefix"], case["argv"]
    quoted = [prefix + systemd_quote(path)]
    quoted += [systemd_quote(case["argv0"])] if "@" in prefix else []
    quoted += [systemd_quote(word) for word in argv]
    at = case["cut"] % len(quoted)
    joint = " \\\n" + ("# a comment\n" if case["comment"] else "") if at else ""
    line = ("ExecStart = " if case["spaced"] else "ExecStart=") + " ".join(quoted[:at]) + joint
    (command,) = configs.exec_starts(_dropin(["ExecStart=", line + " ".join(quoted[at:])]))
    assert command.path == path and command.prefixes == prefix
    got = list(command.argv)
    if ":" in prefix:  # no environment expansion: $$ is passed as written
        got = [word.replace("$$", "$") for word in got]
    assert got == ([case["argv0"]] if "@" in prefix else [path]) + argv


ANY_TEXT = st.text(
    st.sampled_from(list("ExecStart=[]Service#;\\\n\r \t\"'%$@-:+!|/abc{}é\x00")), max_size=200
)


@given(text=ANY_TEXT, unit=st.sampled_from(["", "sglang@a.service", "sglang@.service"]))
def test_any_text_is_commands_or_not_understood(text: str, unit: str) -> None:
    started = time.process_time()  # CPU time: a loaded machine stretches wall time
    try:
        commands = configs.exec_starts(text, unit)
    except configs.NotUnderstood as err:
        assert str(err)
        return
    for command in commands:
        assert command.path and all(isinstance(word, str) for word in command.argv)
        try:
            configs.launched(command)
        except configs.NotUnderstood as err:
            assert str(err)
    assert time.process_time() - started < 1.0


# --------------------------------------------------------------------------- versions

SPELLINGS = ["plain", "dot", "double-slash", "dot-dot", "python3", "linked-root", "linked-python"]
FORMS = ["plain", "minus", "at", "bang", "env", "env-S", "spaced", "continued", "numactl", "quoted"]
WHERE = ["unit", "template", "lkg", "running"]
BREAKERS = ["link-dropin", "env-path", "variable", "specifier", "systemctl-fails",
            "cmdline-gone", "shell-script", "too-big"]  # fmt: skip


def _python(base: Path, name: str, spelling: str) -> str:
    root = base / "ml-env"
    plain = f"{root}/versions/{name}/bin/python"
    return {
        "plain": plain,
        "dot": f"{root}/./versions/{name}/bin/python",
        "double-slash": f"{base}//ml-env/versions/{name}//bin/python",
        "dot-dot": f"{root}/versions/{name}/bin/../bin/python",
        "python3": f"{root}/versions/{name}/bin/python3",
        "linked-root": f"{base}/root-link/versions/{name}/bin/python",
        "linked-python": f"{base}/python-link-{name}",
    }[spelling]


def _line(python: str, form: str) -> str:
    quoted = exec_start([python, "-m", "sglang.launch_server", "--port", "1"])
    return {
        "plain": f"ExecStart={quoted}",
        "minus": f"ExecStart=-{quoted}",
        "at": f"ExecStart=@{python} sglang -m sglang.launch_server",
        "bang": f"ExecStart=!!{quoted}",
        "env": f"ExecStart=/usr/bin/env -i HOME=/x {quoted}",
        "env-S": f"ExecStart=/usr/bin/env -S '{python} -u' -m x",
        "spaced": f"ExecStart = {quoted}",
        "continued": f"ExecStart=\\\n# a comment\n   {quoted}",
        "numactl": f"ExecStart=/usr/bin/numactl --cpunodebind=0 {quoted}",
        "quoted": f'ExecStart="{python}" -m x',
    }[form]


def _host(base: Path, names: list[str]) -> dict[str, Path]:
    paths = {"root": base / "ml-env", "units": base / "units", "state": base / "state"}
    for path in paths.values():
        path.mkdir()
    for name in names:
        venv = paths["root"] / "versions" / name
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").write_text("")
        (venv / "bin" / "python3").symlink_to("python")
        (venv / versions.MARKER).write_text(json.dumps({"version": name, "key": "k1"}))
        (base / f"python-link-{name}").symlink_to(venv / "bin" / "python")
    (base / "root-link").symlink_to(paths["root"])
    return paths


def _write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder / name


HOSTS = st.fixed_dictionaries(
    {
        "count": st.integers(min_value=2, max_value=5),
        "users": st.lists(
            st.tuples(
                st.sampled_from(WHERE),
                st.integers(min_value=0, max_value=4),
                st.sampled_from(SPELLINGS),
                st.sampled_from(FORMS),
            ),
            max_size=4,
        ),
        "breakers": st.lists(st.tuples(st.sampled_from(BREAKERS), st.integers(0, 4)), max_size=2),
        "keep": st.integers(min_value=1, max_value=3),
        "remove": st.lists(st.integers(min_value=0, max_value=4), max_size=2),
    }
)


@given(case=HOSTS)
def test_a_used_version_is_never_pruned_and_what_cannot_be_read_refuses(
    tmp_path_factory: Any, case: dict[str, Any]
) -> None:
    count, users, breakers = case["count"], case["users"], case["breakers"]
    keep, remove = case["keep"], case["remove"]
    base = tmp_path_factory.mktemp("host")
    names = [f"0.5.{20 + index}" for index in range(count)]
    host = _host(base, names)
    used: set[str] = set()
    running: list[tuple[str, bytes]] = []
    for number, (where, index, spelling, form) in enumerate(users):
        name = names[index % count]
        used.add(name)
        python = _python(base, name, spelling)
        if where == "running":
            running.append((f"sglang@r{number}.service", f"{python}\0-m\0sglang\0".encode()))
            continue
        folder = {
            "unit": host["units"] / f"sglang@u{number}.service.d",
            "template": host["units"] / "sglang@.service.d",
            "lkg": host["state"] / f"s{number}" / "lkg",
        }[where]
        _write(folder, f"{number}-launch.conf", _dropin(["ExecStart=", _line(python, form)]))
    fails = _break(base, host, names, breakers, used)
    if not running:
        fails.discard("cmdline-gone")  # no main process to read
    cmdlines = dict(running)

    def read_regular(path: str, limit: int) -> bytes | None:
        if path.startswith("/proc/"):
            pid = int(path.split("/")[2])
            return None if "cmdline-gone" in fails else running[pid - 100][1]
        return Path(path).read_bytes() if Path(path).exists() else None

    def run(argv: list[str], timeout: float) -> tuple[int, str, str]:
        if "systemctl-fails" in fails:
            return 124, "", "no answer within 30 s"
        if argv[1] == "list-units":
            return 0, "".join(f"{unit} loaded active running x\n" for unit in cmdlines), ""
        return 0, f"{100 + list(cmdlines).index(argv[-1])}\n", ""

    original = versions.read_regular
    versions.read_regular = read_regular
    try:
        found = versions.survey(
            str(host["root"]), "k1", run, str(host["units"]), str(host["state"])
        )
    finally:
        versions.read_regular = original
    wanted = names[-1]
    removing = sorted({names[i % count] for i in remove} - {wanted})
    before = sorted(p.name for p in (host["root"] / "versions").iterdir())
    try:
        gone = versions.prune(str(host["root"]), wanted, found, keep, removing, False)
    except ValueError as err:
        assert str(err)
        gone = []
        if fails and not (set(removing) & used):
            assert "cannot be proven" in str(err)
    after = sorted(p.name for p in (host["root"] / "versions").iterdir())
    assert used <= set(after), (used, after, found)
    assert wanted in after
    if fails:
        assert found["unknown"], fails
        assert gone == [] and before == after  # nothing removed while anything is unknown
    else:
        assert found["unknown"] == [], found["unknown"]
        for name in used:
            assert next(v for v in found["versions"] if v["name"] == name)["used_by"]


def _break(
    base: Path, host: dict[str, Path], names: list[str], breakers: list, used: set[str]
) -> set[str]:
    """Things the survey cannot read, each naming a version (which is then in use, unproven)."""
    fails: set[str] = set()
    for number, (kind, index) in enumerate(breakers):
        name = names[index % len(names)]
        python = f"{host['root']}/versions/{name}/bin/python"
        folder = host["units"] / f"sglang@b{number}.service.d"
        if kind in ("systemctl-fails", "cmdline-gone"):
            fails.add(kind)
            continue
        used.add(name)
        fails.add(kind)
        if kind == "link-dropin":
            real = _write(base / "elsewhere", f"{number}.conf", f"ExecStart={python}\n")
            folder.mkdir(parents=True)
            (folder / "10-launch.conf").symlink_to(real)
        elif kind == "too-big":
            _write(folder, "10.conf", f"ExecStart={python}\n#" + "x" * configs.MAX_CONF_BYTES)
        else:
            line = {
                "env-path": "ExecStart=/usr/bin/env python3 -m x",
                "variable": f"ExecStart=/usr/bin/env ${{PY}} {python}",
                "specifier": f"ExecStart={host['root']}/versions/%I/bin/python",
                "shell-script": f"ExecStart=/bin/sh -c 'exec {python} -m x'",
            }[kind]
            _write(folder, "10.conf", _dropin([line]))
    return fails


# --------------------------------------------------------------------------- model revisions

MODEL_FORMS = ["plain", "continued", "env-S", "equals", "spaced", "minus", "lkg-record"]


@given(
    users=st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(MODEL_FORMS), st.booleans()), max_size=3
    ),
    breaker=st.sampled_from(["", "variable", "specifier", "link-dropin", "proc"]),
    keep=st.integers(min_value=1, max_value=3),
)
def test_a_revision_a_server_is_configured_with_is_never_pruned(
    tmp_path_factory: Any, users: list[tuple[int, str, bool]], breaker: str, keep: int
) -> None:
    base = tmp_path_factory.mktemp("models")
    parent = base / "models" / "llama"
    names = [f"rev-{index}" for index in range(4)]
    for index, name in enumerate([*names, "rev-new"]):
        (parent / name).mkdir(parents=True)
        (parent / name / ms.MARKER).write_text(json.dumps({"revision": name, "staged_at": index}))
    systemd, state = base / "systemd", base / "state"
    used = set()
    for number, (index, form, through_link) in enumerate(users):
        revision = parent / names[index]
        used.add(names[index])
        if through_link:
            (base / f"link-{number}").symlink_to(revision)
            revision = base / f"link-{number}"
        if form == "lkg-record":
            record = {"flags": {"model_path": str(revision)}}
            _write(state / f"s{number}" / "lkg", "meta.json", json.dumps(record))
            continue
        quoted = exec_start(["/py", "-m", "sglang.launch_server", "--model-path", str(revision)])
        line = {
            "plain": f"ExecStart={quoted}",
            "continued": f"ExecStart=/py -m x --model-path \\\n  {revision}",
            "env-S": f"ExecStart=/usr/bin/env -S '/py -m x --model-path {revision}'",
            "equals": f"ExecStart=/py --model-path={revision}",
            "spaced": f"ExecStart = {quoted}",
            "minus": f"ExecStart=-{quoted}",
        }[form]
        _write(systemd / f"sglang@m{number}.service.d", "10.conf", _dropin(["ExecStart=", line]))
    broken = systemd / "sglang@broken.service.d"
    if breaker == "variable":
        _write(broken, "10.conf", _dropin(["ExecStart=/py --model-path ${MODEL}"]))
    elif breaker == "specifier":
        _write(broken, "10.conf", _dropin(["ExecStart=/py --model-path %h/m"]))
    elif breaker == "link-dropin":
        real = _write(base / "elsewhere", "x.conf", "ExecStart=/py\n")
        broken.mkdir(parents=True)
        (broken / "10.conf").symlink_to(real)
    params = {
        "path": str(parent / "rev-new"),
        "keep": keep,
        "protect": [],
        "state_dir": str(state),
        "systemd_dir": str(systemd),
        "workdir": str(base / "w"),
    }
    proc = base / "proc"
    if breaker != "proc":
        proc.mkdir()
    original = stage_mod.process_references
    stage_mod.process_references = lambda: load_plugin(
        "plugins/module_utils/model_in_use.py"
    ).process_references(str(proc))
    try:
        with owned.OwnedFolder(str(parent)) as folder:
            pruned, skipped = stage_mod.prune(params, folder)
    finally:
        stage_mod.process_references = original
    left = {p.name for p in parent.iterdir()}
    assert used <= left and "rev-new" in left
    if breaker:
        assert pruned == [] and skipped and "nothing pruned" in skipped
        assert left == {*names, "rev-new"}
    else:
        assert skipped is None
