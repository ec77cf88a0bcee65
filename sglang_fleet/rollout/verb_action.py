"""What every operator-verb action shares (plugins/action/sglang_*.py, docs/ARCHITECTURE.md,
"Operator verbs"): steps said as they run, modules run on the host, a module run under no_log
or as a read in check mode, the rollout lock renewed while a verb works.

An action plugin runs on the controller in the task's worker; `VerbAction.run_verb` is where
each verb begins. A step is one line in the result's `steps` and at `-v`, so a slow verb is
never silent to an operator who asked to see it.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

from sglang_fleet.collection import fqcn
from sglang_fleet.module_utils.fleet_http import without_secrets
from sglang_fleet.server_secrets import is_secret

display = Display()

# What sglang_router_workers needs to take one replica out and drain it (a described server's
# router: url, worker_url, metrics_url; the role's bounds: timeout, min_healthy_others,
# drain_timeout), by the module's name for each.
ROUTER_KEYS = {
    "url": "router_url",
    "worker_url": "worker_url",
    "metrics_url": "drain_metrics_url",
    "timeout": "timeout",
    "min_healthy_others": "min_healthy_others",
    "drain_timeout": "drain_timeout",
}


# What `systemctl is-active` says of a unit (systemctl(1)) and what it means for its router: a
# unit that runs (or reloads, or is being stopped: its router may still send to it) leaves its
# router and drains first; one that is stopped, failed, or waiting to start again (the units
# are Type=simple without ExecStartPre: "activating" is the wait of Restart=) serves nothing.
UNIT_RUNS = frozenset({"active", "reloading", "refreshing", "deactivating"})
UNIT_SERVES_NOTHING = frozenset({"inactive", "failed", "activating"})


def router_args(verb: str, router: Mapping[str, Any] | None, drain: Mapping | None) -> dict:
    """A server's router (its description's URLs) with the drain's bounds, checked: unknown
    keys and a router without its url or worker_url fail the task before the host is touched;
    {} when the server has no router (or the caller asked for no take-out)."""
    if not router:
        return {}
    merged = {**router, **(drain or {})}
    unknown = sorted(set(merged) - set(ROUTER_KEYS))
    if unknown:
        raise AnsibleActionFail(f"{verb}: unknown router or drain key(s) {unknown}")
    missing = [key for key in ("url", "worker_url") if not merged.get(key)]
    if missing:
        raise AnsibleActionFail(f"{verb}: router needs {', '.join(missing)}")
    return merged


class StepFailed(Exception):
    """A step of a verb failed (the message says which); lock_lost when the rollout lock was
    taken over meanwhile (the caller must then leave the host alone: no rollback)."""

    def __init__(self, message: str, lock_lost: bool = False):
        super().__init__(message)
        self.lock_lost = lock_lost


class VerbAction(ActionBase):
    """An action that sequences modules on the host, one step at a time."""

    TRANSFERS_FILES = False
    VERB = "verb"  # the name in each step's -v line

    def begin(self, task_vars: dict | None) -> None:
        self._vars = task_vars or {}
        self._steps: list[str] = []

    def task_args(
        self, required: tuple[str, ...], server_keys: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """The task's arguments, the required ones present and, with server_keys, `server` a
        described server (sglang_server_servers' item) that has them; else the task fails
        before the host is touched."""
        args = dict(self._task.args)
        missing = [name for name in required if args.get(name) in (None, "")]
        if missing:
            raise AnsibleActionFail(f"{self.VERB}: {', '.join(missing)} required")
        server = args.get("server")
        if server_keys and (
            not isinstance(server, Mapping) or any(key not in server for key in server_keys)
        ):
            raise AnsibleActionFail(
                f"{self.VERB}: server must be a described server (sglang_server_servers) "
                f"with {', '.join(server_keys)}"
            )
        return args

    def _action(self, name: str, task_args: dict[str, Any]) -> dict[str, Any]:
        """Another action plugin (copy, the health wait) run as this task, with task_args."""
        task = self._task.copy()
        task.args = task_args
        action = self._shared_loader_obj.action_loader.get(
            fqcn(name),
            task=task,
            connection=self._connection,
            play_context=self._play_context,
            loader=self._loader,
            templar=self._templar,
            shared_loader_obj=self._shared_loader_obj,
        )
        return dict(action.run(task_vars=self._vars))

    def _step(self, text: str) -> None:
        self._steps.append(text)
        display.v(f"  {self.VERB}: {text}")

    def _module(self, name: str, module_args: dict[str, Any]) -> dict[str, Any]:
        done = self._execute_module(
            module_name=fqcn(name), module_args=module_args, task_vars=self._vars
        )
        # What this action copies out of a module's answer (its msg, a stderr tail) into its own
        # result never quotes a key the module was given, in any written form: no_log masks it
        # only as given, and only in the module's own result.
        secrets = [v for k, v in module_args.items() if is_secret(k) and isinstance(v, str)]
        if secrets:
            for key, value in done.items():
                if isinstance(value, str):
                    done[key] = without_secrets(value, secrets)
        return done

    @contextmanager
    def _task_as(self, **attributes: Any) -> Iterator[None]:
        """The task's attributes set for the module runs inside, then put back."""
        before = {name: getattr(self._task, name) for name in attributes}
        for name, value in attributes.items():
            setattr(self._task, name, value)
        try:
            yield
        finally:
            for name, value in before.items():
                setattr(self._task, name, value)

    def _quiet(self) -> AbstractContextManager[None]:
        """A module run that holds a secret (in its arguments or its answer) runs under no_log:
        Ansible censors it wherever it would log it."""
        return self._task_as(no_log=True)

    def _reading(self) -> AbstractContextManager[None]:
        """Read-only module runs happen in check mode too (they change nothing)."""
        return self._task_as(check_mode=False)

    def _renew(self, lock: Mapping[str, Any] | None, lease_s: int | None = None) -> None:
        """The host's rollout lock ({path, token, lease_s}) renewed for lease_s, else its usual
        lease; nothing when no lock is held (no token: an entry point run on its own, or check
        mode). A lock another run took raises StepFailed with lock_lost."""
        lock = lock or {}
        if not lock.get("path") or not lock.get("token"):
            return
        args: dict[str, Any] = {"path": lock["path"], "state": "renewed", "token": lock["token"]}
        lease = int(lease_s or lock.get("lease_s") or 0)
        if lease > 0:
            args["lease_s"] = lease
        renewed = self._module("fleet_lock", args)
        if renewed.get("failed"):
            raise StepFailed(f"the rollout lock: {renewed.get('msg')}", lock_lost=True)
        self._step(f"rollout lock renewed for {lease or 'its usual'} s")

    def _take_out(
        self, server: Mapping[str, Any], router: Mapping[str, Any], api_key: str, lock: Mapping
    ) -> dict[str, Any] | None:
        """A running replica leaves its router and drains (docs/ROUTER.md): the lock renewed
        for the drain's bound first, then sglang_router_workers (state absent; the key under
        no_log). Returns the drain {drained, running_reqs, drain_seconds}; None when the unit
        does not run (it serves nothing, and the router's own health checks keep requests away
        from it). A router that refuses (too few other healthy replicas) raises StepFailed
        before anything left it."""
        script = f"systemctl is-active {shlex.quote(str(server['unit']))} || true"
        done = self._module("ansible.legacy.command", {"argv": ["bash", "-c", script]})
        state = str(done.get("stdout") or "").strip()
        if done.get("failed") or state not in UNIT_RUNS | UNIT_SERVES_NOTHING:
            # Skipping the take-out is a decision to stop a replica its router still sends to:
            # only a state that proves it serves nothing skips it.
            raise StepFailed(
                f"whether {server['unit']} runs cannot be read (systemctl is-active answered "
                f"{state[:80]!r}{': ' + str(done.get('msg'))[:200] if done.get('failed') else ''}"
                "): it is not stopped before it has left its router"
            )
        if state in UNIT_SERVES_NOTHING:
            self._step(
                f"{server['unit']} is {state}: it serves nothing, not taken out of its router"
            )
            return None
        drain_timeout = int(float(router.get("drain_timeout") or 0))
        self._renew(lock, int(lock.get("lease_s") or 0) + drain_timeout)
        module_args = {"router_url": router["url"], "state": "absent"}
        for key, module_key in ROUTER_KEYS.items():
            if key != "url" and router.get(key) not in (None, ""):
                module_args[module_key] = router[key]
        if api_key:
            module_args["api_key"] = api_key
        with self._quiet():
            removed = self._module("sglang_router_workers", module_args)
        if removed.get("failed"):
            raise StepFailed(f"taking it out of its router {router['url']}: {removed.get('msg')}")
        self._step(
            f"out of its router {router['url']}; drained: {removed.get('drained')} "
            f"after {removed.get('drain_seconds')} s"
        )
        return {key: removed.get(key) for key in ("drained", "running_reqs", "drain_seconds")}
