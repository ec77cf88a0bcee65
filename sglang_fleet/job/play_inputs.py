"""What playbooks/job.yml checks before it touches a host (roles/sglang_job, docs/JOB.md): the
sglang_job_* settings typed, the input read on the control node, and the job's record on its
host, against which a later start or resume with another input or other settings is refused.

Every refusal is a JobSettingError naming the variable and what is allowed; the role turns it
into the task's failure in its first play, which runs on the control node alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from sglang_fleet import server_secrets
from sglang_fleet.job import rows
from sglang_fleet.module_utils import typed_number
from sglang_fleet.module_utils.fleet_http import HttpError, check_url
from sglang_fleet.module_utils.typed_number import Range

ACTIONS = ("start", "status", "stop", "resume")
# A job's name is its unit's instance (sglang-job@NAME.service), its folder and its metrics
# label: one plain word, so that no systemd specifier, path or label escaping is involved.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
NAME_RULE = (
    "a plain word of letters, digits, '-' and '_' (at most 64, starting with a letter or digit)"
)
_FOLDER = re.compile(r"/[A-Za-z0-9._+@:/-]*")
_COMMAND = re.compile(r"[A-Za-z0-9._+/-]+")
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
# name==version or a name: what the role's probe can tell installed or not (idempotent pip runs).
_PACKAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:==[A-Za-z0-9.+!_-]+)?")
# The runner's own fields: --sampling cannot set them (sglang_fleet/job/command_line.py).
RESERVED_SAMPLING = ("model", "messages", "max_tokens", "stream")
# Characters per token of the estimate when the operator gives no input length: the usual rule
# of thumb for English text with a BPE tokenizer; said as an estimate wherever it is used.
CHARS_PER_TOKEN = 4
# Rows read for the length estimate, spread over the input (a 1.4 GB input is not read twice).
SAMPLED_ROWS = 2000

NUMBERS: dict[str, tuple[Range, bool]] = {  # (range, may be null)
    "sglang_job_concurrency": (Range(1, 1 << 16, integer=True), True),
    "sglang_job_max_tokens": (Range(1, 1 << 24, integer=True), False),
    "sglang_job_temperature": (Range(0, 100), True),
    "sglang_job_top_p": (Range(0, 1, low_open=True), True),
    "sglang_job_max_attempts": (Range(1, 1000, integer=True), False),
    "sglang_job_drain_seconds": (Range(0, 86400), False),
    "sglang_job_sync_every": (Range(1, 1 << 20, integer=True), False),
    "sglang_job_metrics_port": (Range(0, 65535, integer=True), False),
    "sglang_job_avg_input_len": (Range(1, 1 << 24, integer=True), True),
    "sglang_job_restart_sec": (Range(1, 3600, integer=True), False),
    "sglang_job_start_timeout": (Range(1, 86400, integer=True), False),
    "sglang_job_pip_timeout": (Range(1, 86400, integer=True), False),
}
FOLDERS = ("sglang_job_state_dir", "sglang_job_config_dir", "sglang_job_venv", "sglang_job_program")


class JobSettingError(ValueError):
    """A setting the job cannot run with; `variable` names it."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable} {message}")
        self.variable = variable


def _number(value: Any, variable: str, allowed: Range, nullable: bool) -> int | float | None:
    if nullable and value in (None, ""):
        return None
    try:
        found = typed_number.read(value, variable, allowed)
    except typed_number.NumberError as exc:
        raise JobSettingError(variable, exc.message.removeprefix(f"{variable} ")) from None
    return int(found) if allowed.integer or float(found).is_integer() else found


def _text(value: Any, variable: str, pattern: re.Pattern[str], rule: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        shown = repr(value)[:80] if isinstance(value, str | int | float) else type(value).__name__
        raise JobSettingError(variable, f"must be {rule}, got {shown}")
    return value


def _plain_text(value: Any, variable: str) -> str:
    """Text that reaches a command line or a label: printable, one line, not a flag."""
    if not isinstance(value, str) or not value.isprintable() or value.startswith("-"):
        raise JobSettingError(variable, "must be one line of printable text, not starting with '-'")
    return value


def _sampling(value: Any) -> dict[str, Any]:
    variable = "sglang_job_sampling"
    if not isinstance(value, Mapping):
        raise JobSettingError(variable, "must be a mapping of sampling fields (top_k: 20, ...)")
    reserved = sorted(set(value) & set(RESERVED_SAMPLING))
    if reserved:
        raise JobSettingError(
            variable, f"cannot set {', '.join(reserved)}: the job's own fields (sglang_job_model, "
            "sglang_job_max_tokens)",
        )  # fmt: skip
    found = server_secrets.secrets_in(dict(value))
    if found:
        where, why = found[0]
        raise JobSettingError(
            f"{variable}{where}", f"{why}: sampling fields reach the unit's command line"
        )
    return dict(sorted(value.items()))


def check_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The sglang_job_* settings typed, each refusal naming its variable (see the module
    docstring); the input is read separately (input_facts), and only for start."""
    if not isinstance(values, Mapping):
        raise JobSettingError("settings", "must be a mapping of sglang_job_* variables")
    out: dict[str, Any] = dict(values)
    action = values.get("sglang_job_action")
    if action not in ACTIONS:
        raise JobSettingError(
            "sglang_job_action", f"must be one of {', '.join(ACTIONS)}, got {action!r}"
        )
    out["sglang_job_name"] = _text(
        values.get("sglang_job_name"), "sglang_job_name", NAME, NAME_RULE
    )
    out.update(_numbers(values))
    out.update(_words(values))
    if "sglang_job_sampling" in values:
        out["sglang_job_sampling"] = _sampling(values["sglang_job_sampling"])
    if "sglang_job_metrics_address" in values:
        _address(values["sglang_job_metrics_address"], "sglang_job_metrics_address")
    _package_source(values)
    return out


def _numbers(values: Mapping[str, Any]) -> dict[str, Any]:
    out = {
        name: _number(values[name], name, allowed, nullable)
        for name, (allowed, nullable) in NUMBERS.items()
        if name in values
    }
    if 0 < out.get("sglang_job_metrics_port", 0) < 1024:
        raise JobSettingError(
            "sglang_job_metrics_port", "must be 0 (no metrics) or 1024-65535: the job has no "
            f"privilege to bind a lower port, got {out['sglang_job_metrics_port']}",
        )  # fmt: skip
    return out


def _words(values: Mapping[str, Any]) -> dict[str, Any]:
    """Folders, the interpreter, the user and group, the model: what reaches a command line, a
    unit or a label as one word."""
    out: dict[str, Any] = {}
    rule = "an absolute path of letters, digits and . _ + @ : / - (no spaces, no '..')"
    for name in (n for n in FOLDERS if n in values):
        folder = _text(values[name], name, _FOLDER, rule)
        if "/../" in f"{folder}/" or folder.rstrip("/") in ("", "/"):
            raise JobSettingError(name, f"must be {rule} below /, got {folder!r}")
        out[name] = folder.rstrip("/")
    if "sglang_job_python" in values:
        out["sglang_job_python"] = _text(
            values["sglang_job_python"], "sglang_job_python", _COMMAND, "a command name or path"
        )
    for name in ("sglang_job_user", "sglang_job_group"):
        if name in values:
            out[name] = _text(values[name], name, _USER, "a system user or group name")
    if values.get("sglang_job_model") not in (None, ""):
        out["sglang_job_model"] = _plain_text(values["sglang_job_model"], "sglang_job_model")
    return out


def _address(value: Any, variable: str) -> None:
    try:
        check_url(f"http://{value if ':' not in str(value) else f'[{value}]'}:1/", variable)
    except HttpError:
        raise JobSettingError(
            variable, f"must be a host name or an IP address, got {value!r}"
        ) from None


def _package_source(values: Mapping[str, Any]) -> None:
    wheelhouse, index = values.get("sglang_job_wheelhouse"), values.get("sglang_job_index_url")
    if wheelhouse and index:
        raise JobSettingError(
            "sglang_job_wheelhouse", "and sglang_job_index_url are both set: name one source"
        )
    if wheelhouse:
        _text(wheelhouse, "sglang_job_wheelhouse", _FOLDER, "an absolute folder on the job's host")
    if index:
        try:
            check_url(index, "sglang_job_index_url")
        except HttpError as exc:
            raise JobSettingError("sglang_job_index_url", str(exc)) from None
    packages = values.get("sglang_job_pip_packages", [])
    if not isinstance(packages, list) or not all(
        isinstance(p, str) and _PACKAGE.fullmatch(p) for p in packages
    ):
        raise JobSettingError(
            "sglang_job_pip_packages",
            "must be a list of pip requirements, name==version or a name "
            "(prometheus-client==0.26.0)",
        )


def key_problem(key: Any) -> str | None:
    """What keeps a key from being sent as one (never quoting it)."""
    if not isinstance(key, str):
        return f"must be text, got a {type(key).__name__}"
    if key != key.strip() or not key.isprintable() or not key.isascii() or " " in key:
        return "must be one word of printable ASCII (no spaces, line breaks or control characters)"
    return None


# --- the input, on the control node -----------------------------------------------------------
def input_facts(path: Any, max_tokens: int, avg_input_len: int | None = None) -> dict[str, Any]:
    """The input as the runner will see it: {path, size, sha256, rows, unusable, duplicates} and
    the job's lengths for the planner (avg_input_len: the operator's, else estimated from a
    sample of the rows at CHARS_PER_TOKEN; avg_output_len: max_tokens, the most a call asks).
    A missing input, a FIFO, a directory, a link out of its folder or an input with no usable
    row is refused, naming sglang_job_input."""
    variable = "sglang_job_input"
    if not isinstance(path, str) or not path:
        raise JobSettingError(
            variable, "must name the job's input on the control node (a JSON lines file)"
        )
    try:
        index = rows.scan(path)
    except (rows.InputError, OSError) as exc:
        raise JobSettingError(variable, str(exc).removeprefix("input ")) from None
    usable = [line for line in index.lines if line.skip is None]
    if not usable:
        raise JobSettingError(
            variable, f"{path}: none of its {len(index.lines)} lines is a row the job can send"
        )
    estimated = avg_input_len is None
    if estimated:
        avg_input_len = _estimated_input_len(index, usable)
    return {
        "path": path,
        "size": index.size,
        "sha256": index.sha256,
        "rows": len(index.lines),
        "unusable": len(index.lines) - len(usable),
        "duplicates": index.duplicates,
        "avg_input_len": avg_input_len,
        "avg_input_len_estimated": estimated,
        "avg_output_len": int(max_tokens),
    }


def _estimated_input_len(index: rows.InputIndex, usable: list[rows.Line]) -> int:
    step = max(1, len(usable) // SAMPLED_ROWS)
    sample = usable[::step][:SAMPLED_ROWS]
    chars = [_prompt_chars(rows.read_row(index.path, line)) for line in sample]
    return max(1, math.ceil(sum(chars) / len(chars) / CHARS_PER_TOKEN))


def _prompt_chars(row: dict[str, Any]) -> int:
    """Characters of what a row's calls send and the server reads: the conversation's turns
    the runner keeps (its own assistant turns are regenerated, not sent), or a batch line's
    messages or prompt."""
    if "conversations" in row:
        return sum(len(t["content"]) for t in row["conversations"] if t["role"] != "assistant")
    body = row.get("body") or {}
    if isinstance(body.get("messages"), list):
        return sum(len(str(m.get("content", ""))) for m in body["messages"] if isinstance(m, dict))
    return len(str(body.get("prompt", "")))


# --- the job's record on its host ---------------------------------------------------------------
IDENTITY = ("input_sha256", "model", "max_tokens", "sampling")
IDENTITY_VARIABLES = {
    "input_sha256": "sglang_job_input",
    "model": "sglang_job_model",
    "max_tokens": "sglang_job_max_tokens",
    "sampling": "sglang_job_sampling (with sglang_job_temperature and sglang_job_top_p)",
}


def sampling(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Every sampling field a call carries: sglang_job_sampling with temperature and top_p."""
    found = dict(settings.get("sglang_job_sampling") or {})
    for name in ("temperature", "top_p"):
        value = settings.get(f"sglang_job_{name}")
        if value is not None:
            found[name] = value
    return dict(sorted(found.items()))


def record(settings: Mapping[str, Any], facts: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The job's record on its host (NAME/job.json): what it runs on, which a later start or
    resume must match (the runner's ledger holds the same and refuses too, later)."""
    return {
        "name": settings["sglang_job_name"],
        "input_sha256": facts["sha256"],
        "input_size": facts["size"],
        "input_rows": facts["rows"],
        "input_source": facts["path"],
        "model": model,
        "max_tokens": settings["sglang_job_max_tokens"],
        "sampling": sampling(settings),
        # What resume plans the servers for (the input is not read again).
        "avg_input_len": facts.get("avg_input_len"),
    }


def resumed_settings(settings: Mapping[str, Any], old: Any) -> dict[str, Any]:
    """resume: the settings with the job's own model, max_tokens and sampling from its record
    (a job asks alike for its whole life; the operator need not repeat them), everything else
    (targets, in-flight requests, retries, metrics) as this run gives it."""
    if not isinstance(old, Mapping) or not all(field in old for field in IDENTITY):
        raise JobSettingError(
            "sglang_job_name", f"{settings.get('sglang_job_name')}: the job's record is damaged or "
            "from another version: start it again (sglang_job_action=start) with its input",
        )  # fmt: skip
    return {
        **settings,
        "sglang_job_model": old["model"],
        "sglang_job_max_tokens": old["max_tokens"],
        "sglang_job_sampling": dict(old["sampling"]),
        "sglang_job_temperature": None,
        "sglang_job_top_p": None,
    }


def record_problem(old: Any, new: Mapping[str, Any], started: bool) -> str:
    """Why this start may not go on with the job's folder as it is ("" when it may): a job that
    has rows in its ledger keeps its input and settings; name a new job to change them."""
    if not started or not isinstance(old, Mapping):
        return ""
    for field in IDENTITY:
        if old.get(field) != new.get(field):
            was, now = old.get(field), new.get(field)
            if field == "input_sha256":
                was, now = f"sha256 {str(was)[:12]}...", f"sha256 {str(now)[:12]}..."
            return (
                f"{IDENTITY_VARIABLES[field]}: job {new['name']} has rows done with {was}, this "
                f"run asks for {now}: one job runs on one input with one set of settings, never "
                "mixed; name a new job (sglang_job_name) to run another"
            )
    return ""
