"""Speculative decoding as an autotune candidate (docs/SPECULATIVE.md, docs/AUTOTUNE.md).

autotune_space.speculative lists settings (null: none); each is a candidate over the server's
flags beside the same flags without speculation, planned with its draft (read on the canary),
and tried at the job's load (autotune_workload). The "server" is test_autotune.py's wave model
times a factor for speculation, and the smoke results carry the accept length SGLang's /metrics
would (sglang:spec_accept_length).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_autotune import BASE, CONFIG, HOST, KIMI_JOB, WEIGHTS, kimi_record, run, wave_server

from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.capacity.speculative import algorithm_of
from sglang_fleet.tuning import autotune_inputs, autotune_state, trial_choice, trial_outcome
from sglang_fleet.tuning.autotune_inputs import AutotuneInputError

ROOT = Path(__file__).resolve().parent.parent
DRAFT_PATH = "/shared/kimi-k2.5-eagle3"
DRAFT_CONFIG, DRAFT_WEIGHTS = read_model_dir(
    ROOT / "tests" / "fixtures" / "models" / "kimi-k2.5-eagle3"
)
EAGLE3 = {
    "algorithm": "EAGLE3",
    "draft_model_path": DRAFT_PATH,
    "num_steps": 3,
    "eagle_topk": 1,
    "num_draft_tokens": 4,
}
DRAFTS = {DRAFT_PATH: {"config": DRAFT_CONFIG, "weight_bytes": DRAFT_WEIGHTS, "error": None}}
STORY = BASE | {"mem_fraction_static": 0.88, "kv_cache_dtype": "fp8_e4m3"}


def search(space: dict[str, Any], workload: dict[str, Any] = KIMI_JOB, **change: Any) -> dict:
    context = {
        "model_config": CONFIG,
        "weight_bytes": WEIGHTS,
        "host": HOST,
        "sglang_version": "0.5.23",
        "calibration": [kimi_record()],
        "drafts": DRAFTS,
    }
    args = {
        "server": "kimi",
        "base_flags": STORY,
        "space": space,
        "workload": workload,
        "context": context,
        "kv_cache_dtypes_allowed": ["auto", "fp8_e4m3"],
    }
    return autotune_state.new_state(**(args | change))


def speculating_server(gain: float, accept: float = 2.5):
    """The wave model's server, `gain` times faster with speculation; its /metrics samples carry
    the accept length."""
    plain = wave_server()

    def measure(flags: dict[str, Any]) -> dict[str, Any]:
        smoke = plain(flags)
        if algorithm_of(flags) is None:
            return smoke
        samples = [{"num_running_reqs": 150, "spec_accept_length": accept}] * 3
        return smoke | {
            "output_throughput": smoke["output_throughput"] * gain,
            "server_metrics": {"samples": samples},
        }

    return measure


# --- inputs ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"num_steps": 3}, "autotune_space.speculative[1].algorithm is required"),
        (EAGLE3 | {"steps": 3}, "autotune_space.speculative[1]: unknown key(s) steps"),
        (
            EAGLE3 | {"num_draft_tokens": 6},
            "autotune_space.speculative[1].num_draft_tokens: 6 with speculative_eagle_topk 1",
        ),
        (EAGLE3 | {"num_steps": None}, "autotune_space.speculative[1].num_steps: "),
        (EAGLE3 | {"algorithm": "MEDUSA"}, "speculative[1].algorithm: 'MEDUSA' is not one of"),
        (EAGLE3 | {"accept_length": 0.5}, "speculative[1].accept_length: 0.5 is not"),
        ("EAGLE3", "speculative[1]: 'EAGLE3' is neither null"),
    ],
)
def test_speculative_settings_are_checked_like_the_other_inputs(item: Any, message: str):
    with pytest.raises(AutotuneInputError) as caught:
        autotune_inputs.validate_space({"speculative": [None, item]})
    assert message in str(caught.value)


def test_the_draft_models_a_search_may_start_are_read_and_a_missing_one_refuses():
    space = autotune_inputs.validate_space({"speculative": [None, EAGLE3, {"algorithm": "NGRAM"}]})
    assert autotune_inputs.draft_paths(space, STORY) == [DRAFT_PATH]
    with pytest.raises(AutotuneInputError) as caught:
        search({"speculative": [None, EAGLE3]}, context={
            "model_config": CONFIG, "weight_bytes": WEIGHTS, "host": HOST,
            "drafts": {DRAFT_PATH: {"config": None, "weight_bytes": None, "error": None}},
        })  # fmt: skip
    assert str(caught.value) == (
        f"autotune_space.speculative: the draft model {DRAFT_PATH} cannot be read on the canary: "
        "config.json does not exist"
    )


# --- the candidates ----------------------------------------------------------------------------
def test_each_setting_is_a_candidate_beside_the_same_flags_without_speculation():
    state = search({"speculative": [None, EAGLE3], "mem_fraction_static": [0.88]})
    off, on = state["candidates"]
    assert off["tuned"] == {"mem_fraction_static": 0.88} and off["changes"] == 0
    assert on["tuned"] == {
        "mem_fraction_static": 0.88,
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": DRAFT_PATH,
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
        # SGLang would reset it to 48: the job's concurrency instead.
        "max_running_requests": 150,
    }
    # Planned with its draft: the calibration (a run without speculation) does not predict
    # across a draft, so it is planned from estimates, with the draft's memory.
    assert on["predicted"]["speculative"] is True
    assert on["predicted"]["calibrated"] is False
    # No accept length known yet: its gain is unknown, and said so.
    assert on["predicted"]["speedup"] is None and on["predicted"]["speedup_unknown"] is True
    # Over a server that speculates, null removes its flags.
    spec_base = STORY | {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": DRAFT_PATH,
    }
    [none] = search({"speculative": [None]}, base_flags=spec_base)["candidates"]
    assert none["tuned"] == {"speculative_algorithm": None, "speculative_draft_model_path": None}
    assert none["changes"] == 2


def test_an_expected_accept_length_plans_the_gain_before_any_trial():
    state = search({"speculative": [None, EAGLE3 | {"accept_length": 2.5}]})
    off, on = state["candidates"]
    gain = on["predicted"]["speedup"]
    assert gain is not None and on["predicted"]["speedup_unknown"] is False
    assert on["predicted"]["output_tok_s"] == pytest.approx(
        off["predicted"]["output_tok_s"]
        * gain
        * on["predicted"]["concurrency"]
        / off["predicted"]["concurrency"],
        rel=0.2,
    )


# --- the search at the job's load --------------------------------------------------------------
@pytest.mark.parametrize(("gain", "wins"), [(1.6, True), (0.7, False)])
def test_the_search_tries_speculation_at_the_jobs_load_and_keeps_what_measures_best(
    gain: float, wins: bool
):
    state = search({"speculative": [None, EAGLE3]})
    rows = run(state, speculating_server(gain), check_rule=False)
    tried = {row["candidate"] for row in rows}
    assert tried == {"c000", "c001"}  # with its gain unknown, speculation is always tried
    spec_row = next(row for row in rows if row["candidate"] == "c001")
    assert spec_row["spec_accept_length"] == 2.5
    best = trial_choice.winner(state)
    assert (algorithm_of(best["flags"]) == "EAGLE3") is wins


def test_a_measured_accept_length_plans_the_settings_left():
    second = EAGLE3 | {"num_steps": 5, "num_draft_tokens": 6}
    state = search({"speculative": [None, EAGLE3, second]}, max_trials=2)
    rows = run(state, speculating_server(1.5, accept=3.0), check_rule=False)
    assert [row["candidate"] for row in rows][-1] in ("c001", "c002")
    left = next(c for c in state["candidates"] if c["status"] == "pending")
    assert left["predicted"]["speedup_unknown"] is False
    assert left["predicted"]["speedup"] is not None


def test_the_waves_of_a_start_reset_to_48_are_counted_at_48():
    """A server whose own flags speculate without max_running_requests runs 48 at a time."""
    base = STORY | {"speculative_algorithm": "NGRAM"}
    # Requests of 1000 + 1000 tokens: the calibrated pool (149800 tokens) holds 74 of them.
    job = {"input_len": 1000, "output_len": 1000, "concurrency": 150}
    state = search({"mem_fraction_static": [0.88]}, workload=job, base_flags=base)
    trial = trial_choice.next_trial(state)
    record = kimi_record()
    row = trial_outcome.record_trial(
        state, trial, {"smoke": wave_server()(trial["flags"]), "calibration": record}
    )
    assert row["waves"] == -(-150 // 48) == 4


def test_the_winners_profile_carries_its_speculative_flags_or_removes_them():
    from sglang_fleet.tuning.autotune_report import profile_yaml  # noqa: PLC0415

    state = search({"speculative": [None, EAGLE3]})
    run(state, speculating_server(1.6), check_rule=False)
    profile = profile_yaml(state)
    assert '    speculative_algorithm: "EAGLE3"' in profile
    assert "    max_running_requests: 150" in profile
    spec_base = STORY | {"speculative_algorithm": "NGRAM"}
    state = search({"speculative": [None]}, base_flags=spec_base)
    run(state, speculating_server(0.5), check_rule=False)
    assert "    speculative_algorithm: null" in profile_yaml(state)


def test_the_role_reads_the_drafts_the_filter_names():
    from conftest import load_plugin  # noqa: PLC0415

    filters = load_plugin("plugins/filter/sglang_autotune.py").FilterModule().filters()
    typed = filters["sglang_autotune_inputs"]({"speculative": [None, EAGLE3]}, KIMI_JOB)
    assert filters["sglang_autotune_draft_paths"](typed["space"], STORY) == [DRAFT_PATH]
    assert filters["sglang_autotune_draft_paths"]({"mem_fraction_static": [0.9]}, STORY) == []
