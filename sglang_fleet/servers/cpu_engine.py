"""What a CPU server gets from its device (docs/CPU-SERVERS.md): SGLang's CPU engine switch,
the attention backend, and each rank's OpenMP threads bound to the server's `cpus`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from sglang_fleet.servers.server_values import (
    ServerConfigError,
    check_device,
    check_gpus,
    positive_int,
)

# SGLang's CPU engine (docs/CPU-SERVERS.md): the switch, and where each rank's OpenMP threads go.
CPU_ENGINE_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
CPU_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
# On CPUs without Intel AMX SGLang falls back to this anyway; with AMX its default (intel_amx)
# needs an sgl-kernel CPU build, which PyPI does not have.
CPU_ATTENTION_BACKEND = "torch_native"


def _check_cpus(value: Any, where: str) -> list[int]:
    variable = f"{where}.cpus"
    if value is None:
        return []
    if not isinstance(value, list) or not value:
        raise ServerConfigError(variable, "must be a non-empty list of CPU ids, like [0, 1, 2, 3]")
    for cpu in value:
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
            raise ServerConfigError(variable, f"{cpu!r} is not a CPU id (an integer >= 0)")
    if len(set(value)) != len(value):
        raise ServerConfigError(variable, f"{value} lists a CPU twice")
    return list(value)


def _cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the CPU list syntax SGLang and taskset read)."""
    parts: list[str] = []
    start = prev = cpus[0]
    for cpu in [*cpus[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)


def cpu_threads_bind(cpus: list[int], ranks: int) -> str | None:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` ranks over `cpus` ('0-1|2-3'), None when the CPUs
    do not split evenly."""
    if ranks < 1 or not cpus or len(cpus) % ranks:
        return None
    size = len(cpus) // ranks
    return "|".join(_cpu_ranges(cpus[i * size : (i + 1) * size]) for i in range(ranks))


def _cpu_ranks(flags: Mapping[str, Any]) -> int | None:
    """SGLang's world size on a CPU host: tp x pp x dp (numa_utils.init_threads_binding)."""
    sizes = [positive_int(flags, key) for key in ("tp_size", "pp_size", "dp_size")]
    if None in sizes:
        return None
    return math.prod(size for size in sizes if size is not None)


def apply_cpu_engine(
    flags: dict[str, Any],
    origins: dict[str, str],
    env: dict[str, Any],
    cpus: list[int],
    where: str,
) -> dict[str, Any]:
    """A CPU server's flags (in place) and its engine environment (returned)."""
    flags["device"] = "cpu"
    origins["device"] = f"{where}.device"
    if flags.get("attention_backend") is None:
        flags["attention_backend"] = CPU_ATTENTION_BACKEND
        origins["attention_backend"] = f"{where}.device"
    engine_env = dict(CPU_ENGINE_ENV)
    ranks = _cpu_ranks(flags)
    if CPU_BIND_ENV in env or ranks is None:
        return engine_env  # an env layer binds the ranks itself; host_checks.py reports bad sizes
    if cpus:
        bind = cpu_threads_bind(cpus, ranks)
        if bind is None:
            raise ServerConfigError(
                f"{where}.cpus",
                f"{len(cpus)} CPUs do not split evenly over {ranks} ranks (tp_size x pp_size x "
                f"dp_size); list a multiple of {ranks} CPUs",
            )
        engine_env[CPU_BIND_ENV] = bind
    elif ranks > 1:
        raise ServerConfigError(
            f"{where}.cpus",
            f"a CPU server with {ranks} ranks needs its CPUs: list them in cpus (split evenly "
            f"over the ranks) or set env.{CPU_BIND_ENV} ('0-23|24-47'); without either SGLang "
            "runs at most one rank per NUMA node",
        )
    return engine_env


def device_fields(
    server: Mapping[str, Any], where: str, default: str
) -> tuple[str, list[int], list[int]]:
    """(device, gpus, cpus) of a server: a GPU server lists gpus, a CPU server none."""
    device = check_device(server.get("device", default), f"{where}.device")
    if device == "cpu":
        if server.get("gpus") is not None:
            raise ServerConfigError(
                f"{where}.gpus", "a CPU server (device: cpu) uses no GPUs: leave gpus out"
            )
        return device, [], _check_cpus(server.get("cpus"), where)
    if server.get("cpus") is not None:
        raise ServerConfigError(f"{where}.cpus", "only applies to a CPU server (device: cpu)")
    return device, check_gpus(server.get("gpus"), where), []
