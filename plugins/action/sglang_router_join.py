"""Action sglang_router_join: a replica behind a router goes back into it, after it serves.

The one put-back of a routed replica, the mirror of sglang_router_leave (docs/ROUTER.md): after
its gate passed (a rollout), after its rollback started the last-known-good configuration again,
after a GPU cleanup's or a driver upgrade's start, or when its router lost it. Its decision is
sglang_fleet.rollout.rollback.join_plan:

1. a replica this run took out (`taken_out`) must go back: sglang_router_workers, state
   present, under no_log (the router's key), waits until the router lists it as healthy; a
   router that does not answer fails the task;
2. one it did not take out is put back when its router answers (its /liveness): a router that
   does not answer yet (the first deploy, before playbooks/router.yml) lists it from its own
   worker list when it starts, and that is said, not failed.

Arguments: server (a described server with name and router), api_key, taken_out (bool),
timeout (the router's, seconds). Result: server, router_out (false once it is back), joined
(put back here), steps, changed. A server without a router: skipped. Check mode: nothing.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.rollout import rollback
    from sglang_fleet.rollout.verb_action import VerbAction
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
    VerbAction = ActionBase  # only run() is called, and it fails first
else:
    PACKAGE_ERROR = None

LIVENESS_TIMEOUT_S = 10


class ActionModule(VerbAction):
    """Put one replica back into its router, or say why its router will list it itself."""

    VERB = "sglang_router_join"
    _VALID_ARGS = frozenset(("server", "api_key", "taken_out", "timeout"))

    def run(self, tmp: Any = None, task_vars: dict | None = None) -> dict:
        controller_package.require(PACKAGE_ERROR)
        result = super().run(tmp, task_vars)
        args = self.task_args(("server",), ("name", "router"))
        server, router = args["server"], args["server"]["router"]
        try:
            taken_out = rollback.flag(args.get("taken_out"), "taken_out")
        except ValueError as exc:
            raise AnsibleActionFail(f"{self.VERB}: {exc}") from None
        result.update(server=server["name"], joined=False, router_out=taken_out)
        if not router:
            result.update(skipped=True, msg=f"{server['name']} has no router")
            return result
        if not router.get("url") or not router.get("worker_url"):
            raise AnsibleActionFail(f"{self.VERB}: the server's router needs url and worker_url")
        if self._play_context.check_mode:
            result.update(skipped=True, msg=f"check mode: {server['name']} is not put back")
            return result
        self.begin(task_vars)
        answers = None if taken_out else self._router_answers(router["url"])
        if rollback.join_plan(taken_out, answers) == "leave":
            result.update(
                router_out=False,
                steps=self._steps,
                msg=f"The router {router['url']} does not answer: {server['name']} is not put "
                "back now; the router lists it from its own worker list when it starts.",
            )
            return result
        module_args: dict[str, Any] = {
            "router_url": router["url"],
            "worker_url": router["worker_url"],
            "state": "present",
        }
        if args.get("timeout") not in (None, ""):
            module_args["timeout"] = args["timeout"]
        if args.get("api_key"):
            module_args["api_key"] = str(args["api_key"])
        with self._quiet():
            joined = self._module("sglang_router_workers", module_args)
        if joined.get("failed"):
            result.update(failed=True, steps=self._steps,
                          msg=f"{server['name']}: putting it back into its router "
                          f"{router['url']}: {joined.get('msg')}")  # fmt: skip
            return result
        self._step(f"back in its router {router['url']}, healthy there")
        result.update(router_out=False, joined=True, changed=bool(joined.get("changed")),
                      steps=self._steps, msg=self._steps[-1])  # fmt: skip
        return result

    def _router_answers(self, url: str) -> bool:
        """Whether the router's /liveness answers 200 (read in check mode too)."""
        with self._reading():
            probe = self._module(
                "ansible.legacy.uri", {"url": f"{url}/liveness", "timeout": LIVENESS_TIMEOUT_S}
            )
        answers = probe.get("status") == 200
        self._step(
            f"router {url} answers"
            if answers
            else f"router {url} does not answer ({probe.get('msg') or 'no answer'})"
        )
        return answers
