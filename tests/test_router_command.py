"""The router's command line (sglang_fleet/router.py) and the sglang_router role's filter."""

from __future__ import annotations

import shlex

import pytest
from ansible.errors import AnsibleFilterError
from conftest import load_plugin

from sglang_fleet.router import router_command

PYTHON = "/opt/sglang-router/bin/python"
LAUNCHER = "/opt/sglang-router/bin/sglang-router-launch.py"
FLAGS = {
    "host": "0.0.0.0",
    "port": 8080,
    "worker_urls": ["http://gpu-node-01:8000", "http://gpu-node-02:8000"],
    "policy": "round_robin",
    "disable_circuit_breaker": True,
    "log_dir": None,
}


def test_flags_render_as_the_router_parser_reads_them() -> None:
    command = router_command(FLAGS, python=PYTHON, launcher=LAUNCHER, key_credential="api-key")
    assert command["flag_argv"] == [
        "--disable-circuit-breaker",
        "--host",
        "0.0.0.0",
        "--policy",
        "round_robin",
        "--port",
        "8080",
        "--worker-urls",
        "http://gpu-node-01:8000",
        "http://gpu-node-02:8000",
    ]
    assert command["argv"] == [
        PYTHON,
        LAUNCHER,
        "--api-key-credential",
        "api-key",
        *command["flag_argv"],
    ]
    # Plain words need no systemd quoting: the ExecStart= value splits back into argv.
    assert shlex.split(command["exec_start"]) == command["argv"]


def test_without_a_key_the_launcher_reads_no_credential() -> None:
    command = router_command(FLAGS, python=PYTHON, launcher=LAUNCHER)
    assert "--api-key-credential" not in command["argv"]


@pytest.mark.parametrize("key", ["api_key", "api-key"])
def test_a_key_among_the_flags_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match="credential"):
        router_command({**FLAGS, key: "sk-secret"}, python=PYTHON, launcher=LAUNCHER)


def test_the_filter_wraps_it_and_turns_errors_into_filter_errors() -> None:
    filters = load_plugin("filter_plugins/sglang_router.py").FilterModule().filters()
    command = filters["sglang_router_command"](FLAGS, PYTHON, LAUNCHER, "api-key")
    assert command["exec_start"].startswith(f"{PYTHON} {LAUNCHER} --api-key-credential api-key")
    with pytest.raises(AnsibleFilterError, match="sglang_router"):
        filters["sglang_router_command"](FLAGS, "python3", LAUNCHER)  # not an absolute path
