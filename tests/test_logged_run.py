"""A log's own flags (sglang_fleet.capacity.logged_flags, docs/CALIBRATION.md "A log's own flags"):
what-if
plans from an excerpt without `server_args=` move with the question.

The expected token counts are SGLang's formula worked out here (kv_cache is not called):
#tokens = floor((post - pre x (1 - f) - reserve) GiB / cell), with the Kimi job's figures
(tests/fixtures/logs/README.md): pre 94.19 GiB, post 24.03 GiB, the multimodal reserve
100/1024 GiB, a bf16 cell of (512 + 64) x 61 x 2 = 70272 B, fp8 half of it.
"""

from __future__ import annotations

import math
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from kimi_job import GPU, KIMI_LOG

from sglang_fleet.capacity import attention_dp, logged_flags, planner
from sglang_fleet.capacity.model_config import ModelConfigError, read_model_dir
from sglang_fleet.capacity.planner import plan
from sglang_fleet.capacity.planner_inputs import PlanInputError
from sglang_fleet.capacity.server_log import parse_log
from sglang_fleet.diagnosis import diagnose, run_diagnosis
from sglang_fleet.diagnosis import live_metrics as live
from sglang_fleet.tuning import autotune

ROOT = Path(__file__).resolve().parent.parent
EXCERPT = (
    ROOT / "tests/fixtures/logs/constructed-kimi-k2.5-tp8-mf088-bf16-excerpt.log"
).read_text()
KIMI_DIR = ROOT / "tests/fixtures/models/kimi-k2.5-int4"
CONFIG, WEIGHTS = read_model_dir(KIMI_DIR)
HOST = {"gpu_memory_mib": 97887, "host_ram_gib": 400, "gpu_count": 8, "gpu_name": GPU}
GIB = 2**30
PRE, POST, RESERVE = 94.19, 24.03, 100 / 1024
BF16_CELL = (512 + 64) * 61 * 2
# Attention DP 8 at tp 8: q_b + kv_b + o per layer, the embedding and the w_kc/w_vc copy of
# kv_b that post_load_weights makes, whole on every GPU instead of an eighth
# (tests/test_attention_dp.py works the same figures out).
SPLIT = (1536 * 64 * (128 + 64) + 2 * 512 * 64 * (128 + 128) + 64 * 128 * 7168) * 61 * 2
EMBED = 163840 * 7168 * 2
EXTRA_DP8_GIB = (SPLIT + EMBED) * (1 - 1 / 8) / GIB


def sglang_tokens(fraction: float, cell: int, extra_weight_gib: float = 0.0) -> int:
    rest = POST - extra_weight_gib - PRE * (1 - fraction) - RESERVE
    return math.floor(rest * GIB / cell)


def kimi(log: str, **args: Any) -> dict[str, Any]:
    base = {"tp_size": 8, "avg_input_len": 2000, "avg_output_len": 2000, "calibration_log": log}
    return plan(CONFIG, WEIGHTS, base | args, HOST)


@pytest.mark.parametrize(
    ("fraction", "dtype", "cell"),
    [
        (0.85, "auto", BF16_CELL),
        (0.93, "auto", BF16_CELL),
        (0.90, "fp8_e4m3", BF16_CELL // 2),
        (0.88, "fp8_e4m3", BF16_CELL // 2),
    ],
)
def test_excerpt_predicts_other_fractions_and_dtypes(fraction, dtype, cell):
    """Before, every fraction asked planned the excerpt's own 192976 tokens."""
    result = kimi(EXCERPT, mem_fraction_static=fraction, kv_cache_dtype=dtype)
    expected = sglang_tokens(fraction, cell)
    # The log's count is floored: the plan may lose the part of one cell it dropped.
    assert 0 <= expected - result["max_total_num_tokens"] <= 2, (expected, result)
    assert result["max_total_num_tokens"] != 192976
    assert result["details"]["calibrated"] is True
    assert "calibration_flags_assumed" not in {w["code"] for w in result["warnings"]}


def test_excerpt_predicts_the_085_run_that_was_logged():
    """The excerpt (0.88) plans the 0.85 start the full log recorded: 149800 tokens."""
    logged = int(re.search(r"max_total_num_tokens=(\d+)", KIMI_LOG)[1])
    planned = kimi(EXCERPT, mem_fraction_static=0.85)["max_total_num_tokens"]
    assert logged == 149800 == sglang_tokens(0.85, BF16_CELL)
    assert abs(planned - logged) <= 1


def test_attention_dp_from_an_excerpt_adds_the_replicated_weights():
    """Before, an excerpt's weights were taken as every layout's: DP 8 planned the logged
    pool eight times over."""
    result = kimi(EXCERPT, mem_fraction_static=0.90, kv_cache_dtype="fp8_e4m3", attn_dp_size=8)
    expected = sglang_tokens(0.90, BF16_CELL // 2, EXTRA_DP8_GIB)
    assert 0 <= expected - result["max_total_num_tokens"] <= 2
    assert result["max_total_num_tokens"] < sglang_tokens(0.90, BF16_CELL // 2) / 2


def test_excerpt_and_full_log_of_the_same_run_plan_the_same_layouts():
    args = {"mem_fraction_static": 0.90, "kv_cache_dtype": "fp8_e4m3", "plan_layouts": True}
    from_excerpt, from_full = kimi(EXCERPT, **args), kimi(KIMI_LOG, **args)
    rows = [
        {r["attn_dp_size"]: r["kv_tokens_per_rank"] for r in result["attention_dp_layouts"]}
        for result in (from_excerpt, from_full)
    ]
    assert rows[0].keys() == rows[1].keys() == {1, 2, 4, 8}
    for size, tokens in rows[0].items():
        assert abs(tokens - rows[1][size]) <= 2, size
    best = [r["recommended_layout"]["attn_dp_size"] for r in (from_excerpt, from_full)]
    assert best[0] == best[1]


def test_inferred_flags_name_their_lines():
    run = logged_flags.infer(parse_log(EXCERPT))  # no config.json: the lines alone
    assert run.flags["kv_cache_dtype"] == "auto"
    assert run.flags["cuda_graph_max_bs_decode"] == 512
    assert "torch.bfloat16" in run.sources["kv_cache_dtype"]
    assert "tp_size" in run.unknown  # TP0 and TP5 only: tp is at least 6, the lines say no more


def strip_for_refusal(text: str) -> str:
    """No "[time TPn]" prefix and no weights figure: nothing fixes the layout."""
    lines = [re.sub(r"^\[[^\]]*\]\s*", "", line) for line in text.splitlines()]
    return "\n".join(re.sub(r"mem usage=[\d.]+ GB", "mem usage=-0.01 GB", line) for line in lines)


def test_a_log_that_cannot_be_inferred_is_refused_naming_the_flag():
    text = strip_for_refusal(EXCERPT)
    with pytest.raises(PlanInputError) as err:
        kimi(text, mem_fraction_static=0.90)
    assert err.value.argument == "calibration_log"
    assert "tp_size" in err.value.message and "--logged-flag" in err.value.message
    given = kimi(
        text,
        mem_fraction_static=0.88,
        calibration_log_flags={"tp_size": "8", "attn_dp_size": 1},
    )
    assert given["max_total_num_tokens"] == 192976


def test_stated_flags_are_checked_against_the_lines():
    result = kimi(
        EXCERPT, mem_fraction_static=0.88, calibration_log_flags={"mem_fraction_static": 0.85}
    )
    found = [w for w in result["warnings"] if w["code"] == "calibration_flags_disagree"]
    assert found and "stated 0.85, but the log's lines say 0.88" in found[0]["message"]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"tensor_parallel": 8}, "unknown flag(s) tensor_parallel"),
        ({"tp_size": "eight"}, "tp_size"),
        ({"kv_cache_dtype": "fp9"}, "fp9"),
        ("tp_size=8", "must be a mapping"),
    ],
)
def test_logged_flags_are_typed(flags, words):
    with pytest.raises(PlanInputError) as err:
        kimi(EXCERPT, calibration_log_flags=flags)
    assert err.value.argument == "calibration_log_flags"
    assert words in err.value.message


def cli(tmp_path: Path, *words: str) -> tuple[int, str]:
    log = tmp_path / "excerpt.log"
    log.write_text(EXCERPT)
    argv = ["--model-path", str(KIMI_DIR), "--tp-size", "8", "--gpu-memory-mib", "97887"]
    return planner.main([*argv, "--calibrate-from", str(log), *words]), str(log)


def test_cli_what_if_from_an_excerpt(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    status, _ = cli(tmp_path, "--mem-fraction-static", "0.85", "--logged-flag", "tp_size=8")
    out = capsys.readouterr().out
    assert status == 0
    assert "max_total_num_tokens 149799" in out or "max_total_num_tokens 149800" in out


def test_cli_logged_flag_must_be_name_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    status, _ = cli(tmp_path, "--logged-flag", "tp_size")
    assert status == 2
    assert "argument --logged-flag: must be NAME=VALUE" in capsys.readouterr().err


# --- bounded readers (issue 33: a device or a FIFO held the tools until memory ran out) -----
def run_with_deadline(target, seconds: float = 10.0) -> Any:
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            box["value"] = target()
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the reader did not return"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_calibrate_from_takes_a_regular_file_only(tmp_path, capsys, kind):
    path = {"device": Path("/dev/zero"), "folder": tmp_path}.get(kind, tmp_path / "fifo")
    if kind == "fifo":
        os.mkfifo(path)
    argv = ["--model-path", str(KIMI_DIR), "--gpu-memory-mib", "97887"]
    status = run_with_deadline(lambda: planner.main([*argv, "--calibrate-from", str(path)]))
    assert status == 2
    assert "argument --calibrate-from" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_diagnose_reads_a_regular_file_only(tmp_path, capsys, monkeypatch, kind):
    path = Path("/dev/zero") if kind == "device" else tmp_path / "fifo"
    if kind == "fifo":
        os.mkfifo(path)
    status = run_with_deadline(lambda: diagnose.main(["--log", str(path)]))
    assert status == 2
    assert "--log" in capsys.readouterr().err
    # The key file may be a pipe (the key on stdin), bounded in size and time; a device never.
    monkeypatch.setattr(live, "API_KEY_PIPE_DEADLINE_S", 0.3)
    expected = "no key line within" if kind == "fifo" else "not a regular file or a pipe"
    with pytest.raises(live.UsageError, match=expected):
        run_with_deadline(lambda: live.read_api_key(str(path)))


def test_api_key_pipe_without_a_line_ends_at_its_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(live, "API_KEY_PIPE_DEADLINE_S", 0.3)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # a writer that never writes
    try:
        with pytest.raises(live.UsageError, match=r"no key line within 0\.3 s"):
            run_with_deadline(lambda: live.read_api_key(str(fifo)))
        os.write(writer, b"x" * 5000)
        with pytest.raises(live.UsageError, match="no key line within 4096 bytes"):
            run_with_deadline(lambda: live.read_api_key(str(fifo)))
    finally:
        os.close(writer)


def test_diagnosis_of_a_kv_bound_run_calibrated_by_the_excerpt(tmp_path, capsys):
    """Before: "raise --mem-fraction-static from 0.9 to 0.930: max_total_num_tokens 192976
    (now 192976)" and attention DP 8 with eight times the logged pool."""
    decode = tmp_path / "decode.log"
    decode.write_text("\n".join(line for line in KIMI_LOG.splitlines() if "Decode batch" in line))
    excerpt = tmp_path / "excerpt.log"
    excerpt.write_text(EXCERPT)
    argv = ["--log", str(decode), "--calibrate-from", str(excerpt), "--concurrency", "150"]
    argv += ["--model-path", str(KIMI_DIR), "--tp-size", "8", "--gpu-memory-mib", "97887"]
    assert diagnose.main([*argv, "--mem-fraction-static", "0.9"]) == 0
    out = capsys.readouterr().out
    now = sglang_tokens(0.90, BF16_CELL)
    assert "verdict: kv_cache_bound" in out
    lever = next(line for line in out.splitlines() if line.startswith("lever mem_fraction_static"))
    # 8.17 GiB free at 0.88 (the excerpt), 0.94 GiB less per 0.01, a 5 GiB margin: 0.913.
    assert "from 0.9 to 0.910" in lever
    assert re.search(rf"\(now {now - 2}\)|\(now {now - 1}\)|\(now {now}\)", lever), (now, lever)
    assert "192976" not in out


# --- the real SGLang CPU engine's logs, captured as they came (bench/planner_accuracy.py) ----
@pytest.mark.parametrize("cap", [2048, 4096])
def test_real_cpu_engine_logs_state_and_show_their_flags(cap):
    text = (ROOT / f"tests/fixtures/logs/real-cpu-tiny-llama-mtt{cap}.log").read_text()
    cal = parse_log(text)
    assert cal.device == "cpu"
    assert cal.kv_tokens == cap == cal.max_total_num_tokens
    whole = logged_flags.infer(cal)
    assert whole.flags["tp_size"] == 1 and whole.sources["tp_size"] == "stated"
    assert whole.flags["kv_cache_dtype"] in ("auto", "bfloat16", "bf16")
    assert not whole.disagreements and not whole.unknown
    # Without its server_args line: SGLang tags no rank at tp 1, the KV line says bf16,
    # and the CPU engine's fraction is neither inferred nor needed.
    lines = [line for line in text.splitlines() if "server_args=" not in line]
    bare = logged_flags.infer(parse_log("\n".join(lines)))
    assert (bare.flags["tp_size"], bare.flags["attn_dp_size"]) == (1, 1)
    assert "no rank tag" in bare.sources["tp_size"]
    assert bare.flags["kv_cache_dtype"] == "auto"
    assert bare.unknown == []


def small_pool_run(running: int) -> dict[str, Any]:
    sample = {"num_running_reqs": running, "num_queue_reqs": 8, "token_usage": 0.6}
    return {
        "completed": 24,
        "failed": 0,
        "max_concurrency": 12,
        "concurrency": 9.0,
        "random_input_len": 200,
        "random_output_len": 200,
        "server_metrics": {
            "max_total_num_tokens": 1024,
            "samples": [sample | {"gen_throughput": 80.0}] * 20,
        },
    }


def test_a_small_pool_full_by_whole_requests_is_kv_bound():
    """bench/planner_accuracy.py's real CPU run: 1024 tokens hold two requests of 200 + 200,
    two ran, ten queued, token usage 0.6. Before it read compute_bound ("the KV cache has
    room"); SGLang admits a request only when its whole output fits."""
    log = "[2026-12-04 15:48:00] server_args={'max_total_tokens': 1024, 'device': 'cpu'}\n"
    result = run_diagnosis.diagnose(small_pool_run(running=2), log, 12, None)
    assert result["verdict"] == "kv_cache_bound"
    assert result["evidence"]["requests_fitting_kv"] == 2
    assert result["levers"][0]["code"] == "max_total_tokens"
    assert "--max-total-tokens 1024" in result["levers"][0]["message"]
    # One running of the two that fit: the pool had room, so it is not the bound.
    assert run_diagnosis.diagnose(small_pool_run(running=1), None, 12, None)["verdict"] != (
        "kv_cache_bound"
    )


@pytest.mark.parametrize("tool", ["plan", "diagnose"])
def test_a_log_of_zero_free_memory_is_no_traceback(tmp_path, capsys, tool):
    """`avail mem=0.00 GB` in every memory line (issue 33: ZeroDivisionError in both)."""
    log = tmp_path / "zero.log"
    log.write_text(re.sub(r"avail mem=[\d.]+ GB", "avail mem=0.00 GB", KIMI_LOG))
    argv = ["--model-path", str(KIMI_DIR), "--tp-size", "8", "--gpu-memory-mib", "97887"]
    if tool == "plan":
        status = planner.main([*argv, "--calibrate-from", str(log)])
        assert status in (0, 1)
        assert "calibration_incomplete" in capsys.readouterr().out
    else:
        assert diagnose.main([*argv, "--log", str(log)]) == 0
        assert "verdict:" in capsys.readouterr().out


def test_a_context_without_the_model_still_takes_the_logs_flags():
    """The diagnosis role's live path has the server's flags but not config.json (the deploy
    scenario's diagnose.yml failed on a missing 'model_config')."""
    ctx = run_diagnosis._with_log_calibration({"args": {}}, KIMI_LOG)
    assert ctx["args"]["tp_size"] == 8
    assert ctx["args"]["mem_fraction_static"] == 0.85


def test_a_tp_of_two_billion_is_refused_at_once():
    """`--tp-size 2147483647` ran for minutes (issue 33): parallel sizes end at 4096."""
    with pytest.raises(PlanInputError) as err:
        run_with_deadline(lambda: plan(CONFIG, WEIGHTS, {"tp_size": 2147483647}, HOST), 5)
    assert err.value.argument == "tp_size"


def test_model_config_that_is_a_fifo_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    with pytest.raises(ModelConfigError, match="not a regular file"):
        run_with_deadline(lambda: read_model_dir(model))


@pytest.mark.parametrize("kind", ["fifo", "deep"])
def test_autotune_reads_its_json_bounded(tmp_path, capsys, kind):
    """autotune's command line read its spec with no bound: a FIFO held it, deep JSON was a
    RecursionError traceback."""
    spec = tmp_path / "spec.json"
    if kind == "fifo":
        os.mkfifo(spec)
    else:
        spec.write_text("[" * 100000 + "]" * 100000)
    argv = ["init", "--spec", str(spec), "--context", str(spec), "--state", str(tmp_path / "s")]
    assert run_with_deadline(lambda: autotune.main(argv)) == 2
    err = capsys.readouterr().err
    assert "not a regular file" in err if kind == "fifo" else "nested deeper" in err


def test_live_server_info_nested_past_the_stack_is_no_traceback():
    """live_metrics.py runs alone on a host as live.pyz (no bounded_json beside it): a
    /server_info of 100000 nested lists was a RecursionError traceback."""
    deep = b"[" * 100000 + b"]" * 100000
    info, warnings = live.read_server_info(lambda path: (200, deep), "http://127.0.0.1:1", False)
    assert info is None
    assert "is not JSON" in warnings[0]


def test_a_logs_deprecated_attention_dp_spelling_keeps_its_layout():
    """`--dp-size 4 --enable-dp-attention` in a log's server_args is attention DP 4. The
    first version of the log reading handed the planner dp_size 1 beside enable_dp_attention,
    which it read as attention DP 1."""
    log = (
        "[2026-12-04 10:00:00] server_args={'tp_size': 8, 'dp_size': 4, "
        "'enable_dp_attention': True, 'mem_fraction_static': 0.85}\n"
    )
    args = run_diagnosis._with_log_calibration({"args": {}}, log)["args"]
    layout = attention_dp.resolve_layout(
        args["tp_size"], args["dp_size"], args.get("attn_dp_size"), args.get("enable_dp_attention")
    )
    assert (layout.attn_dp_size, layout.dp_size) == (4, 1)
