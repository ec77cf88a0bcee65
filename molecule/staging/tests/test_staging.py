"""Staging scenario: weights staged from a storage host before anything stops, and the drain
before every stop (docs/STAGING.md, docs/ROUTER.md).

stage-gpu1 runs two replicas (llama-a on :30000, llama-b on :30001) behind SGLang's router
(:8080), both loading /models/llama/rev-a, staged once by converge from
stage-store:/srv/shared/llama/rev-a over SSH. Tests run top to bottom on revision rev-b: a
disk-space refusal, then a corrupted file caught by verification (the old servers serve all
along), then the staged rollout whose downtime excludes the copy, then rollback.yml with clients
going through the router. Figures go to reports/staging/ for the record.
"""

from __future__ import annotations

import json
import os
import re
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

GPU, STORE = "stage-gpu1", "stage-store"
SERVERS = {"llama-a": 30000, "llama-b": 30001}
WORKERS = {f"http://{GPU}:{port}" for port in SERVERS.values()}
SHARED = "/srv/shared/llama"
STAGE_TASK = "Stage, verify and prune"
STOP_TASK_PREFIX = "Stop, clean, start and wait for a real generation"
# The take-out action of router_take_out.yml (sglang_router_leave; its result holds the drain).
TAKE_OUT_TASK_PREFIX = "Take out of its router and drain"
REPORTS = REPO / "reports" / "staging"
WEIGHT = "model-00002-of-00002.safetensors"


def on(name: str) -> Any:
    return testinfra.get_host(f"ansible://{name}?ansible_inventory={INVENTORY}")


def servers(revision: str) -> list[dict[str, Any]]:
    """The scenario's two replicas (host_vars/stage-gpu1/servers.yml) on another revision."""
    return [
        {
            "name": name,
            "model_path": f"/models/llama/{revision}",
            "model_source": {"rsync": f"{STORE}:{SHARED}/{revision}", "revision": revision},
            "served_model_name": "llama-3.1-8b",
            "port": port,
            "gpus": [index],
            "profile": "safe",
            "host": "0.0.0.0",
            "router": {"url": "http://127.0.0.1:8080"},
        }
        for index, (name, port) in enumerate(SERVERS.items())
    ]


def identities() -> dict[str, tuple[str, str]]:
    """MainPID and start time of each replica: unchanged means untouched."""
    host, out = on(GPU), {}
    for name in SERVERS:
        show = host.check_output(
            "systemctl show -p MainPID -p ActiveEnterTimestampMonotonic sglang@%s.service", name
        )
        props = dict(line.split("=", 1) for line in show.splitlines())
        out[name] = (props["MainPID"], props["ActiveEnterTimestampMonotonic"])
    return out


def model_paths() -> dict[str, str]:
    host = on(GPU)
    found = {}
    for name in SERVERS:
        launch = host.file(f"/etc/systemd/system/sglang@{name}.service.d/10-launch.conf")
        found[name] = re.search(r"--model-path (\S+)", launch.content_string).group(1)
    return found


def healthy_workers() -> set[str]:
    return host_reads.healthy_workers(on(GPU))


def generate_through_router() -> dict[str, Any]:
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
    script = (
        "import json, urllib.request;"
        "r = urllib.request.Request('http://127.0.0.1:8080/generate',"
        f" data=json.dumps({body!r}).encode(), headers={{'Content-Type': 'application/json'}});"
        "print(urllib.request.urlopen(r, timeout=30).read().decode())"
    )
    return json.loads(on(GPU).check_output("python3 -c %s", script))


def stage_failure(run: PlaybookRun) -> str:
    failed = [msg for host, task, msg in run.failures if task == STAGE_TASK and host == GPU]
    assert failed, run.failures
    return failed[0]


def first_created(run: PlaybookRun, event: str, task_prefix: str) -> str:
    times = [
        e["created"]
        for e in run.events
        if e.get("event") == event and e["event_data"].get("task", "").startswith(task_prefix)
    ]
    assert times, f"no {event} for {task_prefix}"
    return min(times)


def record(name: str, data: dict[str, Any]) -> None:
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


def test_converge_staged_one_verified_copy_for_both_replicas():
    host = on(GPU)
    marker = json.loads(host.check_output("cat /models/llama/rev-a/.model-stage.json"))
    assert marker["revision"] == "rev-a"
    assert marker["source"] == f"{STORE}:{SHARED}/rev-a"
    assert marker["files"] == len(marker["sizes"]) and WEIGHT in marker["sizes"]
    assert not host.file("/models/llama/rev-a.partial").exists
    staged = host.check_output("sha256sum /models/llama/rev-a/%s", WEIGHT).split()[0]
    assert staged == on(STORE).check_output("sha256sum %s/rev-a/%s", SHARED, WEIGHT).split()[0]
    assert model_paths() == dict.fromkeys(SERVERS, "/models/llama/rev-a")
    assert healthy_workers() == WORKERS


def test_the_disk_space_preflight_refuses_before_the_checkpoint_is_copied():
    before = identities()
    run = run_playbook(
        "deploy.yml",
        extravars={
            "sglang_server_instances": servers("rev-b"),
            "model_stage_free_margin_gb": 10**9,
        },
    )
    assert run.rc != 0
    message = stage_failure(run)
    assert message.startswith("not enough disk space for /models/llama/rev-b")
    assert "model_stage_free_margin_gb" in message and "Nothing was copied." in message
    host = on(GPU)
    assert host.check_output("ls -A /models/llama/rev-b.partial").split() == ["model.sha256.json"]
    assert not host.file("/models/llama/rev-b").exists
    assert identities() == before
    record("disk-refusal", {"message": message})


def test_a_corrupted_file_is_caught_by_verification_while_the_old_servers_serve():
    store = on(STORE)
    store.check_output("cp %s/rev-b/%s /root/%s.good", SHARED, WEIGHT, WEIGHT)
    # Same size, other bytes: only the sha256 tells them apart.
    store.check_output("head -c 3145728 /dev/zero > %s/rev-b/%s", SHARED, WEIGHT)
    before = identities()
    run = run_playbook("deploy.yml", extravars={"sglang_server_instances": servers("rev-b")})
    assert run.rc != 0
    message = stage_failure(run)
    assert "failed verification against model.sha256.json" in message
    assert f"{WEIGHT}: sha256 " in message
    host = on(GPU)
    assert not host.file("/models/llama/rev-b").exists
    assert not host.file(f"/models/llama/rev-b.partial/{WEIGHT}").exists
    assert host.file("/models/llama/rev-b.partial/model-00001-of-00002.safetensors").exists
    assert identities() == before
    assert model_paths() == dict.fromkeys(SERVERS, "/models/llama/rev-a")
    assert generate_through_router()["meta_info"]["completion_tokens"] == 4
    record("verification", {"message": message})


def _summary_rows(run: PlaybookRun) -> dict[str, list[str]]:
    lines = [
        line
        for res in run.task_results("Fleet summary")
        for line in (res.get("msg") or [])
        if isinstance(line, str)
    ]
    header = next(line for line in lines if line.startswith("HOST"))
    assert "DOWN s" in header and "COPY s" in header, lines
    return {line.split()[1]: line.split() for line in lines if line.startswith(GPU)}


def test_the_staged_rollout_s_downtime_does_not_include_the_copy():
    on(STORE).check_output("cp /root/%s.good %s/rev-b/%s", WEIGHT, SHARED, WEIGHT)
    # Throttled, so that the copy takes a measurable time next to the downtime.
    run = run_playbook(
        "deploy.yml",
        extravars={"sglang_server_instances": servers("rev-b"), "model_stage_bwlimit_kbps": 1000},
    )
    assert run.rc == 0, run.failures
    staged = [r for r in run.task_results(STAGE_TASK) if r.get("results")]
    items = staged[0]["results"]
    assert len(items) == 1, "one copy for the two replicas"
    copy_seconds = items[0]["copy_seconds"]
    assert items[0]["changed"] and copy_seconds > 0
    # Every copy finished before the first server stopped.
    assert first_created(run, "runner_on_ok", STAGE_TASK) < first_created(
        run, "playbook_on_task_start", STOP_TASK_PREFIX
    )
    rows = _summary_rows(run)
    assert set(rows) == set(SERVERS)
    # HOST SERVER CONFIG TOK/S P99 TTFT ms DOWN s COPY s OUTCOME: DOWN and COPY are 5 and 6
    downtimes = {name: float(row[5]) for name, row in rows.items()}
    assert all(row[6] == f"{copy_seconds:.1f}" and row[-1] == "passed" for row in rows.values())
    assert all(d > 0 for d in downtimes.values())
    assert model_paths() == dict.fromkeys(SERVERS, "/models/llama/rev-b")
    assert healthy_workers() == WORKERS
    record("rollout", {"copy_seconds": copy_seconds, "downtime_seconds": downtimes})


def test_rollback_drains_each_replica_through_the_router_without_a_failed_request():
    host = on(GPU)
    # An edit by hand that the last-known-good record does not hold: rollback.yml restores it.
    for name in SERVERS:
        host.check_output(
            "echo '# edited by hand' >> /etc/systemd/system/sglang@%s.service.d/10-launch.conf",
            name,
        )
    before = identities()
    # Four clients on the storage host, through the router.
    client = TrafficUnit(on(STORE), "rollback", unit="staging-traffic", url=f"http://{GPU}:8080")
    with client:
        run = run_playbook("rollback.yml", extravars={"sglang_server_instances": servers("rev-b")})
    result = client.result()
    record("rollback-traffic", {k: v for k, v in result.items() if k != "samples"})
    assert run.rc == 0, run.failures
    assert result["requests"] > 0
    assert result["failed"] == 0, result["failures"]
    after = identities()
    assert all(after[name] != before[name] for name in SERVERS), "both replicas restarted"
    took_out = [
        e["event_data"]["res"]
        for e in run.events
        if e.get("event") == "runner_on_ok"
        and e["event_data"].get("task", "").startswith(TAKE_OUT_TASK_PREFIX)
        and "router_out" in e["event_data"]["res"]
    ]
    assert len(took_out) == 2 and all(r["drain"]["drained"] is True for r in took_out), took_out
    said = " ".join(str(r.get("msg")) for r in run.task_results("Say what was rolled back"))
    assert all(f"{name}: down " in said for name in SERVERS), said
    assert healthy_workers() == WORKERS
