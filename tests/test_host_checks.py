"""Tests for sglang_fleet/servers/host_checks.py on servers resolved from inventory-shaped data."""

from __future__ import annotations

from typing import Any

import pytest

from sglang_fleet.servers.describe import resolve_servers
from sglang_fleet.servers.host_checks import host_errors, server_errors

# The Kimi job's host (docs/THE-JOB.md): 8 GPUs and 400 GiB of RAM as the test double reports
# it (ansible_memtotal_mb).
HOST = {"gpu_count": 8, "ram_mib": 400 * 1024}
KIMI_FLAGS = {
    "trust_remote_code": True,
    "mem_fraction_static": 0.88,
    "kv_cache_dtype": "fp8_e4m3",
    "enable_hierarchical_cache": True,
    "hicache_size": 48,
    "hicache_write_policy": "write_through",
}


def resolve(*servers: dict[str, Any], profiles: dict | None = None) -> list[dict[str, Any]]:
    described = [
        {"name": "kimi", "model_path": "/m", "port": 8000, "gpus": list(range(8))} | server
        for server in servers
    ]
    return resolve_servers(described, profiles or {}, {}, {})


def one(server: dict[str, Any], host: dict[str, Any] = HOST, **kw: Any) -> list[dict[str, str]]:
    [resolved] = resolve(server, **kw)
    return server_errors(resolved, host)


def codes(problems: list[dict[str, str]]) -> list[str]:
    return [problem["code"] for problem in problems]


def test_the_kimi_job_final_configuration_passes() -> None:
    assert one({"flags": KIMI_FLAGS}) == []


def test_kimi_hicache_300_gb_per_rank_does_not_fit_and_says_what_does() -> None:
    [problem] = one({"flags": KIMI_FLAGS | {"hicache_size": 300}})
    assert problem["code"] == "hicache_host_ram"
    assert problem["variable"] == "sglang_server_instances[kimi].flags.hicache_size"
    message = problem["message"]
    assert message.startswith("sglang_server_instances[kimi].flags.hicache_size: 300 GB per rank")
    # 300 GB x 8 ranks + 10 GiB against 400 GiB; (429.5 GB - 10.7 GB) / 8 = 52 GB per rank.
    for part in ("x 8 ranks", "= 2400.0 GB", "10 GiB", "429.5 GB (409600 MiB)", "at most 52 GB"):
        assert part in message


def test_hicache_limit_is_exact_at_the_boundary() -> None:
    # 52 GB x 8 = 416 GB + 10.74 GB = 426.7 GB fits 429.5 GB; 53 GB x 8 = 434.7 GB does not.
    assert one({"flags": KIMI_FLAGS | {"hicache_size": 52}}) == []
    assert codes(one({"flags": KIMI_FLAGS | {"hicache_size": 53}})) == ["hicache_host_ram"]


def test_hicache_size_counts_only_when_hierarchical_cache_is_on() -> None:
    assert one({"flags": {"hicache_size": 5000}}) == []


def test_hicache_message_names_the_profile_that_set_it() -> None:
    profiles = {"greedy": {"enable_hierarchical_cache": True, "hicache_size": 300}}
    [problem] = one({"profile": "greedy"}, profiles=profiles)
    assert "(set in sglang_server_profiles.greedy.hicache_size)" in problem["message"]


def test_hierarchical_cache_excludes_disabling_the_radix_cache() -> None:
    [problem] = one({"flags": {"enable_hierarchical_cache": True, "disable_radix_cache": True}})
    assert problem["code"] == "hicache_needs_radix_cache"
    assert problem["variable"].endswith("flags.disable_radix_cache")


def test_tp_times_pp_must_be_divisible_by_nnodes() -> None:
    problems = one({"gpus": [0, 1, 2], "flags": {"tp_size": 3, "nnodes": 2}})
    assert "nnodes_divides_tp_pp" in codes(problems)
    [nnodes] = [p for p in problems if p["code"] == "nnodes_divides_tp_pp"]
    assert "tp_size 3 x pp_size 1 = 3 is not divisible by nnodes 2" in nnodes["message"]


@pytest.mark.parametrize(
    ("gpus", "flags", "ok"),
    [
        ([0, 1, 2, 3], {"tp_size": 4}, True),
        ([0, 1, 2, 3], {"tp_size": 8}, False),
        ([0, 1, 2, 3], {"tp_size": 2, "dp_size": 2}, True),
        ([0, 1, 2, 3], {"tp_size": 4, "dp_size": 4, "enable_dp_attention": True}, True),
        ([0, 1, 2, 3], {"tp_size": 4, "dp_size": 2}, False),
        ([0, 1, 2, 3], {"tp_size": 8, "nnodes": 2, "node_rank": 1}, True),
        ([0, 1, 2, 3], {"tp_size": 2, "pp_size": 2}, True),
    ],
)
def test_gpu_set_matches_the_parallel_layout(gpus: list[int], flags: dict, ok: bool) -> None:
    problems = one({"gpus": gpus, "flags": flags})
    assert ("gpu_count_mismatch" not in codes(problems)) is ok


def test_gpu_count_mismatch_message_gives_the_numbers() -> None:
    [problem] = one({"gpus": [0, 1, 2, 3], "flags": {"tp_size": 8}})
    assert problem["variable"] == "sglang_server_instances[kimi].gpus"
    assert "4 GPUs [0, 1, 2, 3] but tp_size 8 x pp_size 1 x dp replicas 1" in problem["message"]
    assert "= 8 GPUs per node" in problem["message"]


def test_gpus_must_exist_on_the_host() -> None:
    [problem] = one({"gpus": [6, 7, 8, 9]}, host={"gpu_count": "8", "ram_mib": "409600"})
    assert problem["code"] == "gpu_missing"
    assert "GPU 8, 9 does not exist: this host has 8 GPUs (0..7)" in problem["message"]


@pytest.mark.parametrize(("value", "ok"), [(0.88, True), (0, False), (1, False), (1.2, False)])
def test_mem_fraction_static_range(value: float, ok: bool) -> None:
    assert (one({"flags": {"mem_fraction_static": value}}) == []) is ok


def test_mem_fraction_static_that_is_no_number() -> None:
    [problem] = one({"flags": {"mem_fraction_static": "abc"}})
    assert problem["code"] == "mem_fraction_range"
    assert "'abc'" in problem["message"] and "between 0 and 1" in problem["message"]


@pytest.mark.parametrize(("port", "ok"), [(1, True), (65535, True), (0, False), (65536, False)])
def test_port_range(port: int, ok: bool) -> None:
    assert ("port_range" not in codes(one({"port": port}))) is ok


def test_parallel_size_that_is_no_integer_is_reported_not_crashed_on() -> None:
    problems = one({"flags": {"tp_size": "eight"}})
    assert codes(problems) == ["parallel_size"]
    assert problems[0]["variable"] == "sglang_server_instances[kimi].flags.tp_size"


def test_two_tp4_servers_on_disjoint_gpus_are_fine() -> None:
    servers = resolve(
        {"name": "a", "gpus": [0, 1, 2, 3]}, {"name": "b", "gpus": [4, 5, 6, 7], "port": 8001}
    )
    assert host_errors(servers, HOST) == []
    assert [server["flags"]["tp_size"] for server in servers] == [4, 4]


def test_servers_sharing_gpus_or_ports_are_reported() -> None:
    servers = resolve({"name": "a", "gpus": [0, 1, 2, 3]}, {"name": "b", "gpus": [3, 4, 5, 6]})
    problems = host_errors(servers, HOST)
    assert codes(problems) == ["gpu_shared", "port_shared"]
    assert problems[0]["message"] == (
        "sglang_server_instances[b].gpus: GPU 3 is also used by a; servers on one host need "
        "disjoint GPU sets"
    )
    assert "port 8000 is also used by a" in problems[1]["message"]


def test_hicache_pools_of_all_servers_must_fit_together() -> None:
    flags = {"enable_hierarchical_cache": True, "hicache_size": 50}
    servers = resolve(
        {"name": "a", "gpus": [0, 1, 2, 3], "flags": flags},
        {"name": "b", "gpus": [4, 5, 6, 7], "port": 8001, "flags": flags},
    )
    # 4 ranks x 50 GB each: 400 GB together + 10.7 GB reserve fits 429.5 GB.
    assert host_errors(servers, HOST) == []
    # 70 GB: each alone fits (280 GB), together (560 GB) they do not.
    bigger = [s | {"flags": s["flags"] | {"hicache_size": 70}} for s in servers]
    assert [server_errors(s, HOST) for s in bigger] == [[], []]
    [problem] = host_errors(bigger, HOST)
    assert problem["code"] == "hicache_host_ram_total"
    assert "a 280.0 GB + b 280.0 GB = 560.0 GB" in problem["message"]


def routed(**changes: Any) -> dict[str, Any]:
    server = {
        "host": "0.0.0.0",
        "flags": {"enable_metrics": True},
        "router": {"url": "http://gw:30000", "worker_url": "http://n1:8000"},
    }
    return server | changes


def test_a_replica_behind_a_router_passes_with_metrics_and_a_reachable_address() -> None:
    assert one(routed()) == []


def test_a_replica_behind_a_router_needs_metrics_for_its_drain() -> None:
    [problem] = one(routed(flags={}))
    assert problem["code"] == "router_needs_metrics"
    assert problem["variable"] == "sglang_server_instances[kimi].flags.enable_metrics"
    assert "/metrics" in problem["message"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_a_replica_on_loopback_cannot_be_reached_by_a_remote_router(host: str) -> None:
    [problem] = one(routed(host=host))
    assert problem["code"] == "router_cannot_reach"
    assert problem["variable"] == "sglang_server_instances[kimi].host"
    assert "host: 0.0.0.0" in problem["message"] and "http://n1:8000" in problem["message"]


def test_a_router_on_the_same_host_may_reach_a_loopback_replica() -> None:
    router = {"url": "http://127.0.0.1:30000", "worker_url": "http://127.0.0.1:8000"}
    assert one(routed(host="127.0.0.1", router=router)) == []


@pytest.mark.parametrize("key", ["tp_size", "pp_size", "dp_size", "nnodes"])
def test_parallel_sizes_past_4096_are_refused_before_the_planner(key: str) -> None:
    """Issue 33: tp_size 2147483647 with nnodes 2147483647 is one GPU per node, which the GPU
    set check passes; the pre-flight's planner then ran for minutes over its layouts."""
    flags = {"tp_size": 2147483647, "nnodes": 2147483647, key: 2147483647}
    problems = one({"gpus": [0], "flags": flags})
    messages = [p["message"] for p in problems if p["code"] == "parallel_size"]
    assert (
        f"sglang_server_instances[kimi].flags.{key}: 2147483647 must be a whole number "
        "from 1 to 4096" in messages
    )


def test_a_parallel_size_of_thousands_of_digits_is_refused_not_a_traceback() -> None:
    problems = one({"gpus": [0], "flags": {"tp_size": "9" * 5000}})
    assert "parallel_size" in codes(problems)
