"""Action sglang_preflight: check every server of a host before anything on it changes.

One operator verb, sequenced on the controller through read-only modules on the host (as
`ansible.builtin.reboot` sequences its own): one read of everything it decides from
(sglang_host_state's `read`: GPUs, units, the SGLang interpreter and version, the service user,
port holders, model descriptions, calibration stores), then the flag check when needed; its
decisions in tested Python (sglang_fleet.servers.host_checks, sglang_fleet.rollout.preflight_inputs,
sglang_fleet.capacity.verdict):

1. the host's GPUs (a host whose servers all run on SGLang's CPU engine has none,
   docs/CPU-SERVERS.md);
2. the descriptions: cross-flag rules, GPU sets, ports and host RAM (servers/host_checks.py);
3. each flag set against the installed SGLang's own parser (sglang_flags_check), unless an
   earlier play of this run proved the same flag sets with the same interpreter (`proven`:
   an earlier result of this action); in check mode before provisioning there is no SGLang yet, and
   the real run checks them before anything stops;
4. what holds each server's port (the cleanup's ownership rules, docs/GPU-CLEANUP.md): another
   user's program on our port stops the rollout;
5. which servers run now, which running replicas their router does not list (`router_keys`:
   its key by server name, sent under no_log), and the installed SGLang's version;
6. each server's capacity plan from its model description and the host's calibrations
   (docs/CALIBRATION.md), and what the plan means: the line that says what bounds the server,
   a refusal on this host's calibration, a message that blocks.

Every problem found is named in one failure (`msg`, one line each), before anything stops.
Nothing here changes the host, in check mode or not: the reads run in check mode too. The
result, which the role registers as sglang_server_preflight (later steps and plays read it, a
later pre-flight takes it back as `proven`): problems, plans ({server: plan}), bounds
({server: line}), lines (what the role shows: bounds lines not shown yet in this run, and why
check mode could not check something), bounds_shown, gpus (nvidia-smi's list), gpu_count,
host_ram_mib (the inventory's, else the host's MemTotal), running (units), sglang_version,
lkg_records ({server: its last-known-good record as text, or null}), router_missing (running
replicas their router answered without listing: the rollout puts them back),
fingerprints ({server: its model's fingerprint}: what a calibration record is keyed by),
flags_key (what a passed flag check proved, else null), calibration_refused ({server: why this
host's calibration refuses its flag set}: the fleet summary's "refused (calibrated)") and steps
(each step also at -v). A failed pre-flight is registered too, so the refusal reaches the
summary.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import nullcontext, suppress
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.module_utils.bounded_json import loads as bounded_loads

    from sglang_fleet.ansible_values import plain
    from sglang_fleet.capacity import calibration_record
    from sglang_fleet.capacity.planner_inputs import PlanInputError
    from sglang_fleet.capacity.verdict import verdict
    from sglang_fleet.rollout import preflight_inputs as preflight
    from sglang_fleet.rollout.verb_action import VerbAction
    from sglang_fleet.server_secrets import public_record
    from sglang_fleet.servers import host_checks
    from sglang_fleet.servers.unit_files import records_and_routers
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
    VerbAction = ActionBase  # only run() is called, and it fails first
else:
    PACKAGE_ERROR = None

REQUIRED = ("servers", "python", "launch_module", "nvidia_smi")
OPTIONAL = (
    "host_ram_mib",
    "service_user",
    "plan",
    "workload",
    "calibration_mode",
    "warnings_fatal",
    "proven",
    "router_keys",
    "speculation_reset",
)
CALIBRATION_MODES = ("enforce", "warn", "ignore")
SPECULATION_RESET_MODES = ("warn", "refuse")


class Stop(Exception):
    """A read without which nothing else can be checked (the message says which)."""


class ActionModule(VerbAction):
    """Reads the host, checks every server, plans each, names every problem at once."""

    VERB = "sglang_preflight"
    _VALID_ARGS = frozenset((*REQUIRED, *OPTIONAL))

    def run(self, tmp: Any = None, task_vars: dict | None = None) -> dict:
        controller_package.require(PACKAGE_ERROR)
        result = super().run(tmp, task_vars)
        args = plain(dict(self._task.args))
        missing = [name for name in REQUIRED if args.get(name) in (None, "")]
        if missing:
            raise AnsibleActionFail(f"sglang_preflight: {', '.join(missing)} required")
        mode = args.get("calibration_mode") or "enforce"
        if mode not in CALIBRATION_MODES:
            raise AnsibleActionFail(
                f"sglang_server_calibration_mode must be one of {', '.join(CALIBRATION_MODES)}, "
                f"got {mode!r}"
            )
        reset = args.get("speculation_reset") or "warn"
        if reset not in SPECULATION_RESET_MODES:
            raise AnsibleActionFail(
                "sglang_server_speculation_reset must be one of "
                f"{', '.join(SPECULATION_RESET_MODES)}, got {reset!r}"
            )
        args["speculation_reset"] = reset
        for name in ("plan", "warnings_fatal"):
            if not isinstance(args.get(name, False), bool):
                raise AnsibleActionFail(
                    f"sglang_preflight: {name} must be true or false, got {args[name]!r}"
                )
        servers = args["servers"]
        if not isinstance(servers, list) or not all(isinstance(s, Mapping) for s in servers):
            raise AnsibleActionFail("sglang_preflight: servers must be sglang_server_servers")
        self.begin(task_vars)
        self._lines: list[str] = []
        try:
            found = self._check(servers, args, mode)
        except Stop as exc:
            result.update(failed=True, msg=str(exc), problems=[str(exc)], steps=self._steps)
            return result
        problems = found.pop("problems")
        shown = dict((args.get("proven") or {}).get("bounds_shown") or {})
        for name, line in found["bounds"].items():
            if shown.get(name) != line:
                self._lines.append(line)
        result.update(
            changed=False,
            problems=problems,
            lines=self._lines,
            bounds_shown={**shown, **found["bounds"]},
            steps=self._steps,
            **found,
        )
        if problems:
            result.update(failed=True, msg="\n".join(problems))
        else:
            result["msg"] = f"{len(servers)} server(s) checked: nothing blocks the rollout"
        return result

    # --- reads -----------------------------------------------------------------------------
    def _module(self, name: str, module_args: dict[str, Any]) -> dict[str, Any]:
        with self._reading():  # every module here only reads
            return super()._module(name, module_args)

    def _read(self, servers: list[dict], args: dict[str, Any], mode: str) -> dict[str, Any]:
        """Everything the checks decide from, in one read-only module run on the host
        (sglang_host_state's `read`, plugins/module_utils/host_read.py)."""
        gpu = any(server.get("device") != "cpu" for server in servers)
        user = str(args.get("service_user") or "")
        users = ["root"] + ([user] if user else [])
        read = {
            # A host whose servers all run on SGLang's CPU engine has no GPU and no nvidia-smi.
            "nvidia_smi": args["nvidia_smi"] if gpu else "",
            "python": args["python"],
            # The version comes with the flag check's answer (or the proof an earlier play
            # kept): not read a second time here.
            "version": False,
            "user": user,
            "ports": [
                {
                    "label": server["name"],
                    "ours": {
                        "units": [server["unit"]],
                        "process_titles": ["sglang::"],
                        "launch_modules": [args["launch_module"]],
                        "ports": [server["port"]],
                        "users": users,
                    },
                }
                for server in servers
            ],
            # The models, and the draft models of speculative servers (docs/SPECULATIVE.md).
            "models": sorted(
                {server["model_path"] for server in servers}
                | {path for server in servers if (path := preflight.draft_path(server))}
            ),
            # The calibration stores (unless ignored) and the last-known-good records.
            "files": (
                [server["paths"]["calibration_file"] for server in servers]
                if mode != "ignore"
                else []
            )
            + [_lkg_meta(server) for server in servers],
        }
        # Which replicas their router lists (its key by server name, under no_log).
        keys = dict(args.get("router_keys") or {})
        routers = records_and_routers(servers)["routers"]
        with self._quiet() if keys else nullcontext():
            done = self._module(
                "sglang_host_state",
                {
                    "units": [server["unit"] for server in servers],
                    "read": read,
                    "routers": routers,
                    "router_keys": {name: keys[name] for name in keys if keys[name]},
                },
            )
        if done.get("failed") or "read" not in done:
            raise Stop(f"the host could not be read: {done.get('msg')}")
        found = dict(done["read"])
        found["running"] = list(done.get("running") or [])
        # A running replica its router does not list is out of service (an interrupted rollout
        # took it out): the rollout puts it back. A router that does not answer is not judged
        # (the first deploy runs before playbooks/router.yml starts it).
        units = {server["name"]: server["unit"] for server in servers}
        found["router_missing"] = [
            name for name in done.get("router_missing") or [] if units.get(name) in found["running"]
        ]
        unlisted = ", ".join(found["router_missing"])
        self._step(
            f"read the host: running now {', '.join(found['running']) or 'none'}"
            + (f"; not listed by their router: {unlisted}" if unlisted else "")
        )
        return found

    # --- the checks --------------------------------------------------------------------------
    def _check(self, servers: list[dict], args: dict[str, Any], mode: str) -> dict[str, Any]:
        check_mode = bool(self._play_context.check_mode)
        found = self._read(servers, args, mode)
        gpus = self._gpus(servers, found)
        # The inventory's figure, else what the host's /proc/meminfo says (the memtotal_mb fact).
        if args.get("host_ram_mib") in (None, ""):
            args["host_ram_mib"] = found.get("mem_total_mib")
        if not args["host_ram_mib"]:
            raise Stop("the host's RAM could not be read: set sglang_server_host_ram_mib")
        host = {"gpu_count": gpus["gpu_count"], "ram_mib": args["host_ram_mib"]}
        invalid = [p["message"] for p in host_checks.host_errors(servers, host)]
        for server in servers:
            invalid += [p["message"] for p in host_checks.server_errors(server, host)]
        self._step(f"descriptions: {len(invalid)} problem(s)")
        problems = list(invalid)
        installed = bool(found.get("python_exists"))
        flags_key, version, flag_problems = self._flags(servers, args, installed, check_mode)
        problems += flag_problems
        problems += self._ports(servers, found)
        running = found["running"]
        self._step(f"installed SGLang: {version or 'unknown'}")
        plans: dict[str, Any] = {}
        self._fingerprints: dict[str, str] = {}
        bounds: dict[str, str] = {}
        refused: dict[str, str] = {}
        if args.get("plan", True) and not invalid:
            context = {"gpus": gpus["gpus"], "mode": mode, "version": version, "args": args,
                       "found": found}  # fmt: skip
            for server in servers:
                planned = self._plan(server, context, check_mode)
                if planned is None:
                    continue
                if isinstance(planned, str):
                    problems.append(planned)
                    continue
                name = server["name"]
                plans[name] = planned
                said = verdict(
                    planned,
                    name,
                    args.get("workload") or {},
                    warnings_fatal=bool(args.get("warnings_fatal")),
                )
                bounds[name] = said["bounds"]
                if said["refusal"]:
                    refused[name] = said["refusal"]
                if said["blocking"]:
                    problems.append(said["blocking"])
        files = found.get("files") or {}
        return {
            "problems": problems,
            # Each server's last-known-good record ({name: its text, or null}): what the restart
            # decision and the "would restart" lines compare with.
            # Secrets an older record holds are redacted: this result shows at -v.
            "lkg_records": {
                server["name"]: _shown_record(text)
                for server, text in ((s, files.get(_lkg_meta(s))) for s in servers)
            },
            "flags_key": flags_key,
            "sglang_version": version,
            "running": running,
            "router_missing": found["router_missing"],
            "gpus": gpus["gpus"],
            "gpu_count": gpus["gpu_count"],
            "host_ram_mib": args["host_ram_mib"],
            "plans": plans,
            "fingerprints": self._fingerprints,
            "bounds": bounds,
            "calibration_refused": refused,
        }

    def _gpus(self, servers: list[dict], found: dict[str, Any]) -> dict[str, Any]:
        if all(server.get("device") == "cpu" for server in servers):
            self._step("GPUs: none needed (every server runs on the CPU engine)")
            return {"gpu_count": 0, "gpus": []}
        read = found.get("gpus") or {}
        if "error" in read or not read:
            raise Stop(f"the host's GPUs could not be read: {read.get('error')}")
        self._step(f"GPUs: {read.get('gpu_count')}")
        return {"gpu_count": int(read.get("gpu_count") or 0), "gpus": read.get("gpus") or []}

    def _flags(
        self, servers: list[dict], args: dict[str, Any], installed: bool, check_mode: bool
    ) -> tuple[str | None, str | None, list[str]]:
        """(what this check proves, the version the check read, its problems)."""
        python, launch = args["python"], args["launch_module"]
        key = preflight.flags_key(python, launch, servers)
        proven = args.get("proven") or {}
        if installed and proven.get("flags_key") == key:
            self._step("flag sets: proven by an earlier play of this run")
            return key, proven.get("sglang_version"), []
        if not installed and check_mode:
            self._lines.append(
                f"{python} does not exist yet (check mode before provisioning): the flag sets "
                "are checked against the installed SGLang on the real run, before anything stops."
            )
            return None, None, []
        wanted = next((s.get("sglang_version") for s in servers if s.get("sglang_version")), None)
        if not installed:
            # Before sglang_flags_check would only say that the interpreter is missing.
            missing = (
                f"sglang_server_sglang_version {wanted or '(not set)'}: {python} does not "
                "exist, so that version is not installed on this host; run "
                "playbooks/provision.yml with ml_env_sglang_version set to it first "
                "(docs/UPGRADES.md)"
            )
            return None, None, [missing]
        problems: list[str] = []
        version = None
        for server in servers:
            done = self._module(
                "sglang_flags_check",
                {
                    "python": python,
                    "launch_module": launch,
                    "argv": list(server["flag_argv"]),
                    "variable_prefix": f"sglang_server_instances[{server['name']}].flags",
                },
            )
            version = done.get("sglang_version") or version
            if done.get("failed"):
                problems.append(str(done.get("msg")))
        self._step(f"flag sets checked by SGLang's parser: {len(problems)} refused")
        if wanted and version and version != wanted:
            problems.append(
                f"sglang_server_sglang_version is {wanted}, but {python} holds SGLang {version}"
            )
        return (key if installed and not problems else None), version, problems

    def _ports(self, servers: list[dict], found: dict[str, Any]) -> list[str]:
        problems = []
        holders = found.get("port_holders") or {}
        for server in servers:
            held = holders.get(server["name"])
            if not isinstance(held, list):
                problems.append(
                    f"sglang_server_instances[{server['name']}].port: what holds port "
                    f"{server['port']} could not be read: {(held or {}).get('error')}"
                )
                continue
            problem = preflight.foreign_port_problem(server, held)
            if problem:
                problems.append(problem)
        self._step(f"ports of {len(servers)} server(s): {len(problems)} held by others")
        return problems

    def _model_description(
        self, server: dict[str, Any], found: dict[str, Any], check_mode: bool
    ) -> tuple[Any, Any] | str | None:
        """(config.json text, weight bytes) of the server's model as read; a problem's
        message; None where check mode cannot plan yet."""
        name, model = server["name"], server["model_path"]
        read = (found.get("models") or {}).get(model) or {}
        config, weights = read.get("config"), read.get("weight_bytes")
        if read.get("error"):
            return f"sglang_server_instances[{name}].model_path: {model}: {read['error']}"
        if config is None:
            if check_mode:
                # A revision model_stage stages on the real run (docs/STAGING.md) is not there yet.
                self._lines.append(
                    f"{model}/config.json does not exist yet (check mode before the revision is "
                    f"staged): {name} is planned on the real run, after staging and before "
                    "anything stops."
                )
                return None
            return f"sglang_server_instances[{name}].model_path: {model}/config.json does not exist"
        if weights is None:
            return (
                f"sglang_server_instances[{name}].model_path: {model} has neither a "
                "model.safetensors.index.json with metadata.total_size nor *.safetensors"
            )
        return config, weights

    def _plan(
        self, server: dict[str, Any], context: dict[str, Any], check_mode: bool
    ) -> dict[str, Any] | str | None:
        """The server's plan; a problem's message; None where check mode cannot plan yet."""
        name = server["name"]
        found = context["found"]
        model = self._model_description(server, found, check_mode)
        if not isinstance(model, tuple):
            return model
        config, weights = model
        draft = self._draft(server, found)
        if isinstance(draft, str):
            return draft
        args = context["args"]
        stored = None
        if context["mode"] != "ignore":
            store = (found.get("files") or {}).get(server["paths"]["calibration_file"])
            if isinstance(store, dict):  # unreadable: planned as uncalibrated, and said
                self._lines.append(f"{name}: calibration store unreadable: {store.get('error')}")
                store = None
            stored = {
                "store": store or "",
                "mode": context["mode"],
                "sglang_version": context["version"],
            }
        try:
            planned = preflight.server_plan(
                server,
                config,
                weights,
                context["gpus"],
                args["host_ram_mib"],
                args.get("workload") or {},
                stored,
                draft=draft,
                speculation_reset=args["speculation_reset"],
            )
        except PlanInputError as exc:
            if exc.argument in (server.get("flags") or {}):
                # A flag of the server's (a draft SGLang cannot run, say): named as the inventory
                # names it.
                return f"sglang_server_instances[{name}].flags.{exc.argument}: {exc.message}"
            return f"sglang_server_instances[{name}]: cannot plan: {exc}"
        except ValueError as exc:
            return f"sglang_server_instances[{name}]: cannot plan: {exc}"
        # What the calibration of this start is keyed by (docs/CALIBRATION.md); the planner took
        # the same text, so nothing here can be wrong that it did not name.
        with suppress(ValueError):
            self._fingerprints[name] = calibration_record.model_fingerprint(
                bounded_loads(config, "config.json"), weights
            )
        self._step(f"planned {name}: {planned.get('max_total_num_tokens')} KV tokens")
        return json.loads(json.dumps(planned))

    @staticmethod
    def _draft(server: dict[str, Any], found: dict[str, Any]) -> dict[str, Any] | str | None:
        """The draft model's description as read ({config, weight_bytes}), None without one,
        or why it cannot be planned: a missing draft refuses the flag set, named."""
        path = preflight.draft_path(server)
        if path is None:
            return None
        read = (found.get("models") or {}).get(path) or {}
        where = f"sglang_server_instances[{server['name']}].flags.speculative_draft_model_path"
        if read.get("error"):
            return f"{where}: {path}: {read['error']}"
        if read.get("config") is None:
            return (
                f"{where}: {path}/config.json does not exist: the draft model is not on this "
                "host (SGLang would fail loading it after the old server stopped)"
            )
        if read.get("weight_bytes") is None:
            return (
                f"{where}: {path} has neither a model.safetensors.index.json with "
                "metadata.total_size nor *.safetensors"
            )
        return {"config": read["config"], "weight_bytes": read["weight_bytes"]}


def _lkg_meta(server: Mapping[str, Any]) -> str:
    return f"{server['paths']['lkg_dir']}/meta.json"


def _shown_record(text: Any) -> str | None:
    """A last-known-good record's text with every secret in it redacted, flags and other fields
    (sglang_fleet/server_secrets.py, public_record); None where there is none or it is not a JSON
    object."""
    if not isinstance(text, str):
        return None
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    return json.dumps(public_record(record, name_secret_flags=True), sort_keys=True)
