"""Property-based tests of the secrets' one owner (Hypothesis; profiles in conftest.py).

Entry points: describing servers with secret fields and with flags or environment variables
named like secrets (sglang_server_describe), with secrets at every depth of every JSON flag's
value (a mapping or its JSON text, in every flag layer) and in env values; the secrets files
(sglang_server_secrets, sglang_server_secret_files); check mode's "would restart" lines against
any old record (sglang_restart_lines); redaction of records (server_secrets.redact, public_flags,
public_record); the HTTP reader's headers and the text a module error may quote
(fleet_http.request, without_secrets, sglang_router_workers' RouterClient); the router's extra
flags.
Invariants: a secret never appears, as written or escaped (repr, JSON, URL-quoted), in a
description, an argv, ExecStart=, an env line, a file that is not root-only (mode 0600), an
error message, a check line, a shown record or a module's message; each one is in its server's
secrets file; bad input is a ServerConfigError naming the variable and the path to the key,
never another exception.
"""

from __future__ import annotations

import json
import socket
import urllib.parse
from typing import Any

import yaml
from conftest import load_plugin
from hypothesis import given
from hypothesis import strategies as st
from sglang_fleet.module_utils import fleet_http
from test_secrets import FILTERS, JSON_FLAGS, RUNTIME, kimi

from sglang_fleet import server_secrets
from sglang_fleet.servers import restart_decision
from sglang_fleet.servers.describe import describe_servers
from sglang_fleet.servers.router_settings import settings_problems
from sglang_fleet.servers.server_values import ServerConfigError

# Every generated secret carries this marker, so "not in the output" cannot pass by chance.
MARK = "Zq7x"
good_secrets = st.from_regex(r"[A-Za-z0-9_.~+/=-]{4,40}", fullmatch=True).map(lambda s: MARK + s)
# Secrets as an unlucky operator or an attacker writes them: control characters, quotes, % and $
# (systemd specifiers and variables), backslashes, non-ASCII; the marker is plain letters, so any
# escaped form of the secret still holds it.
_NASTY = st.sampled_from(["\n", "\r", "\t", "\x00", "\x01", "\x7f", "\u0085", "\u2028", '"', "'",
                          "\\", "%", "%%", "$", "${X}", "\u20ac", "\U0001f600", " ", "{", "}",
                          "@", ":", "/"])  # fmt: skip
nasty_secrets = st.builds(
    lambda before, after: f"{before}{MARK}{after}",
    st.lists(st.one_of(_NASTY, st.text(max_size=3)), max_size=4).map("".join),
    st.lists(st.one_of(_NASTY, st.text(max_size=3)), max_size=4).map("".join),
)
bad_secrets = st.one_of(
    st.text(max_size=20).map(lambda s: f"{MARK}{s}\n"),
    st.text(max_size=20).map(lambda s: f" {MARK}{s}"),
    st.just(f"-{MARK}"),
    st.just(""),
    st.integers(),
    nasty_secrets,
)
secret_fields = st.dictionaries(
    st.sampled_from(sorted(server_secrets.SECRET_FLAGS)),
    st.one_of(good_secrets, good_secrets, bad_secrets),
    max_size=4,
)
secret_names = st.one_of(
    st.sampled_from(sorted(server_secrets.SECRET_FLAGS)),
    st.sampled_from(
        [
            "hf_token",
            "HF_TOKEN",
            "db_password",
            "s3-secret-key",
            "apikey",
            "x_key",
            "accessToken",
            "secretAccessKey",
            "Authorization",
            "passphrase",
        ]
    ),
    st.builds(
        lambda a, w, b: f"{a}_{w}_{b}".strip("_"),
        st.from_regex(r"[a-z]{0,5}", fullmatch=True),
        st.sampled_from(sorted(server_secrets.SECRET_WORDS)),
        st.from_regex(r"[a-z]{0,5}", fullmatch=True),
    ),
)


def text_of(value: Any) -> str:
    return json.dumps(value, default=str)


@given(secret_fields, st.dictionaries(secret_names, good_secrets, max_size=2), st.booleans())
def test_no_secret_leaves_the_secrets_file(
    fields: dict[str, Any], named: dict[str, str], as_env: bool
) -> None:
    layer = {"env": {k.upper(): v for k, v in named.items()}} if as_env else {"flags": named}
    instance = kimi(**fields, **layer)
    values = [str(v) for v in [*fields.values(), *named.values()] if MARK in str(v)]
    try:
        [server] = describe_servers([instance], {}, {}, {}, runtime=RUNTIME)
    except ServerConfigError as exc:
        assert exc.variable.startswith("sglang_server_instances[kimi].")
        assert not any(value in str(exc) for value in values), exc
        return
    assert not named  # a flag or variable named like a secret is always refused
    shown = text_of(server)
    assert not any(value in shown for value in values)
    assert server["secrets_set"] == sorted(fields)
    secrets = FILTERS["sglang_server_secrets"]([instance])
    files = FILTERS["sglang_server_secret_files"]([server], secrets)
    if fields:
        [file] = files
        # What SGLang's --config reads back (YAML may quote or escape a value as it writes it).
        written = yaml.safe_load(file["content"])
        assert file["mode"] == "0600"
        assert written == {server_secrets.secrets_file_key(k): v for k, v in fields.items()}
    else:
        assert files == []


flag_values = st.recursive(
    st.one_of(good_secrets, st.integers(), st.booleans(), st.text(max_size=6)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(secret_names, st.text(max_size=6)), inner, max_size=3),
    ),
    max_leaves=8,
)


@given(
    st.dictionaries(st.one_of(secret_names, st.from_regex(r"[a-z_]{1,12}", fullmatch=True)),
                    flag_values, max_size=5)
)  # fmt: skip
def test_check_lines_never_show_a_secret_an_old_record_holds(old_flags: dict[str, Any]) -> None:
    [server] = describe_servers([kimi()], {}, {}, {}, runtime=RUNTIME)
    record = {"config_hash": "old", "flags": old_flags}
    lines = restart_decision.restart_lines([server], ["kimi"], [record], [server["unit"]])
    secrets = _values_under_secret_names(old_flags)
    text = "\n".join(lines)
    assert not any(value in text for value in secrets), (secrets, lines)
    redacted = text_of(server_secrets.redact(old_flags))
    assert not any(value in redacted for value in secrets)
    public = text_of(server_secrets.public_flags(old_flags))
    assert not any(value in public for value in secrets)


def _values_under_secret_names(value: Any, under_secret: bool = False) -> list[str]:
    """Every marked string at or below a key named like a secret."""
    if isinstance(value, dict):
        return [
            found
            for key, item in value.items()
            for found in _values_under_secret_names(
                item, under_secret or server_secrets.is_secret(key)
            )
        ]
    if isinstance(value, list):
        return [found for item in value for found in _values_under_secret_names(item, under_secret)]
    return [value] if under_secret and isinstance(value, str) and MARK in value else []


# --- secrets by value, at every depth (issue 44) ----------------------------------------------

# Keys on the way down to a secret: names that hold no secret.
plain_keys = st.from_regex(r"[a-z][a-z_]{0,9}", fullmatch=True).filter(
    lambda k: not server_secrets.is_secret(k)
)
# One step down: a mapping key, or a list index (the secret is put at that index).
steps = st.lists(st.one_of(plain_keys, st.integers(0, 2)), max_size=6)
FLAG_LAYERS = ("defaults", "profile", "instance", "override", "tuned")


def _nest(steps: list[Any], leaf: Any) -> tuple[Any, str]:
    """(a value holding leaf at the end of steps, the path secrets_in() names for it)."""
    value, path = leaf, ""
    for step in reversed(steps):
        # Beside it, numbers in a list and a number in a mapping: nothing to hide there.
        value = [0] * step + [value] if isinstance(step, int) else {step: value, "_n": 1}
    for step in steps:
        path += f"[{step}]" if isinstance(step, int) else f".{step}"
    return value, path


def _no_mark(*texts: Any) -> bool:
    return not any(
        MARK in (t if isinstance(t, str) else json.dumps(t, default=repr)) for t in texts
    )


def _layered(flag: str, value: Any, layer: str) -> dict[str, Any]:
    """describe_servers' arguments with {flag: value} in one flag layer."""
    flags = {flag: value}
    return {
        "servers": [kimi(profile="p", flags=flags if layer == "instance" else {})],
        "profiles": {"p": flags if layer == "profile" else {}},
        "overrides": {"kimi": {"flags": flags}} if layer == "override" else {},
        "defaults": {"flags": flags} if layer == "defaults" else {},
        "tuned": {"kimi": flags} if layer == "tuned" else None,
    }


# Where a secret goes: the JSON flag, its layer, the way down, the key's name, the secret.
placements = st.tuples(
    st.sampled_from(JSON_FLAGS), st.sampled_from(FLAG_LAYERS), steps, secret_names,
    st.one_of(nasty_secrets, good_secrets),
)  # fmt: skip


@given(placements, st.booleans())
def test_a_secret_at_any_depth_of_any_json_flag_is_refused_by_its_path(
    placement: tuple[str, str, list[Any], str, str], as_text: bool
) -> None:
    flag, layer, path_steps, name, secret = placement
    value, path = _nest(path_steps, {name: secret, "x": 1})
    value = json.dumps(value) if as_text else value  # the docs' form: the flag's JSON text
    layers = _layered(flag, value, layer)
    try:
        [server] = describe_servers(
            layers["servers"], layers["profiles"], layers["overrides"], layers["defaults"],
            runtime=RUNTIME, tuned=layers["tuned"],
        )  # fmt: skip
    except ServerConfigError as exc:
        assert exc.variable.endswith(f".{flag}{path}.{name}"), (exc.variable, path)
        assert _no_mark(str(exc)), exc
        return
    shown = [server, server["exec_start"], server["argv"], server["env_lines"],
             [file.get("content") for file in server["files"]]]  # fmt: skip
    raise AssertionError(f"not refused; leaked: {not _no_mark(*shown)}")


@given(
    st.sampled_from(JSON_FLAGS),
    steps,
    st.sampled_from(["url", "endpoint", "master_server_address", "uri"]),
    st.one_of(nasty_secrets, good_secrets).map(lambda s: urllib.parse.quote(s, safe="")),
    st.sampled_from(["redis", "http", "https", "s3", "tcp"]),
)
def test_a_credential_in_a_url_at_any_depth_is_refused(
    flag: str, path_steps: list[Any], key: str, password: str, scheme: str
) -> None:
    value, path = _nest(path_steps, {key: f"{scheme}://user:{password}@cache-1:6379/0"})
    try:
        describe_servers([kimi(flags={flag: value})], {}, {}, {}, runtime=RUNTIME)
    except ServerConfigError as exc:
        assert exc.variable.endswith(f".{flag}{path}.{key}") and _no_mark(str(exc)), exc
        return
    raise AssertionError("a URL with user:password@ was not refused")


@given(
    st.from_regex(r"[A-Z][A-Z0-9_]{0,12}", fullmatch=True).filter(
        lambda k: not server_secrets.is_secret(k) and k not in ("CUDA_VISIBLE_DEVICES",)
    ),
    steps,
    secret_names,
    nasty_secrets.filter(lambda s: "\x00" not in s),
)
def test_a_secret_in_an_env_values_json_is_refused(
    variable: str, path_steps: list[Any], name: str, secret: str
) -> None:
    value, path = _nest(path_steps, {name: secret})
    try:
        describe_servers([kimi(env={variable: json.dumps(value)})], {}, {}, {}, runtime=RUNTIME)
    except ServerConfigError as exc:
        assert _no_mark(str(exc)), exc
        if not exc.variable.endswith(f".env.{variable}"):  # refused for a reason of its own
            assert exc.variable.endswith(f".env.{variable}{path}.{name}"), exc.variable
        return
    raise AssertionError("an env value with a secret in its JSON was not refused")


records = st.recursive(
    st.one_of(good_secrets, nasty_secrets, st.integers(), st.booleans(), st.none()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(secret_names, plain_keys), inner, max_size=3),
        # JSON text of a mapping, as SGLang's JSON flags take it and a record may hold it.
        st.dictionaries(st.one_of(secret_names, plain_keys), inner, max_size=3).map(json.dumps),
    ),
    max_leaves=10,
)


def _marked(value: Any, under_secret: bool = False) -> list[tuple[str, bool]]:
    """Every marked text and whether it is a secret by the rule: under a secret's name, JSON
    text read as its value."""
    if isinstance(value, str):
        if value.lstrip()[:1] in ("{", "["):
            try:
                return _marked(json.loads(value), under_secret)
            except ValueError:
                pass
        return [(value, under_secret)] if MARK in value else []
    if isinstance(value, dict):
        return [
            found
            for key, item in value.items()
            for found in _marked(item, under_secret or server_secrets.is_secret(key))
        ]
    if isinstance(value, list):
        return [found for item in value for found in _marked(item, under_secret)]
    return []


def _marked_secrets(value: Any) -> list[str]:
    """The marked secrets of value that no text shown on purpose holds (a marked value under a
    plain name is shown: finding a secret inside it would say nothing)."""
    found = _marked(value)
    public = [text for text, secret in found if not secret]
    return [text for text, secret in found if secret and not any(text in p for p in public)]


@given(st.dictionaries(st.one_of(secret_names, plain_keys), records, max_size=4), records)
def test_a_shown_record_holds_no_secret_at_any_depth(flags: dict[str, Any], other: Any) -> None:
    record = {"config_hash": "old", "api_key_set": True, "flags": flags, "hf_token": MARK,
              "smoke_result": other}  # fmt: skip
    secrets = _marked_secrets(record)
    for shown in (server_secrets.public_record(record),
                  server_secrets.public_record(record, name_secret_flags=True)):  # fmt: skip
        text = json.dumps(shown)
        assert not any(json.dumps(s)[1:-1] in text for s in secrets), (secrets, shown)
        assert shown["api_key_set"] is True and shown["config_hash"] == "old"
    [server] = describe_servers([kimi()], {}, {}, {}, runtime=RUNTIME)
    lines = "\n".join(
        restart_decision.restart_lines([server], ["kimi"], [record], [server["unit"]])
    )
    assert not any(s in lines or json.dumps(s)[1:-1] in lines for s in secrets), lines


@given(nasty_secrets, st.sampled_from(["Authorization", "X-Api-Key", "Cookie"]))
def test_a_header_is_sent_as_written_or_refused_by_name_never_quoted(
    secret: str, header: str
) -> None:
    with socket.socket() as sock:  # a port nobody listens on: refused at once, nothing waits
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    try:
        fleet_http.request(f"http://127.0.0.1:{port}/x", headers={header: f"Bearer {secret}"},
                           deadline_s=2)  # fmt: skip
    except fleet_http.HttpError as exc:
        assert _no_mark(str(exc), exc.reason), exc
        sendable = all(c == "\t" or " " <= c <= "~" for c in secret)
        assert exc.code == ("unreachable" if sendable else "bad_header"), exc
        return
    raise AssertionError("a closed port answered")


@given(nasty_secrets, st.sampled_from([repr, json.dumps, str, lambda s: repr(s.encode())]),
       st.integers(0, 400))  # fmt: skip
def test_a_routers_answer_is_quoted_without_any_key_it_echoes(
    secret: str, written: Any, padding: int
) -> None:
    """The router's error body quoted (cut at 300 characters) with the key in any written form:
    the key comes out before the cut, so not even a part of it is left."""
    router = load_plugin("plugins/modules/sglang_router_workers.py")

    def send(url: str, **_kwargs: Any) -> fleet_http.Response:
        body = "x" * padding + f"refused {written(secret)} and {written('rk-' + secret)}"
        return fleet_http.Response(400, "Bad Request", {}, body.encode("utf-8", "replace"))

    client = router.RouterClient("http://r:30000", "rk-" + secret, 3.0, send, hidden=(secret,))
    try:
        client.add_worker("http://gpu-1:8000", secret)
    except router.RouterError as exc:
        assert _no_mark(client.safe(exc)), exc
        return
    raise AssertionError("a 400 was not an error")


@given(st.dictionaries(st.one_of(secret_names, plain_keys), records, min_size=1, max_size=3))
def test_the_routers_extra_flags_never_carry_a_secret(extra: dict[str, Any]) -> None:
    settings = {"workers": ["http://gpu-1:8000"], "port": 30000, "prometheus_port": 29000,
                "version": "0.3.2", "api_key": "", "extra_flags": extra}  # fmt: skip
    problems = "\n".join(settings_problems(settings))
    secrets = _marked_secrets(extra)
    assert not secrets or "sglang_router_extra_flags" in problems, (secrets, problems)
    assert _no_mark(problems), problems
