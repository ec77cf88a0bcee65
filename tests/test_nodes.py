"""One server across hosts: where each node runs, with what, and every bad layout refused.

A 2-node server (nodes: [gpu-a, gpu-b]) described once, placed on each host from the hosts'
facts as the role's resolve step does (sglang_fleet/servers/nodes.py, docs/MULTINODE.md).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from conftest import load_plugin

from sglang_fleet.servers import nodes
from sglang_fleet.servers.describe import describe_servers
from sglang_fleet.servers.server_values import ServerConfigError

RUNTIME = {
    "python": "/opt/ml-env/bin/python",
    "launch_module": "sglang.launch_server",
    "config_dir": "/etc/sglang",
    "state_dir": "/var/lib/sglang-fleet",
}
WHERE = "sglang_server_instances[kimi]"


def facts(address: str, interface: str = "eth0", extra: dict | None = None) -> dict[str, Any]:
    """Ansible facts of a host, as far as the layout reads them."""
    found = {
        "interfaces": ["lo", interface, *(extra or {})],
        "lo": {"ipv4": {"address": "127.0.0.1"}},
        interface.replace("-", "_"): {"ipv4": {"address": address}},
        "default_ipv4": {"interface": interface, "address": address},
    }
    for name, addr in (extra or {}).items():
        found[name.replace("-", "_")] = {"ipv4": {"address": addr}}
    return found


def kimi(**changes: Any) -> dict[str, Any]:
    server = {
        "name": "kimi",
        "model_path": "/shared/kimi",
        "port": 8000,
        "gpus": [0, 1, 2, 3],
        "nodes": ["gpu-a", "gpu-b"],
        "flags": {"tp_size": 8},
    }
    return {**server, **changes}


def cluster(host: str, servers_of: dict[str, list] | None = None, **known: Any) -> dict:
    """{host, hosts} with gpu-a and gpu-b (both describing kimi) unless told otherwise."""
    hosts_facts = known or {"gpu-a": facts("10.0.0.1"), "gpu-b": facts("10.0.0.2")}
    servers_of = servers_of or {}
    return {
        "host": host,
        "hosts": {
            name: nodes.host_facts(value, servers_of.get(name, [kimi()]))
            for name, value in hosts_facts.items()
        },
    }


def describe(servers: list[dict], place: dict) -> list[dict]:
    return describe_servers(servers, {}, {}, {}, runtime=RUNTIME, cluster=place)


def test_each_node_gets_its_rank_node_0s_address_and_its_own_interface() -> None:
    [a] = describe([kimi()], cluster("gpu-a"))
    [b] = describe([kimi()], cluster("gpu-b"))
    for server, rank in ((a, 0), (b, 1)):
        assert server["node_rank"] == rank
        assert server["nodes"] == ["gpu-a", "gpu-b"]
        assert server["flags"]["nnodes"] == 2
        assert server["flags"]["node_rank"] == rank
        assert server["flags"]["dist_init_addr"] == "10.0.0.1:50000"
        assert server["flags"]["tp_size"] == 8
        assert 'NCCL_SOCKET_IFNAME="eth0"' in server["env_lines"]
        assert 'GLOO_SOCKET_IFNAME="eth0"' in server["env_lines"]
        assert "--dist-init-addr 10.0.0.1:50000" in server["exec_start"]
    assert a["config_hash"] != b["config_hash"]
    assert a["flag_origins"]["node_rank"] == f"{WHERE}.nodes"


def test_tp_size_defaults_to_the_gpus_of_every_node() -> None:
    server = kimi()
    server["flags"] = {}
    [a] = describe([server], cluster("gpu-a"))
    assert a["flags"]["tp_size"] == 8


def test_a_host_that_is_no_node_does_not_run_the_server() -> None:
    other = {"name": "llama", "model_path": "/m", "port": 8001, "gpus": [7]}
    place = cluster("gpu-c", **{"gpu-a": facts("10.0.0.1"), "gpu-b": facts("10.0.0.2")})
    assert [s["name"] for s in describe([kimi(), other], place)] == ["llama"]


def test_the_chosen_interface_and_port_are_used_on_every_node() -> None:
    known = {
        "gpu-a": facts("10.0.0.1", extra={"ib0": "192.168.7.1"}),
        "gpu-b": facts("10.0.0.2", extra={"ib0": "192.168.7.2"}),
    }
    server = kimi(interface="ib0", dist_init_port=29500)
    servers_of = {"gpu-a": [server], "gpu-b": [server]}
    [b] = describe([server], cluster("gpu-b", servers_of, **known))
    assert b["flags"]["dist_init_addr"] == "192.168.7.1:29500"
    assert b["environment"]["NCCL_SOCKET_IFNAME"] == "ib0"


def test_an_operators_nccl_interface_wins() -> None:
    server = kimi(env={"NCCL_SOCKET_IFNAME": "bond0"})
    [a] = describe([server], cluster("gpu-a", {"gpu-a": [server], "gpu-b": [server]}))
    assert a["environment"]["NCCL_SOCKET_IFNAME"] == "bond0"
    assert a["environment"]["GLOO_SOCKET_IFNAME"] == "eth0"


def test_an_ipv6_node_0_is_bracketed() -> None:
    known = {"gpu-a": facts("fd00::1"), "gpu-b": facts("fd00::2")}
    [b] = describe([kimi()], cluster("gpu-b", **known))
    assert b["flags"]["dist_init_addr"] == "[fd00::1]:50000"


def _refusal(server: dict, place: dict) -> ServerConfigError:
    with pytest.raises(ServerConfigError) as raised:
        describe([server], place)
    return raised.value


@pytest.mark.parametrize(
    ("changes", "variable", "words"),
    [
        ({"nodes": ["gpu-a"]}, "nodes", "two or more"),
        ({"nodes": "gpu-a,gpu-b"}, "nodes", "two or more"),
        ({"nodes": ["gpu-a", "gpu-a"]}, "nodes", "lists gpu-a twice"),
        ({"nodes": ["gpu-a", " gpu-b"]}, "nodes", "not an inventory host name"),
        ({"nodes": ["gpu-a", "gpu-z"]}, "nodes", "gpu-z is not a host of the inventory"),
        ({"dist_init_port": 8000}, "dist_init_port", "the server's own port"),
        ({"dist_init_port": 70000}, "dist_init_port", "not a port number"),
        ({"interface": "eth0 ; rm"}, "interface", "not a network interface name"),
        ({"interface": "ib9"}, "interface", "gpu-a has no IPv4 address on ib9"),
        ({"flags": {"tp_size": 8, "nnodes": 3}}, "flags.nnodes", "set from the server's nodes"),
        ({"flags": {"node_rank": 1}}, "flags.node_rank", "set from the server's nodes"),
        ({"router": {"url": "http://gw:8080"}}, "router", "cannot sit behind a router"),
    ],
)
def test_bad_layouts_are_refused_naming_the_variable(changes, variable, words) -> None:
    server = kimi(**changes)
    place = cluster("gpu-a", {"gpu-a": [server], "gpu-b": [server]})
    error = _refusal(server, place)
    assert error.variable == f"{WHERE}.{variable}", error
    assert words in error.message


def test_interface_and_port_need_nodes() -> None:
    server = kimi(interface="eth0")
    del server["nodes"]
    assert _refusal(server, cluster("gpu-a")).variable == f"{WHERE}.interface"


def test_nodes_must_describe_the_server_alike() -> None:
    fewer_gpus = kimi(gpus=[0, 1])
    other_order = kimi(nodes=["gpu-b", "gpu-a"])
    error = _refusal(kimi(), cluster("gpu-a", {"gpu-b": [fewer_gpus]}))
    assert error.variable == f"{WHERE}.gpus"
    assert "gpu-b gives kimi 2 GPUs, this host 4" in error.message
    error = _refusal(kimi(), cluster("gpu-a", {"gpu-b": [other_order]}))
    assert "gpu-b lists other nodes for kimi" in error.message
    error = _refusal(kimi(), cluster("gpu-a", {"gpu-b": []}))
    assert "gpu-b does not list server kimi" in error.message


def test_every_node_must_be_in_the_run() -> None:
    place = cluster("gpu-b", **{"gpu-a": {}, "gpu-b": facts("10.0.0.2")})
    error = _refusal(kimi(), place)
    assert "no facts of gpu-a: every node must be in the run" in error.message


def test_the_cluster_filter_reads_only_what_the_layout_needs() -> None:
    cluster_filter = load_plugin("plugins/filter/sglang_server.py").sglang_server_cluster
    secret = "sk-never-in-the-cluster"
    hostvars = {
        "gpu-a": {"ansible_facts": facts("10.0.0.1"), "sglang_server_instances": [kimi()]},
        "gpu-b": {
            "ansible_facts": facts("10.0.0.2"),
            "sglang_server_instances": [kimi(api_key=secret)],
        },
        "unrelated": {"ansible_facts": facts("10.0.0.9")},
    }
    place = cluster_filter([kimi()], hostvars, "gpu-a")
    assert place["host"] == "gpu-a"
    assert sorted(place["hosts"]) == ["gpu-a", "gpu-b"]
    assert secret not in repr(place)
    assert place["hosts"]["gpu-b"]["servers"]["kimi"] == {
        "nodes": ["gpu-a", "gpu-b"],
        "gpu_count": 4,
    }
    [a] = describe([copy.deepcopy(kimi())], place)
    assert a["flags"]["node_rank"] == 0


# --- which rollout play each host joins (deploy.yml) -------------------------------------------

BIG = {"name": "big", "nodes": ["n1", "n2"], "router": None}
REPLICA = {"name": "llama", "nodes": [], "router": {"url": "http://gw:8080"}}
ALONE = {"name": "solo", "nodes": [], "router": None}


def test_one_node_that_changes_brings_every_node_of_its_server_into_one_batch() -> None:
    facts = {
        "n1": {"servers": [BIG, REPLICA], "needed": False},
        "n2": {"servers": [BIG, REPLICA], "needed": True},
        "other": {"servers": [ALONE], "needed": True},
        "quiet": {"servers": [ALONE], "needed": False},
    }
    groups = nodes.rollout_groups(["n1", "n2", "other", "quiet"], facts)
    assert groups == {
        "n1": ["multinode"],
        "n2": ["multinode", "routed"],
        "other": ["direct"],
        "quiet": [],
    }


def test_nodes_that_need_nothing_stay_out_of_every_rollout_play() -> None:
    facts = {h: {"servers": [BIG], "needed": False} for h in ("n1", "n2")}
    assert nodes.rollout_groups(["n1", "n2"], facts) == {"n1": [], "n2": []}


def test_a_node_left_out_of_the_run_is_refused_with_the_variable() -> None:
    facts = {"n1": {"servers": [BIG], "needed": True}}
    with pytest.raises(nodes.NodeError) as err:
        nodes.rollout_groups(["n1"], facts)
    assert err.value.variable == "sglang_server_instances[big].nodes"
    assert "n2" in err.value.message and "--limit" in err.value.message


def test_a_server_across_hosts_restarts_on_every_node_when_one_node_decided_so() -> None:
    servers = [BIG, {"name": "solo", "nodes": []}]
    assert nodes.restarts_with_nodes(servers, {"n1": [], "n2": ["big"]}) == ["big"]
    assert nodes.restarts_with_nodes(servers, {"n1": [], "n2": []}) == []
    # A single-host server is never added by another host's decision.
    assert nodes.restarts_with_nodes(servers, {"n1": ["solo"], "n2": []}) == []


def test_the_filters_read_the_check_plays_facts() -> None:
    filters = load_plugin("plugins/filter/sglang_server.py").FilterModule().filters()
    hostvars = {
        "n1": {"sglang_server_servers": [BIG], "sglang_server_rollout_needed": True},
        "n2": {"sglang_server_servers": [BIG], "sglang_server_rollout_needed": False},
    }
    assert filters["sglang_rollout_groups"](["n1", "n2"], hostvars) == {
        "n1": ["multinode"],
        "n2": ["multinode"],
    }
    decided = {"n1": {"own": ["big"]}, "n2": {"own": []}}
    assert filters["sglang_node_restarts"]([BIG], decided, "own") == ["big"]
