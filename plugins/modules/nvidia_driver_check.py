#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module nvidia_driver_check: say whether the NVIDIA driver on this host is usable, and
if not, what is wrong in words an operator can act on. Runs on the GPU host: standard library
only. The decision (decide()) is a pure function so it is unit-tested without a GPU."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: nvidia_driver_check
short_description: Probe or verify the NVIDIA driver (kernel module, userland, GPU count, branch)
description:
  - Runs C(nvidia-smi --query-gpu=index,name,driver_version), reads the loaded kernel module's
    version from I(module_version_file) and the installed module's version from
    C(modinfo -F version nvidia), and decides one I(state).
  - With I(fail_unhealthy=false) (probe) it never fails, so a role can decide from the result
    whether to install and whether to reboot. With I(fail_unhealthy=true) (verify) every state
    but C(healthy) fails with a message that names what is wrong.
  - Read-only; supports check mode.
version_added: "0.1.0"
author: sglang-fleet maintainers (@sglang-fleet)
options:
  nvidia_smi:
    description: Path or name of the nvidia-smi binary.
    type: str
    default: nvidia-smi
  expected_branch:
    description:
      - Driver branch wanted (the major version, C(580) for 580.95.05). Empty accepts any.
    type: str
    default: ""
  expected_gpu_count:
    description: GPUs nvidia-smi must list. C(0) accepts any number above zero.
    type: int
    default: 0
  fail_unhealthy:
    description: Fail with the state's message unless the state is C(healthy).
    type: bool
    default: false
  module_version_file:
    description: Where the running kernel exposes the loaded nvidia module's version.
    type: str
    default: /sys/module/nvidia/version
  modinfo:
    description: Path or name of modinfo, used to read the installed module's version.
    type: str
    default: modinfo
  timeout:
    description: Seconds nvidia-smi and modinfo may take (a hung GPU can block nvidia-smi).
    type: int
    default: 60
"""

EXAMPLES = r"""
- name: Probe the driver (never fails)
  sglang_fleet.fleet.nvidia_driver_check:
    expected_branch: "580"
  register: probe

- name: Verify the driver
  sglang_fleet.fleet.nvidia_driver_check:
    expected_branch: "580"
    expected_gpu_count: 8
    fail_unhealthy: true
"""

RETURN = r"""
state:
  description: >-
    One of healthy, absent, not_loaded, version_mismatch, wrong_branch, too_few_gpus,
    too_many_gpus, no_gpus, error.
  type: str
  returned: always
healthy:
  description: The driver is loaded, consistent, of the wanted branch, with the wanted GPU count.
  type: bool
  returned: always
message:
  description: What is wrong and what to do, or a one-line summary when healthy.
  type: str
  returned: always
driver_version:
  description: Driver version nvidia-smi reports (null when nvidia-smi fails).
  type: str
  returned: always
driver_branch:
  description: Major part of driver_version (null when unknown).
  type: str
  returned: always
branch_matches:
  description: nvidia-smi answers and reports the expected branch (true when none is expected).
  type: bool
  returned: always
gpu_count:
  description: GPUs nvidia-smi lists (null when nvidia-smi fails).
  type: int
  returned: always
gpu_names:
  description: Model name of each GPU.
  type: list
  elements: str
  returned: always
loaded_module_version:
  description: Version of the loaded nvidia kernel module, null when none is loaded.
  type: str
  returned: always
installed_module_version:
  description: Version of the nvidia kernel module installed for the running kernel, or null.
  type: str
  returned: always
reboot_needed:
  description: An installed module differs from the loaded one (or none is loaded).
  type: bool
  returned: always
"""

import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.nvidia_smi import (
    NvidiaSmiError,
    failure_kind,
    parse_csv,
)

# The GPU name may contain commas: the shared parser takes it from the outside in.
QUERY_FIELDS = ["index", "name", "driver_version"]


@dataclass
class Observation:
    """What the host says: nvidia-smi's result and the two module versions."""

    smi_found: bool
    smi_rc: int
    smi_output: str
    loaded_module_version: str | None
    installed_module_version: str | None


@dataclass
class Verdict:
    state: str
    message: str
    healthy: bool = False
    driver_version: str | None = None
    driver_branch: str | None = None
    branch_matches: bool = False
    gpu_count: int | None = None
    gpu_names: list[str] = field(default_factory=list)
    loaded_module_version: str | None = None
    installed_module_version: str | None = None
    reboot_needed: bool = False


def branch_of(version: str | None) -> str | None:
    """580.95.05 -> 580."""
    if not version:
        return None
    return version.strip().split(".", 1)[0] or None


def parse_query(text: str) -> list[dict[str, str]]:
    """Rows of ``--query-gpu=index,name,driver_version --format=csv,noheader`` (module_utils)."""
    try:
        parsed = parse_csv(text, QUERY_FIELDS)
    except NvidiaSmiError as exc:
        raise ValueError(str(exc)) from None
    rows = []
    for row in parsed:
        if not isinstance(row["index"], int) or row["driver_version"] is None:
            raise ValueError(f"unexpected nvidia-smi row: {row}")
        # 580.95.05 is not a number; a one-part version such as 580 would parse as one.
        rows.append(
            {
                "index": str(row["index"]),
                "name": str(row["name"]),
                "driver_version": str(row["driver_version"]),
            }
        )
    return rows


def _module_versions(obs: Observation) -> str:
    loaded = obs.loaded_module_version or "none"
    installed = obs.installed_module_version or "none found for the running kernel"
    return f"loaded kernel module: {loaded}; installed kernel module: {installed}"


def _failed_smi(obs: Observation, base: dict[str, Any]) -> Verdict:
    """nvidia-smi exited non-zero: name the cause from its own words."""
    kind = failure_kind(obs.smi_output)
    output = obs.smi_output.strip()[:300]
    if kind == "version_mismatch":
        return Verdict(
            state="version_mismatch",
            message=(
                "NVIDIA kernel module and userland driver versions differ (nvidia-smi: "
                f"'Driver/library version mismatch'); {_module_versions(obs)}. The driver was "
                "upgraded without reloading the module: reboot the host."
            ),
            **{**base, "reboot_needed": True},
        )
    if kind == "not_loaded":
        if obs.installed_module_version:
            hint = (
                f"a module ({obs.installed_module_version}) is installed for this kernel, so a "
                "reboot is needed to load it (nouveau may still hold the GPUs)"
            )
        else:
            hint = (
                "no nvidia module is installed for the running kernel: check the DKMS build "
                "(dkms status) for this kernel, then reboot"
            )
        return Verdict(
            state="not_loaded",
            message=(
                "NVIDIA kernel module not loaded, reboot needed: nvidia-smi cannot communicate "
                f"with the driver; {_module_versions(obs)}; {hint}."
            ),
            **{**base, "reboot_needed": True},
        )
    if kind == "no_gpus":
        return Verdict(
            state="no_gpus",
            message=f"nvidia-smi found no NVIDIA GPU on this host: {output}",
            **base,
        )
    return Verdict(
        state="error", message=f"nvidia-smi failed (exit {obs.smi_rc}): {output}", **base
    )


def _gpu_count_problem(count: int, expected: int) -> tuple[str, str] | None:
    if count == 0:
        return "no_gpus", "nvidia-smi answers but lists no GPU"
    if expected and count < expected:
        return (
            "too_few_gpus",
            f"fewer GPUs than expected: nvidia-smi lists {count}, expected {expected} "
            "(nvidia_driver_expected_gpu_count). A GPU may have fallen off the bus: look for "
            "Xid errors in the kernel log and check lspci.",
        )
    if expected and count > expected:
        return (
            "too_many_gpus",
            f"more GPUs than expected: nvidia-smi lists {count}, expected {expected}: set "
            "nvidia_driver_expected_gpu_count to this host's GPU count.",
        )
    return None


def _answering(obs: Observation, base: dict[str, Any], expected_branch: str, count: int) -> Verdict:
    """nvidia-smi answered: check module consistency, branch, then GPU count."""
    try:
        rows = parse_query(obs.smi_output)
    except ValueError as exc:
        return Verdict(state="error", message=str(exc), **base)
    version = rows[0]["driver_version"] if rows else None
    branch = branch_of(version)
    base.update(
        driver_version=version,
        driver_branch=branch,
        branch_matches=bool(rows) and (not expected_branch or branch == expected_branch),
        gpu_count=len(rows),
        gpu_names=[r["name"] for r in rows],
    )
    if base["reboot_needed"]:
        return Verdict(
            state="version_mismatch",
            message=(
                "NVIDIA kernel module and userland driver versions differ; "
                f"{_module_versions(obs)}; nvidia-smi reports {version}. Reboot the host to "
                "load the installed module."
            ),
            **base,
        )
    if expected_branch and rows and branch != expected_branch:
        return Verdict(
            state="wrong_branch",
            message=(
                f"driver branch mismatch: nvidia-smi reports driver {version} (branch {branch}), "
                f"wanted branch {expected_branch} (nvidia_driver_branch)."
            ),
            **base,
        )
    problem = _gpu_count_problem(len(rows), count)
    if problem:
        return Verdict(state=problem[0], message=problem[1], **base)
    return Verdict(
        state="healthy",
        healthy=True,
        message=f"driver {version} loaded, {len(rows)} GPU(s): {rows[0]['name']}",
        **base,
    )


def decide(obs: Observation, expected_branch: str, expected_gpu_count: int) -> Verdict:
    """Turn an observation into one state, in the order an operator would fix things."""
    # A module on disk that is not the loaded one means the running driver is stale.
    reboot_needed = bool(
        obs.installed_module_version and obs.loaded_module_version != obs.installed_module_version
    )
    base: dict[str, Any] = {
        "loaded_module_version": obs.loaded_module_version,
        "installed_module_version": obs.installed_module_version,
        "reboot_needed": reboot_needed,
    }
    if not obs.smi_found:
        state = "not_loaded" if obs.installed_module_version else "absent"
        message = (
            "nvidia-smi not found: the NVIDIA driver's userland is not installed"
            f" ({_module_versions(obs)})."
        )
        return Verdict(state=state, message=message, **base)
    if obs.smi_rc != 0:
        return _failed_smi(obs, base)
    return _answering(obs, base, expected_branch, expected_gpu_count)


def _run(argv: list[str], timeout: int) -> tuple[int, str]:
    try:
        # check=False: the caller reads the exit code.
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]} did not answer within {timeout} s"
    return done.returncode, f"{done.stdout}\n{done.stderr}".strip()


def _read_version(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def observe(params: dict[str, Any]) -> Observation:
    smi = shutil.which(params["nvidia_smi"])
    rc, output = 127, ""
    if smi:
        fields = ",".join(QUERY_FIELDS)
        rc, output = _run(
            [smi, f"--query-gpu={fields}", "--format=csv,noheader"], params["timeout"]
        )
    installed = None
    modinfo = shutil.which(params["modinfo"])
    if modinfo:
        mod_rc, mod_out = _run([modinfo, "-F", "version", "nvidia"], params["timeout"])
        installed = mod_out.strip() if mod_rc == 0 and mod_out.strip() else None
    return Observation(
        smi_found=smi is not None,
        smi_rc=rc,
        smi_output=output,
        loaded_module_version=_read_version(params["module_version_file"]),
        installed_module_version=installed,
    )


ARGUMENT_SPEC: dict[str, Any] = {
    "nvidia_smi": {"type": "str", "default": "nvidia-smi"},
    "expected_branch": {"type": "str", "default": ""},
    "expected_gpu_count": {"type": "int", "default": 0},
    "fail_unhealthy": {"type": "bool", "default": False},
    "module_version_file": {"type": "str", "default": "/sys/module/nvidia/version"},
    "modinfo": {"type": "str", "default": "modinfo"},
    "timeout": {"type": "int", "default": 60},
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    params = module.params
    verdict = decide(observe(params), params["expected_branch"], params["expected_gpu_count"])
    result = {"changed": False, **asdict(verdict)}
    if params["fail_unhealthy"] and not verdict.healthy:
        module.fail_json(msg=verdict.message, **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
