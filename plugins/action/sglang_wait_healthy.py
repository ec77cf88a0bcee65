"""Action: wait until an SGLang server answers a real generation, with one progress line a while.

Model loading can take 20 minutes, so the wait is long; instead of hundreds of "retrying" lines it
prints, every `progress_interval` seconds, the elapsed time and the server's latest log line, and
it stops at once when the unit dies or logs a fatal error (the probe module decides that).

With `lock_path` and `lock_token` (what `fleet_lock` state=acquired returned) it also renews the
host's rollout lock while it waits: on the first poll, then every `lock_renew_interval` seconds
(default: a third of the lease, at most 60 s), so a long model load never lets the lease end
under a live run (docs/LOCKING.md). A renewal that finds the lock gone or someone else's ends the
wait as failed with `lock_lost: true` (do not roll back then: the host may be another run's now).
Without `lock_path` it behaves as before.
"""

from __future__ import annotations

import time
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

ARGS = ("unit", "url", "since", "request_timeout", "fatal_patterns", "restarts_baseline")
LOCK_ARGS = ("lock_path", "lock_token", "lock_lease_s", "lock_renew_interval")


class ActionModule(ActionBase):
    """Polls `sglang_health_probe` on the host until healthy, failed or timed out."""

    _VALID_ARGS = frozenset(
        (*ARGS, *LOCK_ARGS, "timeout", "poll_interval", "progress_interval", "name")
    )

    def run(self, tmp: Any = None, task_vars: dict | None = None) -> dict:
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        timeout = float(args.pop("timeout", 1200))
        poll = float(args.pop("poll_interval", 5))
        progress_every = float(args.pop("progress_interval", 30))
        label = args.pop("name", args.get("unit", "server"))
        lease = LeaseRenewal.from_args(args, self._play_context.check_mode)
        if self._play_context.check_mode:
            result.update(
                skipped=True, msg="check mode: no server was started, nothing to wait for"
            )
            return result
        probe_args = {k: v for k, v in args.items() if k in ARGS}
        host = (task_vars or {}).get("inventory_hostname", "?")
        started = time.monotonic()
        last_progress = started
        while True:
            lost = self._renew(lease, task_vars) if lease is not None and lease.due() else ""
            if lost:
                # lock_lost tells a rescue not to roll back: another run may own the host now.
                result.update(failed=True, lock_lost=True, msg=f"{label}: stopped waiting: {lost}")
                return result
            probe = self._execute_module(
                module_name="sglang_fleet.fleet.sglang_health_probe",
                module_args=probe_args,
                task_vars=task_vars,
            )
            if probe.get("failed"):
                raise AnsibleActionFail(f"health probe failed: {probe.get('msg')}")
            elapsed = time.monotonic() - started
            probe["elapsed_s"] = round(elapsed, 1)
            if probe["state"] == "healthy":
                result.update(probe, changed=False, msg=f"{label} healthy after {elapsed:.0f} s")
                return result
            if probe["state"] == "failed":
                tail = "\n".join(probe.get("log_tail", [])[-15:])
                result.update(
                    probe,
                    failed=True,
                    msg=(
                        f"{label} failed to start after {elapsed:.0f} s: {probe.get('cause')}\n"
                        f"last log lines:\n{tail}"
                    ),
                )
                return result
            if elapsed >= timeout:
                result.update(
                    probe,
                    failed=True,
                    msg=(
                        f"{label} not healthy within {timeout:.0f} s (unit "
                        f"{probe.get('active_state')}, last log: {probe.get('last_log_line')!r})"
                    ),
                )
                return result
            if time.monotonic() - last_progress >= progress_every:
                last_progress = time.monotonic()
                display.display(
                    f"  [{host}] {label}: starting, {elapsed:.0f} s elapsed, "
                    f"last log: {probe.get('last_log_line', '')[:160]}"
                )
            time.sleep(poll)

    def _renew(self, lease: LeaseRenewal, task_vars: dict | None) -> str:
        """Renews the lock; returns why it failed, or '' when renewed."""
        renewed = self._execute_module(
            module_name="sglang_fleet.fleet.fleet_lock",
            module_args=lease.module_args(),
            task_vars=task_vars,
        )
        if renewed.get("failed"):
            return str(renewed.get("msg", "fleet_lock failed"))
        lease.renewed(float(renewed.get("lease_s") or 0))
        return ""


class LeaseRenewal:
    """When the wait renews the rollout lock (module fleet_lock, state=renewed)."""

    clock = staticmethod(time.monotonic)

    def __init__(self, path: str, token: str, lease_s: int | None, interval: float | None):
        self.path, self.token, self.lease_s, self.interval = path, token, lease_s, interval
        self._next = 0.0

    @classmethod
    def from_args(cls, args: dict[str, Any], check_mode: bool = False) -> LeaseRenewal | None:
        """None without lock_path; bad values fail here, before the host is touched. In check
        mode fleet_lock takes no lock and returns an empty token: there is nothing to renew."""
        path = args.pop("lock_path", None)
        token = args.pop("lock_token", None)
        lease = _positive(args.pop("lock_lease_s", None), "lock_lease_s", whole=True)
        interval = _positive(args.pop("lock_renew_interval", None), "lock_renew_interval")
        if not path:
            if token or lease or interval:
                raise AnsibleActionFail(
                    "sglang_wait_healthy: lock_token, lock_lease_s and lock_renew_interval "
                    "need lock_path (the fleet_lock file to renew)"
                )
            return None
        if check_mode and not token:
            return None
        if not token or not isinstance(token, str):
            raise AnsibleActionFail(
                f"sglang_wait_healthy: lock_path {path} needs lock_token, the token that "
                "fleet_lock state=acquired returned (register it)"
            )
        return cls(str(path), token, int(lease) if lease else None, interval)

    def due(self) -> bool:
        return self.clock() >= self._next

    def module_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"path": self.path, "state": "renewed", "token": self.token}
        if self.lease_s:
            args["lease_s"] = self.lease_s
        return args

    def renewed(self, lease_s: float) -> None:
        every = self.interval or min(60.0, lease_s / 3 if lease_s > 0 else 60.0)
        self._next = self.clock() + every


def _positive(value: Any, name: str, whole: bool = False) -> float | None:
    if value is None or value == "":
        return None
    try:
        number = float(str(value).strip())
    except ValueError:
        number = 0.0
    if number <= 0 or (whole and not number.is_integer()):
        kind = "a whole number of seconds" if whole else "seconds"
        raise AnsibleActionFail(
            f"sglang_wait_healthy: {name} must be {kind} above 0, got {value!r}"
        )
    return number
