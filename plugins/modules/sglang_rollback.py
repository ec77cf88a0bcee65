#!/usr/bin/python
"""Documentation of the action sglang_rollback (plugins/action/sglang_rollback.py): it runs
on the control node and sequences modules on the host. ansible-doc and ansible-test read an
action's documentation from the module file of its name, as they read ansible.builtin.reboot's."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_rollback
short_description: Put one server back on its last-known-good configuration
description:
- 'After a failure: a lock another run took over leaves the server to that run, and a router
  that would not let it go left it untouched; otherwise the kept files go back in place and
  start, health-gated, or without a record the failed server is stopped and its GPUs cleaned
  (docs/ARCHITECTURE.md, "Operator verbs").'
- 'Check mode: nothing.'
version_added: 0.2.0
author: sglang-fleet maintainers (@sglang-fleet)
options:
  server:
    description: A server as the sglang_server role describes it (C(sglang_server_servers)).
    type: dict
    required: true
  restart:
    description: 'sglang_restart''s arguments for the start: launch_module, owner_users, cleanup,
      health, lock.'
    type: dict
    required: true
  failure:
    description: The failed step's result, C({msg, lock_lost, untouched}).
    type: dict
"""

EXAMPLES = r"""
- name: Roll the server back
  sglang_fleet.fleet.sglang_rollback:
    server: '{{ sglang_server_target }}'
    restart:
      launch_module: sglang.launch_server
      owner_users: [sglang]
    failure: '{{ ansible_failed_result }}'
  register: sglang_server_rollback
"""

RETURN = r"""
decision:
  description: Go back, lock lost or untouched.
  returned: always
  type: str
found:
  description: Whether a last-known-good record was there.
  returned: always
  type: bool
rolled_back:
  description: Whether it serves its last-known-good configuration again.
  returned: always
  type: bool
outcome:
  description: One sentence.
  returned: always
  type: str
steps:
  description: What each step did, in order (also shown at -v).
  returned: always
  type: list
  elements: str
"""
