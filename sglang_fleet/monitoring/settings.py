"""The monitoring role's settings, typed before any template prints them (docs/MONITORING.md,
"Settings").

Every monitoring_* variable a template of roles/monitoring prints goes through check_settings()
first; the templates print what it returns, never the variable itself. So a threshold is a
finite number in its range, printed as a number ("1024 or vector(1)" is refused, not pasted into
PromQL); a duration matches Prometheus's duration grammar as a whole string ("5m\\n" is
refused); a port is an integer 1..65535; what reaches a systemd unit line (a command, a folder,
unit patterns, a time span) holds nothing systemd would read as a second line, a specifier or a
word break. Each refusal names the variable and what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from sglang_fleet.module_utils import typed_number
from sglang_fleet.module_utils.fleet_http import HttpError, check_url
from sglang_fleet.module_utils.typed_number import Range


class SettingError(ValueError):
    """A monitoring setting that no template may print; `variable` names it."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable} {message}")
        self.variable = variable
        self.message = message


# An hour of latency is no objective a server is held to; 1 TiB is more than any GPU holds.
MAX_SLO_MS = 3_600_000
NUMBERS: dict[str, Range] = {
    "monitoring_alert_kv_cache_usage": Range(0, 1, low_open=True),
    "monitoring_alert_slo_quantile": Range(0, 1, low_open=True, high_open=True),
    "monitoring_alert_gpu_unowned_mib": Range(0, 1 << 20),
    "monitoring_slo_ttft_ms": Range(0, MAX_SLO_MS, low_open=True),
    "monitoring_slo_tpot_ms": Range(0, MAX_SLO_MS, low_open=True),
}
PORTS = (
    "monitoring_prometheus_port",
    "monitoring_alertmanager_port",
    "monitoring_node_exporter_port",
    "monitoring_dcgm_exporter_port",
)
# Prometheus durations: True where 0 is meaningless (an interval, a window, a retention).
DURATIONS: dict[str, bool] = {
    "monitoring_scrape_interval": True,
    "monitoring_evaluation_interval": True,
    "monitoring_rate_window": True,
    "monitoring_prometheus_retention": True,
    "monitoring_alertmanager_group_wait": False,
    "monitoring_alert_server_down_for": False,
    "monitoring_alert_not_generating_for": False,
    "monitoring_alert_kv_cache_bound_for": False,
    "monitoring_alert_retractions_for": False,
    "monitoring_alert_gpu_unowned_for": False,
    "monitoring_alert_slo_for": False,
    "monitoring_alert_router_workers_for": False,
    "monitoring_alert_job_stalled_for": True,
}
SYSTEMD_SPANS = ("monitoring_gpu_metrics_interval",)
# Folders that reach a unit line or a configuration file: absolute, plain characters.
FOLDERS: dict[str, bool] = {  # True: may be empty (the feature is off)
    "monitoring_textfile_dir": False,
    "monitoring_grafana_dashboards_dir": False,
    "monitoring_grafana_provisioning_dir": True,
}
COMMANDS = ("monitoring_nvidia_smi",)
UNIT_PATTERNS = ("monitoring_gpu_owner_units",)
URL_LISTS = ("monitoring_alertmanager_webhook_urls",)
UNIT_SETTINGS = ("monitoring_prometheus_service_overrides",)

# Prometheus 2.42's duration grammar (common/model.ParseDuration), one unit at most once, in
# this order; "0" alone is a duration too. Capped well below its int64 nanoseconds.
_DURATION = re.compile(
    r"(?:([0-9]+)y)?(?:([0-9]+)w)?(?:([0-9]+)d)?(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?(?:([0-9]+)ms)?"
)
_DURATION_MS = (365 * 86_400_000, 7 * 86_400_000, 86_400_000, 3_600_000, 60_000, 1000, 1)
MAX_DURATION_MS = 10 * 365 * 86_400_000
# systemd.time(7) spans: numbers with units, spaces between; a bare number is seconds.
_SPAN_UNITS = "|".join(
    ("usec", "us", "msec", "ms", "seconds", "second", "sec", "s", "minutes", "minute", "min",
     "m", "hours", "hour", "hr", "h", "days", "day", "d", "weeks", "week", "w")
)  # fmt: skip
_SPAN_PART = rf"[0-9]+(?:\.[0-9]+)?(?:{_SPAN_UNITS})"
_SPAN = re.compile(rf"[0-9]+|{_SPAN_PART}(?: ?{_SPAN_PART})*")
_FOLDER = re.compile(r"/[A-Za-z0-9._+@:/-]*")
_COMMAND = re.compile(r"[A-Za-z0-9._+/-]+")
_UNIT_PATTERN = re.compile(r"[A-Za-z0-9@:._*?\[\]-]+")
_UNIT_SETTING = re.compile(r"[A-Z][A-Za-z0-9]*")


def number(value: Any, variable: str, allowed: Range) -> int | float:
    """value as a number in its range (plugins/module_utils/typed_number.py: an int or float, or a
    string that is one number, as -e gives it); an integral value comes back as an int, so that a
    template prints 80, not 80.0."""
    try:
        found = typed_number.read(value, variable, allowed)
    except typed_number.NumberError as exc:
        raise SettingError(variable, exc.message) from None
    return int(found) if float(found).is_integer() else found


def port(value: Any, variable: str) -> int:
    return int(number(value, variable, Range(1, 65535, integer=True)))


def duration_ms(value: Any, variable: str, positive: bool) -> int:
    """Milliseconds of a Prometheus duration written as a whole string ("30s", "1h30m", "0")."""
    rule = "a Prometheus duration such as 30s, 5m or 1h30m (units y w d h m s ms, in that order)"
    if not isinstance(value, str):
        raise SettingError(variable, f"must be {rule}, got a {type(value).__name__}")
    match = _DURATION.fullmatch(value)
    if value == "0":
        total = 0
    elif value and match:
        total = sum(
            int(n) * ms for n, ms in zip(match.groups(), _DURATION_MS, strict=True) if n is not None
        )
    else:
        raise SettingError(variable, f"must be {rule}, got {value!r}")
    if total > MAX_DURATION_MS:
        raise SettingError(variable, f"must be at most 3650d, got {value!r}")
    if positive and total == 0:
        raise SettingError(variable, f"must be longer than 0, got {value!r}")
    return total


def systemd_span(value: Any, variable: str) -> str:
    rule = "a systemd time span such as 15s, 1min or 2min 30s, longer than 0"
    if not isinstance(value, str) or not _SPAN.fullmatch(value) or not re.search(r"[1-9]", value):
        raise SettingError(variable, f"must be {rule}, got {value!r}")
    return value


def folder(value: Any, variable: str, may_be_empty: bool) -> str:
    if may_be_empty and value in ("", None):
        return ""
    if not isinstance(value, str) or not _FOLDER.fullmatch(value) or "/../" in f"{value}/":
        rule = "an absolute path of letters, digits and . _ + @ : / - (no spaces, no '..')"
        raise SettingError(variable, f"must be {rule}, got {value!r}")
    return value.rstrip("/") or "/"


def command(value: Any, variable: str) -> str:
    if not isinstance(value, str) or not _COMMAND.fullmatch(value) or value.startswith("-"):
        rule = "a command name or path of letters, digits and . _ + / -"
        raise SettingError(variable, f"must be {rule}, got {value!r}")
    return value


def unit_patterns(value: Any, variable: str) -> list[str]:
    rule = "a non-empty list of systemd unit name patterns (letters, digits, @ : . _ - * ? [ ])"
    if not isinstance(value, list | tuple) or not value:
        raise SettingError(variable, f"must be {rule}")
    for item in value:
        if not isinstance(item, str) or not _UNIT_PATTERN.fullmatch(item):
            raise SettingError(variable, f"must be {rule}, got {item!r}")
    return list(value)


def urls(value: Any, variable: str) -> list[str]:
    if not isinstance(value, list | tuple):
        raise SettingError(variable, "must be a list of http(s) URLs")
    for item in value:
        try:
            check_url(item, "a webhook URL")
        except HttpError as exc:
            raise SettingError(variable, f"holds a bad URL: {exc}") from None
    return list(value)


def unit_settings(value: Any, variable: str) -> dict[str, str]:
    """systemd [Service] settings: Name=value lines, each one line of plain text."""
    if not isinstance(value, Mapping):
        raise SettingError(variable, "must be a mapping of systemd [Service] settings")
    settings = {}
    for key, item in value.items():
        if not isinstance(key, str) or not _UNIT_SETTING.fullmatch(key):
            raise SettingError(f"{variable}.{key}", "is not a systemd setting name (PrivateUsers)")
        text = ("true" if item else "false") if isinstance(item, bool) else item
        if not isinstance(text, str | int) or not str(text).isprintable():
            raise SettingError(f"{variable}.{key}", "must be one line of printable text")
        settings[key] = str(text)
    return settings


_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    **{name: (lambda v, n: number(v, n, NUMBERS[n])) for name in NUMBERS},
    **dict.fromkeys(PORTS, port),
    **{name: (lambda v, n: (duration_ms(v, n, DURATIONS[n]), v)[1]) for name in DURATIONS},
    **dict.fromkeys(SYSTEMD_SPANS, systemd_span),
    **{name: (lambda v, n: folder(v, n, FOLDERS[n])) for name in FOLDERS},
    **dict.fromkeys(COMMANDS, command),
    **dict.fromkeys(UNIT_PATTERNS, unit_patterns),
    **dict.fromkeys(URL_LISTS, urls),
    **dict.fromkeys(UNIT_SETTINGS, unit_settings),
}
KNOWN = tuple(_CHECKS)


def check_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """Each setting typed and checked ({name: value}); SettingError names the first bad one.
    A name this module does not know is refused: a template must print only checked values."""
    if not isinstance(values, Mapping):
        raise SettingError("settings", "must be a mapping of monitoring_* variables")
    checked = {}
    for name, value in values.items():
        if name not in _CHECKS:
            raise SettingError(str(name), f"is not a setting this module checks ({len(KNOWN)})")
        checked[name] = _CHECKS[name](value, name)
    return checked
