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

from collections.abc import Mapping
from typing import Any

from sglang_fleet.module_utils import model_stage_args as checks

SERVERS_VAR = "sglang_server_instances"
SOURCE_KEYS = checks.SOURCE_KEYS
# What the model_stage role's settings may hold (its variable for each module argument).
SETTINGS = {
    "model_stage_free_margin_gb": None,
    "model_stage_keep": "keep",
    "model_stage_bwlimit_kbps": "bwlimit_kbps",
    "model_stage_verify_workers": "verify_workers",
    "model_stage_timeout": "timeout",
    "model_stage_poll": "poll",
}


class StageConfigError(ValueError):
    """A model_source is wrong; `variable` names the inventory path to fix."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable
        self.message = message


def check_model_source(value: Any, where: str, model_path: str) -> dict[str, str] | None:
    """The server's model_source, checked; None when it has none (its model_path is used as is).
    The rules are plugins/module_utils/model_stage_args.py's, which the module applies again on the
    host."""
    if value is None:
        return None
    try:
        source = checks.source(value, f"{where}.model_source")
        checks.model_path(model_path, f"{where}.model_path")
    except checks.ArgError as exc:
        raise StageConfigError(exc.variable, exc.message) from None
    return source


def check_settings(settings: Any) -> dict[str, Any]:
    """The model_stage role's settings, checked on the control node before any host is
    touched: numbers in range (a negative bandwidth limit never reaches rsync), the manifest's
    file name, the ssh command, the Hugging Face interpreter and endpoint. Returns them typed."""
    if not isinstance(settings, Mapping):
        raise StageConfigError("model_stage settings", "must be a mapping")
    out: dict[str, Any] = {}
    try:
        for variable, key in SETTINGS.items():
            if key is None:  # GiB, fractions allowed
                out[variable] = checks.gib(settings.get(variable), variable)
            else:
                out[variable] = checks.number(settings.get(variable), variable, key)
        out["model_stage_manifest_name"] = checks.file_name(
            settings.get("model_stage_manifest_name"), "model_stage_manifest_name"
        )
        out["model_stage_ssh_command"] = checks.command(
            settings.get("model_stage_ssh_command"), "model_stage_ssh_command"
        )
        for variable, check in (
            ("model_stage_hf_python", checks.absolute_path),
            ("model_stage_hf_endpoint", checks.endpoint),
        ):
            value = settings.get(variable)
            out[variable] = check(value, variable) if value not in (None, "") else ""
    except checks.ArgError as exc:
        raise StageConfigError(exc.variable, exc.message) from None
    return out


def host_copies(servers: Any) -> list[dict[str, Any]]:
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
