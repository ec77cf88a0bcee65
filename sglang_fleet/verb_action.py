"""What every operator-verb action shares (action_plugins/sglang_*.py, docs/ARCHITECTURE.md,
"Operator verbs"): steps said as they run, modules run on the host, a module run under no_log
or as a read in check mode, the rollout lock renewed while a verb works.

An action plugin runs on the controller in the task's worker; `VerbAction.run_verb` is where
each verb begins. A step is one line in the result's `steps` and at `-v`, so a slow verb is
never silent to an operator who asked to see it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()


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
            name,
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
        return self._execute_module(module_name=name, module_args=module_args, task_vars=self._vars)

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
