"""The double follows the SGLang installed beside it: version, flag table, and the
`sglang_version_slowdown` knob that makes one version slow (gpusim/README.md, "Versions").

An installed SGLang is faked the way a `--no-deps` wheel leaves it for importlib.metadata: a
`sglang-<version>.dist-info/METADATA` on the path (in-process: sys.path; servers: PYTHONPATH).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from gpusim.engine import AttentionDPSchedulers, Request, Scheduler
from gpusim.flags import (
    NoFlagTable,
    flag_table_json,
    parse_server_args,
    table_versions,
    using_generated_table,
)
from gpusim.memory import GIB, MemoryArgs, MemoryPlan, plan_memory
from gpusim.model import load_model
from gpusim.sglang_server import Launcher
from gpusim.state import Hardware, HardwareFileError, Timing, load_hardware, save_hardware
from gpusim.version import installed_sglang_version, public_version
from gpusim_helpers import GPUSIM_SRC, LLAMA, Server, start_server

from gpusim import SGLANG_VERSION, flags

TABLES = GPUSIM_SRC / "gpusim" / "flags"
# Flags the two tables disagree on (README, "Versions"): removed in 0.5.23, and an alias of
# --enable-hierarchical-cache that 0.5.23 added.
ONLY_0_5_22 = "--speculative-skip-dp-mlp-sync"
ONLY_0_5_23 = "--enable-hicache"
GPU_MIB = 97887
TIMING = Timing(decode_step_s=0.05, batch_slowdown=0.01, prefill_token_s=0.00002)


def fake_sglang(folder: Path, version: str) -> Path:
    """A path entry holding an installed `sglang` distribution's metadata, and nothing else."""
    info = folder / f"sglang-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n", encoding="utf-8"
    )
    return folder


def unrecognized(argv: list[str], version: str, capsys: pytest.CaptureFixture[str]) -> str:
    """argparse's error for argv under that version's table (which must refuse it)."""
    with pytest.raises(SystemExit) as info:
        parse_server_args(argv, version)
    assert info.value.code == 2
    return capsys.readouterr().err


# -- the version --------------------------------------------------------------------------------


def test_version_is_the_installed_sglang_distributions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(fake_sglang(tmp_path, "0.5.22")))
    assert installed_sglang_version() == "0.5.22"


def test_a_local_label_is_reported_and_only_the_table_drops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(fake_sglang(tmp_path, "0.5.23+regressed")))
    assert installed_sglang_version() == "0.5.23+regressed"
    assert public_version("0.5.23+regressed") == "0.5.23"
    assert public_version("0.5.22") == "0.5.22"


def test_without_an_sglang_distribution_the_pinned_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[str] = []

    def not_installed(name: str) -> str:
        asked.append(name)
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert installed_sglang_version() == SGLANG_VERSION == "0.5.23"
    assert asked == ["sglang"]


# -- the flag table per version -----------------------------------------------------------------


def test_each_table_was_dumped_from_its_own_version() -> None:
    assert {"0.5.22", "0.5.23"} <= set(table_versions())
    for version in table_versions():
        table = json.loads((TABLES / f"sglang-{version}.json").read_text(encoding="utf-8"))
        assert table["sglang_version"] == version


def test_0_5_22_parses_with_its_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_server_args(["--model-path", LLAMA, ONLY_0_5_22], "0.5.22")
    assert args.speculative_skip_dp_mlp_sync is True
    err = unrecognized(["--model-path", LLAMA, ONLY_0_5_23], "0.5.22", capsys)
    assert err.rstrip().endswith(f"error: unrecognized arguments: {ONLY_0_5_23}")


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23+regressed"])
def test_0_5_23_and_its_local_labels_parse_with_0_5_23s_flags(
    version: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse_server_args(["--model-path", LLAMA, ONLY_0_5_23], version)
    assert args.enable_hierarchical_cache is True
    err = unrecognized(["--model-path", LLAMA, ONLY_0_5_22], version, capsys)
    assert err.rstrip().endswith(f"error: unrecognized arguments: {ONLY_0_5_22}")


def test_the_table_follows_the_installed_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(fake_sglang(tmp_path, "0.5.22")))
    assert parse_server_args(["--model-path", LLAMA, ONLY_0_5_22]).speculative_skip_dp_mlp_sync


@pytest.mark.parametrize("argv", [["--help"], ["--model-path", LLAMA]])
def test_a_version_without_a_table_is_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_server_args(argv, "0.5.99+local")
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == ""  # --help printed nothing
    assert err.startswith("usage: sglang serve")
    assert (
        "sglang serve: error: gpusim has no flag table for the installed sglang 0.5.99+local "
        "(public version 0.5.99): no flags/sglang-0.5.99.json in the gpusim package, which has "
        f"tables for: {', '.join(table_versions())}."
    ) in err


def test_the_hand_table_serves_only_the_pinned_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A package without 0.5.23's file falls back to the hand table, as before; no other
    version falls back to anything."""
    shutil.copy(TABLES / "sglang-0.5.22.json", tmp_path)
    monkeypatch.setattr(flags, "tables_dir", lambda: tmp_path)
    assert table_versions() == ["0.5.22"]
    assert flag_table_json("0.5.23") is None
    assert not using_generated_table("0.5.23+regressed")
    assert using_generated_table("0.5.22")
    with pytest.raises(NoFlagTable, match=re.escape("which has tables for: 0.5.22.")):
        flag_table_json("0.5.21")
    # The hand table holds this project's flags only: --attention-backend is the real table's.
    assert parse_server_args(["--model-path", LLAMA, "--tp-size", "2"], "0.5.23").tp_size == 2
    unrecognized(["--model-path", LLAMA, "--attention-backend", "fa3"], "0.5.23", capsys)


def load_dumper() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "dump_sglang_flags", GPUSIM_SRC / "tools" / "dump_sglang_flags.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dumper_records_the_version_of_the_sglang_it_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `sglang` distributions on the path: the table is the imported package's, whatever
    importlib.metadata.version finds first (here a metadata-only one)."""
    metadata_only = fake_sglang(tmp_path / "metadata-only", "0.5.22")
    real = fake_sglang(tmp_path / "real", "0.5.23")
    (real / "sglang").mkdir()
    (real / "sglang" / "__init__.py").write_text("", encoding="utf-8")
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    monkeypatch.syspath_prepend(str(real))
    monkeypatch.syspath_prepend(str(metadata_only))
    assert metadata.version("sglang") == "0.5.22"
    monkeypatch.setenv("COLUMNS", "80")  # dump() sets it (argparse's usage width)
    table = load_dumper().dump(argparse.ArgumentParser(prog="sglang serve"))
    assert table["sglang_version"] == "0.5.23"


# -- the slowdown knob: hardware.yaml -----------------------------------------------------------


def test_slowdown_is_read_per_exact_version(tmp_path: Path) -> None:
    (tmp_path / "hardware.yaml").write_text(
        # As Ansible's to_nice_yaml writes gpusim_hardware: version keys unquoted.
        "gpu_count: 8\nsglang_version_slowdown:\n  0.5.23+regressed: 2\n  0.5.22: 1.25\n",
        encoding="utf-8",
    )
    hardware = load_hardware(tmp_path)
    assert hardware.sglang_version_slowdown == {"0.5.23+regressed": 2.0, "0.5.22": 1.25}
    assert hardware.slowdown_for("0.5.23+regressed") == 2.0
    assert hardware.slowdown_for("0.5.23") == 1.0  # the exact string, not the public part
    save_hardware(hardware, tmp_path)
    assert load_hardware(tmp_path) == hardware
    assert Hardware().slowdown_for("0.5.23") == 1.0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"0.5.23": 0.5}, "sglang_version_slowdown['0.5.23'] must be a number >= 1.0"),
        ({"0.5.23": 0}, "sglang_version_slowdown['0.5.23'] must be a number >= 1.0"),
        ({"0.5.23": "2.0"}, "sglang_version_slowdown['0.5.23'] must be a number >= 1.0"),
        ({"0.5.23": True}, "sglang_version_slowdown['0.5.23'] must be a number >= 1.0"),
        ({"0.5.23": None}, "sglang_version_slowdown['0.5.23'] must be a number >= 1.0"),
        ({"0.5.23": math.nan}, "sglang_version_slowdown['0.5.23'] must be a number >= 1.0"),
        ({"0.5.23": math.inf}, "sglang_version_slowdown['0.5.23'] must be a number >= 1.0"),
        ({0.5: 2.0}, "sglang_version_slowdown keys must be sglang version strings"),
        ([2.0], "sglang_version_slowdown must be a mapping of sglang version to a factor"),
        (2.0, "sglang_version_slowdown must be a mapping of sglang version to a factor"),
    ],
)
def test_a_bad_slowdown_is_refused_naming_the_key(value: object, message: str) -> None:
    with pytest.raises(HardwareFileError, match=re.escape(message)):
        Hardware.from_dict({"sglang_version_slowdown": value})


def test_a_bad_slowdown_in_the_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "hardware.yaml"
    path.write_text("sglang_version_slowdown:\n  0.5.23+regressed: 0.9\n", encoding="utf-8")
    expected = f"{path}: sglang_version_slowdown['0.5.23+regressed'] must be a number >= 1.0"
    with pytest.raises(HardwareFileError, match=re.escape(expected)):
        load_hardware(tmp_path)


# -- the slowdown knob: the scheduler's times ---------------------------------------------------


def llama_plan() -> MemoryPlan:
    return plan_memory(load_model(LLAMA), MemoryArgs(), GPU_MIB, [GPU_MIB], 400 * GIB)


def test_the_factor_multiplies_decode_and_prefill_times() -> None:
    plan = llama_plan()
    base = Scheduler(plan, TIMING, realtime=False)
    slow = Scheduler(plan, TIMING, realtime=False, version_slowdown=2.5)
    assert base.decode_step_seconds(1) == pytest.approx(0.05)
    assert base.decode_step_seconds(10) == pytest.approx(0.05 * 1.09)
    assert slow.decode_step_seconds(1) == pytest.approx(2.5 * 0.05)
    assert slow.decode_step_seconds(10) == pytest.approx(2.5 * 0.05 * 1.09)
    assert base.prefill_seconds(1000) == pytest.approx(0.02)
    assert slow.prefill_seconds(1000) == pytest.approx(2.5 * 0.02)
    # Attention DP's own factor and the version's compose.
    both = Scheduler(plan, TIMING, realtime=False, step_factor=1.5, version_slowdown=2.0)
    assert both.decode_step_seconds(1) == pytest.approx(1.5 * 2.0 * 0.05)


async def simulated_seconds(scheduler: Scheduler, requests: int) -> tuple[float, int]:
    """Run `requests` generations to the end on simulated time: (seconds, tokens)."""
    task = asyncio.create_task(scheduler.run())
    batch = [Request(rid=f"r{i}", prompt_tokens=500, max_new_tokens=64) for i in range(requests)]
    for req in batch:
        scheduler.submit(req)
    while not all(req.finished for req in batch):
        await asyncio.sleep(0)
    task.cancel()
    return scheduler.sim_time, scheduler.stats.generation_tokens_total


def test_the_factor_divides_simulated_throughput() -> None:
    plan = llama_plan()

    def run(factor: float) -> tuple[float, int]:
        scheduler = Scheduler(plan, TIMING, realtime=False, version_slowdown=factor)
        return asyncio.run(asyncio.wait_for(simulated_seconds(scheduler, 20), 30))

    (base_s, base_tokens), (slow_s, slow_tokens) = run(1.0), run(2.0)
    assert base_tokens == slow_tokens == 20 * 64
    assert base_s > 0
    assert slow_s == pytest.approx(2.0 * base_s)


def write_slowdown(root: Path, slowdown: dict[str, float]) -> None:
    path = root / "hardware.yaml"
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data["sglang_version_slowdown"] = slowdown
    path.write_text(yaml.safe_dump(data), encoding="utf-8")


@pytest.mark.parametrize(
    ("version", "factor"), [("0.5.23+regressed", 2.0), ("0.5.22", 1.5), ("0.5.23", 1.0)]
)
def test_the_launcher_gives_its_schedulers_the_installed_versions_factor(
    state_dir: Path, version: str, factor: float
) -> None:
    write_slowdown(state_dir, {"0.5.23+regressed": 2.0, "0.5.22": 1.5})
    plan = llama_plan()
    args = parse_server_args(["--model-path", LLAMA], version)
    scheduler = Launcher(args, [], version)._scheduler(plan)
    assert isinstance(scheduler, Scheduler) and scheduler.version_slowdown == factor
    dp_args = parse_server_args(
        ["--model-path", LLAMA, "--tp-size", "2", "--attn-dp-size", "2"], version
    )
    ranks = Launcher(dp_args, [], version)._scheduler(plan)
    assert isinstance(ranks, AttentionDPSchedulers)
    assert [rank.version_slowdown for rank in ranks.ranks] == [factor, factor]


# -- the server process -------------------------------------------------------------------------


def start_with_sglang(
    root: Path, tmp_path: Path, servers: list[Server], version: str, *flags: str
) -> Server:
    """A server whose environment has sglang `version` installed; stopped when the test ends
    (with its ranks, should it start where the test expects it to fail)."""
    site = fake_sglang(tmp_path / "site", version)
    pythonpath = os.pathsep.join([str(site), str(GPUSIM_SRC)])
    server = start_server(root, tmp_path, "--model-path", LLAMA, *flags, PYTHONPATH=pythonpath)
    servers.append(server)
    return server


def exit_code(server: Server) -> int:
    try:
        return server.proc.wait(60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server did not exit:\n{server.log()}") from None


@pytest.mark.slow
def test_server_reports_and_logs_the_installed_version(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    write_slowdown(state_dir, {"0.5.22": 2.0})
    flags = ("--skip-server-warmup", "--log-level", "warning")
    server = start_with_sglang(state_dir, tmp_path, servers, "0.5.22", *flags)
    server.wait_ready()
    with urllib.request.urlopen(server.url + "/server_info", timeout=10) as response:
        assert json.load(response)["version"] == "0.5.22"
    # A warning: shown even at --log-level warning.
    assert (
        "] gpusim: sglang 0.5.22 (the installed sglang distribution); hardware.yaml "
        "sglang_version_slowdown for 0.5.22: decode and prefill are simulated 2x slower"
    ) in server.log()


@pytest.mark.slow
def test_server_start_up_refuses_a_version_without_a_table(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    server = start_with_sglang(state_dir, tmp_path, servers, "0.5.99")
    assert exit_code(server) == 2
    assert "sglang serve: error: gpusim has no flag table for the installed sglang 0.5.99" in (
        server.log()
    )


@pytest.mark.slow
def test_server_start_up_refuses_a_bad_slowdown(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    write_slowdown(state_dir, {"0.5.22": 0.5})
    server = start_with_sglang(state_dir, tmp_path, servers, "0.5.22")
    assert exit_code(server) == 1
    log = server.log()
    assert "Traceback (most recent call last):" in log
    assert (
        f"ValueError: {state_dir / 'hardware.yaml'}: sglang_version_slowdown['0.5.22'] must be "
        "a number >= 1.0"
    ) in log
