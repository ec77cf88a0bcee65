"""The planner's measured error: every start-up log planned from every other of its model and host.

    .venv/bin/python bench/planner_accuracy.py              # fixtures, double, real CPU engine
    .venv/bin/python bench/planner_accuracy.py --skip-real  # without the real SGLang (seconds)
    .venv/bin/python bench/planner_accuracy.py --capture    # also keep the real engine's logs
                                                            # (tests/fixtures/logs/real-cpu-*.log)

Part 1, tokens: the logs come from three places, grouped by model and host:
- tests/fixtures/logs: the constructed Kimi-K2.5 starts (0.85 full, 0.88 excerpt);
- gpusim's SGLang double: the Kimi fixture on 8 simulated 97887 MiB GPUs at several fractions,
  KV dtypes and attention-DP layouts (started here, a few seconds each);
- the real SGLang 0.5.23 CPU engine (the reference venv, scripts/sglang-reference-env.sh): the
  tiny Llama at two --max-total-tokens caps.
For each ordered pair (calibration log A, target log B) the planner is given B's flags (read
from B's server_args) and A as --calibrate-from, once whole and once as an excerpt (no
server_args line, ranks 0 and 5 only: what an operator pastes), and its planned
max_total_num_tokens is set beside the #tokens B logged.

Part 2, the real scheduler KV-bound: the real CPU engine with a small --max-total-tokens, long
requests and more clients than fit; the planned concurrent requests beside the peak of
`sglang:num_running_reqs` read from its /metrics during the run, and the diagnosis of that run
(sglang_fleet.diagnosis.run_diagnosis on its log and the smoke result).

Prints both tables; exits 1 when a GPU pair of one host and SGLang version is off by more than
2 %. Not part of `make test`: part 1 without the real engine takes seconds, the real engine's
three starts a few minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# bench/ is the script's own folder, first on sys.path when run as `python bench/...py`.
import autotune_vs_grid as grid_bench
from gpusim.state import Hardware, Timing

from gpusim import state as gpusim_state
from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.capacity.planner import plan
from sglang_fleet.capacity.planner_inputs import PlanInputError
from sglang_fleet.capacity.server_log import StartupLog, parse_log
from sglang_fleet.diagnosis import run_diagnosis

REPO = Path(__file__).resolve().parent.parent
LOGS = REPO / "tests" / "fixtures" / "logs"
KIMI_FIXTURE = REPO / "tests" / "fixtures" / "models" / "kimi-k2.5-int4"
GPU_HOST = grid_bench.HOST
REF_VENV = Path(os.environ.get("SGLANG_REF_VENV", REPO / ".cache" / "sglang-ref" / "venv"))
MAKE_MODEL = REPO / "gpusim" / "tools" / "make_tiny_llama.py"
TOLERANCE = 0.02
# The flags planned for a target, as its server_args states them.
PLANNED_FLAGS = (
    "tp_size",
    "attn_dp_size",
    "mem_fraction_static",
    "kv_cache_dtype",
    "chunked_prefill_size",
    "cuda_graph_max_bs_decode",
    "page_size",
    "context_length",
    "max_total_tokens",
    "device",
)
# The double's starts: fraction, KV dtype, attention DP (tp 8 throughout).
DOUBLE_STARTS = (
    (0.80, "auto", 1),
    (0.85, "auto", 1),
    (0.88, "auto", 1),
    (0.90, "fp8_e4m3", 1),
    (0.85, "fp8_e4m3", 1),
    (0.88, "fp8_e4m3", 2),
    (0.88, "fp8_e4m3", 4),
)
# The real CPU engine (as tests/double/test_contract_real.py starts it).
CPU_FLAGS = (
    *("--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule"),
    *("--context-length", "2048", "--enable-metrics", "--decode-log-interval", "5"),
)
CPU_CAPS = (2048, 4096)
KV_BOUND_CAPS, KV_BOUND_IN, KV_BOUND_OUT, KV_BOUND_CLIENTS = (1024, 2048), 200, 200, 12
REAL_START_TIMEOUT_S = 600


@dataclass
class Log:
    name: str
    group: str  # model and host: only logs of one group plan each other
    text: str
    model_dir: Path
    host: dict[str, Any]
    why: str = ""  # what the table says when this group's error is not a GPU's

    @functools.cached_property
    def parsed(self) -> StartupLog:
        return parse_log(self.text)


def excerpt(text: str) -> str:
    """What an operator pastes: the memory lines of ranks 0 and 5, no server_args line."""
    keep = ("Load weight", "KV Cache is allocated", "Memory pool end", "Capture", "Reserving")
    out = []
    for line in text.splitlines():
        if "server_args=" in line:
            continue
        ranks = re.findall(r"\bTP(\d+)\b", line.split("]")[0])
        if ranks and ranks[0] not in ("0", "5"):
            continue
        if any(word in line for word in keep) or "max_total_num_tokens=" in line:
            out.append(line)
    return "\n".join(out) + "\n"


def log_flags(cal: StartupLog) -> dict[str, Any]:
    """The flags a log states, as the planner takes them (the question a target asks)."""
    stated = cal.server_args
    args = {k: stated.get(k) for k in PLANNED_FLAGS}
    if stated.get("enable_dp_attention") and not args.get("attn_dp_size"):
        args["attn_dp_size"] = stated.get("dp_size")
    return {k: v for k, v in args.items() if v is not None}


@functools.cache
def model_of(model_dir: Path) -> tuple[dict[str, Any], int]:
    return read_model_dir(model_dir)


def plan_pair(source: Log, target: Log, form: str) -> dict[str, Any]:
    config, weight_bytes = model_of(source.model_dir)
    args = log_flags(target.parsed)
    args["calibration_log"] = excerpt(source.text) if form == "excerpt" else source.text
    row = {"calibration": source.name, "form": form, "target": target.name}
    row["logged"] = target.parsed.kv_tokens
    try:
        result = plan(config, weight_bytes, args, dict(target.host))
    except PlanInputError as exc:
        return row | {"planned": None, "error_pct": None, "note": f"refused: {exc.message}"}
    planned = result["max_total_num_tokens"]
    error = None if not row["logged"] else 100.0 * (planned - row["logged"]) / row["logged"]
    calibrated = result["details"].get("calibrated")
    note = (
        ""
        if calibrated or target.why
        else "not calibrated: " + str(result["details"].get("calibration"))
    )
    return row | {"planned": planned, "error_pct": error, "note": note or target.why}


def fixture_logs() -> list[Log]:
    host = GPU_HOST
    return [
        Log(
            "constructed-kimi 0.85 bf16",
            "kimi-k2.5 int4, 8 x 97887 MiB (constructed)",
            (LOGS / "constructed-kimi-k2.5-tp8-mf085-bf16.log").read_text(),
            KIMI_FIXTURE,
            host,
        ),
        Log(
            "constructed-kimi 0.88 bf16 (excerpt)",
            "kimi-k2.5 int4, 8 x 97887 MiB (constructed)",
            (LOGS / "constructed-kimi-k2.5-tp8-mf088-bf16-excerpt.log").read_text(),
            KIMI_FIXTURE,
            host,
        ),
    ]


# --- the double -------------------------------------------------------------------------------
def double_logs(workdir: Path) -> list[Log]:
    timing = Timing(load_weights_s=0, kv_alloc_s=0, graph_capture_s=0, decode_step_s=0.01)
    root = gpusim_state.init_state(Hardware(timing=timing), workdir / "gpusim")
    model = workdir / "kimi-k2.5-int4"
    shutil.copytree(grid_bench.FIXTURE, model)
    logs = []
    for fraction, dtype, attn_dp in DOUBLE_STARTS:
        flags = {
            "tp_size": 8,
            "trust_remote_code": True,
            "mem_fraction_static": fraction,
            "kv_cache_dtype": dtype,
            "attn_dp_size": attn_dp if attn_dp > 1 else None,
            "cuda_graph_max_bs_decode": 64 if attn_dp > 1 else None,
        }
        label = f"double {fraction} {dtype} dp{attn_dp}"
        text = start_double(root, model, workdir, flags, label.replace(" ", "-"))
        if text is None:
            print(f"  {label}: did not start", file=sys.stderr)
            continue
        logs.append(Log(label, "kimi-k2.5 int4, 8 x 97887 MiB (the double)", text, model, GPU_HOST))
    return logs


def start_double(root: Path, model: Path, workdir: Path, flags: dict, label: str) -> str | None:
    port = grid_bench.free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = workdir / f"{label}.log"
    argv = ["--model-path", str(model), "--port", str(port), *grid_bench.flag_argv(flags)]
    cwd = workdir / "server-cwd"
    cwd.mkdir(exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpusim.sglang_server", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=grid_bench.child_env(root),
            cwd=cwd,
        )
    try:
        healthy = grid_bench.wait_healthy(proc, url)
    finally:
        grid_bench.stop(proc, root)
    return log_path.read_text(errors="replace") if healthy else None


# --- the real SGLang CPU engine ---------------------------------------------------------------
class RealServer:
    """The real SGLang 0.5.23 on its CPU engine, in its own process group."""

    def __init__(self, model: Path, workdir: Path, label: str, cap: int) -> None:
        self.port = grid_bench.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{label}.log"
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}
        cmd = [str(REF_VENV / "bin" / "python"), "-m", "sglang.launch_server"]
        cmd += ["--model-path", str(model), *CPU_FLAGS, "--max-total-tokens", str(cap)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [*cmd, "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_healthy(self) -> bool:
        deadline = time.monotonic() + REAL_START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/health", timeout=5) as response,
            ):
                if response.status == 200:
                    return True
            time.sleep(0.5)
        return False

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def tiny_model(workdir: Path) -> Path:
    folder = workdir / "tiny-llama"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    python = str(REF_VENV / "bin" / "python")
    subprocess.run([python, str(MAKE_MODEL), str(folder)], check=True, env=env, timeout=600)
    return folder


def cpu_host() -> dict[str, Any]:
    with open("/proc/meminfo", encoding="ascii") as handle:
        total_kib = int(next(line for line in handle if line.startswith("MemTotal")).split()[1])
    return {"host_ram_gib": round(total_kib / 2**20, 1)}


def real_logs(model: Path, workdir: Path, capture: bool) -> list[Log]:
    logs = []
    for cap in CPU_CAPS:
        server = RealServer(model, workdir, f"real-cpu-mtt{cap}", cap)
        try:
            if not server.wait_healthy():
                print(f"  real CPU engine at {cap} tokens did not start", file=sys.stderr)
                continue
        finally:
            server.stop()
        text = server.text()
        if capture:
            (LOGS / f"real-cpu-tiny-llama-mtt{cap}.log").write_text(text)
        why = "CPU engine: the pool is --max-total-tokens (host RAM is not the fraction's)"
        logs.append(
            Log(f"real CPU mtt {cap}", "tiny Llama, CPU engine", text, model, cpu_host(), why)
        )
    return logs


def peak_running(url: str, stop: threading.Event, out: dict[str, float]) -> None:
    """The highest sglang:num_running_reqs the real scheduler reported while the load ran."""
    pattern = re.compile(r"^sglang:num_running_reqs\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)
    while not stop.is_set():
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read(4 << 20).decode("utf-8", errors="replace")
            values = [float(v) for v in pattern.findall(text)]
            if values:
                out["peak"] = max(out.get("peak", 0.0), sum(values))
                out["samples"] = out.get("samples", 0) + 1
        stop.wait(0.2)


def kv_bound_run(model: Path, workdir: Path, cap: int) -> dict[str, Any]:
    server = RealServer(model, workdir, f"real-cpu-kv-bound-{cap}", cap)
    try:
        if not server.wait_healthy():
            return {"error": "the real CPU engine did not start:\n" + server.text()[-2000:]}
        done, seen = threading.Event(), {}
        watcher = threading.Thread(target=peak_running, args=(server.url, done, seen))
        watcher.start()
        result_path = workdir / f"kv-bound-smoke-{cap}.json"
        argv = [sys.executable, "-m", "sglang_fleet.smoke.smoke_client", f"--url={server.url}"]
        argv += [f"--num-prompts={KV_BOUND_CLIENTS * 2}", f"--max-concurrency={KV_BOUND_CLIENTS}"]
        argv += [f"--random-input-len={KV_BOUND_IN}", f"--random-output-len={KV_BOUND_OUT}"]
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        argv += [f"--json={result_path}", f"--vocab-size={vocab}"]
        smoke = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
        done.set()
        watcher.join()
    finally:
        server.stop()
    text = server.text()
    config, weight_bytes = model_of(model)
    planned = plan(
        config,
        weight_bytes,
        log_flags(parse_log(text)) | {"avg_input_len": KV_BOUND_IN, "avg_output_len": KV_BOUND_OUT},
        cpu_host(),
    )
    verdict = None
    if result_path.exists():
        smoke_result = json.loads(result_path.read_text())
        verdict = run_diagnosis.diagnose(smoke_result, text, KV_BOUND_CLIENTS, None)
    return {
        "max_total_tokens": cap,
        "planned_concurrent": planned["max_concurrent_requests"],
        "peak_running": seen.get("peak"),
        "metrics_samples": seen.get("samples", 0),
        "smoke_rc": smoke.returncode,
        "smoke_tail": smoke.stderr[-800:],
        "diagnosis": verdict,
    }


# --- report ------------------------------------------------------------------------------------
def pairs(logs: list[Log]) -> list[dict[str, Any]]:
    rows = []
    for source in logs:
        for target in logs:
            if source is target or source.group != target.group:
                continue
            if not target.parsed.server_args:
                continue  # a target must state its flags: they are the question
            for form in ("whole", "excerpt"):
                rows.append(plan_pair(source, target, form) | {"group": source.group})
    return rows


def print_table(rows: list[dict[str, Any]]) -> bool:
    ok = True
    print("| group | calibration log | given as | target | planned | logged | error | note |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        error = row["error_pct"]
        shown = "-" if error is None else f"{error:+.2f} %"
        gpu = "CPU" not in row["group"]
        if gpu and (error is None or abs(error) > 100 * TOLERANCE):
            ok = False
        print(
            f"| {row['group']} | {row['calibration']} | {row['form']} | {row['target']} | "
            f"{row['planned']} | {row['logged']} | {shown} | {row['note']} |"
        )
    gpu_errors = [
        abs(r["error_pct"]) for r in rows if r["error_pct"] is not None and "CPU" not in r["group"]
    ]
    if gpu_errors:
        print(f"\nGPU pairs: {len(gpu_errors)}, largest error {max(gpu_errors):.3f} %")
    print_summary(rows)
    return ok


def print_summary(rows: list[dict[str, Any]]) -> None:
    """Per group and form: pairs, largest error, refusals."""
    print("\n| group | calibration given as | pairs | largest error | refused | note |")
    print("| --- | --- | --- | --- | --- | --- |")
    for group in dict.fromkeys(r["group"] for r in rows):
        for form in ("whole", "excerpt"):
            mine = [r for r in rows if r["group"] == group and r["form"] == form]
            errors = [abs(r["error_pct"]) for r in mine if r["error_pct"] is not None]
            refused = sum(r["planned"] is None for r in mine)
            notes = {r["note"] for r in mine if r["note"] and r["planned"] is not None}
            largest = f"{max(errors):.3f} %" if errors else "-"
            print(
                f"| {group} | {form} | {len(mine)} | {largest} | {refused} | "
                f"{'; '.join(sorted(notes))} |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-real", action="store_true", help="no real SGLang CPU engine")
    parser.add_argument("--capture", action="store_true", help="keep the real engine's logs")
    parser.add_argument("--keep", type=Path, help="leave the logs in this folder")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args(argv)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="planner-accuracy-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        logs = fixture_logs() + double_logs(workdir)
        real = None
        if not args.skip_real:
            if not (REF_VENV / "bin" / "python").exists():
                print(f"no SGLang reference venv at {REF_VENV}: scripts/sglang-reference-env.sh")
                return 2
            model = tiny_model(workdir)
            logs += real_logs(model, workdir, args.capture)
            real = [kv_bound_run(model, workdir, cap) for cap in KV_BOUND_CAPS]
        rows = pairs(logs)
        ok = print_table(rows)
        for run in real or []:
            print_kv_bound(run)
        if args.json:
            args.json.write_text(json.dumps({"pairs": rows, "kv_bound": real}, indent=1))
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def print_kv_bound(real: dict[str, Any]) -> None:
    print(
        f"\nThe real CPU engine KV-bound (max_total_tokens {real.get('max_total_tokens')}, "
        f"{KV_BOUND_CLIENTS} clients of {KV_BOUND_IN} + {KV_BOUND_OUT} tokens):"
    )
    if real.get("error"):
        print(real["error"])
        return
    print(f"  planned concurrent requests: {real['planned_concurrent']}")
    print(
        f"  real peak running requests (/metrics, {real['metrics_samples']} samples): "
        f"{real['peak_running']}"
    )
    diagnosis = real.get("diagnosis") or {}
    print(f"  diagnosis: {diagnosis.get('verdict')}; evidence {diagnosis.get('evidence')}")
    for lever in diagnosis.get("levers") or []:
        print(f"  lever {lever['code']}: {lever['message']}")
    if real["smoke_rc"]:
        print(f"  smoke client exit {real['smoke_rc']}: {real['smoke_tail']}")


if __name__ == "__main__":
    sys.exit(main())
