"""Deploy scenario: real state of the deployed host, then reruns driven through ansible-runner.

Order matters: the module's tests run top to bottom against one host, each leaving both servers
serving on the inventory's configuration.
"""

from __future__ import annotations

import os

import host_reads
import pytest
import testinfra.utils.ansible_runner
from fleet_runner import generate, run_playbook

# A playbook run with a restart and a smoke gate takes minutes, longer on busy shared cores
# (three scenarios at once on two cores) than pytest.ini's default of 300 s; every playbook bounds
# its own waits (as molecule/fleet).
pytestmark = pytest.mark.timeout(900)

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(
    os.environ["MOLECULE_INVENTORY_FILE"]
).get_hosts("gpu_hosts")

HOST = "deploy-gpu1"
UNITS = {"llama-a": "sglang@llama-a.service", "llama-b": "sglang@llama-b.service"}
PORTS = {"llama-a": 30000, "llama-b": 30001}
API_KEY = os.environ.get("MOLECULE_SGLANG_API_KEY", "sk-canary-0f3b9e2d71")


def unit_identity(host, name: str) -> tuple[str, str]:
    return host_reads.unit_identity(host, UNITS[name])


def test_both_servers_run_as_units(host):
    for name, unit in UNITS.items():
        service = host.service(unit)
        assert service.is_running, name
        assert service.is_enabled, name
        assert host.socket(f"tcp://127.0.0.1:{PORTS[name]}").is_listening


def test_servers_answer_a_generation(host):
    assert generate(host, PORTS["llama-a"])["meta_info"]["completion_tokens"] == 4
    assert generate(host, PORTS["llama-b"], API_KEY)["meta_info"]["completion_tokens"] == 4


def test_api_key_is_enforced_and_never_on_argv_unit_or_journal(host):
    with pytest.raises(AssertionError):
        generate(host, PORTS["llama-b"])  # no key: 401
    secrets = host.file("/etc/sglang/llama-b.secrets.yaml")
    assert (secrets.user, secrets.group, secrets.mode) == ("root", "root", 0o600)
    assert API_KEY in host.check_output("cat /etc/sglang/llama-b.secrets.yaml")
    for path in (
        "/etc/systemd/system/sglang@llama-b.service.d/10-launch.conf",
        "/etc/systemd/system/sglang@.service",
        "/etc/sglang/llama-b.env",
    ):
        assert API_KEY not in host.file(path).content_string, path
    assert API_KEY not in host.check_output("ps -eo args")
    assert API_KEY not in host.check_output("journalctl -u sglang@llama-b --no-pager -o cat")


def test_unit_runs_hardened_as_service_user_on_its_gpus(host):
    show = host.check_output(
        "systemctl show -p User -p KillMode -p TimeoutStopUSec -p Restart -p LimitNOFILE"
        " -p LimitMEMLOCK -p ProtectSystem -p PrivateTmp -p NoNewPrivileges sglang@llama-a"
    )
    props = dict(line.split("=", 1) for line in show.splitlines())
    assert props["User"] == "sglang"
    assert props["KillMode"] == "mixed"
    assert props["TimeoutStopUSec"] == "20s"
    assert props["Restart"] == "on-failure"
    assert props["LimitNOFILE"] == "1048576"
    assert props["LimitMEMLOCK"] == "infinity"
    assert props["ProtectSystem"] == "full"
    assert props["PrivateTmp"] == "yes"
    assert props["NoNewPrivileges"] == "yes"
    env_a = host.file("/etc/sglang/llama-a.env").content_string
    assert 'CUDA_VISIBLE_DEVICES="0,1"' in env_a or "CUDA_VISIBLE_DEVICES=0,1" in env_a
    assert "NCCL_PROTO" in env_a
    smi = host.check_output(
        "nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits"
    )
    gpus = host.check_output("nvidia-smi --query-gpu=index,uuid --format=csv,noheader,nounits")
    index_of = {u.strip(): int(i) for i, u in (line.split(",") for line in gpus.splitlines())}
    used = sorted({index_of[line.split(",")[1].strip()] for line in smi.splitlines()})
    assert used == [0, 1, 2, 3]


def test_rerun_with_same_inventory_changes_and_restarts_nothing(host):
    before = {name: unit_identity(host, name) for name in UNITS}
    run = run_playbook("deploy.yml")
    assert run.rc == 0, run.failures
    assert run.changed_tasks(HOST) == []
    assert {name: unit_identity(host, name) for name in UNITS} == before


def test_check_diff_shows_the_flag_change_and_restarts_nothing(host):
    before = {name: unit_identity(host, name) for name in UNITS}
    change = {"sglang_server_overrides": {"llama-a": {"flags": {"max_running_requests": 64}}}}
    run = run_playbook("deploy.yml", extravars=change, cmdline="--check --diff")
    assert run.rc == 0, run.failures
    after_text = "".join(str(d.get("after", "")) for d in run.diffs())
    assert "--max-running-requests 64" in after_text
    # Flag by flag against the last-known-good record, and a summary that says what would happen.
    said = [
        line
        for r in run.task_results("Say what a rollout would do to each server, flag by flag")
        for line in r.get("msg") or []
    ]
    assert "  + --max-running-requests 64" in said, said
    assert said[0].startswith("llama-a: would restart (") and "llama-b: unchanged" in said, said
    summary = [
        line
        for r in run.task_results("Fleet summary")
        if isinstance(r.get("msg"), list)
        for line in r["msg"]
    ]
    rows = {line.split()[1]: line for line in summary if line.startswith(HOST)}
    assert set(rows) == set(UNITS), summary
    assert rows["llama-a"].endswith(" would restart") and rows["llama-b"].endswith(" unchanged")
    assert {name: unit_identity(host, name) for name in UNITS} == before


def test_one_changed_flag_restarts_only_that_server(host):
    before = {name: unit_identity(host, name) for name in UNITS}
    change = {"sglang_server_overrides": {"llama-a": {"flags": {"max_running_requests": 64}}}}
    run = run_playbook("deploy.yml", extravars=change)
    assert run.rc == 0, run.failures
    assert unit_identity(host, "llama-a") != before["llama-a"]
    assert unit_identity(host, "llama-b") == before["llama-b"]
    assert "--max-running-requests" in host.check_output("ps -eo args")
    # Back to the inventory's configuration for the next tests.
    assert run_playbook("deploy.yml").rc == 0


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"not_a_real_flag": 1}, "sglang_server_instances[llama-a].flags"),
        ({"kv_cache_dtype": "fp9_bogus"}, "fp8_e4m3"),
        ({"enable_hierarchical_cache": True, "hicache_size": 300}, "hicache_size"),
    ],
    ids=["unknown-flag", "bad-choice", "hicache-over-host-ram"],
)
def test_bad_flag_sets_fail_before_the_running_server_is_touched(host, flags, expected):
    before = {name: unit_identity(host, name) for name in UNITS}
    run = run_playbook(
        "deploy.yml", extravars={"sglang_server_overrides": {"llama-a": {"flags": flags}}}
    )
    assert run.rc != 0
    messages = " ".join(msg for _, _, msg in run.failures)
    assert expected in messages, messages
    assert run.changed_tasks(HOST) == []
    assert {name: unit_identity(host, name) for name in UNITS} == before


def test_crash_at_start_is_reported_with_its_cause_and_rolled_back(host):
    before_b = unit_identity(host, "llama-b")
    # 0.99 leaves no room for CUDA graphs and prefill: the double dies with CUDA out of memory.
    # The first start calibrated the host, so the pre-flight would refuse 0.99 before anything
    # stops (docs/CALIBRATION.md); warn mode overrules that to exercise the crash and rollback.
    crash = {
        "sglang_server_overrides": {"llama-a": {"flags": {"mem_fraction_static": 0.99}}},
        "sglang_server_calibration_mode": "warn",
    }
    run = run_playbook("deploy.yml", extravars=crash)
    assert run.rc != 0
    messages = " ".join(msg for _, _, msg in run.failures)
    assert "out of memory" in messages.lower(), messages
    assert "Rolled back to the last-known-good configuration" in messages
    # The restart action's health wait (its `health`), which ended the restart.
    waits = [r["health"] for r in run.failed_results() if "elapsed_s" in (r.get("health") or {})]
    # Reported at the crash with its cause, not after the 1200 s health time-out.
    assert waits, run.failures
    assert "failed to start" in waits[0]["msg"]
    assert waits[0]["elapsed_s"] < 120
    assert generate(host, PORTS["llama-a"])["meta_info"]["completion_tokens"] == 4
    assert (
        "0.99"
        not in host.file(
            "/etc/systemd/system/sglang@llama-a.service.d/10-launch.conf"
        ).content_string
    )
    assert unit_identity(host, "llama-b") == before_b


# Every operator action, at the highest verbosity, never shows the API key: real runs where they
# change nothing on a converged host, check mode where a real run would stop servers. The last
# run changes the key itself under --check --diff: neither the old nor the new key may show.
KEY_SAFE_RUNS = [
    ("site.yml", "--check -vvv", {}),
    ("deploy.yml", "-vvv", {}),
    ("rollback.yml", "-vvv", {}),
    ("gpu_cleanup.yml", "--check -vvv", {}),
    ("diagnose.yml", "-vvv", {"diagnosis_window_s": 2}),
]


@pytest.mark.parametrize(("playbook", "cmdline", "extravars"), KEY_SAFE_RUNS)
def test_no_playbook_shows_the_api_key_at_any_verbosity(host, playbook, cmdline, extravars):
    before = {name: unit_identity(host, name) for name in UNITS}
    run = run_playbook(playbook, extravars=extravars, cmdline=cmdline)
    assert run.rc == 0, run.failures
    assert len(run.text()) > 10_000  # -vvv really ran: module arguments and results are shown
    assert API_KEY not in run.text()
    assert {name: unit_identity(host, name) for name in UNITS} == before


def test_a_changed_key_shows_in_no_diff(host):
    before = {name: unit_identity(host, name) for name in UNITS}
    new_key = "sk-canary-NEW-7d21c0"
    run = run_playbook(
        "deploy.yml",
        cmdline="--check --diff -vvv",
        env_overrides={"MOLECULE_SGLANG_API_KEY": new_key},
    )
    assert run.rc == 0, run.failures
    # The secrets file would change, so the server with the key would restart (check mode says
    # so and does nothing), without showing either key.
    [decided] = run.task_results("Decide which servers restart")
    assert decided["ansible_facts"]["sglang_server_restart_names"] == ["llama-b"], decided
    assert API_KEY not in run.text()
    assert new_key not in run.text()
    assert {name: unit_identity(host, name) for name in UNITS} == before
