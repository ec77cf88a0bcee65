"""The autotune search (sglang_fleet.tuning) driven by synthetic measurement functions.

The "server" here is a function of the flag set: the calibrated planner's own token budget
(the Kimi job's calibration: Kimi-K2.5 tp 8 at 0.85, bf16) gives the KV-bound concurrency, and
a decode step of a batch of B takes A_STEP + B_STEP * B seconds, so a job of N requests
runs in ceil(N / B) waves. That is the model autotune fits; the tests check the search
against an exhaustive grid of the same function and that it stops exactly when the rule
says: best measured >= best remaining prediction x (1 - tolerance).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kimi_job import GPU, KIMI_LOG, KIMI_RUN_FLAGS
from yamllint import config as yamllint_config
from yamllint import linter as yamllint_linter

from sglang_fleet.capacity import calibration_predict, calibration_record
from sglang_fleet.capacity.model_config import model_shape, read_model_dir
from sglang_fleet.tuning import (
    autotune,
    autotune_candidates,
    autotune_inputs,
    autotune_report,
    autotune_state,
    speed_model,
    trial_choice,
    trial_outcome,
)
from sglang_fleet.tuning.autotune_inputs import AutotuneInputError
from sglang_fleet.tuning.autotune_picture import PANEL_CANDIDATES, PANEL_TRIALS, render_png

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
CONFIG, WEIGHTS = read_model_dir(FIXTURES / "models" / "kimi-k2.5-int4")
SHAPE = model_shape(CONFIG)
HOST = {"gpu_memory_mib": 97887, "host_ram_gib": 400, "gpu_count": 8, "gpu_name": GPU}
BASE = {
    **KIMI_RUN_FLAGS,
}
SPACE = {
    "mem_fraction_static": [0.85, 0.88, 0.90, 0.93],
    "max_running_requests": [64, 160],
    "chunked_prefill_size": [4096, 8192],
    "cuda_graph_max_bs_decode": [256, 512],
    "kv_cache_dtype": ["auto", "fp8_e4m3"],
}
KIMI_JOB = {"input_len": 2000, "output_len": 2000, "concurrency": 150}
A_STEP, B_STEP, PREFILL_S = 0.05, 0.0005, 0.00002


def kimi_record() -> dict[str, Any]:
    key = {
        "model_config": CONFIG,
        "weight_bytes": WEIGHTS,
        "gpu_name": GPU,
        "gpu_memory_mib": 97887,
        "sglang_version": "0.5.23",
        "flags": BASE,
        "recorded_at": "2026-11-29T10:05:00Z",
    }
    return calibration_record.build_record(KIMI_LOG, None, key)


def context(calibrated: bool = True) -> dict[str, Any]:
    return {
        "model_config": CONFIG,
        "weight_bytes": WEIGHTS,
        "host": HOST,
        "sglang_version": "0.5.23",
        "calibration": [kimi_record()] if calibrated else None,
    }


def search(calibrated: bool = True, **overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "server": "kimi",
        "base_flags": BASE,
        "space": SPACE,
        "workload": KIMI_JOB,
        "context": context(calibrated),
        "kv_cache_dtypes_allowed": ["auto", "fp8_e4m3"],
    }
    return autotune_state.new_state(**(args | overrides))


def true_tokens(flags: dict[str, Any]) -> int:
    """What the server would allocate: the calibration's own prediction (tested elsewhere)."""
    host = {"gpu_memory_mib": 97887, "gpu_name": GPU, "sglang_version": "0.5.23"}
    return calibration_predict.predict(kimi_record(), flags, host, SHAPE).max_total_num_tokens


Measure = Callable[[dict[str, Any]], dict[str, Any]]


def wave_server(factor: Callable[[dict[str, Any]], float] = lambda f: 1.0) -> Measure:
    """Output tok/s of the Kimi job under the wave model, times an optional factor."""

    def measure(flags: dict[str, Any]) -> dict[str, Any]:
        work = KIMI_JOB
        fit = true_tokens(flags) // (work["input_len"] + work["output_len"])
        cap = int(flags.get("max_running_requests") or fit)
        batch = max(1, min(fit, cap, work["concurrency"]))
        waves = math.ceil(work["concurrency"] / batch)
        seconds = work["output_len"] * (A_STEP * waves + B_STEP * work["concurrency"])
        seconds += work["concurrency"] * work["input_len"] * PREFILL_S
        tok_s = work["concurrency"] * work["output_len"] / seconds * factor(flags)
        return {"output_throughput": tok_s, "completed": 150, "failed": 0, "p99_tpot_ms": 50.0}

    return measure


def run(state: dict[str, Any], measure: Measure, check_rule: bool = True) -> list[dict]:
    """Drive the search to the end, checking the stop rule before every trial."""
    rows = []
    while True:
        before = copy.deepcopy(state)
        trial = trial_choice.next_trial(state)
        if trial is None:
            break
        if check_rule and trial["candidate"] != trial_choice.BASELINE_ID:
            assert not _rule_met(before), "a trial ran although the stop rule was met"
        smoke = measure(trial["flags"])
        rows.append(trial_outcome.record_trial(state, trial, {"smoke": smoke}))
    if check_rule and trial_choice.pending(state):
        assert _rule_met(state)
    return rows


def _rule_met(state: dict[str, Any]) -> bool:
    best = trial_choice.best_trial(state)
    todo = trial_choice.pending(state)
    if best is None or not todo:
        return False
    top = max(c["predicted"]["output_tok_s"] for c in todo)
    return best["output_throughput"] >= top * (1 - state["tolerance"])


def grid_best(state: dict[str, Any], measure: Measure) -> float:
    """Exhaustive: every candidate the planner would let start (pruned ones included only
    when they are not an out-of-memory risk, as the grid would crash on those)."""
    results = []
    for candidate in state["candidates"]:
        prune = candidate["prune"] or {}
        if prune.get("code") in ("oom_risk", "cannot_start", "cannot_fit"):
            continue
        results.append(
            measure(autotune_candidates.candidate_flags(state, candidate))["output_throughput"]
        )
    return max(results)


# --- inputs -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({"mem_fraction": [0.9]}, "unknown key(s) mem_fraction; allowed: mem_fraction_static"),
        ({"mem_fraction_static": []}, "autotune_space.mem_fraction_static must be a non-empty"),
        ({"mem_fraction_static": [1.2]}, "1.2 is not a number between 0 and 1 (both excluded)"),
        ({"max_running_requests": [0]}, "autotune_space.max_running_requests: 0 is not a pos"),
        ({"chunked_prefill_size": [-1, 4096.5]}, "4096.5 is not a positive integer or -1"),
        ({"kv_cache_dtype": ["int4"]}, "'int4' is not a KV cache dtype"),
        ({}, "autotune_space must be a mapping of lists"),
    ],
)
def test_bad_space_names_the_variable(space: dict, message: str):
    with pytest.raises(AutotuneInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        autotune_inputs.validate_space(space)


def test_fp8_must_be_opted_into():
    with pytest.raises(AutotuneInputError) as info:
        autotune_inputs.validate_space({"kv_cache_dtype": ["auto", "fp8_e4m3"]})
    assert "fp8_e4m3 is not in autotune_kv_cache_dtypes_allowed (auto, bf16" in str(info.value)
    assert "trade output quality" in str(info.value)
    space = autotune_inputs.validate_space(
        {"kv_cache_dtype": ["auto", "fp8_e4m3"]}, ["auto", "fp8_e4m3"]
    )
    assert space == {"kv_cache_dtype": ["auto", "fp8_e4m3"]}


def test_bad_workload_slo_and_tolerance():
    with pytest.raises(AutotuneInputError, match=r"autotune_workload\.output_len is required"):
        autotune_inputs.validate_workload({"input_len": 10, "concurrency": 2})
    assert autotune_inputs.validate_workload(KIMI_JOB)["num_prompts"] == 150
    with pytest.raises(AutotuneInputError, match="autotune_slo: unknown key"):
        autotune_inputs.validate_slo({"ttft": 1})
    with pytest.raises(AutotuneInputError, match=r"autotune_slo\.max_failures"):
        autotune_inputs.validate_slo({"max_failures": -1})
    with pytest.raises(AutotuneInputError, match="autotune_tolerance"):
        search(tolerance=1.5)


def test_grid_is_every_combination_over_the_servers_flags():
    state = search()
    assert len(state["candidates"]) == 4 * 2 * 2 * 2 * 2
    first = state["candidates"][0]
    assert first["tuned"] == {
        "mem_fraction_static": 0.85,
        "max_running_requests": 64,
        "chunked_prefill_size": 4096,
        "kv_cache_dtype": "auto",
        "cuda_graph_max_bs_decode": 256,
    }
    flags = autotune_candidates.candidate_flags(state, first)
    assert flags["disable_custom_all_reduce"] is True and flags["tp_size"] == 8
    assert first["changes"] == 3  # mrr, chunk and decode steps differ from the base


# --- pruning ------------------------------------------------------------------------------
def by_tuned(state: dict[str, Any], **tuned: Any) -> list[dict[str, Any]]:
    return [c for c in state["candidates"] if all(c["tuned"].get(k) == v for k, v in tuned.items())]


def test_calibrated_planner_prunes_the_oom_risk_with_its_numbers():
    state = search()
    for candidate in by_tuned(state, mem_fraction_static=0.93):
        assert candidate["status"] == "pruned"
        assert candidate["prune"]["code"] == "oom_risk"
        assert "below the 5.0 GiB margin" in candidate["prune"]["reason"]
    # 0.90 keeps 6.29 GiB (6.29 + 0.88 with decode graphs capped at 64): it stays.
    assert all(c["status"] == "pending" for c in by_tuned(state, mem_fraction_static=0.90))


def test_cannot_start_and_cannot_fit_are_pruned():
    state = search(space={"mem_fraction_static": [0.5, 0.85]})
    low = by_tuned(state, mem_fraction_static=0.5)[0]
    assert low["prune"]["code"] == "cannot_start"
    assert "Not enough memory" in low["prune"]["reason"]
    huge = search(workload={"input_len": 200000, "output_len": 2000, "concurrency": 1})
    reasons = {c["prune"]["code"] for c in huge["candidates"] if c["prune"]}
    assert "cannot_fit" in reasons
    bf16 = by_tuned(huge, mem_fraction_static=0.85, kv_cache_dtype="auto")[0]
    assert "cannot hold one request of the workload (200000 + 2000" in bf16["prune"]["reason"]


def test_without_calibration_the_current_flags_start_first_and_calibrate():
    state = search(calibrated=False)
    assert all(not c["predicted"]["calibrated"] for c in state["candidates"])
    assert not any(c["status"] == "pruned" for c in state["candidates"])  # nothing measured
    trial = trial_choice.next_trial(state)
    assert trial["candidate"] == trial_choice.BASELINE_ID
    assert trial["flags"] == BASE
    trial_outcome.record_trial(
        state, trial, {"smoke": wave_server()(BASE), "calibration": kimi_record()}
    )
    # Measured memory now: 0.93 is pruned, everything else is planned with it.
    assert all(c["predicted"]["calibrated"] for c in state["candidates"])
    assert all(c["status"] == "pruned" for c in by_tuned(state, mem_fraction_static=0.93))
    assert trial_choice.next_trial(state)["candidate"] != trial_choice.BASELINE_ID


def test_with_a_calibration_no_baseline_is_needed():
    state = search()
    assert trial_choice.next_trial(state)["candidate"] != trial_choice.BASELINE_ID


def test_no_baseline_restart_when_no_candidate_could_ever_run():
    """Every candidate pruned for a reason no calibration lifts: the search ends without
    restarting the canary for a baseline; one that a calibration may lift still gets it."""
    state = search(calibrated=False)
    for candidate in state["candidates"]:
        candidate.update(status="pruned", prune={"code": "invalid", "reason": "test"})
    assert trial_choice.next_trial(state) is None
    assert state["done"] and state["stop_reason"] == "every candidate was tried or pruned"
    state = search(calibrated=False)
    for candidate in state["candidates"]:
        candidate.update(status="pruned", prune={"code": "cannot_start", "reason": "test"})
    assert trial_choice.next_trial(state)["candidate"] == trial_choice.BASELINE_ID


# --- driving from Ansible -----------------------------------------------------------------
def test_next_trial_is_stable_until_recorded_so_a_rerun_resumes():
    state = search(calibrated=False)
    first = trial_choice.next_trial(state)
    assert trial_choice.next_trial(json.loads(json.dumps(state))) == first  # after a reload
    with pytest.raises(AutotuneInputError, match="not the one in flight"):
        trial_outcome.record_trial(state, {"candidate": "c999"}, {"smoke": None})
    result = {"smoke": wave_server()(first["flags"]), "calibration": kimi_record()}
    trial_outcome.record_trial(state, first, result)
    assert trial_choice.next_trial(state)["n"] == 2


def test_best_predicted_goes_first():
    state = search()
    order = trial_choice.pending(state)
    tops = [c["predicted"]["output_tok_s"] for c in order]
    assert tops == sorted(tops, reverse=True)
    assert trial_choice.next_trial(state)["candidate"] == order[0]["id"]
    # the best predictions are fp8 (twice the KV tokens of bf16) at the highest safe fraction
    assert order[0]["tuned"]["kv_cache_dtype"] == "fp8_e4m3"
    assert order[0]["tuned"]["mem_fraction_static"] == 0.90


# --- early stop -------------------------------------------------------------------------------
def test_stops_exactly_when_the_rule_is_met_and_matches_the_grid():
    state = search()
    measure = wave_server()
    rows = run(state, measure)
    assert state["done"] and state["stop_reason"].startswith("early stop")
    best = trial_choice.best_trial(state)["output_throughput"]
    grid = grid_best(state, measure)
    assert best >= (1 - state["tolerance"]) * grid
    assert len(rows) <= len(state["candidates"]) / 3


def test_from_no_calibration_two_trials_fit_the_model():
    state = search(calibrated=False)
    baseline = trial_choice.next_trial(state)
    trial_outcome.record_trial(
        state, baseline, {"smoke": wave_server()(BASE), "calibration": kimi_record()}
    )
    rows = run(state, wave_server())
    # The baseline (bf16 at 0.85: 37 at once, 5 waves) and the first fp8 trial (2 waves)
    # fix both parameters of duration = A * waves + K: the rest is predicted exactly.
    assert state["speed_model"]["source"] == "fitted"
    assert state["speed_model"]["a"] == pytest.approx(2000 * A_STEP)
    assert len(rows) == 1
    best = trial_choice.best_trial(state)["output_throughput"]
    assert best == pytest.approx(grid_best(state, wave_server()))


@pytest.mark.parametrize("tolerance", [0.0, 0.02, 0.2])
def test_tolerance_trades_trials_for_certainty(tolerance: float):
    noisy = wave_server(lambda f: 1.0 + 0.03 * (f["cuda_graph_max_bs_decode"] == 256))
    state = search(tolerance=tolerance)
    rows = run(state, noisy)
    best = trial_choice.best_trial(state)["output_throughput"]
    assert best >= (1 - tolerance) * max(r["output_throughput"] for r in rows)
    if tolerance == 0.0:
        # Nothing may be left whose prediction beats the best measured.
        assert all(c["predicted"]["output_tok_s"] <= best for c in trial_choice.pending(state))


def test_fewer_trials_with_more_tolerance():
    counts = []
    for tolerance in (0.0, 0.3):
        state = search(tolerance=tolerance)
        counts.append(len(run(state, wave_server(lambda f: 1 + 0.001 * f["tp_size"]))))
    assert counts[1] <= counts[0]


def test_an_unexpected_oom_prunes_everything_predicted_as_tight():
    def crashes_above_088(flags: dict[str, Any]) -> dict[str, Any] | None:
        if flags["mem_fraction_static"] > 0.885:
            return None
        return wave_server()(flags)

    state = search()
    trial = trial_choice.next_trial(state)
    assert trial["tuned"]["mem_fraction_static"] == 0.90
    row = trial_outcome.record_trial(
        state, trial, {"smoke": None, "error": "torch.OutOfMemoryError: CUDA out of memory."}
    )
    assert row["oom"] and row["outcome"] == "failed"
    floor = row["predicted"]["free_after_graph_gib"]
    for candidate in state["candidates"]:
        predicted = candidate["predicted"]["free_after_graph_gib"]
        if candidate["status"] == "pending":
            assert predicted > floor
    tight = [
        c
        for c in state["candidates"]
        if (c["prune"] or {}).get("reason", "").find("when it ran out of memory") >= 0
    ]
    assert tight, "candidates as tight as the crashed one are pruned"
    rows = run(state, lambda f: crashes_above_088(f) or {}, check_rule=False)
    assert not any(r["oom"] for r in rows)


def test_failures_and_slo_misses_never_win():
    def measure(flags: dict[str, Any]) -> dict[str, Any]:
        result = wave_server()(flags)
        if flags["kv_cache_dtype"] == "fp8_e4m3":
            result["p99_tpot_ms"] = 500.0  # fp8 runs miss the TPOT SLO here
        return result

    state = search(slo={"p99_tpot_ms": 100.0})
    rows = run(state, measure, check_rule=False)
    assert any(r["outcome"] == "slo_miss" for r in rows)
    best = trial_choice.winner(state)
    assert best is not None and best["flags"]["kv_cache_dtype"] == "auto"
    failed = search()
    trial = trial_choice.next_trial(failed)
    trial_outcome.record_trial(failed, trial, {"smoke": None, "error": "exited", "phase": "start"})
    assert trial_choice.winner(failed) is None


def test_trial_budget_ends_the_search():
    state = search(calibrated=False, max_trials=2, tolerance=0.0)
    rows = run(state, wave_server(), check_rule=False)
    assert len(rows) == 2
    assert state["stop_reason"] == "the trial budget (2) is spent"


# --- the speed model --------------------------------------------------------------------------
def test_speed_model_fit():
    assert speed_model.fit_speed_model([], 100.0) == {"a": 100.0, "k": 0.0, "source": "prior"}
    scaled = speed_model.fit_speed_model([(2, 300.0), (2, 310.0)], 100.0)
    assert scaled == {"a": 152.5, "k": 0.0, "source": "scaled"}
    exact = speed_model.fit_speed_model([(2, 350.0), (5, 650.0)], 100.0)
    assert exact["a"] == pytest.approx(100.0) and exact["k"] == pytest.approx(150.0)
    # Noise that tilts the line negative falls back to a physical (non-negative) fit.
    tilted = speed_model.fit_speed_model([(2, 400.0), (3, 390.0)], 100.0)
    assert tilted["a"] > 0 and tilted["k"] >= 0


# --- outputs ----------------------------------------------------------------------------------
def test_report_profile_and_picture(tmp_path: Path):
    state = search()
    run(state, wave_server())
    paths = autotune_report.write_report(state, tmp_path / "reports" / "gpu-1" / "kimi", "20261129")
    text = Path(paths["markdown"]).read_text()
    assert "| trial | candidate |" in text and "**Winner**: trial" in text
    assert "oom_risk: mem_fraction_static 0.930 leaves a predicted" in text
    profile_text = Path(paths["profile"]).read_text()
    profile = yaml.safe_load(profile_text)
    tuned = profile["sglang_server_profiles"]["kimi-autotuned"]
    assert tuned == {k: v for k, v in trial_choice.winner(state)["flags"].items() if k in SPACE}
    # The operator commits it: it passes the repository's own yamllint rules.
    rules = yamllint_config.YamlLintConfig(file=str(ROOT / ".yamllint"))
    assert list(yamllint_linter.run(profile_text, rules)) == []
    assert Path(paths["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(Path(paths["json"]).read_text())
    assert "context" not in summary and summary["winner"]["n"] >= 1


def test_picture_panels():
    state = search()
    run(state, wave_server())
    best = trial_choice.winner(state)
    assert best is not None
    figure = render_png(state, "/dev/null", best)
    titles = [ax.get_title(loc="left") for ax in figure.axes]
    assert titles == [PANEL_TRIALS, PANEL_CANDIDATES]
    assert figure.get_suptitle().startswith(f"winner: trial {best['n']} ({best['candidate']})")
    # The winner's bar alone is outlined.
    [bars] = figure.axes[0].containers
    outlined = [bar for bar in bars if bar.get_edgecolor()[3] > 0]
    assert [round(bar.get_x() + bar.get_width() / 2) for bar in outlined] == [best["n"]]


# --- command line -------------------------------------------------------------------------------
def test_cli_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    spec = {
        "server": "kimi",
        "base_flags": BASE,
        "space": SPACE,
        "workload": KIMI_JOB,
        "kv_cache_dtypes_allowed": ["auto", "fp8_e4m3"],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "ctx.json").write_text(json.dumps(context()))
    state_file = str(tmp_path / "state.json")
    common = ["--state", state_file]

    def cli(*argv: str) -> tuple[int, Any]:
        rc = autotune.main(list(argv))
        out = capsys.readouterr().out
        return rc, json.loads(out) if out.strip() else None

    init = ["init", "--spec", str(tmp_path / "spec.json"), "--context", str(tmp_path / "ctx.json")]
    rc, summary = cli(*init, *common)
    assert rc == 0 and summary["candidates"] == 64
    rc, trial = cli("next", *common)
    assert rc == 0 and trial["n"] == 1
    (tmp_path / "result.json").write_text(json.dumps({"smoke": wave_server()(trial["flags"])}))
    rc, row = cli("record", "--result", str(tmp_path / "result.json"), *common)
    assert rc == 0 and row["outcome"] == "ok"
    assert autotune.main(["record", "--result", str(tmp_path / "result.json"), *common]) == 2
    assert "no trial is in flight" in capsys.readouterr().err
    rc, summary = cli(*init, *common)  # a rerun keeps the search where it is
    assert summary["trials"] == 1
    rc, paths = cli("report", "--out-dir", str(tmp_path / "out"), "--stamp", "x", *common)
    assert rc == 0 and Path(paths["png"]).exists()


def test_init_resumes_the_same_search_and_replaces_one_of_other_inputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    spec = {"server": "kimi", "base_flags": BASE, "space": SPACE, "workload": KIMI_JOB}
    spec["kv_cache_dtypes_allowed"] = ["auto", "fp8_e4m3"]
    (tmp_path / "ctx.json").write_text(json.dumps(context()))
    state_file = tmp_path / "state.json"

    def init(spec: dict[str, Any], *extra: str) -> dict[str, Any]:
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        argv = [
            "init",
            "--spec",
            str(tmp_path / "spec.json"),
            "--context",
            str(tmp_path / "ctx.json"),
        ]
        assert autotune.main([*argv, "--state", str(state_file), *extra]) == 0
        return json.loads(capsys.readouterr().out)

    first = init(spec)
    assert (first["resumed"], first["replaced"]) == (False, None)
    state = json.loads(state_file.read_text())
    trial = trial_choice.next_trial(state)
    trial_outcome.record_trial(state, trial, {"smoke": wave_server()(trial["flags"])})
    autotune_state.save_state(state, state_file)
    again = init(spec)
    assert again["resumed"] and again["trials"] == 1 and again["replaced"] is None
    assert again["started_at"] == first["started_at"]
    other = init(spec | {"workload": KIMI_JOB | {"concurrency": 100}})
    assert not other["resumed"] and other["trials"] == 0
    assert other["replaced"] == {
        "started_at": first["started_at"],
        "done": False,
        "stop_reason": None,
        "trials": 1,
    }
    forced = init(spec | {"workload": KIMI_JOB | {"concurrency": 100}}, "--force")
    assert not forced["resumed"] and forced["replaced"]["trials"] == 0


def test_report_is_stamped_with_the_start_of_the_search(tmp_path: Path):
    state = search()
    out = tmp_path / "state.json"
    autotune_state.save_state(state, out)
    args = ["report", "--state", str(out), "--out-dir", str(tmp_path / "r")]
    assert autotune.main(args) == 0
    assert (tmp_path / "r" / f"autotune-{state['started_at']}.md").exists()


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"tolerance": 1.5}, "autotune_tolerance: 1.5 is not a number >= 0 and < 1"),
        ({"tolerance": "x"}, "autotune_tolerance: 'x'"),
        ({"max_trials": 0}, "autotune_max_trials: 0 is not a positive integer"),
        ({"kv_cache_dtypes_allowed": ["fp9"]}, "autotune_kv_cache_dtypes_allowed: 'fp9' is not"),
        ({"workload": {"input_len": 10}}, "autotune_workload.output_len is required"),
    ],
)
def test_inputs_are_checked_without_a_host(inputs: dict[str, Any], message: str):
    given = {"space": {"mem_fraction_static": [0.9]}, "workload": KIMI_JOB} | inputs
    with pytest.raises(AutotuneInputError) as err:
        autotune_inputs.validate_inputs(**given)
    assert message in str(err.value)
    assert (
        autotune_inputs.validate_inputs(
            space=SPACE, workload=KIMI_JOB, kv_cache_dtypes_allowed=["auto", "fp8_e4m3"]
        )["workload"]["num_prompts"]
        == 150
    )


@pytest.mark.parametrize(
    ("calibrated", "overrides", "factor"),
    [
        (True, {}, lambda f: 1.0),
        (False, {}, lambda f: 1.0),  # a baseline start first
        (True, {"max_trials": 2}, lambda f: 1.0),
        (False, {"tolerance": 0.0}, lambda f: 0.5 if f.get("kv_cache_dtype") else 1.0),
    ],
)
def test_trials_at_most_bounds_the_tuning_loop(calibrated, overrides, factor) -> None:
    """The tuning loop (roles/autotune/tasks/main.yml) runs at most trials_at_most() steps, as
    read before the first one; at every step the bound still covers what is left, and it is 0
    once the search is done."""
    state = search(calibrated, **overrides)
    measure = wave_server(factor)
    bounds, steps = [], 0
    while True:
        bounds.append(autotune.trials_at_most(state))
        trial = trial_choice.next_trial(state)
        if trial is None:
            break
        steps += 1
        trial_outcome.record_trial(state, trial, {"smoke": measure(trial["flags"])})
    assert steps > 0
    assert all(bound >= steps - taken for taken, bound in enumerate(bounds))
    assert autotune.trials_at_most(state) == 0
