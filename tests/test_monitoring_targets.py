"""sglang_fleet.monitoring.scrape_targets (scrape targets from the inventory) and the GPU textfile
reader."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest

from sglang_fleet.monitoring import scrape_targets

ROOT = Path(__file__).resolve().parent.parent
READER = ROOT / "roles" / "monitoring" / "files" / "sglang-fleet-gpu-metrics.py"


def load_reader() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sglang_fleet_gpu_metrics", READER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def host(name: str, *servers: dict, router: dict | None = None) -> dict:
    return {"name": name, "address": f"{name}.lan", "servers": list(servers), "router": router}


SERVER = {"name": "llama", "model_path": "/srv/models/llama-8b", "port": 30000, "host": "0.0.0.0"}


def test_a_server_is_scraped_at_its_host_address_with_its_labels() -> None:
    plan = scrape_targets.targets([host("gpu1", SERVER)], "gw", "/k", 2000, 100)
    assert plan["servers"] == [
        {
            "host": "gpu1",
            "server": "llama",
            "model": "llama-8b",
            "target": "gpu1.lan:30000",
            "credentials_file": "",
        }
    ]
    assert plan["slos"] == [{"host": "gpu1", "server": "llama", "ttft": 2.0, "tpot": 0.1}]


def test_loopback_is_scraped_on_the_monitoring_host_only() -> None:
    local = dict(SERVER, host="127.0.0.1")
    plan = scrape_targets.targets([host("gw", local)], "gw", "/k", 2000, 100)
    assert plan["servers"][0]["target"] == "127.0.0.1:30000"
    with pytest.raises(
        scrape_targets.MonitoringError, match=r"server 'llama' on gpu1 listens on 127"
    ):
        scrape_targets.targets([host("gpu1", local)], "gw", "/k", 2000, 100)


def test_keys_go_to_files_and_never_into_the_plan() -> None:
    keyed = dict(SERVER, api_key="sk-secret")
    plan = scrape_targets.targets([host("gpu1", keyed)], "gw", "/k", 2000, 100)
    assert "sk-secret" not in repr(plan)
    assert plan["servers"][0]["credentials_file"] == "/k/gpu1@llama"
    assert scrape_targets.server_credentials([host("gpu1", keyed)], "/k") == [
        {"path": "/k/gpu1@llama", "key": "sk-secret"}
    ]


def test_a_server_across_hosts_is_scraped_on_its_node_0_only() -> None:
    big = dict(SERVER, nodes=["gpu1", "gpu2"], api_key="k")
    hosts = [host("gpu1", big), host("gpu2", big)]
    plan = scrape_targets.targets(hosts, "gw", "/k", 2000, 100)
    assert [s["host"] for s in plan["servers"]] == ["gpu1"]
    assert [c["path"] for c in scrape_targets.server_credentials(hosts, "/k")] == ["/k/gpu1@llama"]


def test_routers_count_their_workers_and_the_host_slo_wins() -> None:
    gw = host("gw", router={"workers": ["http://a:1", "http://b:1"], "prometheus_port": 29000})
    gpu = dict(host("gpu1", SERVER), slo_ttft_ms=300, slo_tpot_ms=None)
    plan = scrape_targets.targets([gw, gpu], "gw", "/k", 2000, 100)
    assert plan["routers"] == [{"host": "gw", "target": "127.0.0.1:29000", "workers": 2}]
    assert plan["slos"] == [{"host": "gpu1", "server": "llama", "ttft": 0.3, "tpot": 0.1}]


def fake_proc(tmp_path: Path, cgroups: dict[str, str]) -> Path:
    for pid, path in cgroups.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cgroup").write_text(f"0::{path}\n", encoding="utf-8")
    return tmp_path


def gpu(index: int, uuid: str, used: float | None, util: float | None) -> dict:
    """A GPU row as plugins/module_utils/nvidia_smi.parse_csv gives it (None: nvidia-smi's
    [N/A])."""
    return {"index": index, "uuid": uuid, "memory.used": used, "memory.total": 97887,
            "utilization.gpu": util}  # fmt: skip


def app(pid: int, name: str, uuid: str, used: int) -> dict:
    return {"pid": pid, "process_name": name, "gpu_uuid": uuid, "used_memory": used}


def job_host(name: str, address: str = "127.0.0.1", port: object = 29100) -> dict:
    return {
        "name": name,
        "address": f"{name}.lan",
        "job": {"metrics_address": address, "metrics_port": port},
    }


def test_the_job_runner_is_scraped_on_each_job_host() -> None:
    jobs = [job_host("gw"), job_host("gpu1", "0.0.0.0", "29200"), job_host("gpu2", port=0)]
    plan = scrape_targets.targets([host("gpu1", SERVER)], "gw", "/k", 2000, 100, jobs)
    # On the monitoring host itself over loopback; elsewhere at its address; port 0: no metrics.
    assert plan["jobs"] == [
        {"host": "gw", "target": "127.0.0.1:29100"},
        {"host": "gpu1", "target": "gpu1.lan:29200"},
    ]
    assert scrape_targets.targets([host("gpu1", SERVER)], "gw", "/k", 2000, 100)["jobs"] == []


@pytest.mark.parametrize(
    ("jobs", "words"),
    [
        ([job_host("gpu1")], "host gpu1: sglang_job_metrics_address is 127.0.0.1, so Prometheus"),
        ([job_host("gw"), job_host("gw")], "gw is listed twice in monitoring_job_hosts"),
        ([job_host("gw", port=70000)], "gw: sglang_job_metrics_port"),
        ("gw", "monitoring_job_hosts must be a list"),
    ],
)
def test_a_job_host_prometheus_cannot_scrape_is_named(jobs: object, words: str) -> None:
    with pytest.raises(scrape_targets.MonitoringError, match=words):
        scrape_targets.targets([], "gw", "/k", 2000, 100, jobs)  # type: ignore[arg-type]


def test_memory_outside_our_units_is_unowned(tmp_path: Path) -> None:
    reader = load_reader()
    proc = fake_proc(
        tmp_path,
        {
            "100": "/system.slice/docker-1.scope/system.slice/sglang@llama.service",
            "200": "/user.slice/user-0.slice/session-4.scope",
        },
    )
    gpus = [gpu(0, "GPU-0", 60000, 87), gpu(1, "GPU-1", 20000, None)]
    apps = [app(100, "python", "GPU-0", 60000), app(200, "train", "GPU-1", 20000)]
    text = reader.render(gpus, apps, proc, ["sglang@*.service"])
    assert 'sglang_fleet_gpu_unowned_memory_mib{gpu="0",uuid="GPU-0"} 0.0' in text
    assert 'sglang_fleet_gpu_unowned_memory_mib{gpu="1",uuid="GPU-1"} 20000.0' in text
    assert (
        'sglang_fleet_gpu_process_memory_mib{gpu="0",pid="100",process="python",'
        'unit="sglang@llama.service",ours="true"} 60000.0'
    ) in text
    assert 'unit="session-4.scope",ours="false"} 20000.0' in text
    assert 'sglang_fleet_gpu_utilization_ratio{gpu="0",uuid="GPU-0"} 0.87' in text
    assert math.isnan(float(text.split('utilization_ratio{gpu="1",uuid="GPU-1"} ')[1].split()[0]))


def test_memory_no_process_accounts_for_is_unowned(tmp_path: Path) -> None:
    """A zombie's memory whose process nvidia-smi no longer lists still counts."""
    reader = load_reader()
    text = reader.render([gpu(0, "GPU-0", 5000, 0)], [], tmp_path, ["sglang@*"])
    assert 'sglang_fleet_gpu_unowned_memory_mib{gpu="0",uuid="GPU-0"} 5000.0' in text


def test_a_failing_nvidia_smi_writes_scrape_success_0(tmp_path: Path) -> None:
    reader = load_reader()
    out = tmp_path / "gpu.prom"
    assert reader.main(["--nvidia-smi", str(tmp_path / "missing"), "--output", str(out)]) == 1
    assert out.read_text(encoding="utf-8").endswith("sglang_fleet_gpu_scrape_success 0\n")
