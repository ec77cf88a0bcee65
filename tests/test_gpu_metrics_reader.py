"""The nvidia-smi textfile reader (roles/monitoring/files/sglang-fleet-gpu-metrics.py) is never
a blind alarm.

Before, it split nvidia-smi's CSV itself: a legal but unusual process path (a comma, a quote)
crashed it before it wrote, and the node exporter kept serving the last reading with scrape
success 1, so neither GPUMemoryHeldWithoutServer nor GPUMetricsFailing could fire. Now the
project's nvidia-smi parser reads it (a comma in a path is taken from the outside in), and any
failure writes scrape success 0 over the old values. Run as the timer runs it: a process of its
own, against a fake nvidia-smi, both with the control node's package and alone with the parser
copied beside it (as on a GPU host).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
READER = ROOT / "roles" / "monitoring" / "files" / "sglang-fleet-gpu-metrics.py"
PARSER = ROOT / "plugins" / "module_utils" / "nvidia_smi.py"
GPUS = [
    {"index": "0", "uuid": "GPU-0", "memory.used": "60000", "memory.total": "97887",
     "utilization.gpu": "87"},
    {"index": "1", "uuid": "GPU-1", "memory.used": "20000", "memory.total": "97887",
     "utilization.gpu": "[N/A]"},
]  # fmt: skip
STALE = 'sglang_fleet_gpu_scrape_success 1\nsglang_fleet_gpu_unowned_memory_mib{gpu="0"} 0\n'
# nvidia-smi's CSV as it prints it: the asked fields in the asked order, cells joined by ", ",
# nothing quoted (gpusim/README.md); a row may also be a raw line.
FAKE = """
import json, sys
rows = json.load(open(sys.argv[1]))
kind, fields = sys.argv[2].split("=", 1)
for row in rows["gpus" if kind == "--query-gpu" else "apps"]:
    print(row if isinstance(row, str) else ", ".join(row[f] for f in fields.split(",")))
sys.exit(rows["rc"])
"""


def app(pid: str, name: str, uuid: str = "GPU-0", used: str = "60000") -> dict[str, str]:
    return {"pid": pid, "process_name": name, "gpu_uuid": uuid, "used_memory": used}


def fake_nvidia_smi(folder: Path, apps: list, gpus: list = GPUS, rc: int = 0) -> Path:
    """A stand-in for nvidia-smi that answers each query from these rows."""
    rows = folder / "rows.json"
    rows.write_text(json.dumps({"gpus": gpus, "apps": apps, "rc": rc}), encoding="utf-8")
    (folder / "fake_smi.py").write_text(FAKE, encoding="utf-8")
    script = folder / "nvidia-smi"
    script.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" "{folder}/fake_smi.py" "{rows}" "$1"\n',
        encoding="utf-8",
    )
    script.chmod(0o755)
    return script


def fake_proc(folder: Path, cgroups: dict[int, str]) -> Path:
    proc = folder / "proc"
    for pid, path in cgroups.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"0::{path}\n", encoding="utf-8")
    return proc


def run_reader(tmp_path: Path, nvidia_smi: Path, *, alone: bool = False) -> tuple[int, str, str]:
    """(exit status, the textfile, stderr) of one timer run over a textfile holding STALE."""
    out = tmp_path / "sglang_fleet_gpu.prom"
    out.write_text(STALE, encoding="utf-8")
    proc = fake_proc(tmp_path, {100: "/system.slice/sglang@llama.service"})
    argv = ["--nvidia-smi", str(nvidia_smi), "--output", str(out), "--proc", str(proc),
            "--owner", "sglang@*.service"]  # fmt: skip
    if alone:  # as on a GPU host: no sglang_fleet package, the parser beside the reader
        host = tmp_path / "usr-local-lib"
        host.mkdir()
        shutil.copy(READER, host / READER.name)
        if PARSER.is_file():
            shutil.copy(PARSER, host / "sglang_fleet_nvidia_smi.py")
        command = [sys.executable, "-S", str(host / READER.name), *argv]
    else:
        command = [sys.executable, str(READER), *argv]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=False)
    return done.returncode, out.read_text(encoding="utf-8"), done.stderr


@pytest.mark.parametrize("alone", [False, True], ids=["package", "alone-on-a-host"])
@pytest.mark.parametrize(
    "path",
    [
        "/opt/my,job/bin/python",
        '/srv/"quoted" dir/python3',
        "/tmp/x, y, z/run",
        "/opt/[weird] (1)/python",
    ],
)
def test_an_unusual_process_path_is_read(tmp_path: Path, path: str, alone: bool) -> None:
    nvidia_smi = fake_nvidia_smi(tmp_path, [app("100", path)])
    code, text, err = run_reader(tmp_path, nvidia_smi, alone=alone)
    assert code == 0, err
    assert "sglang_fleet_gpu_scrape_success 1" in text
    label = path.replace('"', '\\"')
    assert f'pid="100",process="{label}",unit="sglang@llama.service",ours="true"}} 60000.0' in text
    assert 'sglang_fleet_gpu_unowned_memory_mib{gpu="0",uuid="GPU-0"} 0.0' in text


@pytest.mark.parametrize(
    ("apps", "gpus"),
    [
        ([app("100", "/opt/new\nline/python")], GPUS),  # a newline in a path
        (["garbage"], GPUS),
        ([], ["0, GPU-0"]),  # a GPU line with too few columns
        ([], ["no GPU index here, GPU-0, 1, 2, 3"]),
        ([], []),  # no GPU at all
    ],
)
def test_anything_unreadable_writes_scrape_success_0_over_the_old_values(
    tmp_path: Path, apps: list, gpus: list
) -> None:
    code, text, err = run_reader(tmp_path, fake_nvidia_smi(tmp_path, apps, gpus))
    assert code == 1
    assert text.endswith("sglang_fleet_gpu_scrape_success 0\n")
    assert "unowned" not in text  # the old reading is gone
    assert "Traceback" not in err and err.startswith("sglang-fleet-gpu-metrics: ")


def test_a_failing_nvidia_smi_writes_scrape_success_0(tmp_path: Path) -> None:
    code, text, _err = run_reader(tmp_path, fake_nvidia_smi(tmp_path, [], rc=9))
    assert code == 1 and text.endswith("sglang_fleet_gpu_scrape_success 0\n")


def test_alone_without_its_parser_it_still_says_the_scrape_failed(tmp_path: Path) -> None:
    host = tmp_path / "bare"
    host.mkdir()
    shutil.copy(READER, host / READER.name)
    out = tmp_path / "gpu.prom"
    out.write_text(STALE, encoding="utf-8")
    nvidia_smi = fake_nvidia_smi(tmp_path, [])
    done = subprocess.run(
        [sys.executable, "-S", str(host / READER.name), "--nvidia-smi", str(nvidia_smi),
         "--output", str(out)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1 and "sglang_fleet_nvidia_smi.py is missing" in done.stderr
    assert out.read_text(encoding="utf-8").endswith("sglang_fleet_gpu_scrape_success 0\n")
