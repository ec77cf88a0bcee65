"""Property-based tests of the monitoring role's entry points (Hypothesis; profiles in conftest.py).

Entry points: the settings filter (sglang_monitoring_settings), the scrape plan and key files
(sglang_scrape_targets, sglang_monitoring_credentials), the templates they feed
(prometheus.yml, the rules, alertmanager.yml), and the nvidia-smi textfile reader. Invariants,
for any input: a clean error that names the input, or a correct result, never another
exception; every rendered file parses (YAML by yaml.safe_load, the rules and the scrape
configuration by promtool when it is installed, the textfile by prometheus_client's parser);
what went in as a label comes back out unchanged; no key is in any rendered file; no two
servers share a key file, and none leaves the key folder.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from test_monitoring_rules import FILTERS, render, role_vars
from test_monitoring_targets import load_reader

from sglang_fleet.monitoring import scrape_targets
from sglang_fleet.monitoring import settings as monitoring_settings

PROMTOOL = shutil.which("promtool")
# promtool costs a process per example: those tests take a fifth of the profile's examples.
FEW = max(3, settings().max_examples // 5)

# --- strategies --------------------------------------------------------------------------------

DURATION_UNITS = ("y", "w", "d", "h", "m", "s", "ms")
durations = st.lists(
    st.tuples(st.integers(0, 400), st.sampled_from(DURATION_UNITS)), min_size=0, max_size=3
).map(lambda parts: "".join(f"{n}{u}" for n, u in parts))
hostile_text = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        [
            "5m\n",
            "1024 or vector(1)",
            "nan",
            "-5",
            "0",
            "1e309",
            "",
            " ",
            "0x10",
            "15s\nExecStart=/bin/sh",
            "{a: b}",
            "%n",
            "../x",
            "/tmp/a b",
        ]
    ),
)
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    hostile_text,
    durations,
    st.lists(hostile_text, max_size=3),
    st.dictionaries(hostile_text, hostile_text, max_size=2),
)
setting_values = st.dictionaries(st.sampled_from(monitoring_settings.KNOWN), anything, max_size=6)

label_text = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1,
    max_size=20,
)
# Text Prometheus can hold (no control characters): what a legal inventory may name.
printable_text = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=20)
# Names built from a few shared pieces, so that different pairs often spell alike ("a--b" + "c"
# and "a" + "b--c"), plus names that are hard to quote or to use as a file name.
pieces = st.lists(st.sampled_from(["a", "b", "c", "-", "--", "0"]), min_size=1, max_size=4)
server_names = st.one_of(
    pieces.map("".join).filter(lambda n: n[0] != "-"),
    st.from_regex(r"[a-z0-9][a-z0-9-]{0,8}", fullmatch=True),
)
tricky_names = st.sampled_from(["a--b", "llama-\U0001f999", "x@y", "%41", "..", "a/b", "ü", "1:2"])
host_names = st.one_of(
    pieces.map("".join),
    tricky_names,
    st.from_regex(r"[a-z][a-z0-9.-]{0,12}", fullmatch=True),
    label_text,
)
legal_host_names = st.one_of(
    pieces.map("".join),
    tricky_names,
    st.from_regex(r"[a-z][a-z0-9.-]{0,12}", fullmatch=True),
    printable_text,
)


@st.composite
def inventories(draw: st.DrawFn, hostile: bool = True) -> list[dict[str, Any]]:
    """Scraped hosts as the pre-flight gathers them. Names are any text either way (quoting is
    what is tested); hostile=True adds bad ports, addresses and SLOs, which must be refused."""
    ports = st.one_of(st.integers(1, 65535), anything) if hostile else st.integers(1, 65535)
    text = st.one_of(tricky_names, label_text if hostile else printable_text)
    text_or_none = st.one_of(st.none(), text)
    good_slo = st.one_of(st.none(), st.floats(0.001, 3_600_000))
    slo = st.one_of(good_slo, st.just(""), st.floats(), st.integers(-10, 10**7), hostile_text)
    hosts = []
    names = host_names if hostile else legal_host_names
    for name in draw(st.lists(names, min_size=1, max_size=3, unique=True)):
        servers = [
            {
                "name": server,
                "model_path": draw(st.one_of(st.just("/srv/models/m"), text)),
                "served_model_name": draw(text_or_none),
                "port": draw(ports),
                "host": "0.0.0.0",
                "api_key": draw(st.one_of(st.none(), st.just(f"sk-secret-{server}-77f1"))),
            }
            for server in draw(st.lists(server_names, max_size=2, unique=True))
        ]
        addresses = [st.just("10.0.0.7"), st.just("fd00::1"), st.just("gpu.lan")]
        if hostile:
            addresses += [st.just(name), label_text]
        hosts.append({"name": name, "address": draw(st.one_of(*addresses)), "servers": servers,
                      "slo_ttft_ms": draw(slo if hostile else good_slo),
                      "slo_tpot_ms": draw(slo if hostile else good_slo)})  # fmt: skip
    return hosts


# --- settings ----------------------------------------------------------------------------------


@given(setting_values)
def test_settings_are_typed_or_refused_naming_the_variable(values: dict[str, Any]) -> None:
    try:
        checked = FILTERS["sglang_monitoring_settings"](values)
    except AnsibleFilterError as exc:
        assert any(f"monitoring: {name}" in str(exc) for name in values), exc
        return
    assert checked.keys() == values.keys()
    for name, value in checked.items():
        if name in monitoring_settings.NUMBERS:
            assert isinstance(value, int | float) and not isinstance(value, bool)
            assert math.isfinite(value) and monitoring_settings.NUMBERS[name].holds(value)
        if name in monitoring_settings.DURATIONS:
            assert monitoring_settings._DURATION.fullmatch(value) or value == "0"
        if name in monitoring_settings.PORTS:
            assert isinstance(value, int) and 1 <= value <= 65535


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "monitoring_alert_kv_cache_usage": st.floats(0.001, 1),
            "monitoring_alert_slo_quantile": st.floats(0.001, 0.999),
            "monitoring_alert_gpu_unowned_mib": st.one_of(
                st.integers(0, 1 << 20), st.integers(0, 1 << 20).map(str)
            ),
            "monitoring_rate_window": durations.filter(lambda d: d and any(c != "0" for c in d)),
            "monitoring_alert_slo_for": durations.map(lambda d: d or "0"),
            "monitoring_slo_ttft_ms": st.floats(0.001, 3_600_000),
        },
    )
)
@settings(max_examples=FEW)
def test_accepted_settings_render_rules_that_parse(values: dict[str, Any]) -> None:
    try:
        rendered = render("sglang-fleet-rules.yml.j2", role_vars(**values))
    except monitoring_settings.SettingError as exc:  # e.g. a generated duration past 10y
        assert exc.variable in values
        return
    rules = yaml.safe_load(rendered)
    assert rules["groups"][0]["rules"]
    if PROMTOOL is None:
        pytest.skip("promtool missing: rules parsed as YAML only")
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "rules.yml").write_text(rendered, encoding="utf-8")
        done = subprocess.run([PROMTOOL, "check", "rules", "rules.yml"], cwd=folder,
                              capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, (values, done.stdout + done.stderr)


# --- the scrape plan, key files and prometheus.yml ---------------------------------------------


def plan_or_error(hosts: list[dict[str, Any]], key_dir: str) -> dict[str, Any] | None:
    """The plan, or None after checking the error names a host (and a server or field)."""
    try:
        return FILTERS["sglang_scrape_targets"](hosts, "gw", key_dir, 2000, 100)
    except AnsibleFilterError as exc:
        message = str(exc)
        assert message.startswith("monitoring: "), message
        names = [str(h["name"]) for h in hosts]
        assert any(name in message for name in names) or "host" in message, message
        return None


@given(inventories())
def test_a_hostile_inventory_is_planned_or_refused_naming_the_host(
    hosts: list[dict[str, Any]],
) -> None:
    plan = plan_or_error(hosts, "/k")
    if plan is not None:
        assert len(plan["nodes"]) == len(hosts)


@given(inventories(hostile=False))
@example(
    [
        {"name": "a--b", "address": "10.0.0.7", "slo_ttft_ms": None, "slo_tpot_ms": None,
         "servers": [{"name": "c", "model_path": "/m", "served_model_name": "llama-\U0001f999",
                      "port": 1, "host": "0.0.0.0", "api_key": "sk-secret-c-77f1"}]},
        {"name": "a", "address": "gpu.lan", "slo_ttft_ms": 0.5, "slo_tpot_ms": None,
         "servers": [{"name": "b--c", "model_path": "/m", "served_model_name": None,
                      "port": 2, "host": "0.0.0.0", "api_key": "sk-secret-b--c-77f1"}]},
    ]
)  # fmt: skip
def test_a_legal_inventory_is_planned_one_to_one_and_reads_back(
    hosts: list[dict[str, Any]],
) -> None:
    """Any legal inventory (names of any printable text) is planned, never refused; its key
    files are one per server inside the key folder; every label reads back unchanged."""
    key_dir = "/etc/prometheus/sglang-keys"
    try:
        plan = FILTERS["sglang_scrape_targets"](hosts, "gw", key_dir, 2000, 100)
    except AnsibleFilterError as exc:
        assert "too long for a key file name" in str(exc)
        return
    files = [s["credentials_file"] for s in plan["servers"] if s["credentials_file"]]
    assert len(files) == len(set(files))
    assert all(Path(f).parent == Path(key_dir) and ".." not in Path(f).parts for f in files)
    creds = FILTERS["sglang_monitoring_credentials"](hosts, key_dir)
    assert sorted(c["path"] for c in creds) == sorted(files)
    values = role_vars(key_dir=key_dir)
    values["_monitoring_targets"] = plan
    text = render("prometheus.yml.j2", values)
    for host in hosts:
        for server in host["servers"]:
            if server["api_key"]:
                assert server["api_key"] not in text
    config = yaml.safe_load(text)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for server in plan["servers"]:
        labels = jobs[f"sglang/{server['host']}/{server['server']}"]["static_configs"][0]["labels"]
        assert labels == {
            "host": server["host"],
            "server": server["server"],
            "model": server["model"],
        }
    rules = yaml.safe_load(render("sglang-fleet-rules.yml.j2", values))
    constants = [r for r in rules["groups"][0]["rules"] if r.get("record")]
    for row in plan["slos"]:
        assert 0 < row["ttft"] <= 3600 and 0 < row["tpot"] <= 3600
        assert {"host": row["host"], "server": row["server"]} in [
            c.get("labels") for c in constants
        ]


@given(inventories(hostile=False))
@settings(max_examples=FEW)
def test_promtool_reads_every_scrape_config_the_role_renders(hosts: list[dict[str, Any]]) -> None:
    if PROMTOOL is None:
        pytest.skip("promtool missing")
    with tempfile.TemporaryDirectory() as folder:
        plan = plan_or_error(hosts, folder)
        assume(plan is not None)
        assert plan is not None
        for item in scrape_targets.server_credentials(hosts, folder):
            Path(item["path"]).write_text(item["key"], encoding="utf-8")
        values = role_vars(key_dir=folder)
        values["_monitoring_targets"] = plan
        values["_monitoring_rules_file"] = f"{folder}/rules.yml"
        (Path(folder) / "rules.yml").write_text(render("sglang-fleet-rules.yml.j2", values))
        (Path(folder) / "prometheus.yml").write_text(render("prometheus.yml.j2", values))
        done = subprocess.run([PROMTOOL, "check", "config", "prometheus.yml"], cwd=folder,
                              capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, (hosts, done.stdout + done.stderr)


@given(host_names, server_names, host_names, server_names)
@example("a--b", "c", "a", "b--c")  # both were a--b--c (issue 33)
def test_key_file_names_never_collide(h1: str, s1: str, h2: str, s2: str) -> None:
    try:
        a, b = scrape_targets.key_file_name(h1, s1), scrape_targets.key_file_name(h2, s2)
    except scrape_targets.MonitoringError as exc:
        assert "too long" in str(exc)
        return
    assert (a == b) == ((h1, s1) == (h2, s2))
    assert "/" not in a and a not in (".", "..")


@given(st.text())
def test_yaml_strings_read_back_or_are_refused(text: str) -> None:
    try:
        quoted = FILTERS["sglang_yaml_string"](text)
    except AnsibleFilterError:
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in text)
        return
    assert "\n" not in quoted and yaml.safe_load(f"v: {quoted}") == {"v": text}


# --- the nvidia-smi textfile reader ------------------------------------------------------------

READER = load_reader()
process_names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30)


@given(st.lists(st.tuples(st.integers(1, 4_000_000), process_names, st.integers(0, 99_000)),
                max_size=4))  # fmt: skip
def test_the_reader_writes_a_textfile_that_parses_or_says_it_failed(
    apps: list[tuple[int, str, int]],
) -> None:
    """nvidia-smi's CSV as it prints it (no quoting) with any process name: the textfile
    parses; a reading that worked names every process as it was, one that did not says 0."""
    gpus = "0, GPU-0, 90000, 97887, 50\n"
    lines = "".join(f"{pid}, GPU-0, {name}, {used}\n" for pid, name, used in apps)

    def query(_nvidia_smi: str, kind: str, _fields: list[str]) -> str:
        return gpus if kind == "gpu" else lines

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "gpu.prom"
        original, READER.query = READER.query, query
        try:
            code = READER.main(["--output", str(out), "--proc", folder])
        finally:
            READER.query = original
        text = out.read_text(encoding="utf-8")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [success] = families["sglang_fleet_gpu_scrape_success"].samples
    if code != 0:
        assert success.value == 0 and len(families) == 1
        return
    assert success.value == 1
    names = [s.labels["process"] for s in families["sglang_fleet_gpu_process_memory_mib"].samples]
    expected = [READER.nvidia_smi_parser().parse_value(n) for _, n, _ in apps]
    assert names == ["" if n is None else str(n) for n in expected]
