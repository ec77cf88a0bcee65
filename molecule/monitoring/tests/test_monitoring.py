"""Monitoring scenario: Prometheus on the gateway scrapes two servers and their hosts.

monitoring-gpu1 (the gateway) runs Prometheus and Alertmanager, and with monitoring-gpu2 one
server each (the double) and Debian's node exporter fed by the nvidia-smi timer. Tests run top
to bottom: every target is up with its labels; GPU memory is attributed to our units; the key is
nowhere Prometheus serves; a smoke run shows in a rate query (exact token count) and breaks the
scenario's 1 ms TTFT objective; every dashboard query returns data and the main panels are drawn;
then a stopped server and GPU memory held by an orphan fire their alerts in Alertmanager, each
timed against its rule's `for`. Figures go to reports/monitoring/ for the record.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import testinfra
import testinfra.utils.ansible_runner

from sglang_fleet.monitoring import dashboard

pytestmark = pytest.mark.timeout(300)

INVENTORY = os.environ["MOLECULE_INVENTORY_FILE"]
testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(INVENTORY).get_hosts("gpu_hosts")

GATEWAY, SECOND = "monitoring-gpu1", "monitoring-gpu2"
API_KEY = os.environ.get("MOLECULE_SGLANG_API_KEY", "sk-canary-0f3b9e2d71")
REPO = Path(os.environ.get("SGLANG_FLEET_REPO", Path(__file__).resolve().parents[3]))
REPORTS = REPO / "reports" / "monitoring"
# From host_vars/*/monitoring.yml (vars/monitoring.yml).
SCRAPE_S, EVAL_S, DOWN_FOR_S, UNOWNED_FOR_S, SLO_FOR_S, RATE_WINDOW_S = 2, 2, 6, 6, 4, 10
# Detection after the condition starts: a scrape, then two evaluations (pending, firing), then
# the push to Alertmanager; doubled and padded for two busy shared cores.
DETECTION_S = 2 * (SCRAPE_S + 2 * EVAL_S) + 10
SMOKE = "/usr/local/lib/sglang-fleet/smoke.pyz"
FIRED: dict[str, float] = {}


def on(name: str) -> Any:
    return testinfra.get_host(f"ansible://{name}?ansible_inventory={INVENTORY}")


def http_get(url: str) -> str:
    """GET from the gateway itself (Prometheus and Alertmanager listen there)."""
    script = (
        "import sys, urllib.request;"
        "print(urllib.request.urlopen(sys.argv[1], timeout=20).read().decode())"
    )
    return on(GATEWAY).check_output("python3 -c %s %s", script, url)


def prometheus(path: str, params: dict[str, str] | None = None) -> Any:
    body = json.loads(http_get(f"http://127.0.0.1:9090{path}?{urlencode(params or {})}"))
    assert body["status"] == "success", body
    return body["data"]


def query(expr: str) -> list[dict[str, Any]]:
    return prometheus("/api/v1/query", {"query": expr})["result"]


def active_alerts(name: str) -> list[dict[str, Any]]:
    alerts = json.loads(http_get("http://127.0.0.1:9093/api/v2/alerts?active=true"))
    return [a for a in alerts if a["labels"]["alertname"] == name]


def wait_for(check: Any, timeout: float, every: float = 0.5) -> float:
    """Seconds until check() is truthy; fails after timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s: {check.__doc__ or check}")


def record(name: str, seconds: float) -> None:
    FIRED[name] = round(seconds, 1)
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / "alerts.json").write_text(json.dumps(FIRED, indent=2) + "\n", encoding="utf-8")
    print(f"{name}: {seconds:.1f} s")


def test_every_server_and_exporter_is_a_target_with_its_labels() -> None:
    def all_up() -> bool:
        """every target up"""
        targets = prometheus("/api/v1/targets")["activeTargets"]
        return len(targets) == 5 and all(t["health"] == "up" for t in targets)

    wait_for(all_up, 60)
    targets = prometheus("/api/v1/targets")["activeTargets"]
    by_job: dict[str, list[dict[str, str]]] = {}
    for target in targets:
        by_job.setdefault(target["labels"]["job"], []).append(target["labels"])
    assert sorted(by_job) == ["node", "prometheus", "sglang"]
    assert sorted((t["host"], t["server"], t["model"]) for t in by_job["sglang"]) == [
        (GATEWAY, "llama", "llama-3.1-8b"),
        (SECOND, "llama", "llama-3.1-8b"),
    ]
    assert sorted(t["host"] for t in by_job["node"]) == [GATEWAY, SECOND]
    # The server's own series carry our labels beside SGLang's model_name.
    series = query('sglang:num_running_reqs{job="sglang"}')
    assert {(s["metric"]["host"], s["metric"]["model_name"]) for s in series} == {
        (GATEWAY, "llama-3.1-8b"),
        (SECOND, "llama-3.1-8b"),
    }


def test_gpu_memory_is_read_from_nvidia_smi_and_attributed_to_our_units() -> None:
    # The package's postinst starts Prometheus once with Debian's own configuration, which
    # scrapes localhost:9100 as job "node" without our labels, until the role restarts it; those
    # samples stay in queries for Prometheus's 5 min lookback. Our scrape jobs set `host`.
    totals = query('sglang_fleet_gpu_memory_total_mib{host!=""}')
    assert len(totals) == 16 and {float(s["value"][1]) for s in totals} == {97887.0}
    ours = query('sglang_fleet_gpu_process_memory_mib{ours="true",host!=""}')
    assert {(s["metric"]["host"], s["metric"]["gpu"], s["metric"]["unit"]) for s in ours} == {
        (GATEWAY, "0", "sglang@llama.service"),
        (SECOND, "0", "sglang@llama.service"),
    }
    assert all(float(s["value"][1]) > 0 for s in ours)
    assert query("sglang_fleet_gpu_unowned_memory_mib > 0") == []


def test_the_key_is_nowhere_prometheus_serves() -> None:
    for path in (
        "/api/v1/status/config",
        "/api/v1/targets",
        "/api/v1/status/flags",
        "/api/v1/status/runtimeinfo",
        "/api/v1/rules",
    ):
        assert API_KEY not in http_get(f"http://127.0.0.1:9090{path}"), path
    config = prometheus("/api/v1/status/config")["yaml"]
    assert "credentials_file: /etc/prometheus/sglang-keys/monitoring-gpu2@llama" in config
    gateway = on(GATEWAY)
    key_file = gateway.file("/etc/prometheus/sglang-keys/monitoring-gpu2@llama")
    assert (key_file.user, key_file.group, key_file.mode) == ("prometheus", "prometheus", 0o400)
    assert API_KEY not in gateway.file("/etc/prometheus/prometheus.yml").content_string
    assert API_KEY not in gateway.check_output("ps -eo args")


def counter(expr: str) -> float:
    result = query(expr)
    return float(result[0]["value"][1]) if result else 0.0


def test_a_smoke_run_shows_in_a_rate_query_and_breaks_the_ttft_objective() -> None:
    total = f'sum(sglang:generation_tokens_total{{host="{SECOND}"}})'
    before = counter(total)
    started = time.monotonic()
    run = on(SECOND).run(
        "SGLANG_API_KEY=%s python3 %s --url http://127.0.0.1:30000 --json /tmp/smoke.json"
        " --num-prompts 32 --max-concurrency 8 --random-input-len 32 --random-output-len 32"
        " --seed 7 --warmup-requests 0 --timeout 120",
        API_KEY,
        SMOKE,
    )
    assert run.rc == 0, run.stderr
    result = json.loads(on(SECOND).file("/tmp/smoke.json").content_string)
    tokens = result["total_output_tokens"]
    assert result["completed"] == 32 and tokens > 0

    def counted() -> bool:
        """the counter moved by the smoke run's tokens"""
        return counter(total) - before >= tokens

    wait_for(counted, 4 * SCRAPE_S + 10)
    assert counter(total) - before == tokens
    rate = query(f'sum(rate(sglang:generation_tokens_total{{host="{SECOND}"}}[1m]))')
    assert float(rate[0]["value"][1]) > 0

    def ttft_alert() -> bool:
        """SGLangTTFTAboveSLO active for monitoring-gpu2 in Alertmanager"""
        return any(a["labels"]["host"] == SECOND for a in active_alerts("SGLangTTFTAboveSLO"))

    wait_for(ttft_alert, SLO_FOR_S + RATE_WINDOW_S + DETECTION_S)
    record("SGLangTTFTAboveSLO (from the smoke run's start)", time.monotonic() - started)


def test_every_dashboard_query_returns_data_and_the_main_panels_are_drawn() -> None:
    items = dashboard.queries(dashboard.load_dashboard(), "1m")
    empty = [item["expr"] for item in items if not query(item["expr"])]
    assert empty == [], empty
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / "dashboard-queries.txt").write_text(
        f"{len(items)} queries returned data\n", encoding="utf-8"
    )
    print(f"dashboard: {len(items)} queries returned data")

    def get(path: str, params: dict[str, str]) -> dict[str, Any]:
        return prometheus(path, params)

    fetched = dashboard.snapshot(
        get, REPORTS / "panels.png", 3, rate_interval="10s", now=time.time()
    )
    throughput = next(f for f in fetched if f["panel"] == "Generation throughput (tokens/s)")
    assert max(max(values) for _, _, values in throughput["series"]) > 0


def test_a_stopped_server_fires_the_down_alert_after_its_for() -> None:
    second = on(SECOND)
    second.run_expect([0], "systemctl stop sglang@llama.service")

    def down() -> bool:
        """SGLangServerDown active for monitoring-gpu2 in Alertmanager"""
        return any(a["labels"]["host"] == SECOND for a in active_alerts("SGLangServerDown"))

    took = wait_for(down, DOWN_FOR_S + DETECTION_S)
    record("SGLangServerDown (from the stop)", took)
    assert took >= DOWN_FOR_S, "fired before its for"
    assert [a["labels"]["host"] for a in active_alerts("SGLangServerDown")] == [SECOND]
    second.run_expect([0], "systemctl start sglang@llama.service")


def test_gpu_memory_held_by_an_orphan_fires_the_zombie_alert_after_its_for() -> None:
    gateway = on(GATEWAY)
    # A rank left behind by a server, outside every unit of ours.
    gateway.run_expect(
        [0],
        "systemd-run --unit=monitoring-orphan gpusim hold --gpu 3 --mib 20000"
        " --name sglang::scheduler_TP1",
    )
    try:

        def zombie() -> bool:
            """GPUMemoryHeldWithoutServer active for GPU 3 of monitoring-gpu1"""
            return any(
                (a["labels"]["host"], a["labels"]["gpu"]) == (GATEWAY, "3")
                for a in active_alerts("GPUMemoryHeldWithoutServer")
            )

        took = wait_for(zombie, UNOWNED_FOR_S + 2 + DETECTION_S)
        record("GPUMemoryHeldWithoutServer (from the hold)", took)
        assert took >= UNOWNED_FOR_S, "fired before its for"
        held_by = query('sglang_fleet_gpu_process_memory_mib{gpu="3",ours="false"}')
        assert [(s["metric"]["unit"], float(s["value"][1])) for s in held_by] == [
            ("monitoring-orphan.service", 20000.0)
        ]
    finally:
        gateway.run("systemctl stop monitoring-orphan.service")
