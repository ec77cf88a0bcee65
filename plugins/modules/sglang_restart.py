#!/usr/bin/python
"""Documentation of the action sglang_restart (plugins/action/sglang_restart.py): it runs
on the control node and sequences modules on the host. ansible-doc and ansible-test read an
action's documentation from the module file of its name, as they read ansible.builtin.reboot's."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_restart
short_description: Stop one server, clean what it leaves, start it and wait for a real generation
description:
- A replica behind a router leaves it and drains first; the rollout lock is renewed; the stop
  (SIGTERM, then systemd's kill after TimeoutStopSec); only what is provably ours is cleaned
  from its GPUs, anything else fails before any signal (docs/GPU-CLEANUP.md); the start; the
  health gate on a real generation, the lock renewed while the model loads.
- 'A failure says which step; C(lock_lost=true) when the lock was taken over, C(untouched=true)
  when it failed before anything stopped. Check mode: nothing is stopped or started; the action
  is skipped.'
version_added: 0.2.0
author: sglang-fleet maintainers (@sglang-fleet)
options:
  server:
    description: A server as the sglang_server role describes it (C(sglang_server_servers)).
    type: dict
    required: true
  launch_module:
    description: The module the server starts with.
    type: str
    required: true
  owner_users:
    description: The users whose GPU processes count as ours.
    type: list
    required: true
    elements: str
  lock:
    description: The rollout lock this run holds, C({path, token, lease_s}) (the fleet_lock
      action's result); without one, nothing is renewed.
    type: dict
  health:
    description: The health wait's settings (as sglang_wait_healthy's options).
    type: dict
  cleanup:
    description: The operator's C(gpu_cleanup_*) settings.
    type: dict
  router:
    description: 'The replica''s router: C({url, worker_url, metrics_url}).'
    type: dict
  drain:
    description: 'The drain''s bounds: C({timeout, min_healthy_others, drain_timeout}).'
    type: dict
  api_key:
    description: The router's key (never logged).
    type: str
"""

EXAMPLES = r"""
- name: Restart the server
  sglang_fleet.fleet.sglang_restart:
    server: '{{ sglang_server_target }}'
    launch_module: sglang.launch_server
    owner_users: [sglang]
  register: sglang_server_restarted
"""

RETURN = r"""
server:
  description: The server's name.
  returned: always
  type: str
downtime:
  description: C({was_running, stop_result, downtime_seconds}).
  returned: always
  type: dict
health:
  description: The health wait's result.
  returned: always
  type: dict
router_out:
  description: Whether it left its router here and is not back yet.
  returned: always
  type: bool
steps:
  description: What each step did, in order (also shown at -v).
  returned: always
  type: list
  elements: str
"""
