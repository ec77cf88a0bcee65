"""The filter plugins' one conversion of Ansible's values (sglang_fleet/ansible_values.py), and how
the
plugins report what it refuses."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError
from conftest import load_plugin

from sglang_fleet.ansible_values import plain, plain_mapping


class Lazy(Mapping):
    """A mapping that is no dict, as Ansible's lazy containers are to a filter."""

    def __init__(self, data: dict[Any, Any]) -> None:
        self._data = data

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class Tagged(str):
    """A str subclass, as Ansible's tagged strings are."""


def test_plain_turns_every_mapping_into_a_dict_and_every_tuple_into_a_list() -> None:
    value = Lazy({"servers": (Lazy({"name": "a", "gpus": (0, 1)}),), "none": None})
    result = plain(value)
    assert result == {"servers": [{"name": "a", "gpus": [0, 1]}], "none": None}
    assert type(result) is dict
    assert type(result["servers"]) is list
    assert type(result["servers"][0]) is dict
    assert type(result["servers"][0]["gpus"]) is list


def test_plain_names_keys_as_json_does() -> None:
    value = {2: "int", True: "bool", None: "null", 1.5: "float", "s": "str"}
    assert plain(value) == json.loads(json.dumps(value))
    assert list(plain(value)) == ["2", "true", "null", "1.5", "s"]


def test_plain_keeps_leaves_and_scalars_as_they_are() -> None:
    tagged = Tagged("--tp-size")
    assert plain(tagged) is tagged
    assert plain(None) is None
    assert plain(7) == 7
    assert plain([1.5, False, "x"]) == [1.5, False, "x"]
    assert plain({"k": tagged})["k"] is tagged


def test_plain_copies_containers() -> None:
    inner = {"flags": ["--a"]}
    value = {"server": inner}
    result = plain(value)
    result["server"]["flags"].append("--b")
    assert inner == {"flags": ["--a"]}


def test_plain_mapping_reads_json_text() -> None:
    assert plain_mapping('{"completed": 16, "ttft": [1, 2]}', "smoke result") == {
        "completed": 16,
        "ttft": [1, 2],
    }


def test_plain_mapping_of_a_mapping_is_plain() -> None:
    result = plain_mapping(Lazy({2: (Lazy({"a": 1}),)}), "x")
    assert result == {"2": [{"a": 1}]}
    assert type(result["2"][0]) is dict


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "smoke result is not valid JSON: "),
        ("[1, 2]", "smoke result must be a mapping, got list"),
        ([1, 2], "smoke result must be a mapping, got list"),
        (None, "smoke result must be a mapping, got NoneType"),
        ("", "smoke result is not valid JSON: "),
    ],
)
def test_plain_mapping_names_what_is_wrong(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=r"^" + message):
        plain_mapping(value, "smoke result")


@pytest.mark.parametrize("nothing", [None, "", {}])
def test_optional_plain_mapping_gives_none_for_nothing(nothing: Any) -> None:
    assert plain_mapping(nothing, "thresholds", optional=True) is None


def test_optional_plain_mapping_still_refuses_what_is_not_a_mapping() -> None:
    with pytest.raises(ValueError, match=r"^thresholds must be a mapping, got int"):
        plain_mapping(3, "thresholds", optional=True)


# The plugins turn the conversion's ValueError into AnsibleFilterError, with its text as is.


def test_rollout_row_filter_reports_a_result_that_is_not_json() -> None:
    gate = load_plugin("plugins/filter/sglang_gate.py")
    with pytest.raises(AnsibleFilterError, match=r"^sglang_rollout_row: smoke gate result is not"):
        gate.sglang_rollout_row({"name": "x", "config_hash": "h"}, "passed", "{truncated")


def test_rollout_table_reports_a_rollout_result_that_is_no_mapping() -> None:
    gate = load_plugin("plugins/filter/sglang_gate.py")
    hostvars = {"h": {"sglang_server_servers": [], "sglang_server_rollout_results": [["x"]]}}
    with pytest.raises(AnsibleFilterError, match=r"^rollout result must be a mapping, got list"):
        gate.sglang_rollout_table(["h"], hostvars)


def test_diagnose_filters_report_inputs_that_are_no_mapping() -> None:
    diagnose = load_plugin("plugins/filter/sglang_diagnose.py")
    with pytest.raises(AnsibleFilterError, match=r"^plan context must be a mapping, got list"):
        diagnose.sglang_diagnose({"completed": 1}, None, None, [1])
    with pytest.raises(AnsibleFilterError, match=r"^sample must be a mapping, got list"):
        diagnose.sglang_diagnose_live([1])
    with pytest.raises(AnsibleFilterError, match=r"^diagnosis is not valid JSON"):
        diagnose.sglang_diagnosis_table([{"host": "h", "server": "s", "diagnosis": "{"}])


def test_plan_filters_report_inputs_that_are_no_mapping() -> None:
    plan = load_plugin("plugins/filter/sglang_plan.py")
    with pytest.raises(AnsibleFilterError, match=r"^model_config is not valid JSON"):
        plan.sglang_plan("{", 1)
    with pytest.raises(AnsibleFilterError, match=r"^server must be a mapping, got list"):
        plan.sglang_server_plan(["a"], {}, 1, [], 1024)
    with pytest.raises(AnsibleFilterError, match=r"^gpu must be a mapping, got int"):
        plan.sglang_server_plan({"name": "a"}, {}, 1, [0], 1024)


def test_router_filter_takes_a_lazy_mapping_with_tuples_as_the_plain_dict() -> None:
    router = load_plugin("plugins/filter/sglang_router.py")
    flags = {"host": "0.0.0.0", "port": 8080, "worker_urls": ["http://a:8000", "http://b:8000"]}
    python, launcher = "/opt/r/bin/python", "/opt/r/bin/launch.py"
    lazy = Lazy({**flags, "worker_urls": tuple(flags["worker_urls"])})
    assert router.sglang_router_command(lazy, python, launcher) == router.sglang_router_command(
        flags, python, launcher
    )


def test_server_filters_take_lazy_containers_as_plain_data() -> None:
    server = load_plugin("plugins/filter/sglang_server.py")
    described = (Lazy({"name": "a", "gpus": (0,)}), Lazy({"name": "b", "gpus": (1, 2)}))
    assert server.sglang_servers_on_gpus(described, (2,)) == [{"name": "b", "gpus": [1, 2]}]
