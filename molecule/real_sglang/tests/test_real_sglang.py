"""Real SGLang 0.5.23 on its CPU engine: the deployed host, then reruns through ansible-runner.

Order matters: the tests run top to bottom against one host. Each leaves the server serving on
the inventory's configuration, except the last (a SIGKILL, then the cleanup).
"""

from __future__ import annotations

import json
import os
import shlex
import time
from typing import Any

import host_reads
import pytest
import testinfra.utils.ansible_runner
from fleet_runner import REPO, run_playbook
from job_files import JobOnHost, conversation_rows, where_each_row_ended, write_input

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(
    os.environ["MOLECULE_INVENTORY_FILE"]
).get_hosts("gpu_hosts")

# A real start on 2 busy cores: importing SGLang for the flag check alone can take a minute, and
# a rollback test starts the server twice.
pytestmark = pytest.mark.timeout(900)

HOST = "real-sglang-cpu1"
UNIT = "sglang@tiny.service"
PORT = 30000
ML_ENV = "/opt/ml-env/versions/0.5.23/bin/python"
MODEL = "/srv/models/tiny-llama"
STATE = "/var/lib/sglang-fleet/tiny"
LOCK = REPO / "gpusim" / "tools" / "sglang-0.5.23-cpu.lock"
# The smoke workload of the scenario's inventory (group_vars/gpu_hosts/servers.yml).
PROMPTS, INPUT_LEN, OUTPUT_LEN, CONCURRENCY = 8, 32, 16, 4


CLEANUP_TASK = (
    "Kill the service's leftovers, then wait until these GPUs are clear - none (CPU servers)"
)


def request(host: Any, path: str, body: dict | None = None, timeout: int = 120) -> tuple[int, str]:
    """(HTTP status, body) of one request to the server, sent from the host itself."""
    script = (
        "import json, sys, urllib.error, urllib.request\n"
        f"body = {json.dumps(body)!r}\n"
        f"req = urllib.request.Request('http://127.0.0.1:{PORT}{path}',"
        " data=None if body == 'null' else body.encode(),"
        " headers={'Content-Type': 'application/json'})\n"
        "try:\n"
        f"    r = urllib.request.urlopen(req, timeout={timeout})\n"
        "    print(r.status); print(r.read().decode())\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code); print(e.read().decode())\n"
    )
    out = host.check_output("python3 -c %s", script)
    status, _, text = out.partition("\n")
    return int(status), text


def generate(host: Any, new_tokens: int) -> dict[str, Any]:
    body = {
        "text": "hello world",
        "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0},
    }
    status, text = request(host, "/generate", body)
    assert status == 200, text
    return json.loads(text)


def unit_identity(host: Any) -> tuple[str, str]:
    return host_reads.unit_identity(host, UNIT)


def unit_processes(host: Any) -> list[tuple[int, int, str]]:
    """(pid, RSS KiB, args) of every process in the unit's cgroup (v1 and v2 hosts alike)."""
    found = host.run("grep -l %s /proc/[0-9]*/cgroup", f"/{UNIT}").stdout.split()
    rows = []
    for path in found:
        pid = path.split("/")[2]
        out = host.run("ps -o rss=,args= -p %s", pid).stdout.strip()
        if out:
            rss, _, args = out.partition(" ")
            rows.append((int(pid), int(rss), args))
    return rows


def unit_memory_mib(host: Any) -> float:
    """What the unit's memory cgroup charges (anonymous memory and page cache), in MiB."""
    group = host.check_output("systemctl show -p ControlGroup --value %s", UNIT)
    for path in (f"/sys/fs/cgroup{group}/memory.current",
                 f"/sys/fs/cgroup/memory{group}/memory.usage_in_bytes"):  # fmt: skip
        if host.file(path).exists:
            return int(host.file(path).content_string) / 2**20
    raise AssertionError(f"no memory cgroup for {UNIT} ({group})")


def latest_smoke(host: Any) -> dict[str, Any]:
    name = host.check_output("ls -1 %s/smoke | sort | tail -n 1", STATE)
    return json.loads(host.file(f"{STATE}/smoke/{name}").content_string)


def test_provisioning_of_the_cpu_set_is_proven_over_the_cached_layer(host):
    """The image layer was made by ml_env; ml_env over it again installs nothing and its own
    verify (which imports SGLang) finds every pin of the lock."""
    run = run_playbook("provision.yml")
    assert run.rc == 0, run.failures
    assert run.changed_tasks(HOST) == []
    [verify] = run.task_results("Read the installed versions through the virtualenv's python")
    installed = json.loads(verify["stdout"])
    pins = [
        line.split("==")
        for line in LOCK.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert len(pins) > 100
    for name, version in pins:
        assert installed.get(name.lower().replace("_", "-")) == version, name
    assert installed["torch"] == "2.13.0+cpu"
    assert "sglang-fleet-torchvision-stand-in" in installed
    assert "sglang-fleet-sgl-kernel-stand-in" in installed
    assert [n for n in installed if n.startswith("nvidia")] == []
    # A CPU host: no driver was installed, and nothing provides nvidia-smi.
    assert not host.exists("nvidia-smi")


def test_real_sglang_runs_as_the_unit_on_the_cpu_engine_within_2_gb(host):
    assert host.service(UNIT).is_running
    assert host.socket(f"tcp://127.0.0.1:{PORT}").is_listening
    env = host.file("/etc/sglang/tiny.env").content_string
    assert "SGLANG_USE_CPU_ENGINE" in env and "CUDA_VISIBLE_DEVICES" not in env
    procs = unit_processes(host)
    args = [a for _, _, a in procs]
    launcher = next(a for a in args if "sglang.launch_server" in a)
    assert "--device cpu" in launcher and "--sleep-on-idle" in launcher
    assert any(a.startswith("sglang::scheduler") for a in args), args
    assert any(a.startswith("sglang::detokenizer") for a in args), args
    charged = unit_memory_mib(host)
    rss_mib = sum(rss for _, rss, _ in procs) / 1024
    print(
        f"real server: {len(procs)} processes, cgroup {charged:.0f} MiB, RSS sum {rss_mib:.0f} MiB"
    )
    assert charged < 2048


def test_a_generation_has_exact_token_counts(host):
    answer = generate(host, 24)
    assert answer["meta_info"]["completion_tokens"] == 24
    assert len(answer["output_ids"]) == 24
    assert answer["meta_info"]["finish_reason"]["type"] == "length"


def test_the_smoke_gate_counted_exact_tokens(host):
    result = latest_smoke(host)
    assert result["completed"] == PROMPTS and result["failed"] == 0
    assert result["total_input_tokens"] == PROMPTS * INPUT_LEN
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN


def test_rerun_changes_and_restarts_nothing(host):
    before = unit_identity(host)
    run = run_playbook("deploy.yml")
    assert run.rc == 0, run.failures
    assert run.changed_tasks(HOST) == []
    assert unit_identity(host) == before


def test_a_new_flag_set_rolls_out_and_calibrates_from_the_real_journal(host):
    """Also the store's rule (docs/CALIBRATION.md, "The store"): an entry no plan may use,
    put into the host's store beside the converge's good record, is moved to a side file by
    this start's record step, and the good record stays."""
    before = unit_identity(host)
    store = json.loads(host.file(f"{STATE}/calibration.json").content_string)
    damaged = json.loads(json.dumps(store["records"][0]))
    damaged["recorded_at"] = "2026-01-01T00:00:00Z"
    damaged["measured"]["free_after_graph_gib"] = 1e6
    store["records"].append(damaged)
    seeded = host.run(f"printf %s {shlex.quote(json.dumps(store))} > {STATE}/calibration.json")
    assert seeded.rc == 0, seeded.stderr
    change = {"sglang_server_overrides": {"tiny": {"flags": {"max_running_requests": 4}}}}
    run = run_playbook("deploy.yml", extravars=change, timeout=900)
    assert run.rc == 0, run.failures
    assert unit_identity(host) != before
    status, text = request(host, "/server_info")
    assert status == 200 and json.loads(text)["max_running_requests"] == 4
    [calibrated] = run.task_results("Read and record what this start measured - tiny")
    record = calibrated["record"]
    assert record is not None, calibrated
    print(f"calibration of the real start: {json.dumps(record)[:800]}")
    assert record["key"]["device"] == "cpu"
    assert record["measured"]["max_total_num_tokens"] == 4096
    store = json.loads(host.file(f"{STATE}/calibration.json").content_string)
    # What the record step said and did, for a failure to show where the record went.
    kept = [(r["config_hash"], r["recorded_at"]) for r in store["records"]]
    steps = (calibrated.get("steps"), calibrated.get("warnings"), calibrated.get("msg"))
    assert store["records"][0]["config_hash"] == record["config_hash"], (kept, steps)
    assert "2026-01-01T00:00:00Z" not in [r["recorded_at"] for r in store["records"]], kept
    [side] = host.run(f"ls {STATE}").stdout.split("calibration.set-aside-")[1:]
    side_file = host.file(f"{STATE}/calibration.set-aside-{side.split()[0]}")
    assert side_file.mode == 0o600
    [entry] = json.loads(side_file.content_string)["entries"]
    assert entry["content"] == damaged, entry
    assert "measured.free_after_graph_gib 1e+06 is outside" in entry["problem"]
    assert latest_smoke(host)["total_output_tokens"] == PROMPTS * OUTPUT_LEN


def test_a_flag_set_sglang_fails_on_is_rolled_back(host):
    """A context shorter than the smoke request (32 + 16 tokens): SGLang starts, passes the
    one-token health generation, then refuses every smoke request; the rollout goes back."""
    change = {"sglang_server_overrides": {"tiny": {"flags": {"context_length": 24}}}}
    run = run_playbook("deploy.yml", extravars=change, timeout=900)
    assert run.rc != 0
    messages = " ".join(msg for _, _, msg in run.failures)
    assert "Rolled back to the last-known-good configuration" in messages, messages
    status, text = request(host, "/server_info")
    assert status == 200 and json.loads(text)["context_length"] == 1024
    assert generate(host, 8)["meta_info"]["completion_tokens"] == 8
    assert "--context-length 1024" in " ".join(a for _, _, a in unit_processes(host))


def test_diagnose_gives_a_verdict_from_the_real_metrics(host):
    run = run_playbook("diagnose.yml", extravars={"diagnosis_window_s": 3})
    assert run.rc == 0, run.failures
    [kept] = [
        r
        for r in run.task_results("Keep the diagnosis for the table - tiny")
        if "ansible_facts" in r
    ]
    [row] = kept["ansible_facts"]["diagnosis_results"]
    diagnosis = row["diagnosis"]
    print(f"diagnosis of the real server: {json.dumps(diagnosis)[:600]}")
    assert diagnosis["verdict"]
    status, metrics = request(host, "/metrics")
    assert status == 200 and "sglang:realtime_tokens_total" in metrics


def test_sglangs_own_benchmark_agrees_with_our_smoke_client(host):
    bench = (
        f"HF_HUB_OFFLINE=1 {ML_ENV} -m sglang.benchmark.serving --backend sglang"
        f" --host 127.0.0.1 --port {PORT} --dataset-name random-ids --tokenizer {MODEL}"
        f" --num-prompts {PROMPTS} --random-input-len {INPUT_LEN}"
        f" --random-output-len {OUTPUT_LEN} --random-range-ratio 1.0"
        f" --max-concurrency {CONCURRENCY} --seed 42 --output-file /tmp/bench.jsonl"
    )
    ran = host.run("cd /tmp && timeout 300 sh -c %s", bench)
    assert ran.rc == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    theirs = json.loads(host.file("/tmp/bench.jsonl").content_string.splitlines()[-1])
    ours_cmd = (
        f"/usr/bin/python3 /usr/local/lib/sglang-fleet/smoke.pyz --url http://127.0.0.1:{PORT}"
        f" --num-prompts {PROMPTS} --random-input-len {INPUT_LEN}"
        f" --random-output-len {OUTPUT_LEN} --max-concurrency {CONCURRENCY}"
        " --json /tmp/smoke.json"
    )
    ran = host.run(ours_cmd)
    assert ran.rc == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    ours = json.loads(host.file("/tmp/smoke.json").content_string)
    print(
        "bench_serving vs smoke: "
        + json.dumps(
            {
                k: (theirs[k], ours[k])
                for k in ("completed", "total_input_tokens", "total_output_tokens")
            }
        )
    )
    for key in ("completed", "total_input_tokens", "total_output_tokens"):
        assert theirs[key] == ours[key], key
    assert ours["total_output_tokens"] == PROMPTS * OUTPUT_LEN


# A few hundred rows through the real engine, by the same runner and playbook as the fleet's
# job (playbooks/job.yml), as many in flight as the planner says the CPU server holds for their
# lengths: SpecForge chat rows, which SGLang turns into prompts with the tiny Llama's chat template
# (gpusim/tools/make_tiny_llama.py), and OpenAI batch lines to /v1/completions (no template),
# each asking for exactly JOB_TOKENS tokens (ignore_eos).
JOB_CHATS, JOB_BATCH, JOB_TOKENS = 200, 100, 8


def tiny_word(n: int) -> str:
    """The tiny Llama's n-th made-up word (make_tiny_llama.word: a, b, ..., z, aa, ab, ...)."""
    out = ""
    while n >= 0:
        out = chr(ord("a") + n % 26) + out
        n = n // 26 - 1
    return out


WORDS = [tiny_word(n) for n in range(40, 240)]


def batch_lines(count: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"batch-{n}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": "tiny-llama",
                "prompt": " ".join(WORDS[n : n + 12]),
                "max_tokens": JOB_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for n in range(count)
    ]


def test_a_job_runs_a_few_hundred_rows_through_the_real_engine(host, tmp_path):
    job = JobOnHost(HOST, "real")
    chats, batch = conversation_rows(JOB_CHATS, WORDS, prefix="real"), batch_lines(JOB_BATCH)
    path = write_input(tmp_path / "real.jsonl", chats + batch)
    run = run_playbook(
        "job.yml",
        extravars={
            "sglang_job_name": "real",
            "sglang_job_action": "start",
            "sglang_job_input": str(path),
            "sglang_job_max_tokens": JOB_TOKENS,
            "sglang_job_temperature": 0,
            "sglang_job_sampling": {"ignore_eos": True},
        },
    )
    assert run.rc == 0, run.failures
    [said] = run.task_results("Say where the job sends its rows")
    print("job:", said["msg"])
    assert said["msg"][1].startswith(f"http://127.0.0.1:{PORT} (tiny on {HOST}): ")
    assert "from the planner's max_concurrent_requests for the job's lengths" in said["msg"][1]
    took = job.wait(lambda: job.status()["state"] == "finished", 600, "the job to finish")
    ended = job.ended()
    seen = where_each_row_ended(ended)
    assert sorted(seen) == sorted([r["id"] for r in chats] + [b["custom_id"] for b in batch])
    assert set(seen.values()) == {1}
    assert ended["error"] == [] and ended["skipped"] == [], (ended["error"] + ended["skipped"])[:3]
    by_id = {r["id"]: r for r in chats}
    for out in ended["output"]:
        if "custom_id" in out:  # a batch line: the engine's whole answer, exactly JOB_TOKENS
            assert out["error"] is None and out["response"]["status_code"] == 200, out
            assert out["response"]["body"]["usage"]["completion_tokens"] == JOB_TOKENS, out
            continue
        turns = out["conversations"]
        assert out["status"] == "success", out
        assert turns[:2] == by_id[out["id"]]["conversations"][:2]
        assert [t["role"] for t in turns] == ["system", "user", "assistant"]
        assert isinstance(turns[2]["content"], str)
    status = job.status()
    print(f"job: {JOB_CHATS + JOB_BATCH} rows in {took:.0f} s after its start, {status}")
    assert host.service(job.unit).is_enabled


def test_a_stop_lets_running_requests_finish_within_timeout_stop_sec(host):
    tokens = 400
    long_request = {
        "text": "hello world",
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0},
    }
    client = (
        "import json, urllib.request\n"
        f"req = urllib.request.Request('http://127.0.0.1:{PORT}/generate',"
        f" data={json.dumps(long_request)!r}.encode(),"
        " headers={'Content-Type': 'application/json'})\n"
        "out = urllib.request.urlopen(req, timeout=300).read().decode()\n"
        "open('/tmp/drained.json', 'w').write(out)\n"
    )
    host.run("rm -f /tmp/drained.json")
    host.run("nohup python3 -c %s >/tmp/drain-client.log 2>&1 &", client)
    # SGLang updates the gauge from its decode statistics (every 40 decode steps by default),
    # so on busy cores the request shows a while after it starts.
    deadline = time.monotonic() + 90
    running: list[str] = []
    while time.monotonic() < deadline:
        _, metrics = request(host, "/metrics")
        running = [
            line for line in metrics.splitlines() if line.startswith("sglang:num_running_reqs")
        ]
        if running and float(running[0].rsplit(" ", 1)[1]) >= 1:
            break
        time.sleep(0.2)
    else:
        log = host.file("/tmp/drain-client.log").content_string
        raise AssertionError(f"the long request never showed as running: {running} {log}")
    # sglang_server_drain_seconds of the scenario's inventory; systemd prints it as "2min".
    timeout_s = 120
    assert host.check_output("systemctl show -p TimeoutStopUSec --value %s", UNIT) == "2min"
    started = time.monotonic()
    host.run_test("systemctl stop %s", UNIT)
    took = time.monotonic() - started
    # The client writes its answer a moment after the server's last byte.
    written = time.monotonic() + 10
    while not host.file("/tmp/drained.json").exists and time.monotonic() < written:
        time.sleep(0.5)
    log = host.file("/tmp/drain-client.log").content_string
    assert host.file("/tmp/drained.json").exists, f"the running request was cut: {log}"
    drained = json.loads(host.file("/tmp/drained.json").content_string)
    print(f"stop with a {tokens}-token request running took {took:.1f} s (limit {timeout_s} s)")
    assert drained["meta_info"]["completion_tokens"] == tokens
    assert took < timeout_s, f"the stop took {took:.1f} s"
    journal = host.check_output("journalctl -u %s --no-pager -o cat -n 200", UNIT)
    assert "SIGTERM received" in journal
    # Back to serving for the next test, as systemd would bring it back after a reboot: the
    # unit's own start, unchanged, until the server answers a generation. (A deploy here would
    # prove nothing new: the tests above rolled out and back through deploy.yml.)
    host.run_test("systemctl start %s", UNIT)
    probe = (
        "import urllib.request\n"
        f"urllib.request.urlopen('http://127.0.0.1:{PORT}/health_generate', timeout=30)\n"
    )
    ready = time.monotonic() + 600
    while time.monotonic() < ready:
        if host.run("python3 -c %s", probe).rc == 0:
            break
        time.sleep(2)
    assert host.service(UNIT).is_running
    assert generate(host, 4)["meta_info"]["completion_tokens"] == 4


def test_after_a_sigkill_gpu_cleanup_leaves_nothing_of_ours(host):
    host.run_test("systemctl kill --kill-whom=main --signal=SIGKILL %s", UNIT)
    run = run_playbook("gpu_cleanup.yml")
    assert run.rc == 0, run.failures
    [cleaned] = [r for r in run.task_results(CLEANUP_TASK) if "clear" in r]
    print(f"cleanup after SIGKILL: {cleaned['msg']}")
    assert cleaned["clear"] is True and cleaned["accelerator"] == "cpu"
    assert not host.service(UNIT).is_running
    assert not host.socket(f"tcp://127.0.0.1:{PORT}").is_listening
    leftovers = [
        line
        for line in host.check_output("ps -eo pid=,args=").splitlines()
        if "sglang" in line and "ps -eo" not in line
    ]
    assert leftovers == []
    assert unit_processes(host) == []
