"""plugins/action/sglang_preflight.py: every server of a host checked before anything changes.

The host is replaced by a fake `_execute_module` that answers each module from a dict (GPUs,
the flag check, port holders, systemd's states, the model files, the calibration store). What
is checked: a clean host plans and passes with its bounds line; every kind of problem is named
in one failure; flag sets proven by an earlier play are not checked again; check mode reads
(never writes) and says what it cannot check yet; a CPU-only host reads no GPU; the facts the
later steps read.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ansible.errors import AnsibleActionFail
from conftest import load_plugin
from kimi_job import GPU

from sglang_fleet.capacity import calibration_record
from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.rollout import preflight_inputs as preflight
from sglang_fleet.servers.describe import describe_servers

ACTION = load_plugin("plugins/action/sglang_preflight.py")
MODEL = Path(__file__).resolve().parent / "fixtures" / "models" / "kimi-k2.5-int4"
KIMI_CONFIG, KIMI_WEIGHTS = read_model_dir(MODEL)
PYTHON = "/opt/ml-env/bin/python"
RUNTIME = {
    "python": PYTHON,
    "launch_module": "sglang.launch_server",
    "config_dir": "/etc/sglang",
    "state_dir": "/var/lib/sglang-fleet",
}
INSTANCE = {
    "name": "kimi",
    "model_path": "/srv/models/kimi",
    "port": 8000,
    "gpus": list(range(8)),
    "flags": {"mem_fraction_static": 0.88, "trust_remote_code": True},
}
WORKLOAD = {"avg_input_len": 1024, "avg_output_len": 256}


def describe(*instances: dict[str, Any], device: str = "cuda") -> list[dict[str, Any]]:
    return json.loads(
        json.dumps(describe_servers(list(instances), {}, {}, {}, runtime=RUNTIME, device=device))
    )


def args(servers: list[dict[str, Any]], **change: Any) -> dict[str, Any]:
    return {
        "servers": servers,
        "python": PYTHON,
        "launch_module": "sglang.launch_server",
        "nvidia_smi": "nvidia-smi",
        "host_ram_mib": 409600,
        "service_user": "sglang",
        "plan": True,
        "workload": WORKLOAD,
        "calibration_mode": "enforce",
        "warnings_fatal": False,
        "proven": {},
    } | change


def kimi_host(**change: Any) -> dict[str, Any]:
    host = {
        "gpus": [{"index": i, "name": GPU, "memory_total_mib": 97887} for i in range(8)],
        "python": True,
        "flag_problems": {},
        "version": "0.5.23",
        "users": {"sglang"},
        "holders": {},
        "states": {"sglang@kimi.service": "running"},
        "files": {
            "/srv/models/kimi/config.json": json.dumps(KIMI_CONFIG),
            "/srv/models/kimi/model.safetensors.index.json": json.dumps(
                {"metadata": {"total_size": KIMI_WEIGHTS}}
            ),
        },
    }
    return host | change


class FakePreflight(ACTION.ActionModule):
    """The action with the host replaced: each module answers from `host`."""

    def __init__(self, task_args: dict[str, Any], host: dict[str, Any], check_mode: bool = False):
        self._task = SimpleNamespace(
            args=task_args,
            async_val=0,
            check_mode=check_mode,
            action="sglang_preflight",
            no_log=False,
        )
        self._play_context = SimpleNamespace(check_mode=check_mode)
        self._connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir="/tmp/ansible-tmp"))
        self.host, self.calls = host, []

    def _execute_module(self, module_name: str, module_args: dict, task_vars: Any = None) -> dict:
        # Every read runs as in a real run, check mode or not: the modules change nothing.
        assert self._task.check_mode is False, module_name
        self.calls.append((module_name.rsplit(".", 1)[-1], module_args))
        return getattr(self, "host_" + module_name.rsplit(".", 1)[-1])(module_args)

    def host_sglang_host_state(self, args: dict) -> dict:
        """The one read (plugins/module_utils/host_read.py's answer, from `host`)."""
        read, host = args["read"], self.host
        gpus = host["gpus"]
        answer: dict[str, Any] = {
            "python_exists": host["python"],
            "user_exists": read["user"] in host["users"],
            "port_holders": {
                want["label"]: host["holders"].get(want["ours"]["ports"][0], [])
                for want in read["ports"]
            },
            "models": {folder: self._model(folder) for folder in read["models"]},
            "files": {path: host["files"].get(path) for path in read["files"]},
        }
        if read["nvidia_smi"]:
            answer["gpus"] = (
                {"error": "nvidia-smi not found"}
                if gpus is None
                else {"gpus": gpus, "gpu_count": len(gpus)}
            )
        running = [u for u in args["units"] if host["states"].get(u) == "running"]
        self.no_log_at_read = self._task.no_log
        unlisted = [r["label"] for r in args["routers"] if r["label"] in host.get("unlisted", ())]
        return {"changed": False, "running": running, "read": answer, "router_missing": unlisted}

    def _model(self, folder: str) -> dict[str, Any]:
        files = self.host["files"]
        index = files.get(f"{folder}/model.safetensors.index.json")
        weights = json.loads(index)["metadata"]["total_size"] if index else None
        return {"config": files.get(f"{folder}/config.json"), "weight_bytes": weights,
                "error": None}  # fmt: skip

    def host_sglang_flags_check(self, args: dict) -> dict:
        problem = self.host["flag_problems"].get(args["variable_prefix"])
        answer = {"sglang_version": self.host["version"], "problems": []}
        return answer | ({"failed": True, "msg": problem} if problem else {})

    def run_it(self) -> dict[str, Any]:
        return self.run(task_vars={"inventory_hostname": "gpu-a"})

    def modules(self) -> list[str]:
        return [name for name, _ in self.calls]


def test_a_clean_host_plans_every_server_and_passes_with_its_bounds_line() -> None:
    servers = describe(INSTANCE)
    action = FakePreflight(args(servers), kimi_host())
    result = action.run_it()
    assert not result.get("failed"), result["msg"]
    assert result["problems"] == []
    plan = result["plans"]["kimi"]
    assert plan["errors"] == [] and plan["max_total_num_tokens"] > 0
    [line] = result["lines"]
    assert line.startswith("kimi: ") and "KV tokens" in line and "Not calibrated" in line
    assert result["running"] == ["sglang@kimi.service"]
    assert result["sglang_version"] == "0.5.23"
    assert result["flags_key"] == preflight.flags_key(PYTHON, "sglang.launch_server", servers)
    assert result["bounds_shown"] == {"kimi": line}
    assert result["lkg_records"] == {"kimi": None}  # no last-known-good record yet
    # What the calibration of the next start is keyed by, read once here.
    assert result["fingerprints"] == {
        "kimi": calibration_record.model_fingerprint(KIMI_CONFIG, KIMI_WEIGHTS)
    }
    assert "ansible_facts" not in result  # registered: facts would be shadowed by set_fact
    assert result["changed"] is False and len(result["steps"]) >= 5
    assert result["router_missing"] == []


ROUTER = {"url": "http://10.0.0.5:30080", "worker_url": "http://10.0.0.11:8000"}


def test_the_read_names_running_replicas_their_router_does_not_list() -> None:
    """One read asks each replica's router (its key under no_log); a replica that does not run
    is not put back, so only running ones are named."""
    kimi = INSTANCE | {"router": ROUTER}
    other = INSTANCE | {"name": "other", "port": 8001, "gpus": [],
                        "router": ROUTER | {"worker_url": "http://10.0.0.11:8001"}}  # fmt: skip
    servers = describe(kimi | {"gpus": [0, 1, 2, 3]}, other | {"gpus": [4, 5, 6, 7]})
    host = kimi_host(unlisted={"kimi", "other"})
    action = FakePreflight(args(servers, router_keys={"kimi": "sk-r", "other": ""}), host)
    result = action.run_it()
    [read] = [a for name, a in action.calls if name == "sglang_host_state"]
    assert [r["label"] for r in read["routers"]] == ["kimi", "other"]
    assert read["router_keys"] == {"kimi": "sk-r"} and action.no_log_at_read is True
    assert action._task.no_log is False
    assert result["router_missing"] == ["kimi"]  # other's unit does not run
    assert "sk-r" not in json.dumps(result)


def test_every_problem_is_named_in_one_failure() -> None:
    other = INSTANCE | {"name": "other", "port": 8001, "gpus": [7]}  # GPU 7 twice
    servers = describe(INSTANCE, other)
    prefix = "sglang_server_instances[kimi].flags"
    holder = {"pid": 4242, "user": "alice", "cmdline": "python serve.py", "ours": False,
              "reasons": ["not a unit of ours"]}  # fmt: skip
    host = kimi_host(
        flag_problems={prefix: f"1 problem(s) with the SGLang flags: {prefix}.tp_size: bad"},
        holders={8001: [holder]},
    )
    result = FakePreflight(args(servers), host).run_it()
    assert result["failed"] is True
    lines = result["msg"].splitlines()
    assert any("GPU 7 is also used by kimi" in line for line in lines), lines
    assert any(f"{prefix}.tp_size: bad" in line for line in lines), lines
    assert any(
        "sglang_server_instances[other].port: port 8001 is held by a program that is not "
        "sglang@other.service"
        in line
        and "pid 4242 (alice)" in line
        for line in lines
    ), lines
    # The descriptions are wrong: nothing is planned on them.
    assert result["plans"] == {}
    assert result["flags_key"] is None


def test_a_planner_refusal_blocks_with_the_servers_name() -> None:
    servers = describe(
        INSTANCE | {"flags": {"mem_fraction_static": 0.1}}
    )  # no room for the weights
    result = FakePreflight(args(servers), kimi_host()).run_it()
    assert result["failed"] is True
    assert result["msg"].startswith("sglang_server_instances[kimi]: "), result["msg"]
    assert result["bounds"]["kimi"].startswith("kimi: ")


def test_flag_sets_an_earlier_play_proved_are_not_checked_again() -> None:
    servers = describe(INSTANCE)
    first = FakePreflight(args(servers), kimi_host())
    fact = first.run_it()
    assert "sglang_flags_check" in first.modules()
    again = FakePreflight(args(servers, proven=fact), kimi_host())
    result = again.run_it()
    assert "sglang_flags_check" not in again.modules()
    assert result["sglang_version"] == "0.5.23"
    assert result["lines"] == []  # the same bounds line was shown by the earlier play
    # A changed flag set is checked again.
    changed = describe(INSTANCE | {"flags": {"mem_fraction_static": 0.85}})
    third = FakePreflight(args(changed, proven=fact), kimi_host())
    third.run_it()
    assert "sglang_flags_check" in third.modules()


def test_the_host_is_read_once_and_the_flags_checked_once_per_server() -> None:
    action = FakePreflight(args(describe(INSTANCE)), kimi_host())
    action.run_it()
    assert action.modules() == ["sglang_host_state", "sglang_flags_check"]
    [read] = [a["read"] for name, a in action.calls if name == "sglang_host_state"]
    # The service user's processes are ours only once it exists (host_read drops it before).
    assert read["user"] == "sglang"
    assert read["ports"][0]["ours"]["users"] == ["root", "sglang"]
    assert read["version"] is False  # the flag check says it
    assert read["files"] == [
        "/var/lib/sglang-fleet/kimi/calibration.json",
        "/var/lib/sglang-fleet/kimi/lkg/meta.json",
    ]


def test_check_mode_before_provisioning_says_what_it_cannot_check_yet() -> None:
    files: dict[str, str] = {}
    action = FakePreflight(
        args(describe(INSTANCE)), kimi_host(python=False, files=files), check_mode=True
    )
    result = action.run_it()
    assert not result.get("failed"), result["msg"]
    assert "sglang_flags_check" not in action.modules()
    said = " ".join(result["lines"])
    assert f"{PYTHON} does not exist yet" in said
    assert "/srv/models/kimi/config.json does not exist yet" in said
    assert result["plans"] == {}


def test_a_version_that_is_not_installed_or_another_one_is_named_before_any_check() -> None:
    runtime = {**RUNTIME, "sglang_version": "0.5.24"}
    servers = json.loads(json.dumps(describe_servers([INSTANCE], {}, {}, {}, runtime=runtime)))
    action = FakePreflight(args(servers), kimi_host(python=False))
    result = action.run_it()
    assert result["failed"] is True
    assert "sglang_server_sglang_version 0.5.24" in result["msg"], result["msg"]
    assert "provision.yml" in result["msg"]
    assert "sglang_flags_check" not in action.modules()
    result = FakePreflight(args(servers), kimi_host(version="0.5.23")).run_it()
    assert result["failed"] is True
    assert "sglang_server_sglang_version is 0.5.24, but" in result["msg"]
    assert "holds SGLang 0.5.23" in result["msg"]


def test_a_missing_model_description_blocks_a_real_run() -> None:
    result = FakePreflight(args(describe(INSTANCE)), kimi_host(files={})).run_it()
    assert result["failed"] is True
    assert (
        "sglang_server_instances[kimi].model_path: /srv/models/kimi/config.json does not exist"
        in (result["msg"])
    )


def test_a_cpu_only_host_reads_no_gpu() -> None:
    cpu = {key: value for key, value in INSTANCE.items() if key != "gpus"}
    servers = describe(cpu, device="cpu")
    action = FakePreflight(args(servers), kimi_host(gpus=None))
    result = action.run_it()
    [read] = [a["read"] for name, a in action.calls if name == "sglang_host_state"]
    assert read["nvidia_smi"] == ""
    assert result["gpu_count"] == 0


def test_gpus_that_cannot_be_read_stop_the_check_at_once() -> None:
    action = FakePreflight(args(describe(INSTANCE)), kimi_host(gpus=None))
    result = action.run_it()
    assert result["failed"] is True
    assert result["msg"] == "the host's GPUs could not be read: nvidia-smi not found"
    assert action.modules() == ["sglang_host_state"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"calibration_mode": "strict"}, "sglang_server_calibration_mode must be one of"),
        ({"plan": "yes"}, "plan must be true or false"),
        ({"python": ""}, "python required"),
        ({"speculation_reset": "ignore"}, "sglang_server_speculation_reset must be one of"),
    ],
)
def test_bad_arguments_fail_before_the_host_is_read(change: dict, message: str) -> None:
    action = FakePreflight(args(describe(INSTANCE), **change), kimi_host())
    with pytest.raises(AnsibleActionFail, match=message):
        action.run_it()
    assert action.calls == []


def test_systemds_states_are_read_in_the_order_asked() -> None:
    units = ["a.service", "b.service", "c.service"]
    assert preflight.running_units(units, "running\n\ndead\n\nrunning\n") == [
        "a.service",
        "c.service",
    ]
    with pytest.raises(ValueError, match="2 state"):
        preflight.running_units(units, "running\n\ndead\n")


# --- speculative decoding (docs/SPECULATIVE.md) -------------------------------------------------
DRAFT = Path(__file__).resolve().parent / "fixtures" / "models" / "kimi-k2.5-eagle3"
DRAFT_CONFIG, DRAFT_WEIGHTS = read_model_dir(DRAFT)
EAGLE3_FLAGS = {
    "mem_fraction_static": 0.88,
    "kv_cache_dtype": "fp8_e4m3",
    "speculative_algorithm": "EAGLE3",
    "speculative_draft_model_path": "/srv/models/kimi-eagle3",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
}


def draft_files(config: dict[str, Any] = DRAFT_CONFIG) -> dict[str, str]:
    return {
        "/srv/models/kimi-eagle3/config.json": json.dumps(config),
        "/srv/models/kimi-eagle3/model.safetensors.index.json": json.dumps(
            {"metadata": {"total_size": DRAFT_WEIGHTS}}
        ),
    }


def speculative_host(files: dict[str, str]) -> dict[str, Any]:
    host = kimi_host()
    return host | {"files": host["files"] | files}


def test_the_draft_model_is_read_with_the_model_and_planned() -> None:
    servers = describe(INSTANCE | {"flags": EAGLE3_FLAGS | {"max_running_requests": 100}})
    action = FakePreflight(args(servers), speculative_host(draft_files()))
    result = action.run_it()
    assert not result.get("failed"), result["msg"]
    [read] = [a for name, a in action.calls if name == "sglang_host_state"]
    assert read["read"]["models"] == ["/srv/models/kimi", "/srv/models/kimi-eagle3"]
    draft = result["plans"]["kimi"]["speculative"]["draft"]
    assert (draft["architecture"], draft["budget_cell_bytes"]) == (
        "Eagle3DeepseekV2ForCausalLM",
        576,
    )


def test_a_missing_draft_model_blocks_naming_the_flag() -> None:
    servers = describe(INSTANCE | {"flags": EAGLE3_FLAGS | {"max_running_requests": 100}})
    result = FakePreflight(args(servers), kimi_host()).run_it()
    assert result["failed"] is True
    assert result["msg"] == (
        "sglang_server_instances[kimi].flags.speculative_draft_model_path: "
        "/srv/models/kimi-eagle3/config.json does not exist: the draft model is not on this host "
        "(SGLang would fail loading it after the old server stopped)"
    )


def test_a_draft_of_another_architecture_blocks_naming_the_flag() -> None:
    servers = describe(INSTANCE | {"flags": EAGLE3_FLAGS | {"max_running_requests": 100}})
    host = speculative_host(draft_files(KIMI_CONFIG))  # the target itself as an EAGLE-3 draft
    result = FakePreflight(args(servers), host).run_it()
    assert result["failed"] is True
    assert result["msg"].startswith(
        "sglang_server_instances[kimi].flags.speculative_draft_model_path: "
        "/srv/models/kimi-eagle3: EAGLE3 needs an EAGLE-3 draft"
    ), result["msg"]


@pytest.mark.parametrize("mode", ["warn", "refuse"])
def test_the_48_reset_is_warned_or_refused_as_the_inventory_chooses(mode: str) -> None:
    servers = describe(INSTANCE | {"flags": EAGLE3_FLAGS})
    workload = WORKLOAD | {"job_concurrency": 150}
    action = FakePreflight(
        args(servers, speculation_reset=mode, workload=workload),
        speculative_host(draft_files()),
    )
    result = action.run_it()
    said = "WARNING speculative_max_running_requests_reset" in result["bounds"]["kimi"]
    assert said is (mode == "warn")
    assert bool(result.get("failed")) is (mode == "refuse")
    if mode == "refuse":
        assert result["msg"].startswith(
            "sglang_server_instances[kimi]: --max-running-requests is not given: SGLang 0.5.23 "
            "resets it to 48"
        )
        assert "the job's 150 concurrent requests would run 48 at a time" in result["msg"]


def test_a_speculative_flag_sglang_would_change_is_refused_before_planning() -> None:
    flags = EAGLE3_FLAGS | {"speculative_num_draft_tokens": 6, "max_running_requests": 100}
    servers = describe(INSTANCE | {"flags": flags})
    result = FakePreflight(args(servers), speculative_host(draft_files())).run_it()
    assert result["failed"] is True
    assert result["msg"].startswith(
        "sglang_server_instances[kimi].flags.speculative_num_draft_tokens: 6: 6 with "
        "speculative_eagle_topk 1 and speculative_num_steps 3: SGLang 0.5.23 replaces it"
    ), result["msg"]
    assert result["plans"] == {}
