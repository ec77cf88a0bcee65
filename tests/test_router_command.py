"""The router's command line (sglang_fleet/servers/router_settings.py) and the sglang_router role's
filter."""

from __future__ import annotations

import shlex

import pytest
from ansible.errors import AnsibleFilterError
from conftest import load_plugin

from sglang_fleet.servers.router_settings import router_command, settings_problems

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
    filters = load_plugin("plugins/filter/sglang_router.py").FilterModule().filters()
    command = filters["sglang_router_command"](FLAGS, PYTHON, LAUNCHER, "api-key")
    assert command["exec_start"].startswith(f"{PYTHON} {LAUNCHER} --api-key-credential api-key")
    with pytest.raises(AnsibleFilterError, match="sglang_router"):
        filters["sglang_router_command"](FLAGS, "python3", LAUNCHER)  # not an absolute path


# --- the role's settings (sglang_fleet.servers.router_settings.settings_problems)
# ------------------------------
GOOD_SETTINGS = {
    "workers": ["http://gpu-node-01:8000", "https://[fd00::2]:8000"],
    "port": 30000,
    "prometheus_port": "29000",  # as a templated inventory value arrives
    "version": "0.3.2",
    "wheelhouse": "",
    "index_url": "",
    "extra_flags": {"disable-circuit-breaker": True},
    "owned_flags": ["host", "port", "worker_urls", "policy"],
    "api_key": "",
}


def test_good_settings_have_no_problem() -> None:
    assert settings_problems(GOOD_SETTINGS) == []


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"workers": []}, "sglang_router_workers is empty"),
        ({"workers": ["http://a:8000/"]}, "'http://a:8000/' must be http(s)://host[:port]"),
        # The ports the Jinja rule let through: the HTTP reader refuses them (issue 31).
        ({"workers": ["http://a:0"]}, "'http://a:0' has a bad port (1..65535, no leading zero)"),
        ({"workers": ["http://a:08000"]}, "has a bad port (1..65535, no leading zero)"),
        ({"workers": ["http://a:70000"]}, "'http://a:70000' has a bad port (1..65535)"),
        ({"workers": ["http://A:8000", "http://a:8000"]}, "lists a URL more than once"),
        ({"port": 29000}, "must be different ports in 1-65535 (got 29000 and 29000)"),
        ({"port": "http"}, "must be different ports in 1-65535 (got http and 29000)"),
        ({"prometheus_port": 0}, "must be different ports"),
        ({"version": ">=0.3"}, 'sglang_router_version must be an exact version, got ">=0.3"'),
        ({"wheelhouse": "/srv/wheels", "index_url": "http://mirror/simple"}, "not both"),
        ({"extra_flags": {"worker-urls": ["x"], "api_key": "k"}}, "worker-urls, api_key are set"),
        ({"api_key": "two words"}, "sglang_router_api_key must be one word"),
    ],
)
def test_each_bad_setting_is_named(change: dict, problem: str) -> None:
    problems = settings_problems(GOOD_SETTINGS | change)
    assert len(problems) == 1, problems
    assert problem in problems[0]


def test_every_problem_is_reported_at_once_and_no_key_is_printed() -> None:
    bad = {"workers": ["ftp://x"], "port": 1, "prometheus_port": 1, "api_key": "a secret key"}
    problems = settings_problems(GOOD_SETTINGS | bad)
    assert len(problems) == 3, problems
    assert "a secret key" not in " ".join(problems)


def test_the_filter_hands_the_settings_to_python() -> None:
    filters = load_plugin("plugins/filter/sglang_router.py").FilterModule().filters()
    assert filters["sglang_router_problems"](GOOD_SETTINGS) == []
    assert filters["sglang_router_problems"](GOOD_SETTINGS | {"workers": []})
