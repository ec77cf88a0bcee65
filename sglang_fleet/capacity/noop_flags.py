"""Flags the installed SGLang accepts and never reads (docs/SGLANG.md, "Flags that do nothing").

A flag in this table parses, shows up in `server_args=` and `/server_info`, and changes nothing:
setting it is harmless, but tuning it spends trials on noise and reading it in a flag line
misleads whoever diagnoses the server. Each entry lists the versions it was checked in (by
reading the wheel: the field is declared and no module reads it); for another version nothing
is claimed. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NoopFlag:
    default: Any
    versions: tuple[str, ...]
    where: str


NOOP_FLAGS: dict[str, NoopFlag] = {
    "num_continuous_decode_steps": NoopFlag(
        default=1,
        versions=("0.5.23",),
        where="declared in srt/arg_groups/fields/schedule.py, read by no module",
    ),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def noop_flag_issues(
    flags: Mapping[str, Any] | None, sglang_version: str | None = None
) -> list[dict[str, str]]:
    """A `noop_flag` warning for each flag of `flags` set (to a non-default value) that does
    nothing in `sglang_version` (None: the version this project checked, said so)."""
    issues = []
    for name, flag in NOOP_FLAGS.items():
        value = (flags or {}).get(name)
        if value is None or str(value) == str(flag.default):
            continue
        if sglang_version is not None and sglang_version not in flag.versions:
            continue
        version = sglang_version or f"{', '.join(flag.versions)} (the version checked)"
        issues.append(
            {
                "code": "noop_flag",
                "message": f"{_flag(name)} {value} does nothing in SGLang {version}: the flag is "
                f"{flag.where}. Drop it from the flag set; it is not a tuning lever.",
            }
        )
    return issues
