#!/usr/bin/env python3
"""GPU metrics for the node exporter's textfile collector, from nvidia-smi (docs/MONITORING.md).

Run by sglang-fleet-gpu-metrics.timer on a GPU host. Writes, atomically, Prometheus text with:
  sglang_fleet_gpu_memory_used_mib{gpu,uuid}       memory in use (nvidia-smi memory.used)
  sglang_fleet_gpu_memory_total_mib{gpu,uuid}
  sglang_fleet_gpu_utilization_ratio{gpu,uuid}     utilization.gpu / 100
  sglang_fleet_gpu_process_memory_mib{gpu,pid,process,unit,ours}
                                                    every process holding memory, with its
                                                    systemd unit and whether that unit is ours
  sglang_fleet_gpu_unowned_memory_mib{gpu,uuid}    memory not held by one of our units: a
                                                    zombie, an orphaned rank, a stranger's job
  sglang_fleet_gpu_scrape_success                   0 when this reading failed, whatever failed
A process is ours when a component of its cgroup path matches one of the --owner patterns
(systemd unit names, fnmatch), the rule the gpu_cleanup role uses.

nvidia-smi's CSV is read by the project's one parser of it, plugins/module_utils/nvidia_smi.py (the
monitoring role installs it beside this file as sglang_fleet_nvidia_smi.py): nvidia-smi does
not quote its cells, so a process path with a comma or a quote is taken from the outside in.
Anything that goes wrong (nvidia-smi missing or failing, a line the parser refuses, a newline
in a process path, any error here) writes a textfile with scrape success 0 and no old values,
so GPUMetricsFailing fires instead of the last reading staying up. Standard library only.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

GPU_FIELDS = ["index", "uuid", "memory.used", "memory.total", "utilization.gpu"]
APP_FIELDS = ["pid", "gpu_uuid", "process_name", "used_memory"]
# A host with many GPUs and processes prints a few KiB; more is not nvidia-smi's answer.
MAX_OUTPUT_CHARS = 4 << 20
TIMEOUT_S = 30
PARSER_BESIDE = "sglang_fleet_nvidia_smi"


def nvidia_smi_parser() -> ModuleType:
    """plugins/module_utils/nvidia_smi.py: the package's copy on the control node (tests), else the
    copy
    the role installs beside this file on a GPU host."""
    try:
        from sglang_fleet.module_utils import nvidia_smi  # noqa: PLC0415
    except ImportError:
        path = Path(__file__).resolve().parent / f"{PARSER_BESIDE}.py"
        spec = importlib.util.spec_from_file_location(PARSER_BESIDE, path)
        if spec is None or spec.loader is None or not path.is_file():
            raise RuntimeError(
                f"{path} is missing: copy plugins/module_utils/nvidia_smi.py there"
            ) from None
        nvidia_smi = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(nvidia_smi)
    return nvidia_smi


def query(nvidia_smi: str, kind: str, fields: list[str]) -> str:
    """nvidia-smi's CSV for one query; OSError or SubprocessError when it fails or runs long."""
    argv = [nvidia_smi, f"--query-{kind}={','.join(fields)}", "--format=csv,noheader,nounits"]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=TIMEOUT_S,
        check=True,
    )
    if len(done.stdout) > MAX_OUTPUT_CHARS:
        raise ValueError(f"{argv[1]} printed more than {MAX_OUTPUT_CHARS} characters")
    return done.stdout


def owning_unit(proc: Path, pid: int | None) -> str:
    """The innermost systemd unit (.service or .scope) in the process's cgroup path, or ""."""
    if pid is None:
        return ""
    try:
        with (proc / str(pid) / "cgroup").open(encoding="utf-8", errors="replace") as handle:
            text = handle.read(64 << 10)
    except OSError:
        return ""
    for line in text.splitlines():
        _hierarchy, _sep, path = line.partition("::")
        if not path and ":name=systemd:" in line:
            path = line.split(":name=systemd:", 1)[1]
        for part in reversed([p for p in path.split("/") if p]):
            if part.endswith((".service", ".scope")):
                return part
    return ""


def _label(value: Any) -> str:
    """A label value in Prometheus's text format: backslash, quote and newline escaped."""
    text = "" if value is None else str(value)
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: Any) -> float:
    """A parsed cell as a sample value: nvidia-smi's placeholders ("[N/A]") are NaN."""
    return (
        float(value)
        if isinstance(value, int | float) and not isinstance(value, bool)
        else float("nan")
    )


def render(
    gpus: list[dict[str, Any]], apps: list[dict[str, Any]], proc: Path, owners: Sequence[str]
) -> str:
    """The textfile's content for one reading (rows as plugins/module_utils/nvidia_smi.parse_csv
    gives)."""
    index_of = {str(g["uuid"]): g["index"] for g in gpus}
    ours_mib: dict[str, float] = dict.fromkeys(index_of, 0.0)
    lines = [
        "# HELP sglang_fleet_gpu_scrape_success 1 when nvidia-smi answered and was read.",
        "# TYPE sglang_fleet_gpu_scrape_success gauge",
        "sglang_fleet_gpu_scrape_success 1",
        "# HELP sglang_fleet_gpu_process_memory_mib GPU memory a process holds (MiB).",
        "# TYPE sglang_fleet_gpu_process_memory_mib gauge",
    ]
    for app in apps:
        pid = app["pid"] if isinstance(app["pid"], int) else None
        uuid = str(app["gpu_uuid"])
        unit = owning_unit(proc, pid)
        ours = bool(unit) and any(fnmatch.fnmatch(unit, pattern) for pattern in owners)
        used = _number(app["used_memory"])
        if ours:
            ours_mib[uuid] = ours_mib.get(uuid, 0.0) + used
        labels = (
            f'gpu="{_label(index_of.get(uuid, ""))}",pid="{_label(pid)}",'
            f'process="{_label(app["process_name"])}",unit="{_label(unit)}",'
            f'ours="{str(ours).lower()}"'
        )
        lines.append(f"sglang_fleet_gpu_process_memory_mib{{{labels}}} {used}")
    per_gpu = {
        "memory_used_mib": ("GPU memory in use (MiB).", lambda g: _number(g["memory.used"])),
        "memory_total_mib": ("GPU memory in all (MiB).", lambda g: _number(g["memory.total"])),
        "utilization_ratio": (
            "GPU utilization, 0-1.",
            lambda g: _number(g["utilization.gpu"]) / 100.0,
        ),
        "unowned_memory_mib": (
            "GPU memory not held by one of our units (MiB): zombies, orphans, strangers.",
            lambda g: max(_number(g["memory.used"]) - ours_mib.get(str(g["uuid"]), 0.0), 0.0),
        ),
    }
    for metric, (help_text, value) in per_gpu.items():
        lines += [
            f"# HELP sglang_fleet_gpu_{metric} {help_text}",
            f"# TYPE sglang_fleet_gpu_{metric} gauge",
        ]
        lines += [
            f'sglang_fleet_gpu_{metric}{{gpu="{_label(g["index"])}",uuid="{_label(g["uuid"])}"}} '
            f"{value(g)}"
            for g in gpus
        ]
    return "\n".join(lines) + "\n"


def reading(nvidia_smi: str, proc: Path, owners: Sequence[str]) -> str:
    """One whole reading: both queries, parsed, rendered; any failure raises."""
    parser = nvidia_smi_parser()
    gpus = parser.parse_csv(query(nvidia_smi, "gpu", GPU_FIELDS), GPU_FIELDS)
    if not gpus:
        raise ValueError("nvidia-smi lists no GPU")
    for gpu in gpus:
        if not isinstance(gpu["index"], int) or not gpu["uuid"]:
            raise ValueError(f"a GPU row without an index or uuid: {gpu}")
    apps = parser.parse_csv(query(nvidia_smi, "compute-apps", APP_FIELDS), APP_FIELDS)
    return render(gpus, apps, proc, owners)


def failed() -> str:
    return (
        "# HELP sglang_fleet_gpu_scrape_success 1 when nvidia-smi answered and was read.\n"
        "# TYPE sglang_fleet_gpu_scrape_success gauge\nsglang_fleet_gpu_scrape_success 0\n"
    )


def write_atomically(path: Path, text: str) -> None:
    """The node exporter must never read half a file: write beside it, then rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvidia-smi", default="nvidia-smi")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--owner", action="append", default=[], help="unit pattern of ours")
    parser.add_argument("--proc", type=Path, default=Path("/proc"))
    args = parser.parse_args(argv)
    try:
        text = reading(args.nvidia_smi, args.proc, args.owner)
    # Whatever failed, the alarm must go on: a textfile that says so, never the old values.
    except Exception as exc:
        print(f"sglang-fleet-gpu-metrics: {type(exc).__name__}: {exc}", file=sys.stderr)
        write_atomically(args.output, failed())
        return 1
    write_atomically(args.output, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
