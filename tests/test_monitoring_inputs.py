"""The monitoring role's inputs, typed before any template (issue 33's hostile cases).

Settings (sglang_fleet/monitoring/settings.py): a threshold that is PromQL text, SLOs of -5, NaN
or 0, a duration with a trailing newline; each refused naming the variable and what is allowed,
and what passes is printed as a number. Names (sglang_fleet/monitoring/scrape_targets.py): two
host/server
pairs that shared a key file before, a served_model_name with an emoji that made prometheus.yml
unparseable, text Prometheus cannot hold, named with its host, server and field.
"""

from __future__ import annotations

import copy
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import run_local_play
from test_monitoring_rules import INVENTORY, PROMTOOL, needs_promtool, render, role_vars

from sglang_fleet.monitoring import scrape_targets
from sglang_fleet.monitoring import settings as monitoring_settings
from sglang_fleet.monitoring.settings import SettingError, check_settings

ROOT = Path(__file__).resolve().parent.parent


# --- thresholds, SLOs and durations ------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("monitoring_alert_gpu_unowned_mib", "1024 or vector(1)", ">= 0 and <= 1048576"),
        ("monitoring_alert_gpu_unowned_mib", -1, ">= 0 and <= 1048576"),
        ("monitoring_alert_kv_cache_usage", math.nan, "> 0 and <= 1"),
        ("monitoring_alert_kv_cache_usage", "inf", "> 0 and <= 1"),
        ("monitoring_alert_slo_quantile", 1, "between 0 and 1 (both excluded)"),
        ("monitoring_alert_slo_quantile", True, "between 0 and 1 (both excluded)"),
        ("monitoring_slo_ttft_ms", -5, "> 0 and <= 3600000"),
        ("monitoring_slo_ttft_ms", 0, "> 0 and <= 3600000"),
        ("monitoring_slo_tpot_ms", "nan", "> 0 and <= 3600000"),
        ("monitoring_prometheus_port", 70000, "from 1 to 65535"),
        ("monitoring_prometheus_port", "9090.5", "from 1 to 65535"),
        ("monitoring_rate_window", "5m\n", "Prometheus duration"),
        ("monitoring_rate_window", "0", "longer than 0"),
        ("monitoring_alert_slo_for", "5 m", "Prometheus duration"),
        ("monitoring_alert_slo_for", "m5", "Prometheus duration"),
        ("monitoring_alert_slo_for", "\u0665m", "Prometheus duration"),
        ("monitoring_alert_slo_for", 300, "Prometheus duration"),
        ("monitoring_alert_slo_for", "99999y", "at most"),
        ("monitoring_gpu_metrics_interval", "15s\nExecStart=/bin/sh", "systemd time span"),
        ("monitoring_textfile_dir", "/var/lib/x y", "absolute path"),
        ("monitoring_textfile_dir", "relative", "absolute path"),
        ("monitoring_nvidia_smi", "nvidia-smi --evil", "command name"),
        ("monitoring_gpu_owner_units", ["sglang@*.service --x"], "unit name patterns"),
        ("monitoring_gpu_owner_units", [], "unit name patterns"),
        ("monitoring_alertmanager_webhook_urls", ["http://u:p@hook"], "bad URL"),
        ("monitoring_prometheus_service_overrides", {"PrivateUsers": "no\nUser=root"}, "one line"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(name: str, value: Any, said: str) -> None:
    with pytest.raises(SettingError) as raised:
        check_settings({name: value})
    assert raised.value.variable.startswith(name) and said in str(raised.value)


def test_good_settings_come_back_typed() -> None:
    checked = check_settings(
        {
            "monitoring_alert_gpu_unowned_mib": "2048",
            "monitoring_alert_kv_cache_usage": "0.85",
            "monitoring_slo_ttft_ms": 1,
            "monitoring_rate_window": "1h30m",
            "monitoring_alert_slo_for": "0",
            "monitoring_gpu_metrics_interval": "2min 30s",
            "monitoring_prometheus_port": "9090",
            "monitoring_textfile_dir": "/var/lib/prometheus/node-exporter/",
        }
    )
    assert checked["monitoring_alert_gpu_unowned_mib"] == 2048
    assert checked["monitoring_alert_kv_cache_usage"] == 0.85
    assert checked["monitoring_prometheus_port"] == 9090
    assert checked["monitoring_rate_window"] == "1h30m"
    assert checked["monitoring_textfile_dir"] == "/var/lib/prometheus/node-exporter"


def test_an_unknown_setting_is_refused() -> None:
    with pytest.raises(SettingError, match="monitoring_alert_typo"):
        check_settings({"monitoring_alert_typo": 1})


def test_the_role_defaults_pass_and_every_checked_name_is_a_role_variable() -> None:
    defaults = yaml.safe_load((ROOT / "roles/monitoring/defaults/main.yml").read_text())
    assert set(monitoring_settings.KNOWN) <= set(defaults)
    check_settings({name: defaults[name] for name in monitoring_settings.KNOWN})


def test_a_threshold_given_as_text_is_rendered_as_a_number() -> None:
    rules = render("sglang-fleet-rules.yml.j2", role_vars(monitoring_alert_gpu_unowned_mib="2048"))
    [group] = yaml.safe_load(rules)["groups"]
    [held] = [r for r in group["rules"] if r.get("alert") == "GPUMemoryHeldWithoutServer"]
    assert held["expr"] == "sglang_fleet_gpu_unowned_memory_mib > 2048"


def test_promql_text_as_a_threshold_never_reaches_the_rules() -> None:
    with pytest.raises(SettingError, match="monitoring_alert_gpu_unowned_mib"):
        role_vars(monitoring_alert_gpu_unowned_mib="1024 or vector(1)")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        (
            "monitoring_alert_gpu_unowned_mib",
            "1024 or vector(1)",
            "must be a number >= 0 and <= 1048576",
        ),
        ("monitoring_rate_window", "5m\n", "must be a Prometheus duration"),
    ],
)
def test_the_role_refuses_it_before_any_host_is_touched(
    tmp_path: Path, name: str, value: str, said: str
) -> None:
    """Through Ansible: the pre-flight's filter fails the play naming the variable (the old
    assert let "5m\\n" through: `$` matches before a trailing newline)."""
    play = {
        "hosts": "localhost",
        "gather_facts": False,
        "vars": {"monitoring_host": "localhost", "monitoring_scrape_hosts": [], name: value},
        "tasks": [
            {
                "name": "Pre-flight",
                "ansible.builtin.include_role": {"name": "monitoring", "tasks_from": "preflight"},
            }
        ],
    }
    done = run_local_play(tmp_path, play)
    assert done.returncode != 0
    assert f"monitoring: {name} {said}" in done.stdout


@pytest.mark.parametrize("slo", [-5, math.nan, 0, "0", "fast", True, [1]])
def test_a_hosts_smoke_gate_slo_is_a_number_in_range(slo: Any) -> None:
    """-5 fired always, NaN never, and 0 silently meant the default."""
    host = {
        "name": "gpu1",
        "address": "gpu1",
        "slo_ttft_ms": slo,
        "servers": INVENTORY[0]["servers"],
    }
    with pytest.raises(scrape_targets.MonitoringError) as raised:
        scrape_targets.slo_seconds([host], 2000, 100)
    message = str(raised.value)
    assert "host gpu1: smoke_gate_workload.slo_ttft_ms" in message
    assert "> 0 and <= 3600000" in message


@pytest.mark.parametrize("unset", [None, ""])
def test_an_unset_host_slo_is_the_default(unset: Any) -> None:
    host = {
        "name": "gpu1",
        "address": "gpu1",
        "slo_ttft_ms": unset,
        "servers": INVENTORY[0]["servers"],
    }
    [row, _] = scrape_targets.slo_seconds([host], 2000, 100)
    assert row["ttft"] == 2.0 and row["tpot"] == 0.1


# --- names: key files one-to-one, label values any text ----------------------------------------


def test_two_pairs_that_shared_a_key_file_now_differ() -> None:
    """host 'a--b' with server 'c' and host 'a' with server 'b--c' were both 'a--b--c'."""
    hosts = [
        {"name": "a--b", "address": "a-b", "servers": [{"name": "c", "port": 1, "host": "0.0.0.0",
                                                        "model_path": "/m", "api_key": "K1"}]},
        {"name": "a", "address": "a", "servers": [{"name": "b--c", "port": 1, "host": "0.0.0.0",
                                                   "model_path": "/m", "api_key": "K2"}]},
    ]  # fmt: skip
    paths = [item["path"] for item in scrape_targets.server_credentials(hosts, "/k")]
    assert len(set(paths)) == 2
    plan = scrape_targets.targets(hosts, "gw", "/k", 2000, 100)
    assert [s["credentials_file"] for s in plan["servers"]] == paths


@pytest.mark.parametrize(
    ("host", "server"),
    [("gpu-node-01", "llama"), ("../etc", "x"), ("a/b", "c"), ("a@b", "c"), ("a%40b", "c"),
     (".", "x"), ("ünï", "x")],
)  # fmt: skip
def test_a_key_file_name_stays_in_its_folder_and_reads_back(host: str, server: str) -> None:
    from urllib.parse import unquote  # noqa: PLC0415

    name = scrape_targets.key_file_name(host, server)
    assert "/" not in name and name not in (".", "..")
    encoded_host, _, encoded_server = name.partition("@")
    assert (unquote(encoded_host), unquote(encoded_server)) == (host, server)


def test_a_readable_host_keeps_a_readable_key_file_name() -> None:
    assert scrape_targets.key_file_name("gpu-node-01.lan", "llama") == "gpu-node-01.lan@llama"


def test_a_host_name_too_long_for_a_file_is_refused_naming_it() -> None:
    with pytest.raises(scrape_targets.MonitoringError, match="too long for a key file name"):
        scrape_targets.key_file_name("h" * 300, "llama")


def emoji_vars(tmp_path: Path, served: str) -> dict[str, Any]:
    inventory = copy.deepcopy(INVENTORY)
    inventory[0]["servers"][0]["served_model_name"] = served
    values = role_vars(key_dir=str(tmp_path), _inventory=inventory)
    for item in scrape_targets.server_credentials(inventory, str(tmp_path)):
        Path(item["path"]).write_text(item["key"], encoding="utf-8")
    values["_monitoring_rules_file"] = str(tmp_path / "rules.yml")
    (tmp_path / "rules.yml").write_text(render("sglang-fleet-rules.yml.j2", values))
    return values


@pytest.mark.parametrize("served", ["llama-\U0001f999", "m\u2028\u00e9\ufeff\u00a0", "a: b # c"])
def test_any_served_model_name_reads_back_from_prometheus_yml(tmp_path: Path, served: str) -> None:
    text = render("prometheus.yml.j2", emoji_vars(tmp_path, served))
    jobs = {job["job_name"]: job for job in yaml.safe_load(text)["scrape_configs"]}
    assert jobs["sglang/gpu1/a"]["static_configs"][0]["labels"]["model"] == served


@needs_promtool
def test_prometheus_parses_a_served_model_name_with_an_emoji(tmp_path: Path) -> None:
    (tmp_path / "prometheus.yml").write_text(
        render("prometheus.yml.j2", emoji_vars(tmp_path, "llama-\U0001f999")), encoding="utf-8"
    )
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, "check", "config", "prometheus.yml"], cwd=tmp_path,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        (
            "served_model_name",
            "m\ud83d",
            "server 'a' on gpu1: served_model_name is not valid UTF-8",
        ),
        ("served_model_name", "m\nx", "server 'a' on gpu1: served_model_name holds a control"),
        ("served_model_name", ["m"], "server 'a' on gpu1: served_model_name must be text"),
        ("port", "30000 or x", "server 'a' on gpu1: port must be an integer from 1 to 65535"),
        ("port", 0, "server 'a' on gpu1: port must be an integer from 1 to 65535"),
    ],
)
def test_text_prometheus_cannot_hold_names_host_server_and_field(
    field: str, value: Any, said: str
) -> None:
    inventory = copy.deepcopy(INVENTORY)
    inventory[0]["servers"][0][field] = value
    with pytest.raises(scrape_targets.MonitoringError) as raised:
        scrape_targets.targets(inventory, "gw1", "/k", 2000, 100)
    assert said in str(raised.value)


@pytest.mark.parametrize("address", ["gpu1 evil", "gpu1\n- x", "", "a:b:c:z"])
def test_a_bad_scrape_address_is_refused_naming_host_and_field(address: str) -> None:
    inventory = copy.deepcopy(INVENTORY)
    inventory[0]["address"] = address
    with pytest.raises(
        scrape_targets.MonitoringError, match="host gpu1: monitoring_scrape_address"
    ):
        scrape_targets.targets(inventory, "gw1", "/k", 2000, 100)


def test_an_ipv6_scrape_address_is_bracketed_in_its_targets() -> None:
    inventory = copy.deepcopy(INVENTORY)
    inventory[0]["address"] = "fd00::7"
    plan = scrape_targets.targets(inventory, "gw1", "/k", 2000, 100)
    assert plan["servers"][0]["target"] == "[fd00::7]:30000"
    assert plan["nodes"][0]["address"] == "[fd00::7]"


def test_a_host_listed_twice_is_refused() -> None:
    with pytest.raises(scrape_targets.MonitoringError, match="listed twice"):
        scrape_targets.targets([INVENTORY[0], INVENTORY[0]], "gw1", "/k", 2000, 100)


@pytest.mark.skipif(shutil.which("amtool") is None, reason="amtool missing")
def test_alertmanager_config_with_a_webhook_passes_amtool(tmp_path: Path) -> None:
    values = role_vars(monitoring_alertmanager_webhook_urls=["http://hook.lan:8080/a?b=c"])
    (tmp_path / "am.yml").write_text(render("alertmanager.yml.j2", values), encoding="utf-8")
    done = subprocess.run([shutil.which("amtool") or "", "check-config", "am.yml"], cwd=tmp_path,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
