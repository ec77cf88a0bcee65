"""Every secret an SGLang server takes, and the one rule for what counts as one.

Facts: docs/ARCHITECTURE.md, "Secrets".

One list, one owner. Each SGLang flag that carries a secret is a field of the server's
description of the same name (`api_key`, `admin_api_key`, ...), never a flag layer's key: it goes
to the server's root-only secrets file, which systemd hands the unit as a credential and SGLang
reads with `--config` (sglang_fleet/servers/secret_files.py). So it is in no argv, no unit file, no
environment file and no printed description. Environment variables that hold a secret (a hub
token) are refused in `env` layers for the same reason: the environment file is world-readable
and the description is printed.

A secret is found by value, not by place (secrets_in()): a value under a key named like a secret
at any depth of a flag's value (the mapping SGLang reads as JSON, or the JSON text itself), and a
text that carries a credential by itself (a URL's user:password@, a bearer token). SGLang's
--config cannot hold one key of a JSON flag (it passes a nested mapping on as Python text, and
the command line's value replaces the file's whole), so such a secret has no safe place in a
flag: servers/flag_layers.py refuses it, naming the path to the key.

Everything that shows or stores flags (the check-mode "would restart" lines, last-known-good
records and their diffs, calibration records) passes them through public_flags(), redact() or
public_record() first, which apply the same rule, so a record written before a rule existed
shows no secret either.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from typing import Any

from sglang_fleet.module_utils.bounded_json import TooDeep
from sglang_fleet.module_utils.bounded_json import loads as bounded_loads

# SGLang 0.5.23's flags (its parser: gpusim/gpusim/flags/sglang-0.5.23.json) that carry a secret,
# by ServerArgs name. tests/test_secrets.py reads the parser and fails on any flag named like a
# secret (SECRET_WORDS) that is on neither this list nor NOT_SECRET_FLAGS.
SECRET_FLAGS: dict[str, str] = {
    "api_key": "the server's API key (clients send it as a bearer token)",
    "admin_api_key": "the key of SGLang's admin endpoints",
    "ssl_keyfile_password": "the password that decrypts --ssl-keyfile",
    # SGLang itself answers '<redacted>' for it in /server_info: it holds the watermark keys.
    "watermark_config": "the watermark settings, keys included",
}
# Flags whose name has one of SECRET_WORDS but which carry no secret, each with why.
NOT_SECRET_FLAGS: dict[str, str] = {
    "bucket_time_to_first_token": "histogram buckets (seconds)",
    "bucket_inter_token_latency": "histogram buckets (seconds)",
    "speculative_token_map": "a path to the draft model's vocabulary table",
    "tbo_token_distribution_threshold": "a ratio",
    "kt_max_deferred_experts_per_token": "a count",
    "prefill_delayer_token_usage_low_watermark": "a ratio",
    "ssl_keyfile": "a path to the key file (root-only on the host); its password is secret",
}
# Environment variables that hold a secret: refused in env layers (never in a unit's files).
SECRET_ENV: dict[str, str] = {
    "HF_TOKEN": "a Hugging Face token",
    "HUGGING_FACE_HUB_TOKEN": "a Hugging Face token (huggingface_hub's older name)",
}
# A name made of these words (split on '_', '-', '.', spaces and camelCase; any case) looks like
# a secret.
SECRET_WORDS = frozenset({"key", "token", "secret", "secrets", "password", "passwd", "apikey",
                          "credential", "credentials", "passphrase", "authorization", "bearer",
                          "cookie"})  # fmt: skip
# ...and so does one that contains one of these anywhere (the rule records were redacted by, and
# names written as one word: accesskey, authtoken).
SECRET_PARTS = ("api_key", "apikey", "secret", "password", "passwd", "hf_token", "privatekey",
                "accesskey", "accesstoken", "authtoken", "sessiontoken")  # fmt: skip
# Runs of words that name a number, an id or a shape, not a secret: the Hugging Face config keys
# json_model_override_args overrides (eos_token_id, stop_token_ids, image_token_index,
# num_key_value_heads). A name is judged by its other words. A key nested in a flag's value that
# holds no secret but is refused goes here, with the setting it belongs to.
HARMLESS_PHRASES = (
    ("token", "id"),
    ("token", "ids"),
    ("token", "index"),
    ("key", "value", "heads"),
)
# What a redacted value reads as: SGLang's own word for it in /server_info.
REDACTED = "<redacted>"
# Deeper than this, a value is not checked but refused (describe) or redacted whole (shown): no
# flag SGLang reads nests more than a handful of levels.
MAX_DEPTH = 32

_SPLIT = re.compile(r"[_\-\s.]+")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
# A bearer token written out ("Bearer abc..."): an Authorization header's value.
_BEARER = re.compile(r"(?i)\bbearer[ \t]+[^\s]")
# A quoted key followed by ':' in text that is not JSON (a JSON flag's value with a typo, a
# Python dict's repr): each match starts at a quote and stops at the next one, so linear.
_QUOTED_KEY = re.compile(r"""["']([^"'\\\n]*)["']\s*:""")
# Where a URL's authority ends (RFC 3986 3.2): the next '/', '?' or '#', or white space.
_AUTHORITY_END = re.compile(r"[/?#\s]")


def normalized(name: object) -> str:
    """A flag or variable name as compared here: lower case, '-' as '_'."""
    return str(name).strip().lower().replace("-", "_")


def _words(name: object) -> list[str]:
    """The words of a name: split on '_', '-', '.', spaces and camelCase, lower case."""
    text = _CAMEL.sub("_", str(name).strip())
    return [word for word in _SPLIT.split(text.lower()) if word]


def _without_harmless(words: list[str]) -> list[str]:
    kept: list[str] = []
    index = 0
    while index < len(words):
        phrase = next(
            (p for p in HARMLESS_PHRASES if tuple(words[index : index + len(p)]) == p), None
        )
        if phrase:
            index += len(phrase)
        else:
            kept.append(words[index])
            index += 1
    return kept


def named_like_a_secret(name: object) -> bool:
    """Whether a name looks like it holds a secret (the test's rule for SGLang's parser, and the
    rule for keys at any depth of a flag's value)."""
    words = _words(name)
    if any(part in "_".join(words) for part in SECRET_PARTS):
        return True
    return bool(set(_without_harmless(words)) & SECRET_WORDS)


def is_secret(name: object) -> bool:
    """Whether a flag, variable or key named so is treated as a secret: listed, or named like one
    and not listed as harmless. Unknown names that look secret are secret (redacted, refused)."""
    norm = normalized(name)
    if norm in SECRET_FLAGS or norm.upper() in SECRET_ENV:
        return True
    return norm not in NOT_SECRET_FLAGS and named_like_a_secret(name)


def _holds_something(value: Any) -> bool:
    """Whether a value under a secret's name has anything to hide: a switch, a null or an empty
    text has not (`use_api_key: true`); any other value has, numbers included (YAML reads an
    unquoted numeric key as a number)."""
    if value is None or isinstance(value, bool):
        return False
    if isinstance(value, str | Mapping | list | tuple):
        return len(value) > 0
    return True


def _url_with_credentials(text: str) -> bool:
    """Whether text holds a URL with user:password@ (or a token@) in its authority. Linear: each
    '://' starts one scan, which ends at the next '/', so no two scans overlap."""
    start = text.find("://")
    while start != -1:
        end = _AUTHORITY_END.search(text, start + 3)
        authority = text[start + 3 : end.start() if end else len(text)]
        if "@" in authority:
            return True
        start = text.find("://", start + 3)
    return False


def _text_problem(text: str) -> str | None:
    """Why a text carries a credential by itself, or None."""
    if _url_with_credentials(text):
        return "holds a URL with user:password@ (a credential in a URL)"
    if _BEARER.search(text):
        return "holds a bearer token"
    return None


def _json_text(text: str, depth: int) -> tuple[bool, Any]:
    """(True, its value) for text SGLang would read as a JSON object or array; (False, None) for
    other text. Big integers are kept as text (never the 4,300-digit error); too deep raises."""
    if text.lstrip()[:1] not in ("{", "["):
        return False, None
    try:
        return True, bounded_loads(text, "a flag value", MAX_DEPTH - depth, parse_int=str)
    except TooDeep:
        raise
    except ValueError:
        return False, None


def _quoted_secret_keys(text: str) -> list[str]:
    """Keys named like a secret in JSON-like text that is not JSON ('{"api_key": "x",}')."""
    return [m.group(1) for m in _QUOTED_KEY.finditer(text) if is_secret(m.group(1))]


def _shown_key(key: Any) -> str:
    """A key in a path: itself when printable ASCII, else its repr."""
    text = str(key)
    return text if text.isprintable() and text.isascii() else repr(key)


def secrets_in(value: Any, path: str = "", depth: int = 0) -> list[tuple[str, str]]:
    """Where value holds a secret, at every depth: (path, why) pairs, path like '.s3.secret_key'
    or '[0]' ('' for value itself). The one rule: a value with something in it under a key
    named like a secret (is_secret()), a text with a credential in it (a URL's user:password@,
    a bearer token), JSON text read as its value; deeper than MAX_DEPTH nothing can be ruled
    out, so that is a finding too."""
    if depth > MAX_DEPTH:
        return [(path, f"is nested deeper than {MAX_DEPTH} levels: no secret can be ruled out")]
    if isinstance(value, Mapping):
        found = []
        for key, item in value.items():
            where = f"{path}.{_shown_key(key)}"
            if is_secret(key) and _holds_something(item):
                found.append((where, "is named like a secret"))
            else:
                found += secrets_in(item, where, depth + 1)
        return found
    if isinstance(value, list | tuple):
        return [
            hit for index, item in enumerate(value)
            for hit in secrets_in(item, f"{path}[{index}]", depth + 1)
        ]  # fmt: skip
    if isinstance(value, str):
        return _text_secrets(value, path, depth)
    return []


def _text_secrets(text: str, path: str, depth: int) -> list[tuple[str, str]]:
    try:
        is_json, parsed = _json_text(text, depth)
    except TooDeep:
        return [(path, f"is nested deeper than {MAX_DEPTH} levels: no secret can be ruled out")]
    if is_json:
        return secrets_in(parsed, path, depth + 1)
    problem = _text_problem(text)
    if problem:
        return [(path, problem)]
    return [(f"{path}.{_shown_key(key)}", "is named like a secret") for key in
            _quoted_secret_keys(text)]  # fmt: skip


def redact(value: Any, depth: int = 0) -> Any:
    """A copy of value with every secret (secrets_in()'s rule) replaced by REDACTED: the value of
    a key named like a secret, nested mappings and lists too; a text that holds one (JSON text
    with such a key, a URL with user:password@, a bearer token) whole; past MAX_DEPTH levels the
    rest whole."""
    if depth > MAX_DEPTH:
        return REDACTED
    if isinstance(value, Mapping):
        return {
            key: REDACTED if is_secret(key) and _holds_something(item) else redact(item, depth + 1)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(item, depth + 1) for item in value]
    if isinstance(value, str) and secrets_in(value, depth=depth):
        return REDACTED
    return value


def public_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """A flag set with every secret flag left out and every secret below redacted (redact()):
    what a record, a result or a diff may show or store. The one rule for records, at every
    depth (calibration records, last-known-good records, autotune's state)."""
    if not isinstance(flags, Mapping):
        return {}
    return {str(k): redact(v) for k, v in flags.items() if not is_secret(k)}


def public_record(record: Mapping[str, Any], *, name_secret_flags: bool = False) -> dict[str, Any]:
    """A last-known-good record as it may be shown: its flags through public_flags() (with
    name_secret_flags, redact(): a secret flag stays, reading <redacted>, so check mode can say
    it changed), every other field through redact(); api_key_set and secrets_set kept while
    they hold what they name (a boolean; names of SECRET_FLAGS)."""
    shown: dict[str, Any] = {}
    for key, value in record.items():
        if key == "flags" and isinstance(value, Mapping):
            shown[key] = redact(dict(value)) if name_secret_flags else public_flags(value)
        elif key == "api_key_set" and isinstance(value, bool):
            shown[key] = value
        elif key == "secrets_set" and _secret_names(value):
            shown[key] = list(value)
        else:
            shown[key] = redact({key: value})[key]
    return shown


def _secret_names(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(name, str) and name in SECRET_FLAGS for name in value
    )


def secrets_file_key(field: str) -> str:
    """The key a secret takes in the secrets file SGLang's --config reads: the flag's dashes."""
    return field.replace("_", "-")


def server_secrets(servers: Any) -> dict[str, dict[str, str]]:
    """{server name: {secret field: value}} of the servers that have any: what the secrets files
    hold. Only no_log tasks read it (the role's vars/main.yml)."""
    if not isinstance(servers, list):
        return {}
    found: dict[str, dict[str, str]] = {}
    for server in servers:
        if not isinstance(server, Mapping) or not isinstance(server.get("name"), str):
            continue
        values = {
            field: str(server[field])
            for field in SECRET_FLAGS
            if server.get(field) not in (None, "")
        }
        if values:
            found[server["name"]] = values
    return found


def refuse_key_in_argv(
    parser: argparse.ArgumentParser, instead: str, top: argparse.ArgumentParser | None = None
) -> None:
    """--api-key on a command line fails without echoing its value (a command line is visible
    to every user of the host); the message says what to use `instead`. Arguments argparse does
    not know are not echoed either (`--api-k SECRET` would be): the error names none of them.
    `top`: the parser that reports unknown arguments, when `parser` is a subcommand's. The
    parsers must not take abbreviations, or --api-key would be read as --api-key-file."""

    class RefuseKeyInArgv(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, *_args: Any, **_kwargs: Any) -> None:
            parser.error(
                "--api-key is not accepted: a command line is visible to every user of the "
                f"host; use {instead}"
            )

    parser.add_argument("--api-key", nargs="?", action=RefuseKeyInArgv, help=argparse.SUPPRESS)
    for each in {id(p): p for p in (parser, top or parser)}.values():
        report = each.error

        def error(message: str, report: Any = report) -> Any:
            if message.startswith("unrecognized arguments"):
                message = "unrecognized arguments (not shown: one may be a secret); see --help"
            return report(message)

        each.error = error  # type: ignore[method-assign]
