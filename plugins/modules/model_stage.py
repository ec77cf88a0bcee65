#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module model_stage: copy one checkpoint revision to local disk, verify it against its
manifest, and only then give it its final name; prune old revisions. Runs on the GPU host:
standard library only (the decisions live in plugins/module_utils/model_stage.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: model_stage
short_description: Stage a checkpoint revision on local disk, verified, before a server stops
description:
  - Copies the checkpoint named by C(source) into C(path).partial with rsync (resumable; rsync's
    own partial files stay in a hidden folder) or with huggingface_hub's snapshot_download (run
    by C(hf_python), the token in the environment), verifies every file's size and sha256
    against the checkpoint's manifest (SGLang's model_file_verifier format), writes a marker and
    renames the folder to C(path). A file that fails is deleted from the partial copy (the next
    run fetches it again) and the module fails naming it; C(path) is never touched then.
  - Before the first byte of the checkpoint, a disk-space pre-flight refuses with the numbers
    when what is left to copy plus C(free_margin_bytes) does not fit.
  - A revision already staged (our marker with the same source and revision, every file at its
    size) is neither copied nor hashed again (changed=false).
  - Prunes, under the parent of C(path), our staged revisions beyond the C(keep) newest, never
    one that C(path), a path in C(protect), a running process, a server's systemd drop-in or a
    last-known-good record under C(state_dir) refers to (compared by device and inode).
  - Every file operation stays inside the folders it owns (nothing inside is followed through
    a link); only regular files are hashed, each read bounded by the manifest's size.
version_added: "0.4.0"
author: sglang-fleet maintainers (@sglang-fleet)
options:
  path:
    description: Where the server loads the weights (its model_path), an absolute path.
    type: path
    required: true
  source:
    description:
      - Where the weights come from. C(rsync) (a path, or host:/path over SSH) or C(hf_repo);
        C(revision) names the pinned revision; C(manifest) the manifest's file name in the
        checkpoint (default C(manifest_name)).
    type: dict
    required: true
  manifest_name:
    description: Default manifest file name inside a checkpoint.
    type: str
    default: model.sha256.json
  free_margin_bytes:
    description: Bytes that must stay free on the target filesystem after the copy.
    type: int
    default: 0
  keep:
    description: Staged revisions to keep under the parent of C(path) (the in-use ones count).
    type: int
    default: 2
  protect:
    description: Paths never pruned (every server's model_path on this host).
    type: list
    elements: path
    default: []
  bwlimit_kbps:
    description: rsync's --bwlimit in KiB/s; 0 for none.
    type: int
    default: 0
  ssh_command:
    description: rsync's remote shell for a host:/path source (-e), for example ssh with a key.
    type: str
    default: ssh -o BatchMode=yes
  hf_python:
    description: A Python with huggingface_hub (the servers' venv) for C(hf_repo) sources.
    type: path
  hf_endpoint:
    description: The Hugging Face endpoint (an internal mirror); HF_ENDPOINT for the download.
    type: str
  hf_token:
    description: The Hugging Face token, handed to the download in its environment only.
    type: str
  verify_workers:
    description: Files hashed at once.
    type: int
    default: 4
  warm:
    description: Read every file once after staging (page cache); the load after the stop reads RAM.
    type: bool
    default: false
  progress_log:
    description: File that receives the copy's progress (rsync --info=progress2) for tail -f.
    type: path
  state_dir:
    description: The servers' state folder; the last-known-good records under it are kept.
    type: path
    default: /var/lib/sglang-fleet
  systemd_dir:
    description: Where the servers' drop-ins (sglang@NAME.service.d) are; what they load is kept.
    type: path
    default: /etc/systemd/system
  workdir:
    description: The servers' working directory (a relative path in their configuration).
    type: path
    default: /var/lib/sglang
"""

EXAMPLES = r"""
- name: Stage Llama rev-a from the shared storage host
  sglang_fleet.fleet.model_stage:
    path: /models/llama/rev-a
    source: {rsync: "storage-1:/srv/models/llama/rev-a", revision: rev-a}
    free_margin_bytes: "{{ 50 * 1024 ** 3 }}"
    bwlimit_kbps: 500000
"""

RETURN = r"""
state:
  description: What was found before the run (absent, staged, broken, other, foreign, partial).
  type: str
  returned: always
bytes:
  description: Bytes of the checkpoint (the manifest's sum).
  type: int
  returned: when the manifest was read
copy_seconds:
  description: Seconds the copy took (0 when nothing was copied).
  type: float
  returned: always
verify_seconds:
  description: Seconds the verification took.
  type: float
  returned: always
pruned:
  description: Staged revisions removed.
  type: list
  returned: always
prune_skipped:
  description: Why nothing was pruned (a record or drop-in that could not be read), or null.
  type: str
  returned: always
warm_seconds:
  description: Seconds reading the files into the page cache (null when not asked).
  type: float
  returned: always
"""

import json
import os
import stat
import subprocess
import time
from collections.abc import Callable
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.model_in_use import (
    InUse,
    Unreadable,
    configured_references,
    process_references,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.model_stage import (
    MARKER,
    PARTIAL_SUFFIX,
    StageError,
    free_bytes,
    marker_for,
    marker_sizes,
    present_bytes,
    prune_candidates,
    read_manifest,
    read_marker,
    remove_failed,
    space_refusal,
    staged_state,
    verify,
    warm_page_cache,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.model_stage_args import (
    ArgError,
    absolute_path,
    command,
    endpoint,
    file_name,
    model_path,
    number,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.model_stage_args import (
    source as checked_source,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.owned_folder import (
    OutsideFolder,
    OwnedFolder,
    open_log,
)

# Runs under hf_python: huggingface_hub is the servers' dependency, not the system Python's.
# The token and endpoint arrive in the environment (HF_TOKEN, HF_ENDPOINT), never in argv.
HF_SCRIPT = """
import sys
from huggingface_hub import hf_hub_download, snapshot_download
mode, repo, revision, local_dir, name = sys.argv[1:6]
if mode == "file":
    hf_hub_download(repo_id=repo, revision=revision, filename=name, local_dir=local_dir)
else:
    snapshot_download(repo_id=repo, revision=revision, local_dir=local_dir)
"""
# rsync's and the download's own leftovers in a partial copy, removed before it is promoted.
LEFTOVERS = (".rsync-partial", ".cache")

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def check_params(params: dict[str, Any]) -> dict[str, Any]:
    """The arguments checked with the control node's rules
    (plugins/module_utils/model_stage_args.py),
    before anything on the host is touched; ArgError names the argument."""
    checked = dict(params)
    checked["path"] = model_path(params["path"], "path")
    checked["source"] = checked_source(params["source"], "source")
    checked["manifest_name"] = file_name(params["manifest_name"], "manifest_name")
    for key in ("free_margin_bytes", "keep", "bwlimit_kbps", "verify_workers"):
        checked[key] = number(params[key], key, key)
    checked["ssh_command"] = command(params["ssh_command"], "ssh_command")
    # References, not paths we act on: any text a server's model_path holds keeps what it
    # resolves to (a NUL names nothing).
    checked["protect"] = [p for p in params["protect"] if "\0" not in p]
    for key in ("hf_python", "progress_log", "state_dir", "systemd_dir", "workdir"):
        if params.get(key):
            checked[key] = absolute_path(params[key], key)
    if params.get("hf_endpoint"):
        checked["hf_endpoint"] = endpoint(params["hf_endpoint"], "hf_endpoint")
    return checked


def source_text(source: dict[str, Any]) -> str:
    return f"hf:{source['hf_repo']}" if source.get("hf_repo") else str(source["rsync"])


def rsync_argv(params: dict[str, Any], src: str, dest: str) -> list[str]:
    argv = [
        "rsync",
        "--recursive",
        "--links",
        "--times",
        "--partial-dir=.rsync-partial",
        "--chmod=Du=rwx,go=rx,Fu=rw,go=r",
        "--info=progress2",
        "--protect-args",
        "-e",
        params["ssh_command"],
    ]
    if params["bwlimit_kbps"]:
        argv.append(f"--bwlimit={int(params['bwlimit_kbps'])}")
    return [*argv, "--", src, dest]


def fetch(params: dict[str, Any], partial: str, only: str | None, run: Runner) -> None:
    """Copy the manifest alone (only) or the whole checkpoint into the partial folder."""
    source = params["source"]
    env = dict(os.environ)
    if source.get("hf_repo"):
        if not params.get("hf_python"):
            raise StageError("an hf_repo source needs hf_python (a Python with huggingface_hub)")
        argv = [
            params["hf_python"],
            "-c",
            HF_SCRIPT,
            "file" if only else "snapshot",
            source["hf_repo"],
            source["revision"],
            partial,
            only or "",
        ]
        env["HF_HUB_DISABLE_TELEMETRY"] = "1"
        if params.get("hf_endpoint"):
            env["HF_ENDPOINT"] = params["hf_endpoint"]
        if params.get("hf_token"):
            env["HF_TOKEN"] = params["hf_token"]
    else:
        base = str(source["rsync"]).rstrip("/")
        src, dest = (
            (f"{base}/{only}", os.path.join(partial, only)) if only else (base + "/", partial + "/")
        )
        argv = rsync_argv(params, src, dest)
    log = params.get("progress_log")
    try:
        out = open_log(log) if log else os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError) as exc:
        raise StageError(f"progress_log {log}: {exc}") from None
    try:
        done = run(argv, env=env, stdout=out, stderr=subprocess.PIPE, text=True, check=False)
    except OSError as exc:  # rsync or hf_python missing, not executable
        what = (
            "model_stage_hf_python"
            if source.get("hf_repo")
            else "that rsync is installed (model_stage_install_rsync)"
        )
        raise StageError(f"cannot run {argv[0]}: {exc.strerror or exc}; check {what}") from None
    finally:
        os.close(out)
    if done.returncode != 0:
        what = f"the manifest {only}" if only else "the checkpoint"
        raise StageError(
            f"copying {what} from {source_text(source)} failed (exit {done.returncode}): "
            + (done.stderr or "").strip()[-800:]
        )


def prune(params: dict[str, Any], parent: OwnedFolder) -> tuple[list[str], str | None]:
    """(the revisions removed, why nothing was pruned or None)."""
    configured, unreadable = configured_references(
        params["state_dir"], params["systemd_dir"], params["workdir"]
    )
    try:
        running = process_references()
    except Unreadable as err:
        unreadable += err.problems
    if unreadable:
        shown = "; ".join(unreadable[:5]) + (
            f"; and {len(unreadable) - 5} more" if len(unreadable) > 5 else ""
        )
        return [], f"nothing pruned: what these refer to is not known: {shown}"
    protect = [p if p.startswith("/") else os.path.join(params["workdir"], p)
               for p in params["protect"]]  # fmt: skip
    in_use = InUse([params["path"], *protect, *configured, *running])
    doomed = prune_candidates(parent, params["keep"], in_use)
    for name in doomed:
        parent.remove_entry(name)
        log = name + PARTIAL_SUFFIX + ".log"
        info = parent.lstat(log)
        if info is not None and stat.S_ISREG(info.st_mode):  # its progress log, if a file
            parent.remove_file(log)
    return [os.path.join(parent.path, name) for name in doomed], None


def copy_verify_promote(
    params: dict[str, Any], parent: OwnedFolder, name: str, result: dict[str, Any], run: Runner
) -> None:
    """Manifest first, disk-space pre-flight, copy into the partial folder, verify, rename."""
    source = params["source"]
    path = os.path.join(parent.path, name)
    partial_name = name + PARTIAL_SUFFIX
    partial = path + PARTIAL_SUFFIX
    manifest_name = source.get("manifest") or params["manifest_name"]
    parent.make_folder(partial_name)
    with parent.open_folder(partial_name) as folder:  # type: ignore[union-attr]
        fetch(params, partial, manifest_name, run)
        manifest, digest = read_manifest(folder, manifest_name)
        result["bytes"] = total = sum(e.size for e in manifest.values())
        present = present_bytes(folder, manifest)
        margin = params["free_margin_bytes"]
        refusal = space_refusal(total, present, free_bytes(partial), margin, path)
        if refusal:
            raise StageError(refusal)
        started = time.monotonic()
        fetch(params, partial, None, run)
        result["copy_seconds"] = round(time.monotonic() - started, 2)
        started = time.monotonic()
        problems = verify(folder, manifest, True, params["verify_workers"])
        result["verify_seconds"] = round(time.monotonic() - started, 2)
        if problems:
            kept = remove_failed(folder, problems)
            removed = "the failed files were removed from" if not kept else "left in"
            raise StageError(
                f"{source_text(source)} revision {source['revision']} failed verification "
                f"against {manifest_name}; {path} was not touched; {removed} {partial} "
                "(a link, a folder or a device in the copy is left where it is): "
                + "; ".join(map(str, problems))
            )
        marker = marker_for(source_text(source), source["revision"], digest, manifest)
        marker["staged_at"] = time.time()
        for hidden in LEFTOVERS:
            folder.remove_entry(hidden)
        folder.write_file(MARKER, json.dumps(marker, sort_keys=True).encode())
    parent.rename(partial_name, name)


def stage(params: dict[str, Any], check_mode: bool, run: Runner = subprocess.run) -> dict[str, Any]:
    path = params["path"].rstrip("/")
    source = params["source"]
    parent_path, name = os.path.split(path)
    partial_name = name + PARTIAL_SUFFIX
    result: dict[str, Any] = {
        "changed": False,
        "state": "absent",
        "copy_seconds": 0.0,
        "verify_seconds": 0.0,
        "warm_seconds": None,
        "pruned": [],
        "prune_skipped": None,
    }
    if check_mode and not os.path.isdir(parent_path):
        result["changed"] = True
        return result
    os.makedirs(parent_path, mode=0o755, exist_ok=True)
    with OwnedFolder(parent_path) as parent:
        state = staged_state(parent, name, source_text(source), source["revision"])
        result.update(state=state, changed=state != "staged")
        if state == "foreign":
            raise StageError(
                f"{path} exists and was not staged by model_stage (no {MARKER}, or not a "
                "folder): left alone"
            )
        if state == "other":
            raise StageError(
                f"{path} holds another staged revision or source: give each revision its own "
                "model_path"
            )
        if check_mode:
            return result
        if state == "broken":  # resumed from what is left: rsync replaces what changed
            if parent.lstat(partial_name) is not None:
                parent.remove_entry(name)
            else:
                parent.rename(name, partial_name)
        if state != "staged":
            copy_verify_promote(params, parent, name, result, run)
        if params["warm"]:
            started = time.monotonic()
            with parent.open_folder(name) as folder:  # type: ignore[union-attr]
                warm_page_cache(folder, marker_sizes(read_marker(folder) or {}))
            result["warm_seconds"] = round(time.monotonic() - started, 2)
        result["pruned"], result["prune_skipped"] = prune(params, parent)
    result["changed"] = result["changed"] or bool(result["pruned"])
    return result


ARGUMENT_SPEC: dict[str, Any] = {
    "path": {"type": "path", "required": True},
    "source": {"type": "dict", "required": True},
    "manifest_name": {"type": "str", "default": "model.sha256.json"},
    "free_margin_bytes": {"type": "int", "default": 0},
    "keep": {"type": "int", "default": 2},
    "protect": {"type": "list", "elements": "path", "default": []},
    "bwlimit_kbps": {"type": "int", "default": 0},
    "ssh_command": {"type": "str", "default": "ssh -o BatchMode=yes"},
    "hf_python": {"type": "path"},
    "hf_endpoint": {"type": "str"},
    "hf_token": {"type": "str", "no_log": True},
    "verify_workers": {"type": "int", "default": 4},
    "warm": {"type": "bool", "default": False},
    "progress_log": {"type": "path"},
    "state_dir": {"type": "path", "default": "/var/lib/sglang-fleet"},
    "systemd_dir": {"type": "path", "default": "/etc/systemd/system"},
    "workdir": {"type": "path", "default": "/var/lib/sglang"},
}


def run_module(
    params: dict[str, Any], check_mode: bool, run: Runner = subprocess.run
) -> dict[str, Any]:
    """The module's whole run: a result, or {failed, msg} naming the input; never a traceback
    for anything a host or an argument can hold."""
    try:
        checked = check_params(params)
    except ArgError as err:
        return {"failed": True, "changed": False, "msg": f"model_stage: {err}"}
    try:
        return stage(checked, check_mode, run)
    except (StageError, OutsideFolder) as err:
        return {"failed": True, "changed": False, "msg": str(err)}
    except (OSError, ValueError) as err:
        return {"failed": True, "changed": False, "msg": f"staging {checked['path']}: {err}"}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    outcome = run_module(module.params, module.check_mode)
    if outcome.get("prune_skipped"):
        module.warn(outcome["prune_skipped"])
    if outcome.get("failed"):
        module.fail_json(**outcome)
    module.exit_json(**outcome)


if __name__ == "__main__":
    main()
