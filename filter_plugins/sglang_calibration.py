"""Ansible filters over sglang_fleet.calibration: record a start, keep the host's store.

    {{ journal_text | sglang_calibration_record(server_info, key) }}
    {{ journal_text | sglang_calibration_attempt(server_info, key) }}   {record, error}
    {{ store_text | sglang_calibration_store_update(record, path, server) }}
    {{ server_info | sglang_server_info_public }}      what a record reads; never the API key
    {{ config_json | sglang_model_fingerprint(index_json_or_weight_bytes) }}

Thin wrappers over the installed sglang_fleet package (calibration.py, tested there); docs/
CALIBRATION.md describes the record and the store. Slurped JSON text is accepted where a
mapping is expected.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from ansible.errors import AnsibleFilterError

from sglang_fleet import calibration
from sglang_fleet.modelcfg import ModelConfigError, weight_bytes_from_index


def _parsed(value: Any, what: str) -> Any:
    if isinstance(value, str | bytes):
        if not value.strip():
            return None
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise AnsibleFilterError(f"{what} is not valid JSON: {exc}") from exc
    return value


def _weight_bytes(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    try:
        return weight_bytes_from_index(_parsed(value, "weights") or {})
    except ModelConfigError as exc:
        raise AnsibleFilterError(f"sglang_model_fingerprint: {exc}") from exc


def sglang_calibration_record(
    log_text: str | None, server_info: Any = None, key: dict | None = None
) -> dict:
    """calibration.build_record(); a start without the memory figures fails the task."""
    try:
        return calibration.build_record(
            log_text or "", _parsed(server_info, "server_info"), dict(key or {})
        )
    except calibration.CalibrationError as exc:
        raise AnsibleFilterError(f"sglang_calibration_record: {exc}") from exc


def sglang_calibration_attempt(
    log_text: str | None, server_info: Any = None, key: dict | None = None
) -> dict[str, Any]:
    """{record, error}: a start whose log and /server_info lack the memory figures is no
    calibration (error says why), not a failed start."""
    try:
        record = calibration.build_record(
            log_text or "", _parsed(server_info, "server_info"), dict(key or {})
        )
    except calibration.CalibrationError as exc:
        return {"record": None, "error": str(exc)}
    return {"record": record, "error": None}


def sglang_server_info_public(server_info: Any) -> dict[str, Any] | None:
    """calibration.public_server_info(): /server_info without the arguments a record does not
    read (the API key among them)."""
    return calibration.public_server_info(_parsed(server_info, "server_info"))


def sglang_calibration_store_update(
    store: Any, record: dict, path: str = "calibration.json", server: str = "?"
) -> dict[str, Any]:
    """What the record step of a healthy start writes (docs/CALIBRATION.md, "The store"):

    {store: the store with `record` first, to write to `path`;
     set_aside: the side file's content (calibration.dump_set_aside), or None;
     set_aside_path: where it goes, beside the store;
     warning: which entries were set aside and why (naming the file and the server), or None}.

    Entries of the file on the host that no plan may use are moved to the side file, the good
    ones kept: the step never fails the start, and never drops what it cannot read unseen."""
    read = calibration.read_store(store if store not in (None, "") else None)
    problems = [] if not read.set_aside else [read.problems()]
    try:
        records = calibration.add_record(read.records, record)
    except calibration.CalibrationError as exc:
        records = read.records
        problems.append(f"this start's record is not kept: {exc}")
    set_aside, side_path = None, None
    if read.set_aside:
        stamp = calibration.timestamp().replace("-", "").replace(":", "")
        folder, name = posixpath.split(path)
        side_path = posixpath.join(folder, f"{posixpath.splitext(name)[0]}.set-aside-{stamp}.json")
        set_aside = calibration.dump_set_aside(read, path)
    warning = None
    if problems:
        moved = f"; set aside in {side_path}" if side_path else ""
        warning = (
            f"{path} (calibrations of server {server}): {' | '.join(problems)}{moved}; "
            f"{len(records)} record(s) kept"
        )
    return {
        "store": calibration.dump_store(records),
        "set_aside": set_aside,
        "set_aside_path": side_path,
        "warning": warning,
    }


def sglang_model_fingerprint(model_config: Any, weights: Any) -> str:
    """The checkpoint identity a record and the planner compare (config.json + bytes)."""
    config = _parsed(model_config, "model_config")
    if not isinstance(config, dict):
        raise AnsibleFilterError("sglang_model_fingerprint: model_config must be a mapping")
    return calibration.model_fingerprint(config, _weight_bytes(weights))


class FilterModule:
    """Ansible's entry point for filter plugins."""

    def filters(self) -> dict[str, Any]:
        return {
            "sglang_calibration_record": sglang_calibration_record,
            "sglang_calibration_attempt": sglang_calibration_attempt,
            "sglang_server_info_public": sglang_server_info_public,
            "sglang_calibration_store_update": sglang_calibration_store_update,
            "sglang_model_fingerprint": sglang_model_fingerprint,
        }
