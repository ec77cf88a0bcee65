"""A server description's values checked one by one: names, keys, secrets, GPUs, device, port,
text and model path, flag and environment values (`ServerConfigError` names the inventory
path to fix). The rules are listed in sglang_fleet/servers/describe.py's docstring.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Mapping
from typing import Any

from sglang_fleet import server_secrets as _secrets

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


OVERRIDE_KEYS = ("flags", "env")
# A flag or variable named like a secret in a flag or env layer (sglang_fleet/server_secrets.py).
SECRET_NAME_RULE = (
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


def checked_mapping(value: Any, variable: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ServerConfigError(variable, f"must be a mapping, got {type(value).__name__}")
    return value


def shown_key(key: Any) -> str:
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


def refuse_secrets_in(value: Any, variable: str, kind: str) -> None:
    """Refuse a value that holds a secret anywhere in it, naming the path to it (never its text)."""
    found = _secrets.secrets_in(value)
    if found:
        path, why = found[0]
        what, where = _REACHES[kind]
        raise ServerConfigError(
            f"{variable}{path}", f"{why}: " + _NESTED_SECRET_RULE.format(what=what, where=where)
        )


def flag_value_problem(value: Any) -> str | None:
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


def env_value_problem(value: Any) -> str | None:
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


def check_name(server: Mapping[str, Any], index: int) -> str:
    name = server.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ServerConfigError(
            f"{SERVERS_VAR}[{index}].name",
            f"{name!r} must be {NAME_RULE} (it names the unit sglang@<name>.service)",
        )
    return name


def check_keys(
    mapping: Mapping[str, Any], where: str, allowed: tuple[str, ...], hint: str = ""
) -> None:
    unknown = sorted(shown_key(key) for key in mapping if key not in allowed)
    if unknown:
        raise ServerConfigError(
            f"{where}.{unknown[0]}", f"unknown key; allowed: {', '.join(allowed)}{hint}"
        )


def check_secrets(server: Mapping[str, Any], where: str) -> list[str]:
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


def check_gpus(value: Any, where: str) -> list[int]:
    variable = f"{where}.gpus"
    if not isinstance(value, list) or not value:
        raise ServerConfigError(variable, "must be a non-empty list of GPU indexes, like [0, 1]")
    for gpu in value:
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise ServerConfigError(variable, f"{gpu!r} is not a GPU index (an integer >= 0)")
    if len(set(value)) != len(value):
        raise ServerConfigError(variable, f"{value} lists a GPU twice")
    return list(value)


def check_device(value: Any, variable: str) -> str:
    if value not in DEVICES:
        raise ServerConfigError(
            variable, f"{value!r} is not a device; allowed: {', '.join(DEVICES)}"
        )
    return str(value)


def check_port(value: Any, where: str) -> int:
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ServerConfigError(f"{where}.port", f"{value!r} is not a port number (1..65535)")
    return value


def check_text(value: Any, variable: str, required: bool) -> str | None:
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


def check_model_path(value: Any, variable: str) -> str:
    """The server's model_path: text a unit file can carry, with no credential in it (a remote
    path's user:password@ would reach argv)."""
    refuse_secrets_in(value, variable, "flag")
    return str(check_text(value, variable, required=True))


def positive_int(flags: Mapping[str, Any], key: str) -> int | None:
    """An int flag value for the tp_size default, or None when it is not one (host_checks says)."""
    value = flags.get(key, 1)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value
