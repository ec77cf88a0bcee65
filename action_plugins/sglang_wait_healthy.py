"""Action: wait until an SGLang server answers a real generation, with one progress line a while.

Model loading can take 20 minutes, so the wait is long; instead of hundreds of "retrying" lines it
prints, every `progress_interval` seconds, the elapsed time and the server's latest log line, and
it stops at once when the unit dies or logs a fatal error (the probe module decides that).
"""

from __future__ import annotations

import time
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

ARGS = ("unit", "url", "since", "request_timeout", "fatal_patterns", "restarts_baseline")


class ActionModule(ActionBase):
    """Polls `sglang_health_probe` on the host until healthy, failed or timed out."""

    _VALID_ARGS = frozenset((*ARGS, "timeout", "poll_interval", "progress_interval", "name"))

    def run(self, tmp: Any = None, task_vars: dict | None = None) -> dict:
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        timeout = float(args.pop("timeout", 1200))
        poll = float(args.pop("poll_interval", 5))
        progress_every = float(args.pop("progress_interval", 30))
        label = args.pop("name", args.get("unit", "server"))
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
            probe = self._execute_module(
                module_name="sglang_health_probe", module_args=probe_args, task_vars=task_vars
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
