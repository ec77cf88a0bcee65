#!/usr/bin/python
"""Documentation of the action sglang_router_join (plugins/action/sglang_router_join.py): it runs
on the control node and sequences modules on the host. ansible-doc and ansible-test read an
action's documentation from the module file of its name, as they read ansible.builtin.reboot's."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_router_join
short_description: A replica behind a router goes back into it, after it serves
description:
- A replica this run took out must go back and the router must list it as healthy; one it
  did not take out goes back when its router answers, and a router that does not answer yet
  is said, not failed (docs/ROUTER.md).
- 'A server without a router is skipped. Check mode: nothing.'
version_added: 0.2.0
author: sglang-fleet maintainers (@sglang-fleet)
options:
  server:
    description: A described server with its C(name) and C(router).
    type: dict
    required: true
  api_key:
    description: The router's key (never logged).
    type: str
  taken_out:
    description: Whether this run took the replica out.
    type: bool
    default: false
  timeout:
    description: The router's timeout, in seconds.
    type: int
"""

EXAMPLES = r"""
- name: Put the replica back into its router
  sglang_fleet.fleet.sglang_router_join:
    server: '{{ sglang_server_target }}'
    taken_out: true
"""

RETURN = r"""
router_out:
  description: False once it is back.
  returned: always
  type: bool
joined:
  description: Whether it was put back here.
  returned: always
  type: bool
steps:
  description: What each step did, in order (also shown at -v).
  returned: always
  type: list
  elements: str
"""
