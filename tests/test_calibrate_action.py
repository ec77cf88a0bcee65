"""plugins/action/sglang_calibrate.py: one start's calibration, sequenced on the controller.

The host is replaced by a fake `_execute_module` that answers each module from a dict (the
journal's lines, /server_info, the installed version, nvidia-smi, the model files, the store),
and the state-files module's fake keeps what it would write (one run, inside the server's
folder). What is checked: the record the deploy keeps (the Kimi job's figures), the store and
side file it writes, the reasons when a start gives no calibration, that the API key goes to
the server and nowhere else, and check mode.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import load_plugin
from kimi_job import GPU, KIMI_LOG, KIMI_RUN_FLAGS

from sglang_fleet.capacity import calibration_record, calibration_store
from sglang_fleet.capacity.model_config import read_model_dir

ACTION = load_plugin("plugins/action/sglang_calibrate.py")
START_FACTS = load_plugin("plugins/modules/sglang_start_facts.py")
MODEL = Path(__file__).resolve().parent / "fixtures" / "models" / "kimi-k2.5-int4"
KIMI_CONFIG, KIMI_WEIGHTS = read_model_dir(MODEL)
STATE = "/var/lib/sglang-fleet/kimi"
STORE = f"{STATE}/calibration.json"
KEY = "sk-very-secret"
SERVER = {
    "name": "kimi",
    "unit": "sglang@kimi.service",
    "port": 8000,
    "device": "cuda",
    "gpus": [0, 1, 2, 3, 4, 5, 6, 7],
    "model_path": "/srv/models/kimi",
    "paths": {"state_dir": STATE, "calibration_file": STORE},
    "flags": dict(KIMI_RUN_FLAGS),
    "config_hash": "abc123",
}
# What the journal read's grep keeps (the action's MEMORY_LINES, in plain words).
MEMORY_WORDS = ("Load weight", "KV Cache", "Memory pool end", "graph end", "max_total_num_tokens=")
ARGS = {"server": SERVER, "python": "/opt/ml-env/bin/python", "nvidia_smi": "nvidia-smi"}


# The module by FQCN, as the action names it (sglang_fleet/collection.py).
START_FACTS_FQCN = "sglang_fleet.fleet.sglang_start_facts"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class FakeCalibrate(ACTION.ActionModule):
    """The action with the host replaced: each module answers from `host`."""

    def __init__(self, args: dict[str, Any], host: dict[str, Any], check_mode: bool = False):
        self._task = SimpleNamespace(
            args=args, async_val=0, check_mode=check_mode, action="sglang_calibrate", no_log=False
        )
        self._play_context = SimpleNamespace(check_mode=check_mode)
        self._connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir="/tmp/ansible-tmp"))
        self.host, self.calls, self.written, self.no_log = host, [], {}, []

    def _execute_module(self, module_name: str, module_args: dict, task_vars: Any = None) -> dict:
        self.calls.append((module_name, module_args))
        answer = getattr(self, "host_" + module_name.rsplit(".", 1)[-1], None)
        if answer is None:
            raise AssertionError(f"unexpected module {module_name}")
        return answer(module_args)

    def host_command(self, _args: dict) -> dict:
        return {"rc": 0, "stdout": self.host["version"]}

    def host_sglang_start_facts(self, args: dict) -> dict:
        """The module's answer: its own filter (pick) over the server's whole /server_info."""
        self.no_log.append(self._task.no_log)
        info = self.host.get("server_info")
        return {
            "lines": self.host["journal"],
            "server_info": START_FACTS.pick(info, args["server_info_paths"]) if info else None,
            "server_info_error": "" if info else "cannot reach the server",
            "store": self.host["files"].get(f"{args['folder']}/{args['store_name']}"),
        }

    def host_nvidia_gpu_info(self, _args: dict) -> dict:
        return {"gpus": self.host["gpus"]}

    def host_slurp(self, args: dict) -> dict:
        text = self.host["files"].get(args["src"])
        return {"content": _b64(text)} if text is not None else {"failed": True}

    def host_find(self, _args: dict) -> dict:
        return {"files": self.host.get("single_files", [])}

    def host_sglang_state_files(self, args: dict) -> dict:
        for item in args["files"]:
            path = f"{args['folder']}/{item['name']}"
            self.written[path] = (json.loads(item["content"]), item["mode"])
            self.host["files"][path] = item["content"]
        return {"changed": True, "written": [item["name"] for item in args["files"]]}

    def run_it(self) -> dict[str, Any]:
        return self.run(task_vars={"inventory_hostname": "gpu-a"})


def kimi_host(**change: Any) -> dict[str, Any]:
    host = {
        "journal": "\n".join(
            line for line in KIMI_LOG.splitlines() if any(w in line for w in MEMORY_WORDS)
        ),
        "server_info": {"version": "0.5.23", "api_key": KEY, "mem_fraction_static": 0.85},
        "version": "0.5.23\n",
        "gpus": [{"index": i, "name": GPU, "memory_total_mib": 97887} for i in range(8)],
        "files": {
            "/srv/models/kimi/config.json": json.dumps(KIMI_CONFIG),
            "/srv/models/kimi/model.safetensors.index.json": json.dumps(
                {"metadata": {"total_size": KIMI_WEIGHTS}}
            ),
        },
    }
    return host | change


def test_a_healthy_start_is_recorded_first_in_the_store() -> None:
    action = FakeCalibrate(ARGS | {"api_key": KEY}, kimi_host())
    result = action.run_it()
    record = result["record"]
    assert record["measured"]["max_total_num_tokens"] == 149800
    assert record["key"]["model_fingerprint"] == calibration_record.model_fingerprint(
        KIMI_CONFIG, KIMI_WEIGHTS
    )
    assert (record["key"]["gpu_name"], record["key"]["gpu_memory_mib"]) == (GPU, 97887)
    assert record["key"]["sglang_version"] == "0.5.23"
    assert record["config_hash"] == "abc123"
    assert "ansible_facts" not in result  # registered by the role
    assert result["changed"] is True
    store, mode = action.written[STORE]
    assert (store["records"], mode) == ([record], "0644")
    assert "149800 KV tokens" in result["msg"]
    assert len(result["steps"]) >= 5, result["steps"]


def test_the_api_key_goes_to_the_server_and_nowhere_else() -> None:
    action = FakeCalibrate(ARGS | {"api_key": KEY}, kimi_host())
    result = action.run_it()
    [read] = [args for name, args in action.calls if name == START_FACTS_FQCN]
    assert read["api_key"] == KEY and action.no_log == [True]
    assert KEY not in json.dumps(result)
    assert KEY not in json.dumps(action.written)
    # /server_info holds the key (as api_key): the host keeps it, the record's fields come back.
    picked = START_FACTS.pick(kimi_host()["server_info"], read["server_info_paths"])
    assert "api_key" not in picked and picked["mem_fraction_static"] == 0.85


def test_the_journal_read_keeps_only_the_memory_lines_of_this_start() -> None:
    action = FakeCalibrate(ARGS, kimi_host())
    action.run_it()
    [read] = [args for name, args in action.calls if name == START_FACTS_FQCN]
    assert read["unit"] == "sglang@kimi.service"
    assert read["max_lines"] == ACTION.MAX_JOURNAL_LINES
    wanted = re.compile(read["line_pattern"], re.IGNORECASE)  # as the module reads it
    # never server_args=: it lists every argument, an API key among them
    assert wanted.search("server_args=ServerArgs(api_key=x, mem_fraction_static=0.8)") is None
    assert wanted.search("KV Cache is allocated. #tokens: 1")


def test_a_start_without_figures_records_nothing_and_says_why() -> None:
    action = FakeCalibrate(ARGS, kimi_host(journal="", server_info=None))
    result = action.run_it()
    assert result["record"] is None and result["changed"] is False
    assert "kimi: no calibration recorded: the start-up log and /server_info lack" in result["msg"]
    assert action.written == {}


def test_a_damaged_entry_moves_to_a_side_file_and_the_good_ones_stay() -> None:
    host = kimi_host()
    first = FakeCalibrate(ARGS, host).run_it()["record"]
    bad = json.loads(json.dumps(first))
    bad["measured"]["free_after_graph_gib"] = 1e6
    bad["key"]["mem_fraction_static"] = 0.9
    host["files"][STORE] = json.dumps(calibration_store.dump_store([first, bad]))
    again = FakeCalibrate(ARGS, host)
    result = again.run_it()
    [(side_path, (side, mode))] = [(p, w) for p, w in again.written.items() if p != STORE]
    assert side_path.startswith(f"{STATE}/calibration.set-aside-") and mode == "0600"
    assert side["entries"][0]["content"] == bad
    assert [r["key"]["mem_fraction_static"] for r in again.written[STORE][0]["records"]] == [0.85]
    assert result["set_aside_path"] == side_path
    assert "measured.free_after_graph_gib 1e+06" in result["warnings"][0]


def test_a_cpu_server_is_keyed_by_the_hosts_ram() -> None:
    server = SERVER | {"device": "cpu"}
    action = FakeCalibrate(ARGS | {"server": server, "host_ram_mib": "409600"}, kimi_host())
    record = action.run_it()["record"]
    assert (record["key"]["gpu_name"], record["key"]["gpu_memory_mib"]) == ("cpu", 409600)
    assert "nvidia_gpu_info" not in [name for name, _ in action.calls]


def test_a_single_file_checkpoint_is_sized_from_its_file() -> None:
    host = kimi_host()
    del host["files"]["/srv/models/kimi/model.safetensors.index.json"]
    host["single_files"] = [{"path": "/srv/models/kimi/model.safetensors", "size": KIMI_WEIGHTS}]
    record = FakeCalibrate(ARGS, host).run_it()["record"]
    assert record["key"]["model_fingerprint"] == calibration_record.model_fingerprint(
        KIMI_CONFIG, KIMI_WEIGHTS
    )


def test_check_mode_measures_nothing() -> None:
    action = FakeCalibrate(ARGS, kimi_host(), check_mode=True)
    result = action.run_it()
    assert result["skipped"] is True and action.calls == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"server": SERVER, "python": "p"}, "nvidia_smi required"),
        (ARGS | {"server": {"name": "kimi"}}, "server must be a described server"),
    ],
)
def test_bad_arguments_are_named(args: dict[str, Any], message: str) -> None:
    with pytest.raises(ACTION.AnsibleActionFail, match=message):
        FakeCalibrate(args, kimi_host()).run_it()


def test_what_the_preflight_read_is_not_read_again() -> None:
    known = {
        "sglang_version": "0.5.23",
        "gpus": kimi_host()["gpus"],
        "fingerprints": {"kimi": calibration_record.model_fingerprint(KIMI_CONFIG, KIMI_WEIGHTS)},
    }
    action = FakeCalibrate(ARGS | {"known": known}, kimi_host(version="9.9.9\n"))
    record = action.run_it()["record"]
    assert record["key"]["sglang_version"] == "0.5.23"
    assert record["key"]["model_fingerprint"] == known["fingerprints"]["kimi"]
    assert (record["key"]["gpu_name"], record["key"]["gpu_memory_mib"]) == (GPU, 97887)
    called = [name.rsplit(".", 1)[-1] for name, _ in action.calls]
    assert "nvidia_gpu_info" not in called
    # One read of this start (lines, /server_info, the store), one write: no model file, no
    # version read again.
    assert called == ["sglang_start_facts", "sglang_state_files"]
