"""Parse nvidia-smi's CSV query output and recognise its failure messages.

Shared by the Ansible modules that run on GPU hosts, so: standard library only, Python >= 3.10.
Pure functions: the caller runs nvidia-smi and hands the text over, which keeps the parsing
testable against captured real output (tests/fixtures/nvidia_smi/).

Output forms handled (all seen in real captures, see tests/fixtures/nvidia_smi/SOURCES.md):
- ``--format=csv``: a header line (``index, memory.used [MiB]``) and units in values (``97 MiB``);
- ``--format=csv,noheader,nounits``: bare values;
- placeholders instead of values: ``[N/A]``, ``[Not Supported]``, ``[Insufficient Permissions]``,
  ``[Unknown Error]``, ``[Not Found]`` (these become ``None``);
- no processes: an empty output, or a header alone;
- commas inside a process name (older drivers do not sanitise them): the name column is taken
  from the outside in.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any

# Fields are named as we ask for them; nvidia-smi's header uses some other spellings.
HEADER_ALIASES = {
    "used_memory": "used_gpu_memory",
    "name": "process_name",
}

# Values nvidia-smi prints when it cannot or may not tell: mean "unknown", never zero. Both
# are used with fullmatch (`$` would also take a value that ends in a newline).
_PLACEHOLDER = re.compile(r"\[[^\]]*\]|N/A")
_UNIT_SUFFIX = re.compile(r"(-?\d+(?:\.\d+)?)\s*(?:MiB|GiB|KiB|%|W|MHz|C)")

# Columns whose values are free text: a comma inside one must not shift the columns after it.
TEXT_FIELDS = ("process_name", "name")

# Substrings of nvidia-smi's failure output: (needle, kind, what the operator should read instead).
_FAILURES = (
    (
        "couldn't communicate with the NVIDIA driver",
        "not_loaded",
        "nvidia-smi cannot communicate with the NVIDIA driver: the kernel module is not loaded "
        "(driver missing, not built for the running kernel, or the host needs a reboot after a "
        "driver install)",
    ),
    (
        "Driver/library version mismatch",
        "version_mismatch",
        "the NVIDIA kernel module and the user-space driver library differ in version (driver "
        "upgraded without a reboot or module reload)",
    ),
    ("No devices were found", "no_gpus", "nvidia-smi found no NVIDIA GPU on this host"),
    ("Failed to initialize NVML", "nvml", "nvidia-smi could not initialise NVML"),
)


class NvidiaSmiError(Exception):
    """nvidia-smi is missing, failed, or printed something that is not the CSV we asked for."""


def failure_kind(output: str) -> str | None:
    """not_loaded, version_mismatch, no_gpus or nvml for a known failure message, else None."""
    for needle, kind, _reason in _FAILURES:
        if needle.lower() in output.lower():
            return kind
    return None


def explain_failure(output: str) -> str | None:
    """Return a plain-words reason for a known nvidia-smi failure message, else None."""
    for needle, _kind, reason in _FAILURES:
        if needle.lower() in output.lower():
            return reason
    return None


def check_result(argv: list[str], rc: int, stdout: str, stderr: str) -> str:
    """Return stdout when nvidia-smi succeeded, raise NvidiaSmiError with the reason otherwise.

    nvidia-smi prints its driver failure on stdout and exits non-zero; both streams are searched.
    """
    both = f"{stdout}\n{stderr}".strip()
    reason = explain_failure(both)
    if rc != 0 or reason is not None:
        detail = reason or "nvidia-smi failed"
        raise NvidiaSmiError(f"{detail}: `{' '.join(argv)}` exited {rc}: {both[:500]}")
    return stdout


def _header_name(cell: str) -> str:
    r"""The cell without its unit (`memory.used [MiB]`): the trailing `[...]` (from the first
    "[" after any other "]") and the blanks before it. Found by position: the expression
    `\s*\[[^\]]*\]$` costs time quadratic in a cell of many "["."""
    name = cell.strip()
    if not name.endswith("]"):
        return name
    opening = name.find("[", name.rfind("]", 0, len(name) - 1) + 1)
    return name if opening < 0 else name[:opening].rstrip()


def _is_header(cells: list[str], fields: list[str]) -> bool:
    names = [_header_name(c) for c in cells]
    wanted = [HEADER_ALIASES.get(f, f) for f in fields]
    return names[: len(wanted)] == wanted or names[: len(fields)] == list(fields)


def parse_value(text: str) -> str | int | float | None:
    """Turn one CSV cell into None (placeholder), a number (units stripped), or the text."""
    value = text.strip()
    if not value or _PLACEHOLDER.fullmatch(value):
        return None
    unit = _UNIT_SUFFIX.fullmatch(value)
    number = unit.group(1) if unit else value
    try:
        return int(number)
    except ValueError:
        pass
    try:
        return float(number)
    except ValueError:
        return value


def _split_row(line: str, fields: list[str]) -> list[str] | None:
    cells = line.split(",")
    if len(cells) == len(fields):
        return cells
    text_at = next((i for i, f in enumerate(fields) if f in TEXT_FIELDS), None)
    if text_at is None or len(cells) < len(fields):
        return None
    right = len(fields) - text_at - 1
    end = len(cells) - right
    return [*cells[:text_at], ",".join(cells[text_at:end]), *cells[end:]]


def parse_csv(text: str, fields: list[str]) -> list[dict[str, Any]]:
    """Parse ``nvidia-smi --query-...=<fields> --format=csv[,noheader][,nounits]`` output.

    Returns one dict per row keyed by the requested field names. Raises NvidiaSmiError on a row
    that does not have the requested columns (a changed nvidia-smi must fail loudly, not be read
    as "no processes").
    """
    rows: list[dict[str, Any]] = []
    lines = [line for line in text.splitlines() if line.strip()]
    if lines and _is_header(lines[0].split(","), fields):
        lines = lines[1:]
    for line in lines:
        cells = _split_row(line, fields)
        if cells is None:
            raise NvidiaSmiError(f"unexpected nvidia-smi line for fields {fields}: {line!r}")
        rows.append({f: parse_value(c) for f, c in zip(fields, cells, strict=True)})
    return rows


GPU_FIELDS = ["index", "uuid", "name", "memory.used", "memory.total"]
APP_FIELDS = ["pid", "gpu_uuid", "process_name", "used_memory"]


def gpu_query_argv(nvidia_smi: str) -> list[str]:
    return [nvidia_smi, f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"]


def apps_query_argv(nvidia_smi: str) -> list[str]:
    fields = ",".join(APP_FIELDS)
    return [nvidia_smi, f"--query-compute-apps={fields}", "--format=csv,noheader,nounits"]


def parse_gpus(text: str) -> list[dict[str, Any]]:
    """GPUs from the GPU_FIELDS query: index, uuid, name, memory_used_mib, memory_total_mib."""
    gpus = []
    for row in parse_csv(text, GPU_FIELDS):
        if not isinstance(row["index"], int):
            raise NvidiaSmiError(f"GPU row without an index: {row}")
        gpus.append(
            {
                "index": row["index"],
                "uuid": str(row["uuid"]),
                "name": row["name"],
                "memory_used_mib": row["memory.used"],
                "memory_total_mib": row["memory.total"],
            }
        )
    return gpus


def parse_compute_apps(text: str, uuid_to_index: dict[str, int]) -> list[dict[str, Any]]:
    """Compute processes from the APP_FIELDS query, with the GPU index resolved from its uuid.

    A row whose pid is a placeholder (``[Insufficient Permissions]`` when the driver hides it)
    keeps ``pid: None``: the GPU is still busy, so the caller must not read it as free.
    ``gpu_index`` is None when the uuid is not among the GPUs (the caller treats that as
    "could be any GPU").
    """
    apps = []
    for row in parse_csv(text, APP_FIELDS):
        pid = row["pid"] if isinstance(row["pid"], int) else None
        uuid = str(row["gpu_uuid"]) if row["gpu_uuid"] is not None else None
        used = row["used_memory"]
        apps.append(
            {
                "pid": pid,
                "gpu_uuid": uuid,
                "gpu_index": uuid_to_index.get(uuid) if uuid else None,
                "process_name": row["process_name"],
                "used_mib": used if isinstance(used, int) else None,
            }
        )
    return apps


def read_gpus(nvidia_smi: str, timeout: int) -> dict[str, Any]:
    """The module's result; raises NvidiaSmiError with the reason."""
    argv = gpu_query_argv(nvidia_smi)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise NvidiaSmiError(f"nvidia-smi not found: {nvidia_smi!r}") from None
    except subprocess.TimeoutExpired:
        raise NvidiaSmiError(f"`{' '.join(argv)}` gave no answer within {timeout} s") from None
    gpus = parse_gpus(check_result(argv, done.returncode, done.stdout, done.stderr))
    if not gpus:
        raise NvidiaSmiError("nvidia-smi answers but lists no GPU")
    totals = [g["memory_total_mib"] for g in gpus]
    known = [t for t in totals if isinstance(t, int | float)]
    return {
        "gpus": gpus,
        "gpu_count": len(gpus),
        "min_memory_total_mib": min(known) if len(known) == len(totals) else None,
    }
