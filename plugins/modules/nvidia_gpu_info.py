#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module nvidia_gpu_info: the host's GPUs as nvidia-smi reports them (read-only).
Runs on the GPU host: standard library and module_utils only."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: nvidia_gpu_info
short_description: List the host's GPUs (index, name, memory) from nvidia-smi
description:
  - Runs C(nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total
    --format=csv,noheader,nounits) and returns one entry per GPU, parsed by the shared
    C(plugins/module_utils/nvidia_smi.py) (the same parser the cleanup and driver checks use).
  - Fails with nvidia-smi's own reason in plain words (driver not loaded, version mismatch, no
    devices) instead of returning an empty list.
  - Changes nothing; runs in check mode.
version_added: "0.2.0"
author: sglang-fleet maintainers (@sglang-fleet)
options:
  nvidia_smi:
    description: Path or name of the nvidia-smi binary.
    type: str
    default: nvidia-smi
  timeout:
    description: Seconds nvidia-smi may take (a hung GPU can block it).
    type: int
    default: 30
"""

EXAMPLES = r"""
- name: Read the host's GPUs
  sglang_fleet.fleet.nvidia_gpu_info:
  register: gpu_info

- name: Show the smallest GPU
  ansible.builtin.debug:
    msg: "{{ gpu_info.gpu_count }} GPUs, smallest {{ gpu_info.min_memory_total_mib }} MiB"
"""

RETURN = r"""
gpus:
  description: One entry per GPU, in nvidia-smi's order.
  returned: success
  type: list
  elements: dict
  sample:
    - {index: 0, uuid: GPU-8e1..., name: NVIDIA H200, memory_used_mib: 0, memory_total_mib: 143771}
gpu_count:
  description: Number of GPUs listed.
  returned: success
  type: int
min_memory_total_mib:
  description: The smallest memory.total (MiB) among the GPUs; null when nvidia-smi hides it.
  returned: success
  type: int
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.nvidia_smi import (
    NvidiaSmiError,
    read_gpus,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "nvidia_smi": {"type": "str", "default": "nvidia-smi"},
            "timeout": {"type": "int", "default": 30},
        },
        supports_check_mode=True,
    )
    try:
        result = read_gpus(module.params["nvidia_smi"], module.params["timeout"])
    except NvidiaSmiError as exc:
        module.fail_json(msg=str(exc), changed=False)
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
