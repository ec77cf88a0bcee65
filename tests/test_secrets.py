"""One owner for secrets: sglang_fleet/server_secrets.py (docs/ARCHITECTURE.md, "Secrets").

SGLang's own parser is read for flags named like a secret: each must be on the list (a server
field, delivered by the root-only secrets file) or on the list of harmless names. Without the
SGLang reference venv the committed copy of its flag table is read; with it, the real parser.
Then the places a secret leaked before: a flag layer's admin_api_key reached ExecStart=, the
printed description and check mode's `+ --admin-api-key ...` line; an old last-known-good record's
api_key or hf_token was printed by check mode and by the pre-flight's result at -v; a hub token
in an env layer went to the world-readable environment file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import load_plugin, module_argv
from sglang_fleet.module_utils import fleet_http
from sglang_fleet.module_utils.fleet_http import HttpError
from test_preflight_action import INSTANCE, FakePreflight, args, kimi_host
from test_preflight_action import describe as describe_for_preflight

from sglang_fleet import server_secrets
from sglang_fleet.servers import restart_decision
from sglang_fleet.servers.describe import describe_servers
from sglang_fleet.servers.secret_files import secret_files
from sglang_fleet.servers.server_values import ServerConfigError
from sglang_fleet.servers.unit_files import config_hash

ROOT = Path(__file__).resolve().parent.parent
FLAG_TABLE = ROOT / "gpusim" / "gpusim" / "flags" / "sglang-0.5.23.json"
DUMPER_DIR = ROOT / "gpusim" / "tools"
PROBE_CACHE = ROOT / ".cache" / "gpusim-real-probe"
FILTERS = load_plugin("plugins/filter/sglang_server.py").FilterModule().filters()
RUNTIME = {
    "python": "/opt/ml-env/bin/python",
    "launch_module": "sglang.launch_server",
    "config_dir": "/etc/sglang",
    "state_dir": "/var/lib/sglang-fleet",
}
ADMIN = "adm-7c1e-never-shown"
KEY = "sk-4f2a-never-shown"
HUB = "hf_q81z-never-shown"


def kimi(**change: Any) -> dict[str, Any]:
    return {"name": "kimi", "model_path": "/srv/models/kimi", "port": 8000, "gpus": [0]} | change


def describe(*servers: dict[str, Any], **kwargs: Any) -> list[dict[str, Any]]:
    return describe_servers(list(servers), {}, {}, {}, runtime=RUNTIME, **kwargs)


# --- SGLang's parser against the list ---------------------------------------------------------


def unlisted_secret_flags(table: dict[str, Any]) -> list[str]:
    """Flags of a parser dump named like a secret that neither list names."""
    known = server_secrets.SECRET_FLAGS.keys() | server_secrets.NOT_SECRET_FLAGS.keys()
    return sorted(
        action["dest"]
        for action in table["actions"]
        if action["option_strings"]
        and any(
            server_secrets.named_like_a_secret(n)
            for n in [action["dest"], *action["option_strings"]]
        )
        and action["dest"] not in known
    )


def reference_table() -> dict[str, Any]:
    """The real SGLang parser, dumped by gpusim/tools/dump_sglang_flags.py (cached per venv)."""
    venv = Path(os.environ.get("SGLANG_REF_VENV", ROOT / ".cache" / "sglang-ref" / "venv"))
    venv = venv if venv.is_absolute() else ROOT / venv
    stamp = venv / ".stamp"
    if not stamp.is_file():
        pytest.skip(f"no complete SGLang reference venv at {venv} (make sglang-ref)")
    key = hashlib.sha256(stamp.read_bytes() + str(stamp.stat().st_mtime_ns).encode())
    key.update((DUMPER_DIR / "dump_sglang_flags.py").read_bytes())
    cached = PROBE_CACHE / f"parser-{key.hexdigest()[:16]}.json"
    if not cached.is_file():
        code = (
            "import json, sys, dump_sglang_flags as d; "
            "json.dump(d.dump(d.build_server_parser()), sys.stdout)"
        )
        env = dict(os.environ, PYTHONPATH=str(DUMPER_DIR), HF_HUB_OFFLINE="1",
                   PYTHONWARNINGS="ignore")  # fmt: skip
        done = subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env,
                              capture_output=True, text=True, timeout=240, check=True)  # fmt: skip
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(done.stdout, encoding="utf-8")
    return json.loads(cached.read_text(encoding="utf-8"))


def test_every_flag_of_the_committed_parser_table_named_like_a_secret_is_listed() -> None:
    table = json.loads(FLAG_TABLE.read_text(encoding="utf-8"))
    assert table["sglang_version"] == "0.5.23"
    assert unlisted_secret_flags(table) == []
    dests = {action["dest"] for action in table["actions"]}
    # Every listed name is one of SGLang's flags: a list of names that do not exist checks nothing.
    assert server_secrets.SECRET_FLAGS.keys() <= dests
    assert server_secrets.NOT_SECRET_FLAGS.keys() <= dests


@pytest.mark.slow
def test_every_flag_of_the_real_parser_named_like_a_secret_is_listed() -> None:
    assert unlisted_secret_flags(reference_table()) == []


def test_the_check_fails_on_a_new_flag_named_like_a_secret() -> None:
    """The test above can fail: a parser with a new key, token or password flag is caught."""
    table = json.loads(FLAG_TABLE.read_text(encoding="utf-8"))
    for dest in ("hub_token", "s3_secret_access", "db_password", "webhook_key"):
        extra = {"dest": dest, "option_strings": [f"--{dest.replace('_', '-')}"]}
        assert unlisted_secret_flags({"actions": [*table["actions"], extra]}) == [dest]


# --- where secrets leaked before ------------------------------------------------------------


def test_admin_api_key_as_a_flag_is_refused_naming_the_variable() -> None:
    with pytest.raises(ServerConfigError) as raised:
        describe(kimi(flags={"admin-api-key": ADMIN}))
    assert raised.value.variable == "sglang_server_instances[kimi].flags.admin-api-key"
    assert "admin_api_key" in raised.value.message and ADMIN not in str(raised.value)


@pytest.mark.parametrize(
    ("layer", "name"),
    [
        ("flags", "hf_token"),
        ("flags", "ssl_keyfile_password"),
        ("env", "HF_TOKEN"),
        ("env", "AWS_SECRET_ACCESS_KEY"),
    ],
)
def test_secrets_in_flag_and_env_layers_are_refused(layer: str, name: str) -> None:
    with pytest.raises(ServerConfigError) as raised:
        describe(kimi(**{layer: {name: HUB}}))
    assert raised.value.variable == f"sglang_server_instances[kimi].{layer}.{name}"
    assert HUB not in str(raised.value)


def test_a_harmless_flag_named_with_token_still_passes() -> None:
    [server] = describe(kimi(flags={"bucket_time_to_first_token": [0.1, 1.0]}))
    assert "--bucket-time-to-first-token" in server["flag_argv"]


def test_admin_api_key_goes_to_the_secrets_file_only() -> None:
    [server] = describe(kimi(api_key=KEY, admin_api_key=ADMIN))
    shown = json.dumps(server)
    assert ADMIN not in shown and KEY not in shown
    assert "--admin-api-key" not in server["exec_start"]
    assert server["secrets_set"] == ["admin_api_key", "api_key"] and server["api_key_set"]
    assert server["exec_start"].endswith("--config %d/sglang-secrets.yaml")
    secrets = FILTERS["sglang_server_secrets"]([kimi(api_key=KEY, admin_api_key=ADMIN)])
    assert secrets == {"kimi": {"admin_api_key": ADMIN, "api_key": KEY}}
    [file] = secret_files([server], secrets)
    assert f"admin-api-key: {ADMIN}\n" in file["content"] and f"api-key: {KEY}\n" in file["content"]
    assert file["mode"] == "0600"


def test_a_server_with_only_an_admin_key_gets_the_credential_and_quiet_logging() -> None:
    [server] = describe(kimi(admin_api_key=ADMIN))
    assert not server["api_key_set"] and server["secrets_set"] == ["admin_api_key"]
    assert server["load_credential"] == "sglang-secrets.yaml:/etc/sglang/kimi.secrets.yaml"
    assert server["logging_config"] is not None
    assert not any(f.get("absent") for f in server["files"])


def test_an_empty_or_unprintable_secret_field_is_refused_without_quoting_it() -> None:
    with pytest.raises(ServerConfigError, match=r"\[kimi\]\.admin_api_key: is empty"):
        describe(kimi(admin_api_key=""))
    with pytest.raises(ServerConfigError) as raised:
        describe(kimi(ssl_keyfile_password="pw\nnext"))
    assert raised.value.variable.endswith(".ssl_keyfile_password") and "pw" not in str(raised.value)


def test_a_server_with_an_api_key_alone_keeps_its_configuration_hash() -> None:
    """Upgrading restarts nothing: the hash of an API-key-only server is what it was."""
    [server] = describe(kimi(api_key=KEY))
    old = {"flags": server["flags"], "environment": server["environment"], "api_key_set": True}
    assert config_hash(server) == config_hash(old)
    [admin] = describe(kimi(api_key=KEY, admin_api_key=ADMIN))
    assert config_hash(admin) != config_hash(server)


def test_check_mode_lines_never_print_a_secret_an_old_record_holds() -> None:
    [server] = describe(kimi(flags={"tp_size": 1}))
    secrets = {"api_key": KEY, "hf_token": HUB, "admin_api_key": ADMIN}
    nested = {"json_model_override_args": {"hf_token": HUB}}
    record = {"config_hash": "old", "flags": {**server["flags"], "tp_size": 2, **secrets, **nested}}
    lines = restart_decision.restart_lines([server], ["kimi"], [record], [server["unit"]])
    text = "\n".join(lines)
    assert KEY not in text and HUB not in text and ADMIN not in text
    assert "  - --api-key <redacted>" in lines and "  - --tp-size 2" in lines
    assert "  + --tp-size 1" in lines


def test_the_preflight_result_redacts_an_old_records_secrets() -> None:
    """The pre-flight's result (shown at -v) carries each record's text for the check lines."""
    servers = describe_for_preflight(INSTANCE)
    meta = f"{servers[0]['paths']['lkg_dir']}/meta.json"
    record = {"config_hash": "old", "api_key_set": True,
              "flags": {"tp_size": 8, "api_key": KEY, "hf_token": HUB}}  # fmt: skip
    host = kimi_host()
    host["files"] = {**host["files"], meta: json.dumps(record)}
    result = FakePreflight(args(servers), host).run_it()
    assert not result.get("failed"), result.get("msg")
    shown = json.loads(result["lkg_records"]["kimi"])
    assert shown["flags"] == {"tp_size": 8, "api_key": "<redacted>", "hf_token": "<redacted>"}
    assert shown["config_hash"] == "old" and shown["api_key_set"] is True
    assert KEY not in json.dumps(result) and HUB not in json.dumps(result)


def test_records_and_diffs_leave_secret_flags_out() -> None:
    flags = {"tp_size": 2, "watermark_config": '{"key": 1}', "x": {"db_password": "p"}}
    assert server_secrets.public_flags(flags) == {"tp_size": 2, "x": {"db_password": "<redacted>"}}
    assert server_secrets.public_flags("not a mapping") == {}  # type: ignore[arg-type]


def test_redaction_is_bounded_in_depth() -> None:
    deep: Any = "leaf"
    for _ in range(100):
        deep = {"a": deep}
    out = server_secrets.redact(deep)
    for _ in range(33):
        out = out["a"]
    assert out == server_secrets.REDACTED


# --- secrets by value, not by place (issue 44) -----------------------------------------------
# A secret nested in a flag's value (the mapping SGLang reads as JSON, or its JSON text) reached
# flag_argv, ExecStart= and the world-readable drop-in while redact() hid it on screen; a key with
# a line break was quoted, escaped, in module errors, where no_log cannot mask it.

NESTED = "s3cr-nested-Zq7x"
# The JSON flags of SGLang 0.5.23 (gpusim/gpusim/flags/sglang-0.5.23.json) an operator may set.
JSON_FLAGS = (
    "model_loader_extra_config",
    "json_model_override_args",
    "hicache_storage_backend_extra_config",
    "kv_events_config",
    "mm_process_config",
    "preferred_sampling_params",
    "radix_eviction_policy_config",
    "unified_cache_external_linker_config",
    "modelexpress_config",
    "cuda_graph_config",
    "hisparse_config",
)


def _every_text(server: dict[str, Any]) -> str:
    """Everything describe_servers() gives that is printed, run or written world-readable."""
    parts = [json.dumps(server), server["exec_start"], *server["flag_argv"], *server["argv"]]
    parts += server["env_lines"] + [file.get("content", "") for file in server["files"]]
    return "\n".join(parts)


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"s3": {"secret_access_key": NESTED}}, ".s3.secret_access_key"),
        ({"headers": [{"Authorization": NESTED}]}, ".headers[0].Authorization"),
        ({"backend": {"password": 4711}}, ".backend.password"),  # YAML reads 4711 as a number
        ('{"s3": {"accessToken": "' + NESTED + '"}}', ".s3.accessToken"),  # the docs' JSON text
        ('{"api_key": "' + NESTED + '",}', ".api_key"),  # not JSON: read for quoted keys
        ({"url": f"redis://:{NESTED}@cache-1:6379/0"}, ".url"),  # a credential in a URL
        (f"Bearer {NESTED}", ""),
    ],
)
@pytest.mark.parametrize(
    "flag", ["model_loader_extra_config", "hicache_storage_backend_extra_config"]
)
def test_a_secret_nested_in_a_flag_value_is_refused_naming_the_path(
    flag: str, value: Any, path: str
) -> None:
    with pytest.raises(ServerConfigError) as raised:
        describe(kimi(flags={flag: value}))
    assert raised.value.variable == f"sglang_server_instances[kimi].flags.{flag}{path}"
    assert NESTED not in str(raised.value) and "4711" not in str(raised.value)
    assert "root-only file" in raised.value.message  # where such a value must go


@pytest.mark.parametrize("flag", JSON_FLAGS)
def test_no_json_flag_carries_a_nested_secret_to_argv_or_the_unit(flag: str) -> None:
    """Before: describe_servers() returned flag_argv, exec_start and a drop-in holding it."""
    for layer in ("profile", "instance", "override", "tuned"):
        value = {"a": {"b": [{"db_password": NESTED}]}}
        profiles = {"p": {flag: value}} if layer == "profile" else {}
        server = kimi(profile="p") if layer == "profile" else kimi()
        if layer == "instance":
            server["flags"] = {flag: value}
        overrides = {"kimi": {"flags": {flag: value}}} if layer == "override" else {}
        tuned = {"kimi": {flag: value}} if layer == "tuned" else None
        try:
            [described] = describe_servers(
                [server], profiles, overrides, {}, runtime=RUNTIME, tuned=tuned
            )
        except ServerConfigError as exc:
            assert exc.variable.endswith(f"{flag}.a.b[0].db_password"), exc.variable
            assert NESTED not in str(exc)
            continue
        pytest.fail(f"{layer}: {NESTED in _every_text(described)=}")


def test_harmless_nested_keys_named_with_token_or_key_still_pass() -> None:
    """Hugging Face config keys json_model_override_args overrides hold ids and shapes."""
    override = {"eos_token_id": [1, 2], "num_key_value_heads": 8, "rope_scaling": {"factor": 4}}
    [server] = describe(kimi(flags={"json_model_override_args": override}))
    assert '"eos_token_id":[1,2]' in server["exec_start"].replace("\\", "")
    # A switch or a null under a secret's name hides nothing.
    [server] = describe(kimi(flags={"kv_events_config": {"use_token_auth": True, "key": None}}))
    assert "use_token_auth" in server["exec_start"]


def test_an_env_value_with_a_secret_in_it_is_refused() -> None:
    with pytest.raises(ServerConfigError) as raised:
        describe(kimi(env={"SGLANG_HICACHE_CONFIG": '{"auth": {"password": "' + NESTED + '"}}'}))
    assert (
        raised.value.variable
        == "sglang_server_instances[kimi].env.SGLANG_HICACHE_CONFIG.auth.password"
    )
    assert NESTED not in str(raised.value)


def test_a_model_path_with_credentials_is_refused() -> None:
    with pytest.raises(ServerConfigError) as raised:
        describe(kimi(model_path=f"s3://AKIA:{NESTED}@bucket/llama"))
    assert raised.value.variable == "sglang_server_instances[kimi].model_path"
    assert NESTED not in str(raised.value)


def test_a_value_nested_past_the_bound_is_refused_not_walked() -> None:
    deep: Any = {"x": 1}
    for _ in range(200):
        deep = {"a": deep}
    with pytest.raises(ServerConfigError, match="deeper than 32 levels"):
        describe(kimi(flags={"json_model_override_args": deep}))


def test_shown_records_hide_a_secret_nested_as_json_text() -> None:
    """An old record's JSON text: redact() read it as its value (it passed as a plain string)."""
    flags = {"model_loader_extra_config": '{"s3": {"secret_key": "' + NESTED + '"}}',
             "tokenizer_path": f"https://user:{NESTED}@host/t", "tp_size": 2}  # fmt: skip
    assert NESTED not in json.dumps(server_secrets.redact(flags))
    assert NESTED not in json.dumps(server_secrets.public_flags(flags))
    [server] = describe(kimi(flags={"tp_size": 1}))
    record = {"config_hash": "old", "flags": flags}
    lines = restart_decision.restart_lines([server], ["kimi"], [record], [server["unit"]])
    assert NESTED not in "\n".join(lines)
    assert "  - --model-loader-extra-config <redacted>" in lines


def test_a_shown_record_hides_secrets_outside_its_flags_but_keeps_what_they_name() -> None:
    record = {"config_hash": "h", "api_key_set": True, "secrets_set": ["admin_api_key"],
              "hf_token": NESTED, "flags": {"api_key": NESTED, "x": {"token": NESTED}}}  # fmt: skip
    shown = server_secrets.public_record(record)
    assert NESTED not in json.dumps(shown)
    assert shown["api_key_set"] is True and shown["secrets_set"] == ["admin_api_key"]
    assert shown["flags"] == {"x": {"token": "<redacted>"}}


# --- module errors never carry a key ----------------------------------------------------------

# A key with a line break: no_log masks it as written; http.client quoted it escaped
# (b'Bearer Zq7x\nLEAK'), which no_log cannot match. Both halves are unique: any form of the
# key holds one.
BROKEN_KEY = "Zq7x\nLEAKmark"


def _leaks(text: str) -> bool:
    return "Zq7x" in text or "LEAKmark" in text


@contextlib.contextmanager
def _listening() -> Iterator[int]:
    """A port that accepts connections and never answers: nothing must reach it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


def _run_module(tmp_path: Path, module: str, args: dict[str, Any], env: dict[str, str]) -> str:
    """The module run as Ansible runs it; its whole output (stdout and stderr)."""
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}), encoding="utf-8")
    done = subprocess.run(module_argv(module, str(args_file)), capture_output=True, text=True,
                          timeout=60, check=False, env={**os.environ, **env})  # fmt: skip
    assert done.stdout, done.stderr
    return done.stdout + done.stderr


def test_start_facts_never_quotes_a_key_with_a_line_break(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("systemctl", "journalctl"):
        (bin_dir / name).write_text("#!/bin/sh\necho inv-1\n")
        (bin_dir / name).chmod(0o755)
    with _listening() as port:
        output = _run_module(
            tmp_path, "plugins/modules/sglang_start_facts.py",
            {"unit": "sglang@kimi.service", "port": port, "api_key": BROKEN_KEY,
             "line_pattern": "x", "server_info_paths": ["version"], "folder": str(tmp_path),
             "store_name": "calibration.json", "timeout": 3},
            {"PATH": f"{bin_dir}:{os.environ['PATH']}"},
        )  # fmt: skip
    assert not _leaks(output), output
    assert "header Authorization" in output and "Traceback" not in output


def test_router_workers_never_quotes_a_key_with_a_line_break(tmp_path: Path) -> None:
    with _listening() as port:
        output = _run_module(
            tmp_path, "plugins/modules/sglang_router_workers.py",
            {"router_url": f"http://127.0.0.1:{port}", "api_key": BROKEN_KEY, "state": "list",
             "request_timeout": 3},
            {},
        )  # fmt: skip
    assert not _leaks(output), output
    assert "header Authorization" in output and "Traceback" not in output


def test_host_state_never_quotes_a_routers_key_with_a_line_break() -> None:
    host_state = load_plugin("plugins/modules/sglang_host_state.py")
    with _listening() as port:
        want = {"label": "kimi", "router_url": f"http://127.0.0.1:{port}",
                "worker_url": "http://gpu-1:8000"}  # fmt: skip
        found, unknown = host_state.check_router(want, BROKEN_KEY, 3)
    assert found == [] and len(unknown) == 1
    assert not _leaks(unknown[0]) and "header Authorization" in unknown[0], unknown


@pytest.mark.parametrize("char", ["\n", "\r", "\x01", "\x7f", "\u0085", "\u20ac", "\x00"])
def test_the_http_reader_refuses_a_bad_header_value_before_sending_and_never_quotes_it(
    char: str,
) -> None:
    """Before: a line break raised a ValueError quoting the value, and \\x01 was sent."""
    with _listening() as port, pytest.raises(HttpError) as raised:
        fleet_http.request(f"http://127.0.0.1:{port}/x",
                           headers={"Authorization": f"Bearer Zq7x{char}LEAKmark"},
                           deadline_s=2)  # fmt: skip
    assert raised.value.code == "bad_header" and not _leaks(str(raised.value))
    assert "header Authorization" in str(raised.value)


def test_a_routers_answer_that_echoes_the_workers_key_is_quoted_without_it() -> None:
    """The router's 400 may quote the registration it refused, the worker's key in it (JSON
    escapes it), cut at 300 characters: the key is taken out before the cut."""
    router = load_plugin("plugins/modules/sglang_router_workers.py")
    worker_key = 'wk-"Zq7x"-' + "LEAKmark" * 40

    def send(url: str, **_kwargs: Any) -> fleet_http.Response:
        body = json.dumps({"error": "bad request", "got": {"url": url, "api_key": worker_key}})
        return fleet_http.Response(400, "Bad Request", {}, body.encode())

    client = router.RouterClient("http://r:30000", "rk-1", 3.0, send, hidden=(worker_key,))
    with pytest.raises(router.RouterError) as raised:
        client.add_worker("http://gpu-1:8000", worker_key)
    assert not _leaks(str(raised.value)) and "<redacted>" in str(raised.value)


@pytest.mark.parametrize(
    "secret", ["plain-Zq7x", "quote'Zq7x\"", "back\\slash-Zq7x", "line\nZq7x", "€-Zq7x", "%Zq7x$"]
)
def test_without_secrets_takes_out_every_written_form(secret: str) -> None:
    forms = [secret, repr(secret), json.dumps(secret), repr(secret.encode()),
             urllib.parse.quote(secret, safe="")]  # fmt: skip
    text = " | ".join(forms)
    assert "Zq7x" not in fleet_http.without_secrets(text, [secret, None, ""])


# --- records as shown: by value, every field ---------------------------------------------------


def test_a_restore_shows_an_old_records_secrets_nowhere(tmp_path: Path) -> None:
    """A record written by hand or by an older version, with a hub token beside its flags and a
    key in a flag's JSON text: the restore's result showed both (only flags were cleaned, by
    name)."""
    from test_last_known_good import FakeKeep, described  # noqa: PLC0415

    (tmp_path / "etc").mkdir()
    paths = {name: tmp_path / "etc" / name for name in ("dropin", "env_file", "secrets_file")}
    for path in paths.values():
        path.write_text("as written\n")
    paths["lkg_dir"] = tmp_path / "state" / "llama" / "lkg"
    FakeKeep({"server": described(paths, {"tp_size": 2})}).run(task_vars={})
    meta = paths["lkg_dir"] / "meta.json"
    record = json.loads(meta.read_text())
    record["hf_token"] = NESTED
    record["flags"]["model_loader_extra_config"] = '{"s3": {"secret_key": "' + NESTED + '"}}'
    meta.write_text(json.dumps(record))
    paths["dropin"].write_text("edited by hand\n")
    result = FakeKeep({"server": described(paths, {"tp_size": 2}), "state": "restored"}).run(
        task_vars={}
    )
    assert result["found"] and NESTED not in json.dumps(result), result["record"]
    assert result["record"]["api_key_set"] is True and result["record"]["hf_token"] == "<redacted>"


def test_the_preflight_result_redacts_secrets_outside_an_old_records_flags() -> None:
    servers = describe_for_preflight(INSTANCE)
    meta = f"{servers[0]['paths']['lkg_dir']}/meta.json"
    record = {"config_hash": "old", "api_key_set": True, "secrets_set": ["api_key"],
              "hf_token": NESTED, "smoke_result": {"url": f"http://u:{NESTED}@h:1"},
              "flags": {"tp_size": 8, "kv_events_config": f'{{"token": "{NESTED}"}}'}}  # fmt: skip
    host = kimi_host()
    host["files"] = {**host["files"], meta: json.dumps(record)}
    result = FakePreflight(args(servers), host).run_it()
    assert not result.get("failed"), result.get("msg")
    shown = json.loads(result["lkg_records"]["kimi"])
    assert NESTED not in json.dumps(result)
    assert shown["flags"] == {"tp_size": 8, "kv_events_config": "<redacted>"}
    assert shown["api_key_set"] is True and shown["secrets_set"] == ["api_key"]


def test_the_routers_extra_flags_hold_no_secret_and_its_key_no_control_character() -> None:
    from sglang_fleet.servers.router_settings import settings_problems  # noqa: PLC0415

    base = {"workers": ["http://gpu-1:8000"], "port": 30000, "prometheus_port": 29000,
            "version": "0.3.2", "api_key": ""}  # fmt: skip
    problems = settings_problems(
        base | {"extra_flags": {"jwt-secret": NESTED, "mcp-config": {"auth": {"token": NESTED}}}}
    )
    text = "\n".join(problems)
    assert "sglang_router_extra_flags.jwt-secret" in text
    assert "sglang_router_extra_flags.mcp-config.auth.token" in text and NESTED not in text
    problems = settings_problems(base | {"api_key": "Zq7x\x01LEAKmark"})
    assert any("sglang_router_api_key" in p for p in problems) and not _leaks("".join(problems))


def test_an_action_never_copies_a_key_out_of_a_modules_message() -> None:
    """The rollout's actions put a failed module's msg in their own result, which no_log does not
    cover: a module (of any version) that quoted its key escaped showed it there."""
    from test_router_leave_action import FakeLeave, leave_args  # noqa: PLC0415

    key = 'sk-"Zq7x"\\LEAKmark'
    said = f"the router answered 400: {json.dumps({'api_key': key})} and {key!r}"
    action = FakeLeave(leave_args(api_key=key), {"router": {"failed": True, "msg": said}})
    result = action.run_it()
    assert result["failed"] is True and "the router answered 400" in result["msg"]
    assert not _leaks(json.dumps(result)), result["msg"]


@pytest.mark.parametrize(
    "shape",
    ['"a', "bearer" + " " * 100, "a://", '"k"' + " " * 50, "aB", "a.", "[", "\"'", "{'k':"],
)
def test_the_secret_rule_reads_long_text_in_linear_time(shape: str) -> None:
    """No backtracking: 256 KiB of the worst shapes for each pattern (a quote without its
    pair, a 'bearer' with no token, '://' with no host, camelCase) in well under a second
    (about 1 us a character measured; the bound is generous for 2 shared cores)."""
    text = shape * (256 * 1024 // len(shape))
    # CPU time, not wall time: a loaded machine (a fresh-clone make test at load 11) stretched the
    # wall clock past the bound while this process got the CPU it needed.
    started = time.process_time()
    server_secrets.secrets_in({"k": text, "l": [text]})
    server_secrets.is_secret(text)
    assert time.process_time() - started < 3.0
