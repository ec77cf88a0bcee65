"""Every secret an SGLang server takes, and the one rule for what counts as one.

Facts: docs/ARCHITECTURE.md, "Secrets".

One list, one owner. Each SGLang flag that carries a secret is a field of the server's
description of the same name (`api_key`, `admin_api_key`, ...), never a flag layer's key: it goes
to the server's root-only secrets file, which systemd hands the unit as a credential and SGLang
reads with `--config` (sglang_fleet/servers/describe.py). So it is in no argv, no unit file, no
environment file and no printed description. Environment variables that hold a secret (a hub
token) are refused in `env` layers for the same reason: the environment file is world-readable
and the description is printed.

Everything that shows flags (the check-mode "would restart" lines, last-known-good records and
their diffs, calibration records) passes them through redact() or public_flags() first, so a
record written before a flag moved here shows no secret either.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

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
# A name made of these words (split on '_' or '-', any case) looks like a secret.
SECRET_WORDS = frozenset({"key", "token", "secret", "secrets", "password", "passwd", "apikey",
                          "credential", "credentials"})  # fmt: skip
# ...and so does one that contains one of these anywhere (the rule records were redacted by).
SECRET_PARTS = ("api_key", "apikey", "secret", "password", "passwd", "hf_token")
# What a redacted value reads as: SGLang's own word for it in /server_info.
REDACTED = "<redacted>"

_SPLIT = re.compile(r"[_\-\s.]+")


def normalized(name: object) -> str:
    """A flag or variable name as compared here: lower case, '-' as '_'."""
    return str(name).strip().lower().replace("-", "_")


def named_like_a_secret(name: object) -> bool:
    """Whether a name looks like it holds a secret (the test's rule for SGLang's parser)."""
    norm = normalized(name)
    words = set(_SPLIT.split(norm))
    return bool(words & SECRET_WORDS) or any(part in norm for part in SECRET_PARTS)


def is_secret(name: object) -> bool:
    """Whether a flag or variable named so is treated as a secret: listed, or named like one
    and not listed as harmless. Unknown names that look secret are secret (redacted, refused)."""
    norm = normalized(name)
    if norm in SECRET_FLAGS or norm.upper() in SECRET_ENV:
        return True
    return norm not in NOT_SECRET_FLAGS and named_like_a_secret(norm)


def redact(value: Any, depth: int = 0) -> Any:
    """A copy of value with every mapping entry named like a secret replaced by REDACTED (nested
    mappings and lists too; past 32 levels the rest is REDACTED whole)."""
    if depth > 32:
        return REDACTED
    if isinstance(value, Mapping):
        return {
            key: REDACTED if is_secret(key) else redact(item, depth + 1)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(item, depth + 1) for item in value]
    return value


def public_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """A flag set with every secret flag left out and nested secrets redacted: what a record,
    a result or a diff may show."""
    if not isinstance(flags, Mapping):
        return {}
    return {str(k): redact(v) for k, v in flags.items() if not is_secret(k)}


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
