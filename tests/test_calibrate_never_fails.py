"""The calibrate step never rolls back a healthy start (issue 44, item 3), by construction.

`record_calibration.yml` runs inside the block of `roll_out_server.yml` whose rescue restores
last-known-good: a failed calibrate task would stop and roll back a server that passed its
health gate. Two proofs that any failure of reading or recording a start is a warning with the
reason (record null, an ok result):

- every concrete built-in exception type (and a few of Ansible's and the project's), raised
  from each step of the action: the start's read, the version, the device, the fingerprint,
  the record, the store's update and the write;
- the real task file in a real block under ansible-playbook (local connection), with stand-in
  modules in a test-only copy of the collection that answer hostile results (huge integers,
  NaN, wrong shapes, text that is no JSON) or fail or crash: no case reaches the rescue.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleActionFail, AnsibleConnectionFailure, AnsibleError
from conftest import collection_with_modules
from sglang_fleet.module_utils.typed_number import NumberError
from test_calibrate_action import ACTION, ARGS, KEY, SERVER, FakeCalibrate, kimi_host

from sglang_fleet.capacity import calibration, calibration_record, calibration_store

ROOT = Path(__file__).resolve().parent.parent


def _subclasses(base: type[BaseException]) -> Iterator[type[BaseException]]:
    for cls in base.__subclasses__():
        yield cls
        yield from _subclasses(cls)


def _instances() -> list[Exception]:
    """One instance of every concrete built-in Exception subclass that takes a message, the
    ones that take more built by hand, and the types the action's own code raises."""
    found: dict[type, Exception] = {}
    for cls in _subclasses(Exception):
        if cls.__module__ != "builtins" or cls in found:
            continue
        try:
            found[cls] = cls("boom")
        except Exception:  # needs other arguments: built by hand below
            continue
    by_hand: list[Exception] = [
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
        UnicodeEncodeError("ascii", "\xff", 0, 1, "ordinal not in range"),
        UnicodeTranslateError("\xff", 0, 1, "no mapping"),
        ExceptionGroup("several", [ValueError("one"), TypeError("two")]),
        # str() of this one raises: a message that holds a 5,000-digit integer.
        ValueError(10**5000) if hasattr(sys, "set_int_max_str_digits") else ValueError("x"),
        OverflowError("int too large to convert to float"),
        RecursionError("maximum recursion depth exceeded"),
        KeyError("memory_usage"),
        json.JSONDecodeError("Expecting value", "NaN", 0),
        NumberError("measured.pre_gib", "must be a finite number, got a 401-digit integer"),
        calibration.CalibrationError("no figures"),
        ACTION.NoCalibration("nothing measured"),
        AnsibleActionFail("sglang_calibrate: writing failed"),
        AnsibleConnectionFailure("the host went away"),
        AnsibleError("templating failed"),
    ]
    return [*found.values(), *by_hand]


EXCEPTIONS = _instances()

# Each step of the action and how to make it raise: a module run on the host (by its name) or
# a function of the package it calls.
MODULE_STEPS = {
    "start facts": "sglang_start_facts",
    "version": "command",
    "device": "nvidia_gpu_info",
    "fingerprint": "slurp",
    "state-files write": "sglang_state_files",
}
FUNCTION_STEPS = {
    "build_record": (calibration_record, "build_record"),
    "store_update": (calibration_store, "store_update"),
}


class Raising(FakeCalibrate):
    """The fake host, one of whose modules raises `exc` instead of answering."""

    def __init__(self, module: str | None, exc: BaseException) -> None:
        super().__init__(ARGS | {"api_key": KEY}, kimi_host())
        self.module, self.exc, self.raised = module, exc, False

    def _execute_module(self, module_name: str, module_args: dict, task_vars: Any = None) -> dict:
        if module_name.rsplit(".", 1)[-1] == self.module:
            self.raised = True
            raise self.exc
        return super()._execute_module(module_name, module_args, task_vars)


def _message(exc: BaseException) -> str:
    try:
        return str(exc) or type(exc).__name__
    except ValueError:  # a message holding a 5,000-digit integer
        return type(exc).__name__


def _assert_a_warning(result: dict[str, Any], exc: BaseException, where: str) -> None:
    assert not result.get("failed"), (where, result)
    assert result["record"] is None and result["changed"] is False, (where, result)
    assert result["msg"].startswith("kimi: no calibration recorded: "), (where, result["msg"])
    assert len(result["warnings"]) == 1 and result["msg"] in result["warnings"][0], where
    # The reason names what went wrong: the unforeseen type, or a foreseen one's own words.
    said = result["msg"].removeprefix("kimi: no calibration recorded: ")
    assert type(exc).__name__ in said or _message(exc) in said, (where, said)
    assert KEY not in json.dumps(result, default=str), where


def test_the_walk_finds_the_built_in_exception_types() -> None:
    names = {type(exc).__name__ for exc in EXCEPTIONS}
    assert {"OverflowError", "TypeError", "KeyError", "RecursionError", "MemoryError"} <= names
    assert {"UnicodeDecodeError", "ZeroDivisionError", "ExceptionGroup", "OSError"} <= names
    assert len(EXCEPTIONS) > 60, len(EXCEPTIONS)


@pytest.mark.parametrize("step", sorted(MODULE_STEPS))
def test_any_exception_of_a_module_step_is_a_warning(step: str) -> None:
    for exc in EXCEPTIONS:
        action = Raising(MODULE_STEPS[step], exc)
        _assert_a_warning(action.run_it(), exc, f"{step}: {type(exc).__name__}")
        assert action.raised, step  # the step was reached


@pytest.mark.parametrize("step", sorted(FUNCTION_STEPS))
def test_any_exception_of_the_records_code_is_a_warning(
    step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for exc in EXCEPTIONS:
        reached: list[bool] = []

        def raising(
            *_args: Any, _exc: BaseException = exc, _reached: list = reached, **_kwargs: Any
        ) -> Any:
            _reached.append(True)
            raise _exc

        monkeypatch.setattr(*FUNCTION_STEPS[step], raising)
        action = FakeCalibrate(ARGS | {"api_key": KEY}, kimi_host())
        result = action.run_it()
        _assert_a_warning(result, exc, f"{step}: {type(exc).__name__}")
        assert reached and action.written == {}, step


def test_a_write_that_fails_is_a_warning_and_names_the_folder() -> None:
    class FailingWrite(FakeCalibrate):
        def host_sglang_state_files(self, _args: dict) -> dict:
            return {"failed": True, "msg": "No space left on device"}

    result = FailingWrite(ARGS, kimi_host()).run_it()
    assert not result.get("failed") and result["record"] is None
    assert "writing in /var/lib/sglang-fleet/kimi: No space left on device" in result["msg"]


def test_interrupts_are_not_swallowed() -> None:
    """An operator's Ctrl-C (and the worker's exit) still stop the play: only Exception is a
    start's missing calibration."""
    with pytest.raises(KeyboardInterrupt):
        Raising("sglang_start_facts", KeyboardInterrupt()).run_it()


# --- the real block -----------------------------------------------------------------------
JOURNAL = kimi_host()["journal"]
GOOD_FACTS = {"lines": JOURNAL, "server_info": {"version": "0.5.23"}, "store": None}
HUGE = "9" * 5000
GPUS = [{"index": i, "name": "NVIDIA H200", "memory_total_mib": 143771} for i in range(8)]
KNOWN = {
    "sglang_version": "0.5.23",
    "gpus": GPUS,
    "fingerprints": {"kimi": "sha256:" + "0" * 32},
}

# A store on the host with a record whose key holds a 400-digit integer, an entry that is no
# record, and a record whose fraction is NaN text: each set aside, the start's record kept.
DAMAGED_STORE = (
    '{"schema": "sglang-fleet/calibrations/1", "records": ['
    '{"schema": 1, "key": {"tp_size": ' + "9" * 400 + '}, "measured": {"pre_gib": 1}}, '
    '[[[1]]], {"schema": 1, "key": {"mem_fraction_static": "NaN"}, "measured": {}}]}'
)

# case: (what sglang_start_facts prints, what sglang_state_files prints, overrides of the
# case's server / known / host RAM). "crash" raises inside the stand-in (a traceback, no JSON).
CASES: dict[str, dict[str, Any]] = {
    "healthy": {"facts": json.dumps(GOOD_FACTS)},
    "a 5000-digit figure in a line": {
        "facts": json.dumps(
            GOOD_FACTS
            | {
                "lines": JOURNAL.replace("#tokens: 149800", f"#tokens: {HUGE}").replace(
                    "max_total_num_tokens=149800", f"max_total_num_tokens={HUGE}"
                )
            }
        )
    },
    "NaN and huge integers in /server_info": {
        "facts": '{"lines": "", "store": null, "server_info": {"mem_fraction_static": NaN, '
        '"max_total_num_tokens": ' + "9" * 400 + ', "internal_states": [{"memory_usage": '
        '{"weight": Infinity, "kvcache": 1e308, "startup_available": 1e308, "graph": 1e308, '
        '"token_capacity": ' + "9" * 400 + "}}]}}"
    },
    "wrong shapes": {"facts": json.dumps({"lines": {"a": 1}, "server_info": [1, 2], "store": 5})},
    "a damaged store": {"facts": json.dumps(GOOD_FACTS | {"store": DAMAGED_STORE})},
    "the read failed": {"facts": '{"failed": true, "msg": "journalctl: permission denied"}'},
    "the read crashed": {"facts": "crash"},
    "the write failed": {
        "facts": json.dumps(GOOD_FACTS),
        "write": '{"failed": true, "msg": "No space left on device"}',
    },
    "hostile pre-flight facts": {
        "facts": json.dumps(GOOD_FACTS),
        "known": KNOWN | {"sglang_version": 10**30, "gpus": "all"},
        "gpu_info": json.dumps({"gpus": [{"index": 0, "name": "H200", "memory_total_mib": 1e308}]}),
    },
    # Refused before the action reads anything: the task file's own rescue says why.
    "an argument the action refuses": {"facts": json.dumps(GOOD_FACTS), "python": ""},
    "a CPU host's RAM as a huge integer": {
        "facts": json.dumps(GOOD_FACTS),
        "server": {"device": "cpu"},
        "host_ram_mib": 10**400,
    },
}

STAND_IN = '''#!/usr/bin/python
# WANT_JSON
"""Test stand-in for {name}: prints the case's answer as it is, or crashes."""
import json
import sys

ANSWERS = {answers!r}
with open(sys.argv[1]) as handle:
    args = json.load(handle)
answer = ANSWERS[args[{by!r}]]
if answer == "crash":
    raise RuntimeError("the stand-in crashed")
sys.stdout.write(answer)
'''


def _stand_ins(collections: Path, state: Path) -> None:
    """The host's modules for the cases: each answers by the case's unit or folder."""
    cases = list(enumerate(CASES.values()))
    written = '{"changed": true}'
    answers = {
        "sglang_start_facts": ("unit", {f"case-{i}": c["facts"] for i, c in cases}),
        "sglang_state_files": (
            "folder",
            {str(state / f"case-{i}"): c.get("write", written) for i, c in cases},
        ),
        "nvidia_gpu_info": (
            "nvidia_smi",
            {f"case-{i}": c.get("gpu_info", json.dumps({"gpus": GPUS})) for i, c in cases},
        ),
    }
    texts = {
        name: STAND_IN.format(name=name, answers=table, by=by)
        for name, (by, table) in answers.items()
    }
    collection_with_modules(collections, texts)


def _case_vars(index: int, name: str, case: dict[str, Any], state: Path) -> dict[str, Any]:
    server = dict(SERVER) | {
        "unit": f"case-{index}",
        "paths": {
            "state_dir": str(state / f"case-{index}"),
            "calibration_file": str(state / f"case-{index}" / "calibration.json"),
        },
    }
    return {
        "name": name,
        "server": server | case.get("server", {}),
        "known": case.get("known", KNOWN),
        "host_ram_mib": case.get("host_ram_mib", 0),
        "nvidia_smi": f"case-{index}",
        "python": case.get("python", "/nonexistent/python"),
    }


@pytest.mark.slow
def test_no_hostile_answer_reaches_the_rescue_of_the_real_block(tmp_path: Path) -> None:
    collections, state = tmp_path / "collections", tmp_path / "state"
    _stand_ins(collections, state)
    cases = [_case_vars(i, name, case, state) for i, (name, case) in enumerate(CASES.items())]
    (tmp_path / "cases.json").write_text(json.dumps({"cases": cases}), encoding="utf-8")
    task_file = ROOT / "roles" / "sglang_server" / "tasks" / "record_calibration.yml"
    # The block of roll_out_server.yml, reduced to the calibrate step: its rescue marks a rollback.
    one_case = [
        {
            "name": "Restart and gate {{ case.name }}",
            "block": [
                {"ansible.builtin.import_tasks": str(task_file)},
                {
                    "ansible.builtin.set_fact": {
                        "outcomes": "{{ outcomes + [{'case': case.name, "
                        "'record': sglang_server_calibration.record is not none, "
                        "'msg': sglang_server_calibration.msg, "
                        "'warnings': sglang_server_calibration.warnings | default([])}] }}"
                    }
                },
            ],
            "rescue": [
                {
                    "ansible.builtin.set_fact": {
                        "rolled_back": "{{ rolled_back + [{'case': case.name, "
                        "'msg': ansible_failed_result.msg | default('')}] }}"
                    }
                }
            ],
            "vars": {
                "sglang_server_target": "{{ case.server }}",
                "sglang_server_preflight": "{{ case.known }}",
                "__sglang_server_host_ram_mib": "{{ case.host_ram_mib }}",
                "sglang_server_nvidia_smi": "{{ case.nvidia_smi }}",
                "sglang_server_python": "{{ case.python }}",
            },
        }
    ]
    (tmp_path / "one_case.yml").write_text(json.dumps(one_case), encoding="utf-8")
    play = {
        "hosts": "localhost",
        "connection": "local",
        "gather_facts": False,
        "vars_files": [str(tmp_path / "cases.json")],
        "vars": {
            "ansible_python_interpreter": sys.executable,
            "__sglang_server_api_keys": {"kimi": KEY},
            "outcomes": [],
            "rolled_back": [],
        },
        "tasks": [
            {
                "ansible.builtin.include_tasks": str(tmp_path / "one_case.yml"),
                "loop": "{{ cases }}",
                "loop_control": {"loop_var": "case", "label": "{{ case.name }}"},
            },
            {
                "ansible.builtin.copy": {
                    "content": "{{ {'outcomes': outcomes, 'rolled_back': rolled_back} | to_json }}",
                    "dest": str(tmp_path / "out.json"),
                    "mode": "0600",
                }
            },
        ],
    }
    playbook = tmp_path / "play.yml"
    playbook.write_text(json.dumps([play]), encoding="utf-8")
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        # Test infrastructure only: the stand-ins replace the host's modules for this run.
        "ANSIBLE_COLLECTIONS_PATH": str(collections),
        "ANSIBLE_LOCALHOST_WARNING": "false",
        "ANSIBLE_CONNECTION": "local",
        "ANSIBLE_FORCE_COLOR": "0",
    }
    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", "localhost,", str(playbook)],
        capture_output=True, text=True, env=env, timeout=300, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert KEY not in done.stdout + done.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["rolled_back"] == []
    outcomes = {row["case"]: row for row in out["outcomes"]}
    assert sorted(outcomes) == sorted(CASES)
    assert outcomes["healthy"]["record"] is True, outcomes["healthy"]
    assert outcomes["a damaged store"]["record"] is True, outcomes["a damaged store"]
    for name, row in outcomes.items():
        if name in ("healthy", "a damaged store"):
            continue
        assert row["record"] is False, row
        assert row["msg"].startswith("kimi: no calibration recorded: "), row
        assert row["warnings"], row


class Hostile(FakeCalibrate):
    """The fake host answering `answers[module]` as given (a module's result of any shape)."""

    def __init__(self, answers: dict[str, Any], **args: Any) -> None:
        super().__init__(ARGS | {"api_key": KEY} | args, kimi_host())
        self.answers = answers

    def _execute_module(self, module_name: str, module_args: dict, task_vars: Any = None) -> dict:
        short = module_name.rsplit(".", 1)[-1]
        if short in self.answers:
            self.calls.append((module_name, module_args))
            return self.answers[short]
        return super()._execute_module(module_name, module_args, task_vars)


FACTS = {"lines": JOURNAL, "server_info": {"version": "0.5.23"}, "store": None}


@pytest.mark.parametrize(
    ("answers", "args", "reason"),
    [
        (
            {"sglang_start_facts": FACTS | {"lines": JOURNAL.replace("mem=", "mem=" + "9" * 401)}},
            {},
            "memory or scheduler line(s) hold figures no SGLang prints",
        ),
        (
            {
                "sglang_start_facts": FACTS
                | {"server_info": {"tp_size": {"x": 1}, "internal_states": 7}}
            },
            {},
            "key.tp_size must be an integer from 1 to 4096, got a dict",
        ),
        (
            {"sglang_start_facts": FACTS | {"store": {"records": []}}},
            {},
            "the store came back as a dict",
        ),
        ({"sglang_start_facts": {"lines": None, "server_info": "x"}}, {}, "lack pre_gib"),
        (
            {"sglang_state_files": {"failed": True, "msg": 10**5000}},
            {},
            "writing in /var/lib/sglang-fleet/kimi: int",  # a message str() cannot write
        ),
        (
            {"nvidia_gpu_info": {"gpus": [{"index": 0, "name": {"x": 1}, "memory_total_mib": 1}]}},
            {},
            "the GPU's name is a dict, not a name",
        ),
        (
            {
                "nvidia_gpu_info": {
                    "gpus": [{"index": 0, "name": "H200", "memory_total_mib": "lots"}]
                }
            },
            {},
            "memory_total_mib must be a number > 0 and <= 1e+12, got 'lots'",
        ),
        ({"nvidia_gpu_info": {"gpus": "all"}}, {}, "the host's GPUs could not be read: 'all'"),
        (
            {},
            {"server": SERVER | {"device": "cpu"}, "host_ram_mib": "1e999"},
            "host_ram_mib must be",
        ),
        ({}, {"known": {"gpus": 5, "fingerprints": "x", "sglang_version": [1]}}, "calibrated"),
        (
            {"slurp": {"content": "not base64!"}},
            {},
            "/srv/models/kimi/config.json could not be read",
        ),
        ({"command": {"rc": 0, "stdout": "0.5.23\n" * 100}}, {}, "calibrated"),
        (
            {},
            {"flags": "tp_size=8"},
            "the flag set that started must be a mapping, got 'tp_size=8'",
        ),
    ],
)
def test_a_hostile_answer_of_the_host_is_a_warning_or_a_record(
    answers: dict[str, Any], args: dict[str, Any], reason: str
) -> None:
    result = Hostile(answers, **args).run_it()
    assert not result.get("failed"), result
    assert reason in result["msg"], result["msg"]
    if result["record"] is None:
        assert result["warnings"] and reason in result["warnings"][0]
