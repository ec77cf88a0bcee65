"""The Kimi job's missing lever: attention data parallelism, planned and tuned.

Part 1, the planner at full size: Kimi-K2.5 int4 on 8 x RTX PRO 6000 (97887 MiB), tp 8,
--mem-fraction-static 0.90, fp8 KV, calibrated by a start-up log at 0.85 bf16 constructed from
the job's figures, not the job's own log (tests/fixtures/logs/README.md:
constructed-kimi-k2.5-tp8-mf085-bf16.log), the job's requests of 2000 + 2000 tokens.
For each attention-DP size: weights per GPU, KV tokens per rank and in total, concurrent
requests, the KV-bound throughput (concurrency x the log's 12.15 tok/s per request), the free
memory per rank after CUDA graph capture and the decode roofline. Then the same plan for the
job's final hand-tuned flag set (0.88, fp8 KV, TP), the figure the operator stopped at.

Part 2, autotune on the double: the job's final hand-tuned configuration is the server's
flag set (so it is the first trial: the baseline every candidate is measured against), the
space is attn_dp_size 1/2/4/8 x cuda_graph_max_bs_decode 32/64/128 x mem_fraction_static
0.88/0.90 with fp8 KV. As in bench/autotune_vs_grid.py the job is scaled down in time: a copy of
the fixture model with 16 x the layers (a cell 16 x larger) and 16 x fewer attention heads (the
attention weights attention DP replicates stay the same bytes), requests of 2000/16 + 2000/16
tokens, so a request takes the same share of a pool; the client offers 400 concurrent requests
(the job had tens of thousands of prompts: concurrency is the client's choice). The double's
speed under attention DP is a model (gpusim/README.md, "Attention DP"): its ratios say what
the model gives, a real host's autotune decides.

Prints the figures; exits 1 when autotune's winner is not an attention-DP layout or does not
beat the baseline. Not part of `make test` (about 10 trials of 10-20 s here).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# bench/ is the script's own folder, first on sys.path when run as `python bench/...py`.
import autotune_vs_grid as grid_bench
from gpusim.state import Hardware

from gpusim import state as gpusim_state
from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.capacity.planner import plan
from sglang_fleet.tuning import autotune_state, trial_choice, trial_outcome

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
JOB_MODEL = FIXTURES / "models" / "kimi-k2.5-int4"
# Constructed in SGLang 0.5.23's formats from the job's figures (tests/fixtures/logs/README.md).
JOB_LOG = FIXTURES / "logs" / "constructed-kimi-k2.5-tp8-mf085-bf16.log"
GPU_NAME = grid_bench.GPU_NAME
HOST = grid_bench.HOST
# The job's final hand-tuned flag set (docs/THE-JOB.md, inventory profile `throughput`).
HAND_TUNED = {
    "tp_size": 8,
    "trust_remote_code": True,
    "mem_fraction_static": 0.88,
    "kv_cache_dtype": "fp8_e4m3",
    "num_continuous_decode_steps": 4,
    "disable_custom_all_reduce": True,
    "enable_hierarchical_cache": True,
    "hicache_size": 48,
    "hicache_write_policy": "write_through",
    "hicache_io_backend": "kernel",
    "enable_metrics": True,
}
SPACE = {
    "mem_fraction_static": [0.88, 0.90],
    "kv_cache_dtype": ["fp8_e4m3"],
    "attn_dp_size": [1, 2, 4, 8],
    "cuda_graph_max_bs_decode": [32, 64, 128],
}
SCALE = 16
CLIENT_CONCURRENCY = 400


# --- part 1: the planner ---------------------------------------------------------------------
def job_plan(**flags: Any) -> dict[str, Any]:
    config, weights = read_model_dir(JOB_MODEL)
    args = {
        "tp_size": 8,
        "avg_input_len": 2000,
        "avg_output_len": 2000,
        "calibration_log": JOB_LOG.read_text(),
    } | flags
    return plan(config, weights, args, HOST)


def print_layouts() -> tuple[dict[str, Any], dict[str, Any]]:
    result = job_plan(mem_fraction_static=0.90, kv_cache_dtype="fp8_e4m3")
    hand = job_plan(mem_fraction_static=0.88, kv_cache_dtype="fp8_e4m3", plan_layouts=False)
    print("planner, Kimi-K2.5 int4 on 8 x 96 GB, tp 8, 0.90 + fp8 KV, 2000 + 2000 tokens:")
    head = (
        "attn_dp  weights/GPU  KV tokens/rank  total KV tokens  concurrent  "
        "KV-bound tok/s  roofline tok/s  free after graphs  graph bs"
    )
    print(head)
    for row in result["attention_dp_layouts"]:
        print(
            f"{row['attn_dp_size']:7d}  {row['weights_per_gpu_gib']:8.2f} GiB  "
            f"{row['kv_tokens_per_rank']:14d}  {row['total_kv_tokens']:15d}  "
            f"{row['max_concurrent_requests']:10d}  {row['kv_bound_output_tok_s']:14.1f}  "
            f"{row['decode_roofline_tok_s']:14.1f}  "
            f"{row['free_after_graph_gib_per_rank']:13.2f} GiB  "
            f"{row['cuda_graph_max_bs_decode'] or 'default':>8}"
            + (f"  ERRORS {row['errors']}" if row["errors"] else "")
        )
    roof = hand["decode_roofline"]
    print(
        f"hand-tuned (0.88, fp8, TP): {hand['total_kv_tokens']} KV tokens, "
        f"{hand['max_concurrent_requests']} concurrent, {hand['kv_bound_output_tok_s']} tok/s "
        f"KV-bound, roofline {roof['tok_s']} tok/s"
    )
    pick = result["recommended_layout"]
    gain = pick["planned_output_tok_s"] / hand["kv_bound_output_tok_s"]
    print(f"recommended: {pick['reason']}")
    print(f"planned gain over the hand-tuned configuration: {gain:.2f}x")
    return result, hand


# --- part 2: autotune on the double ------------------------------------------------------------
def scaled_model(workdir: Path) -> Path:
    """SCALE x the layers (the cell grows with them) and SCALE x fewer heads (the attention
    weights that attention DP splits over fewer GPUs stay the same bytes)."""
    target = workdir / f"kimi-k2.5-int4-x{SCALE}-layers"
    shutil.copytree(grid_bench.FIXTURE, target)
    config = json.loads((target / "config.json").read_text())
    text = config["text_config"]
    text["num_hidden_layers"] *= SCALE
    text["num_attention_heads"] //= SCALE
    text["num_key_value_heads"] = text["num_attention_heads"]
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def setup(workdir: Path, decode_step_s: float) -> grid_bench.Setup:
    timing = grid_bench.bench_timing(decode_step_s)
    root = gpusim_state.init_state(Hardware(timing=timing), workdir / "gpusim")
    workload = {
        "input_len": 2000 // SCALE,
        "output_len": 2000 // SCALE,
        "concurrency": CLIENT_CONCURRENCY,
        "num_prompts": CLIENT_CONCURRENCY,
    }
    return grid_bench.Setup(root, scaled_model(workdir), workdir, workload, SPACE)


def run_autotune(env: grid_bench.Setup) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    config, weight_bytes = read_model_dir(env.model_dir)
    state = autotune_state.new_state(
        server="kimi",
        base_flags=HAND_TUNED,
        space=SPACE,
        workload=env.workload,
        context={"model_config": config, "weight_bytes": weight_bytes, "host": HOST},
        kv_cache_dtypes_allowed=["auto", "fp8_e4m3"],
    )
    rows = []
    while (trial := trial_choice.next_trial(state)) is not None:
        label = f"trial-{trial['n']:02d}-{trial['candidate']}"
        result = grid_bench.run_trial(env, trial["flags"], label)
        trial_outcome.record_trial(state, trial, result)
        rows.append(grid_bench._row(trial["candidate"], trial["tuned"], result))
        grid_bench._print_row("autotune", len(rows), rows[-1])
    return state, rows


def summarize(state: dict[str, Any], rows: list[dict[str, Any]]) -> bool:
    base = rows[0] if rows and rows[0]["candidate"] == trial_choice.BASELINE_ID else None
    win = trial_choice.winner(state)
    print(f"\nautotune stopped: {state['stop_reason']}; {len(rows)} trials")
    pruned: dict[str, int] = {}
    for c in state["candidates"]:
        if c["status"] == "pruned":
            pruned[c["prune"]["code"]] = pruned.get(c["prune"]["code"], 0) + 1
    print(f"pruned before any trial ran them: {pruned}")
    if not (base and base["output_throughput"] and win):
        print("FAIL: no baseline or no winner")
        return False
    tuned = {k: win["flags"].get(k) for k in ("attn_dp_size", "cuda_graph_max_bs_decode")}
    tuned |= {k: win["flags"].get(k) for k in ("mem_fraction_static", "kv_cache_dtype")}
    ratio = win["output_throughput"] / base["output_throughput"]
    print(f"tuned flag set on the double: {json.dumps(tuned)}")
    print(
        f"double: hand-tuned {base['output_throughput']:.1f} tok/s -> tuned "
        f"{win['output_throughput']:.1f} tok/s ({ratio:.2f}x, the double's model, scaled run)"
    )
    checks = [
        ((win["flags"].get("attn_dp_size") or 1) > 1, "the winner runs attention DP"),
        (ratio > 1.0, f"the winner beats the hand-tuned configuration ({ratio:.2f}x)"),
    ]
    for ok, text in checks:
        print(("PASS " if ok else "FAIL ") + text)
    return all(ok for ok, _ in checks)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-step-s", type=float, default=0.02)
    parser.add_argument("--plan-only", action="store_true", help="part 1 only (seconds)")
    parser.add_argument("--keep", type=Path, default=None, help="keep logs and results here")
    args = parser.parse_args(argv)
    print_layouts()
    if args.plan_only:
        return 0
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="attention-dp-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        env = setup(workdir, args.decode_step_s)
        print(f"\nworkload: {json.dumps(env.workload)} on {env.model_dir.name}", flush=True)
        tic = time.monotonic()
        state, rows = run_autotune(env)
        print(f"wall time: {time.monotonic() - tic:.0f} s")
        return 0 if summarize(state, rows) else 1
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
