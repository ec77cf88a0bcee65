"""Cross-flag rules for resolved server descriptions that need no installed SGLang.

Each problem is `{code, variable, message}`; the message starts with the variable to edit and
gives the numbers and the allowed values, e.g.::

    sglang_server_instances[kimi].flags.hicache_size: 300 GB per rank x 8 ranks on this host
    = 2400.0 GB + SGLang's 10 GiB reserve = 2410.7 GB exceeds host RAM 429.5 GB (409600 MiB);
    at most 52 GB per rank fits

Rules (SGLang checks some of them only after loading weights, or per rank, or not at all):
- tp_size, pp_size, dp_size and nnodes are whole numbers from 1 to MAX_PARALLEL (4096: far
  above any machine, and small enough that the planner's layouts of a flag set stay quick; a
  tp_size of 2**31 - 1 used to keep the pre-flight busy for minutes).
- (tp_size * pp_size) % nnodes == 0 (SGLang's own assertion).
- enable_hierarchical_cache excludes disable_radix_cache (HiCache extends the radix cache).
- HiCache host pool: hicache_size is GB (1e9 bytes) PER RANK; every rank on the host allocates it
  and each checks only its own request against the RAM free at that moment minus 10 GiB, so
  ranks starting together oversubscribe the host. The total must fit: ranks x size + 10 GiB.
- GPUs per node = tp_size * pp_size / nnodes per data-parallel replica (dp_size replicas, or one
  when enable_dp_attention puts the DP ranks inside the TP group); the GPU set must match it.
- Every GPU index exists on the host; mem_fraction_static in (0, 1) (SGLang does not check it);
  port in 1..65535; servers on one host share no GPU and no port, and their HiCache pools fit
  the host RAM together.
- A CPU server (device: cpu, docs/CPU-SERVERS.md) has no GPU set to check; it needs
  max_total_tokens (a positive integer): on CPU SGLang sizes the KV pool from the host's free
  RAM, so without a cap one server takes most of the host. Servers on one host share no CPU of
  their `cpus`.
- Speculative decoding (docs/SPECULATIVE.md; sglang_fleet.capacity.speculative has the rules, read
  from SGLang 0.5.23's speculative_hook.py): a known algorithm the planner models; steps,
  top-k and draft tokens set together, draft tokens that SGLang neither replaces (top-k 1:
  steps + 1) nor fails on (top-k > 1: at most topk + (steps - 1) x topk^2 + 1); STANDALONE and
  NGRAM without attention DP; EAGLE3 and STANDALONE with a draft path. The draft's directory
  and architecture are checked when the model is read (the pre-flight's plan).
- A server behind a router (its `router` field, docs/ROUTER.md) runs with enable_metrics: the
  drain before its restart reads its /metrics; and it listens where the router reaches it: a
  server on loopback only cannot be a worker of a router that reaches it by another address.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Any

from sglang_fleet.capacity import speculative
from sglang_fleet.module_utils import typed_number
from sglang_fleet.servers.server_values import SERVERS_VAR

INTEGER = typed_number.Range(integer=True)

GB = 10**9
GIB = 2**30
MIB = 2**20
HICACHE_RESERVE_BYTES = 10 * GIB  # SGLang's memory_pool_host.py keeps this much RAM free
PORT_RANGE = (1, 65535)
MAX_PARALLEL = 4096

Problem = dict[str, str]


def _problem(code: str, variable: str, message: str) -> Problem:
    return {"code": code, "variable": variable, "message": f"{variable}: {message}"}


def _flag_var(server: Mapping[str, Any], key: str) -> str:
    return f"{SERVERS_VAR}[{server.get('name')}].flags.{key}"


def _where_set(server: Mapping[str, Any], key: str) -> str:
    """' (set in <variable>)' when the value came from a profile, defaults or an override."""
    origin = (server.get("flag_origins") or {}).get(key)
    own = _flag_var(server, key)
    return f" (set in {origin})" if origin and origin != own else ""


def _int_value(value: Any) -> int | None:
    """An integer (or its text, as Ansible may hand it over); None for anything else, a float
    included (plugins/module_utils/typed_number.py: no huge integer, no long text)."""
    if isinstance(value, float):
        return None
    try:
        return int(typed_number.read(value, "a count", INTEGER))
    except typed_number.NumberError:
        return None


def _parallel_sizes(server: Mapping[str, Any], problems: list[Problem]) -> dict[str, int] | None:
    """tp/pp/dp/nnodes as positive ints, or None after reporting the ones that are not."""
    flags = server.get("flags") or {}
    sizes: dict[str, int] = {}
    for key in ("tp_size", "pp_size", "dp_size", "nnodes"):
        value = _int_value(flags.get(key, 1))
        if value is None or not 1 <= value <= MAX_PARALLEL:
            problems.append(
                _problem(
                    "parallel_size",
                    _flag_var(server, key),
                    f"{flags.get(key)!r}{_where_set(server, key)} must be a whole number from "
                    f"1 to {MAX_PARALLEL}",
                )
            )
        else:
            sizes[key] = value
    return sizes if len(sizes) == 4 else None


def ranks_per_node(flags: Mapping[str, Any], sizes: Mapping[str, int]) -> float:
    """GPU processes of this server on each node."""
    replicas = 1 if flags.get("enable_dp_attention") else sizes["dp_size"]
    return sizes["tp_size"] * sizes["pp_size"] * replicas / sizes["nnodes"]


def _check_nnodes(server: Mapping[str, Any], sizes: Mapping[str, int]) -> list[Problem]:
    tp, pp, nnodes = sizes["tp_size"], sizes["pp_size"], sizes["nnodes"]
    if (tp * pp) % nnodes == 0:
        return []
    return [
        _problem(
            "nnodes_divides_tp_pp",
            _flag_var(server, "nnodes"),
            f"tp_size {tp} x pp_size {pp} = {tp * pp} is not divisible by nnodes {nnodes}; "
            f"nnodes must divide {tp * pp}",
        )
    ]


def _check_gpu_set(
    server: Mapping[str, Any], sizes: Mapping[str, int], gpu_count: int | None
) -> list[Problem]:
    flags = server.get("flags") or {}
    gpus = list(server.get("gpus") or [])
    variable = f"{SERVERS_VAR}[{server.get('name')}].gpus"
    problems: list[Problem] = []
    needed = ranks_per_node(flags, sizes)
    if needed != len(gpus):
        replicas = "1 (DP attention)" if flags.get("enable_dp_attention") else sizes["dp_size"]
        problems.append(
            _problem(
                "gpu_count_mismatch",
                variable,
                f"{len(gpus)} GPUs {gpus} but tp_size {sizes['tp_size']} x pp_size "
                f"{sizes['pp_size']} x dp replicas {replicas} / nnodes {sizes['nnodes']} = "
                f"{needed:g} GPUs per node; list {needed:g} GPUs or change tp_size",
            )
        )
    if gpu_count is not None:
        missing = [gpu for gpu in gpus if not 0 <= gpu < gpu_count]
        if missing:
            problems.append(
                _problem(
                    "gpu_missing",
                    variable,
                    f"GPU {', '.join(map(str, missing))} does not exist: this host has "
                    f"{gpu_count} GPUs (0..{gpu_count - 1})",
                )
            )
    return problems


def _check_cpu_tokens(server: Mapping[str, Any]) -> list[Problem]:
    """A CPU server's KV pool must be capped (docs/CPU-SERVERS.md)."""
    flags = server.get("flags") or {}
    value = _int_value(flags.get("max_total_tokens"))
    if value is not None and value >= 1:
        return []
    shown = flags.get("max_total_tokens")
    return [
        _problem(
            "cpu_max_total_tokens",
            _flag_var(server, "max_total_tokens"),
            f"{shown!r}{_where_set(server, 'max_total_tokens')} must be an integer >= 1 on a CPU "
            "server (device: cpu): SGLang's CPU engine sizes the KV pool from the host's free "
            "RAM unless it is capped; the planner (sglang_fleet.capacity.planner) prints what fits",
        )
    ]


def _check_radix(server: Mapping[str, Any]) -> list[Problem]:
    flags = server.get("flags") or {}
    if flags.get("enable_hierarchical_cache") and flags.get("disable_radix_cache"):
        return [
            _problem(
                "hicache_needs_radix_cache",
                _flag_var(server, "disable_radix_cache"),
                "hierarchical cache (enable_hierarchical_cache"
                f"{_where_set(server, 'enable_hierarchical_cache')}) extends the radix cache and "
                "cannot run with disable_radix_cache; set one of them to false",
            )
        ]
    return []


def hicache_bytes(server: Mapping[str, Any], ranks: float) -> tuple[float, float] | None:
    """(GB per rank, host bytes) of the server's HiCache pool, None without a fixed size."""
    flags = server.get("flags") or {}
    if not flags.get("enable_hierarchical_cache"):
        return None
    size_gb = typed_number.finite_or_none(flags.get("hicache_size", 0))
    if not size_gb or size_gb <= 0:
        # Without hicache_size the pool is hicache_ratio x the GPU KV pool, known only at start.
        return None
    return size_gb, size_gb * GB * ranks


def _fits_per_rank(ram_bytes: int, ranks: float) -> int:
    return max(0, int((ram_bytes - HICACHE_RESERVE_BYTES) / ranks // GB))


def _ram_text(ram_mib: int) -> str:
    return f"{ram_mib * MIB / GB:.1f} GB ({ram_mib} MiB)"


def _check_hicache_ram(
    server: Mapping[str, Any], sizes: Mapping[str, int], ram_mib: int | None
) -> list[Problem]:
    flags = server.get("flags") or {}
    ranks = ranks_per_node(flags, sizes)
    pool = hicache_bytes(server, ranks)
    if pool is None or ram_mib is None or ranks <= 0:
        return []
    size_gb, need = pool
    ram = ram_mib * MIB
    if need + HICACHE_RESERVE_BYTES <= ram:
        return []
    return [
        _problem(
            "hicache_host_ram",
            _flag_var(server, "hicache_size"),
            f"{size_gb:g} GB per rank{_where_set(server, 'hicache_size')} x {ranks:g} ranks on "
            f"this host (tp_size {sizes['tp_size']}) = {need / GB:.1f} GB + SGLang's 10 GiB "
            f"reserve = {(need + HICACHE_RESERVE_BYTES) / GB:.1f} GB exceeds host RAM "
            f"{_ram_text(ram_mib)}; at most {_fits_per_rank(ram, ranks)} GB per rank fits",
        )
    ]


def _check_mem_fraction(server: Mapping[str, Any]) -> list[Problem]:
    flags = server.get("flags") or {}
    if flags.get("mem_fraction_static") is None:
        return []
    value = typed_number.finite_or_none(flags["mem_fraction_static"])
    if value is not None and 0 < value < 1:
        return []
    return [
        _problem(
            "mem_fraction_range",
            _flag_var(server, "mem_fraction_static"),
            f"{flags['mem_fraction_static']!r}{_where_set(server, 'mem_fraction_static')} must "
            "be a number strictly between 0 and 1 (SGLang does not check it and fails at start)",
        )
    ]


def _check_speculative(server: Mapping[str, Any]) -> list[Problem]:
    """What SGLang 0.5.23 refuses, fails on or silently changes in the --speculative-* flags;
    the target is not read yet, so an EAGLE start without a draft path is left to the plan."""
    flags = server.get("flags") or {}
    try:
        speculative.settings(flags, None)
    except speculative.SpeculationError as exc:
        return [
            _problem(
                "speculative_flags",
                _flag_var(server, exc.flag),
                f"{flags.get(exc.flag)!r}{_where_set(server, exc.flag)}: {exc.message}",
            )
        ]
    return []


def _check_port(server: Mapping[str, Any]) -> list[Problem]:
    port = _int_value(server.get("port"))
    low, high = PORT_RANGE
    if port is not None and low <= port <= high:
        return []
    return [
        _problem(
            "port_range",
            f"{SERVERS_VAR}[{server.get('name')}].port",
            f"{server.get('port')!r} must be an integer in {low}..{high}",
        )
    ]


LOOPBACK_HOSTS = ("127.", "localhost", "::1", "[::1]")


def _is_loopback(host: str) -> bool:
    return host.lower().startswith(LOOPBACK_HOSTS)


def _check_router(server: Mapping[str, Any]) -> list[Problem]:
    router = server.get("router")
    if not router:
        return []
    name = server.get("name")
    problems: list[Problem] = []
    if (server.get("flags") or {}).get("enable_metrics") is not True:
        problems.append(
            _problem(
                "router_needs_metrics",
                _flag_var(server, "enable_metrics"),
                f"must be true for a server behind a router (router: {router['url']}): before "
                "its restart the rollout takes it out of the router and waits on its /metrics "
                "until its running requests are done",
            )
        )
    worker_host = urllib.parse.urlsplit(router["worker_url"]).hostname or ""
    host = str(server.get("host") or "")
    if _is_loopback(host) and not _is_loopback(worker_host):
        problems.append(
            _problem(
                "router_cannot_reach",
                f"{SERVERS_VAR}[{name}].host",
                f"{host!r} listens on loopback only, but its router reaches it at "
                f"{router['worker_url']}: set host: 0.0.0.0 (or the address of worker_url)",
            )
        )
    return problems


def _host_int(host: Mapping[str, Any], key: str) -> int | None:
    # Ansible may hand over "8" rather than 8 from a templated mapping.
    return _int_value(host.get(key))


def server_errors(server: dict, host: dict) -> list[dict]:
    """Problems of one resolved server on a host {gpu_count, ram_mib}."""
    problems: list[Problem] = []
    problems += _check_port(server)
    problems += _check_mem_fraction(server)
    problems += _check_radix(server)
    problems += _check_router(server)
    problems += _check_speculative(server)
    cpu = server.get("device") == "cpu"
    if cpu:
        problems += _check_cpu_tokens(server)
    sizes = _parallel_sizes(server, problems)
    if sizes is not None:
        problems += _check_nnodes(server, sizes)
        if not cpu:
            problems += _check_gpu_set(server, sizes, _host_int(host, "gpu_count"))
        problems += _check_hicache_ram(server, sizes, _host_int(host, "ram_mib"))
    return problems


def _shared(servers: list[dict], key: str) -> dict[Any, list[str]]:
    users: dict[Any, list[str]] = {}
    for server in servers:
        values = server.get(key)
        for value in values if isinstance(values, list) else [values]:
            users.setdefault(value, []).append(str(server.get("name")))
    return {value: names for value, names in users.items() if len(names) > 1}


def _with_cpus(servers: list[dict]) -> list[dict]:
    return [server for server in servers if server.get("cpus")]


def _total_hicache(servers: list[dict], ram_mib: int | None) -> list[Problem]:
    if ram_mib is None or len(servers) < 2:
        return []
    parts: list[tuple[str, float]] = []
    for server in servers:
        sizes = _parallel_sizes(server, [])
        if sizes is None:
            continue
        pool = hicache_bytes(server, ranks_per_node(server.get("flags") or {}, sizes))
        if pool is not None:
            parts.append((str(server.get("name")), pool[1]))
    total = sum(need for _name, need in parts)
    if len(parts) < 2 or total + HICACHE_RESERVE_BYTES <= ram_mib * MIB:
        return []
    listing = " + ".join(f"{name} {need / GB:.1f} GB" for name, need in parts)
    return [
        _problem(
            "hicache_host_ram_total",
            f"{SERVERS_VAR}[*].flags.hicache_size",
            f"the servers' HiCache pools together ({listing} = {total / GB:.1f} GB) + SGLang's "
            f"10 GiB reserve exceed host RAM {_ram_text(ram_mib)}",
        )
    ]


def host_errors(servers: list[dict], host: dict) -> list[dict]:
    """Problems between the resolved servers of one host: shared GPUs, ports, host RAM."""
    problems: list[Problem] = []
    for gpu, names in sorted(_shared(servers, "gpus").items(), key=lambda item: str(item[0])):
        problems.append(
            _problem(
                "gpu_shared",
                f"{SERVERS_VAR}[{names[-1]}].gpus",
                f"GPU {gpu} is also used by {', '.join(names[:-1])}; servers on one host need "
                "disjoint GPU sets",
            )
        )
    for cpu, names in sorted(
        _shared(_with_cpus(servers), "cpus").items(), key=lambda item: str(item[0])
    ):
        problems.append(
            _problem(
                "cpu_shared",
                f"{SERVERS_VAR}[{names[-1]}].cpus",
                f"CPU {cpu} is also used by {', '.join(names[:-1])}; CPU servers on one host "
                "need disjoint CPU sets",
            )
        )
    for port, names in sorted(_shared(servers, "port").items(), key=lambda item: str(item[0])):
        problems.append(
            _problem(
                "port_shared",
                f"{SERVERS_VAR}[{names[-1]}].port",
                f"port {port} is also used by {', '.join(names[:-1])}; each server needs its "
                "own port",
            )
        )
    problems += _total_hicache(servers, _host_int(host, "ram_mib"))
    return problems
