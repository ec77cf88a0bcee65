"""The shared state directory: simulated hardware, timing and registered GPU processes.

Both halves of the double (nvidia-smi and the SGLang-shaped server) meet here, so tests can
run several independent simulated hosts on one machine by pointing GPUSIM_STATE_DIR at
different directories. Layout: see docs/CONTRACTS.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_STATE_DIR = "/var/lib/gpusim"
# World-writable and sticky like /tmp: the service user and a foreign user's training job
# both register here, but nobody can delete another user's record.
DIR_MODE = 0o1777


@dataclass
class Timing:
    """Simulated durations. Zero everywhere makes the double as fast as the machine allows."""

    # Start-up phases (seconds): weight load, KV pool allocation, CUDA graph capture.
    load_weights_s: float = 2.0
    kv_alloc_s: float = 0.5
    graph_capture_s: float = 1.5
    # Decode step time for a batch of one; a batch of B takes
    # decode_step_s * (1 + batch_slowdown * (B - 1)) (see README, "Throughput model").
    decode_step_s: float = 0.05
    batch_slowdown: float = 0.01
    # Prefill time per new (uncached) input token.
    prefill_token_s: float = 0.00002
    # Attention DP: each rank's decode step takes this x what a TP server's step of the same
    # batch takes (the MoE layers' lockstep and all-gather are not modelled; README,
    # "Attention DP"). A model, not a measurement: a real host's autotune decides.
    attn_dp_step_factor: float = 1.0
    # Speculative decoding (README, "Speculative decoding"): the mean tokens a request gains per
    # verify step, the bonus token included (SGLang's `accept len`, sglang:spec_accept_length),
    # capped at what one step can accept. With the verify's cost it sets the running batch
    # above which speculation stops paying. A model, not a measurement: 2.5 is in the range
    # published EAGLE-3 drafts of Kimi-K2.5 report for chat at 3 steps, top-k 1.
    spec_accept_length: float = 2.5


SLOWDOWN_KEY = "sglang_version_slowdown"


class HardwareFileError(ValueError):
    """hardware.yaml holds a value gpusim refuses; the message names the key."""


def _version_slowdown(value: Any) -> dict[str, float]:
    """`sglang_version_slowdown`: {exact installed sglang version: factor >= 1.0}."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HardwareFileError(
            f"{SLOWDOWN_KEY} must be a mapping of sglang version to a factor "
            f">= 1.0 (e.g. {{'0.5.23+regressed': 2.0}}), got {value!r}"
        )
    factors: dict[str, float] = {}
    for version, factor in value.items():
        if not isinstance(version, str) or not version:
            raise HardwareFileError(
                f"{SLOWDOWN_KEY} keys must be sglang version strings (quote "
                f"them in YAML), got {version!r}"
            )
        if (
            isinstance(factor, bool)
            or not isinstance(factor, int | float)
            or not math.isfinite(factor)
            or factor < 1.0
        ):
            raise HardwareFileError(
                f"{SLOWDOWN_KEY}[{version!r}] must be a number >= 1.0 (how many "
                f"times slower that version decodes and prefills), got {factor!r}"
            )
        factors[version] = float(factor)
    return factors


@dataclass
class Hardware:
    """The simulated host, read from hardware.yaml (missing keys keep these defaults)."""

    gpu_count: int = 8
    gpu_name: str = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    gpu_memory_mib: int = 97887
    host_ram_gib: float = 400.0
    driver_loaded: bool = True
    driver_version: str = "580.95.05"
    cuda_version: str = "13.0"
    timing: Timing = field(default_factory=Timing)
    # A regression per SGLang version (README, "Versions"): the installed version's factor
    # multiplies the decode step and per-token prefill times; versions not listed: 1.0.
    sglang_version_slowdown: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def slowdown_for(self, version: str) -> float:
        """The factor for this exact installed version string (1.0 when not listed)."""
        return self.sglang_version_slowdown.get(version, 1.0)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hardware:
        """Raises HardwareFileError for a bad sglang_version_slowdown."""
        nested = ("timing", SLOWDOWN_KEY)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k not in nested}
        timing_data = data.get("timing") or {}
        timing = Timing(
            **{k: float(v) for k, v in timing_data.items() if k in Timing.__dataclass_fields__}
        )
        if not math.isfinite(timing.spec_accept_length) or timing.spec_accept_length < 1.0:
            raise HardwareFileError(
                "timing.spec_accept_length must be a number >= 1.0 (the mean tokens a request "
                "gains per speculative verify step, the bonus token included), got "
                f"{timing_data.get('spec_accept_length')!r}"
            )
        slowdown = _version_slowdown(data.get(SLOWDOWN_KEY))
        return cls(**known, timing=timing, sglang_version_slowdown=slowdown)


@dataclass
class GpuProc:
    """One process registered on one simulated GPU."""

    pid: int
    gpu_index: int
    used_mib: int
    name: str
    start_time: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def state_dir() -> Path:
    return Path(os.environ.get("GPUSIM_STATE_DIR", DEFAULT_STATE_DIR))


def gpu_uuid(index: int) -> str:
    """A stable, well-formed UUID per index (real ones are random; stability helps tests)."""
    return f"GPU-5a1e0000-0000-4000-8000-{index:012d}"


def pci_bus_id(index: int) -> str:
    return f"00000000:{0x18 + index * 0x10:02X}:00.0"


def load_hardware(root: Path | None = None) -> Hardware:
    path = (root or state_dir()) / "hardware.yaml"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        return Hardware()
    try:
        return Hardware.from_dict(data)
    except HardwareFileError as exc:
        raise HardwareFileError(f"{path}: {exc}") from None


def save_hardware(hardware: Hardware, root: Path | None = None) -> None:
    root = root or state_dir()
    _atomic_write(root / "hardware.yaml", yaml.safe_dump(hardware.to_dict(), sort_keys=False))


def _mkdir_shared(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    # chmod can fail when another user created it: that user already made it shared.
    with contextlib.suppress(PermissionError):
        path.chmod(DIR_MODE)


def init_state(hardware: Hardware, root: Path | None = None) -> Path:
    """Create the directory tree, the device files and hardware.yaml."""
    root = root or state_dir()
    for sub in (root, root / "procs", root / "dev"):
        _mkdir_shared(sub)
    for name in ["nvidiactl", *[f"nvidia{i}" for i in range(hardware.gpu_count)]]:
        dev = root / "dev" / name
        if not dev.exists():
            dev.touch()
            dev.chmod(0o666)
    save_hardware(hardware, root)
    return root


def device_path(index: int, root: Path | None = None) -> Path:
    return (root or state_dir()) / "dev" / f"nvidia{index}"


def _atomic_write(path: Path, text: str) -> None:
    # Readers (nvidia-smi) must never see half a record.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def proc_start_time(pid: int) -> int | None:
    """Start time of a PID in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    state = fields[0]
    if state in ("Z", "X"):
        return None  # a zombie holds no GPU memory
    return int(fields[19])


def register(
    pid: int, gpu_index: int, used_mib: int, name: str, root: Path | None = None
) -> GpuProc:
    """Record (or update) that PID holds used_mib on GPU gpu_index."""
    root = root or state_dir()
    start = proc_start_time(pid)
    if start is None:
        raise ProcessLookupError(f"pid {pid} is not running")
    proc = GpuProc(pid, gpu_index, int(used_mib), name, start)
    _atomic_write(_record_path(root, pid, gpu_index), json.dumps(proc.to_dict()))
    return proc


def unregister(pid: int, root: Path | None = None) -> None:
    root = root or state_dir()
    for path in (root / "procs").glob(f"{pid}-*.json"):
        path.unlink(missing_ok=True)


def _record_path(root: Path, pid: int, gpu_index: int) -> Path:
    # One file per (pid, gpu): a process could hold several GPUs.
    return root / "procs" / f"{pid}-{gpu_index}.json"


def _is_live(proc: GpuProc) -> bool:
    return proc_start_time(proc.pid) == proc.start_time


def live_procs(root: Path | None = None, prune: bool = True) -> list[GpuProc]:
    """Registered processes that are still alive; dead or reused PIDs are dropped."""
    root = root or state_dir()
    procs: list[GpuProc] = []
    for path in sorted((root / "procs").glob("*.json")):
        try:
            proc = GpuProc(**json.loads(path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            continue
        if _is_live(proc):
            procs.append(proc)
        elif prune:
            # Another user's stale record may not be ours to delete (sticky dir): skip it.
            with contextlib.suppress(OSError):
                path.unlink()
    return sorted(procs, key=lambda p: (p.gpu_index, p.pid))


def used_mib_by_gpu(hardware: Hardware, procs: list[GpuProc]) -> list[int]:
    used = [0] * hardware.gpu_count
    for proc in procs:
        if 0 <= proc.gpu_index < hardware.gpu_count:
            used[proc.gpu_index] += proc.used_mib
    return used
