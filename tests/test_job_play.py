"""playbooks/job.yml's decisions on the control node (roles/sglang_job, docs/JOB.md): the
sglang_job_* settings typed, the input read, the job's record, the targets and their in-flight
requests, the unit's command line and what `status` shows; and the runner's per-server
concurrency that the unit's command line uses."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from sglang_fleet.module_utils import server_configs

from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.job import command_line, play_inputs, play_targets
from sglang_fleet.rollout import job_plans
from sglang_fleet.rollout.preflight_inputs import server_plan
from sglang_fleet.servers.describe import describe_servers

ROOT = Path(__file__).resolve().parent.parent
ROLE = ROOT / "roles" / "sglang_job"


def write_rows(path: Path, count: int, words: int = 8) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        for number in range(count):
            row = {
                "id": f"row-{number}",
                "conversations": [{"role": "user", "content": " ".join(["word"] * words)}],
            }
            handle.write(json.dumps(row) + "\n")
    return path


# --- the runner: one --concurrency, or one per --server -------------------------------------
def _capacities(*argv: str) -> list[int]:
    ns = command_line.parser().parse_args(["run", "in.jsonl", "--output", "out.jsonl", *argv])
    return [server.capacity for server in command_line._pool(ns, "").servers]


def test_one_concurrency_holds_for_every_server_and_one_each_pairs_in_order() -> None:
    a, b = "http://a:1", "http://b:1"
    assert _capacities("--server", a, "--server", b) == [16, 16]
    assert _capacities("--server", a, "--server", b, "--concurrency", "3") == [3, 3]
    assert _capacities(
        "--server", a, "--concurrency", "422", "--server", b, "--concurrency", "7"
    ) == [422, 7]


def test_a_concurrency_count_that_matches_no_rule_is_bad_usage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = write_rows(tmp_path / "in.jsonl", 2)
    argv = ["run", str(rows), "--output", str(tmp_path / "out.jsonl")]
    for url in ("http://127.0.0.1:9", "http://127.0.0.1:10"):
        argv += ["--server", url]
    code = command_line.main(
        [*argv, "--concurrency", "1", "--concurrency", "2", "--concurrency", "3"]
    )
    assert code == command_line.USAGE
    assert "--concurrency given 3 times for 2 --server" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


# --- the settings, each refusal naming its variable ------------------------------------------
DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text(encoding="utf-8"))


def settings(**change: Any) -> dict[str, Any]:
    values = {
        k: v
        for k, v in DEFAULTS.items()
        if k not in ("sglang_job_input", "sglang_job_workload", "sglang_job_api_key")
    }
    values.update({"sglang_job_name": "eagle3", **change})
    return play_inputs.check_settings(values)


def test_the_role_defaults_pass_and_come_back_typed() -> None:
    typed = settings(sglang_job_concurrency="8", sglang_job_temperature="0")
    assert typed["sglang_job_concurrency"] == 8 and typed["sglang_job_temperature"] == 0
    assert typed["sglang_job_max_tokens"] == 2048 and typed["sglang_job_avg_input_len"] is None


@pytest.mark.parametrize(
    ("change", "variable", "words"),
    [
        ({"sglang_job_action": "restart"}, "sglang_job_action", "start, status, stop, resume"),
        ({"sglang_job_name": "a b"}, "sglang_job_name", "plain word"),
        ({"sglang_job_name": "../x"}, "sglang_job_name", "plain word"),
        ({"sglang_job_name": "x\n"}, "sglang_job_name", "plain word"),
        ({"sglang_job_name": "a%i"}, "sglang_job_name", "plain word"),
        ({"sglang_job_concurrency": 0}, "sglang_job_concurrency", ""),
        ({"sglang_job_concurrency": 70000}, "sglang_job_concurrency", ""),
        ({"sglang_job_concurrency": "8 or 9"}, "sglang_job_concurrency", ""),
        ({"sglang_job_concurrency": 2.5}, "sglang_job_concurrency", ""),
        ({"sglang_job_max_tokens": True}, "sglang_job_max_tokens", ""),
        ({"sglang_job_top_p": 0}, "sglang_job_top_p", ""),
        ({"sglang_job_metrics_port": 80}, "sglang_job_metrics_port", "1024"),
        ({"sglang_job_sampling": {"max_tokens": 5}}, "sglang_job_sampling", "job's own fields"),
        ({"sglang_job_sampling": {"api_key": "x"}}, "sglang_job_sampling.api_key", "secret"),
        ({"sglang_job_sampling": "top_k=5"}, "sglang_job_sampling", "mapping"),
        ({"sglang_job_model": "--api-key"}, "sglang_job_model", "printable"),
        ({"sglang_job_state_dir": "/var/lib/../etc"}, "sglang_job_state_dir", "absolute"),
        ({"sglang_job_state_dir": "/"}, "sglang_job_state_dir", "absolute"),
        ({"sglang_job_user": "Root User"}, "sglang_job_user", "user"),
        (
            {"sglang_job_wheelhouse": "/w", "sglang_job_index_url": "http://i/simple"},
            "sglang_job_wheelhouse",
            "one source",
        ),
        ({"sglang_job_pip_packages": ["x>=1"]}, "sglang_job_pip_packages", "name==version"),
        ({"sglang_job_metrics_address": "a b"}, "sglang_job_metrics_address", "host name"),
    ],
)
def test_a_bad_setting_is_refused_naming_its_variable(
    change: dict, variable: str, words: str
) -> None:
    with pytest.raises(play_inputs.JobSettingError) as caught:
        settings(**change)
    assert caught.value.variable == variable
    assert str(caught.value).startswith(variable) and words in str(caught.value)


def test_the_key_problem_never_quotes_the_key() -> None:
    key = "sk-two words"
    problem = play_inputs.key_problem(key)
    assert problem and key not in problem and "sk-" not in problem
    assert play_inputs.key_problem("sk-fine-0123") is None


# --- the input, read on the control node -----------------------------------------------------
def test_the_input_is_read_with_its_rows_sha_and_estimated_lengths(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "in.jsonl", 10, words=20)  # 20 x "word" + spaces: 99 chars
    with path.open("a") as handle:
        handle.write("not json\n")
    facts = play_inputs.input_facts(str(path), 512)
    assert facts["rows"] == 11 and facts["unusable"] == 1 and facts["duplicates"] == 0
    assert facts["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert facts["avg_input_len"] == 25 and facts["avg_input_len_estimated"]  # ceil(99 / 4)
    assert facts["avg_output_len"] == 512
    given = play_inputs.input_facts(str(path), 512, 2000)
    assert given["avg_input_len"] == 2000 and not given["avg_input_len_estimated"]


def test_batch_lines_count_their_messages_or_prompt(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "x" * 400}]}},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "y" * 80}},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert play_inputs.input_facts(str(path), 16)["avg_input_len"] == 60  # (400 + 80) / 2 / 4


@pytest.mark.parametrize("kind", ["missing", "fifo", "folder", "empty", "no row"])
def test_an_input_the_job_cannot_use_is_refused_naming_the_variable(
    kind: str, tmp_path: Path
) -> None:
    path = tmp_path / "in.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "empty":
        path.write_text("")
    elif kind == "no row":
        path.write_text('{"id": 1}\n[]\n')
    with pytest.raises(play_inputs.JobSettingError) as caught:
        play_inputs.input_facts(str(path), 16)
    assert caught.value.variable == "sglang_job_input" and str(path) in str(caught.value)


# --- the job's record: one input and one set of settings per job -----------------------------
FACTS = {"path": "/in.jsonl", "size": 10, "sha256": "a" * 64, "rows": 3, "avg_input_len": 9}


def test_a_job_with_rows_done_keeps_its_input_and_settings() -> None:
    typed = settings(sglang_job_temperature=0)
    old = play_inputs.record(typed, FACTS, "llama")
    assert old["sampling"] == {"temperature": 0} and old["avg_input_len"] == 9
    other_input = play_inputs.record(typed, {**FACTS, "sha256": "b" * 64}, "llama")
    problem = play_inputs.record_problem(old, other_input, started=True)
    assert problem.startswith("sglang_job_input: job eagle3 has rows done with sha256 aaaa")
    assert "name a new job (sglang_job_name)" in problem
    other_tokens = play_inputs.record(settings(sglang_job_max_tokens=16), FACTS, "llama")
    assert play_inputs.record_problem(old, other_tokens, started=True).startswith(
        "sglang_job_max_tokens"
    )
    other_sampling = play_inputs.record(settings(sglang_job_temperature=0.5), FACTS, "llama")
    assert play_inputs.record_problem(old, other_sampling, started=True).startswith(
        "sglang_job_sampling"
    )
    # The same job again, or a job that never ran a row: nothing to keep.
    assert play_inputs.record_problem(old, dict(old), started=True) == ""
    assert play_inputs.record_problem(old, other_input, started=False) == ""


def test_resume_takes_the_jobs_own_model_tokens_and_sampling_from_its_record() -> None:
    old = play_inputs.record(settings(sglang_job_max_tokens=16, sglang_job_top_p=0.9), FACTS, "m")
    resumed = play_inputs.resumed_settings(settings(sglang_job_concurrency=64), old)
    assert resumed["sglang_job_max_tokens"] == 16 and resumed["sglang_job_model"] == "m"
    assert play_inputs.sampling(resumed) == {"top_p": 0.9}
    assert resumed["sglang_job_concurrency"] == 64
    with pytest.raises(play_inputs.JobSettingError, match="record is damaged"):
        play_inputs.resumed_settings(settings(), {"model": "m"})


# --- targets: the router when there is one, else each server ---------------------------------
def entry(host: str, name: str = "llama", **change: Any) -> dict[str, Any]:
    found = {"host": host, "name": name, "port": 30000, "listen": "0.0.0.0", "router_url": None,
             "model": "llama-3.1-8b", "planned": 211, "problem": None}  # fmt: skip
    found.update(change)
    return found


ROUTED = [entry(h, router_url="http://gw:8080") for h in ("gpu1", "gpu2")]


def test_replicas_behind_a_router_are_one_target_holding_the_sum_of_their_plans() -> None:
    chosen = play_targets.targets(ROUTED, "gw", None, None)
    assert chosen["model"] == "llama-3.1-8b"
    assert chosen["targets"] == [
        {"url": "http://gw:8080", "concurrency": 422, "planned": 422, "via": "router",
         "servers": ["llama on gpu1", "llama on gpu2"]}
    ]  # fmt: skip
    assert chosen["lines"] == [
        "http://gw:8080 (the router of llama on gpu1, llama on gpu2): 422 requests in flight, "
        "from the planner's max_concurrent_requests for the job's lengths (211 + 211)"
    ]
    forced = play_targets.targets(ROUTED, "gw", None, 4)
    assert forced["targets"][0]["concurrency"] == 4 and forced["targets"][0]["planned"] == 422
    assert "from sglang_job_concurrency (the planner: 422)" in forced["lines"][0]


def test_servers_without_a_router_are_each_a_target_on_their_own_url() -> None:
    servers = [
        entry("gpu1", planned=100),
        entry("gpu2", planned=7, listen="10.0.0.2"),
        entry("gw", listen="127.0.0.1"),
    ]
    chosen = play_targets.targets(servers, "gw", None, None)
    assert [(t["url"], t["concurrency"], t["via"]) for t in chosen["targets"]] == [
        ("http://gpu1:30000", 100, "server"),
        ("http://10.0.0.2:30000", 7, "server"),
        ("http://127.0.0.1:30000", 211, "server"),
    ]


def test_a_server_on_loopback_elsewhere_is_refused_naming_it() -> None:
    with pytest.raises(play_targets.JobSettingError) as caught:
        play_targets.targets([entry("gpu1", listen="127.0.0.1")], "gw", None, None)
    assert caught.value.variable == "sglang_job_host"
    assert "server llama on gpu1 listens on 127.0.0.1 only" in str(caught.value)


def test_the_jobs_model_chooses_its_servers() -> None:
    servers = [
        *ROUTED,
        entry("gpu1", name="big", port=30001, model="llama-2node", listen="127.0.0.1"),
    ]
    with pytest.raises(
        play_targets.JobSettingError, match=r"serve 2 models \(llama-2node, llama-3\.1-8b\)"
    ):
        play_targets.targets(servers, "gw", None, None)
    with pytest.raises(play_targets.JobSettingError, match="'mistral': no server serves it"):
        play_targets.targets(servers, "gw", "mistral", None)
    chosen = play_targets.targets(servers, "gw", "llama-3.1-8b", None)
    assert [t["url"] for t in chosen["targets"]] == ["http://gw:8080"]
    with pytest.raises(play_targets.JobSettingError, match="describe none"):
        play_targets.targets([], "gw", None, None)


def test_a_server_the_planner_could_not_size_needs_the_operators_concurrency() -> None:
    servers = [ROUTED[0], {**ROUTED[1], "planned": None, "problem": "/m: no config.json"}]
    with pytest.raises(play_targets.JobSettingError) as caught:
        play_targets.targets(servers, "gw", None, None)
    assert caught.value.variable == "sglang_job_concurrency"
    assert "llama on gpu2: /m: no config.json" in str(caught.value)
    assert play_targets.targets(servers, "gw", None, 8)["targets"][0]["concurrency"] == 8


def test_the_key_is_the_servers_one_key_or_the_operators() -> None:
    names = ["llama on gpu1", "llama on gpu2"]
    assert play_targets.api_key(dict.fromkeys(names, "sk-a"), names) == "sk-a"
    assert play_targets.api_key({}, names) == ""
    assert play_targets.api_key({names[0]: "sk-a"}, names, "sk-job") == "sk-job"
    with pytest.raises(play_targets.JobSettingError) as caught:
        play_targets.api_key({names[0]: "sk-a", names[1]: "sk-b"}, names)
    assert caught.value.variable == "sglang_job_api_key"
    assert "sk-a" not in str(caught.value) and "sk-b" not in str(caught.value)


# --- the unit's command line -------------------------------------------------------------------
PATHS = {
    "python": "/opt/sglang-job/bin/python",
    "program": "/usr/local/lib/sglang-fleet/job.pyz",
    "input": "/var/lib/sglang-job/j/input/input.jsonl",
    "output": "/var/lib/sglang-job/j/output/j.jsonl",
}
STOP = ["\n\nUser:", "a b", "50% $HOME;"]


def test_the_command_line_is_what_the_runner_parses_with_no_key_in_it() -> None:
    typed = settings(
        sglang_job_temperature=0, sglang_job_sampling={"stop": ["\n\nUser:", "a b", "50% $HOME;"]}
    )
    chosen = play_targets.targets(
        [*ROUTED, entry("gpu3", model="llama-3.1-8b", planned=5)], "gw", None, None
    )
    built = play_targets.command(typed, chosen, PATHS)
    argv = built["argv"]
    assert argv[:4] == [PATHS["python"], PATHS["program"], "run", PATHS["input"]]
    ns = command_line.parser().parse_args(argv[2:])
    assert ns.server == ["http://gw:8080", "http://gpu3:30000"] and ns.concurrency == [422, 5]
    assert ns.name == "eagle3" and ns.model == "llama-3.1-8b" and ns.max_tokens == 2048
    assert json.loads(ns.sampling) == {"stop": STOP, "temperature": 0}
    assert ns.metrics_port == 29100 and ns.metrics_address == "127.0.0.1"
    assert not any("key" in word for word in argv)
    # systemd reads the ExecStart= value back into the same words (its quoting rules, as the
    # project's one reader of ExecStart= lines reads them).
    [read_back] = server_configs.exec_start(built["exec_start"], "sglang-job@eagle3.service")
    assert list(read_back.argv) == argv


def test_status_shows_the_runners_line_and_the_unit() -> None:
    snapshot = {
        "job": "eagle3", "state": "running", "rows": {"total": 10, "output": 5, "error": 1,
        "skipped": 1, "left": 3}, "output_tok_s": 812.5, "rows_per_s": 2.0, "eta_s": 2,
        "errors_by_class": {"row": 1}, "retries_by_class": {"server": 4},
        "servers": [{"in_service": True}], "message": "",
    }  # fmt: skip
    unit = {
        "ActiveState": "active",
        "SubState": "running",
        "UnitFileState": "enabled",
        "NRestarts": "2",
    }
    lines = play_targets.status_lines("eagle3", snapshot, unit)
    assert lines[0].startswith(
        "eagle3: running, 7/10 rows (output 5, error 1, skipped 1, left 3), 812.5 tok/s"
    )
    assert "errors: row 1" in lines[0] and lines[1] == "retries by class: server 4"
    assert (
        lines[-1]
        == "unit sglang-job@eagle3.service: active/running, enabled at boot, restarted 2 time(s)"
    )
    stopped = {
        **unit,
        "ActiveState": "failed",
        "SubState": "failed",
        "ExecMainStatus": "1",
        "Result": "exit-code",
    }
    assert play_targets.status_lines("eagle3", None, stopped) == [
        "job eagle3: no ledger yet (never started here)",
        "unit sglang-job@eagle3.service: failed/failed, enabled at boot, restarted 2 time(s), "
        "last exit status 1 (exit-code)",
    ]


# --- each server planned for the job's lengths on its host ------------------------------------
CALIBRATION = "/var/lib/sglang-fleet/llama/calibration.json"


def test_servers_are_planned_for_the_jobs_lengths_and_a_missing_model_is_said() -> None:
    server = {"name": "llama", "port": 30000, "host": "0.0.0.0", "model_path": "/srv/models/m",
              "served_model_name": None, "nodes": [], "device": "cuda", "router": None,
              "paths": {"calibration_file": CALIBRATION}}  # fmt: skip
    asked = job_plans.read_request(
        [server, {**server, "name": "n1", "nodes": ["gpu0", "gpu1"]}],
        "gpu1",
        "nvidia-smi",
        "enforce",
    )
    assert asked == {"nvidia_smi": "nvidia-smi", "models": ["/srv/models/m"],
                     "files": ["/var/lib/sglang-fleet/llama/calibration.json"]}  # fmt: skip
    [found] = job_plans.entries(
        [server], "gpu1", {"models": {}}, {"avg_input_len": 30, "avg_output_len": 16}
    )
    assert found["planned"] is None and "/srv/models/m" in found["problem"]
    assert found["model"] == "/srv/models/m" and found["router_url"] is None
    with pytest.raises(ValueError, match="sglang_server_calibration_mode"):
        job_plans.entries([server], "gpu1", {}, {}, calibration_mode="sometimes")


KIMI = ROOT / "tests" / "fixtures" / "models" / "kimi-k2.5-int4"


def test_a_server_is_planned_as_the_preflight_plans_it_for_the_jobs_lengths() -> None:
    config, weights = read_model_dir(KIMI)
    runtime = {"python": "/opt/ml-env/bin/python", "launch_module": "sglang.launch_server",
               "config_dir": "/etc/sglang", "state_dir": "/var/lib/sglang-fleet"}  # fmt: skip
    instance = {"name": "kimi", "model_path": "/srv/models/kimi", "port": 8000,
                "gpus": list(range(8)), "router": {"url": "http://gw:30000"},
                "flags": {"mem_fraction_static": 0.88, "trust_remote_code": True}}  # fmt: skip
    servers = json.loads(
        json.dumps(
            describe_servers([instance], {}, {}, {}, runtime=runtime, cluster={"host": "gpu1"})
        )
    )
    gpus = [
        {"index": i, "name": "NVIDIA RTX PRO 6000", "memory_total_mib": 97887} for i in range(8)
    ]
    model = {"config": json.dumps(config), "weight_bytes": weights}
    found = {"gpus": {"gpus": gpus, "gpu_count": 8}, "mem_total_mib": 409600, "files": {},
             "models": {"/srv/models/kimi": model}}  # fmt: skip
    story = {"avg_input_len": 2000, "avg_output_len": 2000}
    [planned] = job_plans.entries(servers, "gpu1", found, story)
    expected = server_plan(
        servers[0],
        config,
        weights,
        gpus,
        409600,
        story,
        {"store": "", "mode": "enforce", "sglang_version": None},
    )
    assert planned == {"host": "gpu1", "name": "kimi", "port": 8000, "listen": "127.0.0.1",
                       "router_url": "http://gw:30000", "model": "/srv/models/kimi",
                       "planned": expected["max_concurrent_requests"], "problem": None}  # fmt: skip
    # Shorter rows: more of them at once.
    [short] = job_plans.entries(
        servers, "gpu1", found, {"avg_input_len": 200, "avg_output_len": 200}
    )
    assert short["planned"] > planned["planned"] > 0
    # GPUs that could not be read: said, not planned.
    [blind] = job_plans.entries(
        servers, "gpu1", {**found, "gpus": {"error": "nvidia-smi: not found"}}, story
    )
    assert blind["planned"] is None and "nvidia-smi: not found" in blind["problem"]


# --- the unit: what systemd restarts, read against the runner's exit statuses ------------------
def unit_settings() -> dict[str, str]:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(ROOT / "templates"), undefined=jinja2.StrictUndefined
    )
    env.filters["comment"] = lambda text: f"# {text}"
    text = env.get_template("sglang-job@.service.j2").render(
        ansible_managed="managed",
        **{k: v for k, v in DEFAULTS.items() if k.startswith("sglang_job_")},
    )
    return dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#")
    )


def test_the_unit_restarts_a_killed_runner_and_leaves_each_exit_status_to_the_operator() -> None:
    unit = unit_settings()
    assert unit["Restart"] == "on-failure"  # a signal (SIGKILL, the OOM killer) restarts it
    prevented = set(unit["RestartPreventExitStatus"].split())
    success = set(unit["SuccessExitStatus"].split())
    # Every status the runner ends with on its own is the operator's to act on, never a restart:
    # failed (a full disk) and bad usage are failures systemd does not retry; stopped (SIGTERM,
    # drained) is a clean end that resume starts again.
    statuses = {str(code) for code in command_line.EXIT.values()} | {str(command_line.USAGE)}
    assert statuses - {"0"} == prevented | success
    assert success == {str(command_line.EXIT["stopped"])}
    assert unit["User"] == "sglang-job" and unit["ProtectSystem"] == "strict"
    assert unit["NoNewPrivileges"] == "yes" and unit["CapabilityBoundingSet"] == ""
    assert "ExecStart" not in unit  # each job's drop-in gives its own
