#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module model_stage: copy one checkpoint revision to local disk, verify it against its
manifest, and only then give it its final name; prune old revisions. Runs on the GPU host:
standard library only (the decisions live in module_utils/model_stage.py)."""

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
    C(path), a path in C(protect), or the --model-path of a running process.
version_added: "0.4.0"
author: sglang-fleet
options:
  path:
    description: Where the server loads the weights (its model_path): an absolute path.
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
"""

EXAMPLES = r"""
- name: Stage Llama rev-a from the shared storage host
  model_stage:
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
warm_seconds:
  description: Seconds reading the files into the page cache (null when not asked).
  type: float
  returned: always
"""

import json
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.model_stage import (
    MARKER,
    PARTIAL_SUFFIX,
    FileEntry,
    StageError,
    bad_files,
    free_bytes,
    manifest_digest,
    marker_for,
    model_paths_in_use,
    parse_manifest,
    present_bytes,
    prune_candidates,
    remove_tree,
    space_refusal,
    staged_state,
    verify,
    warm_page_cache,
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

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


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
    with open(log or os.devnull, "a", encoding="utf-8") as out:
        done = run(argv, env=env, stdout=out, stderr=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        what = f"the manifest {only}" if only else "the checkpoint"
        raise StageError(
            f"copying {what} from {source_text(source)} failed (exit {done.returncode}): "
            + (done.stderr or "").strip()[-800:]
        )


def read_manifest(partial: str, name: str) -> tuple[dict[str, FileEntry], str]:
    try:
        with open(os.path.join(partial, name), "rb") as handle:
            raw = handle.read()
        data = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise StageError(f"the manifest {name} cannot be read: {exc}") from exc
    return parse_manifest(data, f"manifest {name}"), manifest_digest(raw)


def prune(params: dict[str, Any]) -> list[str]:
    parent = os.path.dirname(params["path"].rstrip("/"))
    protected = [params["path"], *params["protect"], *model_paths_in_use()]
    doomed = prune_candidates(parent, params["keep"], protected)
    for path in doomed:
        remove_tree(path)
        if os.path.isfile(path + PARTIAL_SUFFIX + ".log"):
            os.remove(path + PARTIAL_SUFFIX + ".log")
    return doomed


def copy_verify_promote(
    params: dict[str, Any], path: str, name: str, result: dict[str, Any], run: Runner
) -> None:
    """Manifest first, disk-space pre-flight, copy into the partial folder, verify, rename."""
    source = params["source"]
    partial = path + PARTIAL_SUFFIX
    os.makedirs(partial, exist_ok=True)
    fetch(params, partial, name, run)
    manifest, digest = read_manifest(partial, name)
    result["bytes"] = total = sum(e.size for e in manifest.values())
    present = present_bytes(partial, manifest)
    margin = params["free_margin_bytes"]
    refusal = space_refusal(total, present, free_bytes(partial), margin, path)
    if refusal:
        raise StageError(refusal)
    started = time.monotonic()
    fetch(params, partial, None, run)
    result["copy_seconds"] = round(time.monotonic() - started, 2)
    started = time.monotonic()
    problems = verify(partial, manifest, True, params["verify_workers"])
    result["verify_seconds"] = round(time.monotonic() - started, 2)
    if problems:
        for bad in bad_files(problems):
            if os.path.isfile(os.path.join(partial, bad)):
                os.remove(os.path.join(partial, bad))
        raise StageError(
            f"{source_text(source)} revision {source['revision']} failed verification against "
            f"{name}; {path} was not touched and the failed files were removed from "
            f"{partial}: " + "; ".join(problems)
        )
    marker = marker_for(source_text(source), source["revision"], digest, manifest)
    marker["staged_at"] = time.time()
    for hidden in (".rsync-partial", ".cache"):
        if os.path.isdir(os.path.join(partial, hidden)):
            remove_tree(os.path.join(partial, hidden))
    with open(os.path.join(partial, MARKER), "w", encoding="utf-8") as handle:
        json.dump(marker, handle, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(partial, path)


def stage(params: dict[str, Any], check_mode: bool, run: Runner = subprocess.run) -> dict[str, Any]:
    path = params["path"].rstrip("/")
    source = params["source"]
    partial = path + PARTIAL_SUFFIX
    name = source.get("manifest") or params["manifest_name"]
    state = staged_state(path, source_text(source), source["revision"])
    result: dict[str, Any] = {
        "changed": state != "staged",
        "state": state,
        "copy_seconds": 0.0,
        "verify_seconds": 0.0,
        "warm_seconds": None,
        "pruned": [],
    }
    if state == "foreign":
        raise StageError(
            f"{path} exists and was not staged by model_stage (no {MARKER}): left alone"
        )
    if state == "other":
        raise StageError(
            f"{path} holds another staged revision or source: give each revision its own model_path"
        )
    if check_mode:
        return result
    if state == "broken":  # resumed from what is left: rsync replaces what changed
        if os.path.exists(partial):
            remove_tree(path)
        else:
            os.rename(path, partial)
    if state != "staged":
        copy_verify_promote(params, path, name, result, run)
    if params["warm"]:
        started = time.monotonic()
        warm_page_cache(path, read_marker_sizes(path))
        result["warm_seconds"] = round(time.monotonic() - started, 2)
    result["pruned"] = prune(params)
    result["changed"] = result["changed"] or bool(result["pruned"])
    return result


def read_marker_sizes(path: str) -> dict[str, int]:
    with open(os.path.join(path, MARKER), encoding="utf-8") as handle:
        return dict(json.load(handle).get("sizes") or {})


def main() -> None:
    module = AnsibleModule(
        argument_spec={
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
        },
        supports_check_mode=True,
    )
    params = module.params
    source = params["source"] or {}
    if (
        not os.path.isabs(params["path"])
        or not source.get("revision")
        or not (bool(source.get("rsync")) ^ bool(source.get("hf_repo")))
    ):
        module.fail_json(
            msg="path must be absolute; source needs a revision and exactly one of rsync, hf_repo"
        )
    try:
        module.exit_json(**stage(params, module.check_mode))
    except StageError as err:
        module.fail_json(msg=str(err))


if __name__ == "__main__":
    main()
