"""roles/sglang_server/tasks/configure.yml: each write is skipped for what the host read proved in
place, and only for that (issue 47: a change costs what it changes).

The task file's own `when:` conditions and its block's variable are evaluated with Ansible's
templar against the read's answers: all in place skips every write; a read that failed (no
`in_place`) skips none (fail closed); one file that differs is the one file written. The read
itself is plugins/modules/sglang_host_state.py (tests/test_sglang_host_state.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

CONFIGURE = Path(__file__).resolve().parent.parent / "roles/sglang_server/tasks/configure.yml"
UNIT_FILE = "/etc/systemd/system/sglang@.service"
FILES = [UNIT_FILE, "/etc/systemd/system/sglang@kimi.service.d/launch.conf", "/etc/sglang/kimi.env"]
SECRETS = ["/etc/sglang/kimi.secrets"]
DIRECTORIES = ["/etc/sglang", "/var/lib/sglang-fleet", "/etc/systemd/system/sglang@kimi.service.d"]
UNITS = ["sglang@kimi.service"]
# The items each looped write goes over, by the start of its name.
ITEMS = {
    "Create the configuration": [{"path": path} for path in DIRECTORIES],
    "Write the template unit": [{"path": path} for path in FILES],
    "Remove the files": [{"path": "/etc/sglang/old.secrets"}],
    "Write each server's secrets": [{"path": path} for path in SECRETS],
    "Enable each server": [{"unit": unit} for unit in UNITS],
}
ALL_IN_PLACE = {
    "files": [*FILES, *SECRETS, "/etc/sglang/old.secrets"],
    "directories": DIRECTORIES,
    "groups": ["sglang"],
    "users": ["sglang"],
    "enabled": UNITS,
}


def tasks() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the read, the block of writes)."""
    read, block = yaml.safe_load(CONFIGURE.read_text())
    return read, block


def ran(placed: dict[str, Any]) -> dict[str, list[Any]]:
    """For each write task: the items (None for a task without a loop) it would run for, given
    the read's registered answer."""
    _, block = tasks()
    base = {
        "_sglang_server_placed": placed,
        "sglang_server_group": "sglang",
        "sglang_server_user": "sglang",
        "ansible_check_mode": False,
        "__sglang_server_unit_file": UNIT_FILE,
        "__sglang_server_changed_paths": [],
    }
    templar = Templar(loader=DataLoader(), variables=base)
    in_place = templar.template(trust_as_template(block["vars"]["__sglang_server_in_place"]))
    runs: dict[str, list[Any]] = {}
    for task in block["block"]:
        if task["name"].startswith("Reload systemd"):
            continue  # decided by what the writes changed (vars/main.yml), not by the read
        items = next((v for k, v in ITEMS.items() if task["name"].startswith(k)), [None])
        when = task["when"] if isinstance(task["when"], list) else [task["when"]]
        runs[task["name"]] = [
            item
            for item in items
            if all(
                Templar(
                    loader=DataLoader(),
                    variables={**base, "__sglang_server_in_place": in_place, "item": item},
                ).evaluate_conditional(trust_as_template(condition))
                for condition in when
            )
        ]
    return runs


def test_the_read_comes_first_and_a_failed_read_fails_nothing() -> None:
    read, block = tasks()
    assert read["sglang_fleet.fleet.sglang_host_state"]["files"] == "{{ __sglang_server_files }}"
    assert (
        read["sglang_fleet.fleet.sglang_host_state"]["secret_files"]
        == "{{ __sglang_server_secret_files }}"
    )
    assert read["failed_when"] is False and read["register"] == "_sglang_server_placed"
    # Every write but the reload asks the read (a write added without asking shows here).
    writes = [task for task in block["block"] if not task["name"].startswith("Reload")]
    assert len(writes) == 7
    for task in writes:
        assert "__sglang_server_in_place" in str(task["when"]), task["name"]


def test_everything_in_place_skips_every_write() -> None:
    runs = ran({"changed": False, "in_place": ALL_IN_PLACE})
    assert runs and all(items == [] for items in runs.values()), runs


@pytest.mark.parametrize(
    "placed",
    [
        {"failed": True, "msg": "cannot read the host's state: timeout"},
        {"skipped": True},
        {"changed": False, "in_place": {}},
    ],
    ids=["failed", "skipped", "empty"],
)
def test_a_read_that_proves_nothing_skips_nothing(placed: dict[str, Any]) -> None:
    runs = ran(placed)
    for name, items in runs.items():
        wanted = next((v for k, v in ITEMS.items() if name.startswith(k)), [None])
        assert items == wanted, name


def test_one_file_that_differs_is_the_one_written() -> None:
    launch = FILES[1]
    in_place = ALL_IN_PLACE | {"files": [p for p in ALL_IN_PLACE["files"] if p != launch]}
    runs = ran({"changed": False, "in_place": in_place})
    written = {name: items for name, items in runs.items() if items}
    assert written == {
        next(n for n in runs if n.startswith("Write the template")): [{"path": launch}]
    }
