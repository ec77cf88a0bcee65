"""`nvidia-smi` for simulated GPUs: the query forms a deployment tool relies on.

Answers from the state directory (gpusim.state): memory used on a GPU is the sum of the live
processes registered on it, exactly as a real GPU reports nothing else once a process is gone.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpusim import state
from gpusim.state import GpuProc, Hardware

# nvidia-smi's documented return value for "NVIDIA driver is not loaded".
EXIT_DRIVER_NOT_LOADED = 9
EXIT_INVALID_ARGUMENT = 2
DRIVER_MESSAGE = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)
# The driver keeps a little memory on every GPU that no process owns; real cards show ~0-4 MiB.
IDLE_RESERVED_MIB = 0
NA = "[N/A]"


@dataclass
class GpuView:
    """What nvidia-smi knows about one GPU."""

    index: int
    hardware: Hardware
    used_mib: int

    @property
    def total_mib(self) -> int:
        return self.hardware.gpu_memory_mib

    @property
    def free_mib(self) -> int:
        return max(0, self.total_mib - self.used_mib)


@dataclass
class Field:
    """One queryable column: its header, unit (shown unless nounits) and value getter."""

    header: str
    unit: str | None
    getter: Callable[..., object]


def _mib(value: int) -> tuple[int, str]:
    return value, "MiB"


GPU_FIELDS: dict[str, Field] = {
    "timestamp": Field("timestamp", None, lambda g: time.strftime("%Y/%m/%d %H:%M:%S.000")),
    "index": Field("index", None, lambda g: g.index),
    "count": Field("count", None, lambda g: g.hardware.gpu_count),
    "name": Field("name", None, lambda g: g.hardware.gpu_name),
    "uuid": Field("uuid", None, lambda g: state.gpu_uuid(g.index)),
    "pci.bus_id": Field("pci.bus_id", None, lambda g: state.pci_bus_id(g.index)),
    "driver_version": Field("driver_version", None, lambda g: g.hardware.driver_version),
    "memory.total": Field("memory.total [MiB]", "MiB", lambda g: g.total_mib),
    "memory.used": Field("memory.used [MiB]", "MiB", lambda g: g.used_mib),
    "memory.free": Field("memory.free [MiB]", "MiB", lambda g: g.free_mib),
    "memory.reserved": Field("memory.reserved [MiB]", "MiB", lambda g: IDLE_RESERVED_MIB),
    "utilization.gpu": Field("utilization.gpu [%]", "%", lambda g: 100 if g.used_mib > 0 else 0),
    "utilization.memory": Field("utilization.memory [%]", "%", lambda g: 0),
    "temperature.gpu": Field("temperature.gpu", None, lambda g: 34),
    "power.draw": Field("power.draw [W]", "W", lambda g: f"{(120 if g.used_mib else 35):.2f}"),
    "persistence_mode": Field("persistence_mode", None, lambda g: "Enabled"),
    "compute_mode": Field("compute_mode", None, lambda g: "Default"),
    "serial": Field("serial", None, lambda g: f"165002{g.index:07d}"),
    "vbios_version": Field("vbios_version", None, lambda g: NA),
}
GPU_ALIASES = {
    "gpu_name": "name",
    "gpu_uuid": "uuid",
    "gpu_bus_id": "pci.bus_id",
    "driver": "driver_version",
}

APP_FIELDS: dict[str, Field] = {
    "pid": Field("pid", None, lambda p, g: p.pid),
    "process_name": Field("process_name", None, lambda p, g: p.name),
    "gpu_uuid": Field("gpu_uuid", None, lambda p, g: state.gpu_uuid(p.gpu_index)),
    "gpu_bus_id": Field("gpu_bus_id", None, lambda p, g: state.pci_bus_id(p.gpu_index)),
    "gpu_name": Field("gpu_name", None, lambda p, g: g.gpu_name),
    "gpu_serial": Field("gpu_serial", None, lambda p, g: f"165002{p.gpu_index:07d}"),
    "used_memory": Field("used_gpu_memory [MiB]", "MiB", lambda p, g: p.used_mib),
    "timestamp": Field("timestamp", None, lambda p, g: time.strftime("%Y/%m/%d %H:%M:%S.000")),
}
APP_ALIASES = {"used_gpu_memory": "used_memory", "name": "process_name"}


class InvalidField(ValueError):
    pass


def _resolve(names: str, fields: dict[str, Field], aliases: dict[str, str]) -> list[Field]:
    resolved = []
    for raw in names.split(","):
        name = raw.strip()
        key = aliases.get(name, name)
        if key not in fields:
            raise InvalidField(name)
        resolved.append(fields[key])
    return resolved


def _cell(field: Field, value: object, units: bool) -> str:
    if units and field.unit and value != NA:
        return f"{value} {field.unit}"
    return str(value)


def format_csv(
    fields: list[Field], rows: list[list[object]], header: bool, units: bool
) -> list[str]:
    """nvidia-smi's CSV: ", " between cells; the header keeps its [unit] even with nounits."""
    lines = [", ".join(f.header for f in fields)] if header else []
    for row in rows:
        lines.append(", ".join(_cell(f, v, units) for f, v in zip(fields, row, strict=True)))
    return lines


def _parse_format(spec: str) -> tuple[bool, bool]:
    parts = {p.strip() for p in spec.split(",")}
    if "csv" not in parts or not parts <= {"csv", "noheader", "nounits"}:
        raise InvalidField(f"format {spec}")
    return "noheader" not in parts, "nounits" not in parts


def _select(views: list[GpuView], ids: str | None) -> list[GpuView]:
    if ids is None:
        return views
    wanted = {i.strip() for i in ids.split(",")}
    return [v for v in views if str(v.index) in wanted or state.gpu_uuid(v.index) in wanted]


def gpu_views(hardware: Hardware, procs: list[GpuProc]) -> list[GpuView]:
    used = state.used_mib_by_gpu(hardware, procs)
    return [GpuView(i, hardware, used[i]) for i in range(hardware.gpu_count)]


_COLS = (41, 24, 22)  # inner widths of the three GPU table columns
_WIDE = 89  # inner width of the header and process tables


def _rule(fill: str = "-", cross: str = "+") -> str:
    return cross + cross.join(fill * w for w in _COLS) + cross


def _cells(*cells: str) -> str:
    return "|" + "|".join(f" {c:<{w - 2}} " for c, w in zip(cells, _COLS, strict=True)) + "|"


def _wide(text: str = "", fill: str = " ") -> str:
    return "|" + f" {text}".ljust(_WIDE, fill) + "|" if text else "+" + fill * _WIDE + "+"


def _table(hardware: Hardware, views: list[GpuView], procs: list[GpuProc]) -> list[str]:
    """A plain table shaped like nvidia-smi's default output (readable, not byte-exact)."""
    head = (
        f"NVIDIA-SMI {hardware.driver_version:<22}Driver Version: {hardware.driver_version:<15}"
        f"CUDA Version: {hardware.cuda_version}"
    )
    lines = [time.strftime("%a %b %d %H:%M:%S %Y"), _wide(fill="-"), _wide(head), _rule()]
    lines += [
        _cells("GPU  Name                 Persistence-M", "Bus-Id          Disp.A",
               "Volatile Uncorr. ECC"),
        _cells("Fan  Temp   Perf          Pwr:Usage/Cap", "          Memory-Usage",
               "GPU-Util  Compute M."),
        _rule("=", "|"),
    ]  # fmt: skip
    for v in views:
        mem = f"{v.used_mib}MiB / {v.total_mib}MiB"
        util = f"{100 if v.used_mib else 0}%"
        lines.append(
            _cells(f"{v.index:>3}  {hardware.gpu_name[:29]:<29}  On",
                   f"{state.pci_bus_id(v.index)} Off", f"{'0':>20}")
        )  # fmt: skip
        lines.append(
            _cells("N/A   34C    P0          35W /  600W", f"{mem:>22}", f"{util:>8}      Default")
        )
        lines.append(_rule())
    lines += ["", _wide(fill="-"), _wide("Processes:")]
    lines.append(
        _wide(f"{'GPU':>4}   GI   CI  {'PID':>15}   Type   {'Process name':<34}GPU Memory")
    )
    lines.append("|" + "=" * _WIDE + "|")
    shown = [p for p in procs if any(v.index == p.gpu_index for v in views)]
    if not shown:
        lines.append(_wide("No running processes found"))
    for p in shown:
        lines.append(
            _wide(f"{p.gpu_index:>4}  N/A  N/A  {p.pid:>15}      C   {p.name[:34]:<34}"
                  f"{str(p.used_mib) + 'MiB':>10}")
        )  # fmt: skip
    lines.append(_wide(fill="-"))
    return lines


def _list_gpus(views: list[GpuView]) -> list[str]:
    return [
        f"GPU {v.index}: {v.hardware.gpu_name} (UUID: {state.gpu_uuid(v.index)})" for v in views
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvidia-smi", add_help=True, allow_abbrev=False)
    parser.add_argument("--query-gpu", dest="query_gpu")
    parser.add_argument("--query-compute-apps", dest="query_apps")
    parser.add_argument("--format", dest="fmt")
    parser.add_argument("-i", "--id", dest="ids")
    parser.add_argument("-L", "--list-gpus", action="store_true", dest="list_gpus")
    return parser


def run(argv: Sequence[str]) -> tuple[int, list[str], list[str]]:
    """Return (exit code, stdout lines, stderr lines); main() prints them."""
    args = build_parser().parse_args(list(argv))
    hardware = state.load_hardware()
    if not hardware.driver_loaded:
        return EXIT_DRIVER_NOT_LOADED, [DRIVER_MESSAGE], []
    procs = state.live_procs()
    views = _select(gpu_views(hardware, procs), args.ids)
    if args.ids is not None and not views:
        return 6, [f"No devices were found matching id {args.ids}"], []
    if args.list_gpus:
        return 0, _list_gpus(views), []
    if args.query_gpu is None and args.query_apps is None:
        return 0, _table(hardware, views, procs), []
    return _query(args, hardware, views, procs)


def _query(
    args: argparse.Namespace, hardware: Hardware, views: list[GpuView], procs: list[GpuProc]
) -> tuple[int, list[str], list[str]]:
    if args.fmt is None:
        return EXIT_INVALID_ARGUMENT, ["--format must be specified with --query-*."], []
    try:
        header, units = _parse_format(args.fmt)
        if args.query_gpu:
            fields = _resolve(args.query_gpu, GPU_FIELDS, GPU_ALIASES)
            rows = [[f.getter(v) for f in fields] for v in views]
        else:
            fields = _resolve(args.query_apps, APP_FIELDS, APP_ALIASES)
            indexes = {v.index for v in views}
            rows = [
                [f.getter(p, hardware) for f in fields] for p in procs if p.gpu_index in indexes
            ]
    except InvalidField as exc:
        return EXIT_INVALID_ARGUMENT, [f'Field "{exc}" is not a valid field to query.', ""], []
    return 0, format_csv(fields, rows, header, units), []


def main(argv: Sequence[str] | None = None) -> int:
    code, out, err = run(sys.argv[1:] if argv is None else argv)
    for line in out:
        print(line)
    for line in err:
        print(line, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
