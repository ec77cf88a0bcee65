#!/usr/bin/python
"""Documentation of the action sglang_preflight (plugins/action/sglang_preflight.py): it runs
on the control node and sequences modules on the host. ansible-doc and ansible-test read an
action's documentation from the module file of its name, as they read ansible.builtin.reboot's."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_preflight
short_description: Check every server of a host before anything on it changes
description:
- 'Reads the host once (GPUs, units, the SGLang interpreter and version, the service user,
  port holders, model descriptions, calibration stores), then checks the servers without changing
  anything: cross-flag rules, GPU sets, ports and host RAM, every flag set against the installed
  SGLang''s own parser, what holds each port, and each server''s capacity plan
  (docs/ARCHITECTURE.md,
  "Stages").'
- Every problem found is named in one failure, before anything stops. Nothing changes the
  host, in check mode or not.
version_added: 0.2.0
author: sglang-fleet maintainers (@sglang-fleet)
options:
  servers:
    description: The servers as the sglang_server role describes them (C(sglang_server_servers)).
    type: list
    required: true
    elements: dict
  python:
    description: The SGLang virtualenv's interpreter.
    type: path
    required: true
  launch_module:
    description: The module the servers start with (C(sglang.launch_server)).
    type: str
    required: true
  nvidia_smi:
    description: The nvidia-smi command on the host.
    type: str
    required: true
  host_ram_mib:
    description: The host's RAM in MiB; the host's MemTotal by default.
    type: int
  service_user:
    description: The user the servers run as.
    type: str
  plan:
    description: The capacity planner's settings.
    type: dict
  workload:
    description: The workload the plan is made for.
    type: dict
  calibration_mode:
    description: What a refusal on this host's calibration does.
    type: str
    choices:
    - enforce
    - warn
    - ignore
    default: enforce
  warnings_fatal:
    description: Whether a plan's warnings block.
    type: bool
    default: false
  proven:
    description: 'An earlier result of this action in the same run: flag sets it proved are
      not checked again.'
    type: dict
  router_keys:
    description: Each routed server's router key, by server name (never logged).
    type: dict
  speculation_reset:
    description: What a flag set whose speculation SGLang would reset does (docs/SPECULATIVE.md).
    type: str
    choices:
    - warn
    - refuse
    default: warn
"""

EXAMPLES = r"""
- name: Check every server before anything changes
  sglang_fleet.fleet.sglang_preflight:
    servers: '{{ sglang_server_servers }}'
    python: /opt/ml-env/bin/python
    launch_module: sglang.launch_server
    nvidia_smi: nvidia-smi
  register: sglang_server_preflight
"""

RETURN = r"""
problems:
  description: Every problem found, one line each (the failure's C(msg) too).
  returned: always
  type: list
  elements: str
plans:
  description: Each server's capacity plan, by server name.
  returned: always
  type: dict
bounds:
  description: The line that says what bounds each server, by server name.
  returned: always
  type: dict
lines:
  description: What the role shows.
  returned: always
  type: list
  elements: str
running:
  description: The servers' units that run now.
  returned: always
  type: list
  elements: str
sglang_version:
  description: The installed SGLang's version.
  returned: always
  type: str
steps:
  description: What each step did, in order (also shown at -v).
  returned: always
  type: list
  elements: str
"""
