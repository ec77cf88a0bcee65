"""One server across hosts: the rendezvous, the group's liveness and the socket interfaces.

What it stands in for (sglang 0.5.23 `srt/distributed/bootstrap.py`, `parallel_state.py`):
every scheduler calls `torch.distributed.init_process_group(init_method="tcp://<dist-init-addr>",
world_size=tp*pp, timeout=--dist-timeout)`. Rank 0 (node 0) hosts a TCPStore on the dist-init
port (bound on every local address) and waits until all tp*pp ranks have connected; the other
nodes' ranks connect to it, retrying until the same timeout. Afterwards the ranks exchange
requests every scheduler step over gloo (CPU) and tensors over NCCL, so a node that goes away
takes the whole group down. The double does this with one TCP link per node, held by the
launcher: node 0 accepts one link per other node, each node reports its ranks and free GPU
memory, node 0 answers "go" with the group's least free memory (SGLang reduces it over all
ranks before sizing the KV pool), and from then on each end treats the link closing as a
dead peer. A graceful stop of node 0 sends "shutdown" first (SGLang's ShutdownReq broadcast).

Messages are one JSON object per line: {"hello": {...}}, {"go": {...}}, {"shutdown": true}.
Error texts are torch's, gloo's and NCCL's (README, "Multi-node"); file:line parts inside
them vary between torch builds.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import ipaddress
import json
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusim.memory import StartupFailure

# torch's default for the NCCL backend when --dist-timeout is unset (10 minutes).
DEFAULT_DIST_TIMEOUT_S = 600
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0
SIOCGIFADDR = 0x8915
IFNAMSIZ = 16
IF_INET6 = Path("/proc/net/if_inet6")
# NCCL's own interface preference when NCCL_SOCKET_IFNAME is unset.
NCCL_AUTO_ORDER = ("ib", "^docker,lo,virbr", "docker", "lo")
NCCL_DEBUG_LEVELS = {"WARN": 1, "INFO": 2, "ABORT": 0, "VERSION": 0, "TRACE": 3}

PeerLost = Callable[[str, int], None]


# -- addresses --------------------------------------------------------------------------------


def parse_address(addr: str) -> tuple[str, int]:
    """`NetworkAddress.parse` (srt/utils/network.py): host:port or [v6]:port, SGLang's errors."""
    if not addr:
        raise ValueError("Empty address string")
    if addr.startswith("["):
        close = addr.find("]")
        if close == -1:
            raise ValueError(f"Missing closing bracket in IPv6 address: {addr!r}")
        host, rest = addr[1:close], addr[close + 1 :]
        if not _is_ipv6(host):
            raise ValueError(f"Invalid IPv6 address inside brackets: {host!r}")
        if not rest.startswith(":") or len(rest) < 2:
            raise ValueError(f"Expected ':port' after closing bracket, got: {rest!r}")
        return host, _parse_port(rest[1:])
    if ":" not in addr:
        raise ValueError(f"Missing port in address (expected host:port): {addr!r}")
    host, port_text = addr.rsplit(":", 1)
    if not host:
        raise ValueError(f"Empty host in address: {addr!r}")
    if ":" in host and _is_ipv6(host):
        raise ValueError(
            f"Bare IPv6 address without brackets is ambiguous: {addr!r}. "
            f"Use [{host}]:{port_text} instead."
        )
    return host, _parse_port(port_text)


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def _parse_port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"Invalid port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"Port out of range (0-65535): {port}")
    return port


# -- the group as configured by the flags ----------------------------------------------------


@dataclass
class GroupConfig:
    """What one node knows about its group before any network traffic."""

    node_rank: int
    nnodes: int
    world_size: int  # tp * pp: torch's world, counted in ranks
    local_ranks: int
    timeout_s: int
    host: str = "127.0.0.1"
    port: int = 0
    listener: socket.socket | None = None  # node 0's store port, bound before ranks fork
    failure: StartupFailure | None = None  # what the scheduler will raise at init

    @property
    def networked(self) -> bool:
        return self.nnodes > 1 or self.listener is not None


def configure(args: Any, local_ranks: int) -> GroupConfig:
    """Resolve address and timeout like SGLang's bootstrap; bind node 0's port now.

    Failures are recorded, not raised: SGLang meets them in the scheduler, after the launcher
    has logged its arguments and spawned its ranks.
    """
    nnodes, node_rank = args.nnodes, args.node_rank
    world = args.tp_size * getattr(args, "pp_size", 1)
    timeout = getattr(args, "dist_timeout", None)
    group = GroupConfig(node_rank, nnodes, world, local_ranks, timeout or DEFAULT_DIST_TIMEOUT_S)
    if timeout is not None and timeout <= 0:
        group.failure = StartupFailure("AssertionError", "timeout must be positive", "init")
        return group
    try:
        group.host, group.port = _rendezvous_address(args)
    except ValueError as exc:
        group.failure = StartupFailure("ValueError", str(exc), "init")
        return group
    if node_rank == 0 and (nnodes > 1 or getattr(args, "dist_init_addr", None)):
        try:
            group.listener = listen(group.host, group.port)
        except OSError as exc:
            group.failure = bind_failure(group.port, _is_ipv6(group.host), exc)
    return group


def _rendezvous_address(args: Any) -> tuple[str, int]:
    """`_resolve_dist_init_method`: --dist-init-addr, else host and the (random) NCCL port."""
    if getattr(args, "dist_init_addr", None):
        return parse_address(args.dist_init_addr)
    port = getattr(args, "nccl_port", None) or _unused_port()
    return args.host or "127.0.0.1", port


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listen(host: str, port: int) -> socket.socket:
    """TCPStore's server socket: every local address of the family, SO_REUSEADDR as libuv."""
    family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        # Every local address, as torch's TCPStore server does, not only the given host.
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def bind_failure(port: int, ipv6: bool, exc: OSError) -> StartupFailure:
    code = exc.errno or 0
    name = errno.errorcode.get(code, "UNKNOWN")
    return StartupFailure(
        "torch.distributed.DistNetworkError",
        "The server socket has failed to listen on any local network address. "
        f"port: {port}, useIpv6: {str(ipv6).lower()}, code: -{code}, name: {name}, "
        f"message: {os.strerror(code).lower()}",
        "init",
    )


def clients_timeout(timeout_s: int, joined: int, world: int) -> StartupFailure:
    # TCPStore compares whole elapsed seconds with the timeout: it gives up one second late.
    return StartupFailure(
        "torch.distributed.DistStoreError",
        f"Timed out after {timeout_s + 1} seconds waiting for clients. "
        f"{joined}/{world} clients joined.",
        "init",
    )


def connect_timeout(timeout_s: int, host: str, port: int) -> StartupFailure:
    return StartupFailure(
        "torch.distributed.DistNetworkError",
        f"The client socket has timed out after {timeout_s * 1000}ms while trying to connect "
        f"to ({host}, {port}).",
        "init",
    )


def peer_closed(host: str, port: int) -> tuple[str, str]:
    """What a scheduler raises when a gloo peer goes away (its broadcast every step)."""
    shown = f"[{host}]:{port}"
    return (
        "RuntimeError",
        f"[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer {shown}",
    )


# -- socket interfaces (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME) -------------------------------


def interface_addresses() -> dict[str, list[str]]:
    """Addresses per interface, IPv4 first (what getifaddrs gives NCCL and gloo)."""
    found: dict[str, list[str]] = {}
    for _, name in socket.if_nameindex():
        ipv4 = _ipv4_of(name)
        if ipv4 is not None:
            found.setdefault(name, []).append(ipv4)
    with contextlib.suppress(OSError):
        for line in IF_INET6.read_text().splitlines():
            fields = line.split()
            if len(fields) == 6:
                address = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
                found.setdefault(fields[5], []).append(str(address))
    return found


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("256s", name.encode()[: IFNAMSIZ - 1])
        try:
            reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def gloo_failure(env: dict[str, str], addresses: dict[str, list[str]]) -> StartupFailure | None:
    """torch creates one gloo device per name in GLOO_SOCKET_IFNAME (values of 2+ chars)."""
    value = env.get("GLOO_SOCKET_IFNAME", "")
    if len(value) <= 1:
        return None
    for name in filter(None, value.split(",")):
        if not addresses.get(name):
            return StartupFailure(
                "RuntimeError",
                "[enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/device.cc:84] "
                f"ifa != nullptr. Unable to find address for: {name}",
                "init",
            )
    return None


def nccl_interfaces(spec: str, addresses: dict[str, list[str]]) -> list[tuple[str, str]]:
    """NCCL's matching: comma list of prefixes, '=' for exact names, '^' to exclude."""
    exclude = spec.startswith("^")
    spec = spec.removeprefix("^")
    exact = spec.startswith("=")
    spec = spec.removeprefix("=")
    wanted = [item.split(":")[0] for item in spec.split(",") if item]
    chosen: list[tuple[str, str]] = []
    for name, addrs in addresses.items():
        usable = [a for a in addrs if a != "::1"]  # NCCL skips IPv6 loopback
        if not usable:
            continue
        hit = any(name == w if exact else name.startswith(w) for w in wanted)
        if hit != exclude:
            chosen.append((name, usable[0]))
    return chosen


def nccl_bootstrap(env: dict[str, str], addresses: dict[str, list[str]]) -> tuple[str, str] | None:
    """The interface NCCL's bootstrap picks, or None ("no socket interface found")."""
    spec = env.get("NCCL_SOCKET_IFNAME")
    for candidate in [spec] if spec else NCCL_AUTO_ORDER:
        found = nccl_interfaces(candidate, addresses)
        if found:
            return found[0]
    return None


def nccl_failure() -> StartupFailure:
    # sglang's pynccl wrapper: RuntimeError(f"NCCL error: {ncclGetErrorString(ncclInvalidUsage)}")
    return StartupFailure(
        "RuntimeError", "NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details)", "init"
    )


def nccl_debug_lines(
    env: dict[str, str], choice: tuple[str, str] | None, pid: int, device: int
) -> list[str]:
    """What NCCL prints on stdout at NCCL_DEBUG=WARN/INFO while bootstrapping (else nothing)."""
    level = NCCL_DEBUG_LEVELS.get(env.get("NCCL_DEBUG", "").upper(), 0)
    head = f"{socket.gethostname()}:{pid}:{pid} [{device}]"
    lines: list[str] = []
    spec = env.get("NCCL_SOCKET_IFNAME")
    if level >= NCCL_DEBUG_LEVELS["INFO"] and spec:
        lines.append(f"{head} NCCL INFO NCCL_SOCKET_IFNAME set by environment to {spec}")
    if choice is None and level >= NCCL_DEBUG_LEVELS["WARN"]:
        lines.append(f"{head} bootstrap.cc:111 NCCL WARN Bootstrap : no socket interface found")
    elif choice is not None and level >= NCCL_DEBUG_LEVELS["INFO"]:
        lines.append(f"{head} NCCL INFO Bootstrap: Using {choice[0]}:{choice[1]}<0>")
    return lines


# -- the links between nodes -----------------------------------------------------------------


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode() + b"\n"


def _decode(line: bytes) -> dict[str, Any] | None:
    try:
        message = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return message if isinstance(message, dict) else None


@dataclass
class Link:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    node_rank: int = 0
    ranks: int = 0
    min_free_mib: int = 0

    @property
    def peer(self) -> tuple[str, int]:
        name = self.writer.get_extra_info("peername") or ("?", 0)
        return str(name[0]), int(name[1])

    @property
    def local(self) -> tuple[str, int]:
        name = self.writer.get_extra_info("sockname") or ("?", 0)
        return str(name[0]), int(name[1])


async def _until_closed(link: Link) -> dict[str, Any] | None:
    """Read until the peer closes (None) or sends a message (returned)."""
    with contextlib.suppress(ConnectionError):
        while True:
            line = await link.reader.readline()
            if not line:
                return None
            message = _decode(line)
            if message is not None:
                return message
    return None


@dataclass
class Leader:
    """Node 0: the store's host. Waits for every other node, then watches them."""

    group: GroupConfig
    links: dict[int, Link] = field(default_factory=dict)
    joined_ranks: int = 0
    formed: bool = False
    closing: bool = False
    _complete: asyncio.Event = field(default_factory=asyncio.Event)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def gather(self, local_min_free_mib: int) -> int:
        """Return the group's least free MiB once all nodes joined; StartupFailure on timeout."""
        assert self.group.listener is not None
        self.joined_ranks = self.group.local_ranks
        self._server = await asyncio.start_server(self._on_client, sock=self.group.listener)
        if self.group.nnodes > 1:
            waiter = asyncio.ensure_future(self._complete.wait())
            # asyncio.wait, not wait_for: its timeout error differs between Python 3.10 and 3.11.
            done, _ = await asyncio.wait({waiter}, timeout=self.group.timeout_s + 1)
            if not done:
                waiter.cancel()
                raise clients_timeout(
                    self.group.timeout_s, self.joined_ranks, self.group.world_size
                )
        self.formed = True
        least = min([local_min_free_mib, *(link.min_free_mib for link in self.links.values())])
        for link in self.links.values():
            link.writer.write(_encode({"go": {"min_free_mib": least}}))
        return least

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
        except (ConnectionError, ValueError):  # reset, or a line past the stream's limit
            line = b""
        hello = (_decode(line) or {}).get("hello")
        link = Link(reader, writer)
        if self.formed or not self._accept(hello, link):
            # A late, duplicate or foreign node: its next read sees the link closed.
            writer.close()
            return
        self.links[link.node_rank] = link
        self.joined_ranks += link.ranks
        if len(self.links) == self.group.nnodes - 1:
            self._complete.set()

    def _accept(self, hello: Any, link: Link) -> bool:
        if not isinstance(hello, dict):
            return False
        try:
            rank, ranks = int(hello["node_rank"]), int(hello["ranks"])
            link.min_free_mib = int(hello["min_free_mib"])
            sizes = (int(hello["nnodes"]), int(hello["world_size"]))
        except (KeyError, TypeError, ValueError):
            return False
        if sizes != (self.group.nnodes, self.group.world_size):
            return False
        if not 0 < rank < self.group.nnodes or rank in self.links:
            return False
        link.node_rank, link.ranks = rank, ranks
        return True

    def watch(self, on_lost: PeerLost) -> None:
        for link in self.links.values():
            task = asyncio.create_task(self._watch(link, on_lost))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _watch(self, link: Link, on_lost: PeerLost) -> None:
        peer = link.peer
        await _until_closed(link)
        if not self.closing:
            on_lost(*peer)

    async def shutdown(self) -> None:
        """SGLang's ShutdownReq: the other nodes' schedulers stop, then the links close."""
        self.closing = True
        for link in self.links.values():
            with contextlib.suppress(ConnectionError):
                link.writer.write(_encode({"shutdown": True}))
                await link.writer.drain()
            link.writer.close()
        if self._server is not None:
            self._server.close()


@dataclass
class Member:
    """A node >= 1: connects to node 0 (retrying until the timeout), then follows it."""

    group: GroupConfig
    link: Link | None = None
    _task: asyncio.Task[None] | None = None

    async def join(self, local_min_free_mib: int) -> int:
        """Return the group's least free MiB; StartupFailure on timeout or a lost node 0."""
        self.link = await self._connect()
        hello = {
            "node_rank": self.group.node_rank,
            "nnodes": self.group.nnodes,
            "world_size": self.group.world_size,
            "ranks": self.group.local_ranks,
            "min_free_mib": local_min_free_mib,
        }
        self.link.writer.write(_encode({"hello": hello}))
        peer = self.link.peer
        message = await _until_closed(self.link)
        go = (message or {}).get("go")
        if not isinstance(go, dict):
            raise StartupFailure(*peer_closed(*peer), "init")
        return int(go["min_free_mib"])

    async def _connect(self) -> Link:
        loop = asyncio.get_running_loop()
        host, port, timeout = self.group.host, self.group.port, self.group.timeout_s
        deadline = loop.time() + timeout
        delay = RETRY_FIRST_S
        while True:
            attempt = asyncio.ensure_future(asyncio.open_connection(host, port))
            await asyncio.wait({attempt}, timeout=max(deadline - loop.time(), RETRY_FIRST_S))
            if attempt.done() and attempt.exception() is None:
                reader, writer = attempt.result()
                return Link(reader, writer)
            attempt.cancel()
            if attempt.done() and not isinstance(attempt.exception(), OSError):
                raise attempt.exception()  # not a network failure: a bug, show it
            if loop.time() >= deadline:
                raise connect_timeout(timeout, host, port)
            await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
            delay = min(delay * 2, RETRY_MAX_S)

    def watch(self, on_lost: PeerLost, on_shutdown: Callable[[], None]) -> None:
        assert self.link is not None
        self._task = asyncio.create_task(self._watch(self.link, on_lost, on_shutdown))

    @staticmethod
    async def _watch(link: Link, on_lost: PeerLost, on_shutdown: Callable[[], None]) -> None:
        peer = link.peer
        message = await _until_closed(link)
        if message is not None and message.get("shutdown"):
            on_shutdown()
        else:
            on_lost(*peer)
