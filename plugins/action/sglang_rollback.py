"""Action sglang_rollback: one server back on its last-known-good configuration.

The rollback verb (docs/ARCHITECTURE.md, "Operator verbs"), sequenced on the controller as
`ansible.builtin.reboot` sequences its own; its decisions are sglang_fleet.rollout.rollback's:

0. with `failure` (the failed step's result, as a rollout's rescue has it): a lock another run
   took over leaves the server to that run, and a router that would not let it go left it
   untouched; neither goes back (nothing is run on the host);
1. the kept files back in place (sglang_last_known_good, state restored);
2. found: the last-known-good configuration started and health-gated (sglang_restart, with the
   caller's `restart` arguments: launch_module, owner_users, cleanup, health, lock; never a
   router: the replica left it before); none yet: the failed server stopped and its GPUs
   cleaned (gpu_cleanup, state clean, as the restart cleans).

Arguments: server (a described server), restart (as above), failure (optional: {msg, lock_lost,
untouched}). Result: server, decision (go back / lock lost / untouched), found, record (the
restored record, secrets redacted), restarted (sglang_restart's result: downtime, started_at,
restarts_baseline), rolled_back (it serves its last-known-good configuration again), outcome
(one sentence), row_outcome (the fleet summary's: rolled back / failed), rejoin (a replica
behind a router goes back into it), msg (with `failure`: the message the host fails with),
steps, changed. A restore or a start that fails fails the task (the host). Check mode: nothing.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.rollout import restart, rollback
    from sglang_fleet.rollout.verb_action import StepFailed, VerbAction
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
    VerbAction = ActionBase  # only run() is called, and it fails first
else:
    PACKAGE_ERROR = None

RESTART_KEYS = frozenset(("launch_module", "owner_users", "cleanup", "health", "lock"))


class ActionModule(VerbAction):
    """Go back to the last-known-good files and start them, or stop and clean without any."""

    VERB = "sglang_rollback"
    _VALID_ARGS = frozenset(("server", "restart", "failure"))

    def run(self, tmp: Any = None, task_vars: dict | None = None) -> dict:
        controller_package.require(PACKAGE_ERROR)
        result = super().run(tmp, task_vars)
        args = self.task_args(("server", "restart"), ("name", "unit", "port", "paths"))
        server, restart_args = args["server"], dict(args["restart"] or {})
        unknown = sorted(set(restart_args) - RESTART_KEYS)
        if unknown:
            raise AnsibleActionFail(f"{self.VERB}: unknown restart key(s) {unknown}")
        failure = args.get("failure")
        if failure is not None and not isinstance(failure, Mapping):
            raise AnsibleActionFail(f"{self.VERB}: failure must be the failed step's result")
        try:
            decision = rollback.decide(failure)
        except ValueError as exc:  # nothing is stopped or restarted on a result it cannot read
            raise AnsibleActionFail(f"{self.VERB}: {exc}") from None
        result.update(server=server["name"], decision=decision, found=False, record=None,
                      restarted=None, rolled_back=False)  # fmt: skip
        if self._play_context.check_mode:
            result.update(skipped=True, msg=f"check mode: {server['name']} is not rolled back")
            return result
        self.begin(task_vars)
        if decision == rollback.GO_BACK:
            try:
                self._go_back(server, restart_args, result)
            except StepFailed as exc:
                result.update(failed=True, msg=f"{server['name']}: rollback: {exc}",
                              lock_lost=exc.lock_lost, steps=self._steps, changed=True)  # fmt: skip
                return result
        else:
            self._step(f"{server['name']}: {decision}: not rolled back")
        found = bool(result["found"])
        config_hash = (result["record"] or {}).get("config_hash")
        said = rollback.outcome(decision, found, config_hash)
        result.update(
            rolled_back=decision == rollback.GO_BACK and found,
            outcome=said,
            row_outcome=rollback.row_outcome(decision, found),
            rejoin=rollback.rejoin(decision, found, bool(server.get("router"))),
            changed=decision == rollback.GO_BACK,
            steps=self._steps,
            msg=rollback.failure_message(
                server["name"], decision, str(failure.get("msg") or "unknown failure"), said
            )
            if failure is not None
            else f"{server['name']}: {said}",
        )
        return result

    def _go_back(
        self, server: Mapping[str, Any], restart_args: dict[str, Any], result: dict[str, Any]
    ) -> None:
        restored = self._action("sglang_last_known_good", {"server": server, "state": "restored"})
        self._steps.extend(restored.get("steps") or [])
        if restored.get("failed"):
            raise StepFailed(str(restored.get("msg")))
        result.update(found=bool(restored.get("found")), record=restored.get("record"))
        if restored.get("found"):
            started = self._action("sglang_restart", {**restart_args, "server": server})
            self._steps.extend(started.get("steps") or [])
            result["restarted"] = {key: value for key, value in started.items() if key != "steps"}
            if started.get("failed"):
                raise StepFailed(str(started.get("msg")), bool(started.get("lock_lost")))
            return
        self._stop_and_clean(server, restart_args)

    def _stop_and_clean(self, server: Mapping[str, Any], restart_args: Mapping[str, Any]) -> None:
        """No last-known-good yet: the failed server stopped and its GPUs left clean."""
        unit = str(server["unit"])
        stopped = self._module(
            "ansible.legacy.command",
            {"argv": ["bash", "-c", f"systemctl stop {shlex.quote(unit)}"]},
        )
        if stopped.get("rc") != 0:
            raise StepFailed(
                f"systemd could not stop {unit}: {stopped.get('stderr') or stopped.get('msg')}"
            )
        self._step(f"stopped {unit}")
        try:
            settings = restart.cleanup_settings(restart_args.get("cleanup"))
        except restart.SettingsError as exc:
            raise StepFailed(str(exc)) from None
        cleanup = restart.cleanup_args(
            server,
            settings,
            str(restart_args.get("launch_module") or ""),
            [str(user) for user in restart_args.get("owner_users") or []],
        )
        cleaned = self._module("gpu_cleanup", cleanup)
        if cleaned.get("failed"):
            lines = restart.holder_lines(cleaned.get("processes") or [])
            raise StepFailed("\n".join([str(cleaned.get("msg")), *lines]))
        self._step(f"cleanup: {cleaned.get('msg')}")
