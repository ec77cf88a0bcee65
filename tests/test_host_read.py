"""plugins/module_utils/host_read.py: what a pre-flight reads on a host, in one module run, bounded.

Real files in a temporary folder, the real interpreter, the real /proc (a socket this test
listens on): a model folder gives its config and weights' bytes from the index or from its
single checkpoint; files are read as text or None, never through a symlink, never past the
size bound, never a FIFO (which would block); the port's holder is this process, not ours by
the cleanup's rules; a missing service user owns nothing.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import sys
from pathlib import Path

import pytest
from conftest import load_plugin

host_read = load_plugin("plugins/module_utils/host_read.py")
ME = pwd.getpwuid(os.getuid()).pw_name


def test_a_model_folder_gives_its_config_and_weights(tmp_path: Path) -> None:
    indexed = tmp_path / "indexed"
    indexed.mkdir()
    (indexed / "config.json").write_text('{"hidden_size": 8}')
    (indexed / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 123456}})
    )
    single = tmp_path / "single"
    single.mkdir()
    (single / "config.json").write_text("{}")
    (single / "model.safetensors").write_bytes(b"x" * 1000)
    found = host_read.read({"models": [str(indexed), str(single), str(tmp_path / "none")]}, 5)
    models = found["models"]
    assert models[str(indexed)] == {"config": '{"hidden_size": 8}', "weight_bytes": 123456,
                                    "error": None}  # fmt: skip
    assert models[str(single)]["weight_bytes"] == 1000
    assert models[str(tmp_path / "none")]["config"] is None


def test_files_are_bounded_regular_and_never_followed(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "store.json").write_text('{"records": []}')
    (tmp_path / "link.json").symlink_to(tmp_path / "store.json")
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "big.json").write_bytes(b"x" * 64)
    monkeypatch.setattr(host_read, "MAX_FILE_BYTES", 32)
    paths = [str(tmp_path / n) for n in ("store.json", "missing.json", "link.json",
                                        "fifo.json", "big.json")]  # fmt: skip
    files = host_read.read({"files": paths}, 5)["files"]
    assert files[paths[0]] == '{"records": []}'
    assert files[paths[1]] is None
    assert "error" in files[paths[2]]  # a symlink is not followed
    assert "not a regular file" in files[paths[3]]["error"]
    assert "over 32 bytes" in files[paths[4]]["error"]


def test_the_hosts_ram_is_read_like_the_memtotal_fact() -> None:
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        kib = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1])
    assert host_read.read({}, 5)["mem_total_mib"] == kib // 1024


def test_the_interpreter_and_the_service_user() -> None:
    found = host_read.read({"python": sys.executable, "user": "no-such-user-x"}, 30)
    assert found["python_exists"] is True
    assert found["user_exists"] is False
    missing = host_read.read({"python": "/nonexistent/python"}, 5)
    assert missing == {**missing, "python_exists": False, "sglang_version": None}
    unasked = host_read.read({"python": sys.executable, "version": False}, 5)
    assert unasked["python_exists"] is True and "sglang_version" not in unasked


def test_the_ports_holder_is_classified_by_the_cleanup_rules() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        ours = {
            "units": ["sglang@x.service"],
            "process_titles": ["sglang::"],
            "launch_modules": ["sglang.launch_server"],
            "ports": [port],
            "users": [ME],
        }
        holders = host_read.read({"ports": [{"label": "x", "ours": ours}]}, 5)["port_holders"]
    [holder] = holders["x"]
    assert holder["pid"] == os.getpid() and holder["ports"] == [port]
    assert holder["ours"] is False  # a port alone makes nothing ours
    assert holder["reasons"], holder


@pytest.mark.parametrize("nvidia_smi", ["/nonexistent/nvidia-smi"])
def test_gpus_that_cannot_be_read_say_why(nvidia_smi: str) -> None:
    found = host_read.read({"nvidia_smi": nvidia_smi}, 5)
    assert "nvidia-smi not found" in found["gpus"]["error"]
