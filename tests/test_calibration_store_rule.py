"""The store's one rule covers the whole record (issue 44, items 2, 4 and 6).

A record's `key` (its fraction, dtype, sizes, GPU memory, versions, flags) anchors every
prediction. It is checked by the same rule as the measured figures, on write and on read: what
the reader sets aside is refused on write, and what the reader keeps plans like a record just
built, so a damaged entry can never refuse a flag set. Every number in a record, a log line or
/server_info is read through typed_number (a reason, never OverflowError). Records already in the
0644 store are cleaned of secrets on the next write.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from kimi_job import GPU, KIMI_LOG, KIMI_RUN_FLAGS
from sglang_fleet.module_utils.typed_number import shown
from test_calibrate_action import ARGS, STORE, FakeCalibrate, kimi_host

from sglang_fleet.capacity import (
    calibration_apply,
    calibration_match,
    calibration_record,
    calibration_rule,
    calibration_store,
    planner,
)
from sglang_fleet.capacity.calibration import CalibrationError
from sglang_fleet.capacity.model_config import model_shape, read_model_dir

FIXTURES = Path(__file__).resolve().parent / "fixtures"
KIMI_DIR = FIXTURES / "models" / "kimi-k2.5-int4"
KIMI_CONFIG, KIMI_WEIGHTS = read_model_dir(KIMI_DIR)
KIMI = model_shape(KIMI_CONFIG)
KEY = {
    "model_config": KIMI_CONFIG,
    "weight_bytes": KIMI_WEIGHTS,
    "gpu_name": GPU,
    "gpu_memory_mib": 97887,
    "sglang_version": "0.5.23",
    "flags": KIMI_RUN_FLAGS,
    "server": "kimi",
    "recorded_at": "2026-11-29T10:05:00Z",
}
GOOD = calibration_record.build_record(KIMI_LOG, None, KEY)
HOST = {
    "gpu_name": GPU,
    "gpu_memory_mib": 97887,
    "sglang_version": "0.5.23",
    "model_fingerprint": GOOD["key"]["model_fingerprint"],
    "architecture": KIMI.architecture,
}
AT_088 = dict(KIMI_RUN_FLAGS, mem_fraction_static=0.88)
HUGE = 10**400

# (field of the key, damaged value, what the rule says)
DAMAGED_KEYS = [
    ("mem_fraction_static", None, "key.mem_fraction_static is missing"),
    (
        "mem_fraction_static",
        "0.85",
        "key.mem_fraction_static must be a number between 0 and 1 (both excluded)",
    ),
    ("mem_fraction_static", True, "key.mem_fraction_static must be"),
    ("mem_fraction_static", HUGE, "got a 401-digit integer"),
    ("mem_fraction_static", 1.5, "got 1.5"),
    ("mem_fraction_static", 0.0, "got 0.0"),
    ("mem_fraction_static", -0.5, "got -0.5"),
    ("mem_fraction_static", [0.85], "got a list"),
    # In range, but not the fraction these figures were measured at.
    ("mem_fraction_static", 0.5, "leaves -23.06 GiB for the KV pool"),
    ("mem_fraction_static", 0.8, "leaves 5.19 GiB for the KV pool"),
    ("kv_cache_dtype", "fp3", "key.kv_cache_dtype 'fp3' has no known cell size"),
    ("kv_cache_dtype", 5, "key.kv_cache_dtype 5 has no known cell size"),
    ("tp_size", 0, "key.tp_size must be an integer from 1 to 4096, got 0"),
    ("tp_size", -8, "got -8"),
    ("tp_size", HUGE, "got a 401-digit integer"),
    ("tp_size", 8.5, "got 8.5"),
    ("tp_size", 1e30, "got 1e+30"),
    ("tp_size", "8", "got the text '8'"),
    ("tp_size", True, "got True"),
    ("dp_size", 0, "key.dp_size must be an integer"),
    ("attn_dp_size", -1, "key.attn_dp_size must be an integer"),
    ("page_size", 0, "key.page_size must be an integer"),
    ("page_size", HUGE, "key.page_size must be an integer"),
    ("chunked_prefill_size", -5, "key.chunked_prefill_size must be an integer from -1 to "),
    ("max_running_requests", 0, "key.max_running_requests must be an integer from 1 to "),
    ("cuda_graph_max_bs_decode", HUGE, "key.cuda_graph_max_bs_decode must be an integer"),
    ("context_length", HUGE, "key.context_length must be an integer"),
    ("max_total_tokens", -1, "key.max_total_tokens must be an integer"),
    ("gpu_memory_mib", HUGE, "key.gpu_memory_mib must be a number > 0 and <= 1e+12"),
    ("gpu_memory_mib", -1, "key.gpu_memory_mib must be a number > 0 and <= 1e+12"),
    ("gpu_memory_mib", "x", "key.gpu_memory_mib must be a number > 0 and <= 1e+12"),
    ("device", "tpu", "key.device must be one of cuda, cpu, got 'tpu'"),
    ("gpu_name", 5, "key.gpu_name must be text"),
    ("sglang_version", HUGE, "key.sglang_version must be text"),
    ("model_fingerprint", ["sha256:0"], "key.model_fingerprint must be text"),
    ("flags", "tp_size=8", "key.flags must be a mapping of flag names"),
    ("flags", [1], "key.flags must be a mapping of flag names"),
    ("flags", {"x": float("nan")}, "no JSON the store can hold"),
]


def damaged(field: str, value: Any) -> dict[str, Any]:
    record = copy.deepcopy(GOOD)
    record["key"][field] = value
    return record


def _store(*records: dict[str, Any]) -> str:
    return json.dumps(calibration_store.dump_store(records))


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    DAMAGED_KEYS,
    ids=[f"{field}={shown(value, 12)}" for field, value, _ in DAMAGED_KEYS],
)
def test_a_damaged_key_is_set_aside_on_read_and_refused_on_write(
    field: str, value: Any, problem: str
) -> None:
    record = damaged(field, value)
    assert problem in (calibration_rule.record_problem(record) or ""), (
        calibration_rule.record_problem(record)
    )
    # Read: set aside and named, the good record kept.
    read = calibration_store.read_store([GOOD, record])
    assert read.records == [GOOD]
    assert [s.entry for s in read.set_aside] == [1] and problem in read.problems()
    # Write: refused, and the record step keeps what it had.
    with pytest.raises(CalibrationError, match="would not be read back"):
        calibration_store.add_record([GOOD], record)
    update = calibration_store.store_update(_store(GOOD), record, "/s/calibration.json", "kimi")
    assert update["store"]["records"] == [GOOD]
    assert "this start's record is not kept" in update["warning"]
    # Planning: never an exception, never a refusal resting on the damaged record.
    for given in ([record], record, _store(record)):
        applied = calibration_apply.apply(given, AT_088, HOST, KIMI)
        assert applied.record is None and applied.errors == [], applied
        assert "no calibration usable" in applied.reason
        # As text, a NaN is no JSON: the whole file is set aside.
        assert problem in applied.reason or "not JSON (NaN" in applied.reason


def test_a_damaged_fraction_no_longer_refuses_a_flag_set_the_good_record_passes() -> None:
    """0.88 passes on the good record (8.2 GiB predicted free); the same record with its
    fraction damaged to 0.5 predicted a negative free memory and refused it (the issue's 'a
    damaged but accepted record refuses a flag set')."""
    assert calibration_apply.apply([GOOD], AT_088, HOST, KIMI).errors == []
    applied = calibration_apply.apply([damaged("mem_fraction_static", 0.5)], AT_088, HOST, KIMI)
    assert applied.errors == [] and applied.prediction is None


def test_a_record_handed_over_as_data_passes_the_rule_too() -> None:
    """apply() read only text through the store's rule: a list of records planned with a
    measured figure the reader sets aside (free after graphs 0: 0.88 refused)."""
    bad = copy.deepcopy(GOOD)
    bad["measured"]["free_after_graph_gib"] = True
    applied = calibration_apply.apply([bad], AT_088, HOST, KIMI)
    assert applied.errors == [] and applied.record is None
    assert "measured.free_after_graph_gib is True, not a finite number" in applied.reason


def test_match_names_an_entry_that_is_no_record() -> None:
    record, reason = calibration_match.match([5, GOOD], AT_088, HOST)
    assert record == GOOD
    record, reason = calibration_match.match([5, "x"], AT_088, HOST)
    assert record is None and "no record (JSON int)" in reason


@pytest.mark.parametrize(
    ("where", "value", "problem"),
    [
        ("pre_gib", HUGE, "measured.pre_gib is a 401-digit integer, outside -1..4096"),
        ("max_total_num_tokens", 10**30, "measured.max_total_num_tokens is a 31-digit integer"),
        ("max_total_num_tokens", 149800.5, "measured.max_total_num_tokens 149800 is not a whole"),
        ("context_len", "262144", "measured.context_len is '262144', not a finite number"),
    ],
    ids=["pre_gib-huge", "tokens-31-digits", "tokens-fraction", "context-text"],
)
def test_measured_figures_are_typed(where: str, value: Any, problem: str) -> None:
    record = copy.deepcopy(GOOD)
    record["measured"][where] = value
    assert problem in (calibration_rule.record_problem(record) or ""), (
        calibration_rule.record_problem(record)
    )


def test_big_integers_in_the_store_are_named_not_raised() -> None:
    """JSON allows integers of any size; the reader ran float() and math.isfinite() on them
    (OverflowError) in the store, the planner and the record step."""
    text = _store(GOOD).replace('"gpu_memory_mib": 97887.0', f'"gpu_memory_mib": {"9" * 400}')
    read = calibration_store.read_store(text)
    assert read.records == []
    assert "key.gpu_memory_mib must be a number > 0 and <= " in read.problems()
    assert "a 400-digit integer" in read.problems()
    update = calibration_store.store_update(text, GOOD, "/s/calibration.json", "kimi")
    assert update["store"]["records"] == [GOOD]
    # Past Python's 4,300 digits JSON itself cannot be read: the whole file is set aside.
    text = _store(GOOD).replace('"gpu_memory_mib": 97887.0', f'"gpu_memory_mib": {"9" * 5000}')
    read = calibration_store.read_store(text)
    assert read.records == [] and read.problems().startswith("the whole file: not JSON")


def test_a_log_of_figures_past_any_number_records_nothing_and_says_why() -> None:
    """A line whose figure no SGLang prints is skipped (server_log); what the other lines give
    is a record the rule accepts, or a CalibrationError that says which lines were skipped."""
    for old, new, problem in (
        ("avail mem=", "avail mem=9" + "9" * 400, "hold figures no SGLang prints"),
        ("#tokens: 149800", "#tokens: " + "9" * 400, None),
        ("#tokens: 149800", "#tokens: " + "9" * 5000, None),
    ):
        log = KIMI_LOG.replace(old, new)
        if problem is None:
            assert (
                calibration_rule.record_problem(calibration_record.build_record(log, None, KEY))
                is None
            )
            continue
        with pytest.raises(CalibrationError, match=problem):
            calibration_record.build_record(log, None, KEY)


@pytest.mark.parametrize(
    "info",
    [
        {"internal_states": 7},
        {"internal_states": [{"memory_usage": {"weight": HUGE, "kvcache": float("nan")}}]},
        {"internal_states": [{"memory_usage": {"graph": {"a": HUGE}, "token_capacity": 1e300}}]},
        {"max_total_num_tokens": HUGE, "mem_fraction_static": float("inf"), "version": [1]},
    ],
)
def test_server_info_of_any_shape_gives_a_record_or_a_calibration_error(info: dict) -> None:
    try:
        record = calibration_record.build_record("", info, KEY)
    except CalibrationError:
        return
    assert calibration_rule.record_problem(record) is None


def test_the_planner_command_line_plans_past_a_damaged_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--calibration FILE` with entries whose key holds a huge integer, a wrong-shaped flag
    set or a damaged fraction: exit 0 (before: an OverflowError traceback, or a refusal, exit
    1), the entries named in calibration_set_aside."""
    text = _store(
        damaged("tp_size", HUGE),
        damaged("flags", "x"),
        damaged("mem_fraction_static", 0.5),
        damaged("page_size", 10**30),
    )
    store = tmp_path / "calibration.json"
    store.write_text(text, encoding="utf-8")
    argv = ["--model-path", str(KIMI_DIR), "--tp-size", "8", "--mem-fraction-static", "0.88",
            "--gpu-memory-mib", "97887", "--calibration", str(store), "--json"]  # fmt: skip
    assert planner.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    aside = result["details"]["calibration_set_aside"]
    assert len(aside) == 4 and "a 401-digit integer" in aside[0], aside
    assert result["errors"] == []
    # The good record plans as before.
    store.write_text(_store(GOOD), encoding="utf-8")
    assert planner.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["details"]["calibrated"] is True


def test_a_store_of_more_entries_than_any_store_holds_is_set_aside_whole() -> None:
    read = calibration_store.read_store("[" + ", ".join(["1"] * 5000) + "]")
    assert read.records == [] and "5000 entries, more than a store holds" in read.problems()
    read = calibration_store.read_store([1] * 20)
    assert len(read.set_aside) == 20 and read.problems().endswith("; and 12 more")


# --- secrets in records already stored ------------------------------------------------------
SECRETS = ("pw-old-secret-1", "hf_nested_secret_2", "sk-json-text-secret-3", "adm-top-secret-4")


def _old_record_with_secrets() -> dict[str, Any]:
    """A record written before these flags were known to hold secrets, or with the secret
    nested inside a mapping flag's value, as data or as JSON text."""
    old = copy.deepcopy(GOOD)
    old["recorded_at"] = "2026-10-01T00:00:00Z"
    old["key"]["flags"] = dict(
        KIMI_RUN_FLAGS,
        chunked_prefill_size=4096,
        ssl_keyfile_password=SECRETS[0],
        json_model_override_args={"rope": {"factor": 2}, "hub": {"hf_token": SECRETS[1]}},
        speculative_config=json.dumps({"draft": {"api_key": SECRETS[2]}}),
    )
    old["key"]["chunked_prefill_size"] = 4096
    old["admin_api_key"] = SECRETS[3]
    old["measured"]["note"] = [{"password": SECRETS[0]}]
    return old


def test_one_calibrate_write_cleans_every_secret_from_the_store() -> None:
    host = kimi_host()
    old = _old_record_with_secrets()
    # One record kept (its key differs: chunked prefill 4096) and one set aside, each with the
    # server's own key in a place no name marks.
    aside = copy.deepcopy(old)
    aside["measured"]["pre_gib"] = -1
    aside["key"]["model_path"] = f"/models/{ARGS_KEY}"
    old["key"]["model_path"] = f"/models/{ARGS_KEY}/kimi"
    host["files"][STORE] = json.dumps(calibration_store.dump_store([old, aside]))
    action = FakeCalibrate(ARGS | {"api_key": ARGS_KEY}, host)
    result = action.run_it()
    assert result["record"] is not None, result["msg"]
    written = {path: text for path, text in host["files"].items() if path.startswith(STORE[:-5])}
    store_text = written[STORE]
    records = json.loads(store_text)["records"]
    assert [r["recorded_at"] for r in records[1:]] == ["2026-10-01T00:00:00Z"]  # still kept
    for path, text in written.items():
        for secret in (*SECRETS, ARGS_KEY):
            assert secret not in text, (path, secret)
    kept = records[1]
    assert "ssl_keyfile_password" not in kept["key"]["flags"]
    assert kept["key"]["flags"]["json_model_override_args"]["hub"]["hf_token"] == "<redacted>"
    assert kept["key"]["flags"]["json_model_override_args"]["rope"] == {"factor": 2}
    # JSON text holding a secret is redacted whole (server_secrets.redact: the one rule).
    assert kept["key"]["flags"]["speculative_config"] == "<redacted>"
    assert kept["admin_api_key"] == "<redacted>"
    assert kept["key"]["model_path"] == "/models/<redacted>/kimi"
    # The cleaned record still plans: its figures and the rest of its key are untouched.
    assert calibration_rule.record_problem(kept) is None


ARGS_KEY = "sk-the-servers-own-key"


def test_a_record_its_cleaning_leaves_unusable_is_not_kept_and_the_step_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server key that is also a dtype's name: redacted by value, the record would name an
    unknown dtype; it is not written, and the action reports no calibration (before, it said
    'calibrated' for a record the store did not keep)."""
    record = copy.deepcopy(GOOD)
    record["key"]["kv_cache_dtype"] = "fp8_e4m3"
    record["key"]["flags"] = dict(KIMI_RUN_FLAGS, kv_cache_dtype="fp8_e4m3")
    update = calibration_store.store_update(_store(GOOD), record, "/s/c.json", "kimi", ["fp8_e4m3"])
    assert update["record"] is None and update["store"]["records"] == [GOOD]
    assert "this start's record is not kept" in update["warning"]
    assert "fp8_e4m3" not in json.dumps(update)
    monkeypatch.setattr(calibration_store, "store_update", lambda *_a, **_k: update)
    result = FakeCalibrate(ARGS, kimi_host()).run_it()
    assert result["record"] is None and not result.get("failed")
    assert result["msg"].startswith("kimi: no calibration recorded: /s/c.json")
