"""Calibration records: building, storing, matching, predicting (sglang_fleet.capacity.calibration).

A start-up log constructed from the Kimi job's figures (docs/THE-JOB.md;
fixtures/logs/constructed-kimi-k2.5-tp8-mf085-bf16.log, in SGLang 0.5.23's formats) shows
pre = 94.19 GiB, post = 24.03 GiB, 149800 KV tokens at
0.85 with bf16 KV (MLA cell 576 x 61 x 2 = 70272 B) and 11.00 GiB free after CUDA graph
capture (14.13 GiB at "Memory pool end": 3.13 GiB of graphs). The last test starts the
gpusim double for real and compares a prediction with what the next start reports.
"""

from __future__ import annotations

import copy
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import load_plugin
from kimi_job import GPU, KIMI_LOG, KIMI_RUN_FLAGS

from sglang_fleet.capacity import (
    calibration,
    calibration_apply,
    calibration_match,
    calibration_predict,
    calibration_record,
    calibration_rule,
    calibration_store,
    kv_cache,
)
from sglang_fleet.capacity.calibration import CalibrationError
from sglang_fleet.capacity.model_config import model_shape, read_model_dir, weight_bytes_from_index
from sglang_fleet.rollout import preflight_inputs as preflight

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
KIMI_CONFIG, KIMI_WEIGHTS = read_model_dir(FIXTURES / "models" / "kimi-k2.5-int4")
LLAMA_CONFIG, LLAMA_WEIGHTS = read_model_dir(FIXTURES / "models" / "llama-3.1-8b")
KIMI = model_shape(KIMI_CONFIG)
LLAMA = model_shape(LLAMA_CONFIG)
GIB = 2**30
KIMI_FLAGS = {
    **KIMI_RUN_FLAGS,
    "host": "0.0.0.0",
    "port": 8000,
    "api_key": "sk-very-secret",
}
KEY = {
    "model_path": "/shared/kimi-k2.5-int4",
    "model_config": KIMI_CONFIG,
    "weight_bytes": KIMI_WEIGHTS,
    "gpu_name": GPU,
    "gpu_memory_mib": 97887,
    "sglang_version": "0.5.23",
    "flags": KIMI_FLAGS,
    "server": "kimi",
    "recorded_at": "2026-11-29T10:05:00Z",
}
HOST = {
    "gpu_name": GPU,
    "gpu_memory_mib": 97887,
    "sglang_version": "0.5.23",
    "model_fingerprint": calibration_record.model_fingerprint(KIMI_CONFIG, KIMI_WEIGHTS),
    "architecture": KIMI.architecture,
}


def kimi_record(**key: Any) -> dict[str, Any]:
    return calibration_record.build_record(KIMI_LOG, None, KEY | key)


def flags(**changes: Any) -> dict[str, Any]:
    return {k: v for k, v in (KIMI_FLAGS | changes).items() if v is not None}


# --- building ---------------------------------------------------------------------------
def test_record_from_the_kimi_job_log():
    record = kimi_record()
    measured, key = record["measured"], record["key"]
    assert (measured["pre_gib"], measured["post_gib"], measured["weight_gib"]) == (
        94.19,
        24.03,
        70.16,
    )
    assert measured["max_total_num_tokens"] == 149800
    # graphs: 14.13 GiB free at "Memory pool end" - 11.00 after capture
    assert (measured["free_after_graph_gib"], measured["graph_gib"]) == (11.00, 3.13)
    assert (measured["max_running_requests"], measured["context_len"]) == (2048, 262144)
    # 9.80 GiB (two decimals) / 149800 tokens: close to the exact MLA cell, 70272 B
    assert measured["cell_size_bytes"] == pytest.approx(70272, rel=1e-3)
    assert key["architecture"] == "KimiK25ForConditionalGeneration"
    assert (key["tp_size"], key["mem_fraction_static"], key["kv_cache_dtype"]) == (8, 0.85, "auto")
    assert key["model_fingerprint"] == HOST["model_fingerprint"]
    assert record["sources"] == ["log"]
    assert (record["server"], record["recorded_at"]) == ("kimi", "2026-11-29T10:05:00Z")


def test_record_never_holds_a_secret():
    record = kimi_record()
    assert "api_key" not in record["key"]["flags"]
    assert "sk-very-secret" not in json.dumps(record)


def test_record_from_the_log_alone_knows_only_what_the_log_says():
    record = calibration_record.build_record(KIMI_LOG, None, {})
    key = record["key"]
    assert key["model_path"] == "/shared/kimi-k2.5-int4"  # the server_args line
    assert key["model_fingerprint"] is None and key["gpu_name"] is None
    assert key["flags"] is None
    assert key["chunked_prefill_size"] == 8192


def server_info() -> dict[str, Any]:
    """/server_info of a Llama start at 0.85 (rank 0's figures, as SGLang reports them)."""
    return {
        "model_path": "/models/llama",
        "tp_size": 1,
        "dp_size": 1,
        "mem_fraction_static": 0.85,
        "kv_cache_dtype": "auto",
        "chunked_prefill_size": 8192,
        "max_running_requests": 2048,
        "max_total_num_tokens": 537877,
        "page_size": 1,
        "version": "0.5.23",
        "internal_states": [
            {
                "memory_usage": {
                    "weight": 14.958,
                    "kvcache": 65.663,
                    "startup_available": 10.6,
                    "token_capacity": 537877,
                    "graph": {"prefill": 0.453, "decode": 0.5},
                }
            }
        ],
    }


def test_record_from_server_info_where_the_log_lacks_memory_lines():
    record = calibration_record.build_record("nothing useful here\n", server_info(), {})
    measured = record["measured"]
    # post = KV + graphs + still free; pre = post + weights (rank 0; a little low)
    assert measured["post_gib"] == pytest.approx(65.663 + 0.953 + 10.6)
    assert measured["pre_gib"] == pytest.approx(65.663 + 0.953 + 10.6 + 14.958)
    assert measured["free_after_graph_gib"] == 10.6
    assert measured["graph_gib"] == pytest.approx(0.953)
    assert measured["max_total_num_tokens"] == 537877
    assert record["key"]["sglang_version"] == "0.5.23"
    assert record["sources"] == ["server_info"]


def test_incomplete_sources_are_an_error_naming_what_is_missing():
    with pytest.raises(CalibrationError, match="pre_gib, post_gib, max_total_num_tokens"):
        calibration_record.build_record("no memory lines\n", None, {})
    info = server_info()
    del info["internal_states"]
    with pytest.raises(CalibrationError, match="free_after_graph_gib"):
        calibration_record.build_record("", info, {})


def test_post_capture_kv_sizing_is_recorded_and_never_matches():
    log = KIMI_LOG + "[2026-11-29 10:04:00 TP0] KV Cache VA upper bound. dtype: x\n"
    record = calibration_record.build_record(log, None, KEY)
    assert record["measured"]["post_capture_kv_sizing"] is True
    found, reason = calibration_match.match([record], flags(), HOST)
    assert found is None
    assert "sized after CUDA graph capture" in reason


# --- the store ----------------------------------------------------------------------------
def test_store_keeps_newest_first_and_one_record_per_flag_set():
    first = kimi_record(recorded_at="2026-11-29T10:00:00Z")
    again = kimi_record(recorded_at="2026-11-30T10:00:00Z")
    other = kimi_record(recorded_at="2026-11-30T11:00:00Z")
    other["key"]["mem_fraction_static"] = 0.88
    records = calibration_store.add_record([], first)
    records = calibration_store.add_record(records, other)
    records = calibration_store.add_record(records, again)  # same flag set as `first`
    assert [r["recorded_at"] for r in records] == ["2026-11-30T10:00:00Z", "2026-11-30T11:00:00Z"]
    many = records
    for i in range(20):
        extra = copy.deepcopy(first)
        extra["key"]["page_size"] = i + 2
        many = calibration_store.add_record(many, extra)
    assert len(many) == calibration.STORE_LIMIT


def test_store_round_trips_as_json_and_sets_aside_what_is_no_store():
    records = calibration_store.add_record([], kimi_record())
    text = json.dumps(calibration_store.dump_store(records))
    assert json.loads(text)["schema"] == calibration.STORE_SCHEMA
    for given in (text, json.loads(text), records[0]):  # text, parsed, one bare record
        read = calibration_store.read_store(given)
        assert (read.records, read.set_aside) == (records, [])
    assert calibration_store.read_store("") == calibration_store.read_store(None)
    assert calibration_store.read_store(None).records == []
    junk = calibration_store.read_store("42")
    assert junk.records == []
    assert junk.problems() == "the whole file: a calibration store holds {schema, records: [...]}"
    assert junk.set_aside[0].content == "42"  # kept for the side file as it was


# --- the store: one rule for writing and reading (issue: the store refused its own records) --
REAL_CPU = FIXTURES / "real-sglang-0.5.23-cpu"
LATE_RELEASE_LOG = (FIXTURES / "logs" / "constructed-llama-3.1-8b-tp1-late-release.log").read_text()
LLAMA_KEY = {
    "model_path": "/models/llama-3.1-8b",
    "model_config": LLAMA_CONFIG,
    "weight_bytes": LLAMA_WEIGHTS,
    "gpu_name": "NVIDIA H100 80GB HBM3",
    "gpu_memory_mib": 97887,
    "sglang_version": "0.5.23",
    "flags": {"tp_size": 1, "mem_fraction_static": 0.88},
    "server": "llama",
}


def _cpu_key() -> dict[str, Any]:
    """What the record step of a CPU server keys a record with: the host's RAM as the device."""
    return {
        "model_path": "/opt/models/tiny",
        "model_fingerprint": "sha256:tiny",
        "gpu_name": "cpu",
        "gpu_memory_mib": 24 * 1024,
        "sglang_version": "0.5.23",
        "flags": {"device": "cpu", "max_total_tokens": 4096, "context_length": 2048},
        "server": "tiny",
    }


def _written_then_read(record: dict[str, Any], store: str = "") -> calibration_store.StoreRead:
    update = calibration_store.store_update(store, record, STORE_PATH, "tiny")
    return calibration_store.read_store(json.dumps(update["store"]))


STORE_PATH = "/var/lib/sglang-fleet/tiny/calibration.json"


def test_the_real_cpu_engine_start_whose_free_memory_rose_is_kept_and_read_back():
    """SGLang 0.5.23's CPU engine, captured as it came (fixtures/real-sglang-0.5.23-cpu/
    startup-free-memory-rose.log): host RAM moved during the weight load, so free memory rose
    ("mem usage=-0.0x GB"). main wrote such a record and refused it on the next read."""
    log = (REAL_CPU / "startup-free-memory-rose.log").read_text()
    record = calibration_record.build_record(log, None, _cpu_key())
    measured = record["measured"]
    assert (measured["pre_gib"], measured["post_gib"]) == (21.38, 21.49)
    assert measured["max_total_num_tokens"] == 4096
    assert record["key"]["device"] == "cpu"
    assert measured["free_rose_during_load_gib"] == round(
        measured["post_gib"] - measured["pre_gib"], 3
    )
    assert measured["weight_gib"] is None  # a rise measures no weights: unknown, not 0 or < 0
    read = _written_then_read(record)
    assert read.set_aside == []
    assert read.records == [record]
    # ... and the next pre-flight plans with the store instead of refusing the host.
    server = {"name": "tiny", "paths": {"calibration_file": STORE_PATH}, "flags": {}}
    store = json.dumps(calibration_store.dump_store(read.records))
    args = preflight.calibration_args({"store": store, "mode": "enforce"}, server)
    assert calibration_store.read_store(args["calibration"]).records == [record]


def test_a_gpu_start_whose_free_memory_rose_within_the_noise_is_kept_and_plans():
    record = calibration_record.build_record(LATE_RELEASE_LOG, None, LLAMA_KEY)
    measured = record["measured"]
    assert (measured["pre_gib"], measured["post_gib"]) == (79.80, 80.04)
    assert measured["weight_gib"] is None
    assert measured["max_total_num_tokens"] == 577241
    assert _written_then_read(record).records == [record]
    host = {"gpu_memory_mib": 97887, "gpu_name": LLAMA_KEY["gpu_name"], "sglang_version": "0.5.23"}
    flags_090 = {"tp_size": 1, "mem_fraction_static": 0.90}
    found, reason = calibration_match.match([record], flags_090, host, flags_complete=False)
    assert found == record, reason
    # SGLang's own formula at 0.90 from the same two readings.
    rest = kv_cache.rest_gib(79.80, 80.04, 0.90)
    expected = kv_cache.max_total_num_tokens(rest, 131072, 1)
    predicted = calibration_predict.predict(record, flags_090, host, LLAMA).max_total_num_tokens
    assert abs(predicted - expected) <= 0.001 * expected


def test_a_gpu_start_whose_free_memory_rose_past_the_noise_is_no_calibration():
    """Past the noise, `pre` understates the GPU (a release of at least the weights plus the
    rise happened during the load): no record is written, and the reason names the figures."""
    log = LATE_RELEASE_LOG.replace(
        "avail mem=80.04 GB, mem usage=-0.24 GB", "avail mem=81.80 GB, mem usage=-2.00 GB"
    )
    with pytest.raises(
        CalibrationError, match=r"free memory rose 2\.00 GiB during the weight load"
    ):
        calibration_record.build_record(log, None, LLAMA_KEY)
    with pytest.raises(CalibrationError, match=r"more than the 0\.40 GiB of measurement noise"):
        calibration_record.build_record(log, None, LLAMA_KEY)


def test_nothing_is_written_that_the_reader_would_set_aside():
    record = kimi_record()
    damaged = copy.deepcopy(record)
    damaged["measured"]["post_gib"] = damaged["measured"]["pre_gib"] + 1
    problem = calibration_rule.record_problem(damaged)
    assert problem and "free memory rose 1.00 GiB" in problem
    with pytest.raises(CalibrationError, match="would not be read back: free memory rose"):
        calibration_store.add_record([record], damaged)
    update = calibration_store.store_update("", damaged, STORE_PATH, "kimi")
    assert update["store"]["records"] == []
    assert "this start's record is not kept: the record would not be read back" in update["warning"]


def test_a_store_with_one_bad_entry_keeps_the_good_ones_and_sets_the_bad_one_aside():
    good = kimi_record(recorded_at="2026-11-30T10:00:00Z")
    bad = copy.deepcopy(good)
    bad["recorded_at"] = "2026-11-29T10:00:00Z"
    bad["key"]["mem_fraction_static"] = 0.88
    bad["measured"]["free_after_graph_gib"] = 1e6
    text = json.dumps(calibration_store.dump_store([good, bad]))
    read = calibration_store.read_store(text)
    assert read.records == [good]
    assert read.problems() == (
        "record 1 (recorded 2026-11-29T10:00:00Z): measured.free_after_graph_gib 1e+06 is "
        "outside -1..4096"
    )
    # The pre-flight plans with the good record and names the bad one; nothing blocks.
    plan_filter = load_plugin("plugins/filter/sglang_plan.py").sglang_server_plan
    server = {
        "name": "kimi",
        "paths": {"calibration_file": STORE_PATH},
        "plan_args": {"tp_size": 8, "mem_fraction_static": 0.85, "kv_cache_dtype": "auto"},
        "flags": dict(KIMI_RUN_FLAGS),
        "gpus": list(range(8)),
    }
    gpus = [{"index": i, "name": GPU, "memory_total_mib": 97887} for i in range(8)]
    result = plan_filter(
        server, KIMI_CONFIG, KIMI_WEIGHTS, gpus, 400 * 1024, None,
        {"store": text, "mode": "enforce", "sglang_version": "0.5.23"},
    )  # fmt: skip
    assert result["details"]["calibrated"] is True
    assert result["details"]["calibration_set_aside"] == [read.problems()]
    assert result["errors"] == []
    # The record step of the next healthy start moves it to a side file beside the store.
    newer = kimi_record(recorded_at="2026-12-01T10:00:00Z", flags=flags(chunked_prefill_size=4096))
    update = calibration_store.store_update(text, newer, STORE_PATH, "kimi")
    assert [r["recorded_at"] for r in update["store"]["records"]] == [
        "2026-12-01T10:00:00Z",
        "2026-11-30T10:00:00Z",
    ]
    assert update["set_aside_path"].startswith("/var/lib/sglang-fleet/tiny/calibration.set-aside-")
    assert update["set_aside_path"].endswith("Z.json")
    assert update["set_aside"]["entries"] == [
        {"entry": 1, "problem": read.set_aside[0].problem, "content": bad}
    ]
    assert "record 1 (recorded 2026-11-29T10:00:00Z)" in update["warning"]
    assert update["set_aside_path"] in update["warning"]


# --- matching -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("changes", "predicted"),
    [
        ({"mem_fraction_static": 0.90}, "mem_fraction_static 0.85 -> 0.9"),
        ({"max_running_requests": 128}, "max_running_requests None -> 128"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype auto -> fp8_e4m3"),
        ({"chunked_prefill_size": 4096}, "chunked_prefill_size 8192 -> 4096"),
        ({"cuda_graph_max_bs_decode": 64}, "cuda_graph_max_bs_decode None -> 64"),
        ({"page_size": 64}, "page_size 1 -> 64"),
    ],
)
def test_changes_a_record_predicts_across(changes: dict[str, Any], predicted: str):
    record, reason = calibration_match.match([kimi_record()], flags(**changes), HOST)
    assert record is not None
    assert predicted in reason


@pytest.mark.parametrize(
    "changes",
    [
        {"port": 8001, "host": "127.0.0.1", "api_key": "other"},
        {"num_continuous_decode_steps": 1, "enable_metrics": True, "log_level": "debug"},
        {"enable_hierarchical_cache": True, "hicache_size": 48},
        {"tp_size": "8", "disable_custom_all_reduce": "true"},  # the same, as extra-vars text
    ],
)
def test_flags_without_a_memory_effect_keep_the_record(changes: dict[str, Any]):
    record, reason = calibration_match.match([kimi_record()], flags(**changes), HOST)
    assert record is not None, reason


@pytest.mark.parametrize(
    ("changes", "host", "why"),
    [
        ({"tp_size": 4}, {}, "tp_size differs (8 vs 4)"),
        ({"dp_size": 2}, {}, "dp_size differs (1 vs 2)"),
        ({"pp_size": 2}, {}, "pp_size differs"),
        ({"disable_custom_all_reduce": None}, {}, "disable_custom_all_reduce differs"),
        ({"attention_backend": "flashinfer"}, {}, "attention_backend differs"),
        ({"kv_cache_dtype": "int3"}, {}, "no known cell size"),
        ({}, {"gpu_name": "NVIDIA H200"}, "GPU model differs"),
        ({}, {"gpu_memory_mib": 143771}, "GPU memory differs"),
        ({}, {"sglang_version": "0.5.21"}, "SGLang version differs"),
        ({}, {"model_fingerprint": "sha256:0"}, "model (config.json + weights) differs"),
        ({}, {"architecture": "LlamaForCausalLM"}, "model architecture differs"),
    ],
)
def test_differences_that_make_a_record_unusable(changes: dict, host: dict, why: str):
    record, reason = calibration_match.match([kimi_record()], flags(**changes), HOST | host)
    assert record is None
    assert why in reason
    assert reason.startswith("no calibration matches")


def test_unknown_sides_are_not_verified_rather_than_rejected():
    log_only = calibration_record.build_record(KIMI_LOG, None, {})
    record, reason = calibration_match.match([log_only], flags(), HOST)
    assert record is not None
    assert "not verified" in reason and "other flags not recorded" in reason
    # A planner that knows only some flags compares only topology, dtype and identity.
    record, reason = calibration_match.match(
        [kimi_record()], {"tp_size": 8, "attention_backend": "x"}, HOST, flags_complete=False
    )
    assert record is not None
    assert "other flags not given" in reason


def test_the_closest_record_wins_then_the_newest():
    at_085 = kimi_record(recorded_at="2026-11-29T10:00:00Z")
    at_090 = copy.deepcopy(at_085)
    at_090["key"]["mem_fraction_static"] = 0.90
    at_090["recorded_at"] = "2026-11-29T11:00:00Z"
    newer_085 = copy.deepcopy(at_085)
    newer_085["recorded_at"] = "2026-11-30T10:00:00Z"
    store = [newer_085, at_090, at_085]  # the store keeps the newest first
    chosen, reason = calibration_match.match(store, flags(mem_fraction_static=0.90), HOST)
    assert chosen == at_090
    assert "same flag set" in reason
    chosen, _ = calibration_match.match(store, flags(), HOST)
    assert chosen["recorded_at"] == "2026-11-30T10:00:00Z"


def test_nothing_recorded_says_so():
    assert calibration_match.match([], flags(), HOST) == (None, "no calibration recorded")
    assert calibration_match.match(None, flags(), HOST) == (None, "no calibration recorded")


# --- predicting -------------------------------------------------------------------------------
def prediction(**changes: Any) -> calibration_predict.Prediction:
    record = kimi_record()
    return calibration_predict.predict(record, flags(**changes), HOST, KIMI)


def test_same_flag_set_predicts_what_was_measured():
    p = prediction()
    assert p.max_total_num_tokens == 149800
    assert p.free_after_graph_gib == pytest.approx(11.00)
    assert (p.graph_delta_gib, p.req_to_token_delta_gib) == (0.0, 0.0)


@pytest.mark.parametrize("fraction", [0.80, 0.88, 0.90, 0.93])
def test_fraction_moves_the_static_pool_by_delta_times_pre(fraction: float):
    p = prediction(mem_fraction_static=fraction)
    delta = (fraction - 0.85) * 94.19
    assert p.max_total_num_tokens == int(149800 * 70272 + delta * GIB) // 70272
    assert p.free_after_graph_gib == pytest.approx(11.00 - delta)
    # highest fraction with 5 GiB left: 0.85 + (11.00 - 5) / 94.19 = 0.9137 -> 0.913
    assert p.max_safe_mem_fraction_static == 0.913
    assert p.fits is (11.00 - delta >= 5.0)


def test_fp8_reuses_the_same_pool_at_half_the_cell():
    p = prediction(kv_cache_dtype="fp8_e4m3")
    assert p.cell_size_bytes == 35136
    assert p.max_total_num_tokens == 2 * 149800
    assert p.free_after_graph_gib == pytest.approx(11.00)  # the pool's bytes do not change
    assert "cell size 70272 -> 35136" in p.notes[0]


def test_smaller_batch_caps_shrink_decode_graphs_by_sglangs_estimate():
    # tp 8 on a 96 GB GPU: decode graphs up to bs 512; max_running_requests 128 caps them
    # at 128: (512 - 128) x 2 MiB = 0.75 GiB less graph memory.
    p = prediction(max_running_requests=128)
    assert p.graph_delta_gib == pytest.approx(-0.75)
    assert p.free_after_graph_gib == pytest.approx(11.75)
    explicit = prediction(cuda_graph_max_bs_decode=256)
    assert explicit.graph_delta_gib == pytest.approx(-0.5)


def test_mha_prefill_graphs_follow_the_chunk():
    # Llama (MHA): 8 MiB per prefill capture bucket; 8192 has 58 buckets, 4096 has 49.
    record = kimi_record()
    record["key"] |= {"tp_size": 1, "architecture": None, "model_fingerprint": None}
    llama_flags = {"tp_size": 1, "mem_fraction_static": 0.85, "chunked_prefill_size": 4096}
    p = calibration_predict.predict(record, llama_flags, HOST, LLAMA)
    buckets = len(kv_cache.prefill_graph_token_buckets(4096)) - len(
        kv_cache.prefill_graph_token_buckets(8192)
    )
    # tp 1 decode graphs: 256 either way; only the prefill buckets differ
    assert p.graph_delta_gib == pytest.approx(buckets * 8 / 1024)


def test_a_larger_request_table_costs_memory_a_smaller_one_is_not_credited():
    # (max_running_requests + 1) x context_len int32 entries: 4096 instead of 2048 requests
    # at 262144 tokens of context = 2048 x 262144 x 4 B = 2 GiB more.
    bigger = prediction(max_running_requests=4096)
    assert bigger.req_to_token_delta_gib == pytest.approx(2.0)
    assert bigger.free_after_graph_gib == pytest.approx(11.00 - 2.0)
    smaller = prediction(max_running_requests=1024)
    assert smaller.req_to_token_delta_gib == 0.0


def test_margin_grows_with_chunks_above_8192():
    assert calibration_predict.margin_for(5.0, 8192) == 5.0
    assert calibration_predict.margin_for(5.0, 4096) == 5.0
    assert calibration_predict.margin_for(5.0, 16384) == 10.0
    assert calibration_predict.margin_for(5.0, -1) == 10.0  # no chunking: a 16384-token prefill
    p = prediction(chunked_prefill_size=16384)
    assert p.margin_gib == 10.0
    # MLA prefill graphs do not grow with the chunk: 11.00 GiB free still clears 10 GiB,
    # 0.88 (8.17 GiB) no longer does.
    assert p.free_after_graph_gib == pytest.approx(11.00)
    assert p.fits
    assert not prediction(chunked_prefill_size=16384, mem_fraction_static=0.88).fits


def test_page_size_and_token_cap_round_the_prediction():
    p = prediction(page_size=64)
    assert p.max_total_num_tokens == 149800 // 64 * 64
    capped = prediction(max_total_tokens=100000)
    assert capped.max_total_num_tokens == 100000


# --- the planner's entry point ------------------------------------------------------------
def test_enforced_oom_risk_is_an_error_with_the_numbers():
    applied = calibration_apply.apply(
        [kimi_record()], flags(mem_fraction_static=0.93), HOST, KIMI, margin_gib=5.0
    )
    assert applied.warnings == []
    [error] = applied.errors
    assert error["code"] == "oom_risk_mem_fraction"
    free = 11.00 - 0.08 * 94.19  # 3.46 GiB
    assert f"predicted {free:.2f} GiB free after CUDA graph capture" in error["message"]
    assert "below the 5.0 GiB margin" in error["message"]
    assert "highest fraction that keeps the margin is 0.913" in error["message"]


def test_warn_mode_overrules_and_ignore_mode_skips():
    warned = calibration_apply.apply(
        [kimi_record()], flags(mem_fraction_static=0.93), HOST, KIMI, mode="warn"
    )
    assert warned.errors == []
    assert "calibration_mode is 'warn'" in warned.warnings[0]["message"]
    ignored = calibration_apply.apply(
        [kimi_record()], flags(mem_fraction_static=0.93), HOST, KIMI, mode="ignore"
    )
    assert (ignored.prediction, ignored.errors, ignored.warnings) == (None, [], [])
    with pytest.raises(CalibrationError, match="enforce, warn, ignore"):
        calibration_apply.apply([kimi_record()], flags(), HOST, KIMI, mode="strict")


def test_mismatch_is_a_warning_and_no_prediction():
    applied = calibration_apply.apply([kimi_record()], flags(tp_size=4), HOST, KIMI)
    assert applied.prediction is None and applied.errors == []
    [warning] = applied.warnings
    assert warning["code"] == "calibration_mismatch"
    assert "tp_size differs (8 vs 4)" in warning["message"]
    assert "falls back to estimates" in warning["message"]


def test_store_text_is_accepted():
    text = json.dumps(calibration_store.dump_store([kimi_record()]))
    applied = calibration_apply.apply(text, flags(mem_fraction_static=0.90), HOST, KIMI)
    assert applied.prediction is not None
    assert applied.prediction.fits


# --- on the double: planned max_total_num_tokens within 2 % of what the server reports -------
@pytest.mark.slow
def test_prediction_matches_the_next_start_of_the_double(tmp_path: Path):
    import gpusim_helpers as helpers  # noqa: PLC0415  (only this test starts the double)

    root = helpers.init_root(tmp_path / "gpusim")
    config, weight_bytes = read_model_dir(helpers.KIMI)
    shape = model_shape(config)
    host = HOST | {"model_fingerprint": calibration_record.model_fingerprint(config, weight_bytes)}

    def start(server_flags: dict[str, Any]) -> dict[str, Any]:
        argv = ["--model-path", helpers.KIMI]
        for name, value in server_flags.items():
            argv += [f"--{name.replace('_', '-')}", str(value)]
        server = helpers.start_server(root, tmp_path, *argv)
        try:
            server.wait_ready(60)
            with urllib.request.urlopen(server.url + "/server_info", timeout=10) as response:
                info = json.load(response)
            key = {
                "model_config": config,
                "weight_bytes": weight_bytes,
                "gpu_name": GPU,
                "gpu_memory_mib": 97887,
                "flags": server_flags,
            }
            return calibration_record.build_record(server.log(), info, key)
        finally:
            helpers.stop_server(server)

    first = {"tp_size": 8, "mem_fraction_static": 0.85, "kv_cache_dtype": "fp8_e4m3"}
    record = start(first)
    for changes in (
        {"mem_fraction_static": 0.90},
        {"mem_fraction_static": 0.88, "kv_cache_dtype": "auto", "max_running_requests": 128},
        {"mem_fraction_static": 0.80, "chunked_prefill_size": 4096},
    ):
        candidate = first | changes
        found, reason = calibration_match.match([record], candidate, host)
        assert found is not None, reason
        predicted = calibration_predict.predict(found, candidate, host, shape)
        measured = start(candidate)["measured"]
        reported = measured["max_total_num_tokens"]
        assert abs(predicted.max_total_num_tokens - reported) <= 0.02 * reported
        # In fact far closer: the double follows SGLang's formula to the token.
        assert abs(predicted.max_total_num_tokens - reported) <= 0.001 * reported
        # Free memory after graphs: the planner moves the measured graph memory by SGLang's
        # reserve estimate (memory_hook.py, 2 MiB per decode batch size), the double allocates
        # its own model of capture (gpusim/memory.py graph_memory_mib, issue 47: no formula
        # shared). Shrinking the decode graphs from 512 to 128 requests frees 768 MiB by the
        # estimate and about 580 MiB in the double; within a quarter GiB of each other.
        assert predicted.free_after_graph_gib == pytest.approx(
            measured["free_after_graph_gib"], abs=0.25
        )


# --- the store update and the fingerprint, as the calibrate action uses them ----------------
def test_store_update_and_fingerprint():
    record = kimi_record()
    update = calibration_store.store_update("", record)
    store = update["store"]
    again = calibration_store.store_update(json.dumps(store), record)
    assert again["store"] == store  # the same flag set replaces its older record
    assert update["warning"] is again["warning"] is None
    index = {"metadata": {"total_size": KIMI_WEIGHTS}}
    assert (
        calibration_record.model_fingerprint(KIMI_CONFIG, weight_bytes_from_index(index))
        == HOST["model_fingerprint"]
    )
    with pytest.raises(CalibrationError, match="pre_gib"):
        calibration_record.build_record("no memory lines", None, {})
    broken = calibration_store.store_update("{", record)
    assert broken["store"]["records"] == [record]  # the start's record is kept ...
    assert broken["set_aside"]["entries"][0]["content"] == "{"  # ... and the file set aside
