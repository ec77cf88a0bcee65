"""Weight staging never acts outside what it owns and never ends in a traceback (issue 33;
docs/STAGING.md, "Files on the host" and "What pruning keeps"). Each test is an example of the
issue: verification removing a file through a linked folder of the source, pruning a revision
still in use (a relative --model-path, the --model alias, a stopped server's last-known-good),
a failing file named `model: x.safetensors`, a source file that is a FIFO, and the inputs and
host states that used to end the module in an uncaught exception."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import load_plugin, module_argv
from test_model_stage import FILES, FakeRsync, _checkpoint, _params, _process, _staged

mod = load_plugin("plugins/modules/model_stage.py")
ms = load_plugin("plugins/module_utils/model_stage.py")


def _manifest(folder: Path, files: dict[str, bytes]) -> None:
    entries = {
        name: {"sha256": hashlib.sha256(content).hexdigest(), "size": len(content)}
        for name, content in files.items()
    }
    (folder / "model.sha256.json").write_text(json.dumps({"files": entries}))


def _run(params: dict[str, Any], run: Any = None) -> dict[str, Any]:
    """The module as main() runs it: a result or {failed, msg}, never an exception."""
    return mod.run_module(params, False, run or FakeRsync())


@pytest.fixture(autouse=True)
def _no_host_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mod, "process_references", list)


# ------------------------------------------------------------------ removal stays inside


def test_a_failed_file_behind_a_linked_folder_of_the_source_is_never_removed(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "etc"
    outside.mkdir()
    victim = outside / "weights.safetensors"
    victim.write_bytes(b"operator's file")
    source = _checkpoint(tmp_path / "shared" / "rev-a", {"config.json": b"{}"})
    (source / "sub").symlink_to(outside)  # rsync --links copies the link as a link
    _manifest(
        source, {"config.json": b"{}", "sub/weights.safetensors": b"x" * len(b"operator's file")}
    )
    params = _params(tmp_path, source)
    result = _run(params)
    assert result["failed"] is True
    assert "sub/weights.safetensors" in result["msg"] and "symbolic link" in result["msg"]
    assert victim.read_bytes() == b"operator's file"
    assert not Path(params["path"]).exists()


def test_a_failing_file_named_model_colon_x_removes_only_itself(tmp_path: Path) -> None:
    good, bad = b"good weights", b"bad weights!"
    source = _checkpoint(
        tmp_path / "shared" / "rev-a", {"model": good, "model: x.safetensors": bad}
    )
    _manifest(source, {"model": good, "model: x.safetensors": b"other bytes!"})
    params = _params(tmp_path, source)
    result = _run(params)
    assert result["failed"] is True and "model: x.safetensors: sha256" in result["msg"]
    partial = Path(params["path"] + ".partial")
    assert (partial / "model").read_bytes() == good
    assert not (partial / "model: x.safetensors").exists()


def test_the_marker_is_never_written_through_a_link_the_source_carries(tmp_path: Path) -> None:
    outside = tmp_path / "shadow"
    outside.write_bytes(b"secret line\n")
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)
    (source / ms.MARKER).symlink_to(outside)
    params = _params(tmp_path, source)
    assert _run(params)["changed"] is True
    assert outside.read_bytes() == b"secret line\n"
    marker = Path(params["path"], ms.MARKER)
    assert not marker.is_symlink() and json.loads(marker.read_text())["revision"] == "rev-a"


# ------------------------------------------------------------------ bounded readers


def test_a_source_file_that_is_a_fifo_fails_verification_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    source = _checkpoint(tmp_path / "shared" / "rev-a", {"config.json": b"{}"})
    (source / "model.safetensors").symlink_to(fifo)
    _manifest(source, {"config.json": b"{}", "model.safetensors": b""})
    params = _params(tmp_path, source)
    done: list[dict[str, Any]] = []
    worker = threading.Thread(target=lambda: done.append(_run(params)), daemon=True)
    worker.start()
    worker.join(20)
    if not done:  # the old code waits on the FIFO: give it a writer so the thread can end
        with open(fifo, "wb"):
            pass
    assert done, "staging hung on a FIFO"
    assert done[0]["failed"] is True and "model.safetensors: a symbolic link" in done[0]["msg"]


# ------------------------------------------------------------------ pruning keeps what is in use


def _stage_with_old_revisions(tmp_path: Path, **extra: Any) -> tuple[Path, dict[str, Any]]:
    parent = tmp_path / "models" / "llama"
    _staged(parent, "rev-0", 1.0)
    _staged(parent, "rev-1", 2.0)
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)
    return parent, _params(tmp_path, source, keep=1, **extra)


@pytest.mark.parametrize(
    "argv",
    [
        ["python3", "-m", "sglang.launch_server", "--model-path", "rev-0"],
        ["python3", "-m", "sglang.launch_server", "--model", "rev-0"],
        ["python3", "-m", "sglang.launch_server", "--model-pa=rev-0"],
    ],
    ids=["relative-model-path", "model-alias", "abbreviation"],
)
def test_pruning_keeps_what_a_process_loads_however_it_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    parent, params = _stage_with_old_revisions(tmp_path)
    proc = tmp_path / "proc"
    _process(proc, "4242", argv, cwd=parent)
    refs = load_plugin("plugins/module_utils/model_in_use.py")
    monkeypatch.setattr(mod, "process_references", lambda: refs.process_references(str(proc)))
    result = _run(params)
    assert (parent / "rev-0").is_dir(), result
    assert result["pruned"] == [str(parent / "rev-1")]


def test_pruning_keeps_a_revision_a_process_reaches_through_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent, params = _stage_with_old_revisions(tmp_path)
    (tmp_path / "current").symlink_to(parent / "rev-0")
    monkeypatch.setattr(mod, "process_references", lambda: [str(tmp_path / "current")])
    _run(params)
    assert (parent / "rev-0").is_dir() and not (parent / "rev-1").exists()


def test_pruning_keeps_the_last_known_good_revision_of_a_stopped_server(tmp_path: Path) -> None:
    parent, params = _stage_with_old_revisions(tmp_path)
    lkg = tmp_path / "state" / "kimi" / "lkg"
    lkg.mkdir(parents=True)
    record = {"server": "kimi", "flags": {"model_path": str(parent / "rev-0"), "tp_size": 8}}
    (lkg / "meta.json").write_text(json.dumps(record))
    result = _run(params)
    assert (parent / "rev-0").is_dir(), result
    assert result["pruned"] == [str(parent / "rev-1")]


def test_pruning_keeps_what_a_server_s_drop_in_loads(tmp_path: Path) -> None:
    parent, params = _stage_with_old_revisions(tmp_path)
    dropin = tmp_path / "systemd" / "sglang@old.service.d"
    dropin.mkdir(parents=True)
    (dropin / "10-launch.conf").write_text(
        "[Service]\nExecStart=\nExecStart=/opt/ml-env/bin/python3 -m sglang.launch_server "
        f'--model-path "{parent / "rev-0"}" --port 8000\n'
    )
    _run(params)
    assert (parent / "rev-0").is_dir() and not (parent / "rev-1").exists()


def test_an_unreadable_record_stops_pruning_with_a_warning(tmp_path: Path) -> None:
    parent, params = _stage_with_old_revisions(tmp_path)
    lkg = tmp_path / "state" / "kimi" / "lkg"
    lkg.mkdir(parents=True)
    (lkg / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    result = _run(params)
    assert result["pruned"] == [] and "meta.json cannot be read" in result["prune_skipped"]
    assert (parent / "rev-0").is_dir() and (parent / "rev-1").is_dir()


# ------------------------------------------------------------------ clean failures


def test_a_folder_named_in_the_manifest_is_a_clean_failure(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)
    (source / "shards").mkdir()
    _manifest(source, {**FILES, "shards": b""})
    result = _run(_params(tmp_path, source))
    assert result["failed"] is True and "shards: a folder, not a file" in result["msg"]


def test_a_deeply_nested_manifest_is_a_clean_failure(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)
    (source / "model.sha256.json").write_text('{"files": ' + "[" * 50_000 + "]" * 50_000 + "}")
    result = _run(_params(tmp_path, source))
    assert result["failed"] is True
    assert "the manifest model.sha256.json cannot be read" in result["msg"]
    assert "nested deeper" in result["msg"]


def test_a_leftover_partial_file_is_a_clean_failure_and_stays(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)
    params = _params(tmp_path, source)
    leftover = Path(params["path"] + ".partial")
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"not a folder")
    result = _run(params)
    assert result["failed"] is True
    assert f"{leftover} exists and is not a folder" in result["msg"]
    assert leftover.read_bytes() == b"not a folder"


def test_a_missing_rsync_is_a_clean_failure(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)

    def no_rsync(argv: list[str], **kwargs: Any) -> Any:
        raise FileNotFoundError(2, "No such file or directory", argv[0])

    result = _run(_params(tmp_path, source), no_rsync)
    assert result["failed"] is True
    assert "cannot run rsync" in result["msg"] and "model_stage_install_rsync" in result["msg"]


def test_a_missing_hf_python_is_a_clean_failure(tmp_path: Path) -> None:
    params = _params(tmp_path, tmp_path, hf_python=str(tmp_path / "no-venv" / "bin" / "python"))
    params["source"] = {"hf_repo": "org/llama", "revision": "0" * 40}
    result = mod.run_module(params, False)
    assert result["failed"] is True
    assert "no-venv/bin/python" in result["msg"] and "model_stage_hf_python" in result["msg"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"path": "/models/llama/rev-a\nExecStart=/bin/sh"}, "path: holds a control character"),
        ({"path": "/models/llama/rev\x00a"}, "path: holds a control character"),
        ({"path": "/"}, "path: '/'"),
        ({"path": "/rev-a"}, "a folder of its revisions"),
        ({"path": "/models/../etc/rev-a"}, "'..'"),
        ({"source": {"rsync": "rsync://store/models/rev-a", "revision": "r"}}, "source.rsync"),
        ({"source": {"rsync": "store::models/rev-a", "revision": "r"}}, "source.rsync"),
        ({"source": {"rsync": "/", "revision": "r"}}, "source.rsync"),
        ({"source": {"rsync": "store:/", "revision": "r"}}, "source.rsync"),
        ({"bwlimit_kbps": -5}, "bwlimit_kbps: must be an integer from 0 to 1099511627776, got -5"),
        ({"keep": 0}, "keep: must be an integer from 1 to 1000, got 0"),
        ({"verify_workers": 0}, "verify_workers: must be an integer from 1 to 64, got 0"),
        ({"free_margin_bytes": -1}, "free_margin_bytes: must be an integer from 0 to"),
        (
            {"free_margin_bytes": 10**400},
            "free_margin_bytes: must be an integer from 0 to 1152921504606846976, "
            "got a 401-digit integer",
        ),
        (
            {"verify_workers": "9" * 5000},
            "verify_workers: must be an integer from 1 to 64, got 5000",
        ),
        ({"ssh_command": "-oProxyCommand=sh"}, "ssh_command"),
        ({"manifest_name": "../m.json"}, "manifest_name"),
    ],
)
def test_bad_input_is_refused_naming_it_before_anything_is_touched(
    tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    source = _checkpoint(tmp_path / "shared" / "rev-a", FILES)
    params = {**_params(tmp_path, source), **change}
    if "source" in change and change["source"].get("rsync") == "/":
        params["path"] = str(tmp_path / "models" / "llama" / "rev-a")
    rsync = FakeRsync()
    result = _run(params, rsync)
    assert result["failed"] is True and named in result["msg"], result["msg"]
    assert rsync.calls == []
    assert not (tmp_path / "models").exists()


def test_the_module_as_ansible_runs_it_fails_cleanly_and_keeps_the_token_out(
    tmp_path: Path,
) -> None:
    args = {
        "path": "/",
        "source": {"hf_repo": "org/llama", "revision": "0" * 40},
        "hf_token": "hf_not_to_be_shown",
    }
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    done = subprocess.run(
        module_argv("plugins/modules/model_stage.py", str(args_file)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    result = json.loads(done.stdout)
    assert result["failed"] is True and result["msg"].startswith("model_stage: path: '/'")
    assert "Traceback" not in done.stdout + done.stderr
    assert "hf_not_to_be_shown" not in done.stdout + done.stderr
