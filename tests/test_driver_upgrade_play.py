"""playbooks/driver_upgrade.yml's first play for real, in --check, against two inventory hosts
that are this machine (local connection): the nvidia_driver pre-flight and probe (a stub
nvidia-smi per host), the servers described and read (a systemctl stand-in on PATH, last-known-
good records in a private state folder), their router asked (a stand-in answering GET /workers),
the decision, the table, and every refusal before any host is touched. --check never reaches
the plays that change hosts; the refusals stop in the first play whatever the mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PLAYBOOK = ROOT / "playbooks" / "driver_upgrade.yml"


class Router:
    """A stand-in sglang-router: GET /workers answers `workers`."""

    def __init__(self) -> None:
        self.workers: list[dict[str, Any]] = []
        router = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps({"workers": router.workers, "total": len(router.workers)})
                self.send_response(200 if self.path == "/workers" else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def router() -> Iterator[Router]:
    stand_in = Router()
    yield stand_in
    stand_in.server.shutdown()


def replica(name: str, host: str, port: int, router_url: str) -> dict[str, Any]:
    return {
        "name": name,
        "model_path": "/srv/models/llama",
        "port": port,
        "gpus": [0],
        "host": "0.0.0.0",
        "router": {"url": router_url, "worker_url": f"http://{host}:{port}"},
    }


def write_inventory(
    tmp_path: Path, router_url: str, node_b: str = "590.10.01", **group_vars: Any
) -> Path:
    """node-a: driver 580, its replica kimi running; node-b: on `node_b`, its replica kimi."""
    hosts: dict[str, Any] = {}
    for host, version, port in (("node-a", "580.95.05", 8000), ("node-b", node_b, 8001)):
        smi = tmp_path / f"nvidia-smi-{host}"
        smi.write_text(
            "#!/bin/sh\n" + "".join(f"echo '{i}, NVIDIA H200, {version}'\n" for i in range(2)),
            encoding="utf-8",
        )
        smi.chmod(0o755)
        state = tmp_path / "state" / host
        name = "kimi"  # one unit name on both: the hosts share this machine's systemctl
        (state / name / "lkg").mkdir(parents=True)
        (state / name / "lkg" / "meta.json").write_text("{}", encoding="utf-8")
        hosts[host] = {
            "nvidia_driver_nvidia_smi": str(smi),
            "sglang_server_state_dir": str(state),
            "sglang_server_instances": [replica(name, host, port, router_url)],
        }
    inventory = {
        "gpu_hosts": {
            "hosts": hosts,
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "ansible_become": False,
                "nvidia_driver_branch": "590",
                "nvidia_driver_modinfo": str(tmp_path / "no-modinfo"),
                "nvidia_driver_module_version_file": str(tmp_path / "no-module"),
                **group_vars,
            },
        }
    }
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(inventory), encoding="utf-8")
    return path


def run(
    tmp_path: Path, router: Router, *extra: str, check: bool = True, **inventory: Any
) -> subprocess.CompletedProcess[str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    systemctl = bindir / "systemctl"
    systemctl.write_text(
        "#!/bin/sh\necho 'sglang@kimi.service loaded active running x'\n", encoding="utf-8"
    )
    systemctl.chmod(0o755)
    hosts = write_inventory(tmp_path, router.url, **inventory)
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_LOCALHOST_WARNING": "false",
        "ANSIBLE_FORCE_COLOR": "0",
        # Results as JSON: the table's lines unwrapped.
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
    }
    return subprocess.run(
        [str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", str(hosts),
         *(["--check"] if check else []), *extra, str(PLAYBOOK)],
        capture_output=True, text=True, env=env, timeout=300, check=False, cwd=ROOT,
    )  # fmt: skip


def healthy(router: Router) -> None:
    router.workers = [
        {"id": "1", "url": "http://node-a:8000", "is_healthy": True},
        {"id": "2", "url": "http://node-b:8001", "is_healthy": True},
    ]


@pytest.mark.slow
def test_check_mode_says_what_would_happen_and_changes_nothing(
    tmp_path: Path, router: Router
) -> None:
    healthy(router)
    done = run(tmp_path, router)
    out = done.stdout
    assert done.returncode == 0, out
    assert "node-a  580.95.05   590     kimi" in out
    assert "alone, 1 of 1 (replicas behind a router)" in out
    assert "node-b  590.10.01   -       -" in out
    assert "up to date" in out
    assert "check mode: nothing was changed" in out
    # The plays that change hosts have none.
    assert "Take this host's rollout lock" not in out
    assert "Install the driver branch" not in out


@pytest.mark.slow
def test_a_router_below_n_minus_1_refuses_the_run(tmp_path: Path, router: Router) -> None:
    healthy(router)
    router.workers[1]["is_healthy"] = False
    done = run(tmp_path, router)
    assert done.returncode != 0
    assert "driver_upgrade.yml refuses to start; nothing was changed on any host" in done.stdout
    assert "worker http://node-b:8001 is not healthy" in done.stdout
    assert "fatal: [node-a]" in done.stdout and "fatal: [node-b]" in done.stdout


@pytest.mark.slow
def test_a_router_that_does_not_answer_refuses_the_run(tmp_path: Path, router: Router) -> None:
    router.server.shutdown()
    router.server.server_close()
    done = run(tmp_path, router)
    assert done.returncode != 0
    assert "the router's replicas cannot be proven healthy" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["-e", "driver_upgrade_serial=0"], "driver_upgrade_serial: '0' is not a batch size"),
        (["-e", '{"driver_upgrade_serial": [1, "0%"]}'], "driver_upgrade_serial: '0%'"),
        (["-e", "nvidia_driver_branch=latest"], "nvidia_driver_branch: 'latest' is not a driver"),
    ],
    ids=["serial-zero", "serial-zero-percent", "branch-not-numeric"],
)
def test_bad_settings_are_refused_before_any_host_is_read(
    tmp_path: Path, router: Router, extra: list[str], expected: str
) -> None:
    healthy(router)
    done = run(tmp_path, router, *extra)
    assert done.returncode != 0
    assert expected in done.stdout
    assert "Check the branch and probe the driver" not in done.stdout


@pytest.mark.slow
def test_a_branch_too_old_for_the_pinned_cuda_is_refused_in_the_first_play(
    tmp_path: Path, router: Router
) -> None:
    healthy(router)
    done = run(tmp_path, router, "-e", "nvidia_driver_branch=570")
    assert done.returncode != 0
    assert 'nvidia_driver_branch "570" cannot run CUDA 13' in done.stdout
    assert "Decide which hosts change" not in done.stdout


@pytest.mark.slow
def test_a_failed_host_names_its_servers_and_stops_the_rollout(
    tmp_path: Path, router: Router
) -> None:
    """A real run (no --check) in which the first host's first step fails (its lock file's
    folder does not exist, so nothing else can run there): the rescue names the host's servers,
    the lock is given back, and the second host that needed the change is never reached."""
    healthy(router)
    done = run(
        tmp_path,
        router,
        check=False,
        node_b="580.95.05",
        sglang_server_lock_path=str(tmp_path / "missing" / "sglang-fleet.lock"),
    )
    out = done.stdout
    assert done.returncode != 0
    assert "alone, 1 of 2" in out and "alone, 2 of 2" in out
    second_play = out.split("PLAY [Change the driver on the hosts with a replica behind a router")[
        1
    ]
    assert "node-a: the driver change failed:" in second_play
    assert "Running, not through this run's gates: kimi" in second_play
    assert "The rollout stops here; hosts after this one were not touched." in second_play
    assert "[node-b]" not in second_play
    assert "PLAY [Change the driver on the other hosts" not in out
    assert "Install the driver branch" not in out
