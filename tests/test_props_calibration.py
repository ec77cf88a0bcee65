"""Property-based tests of the calibration store and the calibrate step (Hypothesis; profiles in
tests/conftest.py). Invariants (issue 44, items 3, 4 and 7):

- store_update never raises; what the reader keeps plans without error; a record the reader
  would set aside is never written (the written store reads back whole); the written store
  holds no secret, whatever the records it kept held and at whatever depth;
- the reader and the planner's use of calibration give a result or a clean reason for any
  JSON, never another exception;
- build_record gives a record the rule accepts or a CalibrationError, for any log text and any
  /server_info;
- the calibrate step, given any journal lines, /server_info and store from the host, never
  fails (a record, or null with the reason).
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from hypothesis import event, given
from hypothesis import strategies as st
from kimi_job import GPU, KIMI_LOG, KIMI_RUN_FLAGS
from test_calibrate_action import ARGS, START_FACTS, STORE, FakeCalibrate, kimi_host
from test_calibration_store_rule import GOOD, HOST, KIMI_DIR

from sglang_fleet.capacity import (
    calibration,
    calibration_apply,
    calibration_predict,
    calibration_record,
    calibration_rule,
    calibration_store,
)
from sglang_fleet.capacity.model_config import model_shape, read_model_dir

KIMI_CONFIG, _ = read_model_dir(KIMI_DIR)
KIMI = model_shape(KIMI_CONFIG)
SECRET = "sk-generated-secret-value"
SERVER_KEY = "sk-the-servers-own-key"
FLAG_SETS = [
    dict(KIMI_RUN_FLAGS, mem_fraction_static=0.88),
    dict(KIMI_RUN_FLAGS, mem_fraction_static=0.95, kv_cache_dtype="fp8_e4m3"),
    dict(KIMI_RUN_FLAGS, max_running_requests=64, context_length=8192, page_size=64),
]

# Numbers as JSON, a log or a server can give them: huge integers, NaN, infinities, text.
numbers = st.one_of(
    st.integers(-(10**6), 10**6),
    st.integers(min_value=2**62, max_value=10**500),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 0.5, 1e-300, 1e308, 10**400, -(10**400), True, False]),
    st.from_regex(r"[0-9]{1,40}(\.[0-9]{1,5})?", fullmatch=True),
)
scalars = st.one_of(st.none(), numbers, st.text(max_size=8))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
# A secret somewhere in a flag's value: under a secret name at some depth, or as JSON text.
secret_names = st.sampled_from(["api_key", "admin_api_key", "hf_token", "password", "x_secret"])
secret_values = st.builds(
    lambda name, depth, text: (
        json.dumps(_nest({name: SECRET}, depth)) if text else _nest({name: SECRET}, depth)
    ),
    secret_names,
    st.integers(0, 4),
    st.booleans(),
)


def _nest(value: Any, depth: int) -> Any:
    for level in range(depth):
        value = {f"level{level}": value} if level % 2 == 0 else [value]
    return value


KEY_FIELDS = [*calibration_rule.KEY_FIELDS, "extra"]
MEASURED_FIELDS = [*calibration_rule.MEASURED_FIELDS, "extra"]
DELETE = object()
mutation = st.one_of(
    st.tuples(st.just("key"), st.sampled_from(KEY_FIELDS), st.one_of(values, st.just(DELETE))),
    st.tuples(
        st.just("measured"), st.sampled_from(MEASURED_FIELDS), st.one_of(values, st.just(DELETE))
    ),
    st.tuples(st.just("flags"), st.text(min_size=1, max_size=12), st.one_of(values, secret_values)),
    st.tuples(st.just("flags"), secret_names, st.just(SECRET)),
    st.tuples(
        st.just("top"), st.sampled_from(["schema", "recorded_at", "sources", "api_key"]), values
    ),
)


def _mutated(changes: list[tuple[str, str, Any]], recorded_at: str) -> Any:
    record = copy.deepcopy(GOOD)
    record["recorded_at"] = recorded_at
    for where, name, value in changes:
        if where == "flags" and not isinstance(record["key"].get("flags"), dict):
            record["key"]["flags"] = {}  # an earlier change took the flag set away
        if where == "top":
            target = record
        elif where == "flags":
            target = record["key"]["flags"]
        else:
            target = record[where]
        if value is DELETE:
            target.pop(name, None)
        else:
            target[name] = value
    return record


records = st.builds(
    _mutated,
    st.lists(mutation, max_size=3),
    st.sampled_from(["2026-11-29T10:00:00Z", "2026-11-30T10:00:00Z"]),
)
stores = st.one_of(
    st.lists(records, max_size=3).map(
        lambda rs: json.dumps(calibration_store.dump_store(rs), default=str)
    ),
    st.lists(st.one_of(records, values), max_size=3),
    values.map(lambda v: json.dumps(v, default=str)),
    st.text(max_size=30),
    st.none(),
)


def _finite(prediction: calibration_predict.Prediction) -> bool:
    return all(
        math.isfinite(value)
        for value in prediction.as_dict().values()
        if isinstance(value, int | float) and not isinstance(value, bool)
    )


def _plans(record: dict[str, Any]) -> None:
    for flags in FLAG_SETS:
        applied = calibration_apply.apply([record], flags, HOST, KIMI)
        if applied.prediction is not None:
            assert _finite(applied.prediction), applied.prediction


@given(store=stores, record=records)
def test_the_record_step_never_raises_and_writes_only_what_reads_back_without_secrets(
    store: Any, record: Any
) -> None:
    record["recorded_at"] = "this start"
    update = calibration_store.store_update(
        store, record, "/var/lib/sglang-fleet/kimi/calibration.json", "kimi", secrets=[SERVER_KEY]
    )
    text = json.dumps(update["store"], allow_nan=False)
    read = calibration_store.read_store(text)
    assert read.set_aside == [], read.problems()
    assert read.records == update["store"]["records"]
    for kept in read.records:
        _plans(kept)
    assert SECRET not in text and SERVER_KEY not in text
    if update["set_aside"] is not None:
        json.dumps(update["set_aside"], allow_nan=False)
        assert update["warning"] and update["set_aside_path"] in update["warning"]
    first = update["store"]["records"][:1]
    event(
        f"records kept: {len(read.records)}, entries set aside: {update['set_aside'] is not None}"
    )
    if calibration_rule.record_problem(calibration_record.public_record(record, [SERVER_KEY])):
        assert all(r.get("recorded_at") != "this start" for r in update["store"]["records"])
        assert "this start's record is not kept" in update["warning"]
    else:
        assert first and first[0]["recorded_at"] == "this start"


@given(record=records)
def test_a_record_the_rule_accepts_plans_and_one_it_refuses_is_never_kept(record: Any) -> None:
    record["recorded_at"] = "new"
    problem = calibration_rule.record_problem(record)
    try:
        kept = calibration_store.add_record([GOOD], record)
    except calibration.CalibrationError as exc:
        event("refused")
        assert problem is not None and problem in str(exc)
    else:
        event("kept")
        assert problem is None and kept[0] == record
        _plans(record)
    applied = calibration_apply.apply([record], FLAG_SETS[0], HOST, KIMI)
    if problem is not None:
        assert applied.record is None and applied.errors == []


@given(data=st.one_of(values, st.lists(records, max_size=3)), text=st.booleans())
def test_the_reader_and_the_planners_use_give_a_result_for_any_json(data: Any, text: bool) -> None:
    given_store = json.dumps(data, default=str) if text else data
    read = calibration_store.read_store(given_store)
    for record in read.records:
        assert calibration_rule.record_problem(record) is None
    for flags in FLAG_SETS:
        calibration_apply.apply(given_store, flags, HOST, KIMI, mode="warn")


# --- building a record from what a start gives -------------------------------------------------
KIMI_LINES = [line for line in KIMI_LOG.splitlines() if line.strip()]
log_numbers = st.one_of(
    st.from_regex(r"-?[0-9]{1,30}(\.[0-9]{1,4})?", fullmatch=True),
    st.integers(300, 5000).map(lambda n: "9" * n),
    st.sampled_from(["0", "0.00", "1e999", "nan", "inf", "-1"]),
)


@st.composite
def journals(draw: st.DrawFn) -> str:
    """The Kimi start's lines with some of their numbers replaced, some lines dropped or
    repeated, and a few lines of anything."""
    lines = []
    for line in KIMI_LINES:
        if draw(st.integers(0, 9)) == 0:
            continue
        words = line.split("=")
        if len(words) > 1 and draw(st.integers(0, 4)) == 0:
            index = draw(st.integers(1, len(words) - 1))
            words[index] = draw(log_numbers) + words[index].lstrip("0123456789.")
        lines.append("=".join(words))
    lines += draw(st.lists(st.text(max_size=60), max_size=3))
    return "\n".join(lines)


server_infos = st.one_of(
    st.none(),
    values,
    st.fixed_dictionaries(
        {},
        optional={
            **dict.fromkeys(calibration_record.SERVER_INFO_FIELDS, scalars),
            "internal_states": st.one_of(
                values,
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "memory_usage": st.dictionaries(
                                st.sampled_from(
                                    [
                                        "weight",
                                        "kvcache",
                                        "startup_available",
                                        "token_capacity",
                                        "graph",
                                    ]
                                ),
                                st.one_of(numbers, values),
                                max_size=5,
                            )
                        }
                    ),
                    max_size=2,
                ),
            ),
        },
    ),
)


@given(journal=journals(), info=server_infos)
def test_build_record_gives_a_record_the_rule_accepts_or_a_calibration_error(
    journal: str, info: Any
) -> None:
    key = {
        "model_fingerprint": GOOD["key"]["model_fingerprint"],
        "gpu_name": GPU,
        "gpu_memory_mib": 97887,
        "sglang_version": "0.5.23",
        "flags": KIMI_RUN_FLAGS,
    }
    try:
        record = calibration_record.build_record(journal, info, key)
    except calibration.CalibrationError as exc:
        event("no record")
        assert str(exc)
        return
    event("a record")
    assert calibration_rule.record_problem(record) is None
    _plans(record)


@given(journal=journals(), info=server_infos, store=stores)
def test_the_calibrate_step_never_fails_whatever_the_host_answers(
    journal: str, info: Any, store: Any
) -> None:
    host = kimi_host(journal=journal, server_info=info if isinstance(info, dict) else None)
    if isinstance(store, str):
        host["files"][STORE] = store
    action = FakeCalibrate(ARGS | {"api_key": SERVER_KEY}, host)
    result = action.run_it()
    assert not result.get("failed"), result
    assert SERVER_KEY not in json.dumps(result, default=str)
    event("no record" if result["record"] is None else "a record")
    if result["record"] is None:
        assert result["msg"].startswith("kimi: no calibration recorded: ")
        assert result["warnings"], result
        return
    written = host["files"][STORE]
    assert SERVER_KEY not in written
    read = calibration_store.read_store(written)
    assert read.set_aside == [] and read.records[0] == result["record"]


@given(document=values)
def test_the_start_facts_module_keeps_only_the_paths_it_is_asked_for(document: Any) -> None:
    paths = [*calibration_record.SERVER_INFO_FIELDS, "internal_states.0.memory_usage"]
    picked = START_FACTS.pick(document, paths)
    assert set(picked) <= {path.split(".")[0] for path in paths}
    info = calibration_record.public_server_info(picked)
    assert info is not None
