"""Weight staging (plugins/modules/model_stage.py, plugins/module_utils/model_stage.py,
docs/STAGING.md): the manifest, the disk-space pre-flight, copy-verify-rename, no second copy,
pruning, and the
Hugging Face path through a fake huggingface_hub (no hub is reachable here)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import load_plugin

mod = load_plugin("plugins/modules/model_stage.py")
ms = load_plugin("plugins/module_utils/model_stage.py")
owned = load_plugin("plugins/module_utils/owned_folder.py")
in_use = load_plugin("plugins/module_utils/model_in_use.py")


def _checkpoint(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"files": {}}
    for name, content in files.items():
        (folder / name).write_bytes(content)
        manifest["files"][name] = {
            "sha256": hashlib.sha256(content).hexdigest(),
            "size": len(content),
        }
    (folder / "model.sha256.json").write_text(json.dumps(manifest))
    return folder


class FakeRsync:
    """Stands in for rsync on a local source: copies what rsync's argv names, and records it."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> SimpleNamespace:
        self.calls.append(argv)
        src, dest = argv[-2], argv[-1]
        if src.endswith("/"):
            for item in Path(src).iterdir():
                target = Path(dest) / item.name
                if item.is_symlink():  # --links: a link is copied as a link
                    if not target.is_symlink():
                        os.symlink(os.readlink(item), target)
                    continue
                if item.is_dir():  # --recursive
                    shutil.copytree(item, target, symlinks=True, dirs_exist_ok=True)
                    continue
                # rsync's quick check: same size and mtime is skipped
                if target.exists() and target.stat().st_size == item.stat().st_size:
                    continue
                shutil.copy2(item, target)
        else:
            shutil.copy2(src, dest)
        return SimpleNamespace(returncode=0, stderr="")


def _params(tmp_path: Path, source: Path, **extra: Any) -> dict[str, Any]:
    params = {
        "path": str(tmp_path / "models" / "llama" / "rev-a"),
        "source": {"rsync": str(source), "revision": "rev-a"},
        "manifest_name": "model.sha256.json",
        "free_margin_bytes": 0,
        "keep": 2,
        "protect": [],
        "bwlimit_kbps": 0,
        "ssh_command": "ssh -o BatchMode=yes",
        "hf_python": None,
        "hf_endpoint": None,
        "hf_token": None,
        "verify_workers": 2,
        "warm": False,
        "progress_log": None,
        "state_dir": str(tmp_path / "state"),
        "systemd_dir": str(tmp_path / "systemd"),
        "workdir": str(tmp_path / "workdir"),
    }
    params.update(extra)
    return params


@pytest.fixture(autouse=True)
def _no_host_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pruning reads /proc: these tests give it the processes they mean (none by default)."""
    monkeypatch.setattr(mod, "process_references", list)


def stage(params: dict[str, Any], check_mode: bool, run: Any) -> dict[str, Any]:
    """The module's staging with its arguments checked first, as main() runs it."""
    return mod.stage(mod.check_params(params), check_mode, run)


FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"w" * 50_000}


def test_a_revision_is_copied_verified_and_renamed_then_never_copied_again(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)
    params = _params(tmp_path, source, warm=True)
    rsync = FakeRsync()
    first = stage(params, False, rsync)
    final = Path(params["path"])
    assert first["changed"] is True and first["state"] == "absent"
    assert first["bytes"] == sum(len(c) for c in FILES.values())
    assert (final / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert not Path(params["path"] + ".partial").exists()
    marker = json.loads((final / ms.MARKER).read_text())
    assert marker["revision"] == "rev-a" and marker["files"] == 2
    assert first["warm_seconds"] is not None
    # manifest alone first, then the checkpoint
    assert [c[-2].endswith("model.sha256.json") for c in rsync.calls] == [True, False]

    def no_copy(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a staged revision must not be copied again")

    second = stage({**params, "warm": False}, False, no_copy)
    assert second["changed"] is False and second["state"] == "staged"
    assert second["copy_seconds"] == 0.0


def test_a_corrupt_file_fails_verification_and_never_reaches_the_final_name(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)
    (source / "model.safetensors").write_bytes(b"x" * 50_000)  # same size, other bytes
    params = _params(tmp_path, source)
    with pytest.raises(mod.StageError) as err:
        stage(params, False, FakeRsync())
    assert "model.safetensors: sha256" in str(err.value)
    assert "failed verification" in str(err.value)
    assert not Path(params["path"]).exists()
    # removed from the partial copy, so the next run fetches it again
    partial = Path(params["path"] + ".partial")
    assert not (partial / "model.safetensors").exists()
    assert (partial / "config.json").exists()
    # the source is repaired: the next run copies only what is missing and passes
    (source / "model.safetensors").write_bytes(FILES["model.safetensors"])
    assert stage(params, False, FakeRsync())["changed"] is True
    assert Path(params["path"], "model.safetensors").read_bytes() == FILES["model.safetensors"]


def test_the_disk_space_preflight_refuses_with_numbers_before_the_checkpoint_is_copied(
    tmp_path: Path,
) -> None:
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)
    params = _params(tmp_path, source, free_margin_bytes=10**18)
    rsync = FakeRsync()
    with pytest.raises(mod.StageError) as err:
        stage(params, False, rsync)
    message = str(err.value)
    assert message.startswith("not enough disk space for")
    assert "(50023 bytes)" in message and "model_stage_free_margin_gb" in message
    assert len(rsync.calls) == 1  # the manifest only
    assert not (Path(params["path"] + ".partial") / "model.safetensors").exists()


def test_space_refusal_arithmetic_counts_what_is_already_there() -> None:
    gib = 1024**3
    assert ms.space_refusal(600 * gib, 0, 700 * gib, 50 * gib, "/m") is None
    assert ms.space_refusal(600 * gib, 0, 640 * gib, 50 * gib, "/m") is not None
    # a resumed copy needs only the rest
    assert ms.space_refusal(600 * gib, 100 * gib, 560 * gib, 50 * gib, "/m") is None
    refusal = ms.space_refusal(600 * gib, 0, 640 * gib, 50 * gib, "/m")
    assert "short by 10.00 GiB" in str(refusal)


def test_free_bytes_reads_the_nearest_existing_parent(tmp_path: Path) -> None:
    seen = []

    def statvfs(path: str) -> SimpleNamespace:
        seen.append(path)
        return SimpleNamespace(f_bavail=10, f_frsize=4096)

    assert ms.free_bytes(str(tmp_path / "a" / "b"), statvfs) == 40960
    assert seen == [str(tmp_path)]


@pytest.mark.parametrize(
    ("files", "fragment"),
    [
        ({"/etc/passwd": {"sha256": "0" * 64, "size": 1}}, "relative path"),
        ({"../x": {"sha256": "0" * 64, "size": 1}}, "relative path"),
        ({".hidden": {"sha256": "0" * 64, "size": 1}}, "hidden"),
        ({"a": {"sha256": "ABC", "size": 1}}, "64 lowercase hex"),
        ({"a": {"sha256": "0" * 64, "size": -1}}, "size must be"),
        ({"a": {"sha256": "0" * 64, "size": True}}, "size must be"),
        ({}, "lists no files"),
    ],
)
def test_a_manifest_that_cannot_be_checked_is_refused(files: dict, fragment: str) -> None:
    with pytest.raises(ms.StageError, match=fragment):
        ms.parse_manifest({"files": files})


def test_the_deprecated_checksums_form_is_refused_it_has_no_sizes() -> None:
    with pytest.raises(ms.StageError, match="expected"):
        ms.parse_manifest({"checksums": {"a": "0" * 64}})


def test_a_directory_not_staged_by_us_is_never_overwritten(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)
    params = _params(tmp_path, source)
    Path(params["path"]).mkdir(parents=True)
    (Path(params["path"]) / "weights.bin").write_bytes(b"operator's own")
    with pytest.raises(mod.StageError, match="not staged by model_stage"):
        stage(params, False, FakeRsync())
    assert (Path(params["path"]) / "weights.bin").read_bytes() == b"operator's own"


def test_a_staged_file_that_changed_size_is_copied_again(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)
    params = _params(tmp_path, source)
    stage(params, False, FakeRsync())
    Path(params["path"], "model.safetensors").write_bytes(b"short")
    again = stage(params, False, FakeRsync())
    assert again["state"] == "broken" and again["changed"] is True
    assert Path(params["path"], "model.safetensors").read_bytes() == FILES["model.safetensors"]


def test_check_mode_says_it_would_stage_and_copies_nothing(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)
    params = _params(tmp_path, source)
    rsync = FakeRsync()
    assert stage(params, True, rsync)["changed"] is True
    assert rsync.calls == [] and not Path(params["path"] + ".partial").exists()


def _staged(parent: Path, name: str, staged_at: float) -> Path:
    folder = parent / name
    folder.mkdir(parents=True)
    (folder / ms.MARKER).write_text(json.dumps({"revision": name, "staged_at": staged_at}))
    return folder


def test_prune_keeps_the_newest_and_never_one_in_use_or_foreign(tmp_path: Path) -> None:
    for index, name in enumerate(["r1", "r2", "r3", "r4"]):
        _staged(tmp_path, name, 100.0 + index)
    (tmp_path / "operator-copy").mkdir()  # no marker: not ours
    (tmp_path / "r5.partial").mkdir()  # a copy in progress
    with owned.OwnedFolder(str(tmp_path)) as parent:
        doomed = ms.prune_candidates(parent, 2, in_use.InUse([str(tmp_path / "r1")]))
        # r1 is in use and counts toward the two kept; r4 is the newest of the rest
        assert doomed == ["r2", "r3"]
        assert ms.prune_candidates(parent, 10, in_use.InUse([])) == []


def test_prune_removes_old_revisions_after_staging_and_keeps_the_one_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = tmp_path / "models" / "llama"
    _staged(parent, "rev-0", 1.0)
    _staged(parent, "rev-old", 2.0)
    monkeypatch.setattr(mod, "process_references", lambda: [str(parent / "rev-0")])
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)
    result = stage(_params(tmp_path, source, keep=2), False, FakeRsync())
    assert result["pruned"] == [str(parent / "rev-old")]
    assert (parent / "rev-0").exists() and (parent / "rev-a").exists()


def _process(proc: Path, pid: str, argv: list[str], cwd: Path | None = None) -> None:
    (proc / pid).mkdir(parents=True)
    (proc / pid / "cmdline").write_bytes(b"\x00".join(a.encode() for a in argv) + b"\x00")
    if cwd is not None:
        (proc / pid / "cwd").symlink_to(cwd)


def test_process_references_read_running_processes(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _process(proc, "10", ["python", "--model-path", "/m/a"])
    _process(proc, "11", ["x", "--model-path=/m/b"])
    _process(proc, "12", ["python", "--model", "rev-c"], cwd=tmp_path / "models")
    (proc / "self").mkdir()
    found = in_use.process_references(str(proc))
    assert {"/m/a", "/m/b", str(tmp_path / "models" / "rev-c")} <= set(found)


def test_rsync_argv_is_resumable_bounded_and_ends_options_before_paths(tmp_path: Path) -> None:
    params = _params(tmp_path, tmp_path, bwlimit_kbps=250000, ssh_command="ssh -i /k")
    argv = mod.rsync_argv(params, "store:/ckpt/", "/models/x.partial/")
    assert "--partial-dir=.rsync-partial" in argv and "--bwlimit=250000" in argv
    assert argv[argv.index("-e") + 1] == "ssh -i /k"
    assert argv[-3:] == ["--", "store:/ckpt/", "/models/x.partial/"]


def test_a_failed_copy_names_the_source_and_rsync_s_error(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)

    def broken(argv: list[str], **kwargs: Any) -> SimpleNamespace:
        return SimpleNamespace(returncode=23, stderr="rsync: link_stat failed: No such file")

    with pytest.raises(mod.StageError, match=r"exit 23\): rsync: link_stat failed"):
        stage(_params(tmp_path, source), False, broken)


FAKE_HUB = """
import json, os, shutil, sys
SOURCE = os.environ["FAKE_HUB_SOURCE"]
def _record(kind, **kw):
    with open(os.environ["FAKE_HUB_LOG"], "a") as log:
        log.write(json.dumps({"kind": kind, "argv": sys.argv, "token": os.environ.get("HF_TOKEN"),
                              "endpoint": os.environ.get("HF_ENDPOINT"), **kw}) + "\\n")
def hf_hub_download(repo_id, revision, filename, local_dir):
    _record("file", repo=repo_id, revision=revision)
    os.makedirs(local_dir, exist_ok=True)
    shutil.copy(os.path.join(SOURCE, filename), os.path.join(local_dir, filename))
def snapshot_download(repo_id, revision, local_dir):
    _record("snapshot", repo=repo_id, revision=revision)
    for name in os.listdir(SOURCE):
        shutil.copy(os.path.join(SOURCE, name), os.path.join(local_dir, name))
"""


def test_the_hugging_face_path_passes_token_and_endpoint_in_the_environment_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _checkpoint(tmp_path / "hub" / "org--llama", FILES)
    fake = tmp_path / "fake"
    (fake / "huggingface_hub").mkdir(parents=True)
    (fake / "huggingface_hub" / "__init__.py").write_text(FAKE_HUB)
    log = tmp_path / "hub.log"
    monkeypatch.setenv("PYTHONPATH", str(fake))
    monkeypatch.setenv("FAKE_HUB_SOURCE", str(source))
    monkeypatch.setenv("FAKE_HUB_LOG", str(log))
    seen: list[list[str]] = []

    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.append(argv)
        return subprocess.run(argv, **kwargs)  # noqa: PLW1510 - check is in kwargs

    revision = "0123456789abcdef0123456789abcdef01234567"
    params = _params(
        tmp_path,
        source,
        hf_python=sys.executable,
        hf_endpoint="http://127.0.0.1:9/mirror",
        hf_token="hf_secret_token",
    )
    params["source"] = {"hf_repo": "org/llama", "revision": revision}
    result = stage(params, False, run)
    assert result["changed"] is True
    assert Path(params["path"], "model.safetensors").read_bytes() == FILES["model.safetensors"]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["kind"] for c in calls] == ["file", "snapshot"]
    assert all(c["token"] == "hf_secret_token" for c in calls)
    assert all(c["endpoint"] == "http://127.0.0.1:9/mirror" for c in calls)
    assert all(c["revision"] == revision for c in calls)
    assert not any("hf_secret_token" in " ".join(argv) for argv in seen)
    marker = json.loads(Path(params["path"], ms.MARKER).read_text())
    assert marker["source"] == "hf:org/llama"


def test_the_module_declares_the_token_no_log() -> None:
    text = Path(mod.__file__).read_text()
    assert '"hf_token": {"type": "str", "no_log": True}' in text
    assert os.path.basename(mod.__file__) == "model_stage.py"
