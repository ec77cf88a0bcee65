"""Action sglang_last_known_good: keep the configuration a server just passed with.

One operator verb, sequenced on the controller through modules on the host (as
`ansible.builtin.reboot` sequences its own). Right after a server passed its gates:

A server across hosts (its `nodes`) first checks that every node passed this restart
(sglang_fleet.rollout.restart.failed_nodes: each node's registered restart, and node 0's smoke
gate);
one that did not fails the task on every node, and all go back to last-known-good together.
Then, in one module run on the host (plugins/modules/sglang_last_known_good.py, under no_log), into
its last-known-good folder (<state dir>/<server>/lkg, root only):

1. the files that made it: the launch drop-in, the environment file and, when the server has a
   secret (sglang_fleet/server_secrets.py), its secrets file (no secret reaches a result or a
   diff); a secrets file the passing configuration did not have is removed;
2. its record, meta.json: server, config_hash, the whole flag set, api_key_set, secrets_set
   (the names of its secret fields), the installed
   SGLang version, and the smoke result it passed with (what the relative gate compares the next
   start with).

The result: record (a flag named like a secret left out), previous (the config hash the record
held before, or null), changed, steps. With --diff it shows the record's change (config_hash,
sglang_version, the flags; never a key, nor a flag named like a secret). Check mode: nothing
passed a gate, so nothing is recorded; the action is skipped.

With `state: restored` (the rollback, rollback_server.yml) the same module run puts the kept
launch drop-in and environment file back, and the secrets file when the kept set had a key,
each only where it differs, and reloads systemd when one changed. The result: found (false:
no record yet, nothing changed), record (as above), written (the paths put back), changed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.rollout import restart
    from sglang_fleet.rollout.verb_action import VerbAction
    from sglang_fleet.server_secrets import public_flags, public_record
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
    VerbAction = ActionBase  # only run() is called, and it fails first
else:
    PACKAGE_ERROR = None

SERVER_KEYS = ("name", "config_hash", "flags", "api_key_set", "paths")
PATH_KEYS = ("lkg_dir", "dropin", "env_file", "secrets_file")


class ActionModule(VerbAction):
    """Copies the passing files into lkg/ and writes the record beside them."""

    VERB = "sglang_last_known_good"
    _VALID_ARGS = frozenset(("server", "state", "sglang_version", "smoke_result"))

    def run(self, tmp: Any = None, task_vars: dict | None = None) -> dict:
        controller_package.require(PACKAGE_ERROR)
        result = super().run(tmp, task_vars)
        server = self._task.args.get("server")
        if (
            not isinstance(server, Mapping)
            or any(k not in server for k in SERVER_KEYS)
            or any(k not in server["paths"] for k in PATH_KEYS)
        ):
            raise AnsibleActionFail(
                "sglang_last_known_good: server must be a described server "
                f"({', '.join(SERVER_KEYS)}; paths {', '.join(PATH_KEYS)})"
            )
        state = self._task.args.get("state") or "kept"
        if state not in ("kept", "restored"):
            raise AnsibleActionFail(
                f"sglang_last_known_good: state is kept or restored, not {state!r}"
            )
        if state == "restored":
            self.begin(task_vars)
            return {**result, **self._restore(server)}
        if self._play_context.check_mode:
            result.update(skipped=True, msg="check mode: nothing passed a gate, nothing recorded")
            return result
        self.begin(task_vars)
        # A server across hosts: no node records a configuration another node failed with
        # (docs/MULTINODE.md); the failing node is in its rollback, and this one follows it.
        failed = restart.failed_nodes(server, self._vars.get("hostvars") or {})
        if failed:
            raise AnsibleActionFail(
                f"node {', '.join(failed)} of {server['name']} failed: every node goes back to "
                "its last-known-good configuration"
            )
        paths = server["paths"]
        lkg = str(paths["lkg_dir"])
        record = {
            "server": server["name"],
            "config_hash": server["config_hash"],
            "flags": dict(server["flags"]),
            "api_key_set": bool(server["api_key_set"]),
            "secrets_set": sorted(server.get("secrets_set") or []),
            "sglang_version": self._task.args.get("sglang_version") or None,
            "smoke_result": self._task.args.get("smoke_result") or None,
        }
        copies = [
            {"name": "10-launch.conf", "src": paths["dropin"]},
            {"name": "server.env", "src": paths["env_file"]},
        ]
        keyed = bool(record["api_key_set"] or record["secrets_set"])
        if keyed:
            copies.append({"name": "secrets.yaml", "src": paths["secrets_file"]})
        # One module run on the host (plugins/modules/sglang_last_known_good.py), under no_log: the
        # secrets file is among the copies, and the old record among the answers.
        with self._quiet():
            done = self._module(
                "sglang_last_known_good",
                {
                    "lkg_dir": lkg,
                    "files": copies,
                    "absent": [] if keyed else ["secrets.yaml"],
                    "record": record,
                },
            )
        if done.get("failed"):
            raise AnsibleActionFail(f"sglang_last_known_good: {done.get('msg')}")
        old = done.get("previous") if isinstance(done.get("previous"), Mapping) else None
        changed = bool(done.get("changed"))
        self._step(f"kept {', '.join(c['name'] for c in copies)} in {lkg}")
        self._step(f"recorded {record['config_hash']} as last-known-good of {server['name']}")
        previous = old.get("config_hash") if old else None
        result.update(
            changed=changed,
            # A flag named like a secret (an admin API key, a token) stays on the host.
            record=public_record(record),
            previous=previous,
            steps=self._steps,
            msg=f"{server['name']}: last-known-good is now {record['config_hash']}"
            + (f" (was {previous})" if previous and previous != record["config_hash"] else ""),
        )
        if self._task.diff and old != record:
            result["diff"] = {
                "before_header": f"{lkg}/meta.json",
                "after_header": f"{lkg}/meta.json",
                "before": _shown(old),
                "after": _shown(record),
            }
        return result

    def _restore(self, server: Mapping[str, Any]) -> dict[str, Any]:
        """The kept files back in place (one module run, under no_log: the secrets file)."""
        paths = server["paths"]
        lkg = str(paths["lkg_dir"])
        files = [
            {"name": "10-launch.conf", "dest": paths["dropin"], "mode": "0644"},
            {"name": "server.env", "dest": paths["env_file"], "mode": "0644"},
            {"name": "secrets.yaml", "dest": paths["secrets_file"], "mode": "0600"},
        ]
        with self._quiet():
            done = self._module(
                "sglang_last_known_good", {"lkg_dir": lkg, "state": "restored", "files": files}
            )
        if done.get("failed"):
            raise AnsibleActionFail(f"sglang_last_known_good: {done.get('msg')}")
        if not done.get("found"):
            self._step(f"no record in {lkg}")
            return {"changed": False, "found": False, "record": None, "written": [],
                    "steps": self._steps,
                    "msg": f"{server['name']}: no last-known-good configuration yet"}  # fmt: skip
        record = dict(done.get("record") or {})
        written = [str(path) for path in done.get("written") or []]
        self._step(f"put back {', '.join(written) or 'nothing (already in place)'} from {lkg}")
        return {
            "changed": bool(done.get("changed")),
            "found": True,
            # The host's record as written, by whatever version: every secret in it redacted.
            "record": public_record({**record, "flags": record.get("flags") or {}}),
            "written": written,
            "steps": self._steps,
            "msg": f"{server['name']}: last-known-good {record.get('config_hash')} is in place",
        }


def _shown(record: Mapping[str, Any] | None) -> str:
    """What --diff shows of a record: its hash, version and flags, a flag named like a secret
    (an admin API key, a token) left out."""
    if not record:
        return ""
    shown = {key: record.get(key) for key in ("config_hash", "sglang_version")}
    flags = record.get("flags")
    shown["flags"] = public_flags(flags) if isinstance(flags, Mapping) else None
    return json.dumps(shown, indent=2, sort_keys=True) + "\n"
