"""Upgrade scenario: SGLang versions side by side, rolled through the router like a flag change.

upgrade-gpu1 runs the router (port 8080) and one replica, upgrade-gpu2 the other. The fleet
starts on SGLang 0.5.22 (converge). Tests run top to bottom, each under steady client traffic
through the router where servers restart (molecule/shared/traffic.py: every request must come
back whole, and the router must keep at least N-1 of N replicas healthy):
1. provisioning a new version builds it beside the old one and touches no running server;
2. check mode says which servers would restart and why (the SGLang version);
3. 0.5.22 -> 0.5.23 rolls through the router without a failed request;
4. a version the double makes slow is caught by the relative gate on the canary and rolled back
   to the old virtualenv automatically; the second replica is never touched;
5. an unknown version is refused before anything is built; a prune that would remove a version
   in use is refused; unused ones go;
6. a driver branch change goes host by host (playbooks/driver_upgrade.yml).
The figures go to reports/upgrade/ for the record (docs/UPGRADES.md).
"""

from __future__ import annotations

import json
import os
from typing import Any

import host_reads
import pytest
import testinfra
import testinfra.utils.ansible_runner
from fleet_runner import REPO, PlaybookRun, run_playbook
from traffic_unit import TrafficUnit

pytestmark = pytest.mark.timeout(900)

INVENTORY = os.environ["MOLECULE_INVENTORY_FILE"]
testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(INVENTORY).get_hosts("gpu_hosts")

GATEWAY, SECOND = "upgrade-gpu1", "upgrade-gpu2"
REPLICAS = (GATEWAY, SECOND)
ROUTER = "http://upgrade-gpu1:8080"
WORKERS = {f"http://{host}:30000" for host in REPLICAS}
UNIT = "sglang@llama.service"
META = "/var/lib/sglang-fleet/llama/lkg/meta.json"
LAUNCH = "/etc/systemd/system/sglang@llama.service.d/10-launch.conf"
VERSIONS = "/opt/ml-env/versions"
API_KEY = os.environ.get("MOLECULE_SGLANG_API_KEY", "sk-canary-0f3b9e2d71")
REPORTS = REPO / "reports" / "upgrade"
RESTART_TASK = "Stop, clean, start and wait for a real generation - llama"
OLD, NEW, REGRESSED = "0.5.22", "0.5.23", "0.5.23+regressed"
# The double serves REGRESSED this many times slower (gpusim's sglang_version_slowdown knob).
SLOWDOWN = 4.0


def on(name: str) -> Any:
    return testinfra.get_host(f"ansible://{name}?ansible_inventory={INVENTORY}")


def version(value: str) -> dict[str, Any]:
    return {"ml_env_sglang_version": value}


def unit_identity(host: Any) -> tuple[str, str]:
    return host_reads.unit_identity(host, UNIT)


def identities() -> dict[str, tuple[str, str]]:
    return {h: unit_identity(on(h)) for h in REPLICAS}


def lkg(host: Any) -> dict[str, Any]:
    return host_reads.read_json(host, META)


def runs_from(host: Any) -> str:
    """The SGLang version the running server was started from (its main process's python)."""
    pid = host.check_output("systemctl show -p MainPID --value %s", UNIT)
    argv0 = host.check_output("tr '\\0' '\\n' < /proc/%s/cmdline | head -1", pid)
    assert argv0.startswith(f"{VERSIONS}/") and argv0.endswith("/bin/python"), argv0
    return argv0[len(VERSIONS) + 1 :].split("/")[0]


def healthy_workers() -> set[str]:
    return host_reads.healthy_workers(on(GATEWAY), API_KEY)


def traffic(label: str) -> TrafficUnit:
    return TrafficUnit(on(SECOND), label, unit="upgrade-traffic", url=ROUTER, key=API_KEY)


def record(label: str, data: dict[str, Any]) -> None:
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / f"{label}.json").write_text(json.dumps(data, indent=1))


def traffic_figures(result: dict[str, Any]) -> dict[str, Any]:
    healthy = [s[1] for s in result["samples"]]
    return {
        "requests": result["requests"],
        "failed": result["failed"],
        "short": result["tokens"]["short"],
        "lowest_healthy": min(healthy),
        "of": len(REPLICAS),
        "samples": len(healthy),
        "elapsed_s": result["elapsed_s"],
    }


def downtimes(run: PlaybookRun) -> dict[str, float]:
    """Each restarted replica's downtime (stop to healthy), from its restart action."""
    out = {}
    for event in run.events:
        data = event.get("event_data", {})
        if event.get("event") == "runner_on_ok" and data.get("task") == RESTART_TASK:
            seconds = ((data.get("res") or {}).get("downtime") or {}).get("downtime_seconds")
            if seconds is not None:
                out[data["host"]] = seconds
    return out


def test_the_fleet_starts_on_the_old_version_behind_the_router():
    assert healthy_workers() == WORKERS
    for host in REPLICAS:
        assert runs_from(on(host)) == OLD
        assert lkg(on(host))["sglang_version"] == OLD


def test_provisioning_builds_a_version_beside_the_old_and_touches_no_running_server():
    before = identities()
    run = run_playbook("provision.yml", extravars=version(REGRESSED))
    assert run.rc == 0, run.failures
    assert identities() == before
    for host in REPLICAS:
        node = on(host)
        assert runs_from(node) == OLD
        for name in (OLD, NEW, REGRESSED):
            assert node.file(f"{VERSIONS}/{name}/sglang-fleet-env.json").exists, name
        assert not node.file(f"{VERSIONS}/.building-{REGRESSED}").exists
    # A rerun builds nothing.
    again = run_playbook("provision.yml", extravars=version(REGRESSED))
    assert again.rc == 0 and again.changed_tasks() == [], again.changed_tasks()


def test_check_mode_says_the_version_change_and_touches_nothing():
    before = identities()
    run = run_playbook("deploy.yml", extravars=version(NEW), cmdline="--check")
    assert run.rc == 0, run.failures
    assert f"llama: would restart (SGLang {OLD} -> {NEW}, same flags)" in run.text()
    assert identities() == before


def test_an_upgrade_rolls_through_the_router_without_a_failed_request():
    before = identities()
    with traffic("upgrade") as client:
        run = run_playbook("deploy.yml", extravars=version(NEW))
    result = client.result()
    assert run.rc == 0, run.failures
    figures = traffic_figures(result)
    record("upgrade", {**figures, "downtime_s": downtimes(run), "task_headers": run.task_headers})
    print("upgrade", OLD, "->", NEW, figures, downtimes(run))
    for host in REPLICAS:
        node = on(host)
        assert unit_identity(node) != before[host], f"{host} was not restarted"
        assert runs_from(node) == NEW
        assert lkg(node)["sglang_version"] == NEW
        assert f"{VERSIONS}/{NEW}/bin/python -m " in node.file(LAUNCH).content_string
    assert set(downtimes(run)) == set(REPLICAS)
    assert result["failed"] == 0, result["failures"]
    assert result["requests"] > 50 and result["stopped_by"] == "stop_file"
    assert figures["lowest_healthy"] == len(REPLICAS) - 1  # each replica really left, one at a time
    assert healthy_workers() == WORKERS


def set_slowdown(factor: float | None) -> None:
    """The double's knob, in its hardware file on both hosts (read when a server starts)."""
    script = (
        "import os, sys, yaml; p = '/var/lib/gpusim/hardware.yaml';"
        "h = (yaml.safe_load(open(p)) if os.path.exists(p) else None) or {};"
        "f = sys.argv[1];"
        "h.pop('sglang_version_slowdown', None) if f == 'none' else"
        " h.__setitem__('sglang_version_slowdown', {sys.argv[2]: float(f)});"
        "yaml.safe_dump(h, open(p, 'w'))"
    )
    python = f"{VERSIONS}/{NEW}/bin/python"  # its venv has PyYAML (the double's dependency)
    for host in REPLICAS:
        on(host).check_output("%s -c %s %s %s", python, script, str(factor or "none"), REGRESSED)


def test_a_version_that_regresses_is_rolled_back_to_the_old_virtualenv():
    canary, second = on(GATEWAY), on(SECOND)
    canary_lkg, second_identity = lkg(canary), unit_identity(second)
    set_slowdown(SLOWDOWN)
    try:
        with traffic("regression") as client:
            run = run_playbook("deploy.yml", extravars=version(REGRESSED))
        result = client.result()
    finally:
        set_slowdown(None)
    assert run.rc != 0
    failures = {h for h, _, _ in run.failures}
    assert failures == {GATEWAY}, run.failures
    text = " ".join(msg for _, _, msg in run.failures)
    gates = [r for r in run.failed_results() if r.get("passed") is False and r.get("measured")]
    assert gates, run.failed_results()
    measured = gates[0]["measured"]["output_throughput"]
    passed_with = canary_lkg["smoke_result"]
    baseline = (passed_with.get("metrics") or passed_with)["output_throughput"]
    drop_pct = round(100 * (1 - measured / baseline), 1)
    figures = traffic_figures(result)
    record("regression", {
        **figures, "downtime_s": downtimes(run), "baseline_tok_s": baseline,
        "measured_tok_s": measured, "drop_pct": drop_pct, "verdict": gates[0]["summary"],
    })  # fmt: skip
    print("regression", figures, baseline, "->", measured, f"-{drop_pct}%", gates[0]["summary"])
    assert drop_pct > 50, (baseline, measured)
    assert "regression" in json.dumps(gates[0]["failures"]), gates[0]["failures"]
    assert f"Rolled back to the last-known-good configuration {canary_lkg['config_hash']}" in text
    # The canary serves from the old virtualenv again; the second replica was never touched.
    assert runs_from(canary) == NEW
    assert lkg(canary) == canary_lkg
    assert unit_identity(second) == second_identity and runs_from(second) == NEW
    assert result["failed"] == 0, result["failures"]
    assert figures["lowest_healthy"] >= len(REPLICAS) - 1
    assert healthy_workers() == WORKERS


def test_an_unknown_version_is_refused_before_anything_is_built():
    run = run_playbook("provision.yml", extravars=version("0.5.99"))
    assert run.rc != 0
    text = " ".join(msg for _, _, msg in run.failures)
    assert "ml_env_sglang_version 0.5.99 is not in the wheelhouse" in text, text
    assert f"{OLD}, {NEW}, {REGRESSED}" in text, text
    for host in REPLICAS:
        assert not on(host).file(f"{VERSIONS}/.building-0.5.99").exists


def test_a_prune_of_a_version_in_use_is_refused_and_unused_versions_go():
    run = run_playbook("provision.yml", extravars={**version(NEW), "ml_env_remove_versions": [NEW]})
    assert run.rc != 0
    text = " ".join(msg for _, _, msg in run.failures)
    assert "ml_env_remove_versions" in text and "sglang@llama.service" in text, text
    run = run_playbook("provision.yml", extravars={**version(NEW), "ml_env_keep_versions": 1})
    assert run.rc == 0, run.failures
    for host in REPLICAS:
        assert on(host).check_output("ls %s", VERSIONS).split() == [NEW]
        assert runs_from(on(host)) == NEW


# --- a driver branch, host by host ------------------------------------------------------------

# The stand-in branch package and reboot of molecule/shared/driver_standin.yml, through the
# nvidia_driver role's own variables.
DRIVER = {
    "nvidia_driver_branch": "590",
    "nvidia_driver_repository": "preconfigured",
    "nvidia_driver_packages": ["gpusim-nvidia-driver-590"],
    "nvidia_driver_reboot": True,
    "nvidia_driver_reboot_command": "/usr/local/sbin/gpusim-reboot",
    "nvidia_driver_boot_time_command": "cat /var/lib/gpusim/boot_id",
    "nvidia_driver_modinfo": "/usr/local/sbin/gpusim-modinfo",
    "nvidia_driver_module_version_file": "/var/lib/gpusim/module-loaded",
}


def driver_version(host: Any) -> str:
    return host.check_output("nvidia-smi --query-gpu=driver_version --format=csv,noheader").split()[
        0
    ]


def reboots(host: Any) -> list[float]:
    log = host.file("/var/log/gpusim-reboot.log")
    lines = log.content_string.splitlines() if log.exists else []
    return [float(line.split()[0]) for line in lines if " reboot: " in line]


def test_provision_refuses_a_driver_change_under_running_servers():
    before = identities()
    run = run_playbook("provision.yml", extravars={**version(NEW), **DRIVER})
    assert run.rc != 0
    text = " ".join(msg for _, _, msg in run.failures)
    assert "driver_upgrade.yml" in text and "sglang@llama.service" in text, text
    assert {h for h, _, _ in run.failures} == set(REPLICAS)
    assert identities() == before
    assert {driver_version(on(h)) for h in REPLICAS} == {"580.95.05"}
    assert all(reboots(on(h)) == [] for h in REPLICAS)


def test_a_driver_branch_goes_host_by_host_without_a_failed_request():
    with traffic("driver") as client:
        run = run_playbook("driver_upgrade.yml", extravars={**version(NEW), **DRIVER}, timeout=900)
    result = client.result()
    assert run.rc == 0, run.failures
    times = {h: reboots(on(h)) for h in REPLICAS}
    order = sorted(REPLICAS, key=lambda h: times[h][0] if times[h] else float("inf"))
    figures = traffic_figures(result)
    summaries = [
        str((e["event_data"].get("res") or {}).get("msg"))
        for e in run.events
        if e.get("event") == "runner_on_ok"
        and e["event_data"].get("task") == "Say what changed on this host"
    ]
    record("driver", {**figures, "reboot_order": order, "reboots": times, "summaries": summaries})
    print("driver 580 -> 590", figures, "reboot order", order, summaries)
    assert all(len(times[h]) == 1 for h in REPLICAS), times
    assert order == [GATEWAY, SECOND]
    for host in REPLICAS:
        node = on(host)
        assert driver_version(node) == "590.10.01"
        assert node.service(UNIT).is_running and runs_from(node) == NEW
    assert result["failed"] == 0, result["failures"]
    assert figures["lowest_healthy"] == len(REPLICAS) - 1
    assert healthy_workers() == WORKERS
    # A rerun finds every host on the branch: nothing to do, nothing restarted.
    before = identities()
    again = run_playbook("driver_upgrade.yml", extravars={**version(NEW), **DRIVER})
    assert again.rc == 0, again.failures
    assert identities() == before
