"""Action sglang_router_leave: a replica behind a router leaves it and drains, before it stops.

The one take-out of a routed replica (docs/ROUTER.md, "A rollout of N replicas behind the
router"): a rollout's restart runs it as its first step (plugins/action/sglang_restart.py); a
rollback, a GPU cleanup and an autotune trial run this action before their stop
(roles/sglang_server/tasks/router_take_out.yml). Both are `VerbAction._take_out`
(sglang_fleet/rollout/verb_action.py):

1. whether the unit runs: one that does not serves nothing and is not taken out (the router's
   own health checks keep requests away from it);
2. the rollout lock renewed for its lease plus the drain's bound;
3. sglang_router_workers, state absent, under no_log (the router's key): it refuses, before
   removing anything, when fewer than min_healthy_others other healthy replicas would be left;
   then the bounded drain on the replica's /metrics.

Arguments: server (a described server with name and unit), router (its url, worker_url,
metrics_url), drain (timeout, min_healthy_others, drain_timeout), lock ({path, token, lease_s};
none held: nothing to renew), api_key. Result: server, router_out (it left its router here),
drain {drained, running_reqs, drain_seconds} (null when it did not run), steps, changed. A
router that refuses fails the task with the server untouched. Check mode: nothing leaves.
"""

from __future__ import annotations

from typing import Any

from ansible.plugins.action import ActionBase
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.rollout.verb_action import StepFailed, VerbAction, router_args
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
    VerbAction = ActionBase  # only run() is called, and it fails first
else:
    PACKAGE_ERROR = None


class ActionModule(VerbAction):
    """Take one running replica out of its router and wait for its running requests."""

    VERB = "sglang_router_leave"
    _VALID_ARGS = frozenset(("server", "router", "drain", "lock", "api_key"))

    def run(self, tmp: Any = None, task_vars: dict | None = None) -> dict:
        controller_package.require(PACKAGE_ERROR)
        result = super().run(tmp, task_vars)
        args = self.task_args(("server", "router"), ("name", "unit"))
        server = args["server"]
        router = router_args(self.VERB, args["router"], args.get("drain"))
        result.update(server=server["name"], router_out=False, drain=None)
        if self._play_context.check_mode:
            result.update(skipped=True, msg=f"check mode: {server['name']} would leave its router")
            return result
        self.begin(task_vars)
        try:
            drain = self._take_out(
                server, router, str(args.get("api_key") or ""), dict(args.get("lock") or {})
            )
        except StepFailed as exc:
            result.update(failed=True, msg=f"{server['name']}: {exc}", lock_lost=exc.lock_lost)
            result.update(steps=self._steps)
            return result
        result.update(
            router_out=drain is not None,
            drain=drain,
            changed=drain is not None,
            steps=self._steps,
            msg=self._steps[-1],
        )
        return result
