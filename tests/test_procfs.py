"""Tests for plugins/module_utils/procfs.py, the /proc reader that the gpu_cleanup module (on GPU
hosts) and the fleet_lock action plugin (on the controller) share. Samples in tests/fixtures/proc/
(sources in SOURCES.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_plugin

procfs = load_plugin("plugins/module_utils/procfs.py")

PROC_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "proc"


def proc_fixture(name: str) -> str:
    return (PROC_FIXTURES / name).read_text(encoding="utf-8")


def test_parse_stat_with_parentheses_in_the_name() -> None:
    stat = "4242 (sglang::sch) (x)) S 1 4230 4230 0 -1 4194560 " + " ".join(["0"] * 12) + " 777 0"
    assert procfs.parse_stat(stat) == ("S", 1, 4230, 777)


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("0::/system.slice/sglang-kimi.service\n", "/system.slice/sglang-kimi.service"),
        (
            "12:pids:/system.slice/sglang.service\n"
            "4:memory:/system.slice/sglang.service\n"
            "1:name=systemd:/system.slice/sglang.service\n",
            "/system.slice/sglang.service",
        ),
        # hybrid layout as on the machine that wrote these tests
        ("9:name=systemd:/user.slice/user-1000.slice/session-3.scope\n8:pids:/\n0::/\n", None),
    ],
)
def test_parse_cgroup_v1_v2_hybrid(text: str, path: str | None) -> None:
    expected = path or "/user.slice/user-1000.slice/session-3.scope"
    assert procfs.parse_cgroup(text) == expected


@pytest.mark.parametrize(
    ("name", "uids"),
    [
        ("root", (0, 0)),
        ("nobody", (65534, 65534)),
        # setresuid(0, 65534, 0): real root, effective nobody
        ("real_root_effective_nobody", (0, 65534)),
    ],
)
def test_parse_status_uids_real_and_effective(name: str, uids: tuple[int, int]) -> None:
    assert procfs.parse_status_uids(proc_fixture(f"status/{name}.txt")) == uids


def test_parse_stat_survives_odd_process_names() -> None:
    line = "123 (a) b (c)) S 45 123 123 0 -1 4194560 " + " ".join(["0"] * 12) + " 98765 0"
    assert procfs.parse_stat(line) == ("S", 45, 123, 98765)
