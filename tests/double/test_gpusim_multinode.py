"""One SGLang server across simulated hosts: nodes as processes on loopback, one state dir each.

Each "host" is its own GPUSIM_STATE_DIR (its own GPUs, nvidia-smi and process registry); the
nodes meet on a dist-init port on 127.0.0.1, as real nodes meet on node 0's address.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from gpusim.distributed import (
    gloo_failure,
    nccl_bootstrap,
    nccl_debug_lines,
    nccl_interfaces,
    parse_address,
)
from gpusim.memory import GIB, MemoryArgs, cell_size_bytes, plan_memory, weight_gib_per_rank
from gpusim.model import load_model
from gpusim.state import Hardware
from gpusim_helpers import (
    LLAMA,
    Server,
    free_port,
    init_root,
    port_is_bound,
    start_server,
)

from gpusim import state

slow = pytest.mark.slow
GPU_MIB = Hardware().gpu_memory_mib
LLAMA_WEIGHT_GIB = load_model(LLAMA).weight_bytes / GIB  # 14.96 GiB
EXIT_WAIT_S = 20
SCHEDULER_CRASH = "Scheduler hit an exception"
LAUNCH_SIGQUIT = "Received sigquit from a child process. It usually means the child failed."
RUNNING_SIGQUIT = "SIGQUIT received. signum=None, frame=None. It usually means one child failed."
PEER_CLOSED = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "


# -- helpers ----------------------------------------------------------------------------------


def start_node(
    tmp_path: Path,
    servers: list[Server],
    node_rank: int,
    nnodes: int,
    dist_port: int,
    *flags: str,
    tp: int = 4,
    timeout_s: int = 60,
    **env: str,
) -> Server:
    """Node `node_rank` of a group: its own simulated host, the group's flags."""
    root = tmp_path / f"host{node_rank}"
    if not root.exists():
        init_root(root)
    server = start_server(
        root,
        tmp_path,
        *("--model-path", LLAMA, "--tp-size", str(tp)),
        *("--nnodes", str(nnodes), "--node-rank", str(node_rank)),
        *("--dist-init-addr", f"127.0.0.1:{dist_port}", "--dist-timeout", str(timeout_s)),
        *flags,
        **env,
    )
    servers.append(server)
    return server


def form_group(
    tmp_path: Path, servers: list[Server], nnodes: int, tp: int, **env: str
) -> list[Server]:
    dist_port = free_port()
    nodes = [
        start_node(tmp_path, servers, n, nnodes, dist_port, tp=tp, **env) for n in range(nnodes)
    ]
    for node in nodes:
        node.wait_ready()
    return nodes


def registered(node: Server) -> list[state.GpuProc]:
    return state.live_procs(node.root, prune=False)


def generate(node: Server, tokens: int = 4) -> dict:
    body = {"text": "hello there", "sampling_params": {"max_new_tokens": tokens}}
    request = urllib.request.Request(
        node.url + "/generate", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=20) as response:
        return json.loads(response.read())


def wait_exit(node: Server) -> int:
    return node.proc.wait(EXIT_WAIT_S)


def wait_for_line(node: Server, text: str) -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    while time.monotonic() < deadline and node.proc.poll() is None:
        if text in node.log():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in log (exit {node.proc.poll()}):\n{node.log()}")


# -- the group forms, serves and stops --------------------------------------------------------


@slow
def test_two_nodes_form_one_server_each_holding_its_half(
    tmp_path: Path, servers: list[Server]
) -> None:
    node0, node1 = form_group(tmp_path, servers, nnodes=2, tp=4)
    reply = generate(node0)
    assert reply["meta_info"]["completion_tokens"] == 4
    # Node 1 serves SGLang's dummy health server and nothing else.
    assert node1.status("/health") == node1.status("/health_generate") == 200
    assert node1.status("/ping") == 200
    assert node1.status("/v1/models") == 404
    # State per host: each registry holds only its node's ranks, on its own GPUs 0 and 1.
    names0 = {(p.gpu_index, p.name) for p in registered(node0)}
    names1 = {(p.gpu_index, p.name) for p in registered(node1)}
    assert names0 == {(0, "sglang::scheduler_TP0"), (1, "sglang::scheduler_TP1")}
    assert names1 == {(0, "sglang::scheduler_TP2"), (1, "sglang::scheduler_TP3")}
    # Every rank holds 1/tp of the weights, so each node holds half of the model.
    share = f"mem usage={LLAMA_WEIGHT_GIB / 4:.2f} GB."
    for node, ranks in ((node0, ("TP0", "TP1")), (node1, ("TP2", "TP3"))):
        lines = [line for line in node.log().splitlines() if "Load weight end" in line]
        assert [line.split("]")[0].split()[-1] for line in lines] == list(ranks)
        assert all(share in line for line in lines)
    assert "The server is fired up and ready to roll!" in node0.log()
    assert "The server is fired up and ready to roll!" not in node1.log()
    assert "Dummy health check server started in background thread at 127.0.0.1:" in node1.log()
    # Both nodes size the same KV pool and the rank memory matches on both hosts.
    used0 = sorted(p.used_mib for p in registered(node0))
    used1 = sorted(p.used_mib for p in registered(node1))
    assert used0 == used1


@slow
def test_three_nodes_node0_waits_for_the_last_one(tmp_path: Path, servers: list[Server]) -> None:
    dist_port = free_port()
    node0 = start_node(tmp_path, servers, 0, 3, dist_port, tp=3)
    node1 = start_node(tmp_path, servers, 1, 3, dist_port, tp=3)
    wait_for_line(node1, "Init parallel begin.")
    wait_for_line(node0, "Init parallel begin.")
    # Node 2 has not started: node 0 is still in the rendezvous, so still starting.
    assert node0.status("/health") == 503
    assert "Init parallel ends" not in node0.log()
    node2 = start_node(tmp_path, servers, 2, 3, dist_port, tp=3)
    for node in (node0, node1, node2):
        node.wait_ready()
    assert generate(node0)["meta_info"]["completion_tokens"] == 4
    assert [p.name for p in registered(node2)] == ["sglang::scheduler_TP2"]


@slow
def test_stopping_node0_stops_the_group_and_followers_ignore_sigterm(
    tmp_path: Path, servers: list[Server]
) -> None:
    node0, node1 = form_group(tmp_path, servers, nnodes=2, tp=2)
    node1.proc.send_signal(signal.SIGTERM)
    wait_for_line(node1, "SIGTERM received on node_rank 1; waiting for the rank-0 ShutdownReq")
    assert node1.proc.poll() is None
    assert node0.status("/health") == 200
    node0.proc.send_signal(signal.SIGTERM)
    assert wait_exit(node0) == 0
    assert wait_exit(node1) == 0  # node 0's ShutdownReq
    (pid,) = {int(line.split()[-4]) for line in node1.log().splitlines() if "terminated" in line}
    assert f"Scheduler or DataParallelController {pid} terminated with 0" in node1.log()
    assert registered(node0) == registered(node1) == []
    assert not port_is_bound(node0.port) and not port_is_bound(node1.port)


# -- a node that never comes, or goes ---------------------------------------------------------


@slow
def test_node0_gives_up_after_the_dist_timeout_with_torchs_message(
    tmp_path: Path, servers: list[Server]
) -> None:
    dist_port = free_port()
    node0 = start_node(tmp_path, servers, 0, 2, dist_port, tp=4, timeout_s=1)
    assert wait_exit(node0) == -signal.SIGKILL
    log = node0.log()
    assert SCHEDULER_CRASH in log
    # torch counts ranks: node 0's two of the world's four joined.
    assert (
        "torch.distributed.DistStoreError: Timed out after 2 seconds waiting for clients. "
        "2/4 clients joined." in log
    )
    assert LAUNCH_SIGQUIT in log
    assert "Load weight begin" not in log
    assert registered(node0) == []
    assert not port_is_bound(dist_port)


@slow
def test_a_node_without_node0_gives_up_after_the_dist_timeout(
    tmp_path: Path, servers: list[Server]
) -> None:
    dist_port = free_port()
    node1 = start_node(tmp_path, servers, 1, 2, dist_port, tp=4, timeout_s=1)
    assert wait_exit(node1) == -signal.SIGKILL
    assert (
        "torch.distributed.DistNetworkError: The client socket has timed out after 1000ms "
        f"while trying to connect to (127.0.0.1, {dist_port})." in node1.log()
    )
    assert registered(node1) == []
    assert not port_is_bound(node1.port)


@slow
def test_a_killed_node_takes_node0_down(tmp_path: Path, servers: list[Server]) -> None:
    node0, node1 = form_group(tmp_path, servers, nnodes=2, tp=2)
    node1.proc.kill()
    assert wait_exit(node0) == -signal.SIGKILL
    log = node0.log()
    assert SCHEDULER_CRASH in log and PEER_CLOSED + "closed by peer [127.0.0.1]:" in log
    assert RUNNING_SIGQUIT in log  # node 0 was serving: the tokenizer manager's handler
    assert registered(node0) == []


@slow
def test_a_killed_node0_takes_the_other_nodes_down(tmp_path: Path, servers: list[Server]) -> None:
    node0, node1, node2 = form_group(tmp_path, servers, nnodes=3, tp=3)
    node0.proc.kill()
    for node in (node1, node2):
        assert wait_exit(node) == -signal.SIGKILL
        assert PEER_CLOSED + "closed by peer [127.0.0.1]:" in node.log()
        assert LAUNCH_SIGQUIT in node.log()
        assert registered(node) == []


@slow
def test_systemd_stopping_a_follower_ends_it_cleanly_and_the_group_with_it(
    tmp_path: Path, servers: list[Server]
) -> None:
    node0, node1 = form_group(tmp_path, servers, nnodes=2, tp=4)
    ranks = [p.pid for p in registered(node1)]
    for pid in [node1.proc.pid, *ranks]:  # SIGTERM to every process (a kill of the whole group)
        os.kill(pid, signal.SIGTERM)
    assert wait_exit(node1) == 0
    for pid in ranks:
        assert f"Scheduler or DataParallelController {pid} terminated with -15" in node1.log()
    assert wait_exit(node0) == -signal.SIGKILL
    assert PEER_CLOSED in node0.log()


@slow
def test_one_dead_scheduler_brings_its_node_and_the_group_down(
    tmp_path: Path, servers: list[Server]
) -> None:
    node0, node1 = form_group(tmp_path, servers, nnodes=2, tp=4)
    victim, survivor = (p.pid for p in registered(node1))
    os.kill(victim, signal.SIGKILL)
    assert wait_exit(node1) == -signal.SIGKILL  # its sibling's gloo pair broke
    log = node1.log()
    assert f"Scheduler or DataParallelController {victim} terminated with -9" in log
    assert PEER_CLOSED in log and LAUNCH_SIGQUIT in log
    assert f"{survivor} terminated" not in log
    assert wait_exit(node0) == -signal.SIGKILL


@slow
def test_a_late_or_duplicate_node_is_turned_away(tmp_path: Path, servers: list[Server]) -> None:
    node0, _ = form_group(tmp_path, servers, nnodes=2, tp=2)
    dist_port = int(node0.log().split("'dist_init_addr': '127.0.0.1:")[1].split("'")[0])
    extra = start_server(
        init_root(tmp_path / "host-extra"),
        tmp_path,
        *("--model-path", LLAMA, "--tp-size", "2", "--nnodes", "2", "--node-rank", "1"),
        *("--dist-init-addr", f"127.0.0.1:{dist_port}"),
    )
    servers.append(extra)
    assert wait_exit(extra) == -signal.SIGKILL
    assert PEER_CLOSED in extra.log()
    assert node0.status("/health") == 200


# -- memory per node --------------------------------------------------------------------------


@slow
def test_the_group_sizes_kv_by_its_least_free_gpu(tmp_path: Path, servers: list[Server]) -> None:
    dist_port = free_port()
    host1 = init_root(tmp_path / "host1")
    # A foreign job on host 1 takes 4000 MiB of its GPU 0 (under the 10% balance limit).
    state.register(os.getpid(), 0, 4000, "python3", host1)
    nodes = [start_node(tmp_path, servers, n, 2, dist_port, tp=4) for n in (0, 1)]
    for node in nodes:
        node.wait_ready()
    with urllib.request.urlopen(nodes[0].url + "/server_info", timeout=10) as response:
        tokens = json.loads(response.read())["max_total_num_tokens"]
    model, args = load_model(LLAMA), MemoryArgs(tp_size=4, nnodes=2)
    expected = plan_memory(
        model, args, GPU_MIB, [GPU_MIB] * 2, 400 * GIB, group_min_free_mib=GPU_MIB - 4000
    )
    alone = plan_memory(model, MemoryArgs(tp_size=4, nnodes=2), GPU_MIB, [GPU_MIB] * 2, 400 * GIB)
    assert tokens == expected.max_total_num_tokens < alone.max_total_num_tokens
    state.unregister(os.getpid(), host1)


def norms_gib() -> float:
    """The Llama's RMSNorm weights (two per layer and the final one), whole on every GPU."""
    return (2 * 4096 * 32 + 4096) * 2 / GIB


def test_weights_split_over_every_rank_of_the_group() -> None:
    llama = load_model(LLAMA)
    one_node = weight_gib_per_rank(llama, MemoryArgs(tp_size=8))
    two_nodes = weight_gib_per_rank(llama, MemoryArgs(tp_size=16, nnodes=2))
    # 8 GPUs per node either way: about half the model per node. Not exactly: the Llama has 8
    # KV heads, so at tp 16 QKVParallelLinear gives each GPU one of them (two GPUs hold each),
    # k + v of one head, 2 x 4096 x 128 x 32 layers x 2 B = 64 MiB per GPU at tp 8 and at
    # tp 16 (16-way splitting would give 32), and the norms, whole on every GPU either way.
    kv_all = 2 * 4096 * 8 * 128 * 32 * 2
    assert two_nodes == pytest.approx(one_node / 2 + kv_all / 16 / GIB + norms_gib() / 2)
    # Pipeline stages across nodes: each stage holds its layers' weights and KV.
    staged = MemoryArgs(tp_size=8, pp_size=2, nnodes=2)
    assert weight_gib_per_rank(llama, staged) == one_node / 2
    assert cell_size_bytes(llama, 8, "auto", pp_size=2) == cell_size_bytes(llama, 8, "auto") / 2
    # 61 layers over 2 stages: the larger stage has 31 (SGLang gives the last stage the extra).
    kimi = load_model(str(Path(LLAMA).parent / "kimi-k2.5-int4"))
    assert cell_size_bytes(kimi, 8, "auto", pp_size=2) == (512 + 64) * 31 * 2


# -- what SGLang rejects ----------------------------------------------------------------------


@slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--tp-size", "3", "--nnodes", "2"), "AssertionError: tp_size must be divisible by"),
        (
            ("--tp-size", "2", "--dp-size", "2", "--nnodes", "2"),
            "AssertionError: multi-node data-parallel replicas are not supported",
        ),
        (("--tp-size", "2", "--nnodes", "0"), "ZeroDivisionError: integer modulo by zero"),
        (
            ("--tp-size", "2", "--nnodes", "2", "--node-rank", "2"),
            "ValueError: gpusim: --node-rank 2 is not in 0..1 (--nnodes 2)",
        ),
    ],
)
def test_bad_node_layouts_fail_before_any_gpu_work(
    tmp_path: Path, servers: list[Server], flags: tuple[str, ...], message: str
) -> None:
    root = init_root(tmp_path / "host0")
    server = start_server(root, tmp_path, "--model-path", LLAMA, *flags)
    servers.append(server)
    assert wait_exit(server) == 1
    assert message in server.log()
    assert registered(server) == []


@slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--dist-timeout", "0"), "AssertionError: timeout must be positive"),
        (
            ("--dist-init-addr", "10.0.0.1"),
            "ValueError: Missing port in address (expected host:port): '10.0.0.1'",
        ),
    ],
)
def test_bad_rendezvous_settings_fail_in_the_scheduler(
    tmp_path: Path, servers: list[Server], flags: tuple[str, ...], message: str
) -> None:
    root = init_root(tmp_path / "host0")
    server = start_server(root, tmp_path, "--model-path", LLAMA, "--tp-size", "2", *flags)
    servers.append(server)
    assert wait_exit(server) == -signal.SIGKILL
    assert SCHEDULER_CRASH in server.log() and message in server.log()


@slow
def test_dist_init_port_in_use(tmp_path: Path, servers: list[Server]) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        node0 = start_node(tmp_path, servers, 0, 2, port, tp=2)
        assert wait_exit(node0) == -signal.SIGKILL
    assert (
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any "
        f"local network address. port: {port}, useIpv6: false, code: -98, "
        "name: EADDRINUSE, message: address already in use" in node0.log()
    )


# -- socket interfaces ------------------------------------------------------------------------


@slow
def test_a_missing_gloo_interface_fails_like_gloo(tmp_path: Path, servers: list[Server]) -> None:
    root = init_root(tmp_path / "host0")
    server = start_server(
        root, tmp_path, "--model-path", LLAMA, GLOO_SOCKET_IFNAME="lo,gpusim-none0"
    )
    servers.append(server)
    assert wait_exit(server) == -signal.SIGKILL
    assert (
        "RuntimeError: [enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/device.cc:84]"
        " ifa != nullptr. Unable to find address for: gpusim-none0" in server.log()
    )


@slow
def test_a_missing_nccl_interface_fails_like_nccl(tmp_path: Path, servers: list[Server]) -> None:
    root = init_root(tmp_path / "host0")
    server = start_server(
        root,
        tmp_path,
        *("--model-path", LLAMA, "--tp-size", "2"),
        NCCL_SOCKET_IFNAME="=gpusim-none0",
        NCCL_DEBUG="WARN",
    )
    servers.append(server)
    assert wait_exit(server) == -signal.SIGKILL
    log = server.log()
    assert "NCCL WARN Bootstrap : no socket interface found" in log
    assert "RuntimeError: NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details)" in log


@slow
def test_the_group_logs_the_interfaces_it_uses(tmp_path: Path, servers: list[Server]) -> None:
    env = {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "INFO"}
    node0, node1 = form_group(tmp_path, servers, nnodes=2, tp=2, **env)
    for node in (node0, node1):
        assert "NCCL INFO NCCL_SOCKET_IFNAME set by environment to lo" in node.log()
        assert "NCCL INFO Bootstrap: Using lo:127.0.0.1<0>" in node.log()


ADDRESSES = {
    "lo": ["127.0.0.1", "::1"],
    "eth0": ["10.0.0.5", "fe80::1"],
    "eth1": ["10.1.0.5"],
    "docker0": ["172.17.0.1"],
    "ib0": [],
    "v6only": ["::1"],
}


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("eth", ["eth0", "eth1"]),  # a prefix
        ("=eth", []),  # exact names only
        ("=eth1", ["eth1"]),
        ("^eth,lo", ["docker0"]),  # everything else (with an address)
        ("^=eth0", ["lo", "eth1", "docker0"]),
        ("eth0:1234,docker", ["eth0", "docker0"]),  # ports are ignored
        ("ib", []),  # no address: not usable
        ("v6only", []),  # IPv6 loopback is skipped
    ],
)
def test_nccl_socket_ifname_matching(spec: str, names: list[str]) -> None:
    assert [name for name, _ in nccl_interfaces(spec, ADDRESSES)] == names


def test_nccl_and_gloo_interface_rules() -> None:
    assert nccl_bootstrap({}, ADDRESSES) == ("eth0", "10.0.0.5")  # NCCL's own choice
    assert nccl_bootstrap({"NCCL_SOCKET_IFNAME": "lo"}, ADDRESSES) == ("lo", "127.0.0.1")
    assert nccl_bootstrap({"NCCL_SOCKET_IFNAME": "wlan"}, ADDRESSES) is None
    assert nccl_debug_lines({"NCCL_SOCKET_IFNAME": "wlan"}, None, 7, 0) == []  # NCCL is quiet
    assert gloo_failure({"GLOO_SOCKET_IFNAME": "eth1"}, ADDRESSES) is None
    assert gloo_failure({"GLOO_SOCKET_IFNAME": "x"}, ADDRESSES) is None  # torch ignores 1 char
    failure = gloo_failure({"GLOO_SOCKET_IFNAME": "eth1,ib0"}, ADDRESSES)
    assert failure is not None and failure.message.endswith("Unable to find address for: ib0")


@pytest.mark.parametrize(
    ("addr", "parsed"),
    [("10.0.0.1:5000", ("10.0.0.1", 5000)), ("[fd00::2]:5000", ("fd00::2", 5000))],
)
def test_dist_init_addr_parsing(addr: str, parsed: tuple[str, int]) -> None:
    assert parse_address(addr) == parsed


@pytest.mark.parametrize(
    ("addr", "error"),
    [
        ("fd00::2:5000", "Bare IPv6 address without brackets is ambiguous"),
        ("host:http", "Invalid port number: 'http'"),
        ("host:70000", "Port out of range (0-65535): 70000"),
        ("[fd00::2", "Missing closing bracket"),
    ],
)
def test_bad_dist_init_addr(addr: str, error: str) -> None:
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        parse_address(addr)


@slow
def test_node_health_is_refused_until_its_ranks_are_up(
    tmp_path: Path, servers: list[Server]
) -> None:
    node1 = start_node(tmp_path, servers, 1, 2, free_port(), tp=2)
    wait_for_line(node1, "Init parallel begin.")
    with pytest.raises(urllib.error.URLError):
        node1.status("/health")  # SGLang starts the dummy server only once its ranks are up
