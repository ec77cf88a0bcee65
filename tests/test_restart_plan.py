"""sglang_fleet.servers.restart_decision: what check mode says a rollout would do, flag by flag."""

from __future__ import annotations

from sglang_fleet.servers.restart_decision import flag_changes, restart_lines


def server(name: str, **flags: object) -> dict:
    return {"name": name, "unit": f"sglang@{name}.service", "flags": {"model_path": "/m", **flags}}


def test_a_changed_flag_shows_its_old_and_new_launch_words():
    old = {"model_path": "/m", "chunked_prefill_size": 8192, "tp_size": 2}
    new = {"model_path": "/m", "chunked_prefill_size": 4096, "tp_size": 2}
    assert flag_changes(old, new) == [
        "- --chunked-prefill-size 8192",
        "+ --chunked-prefill-size 4096",
    ]


def test_added_removed_and_switch_flags_render_as_the_launch_line_does():
    old = {"model_path": "/m", "enable_metrics": True, "max_running_requests": 64}
    new = {"model_path": "/n", "enable_metrics": False, "json_model_override_args": {"a": 1}}
    assert flag_changes(old, new) == [
        "- --model-path /m",
        "+ --model-path /n",
        "- --enable-metrics",
        '+ --json-model-override-args {"a":1}',
        "- --max-running-requests 64",
    ]


def test_spellings_of_the_same_flag_and_omitted_values_are_no_change():
    old = {"model_path": "/m", "tp-size": 2, "disable_radix_cache": False}
    new = {"model_path": "/m", "tp_size": 2, "disable_radix_cache": None}
    assert flag_changes(old, new) == []


def test_a_value_that_looks_like_a_flag_stays_a_value():
    old = {"model_path": "/m", "served_model_name": "--x"}
    new = {"model_path": "/m", "served_model_name": "--y"}
    assert flag_changes(old, new) == ["- --served-model-name --x", "+ --served-model-name --y"]


def test_restart_lines_say_why_each_server_would_restart():
    servers = [
        server("a", chunked_prefill_size=4096),
        server("b"),
        server("c"),
        server("d"),
        server("e"),
    ]
    records = [
        {"flags": {"model_path": "/m", "chunked_prefill_size": 8192}},
        {"flags": {"model_path": "/m"}},
        None,
        {"flags": {"model_path": "/m"}},
        {"flags": {"model_path": "/m"}},
    ]
    running = ["sglang@a.service", "sglang@b.service", "sglang@c.service", "sglang@e.service"]
    lines = restart_lines(servers, ["a", "c", "d", "e"], records, running)
    assert lines == [
        "a: would restart (2 flag line(s) differ from its last-known-good configuration)",
        "  - --chunked-prefill-size 8192",
        "  + --chunked-prefill-size 4096",
        "b: unchanged",
        "c: would restart (no last-known-good record yet)",
        "d: would restart (not running)",
        "e: would restart (its unit, environment, secrets or logging changed; same flags)",
    ]


def test_restart_lines_name_an_sglang_upgrade_with_or_without_flag_changes():
    upgraded = {**server("a"), "sglang_version": "0.5.23"}
    both = {**server("b", chunked_prefill_size=4096), "sglang_version": "0.5.23"}
    same = {**server("c"), "sglang_version": "0.5.23"}
    records = [
        {"flags": {"model_path": "/m"}, "sglang_version": "0.5.22"},
        {"flags": {"model_path": "/m", "chunked_prefill_size": 8192}, "sglang_version": "0.5.22"},
        {"flags": {"model_path": "/m"}, "sglang_version": "0.5.23"},
    ]
    running = ["sglang@a.service", "sglang@b.service", "sglang@c.service"]
    lines = restart_lines([upgraded, both, same], ["a", "b", "c"], records, running)
    assert lines == [
        "a: would restart (SGLang 0.5.22 -> 0.5.23, same flags)",
        "b: would restart (SGLang 0.5.22 -> 0.5.23; 2 flag line(s) differ from its"
        " last-known-good configuration)",
        "  - --chunked-prefill-size 8192",
        "  + --chunked-prefill-size 4096",
        "c: would restart (its unit, environment, secrets or logging changed; same flags)",
    ]
