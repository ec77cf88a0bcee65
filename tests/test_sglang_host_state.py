"""plugins/modules/sglang_host_state.py: every kind of difference is found and said, nothing is
changed."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import load_plugin

state = load_plugin("plugins/modules/sglang_host_state.py")
ME = pwd.getpwuid(os.getuid()).pw_name
MY_GROUP = grp.getgrgid(os.getgid()).gr_name


def sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def params(**changes: object) -> dict:
    base = {
        "files": [],
        "secret_files": [],
        "directories": [],
        "groups": [],
        "users": [],
        "units": [],
        "records": [],
        "routers": [],
        "router_keys": {},
        "lock_path": "",
        "timeout": 5,
    }
    return base | changes


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "launch.conf").write_text("ExecStart=/bin/true\n")
    (tmp_path / "launch.conf").chmod(0o644)
    (tmp_path / "meta.json").write_text(json.dumps({"config_hash": "abc123"}))
    (tmp_path / "dropin.d").mkdir(mode=0o755)
    return tmp_path


def want_file(path: Path, text: str, mode: str = "0644") -> dict:
    return {"path": str(path), "sha1": sha1(text), "owner": ME, "group": MY_GROUP, "mode": mode}


def test_a_host_as_wanted_has_no_difference(tree: Path) -> None:
    result = state.run(
        params(
            files=[want_file(tree / "launch.conf", "ExecStart=/bin/true\n"),
                   {"path": str(tree / "gone.yaml"), "absent": True}],
            lock_path=str(tree / "lock"),
            directories=[{"path": str(tree / "dropin.d"), "owner": ME, "mode": "0755"}],
            groups=[MY_GROUP],
            users=[{"name": ME, "group": MY_GROUP}],
            records=[{"label": "llama", "path": str(tree / "meta.json"), "key": "config_hash",
                      "value": "abc123"}],
        )
    )  # fmt: skip
    # Everything asked for is proven in place: configure.yml skips each write of it.
    in_place = {"files": [str(tree / "launch.conf"), str(tree / "gone.yaml")],
                "directories": [str(tree / "dropin.d")], "groups": [MY_GROUP], "users": [ME],
                "enabled": []}  # fmt: skip
    assert result == {"changed": False, "differences": [], "converged": True, "unknown": [],
                      "changed_paths": [], "would_write": False, "running": [],
                      "router_missing": [], "in_place": in_place}  # fmt: skip


def test_every_file_difference_is_named(tree: Path) -> None:
    (tree / "lock").write_text("{}")
    result = state.run(
        params(
            files=[
                want_file(tree / "launch.conf", "ExecStart=/bin/false\n"),
                want_file(tree / "missing.env", "A=1\n"),
                {"path": str(tree / "meta.json"), "absent": True},
                {**want_file(tree / "launch.conf", "ExecStart=/bin/true\n"), "mode": "0600"},
                want_file(tree / "dropin.d", ""),
            ],
            secret_files=[{**want_file(tree / "launch.conf", "x"), "owner": "nobody-such"}],
            lock_path=str(tree / "lock"),
        )
    )
    launch = tree / "launch.conf"
    assert result["differences"] == [
        f"{launch}: content differs",
        f"{tree / 'missing.env'}: missing",
        f"{tree / 'meta.json'}: present, wanted absent",
        f"{launch}: mode 0644, wanted 0600",
        f"{tree / 'dropin.d'}: not a regular file",
        f"{launch}: owner {ME}, wanted nobody-such",
        f"{launch}: content differs",
        f"{tree / 'lock'}: present, wanted absent",
    ]
    assert not result["converged"]
    # What a rollout's writes would change; the lock held is not one of them.
    assert result["would_write"] is True
    assert result["changed_paths"] == [
        str(launch), str(tree / "missing.env"), str(tree / "meta.json"), str(launch),
        str(tree / "dropin.d"), str(launch),
    ]  # fmt: skip
    # A file with any difference is not in place, nor is one listed twice with a difference
    # in either listing (configure.yml writes it then).
    assert result["in_place"]["files"] == []
    # The SHA-1 wanted or found is never in the answer.
    assert sha1("x") not in json.dumps(result)


def test_in_place_lists_only_what_was_proven(tree: Path) -> None:
    """configure.yml skips a write only for what this read lists as in place: one difference
    of a file, directory, group or user leaves it out, and the rest stays listed."""
    result = state.run(
        params(
            files=[want_file(tree / "launch.conf", "ExecStart=/bin/true\n"),
                   want_file(tree / "missing.env", "A=1\n"),
                   {**want_file(tree / "launch.conf", "ExecStart=/bin/true\n"), "path":
                    str(tree / "meta.json")}],
            secret_files=[{"path": str(tree / "secrets.env"), "absent": True}],
            directories=[{"path": str(tree / "dropin.d"), "owner": ME, "mode": "0755"},
                         {"path": str(tree / "dropin.d"), "mode": "0700"},
                         {"path": str(tree / "nope"), "mode": "0755"}],
            groups=[MY_GROUP, "no-such-group-x"],
            users=[{"name": ME, "group": MY_GROUP}, {"name": "no-such-user-x"}],
        )
    )  # fmt: skip
    assert result["in_place"] == {
        "files": [str(tree / "launch.conf"), str(tree / "secrets.env")],
        "directories": [],  # dropin.d is asked for twice, once with another mode
        "groups": [MY_GROUP],
        "users": [ME],
        "enabled": [],
    }
    assert result["changed_paths"] == [str(tree / "missing.env"), str(tree / "meta.json")]


def test_directories_groups_users_and_records(tree: Path) -> None:
    result = state.run(
        params(
            directories=[{"path": str(tree / "nope"), "mode": "0755"},
                         {"path": str(tree / "launch.conf")},
                         {"path": str(tree / "dropin.d"), "mode": "0700"}],
            groups=["no-such-group-x"],
            users=[{"name": "no-such-user-x"}, {"name": ME, "shell": "/bin/no-such-shell"}],
            records=[{"label": "llama", "path": str(tree / "meta.json"), "key": "config_hash",
                      "value": "def456"},
                     {"label": "other", "path": str(tree / "none.json"), "key": "config_hash",
                      "value": "x"}],
        )
    )  # fmt: skip
    shell = pwd.getpwnam(ME).pw_shell
    assert result["differences"] == [
        f"{tree / 'nope'}: missing",
        f"{tree / 'launch.conf'}: not a directory",
        f"{tree / 'dropin.d'}: mode 0755, wanted 0700",
        "group no-such-group-x: missing",
        "user no-such-user-x: missing",
        f"user {ME}: shell {shell}, wanted /bin/no-such-shell",
        f"llama: {tree / 'meta.json'} holds config_hash 'abc123', wanted 'def456'",
        f"other: no record at {tree / 'none.json'}",
    ]
    assert result["would_write"] is True  # directories, the group and the user


def test_units_must_be_enabled_and_running(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def systemctl(args: list[str], timeout: int) -> list[str]:
        calls.append(args)
        answers = {"is-enabled": ["enabled", "disabled"], "is-active": ["active", "failed"]}
        return answers[args[0]]

    monkeypatch.setattr(state, "_systemctl", systemctl)
    result = state.run(params(units=["sglang@a.service", "sglang@b.service"]))
    assert result["differences"] == [
        "sglang@b.service: disabled, wanted enabled",
        "sglang@b.service: failed, wanted running",
    ]
    assert result["would_write"] is True and result["changed_paths"] == []  # enabling writes
    assert result["in_place"]["enabled"] == ["sglang@a.service"]  # b gets enabled
    only_stopped = {"is-enabled": ["enabled", "enabled"], "is-active": ["active", "failed"]}
    monkeypatch.setattr(state, "_systemctl", lambda args, timeout: only_stopped[args[0]])
    result = state.run(params(units=["sglang@a.service", "sglang@b.service"]))
    assert result["differences"] == ["sglang@b.service: failed, wanted running"]
    assert result["would_write"] is False  # a restart, not a write
    # One call of each kind for all units.
    assert calls == [
        ["is-enabled", "sglang@a.service", "sglang@b.service"],
        ["is-active", "sglang@a.service", "sglang@b.service"],
    ]


class Router(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != "Bearer sk-router":
            self.send_response(401)
            self.end_headers()
            return
        # The real router's shape (docs/ROUTER.md): every worker has its id and health.
        worker = {"id": "5b2a4f47", "url": "http://gpu-node-01:8000", "is_healthy": True}
        body = json.dumps({"workers": [worker], "total": 1}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def router() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_routers_must_list_their_replicas(router: str) -> None:
    routers = [
        {"label": "a", "router_url": router, "worker_url": "http://GPU-NODE-01:8000"},
        {"label": "b", "router_url": router, "worker_url": "http://gpu-node-02:8000"},
        {"label": "c", "router_url": "http://127.0.0.1:9", "worker_url": "http://n:1"},
    ]
    keys = {"a": "sk-router", "b": "sk-router", "c": "sk-router"}
    result = state.run(params(routers=routers, router_keys=keys))
    assert result["differences"] == [f"b: router {router} does not list http://gpu-node-02:8000"]
    assert result["router_missing"] == ["b"]  # a's URL differs only in the host's case
    assert len(result["unknown"]) == 1 and result["unknown"][0].startswith("c: router")
    # A router that refuses the key is reported as not checked, not as a difference.
    result = state.run(params(routers=routers[:1], router_keys={"a": "wrong"}))
    assert result["converged"] and "401" in result["unknown"][0]
    assert result["router_missing"] == []  # not judged
