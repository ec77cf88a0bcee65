#!/usr/bin/python
"""Documentation of the action sglang_wait_healthy (plugins/action/sglang_wait_healthy.py): it runs
on the control node and sequences modules on the host. ansible-doc and ansible-test read an
action's documentation from the module file of its name, as they read ansible.builtin.reboot's."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_wait_healthy
short_description: Wait until an SGLang server answers a real generation
description:
- Polls the sglang_health_probe module on the host until the server answers a generation,
  the unit dies, it logs a fatal error or the time runs out; every C(progress_interval) seconds
  one line with the elapsed time and the server's latest log line.
- With C(lock_path) and C(lock_token) it renews the host's rollout lock while it waits; a
  lock taken over ends the wait as failed with C(lock_lost=true) (docs/LOCKING.md).
- 'Check mode: no server was started; the action is skipped.'
version_added: 0.2.0
author: sglang-fleet maintainers (@sglang-fleet)
options:
  unit:
    description: The server's systemd unit.
    type: str
  url:
    description: The server's URL.
    type: str
  since:
    description: The start's time, for the journal.
    type: str
  request_timeout:
    description: One probe's bound, in seconds.
    type: float
  fatal_patterns:
    description: Log lines that end the wait as failed.
    type: list
    elements: str
  restarts_baseline:
    description: The unit's restart count before the start.
    type: int
  timeout:
    description: The whole wait's bound, in seconds.
    type: float
    default: 1200
  poll_interval:
    description: Seconds between probes.
    type: float
    default: 5
  progress_interval:
    description: Seconds between progress lines.
    type: float
    default: 30
  name:
    description: The server's name in messages; the unit by default.
    type: str
  lock_path:
    description: The rollout lock's path on the host.
    type: path
  lock_token:
    description: This run's lock token.
    type: str
  lock_lease_s:
    description: The lock's lease, in seconds.
    type: int
  lock_renew_interval:
    description: Seconds between renewals; a third of the lease, at most 60, by default.
    type: float
"""

EXAMPLES = r"""
- name: Wait for a generation
  sglang_fleet.fleet.sglang_wait_healthy:
    unit: sglang@kimi.service
    url: http://127.0.0.1:8000
    timeout: 1800
"""

RETURN = r"""
msg:
  description: How the wait ended.
  returned: always
  type: str
lock_lost:
  description: Whether the rollout lock was taken over.
  returned: when the lock was lost
  type: bool
"""
