#!/usr/bin/python
"""Documentation of the action sglang_calibrate (plugins/action/sglang_calibrate.py): it runs
on the control node and sequences modules on the host. ansible-doc and ansible-test read an
action's documentation from the module file of its name, as they read ansible.builtin.reboot's."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_calibrate
short_description: Keep what one healthy start of a server measured in the host's calibration
  store
description:
- Reads this start's memory lines from the journal and C(/server_info) (with the server's
  API key in a header, under no_log), the installed SGLang's version, the server's GPUs and
  its model's fingerprint, builds a calibration record and keeps it first in the host's store
  (docs/CALIBRATION.md).
- 'Never fails a healthy start: any failure of reading or recording ends with C(record=null),
  the reason in C(msg) and a warning.'
- 'Check mode: nothing was started, so nothing is measured; the action is skipped.'
version_added: 0.2.0
author: sglang-fleet maintainers (@sglang-fleet)
options:
  server:
    description: A server as the sglang_server role describes it (C(sglang_server_servers)).
    type: dict
    required: true
  python:
    description: The server's Python (its virtualenv's interpreter), which reads the installed
      SGLang's version.
    type: path
    required: true
  nvidia_smi:
    description: The nvidia-smi command on the host.
    type: str
    required: true
  flags:
    description: The flags the server runs with; the server's own by default.
    type: dict
  config_hash:
    description: The configuration's hash; the server's own by default.
    type: str
  host_ram_mib:
    description: The host's RAM in MiB, for a CPU server.
    type: int
  api_key:
    description: The server's API key (never logged).
    type: str
  known:
    description: What this play's pre-flight read, C({sglang_version, gpus, fingerprints}),
      sparing those reads.
    type: dict
"""

EXAMPLES = r"""
- name: Keep what the start measured
  sglang_fleet.fleet.sglang_calibrate:
    server: '{{ sglang_server_target }}'
    python: /opt/ml-env/bin/python
    nvidia_smi: nvidia-smi
  register: sglang_server_calibration
"""

RETURN = r"""
record:
  description: The calibration record kept, or null with the reason in C(msg).
  returned: always
  type: dict
msg:
  description: What was measured, or why nothing was.
  returned: always
  type: str
store:
  description: The store's path on the host.
  returned: always
  type: str
steps:
  description: What each step did, in order (also shown at -v).
  returned: always
  type: list
  elements: str
"""
