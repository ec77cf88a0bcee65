"""Where a server's weights come from (`model_source`) and the copies a host needs
(docs/STAGING.md). Checked on the control node, before any host is touched.

A server's `model_source` is one of:

    model_source: {rsync: "storage-1:/srv/models/llama/rev-a", revision: rev-a}
    model_source: {rsync: /mnt/shared/models/llama/rev-a, revision: rev-a}
    model_source: {hf_repo: org/llama, revision: <40-hex commit>}

with an optional `manifest` (the manifest's file name in the checkpoint). The weights are copied
to the server's `model_path` (local disk), the path SGLang loads; a host copies each model_path
once, however many of its servers load it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

SERVERS_VAR = "sglang_server_instances"
SOURCE_KEYS = ("rsync", "hf_repo", "revision", "manifest")
# [user@]host:/path over SSH, or an absolute path (shared storage mounted on the host).
RSYNC_REMOTE_RE = re.compile(r"(?:[A-Za-z0-9._-]+@)?[A-Za-z0-9][A-Za-z0-9.-]*:(/.*)")
HF_REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# A pinned Hugging Face revision is a commit: a branch or tag could move under a rollout.
HF_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MANIFEST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class StageConfigError(ValueError):
    """A model_source is wrong; `variable` names the inventory path to fix."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable
        self.message = message


def _text(value: Any, variable: str) -> str:
    if not isinstance(value, str) or not value:
        raise StageConfigError(variable, "must be a non-empty string")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise StageConfigError(variable, "holds a control character")
    return value


def _check_rsync(value: Any, variable: str) -> str:
    text = _text(value, variable)
    remote = RSYNC_REMOTE_RE.fullmatch(text)
    path = remote.group(1) if remote else text
    if not path.startswith("/") or "/../" in path + "/" or text.startswith("-"):
        raise StageConfigError(
            variable,
            f"{text!r} is not an absolute path or [user@]host:/absolute/path (no '..')",
        )
    return text.rstrip("/") or "/"


def check_model_source(value: Any, where: str, model_path: str) -> dict[str, str] | None:
    """The server's model_source, checked; None when it has none (its model_path is used as is)."""
    if value is None:
        return None
    variable = f"{where}.model_source"
    if not isinstance(value, Mapping):
        raise StageConfigError(variable, "must be a mapping: {rsync|hf_repo, revision, manifest?}")
    unknown = sorted(str(k) for k in value if k not in SOURCE_KEYS)
    if unknown:
        raise StageConfigError(
            f"{variable}.{unknown[0]}", f"unknown key; allowed: {', '.join(SOURCE_KEYS)}"
        )
    if bool(value.get("rsync")) == bool(value.get("hf_repo")):
        raise StageConfigError(variable, "needs one of rsync (a path or host:/path), hf_repo")
    if not model_path.startswith("/"):
        raise StageConfigError(
            f"{where}.model_path", f"{model_path!r}: a staged model_path must be an absolute path"
        )
    revision = _text(value.get("revision"), f"{variable}.revision")
    source: dict[str, str] = {"revision": revision}
    if value.get("hf_repo"):
        repo = _text(value["hf_repo"], f"{variable}.hf_repo")
        if not HF_REPO_RE.fullmatch(repo):
            raise StageConfigError(f"{variable}.hf_repo", f"{repo!r} is not an org/name repo id")
        if not HF_COMMIT_RE.fullmatch(revision):
            raise StageConfigError(
                f"{variable}.revision",
                f"{revision!r}: pin a Hugging Face source to a commit (40 hex digits); a branch "
                "or tag can move between two hosts' copies",
            )
        source["hf_repo"] = repo
    else:
        source["rsync"] = _check_rsync(value["rsync"], f"{variable}.rsync")
        if not REVISION_RE.fullmatch(revision):
            raise StageConfigError(
                f"{variable}.revision", f"{revision!r}: letters, digits, '.', '_' and '-' only"
            )
    if value.get("manifest") is not None:
        manifest = _text(value["manifest"], f"{variable}.manifest")
        if not MANIFEST_RE.fullmatch(manifest):
            raise StageConfigError(
                f"{variable}.manifest", f"{manifest!r}: a file name in the checkpoint's folder"
            )
        source["manifest"] = manifest
    return source


def stage_plan(servers: Any) -> list[dict[str, Any]]:
    """The copies one host makes: one per model_path with a model_source, with the servers that
    load it. Servers that share a model_path must name the same source."""
    if servers is None:
        return []
    if not isinstance(servers, list):
        raise StageConfigError(SERVERS_VAR, "must be a list of server descriptions")
    plan: dict[str, dict[str, Any]] = {}
    for index, server in enumerate(servers):
        if not isinstance(server, Mapping):
            raise StageConfigError(f"{SERVERS_VAR}[{index}]", "must be a mapping")
        name = str(server.get("name", index))
        where = f"{SERVERS_VAR}[{name}]"
        model_path = server.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise StageConfigError(f"{where}.model_path", "must be a non-empty string")
        source = check_model_source(server.get("model_source"), where, model_path)
        if source is None:
            continue
        path = model_path.rstrip("/")
        entry = plan.setdefault(path, {"path": path, "source": source, "servers": []})
        if entry["source"] != source:
            raise StageConfigError(
                f"{where}.model_source",
                f"model_path {path} is also loaded by {', '.join(entry['servers'])} with another "
                "model_source: one path holds one revision",
            )
        entry["servers"].append(name)
    return [plan[path] for path in sorted(plan)]


def protected_paths(servers: Any) -> list[str]:
    """Every model_path of the host's servers: pruning never removes one."""
    return sorted(
        {
            str(s["model_path"]).rstrip("/")
            for s in servers or []
            if isinstance(s, Mapping) and isinstance(s.get("model_path"), str)
        }
    )


SUMMARY_KEYS = (
    "changed",
    "state",
    "bytes",
    "copy_seconds",
    "verify_seconds",
    "warm_seconds",
    "pruned",
)


def stage_summary(results: Any) -> dict[str, dict[str, Any]]:
    """{model_path: what its copy did} from the staging task's loop results (the module's
    return values, read back by the fleet summary: copy time apart from downtime)."""
    summary: dict[str, dict[str, Any]] = {}
    for result in results or []:
        if not isinstance(result, Mapping) or not isinstance(result.get("item"), Mapping):
            continue
        path = str(result["item"].get("path"))
        summary[path] = {key: result.get(key) for key in SUMMARY_KEYS}
    return summary
