"""The flag and environment layers of a server description, each checked, and how they combine
(later wins, nested mappings key by key, null removes; sglang_fleet/servers/describe.py,
"Precedence").
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from sglang_fleet import server_secrets as _secrets
from sglang_fleet.servers.launch_line import normalize_key
from sglang_fleet.servers.server_values import (
    ENV_NAME_RE,
    MANAGED_ENV,
    MANAGED_FLAGS,
    PROFILES_VAR,
    SECRET_NAME_RULE,
    ServerConfigError,
    checked_mapping,
    env_value_problem,
    flag_value_problem,
    refuse_secrets_in,
    shown_key,
)


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


def flag_layer(value: Any, variable: str) -> dict[str, Any]:
    """A flag mapping with keys in ServerArgs spelling; managed keys and bad values refused."""
    layer: dict[str, Any] = {}
    for key, item in checked_mapping(value, variable).items():
        try:
            norm = normalize_key(key)
        except ValueError as exc:
            raise ServerConfigError(f"{variable}.{shown_key(key)}", str(exc)) from None
        if norm in MANAGED_FLAGS:
            raise ServerConfigError(
                f"{variable}.{key}", f"is set by the server's own field: use {MANAGED_FLAGS[norm]}"
            )
        if _secrets.is_secret(norm):
            raise ServerConfigError(f"{variable}.{key}", SECRET_NAME_RULE)
        if norm in layer:
            raise ServerConfigError(f"{variable}.{key}", f"repeats flag {norm} (same flag)")
        # Before the value's own checks: they quote a bad value, and walk it without a bound.
        refuse_secrets_in(item, f"{variable}.{key}", "flag")
        problem = flag_value_problem(item)
        if problem:
            raise ServerConfigError(f"{variable}.{key}", problem)
        layer[norm] = item
    return layer


def env_layer(value: Any, variable: str) -> dict[str, Any]:
    layer = dict(checked_mapping(value, variable))
    for key, item in layer.items():
        if not isinstance(key, str) or not ENV_NAME_RE.fullmatch(key):
            raise ServerConfigError(
                f"{variable}.{shown_key(key)}",
                "is not an environment variable name (letters, digits, '_', no leading digit)",
            )
        if key in MANAGED_ENV:
            raise ServerConfigError(
                f"{variable}.{key}", f"is set from the server's {MANAGED_ENV[key]}"
            )
        if _secrets.is_secret(key):
            raise ServerConfigError(f"{variable}.{key}", SECRET_NAME_RULE)
        refuse_secrets_in(item, f"{variable}.{key}", "env")
        problem = env_value_problem(item)
        if problem:
            raise ServerConfigError(f"{variable}.{key}", problem)
    return layer


def flag_origins(layers: list[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    """Which variable set each top-level flag last (for messages that say what to edit)."""
    origins: dict[str, str] = {}
    for variable, layer in layers:
        for key, value in layer.items():
            if value is None:
                origins.pop(key, None)
            else:
                origins[key] = f"{variable}.{key}"
    return origins


def profile_layer(
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
    return profile, flag_layer(profiles[profile], f"{PROFILES_VAR}.{profile}")
