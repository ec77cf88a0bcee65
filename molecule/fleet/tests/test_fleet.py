"""Fleet scenario: two replicas behind SGLang's real router, rolled while clients send traffic.

fleet-gpu1 runs the router (port 8080) and one replica, fleet-gpu2 the other replica. During
each rollout molecule/shared/traffic.py runs on fleet-gpu2 against the router: every request must
come back whole, and the router must keep at least N-1 of the N replicas healthy all the time
(sampled from its /readiness). Tests run top to bottom: a changed flag set is rolled out to both
replicas, then a failing one is rolled back on the first and never reaches the second.
Each run's traffic figures go to reports/fleet/ for the record.

A job (playbooks/job.yml) of 2,400 rows runs on the gateway through the router all the while:
started before the changed flag set's rollout, its runner SIGKILLed twice during that rollout
(its unit restarts it), the second replica's server SIGKILLed after it (its unit restarts it),
then stopped and resumed by the operator's verbs. Every input row must end exactly once across
output, error and skipped, and every output row must be what the double generates for its
prompt and sampling settings (gpusim.http_api.output_seed).

Beside the replicas, "big" runs across both hosts (node 0 on fleet-gpu1, node 1 on fleet-gpu2):
a changed flag set restarts both nodes together and leaves the replicas alone; a failing one
(out of memory at start-up) rolls both nodes back to their last-known-good configuration.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import host_reads
import pytest
import testinfra
import testinfra.utils.ansible_runner
from fleet_runner import REPO, PlaybookRun, run_playbook
from gpusim.http_api import TextStream, output_seed
from gpusim.tokenizer import WordTokenizer
from job_files import JobOnHost, conversation_rows, where_each_row_ended, write_input
from traffic_unit import TrafficUnit

# A rollout of both replicas (or both nodes) with traffic runs for minutes, longer on busy
# shared cores than pytest.ini's default of 300 s; every playbook bounds its own waits.
pytestmark = pytest.mark.timeout(900)

INVENTORY = os.environ["MOLECULE_INVENTORY_FILE"]
testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(INVENTORY).get_hosts("gpu_hosts")

GATEWAY, SECOND = "fleet-gpu1", "fleet-gpu2"
REPLICAS = (GATEWAY, SECOND)
ROUTER = "http://fleet-gpu1:8080"
WORKERS = {f"http://{host}:30000" for host in REPLICAS}
UNIT = "sglang@llama.service"
META = "/var/lib/sglang-fleet/llama/lkg/meta.json"
LAUNCH = "/etc/systemd/system/sglang@llama.service.d/10-launch.conf"
API_KEY = os.environ.get("MOLECULE_SGLANG_API_KEY", "sk-canary-0f3b9e2d71")
REPORTS = REPO / "reports" / "fleet"
ROLLOUT_PLAYS = (
    "Roll out the replicas behind a router, one host at a time",
    "Roll out the other hosts, a canary first",
)
# A flag that changes the launch line and nothing the double's speed depends on.
CHANGED = {"chunked_prefill_size": 4096}
# No room left for CUDA graphs: the double dies at start-up with CUDA out of memory.
FAILING = {"mem_fraction_static": 0.99}


BIG_UNIT = "sglang@big.service"
BIG_META = "/var/lib/sglang-fleet/big/lkg/meta.json"
BIG_LAUNCH = "/etc/systemd/system/sglang@big.service.d/10-launch.conf"
MULTINODE_PLAY = "Roll out the servers across hosts, all nodes of a server together"
# The calibration every start records would refuse 0.99 before anything stops (the tuning
# scenario shows that); overruled here so the failure happens where a rollback is needed.
OVERRULE = {"sglang_server_calibration_mode": "warn"}


# The job: 2,400 rows of 32 tokens through the router. One call at a time until the rollout, the
# kills and the dead replica are behind it: a call takes at least 32 decode steps of 5 ms
# (molecule/shared/inventory/group_vars/all/simulated_host.yml), so the job cannot end before the
# rollout does, whatever the load; then resumed with 32 at a time to finish.
JOB = JobOnHost(GATEWAY, "fleet")
JOB_ROWS, JOB_TOKENS, SLOW, FAST = 2400, 32, 1, 32
JOB_MODEL = "llama-3.1-8b"
JOB_SETTINGS = {"sglang_job_name": "fleet", "sglang_job_model": JOB_MODEL}
WORDS = WordTokenizer.from_dir(None).vocab[40:400]
# The tokenizer of the replicas' model (/srv/models is the double's fixtures on the test hosts).
LLAMA_WORDS = WordTokenizer.from_dir(str(REPO / "gpusim/gpusim/fixtures/llama-3.1-8b-instruct"))
JOB_EVENTS: dict[str, Any] = {}


def on(name: str) -> Any:
    return testinfra.get_host(f"ansible://{name}?ansible_inventory={INVENTORY}")


def overrides(flags: dict[str, Any], server: str = "llama") -> dict[str, Any]:
    """Host overrides for one server's flags; the others keep what the tests before rolled out
    (the replicas their changed flag set, which the tests of the server across hosts keep)."""
    kept = {} if server == "llama" else {"llama": {"flags": CHANGED}}
    return {"sglang_server_overrides": {**kept, server: {"flags": flags}}}


def unit_identity(host: Any, unit: str = UNIT) -> tuple[str, str]:
    return host_reads.unit_identity(host, unit)


def lkg(host: Any, meta: str = META) -> dict[str, Any]:
    return host_reads.read_json(host, meta)


def router_workers(host: Any) -> list[dict[str, Any]]:
    """GET /workers with the key, from the gateway itself."""
    return host_reads.router_workers(host, API_KEY)


def healthy_workers() -> set[str]:
    return host_reads.healthy_workers(on(GATEWAY), API_KEY)


def traffic(label: str) -> TrafficUnit:
    """Four clients on fleet-gpu2 sending steady traffic through the router with the key."""
    return TrafficUnit(on(SECOND), label, unit="fleet-traffic", url=ROUTER, key=API_KEY)


def traffic_result(client: TrafficUnit, label: str) -> dict[str, Any]:
    """The client's result, also kept in reports/fleet/ for the record."""
    result = client.result()
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / f"traffic-{label}.json").write_text(json.dumps(result, indent=1))
    return result


def capacity_summary(result: dict[str, Any]) -> str:
    healthy = [s[1] for s in result["samples"]]
    below = sum(1 for h in healthy if h < len(REPLICAS))
    return (
        f"{result['requests']} requests, {result['failed']} failed, healthy replicas "
        f"min {min(healthy)} max {max(healthy)} of {len(REPLICAS)} over {len(healthy)} samples "
        f"({below} below {len(REPLICAS)}), {result['elapsed_s']} s"
    )


def rollout_events(run: PlaybookRun, host: str) -> list[dict[str, Any]]:
    return [
        e["event_data"]
        for e in run.events
        if e.get("event", "").startswith("runner_on_")
        and e["event_data"].get("host") == host
        and e["event_data"].get("play") in ROLLOUT_PLAYS
    ]


@contextmanager
def runner_kills(after_rows: list[int]) -> Iterator[list[dict[str, Any]]]:
    """SIGKILLs the job's runner while the block runs (a rollout), once for each number of rows
    the job must have finished since the kill before (or since the block began), each only once
    its unit has restarted the runner after the kill before. Yields the kills ({at_s, done}) as
    they happen."""
    kills: list[dict[str, Any]] = []
    stop = threading.Event()
    count = len(after_rows)

    def done() -> int:
        rows = JOB.status()["rows"]
        return int(rows["total"]) - int(rows["left"])

    def kill_each() -> None:
        began, mark = time.monotonic(), done()
        while len(kills) < count and not stop.wait(1.0):
            unit = JOB.unit_state()
            if unit.get("SubState") != "running" or int(unit.get("NRestarts") or 0) < len(kills):
                continue
            now = done()
            if now >= mark + after_rows[len(kills)]:
                JOB.kill()
                kills.append({"at_s": round(time.monotonic() - began, 1), "done": now})
                mark = now

    thread = threading.Thread(target=kill_each, daemon=True)
    thread.start()
    try:
        yield kills
    finally:
        stop.set()
        thread.join(30)


def expected_conversation(row: dict[str, Any]) -> list[dict[str, Any]]:
    """What the double answers the row through the router: its text is a function of the prompt
    and the sampling settings as the double receives them (gpusim.http_api.output_seed). The
    router (sglang-router 0.3.2) sends the body on re-serialized: temperature 0 arrives as 0.0,
    the messages as they were sent (tests/test_job_runner.py computes the same without it)."""
    messages: list[dict[str, Any]] = []
    for turn in row["conversations"]:
        if turn["role"] == "assistant":
            continue
        messages.append(turn)
        if turn["role"] == "user":
            stream = TextStream(LLAMA_WORDS, output_seed(messages, {"temperature": 0.0}))
            stream.advance(JOB_TOKENS)
            messages = [*messages, {"role": "assistant", "content": stream.text}]
    return messages


def test_a_job_starts_on_the_gateway_through_the_router_with_its_key_as_a_credential(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    rows = conversation_rows(JOB_ROWS, WORDS)
    path = write_input(
        tmp_path_factory.mktemp("job") / "fleet.jsonl",
        rows,
        ["not json", json.dumps({"id": "bad-1", "conversations": []})],
    )
    JOB_EVENTS["rows"] = rows
    run = run_playbook(
        "job.yml",
        extravars={
            **JOB_SETTINGS,
            "sglang_job_action": "start",
            "sglang_job_input": str(path),
            "sglang_job_max_tokens": JOB_TOKENS,
            "sglang_job_temperature": 0,
            "sglang_job_concurrency": SLOW,
        },
    )
    assert run.rc == 0, run.failures
    [said] = run.task_results("Say where the job sends its rows")
    JOB_EVENTS["said"] = said["msg"]
    # Through the router, for both replicas; the planner sized both for the job's lengths.
    assert said["msg"][0] == f"job fleet asks {JOB_MODEL} through:"
    assert said["msg"][1].startswith(
        f"{ROUTER} (the router of llama on {GATEWAY}, llama on {SECOND}): {SLOW} requests in "
        "flight, from sglang_job_concurrency (the planner: "
    ), said["msg"]
    unit = JOB.unit_state()
    assert unit["ActiveState"] == "active" and unit["UnitFileState"] == "enabled", unit
    gateway = on(GATEWAY)
    show = gateway.check_output("systemctl show -p User -p ExecStart %s", JOB.unit)
    unit_files = gateway.check_output("systemctl cat %s", JOB.unit)
    assert "User=sglang-job" in show
    # (systemd 252 shows a LoadCredential= setting as "[unprintable]": read from the files.)
    assert "LoadCredential=api-key:/etc/sglang-job/fleet.api-key" in unit_files
    for where in (
        show,
        unit_files,
        gateway.check_output("ps -eo args"),
        JOB.journal(),
        run.text(),
    ):
        assert API_KEY not in where
    # Its metrics, for the monitoring role's scrape.
    metrics = gateway.check_output(
        "python3 -c %s",
        "import urllib.request as u; print(u.urlopen('http://127.0.0.1:29100/metrics').read().decode())",
    )
    assert 'sglang_job_rows{job_name="fleet",state="left"}' in metrics


def test_the_router_serves_both_replicas_with_the_servers_key():
    host = on(GATEWAY)
    assert healthy_workers() == WORKERS
    assert host.service("sglang-router.service").is_running
    show = host.check_output("systemctl show -p User -p ExecStart sglang-router.service")
    assert "User=sglang-router" in show
    for where in (show, host.file("/etc/systemd/system/sglang-router.service").content_string):
        assert API_KEY not in where
    assert API_KEY not in host.check_output("ps -eo args")
    assert API_KEY not in host.check_output("journalctl -u sglang-router --no-pager -o cat")
    # Without the key the worker API refuses.
    out = host.run(
        "python3 -c %s", "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/workers')"
    )
    assert out.rc != 0 and "401" in out.stderr


def test_each_replica_listens_for_the_router_and_reports_metrics(host):
    assert host.socket("tcp://0.0.0.0:30000").is_listening
    launch = host.file(LAUNCH).content_string
    assert "--host 0.0.0.0" in launch and "--enable-metrics" in launch


def test_a_changed_flag_set_rolls_through_the_router_without_a_failed_request():
    before = {h: (unit_identity(on(h)), lkg(on(h))["config_hash"]) for h in REPLICAS}
    # The job started by the test before runs through this rollout; its runner is SIGKILLed
    # twice while the rollout runs, 20 rows in and 80 rows later (a few seconds and about half a
    # minute in, at one call at a time; the rollout takes a minute or more). The job's own test
    # checks every row afterwards.
    with traffic("changed") as client, runner_kills([20, 80]) as kills:
        began = time.monotonic()
        run = run_playbook("deploy.yml", extravars=overrides(CHANGED))
    assert run.rc == 0, run.failures
    JOB_EVENTS["kills"] = kills
    JOB_EVENTS["after_rollout"] = JOB.status()["rows"]
    JOB_EVENTS["rollout_s"] = round(time.monotonic() - began, 1)
    result = traffic_result(client, "changed")
    print("changed flag set:", capacity_summary(result), f"({run.task_headers} task headers)")
    # The two-host rollout's task headers, for the record (docs/TESTING.md).
    (REPORTS / "rollout-changed.json").write_text(json.dumps({"task_headers": run.task_headers}))
    for host in REPLICAS:
        identity, config = before[host]
        assert unit_identity(on(host)) != identity, f"{host} was not restarted"
        assert lkg(on(host))["config_hash"] != config
        assert "--chunked-prefill-size 4096" in on(host).file(LAUNCH).content_string
    assert result["failed"] == 0, result["failures"]
    assert result["requests"] > 50 and result["stopped_by"] == "stop_file"
    healthy = [s[1] for s in result["samples"]]
    # Never below N-1 of N; and the dip to N-1 happened (each replica really left the router).
    assert min(healthy) >= len(REPLICAS) - 1, healthy
    assert min(healthy) == len(REPLICAS) - 1
    assert healthy_workers() == WORKERS


def test_the_job_survives_two_kills_a_rollout_and_a_dead_replica_with_every_row_once() -> None:
    """The job that started before the rollout: two SIGKILLs of its runner during the rollout,
    one of the second replica's server now, then stop and resume; every row ends once, and each
    output row is what the double generated for its prompt."""
    kills = JOB_EVENTS["kills"]
    assert len(kills) == 2, f"the rollout ended before two kills: {kills}"
    assert int(JOB_EVENTS["after_rollout"]["left"]) > 0, JOB_EVENTS["after_rollout"]
    assert int(JOB.unit_state()["NRestarts"]) == 2
    # The second replica's server dies; its unit restarts it, the router takes it back, and the
    # job goes on through the first replica meanwhile.
    second, identity = on(SECOND), unit_identity(on(SECOND))
    done = JOB_ROWS + 2 - JOB.left()
    second.check_output("systemctl kill --signal=SIGKILL %s", UNIT)
    JOB.wait(
        lambda: unit_identity(second) != identity and second.service(UNIT).is_running,
        120,
        "the replica back",
    )
    JOB.wait(
        lambda: JOB_ROWS + 2 - JOB.left() >= done + 20, 120, "rows after the replica's SIGKILL"
    )
    JOB.wait(lambda: healthy_workers() == WORKERS, 120, "both replicas healthy in the router")
    assert JOB.left() > 0, "the job ended before the replica's SIGKILL was behind it"
    # stop: it drains and stays stopped (disabled: a reboot would not start it either).
    stopped = run_playbook("job.yml", extravars={**JOB_SETTINGS, "sglang_job_action": "stop"})
    assert stopped.rc == 0, stopped.failures
    unit = JOB.unit_state()
    assert unit["ActiveState"] == "inactive" and unit["UnitFileState"] == "disabled", unit
    status = JOB.status()
    assert status["state"] == "stopped" and status["rows"]["left"] > 0, status
    # resume: the same input, the job's own settings, more calls at once.
    resumed = run_playbook(
        "job.yml",
        extravars={**JOB_SETTINGS, "sglang_job_action": "resume", "sglang_job_concurrency": FAST},
    )
    assert resumed.rc == 0, resumed.failures
    [shown] = resumed.task_results("Show where the job stands")
    assert shown["msg"][0].startswith("fleet: "), shown["msg"]
    assert "unit sglang-job@fleet.service: " in " ".join(map(str, shown["msg"]))
    JOB.wait(lambda: JOB.status()["state"] == "finished", 600, "the job to finish")
    # Exactly once: every input row in one file, once; each output row what the double wrote.
    ended = JOB.ended()
    seen = where_each_row_ended(ended)
    rows = JOB_EVENTS["rows"]
    assert sorted(seen) == sorted([r["id"] for r in rows] + ["bad-1", f"line:{JOB_ROWS + 1}"])
    assert set(seen.values()) == {1}, [k for k, n in seen.items() if n > 1][:10]
    assert ended["error"] == [], ended["error"][:3]
    assert sorted(str(r.get("id", r.get("line"))) for r in ended["skipped"]) == sorted(
        ["bad-1", str(JOB_ROWS + 1)]
    )
    by_id = {r["id"]: r for r in rows}
    wrong = [
        out["id"]
        for out in ended["output"]
        if out["status"] != "success"
        or out["conversations"] != expected_conversation(by_id[out["id"]])
    ]
    assert wrong == [], f"{len(wrong)} rows differ from what the double generated: {wrong[:5]}"
    # Each start of the runner resumed from the ledger: the first, two after the kills, resume.
    openings = [line for line in JOB.journal().splitlines() if line.startswith("job fleet: ")]
    assert len(openings) >= 4, openings
    record = {"kills": kills, "after_rollout": JOB_EVENTS["after_rollout"], "openings": openings,
              "output": len(ended["output"]), "skipped": len(ended["skipped"]),
              "rollout_s": JOB_EVENTS["rollout_s"], "said": JOB_EVENTS["said"]}  # fmt: skip
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / "job.json").write_text(json.dumps(record, indent=1))
    print("job:", record)


def test_a_failing_flag_set_is_rolled_back_and_put_back_without_a_failed_request():
    canary, second = on(GATEWAY), on(SECOND)
    canary_lkg, second_identity = lkg(canary), unit_identity(second)
    # At -vvv: the key passes through the router's worker API (out, list, back) and never shows.
    with traffic("failing") as client:
        run = run_playbook(
            "deploy.yml", extravars={**overrides(FAILING), **OVERRULE}, cmdline="-vvv"
        )
    assert run.rc != 0
    assert API_KEY not in run.text()
    # The restart action took it out of the router and drained it before the stop.
    restarts = run.task_results("Stop, clean, start and wait for a real generation - llama")
    assert any(r.get("router_out") and r.get("drain") for r in restarts), restarts
    result = traffic_result(client, "failing")
    print("failing flag set:", capacity_summary(result))
    text = " ".join(msg for h, _, msg in run.failures if h == GATEWAY)
    assert "out of memory" in text.lower(), text
    assert f"Rolled back to the last-known-good configuration {canary_lkg['config_hash']}" in text
    assert {h for h, _, _ in run.failures} == {GATEWAY}
    # The rollout stopped at the canary: the second replica was checked, never touched.
    assert rollout_events(run, SECOND) == []
    assert unit_identity(second) == second_identity
    # The canary serves its old configuration and is back in the router.
    assert "0.99" not in canary.file(LAUNCH).content_string
    assert lkg(canary) == canary_lkg
    assert healthy_workers() == WORKERS
    assert result["failed"] == 0, result["failures"]
    healthy = [s[1] for s in result["samples"]]
    assert min(healthy) >= len(REPLICAS) - 1, healthy


# --- one server across both hosts --------------------------------------------------------------


def generate(host: Any, port: int, tokens: int = 8) -> int:
    """Completion tokens of one /generate on host:port, asked from the host itself."""
    script = (
        "import json, urllib.request;"
        f"body = json.dumps({{'text': 'hi', 'sampling_params': {{'max_new_tokens': {tokens},"
        " 'ignore_eos': True}}).encode();"
        f"r = urllib.request.Request('http://127.0.0.1:{port}/generate', data=body,"
        " headers={'Content-Type': 'application/json'});"
        "print(json.loads(urllib.request.urlopen(r, timeout=30).read())['meta_info']"
        "['completion_tokens'])"
    )
    return int(host.check_output("python3 -c %s", script))


def test_the_server_across_hosts_runs_one_rank_per_node_and_serves_from_node_0():
    node0, node1 = on(GATEWAY), on(SECOND)
    address = node0.interface("eth0").addresses[0]
    for rank, node in enumerate((node0, node1)):
        assert node.service(BIG_UNIT).is_running
        launch = node.file(BIG_LAUNCH).content_string
        for flag in ("--nnodes 2", f"--node-rank {rank}", f"--dist-init-addr {address}:50000"):
            assert flag in launch
        assert "--tp-size 2" in launch
        env = node.file("/etc/sglang/big.env").content_string
        assert 'NCCL_SOCKET_IFNAME="eth0"' in env and 'GLOO_SOCKET_IFNAME="eth0"' in env
    assert generate(node0, 30001) == 8
    # Node 1 answers only SGLang's dummy health endpoint.
    health = node1.run(
        "python3 -c %s",
        "import urllib.request as u; print(u.urlopen("
        "'http://127.0.0.1:30001/health', timeout=10).status)",
    )
    assert health.stdout.strip() == "200"


BIG_RESTART_TASK = "Stop, clean, start and wait for a real generation - big"


def test_a_changed_flag_set_restarts_every_node_of_the_server_together():
    nodes = (on(GATEWAY), on(SECOND))
    before = [(unit_identity(n, BIG_UNIT), lkg(n, BIG_META)["config_hash"]) for n in nodes]
    replicas = [unit_identity(n) for n in nodes]
    run = run_playbook("deploy.yml", extravars=overrides(CHANGED, "big"))
    assert run.rc == 0, run.failures
    for node, (identity, config) in zip(nodes, before, strict=True):
        assert unit_identity(node, BIG_UNIT) != identity
        assert lkg(node, BIG_META)["config_hash"] != config
        assert "--chunked-prefill-size 4096" in node.file(BIG_LAUNCH).content_string
    # Both nodes started in the same task (one include for both, in lockstep).
    starts = [
        e["event_data"]["host"]
        for e in run.events
        if e.get("event") == "runner_on_ok"
        and e["event_data"].get("task") == BIG_RESTART_TASK
        and e["event_data"].get("play") == MULTINODE_PLAY
    ]
    assert sorted(starts) == sorted(REPLICAS)
    # The replicas were not part of it.
    assert [unit_identity(n) for n in nodes] == replicas
    assert generate(nodes[0], 30001) == 8


def test_a_failing_flag_set_rolls_every_node_of_the_server_back():
    nodes = (on(GATEWAY), on(SECOND))
    old = [lkg(n, BIG_META) for n in nodes]
    replicas = [unit_identity(n) for n in nodes]
    run = run_playbook("deploy.yml", extravars={**overrides(FAILING, "big"), **OVERRULE})
    assert run.rc != 0
    failed = {h for h, _, _ in run.failures}
    assert failed == set(REPLICAS), run.failures
    text = " ".join(msg for _, _, msg in run.failures)
    assert "out of memory" in text.lower(), text
    for node, record in zip(nodes, old, strict=True):
        assert lkg(node, BIG_META) == record
        assert "0.99" not in node.file(BIG_LAUNCH).content_string
        assert node.service(BIG_UNIT).is_running
        assert f"Rolled back to the last-known-good configuration {record['config_hash']}" in text
    assert [unit_identity(n) for n in nodes] == replicas
    assert generate(nodes[0], 30001) == 8
