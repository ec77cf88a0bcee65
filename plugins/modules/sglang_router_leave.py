#!/usr/bin/python
"""Documentation of the action sglang_router_leave (plugins/action/sglang_router_leave.py): it runs
on the control node and sequences modules on the host. ansible-doc and ansible-test read an
action's documentation from the module file of its name, as they read ansible.builtin.reboot's."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_router_leave
short_description: A replica behind a router leaves it and drains, before it stops
description:
- A running replica leaves its router, which refuses when too few other healthy replicas would
  be left; then the bounded drain of its running requests; the rollout lock is renewed for
  the drain first (docs/ROUTER.md).
- 'A router that refuses fails the task with the server untouched. Check mode: nothing leaves.'
version_added: 0.2.0
author: sglang-fleet maintainers (@sglang-fleet)
options:
  server:
    description: A described server with its C(name) and C(unit).
    type: dict
    required: true
  router:
    description: 'The replica''s router: C({url, worker_url, metrics_url}).'
    type: dict
    required: true
  drain:
    description: 'The drain''s bounds: C({timeout, min_healthy_others, drain_timeout}).'
    type: dict
  lock:
    description: The rollout lock this run holds, C({path, token, lease_s}) (the fleet_lock
      action's result); without one, nothing is renewed.
    type: dict
  api_key:
    description: The router's key (never logged).
    type: str
"""

EXAMPLES = r"""
- name: Take the replica out of its router
  sglang_fleet.fleet.sglang_router_leave:
    server: '{{ sglang_server_target }}'
    router: '{{ sglang_server_target.router }}'
"""

RETURN = r"""
router_out:
  description: Whether it left its router here.
  returned: always
  type: bool
drain:
  description: C({drained, running_reqs, drain_seconds}), null when it did not run.
  returned: always
  type: dict
steps:
  description: What each step did, in order (also shown at -v).
  returned: always
  type: list
  elements: str
"""
