"""Property-based tests of the JSON readers of host and server data and of the lock's judgement
of a lock file (Hypothesis; profiles in tests/conftest.py). Invariants (issue 33): a value or a
ValueError naming what was read, never RecursionError or another exception; a lock file is a
record, a damaged file or a refusal, and one whose time lies ahead of the host's clock is never
taken over nor counted as a lease that ends."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from conftest import load_plugin
from hypothesis import given
from hypothesis import strategies as st

bounded = load_plugin("plugins/module_utils/bounded_json.py")
lock = load_plugin("plugins/modules/fleet_lock.py")
lock_action = load_plugin("plugins/action/fleet_lock.py")
lkg = load_plugin("plugins/modules/sglang_last_known_good.py")
host_state = load_plugin("plugins/modules/sglang_host_state.py")

values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=12,
)
documents = st.one_of(
    values.map(json.dumps),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.tuples(st.integers(0, 5000), st.sampled_from(["[", '{"a":', "[{}, "])).map(
        lambda n: n[1] * n[0] + "1" + ("]" if n[1] != '{"a":' else "}") * n[0]
    ),
)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@given(document=documents)
def test_the_helper_gives_a_value_no_deeper_than_its_bound_or_a_named_error(
    document: str | bytes,
) -> None:
    try:
        value = bounded.loads(document, "what")
    except ValueError as exc:
        assert str(exc).startswith("what: "), str(exc)
    else:
        assert _depth(value) <= bounded.MAX_DEPTH


@given(value=values)
def test_the_depth_check_agrees_with_the_depth(value: Any) -> None:
    assert bool(bounded.depth_problem(value, 3)) == (_depth(value) > 3)


@given(document=documents)
def test_a_last_known_good_record_is_read_or_refused(
    tmp_path_factory: pytest.TempPathFactory, document: str | bytes
) -> None:
    folder = tmp_path_factory.mktemp("lkg")
    raw = document.encode() if isinstance(document, str) else document
    (folder / "meta.json").write_bytes(raw)
    try:
        lkg.restore({"lkg_dir": str(folder), "files": []}, True, lambda: None)
    except ValueError as exc:
        assert str(folder) in str(exc)
    kept = lkg.keep({"lkg_dir": str(folder), "files": [], "absent": [], "record": {}}, True)
    assert kept["previous"] is None or isinstance(kept["previous"], dict)
    found = host_state.check_record(
        {"path": str(folder / "meta.json"), "key": "config_hash", "value": "x"}
    )
    assert all(isinstance(line, str) for line in found)


BOOT = "11111111-2222-3333-4444-555555555555"


@given(
    raw=st.one_of(documents, st.just("")),
    mtime_offset=st.one_of(st.floats(-1e9, 1e9), st.sampled_from([0.0, 1.0, 3.0, 86400 * 365])),
    boot=st.sampled_from([BOOT, "another-boot", ""]),
)
def test_a_lock_file_is_a_record_a_damaged_file_or_a_refusal(
    raw: str | bytes, mtime_offset: float, boot: str
) -> None:
    data = raw.encode() if isinstance(raw, str) else raw
    now = lock.HostClock(boot, 1000.0, 1_800_000_000.0)
    found = (
        lock.parse(data, now.wall + mtime_offset)
        if data.strip()
        else lock.Found(data, now.wall + mtime_offset, None, "empty")
    )
    view = lock.holder_view(found, now, 900, "/run/lock/x")
    json.dumps(view, allow_nan=False)
    assert view["age_s"] >= 0 and view["renewed_ago_s"] >= 0
    assert "/run/lock/x" in view["summary"] or view["readable"]
    if found.record is None and mtime_offset > lock.FUTURE_TOLERANCE_S + 1:
        assert view["unmeasurable"] is True and "lease ends" not in view["summary"]
    verdict = lock_action.judge(view, _me(), {}, "/run/lock/x", "gpu-1")
    if view["unmeasurable"]:
        assert not verdict.stale and "remove /run/lock/x on gpu-1 by hand" in verdict.advice
    assert math.isfinite(view["lease_left_s"])


def _me() -> Any:
    controller = lock_action.Controller("ctl-2", "a-different-boot", "pid:[1]", 1000, False)
    playbook = lock_action.Proc(9999, 1, 1000, 1, b"ansible-playbook deploy.yml\0")
    return lock_action.RunIdentity(controller, playbook)
