"""Validators that take a value whole refuse one that ends in a newline (issue 44).

`re.match(r"^...$")` accepts "value\\n": `$` also matches before a string's last newline. Each
validator below now uses fullmatch (or `\\Z`); each test gives it a value that passed before.
A last test reads every product module's compiled expressions, so that a new `$` is caught.
"""

from __future__ import annotations

import re

import pytest
from conftest import load_plugin
from product_regexes import product_regexes, takes_a_last_newline
from sglang_fleet.module_utils import fleet_http, gpu_cleanup_ownership, procfs

from sglang_fleet.servers.describe import describe_servers
from sglang_fleet.servers.server_values import ServerConfigError

RUNTIME = {
    "python": "/opt/ml-env/bin/python",
    "launch_module": "sglang.launch_server",
    "config_dir": "/etc/sglang",
    "state_dir": "/var/lib/sglang-fleet",
}
SERVER = {"name": "kimi", "model_path": "/shared/kimi", "port": 8000, "gpus": [0]}


def test_an_sglang_version_with_a_trailing_newline_is_refused() -> None:
    describe_servers([SERVER], {}, {}, {}, runtime={**RUNTIME, "sglang_version": "0.5.23"})
    with pytest.raises(ServerConfigError, match="sglang_server_sglang_version"):
        describe_servers([SERVER], {}, {}, {}, runtime={**RUNTIME, "sglang_version": "0.5.23\n"})


def test_a_host_label_with_a_trailing_newline_is_no_host_name() -> None:
    assert fleet_http._host_problem("router.example") is None
    assert "is not a host name" in str(fleet_http._host_problem("router.example\n"))


def test_a_worker_url_with_a_trailing_newline_has_the_wrong_shape() -> None:
    workers = load_plugin("plugins/modules/sglang_router_workers.py")
    assert workers.check_worker_url("http://10.0.0.1:8000") is None
    problem = workers.check_worker_url("http://10.0.0.1:8000\n")
    assert problem is not None and "must be http(s)://host[:port]" in problem


def test_a_socket_link_with_a_trailing_newline_is_no_socket() -> None:
    assert procfs.socket_inodes(["socket:[12]", "socket:[13]\n", "/dev/null"]) == {12}


def test_a_device_named_with_a_trailing_newline_is_no_numbered_gpu() -> None:
    discovery = load_plugin("plugins/module_utils/gpu_cleanup_discovery.py")
    assert discovery.device_gpu("/dev/nvidia3", "/dev/nvidia*") == 3
    # Not GPU 0: a device file we cannot number holds every GPU, as before.
    assert discovery.device_gpu("/dev/nvidia0\n", "/dev/nvidia*") == "any"


def test_cgroup_names_are_matched_whole() -> None:
    # /proc/PID/cgroup is read line by line, so no real part ends in a newline; these are the
    # names the container and login rules take whole.
    ours = gpu_cleanup_ownership
    assert ours.container_cgroup("/system.slice/docker-ab.scope") == "docker-ab.scope"
    assert ours.container_cgroup("/system.slice/docker-ab.scope\n") is None
    assert ours.login_uid("/user.slice/user-1000.slice") == 1000
    assert ours.login_uid("/user.slice/user-1000.slice\n") is None
    assert ours.container_root("/kubepods/besteffort/podab/c1") == "/kubepods/besteffort/podab/c1"
    assert ours.container_root("/kubepods/besteffort/podab\n/c1") == ""


# --------------------------------------------------------------------------- every expression


def test_no_product_expression_ends_in_a_dollar_that_takes_a_newline() -> None:
    regexes = product_regexes()
    assert len(regexes) > 40, "the product modules were not all read"
    dollar = [
        f"{regex} = {regex.pattern.pattern!r}"
        for regex in regexes
        if takes_a_last_newline(regex.pattern)
    ]
    assert not dollar, "use fullmatch or \\Z:\n" + "\n".join(dollar)


def test_the_dollar_check_sees_a_dollar() -> None:
    assert takes_a_last_newline(re.compile(r"^(a|(?:b$)+)"))
    assert not takes_a_last_newline(re.compile(r"a\Z"))
    assert not takes_a_last_newline(re.compile(r"a$", re.MULTILINE))
