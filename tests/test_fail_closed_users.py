"""Who uses a SGLang version or a model revision is proven, never guessed (issue 44, item 1):
plugins/module_utils/server_configs.py reads `ExecStart=` as systemd does or says it does not
understand it; plugins/modules/ml_env_versions.py places interpreter paths after the same
normalisation on both sides, and refuses to remove anything when something could not be read;
plugins/module_utils/model_in_use.py does the same for model pruning.

Each test here failed on a8010cc (the fault it names in its docstring) and passes now.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.module_utils.testing import patch_module_args
from conftest import load_plugin
from test_flags import HOSTILE

from sglang_fleet.servers.launch_line import exec_start

configs = load_plugin("plugins/module_utils/server_configs.py")
versions = load_plugin("plugins/modules/ml_env_versions.py")
in_use = load_plugin("plugins/module_utils/model_in_use.py")
stage_mod = load_plugin("plugins/modules/model_stage.py")


# --------------------------------------------------------------------------- a host


def make_version(root: Path, name: str) -> Path:
    venv = root / "versions" / name
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / versions.MARKER).write_text(json.dumps({"version": name, "key": "k1"}))
    return venv


def write_dropin(units: Path, unit: str, text: str, name: str = "10-launch.conf") -> Path:
    folder = units / f"{unit}.d"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder / name


def no_units(argv: list[str], timeout: float) -> tuple[int, str, str]:
    return 0, "", ""


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    paths = {"root": tmp_path / "ml-env", "units": tmp_path / "units", "state": tmp_path / "state"}
    for path in paths.values():
        path.mkdir()
    for name in ("0.5.20", "0.5.21", "0.5.22"):
        make_version(paths["root"], name)
    return paths


def survey(host: dict[str, Path], run: Any = no_units, root: str | None = None) -> dict:
    return versions.survey(
        root or str(host["root"]), "k1", run, str(host["units"]), str(host["state"])
    )


def prune_all_unused(host: dict[str, Path], found: dict) -> list[str]:
    """What a prune down to the wanted 0.5.22 alone removes (ValueError when it refuses)."""
    return versions.prune(str(host["root"]), "0.5.22", found, 1, [], False)


def left(host: dict[str, Path]) -> list[str]:
    return sorted(p.name for p in (host["root"] / "versions").iterdir())


# --------------------------------------------------------------------------- path spellings


@pytest.mark.parametrize(
    "spelling",
    [
        "{root}/./versions/0.5.21/bin/python",
        "{root_dir}//ml-env/versions/0.5.21/bin/python",
        "{root}/versions/0.5.21/bin/../bin/python",
        "{root}/versions/0.5.21/bin/python3.11",
        "{link_root}/versions/0.5.21/bin/python",
        "{link_python}",
    ],
    ids=["dot", "double-slash", "dot-dot", "python3.11", "linked-root", "linked-python"],
)
def test_a_version_named_in_any_spelling_of_its_path_is_kept(
    host: dict[str, Path], tmp_path: Path, spelling: str
) -> None:
    """a8010cc compared the text after os.path.normpath of the root only: any other spelling of
    a drop-in's interpreter (a dot, a double slash, a link to the root or to the python) was
    "nobody", and the prune removed the version the server is configured with."""
    root = host["root"]
    (tmp_path / "link-root").symlink_to(root)
    (tmp_path / "link-python").symlink_to(root / "versions" / "0.5.21" / "bin" / "python")
    python = spelling.format(
        root=root,
        root_dir=tmp_path,
        link_root=tmp_path / "link-root",
        link_python=tmp_path / "link-python",
    )
    write_dropin(
        host["units"], "sglang@a.service", f"[Service]\nExecStart=\nExecStart={python} -m x\n"
    )
    found = survey(host)
    used = {v["name"]: v["used_by"] for v in found["versions"]}
    assert used["0.5.21"] == ["sglang@a.service (its unit)"]
    assert found.get("unknown", []) == []
    assert prune_all_unused(host, found) == ["0.5.20"]
    assert left(host) == ["0.5.21", "0.5.22"]


@pytest.mark.parametrize("given", ["{root}/", "{link_root}", "{link_root}/"])
def test_the_root_given_with_a_slash_or_as_a_link_finds_the_same_users(
    host: dict[str, Path], tmp_path: Path, given: str
) -> None:
    """The root itself given through a link: a8010cc compared the drop-in's real path with the
    link's text and found nobody."""
    (tmp_path / "link-root").symlink_to(host["root"])
    python = host["root"] / "versions" / "0.5.21" / "bin" / "python"
    write_dropin(host["units"], "sglang@a.service", f"ExecStart={python}\n")
    root = given.format(root=host["root"], link_root=tmp_path / "link-root")
    found = survey(host, root=root)
    assert [v["used_by"] for v in found["versions"] if v["name"] == "0.5.21"] == [
        ["sglang@a.service (its unit)"]
    ]


# --------------------------------------------------------------------------- ExecStart= forms


@pytest.mark.parametrize(
    "text",
    [
        "[Service]\nExecStart=-{py} -m sglang.launch_server\n",
        "[Service]\nExecStart=@{py} sglang-a -m sglang.launch_server\n",
        "[Service]\nExecStart=+{py} -m x\n",
        "[Service]\nExecStart=!!{py} -m x\n",
        "[Service]\nExecStart=:-@{py} x -m y\n",
        "[Service]\nExecStart = {py} -m x\n",
        "[Service]\nExecStart=\\\n  {py} -m x\n",
        "[Service]\nExecStart=\\\n# a comment inside the continuation\n  {py} -m x\n",
        "[Service]\nExecStart=/usr/bin/env -i HOME=/var/lib/sglang {py} -m x\n",
        "[Service]\nExecStart=/usr/bin/env -u LANG -S '{py} -u' -m x\n",
        "[Service]\nExecStart=/usr/bin/env -S '-i {py} -u' -m x\n",
        "[Service]\nExecStart=/usr/bin/numactl --cpunodebind=0 {py} -m x\n",
        '[Service]\nExecStart="{py}" -m x\n',
        "ExecStart={py} -m x\n",
    ],
    ids=[
        "minus",
        "at",
        "plus",
        "bang-bang",
        "combined",
        "spaces-around-equals",
        "continuation",
        "comment-in-continuation",
        "env",
        "env-S",
        "env-S-options",
        "numactl",
        "quoted",
        "no-section",
    ],
)
def test_every_exec_start_form_systemd_runs_names_its_interpreter(
    host: dict[str, Path], text: str
) -> None:
    """a8010cc read only `ExecStart=` at the start of a line, split it like a shell, and took
    the first word: a prefix, spaces around `=`, a continuation line or an env wrapper made the
    interpreter "nobody's", and the prune removed it."""
    python = host["root"] / "versions" / "0.5.21" / "bin" / "python"
    write_dropin(host["units"], "sglang@a.service", text.format(py=python))
    found = survey(host)
    used = {v["name"]: v["used_by"] for v in found["versions"]}
    assert used["0.5.21"] == ["sglang@a.service (its unit)"]
    assert found.get("unknown", []) == []
    assert prune_all_unused(host, found) == ["0.5.20"]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("ExecStart=/usr/bin/env python3 -m sglang.launch_server\n", "PATH"),
        ("ExecStart=${{PYTHON}} -m x\n", "$ in the program path"),
        ("ExecStart=/usr/bin/env ${{PYTHON}} -m x\n", "environment variable"),
        ("ExecStart=/opt/ml-env/versions/%I/bin/python\n", "specifier %I"),
        ("ExecStart=|{py} -m x\n", "shell"),
        ("ExecStart='{py} -m x\n", "unbalanced quoting"),
        ("ExecStart=/bin/sh -c 'exec {py} -m x'\n", "names the root but is no path"),
        ("[Service\nExecStart={py}\n", "no section header"),
    ],
    ids=[
        "env-path",
        "variable",
        "env-variable",
        "specifier",
        "shell-prefix",
        "quote",
        "shell-script",
        "header",
    ],
)
def test_a_line_not_understood_refuses_the_prune_naming_it(
    host: dict[str, Path], text: str, reason: str
) -> None:
    """A launch line this reader cannot resolve: a8010cc read it as some other word (or as
    nothing) and pruned; now the survey's unknown names the file and why, and nothing goes."""
    python = host["root"] / "versions" / "0.5.21" / "bin" / "python"
    path = write_dropin(host["units"], "sglang@a.service", text.format(py=python))
    found = survey(host)
    assert any(str(path) in item or "sglang@a.service" in item for item in found.get("unknown", []))
    assert any(reason in item for item in found.get("unknown", [])), found.get("unknown", [])
    with pytest.raises(ValueError, match="nothing was removed: who uses the SGLang versions"):
        prune_all_unused(host, found)
    assert left(host) == ["0.5.20", "0.5.21", "0.5.22"]


def test_a_template_drop_in_for_every_instance_counts(host: dict[str, Path]) -> None:
    """sglang@.service.d applies to every sglang@ unit: its interpreter is in use."""
    python = host["root"] / "versions" / "0.5.20" / "bin" / "python"
    write_dropin(host["units"], "sglang@.service", f"[Service]\nExecStart=\nExecStart={python}\n")
    found = survey(host)
    assert next(v["used_by"] for v in found["versions"]) == ["sglang@.service (its unit)"]


# --------------------------------------------------------------------------- what cannot be read


def test_a_drop_in_that_cannot_be_read_refuses_the_prune(host: dict[str, Path]) -> None:
    """a8010cc read an unreadable drop-in (here a link, which the bounded reader refuses) as
    empty: the version its target names was pruned."""
    python = host["root"] / "versions" / "0.5.21" / "bin" / "python"
    real = host["units"].parent / "elsewhere.conf"
    real.write_text(f"ExecStart={python}\n")
    (host["units"] / "sglang@a.service.d").mkdir()
    (host["units"] / "sglang@a.service.d" / "10-launch.conf").symlink_to(real)
    found = survey(host)
    assert any("10-launch.conf cannot be read" in item for item in found.get("unknown", []))
    with pytest.raises(ValueError, match=r"10-launch\.conf cannot be read"):
        prune_all_unused(host, found)
    assert left(host) == ["0.5.20", "0.5.21", "0.5.22"]


def test_a_last_known_good_copy_over_its_bound_refuses(host: dict[str, Path]) -> None:
    """A copy bigger than the reader's bound was "nobody's" on a8010cc."""
    lkg = host["state"] / "a" / "lkg"
    lkg.mkdir(parents=True)
    python = host["root"] / "versions" / "0.5.20" / "bin" / "python"
    (lkg / "10-launch.conf").write_text(f"ExecStart={python}\n" + "#" * configs.MAX_CONF_BYTES)
    found = survey(host)
    assert any("over" in item and "10-launch.conf" in item for item in found.get("unknown", []))
    with pytest.raises(ValueError, match="who uses the SGLang versions cannot be proven"):
        prune_all_unused(host, found)


def test_a_listing_cut_at_its_bound_refuses(
    host: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """a8010cc read the first MAX_ENTRIES names of the units' folder and called the rest
    nobody's."""
    monkeypatch.setattr(configs, "MAX_ENTRIES", 2)
    python = host["root"] / "versions" / "0.5.21" / "bin" / "python"
    for name in ("sglang@a.service", "sglang@b.service", "sglang@c.service"):
        write_dropin(host["units"], name, "[Service]\nExecStart=/usr/bin/true\n")
    write_dropin(host["units"], "sglang@z.service", f"[Service]\nExecStart={python}\n")
    found = survey(host)
    assert any("more than the 2 entries read" in item for item in found.get("unknown", []))
    with pytest.raises(ValueError, match="more than the 2 entries read"):
        prune_all_unused(host, found)
    assert left(host) == ["0.5.20", "0.5.21", "0.5.22"]


@pytest.mark.parametrize(
    "answers",
    [
        {"list-units": (1, "", "Failed to connect to bus")},
        {"list-units": (124, "", "no answer within 30 s")},
        {"show": (1, "", "Unit not loaded")},
        {"show": (0, "forty-two\n", "")},
        {"show": (0, "0\n", "")},
        {"cmdline": None},
    ],
    ids=[
        "list-fails",
        "list-times-out",
        "show-fails",
        "pid-garbage",
        "active-no-pid",
        "cmdline-unreadable",
    ],
)
def test_a_running_unit_that_cannot_be_read_refuses(
    host: dict[str, Path], monkeypatch: pytest.MonkeyPatch, answers: dict
) -> None:
    """a8010cc skipped a failed or timed-out systemctl, an unreadable MainPID and an
    unreadable /proc/PID/cmdline: the version a server runs from was pruned under it."""
    answer = {
        "list-units": (0, "sglang@b.service loaded active running SGLang b\n", ""),
        "show": (0, "42\n", ""),
        **answers,
    }
    cmdline = f"{host['root']}/versions/0.5.21/bin/python\0-m\0sglang\0".encode()
    monkeypatch.setattr(
        versions,
        "read_regular",
        lambda path, limit: answer.get("cmdline", cmdline) if path == "/proc/42/cmdline" else None,
    )

    def run(argv: list[str], timeout: float) -> tuple[int, str, str]:
        return answer[argv[1]]

    found = survey(host, run)
    assert found.get("unknown", []), found
    with pytest.raises(ValueError, match="nothing was removed"):
        prune_all_unused(host, found)
    assert left(host) == ["0.5.20", "0.5.21", "0.5.22"]


def test_a_running_server_keeps_its_version_however_its_argv0_is_spelled(
    host: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The running side normalises as the configured side does (a8010cc: text only)."""
    cmdline = f"{host['root']}/versions/./0.5.20/bin/python\0-m\0sglang\0".encode()
    monkeypatch.setattr(versions, "read_regular", lambda path, limit: cmdline)

    def run(argv: list[str], timeout: float) -> tuple[int, str, str]:
        if argv[1] == "list-units":
            return 0, "sglang@b.service loaded active running SGLang b\n", ""
        return 0, "42\n", ""

    found = survey(host, run)
    assert found.get("unknown", []) == []
    assert found["versions"][0]["used_by"] == ["sglang@b.service (running)"]


def test_an_unfinished_build_a_unit_names_is_not_removed(host: dict[str, Path]) -> None:
    """a8010cc removed every .building-* folder when pruning, even one a drop-in names."""
    build = host["root"] / "versions" / ".building-0.5.23"
    (build / "bin").mkdir(parents=True)
    write_dropin(host["units"], "sglang@a.service", f"ExecStart={build}/bin/python -m x\n")
    found = survey(host)
    assert found["building_used_by"] == {".building-0.5.23": ["sglang@a.service (its unit)"]}
    with pytest.raises(ValueError, match="unfinished build"):
        prune_all_unused(host, found)
    assert build.is_dir()


def test_install_refuses_to_replace_a_version_when_users_are_unknown(
    host: dict[str, Path],
) -> None:
    """installed replaces an old <wanted> folder: not when who uses it cannot be proven."""
    build = host["root"] / "versions" / ".building-0.5.21"
    (build / "bin").mkdir(parents=True)
    write_dropin(host["units"], "sglang@a.service", "ExecStart=/usr/bin/env python3 -m x\n")
    found = survey(host)
    with pytest.raises(ValueError, match="nothing was replaced"):
        versions.install(str(host["root"]), "0.5.21", found, False)
    assert (host["root"] / "versions" / "0.5.21" / versions.MARKER).exists()


def test_read_still_reports_and_a_prune_that_removes_nothing_passes(
    host: dict[str, Path],
) -> None:
    write_dropin(host["units"], "sglang@a.service", "ExecStart=/usr/bin/env python3 -m x\n")
    found = survey(host)
    assert [v["name"] for v in found["versions"]] == ["0.5.20", "0.5.21", "0.5.22"]
    assert versions.prune(str(host["root"]), "0.5.22", found, 3, [], False) == []


# --------------------------------------------------------------------------- the marker


def test_a_deeply_nested_marker_is_a_version_not_ready_not_a_traceback(
    host: dict[str, Path],
) -> None:
    """a8010cc read the marker with json.loads: 100,000 levels of [ ended in RecursionError,
    which the module did not catch."""
    marker = host["root"] / "versions" / "0.5.21" / versions.MARKER
    marker.write_text("[" * 100_000 + "]" * 100_000)
    found = survey(host)
    entry = next(v for v in found["versions"] if v["name"] == "0.5.21")
    assert entry["ready"] is False and "nested deeper" in entry["problem"]


@pytest.mark.parametrize(
    "meta",
    [{"version": "0.5.21", "key": ["k1"]}, {"version": "0.5.21", "key": 7},
     {"version": "0.5.21", "key": "k1\n"}, {"version": ["0.5.21"]}],
)  # fmt: skip
def test_marker_fields_are_typed(host: dict[str, Path], meta: dict) -> None:
    """a8010cc returned whatever the marker held as the version's key (a list, a number)."""
    (host["root"] / "versions" / "0.5.21" / versions.MARKER).write_text(json.dumps(meta))
    entry = next(v for v in survey(host)["versions"] if v["name"] == "0.5.21")
    assert entry["ready"] is False and entry["key"] == "" and entry["problem"]


@pytest.mark.parametrize("name", ["0.5.23\n", "0.5.21\n"])
def test_a_version_name_with_a_trailing_newline_is_refused(
    host: dict[str, Path], name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """NAME_RE used re.match with `$`, which matches before a trailing newline."""
    args = {
        "root": str(host["root"]),
        "wanted": "0.5.22",
        "remove": [name],
        "units_dir": str(host["units"]),
        "state_dir": str(host["state"]),
        "state": "read",
    }
    if name == "0.5.23\n":
        args["wanted"], args["remove"] = name, []
    with patch_module_args(args), pytest.raises(SystemExit):
        versions.main()
    result = json.loads(capsys.readouterr().out)
    assert result.get("failed") and "is not a version" in result["msg"], result


# --------------------------------------------------------------------------- launch_line


def test_what_launch_line_writes_reads_back_word_for_word() -> None:
    """The one reader understands every hostile value launch_line.py quotes (the values
    tests/test_flags.py round-trips through a real systemd)."""
    argv = ["/opt/ml env%/versions/0.5.21/bin/python", "-m", "sglang.launch_server", *HOSTILE]
    text = f"[Service]\nExecStart=\nExecStart={exec_start(argv)} --config %d/secrets.yaml\n"
    (command,) = configs.exec_starts(text, "sglang@llama.service")
    assert command.path == argv[0]
    assert list(command.argv) == [
        *argv,
        "--config",
        "/run/credentials/sglang@llama.service/secrets.yaml",
    ]


# --------------------------------------------------------------------------- model pruning


def test_a_proc_that_cannot_be_listed_refuses_model_pruning(tmp_path: Path) -> None:
    """a8010cc returned no process when /proc could not be listed: every revision a running
    server loads looked unused."""
    with pytest.raises(in_use.Unreadable, match="cannot be listed"):
        in_use.process_references(str(tmp_path / "no-proc"))


def test_a_process_whose_working_directory_cannot_be_read_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--model-path rev-a` is relative to the process's working directory: a8010cc dropped it
    when that link could not be read (root without CAP_SYS_PTRACE in a container)."""
    proc = tmp_path / "proc"
    (proc / "77").mkdir(parents=True)
    (proc / "77" / "cmdline").write_bytes(b"python\0--model-path\0rev-a\0")
    real = os.readlink

    def readlink(path: Any, *args: Any, **kwargs: Any) -> str:
        if str(path).endswith("/77/cwd"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(in_use.os, "readlink", readlink)
    with pytest.raises(in_use.Unreadable, match=r"process 77 .*Permission denied"):
        in_use.process_references(str(proc))


def test_a_process_mapping_more_than_the_old_bound_still_keeps_its_model(tmp_path: Path) -> None:
    """a8010cc read /proc/PID/maps whole, at most 8 MiB, and read nothing of a bigger one."""
    proc = tmp_path / "proc"
    (proc / "78").mkdir(parents=True)
    (proc / "78" / "cmdline").write_bytes(b"python\0")
    filler = b"7f0000000000-7f0000001000 r--p 00000000 00:00 0 \n" * 200_000  # ~10 MiB
    model = b"7f0000002000-7f0000003000 r--p 00000000 08:01 42 /models/llama/rev-a/w.safetensors\n"
    (proc / "78" / "maps").write_bytes(filler + model)
    assert "/models/llama/rev-a/w.safetensors" in in_use.process_references(str(proc))


def _revisions(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    ms = load_plugin("plugins/module_utils/model_stage.py")
    parent = tmp_path / "models" / "llama"
    for index, name in enumerate(("rev-0", "rev-1", "rev-new")):
        folder = parent / name
        folder.mkdir(parents=True)
        (folder / ms.MARKER).write_text(json.dumps({"revision": name, "staged_at": index}))
    params = {
        "path": str(parent / "rev-new"), "keep": 1, "protect": [],
        "state_dir": str(tmp_path / "state"), "systemd_dir": str(tmp_path / "systemd"),
        "workdir": str(tmp_path / "workdir"),
    }  # fmt: skip
    return parent, params


@pytest.mark.parametrize(
    "text",
    [
        "[Service]\nExecStart=-/py -m sglang.launch_server --model-path \\\n  {rev}\n",
        "[Service]\nExecStart=/usr/bin/env -S '/py -m x --model-path {rev}'\n",
        "[Service]\nExecStart = /py --model-path={rev}\n",
    ],
    ids=["continuation", "env-S", "spaces-around-equals"],
)
def test_model_pruning_keeps_what_every_exec_start_form_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    """a8010cc missed a revision named on a continuation line, inside env -S, or after
    `ExecStart =`: it was pruned while a server was configured with it."""
    parent, params = _revisions(tmp_path)
    write_dropin(tmp_path / "systemd", "sglang@a.service", text.format(rev=parent / "rev-0"))
    monkeypatch.setattr(stage_mod, "process_references", list)
    owned = load_plugin("plugins/module_utils/owned_folder.py")
    with owned.OwnedFolder(str(parent)) as folder:
        pruned, skipped = stage_mod.prune(params, folder)
    assert skipped is None
    assert (parent / "rev-0").is_dir() and pruned == [str(parent / "rev-1")]


@pytest.mark.parametrize(
    "text",
    ["ExecStart=/py --model-path ${MODEL}\n", "ExecStart=/py --model-path %h/models/rev-0\n"],
    ids=["variable", "specifier"],
)
def test_model_pruning_refuses_a_launch_line_it_cannot_resolve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    """a8010cc took `${MODEL}` or `%h/...` as literal text, which names nothing: pruned."""
    parent, params = _revisions(tmp_path)
    write_dropin(tmp_path / "systemd", "sglang@a.service", text)
    monkeypatch.setattr(stage_mod, "process_references", list)
    owned = load_plugin("plugins/module_utils/owned_folder.py")
    with owned.OwnedFolder(str(parent)) as folder:
        pruned, skipped = stage_mod.prune(params, folder)
    assert pruned == [] and skipped and "10-launch.conf" in skipped
    assert (parent / "rev-0").is_dir() and (parent / "rev-1").is_dir()


def test_model_pruning_refuses_when_a_process_cannot_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent, params = _revisions(tmp_path)

    def unreadable() -> list[str]:
        raise in_use.Unreadable(["process 9 (/proc/9) cannot be read (Permission denied)"])

    monkeypatch.setattr(stage_mod, "process_references", unreadable)
    owned = load_plugin("plugins/module_utils/owned_folder.py")
    with owned.OwnedFolder(str(parent)) as folder:
        pruned, skipped = stage_mod.prune(params, folder)
    assert pruned == [] and "process 9" in skipped
    assert (parent / "rev-0").is_dir() and (parent / "rev-1").is_dir()


def test_the_module_documents_what_it_returns_as_yaml() -> None:
    """ansible-doc reads DOCUMENTATION as YAML: a8010cc's had `guessed: a running ...` inside a
    list item, which YAML reads as a mapping key, so the module's documentation did not load."""
    doc = yaml.safe_load(versions.DOCUMENTATION)
    assert set(doc["options"]) >= {"root", "wanted", "state", "keep", "remove"}
    assert {"unknown", "building_used_by", "versions"} <= set(yaml.safe_load(versions.RETURN))
