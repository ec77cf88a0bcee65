"""The restart verb's decisions, in Python (plugins/action/sglang_restart.py).

- cleanup_settings: the operator's gpu_cleanup_* settings (docs/GPU-CLEANUP.md) typed and
  range-checked before anything stops, each refusal naming its variable and what is allowed;
  what the restart sets itself (the GPUs, units, ports, owners of the server) is not taken
  from them;
- cleanup_args: the gpu_cleanup module's arguments for one server's restart;
- holder_lines: what the cleanup found on the GPUs, one line per process and what was done;
- downtime: stop to a passed health gate, on the host's clock;
- failed_nodes: which nodes of a server across hosts did not pass this restart (read from what
  each node registered), so that no node records a configuration another node failed with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_fleet.module_utils import typed_number
from sglang_fleet.module_utils.typed_number import Range

# The settings an operator may give (gpu_cleanup_<name>), with their types; the module's own
# defaults hold for the ones not given.
SETTINGS: dict[str, type] = {
    "nvidia_smi": str,
    "device_glob": str,
    "ignore_names": list,
    "process_titles": list,
    "allow_kill_foreign": bool,
    "term_timeout": float,
    "clear_timeout": float,
    "poll_interval": float,
    "max_used_mib": int,
    "reset_stuck_gpus": bool,
}
# Set by the restart from the server (its GPUs, unit, port, owners): an inventory value of these
# belongs to the `clean` entry point (playbooks/gpu_cleanup.yml), not to a restart.
PER_SERVER = frozenset(
    {"gpus", "units", "ports", "owner_users", "launch_modules", "accelerator", "state"}
)
# The numbers' ranges: a wait is above 0 s and at most a day (a longer one is a typo, and a
# cleanup that waits longer holds the rollout lock that long); MiB up to 1 PiB.
_DAY_S = 86_400
NUMBERS: dict[str, Range] = {
    "term_timeout": Range(0, _DAY_S, low_open=True),
    "clear_timeout": Range(0, _DAY_S, low_open=True),
    "poll_interval": Range(0, _DAY_S, low_open=True),
    "max_used_mib": Range(0, 1 << 30, integer=True),
}
TRUE_WORDS = {"true": True, "yes": True, "on": True, "1": True}
FALSE_WORDS = {"false": False, "no": False, "off": False, "0": False}


class SettingsError(ValueError):
    """A gpu_cleanup_* setting that cannot be used (the message names it)."""


def _typed(name: str, value: Any, kind: type) -> Any:
    variable = f"gpu_cleanup_{name}"
    if kind is bool:
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return TRUE_WORDS.get(word, False)
        raise SettingsError(f"{variable} must be true or false, got {value!r}")
    if kind is list:
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return list(value)
        raise SettingsError(f"{variable} must be a list of names, got {value!r}")
    if kind is str:
        if isinstance(value, str) and value and "\n" not in value and "\0" not in value:
            return value
        raise SettingsError(f"{variable} must be one line of text, got {value!r}")
    try:
        return typed_number.read(value, variable, NUMBERS[name])
    except typed_number.NumberError as exc:
        raise SettingsError(str(exc)) from None


def cleanup_settings(given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The operator's gpu_cleanup_* settings ({name without the prefix: value}), typed."""
    settings: dict[str, Any] = {}
    for name, value in (given or {}).items():
        if name in PER_SERVER or value is None:
            continue
        if name not in SETTINGS:
            allowed = ", ".join(f"gpu_cleanup_{n}" for n in sorted(SETTINGS))
            raise SettingsError(f"gpu_cleanup_{name} is not a cleanup setting; allowed: {allowed}")
        settings[name] = _typed(name, value, SETTINGS[name])
    if "device_glob" in settings and not settings["device_glob"].startswith("/"):
        raise SettingsError(
            f"gpu_cleanup_device_glob must be an absolute path, got {settings['device_glob']!r}"
        )
    return settings


def cleanup_args(
    server: Mapping[str, Any], settings: Mapping[str, Any], launch_module: str, users: list[str]
) -> dict[str, Any]:
    """The gpu_cleanup module's arguments (state clean) before one server starts: its GPUs
    (none on SGLang's CPU engine, docs/CPU-SERVERS.md), its unit and port mark what is ours."""
    cpu = server.get("device") == "cpu"
    args = {key: value for key, value in settings.items() if key != "process_titles"}
    return {
        **args,
        "state": "clean",
        "accelerator": "cpu" if cpu else "gpu",
        "gpus": [] if cpu else [int(gpu) for gpu in server.get("gpus") or []],
        "ours": {
            "units": [server["unit"]],
            "process_titles": list(settings.get("process_titles") or ["sglang::"]),
            "launch_modules": [launch_module],
            "ports": [int(server["port"])],
            "users": list(users),
        },
    }


def holder_lines(processes: list[Mapping[str, Any]]) -> list[str]:
    """One line per process the cleanup found: its GPUs, pid, user, memory, command, whether it
    is ours and what was done (kill, keep: not on a needed GPU, block: foreign, ignore)."""
    lines = []
    for proc in processes:
        gpus = "any" if proc.get("any_gpu") else ",".join(str(g) for g in proc.get("gpus") or [])
        used = "-" if proc.get("used_mib") is None else proc.get("used_mib")
        command = str(proc.get("cmdline") or "")
        command = command if len(command) <= 60 else command[:57] + "..."
        owner = "ours" if proc.get("ours") else "foreign"
        lines.append(
            f"GPU {gpus}: pid {proc.get('pid')} ({proc.get('user')}, {used} MiB) {command} "
            f"[{owner}, {proc.get('action')}]"
        )
    return lines


def downtime(before_stop: str, healthy_at: str) -> dict[str, Any]:
    """{was_running, downtime_seconds} from the host's `date +%s.%N` and `systemctl is-active`
    before the stop ("<clock>\\n<state>") and its clock at the passed health gate; a clock that
    does not read as a number gives downtime_seconds None (not measured), never an error: the
    server is healthy by then, and a figure must not roll it back."""
    words = before_stop.split()
    stopped_at = typed_number.finite_or_none(words[0] if words else None)
    healthy = typed_number.finite_or_none(healthy_at.strip())
    seconds = None if stopped_at is None or healthy is None else round(healthy - stopped_at, 1)
    return {"was_running": len(words) > 1 and words[1] == "active", "downtime_seconds": seconds}


# What each node of a server across hosts registers in roll_out_server.yml: its restart (every
# node) and its smoke gate (node 0 alone; docs/MULTINODE.md).
RESTART_RESULT = "sglang_server_restarted"
GATE_RESULT = "smoke_gate_run"


def failed_nodes(server: Mapping[str, Any], hostvars: Mapping[str, Any]) -> list[str]:
    """The nodes of `server` (its `nodes`, node 0 first) that did not pass this restart: a node
    whose restart of this server failed or is missing, and node 0 when its smoke gate failed.
    Every node runs roll_out_server.yml in lockstep (one include for all), so by the time one node
    records last-known-good, each node's results for this server are registered; a node that
    failed is in the rollback already, and the others must follow it there."""
    failed = []
    for rank, node in enumerate(server.get("nodes") or []):
        facts = hostvars.get(node) or {}
        restarted = facts.get(RESTART_RESULT)
        passed = (
            isinstance(restarted, Mapping)
            and restarted.get("server") == server["name"]
            and not restarted.get("failed")
        )
        if passed and rank == 0:
            gate = facts.get(GATE_RESULT)
            passed = not (isinstance(gate, Mapping) and gate.get("failed"))
        if not passed:
            failed.append(str(node))
    return failed
