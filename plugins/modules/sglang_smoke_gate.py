#!/usr/bin/python
"""Documentation of the action sglang_smoke_gate (plugins/action/sglang_smoke_gate.py): it runs
on the control node and sequences modules on the host. ansible-doc and ansible-test read an
action's documentation from the module file of its name, as they read ansible.builtin.reboot's."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_smoke_gate
short_description: Measure a freshly started server with a smoke benchmark and gate on the
  result
description:
- Runs the standard-library smoke client on the host in one module run (the API key on stdin,
  never in argv or a result), keeps the result, its picture and its diagnosis under C(reports_dir)
  on the control node, and judges it against every threshold and, with C(max_regression_pct),
  the last-known-good result.
- 'A failed gate fails the task with "smoke gate: ..." and the caller rolls back. Check mode:
  nothing runs.'
version_added: 0.2.0
author: sglang-fleet maintainers (@sglang-fleet)
options:
  server:
    description: A described server with its C(name) and C(port).
    type: dict
    required: true
  workload:
    description: The benchmark's workload (prompts, lengths, concurrency).
    type: dict
    required: true
  python:
    description: The host's Python that runs the client.
    type: path
    required: true
  client_path:
    description: Where the client goes on the host.
    type: path
    required: true
  state_dir:
    description: The server's state folder on the host.
    type: path
    required: true
  reports_dir:
    description: The control node's folder for reports.
    type: path
    required: true
  api_key:
    description: The server's API key (never logged).
    type: str
  timeout:
    description: The benchmark's bound, in seconds.
    type: int
    default: 600
  journal_lines:
    description: How many lines of this start's journal are read back.
    type: int
  thresholds:
    description: The gate's thresholds.
    type: dict
  lock:
    description: The rollout lock this run holds, C({path, token, lease_s}) (the fleet_lock
      action's result); without one, nothing is renewed.
    type: dict
"""

EXAMPLES = r"""
- name: Gate the server on a smoke benchmark
  sglang_fleet.fleet.sglang_smoke_gate:
    server: '{{ sglang_server_target }}'
    workload:
      num_prompts: 64
    python: /usr/bin/python3
    client_path: /usr/local/lib/sglang-fleet/smoke.pyz
    state_dir: /var/lib/sglang-fleet/kimi
    reports_dir: reports
  register: smoke_gate_run
"""

RETURN = r"""
passed:
  description: Whether the gate passed.
  returned: always
  type: bool
summary:
  description: 'One line: what was measured and the verdict.'
  returned: always
  type: str
measured:
  description: What the fleet summary shows.
  returned: always
  type: dict
report:
  description: The result's path on the control node.
  returned: always
  type: str
steps:
  description: What each step did, in order (also shown at -v).
  returned: always
  type: list
  elements: str
"""
