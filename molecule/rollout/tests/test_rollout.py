"""Rollout scenario: the smoke gate, automatic rollback, the canary batch and the host lock.

Two hosts with one server each. Tests run top to bottom: the first ones change only the canary
(rollout-gpu1, --limit); the last one brings it back to the inventory's configuration.
Assertions read ansible-runner's events (which host failed in which task, with what message)
and the hosts' real state (unit identity, last-known-good record), never scraped output.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import host_reads
import pytest
import testinfra
import testinfra.utils.ansible_runner
from fleet_runner import REPO, PlaybookRun, generate, run_playbook

# A playbook run with a restart and a smoke gate takes minutes, longer on busy shared cores
# (three scenarios at once on two cores) than pytest.ini's default of 300 s; every playbook bounds
# its own waits (as molecule/fleet).
pytestmark = pytest.mark.timeout(900)

INVENTORY = os.environ["MOLECULE_INVENTORY_FILE"]
testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(INVENTORY).get_hosts("gpu_hosts")

CANARY, SECOND = "rollout-gpu1", "rollout-gpu2"
UNIT = "sglang@llama.service"
LAUNCH = "/etc/systemd/system/sglang@llama.service.d/10-launch.conf"
META = "/var/lib/sglang-fleet/llama/lkg/meta.json"
LOCK = "/run/lock/sglang-fleet.lock"
API_KEY = os.environ.get("MOLECULE_SGLANG_API_KEY", "sk-canary-0f3b9e2d71")
SUMMARY_TASK = "Fleet summary"

# At decode_step_s 0.005 a pool of 148 tokens (mem_fraction_static 0.1579, planner and double
# agree) admits one 64 + 64 request at a time: under 200 tok/s against a minimum of 400.
KV_BOUND = {"mem_fraction_static": 0.1579}
# No room left for CUDA graphs: the double dies at start-up with CUDA out of memory. The first
# deploy calibrated the host, so the pre-flight refuses 0.99 before anything stops
# (docs/CALIBRATION.md); warn mode overrules that, and the crash and its rollback still run.
CRASH = {"mem_fraction_static": 0.99}
OVERRULE = {"sglang_server_calibration_mode": "warn"}
GOOD = {"chunked_prefill_size": 4096}
# A server that answers wrongly: every stream ends cleanly after 1 of the 64 tokens asked for.
# The double's fault file (gpusim/README.md, "Faults") keys the fault to this flag value, so
# only the new configuration has it and the rollback serves right again; the roles know
# nothing of it.
TRUNCATING = {"chunked_prefill_size": 3072}
FAULTS = "/var/lib/gpusim/faults.yaml"
TRUNCATE_3072 = "faults: [{mode: truncate, tokens: 1, when: {chunked_prefill_size: 3072}}]"


def on(name: str) -> Any:
    return testinfra.get_host(f"ansible://{name}?ansible_inventory={INVENTORY}")


def overrides(flags: dict[str, Any]) -> dict[str, Any]:
    return {"sglang_server_overrides": {"llama": {"flags": flags}}}


def unit_identity(host: Any) -> tuple[str, str]:
    return host_reads.unit_identity(host, UNIT)


def lkg(host: Any) -> dict[str, Any]:
    return host_reads.read_json(host, META)


def summary_lines(run: PlaybookRun) -> list[str]:
    printed = [r["msg"] for r in run.task_results(SUMMARY_TASK) if isinstance(r.get("msg"), list)]
    assert len(printed) == 1, "the fleet summary was not printed exactly once"
    return printed[0]


def row(lines: list[str], host: str) -> str:
    (line,) = [line for line in lines if line.startswith(host)]
    return line


# deploy.yml checks every host first (read-only, all at once), then rolls out only the hosts
# that would change: a host the rollout never reached has events of the check play only.
# deploy.yml's plays that read (or stage weights on) every host before any rollout play runs.
EVERY_HOST_PLAYS = {
    "Stage the weights while the running servers serve",
    "Check every host before anything changes",
}


def hosts_with_events(run: PlaybookRun) -> set[str]:
    """Hosts the rollout plays reached (the staging and check plays run on every host)."""
    kinds = ("runner_on_ok", "runner_on_failed", "runner_on_skipped", "runner_item_on_ok")
    return {
        e["event_data"].get("host")
        for e in run.events
        if e.get("event") in kinds and e["event_data"].get("play") not in EVERY_HOST_PLAYS
    } - {None, "localhost"}


def failure_text(run: PlaybookRun, host: str) -> str:
    return " ".join(msg for h, _, msg in run.failures if h == host)


def test_first_deploy_passed_the_gate_on_both_hosts(host):
    record = json.loads(host.check_output("cat %s", META))
    smoke = record["smoke_result"]
    assert smoke["metrics"]["completed"] == 16
    assert smoke["metrics"]["failed"] == 0  # the API key reached the client
    assert smoke["metrics"]["output_throughput"] > 400
    assert smoke["workload"]["max_concurrency"] == 8
    assert smoke["verdict"] in {"healthy", "client_bound", "compute_bound", "unknown"}
    assert API_KEY not in host.check_output("cat %s", META)


def test_good_change_passes_and_becomes_last_known_good():
    canary = on(CANARY)
    before = lkg(canary)
    run = run_playbook("deploy.yml", extravars=overrides(GOOD), limit=CANARY)
    assert run.rc == 0, run.failures
    after = lkg(canary)
    assert after["flags"]["chunked_prefill_size"] == 4096
    assert after["config_hash"] != before["config_hash"]
    smoke = after["smoke_result"]
    assert smoke["metrics"]["output_throughput"] > 400
    report = Path(smoke["report"])
    assert report.is_file() and report.is_relative_to(REPO / "reports" / CANARY / "llama")
    assert json.loads(report.read_text())["completed"] == 16
    assert report.with_suffix(".png").stat().st_size > 10_000
    assert json.loads(report.with_suffix(".diagnosis.json").read_text())["verdict"]
    line = row(summary_lines(run), CANARY)
    assert after["config_hash"] in line and line.endswith("passed")
    print("good change:", line)


def test_crash_at_start_is_rolled_back_to_the_old_flags():
    canary = on(CANARY)
    before = lkg(canary)
    run = run_playbook("deploy.yml", extravars=overrides(CRASH) | OVERRULE, limit=CANARY)
    assert run.rc != 0
    text = failure_text(run, CANARY)
    assert "out of memory" in text.lower(), text
    assert f"Rolled back to the last-known-good configuration {before['config_hash']}" in text
    assert "rolled back" in row(summary_lines(run), CANARY)
    launch = canary.file(LAUNCH).content_string
    assert "0.99" not in launch and "--chunked-prefill-size 4096" in launch
    assert generate(canary, 30000, API_KEY)["meta_info"]["completion_tokens"] == 4
    assert lkg(canary) == before


def test_kv_bound_change_misses_the_throughput_gate_and_is_rolled_back():
    canary = on(CANARY)
    before = lkg(canary)
    run = run_playbook("deploy.yml", extravars=overrides(KV_BOUND), limit=CANARY)
    assert run.rc != 0
    text = failure_text(run, CANARY)
    # Which threshold, by how much, with the measured figures, and what bounded the server.
    assert "output_throughput" in text and "is below the minimum 400 (-" in text, text
    assert "(measured: output " in text and "p99 TTFT" in text, text
    assert "diagnosis: kv_cache_bound" in text, text
    assert "Rolled back to the last-known-good configuration" in text
    line = row(summary_lines(run), CANARY)
    assert line.endswith("rolled back")
    print("kv-bound change:", line)
    assert "0.1579" not in canary.file(LAUNCH).content_string
    assert generate(canary, 30000, API_KEY)["meta_info"]["completion_tokens"] == 4
    assert lkg(canary) == before


def test_a_server_that_truncates_its_answers_fails_the_gate_and_is_rolled_back():
    canary = on(CANARY)
    before = lkg(canary)
    canary.check_output("printf '%%s\\n' %s > %s", TRUNCATE_3072, FAULTS)
    try:
        run = run_playbook("deploy.yml", extravars=overrides(TRUNCATING), limit=CANARY)
        assert run.rc != 0
        text = failure_text(run, CANARY)
        # Clean streams, wrong output: every request failed as short_output, no output at all.
        assert "no request got the completion tokens it asked for" in text, text
        assert "(16 of 16 requests failed: short_output 16)" in text, text
        assert f"Rolled back to the last-known-good configuration {before['config_hash']}" in text
        line = row(summary_lines(run), CANARY)
        assert line.endswith("rolled back")
        print("truncating server:", line)
        assert "3072" not in canary.file(LAUNCH).content_string
        # The fault file is still there: last-known-good's flags do not match it.
        assert generate(canary, 30000, API_KEY)["meta_info"]["completion_tokens"] == 4
        assert lkg(canary) == before
    finally:
        canary.run("rm -f %s", FAULTS)


def test_a_bad_change_stops_at_the_canary():
    canary, second = on(CANARY), on(SECOND)
    second_before = unit_identity(second)
    second_lkg = lkg(second)
    run = run_playbook("deploy.yml", extravars=overrides(CRASH) | OVERRULE)
    assert run.rc != 0
    assert {h for h, _, _ in run.failures} == {CANARY}
    assert SECOND not in hosts_with_events(run)
    assert unit_identity(second) == second_before
    assert lkg(second) == second_lkg
    lines = summary_lines(run)
    assert row(lines, CANARY).endswith("rolled back")
    assert row(lines, SECOND).endswith("not reached")
    assert generate(canary, 30000, API_KEY)["meta_info"]["completion_tokens"] == 4


def _proc_starttime(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def lock_record(host: Any, pid: int, user: str) -> dict[str, Any]:
    """A lock as a run on this controller (the test process's) writes it (docs/LOCKING.md).

    pid names that run's ansible-playbook; its start time and command line are this process's
    when it is alive, so the lock's liveness rule finds it.
    """
    alive = Path(f"/proc/{pid}").exists()
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if alive else b"gone"
    boot_id = host.check_output("cat /proc/sys/kernel/random/boot_id").strip()
    uptime = float(host.check_output("cat /proc/uptime").split()[0])
    wall = float(host.check_output("date +%s"))
    return {
        "version": 1,
        "token": "0123456789abcdef0123456789abcdef",
        "run_id": f"test-{pid}",
        "owner": {
            "user": user,
            "uid": os.getuid(),
            "controller": os.uname().nodename,
            "controller_boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "controller_pidns": os.readlink("/proc/self/ns/pid"),
            "pid": pid,
            "pid_starttime": _proc_starttime(pid) if alive else 1,
            "cmdline_sha256": hashlib.sha256(cmdline).hexdigest(),
            "playbook": "deploy.yml",
        },
        "lease_s": 900,
        "depth": 1,
        "taken_at": "2026-11-30T00:00:00Z",
        "renewed_at": "2026-11-30T00:00:00Z",
        "host_clock": {
            "boot_id": boot_id,
            "taken_boottime": uptime - 200,
            "renewed_boottime": uptime - 200,
            "taken_wall": wall - 200,
            "renewed_wall": wall - 200,
        },
    }


def test_a_held_lock_fails_fast_naming_its_holder():
    canary = on(CANARY)
    before = unit_identity(canary)
    # A live holder on this controller: this test process stands for that run's playbook.
    record = lock_record(canary, os.getpid(), "alice")
    canary.run("printf '%%s\\n' %s > %s", json.dumps(record), LOCK)
    try:
        started = time.monotonic()
        run = run_playbook("deploy.yml", limit=CANARY)
        took = time.monotonic() - started
        assert run.rc != 0
        text = failure_text(run, CANARY)
        holder = f"is locked by alice@{os.uname().nodename} (pid {os.getpid()}"
        assert holder in text, text
        # Written 200 s "ago" on the host's own clock; the run reads it while it runs (which on
        # busy shared cores can take a minute), so the age lies between 200 s and 200 s plus
        # the run's own time: the age comes from the host's clock, not this controller's.
        age = re.search(r"taken (\d+) min (\d+) s ago by the host's clock", text)
        assert age, text
        assert 200 <= int(age[1]) * 60 + int(age[2]) <= 200 + took + 2, (text, took)
        assert f"that run still has 1 process(es) on this controller: pid {os.getpid()}" in text
        assert run.changed_tasks(CANARY) == []
        assert unit_identity(canary) == before
        assert json.loads(canary.check_output("cat %s", LOCK))["owner"]["user"] == "alice"
    finally:
        canary.run("rm -f %s", LOCK)


def test_a_stale_lock_is_taken_over_and_the_run_converges():
    canary = on(CANARY)
    # An interrupted run on this controller: no process of it is left (pid_max is never reached).
    canary.run("printf '%%s\\n' %s > %s", json.dumps(lock_record(canary, 4194304 + 1, "bob")), LOCK)
    run = run_playbook("deploy.yml", limit=CANARY)
    assert run.rc == 0, run.failures
    assert not canary.file(LOCK).exists
    # The fleet_lock action's result: the check play takes the stale lock over; the rollout play
    # takes it again after the check gave it back.
    outcomes = [r for r in run.task_results("Take this host's rollout lock") if "outcome" in r]
    assert [r["outcome"] for r in outcomes] == ["taken_over", "acquired"], outcomes
    taken = outcomes[0]
    assert taken["outcome"] == "taken_over", taken
    assert "took over the lock of bob@" in taken["msg"], taken["msg"]
    assert "no process of that run is left on this controller" in taken["msg"]
    # Back on the inventory's flags: the good change of the earlier test is gone again.
    assert "--chunked-prefill-size" not in canary.file(LAUNCH).content_string
    assert row(summary_lines(run), CANARY).endswith("passed")
