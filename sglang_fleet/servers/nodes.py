"""One SGLang server across hosts: which node this host is, and what each node is started with.

A server with `nodes` (inventory host names, node 0 first) runs on each of those hosts with the
same flags plus the multi-node ones SGLang needs (docs/MULTINODE.md):

    --nnodes N  --node-rank R  --dist-init-addr <node 0's address on the interface>:<port>
    NCCL_SOCKET_IFNAME=<this node's interface>  GLOO_SOCKET_IFNAME=<same>

The interface is the server's `interface`, else each host's default-route interface from its
facts; node 0's address is its IPv4 address on that interface. Everything here is checked
before anything stops: a node listed twice, a node the inventory does not know, nodes that
describe the server differently (another node list, another number of GPUs), an interface a
node lacks, a dist-init port that is the server's own port, a privileged port, a port another
server on node 0 listens on or rendezvous at, a loopback address for node 0, two nodes with one
address (one machine under two inventory names).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_DIST_INIT_PORT = 50000
# Ports below this belong to system services (ssh is 22): never a rendezvous port.
MIN_DIST_INIT_PORT = 1024
# Linux interface names: up to 15 characters, no '/', no white space.
INTERFACE_RE = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")
# Flags the node layout sets; a flag layer of a server with nodes may not set them too.
NODE_FLAGS = ("nnodes", "node_rank", "dist_init_addr")
NODE_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


class NodeError(ValueError):
    """A multi-node description is wrong; `variable` names what to fix."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable
        self.message = message


@dataclass(frozen=True)
class Layout:
    """What one node of a multi-node server is started with."""

    nodes: tuple[str, ...]
    node_rank: int
    interface: str
    dist_init_addr: str

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    def flags(self) -> dict[str, Any]:
        return {
            "nnodes": self.nnodes,
            "node_rank": self.node_rank,
            "dist_init_addr": self.dist_init_addr,
        }

    def env(self) -> dict[str, str]:
        return dict.fromkeys(NODE_ENV, self.interface)


def host_facts(facts: Mapping[str, Any] | None, servers: Any) -> dict[str, Any]:
    """What the layout needs of one host, from its Ansible facts and its server list.

    facts: the host's ansible_facts (default_ipv4, interfaces, <interface>.ipv4); servers: its
    sglang_server_instances (only name, nodes and gpus are read).
    """
    facts = facts or {}
    addresses: dict[str, str] = {}
    for name in facts.get("interfaces") or []:
        # Ansible names an interface's facts with '-' and ':' turned into '_'.
        entry = facts.get(str(name).replace("-", "_").replace(":", "_")) or {}
        address = (entry.get("ipv4") or {}).get("address") if isinstance(entry, Mapping) else None
        if address:
            addresses[str(name)] = str(address)
    default = (facts.get("default_ipv4") or {}).get("interface")
    described, ports = {}, {}
    for server in servers if isinstance(servers, list) else []:
        if isinstance(server, Mapping) and isinstance(server.get("name"), str):
            gpus = server.get("gpus")
            described[server["name"]] = {
                "nodes": server.get("nodes"),
                "gpu_count": len(gpus) if isinstance(gpus, list) else None,
            }
            ports[server["name"]] = {
                "port": server.get("port"),
                "dist_init_port": server.get("dist_init_port"),
            }
    return {
        "facts_known": bool(facts),
        "default_interface": str(default) if default else None,
        "addresses": addresses,
        "servers": described,
        "ports": ports,
    }


def _node_names(value: Any, variable: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) < 2:
        raise NodeError(
            variable, "must list two or more inventory hosts, node 0 first (leave it out for one)"
        )
    for node in value:
        if not isinstance(node, str) or not node or node != node.strip():
            raise NodeError(variable, f"{node!r} is not an inventory host name")
    for node in value:
        if value.count(node) > 1:
            raise NodeError(variable, f"lists {node} twice: each host is one node")
    return tuple(value)


def _port(value: Any, variable: str, server_port: int) -> int:
    if value is None:
        value = DEFAULT_DIST_INIT_PORT
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise NodeError(variable, f"{value!r} is not a port number (1..65535)")
    if value < MIN_DIST_INIT_PORT:
        raise NodeError(
            variable,
            f"{value} is a system service's port (below {MIN_DIST_INIT_PORT}; ssh is 22): pick a "
            f"free port from {MIN_DIST_INIT_PORT} to 65535",
        )
    if value == server_port:
        raise NodeError(variable, f"{value} is the server's own port; pick another")
    return value


def _interface_name(value: Any, variable: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not INTERFACE_RE.fullmatch(value):
        raise NodeError(variable, f"{value!r} is not a network interface name (like eth0)")
    return value


def _known(node: str, cluster: Mapping[str, Any], variable: str) -> Mapping[str, Any]:
    known = cluster.get(node)
    if not isinstance(known, Mapping):
        raise NodeError(variable, f"{node} is not a host of the inventory")
    return known


def _interface_of(
    node: str, chosen: str | None, known: Mapping[str, Any], where: str
) -> tuple[str, str]:
    """(interface, IPv4 address) of a node: the chosen interface or its default route's."""
    if not known.get("facts_known"):
        raise NodeError(
            f"{where}.nodes",
            f"no facts of {node}: every node must be in the run (gather facts, and no --limit "
            "that leaves a node out)",
        )
    interface = chosen or known.get("default_interface")
    variable = f"{where}.interface" if chosen else f"{where}.nodes"
    if not interface:
        raise NodeError(variable, f"{node} has no default route: set interface")
    address = (known.get("addresses") or {}).get(interface)
    if not address:
        have = ", ".join(sorted(known.get("addresses") or {})) or "none"
        raise NodeError(
            variable, f"{node} has no IPv4 address on {interface} (its interfaces: {have})"
        )
    return interface, address


def _port_taken(name: str, port: int, node0: str, cluster: Mapping[str, Any], where: str) -> None:
    """Node 0 hosts the rendezvous: no other server there may listen on the port or meet there."""
    known = cluster[node0]
    for other, ports in (known.get("ports") or {}).items():
        if other == name or not isinstance(ports, Mapping):
            continue
        theirs = (known.get("servers") or {}).get(other) or {}
        their_nodes = theirs.get("nodes") if isinstance(theirs.get("nodes"), list) else []
        rendezvous = None
        if their_nodes and their_nodes[0] == node0:
            rendezvous = ports.get("dist_init_port") or DEFAULT_DIST_INIT_PORT
        if port in (ports.get("port"), rendezvous):
            what = "serves on" if port == ports.get("port") else "meets its nodes on"
            raise NodeError(
                f"{where}.dist_init_port",
                f"server {other} on {node0} (node 0) {what} port {port}: give each server "
                "across hosts its own dist_init_port",
            )


def _addresses_apart(
    nodes: tuple[str, ...], chosen: str | None, cluster: Mapping[str, Any], where: str
) -> str:
    """Node 0's address, after checking it is reachable from other hosts and that no two
    nodes share an address (one machine listed under two inventory names)."""
    seen: dict[str, str] = {}
    for node in nodes:
        if node != nodes[0] and not cluster[node].get("facts_known"):
            continue  # refused by name where its own layout is made
        _interface, address = _interface_of(node, chosen, cluster[node], where)
        if node == nodes[0]:
            parsed = ipaddress.ip_address(address.split("%")[0])
            if parsed.is_loopback or parsed.is_unspecified:
                raise NodeError(
                    f"{where}.interface" if chosen else f"{where}.nodes",
                    f"{node} (node 0) has {address} there, which no other host can reach: "
                    "choose the interface the nodes share (interface)",
                )
        if address in seen:
            raise NodeError(
                f"{where}.nodes",
                f"{seen[address]} and {node} both have {address}: one machine under two "
                "inventory names cannot be two nodes",
            )
        seen[address] = node
    return next(iter(seen))  # node 0 is always first


def _same_description(
    name: str, nodes: tuple[str, ...], gpu_count: int, cluster: Mapping[str, Any], where: str
) -> None:
    """Every node describes the server with the same node list and the same number of GPUs."""
    for node in nodes:
        theirs = (_known(node, cluster, f"{where}.nodes").get("servers") or {}).get(name)
        if theirs is None:
            raise NodeError(f"{where}.nodes", f"{node} does not list server {name}")
        if list(theirs.get("nodes") or []) != list(nodes):
            raise NodeError(
                f"{where}.nodes",
                f"{node} lists other nodes for {name} ({theirs.get('nodes')}): all nodes need "
                "the same list, in the same order",
            )
        if theirs.get("gpu_count") != gpu_count:
            raise NodeError(
                f"{where}.gpus",
                f"{node} gives {name} {theirs.get('gpu_count')} GPUs, this host {gpu_count}: "
                "every node needs the same number",
            )


def layout(
    server: Mapping[str, Any],
    where: str,
    *,
    host: str | None,
    cluster: Mapping[str, Any],
    gpu_count: int,
    server_port: int,
) -> Layout | None:
    """The node layout of a server with `nodes` on `host`, or None when `host` is not a node.

    cluster: {hostname: host_facts(...)} for the hosts the inventory knows.
    """
    nodes = _node_names(server.get("nodes"), f"{where}.nodes")
    port = _port(server.get("dist_init_port"), f"{where}.dist_init_port", server_port)
    chosen = _interface_name(server.get("interface"), f"{where}.interface")
    for node in nodes:
        _known(node, cluster, f"{where}.nodes")
    if host is None or host not in nodes:
        return None
    _same_description(str(server.get("name")), nodes, gpu_count, cluster, where)
    _port_taken(str(server.get("name")), port, nodes[0], cluster, where)
    address = _addresses_apart(nodes, chosen, cluster, where)
    interface, _address = _interface_of(host, chosen, cluster[host], where)
    dist_init = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    return Layout(nodes, nodes.index(host), interface, dist_init)


def rollout_groups(
    hosts: list[str], facts: Mapping[str, Mapping[str, Any]]
) -> dict[str, list[str]]:
    """Which rollout plays of playbooks/deploy.yml each checked host joins, in `hosts`' order.

    facts: {host: {servers: the described servers (name, nodes, router), needed: whether the
    check found something to change there}}. A server across hosts restarts on all its nodes
    together, so when any node needs a rollout every node of that server joins `multinode`
    (rolled in one batch). The host's servers on it alone join `routed` (one behind a router:
    one host at a time) or `direct` when the host needs a rollout. A node the run did not check
    (left out by --limit) is refused: its rank would start alone.
    """
    checked = set(hosts)
    groups: dict[str, list[str]] = {host: [] for host in hosts}
    for host in hosts:
        for server in (facts.get(host) or {}).get("servers") or []:
            nodes = list(server.get("nodes") or [])
            missing = [node for node in nodes if node not in checked]
            if missing:
                raise NodeError(
                    f"sglang_server_instances[{server.get('name')}].nodes",
                    f"nodes {', '.join(missing)} are not in this run: every node of a server "
                    "across hosts must be (no --limit that leaves one out)",
                )
            if any((facts.get(node) or {}).get("needed") for node in nodes):
                for node in nodes:
                    if "multinode" not in groups[node]:
                        groups[node].append("multinode")
    for host in hosts:
        entry = facts.get(host) or {}
        alone = [s for s in entry.get("servers") or [] if not s.get("nodes")]
        if entry.get("needed") and alone:
            groups[host].append("routed" if any(s.get("router") for s in alone) else "direct")
    return groups


def restarts_with_nodes(
    servers: list[Mapping[str, Any]], decisions: Mapping[str, list[str]]
) -> list[str]:
    """Names of this host's servers across hosts that any of their nodes decided to restart
    (decisions: {host: names}): a server across hosts restarts on every node or on none."""
    return [
        str(server["name"])
        for server in servers
        if server.get("nodes")
        and any(server["name"] in (decisions.get(node) or []) for node in server["nodes"])
    ]
