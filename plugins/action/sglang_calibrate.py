"""Action sglang_calibrate: keep what one healthy start of a server measured (docs/CALIBRATION.md).

One operator verb, sequenced on the controller through modules on the host, as
`ansible.builtin.reboot` sequences its own:

1. one read on the host (plugins/modules/sglang_start_facts.py, under no_log): the start-up memory
   lines of this start (the unit's current invocation in the journal), never `server_args=`,
   which lists every argument, an API key among them; `/server_info` with the server's API key
   in a header, of which only the fields a record reads leave the host
   (calibration_record.SERVER_INFO_FIELDS and rank 0's memory_usage); and the server's store;
3. the key's other parts from the host: the installed SGLang's version (importlib.metadata in
   the server's python), the server's own GPUs (nvidia_gpu_info; a CPU server's device is the
   host's RAM) and the model's fingerprint (config.json and the index's total_size, or the
   single checkpoint's size); `known` ({sglang_version, gpus, fingerprints: {server: ...}}:
   what this play's pre-flight read) spares those reads;
4. the record (calibration_record.build_record: a start whose figures are missing, or moved past the
   noise, records nothing and says why);
5. the host's store: this record first, entries no plan may use moved to a side file beside it
   (calibration_store.store_update), both written in one run of
   plugins/modules/sglang_state_files.py.

Calibration never fails a healthy start, by construction: the step runs inside the block whose
rescue restores last-known-good, so any failure of reading or recording the start (any
Exception, foreseen or not) ends it with `record: null`, the reason in msg and a warning.
The result: record, msg (what was measured, or why nothing was), store, set_aside_path, steps
(what each step did), changed (the store or a side file was written); the role registers it
as sglang_server_calibration (a registered result, not a fact: a fact would sit under
set_fact's values of the same name). Check mode: nothing is started in check mode, so nothing
is measured; the action is skipped.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.module_utils.bounded_json import loads as bounded_loads
    from sglang_fleet.module_utils.typed_number import NumberError, Range, shown
    from sglang_fleet.module_utils.typed_number import read as read_number

    from sglang_fleet.capacity import (
        calibration,
        calibration_record,
        calibration_rule,
        calibration_store,
    )
    from sglang_fleet.capacity.model_config import ModelConfigError, weight_bytes_from_index
    from sglang_fleet.rollout.verb_action import VerbAction
    from sglang_fleet.servers.describe import server_gpus
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
    VerbAction = ActionBase  # only run() is called, and it fails first
else:
    PACKAGE_ERROR = None

# The journal lines a record reads (calibration_record.build_record's start-up lines).
MEMORY_LINES = (
    r"load weight (begin|end)\.|kv cache is allocated|memory pool end|graph end\.|"
    r"max_total_num_tokens=|kv cache va upper bound|post-capture kv sizing"
)
SERVER_KEYS = ("name", "unit", "port", "device", "model_path", "paths", "flags", "config_hash")
REQUIRED = ("server", "python", "nvidia_smi")
# Only the text a record reads comes back from the host: a start-up has a few dozen such lines.
MAX_JOURNAL_LINES = 2000
# Rank 0's memory figures in /server_info (calibration_record.public_server_info keeps them).
MEMORY_USAGE_PATH = "internal_states.0.memory_usage"
# At most the module's own bound on what it returns: MAX_JOURNAL_LINES lines of at most 4096
# characters (plugins/modules/sglang_start_facts.py MAX_LINE_CHARS).
MAX_LINES_CHARS = MAX_JOURNAL_LINES * 4097
# A version as importlib.metadata prints it, a fingerprint as calibration_record.model_fingerprint
# writes it: one short line.
MAX_VERSION_CHARS = 64
MAX_FINGERPRINT = 128


class NoCalibration(Exception):
    """This start gives no calibration record (the message says why)."""


class ActionModule(VerbAction):
    """Reads one start's figures from the host, builds its record, keeps it in the store."""

    VERB = "sglang_calibrate"
    _VALID_ARGS = frozenset((*REQUIRED, "flags", "config_hash", "host_ram_mib", "api_key", "known"))

    def run(self, tmp: Any = None, task_vars: dict | None = None) -> dict:
        controller_package.require(PACKAGE_ERROR)
        result = super().run(tmp, task_vars)
        args = self.task_args(REQUIRED, SERVER_KEYS)
        server = args["server"]
        if self._play_context.check_mode:
            result.update(skipped=True, msg="check mode: no server was started, nothing measured")
            return result
        self.begin(task_vars)
        self._store_text: Any = None
        api_key = args.get("api_key")
        self._secrets = (api_key,) if isinstance(api_key, str) and api_key else ()
        name = _said(server["name"], 100)
        # This step runs inside the block whose rescue restores last-known-good: whatever goes
        # wrong reading or recording a start (any exception, not only the ones foreseen) is
        # this start's missing calibration, a warning with the reason, never a failed task
        # that would roll back a healthy server.
        try:
            return self._calibrate(server, args, result)
        except Exception as exc:  # by design: see above
            reason = self._clean(f"{name}: no calibration recorded: {_reason(exc)}")
        self._step(reason)
        result.update(changed=False, record=None, msg=reason, steps=self._steps)
        result["warnings"] = [f"{self._vars.get('inventory_hostname', '?')}: {reason}"]
        return result

    def _calibrate(self, server: Mapping[str, Any], args: Mapping[str, Any], result: dict) -> dict:
        changed, update = self._keep(server, self._record(server, args))
        record, warning = update["record"], update["warning"]
        if warning:
            result["warnings"] = [f"{self._vars.get('inventory_hostname', '?')}: {warning}"]
        result.update(
            changed=changed,
            store=server["paths"]["calibration_file"],
            set_aside_path=update["set_aside_path"],
            steps=self._steps,
        )
        if record is None:  # refused by the store's rule (the warning says why)
            reason = self._clean(f"{server['name']}: no calibration recorded: {warning}")
            result.update(record=None, msg=reason)
            return result
        measured, key = record["measured"], record["key"]
        msg = (
            f"{server['name']} calibrated: {measured['max_total_num_tokens']} KV tokens, "
            f"{measured['free_after_graph_gib']} GiB free after CUDA graph capture at "
            f"mem_fraction_static {key['mem_fraction_static']} "
            f"({key['kv_cache_dtype']} KV, from {' and '.join(record['sources'])})"
        )
        result.update(record=record, msg=msg)
        return result

    def _clean(self, text: str) -> str:
        """text without the server's key (a reason quotes what failed, never the key)."""
        for secret in self._secrets:
            text = text.replace(secret, "<redacted>")
        return text

    # --- steps ---------------------------------------------------------------------------
    def _record(self, server: Mapping[str, Any], args: Mapping[str, Any]) -> dict[str, Any]:
        lines, info = self._read_start(server, str(args.get("api_key") or ""))
        # What this play's pre-flight read already (its version, GPUs and the model's
        # fingerprint) is not read again; what it holds that is not of that shape is read.
        known = _mapping(args.get("known"))
        fingerprints = _mapping(known.get("fingerprints"))
        version = _version_text(known.get("sglang_version")) or self._version(args["python"])
        flags = args.get("flags") or server["flags"]
        if not isinstance(flags, Mapping):
            raise NoCalibration(f"the flag set that started must be a mapping, got {shown(flags)}")
        key = {
            "server": server["name"],
            "config_hash": args.get("config_hash") or server["config_hash"],
            "model_path": server["model_path"],
            "model_fingerprint": _version_text(fingerprints.get(server["name"]), MAX_FINGERPRINT)
            or self._fingerprint(server["model_path"]),
            **self._device(server, args, known.get("gpus")),
            "sglang_version": version or _version_text((info or {}).get("version")),
            "flags": dict(flags),
        }
        try:
            record = calibration_record.build_record(lines, info, key)
        except calibration.CalibrationError as exc:
            raise NoCalibration(str(exc)) from None
        self._step(f"built the record from {' and '.join(record['sources'])}")
        return record

    def _read_start(self, server: Mapping[str, Any], api_key: str) -> tuple[str, Any]:
        """This start's memory lines and /server_info, and the store, in one module run on the
        host (plugins/modules/sglang_start_facts.py); the key goes in under no_log and only the
        parts
        of /server_info a record uses come back."""
        paths = server["paths"]
        folder, store_path = str(paths["state_dir"]), str(paths["calibration_file"])
        if os.path.dirname(store_path) != folder:
            raise AnsibleActionFail(f"sglang_calibrate: {store_path} is not inside {folder}")
        with self._quiet():
            done = self._module(
                "sglang_start_facts",
                {
                    "unit": server["unit"],
                    "port": int(server["port"]),
                    "api_key": api_key,
                    "line_pattern": MEMORY_LINES,
                    "max_lines": MAX_JOURNAL_LINES,
                    "server_info_paths": [
                        *calibration_record.SERVER_INFO_FIELDS,
                        MEMORY_USAGE_PATH,
                    ],
                    "folder": folder,
                    "store_name": os.path.basename(store_path),
                },
            )
        if done.get("failed"):
            raise NoCalibration(
                f"this start of {server['unit']} could not be read: {_said(done.get('msg'))}"
            )
        store = done.get("store")
        if store is not None and not isinstance(store, str):
            raise NoCalibration(f"the store came back as {shown(store)}, not text")
        self._store_text = store
        lines = done.get("lines")
        if not isinstance(lines, str):
            self._step(f"the journal's lines came back as {shown(lines)}, not text")
            lines = ""
        lines = lines[:MAX_LINES_CHARS]
        count = lines.count("\n") + bool(lines)
        self._step(f"read {count} start-up memory line(s) of {server['unit']}")
        info = calibration_record.public_server_info(done.get("server_info"))
        if info is None:
            self._step(f"/server_info gave nothing ({_said(done.get('server_info_error'))})")
        else:
            self._step("read /server_info (only the fields a record uses are kept)")
        return lines, info

    def _version(self, python: str) -> str | None:
        code = "import importlib.metadata as m; print(m.version('sglang'))"
        done = self._module("ansible.legacy.command", {"argv": [python, "-c", code]})
        version = _version_text(done.get("stdout")) if done.get("rc") == 0 else None
        self._step(f"installed SGLang: {version or 'unknown'}")
        return version

    def _device(
        self, server: Mapping[str, Any], args: Mapping[str, Any], gpus: Any = None
    ) -> dict[str, Any]:
        """gpu_name and gpu_memory_mib of the key: the server's own GPUs (the smallest
        memory; nvidia_gpu_info unless the pre-flight's read is given), or for a CPU server the
        host's RAM (docs/CPU-SERVERS.md). Every figure is typed (typed_number): one that is
        not a number in range is a reason, never an exception."""
        try:
            if server.get("device") == "cpu":
                ram = read_number(
                    args.get("host_ram_mib"), "host_ram_mib", calibration_rule.DEVICE_MIB
                )
                return {"gpu_name": "cpu", "gpu_memory_mib": ram}
            if not _gpu_list(gpus):
                info = self._module("nvidia_gpu_info", {"nvidia_smi": args["nvidia_smi"]})
                gpus = info.get("gpus")
                if info.get("failed") or not _gpu_list(gpus):
                    why = _said(info.get("msg")) if info.get("failed") else shown(gpus)
                    raise NoCalibration(f"the host's GPUs could not be read: {why}")
            own = server_gpus(server, gpus)
            name = own[0].get("name")
            if not isinstance(name, str) or not name or len(name) > calibration_rule.MAX_NAME_CHARS:
                raise NoCalibration(f"the GPU's name is {shown(name)}, not a name")
            memory = min(
                read_number(
                    g.get("memory_total_mib"), "memory_total_mib", calibration_rule.DEVICE_MIB
                )
                for g in own
            )
        except NumberError as exc:
            raise NoCalibration(f"the device's memory: {exc}") from None
        self._step(f"GPUs {', '.join(shown(g.get('index')) for g in own)}: {name}")
        return {"gpu_name": name, "gpu_memory_mib": memory}

    def _slurp(self, path: str) -> str | None:
        done = self._module("ansible.legacy.slurp", {"src": path})
        content = done.get("content")
        if done.get("failed") or not isinstance(content, str):
            return None
        try:
            return base64.b64decode(content, validate=True).decode("utf-8", errors="replace")
        except ValueError:  # binascii.Error: no base64
            return None

    def _fingerprint(self, model_path: str) -> str:
        config_text = self._slurp(f"{model_path}/config.json")
        if config_text is None:
            raise NoCalibration(f"{model_path}/config.json could not be read")
        index_text = self._slurp(f"{model_path}/model.safetensors.index.json")
        try:
            config = bounded_loads(config_text, f"{model_path}/config.json")
            if index_text is not None:
                index = bounded_loads(index_text, f"{model_path}/model.safetensors.index.json")
                weights = weight_bytes_from_index(index)
            else:  # a single-file checkpoint (small models): its size stands in
                found = self._module(
                    "ansible.legacy.find", {"paths": model_path, "patterns": "*.safetensors"}
                )
                files = found.get("files") or []
                if not isinstance(files, list) or not all(isinstance(f, Mapping) for f in files):
                    raise NoCalibration(
                        f"the checkpoint files of {model_path} came back as {shown(files)}"
                    )
                weights = sum(
                    read_number(
                        f.get("size") or 0, "a checkpoint file's size", Range(0, integer=True)
                    )
                    for f in files
                )
            if not isinstance(config, dict):
                raise NoCalibration(f"{model_path}/config.json is not a mapping")
            fingerprint = calibration_record.model_fingerprint(config, weights)
        except (ValueError, ModelConfigError) as exc:
            raise NoCalibration(f"the model description of {model_path}: {_said(exc)}") from None
        self._step(f"model fingerprint of {model_path}")
        return fingerprint

    # --- the store -------------------------------------------------------------------------
    def _keep(self, server: Mapping[str, Any], record: dict) -> tuple[bool, dict[str, Any]]:
        """The record first in the store, and what no plan may use set aside beside it, in one
        module run on the host (plugins/modules/sglang_state_files.py, inside the server's folder).
        Every record kept is cleaned of secrets on the way (calibration_store.store_update)."""
        paths = server["paths"]
        folder, store_path = str(paths["state_dir"]), str(paths["calibration_file"])
        store = self._store_text  # read with this start's lines (_read_start)
        update = calibration_store.store_update(
            store, record, store_path, server["name"], secrets=self._secrets
        )
        files = [_state_file(folder, store_path, update["store"], "0644")]
        if update["set_aside"] is not None:
            files.append(_state_file(folder, update["set_aside_path"], update["set_aside"], "0600"))
        done = self._module("sglang_state_files", {"folder": folder, "files": files})
        if done.get("failed"):
            raise NoCalibration(f"writing in {folder}: {_said(done.get('msg'))}")
        if update["set_aside"] is not None:
            self._step(f"set aside what no plan may use in {update['set_aside_path']}")
        records = len(update["store"]["records"])
        if update["record"] is not None:
            self._step(f"kept the record first of {records} in {store_path}")
        return bool(done.get("changed")), update


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _gpu_list(gpus: Any) -> bool:
    """Whether gpus is nvidia_gpu_info's list: GPUs, each a mapping."""
    return isinstance(gpus, list) and bool(gpus) and all(isinstance(g, Mapping) for g in gpus)


def _version_text(value: Any, limit: int = MAX_VERSION_CHARS) -> str | None:
    """A version (or a fingerprint) as the host printed it: one short line, else nothing."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    return text if text and len(text) <= limit and "\n" not in text else None


def _said(value: Any, limit: int = 300) -> str:
    """A module's message or an exception as a reason: text, bounded (the str() of an
    exception that carries a huge integer can itself raise)."""
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:  # its text is the one thing it cannot give
        text = type(value).__name__
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _reason(exc: BaseException) -> str:
    """Why this start records nothing: the step's own reason, or an unforeseen failure named
    by its type and message."""
    if isinstance(exc, NoCalibration):
        return _said(exc)
    return f"the record step failed ({type(exc).__name__}: {_said(exc) or 'no message'})"


def _state_file(folder: str, path: str, data: Any, mode: str) -> dict[str, str]:
    """One file for sglang_state_files: JSON text (never NaN: the reader refuses it), named
    inside the server's folder."""
    if os.path.dirname(path) != folder:
        raise AnsibleActionFail(f"sglang_calibrate: {path} is not inside {folder}")
    text = json.dumps(data, indent=4, sort_keys=True, allow_nan=False) + "\n"
    return {"name": os.path.basename(path), "content": text, "mode": mode}
