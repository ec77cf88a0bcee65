"""Action sglang_calibrate: keep what one healthy start of a server measured (docs/CALIBRATION.md).

One operator verb, sequenced on the controller through modules on the host, as
`ansible.builtin.reboot` sequences its own:

1. one read on the host (library/sglang_start_facts.py, under no_log): the start-up memory
   lines of this start (the unit's current invocation in the journal), never `server_args=`,
   which lists every argument, an API key among them; `/server_info` with the server's API key
   in a header, of which only the fields a record reads leave the host
   (calibration.SERVER_INFO_FIELDS and rank 0's memory_usage); and the server's store;
3. the key's other parts from the host: the installed SGLang's version (importlib.metadata in
   the server's python), the server's own GPUs (nvidia_gpu_info; a CPU server's device is the
   host's RAM) and the model's fingerprint (config.json and the index's total_size, or the
   single checkpoint's size); `known` ({sglang_version, gpus, fingerprints: {server: ...}}:
   what this play's pre-flight read) spares those reads;
4. the record (calibration.build_record: a start whose figures are missing, or moved past the
   noise, records nothing and says why);
5. the host's store: this record first, entries no plan may use moved to a side file beside it
   (calibration.store_update), both written in one run of library/sglang_state_files.py.

Calibration never fails a healthy start: what cannot be read ends the step with
`record: null` and the reason. The result: record, msg (what was measured, or why nothing
was), store, set_aside_path, steps (what each step did), changed (the store or a side file
was written); the role registers it as sglang_server_calibration (a registered result, not a fact:
a fact would sit under set_fact's values of the same name). Check mode: nothing is started
in check mode, so nothing is measured; the action is skipped.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleActionFail
from sglang_fleet.module_utils.bounded_json import loads as bounded_loads

from sglang_fleet.capacity import calibration
from sglang_fleet.capacity.model_config import ModelConfigError, weight_bytes_from_index
from sglang_fleet.rollout.verb_action import VerbAction
from sglang_fleet.servers.describe import server_gpus

# The journal lines a record reads (calibration.build_record's start-up lines).
MEMORY_LINES = (
    r"load weight (begin|end)\.|kv cache is allocated|memory pool end|graph end\.|"
    r"max_total_num_tokens=|kv cache va upper bound|post-capture kv sizing"
)
SERVER_KEYS = ("name", "unit", "port", "device", "model_path", "paths", "flags", "config_hash")
REQUIRED = ("server", "python", "nvidia_smi")
# Only the text a record reads comes back from the host: a start-up has a few dozen such lines.
MAX_JOURNAL_LINES = 2000
# Rank 0's memory figures in /server_info (calibration.public_server_info keeps them).
MEMORY_USAGE_PATH = "internal_states.0.memory_usage"


class NoCalibration(Exception):
    """This start gives no calibration record (the message says why)."""


class ActionModule(VerbAction):
    """Reads one start's figures from the host, builds its record, keeps it in the store."""

    VERB = "sglang_calibrate"
    _VALID_ARGS = frozenset((*REQUIRED, "flags", "config_hash", "host_ram_mib", "api_key", "known"))

    def run(self, tmp: Any = None, task_vars: dict | None = None) -> dict:
        result = super().run(tmp, task_vars)
        args = self.task_args(REQUIRED, SERVER_KEYS)
        server = args["server"]
        if self._play_context.check_mode:
            result.update(skipped=True, msg="check mode: no server was started, nothing measured")
            return result
        self.begin(task_vars)
        name = server["name"]
        try:
            record = self._record(server, args)
        except NoCalibration as exc:
            reason = f"{name}: no calibration recorded: {exc}"
            self._step(reason)
            result.update(
                changed=False,
                record=None,
                msg=reason,
                steps=self._steps,
            )
            return result
        changed, warning, side_path = self._keep(server, record)
        measured = record["measured"]
        msg = (
            f"{name} calibrated: {measured['max_total_num_tokens']} KV tokens, "
            f"{measured['free_after_graph_gib']} GiB free after CUDA graph capture at "
            f"mem_fraction_static {record['key']['mem_fraction_static']} "
            f"({record['key']['kv_cache_dtype']} KV, from {' and '.join(record['sources'])})"
        )
        if warning:
            result["warnings"] = [f"{self._vars.get('inventory_hostname', '?')}: {warning}"]
        result.update(
            changed=changed,
            record=record,
            msg=msg,
            store=server["paths"]["calibration_file"],
            set_aside_path=side_path,
            steps=self._steps,
        )
        return result

    # --- steps ---------------------------------------------------------------------------
    def _record(self, server: Mapping[str, Any], args: Mapping[str, Any]) -> dict[str, Any]:
        lines, info = self._read_start(server, str(args.get("api_key") or ""))
        # What this play's pre-flight read already (its version, GPUs and the model's
        # fingerprint) is not read again.
        known = args.get("known") or {}
        fingerprints = known.get("fingerprints") or {}
        version = known.get("sglang_version") or self._version(args["python"])
        key = {
            "server": server["name"],
            "config_hash": args.get("config_hash") or server["config_hash"],
            "model_path": server["model_path"],
            "model_fingerprint": fingerprints.get(server["name"])
            or self._fingerprint(server["model_path"]),
            **self._device(server, args, known.get("gpus")),
            "sglang_version": version or (info or {}).get("version"),
            "flags": dict(args.get("flags") or server["flags"]),
        }
        try:
            record = calibration.build_record(lines, info, key)
        except calibration.CalibrationError as exc:
            raise NoCalibration(str(exc)) from None
        self._step(f"built the record from {' and '.join(record['sources'])}")
        return record

    def _read_start(self, server: Mapping[str, Any], api_key: str) -> tuple[str, Any]:
        """This start's memory lines and /server_info, and the store, in one module run on the
        host (library/sglang_start_facts.py); the key goes in under no_log and only the parts
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
                    "server_info_paths": [*calibration.SERVER_INFO_FIELDS, MEMORY_USAGE_PATH],
                    "folder": folder,
                    "store_name": os.path.basename(store_path),
                },
            )
        if done.get("failed"):
            raise NoCalibration(
                f"this start of {server['unit']} could not be read: {done.get('msg')}"
            )
        self._store_text = done.get("store")
        lines = str(done.get("lines") or "")
        self._step(f"read {len(lines.splitlines())} start-up memory line(s) of {server['unit']}")
        info = calibration.public_server_info(done.get("server_info"))
        if info is None:
            self._step(f"/server_info gave nothing ({done.get('server_info_error')})")
        else:
            self._step("read /server_info (only the fields a record uses are kept)")
        return lines, info

    def _version(self, python: str) -> str | None:
        code = "import importlib.metadata as m; print(m.version('sglang'))"
        done = self._module("ansible.legacy.command", {"argv": [python, "-c", code]})
        version = str(done.get("stdout") or "").strip() if done.get("rc") == 0 else None
        self._step(f"installed SGLang: {version or 'unknown'}")
        return version or None

    def _device(
        self, server: Mapping[str, Any], args: Mapping[str, Any], gpus: Any = None
    ) -> dict[str, Any]:
        """gpu_name and gpu_memory_mib of the key: the server's own GPUs (the smallest
        memory; nvidia_gpu_info unless the pre-flight's read is given), or for a CPU server the
        host's RAM (docs/CPU-SERVERS.md)."""
        if server.get("device") == "cpu":
            ram = int(float(args.get("host_ram_mib") or 0))
            if ram <= 0:
                raise NoCalibration("a CPU server's record needs host_ram_mib")
            return {"gpu_name": "cpu", "gpu_memory_mib": ram}
        if not gpus:
            info = self._module("nvidia_gpu_info", {"nvidia_smi": args["nvidia_smi"]})
            gpus = info.get("gpus") or []
            if info.get("failed") or not gpus:
                raise NoCalibration(f"the host's GPUs could not be read: {info.get('msg')}")
        own = server_gpus(server, gpus)
        self._step(f"GPUs {', '.join(str(g.get('index')) for g in own)}: {own[0].get('name')}")
        return {
            "gpu_name": own[0].get("name"),
            "gpu_memory_mib": min(g.get("memory_total_mib") for g in own),
        }

    def _slurp(self, path: str) -> str | None:
        done = self._module("ansible.legacy.slurp", {"src": path})
        if done.get("failed") or "content" not in done:
            return None
        return base64.b64decode(done["content"]).decode("utf-8", errors="replace")

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
                weights = sum(int(f.get("size") or 0) for f in found.get("files") or [])
        except (ValueError, ModelConfigError) as exc:
            raise NoCalibration(f"the model description of {model_path}: {exc}") from None
        if not isinstance(config, dict):
            raise NoCalibration(f"{model_path}/config.json is not a mapping")
        self._step(f"model fingerprint of {model_path}")
        return calibration.model_fingerprint(config, weights)

    # --- the store -------------------------------------------------------------------------
    def _keep(self, server: Mapping[str, Any], record: dict) -> tuple[bool, str | None, Any]:
        """The record first in the store, and what no plan may use set aside beside it, in one
        module run on the host (library/sglang_state_files.py, inside the server's folder)."""
        paths = server["paths"]
        folder, store_path = str(paths["state_dir"]), str(paths["calibration_file"])
        store = self._store_text  # read with this start's lines (_read_start)
        update = calibration.store_update(store, record, store_path, server["name"])
        files = [_state_file(folder, store_path, update["store"], "0644")]
        if update["set_aside"] is not None:
            files.append(_state_file(folder, update["set_aside_path"], update["set_aside"], "0600"))
        done = self._module("sglang_state_files", {"folder": folder, "files": files})
        if done.get("failed"):
            raise AnsibleActionFail(f"sglang_calibrate: writing in {folder}: {done.get('msg')}")
        if update["set_aside"] is not None:
            self._step(f"set aside what no plan may use in {update['set_aside_path']}")
        records = len(update["store"]["records"])
        self._step(f"kept the record first of {records} in {store_path}")
        return bool(done.get("changed")), update["warning"], update["set_aside_path"]


def _state_file(folder: str, path: str, data: Any, mode: str) -> dict[str, str]:
    """One file for sglang_state_files: JSON text, named inside the server's folder."""
    if os.path.dirname(path) != folder:
        raise AnsibleActionFail(f"sglang_calibrate: {path} is not inside {folder}")
    text = json.dumps(data, indent=4, sort_keys=True) + "\n"
    return {"name": os.path.basename(path), "content": text, "mode": mode}
