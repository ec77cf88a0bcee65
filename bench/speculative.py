#!/usr/bin/env python3
"""Speculative decoding at the job's load: autotune on gpusim's SGLang double (issue 46).

    .venv/bin/python bench/speculative.py                    # 150 clients, then 16
    .venv/bin/python bench/speculative.py --loads 16         # one load
    .venv/bin/python bench/speculative.py --timing NAME=VALUE   # a gpusim Timing setting

The story's job (docs/THE-JOB.md): Kimi-K2.5 int4 at tp 8, fp8 KV at mem_fraction_static 0.88,
150 concurrent requests of 2000 + 2000 tokens, and an EAGLE-3 draft of the model
(tests/fixtures/models/kimi-k2.5-eagle3: one MLA layer). At each load (150 clients, the job's;
16, the smoke gate's) autotune searches `autotune_space.speculative: [null, EAGLE3 3 steps, top-k
1, 4 draft tokens]` over those flags: both candidates run, since speculation's gain is unknown
until a trial measures its accept length, and autotune keeps the better one. Each trial is a
canary's: start the double with the candidate's flags, health, calibration record, the smoke
client at the load, stop (bench/autotune_vs_grid.py's trial, scaled the same way: requests of
2000/S + 2000/S tokens on a model of S x the layers, --scale S, default 20).

It needs the double to model speculation (the other half of issue 46: the draft's memory, the
accept length, sglang:spec_accept_length in /metrics); it checks that first with one short
start and skips with a message otherwise. The double's own knobs (its accept length, the batch
where speculation stops paying) are gpusim Timing/Hardware settings, left at their defaults
unless --timing or --hardware names one.

Prints, per load, the output tok/s without and with speculation, the accept length the trial
measured, and which one autotune picks; exits 1 when autotune's pick is not the faster of the
two it measured. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

# bench/ is on sys.path when this file runs: the trial machinery is autotune_vs_grid's.
import autotune_vs_grid as trials
from gpusim.state import Hardware

from gpusim import state as gpusim_state
from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.capacity.speculative import algorithm_of
from sglang_fleet.smoke.smoke_client.prometheus_text import parse_series
from sglang_fleet.tuning import autotune_state, trial_choice, trial_outcome

REPO = Path(__file__).resolve().parent.parent
DRAFT_FIXTURE = REPO / "tests" / "fixtures" / "models" / "kimi-k2.5-eagle3"
# The story's final configuration (docs/THE-JOB.md), without max_running_requests: a
# speculative candidate gets the job's concurrency (SGLang would reset it to 48).
BASE_FLAGS = trials.BASE_FLAGS | {"mem_fraction_static": 0.88, "kv_cache_dtype": "fp8_e4m3"}
EAGLE3 = {"algorithm": "EAGLE3", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
LOADS = (150, 16)
PROBE_TIMEOUT_S = 60


def _setting(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"must be NAME=VALUE, got {text!r}")
    return name.strip(), float(value)


def double_state(workdir: Path, args: argparse.Namespace) -> Path:
    """The simulated host: the trial timing of autotune_vs_grid.py, and the settings given."""
    timing = trials.bench_timing(args.decode_step_s)
    hardware_fields = {f.name for f in dataclasses.fields(Hardware)}
    timing_fields = {f.name for f in dataclasses.fields(type(timing))}
    for name, value in args.timing:
        if name not in timing_fields:
            sys.exit(f"--timing {name}: the double's Timing has no such setting")
        timing = dataclasses.replace(timing, **{name: value})
    hardware = Hardware(timing=timing)
    for name, value in args.hardware:
        if name not in hardware_fields:
            sys.exit(f"--hardware {name}: the double's Hardware has no such setting")
        hardware = dataclasses.replace(hardware, **{name: value})
    return gpusim_state.init_state(hardware, workdir / "gpusim")


def setup(workdir: Path, root: Path, scale: int, concurrency: int) -> trials.Setup:
    workload = {
        "input_len": trials.STORY_INPUT // scale,
        "output_len": trials.STORY_OUTPUT // scale,
        "concurrency": concurrency,
        "num_prompts": concurrency,
    }
    model = workdir / f"kimi-k2.5-int4-x{scale}-layers"
    if not model.exists():
        model = trials.scaled_model(workdir, scale)
    space = {"speculative": [None, EAGLE3 | {"draft_model_path": str(workdir / "draft")}]}
    return trials.Setup(root, model, workdir, workload, space)


def double_speculates(env: trials.Setup) -> str | None:
    """Why the double cannot stand in for speculation here (None when it can): one start with
    EAGLE3 flags, one generation, then SGLang's accept gauge must be in /metrics."""
    port = trials.free_port()
    url = f"http://127.0.0.1:{port}"
    flags = BASE_FLAGS | {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": str(env.workdir / "draft"),
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
        "max_running_requests": 16,
        # SGLang publishes the accept gauges with a decode log line (every 40 steps by
        # default): the probe's one short generation needs them sooner.
        "decode_log_interval": 4,
    }
    argv = ["--model-path", str(env.model_dir), "--port", str(port), *trials.flag_argv(flags)]
    cwd = env.workdir / "server-cwd"
    cwd.mkdir(exist_ok=True)
    log = env.workdir / "probe.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpusim.sglang_server", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=trials.child_env(env.root),
            cwd=cwd,
        )
    try:
        if not trials.wait_healthy(proc, url):
            return f"it does not start with EAGLE3 flags: {trials._tail(log, 5)}"
        body = json.dumps({"input_ids": [1] * 32, "sampling_params": {"max_new_tokens": 64}})
        request = urllib.request.Request(
            url + "/generate", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S) as response:
            response.read()
        time.sleep(1.0)  # gauges are published on the decode log interval
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        accepted = [
            value for name, _, value in parse_series(metrics)
            if name == "sglang:spec_accept_length" and value >= 1
        ]  # fmt: skip
        if not accepted:
            return "its /metrics has no sglang:spec_accept_length of 1 or more after a generation"
        return None
    except OSError as exc:
        return f"it does not answer: {exc}"
    finally:
        trials.stop(proc, env.root)


def search(env: trials.Setup) -> dict[str, Any]:
    config, weight_bytes = read_model_dir(env.model_dir)
    draft_config, draft_bytes = read_model_dir(env.workdir / "draft")
    drafts = {str(env.workdir / "draft"): {"config": draft_config, "weight_bytes": draft_bytes}}
    return autotune_state.new_state(
        server="kimi",
        base_flags=BASE_FLAGS,
        space=env.space,
        workload=env.workload,
        context={
            "model_config": config,
            "weight_bytes": weight_bytes,
            "host": trials.HOST,
            "drafts": drafts,
        },
        kv_cache_dtypes_allowed=["auto", "fp8_e4m3"],
    )


def run_load(env: trials.Setup) -> dict[str, Any]:
    """Autotune at one load: every trial it runs, and its pick."""
    state = search(env)
    measured: dict[str, dict[str, Any]] = {}
    while (trial := trial_choice.next_trial(state)) is not None:
        label = f"c{env.workload['concurrency']}-{trial['n']:02d}-{trial['candidate']}"
        result = trials.run_trial(env, trial["flags"], label)
        row = trial_outcome.record_trial(state, trial, result)
        kind = "speculative" if algorithm_of(trial["flags"]) else "plain"
        measured[kind] = row
        tok_s = row["output_throughput"]
        print(
            f"{env.workload['concurrency']:4d} clients  {kind:11s}  "
            + (f"{tok_s:8.1f} tok/s" if tok_s else f"  {row['outcome']}")
            + (f", accept length {row['spec_accept_length']}" if row["spec_accept_length"] else ""),
            flush=True,
        )
    best = trial_choice.winner(state)
    picked = None if best is None else ("speculative" if algorithm_of(best["flags"]) else "plain")
    return {"measured": measured, "picked": picked, "stop_reason": state["stop_reason"]}


def report(results: dict[int, dict[str, Any]]) -> bool:
    print("\nclients  without tok/s  with tok/s  with/without  accept length  autotune picks")
    ok = True
    for load, found in results.items():
        plain = found["measured"].get("plain") or {}
        spec = found["measured"].get("speculative") or {}
        a, b = plain.get("output_throughput"), spec.get("output_throughput")
        ratio = f"{b / a:.2f}" if a and b else "-"
        print(
            f"{load:7d}  {a or 0:13.1f}  {b or 0:10.1f}  {ratio:>12s}  "
            f"{spec.get('spec_accept_length') or '-':>13}  {found['picked']}"
        )
        faster = "speculative" if (b or 0) > (a or 0) else "plain"
        if found["picked"] != faster:
            print(f"FAIL at {load} clients: autotune picked {found['picked']}, {faster} was faster")
            ok = False
    return ok


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=20, help="divide request lengths by this")
    parser.add_argument("--decode-step-s", type=float, default=0.02)
    parser.add_argument("--loads", type=int, nargs="+", default=list(LOADS))
    parser.add_argument("--timing", type=_setting, action="append", default=[])
    parser.add_argument("--hardware", type=_setting, action="append", default=[])
    parser.add_argument("--keep", type=Path, default=None, help="keep logs and results here")
    args = parser.parse_args(argv)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="speculative-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(DRAFT_FIXTURE, workdir / "draft", dirs_exist_ok=True)
        root = double_state(workdir, args)
        why = double_speculates(setup(workdir, root, args.scale, 16))
        if why is not None:
            print(f"SKIP: the double does not model speculative decoding: {why}")
            return 0
        results = {load: run_load(setup(workdir, root, args.scale, load)) for load in args.loads}
        return 0 if report(results) else 1
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
