"""The monitoring role's alert rules and Prometheus configuration, checked by promtool.

The rules template is rendered with the role's defaults and a small inventory, then
``promtool check rules`` and ``promtool test rules tests/monitoring/sglang-fleet-rules.test.yml``
run on it (every alert has a case where it fires and one where it must not). The scrape
configuration is rendered from the same inventory and passes ``promtool check config``; no key
is in it. promtool comes from Debian's prometheus package (scripts/ensure-host-tools.sh).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from conftest import load_plugin

from sglang_fleet.monitoring import scrape_targets
from sglang_fleet.monitoring import settings as monitoring_settings

ROOT = Path(__file__).resolve().parent.parent
ROLE = ROOT / "roles" / "monitoring"
TESTS = ROOT / "tests" / "monitoring"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool missing: run scripts/ensure-host-tools.sh (make host)"
)
KEY = "sk-test-never-in-config-7f3a"
FILTERS = load_plugin("plugins/filter/sglang_monitoring.py").FilterModule().filters()

INVENTORY: list[dict[str, Any]] = [
    {
        "name": "gpu1",
        "address": "gpu1",
        "slo_ttft_ms": 500,
        "slo_tpot_ms": 50,
        "servers": [
            {"name": "a", "model_path": "/srv/models/m", "port": 30000, "host": "0.0.0.0"},
            {
                "name": "b",
                "model_path": "/srv/models/m",
                "served_model_name": "m-b",
                "port": 30001,
                "host": "0.0.0.0",
                "api_key": KEY,
            },
        ],
    },
]
INVENTORY += [
    {
        "name": name,
        "address": name,
        "servers": [],
        "router": {
            "workers": ["http://a:1", "http://b:1", "http://c:1"],
            "prometheus_host": "127.0.0.1" if name == "gw1" else "0.0.0.0",
            "prometheus_port": 29000,
        },
    }
    for name in ("gw1", "gw2", "gw3")
]


# The job runner's metrics on the gateway (roles/sglang_job's defaults).
JOB_HOSTS = [
    {
        "name": "gw1",
        "address": "gw1",
        "job": {"metrics_address": "127.0.0.1", "metrics_port": 29100},
    }
]


def role_vars(key_dir: str = "/etc/keys", **change: Any) -> dict[str, Any]:
    """The role's defaults (with `change`) as its pre-flight leaves them: the settings typed
    (_monitoring_settings, as both entry points set it) and the scrape plan."""
    values = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text(encoding="utf-8"))
    values.update(yaml.safe_load((ROLE / "vars" / "main.yml").read_text(encoding="utf-8")))
    values.update(change)
    values["monitoring_host"] = "gw1"
    settings = monitoring_settings.check_settings(
        {name: values[name] for name in monitoring_settings.KNOWN}
    )
    values["_monitoring_settings"] = values["_monitoring_exporter_settings"] = settings
    values["_monitoring_targets"] = scrape_targets.targets(
        values.get("_inventory", INVENTORY),
        "gw1",
        key_dir,
        settings["monitoring_slo_ttft_ms"],
        settings["monitoring_slo_tpot_ms"],
        JOB_HOSTS,
    )
    return values


def render(template: str, values: dict[str, Any]) -> str:
    """A template of the role as Ansible renders it: strict, with the role's filters."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(ROLE / "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    env.filters.update(FILTERS)
    # The templates name the filters by FQCN, as Ansible resolves them (docs/COLLECTION.md).
    env.filters.update({f"sglang_fleet.fleet.{name}": f for name, f in FILTERS.items()})
    return env.get_template(template).render(**values)


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, check=False)


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    (tmp_path / "sglang-fleet-rules.yml").write_text(
        render("sglang-fleet-rules.yml.j2", role_vars()), encoding="utf-8"
    )
    shutil.copy(TESTS / "sglang-fleet-rules.test.yml", tmp_path)
    return tmp_path


@needs_promtool
def test_rules_parse(rules_dir: Path) -> None:
    result = promtool("check", "rules", "sglang-fleet-rules.yml", cwd=rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    # 7 inventory constants (4 SLOs, 3 routers) and 11 alerts.
    assert "SUCCESS: 18 rules found" in result.stdout


@needs_promtool
def test_every_alert_fires_and_stays_quiet_as_its_unit_tests_say(rules_dir: Path) -> None:
    result = promtool("test", "rules", "sglang-fleet-rules.test.yml", cwd=rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_unit_test() -> None:
    rules = yaml.safe_load(render("sglang-fleet-rules.yml.j2", role_vars()))
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    cases = yaml.safe_load((TESTS / "sglang-fleet-rules.test.yml").read_text(encoding="utf-8"))
    fired = {
        t["alertname"]
        for case in cases["tests"]
        for t in case["alert_rule_test"]
        if t["exp_alerts"]
    }
    quiet = {
        t["alertname"]
        for case in cases["tests"]
        for t in case["alert_rule_test"]
        if not t["exp_alerts"]
    }
    assert fired == alerts
    # MonitoringTargetDown's quiet case is the router target that stays up in the same test.
    assert alerts - quiet == {"MonitoringTargetDown", "SGLangRouterWorkersLow"}


def test_slo_constants_come_from_the_host_and_routers_count_their_workers() -> None:
    rules = yaml.safe_load(render("sglang-fleet-rules.yml.j2", role_vars()))
    [group] = rules["groups"]  # one group: the constants are evaluated before the alerts
    constants = [(r["record"], r["expr"], r["labels"]) for r in group["rules"] if "record" in r]
    first_alert = next(i for i, r in enumerate(group["rules"]) if "alert" in r)
    assert all("record" in r for r in group["rules"][:first_alert])
    assert not any("record" in r for r in group["rules"][first_alert:])
    assert ("sglang_fleet:slo_ttft_seconds", "0.5", {"host": "gpu1", "server": "a"}) in constants
    assert ("sglang_fleet:slo_tpot_seconds", "0.05", {"host": "gpu1", "server": "b"}) in constants
    assert ("sglang_fleet:router_workers_expected", "3", {"host": "gw3"}) in constants
    assert len(constants) == 4 + 3


@needs_promtool
def test_scrape_config_passes_promtool_and_holds_no_key(tmp_path: Path) -> None:
    values = role_vars(key_dir=str(tmp_path))
    # promtool checks that the key files exist (the role writes them before the config).
    for item in scrape_targets.server_credentials(INVENTORY, str(tmp_path)):
        Path(item["path"]).write_text(item["key"], encoding="utf-8")
    values["_monitoring_rules_file"] = str(tmp_path / "sglang-fleet-rules.yml")
    (tmp_path / "sglang-fleet-rules.yml").write_text(
        render("sglang-fleet-rules.yml.j2", values), encoding="utf-8"
    )
    text = render("prometheus.yml.j2", values)
    (tmp_path / "prometheus.yml").write_text(text, encoding="utf-8")
    result = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert KEY not in text
    config = yaml.safe_load(text)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["sglang/gpu1/b"]["authorization"] == {"credentials_file": f"{tmp_path}/gpu1@b"}
    assert "authorization" not in jobs["sglang/gpu1/a"]
    assert jobs["sglang/gpu1/b"]["static_configs"][0] == {
        "targets": ["gpu1:30001"],
        "labels": {"host": "gpu1", "server": "b", "model": "m-b"},
    }
    assert [t["targets"] for t in jobs["sglang-router"]["static_configs"]] == [
        ["127.0.0.1:29000"],
        ["gw2:29000"],
        ["gw3:29000"],
    ]
    assert "dcgm" not in jobs
    # The job runner on the job host: one target, no key (its metrics hold no secret).
    assert jobs["sglang-job"] == {
        "job_name": "sglang-job",
        "static_configs": [{"targets": ["127.0.0.1:29100"], "labels": {"host": "gw1"}}],
    }
