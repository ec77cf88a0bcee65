"""Action sglang_restart: stop one server, clean what it leaves, start it, wait for a generation.

One operator verb, sequenced on the controller through modules on the host (as
`ansible.builtin.reboot` sequences its own); its decisions are sglang_fleet.rollout.restart's:

0. a replica behind a router (`router`, its URLs; `drain`, the bounds) that runs leaves it and
   drains first (sglang_router_workers, state absent; the lock renewed for the drain's bound
   first, docs/ROUTER.md); a router that refuses (too few other healthy replicas) fails the
   verb with `untouched: true`: nothing was stopped;
1. the rollout lock renewed before the stop (fleet_lock, state renewed; with no lock held, as
   in the `rollback` entry point run on its own, nothing to renew);
2. the host's clock and whether the unit runs, then the stop: SIGTERM, SGLang drains its
   running requests, systemd kills what is left after the unit's TimeoutStopSec; how the stop
   ended (systemd's Result=, "timeout" when it had to kill);
3. the cleanup of the server's leftovers and the memory gate on its GPUs (gpu_cleanup state
   clean: only what is provably ours is killed, anything else on its GPUs fails the restart
   with a table before any signal, docs/GPU-CLEANUP.md);
4. the start-limit counter cleared, the restart count and the clock noted, the start;
5. the health gate: sglang_wait_healthy (a real generation; the rollout lock renewed while the
   model loads), then the clock: the downtime runs from the stop to here.

The result: server (its name), downtime {was_running, stop_result, downtime_seconds},
started_at (host clock at the start), restarts_baseline (the unit's restart count before it),
health (the wait's result), health_s (the wait's own seconds), cleanup {msg, lines}, router_out
(it left its router here and is not back yet), drain {drained, running_reqs, drain_seconds}
(null without one), steps, changed. A failure says which step; lock_lost: true when the lock
was taken over (do not roll back then: the host may be another run's now); untouched: true when
it failed before anything stopped. Check mode: nothing is stopped or started; the action is skipped.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.rollout import restart
    from sglang_fleet.rollout.verb_action import StepFailed, VerbAction, router_args
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
    VerbAction = ActionBase  # only run() is called, and it fails first
else:
    PACKAGE_ERROR = None

REQUIRED = ("server", "launch_module", "owner_users")
OPTIONAL = ("lock", "health", "cleanup", "router", "drain", "api_key")
HEALTH_KEYS = ("timeout", "poll_interval", "progress_interval")
LOCK_KEYS = ("path", "token", "lease_s")


class ActionModule(VerbAction):
    """Stop, clean, start and health-gate one server, with the lock renewed around it."""

    VERB = "sglang_restart"
    _VALID_ARGS = frozenset((*REQUIRED, *OPTIONAL))

    def run(self, tmp: Any = None, task_vars: dict | None = None) -> dict:
        controller_package.require(PACKAGE_ERROR)
        result = super().run(tmp, task_vars)
        args = self.task_args(REQUIRED, ("name", "unit", "port"))
        server = args["server"]
        try:
            settings = restart.cleanup_settings(args.get("cleanup"))
        except restart.SettingsError as exc:
            raise AnsibleActionFail(str(exc)) from None
        health = dict(args.get("health") or {})
        lock = dict(args.get("lock") or {})
        # The server's router (its description's url, worker_url, metrics_url) and the drain's
        # bounds (the role's timeout, min_healthy_others, drain_timeout).
        router = router_args(self.VERB, args.get("router"), args.get("drain"))
        unknown = sorted(set(health) - set(HEALTH_KEYS)) + sorted(set(lock) - set(LOCK_KEYS))
        if unknown:
            raise AnsibleActionFail(f"sglang_restart: unknown health or lock key(s) {unknown}")
        if self._play_context.check_mode:
            result.update(skipped=True, msg=f"check mode: {server['unit']} would be restarted")
            return result
        self.begin(task_vars)
        self._done: dict[str, Any] = {"router_out": False, "drain": None}
        self._stopping = False  # until the stop begins, a failure leaves the server as it was
        cleanup = restart.cleanup_args(
            server, settings, str(args["launch_module"]), [str(u) for u in args["owner_users"]]
        )
        try:
            if router:
                drain = self._take_out(server, router, str(args.get("api_key") or ""), lock)
                self._done.update(router_out=drain is not None, drain=drain)
            self._restart(server, cleanup, health, lock)
        except StepFailed as exc:
            untouched = not self._stopping
            result.update(
                server=server["name"],
                failed=True,
                msg=f"{server['name']}: {exc}",
                lock_lost=exc.lock_lost,
                untouched=untouched,
                steps=self._steps,
                changed=not untouched or self._done["router_out"],
                **self._done,
            )
            return result
        result.update(
            server=server["name"],
            changed=True,
            msg=f"{server['name']} restarted: healthy after "
            f"{self._done['downtime']['downtime_seconds']} s of downtime",
            steps=self._steps,
            **self._done,
        )
        return result

    # --- steps -----------------------------------------------------------------------------
    def _shell(self, script: str, what: str) -> str:
        done = self._module(
            "ansible.legacy.command", {"argv": ["bash", "-c", "set -e -o pipefail; " + script]}
        )
        if done.get("rc") != 0:
            raise StepFailed(f"{what}: {done.get('stderr') or done.get('msg')}")
        return str(done.get("stdout") or "")

    def _restart(
        self,
        server: Mapping[str, Any],
        cleanup: dict[str, Any],
        health: Mapping[str, Any],
        lock: Mapping[str, Any],
    ) -> None:
        unit, quoted = str(server["unit"]), shlex.quote(str(server["unit"]))
        self._renew(lock)
        self._stopping = True
        # One call: the clock and whether it runs, the stop (SGLang drains, systemd kills after
        # TimeoutStopSec), and how the stop ended.
        stopped = self._shell(
            f"date +%s.%N; systemctl is-active {quoted} || true; systemctl stop {quoted}; "
            f"systemctl show --property=Result --value {quoted}",
            f"systemd could not stop {unit}",
        ).split()
        before_stop, stop_result = " ".join(stopped[:2]), (stopped[2:] or ["unknown"])[-1]
        self._step(f"stopped {unit} (Result={stop_result})")
        self._done["downtime"] = {"stop_result": stop_result}
        cleaned = self._module("gpu_cleanup", cleanup)
        lines = restart.holder_lines(cleaned.get("processes") or [])
        self._done["cleanup"] = {"msg": cleaned.get("msg"), "lines": lines}
        if cleaned.get("failed"):
            raise StepFailed("\n".join([str(cleaned.get("msg")), *lines]))
        self._step(f"cleanup: {cleaned.get('msg')}")
        # One call: the start-limit counter cleared (earlier failed starts must not block this
        # one), the restart count and the clock noted, the start.
        before = self._shell(
            f"systemctl reset-failed {quoted} 2>/dev/null || true; "
            f"systemctl show --property=NRestarts --value {quoted}; date +%s; "
            f"systemctl start {quoted}",
            f"systemd could not start {unit}",
        ).split()
        self._done["restarts_baseline"] = int(before[0])
        self._done["started_at"] = float(before[1])
        self._step(f"started {unit}")
        waited = self._wait(server, health, lock)
        self._done["health"] = waited
        if waited.get("failed"):
            raise StepFailed(str(waited.get("msg")), lock_lost=bool(waited.get("lock_lost")))
        healthy_at = self._shell("date +%s.%N", "reading the clock")
        self._done["downtime"] = {
            "stop_result": stop_result,
            **restart.downtime(before_stop, healthy_at),
        }
        seconds = self._done["downtime"]["downtime_seconds"]
        self._step(
            f"healthy: {seconds} s from the stop"
            if seconds is not None
            else "healthy (the host's clock did not read as a number: downtime not measured)"
        )

    def _wait(
        self, server: Mapping[str, Any], health: Mapping[str, Any], lock: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The health gate: the sglang_wait_healthy action, which renews the lock meanwhile."""
        wait_args = {
            "name": server["name"],
            "unit": server["unit"],
            "url": f"http://127.0.0.1:{int(server['port'])}/health_generate",
            "since": self._done["started_at"],
            "restarts_baseline": self._done["restarts_baseline"],
            **{key: health[key] for key in HEALTH_KEYS if health.get(key) is not None},
        }
        if lock.get("path") and lock.get("token"):
            wait_args.update(lock_path=lock["path"], lock_token=lock["token"])
            if lock.get("lease_s"):
                wait_args["lock_lease_s"] = lock["lease_s"]
        started = time.monotonic()
        waited = self._action("sglang_wait_healthy", wait_args)
        self._done["health_s"] = round(time.monotonic() - started, 2)
        return waited
