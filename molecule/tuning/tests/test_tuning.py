"""Tuning scenario: calibration, the calibrated pre-flight, live diagnosis and autotune.

One host, one server (Llama 3.1 8B with 70 x the layers, TP 1, with an API key). The tests run
top to bottom and each leaves the server serving:

1. the converge's start (0.88, bf16 KV) calibrated the host;
2. the Kimi job's KV-bound load (150 concurrent requests on bf16 KV) is diagnosed live;
3. 0.97 is refused before anything stops (sglang_server_calibration_mode: warn overrules it:
   the deploy and rollout scenarios start their 0.99 crash that way);
4. 0.90 with fp8 KV rolls out, its token budget within 2 % of the calibrated plan; from here
   on the "inventory" (NOW, as extra vars) says 0.90 with fp8;
5. autotune refuses fp8 in its space unless the operator allows it;
6. an autotune run killed in its first trial leaves the host serving; 7. the rerun repeats
   that trial (which now runs out of memory under load, a gpusim fault: rolled back), finishes
   and restores last-known-good; 8. a rerun with autotune_apply rolls the winner out;
9. a deploy with the winner committed to the inventory changes nothing;
10. speculative decoding (NGRAM) without max_running_requests is refused before anything stops
    when sglang_server_speculation_reset says refuse, and warned in the plan by default;
11. with max_running_requests set the double serves it, and the diagnosis of a load reads its
    accept length from /metrics.

Timings are printed (pytest -s), never asserted.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import host_reads
import pytest
import testinfra
import testinfra.utils.ansible_runner
import yaml
from fleet_runner import PlaybookRun, generate, run_playbook

INVENTORY = os.environ["MOLECULE_INVENTORY_FILE"]
testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(INVENTORY).get_hosts("gpu_hosts")

HOST = "tuning-gpu1"
UNIT = "sglang@llama.service"
PORT = 30000
STATE = "/var/lib/sglang-fleet/llama"
CALIBRATIONS = f"{STATE}/calibration.json"
META = f"{STATE}/lkg/meta.json"
LAUNCH = "/etc/systemd/system/sglang@llama.service.d/10-launch.conf"
API_KEY = os.environ.get("MOLECULE_SGLANG_API_KEY", "molecule-test-key")
KEY_FILE = "/root/.tuning-test-key"
PREFLIGHT_TASK = "Check every server before anything on the host changes (flags, ports, capacity)"
FAULTS = "/var/lib/gpusim/faults.yaml"
GPU = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
# After test 4 the inventory is taken to say this (passed as extra vars to every later run).
NOW_FLAGS = {"mem_fraction_static": 0.90, "kv_cache_dtype": "fp8_e4m3"}
NOW = {"sglang_server_overrides": {"llama": {"flags": NOW_FLAGS}}}
# The search's state and report: a folder of this test run, so that no earlier run's state is
# resumed.
REPORTS = Path(tempfile.mkdtemp(prefix="tuning-reports-"))
AUTOTUNE = NOW | {"autotune_reports_dir": str(REPORTS)}
SEARCH = REPORTS / HOST / "llama"
# The candidate that runs first (0.90, fp8, 96 running: the only one predicted to finish the
# job in two waves) dies under load with CUDA out of memory once it served one request.
CRASH_96 = "faults: [{mode: crash, after_requests: 1, when: {max_running_requests: 96}}]"


def on_host() -> Any:
    return testinfra.get_host(f"ansible://{HOST}?ansible_inventory={INVENTORY}")


def unit_identity(host: Any) -> tuple[str, str]:
    return host_reads.unit_identity(host, UNIT)


read_json = host_reads.read_json


@pytest.fixture(scope="module", autouse=True)
def _key_file() -> Any:
    """The API key in a root-only file on the host, for the test's own requests and load."""
    host = on_host()
    host.check_output("umask 077; printf %%s %s > %s", API_KEY, KEY_FILE)
    yield
    host.run("rm -f %s", KEY_FILE)


def server_info(host: Any) -> dict[str, Any]:
    script = (
        "import json, urllib.request;"
        f"key = open({KEY_FILE!r}).read().strip();"
        f"r = urllib.request.Request('http://127.0.0.1:{PORT}/server_info',"
        " headers={'Authorization': 'Bearer ' + key});"
        "print(urllib.request.urlopen(r, timeout=30).read().decode())"
    )
    return json.loads(host.check_output("python3 -c %s", script))


def metrics(host: Any) -> dict[str, float]:
    """The scheduler gauges of /metrics (no key needed there)."""
    script = (
        "import urllib.request;"
        f"r = urllib.request.urlopen('http://127.0.0.1:{PORT}/metrics', timeout=10);"
        "print(r.read().decode())"
    )
    values: dict[str, float] = {}
    for line in host.check_output("python3 -c %s", script).splitlines():
        for name in ("num_running_reqs", "num_queue_reqs"):
            if line.startswith(f"sglang:{name}"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def ran(run: PlaybookRun, task_prefix: str) -> list[dict[str, Any]]:
    """Events of tasks whose name starts with task_prefix that ran (not skipped)."""
    kinds = ("runner_on_ok", "runner_on_failed")
    return [
        e
        for e in run.events
        if e.get("event") in kinds and e["event_data"].get("task", "").startswith(task_prefix)
    ]


def failure_text(run: PlaybookRun) -> str:
    return " ".join(msg for _, _, msg in run.failures)


def summary_lines(run: PlaybookRun) -> list[str]:
    printed = [
        r["msg"] for r in run.task_results("Fleet summary") if isinstance(r.get("msg"), list)
    ]
    assert len(printed) == 1, "the fleet summary was not printed exactly once"
    return printed[0]


def seconds_between(first: dict[str, Any], second: dict[str, Any]) -> float:
    return (
        datetime.fromisoformat(second["created"]) - datetime.fromisoformat(first["created"])
    ).total_seconds()


def state() -> dict[str, Any]:
    return json.loads((SEARCH / "autotune-state.json").read_text())


# --- 1. calibration -------------------------------------------------------------------------
def test_the_first_start_calibrated_the_host(host):
    text = host.check_output("cat %s", CALIBRATIONS)
    assert API_KEY not in text
    [record] = json.loads(text)["records"]
    key, measured = record["key"], record["measured"]
    assert (key["mem_fraction_static"], key["kv_cache_dtype"]) == (0.88, "auto")
    assert (key["gpu_name"], key["gpu_memory_mib"]) == (GPU, 97887)
    assert key["sglang_version"] == "0.5.23"  # the venv's installed SGLang
    assert key["model_fingerprint"].startswith("sha256:")
    assert key["architecture"] == "LlamaForCausalLM"
    assert key["flags"]["mem_fraction_static"] == 0.88
    assert record["sources"] == ["log", "server_info"]
    assert measured["max_total_num_tokens"] == server_info(host)["max_total_num_tokens"]
    assert measured["free_after_graph_gib"] > 5
    stored = host.file(CALIBRATIONS)
    assert (stored.user, stored.mode) == ("root", 0o644)
    # /var/lib is on the container's disk, not a tmpfs: the records survive a reboot.
    assert host.check_output("findmnt -n -o FSTYPE -T %s", CALIBRATIONS) != "tmpfs"


# --- 2. live diagnosis of the Kimi job's KV-bound load -------------------------------------------
def test_the_kimi_jobs_kv_bound_load_is_diagnosed_with_the_fp8_and_fraction_levers(host):
    before = unit_identity(host)
    load = host.check_output(
        f"SGLANG_API_KEY=$(cat {KEY_FILE}) nohup timeout 90 python3 "
        f"/usr/local/lib/sglang-fleet/smoke.pyz --url http://127.0.0.1:{PORT} --duration 60 "
        "--max-concurrency 150 --random-input-len 100 --random-output-len 100 "
        "--warmup-requests 0 > /tmp/kv-load.log 2>&1 & echo $!"
    )
    try:
        deadline = time.monotonic() + 30
        while metrics(host).get("num_queue_reqs", 0) == 0:
            assert time.monotonic() < deadline, host.check_output("tail -5 /tmp/kv-load.log")
            time.sleep(1)
        tic = time.monotonic()
        run = run_playbook("diagnose.yml")
        took = time.monotonic() - tic
    finally:
        host.run("kill %s", load.strip())
    assert run.rc == 0, run.failures
    [result] = [r for r in run.task_results("Diagnose llama") if "ansible_facts" in r]
    diagnosis = result["ansible_facts"]["diagnosis_live"]
    print(f"\nKV-bound load: {diagnosis['summary']} (diagnose.yml {took:.0f} s)")
    assert diagnosis["verdict"] == "kv_cache_bound", diagnosis["summary"]
    assert diagnosis["row"]["running"] <= 45  # about 40 of 150 fit at 0.88 with bf16
    assert diagnosis["row"]["queued"] > 50
    codes = [lever["code"] for lever in diagnosis["levers"]]
    assert codes[0] == "kv_cache_dtype_fp8"
    assert any(code.startswith("mem_fraction_static") for code in codes), codes
    levers = json.dumps(diagnosis["levers"]).lower()
    assert "hicache" not in levers and "hierarchical" not in levers
    assert any("not a lever for decode slots" in note.lower() for note in diagnosis["notes"])
    [table] = [r["msg"] for r in run.task_results("Diagnosis of every server")]
    assert any("kv_cache_bound" in line and line.startswith(HOST) for line in table)
    assert unit_identity(host) == before  # no restart
    assert not host.file("/run/lock/sglang-fleet.lock").exists  # no lock
    deadline = time.monotonic() + 60
    while metrics(host).get("num_running_reqs", 0) > 0:  # let the aborted load drain
        assert time.monotonic() < deadline
        time.sleep(1)


# --- 3. the calibrated pre-flight --------------------------------------------------------
def test_097_is_refused_before_anything_stops(host):
    before = unit_identity(host)
    tic = time.monotonic()
    run = run_playbook(
        "deploy.yml",
        extravars={"sglang_server_overrides": {"llama": {"flags": {"mem_fraction_static": 0.97}}}},
    )
    took = time.monotonic() - tic
    assert run.rc != 0
    message = failure_text(run)
    assert "mem_fraction_static 0.970 leaves a predicted" in message, message
    assert "GiB free after CUDA graph capture, below the 5.0 GiB margin" in message
    assert "The highest fraction that keeps the margin is 0.9" in message
    assert "sglang_server_calibration_mode: warn" in message
    assert run.changed_tasks(HOST) == []
    assert unit_identity(host) == before
    assert generate(host, PORT, API_KEY)["meta_info"]["completion_tokens"] == 4
    [line] = [line for line in summary_lines(run) if line.startswith(HOST)]
    assert line.endswith("refused (calibrated)"), line
    first = run.events[0]
    [refusal] = [
        e
        for e in run.events
        if e.get("event") == "runner_on_failed"
        and e["event_data"].get("task", "") == PREFLIGHT_TASK
    ]
    print(
        f"\n0.97 refused before stop: {seconds_between(first, refusal):.1f} s from the start of "
        f"deploy.yml to the refusal, {took:.1f} s for the whole run; MainPID {before[0]} unchanged"
    )
    print("refusal:", message[:400])


# --- 4. 0.90 with fp8 KV ----------------------------------------------------------------------
def test_090_with_fp8_rolls_out_within_2_percent_of_the_calibrated_plan(host):
    before = unit_identity(host)
    run = run_playbook("deploy.yml", extravars=NOW)
    assert run.rc == 0, run.failures
    # Planned twice: by deploy.yml's check play and by the rollout; the same figures both times.
    plans = [r["plans"]["llama"] for r in run.task_results(PREFLIGHT_TASK)]
    assert len(plans) == 2, plans
    planned = plans[-1]
    assert plans[0]["max_total_num_tokens"] == planned["max_total_num_tokens"]
    assert planned["errors"] == []
    assert planned["details"]["calibrated"], planned["warnings"]
    reported = server_info(host)["max_total_num_tokens"]
    gap = abs(planned["max_total_num_tokens"] - reported) / reported
    print(
        f"\n0.90 fp8: planned max_total_num_tokens {planned['max_total_num_tokens']} "
        f"(calibrated: {planned['details']['calibration']}), reported {reported}, "
        f"gap {gap:.3%}; predicted free after CUDA graphs "
        f"{planned['details']['free_after_graph_gib']} GiB"
    )
    assert gap <= 0.02
    assert unit_identity(host) != before
    lkg = read_json(host, META)
    assert (lkg["flags"]["mem_fraction_static"], lkg["flags"]["kv_cache_dtype"]) == (
        0.90,
        "fp8_e4m3",
    )
    records = read_json(host, CALIBRATIONS)["records"]
    assert [(r["key"]["mem_fraction_static"], r["key"]["kv_cache_dtype"]) for r in records] == [
        (0.90, "fp8_e4m3"),
        (0.88, "auto"),
    ]
    [line] = [line for line in summary_lines(run) if line.startswith(HOST)]
    assert line.endswith("passed"), line


# --- 5.-9. autotune ----------------------------------------------------------------------------
def test_autotune_refuses_fp8_unless_the_operator_allows_it(host):
    before = unit_identity(host)
    run = run_playbook(
        "autotune.yml", extravars=AUTOTUNE | {"autotune_kv_cache_dtypes_allowed": ["auto"]}
    )
    assert run.rc != 0
    message = failure_text(run)
    assert (
        "autotune_space.kv_cache_dtype: fp8_e4m3 is not in autotune_kv_cache_dtypes_allowed"
        in message
    )
    assert run.changed_tasks(HOST) == []
    assert unit_identity(host) == before


def test_an_interrupted_autotune_leaves_the_host_serving(host):
    lkg_before = read_json(host, META)

    def healthy_trial(event: dict[str, Any]) -> bool:
        data = event.get("event_data", {})
        return event.get("event") == "runner_on_ok" and data.get("task", "").startswith(
            "Stop, clean, start and wait for a real generation"
        )

    run = run_playbook("autotune.yml", extravars=AUTOTUNE, interrupt_after=healthy_trial)
    assert run.status == "canceled", (run.status, run.failures)
    search = state()
    assert search["trials"] == [] and search["in_flight"]["n"] == 1
    assert search["in_flight"]["tuned"] == {
        "mem_fraction_static": 0.9,
        "max_running_requests": 96,
        "kv_cache_dtype": "fp8_e4m3",
    }
    assert "--max-running-requests 96" in host.file(LAUNCH).content_string  # the trial serves
    assert host.service(UNIT).is_running
    assert generate(host, PORT, API_KEY)["meta_info"]["completion_tokens"] == 4
    assert read_json(host, META) == lkg_before  # a trial never becomes last-known-good


@pytest.mark.timeout(900)  # two trials, a rollback and the restore: minutes on shared cores
def test_the_rerun_repeats_the_trial_rolls_back_its_crash_and_restores(host):
    lkg_before = read_json(host, META)
    host.check_output(f"printf '%s\\n' {CRASH_96!r} > {FAULTS}")
    try:
        tic = time.monotonic()
        run = run_playbook("autotune.yml", extravars=AUTOTUNE)
        took = time.monotonic() - tic
    finally:
        host.check_output(f"rm -f {FAULTS}")
    assert run.rc == 0, run.failures
    search = state()
    trials = search["trials"]
    print(f"\nautotune rerun: {took:.0f} s, {len(trials)} trials, stopped: {search['stop_reason']}")
    for t in trials:
        figures = f"{t['outcome']} {t['output_throughput']} tok/s oom={t['oom']}"
        print(f"  trial {t['n']} {t['tuned']}: {figures}")
    first = trials[0]
    assert first["tuned"]["max_running_requests"] == 96  # the trial in flight came back first
    assert (first["outcome"], first["oom"], first["phase"]) == ("failed", True, "smoke")
    assert any(t["outcome"] == "ok" for t in trials[1:])
    pruned = [c for c in search["candidates"] if c["status"] == "pruned"]
    calibrated = [c for c in pruned if c["tuned"]["mem_fraction_static"] == 0.97]
    assert len(calibrated) == 4
    assert all(c["prune"]["code"] == "oom_risk" for c in calibrated)
    assert all("GiB free after CUDA graph capture" in c["prune"]["reason"] for c in calibrated)
    # The report: table, picture, winner profile.
    stamp = search["started_at"]
    markdown = (SEARCH / f"autotune-{stamp}.md").read_text()
    assert "Pruned before trying" in markdown and "**Winner**: trial" in markdown
    assert (SEARCH / f"autotune-{stamp}.png").stat().st_size > 10_000
    profile = yaml.safe_load((SEARCH / f"autotune-{stamp}-profile.yml").read_text())
    winner = json.loads((SEARCH / f"autotune-{stamp}.json").read_text())["winner"]
    assert profile["sglang_server_profiles"]["llama-autotuned"] == winner["tuned"]
    # Back on last-known-good, which no trial overwrote; the calibrations survived the rollbacks.
    assert read_json(host, META) == lkg_before
    lkg_launch = host.check_output("cat %s/lkg/10-launch.conf", STATE)
    assert host.file(LAUNCH).content_string.strip() == lkg_launch.strip()
    assert generate(host, PORT, API_KEY)["meta_info"]["completion_tokens"] == 4
    records = read_json(host, CALIBRATIONS)["records"]
    flag_sets = {
        (r["key"]["mem_fraction_static"], r["key"]["max_running_requests"]) for r in records
    }
    assert {(0.88, None), (0.90, None), (0.90, 96)} <= flag_sets


def test_autotune_apply_rolls_the_winner_out_through_the_gated_path(host):
    finished = state()
    winner = json.loads((SEARCH / f"autotune-{finished['started_at']}.json").read_text())["winner"]
    run = run_playbook("autotune.yml", extravars=AUTOTUNE | {"autotune_apply": True})
    assert run.rc == 0, run.failures
    assert state()["trials"] == finished["trials"]  # the finished search is not run again
    assert ran(run, "Start, calibrate and benchmark the trial") == []
    lkg = read_json(host, META)
    for name, value in winner["tuned"].items():
        assert lkg["flags"][name] == value, name
    assert lkg["smoke_result"]["metrics"]["failed"] == 0  # gated: benchmarked and passed
    [line] = [line for line in summary_lines(run) if line.startswith(HOST)]
    assert line.endswith("passed"), line
    assert generate(host, PORT, API_KEY)["meta_info"]["completion_tokens"] == 4


def test_a_deploy_with_the_winner_committed_changes_nothing(host):
    before = unit_identity(host)
    winner = json.loads((SEARCH / f"autotune-{state()['started_at']}.json").read_text())["winner"]
    committed = {"sglang_server_overrides": {"llama": {"flags": NOW_FLAGS | winner["tuned"]}}}
    run = run_playbook("deploy.yml", extravars=committed)
    assert run.rc == 0, run.failures
    assert run.changed_tasks(HOST) == []
    assert unit_identity(host) == before


# --- 10.-11. speculative decoding (issue 46) ----------------------------------------------------
# NGRAM drafts from the prompt itself: no draft model to stage on the host. SGLang 0.5.23 resets
# max_running_requests to 48 for speculation when the flag set does not give it.
NGRAM = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4}


def _winner_flags() -> dict[str, Any]:
    winner = json.loads((SEARCH / f"autotune-{state()['started_at']}.json").read_text())["winner"]
    return NOW_FLAGS | winner["tuned"]


def test_speculation_without_max_running_requests_is_refused_or_warned_as_the_inventory_says(
    host,
):
    before = unit_identity(host)
    # A null removes a flag from every layer (docs/INVENTORY.md): the winner's too.
    flags = {**_winner_flags(), **NGRAM, "max_running_requests": None}
    overrides = {"sglang_server_overrides": {"llama": {"flags": flags}}}
    run = run_playbook(
        "deploy.yml", extravars=overrides | {"sglang_server_speculation_reset": "refuse"}
    )
    assert run.rc != 0
    message = failure_text(run)
    assert "reset to 48 for speculative decoding" in message, message
    assert "max_running_requests" in message
    assert run.changed_tasks(HOST) == []
    assert unit_identity(host) == before
    # warn (the default): the same flag set passes the pre-flight, its plan saying why; check
    # mode shows it and changes nothing.
    run = run_playbook("deploy.yml", extravars=overrides, cmdline="--check")
    assert run.rc == 0, run.failures
    [plan] = [r["plans"]["llama"] for r in run.task_results(PREFLIGHT_TASK)][:1]
    codes = [w["code"] for w in plan["warnings"]]
    assert "speculative_max_running_requests_reset" in codes, codes
    assert unit_identity(host) == before


def test_speculation_with_max_running_requests_serves_and_is_diagnosed(host):
    running = {**_winner_flags(), **NGRAM, "max_running_requests": 64}
    run = run_playbook(
        "deploy.yml", extravars={"sglang_server_overrides": {"llama": {"flags": running}}}
    )
    assert run.rc == 0, run.failures
    info = server_info(host)
    assert (info["speculative_algorithm"], info["max_running_requests"]) == ("NGRAM", 64)
    assert generate(host, PORT, API_KEY)["meta_info"]["completion_tokens"] == 4
    load = host.check_output(
        f"SGLANG_API_KEY=$(cat {KEY_FILE}) nohup timeout 60 python3 "
        f"/usr/local/lib/sglang-fleet/smoke.pyz --url http://127.0.0.1:{PORT} --duration 40 "
        "--max-concurrency 16 --random-input-len 100 --random-output-len 200 "
        "--warmup-requests 0 > /tmp/spec-load.log 2>&1 & echo $!"
    )
    try:
        time.sleep(8)  # a few decode log intervals: the accept gauges are published with them
        run = run_playbook("diagnose.yml")
    finally:
        host.run("kill %s", load.strip())
    assert run.rc == 0, run.failures
    [result] = [r for r in run.task_results("Diagnose llama") if "ansible_facts" in r]
    diagnosis = result["ansible_facts"]["diagnosis_live"]
    print(f"\nspeculating under load: {diagnosis['summary']}")
    accept = diagnosis["evidence"].get("spec_accept_length")
    assert accept is not None and accept >= 1, diagnosis["evidence"]
    assert any("Speculative decoding: accept length" in n for n in diagnosis["notes"])
