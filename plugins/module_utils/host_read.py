"""What a pre-flight reads on a host, in one module run (plugins/modules/sglang_host_state.py,
option `read`; the sglang_preflight action decides from it). Runs on the GPU host: standard library
and module_utils only. Every reader is bounded: files by size, commands by time.

- gpus: nvidia-smi's GPU list (plugins/module_utils/nvidia_smi.py), or why it could not be read;
- python: whether the installed SGLang's interpreter exists, and SGLang's version in it
  (unless `version` is false: an import of its metadata, which a caller that runs the flag
  check, or has its result, need not pay again);
- user: whether the service user exists (before the first deploy it owns nothing);
- ports: who listens on each server's port, classified by the cleanup's ownership rules
  (docs/GPU-CLEANUP.md), each server with its own rules (its unit, its port);
- models: each model folder's config.json text and its weights' bytes (the index's
  metadata.total_size, else the single checkpoint's *.safetensors sizes);
- files: small JSON files as text (calibration stores, last-known-good records), or None;
- mem_total_mib: the host's RAM (what Ansible's memtotal_mb fact says), always.
"""

from __future__ import annotations

import glob
import os
import pwd
import subprocess
from typing import Any

from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_file import read_regular
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_json import (
    loads as bounded_loads,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.gpu_cleanup_discovery import (
    port_holders,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.gpu_cleanup_ownership import (
    OursRules,
    Ownership,
    container_root,
    resolve_owner_uids,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.nvidia_smi import (
    NvidiaSmiError,
    read_gpus,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.procfs import PROC, own_cgroup

# config.json, a safetensors index, a calibration store, a last-known-good record: far less.
MAX_FILE_BYTES = 32 * 1024 * 1024
VERSION_CODE = "import importlib.metadata as m; print(m.version('sglang'))"
INDEX = "model.safetensors.index.json"


def read_text(path: str) -> str | None:
    """A regular file's text (bounded), None when it does not exist; ValueError otherwise."""
    data = read_regular(path, MAX_FILE_BYTES)
    return None if data is None else data.decode("utf-8", errors="replace")


def read_model(folder: str) -> dict[str, Any]:
    """{config: text or None, weight_bytes: int or None, error: text or None} of one folder."""
    found: dict[str, Any] = {"config": None, "weight_bytes": None, "error": None}
    try:
        found["config"] = read_text(os.path.join(folder, "config.json"))
        index = read_text(os.path.join(folder, INDEX))
        if index is not None:
            total = (bounded_loads(index, INDEX).get("metadata") or {}).get("total_size")
            found["weight_bytes"] = total if isinstance(total, int) and total > 0 else None
        else:
            files = glob.glob(os.path.join(glob.escape(folder), "*.safetensors"))
            found["weight_bytes"] = sum(os.stat(f).st_size for f in files) or None
    except (OSError, ValueError, AttributeError) as err:
        found["error"] = str(err)
    return found


def mem_total_mib(proc_root: str = PROC) -> int | None:
    """The host's RAM (MemTotal of /proc/meminfo) in MiB, as Ansible's memtotal_mb fact."""
    try:
        with open(os.path.join(proc_root, "meminfo"), encoding="ascii", errors="replace") as f:
            for line in f.read(65536).splitlines():
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def sglang_version(python: str, timeout: int) -> str | None:
    try:
        done = subprocess.run(
            [python, "-c", VERSION_CODE],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def read(params: dict[str, Any], timeout: int, proc_root: str = PROC) -> dict[str, Any]:
    """The `read` option's answer; see the module docstring."""
    found: dict[str, Any] = {"mem_total_mib": mem_total_mib(proc_root)}
    if params.get("nvidia_smi"):
        try:
            found["gpus"] = read_gpus(params["nvidia_smi"], timeout)
        except NvidiaSmiError as err:
            found["gpus"] = {"error": str(err)}
    python = params.get("python")
    if python:
        found["python_exists"] = os.path.exists(python)
        if params.get("version", True):
            found["sglang_version"] = (
                sglang_version(python, timeout) if found["python_exists"] else None
            )
    user = params.get("user")
    if user:
        try:
            pwd.getpwnam(user)
            found["user_exists"] = True
        except KeyError:
            found["user_exists"] = False
    holders: dict[str, Any] = {}
    own = container_root(own_cgroup(proc_root))
    for want in params.get("ports") or []:
        users = list(want["ours"].get("users") or ["root"])
        if user and not found.get("user_exists"):
            users = [u for u in users if u != user]
        rules = OursRules.from_params({**want["ours"], "users": users})
        try:
            ownership = Ownership(rules, resolve_owner_uids(rules.users), own)
            holders[want["label"]] = port_holders(ownership, proc_root)
        except (OSError, ValueError) as err:
            holders[want["label"]] = {"error": str(err)}
    found["port_holders"] = holders
    found["models"] = {folder: read_model(folder) for folder in params.get("models") or []}
    files: dict[str, Any] = {}
    for path in params.get("files") or []:
        try:
            files[path] = read_text(path)
        except (OSError, ValueError) as err:
            files[path] = {"error": str(err)}
    found["files"] = files
    return found
