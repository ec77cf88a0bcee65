"""Property-based tests of weight staging (Hypothesis; profiles in tests/conftest.py): the
model_stage module's arguments, the role's filters, the folder helper and a whole staging run
against generated hostile checkpoints and host states. Invariants (issue 33): a clean error
naming the input or a correct result, never a traceback; bounded time (no FIFO or device is
read); nothing outside the folders we own is touched; no token in any output."""

from __future__ import annotations

import hashlib
import json
import os
import string
from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError
from conftest import load_plugin
from hypothesis import given
from hypothesis import strategies as st
from test_model_stage import FakeRsync, _params

mod = load_plugin("plugins/modules/model_stage.py")
ms = load_plugin("plugins/module_utils/model_stage.py")
owned = load_plugin("plugins/module_utils/owned_folder.py")
refs = load_plugin("plugins/module_utils/model_in_use.py")
filters = load_plugin("plugins/filter/model_stage.py").FilterModule().filters()

ARGUMENTS = set(mod.ARGUMENT_SPEC)
TOKEN = "hf_PropertyTestToken0123456789"

# Text that paths, names and commands are made of: ordinary characters and the ones that break
# things (controls, NUL, slashes, dots, colons, quotes, non-ASCII).
_chars = st.sampled_from(list(string.ascii_letters + string.digits + "-_.:/@ \n\t\x00\x7f'\"é"))
texts = st.text(_chars, max_size=24)
paths = st.one_of(
    texts,
    st.lists(
        st.sampled_from(["models", "llama", "rev-a", ".", "..", "", "x\ny", "a b"]), max_size=4
    ).map(lambda parts: "/" + "/".join(parts)),
)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
    st.booleans(),
    st.none(),
)
rsync_sources = st.one_of(
    texts,
    st.sampled_from(
        ["/", "store:/", "rsync://store/m", "store::m/x", "-e sh", "/a/../b", "//x", "/a/./b",
         "store:/srv/m/rev-a", "/shared/m/rev-a", "user@store:/srv/m"]
    ),
)  # fmt: skip
sources = st.one_of(
    st.fixed_dictionaries(
        {"rsync": rsync_sources, "revision": texts},
        optional={"manifest": texts, "size": numbers},
    ),
    st.fixed_dictionaries(
        {
            "hf_repo": st.one_of(texts, st.just("org/llama")),
            "revision": st.one_of(texts, st.just("0" * 40)),
        },
    ),
    st.dictionaries(texts, texts, max_size=3),
    texts,
    st.none(),
)


@given(
    args=st.fixed_dictionaries(
        {
            "path": paths,
            "source": sources,
            "keep": numbers,
            "bwlimit_kbps": numbers,
            "verify_workers": numbers,
            "free_margin_bytes": numbers,
            "ssh_command": texts,
            "manifest_name": texts,
        }
    )
)
def test_module_arguments_give_a_named_error_or_a_check_mode_answer(args: dict[str, Any]) -> None:
    params = {
        **_params(Path("/nonexistent-root"), Path("/nonexistent-source")),
        **args,
        "hf_token": TOKEN,
    }

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("check mode copies nothing")

    result = mod.run_module(params, True, never)
    assert isinstance(result, dict)
    assert TOKEN not in json.dumps(result, default=str)
    if result.get("failed"):
        named = result["msg"].removeprefix("model_stage: ").split(":", 1)[0].split(".")[0]
        assert named in ARGUMENTS or result["msg"].startswith("staging "), result["msg"]
    else:
        assert result["state"] in ("absent", "staged", "broken", "other", "foreign")


servers = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"name": texts, "model_path": paths},
            optional={"model_source": sources},
        ),
        texts,
        st.none(),
        st.integers(),
    ),
    max_size=3,
)


@given(servers=st.one_of(servers, texts, st.dictionaries(texts, texts, max_size=2)))
def test_the_plan_filters_name_the_variable_or_answer(servers: Any) -> None:
    for name in ("model_stage_copies", "model_stage_protected", "model_stage_summary"):
        try:
            answer = filters[name](servers)
        except AnsibleFilterError as exc:
            assert "sglang_server_instances" in str(exc) or "model_stage" in str(exc), str(exc)
        else:
            json.dumps(answer)


@given(
    settings=st.fixed_dictionaries(
        {
            "model_stage_free_margin_gb": numbers,
            "model_stage_keep": numbers,
            "model_stage_bwlimit_kbps": numbers,
            "model_stage_verify_workers": numbers,
            "model_stage_timeout": numbers,
            "model_stage_poll": numbers,
            "model_stage_manifest_name": texts,
            "model_stage_ssh_command": texts,
            "model_stage_hf_python": st.one_of(paths, st.just("")),
            "model_stage_hf_endpoint": st.one_of(texts, st.just("http://mirror:8080/hf")),
        }
    )
)
def test_the_settings_filter_names_the_variable_or_types_every_value(
    settings: dict[str, Any],
) -> None:
    try:
        checked = filters["model_stage_settings"](settings)
    except AnsibleFilterError as exc:
        assert str(exc).split(":", 1)[0] in settings, str(exc)
    else:
        assert checked["model_stage_bwlimit_kbps"] >= 0 and checked["model_stage_keep"] >= 1
        assert 1 <= checked["model_stage_verify_workers"] <= 64


# --------------------------------------------------------------------- nothing leaves the root


def _snapshot(folder: Path) -> dict[str, str]:
    """Every entry under folder: its kind and, for a file, its bytes' digest."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            if path.is_symlink():
                seen[str(path)] = "link:" + os.readlink(path)
            elif path.is_file():
                seen[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                seen[str(path)] = "dir"
    return seen


def _outside(tmp: Path) -> Path:
    outside = tmp / "outside"
    (outside / "sub").mkdir(parents=True, exist_ok=True)
    (outside / "victim").write_bytes(b"keep me")
    (outside / "sub" / "victim").write_bytes(b"keep me too")
    if not (outside / "fifo").exists():
        os.mkfifo(outside / "fifo")
    return outside


_names = st.sampled_from(["a", "b", "sub", "victim", "fifo", ".model-stage.json", "c d"])
_relative = st.lists(
    st.one_of(_names, st.sampled_from(["..", ".", ""])), min_size=1, max_size=3
).map("/".join)
_entries = st.lists(
    st.tuples(
        st.lists(_names, min_size=1, max_size=2).map("/".join),
        st.sampled_from(["file", "dir", "link-file", "link-dir", "link-fifo", "link-dangling"]),
    ),
    max_size=6,
)
_ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["remove_file", "remove_entry", "write_file", "read_small", "lstat", "rename",
             "make_folder", "open_folder", "regular_size"]
        ),
        _relative,
        _names,
    ),
    max_size=6,
)  # fmt: skip


def _build(root: Path, outside: Path, entries: list[tuple[str, str]]) -> None:
    targets = {
        "link-file": outside / "victim",
        "link-dir": outside / "sub",
        "link-fifo": outside / "fifo",
        "link-dangling": outside / "nothing",
    }
    for relative, kind in entries:
        path = root / relative
        on_the_way = [root.joinpath(*Path(relative).parts[:n]) for n in range(1, 3)]
        if any(p.is_symlink() for p in on_the_way) or os.path.lexists(path):
            continue  # never build through a link (a write into the FIFO would block)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if kind == "file":
                path.write_bytes(b"ours")
            elif kind == "dir":
                path.mkdir(exist_ok=True)
            else:
                path.symlink_to(targets[kind])
        except OSError:
            continue  # a name taken by an earlier entry, or a link on the way


@given(entries=_entries, ops=_ops)
def test_folder_operations_never_touch_anything_outside_the_root(
    tmp_path_factory: pytest.TempPathFactory,
    entries: list[tuple[str, str]],
    ops: list[tuple[str, str, str]],
) -> None:
    tmp = tmp_path_factory.mktemp("root")
    outside = _outside(tmp)
    root = tmp / "root"
    root.mkdir()
    _build(root, outside, entries)
    before = _snapshot(outside)
    with owned.OwnedFolder(str(root)) as folder:
        for op, relative, name in ops:
            try:
                if op == "write_file":
                    folder.write_file(name, b"new")
                elif op == "rename":
                    folder.rename(name, name + ".renamed")
                elif op == "make_folder":
                    folder.make_folder(name)
                elif op == "open_folder":
                    opened = folder.open_folder(name)
                    if opened is not None:
                        opened.close()
                elif op == "read_small":
                    folder.read_small(relative, 1024)
                else:
                    getattr(folder, op)(relative)
            except (owned.OutsideFolder, OSError, ValueError):
                continue
    assert _snapshot(outside) == before


_kinds = st.sampled_from(
    ["good", "bad-bytes", "bad-size", "link-outside-file", "through-linked-folder",
     "folder", "link-fifo", "missing"]
)  # fmt: skip


@given(files=st.dictionaries(st.sampled_from(["w1", "w2", "model: w1", "w 3"]), _kinds,
                             min_size=1, max_size=4))  # fmt: skip
def test_staging_a_hostile_checkpoint_is_a_named_failure_or_a_verified_copy(
    tmp_path_factory: pytest.TempPathFactory, files: dict[str, str]
) -> None:
    tmp = tmp_path_factory.mktemp("stage")
    outside = _outside(tmp)
    source = tmp / "shared" / "rev-a"
    source.mkdir(parents=True)
    (source / "linked").symlink_to(outside / "sub")
    manifest = {}
    for name, kind in files.items():
        content = name.encode() * 3
        listed = f"linked/{name}" if kind == "through-linked-folder" else name
        if kind in ("good", "bad-bytes", "bad-size"):
            (source / name).write_bytes(content if kind == "good" else b"X" * len(content))
        elif kind == "link-outside-file":
            (source / name).symlink_to(outside / "victim")
        elif kind == "folder":
            (source / name).mkdir()
        elif kind == "link-fifo":
            (source / name).symlink_to(outside / "fifo")
        elif kind == "through-linked-folder":
            (outside / "sub" / name).write_bytes(b"Y" * len(content))
        size = len(content) + (1 if kind == "bad-size" else 0)
        manifest[listed] = {"sha256": hashlib.sha256(content).hexdigest(), "size": size}
    (source / "model.sha256.json").write_text(json.dumps({"files": manifest}))
    params = {**_params(tmp, source), "hf_token": TOKEN}
    before = _snapshot(outside)
    result = mod.run_module(params, False, FakeRsync())
    assert _snapshot(outside) == before
    assert TOKEN not in json.dumps(result, default=str)
    final = Path(params["path"])
    if all(kind == "good" for kind in files.values()):
        assert not result.get("failed"), result
        assert all((final / name).read_bytes() == name.encode() * 3 for name in files)
    else:
        assert result["failed"] is True and "failed verification" in result["msg"], result
        assert not final.exists()
        bad = [n for n, k in files.items() if k != "good"]
        assert all(name in result["msg"] for name in bad)


@given(
    revisions=st.lists(st.floats(0, 1e9), min_size=1, max_size=5),
    keep=st.integers(1, 4),
    used=st.lists(
        st.tuples(st.integers(0, 4), st.sampled_from(["relative", "absolute", "link", "inside",
                                                      "lkg", "dropin", "model-alias"])),
        max_size=3,
    ),
)  # fmt: skip
def test_pruning_never_removes_a_revision_in_use_or_anything_outside(
    tmp_path_factory: pytest.TempPathFactory,
    revisions: list[float],
    keep: int,
    used: list[tuple[int, str]],
) -> None:
    tmp = tmp_path_factory.mktemp("prune")
    outside = _outside(tmp)
    parent = tmp / "models" / "llama"
    names = []
    for index, staged_at in enumerate(revisions):
        folder = parent / f"rev-{index}"
        folder.mkdir(parents=True)
        (folder / "w").write_bytes(b"weights")
        (folder / "escape").symlink_to(outside / "sub")
        (folder / ms.MARKER).write_text(json.dumps({"revision": "x", "staged_at": staged_at}))
        names.append(folder.name)
    proc = tmp / "proc"
    proc.mkdir()  # an empty /proc: no process (a missing one proves nothing, and refuses)
    in_use = set()
    for number, (index, how) in enumerate(used):
        if index >= len(names):
            continue
        in_use.add(names[index])
        target = parent / names[index]
        argv, cwd = ["python3", "-m", "sglang.launch_server", "--model-path", str(target)], None
        if how == "relative":
            argv[-1], cwd = names[index], parent
        elif how == "model-alias":
            argv[-2] = "--model"
        elif how == "link":
            (tmp / f"current-{number}").symlink_to(target)
            argv[-1] = str(tmp / f"current-{number}")
        elif how == "inside":
            argv[-1] = str(target / "w")
        elif how == "lkg":
            lkg = tmp / "state" / f"s{number}" / "lkg"
            lkg.mkdir(parents=True)
            (lkg / "meta.json").write_text(json.dumps({"flags": {"model_path": str(target)}}))
            continue
        elif how == "dropin":
            dropin = tmp / "systemd" / f"sglang@s{number}.service.d"
            dropin.mkdir(parents=True)
            (dropin / "10-launch.conf").write_text(f"ExecStart=/py -m x --model-path {target}\n")
            continue
        (proc / str(100 + number)).mkdir(parents=True)
        (proc / str(100 + number) / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
        if cwd is not None:
            (proc / str(100 + number) / "cwd").symlink_to(cwd)
    params = {**_params(tmp, tmp), "path": str(parent / "rev-new"), "keep": keep}
    checked = mod.check_params(params)
    mod_refs = lambda: refs.process_references(str(proc))  # noqa: E731 - read by prune()
    original, mod.process_references = mod.process_references, mod_refs
    before = _snapshot(outside)
    try:
        with owned.OwnedFolder(str(parent)) as folder:
            pruned, skipped = mod.prune(checked, folder)
    finally:
        mod.process_references = original
    assert skipped is None
    removed = {Path(p).name for p in pruned}
    assert not removed & in_use, (removed, in_use)
    assert len(names) - len(removed) >= min(keep, len(names))
    assert all((parent / name).is_dir() for name in names if name not in removed)
    assert _snapshot(outside) == before
