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
unless an env layer sets it. --max-total-tokens is checked by host_checks.py: on CPU SGLang sizes
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

This module resolves (resolve_server, resolve_servers) and hands each server to the renderer
(describe_servers). The pieces live beside it, one job a module: server_values.py (the value
checks above), flag_layers.py (the layers and their precedence), cpu_engine.py (a CPU server's
device), server_router.py (router URLs), unit_files.py (what the role writes, the config hash)
and secret_files.py (the secrets files and API keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_fleet.servers import nodes as _nodes
from sglang_fleet.servers.cpu_engine import apply_cpu_engine, device_fields
from sglang_fleet.servers.flag_layers import (
    combine,
    env_layer,
    flag_layer,
    flag_origins,
    profile_layer,
)
from sglang_fleet.servers.model_source import StageConfigError, check_model_source
from sglang_fleet.servers.server_router import check_router
from sglang_fleet.servers.server_values import (
    DEFAULT_HOST,
    DEFAULTS_KEYS,
    DEFAULTS_VAR,
    DEVICE_VAR,
    OVERRIDE_KEYS,
    OVERRIDES_VAR,
    PROFILES_VAR,
    SERVER_KEYS,
    SERVERS_VAR,
    TUNED_VAR,
    ServerConfigError,
    check_device,
    check_keys,
    check_model_path,
    check_name,
    check_port,
    check_secrets,
    check_text,
    checked_mapping,
    positive_int,
)
from sglang_fleet.servers.unit_files import check_runtime, render_server


def server_gpus(server: Mapping[str, Any], gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The server's own GPUs as nvidia-smi lists them; every GPU when none of them is listed
    (what the pre-flight plans on and a calibration record is keyed by)."""
    wanted = {str(index) for index in server.get("gpus") or []}
    return [gpu for gpu in gpus if str(gpu.get("index")) in wanted] or gpus


def default_tp_size(flags: Mapping[str, Any], gpu_count: int) -> int | None:
    """tp_size that uses exactly the server's GPUs on this node (None: cannot tell)."""
    nnodes, pp, dp = (positive_int(flags, key) for key in ("nnodes", "pp_size", "dp_size"))
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
    name = check_name(server, index)
    where = f"{SERVERS_VAR}[{name}]"
    check_keys(server, where, SERVER_KEYS, " (SGLang flags go in flags:)")
    secrets_set = check_secrets(server, where)
    model_path = check_model_path(server.get("model_path"), f"{where}.model_path")
    try:
        model_source = check_model_source(server.get("model_source"), where, str(model_path))
    except StageConfigError as exc:
        raise ServerConfigError(exc.variable, exc.message) from exc
    served_name = check_text(
        server.get("served_model_name"), f"{where}.served_model_name", required=False
    )
    host = check_text(
        server.get("host", defaults.get("host", DEFAULT_HOST)), f"{where}.host", required=True
    )
    device, gpus, cpus = device_fields(server, where, device)
    cpu = device == "cpu"
    port = check_port(server.get("port"), where)
    router = check_router(server.get("router"), where, port, host, (cluster or {}).get("host"))
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
    profile, profile_flags = profile_layer(server, profiles, where)
    override = checked_mapping(overrides.get(name), f"{OVERRIDES_VAR}.{name}")
    check_keys(override, f"{OVERRIDES_VAR}.{name}", OVERRIDE_KEYS)

    flag_layers = [
        (f"{DEFAULTS_VAR}.flags", flag_layer(defaults.get("flags"), f"{DEFAULTS_VAR}.flags")),
        (f"{PROFILES_VAR}.{profile}", profile_flags),
        (f"{where}.flags", flag_layer(server.get("flags"), f"{where}.flags")),
        (
            f"{OVERRIDES_VAR}.{name}.flags",
            flag_layer(override.get("flags"), f"{OVERRIDES_VAR}.{name}.flags"),
        ),
        (f"{TUNED_VAR}.{name}", flag_layer((tuned or {}).get(name), f"{TUNED_VAR}.{name}")),
    ]
    flags: dict[str, Any] = {}
    for _variable, layer in flag_layers:
        flags = combine(flags, layer)
    origins = flag_origins(flag_layers)
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
        env = combine(env, env_layer(value, variable))
    if node_layout:
        # NCCL and gloo talk over this node's interface unless the env layers name one.
        env = {**node_layout.env(), **env}

    if "tp_size" not in flags:
        tp_size = default_tp_size(flags, len(gpus) or 1)
        if tp_size is not None:
            flags["tp_size"] = tp_size
            origins["tp_size"] = f"{where}.{'device' if cpu else 'gpus'}"
    engine_env = apply_cpu_engine(flags, origins, env, cpus, where) if cpu else {}
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
    profiles = checked_mapping(profiles, PROFILES_VAR)
    overrides = checked_mapping(overrides, OVERRIDES_VAR)
    defaults = checked_mapping(defaults, DEFAULTS_VAR)
    tuned = checked_mapping(tuned, TUNED_VAR)
    check_keys(defaults, DEFAULTS_VAR, DEFAULTS_KEYS)
    device = check_device(device, DEVICE_VAR)
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
    defaults = dict(checked_mapping(defaults, DEFAULTS_VAR))
    base_env = env_layer(nccl_env, "sglang_server_nccl_env")
    defaults["env"] = combine(base_env, env_layer(defaults.get("env"), f"{DEFAULTS_VAR}.env"))
    checked_runtime = check_runtime(runtime or {})
    resolved = resolve_servers(
        servers, profiles, overrides, defaults, cluster=cluster, tuned=tuned, device=device
    )
    return [{**server, **render_server(server, checked_runtime)} for server in resolved]
