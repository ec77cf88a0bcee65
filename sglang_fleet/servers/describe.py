"""Resolve the inventory's server descriptions into what the role renders.

A server in `sglang_server_instances`::

    - name: kimi                      # becomes the unit instance sglang@kimi.service
      model_path: /shared/kimi-k2.5-int4
      served_model_name: kimi-k2.5    # optional
      port: 8000
      gpus: [0, 1, 2, 3, 4, 5, 6, 7]
      device: cuda                    # optional: cuda (default: sglang_server_device) or cpu
      profile: throughput             # optional: a key of sglang_server_profiles
      flags: {mem_fraction_static: 0.88}
      env: {NCCL_PROTO: LL}
      host: 127.0.0.1                 # optional: loopback unless the inventory opens it
      api_key: "{{ vault_kimi_api_key }}"   # optional secret: never in flags, argv or the result
                                      # (leave it out to serve without a key; '' is an error)
      admin_api_key: "{{ vault_kimi_admin_key }}"  # optional, like each secret flag of
                                      # server_secrets.SECRET_FLAGS: a field, never a flag
      router:                         # optional: a replica behind SGLang's router (docs/ROUTER.md)
        url: http://gateway-01:30000  # the router's API as this host reaches it
        worker_url: http://gpu-node-01:8000   # optional: this server as the router lists it;
                                      # default http://<inventory_hostname>:<port>

A CPU server (`device: cpu`, or sglang_server_device: cpu for the host; docs/CPU-SERVERS.md)
runs SGLang's CPU engine: it lists no `gpus`, may list the `cpus` its ranks are bound to, and
gets the engine's environment and flags from its device, not from a layer an operator must
remember: SGLANG_USE_CPU_ENGINE=1 (what makes SGLang's is_cpu() true), --device cpu, and
--attention-backend torch_native unless a layer sets a backend (SGLang's CPU default,
intel_amx, needs an sgl-kernel CPU build). With more than one rank per host,
SGLANG_CPU_OMP_THREADS_BIND comes from `cpus` (split evenly, one '|'-separated group per rank)
unless an env layer sets it. --max-total-tokens is checked by validate.py: on CPU SGLang sizes
the KV pool from free RAM.

Precedence (later wins; nested mappings such as json_model_override_args combine key by key; a
value of null removes the key set by an earlier layer):

    flags: sglang_server_defaults.flags  <  sglang_server_profiles[profile]
           <  sglang_server_instances[i].flags  <  sglang_server_overrides[name].flags
           <  sglang_server_tuned_flags[name]   (one run's flags: autotune's trials and winner)
    env:   sglang_server_defaults.env  <  sglang_server_instances[i].env
           <  sglang_server_overrides[name].env

Example: defaults.flags {log_level: info, mem_fraction_static: 0.85}, profile `throughput`
{mem_fraction_static: 0.90, kv_cache_dtype: fp8_e4m3}, server flags {mem_fraction_static: 0.88},
host_vars override {kv_cache_dtype: null} give {log_level: info, mem_fraction_static: 0.88} plus
the fields the role manages: model_path, port, host, served_model_name and tp_size (default: the
GPU count x nnodes / pp_size, divided by dp_size unless DP attention shares the TP group).

Flag keys may use dashes (mem-fraction-static); they are stored in ServerArgs spelling (underscores)
so layers that spell a key differently still override each other. The description stays
independent of the host that runs it: nnodes/node_rank/dist_init_addr are ordinary flags.

What resolution refuses (ServerConfigError naming the variable), so that nothing is written
for an input the renderers or systemd would mangle:

- names, flag keys and environment names match their pattern as a whole string (a trailing
  newline is not "the end");
- model_path, served_model_name and host hold no control characters;
- flag values are strings, numbers, booleans, lists of those or JSON-like mappings; strings
  hold no NUL (no command line can carry one) and are valid UTF-8; numbers are finite and
  integers fit in 64 bits;
- environment values are strings or numbers without control characters other than TAB
  (an EnvironmentFile line cannot hold a newline, and systemd drops other control bytes);
- api_key and every other secret field (sglang_fleet.server_secrets.SECRET_FLAGS: each secret
  flag of SGLang is a field of the server, never a flag), when present, is a non-empty string of
  printable ASCII without surrounding spaces or a leading dash, at most MAX_API_KEY_CHARS long;
  messages about it never quote it. A flag or environment variable named like a secret is
  refused in every layer, and so is a secret inside a value, at any depth (a key named like a
  secret in a flag's mapping or its JSON text, a URL's user:password@; the error names the path
  to it): SGLang's --config cannot take one key of a JSON flag, so it has no safe place there
  (docs/ARCHITECTURE.md, "Secrets");
- router.url and router.worker_url are http(s)://host[:port] with no path and no trailing slash
  (sglang-router 0.3.2 compares worker URLs as written, docs/ROUTER.md), and worker_url names
  the server's own port. The router is no flag: it changes neither argv nor the config hash.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import unicodedata
import urllib.parse
from collections.abc import Mapping
from typing import Any

from sglang_fleet import server_secrets as _secrets
from sglang_fleet.capacity.planner_inputs import PLANNER_FLAGS
from sglang_fleet.module_utils.fleet_http import HttpError, check_url, redact_url
from sglang_fleet.servers import nodes as _nodes
from sglang_fleet.servers.launch_line import env_file_line, exec_start, normalize_key, to_argv
from sglang_fleet.servers.model_source import StageConfigError, check_model_source
from sglang_fleet.servers.router_settings import ROUTER_URL_RE, ROUTER_URL_RULE, url_port

SERVERS_VAR = "sglang_server_instances"
PROFILES_VAR = "sglang_server_profiles"
OVERRIDES_VAR = "sglang_server_overrides"
TUNED_VAR = "sglang_server_tuned_flags"
DEFAULTS_VAR = "sglang_server_defaults"

# Whole-string patterns, used with fullmatch: with match() and `$` a trailing newline passes.
NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,40}")
NAME_RULE = "1 to 41 lower-case letters, digits or '-', not starting with '-'"
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A visible ASCII character, or a space between two of them: what an HTTP header value carries
# unchanged (RFC 9110 field-value, minus tabs and non-ASCII, which clients encode differently).
API_KEY_RE = re.compile(r"[!-~]([ -~]*[!-~])?")
# HTTP servers cap a header line at 8 KiB or so; a longer key could not be sent at all.
MAX_API_KEY_CHARS = 4096
# Integers beyond this are no SGLang setting; C extensions would overflow on them.
MAX_FLAG_INT = 2**63 - 1
DEFAULT_HOST = "127.0.0.1"
SERVER_KEYS = (
    "name",
    "model_path",
    "served_model_name",
    "port",
    "gpus",
    "device",
    "cpus",
    "profile",
    "flags",
    "env",
    "host",
    *_secrets.SECRET_FLAGS,
    "router",
    # Where the weights come from, staged to model_path before a stop
    # (sglang_fleet/servers/model_source.py).
    "model_source",
    # One server across hosts (sglang_fleet/servers/nodes.py, docs/MULTINODE.md).
    "nodes",
    "dist_init_port",
    "interface",
)
ROUTER_KEYS = ("url", "worker_url")
# Addresses that mean "every interface": the host itself reaches such a server on loopback.
WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]", "[::]": "[::1]"}
# Flags the description sets from its own fields (or keeps secret): setting them in a flag layer
# would make two places disagree, so the error says which field to use instead.
MANAGED_FLAGS = {
    "model_path": "model_path",
    "port": "port",
    "host": "host",
    "served_model_name": "served_model_name",
    **{
        flag: f"the server's {flag} (a secret: it goes to a root-only config file, never to argv)"
        for flag in _secrets.SECRET_FLAGS
    },
    "config": "nothing (the role passes --config for the secrets file itself)",
    "device": "device (cuda or cpu; a CPU server gets the CPU engine's environment too)",
}
MANAGED_ENV = {"CUDA_VISIBLE_DEVICES": "gpus", "SGLANG_USE_CPU_ENGINE": "device"}
DEVICE_VAR = "sglang_server_device"
DEVICES = ("cuda", "cpu")
# SGLang's CPU engine (docs/CPU-SERVERS.md): the switch, and where each rank's OpenMP threads go.
CPU_ENGINE_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
CPU_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
# On CPUs without Intel AMX SGLang falls back to this anyway; with AMX its default (intel_amx)
# needs an sgl-kernel CPU build, which PyPI does not have.
CPU_ATTENTION_BACKEND = "torch_native"
OVERRIDE_KEYS = ("flags", "env")
# A flag or variable named like a secret in a flag or env layer (sglang_fleet/server_secrets.py).
_SECRET_NAME_RULE = (
    "is named like a secret, which never goes in flags or env (they reach argv, the unit's "
    "files and the printed description): give SGLang's secret flags as the server's own "
    f"fields ({', '.join(_secrets.SECRET_FLAGS)}), which go to a root-only config file; "
    "a hub token belongs to weight staging (model_stage_hf_token)"
)
# A secret inside a value (server_secrets.secrets_in(): a key named like a secret at any depth,
# JSON text included, or a credential in a URL): why it has no safe place there, and where it goes.
_NESTED_SECRET_RULE = (
    "{what} reaches {where}, and SGLang's --config file cannot hold one key of a JSON flag (it "
    "passes a nested mapping on as Python text, not JSON, and one value of a flag replaces the "
    "other whole): give the secret in a root-only file the setting reads by path "
    "(hicache_storage_backend_extra_config takes '@/etc/sglang/<file>.json', mode 0600), or as "
    f"one of the server's secret fields ({', '.join(_secrets.SECRET_FLAGS)}); a key that holds "
    "no secret is listed in sglang_fleet/server_secrets.py (HARMLESS_PHRASES)"
)
_REACHES = {
    "flag": ("a flag's value", "argv, the unit's world-readable drop-in and the printed "
             "description"),
    "env": ("an environment value", "the world-readable environment file and the printed "
            "description"),
}  # fmt: skip
DEFAULTS_KEYS = ("flags", "env", "host")


class ServerConfigError(ValueError):
    """A server description is wrong; `variable` names the inventory path to fix."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable
        self.message = message


def combine(base: Mapping[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive merge, layer wins; a None in the layer removes the key."""
    merged = copy.deepcopy(dict(base))
    for key, value in layer.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = combine(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _mapping(value: Any, variable: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ServerConfigError(variable, f"must be a mapping, got {type(value).__name__}")
    return value


def _shown(key: Any) -> str:
    """A key as it may appear in a variable path: itself when printable, else its repr."""
    text = str(key)
    return text if text.isprintable() and text.isascii() else repr(key)


def _control_char(text: str, allowed: str = "") -> str | None:
    """The first control character of text (a Unicode Cc other than `allowed`), if any."""
    return next((c for c in text if c not in allowed and unicodedata.category(c) == "Cc"), None)


def _text_problem(text: str) -> str | None:
    """Why a string cannot be one argv word of a unit file, or None."""
    if "\0" in text:
        return "holds a NUL character, which no command line can carry"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8 text (a unit file must be UTF-8)"
    return None


def _scalar_problem(value: Any) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if abs(value) > MAX_FLAG_INT:
            return f"a {value.bit_length()}-bit integer is out of range (at most 64 bits)"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value!r} is not a finite number"
    if isinstance(value, str):
        return _text_problem(value)
    return f"a {type(value).__name__} is not a flag value (use a string, number or boolean)"


def _json_problem(value: Any) -> str | None:
    """Why a nested mapping value cannot be written as the JSON SGLang reads, or None."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"mapping key {key!r} is not a string (JSON keys are strings)"
            problem = _text_problem(key) or _json_problem(item)
            if problem:
                return problem
        return None
    if isinstance(value, list | tuple):
        return next((p for p in map(_json_problem, value) if p), None)
    return _scalar_problem(value)


def _refuse_secrets_in(value: Any, variable: str, kind: str) -> None:
    """Refuse a value that holds a secret anywhere in it, naming the path to it (never its text)."""
    found = _secrets.secrets_in(value)
    if found:
        path, why = found[0]
        what, where = _REACHES[kind]
        raise ServerConfigError(
            f"{variable}{path}", f"{why}: " + _NESTED_SECRET_RULE.format(what=what, where=where)
        )


def _flag_value_problem(value: Any) -> str | None:
    """Why a flag value cannot be rendered as argv words, or None."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return _json_problem(value)
    if isinstance(value, list | tuple):
        for item in value:
            if item is None or isinstance(item, Mapping | list | tuple):
                return "a list flag takes strings, numbers or booleans, not nested values"
            problem = _scalar_problem(item)
            if problem:
                return problem
        return None
    return _scalar_problem(value)


def _flag_layer(value: Any, variable: str) -> dict[str, Any]:
    """A flag mapping with keys in ServerArgs spelling; managed keys and bad values refused."""
    layer: dict[str, Any] = {}
    for key, item in _mapping(value, variable).items():
        try:
            norm = normalize_key(key)
        except ValueError as exc:
            raise ServerConfigError(f"{variable}.{_shown(key)}", str(exc)) from None
        if norm in MANAGED_FLAGS:
            raise ServerConfigError(
                f"{variable}.{key}", f"is set by the server's own field: use {MANAGED_FLAGS[norm]}"
            )
        if _secrets.is_secret(norm):
            raise ServerConfigError(f"{variable}.{key}", _SECRET_NAME_RULE)
        if norm in layer:
            raise ServerConfigError(f"{variable}.{key}", f"repeats flag {norm} (same flag)")
        # Before the value's own checks: they quote a bad value, and walk it without a bound.
        _refuse_secrets_in(item, f"{variable}.{key}", "flag")
        problem = _flag_value_problem(item)
        if problem:
            raise ServerConfigError(f"{variable}.{key}", problem)
        layer[norm] = item
    return layer


def _env_value_problem(value: Any) -> str | None:
    """Why a value cannot be one EnvironmentFile= line (see the module docstring), or None."""
    if value is None:
        return None  # null removes the variable set by an earlier layer
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return (
            f"a {type(value).__name__} is not an environment value: use a quoted string "
            "(for example '1', 'true' or '') or a number"
        )
    char = _control_char(value, allowed="\t") if isinstance(value, str) else None
    if char is not None:
        return f"holds the control character {char!r}; an EnvironmentFile line allows none but TAB"
    return _scalar_problem(value)


def _env_layer(value: Any, variable: str) -> dict[str, Any]:
    layer = dict(_mapping(value, variable))
    for key, item in layer.items():
        if not isinstance(key, str) or not ENV_NAME_RE.fullmatch(key):
            raise ServerConfigError(
                f"{variable}.{_shown(key)}",
                "is not an environment variable name (letters, digits, '_', no leading digit)",
            )
        if key in MANAGED_ENV:
            raise ServerConfigError(
                f"{variable}.{key}", f"is set from the server's {MANAGED_ENV[key]}"
            )
        if _secrets.is_secret(key):
            raise ServerConfigError(f"{variable}.{key}", _SECRET_NAME_RULE)
        _refuse_secrets_in(item, f"{variable}.{key}", "env")
        problem = _env_value_problem(item)
        if problem:
            raise ServerConfigError(f"{variable}.{key}", problem)
    return layer


def _origins(layers: list[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    """Which variable set each top-level flag last (for messages that say what to edit)."""
    origins: dict[str, str] = {}
    for variable, layer in layers:
        for key, value in layer.items():
            if value is None:
                origins.pop(key, None)
            else:
                origins[key] = f"{variable}.{key}"
    return origins


def _check_name(server: Mapping[str, Any], index: int) -> str:
    name = server.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ServerConfigError(
            f"{SERVERS_VAR}[{index}].name",
            f"{name!r} must be {NAME_RULE} (it names the unit sglang@<name>.service)",
        )
    return name


def _check_keys(
    mapping: Mapping[str, Any], where: str, allowed: tuple[str, ...], hint: str = ""
) -> None:
    unknown = sorted(_shown(key) for key in mapping if key not in allowed)
    if unknown:
        raise ServerConfigError(
            f"{where}.{unknown[0]}", f"unknown key; allowed: {', '.join(allowed)}{hint}"
        )


def _check_secrets(server: Mapping[str, Any], where: str) -> list[str]:
    """The secret fields the server sets (sorted); each present one must be usable."""
    return sorted(field for field in _secrets.SECRET_FLAGS if _check_secret(server, where, field))


def _check_secret(server: Mapping[str, Any], where: str, field: str) -> bool:
    """Whether the server sets this secret; a present one must be usable (never quoted back)."""
    if field not in server:
        return False
    variable = f"{where}.{field}"
    key = server[field]
    if key is None or key == "":
        raise ServerConfigError(
            variable,
            "is empty (an unset vault variable or environment lookup?); set it, or leave "
            f"{field} out" + (" to serve without authentication" if field == "api_key" else ""),
        )
    if not isinstance(key, str):
        raise ServerConfigError(variable, f"must be a string, got a {type(key).__name__}")
    if len(key) > MAX_API_KEY_CHARS:
        raise ServerConfigError(variable, f"is longer than {MAX_API_KEY_CHARS} characters")
    if key.startswith("-") or not API_KEY_RE.fullmatch(key):
        raise ServerConfigError(
            variable,
            "must be printable ASCII (letters, digits, punctuation, inner spaces) without "
            "leading or trailing whitespace, control characters or a leading '-': it travels "
            "in an HTTP header and a YAML file (the key itself is not shown here)",
        )
    return True


def _check_gpus(value: Any, where: str) -> list[int]:
    variable = f"{where}.gpus"
    if not isinstance(value, list) or not value:
        raise ServerConfigError(variable, "must be a non-empty list of GPU indexes, like [0, 1]")
    for gpu in value:
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise ServerConfigError(variable, f"{gpu!r} is not a GPU index (an integer >= 0)")
    if len(set(value)) != len(value):
        raise ServerConfigError(variable, f"{value} lists a GPU twice")
    return list(value)


def _check_device(value: Any, variable: str) -> str:
    if value not in DEVICES:
        raise ServerConfigError(
            variable, f"{value!r} is not a device; allowed: {', '.join(DEVICES)}"
        )
    return str(value)


def _check_cpus(value: Any, where: str) -> list[int]:
    variable = f"{where}.cpus"
    if value is None:
        return []
    if not isinstance(value, list) or not value:
        raise ServerConfigError(variable, "must be a non-empty list of CPU ids, like [0, 1, 2, 3]")
    for cpu in value:
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
            raise ServerConfigError(variable, f"{cpu!r} is not a CPU id (an integer >= 0)")
    if len(set(value)) != len(value):
        raise ServerConfigError(variable, f"{value} lists a CPU twice")
    return list(value)


def _cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the CPU list syntax SGLang and taskset read)."""
    parts: list[str] = []
    start = prev = cpus[0]
    for cpu in [*cpus[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)


def cpu_threads_bind(cpus: list[int], ranks: int) -> str | None:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` ranks over `cpus` ('0-1|2-3'), None when the CPUs
    do not split evenly."""
    if ranks < 1 or not cpus or len(cpus) % ranks:
        return None
    size = len(cpus) // ranks
    return "|".join(_cpu_ranges(cpus[i * size : (i + 1) * size]) for i in range(ranks))


def _cpu_ranks(flags: Mapping[str, Any]) -> int | None:
    """SGLang's world size on a CPU host: tp x pp x dp (numa_utils.init_threads_binding)."""
    sizes = [_positive_int(flags, key) for key in ("tp_size", "pp_size", "dp_size")]
    if None in sizes:
        return None
    return math.prod(size for size in sizes if size is not None)


def _cpu_engine(
    flags: dict[str, Any],
    origins: dict[str, str],
    env: dict[str, Any],
    cpus: list[int],
    where: str,
) -> dict[str, Any]:
    """A CPU server's flags (in place) and its engine environment (returned)."""
    flags["device"] = "cpu"
    origins["device"] = f"{where}.device"
    if flags.get("attention_backend") is None:
        flags["attention_backend"] = CPU_ATTENTION_BACKEND
        origins["attention_backend"] = f"{where}.device"
    engine_env = dict(CPU_ENGINE_ENV)
    ranks = _cpu_ranks(flags)
    if CPU_BIND_ENV in env or ranks is None:
        return engine_env  # an env layer binds the ranks itself; validate.py reports bad sizes
    if cpus:
        bind = cpu_threads_bind(cpus, ranks)
        if bind is None:
            raise ServerConfigError(
                f"{where}.cpus",
                f"{len(cpus)} CPUs do not split evenly over {ranks} ranks (tp_size x pp_size x "
                f"dp_size); list a multiple of {ranks} CPUs",
            )
        engine_env[CPU_BIND_ENV] = bind
    elif ranks > 1:
        raise ServerConfigError(
            f"{where}.cpus",
            f"a CPU server with {ranks} ranks needs its CPUs: list them in cpus (split evenly "
            f"over the ranks) or set env.{CPU_BIND_ENV} ('0-23|24-47'); without either SGLang "
            "runs at most one rank per NUMA node",
        )
    return engine_env


def _device_fields(
    server: Mapping[str, Any], where: str, default: str
) -> tuple[str, list[int], list[int]]:
    """(device, gpus, cpus) of a server: a GPU server lists gpus, a CPU server none."""
    device = _check_device(server.get("device", default), f"{where}.device")
    if device == "cpu":
        if server.get("gpus") is not None:
            raise ServerConfigError(
                f"{where}.gpus", "a CPU server (device: cpu) uses no GPUs: leave gpus out"
            )
        return device, [], _check_cpus(server.get("cpus"), where)
    if server.get("cpus") is not None:
        raise ServerConfigError(f"{where}.cpus", "only applies to a CPU server (device: cpu)")
    return device, _check_gpus(server.get("gpus"), where), []


def _check_port(value: Any, where: str) -> int:
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ServerConfigError(f"{where}.port", f"{value!r} is not a port number (1..65535)")
    return value


def _check_text(value: Any, variable: str, required: bool) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise ServerConfigError(variable, f"{value!r} must be a non-empty string")
    char = _control_char(value)
    if char is not None:
        raise ServerConfigError(variable, f"{value!r} holds the control character {char!r}")
    problem = _text_problem(value)
    if problem:
        raise ServerConfigError(variable, problem)
    return value


def _check_model_path(value: Any, variable: str) -> str:
    """The server's model_path: text a unit file can carry, with no credential in it (a remote
    path's user:password@ would reach argv)."""
    _refuse_secrets_in(value, variable, "flag")
    return str(_check_text(value, variable, required=True))


def server_gpus(server: Mapping[str, Any], gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The server's own GPUs as nvidia-smi lists them; every GPU when none of them is listed
    (what the pre-flight plans on and a calibration record is keyed by)."""
    wanted = {str(index) for index in server.get("gpus") or []}
    return [gpu for gpu in gpus if str(gpu.get("index")) in wanted] or gpus


def local_address(host: str) -> str:
    """Where the server's own host reaches it: loopback for a wildcard address, else the address
    (bracketed when it is IPv6)."""
    if host in WILDCARD_HOSTS:
        return WILDCARD_HOSTS[host]
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _readable_url(url: str, variable: str) -> None:
    """What the modules' HTTP reader refuses (port 0 or above 65535, a leading zero, a host
    like '..'), refused here first, before any host is touched."""
    try:
        check_url(url, variable)
    except HttpError as exc:
        raise ServerConfigError(variable, str(exc).removeprefix(f"{variable} ")) from None


def _check_router(
    value: Any, where: str, port: int, host: str, hostname: str | None
) -> dict[str, str] | None:
    """The server's router: {url, worker_url, metrics_url}, or None when it has none."""
    if value is None:
        return None
    variable = f"{where}.router"
    router = _mapping(value, variable)
    _check_keys(router, variable, ROUTER_KEYS)
    url = router.get("url")
    if not isinstance(url, str) or not ROUTER_URL_RE.fullmatch(url):
        raise ServerConfigError(
            f"{variable}.url",
            f"{redact_url(repr(url))} must be the router's URL as this host reaches it, "
            f"{ROUTER_URL_RULE}",
        )
    _readable_url(url, f"{variable}.url")
    worker_url = router.get("worker_url")
    if worker_url is None:
        if not hostname:
            raise ServerConfigError(
                f"{variable}.worker_url",
                "is required here: no host name to build http://<host>:<port> from",
            )
        worker_url = f"http://{hostname}:{port}"
    match = ROUTER_URL_RE.fullmatch(worker_url) if isinstance(worker_url, str) else None
    if match is None:
        raise ServerConfigError(
            f"{variable}.worker_url",
            f"{redact_url(repr(worker_url))} must be {ROUTER_URL_RULE} (sglang-router compares "
            "worker URLs as written: 'http://host:port/' never becomes healthy)",
        )
    _readable_url(worker_url, f"{variable}.worker_url")
    if _url_key(url) == _url_key(worker_url):
        raise ServerConfigError(
            f"{variable}.url",
            f"{url} is the server's own worker URL: a server cannot be routed through itself",
        )
    if url_port(match) != port:
        raise ServerConfigError(
            f"{variable}.worker_url",
            f"{worker_url!r} names port {url_port(match)}, but the server listens on port {port}",
        )
    return {
        "url": url,
        "worker_url": worker_url,
        # Read on the server's own host while it drains (needs enable_metrics, validate.py).
        "metrics_url": f"http://{local_address(host)}:{port}/metrics",
    }


def _profile_layer(
    server: Mapping[str, Any], profiles: Mapping[str, Any], where: str
) -> tuple[str | None, dict[str, Any]]:
    profile = server.get("profile")
    if profile is None:
        return None, {}
    if not isinstance(profile, str) or profile not in profiles:
        allowed = ", ".join(sorted(str(key) for key in profiles)) or "none defined"
        raise ServerConfigError(
            f"{where}.profile", f"{profile!r} is not a profile in {PROFILES_VAR}: {allowed}"
        )
    return profile, _flag_layer(profiles[profile], f"{PROFILES_VAR}.{profile}")


def _positive_int(flags: Mapping[str, Any], key: str) -> int | None:
    """An int flag value for the tp_size default, or None when it is not one (validate says)."""
    value = flags.get(key, 1)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def default_tp_size(flags: Mapping[str, Any], gpu_count: int) -> int | None:
    """tp_size that uses exactly the server's GPUs on this node (None: cannot tell)."""
    nnodes, pp, dp = (_positive_int(flags, key) for key in ("nnodes", "pp_size", "dp_size"))
    if nnodes is None or pp is None or dp is None:
        return None
    # With DP attention the DP ranks live inside the TP group; otherwise each DP replica has its
    # own TP group and GPUs.
    replicas = 1 if flags.get("enable_dp_attention") else dp
    total = gpu_count * nnodes
    if total % (pp * replicas):
        return None
    return total // (pp * replicas)


def _node_layout(
    server: Mapping[str, Any],
    where: str,
    cluster: Mapping[str, Any] | None,
    gpu_count: int,
    port: int,
) -> _nodes.Layout | bool | None:
    """The multi-node layout on this host; False for a one-host server, None when this host is
    not one of the server's nodes."""
    if server.get("nodes") is None:
        for key in ("dist_init_port", "interface"):
            if server.get(key) is not None:
                raise ServerConfigError(f"{where}.{key}", "only applies to a server with nodes")
        return False
    cluster = cluster or {}
    try:
        return _nodes.layout(
            server,
            where,
            host=cluster.get("host"),
            cluster=cluster.get("hosts") or {},
            gpu_count=gpu_count,
            server_port=port,
        )
    except _nodes.NodeError as exc:
        raise ServerConfigError(exc.variable, exc.message) from None


def _refuse_node_flags(flag_layers: list[tuple[str, dict[str, Any]]]) -> None:
    for variable, layer in flag_layers:
        for key in _nodes.NODE_FLAGS:
            if layer.get(key) is not None:
                raise ServerConfigError(
                    f"{variable}.{key}", "is set from the server's nodes (node order and node 0)"
                )


def resolve_server(
    server: Mapping[str, Any],
    index: int,
    profiles: Mapping[str, Any],
    overrides: Mapping[str, Any],
    defaults: Mapping[str, Any],
    *,
    cluster: Mapping[str, Any] | None = None,
    tuned: Mapping[str, Any] | None = None,
    device: str = "cuda",
) -> dict[str, Any] | None:
    """One resolved server description (see the module docstring); None for a multi-node
    server this host is not a node of. cluster: {host: this host's inventory name (the default
    host of router.worker_url), hosts: {...}} for multi-node servers. device: the host's default
    device (sglang_server_device), which the server's own `device` overrides."""
    if not isinstance(server, Mapping):
        raise ServerConfigError(f"{SERVERS_VAR}[{index}]", "must be a mapping")
    name = _check_name(server, index)
    where = f"{SERVERS_VAR}[{name}]"
    _check_keys(server, where, SERVER_KEYS, " (SGLang flags go in flags:)")
    secrets_set = _check_secrets(server, where)
    model_path = _check_model_path(server.get("model_path"), f"{where}.model_path")
    try:
        model_source = check_model_source(server.get("model_source"), where, str(model_path))
    except StageConfigError as exc:
        raise ServerConfigError(exc.variable, exc.message) from exc
    served_name = _check_text(
        server.get("served_model_name"), f"{where}.served_model_name", required=False
    )
    host = _check_text(
        server.get("host", defaults.get("host", DEFAULT_HOST)), f"{where}.host", required=True
    )
    device, gpus, cpus = _device_fields(server, where, device)
    cpu = device == "cpu"
    port = _check_port(server.get("port"), where)
    router = _check_router(server.get("router"), where, port, host, (cluster or {}).get("host"))
    if router is not None and server.get("nodes"):
        # A replica is rolled one host at a time, a server across hosts on all its nodes at
        # once (docs/MULTINODE.md): one server cannot be both.
        raise ServerConfigError(
            f"{where}.router", "a server across hosts (nodes:) cannot sit behind a router"
        )
    # A CPU server's node is one "device" for the tp_size default: one rank unless flags say.
    node_layout = _node_layout(server, where, cluster, len(gpus) or 1, port)
    if node_layout is None:
        return None
    profile, profile_flags = _profile_layer(server, profiles, where)
    override = _mapping(overrides.get(name), f"{OVERRIDES_VAR}.{name}")
    _check_keys(override, f"{OVERRIDES_VAR}.{name}", OVERRIDE_KEYS)

    flag_layers = [
        (f"{DEFAULTS_VAR}.flags", _flag_layer(defaults.get("flags"), f"{DEFAULTS_VAR}.flags")),
        (f"{PROFILES_VAR}.{profile}", profile_flags),
        (f"{where}.flags", _flag_layer(server.get("flags"), f"{where}.flags")),
        (
            f"{OVERRIDES_VAR}.{name}.flags",
            _flag_layer(override.get("flags"), f"{OVERRIDES_VAR}.{name}.flags"),
        ),
        (f"{TUNED_VAR}.{name}", _flag_layer((tuned or {}).get(name), f"{TUNED_VAR}.{name}")),
    ]
    flags: dict[str, Any] = {}
    for _variable, layer in flag_layers:
        flags = combine(flags, layer)
    origins = _origins(flag_layers)
    if node_layout:
        _refuse_node_flags(flag_layers)
        flags.update(node_layout.flags())
        origins.update(dict.fromkeys(_nodes.NODE_FLAGS, f"{where}.nodes"))

    env: dict[str, Any] = {}
    for variable, value in (
        (f"{DEFAULTS_VAR}.env", defaults.get("env")),
        (f"{where}.env", server.get("env")),
        (f"{OVERRIDES_VAR}.{name}.env", override.get("env")),
    ):
        env = combine(env, _env_layer(value, variable))
    if node_layout:
        # NCCL and gloo talk over this node's interface unless the env layers name one.
        env = {**node_layout.env(), **env}

    if "tp_size" not in flags:
        tp_size = default_tp_size(flags, len(gpus) or 1)
        if tp_size is not None:
            flags["tp_size"] = tp_size
            origins["tp_size"] = f"{where}.{'device' if cpu else 'gpus'}"
    engine_env = _cpu_engine(flags, origins, env, cpus, where) if cpu else {}
    flags.update(model_path=model_path, host=host, port=port)
    origins.update(model_path=f"{where}.model_path", host=f"{where}.host", port=f"{where}.port")
    if served_name is not None:
        flags["served_model_name"] = served_name
        origins["served_model_name"] = f"{where}.served_model_name"

    cuda_visible_devices = ",".join(str(gpu) for gpu in gpus)
    # What the unit's EnvironmentFile holds: the merged env plus the device's own variables
    # (a GPU server's GPU set; a CPU server's engine switch and rank binding).
    device_env = engine_env if cpu else {"CUDA_VISIBLE_DEVICES": cuda_visible_devices}
    return {
        "name": name,
        "unit": f"sglang@{name}.service",
        "model_path": model_path,
        "model_source": model_source,
        "served_model_name": served_name,
        "port": port,
        "host": host,
        "gpus": gpus,
        "device": device,
        "cpus": cpus,
        "cuda_visible_devices": cuda_visible_devices,
        "profile": profile,
        "flags": flags,
        "flag_origins": origins,
        "env": env,
        "environment": {**env, **device_env},
        # The keys themselves stay out of the description, which Ansible prints and diffs.
        "api_key_set": "api_key" in secrets_set,
        "secrets_set": secrets_set,
        "router": router,
        # Multi-node servers: every node in order (node 0 first) and this host's rank in it.
        "nodes": list(node_layout.nodes) if node_layout else [],
        "node_rank": node_layout.node_rank if node_layout else None,
    }


def resolve_servers(
    servers: list[dict],
    profiles: dict,
    overrides: dict,
    defaults: dict,
    *,
    cluster: Mapping[str, Any] | None = None,
    tuned: dict | None = None,
    device: str = "cuda",
) -> list[dict]:
    """Resolve every server of a host; errors raise ServerConfigError naming the variable.

    device: the host's default device (sglang_server_device). cluster ({host: this host's
    inventory name, hosts: {name: nodes.host_facts(...)}}) places multi-node servers (a server
    whose nodes do not include this host is left out) and gives the default host of a router's
    worker URL.
    """
    if servers is None:
        servers = []
    if not isinstance(servers, list):
        raise ServerConfigError(SERVERS_VAR, "must be a list of server descriptions")
    profiles = _mapping(profiles, PROFILES_VAR)
    overrides = _mapping(overrides, OVERRIDES_VAR)
    defaults = _mapping(defaults, DEFAULTS_VAR)
    tuned = _mapping(tuned, TUNED_VAR)
    _check_keys(defaults, DEFAULTS_VAR, DEFAULTS_KEYS)
    device = _check_device(device, DEVICE_VAR)
    placed = [
        resolve_server(
            server,
            index,
            profiles,
            overrides,
            defaults,
            cluster=cluster,
            tuned=tuned,
            device=device,
        )
        for index, server in enumerate(servers)
    ]
    resolved = [server for server in placed if server is not None]
    names = [server["name"] for server in resolved]
    for name in names:
        if names.count(name) > 1:
            raise ServerConfigError(f"{SERVERS_VAR}[{name}]", "two servers have this name")
    for variable, layer in ((OVERRIDES_VAR, overrides), (TUNED_VAR, tuned)):
        for name in layer:
            if name not in names:
                raise ServerConfigError(
                    f"{variable}.{name}",
                    f"names no server of this host; servers: {', '.join(names) or 'none'}",
                )
    return resolved


def config_hash(server: Mapping[str, Any]) -> str:
    """A short, stable name for what a server runs: flags, environment, which secrets are set and
    the SGLang version it runs (docs/UPGRADES.md).

    The fleet summary and the last-known-good record use it to say which configuration passed.
    """
    identity = {
        "flags": server.get("flags", {}),
        "environment": server.get("environment", {}),
        "api_key_set": bool(server.get("api_key_set")),
    }
    if server.get("sglang_version"):  # absent in descriptions made without one
        identity["sglang_version"] = str(server["sglang_version"])
    others = [name for name in server.get("secrets_set") or [] if name != "api_key"]
    if others:  # absent otherwise: servers with an API key alone keep their hash
        identity["secrets_set"] = sorted(others)
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- what the role writes

SYSTEMD_DIR = "/etc/systemd/system"
# Where the unit finds the secrets file systemd hands it (LoadCredential=): %d is the unit's
# credentials directory, a specifier systemd expands, so it is appended unquoted.
SECRETS_CREDENTIAL = "sglang-secrets.yaml"
LOGGING_CONFIG_ENV = "SGLANG_LOGGING_CONFIG_PATH"
# SGLang logs its resolved server arguments, API key included, at info level through this logger
# (docs/SGLANG.md, "Logs"): raised to WARNING on servers that have a key.
KEY_LOGGING_LOGGER = "sglang.srt.entrypoints.engine"
RUNTIME_KEYS = ("python", "launch_module", "config_dir", "state_dir")
# The SGLang version the python above holds (sglang_server_sglang_version): part of each server's
# configuration, so an upgrade rolls out like a flag change (docs/UPGRADES.md).
VERSION_RE = re.compile(r"[0-9][0-9A-Za-z.+!_-]{0,63}")  # fullmatch: `$` takes a trailing newline


def _runtime(runtime: Mapping[str, Any]) -> dict[str, str]:
    """Where SGLang is installed, which version it is and where the role keeps files, checked
    once."""
    runtime = _mapping(runtime, "runtime")
    values = {}
    version = runtime.get("sglang_version")
    if version is not None:
        if not isinstance(version, str) or not VERSION_RE.fullmatch(version):
            raise ServerConfigError(
                "sglang_server_sglang_version", f"{version!r} is not an exact SGLang version"
            )
        values["sglang_version"] = version
    for key in RUNTIME_KEYS:
        value = runtime.get(key)
        if not isinstance(value, str) or not value:
            raise ServerConfigError(f"sglang_server_{key}", f"{value!r} must be a non-empty string")
        if key != "launch_module" and not value.startswith("/"):
            raise ServerConfigError(f"sglang_server_{key}", f"{value!r} must be an absolute path")
        values[key] = value
    return values


def _logging_config(flags: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's own log format through SGLANG_LOGGING_CONFIG_PATH, minus the key-bearing line."""
    level = str(flags.get("log_level") or "info").upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "sglang": {"format": "[%(asctime)s] %(message)s", "datefmt": "%Y-%m-%d %H:%M:%S"}
        },
        "handlers": {
            "console": {
                "class": "logging.StreamHandler",
                "formatter": "sglang",
                "stream": "ext://sys.stdout",
            }
        },
        "root": {"level": level, "handlers": ["console"]},
        "loggers": {KEY_LOGGING_LOGGER: {"level": "WARNING"}},
    }


# What Ansible's own templates put first ({{ ansible_managed | comment }}). The role's files kept
# it when they moved from templates to here, so a file a template wrote is the same byte for byte
# (an upgrade restarts nothing).
MANAGED_HEADER = "#\n# Ansible managed\n#\n"
ROOT_FILE = {"owner": "root", "group": "root", "mode": "0644"}


def _dropin_text(name: str, exec_line: str, load_credential: str | None) -> str:
    """The drop-in that gives sglang@<name>.service its launch line."""
    text = (
        f"{MANAGED_HEADER}# Launch line of SGLang server {name}, quoted for systemd's command-line"
        " parser by\n# sglang_fleet.servers.describe (docs/ARCHITECTURE.md).\n[Service]\n"
    )
    if load_credential:
        text += (
            "# The API key never appears on the command line: systemd hands the root-only secrets"
            " file to the\n# service as a credential and SGLang reads it with --config.\n"
            f"LoadCredential={load_credential}\n"
        )
    return f"{text}ExecStart=\nExecStart={exec_line}\n"


def _env_text(name: str, env_lines: list[str]) -> str:
    """The EnvironmentFile of sglang@<name>.service."""
    return (
        f"{MANAGED_HEADER}# Environment of SGLang server {name}: its GPU set, this host's NCCL"
        " settings and, with\n# an API key, the logging configuration that keeps the key out of"
        " the journal.\n" + "".join(f"{line}\n" for line in env_lines)
    )


def _server_files(name: str, paths: Mapping[str, str], rendered: Mapping[str, Any]) -> list[dict]:
    """Every file of one server a rollout writes (or removes), with its content: configure.yml
    writes exactly these and inspect.yml compares exactly these. The secrets file is apart
    (secret_files()): its content is the key."""
    files = [
        {"path": paths["dropin"], **ROOT_FILE,
         "content": _dropin_text(name, rendered["exec_start"], rendered["load_credential"])},
        {"path": paths["env_file"], **ROOT_FILE,
         "content": _env_text(name, rendered["env_lines"])},
    ]  # fmt: skip
    if rendered["logging_config"] is not None:
        text = json.dumps(rendered["logging_config"], indent=4, sort_keys=True) + "\n"
        files.append({"path": paths["logging_file"], **ROOT_FILE, "content": text})
    else:
        files.append({"path": paths["secrets_file"], "absent": True})
    return [{"server": name, **file} for file in files]


def _has_secrets(server: Mapping[str, Any]) -> bool:
    """Whether the server has a secrets file (any secret field, the API key among them)."""
    return bool(server.get("secrets_set") or server.get("api_key_set"))


def secret_files(
    servers: list[Mapping[str, Any]], secrets: Mapping[str, Mapping[str, str]]
) -> list[dict]:
    """The root-only secrets file of each server with a secret, with its content: read by
    SGLang's --config, which turns each key into "--<key> <value>" as written (dashed keys).
    secrets: server_secrets.server_secrets() of the inventory ({name: {field: value}}). Only
    no_log tasks call this."""
    import yaml  # noqa: PLC0415 (the control node's Ansible brings PyYAML; the hosts need none)

    files = []
    for server in servers:
        if not _has_secrets(server):
            continue
        given = secrets.get(server["name"])
        given = given if isinstance(given, Mapping) else {}
        fields = sorted(server.get("secrets_set") or ["api_key"])
        missing = [field for field in fields if not given.get(field)]
        if missing:
            raise ServerConfigError(
                f"{SERVERS_VAR}[{server['name']}]",
                f"the description names {', '.join(missing)} but no value was handed over",
            )
        key = {_secrets.secrets_file_key(field): given[field] for field in fields}
        body = yaml.safe_dump(key, indent=4, allow_unicode=True, default_flow_style=False)
        content = (
            f"{MANAGED_HEADER}# Read by SGLang's --config, which turns each key into"
            ' "--<key> <value>" exactly as written:\n# keys take the flags\' dashed spelling.\n'
            f"{body}"
        )
        path = server["paths"]["secrets_file"]
        files.append({"server": server["name"], "path": path, **ROOT_FILE, "mode": "0600",
                      "content": content})  # fmt: skip
    return files


def records_and_routers(servers: list[Mapping[str, Any]]) -> dict[str, list[dict]]:
    """What a converged host holds besides its files (the sglang_host_state module's `records`
    and `routers`): each server's last-known-good record naming its configuration hash, and each
    replica listed by its router."""
    return {
        "records": [
            {"label": server["name"], "path": f"{server['paths']['lkg_dir']}/meta.json",
             "key": "config_hash", "value": server["config_hash"]}
            for server in servers
        ],
        "routers": [
            {"label": server["name"], "router_url": server["router"]["url"],
             "worker_url": server["router"]["worker_url"]}
            for server in servers
            if server.get("router")
        ],
    }  # fmt: skip


def _rendered(server: dict[str, Any], runtime: Mapping[str, str]) -> dict[str, Any]:
    """Everything the role writes and runs for one resolved server, computed in one place."""
    name = server["name"]
    config_dir, state_dir = runtime["config_dir"], runtime["state_dir"]
    paths = {
        "dropin_dir": f"{SYSTEMD_DIR}/{server['unit']}.d",
        "dropin": f"{SYSTEMD_DIR}/{server['unit']}.d/10-launch.conf",
        "env_file": f"{config_dir}/{name}.env",
        "secrets_file": f"{config_dir}/{name}.secrets.yaml",
        "logging_file": f"{config_dir}/{name}.logging.json",
        "state_dir": f"{state_dir}/{name}",
        "lkg_dir": f"{state_dir}/{name}/lkg",
        # Outside lkg/: a rollback restores lkg/ only, so calibrations survive it.
        "calibration_file": f"{state_dir}/{name}/calibration.json",
    }
    try:
        flag_argv = to_argv(server["flags"])
        argv = [runtime["python"], "-m", runtime["launch_module"], *flag_argv]
        exec_line = exec_start(argv)
        environment = dict(server["environment"])
        if _has_secrets(server):
            environment[LOGGING_CONFIG_ENV] = paths["logging_file"]
        env_lines = [env_file_line(key, environment[key]) for key in sorted(environment)]
    except ValueError as exc:
        raise ServerConfigError(f"{SERVERS_VAR}[{name}]", str(exc)) from None
    keyed = _has_secrets(server)
    if keyed:
        argv += ["--config", f"%d/{SECRETS_CREDENTIAL}"]
        exec_line += f" --config %d/{SECRETS_CREDENTIAL}"
    rendered = {
        "flag_argv": flag_argv,
        "argv": argv,
        "exec_start": exec_line,
        "env_lines": env_lines,
        "logging_config": _logging_config(server["flags"]) if keyed else None,
        "load_credential": f"{SECRETS_CREDENTIAL}:{paths['secrets_file']}" if keyed else None,
        "paths": paths,
        "plan_args": {key: server["flags"][key] for key in PLANNER_FLAGS if key in server["flags"]},
        "sglang_version": runtime.get("sglang_version"),
        "config_hash": config_hash({**server, "sglang_version": runtime.get("sglang_version")}),
    }
    rendered["files"] = _server_files(name, paths, rendered)
    rendered["directories"] = [{"path": paths["dropin_dir"], **ROOT_FILE, "mode": "0755"}]
    return rendered


def describe_servers(
    servers: list[dict],
    profiles: dict,
    overrides: dict,
    defaults: dict,
    *,
    nccl_env: dict | None = None,
    runtime: dict | None = None,
    cluster: dict | None = None,
    tuned: dict | None = None,
    device: str = "cuda",
) -> list[dict]:
    """The one call the role makes: inventory -> resolved servers with everything it writes.

    nccl_env (the host family's NCCL settings) is the lowest environment layer, under
    defaults.env. runtime: {python, launch_module, config_dir, state_dir, and optionally
    sglang_version: the version that python holds}. cluster: where
    multi-node servers run and this host's name (resolve_servers()). tuned: {name: flags}, the
    highest flag layer (sglang_server_tuned_flags). device: the host's default device
    (sglang_server_device: cuda or cpu), under each server's own `device`. Each server is
    resolve_server()'s description plus flag_argv (the flags as SGLang's parser reads them),
    argv (the whole command), exec_start (the ExecStart= value), env_lines (the EnvironmentFile),
    logging_config and load_credential (servers with a secret), paths, files (each file the
    role writes or removes for it, with its content: configure.yml writes exactly these, inspect.yml
    compares exactly these), directories, plan_args (the planner's flags) and config_hash. No
    secret is in the result, only secrets_set, their names (secret_files() renders the secrets
    files).
    """
    defaults = dict(_mapping(defaults, DEFAULTS_VAR))
    base_env = _env_layer(nccl_env, "sglang_server_nccl_env")
    defaults["env"] = combine(base_env, _env_layer(defaults.get("env"), f"{DEFAULTS_VAR}.env"))
    checked_runtime = _runtime(runtime or {})
    resolved = resolve_servers(
        servers, profiles, overrides, defaults, cluster=cluster, tuned=tuned, device=device
    )
    return [{**server, **_rendered(server, checked_runtime)} for server in resolved]


def api_keys(servers: Any) -> dict[str, str]:
    """{server name: API key} of the servers that have one: what the smoke client, the probes and
    the router need. Kept out of describe_servers() so the key never lands in a printed fact."""
    if not isinstance(servers, list):
        return {}
    return {
        str(server["name"]): str(server["api_key"])
        for server in servers
        if isinstance(server, Mapping) and server.get("api_key") not in (None, "")
    }


def _url_key(url: str) -> str:
    """A worker URL as sglang-router compares it: scheme and host case-insensitive, the rest as
    written (docs/ROUTER.md, "Worker API")."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(
        (parts.scheme.lower(), parts.netloc.lower(), parts.path, parts.query, parts.fragment)
    )
