"""Tests for sglang_fleet/servers/describe.py (resolution and precedence) and its Ansible
filters."""

from __future__ import annotations

import base64 as b64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError
from conftest import load_plugin

from sglang_fleet.servers.describe import describe_servers, resolve_servers
from sglang_fleet.servers.flag_layers import combine
from sglang_fleet.servers.secret_files import api_keys
from sglang_fleet.servers.server_values import ServerConfigError
from sglang_fleet.servers.unit_files import config_hash

ROOT = Path(__file__).resolve().parent.parent


def kimi(**changes: Any) -> dict[str, Any]:
    server = {
        "name": "kimi",
        "model_path": "/shared/kimi-k2.5-int4",
        "port": 8000,
        "gpus": [0, 1, 2, 3, 4, 5, 6, 7],
    }
    server.update(changes)
    return server


PROFILES = {
    "throughput": {"mem_fraction_static": 0.90, "kv_cache_dtype": "fp8_e4m3"},
    "safe": {"mem_fraction_static": 0.80},
}
DEFAULTS = {
    "flags": {"log_level": "info", "mem_fraction_static": 0.85},
    "env": {"NCCL_PROTO": "LL"},
}


def test_precedence_example_from_the_docstring() -> None:
    server = kimi(profile="throughput", flags={"mem_fraction_static": 0.88})
    overrides = {"kimi": {"flags": {"kv_cache_dtype": None}}}
    [resolved] = resolve_servers([server], PROFILES, overrides, DEFAULTS)
    assert resolved["flags"] == {
        "log_level": "info",
        "mem_fraction_static": 0.88,
        "tp_size": 8,
        "model_path": "/shared/kimi-k2.5-int4",
        "host": "127.0.0.1",
        "port": 8000,
    }
    assert resolved["flag_origins"]["mem_fraction_static"] == (
        "sglang_server_instances[kimi].flags.mem_fraction_static"
    )
    assert resolved["flag_origins"]["log_level"] == "sglang_server_defaults.flags.log_level"
    assert "kv_cache_dtype" not in resolved["flag_origins"]


def test_each_layer_beats_the_one_before() -> None:
    def value(**layers: Any) -> Any:
        server = kimi(profile="throughput", flags=layers.get("server", {}))
        overrides = {"kimi": {"flags": layers.get("override", {})}}
        [resolved] = resolve_servers([server], PROFILES, overrides, DEFAULTS)
        return resolved["flags"]["mem_fraction_static"]

    assert value() == 0.90  # profile beats defaults
    assert value(server={"mem_fraction_static": 0.88}) == 0.88
    assert value(server={"mem_fraction_static": 0.88}, override={"mem_fraction_static": 0.7}) == 0.7


def test_tuned_flags_lie_over_every_inventory_layer_and_say_so() -> None:
    server = kimi(profile="throughput", flags={"mem_fraction_static": 0.88})
    overrides = {"kimi": {"flags": {"mem_fraction_static": 0.7}}}
    tuned = {"kimi": {"mem_fraction_static": 0.9, "max_running_requests": 96}}
    [resolved] = resolve_servers([server], PROFILES, overrides, DEFAULTS, tuned=tuned)
    assert resolved["flags"]["mem_fraction_static"] == 0.9
    assert resolved["flags"]["kv_cache_dtype"] == "fp8_e4m3"  # untouched layers stay
    assert resolved["flag_origins"]["max_running_requests"] == (
        "sglang_server_tuned_flags.kimi.max_running_requests"
    )
    [plain] = resolve_servers([server], PROFILES, overrides, DEFAULTS)
    assert config_hash(resolved) != config_hash(plain)
    with pytest.raises(ServerConfigError, match=r"sglang_server_tuned_flags\.llama: names no"):
        resolve_servers([server], PROFILES, {}, DEFAULTS, tuned={"llama": {"tp_size": 1}})


def test_nested_flags_combine_key_by_key_and_null_removes() -> None:
    defaults = {"flags": {"json_model_override_args": {"a": 1, "b": {"c": 2, "d": 3}}}}
    server = kimi(flags={"json_model_override_args": {"b": {"c": 9, "d": None}, "e": 5}})
    [resolved] = resolve_servers([server], {}, {}, defaults)
    assert resolved["flags"]["json_model_override_args"] == {"a": 1, "b": {"c": 9}, "e": 5}
    assert defaults["flags"]["json_model_override_args"]["b"] == {"c": 2, "d": 3}  # not mutated


def test_dashed_and_snake_keys_override_each_other() -> None:
    server = kimi(profile="safe", flags={"mem-fraction-static": 0.5})
    [resolved] = resolve_servers([server], PROFILES, {}, {})
    assert resolved["flags"]["mem_fraction_static"] == 0.5
    assert "mem-fraction-static" not in resolved["flags"]


def test_env_layers_and_the_gpu_set() -> None:
    server = kimi(gpus=[4, 5, 6, 7], env={"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"})
    overrides = {"kimi": {"env": {"NCCL_ALGO": None, "NCCL_SOCKET_IFNAME": "eth0"}}}
    [resolved] = resolve_servers([server], {}, overrides, DEFAULTS)
    assert resolved["env"] == {"NCCL_PROTO": "Simple", "NCCL_SOCKET_IFNAME": "eth0"}
    assert resolved["cuda_visible_devices"] == "4,5,6,7"
    assert resolved["environment"] == {
        "NCCL_PROTO": "Simple",
        "NCCL_SOCKET_IFNAME": "eth0",
        "CUDA_VISIBLE_DEVICES": "4,5,6,7",
    }
    assert resolved["unit"] == "sglang@kimi.service"


@pytest.mark.parametrize(
    ("gpus", "flags", "tp_size"),
    [
        ([0, 1, 2, 3, 4, 5, 6, 7], {}, 8),
        ([0, 1, 2, 3, 4, 5, 6, 7], {"dp_size": 2}, 4),
        ([0, 1, 2, 3, 4, 5, 6, 7], {"dp_size": 8, "enable_dp_attention": True}, 8),
        ([0, 1, 2, 3], {"pp_size": 2}, 2),
        ([0, 1, 2, 3, 4, 5, 6, 7], {"nnodes": 2, "node_rank": 0}, 16),
        ([0, 1, 2, 3], {"tp_size": 2, "dp_size": 2}, 2),  # explicit wins
    ],
)
def test_tp_size_default_uses_the_gpu_set(gpus: list[int], flags: dict, tp_size: int) -> None:
    [resolved] = resolve_servers([kimi(gpus=gpus, flags=flags)], {}, {}, {})
    assert resolved["flags"]["tp_size"] == tp_size


def test_no_tp_size_default_when_the_gpus_do_not_divide() -> None:
    [resolved] = resolve_servers([kimi(gpus=[0, 1, 2], flags={"dp_size": 2})], {}, {}, {})
    assert "tp_size" not in resolved["flags"]  # host_checks.py reports the mismatch


def test_host_defaults_to_loopback_and_served_name_is_a_flag() -> None:
    [local, public] = resolve_servers(
        [kimi(), kimi(name="pub", port=8001, host="0.0.0.0", served_model_name="kimi-k2.5")],
        {},
        {},
        {},
    )
    assert local["host"] == local["flags"]["host"] == "127.0.0.1"
    assert "served_model_name" not in local["flags"]
    assert public["flags"]["host"] == "0.0.0.0"
    assert public["flags"]["served_model_name"] == "kimi-k2.5"


def test_api_key_never_enters_the_description() -> None:
    [resolved] = resolve_servers([kimi(api_key="sk-secret-123")], {}, {}, {})
    assert resolved["api_key_set"] is True
    assert "sk-secret-123" not in json.dumps(resolved)


def _error(servers: list, profiles=None, overrides=None, defaults=None) -> ServerConfigError:
    with pytest.raises(ServerConfigError) as excinfo:
        resolve_servers(servers, profiles or {}, overrides or {}, defaults or {})
    return excinfo.value


def test_unknown_profile_lists_the_profiles() -> None:
    error = _error([kimi(profile="fast")], PROFILES)
    assert error.variable == "sglang_server_instances[kimi].profile"
    assert "'fast'" in error.message and "safe, throughput" in error.message


@pytest.mark.parametrize(
    "name", ["Kimi", "-kimi", "kimi_1", "a" * 42, "", None, "kimi.service", "kimi\n"]
)
def test_bad_names_are_refused(name: object) -> None:
    error = _error([kimi(name=name)])
    assert error.variable == "sglang_server_instances[0].name"
    assert "lower-case letters, digits or '-'" in error.message


@pytest.mark.parametrize(
    ("server", "variable", "words"),
    [
        (kimi(flags={"port": 9000}), "sglang_server_instances[kimi].flags.port", "use port"),
        (kimi(flags={"api-key": "x"}), "sglang_server_instances[kimi].flags.api-key", "secret"),
        (kimi(flags={"Bad Key": 1}), "sglang_server_instances[kimi].flags.Bad Key", "letters"),
        (kimi(env={"CUDA_VISIBLE_DEVICES": "0"}), "[kimi].env.CUDA_VISIBLE_DEVICES", "gpus"),
        (kimi(env={"1X": "0"}), "sglang_server_instances[kimi].env.1X", "environment"),
        (kimi(gpus=[]), "sglang_server_instances[kimi].gpus", "non-empty"),
        (kimi(gpus=[0, 0]), "sglang_server_instances[kimi].gpus", "twice"),
        (kimi(gpus=[0, -1]), "sglang_server_instances[kimi].gpus", "-1"),
        (kimi(gpus="0,1"), "sglang_server_instances[kimi].gpus", "list"),
        (kimi(port="http"), "sglang_server_instances[kimi].port", "1..65535"),
        (kimi(model_path=None), "sglang_server_instances[kimi].model_path", "non-empty"),
        (kimi(flags=["x"]), "sglang_server_instances[kimi].flags", "mapping"),
        (kimi(gpu=[0]), "sglang_server_instances[kimi].gpu", "unknown key"),
    ],
)
def test_bad_fields_name_the_variable(server: dict, variable: str, words: str) -> None:
    error = _error([server])
    assert error.variable.endswith(variable)
    assert words in str(error)


def test_duplicate_names_and_stray_overrides_are_refused() -> None:
    assert "two servers" in _error([kimi(), kimi(port=8001)]).message
    error = _error([kimi()], overrides={"kmi": {"flags": {}}})
    assert error.variable == "sglang_server_overrides.kmi"
    assert "kimi" in error.message


def test_combine_does_not_alias_its_inputs() -> None:
    base = {"a": {"b": [1]}}
    merged = combine(base, {"c": 1})
    merged["a"]["b"].append(2)
    assert base == {"a": {"b": [1]}}


# --------------------------------------------------------------------------- filter plugin


FILTERS = load_plugin("plugins/filter/sglang_server.py").FilterModule().filters()
RUNTIME = {
    "python": "/opt/ml-env/bin/python",
    "launch_module": "sglang.launch_server",
    "config_dir": "/etc/sglang",
    "state_dir": "/var/lib/sglang-fleet",
}


def describe(servers: list[dict], **layers: Any) -> list[dict]:
    return describe_servers(
        servers,
        layers.get("profiles", {}),
        layers.get("overrides", {}),
        layers.get("defaults", {}),
        nccl_env=layers.get("nccl_env", {}),
        runtime=layers.get("runtime", RUNTIME),
    )


def test_describe_gives_everything_the_role_writes_in_one_call() -> None:
    [server] = describe(
        [kimi(api_key="sk-secret-123", flags={"mem_fraction_static": 0.88})],
        nccl_env={"NCCL_PROTO": "LL"},
        defaults={"flags": {"log_level": "warning"}, "env": {"NCCL_ALGO": "Ring"}},
    )
    assert server["argv"][:5] == [
        "/opt/ml-env/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        server["model_path"],
    ]
    assert server["argv"][3:-2] == server["flag_argv"]
    assert "--mem-fraction-static 0.88" in server["exec_start"]
    assert server["exec_start"].endswith(" --config %d/sglang-secrets.yaml")
    assert server["load_credential"] == "sglang-secrets.yaml:/etc/sglang/kimi.secrets.yaml"
    assert server["env_lines"] == [
        'CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"',
        'NCCL_ALGO="Ring"',
        'NCCL_PROTO="LL"',
        'SGLANG_LOGGING_CONFIG_PATH="/etc/sglang/kimi.logging.json"',
    ]
    assert server["logging_config"]["root"]["level"] == "WARNING"
    assert server["logging_config"]["loggers"] == {
        "sglang.srt.entrypoints.engine": {"level": "WARNING"}
    }
    assert server["paths"]["dropin"] == "/etc/systemd/system/sglang@kimi.service.d/10-launch.conf"
    assert server["paths"]["lkg_dir"] == "/var/lib/sglang-fleet/kimi/lkg"
    assert server["paths"]["calibration_file"] == "/var/lib/sglang-fleet/kimi/calibration.json"
    assert server["plan_args"] == {"mem_fraction_static": 0.88, "tp_size": 8}
    assert server["config_hash"] == config_hash(server)
    assert "sk-secret-123" not in json.dumps(server)


def test_the_sglang_version_is_part_of_the_configuration() -> None:
    runtime = {**RUNTIME, "python": "/opt/ml-env/versions/0.5.22/bin/python"}
    [old] = describe([kimi()], runtime={**runtime, "sglang_version": "0.5.22"})
    runtime = {**RUNTIME, "python": "/opt/ml-env/versions/0.5.23/bin/python"}
    [new] = describe([kimi()], runtime={**runtime, "sglang_version": "0.5.23"})
    assert (old["sglang_version"], new["sglang_version"]) == ("0.5.22", "0.5.23")
    assert old["config_hash"] != new["config_hash"]
    assert new["exec_start"].startswith("/opt/ml-env/versions/0.5.23/bin/python -m ")
    [unversioned] = describe([kimi()])
    assert unversioned["sglang_version"] is None
    assert unversioned["config_hash"] == config_hash(
        {
            "flags": unversioned["flags"],
            "environment": unversioned["environment"],
            "api_key_set": False,
        }
    )
    for bad in ("0.5.23/../x", "", "latest", 523):
        with pytest.raises(ServerConfigError, match="sglang_server_sglang_version"):
            describe([kimi()], runtime={**RUNTIME, "sglang_version": bad})


def test_the_nccl_env_is_the_lowest_environment_layer() -> None:
    [server] = describe(
        [kimi(env={"NCCL_PROTO": "Simple"})],
        nccl_env={"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"},
        defaults={"env": {"NCCL_ALGO": "Tree"}},
    )
    assert server["environment"]["NCCL_PROTO"] == "Simple"
    assert server["environment"]["NCCL_ALGO"] == "Tree"
    assert server["load_credential"] is None
    assert server["logging_config"] is None


@pytest.mark.parametrize(
    ("runtime", "variable"),
    [
        ({**RUNTIME, "python": "python3"}, "sglang_server_python"),
        ({**RUNTIME, "config_dir": ""}, "sglang_server_config_dir"),
        ({k: v for k, v in RUNTIME.items() if k != "state_dir"}, "sglang_server_state_dir"),
    ],
)
def test_describe_refuses_an_unusable_runtime(runtime: dict, variable: str) -> None:
    with pytest.raises(ServerConfigError) as raised:
        describe([kimi()], runtime=runtime)
    assert raised.value.variable == variable


def test_api_keys_maps_names_to_keys_of_servers_that_have_one() -> None:
    assert api_keys([kimi(api_key="k1"), {**kimi(), "name": "other"}]) == {"kimi": "k1"}
    assert api_keys(None) == {}


def test_filters_wrap_the_library_and_turn_errors_into_filter_errors() -> None:
    [server] = FILTERS["sglang_server_describe"]([kimi()], {}, {}, None, {}, RUNTIME)
    assert server["flag_argv"][:2] == ["--model-path", server["model_path"]]
    assert FILTERS["sglang_server_errors"](server, {"gpu_count": "8", "ram_mib": 409600}) == []
    with pytest.raises(AnsibleFilterError, match=r"sglang_server_instances\[kimi\].profile"):
        FILTERS["sglang_server_describe"]([kimi(profile="x")], {}, {}, {}, {}, RUNTIME)
    with pytest.raises(AnsibleFilterError, match="absolute path"):
        FILTERS["sglang_server_describe"]([kimi()], {}, {}, {}, {}, {**RUNTIME, "python": "py"})
    assert FILTERS["sglang_server_api_keys"]([kimi(api_key="k")]) == {"kimi": "k"}


def test_servers_on_gpus_picks_the_servers_that_use_any_of_them() -> None:
    a = {"name": "a", "gpus": [0, 1]}
    b = {"name": "b", "gpus": [2, 3]}
    pick = FILTERS["sglang_servers_on_gpus"]
    assert [s["name"] for s in pick([a, b], [1, 5])] == ["a"]
    assert [s["name"] for s in pick([a, b], ["3"])] == ["b"]
    assert [s["name"] for s in pick([a, b], [])] == ["a", "b"]


@pytest.mark.slow
def test_filters_work_inside_ansible() -> None:
    """The plugin loads through ansible.cfg's filter_plugins and describes a real server."""
    described = "(servers | sglang_server_describe({}, {}, {}, {'NCCL_PROTO': 'L\"L'}, runtime))[0]"
    task = {"msg": f"{{{{ {described}.exec_start }}}}|{{{{ {described}.env_lines | join(';') }}}}"}
    variables = json.dumps({"servers": [kimi()], "runtime": RUNTIME})
    proc = subprocess.run(
        [
            *(str(Path(sys.executable).parent / "ansible"), "localhost", "-i", "localhost,"),
            *("-c", "local", "-m", "ansible.builtin.debug", "-a", json.dumps(task)),
            *("-e", variables),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1", "ANSIBLE_STDOUT_CALLBACK": "json"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [host_result] = json.loads(proc.stdout)["plays"][0]["tasks"][0]["hosts"].values()
    exec_start, env_lines = host_result["msg"].split("|", 1)
    assert exec_start.startswith("/opt/ml-env/bin/python -m sglang.launch_server --model-path ")
    assert 'NCCL_PROTO="L\\"L"' in env_lines.split(";")


def test_config_hash_names_flags_env_and_key_presence_but_not_order():
    base = {"flags": {"a": 1, "b": 2}, "environment": {"X": "1"}, "api_key_set": False}
    same = {"api_key_set": False, "environment": {"X": "1"}, "flags": {"b": 2, "a": 1}}
    assert config_hash(base) == config_hash(same)
    assert len(config_hash(base)) == 12
    assert config_hash(base) != config_hash({**base, "flags": {"a": 1, "b": 3}})
    assert config_hash(base) != config_hash({**base, "environment": {"X": "2"}})
    assert config_hash(base) != config_hash({**base, "api_key_set": True})


def test_the_restart_decision_reads_configure_results_records_and_running_units():
    def described(name: str, flags: dict) -> dict:
        [server] = describe([kimi(name=name, port=30000 + len(name), flags=flags)])
        return server

    a, b, c = described("a", {"x": 1}), described("bb", {"x": 2}), described("ccc", {})

    def slurp(server, **change):
        meta = {"config_hash": config_hash({**server, **change})}
        return {"content": b64.b64encode(json.dumps(meta).encode()).decode()}

    good = [slurp(a), slurp(b), slurp(c)]
    running = [a["unit"], b["unit"], c["unit"]]
    decide = FILTERS["sglang_restart_decision"]
    assert decide([a, b, c], [], running, good) == []
    # A server's own files: its drop-in, its environment, its (removed) secrets file.
    assert decide([a, b, c], [b["paths"]["env_file"]], running, good) == ["bb"]
    assert decide([a, b, c], [c["paths"]["secrets_file"]], running, good) == ["ccc"]
    # A file of no server (the template unit): every server.
    assert decide([a, b, c], ["/etc/systemd/system/sglang@.service"], running, good) == [
        "a", "bb", "ccc"
    ]  # fmt: skip
    assert decide([a, b, c], [], running[1:], good) == ["a"]
    records = [slurp(a), slurp(b, flags={"x": 1}), {"failed": True, "msg": "not found"}]
    assert decide([a, b, c], [], running, records) == ["bb", "ccc"]


# The role's files as Ansible's templates wrote them before sglang_fleet.servers.describe rendered
# them:
# the same bytes, so upgrading the role restarts no server.
KIMI_DROPIN = """#
# Ansible managed
#
# Launch line of SGLang server kimi, quoted for systemd's command-line parser by
# sglang_fleet.servers.describe (docs/ARCHITECTURE.md).
[Service]
# The API key never appears on the command line: systemd hands the root-only secrets file to the
# service as a credential and SGLang reads it with --config.
LoadCredential=sglang-secrets.yaml:/etc/sglang/kimi.secrets.yaml
ExecStart=
ExecStart={exec_start}
"""
KIMI_ENV = """#
# Ansible managed
#
# Environment of SGLang server kimi: its GPU set, this host's NCCL settings and, with
# an API key, the logging configuration that keeps the key out of the journal.
CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"
SGLANG_LOGGING_CONFIG_PATH="/etc/sglang/kimi.logging.json"
"""
KIMI_SECRETS = """#
# Ansible managed
#
# Read by SGLang's --config, which turns each key into "--<key> <value>" exactly as written:
# keys take the flags' dashed spelling.
api-key: 'sk-é''"x: y'
"""


def test_each_server_carries_its_files_with_their_content() -> None:
    [keyed, plain_one] = describe([kimi(api_key="sk-secret-123"), kimi(name="b", port=30001)])
    files = {file["path"]: file for file in keyed["files"]}
    dropin = files["/etc/systemd/system/sglang@kimi.service.d/10-launch.conf"]
    assert dropin == {"server": "kimi", "path": dropin["path"], "owner": "root", "group": "root",
                      "mode": "0644",
                      "content": KIMI_DROPIN.format(exec_start=keyed["exec_start"])}  # fmt: skip
    assert files["/etc/sglang/kimi.env"]["content"] == KIMI_ENV
    logging = json.loads(files["/etc/sglang/kimi.logging.json"]["content"])
    assert logging == keyed["logging_config"]
    assert keyed["directories"] == [{"path": "/etc/systemd/system/sglang@kimi.service.d",
                                     "owner": "root", "group": "root", "mode": "0755"}]  # fmt: skip
    # Without a key: no logging configuration, and a secrets file left over is removed.
    assert [f["path"] for f in plain_one["files"]][2:] == ["/etc/sglang/b.secrets.yaml"]
    assert plain_one["files"][2]["absent"] is True
    assert "LoadCredential" not in plain_one["files"][0]["content"]


def test_secrets_files_render_only_for_servers_with_a_key() -> None:
    servers = describe([kimi(api_key="x"), kimi(name="b", port=30001)])
    [secret] = FILTERS["sglang_server_secret_files"](servers, {"kimi": {"api_key": "sk-é'\"x: y"}})
    assert secret["path"] == "/etc/sglang/kimi.secrets.yaml" and secret["mode"] == "0600"
    assert secret["content"] == KIMI_SECRETS


def test_records_and_routers_name_each_servers_configuration_and_worker() -> None:
    routed = kimi(router={"url": "http://gw:30000", "worker_url": "http://gpu-01:8000"})
    [server] = describe([routed])
    wants = FILTERS["sglang_server_records_and_routers"]([server])
    record = "/var/lib/sglang-fleet/kimi/lkg/meta.json"
    assert wants["records"] == [{"label": "kimi", "path": record, "key": "config_hash",
                                 "value": server["config_hash"]}]  # fmt: skip
    assert wants["routers"] == [{"label": "kimi", "router_url": "http://gw:30000",
                                 "worker_url": "http://gpu-01:8000"}]  # fmt: skip


@pytest.mark.parametrize("key", ["", None, " sk-secret-123", "sk-secret-123\n", "-sk-secret-123"])
def test_a_present_api_key_must_be_usable_and_is_never_quoted(key: object) -> None:
    error = _error([kimi(api_key=key)])
    assert error.variable == "sglang_server_instances[kimi].api_key"
    assert "sk-secret-123" not in str(error)


def test_leaving_api_key_out_serves_without_a_key() -> None:
    [resolved] = resolve_servers([kimi()], {}, {}, {})
    assert resolved["api_key_set"] is False


ROUTED = {"url": "http://gateway-01:30000"}


def test_a_replica_names_its_router_and_its_own_url_defaults_to_the_host_name() -> None:
    [server] = resolve_servers(
        [kimi(host="0.0.0.0", router=ROUTED)], {}, {}, {}, cluster={"host": "gpu-node-01"}
    )
    assert server["router"] == {
        "url": "http://gateway-01:30000",
        "worker_url": "http://gpu-node-01:8000",
        "metrics_url": "http://127.0.0.1:8000/metrics",
    }
    explicit = {**ROUTED, "worker_url": "http://10.0.0.11:8000"}
    [server] = resolve_servers([kimi(host="10.0.0.11", router=explicit)], {}, {}, {})
    assert server["router"]["worker_url"] == "http://10.0.0.11:8000"
    assert server["router"]["metrics_url"] == "http://10.0.0.11:8000/metrics"
    [plain] = resolve_servers([kimi()], {}, {}, {})
    assert plain["router"] is None


def test_the_router_changes_neither_argv_nor_the_config_hash() -> None:
    [routed] = describe([kimi(router={**ROUTED, "worker_url": "http://n1:8000"})])
    [plain] = describe([kimi()])
    assert routed["argv"] == plain["argv"]
    assert routed["config_hash"] == plain["config_hash"]


@pytest.mark.parametrize(
    ("router", "variable", "words"),
    [
        ("http://gw:30000", "router", "mapping"),
        ({"url": "http://gw:30000/", "worker_url": "http://n1:8000"}, "router.url", "no path"),
        ({"url": "gw:30000", "worker_url": "http://n1:8000"}, "router.url", "http(s)://"),
        ({"worker_url": "http://n1:8000"}, "router.url", "as this host reaches it"),
        (
            {"url": "http://gw:1", "worker_url": "http://n1:8000/"},
            "router.worker_url",
            "as written",
        ),
        ({"url": "http://gw:1", "worker_url": "http://n1:9000"}, "router.worker_url", "port 8000"),
        ({"url": "http://gw:1", "worker_url": "http://n1"}, "router.worker_url", "names port 80,"),
        ({"url": "http://gw:1"}, "router.worker_url", "no host name"),
        ({"url": "http://gw:1", "policy": "x"}, "router.policy", "unknown key"),
    ],
)
def test_bad_router_fields_name_the_variable(router: object, variable: str, words: str) -> None:
    error = _error([kimi(router=router)])
    assert error.variable == f"sglang_server_instances[kimi].{variable}"
    assert words in error.message


def test_the_restart_decision_takes_the_preflights_records_by_name():
    """The pre-flight reads every server of the host; a rollout play decides for its scope."""
    [a] = describe([kimi(name="a", port=30001, flags={"x": 1})])
    [b] = describe([kimi(name="bb", port=30002, flags={"x": 2})])
    texts = {s["name"]: json.dumps({"config_hash": config_hash(s)}) for s in (a, b)}
    decide = FILTERS["sglang_restart_decision"]
    assert decide([b], [], [b["unit"]], texts) == []  # a is out of this play's scope
    assert decide([a, b], [], [a["unit"], b["unit"]], texts | {"a": None}) == ["a"]
