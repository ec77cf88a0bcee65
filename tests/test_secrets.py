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

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import load_plugin
from test_preflight_action import INSTANCE, FakePreflight, args, kimi_host
from test_preflight_action import describe as describe_for_preflight

from sglang_fleet import server_secrets
from sglang_fleet.servers import restart_decision
from sglang_fleet.servers.describe import (
    ServerConfigError,
    config_hash,
    describe_servers,
    secret_files,
)

ROOT = Path(__file__).resolve().parent.parent
FLAG_TABLE = ROOT / "gpusim" / "gpusim" / "flags" / "sglang-0.5.23.json"
DUMPER_DIR = ROOT / "gpusim" / "tools"
PROBE_CACHE = ROOT / ".cache" / "gpusim-real-probe"
FILTERS = load_plugin("filter_plugins/sglang_server.py").FilterModule().filters()
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
