"""CPU servers (device: cpu) in sglang_fleet/servers/describe.py (cpu_engine.py) and host_checks.py
(docs/CPU-SERVERS.md)."""

from __future__ import annotations

from typing import Any

import pytest

from sglang_fleet.servers.cpu_engine import cpu_threads_bind
from sglang_fleet.servers.describe import describe_servers
from sglang_fleet.servers.host_checks import host_errors, server_errors
from sglang_fleet.servers.server_values import ServerConfigError

RUNTIME = {
    "python": "/opt/ml-env/bin/python",
    "launch_module": "sglang.launch_server",
    "config_dir": "/etc/sglang",
    "state_dir": "/var/lib/sglang-fleet",
}
HOST = {"gpu_count": 0, "ram_mib": 24 * 1024}


def tiny(**changes: Any) -> dict[str, Any]:
    server: dict[str, Any] = {
        "name": "tiny",
        "model_path": "/models/tiny-llama",
        "port": 30000,
        "device": "cpu",
        "flags": {"max_total_tokens": 4096, "context_length": 2048},
    }
    server.update(changes)
    return server


def describe(*servers: dict[str, Any], device: str = "cuda", **kw: Any) -> list[dict[str, Any]]:
    return describe_servers(
        list(servers), {}, {}, kw.pop("defaults", {}), runtime=RUNTIME, device=device
    )


def test_cpu_server_gets_the_engine_environment_and_flags() -> None:
    [server] = describe(tiny())
    assert server["device"] == "cpu"
    assert server["gpus"] == []
    assert server["environment"] == {"SGLANG_USE_CPU_ENGINE": "1"}
    assert "CUDA_VISIBLE_DEVICES" not in server["environment"]
    assert server["env_lines"] == ['SGLANG_USE_CPU_ENGINE="1"']
    argv = server["flag_argv"]
    assert argv[argv.index("--device") + 1] == "cpu"
    assert argv[argv.index("--attention-backend") + 1] == "torch_native"
    assert argv[argv.index("--max-total-tokens") + 1] == "4096"
    assert argv[argv.index("--tp-size") + 1] == "1"
    assert server["flag_origins"]["device"] == "sglang_server_instances[tiny].device"


def test_host_default_device_applies_and_a_server_overrides_it() -> None:
    gpu = {"name": "gpu", "model_path": "/m", "port": 8000, "gpus": [0], "device": "cuda"}
    cpu = {k: v for k, v in tiny().items() if k != "device"}
    by_name = {s["name"]: s for s in describe(gpu, cpu, device="cpu")}
    assert by_name["tiny"]["device"] == "cpu"
    assert by_name["gpu"]["device"] == "cuda"
    assert by_name["gpu"]["environment"] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert "--device" not in by_name["gpu"]["flag_argv"]


def test_an_attention_backend_set_in_a_layer_wins() -> None:
    [server] = describe(tiny(flags={"max_total_tokens": 4096, "attention_backend": "intel_amx"}))
    argv = server["flag_argv"]
    assert argv[argv.index("--attention-backend") + 1] == "intel_amx"


@pytest.mark.parametrize(
    ("changes", "variable"),
    [
        ({"gpus": [0]}, "sglang_server_instances[tiny].gpus"),
        ({"device": "tpu"}, "sglang_server_instances[tiny].device"),
        ({"device": "cuda", "gpus": [0], "cpus": [0]}, "sglang_server_instances[tiny].cpus"),
        ({"cpus": [0, 0]}, "sglang_server_instances[tiny].cpus"),
        ({"flags": {"device": "cpu"}}, "sglang_server_instances[tiny].flags.device"),
        (
            {"env": {"SGLANG_USE_CPU_ENGINE": "0"}},
            "sglang_server_instances[tiny].env.SGLANG_USE_CPU_ENGINE",
        ),
    ],
)
def test_bad_cpu_descriptions_name_the_variable(changes: dict, variable: str) -> None:
    with pytest.raises(ServerConfigError) as caught:
        describe(tiny(**changes))
    assert caught.value.variable == variable


def test_host_device_must_be_known() -> None:
    with pytest.raises(ServerConfigError) as caught:
        describe(tiny(), device="gpu")
    assert caught.value.variable == "sglang_server_device"
    assert "cuda, cpu" in caught.value.message


def test_two_ranks_bind_their_cpus() -> None:
    flags = {"max_total_tokens": 4096, "tp_size": 2}
    [server] = describe(tiny(flags=flags, cpus=[0, 1, 2, 3]))
    assert server["environment"] == {
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_CPU_OMP_THREADS_BIND": "0-1|2-3",
    }


def test_two_ranks_without_cpus_or_bind_are_refused() -> None:
    with pytest.raises(ServerConfigError) as caught:
        describe(tiny(flags={"max_total_tokens": 4096, "tp_size": 2}))
    assert caught.value.variable == "sglang_server_instances[tiny].cpus"
    assert "SGLANG_CPU_OMP_THREADS_BIND" in caught.value.message


def test_an_env_bind_is_kept() -> None:
    flags = {"max_total_tokens": 4096, "tp_size": 2}
    [server] = describe(tiny(flags=flags, env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}))
    assert server["environment"]["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"


def test_uneven_cpus_are_refused() -> None:
    with pytest.raises(ServerConfigError, match="do not split evenly over 2 ranks"):
        describe(tiny(flags={"max_total_tokens": 4096, "tp_size": 2}, cpus=[0, 1, 2]))


@pytest.mark.parametrize(
    ("cpus", "ranks", "bind"),
    [([0, 1], 2, "0|1"), ([0, 1, 2, 5], 1, "0-2,5"), ([4, 5, 6, 7, 8, 9], 3, "4-5|6-7|8-9")],
)
def test_cpu_threads_bind(cpus: list[int], ranks: int, bind: str) -> None:
    assert cpu_threads_bind(cpus, ranks) == bind


def test_max_total_tokens_is_required_on_cpu() -> None:
    [server] = describe(tiny(flags={"context_length": 2048}))
    problems = server_errors(server, HOST)
    assert [p["code"] for p in problems] == ["cpu_max_total_tokens"]
    assert problems[0]["variable"] == "sglang_server_instances[tiny].flags.max_total_tokens"


def test_a_valid_cpu_server_has_no_problems_and_no_gpu_check() -> None:
    [server] = describe(tiny())
    assert server_errors(server, HOST) == []


def test_cpu_servers_share_no_cpu() -> None:
    one = tiny(cpus=[0, 1])
    two = tiny(name="two", port=30001, cpus=[1, 2])
    problems = host_errors(describe(one, two), HOST)
    assert [p["code"] for p in problems] == ["cpu_shared"]
    assert "CPU 1 is also used by tiny" in problems[0]["message"]
