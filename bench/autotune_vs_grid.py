#!/usr/bin/env python3
"""Autotune against the exhaustive grid, with real trials on gpusim's SGLang double.

    .venv/bin/python bench/autotune_vs_grid.py                 # grid, then autotune
    .venv/bin/python bench/autotune_vs_grid.py --only autotune # the autotune half alone

Each trial is what the playbook does on a canary, on a simulated 8 x 96 GB host: start the
server with the candidate's flags (`python -m gpusim.sglang_server`), wait for /health,
build the calibration record from the start-up log and /server_info, run the smoke client
(`python -m sglang_fleet.smoke.smoke_client`) with the Kimi job, stop the server.

The story's job is 150 concurrent requests of 2000 + 2000 tokens on Kimi-K2.5 int4, tp 8.
Scaled down in time (--scale S, default 20): requests of 2000/S + 2000/S tokens on a copy of
the fixture model with S x the layers, so that one request still takes the same share of
the KV pool (the same concurrency, the same memory, the same pruning), in S x fewer decode
steps; the double's decode step is --decode-step-s (default 0.02 s, 0.4 x its default, so
that the machine streams far below what its cores can: the figures stay the model's, not
the CPU's). Throughput ratios between flag sets are what the double's model gives at full
size; absolute tok/s are the scaled run's.

The space: mem_fraction_static 0.85/0.88/0.90/0.93, max_running_requests 96/160,
chunked_prefill_size 4096/8192, kv_cache_dtype auto/fp8_e4m3 (32 candidates); --space full
adds cuda_graph_max_bs_decode 256/512 (64). num_continuous_decode_steps does nothing in
SGLang 0.5.23 and is no longer a space key.

Targets (issue 13): autotune's best >= 95 % of the grid's best output tok/s, in at most a
third of the grid's trials, and no autotune trial after the first start runs out of memory.
Prints the figures; exits 1 when a target is missed. Not part of `make test`: the grid
runs 32 trials of about 12 s each here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The venv `make` builds has both packages installed (editable): no path edits here.
from gpusim.state import Hardware, Timing

from gpusim import state as gpusim_state
from sglang_fleet.capacity import calibration, calibration_record
from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.tuning import (
    autotune_candidates,
    autotune_inputs,
    autotune_report,
    autotune_state,
    trial_choice,
    trial_outcome,
)

REPO = Path(__file__).resolve().parent.parent
GPUSIM = REPO / "gpusim"

FIXTURE = GPUSIM / "gpusim" / "fixtures" / "kimi-k2.5-int4"
GPU_MIB = 97887
GPU_NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
HOST = {"gpu_memory_mib": GPU_MIB, "host_ram_gib": 400, "gpu_count": 8, "gpu_name": GPU_NAME}
# The story's first start: tp 8 at 0.85, bf16 KV, 4 decode steps per schedule.
BASE_FLAGS = {
    "tp_size": 8,
    "trust_remote_code": True,
    "mem_fraction_static": 0.85,
    "kv_cache_dtype": "auto",
    "num_continuous_decode_steps": 4,
    "disable_custom_all_reduce": True,
    "enable_metrics": True,
}
SPACE = {
    "mem_fraction_static": [0.85, 0.88, 0.90, 0.93],
    "max_running_requests": [96, 160],
    "chunked_prefill_size": [4096, 8192],
    "kv_cache_dtype": ["auto", "fp8_e4m3"],
}
# The decode CUDA graph batch: graph memory and the batch a step runs with graphs.
FULL_SPACE = SPACE | {"cuda_graph_max_bs_decode": [256, 512]}
STORY_INPUT, STORY_OUTPUT, STORY_CONCURRENCY = 2000, 2000, 150
START_TIMEOUT_S = 60
SMOKE_TIMEOUT_S = 600


@dataclass
class Setup:
    root: Path
    model_dir: Path
    workdir: Path
    workload: dict[str, int]
    space: dict[str, list[Any]]


def scaled_model(workdir: Path, scale: int) -> Path:
    """The fixture with scale x the layers: a cell scale x larger, the same weights."""
    target = workdir / f"kimi-k2.5-int4-x{scale}-layers"
    shutil.copytree(FIXTURE, target)
    config = json.loads((target / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] *= scale
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def bench_timing(decode_step_s: float) -> Timing:
    """The double's timing for a scaled job: no start-up cost, prefill in step with decode."""
    return Timing(
        load_weights_s=0,
        kv_alloc_s=0,
        graph_capture_s=0,
        decode_step_s=decode_step_s,
        batch_slowdown=0.01,
        prefill_token_s=0.00002 * decode_step_s / 0.05,
    )


def setup(workdir: Path, scale: int, decode_step_s: float, space: dict[str, list]) -> Setup:
    timing = bench_timing(decode_step_s)
    root = gpusim_state.init_state(Hardware(timing=timing), workdir / "gpusim")
    workload = {
        "input_len": STORY_INPUT // scale,
        "output_len": STORY_OUTPUT // scale,
        "concurrency": STORY_CONCURRENCY,
        "num_prompts": STORY_CONCURRENCY,
    }
    return Setup(root, scaled_model(workdir, scale), workdir, workload, space)


# --- one trial ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flag_argv(flags: dict[str, Any]) -> list[str]:
    argv = []
    for name, value in flags.items():
        option = "--" + name.replace("_", "-")
        if value is True:
            argv.append(option)
        elif value not in (None, False):
            argv += [option, str(value)]
    return argv


def child_env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["GPUSIM_STATE_DIR"] = str(root)
    env["SGL_FORCE_SHUTDOWN"] = "1"
    return env


def get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.load(response)
    except (OSError, urllib.error.URLError, json.JSONDecodeError):
        return None


def wait_healthy(proc: subprocess.Popen[bytes], url: str) -> bool:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(url + "/health", timeout=5) as response,
        ):
            if response.status == 200:
                return True
        time.sleep(0.1)
    return False


def stop(proc: subprocess.Popen[bytes], root: Path) -> None:
    """SIGTERM (forced shutdown), then kill what the launcher registered, by pid."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for rank in gpusim_state.live_procs(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank.pid, signal.SIGKILL)


def smoke(url: str, workload: dict[str, int], out: Path) -> dict[str, Any] | None:
    argv = [
        sys.executable,
        "-m",
        "sglang_fleet.smoke.smoke_client",
        f"--url={url}",
        f"--num-prompts={workload['num_prompts']}",
        f"--max-concurrency={workload['concurrency']}",
        f"--random-input-len={workload['input_len']}",
        f"--random-output-len={workload['output_len']}",
        "--warmup-requests=1",
        "--metrics-interval=1",
        f"--json={out}",
    ]
    subprocess.run(argv, cwd=REPO, capture_output=True, timeout=SMOKE_TIMEOUT_S, check=False)
    return json.loads(out.read_text()) if out.exists() else None


def run_trial(env: Setup, flags: dict[str, Any], label: str) -> dict[str, Any]:
    """One stop -> start -> health -> smoke -> stop cycle; the autotune result dict."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = env.workdir / f"{label}.log"
    argv = ["--model-path", str(env.model_dir), "--port", str(port), *flag_argv(flags)]
    cmd = [sys.executable, "-m", "gpusim.sglang_server", *argv]
    with open(log_path, "wb") as log:
        # In a folder of its own: `python -m` puts the working directory first on sys.path, and
        # a gpusim/ folder there (the repository's, the simulated host's state) would shadow
        # the installed package.
        cwd = env.workdir / "server-cwd"
        cwd.mkdir(exist_ok=True)
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(env.root), cwd=cwd
        )
    try:
        if not wait_healthy(proc, url):
            return {"error": _tail(log_path), "phase": "start", "smoke": None, "calibration": None}
        record = _calibrate(env, log_path, get_json(url + "/server_info"), flags)
        result = smoke(url, env.workload, env.workdir / f"{label}.json")
        crashed = proc.poll() is not None
        return {
            "smoke": result,
            "calibration": record,
            "error": _tail(log_path) if crashed else None,
            "phase": "smoke" if crashed else None,
        }
    finally:
        stop(proc, env.root)


def _calibrate(env: Setup, log_path: Path, info: dict | None, flags: dict) -> dict | None:
    """The record the role stores after the health gate (capacity/calibration_record.py)."""
    config, weight_bytes = read_model_dir(env.model_dir)
    key = {
        "model_config": config,
        "weight_bytes": weight_bytes,
        "gpu_name": GPU_NAME,
        "gpu_memory_mib": GPU_MIB,
        "sglang_version": (info or {}).get("version"),
        "flags": flags,
    }
    try:
        return calibration_record.build_record(log_path.read_text(errors="replace"), info, key)
    except calibration.CalibrationError:
        return None


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# --- the two searches ---------------------------------------------------------------------
def new_search(env: Setup, tolerance: float) -> dict[str, Any]:
    config, weight_bytes = read_model_dir(env.model_dir)
    return autotune_state.new_state(
        server="kimi",
        base_flags=BASE_FLAGS,
        space=env.space,
        workload=env.workload,
        context={"model_config": config, "weight_bytes": weight_bytes, "host": HOST},
        kv_cache_dtypes_allowed=["auto", "fp8_e4m3"],
        tolerance=tolerance,
    )


def run_grid(env: Setup) -> list[dict[str, Any]]:
    """Every candidate of the space, in grid order (the same candidates autotune plans)."""
    state = new_search(env, 0.0)
    rows = []
    for candidate in state["candidates"]:
        flags = autotune_candidates.candidate_flags(state, candidate)
        result = run_trial(env, flags, f"grid-{candidate['id']}")
        rows.append(_row(candidate["id"], candidate["tuned"], result))
        _print_row("grid", len(rows), rows[-1])
    return rows


def _row(cid: str, tuned: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    smoke_result = result.get("smoke") or {}
    texts = [result.get("error") or ""] + [str(e) for e in smoke_result.get("errors") or []]
    ok = not result.get("error") and smoke_result.get("failed") == 0
    return {
        "candidate": cid,
        "tuned": tuned,
        "ok": ok and bool(smoke_result.get("completed")),
        "output_throughput": smoke_result.get("output_throughput") if ok else None,
        "oom": any("out of memory" in t.lower() for t in texts),
    }


def _print_row(kind: str, n: int, row: dict[str, Any]) -> None:
    tok_s = row["output_throughput"]
    figure = f"{tok_s:8.1f} tok/s" if tok_s else "  failed" + (" (OOM)" if row["oom"] else "")
    tuned = " ".join(f"{k}={v}" for k, v in row["tuned"].items()) or "(current flags)"
    print(f"{kind:8s} {n:3d} {row['candidate']:5s} {figure}  {tuned}", flush=True)


def run_autotune(env: Setup, tolerance: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    state = new_search(env, tolerance)
    rows = []
    while (trial := trial_choice.next_trial(state)) is not None:
        result = run_trial(env, trial["flags"], f"autotune-{trial['n']:02d}-{trial['candidate']}")
        trial_outcome.record_trial(state, trial, result)
        rows.append(_row(trial["candidate"], trial["tuned"], result))
        _print_row("autotune", len(rows), rows[-1])
    return state, rows


# --- figures --------------------------------------------------------------------------------
def best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [r for r in rows if r["output_throughput"]]
    return max(ok, key=lambda r: r["output_throughput"]) if ok else None


def summarize(grid: list[dict], tuned_rows: list[dict], state: dict[str, Any]) -> bool:
    grid_best, auto_best = best(grid), best(tuned_rows)
    grid_ooms = sum(r["oom"] for r in grid)
    late_ooms = sum(r["oom"] for r in tuned_rows[1:])
    print()
    print(f"grid:     {len(grid)} trials, best {_fmt(grid_best)}, {grid_ooms} out of memory")
    print(f"autotune: {len(tuned_rows)} trials, best {_fmt(auto_best)}, ", end="")
    print(f"{late_ooms} out of memory after the first start")
    print(f"autotune stopped: {state['stop_reason']}")
    pruned = [c for c in state["candidates"] if c["status"] == "pruned"]
    by_code: dict[str, int] = {}
    for c in pruned:
        by_code[c["prune"]["code"]] = by_code.get(c["prune"]["code"], 0) + 1
    print(f"autotune pruned {len(pruned)} candidates: {by_code}")
    if not (grid_best and auto_best):
        print("FAIL: a search found no working flag set")
        return False
    ratio = auto_best["output_throughput"] / grid_best["output_throughput"]
    share = len(tuned_rows) / len(grid)
    checks = [
        (ratio >= 0.95, f"autotune best / grid best = {ratio:.1%} (target >= 95 %)"),
        (share <= 1 / 3, f"autotune trials / grid trials = {share:.1%} (target <= 33.3 %)"),
        (late_ooms == 0, f"out-of-memory trials after the first start: {late_ooms} (target 0)"),
    ]
    for ok, text in checks:
        print(("PASS " if ok else "FAIL ") + text)
    return all(ok for ok, _ in checks)


def _fmt(row: dict[str, Any] | None) -> str:
    if row is None:
        return "none"
    tuned = " ".join(f"{k}={v}" for k, v in row["tuned"].items()) or "(current flags)"
    return f"{row['output_throughput']:.1f} tok/s ({row['candidate']}: {tuned})"


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so that the trial in progress stops its server."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=20, help="divide request lengths by this")
    parser.add_argument("--decode-step-s", type=float, default=0.02)
    parser.add_argument(
        "--space",
        choices=("default", "full"),
        default="default",
        help="full adds cuda_graph_max_bs_decode [256, 512] (64 candidates instead of 32)",
    )
    parser.add_argument("--tolerance", type=float, default=autotune_inputs.DEFAULT_TOLERANCE)
    parser.add_argument("--only", choices=("grid", "autotune"), default=None)
    parser.add_argument("--keep", type=Path, default=None, help="keep logs and results here")
    parser.add_argument(
        "--grid-results",
        type=Path,
        default=None,
        help="reuse the grid.json of an earlier run (--keep) instead of running the grid",
    )
    parser.add_argument("--report-dir", type=Path, default=None, help="write autotune's report")
    args = parser.parse_args(argv)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="autotune-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        space = FULL_SPACE if args.space == "full" else SPACE
        env = setup(workdir, args.scale, args.decode_step_s, space)
        print(f"workload: {json.dumps(env.workload)} on {env.model_dir.name}", flush=True)
        tic = time.monotonic()
        if args.grid_results:
            grid = json.loads(args.grid_results.read_text())
            print(f"grid: {len(grid)} trials read from {args.grid_results}")
        else:
            grid = run_grid(env) if args.only != "autotune" else []
            (workdir / "grid.json").write_text(json.dumps(grid, indent=1))
        grid_s = time.monotonic() - tic
        state, tuned_rows = run_autotune(env, args.tolerance) if args.only != "grid" else ({}, [])
        print(f"\nwall time: grid {grid_s:.0f} s, autotune {time.monotonic() - tic - grid_s:.0f} s")
        if args.report_dir and state:
            print(autotune_report.write_report(state, args.report_dir, "bench"))
        if args.only:
            rows = grid or tuned_rows
            print(f"{args.only}: {len(rows)} trials, best {_fmt(best(rows))}")
            return 0
        return 0 if summarize(grid, tuned_rows, state) else 1
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
