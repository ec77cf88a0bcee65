"""Property-based tests of the secrets' one owner (Hypothesis; profiles in conftest.py).

Entry points: describing servers with secret fields and with flags or environment variables
named like secrets (sglang_server_describe), the secrets files (sglang_server_secrets,
sglang_server_secret_files), check mode's "would restart" lines against any old record
(sglang_restart_lines), and redaction of records (server_secrets.redact, public_flags).
Invariants: a secret never appears in a description, an argv, a unit's files, an error
message, a check line or a redacted record; each one is in its server's secrets file; bad input
is a ServerConfigError naming the variable, never another exception.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from test_secrets import FILTERS, RUNTIME, kimi

from sglang_fleet import server_secrets
from sglang_fleet.servers import restart_decision
from sglang_fleet.servers.describe import ServerConfigError, describe_servers

# Every generated secret carries this marker, so "not in the output" cannot pass by chance.
MARK = "Zq7x"
good_secrets = st.from_regex(r"[A-Za-z0-9_.~+/=-]{4,40}", fullmatch=True).map(lambda s: MARK + s)
bad_secrets = st.one_of(
    st.text(max_size=20).map(lambda s: f"{MARK}{s}\n"),
    st.text(max_size=20).map(lambda s: f" {MARK}{s}"),
    st.just(f"-{MARK}"),
    st.just(""),
    st.integers(),
)
secret_fields = st.dictionaries(
    st.sampled_from(sorted(server_secrets.SECRET_FLAGS)),
    st.one_of(good_secrets, good_secrets, bad_secrets),
    max_size=4,
)
secret_names = st.one_of(
    st.sampled_from(sorted(server_secrets.SECRET_FLAGS)),
    st.sampled_from(["hf_token", "HF_TOKEN", "db_password", "s3-secret-key", "apikey", "x_key"]),
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
        assert file["mode"] == "0600" and all(value in file["content"] for value in values)
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
