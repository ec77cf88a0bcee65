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
  sglang_fleet_gpu_scrape_success                   0 when nvidia-smi failed (driver gone)
A process is ours when a component of its cgroup path matches one of the --owner patterns
(systemd unit names, fnmatch), the rule the gpu_cleanup role uses. Standard library only.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

GPU_FIELDS = "index,uuid,memory.used,memory.total,utilization.gpu"
APP_FIELDS = "pid,process_name,gpu_uuid,used_memory"


def _rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in row] for row in csv.reader(text.splitlines()) if row]


def _number(cell: str) -> float:
    """nvidia-smi prints "[N/A]" or "[Not Supported]" for what a card cannot report."""
    try:
        return float(cell)
    except ValueError:
        return float("nan")


def query(nvidia_smi: str, kind: str, fields: str) -> list[list[str]]:
    out = subprocess.run(
        [nvidia_smi, f"--query-{kind}={fields}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return _rows(out.stdout)


def owning_unit(proc: Path, pid: str) -> str:
    """The innermost systemd unit (.service or .scope) in the process's cgroup path, or ""."""
    try:
        text = (proc / pid / "cgroup").read_text(encoding="utf-8")
    except OSError:
        return ""
    for line in text.splitlines():
        _, _, path = line.partition("::")
        if not path and ":name=systemd:" in line:
            path = line.split(":name=systemd:", 1)[1]
        for part in reversed([p for p in path.split("/") if p]):
            if part.endswith((".service", ".scope")):
                return part
    return ""


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(gpus: list[list[str]], apps: list[list[str]], proc: Path, owners: Sequence[str]) -> str:
    """The textfile's content for one nvidia-smi reading."""
    index_of = {row[1]: row[0] for row in gpus}
    ours_mib: dict[str, float] = {row[1]: 0.0 for row in gpus}
    lines = [
        "# HELP sglang_fleet_gpu_scrape_success 1 when nvidia-smi answered.",
        "# TYPE sglang_fleet_gpu_scrape_success gauge",
        "sglang_fleet_gpu_scrape_success 1",
        "# HELP sglang_fleet_gpu_process_memory_mib GPU memory a process holds (MiB).",
        "# TYPE sglang_fleet_gpu_process_memory_mib gauge",
    ]
    for pid, name, uuid, used in apps:
        unit = owning_unit(proc, pid)
        ours = any(fnmatch.fnmatch(unit, pattern) for pattern in owners)
        if ours:
            ours_mib[uuid] = ours_mib.get(uuid, 0.0) + _number(used)
        labels = (
            f'gpu="{index_of.get(uuid, "")}",pid="{pid}",process="{_label(name)}",'
            f'unit="{_label(unit)}",ours="{str(ours).lower()}"'
        )
        lines.append(f"sglang_fleet_gpu_process_memory_mib{{{labels}}} {_number(used)}")
    per_gpu = {
        "memory_used_mib": ("GPU memory in use (MiB).", lambda r: _number(r[2])),
        "memory_total_mib": ("GPU memory in all (MiB).", lambda r: _number(r[3])),
        "utilization_ratio": ("GPU utilization, 0-1.", lambda r: _number(r[4]) / 100.0),
        "unowned_memory_mib": (
            "GPU memory not held by one of our units (MiB): zombies, orphans, strangers.",
            lambda r: max(_number(r[2]) - ours_mib.get(r[1], 0.0), 0.0),
        ),
    }
    for metric, (help_text, value) in per_gpu.items():
        lines += [
            f"# HELP sglang_fleet_gpu_{metric} {help_text}",
            f"# TYPE sglang_fleet_gpu_{metric} gauge",
        ]
        lines += [
            f'sglang_fleet_gpu_{metric}{{gpu="{row[0]}",uuid="{row[1]}"}} {value(row)}'
            for row in gpus
        ]
    return "\n".join(lines) + "\n"


def failed() -> str:
    return (
        "# HELP sglang_fleet_gpu_scrape_success 1 when nvidia-smi answered.\n"
        "# TYPE sglang_fleet_gpu_scrape_success gauge\nsglang_fleet_gpu_scrape_success 0\n"
    )


def write_atomically(path: Path, text: str) -> None:
    """The node exporter must never read half a file: write beside it, then rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvidia-smi", default="nvidia-smi")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--owner", action="append", default=[], help="unit pattern of ours")
    parser.add_argument("--proc", type=Path, default=Path("/proc"))
    args = parser.parse_args(argv)
    try:
        gpus = query(args.nvidia_smi, "gpu", GPU_FIELDS)
        apps = query(args.nvidia_smi, "compute-apps", APP_FIELDS)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"nvidia-smi failed: {exc}", file=sys.stderr)
        write_atomically(args.output, failed())
        return 1
    write_atomically(args.output, render(gpus, apps, args.proc, args.owner))
    return 0


if __name__ == "__main__":
    sys.exit(main())
