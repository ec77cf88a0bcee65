#!/usr/bin/python
"""Documentation of the action sglang_host_program (plugins/action/sglang_host_program.py): it runs
on the control node and sequences modules on the host. ansible-doc and ansible-test read an
action's documentation from the module file of its name, as they read ansible.builtin.reboot's."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_host_program
short_description: Put one of sglang_fleet's host-side programs on a host as one zipapp
description:
- 'Builds a zipapp of an entry module of the controller package sglang_fleet and what it imports,
  on the control node, and hands it to ansible.builtin.copy: check mode, C(changed) and owner,
  group and mode behave as copy''s; the same sources give the same bytes (docs/ARCHITECTURE.md,
  "Host-side programs").'
version_added: 0.2.0
author: sglang-fleet maintainers (@sglang-fleet)
options:
  entry:
    description: The module of sglang_fleet whose C(main()) the program runs.
    type: str
    required: true
  dest:
    description: Where the program goes on the host.
    type: path
    required: true
  requires:
    description: Third-party packages (top-level import names) the host provides.
    type: list
    elements: str
    default: []
  mode:
    description: As ansible.builtin.copy's.
    type: raw
  owner:
    description: As ansible.builtin.copy's.
    type: str
  group:
    description: As ansible.builtin.copy's.
    type: str
"""

EXAMPLES = r"""
- name: Put the sampler on the host
  sglang_fleet.fleet.sglang_host_program:
    entry: sglang_fleet.diagnosis.live_metrics
    dest: /usr/local/lib/sglang-fleet/live.pyz
    mode: '0755'
"""

RETURN = r"""
size:
  description: The program's size in bytes.
  returned: always
  type: int
requires:
  description: The third-party packages the program imports, which the host must have.
  returned: always
  type: list
  elements: str
optional:
  description: Those it imports only if they are there.
  returned: always
  type: list
  elements: str
"""
