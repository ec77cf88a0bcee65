#!/usr/bin/env python3
"""The job runner beside the smoke benchmark on one server, and what a SIGKILL costs it (issue 45).

    .venv/bin/python bench/job_runner.py                     # paced double, about 3 min
    .venv/bin/python bench/job_runner.py --decode-step 0     # the double at zero latency
    .venv/bin/python bench/job_runner.py --json result.json  # also the figures as JSON

One gpusim SGLang double, started here, serves both clients in turn with the same workload:
the same requests, prompt and output lengths, concurrency and sampling (temperature 0):
- the smoke benchmark (`python -m sglang_fleet.smoke.smoke_client`, the smoke gate's client):
  `--num-prompts N --max-concurrency C --random-input-len I --random-output-len O`;
- the job runner (`python -m sglang_fleet.job run`): N SpecForge rows of one user turn, sent to
  /v1/chat/completions with `--concurrency C --max-tokens O`, each prompt I tokens as the
  double counts them (its chat template included).
Both run as child processes; a child's CPU time is its user + system time from os.wait4, so
other load on the shared cores does not count in it. Each client runs at two counts (N1, N2),
alternately, and the differences cancel start-up (imports, the input's scan, the ledger's open):

    rows/s        = (N2 - N1) / (wall(N2) - wall(N1))
    CPU per row   = (cpu(N2) - cpu(N1)) / (N2 - N1)

The server's /metrics (prompt and generation tokens, requests) are read before and after every
run, so the table shows that both clients asked for the same tokens.

Then the kill test: a fresh output for the N2 rows, the runner SIGKILLed at several instants
(the first the instant it opens its ledger; then, in turn, the instant the run's first row is
being written, found by watching the output file grow, and a random instant within the time the
rows left need), resumed after each kill, and run to the end. Afterwards every input id is
counted across the output, error and skipped files: lost (in none), written twice (in more than
one line), and each output row's text checked against what the double generates for its prompt.

Targets (issue 45): the runner's rows/s within 5 % of the smoke benchmark's, 0 rows lost, 0
written twice. Exits 1 when one is missed. The default double is paced (`--decode-step` 0.05 s,
the double's default, as a GPU paces a real server): the question is then whether the runner
keeps the server as full as the smoke client does. At `--decode-step 0` the double is as fast
as the shared cores allow, and each client's own CPU cost shows in its rows/s. Compare figures
within one run, never across runs (bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GPUSIM = REPO / "gpusim"
FIXTURE = GPUSIM / "gpusim" / "fixtures" / "llama-3.1-8b-instruct"
CHILD_TIMEOUT_S = 600
TARGET_RATIO = 0.95
SEED = 45

sys.path.insert(0, str(GPUSIM))
from gpusim.http_api import TextStream, output_seed  # noqa: E402
from gpusim.state import Hardware, Timing  # noqa: E402
from gpusim.tokenizer import WordTokenizer  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gpusim import state  # noqa: E402
from sglang_fleet.job.ledger import FILES, file_paths, read_counts  # noqa: E402

SERVER_COUNTERS = {
    "sglang:prompt_tokens": "prompt_tokens",
    "sglang:generation_tokens": "generation_tokens",
    "sglang:num_requests": "requests",
}


@dataclass
class Run:
    """One client process: what it asked of the server and what it cost."""

    client: str
    rows: int
    wall_s: float
    cpu_s: float
    prompt_tokens: int
    generation_tokens: int
    requests: int


# --- the server ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_double(port: int, state_dir: Path, decode_step_s: float) -> subprocess.Popen[bytes]:
    """gpusim's SGLang double, instant to start, each decode step `decode_step_s` for a batch
    of one (the double's throughput model: docs in gpusim/README.md)."""
    timing = Timing(
        load_weights_s=0, kv_alloc_s=0, graph_capture_s=0, decode_step_s=decode_step_s,
        prefill_token_s=0,
    )  # fmt: skip
    state.init_state(Hardware(timing=timing), state_dir)
    env = {
        **os.environ,
        "GPUSIM_STATE_DIR": str(state_dir),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(GPUSIM), os.environ.get("PYTHONPATH")])),
    }
    cmd = [
        sys.executable, "-m", "gpusim.sglang_server", "--model-path", str(FIXTURE),
        "--port", str(port), "--log-level", "warning", "--skip-server-warmup", "--enable-metrics",
        # a batch far larger than the concurrency, so the double never queues
        "--max-running-requests", "1024",
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the double exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the double did not become ready")


def server_counters(url: str) -> Counter[str]:
    """The double's request and token counters, summed over their labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        name = SERVER_COUNTERS.get(family.name)
        if name:
            found[name] += int(sum(s.value for s in family.samples if s.name.endswith("_total")))
    return found


# --- the workload ---------------------------------------------------------------------------


def job_rows(count: int, input_len: int) -> list[dict[str, Any]]:
    """SpecForge rows of one user turn whose chat prompt is `input_len` tokens to the double
    ('user : w1 ... wk' and 'assistant :', one token per word and colon)."""
    tokenizer = WordTokenizer.from_dir(str(FIXTURE))
    vocab = tokenizer.vocab[40:]
    words = input_len - 4
    rng = random.Random(SEED)
    made = []
    for number in range(count):
        text = " ".join(rng.choices(vocab, k=words))
        made.append({"id": f"row-{number}", "conversations": [{"role": "user", "content": text}]})
    prompt = f"user : {made[0]['conversations'][0]['content']}\nassistant :"
    if len(tokenizer.encode(prompt)) != input_len:
        raise RuntimeError(f"the rows' prompts are not {input_len} tokens to the double")
    return made


def write_rows(path: Path, made: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for row in made:
            handle.write(json.dumps(row) + "\n")


def expected_answer(row: dict[str, Any], output_len: int) -> str:
    """What the double generates for a row's one user turn (tests/test_job_runner.py)."""
    messages = row["conversations"]
    body = {"temperature": 0, "model": "default", "messages": messages}
    stream = TextStream(WordTokenizer.from_dir(str(FIXTURE)), output_seed(messages, body))
    stream.advance(output_len)
    return stream.text


# --- the clients ----------------------------------------------------------------------------


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, float, float, str]:
    """(exit status, wall seconds, CPU seconds, stderr) of one child process."""
    tic = time.perf_counter()
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=errors)
        _, status, usage = _wait(proc, time.monotonic() + CHILD_TIMEOUT_S)
        wall = time.perf_counter() - tic
        errors.seek(0)
        said = errors.read().decode(errors="replace")
    return os.waitstatus_to_exitcode(status), wall, usage.ru_utime + usage.ru_stime, said


def _wait(proc: subprocess.Popen[bytes], deadline: float) -> tuple[int, int, Any]:
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return pid, status, usage
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"timed out: {' '.join(map(str, proc.args))}")
        time.sleep(0.02)


def env_with_repo() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def smoke(url: str, n: int, args: argparse.Namespace, folder: Path) -> Run:
    out = folder / f"smoke-{n}.json"
    cmd = [
        sys.executable, "-m", "sglang_fleet.smoke.smoke_client", "--url", url,
        "--backend", args.smoke_backend, "--num-prompts", str(n),
        "--max-concurrency", str(args.concurrency), "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--warmup-requests", "0",
        "--metrics-interval", "5", "--json", str(out),
    ]  # fmt: skip
    before = server_counters(url)
    code, wall, cpu, said = run_child(cmd, env_with_repo())
    if code != 0:
        raise RuntimeError(f"smoke client exited {code}: {said[-2000:]}")
    result = json.loads(out.read_text())
    if result["completed"] != n:
        raise RuntimeError(f"smoke client: {result['completed']} of {n} requests completed")
    return _run("smoke", n, wall, cpu, server_counters(url) - before)


def runner_cmd(url: str, source: Path, output: Path, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, "-m", "sglang_fleet.job", "run", str(source), "--output", str(output),
        "--server", url, "--concurrency", str(args.concurrency),
        "--max-tokens", str(args.output_len), "--temperature", "0",
    ]  # fmt: skip


def runner(url: str, n: int, args: argparse.Namespace, folder: Path) -> Run:
    source, output = folder / f"rows-{n}.jsonl", folder / f"out-{n}-{time.time_ns()}.jsonl"
    write_rows(source, job_rows(n, args.input_len))
    before = server_counters(url)
    code, wall, cpu, said = run_child(runner_cmd(url, source, output, args), env_with_repo())
    if code != 0:
        raise RuntimeError(f"job runner exited {code}: {said[-2000:]}")
    done = sum(1 for _ in output.open(encoding="utf-8"))
    if done != n:
        raise RuntimeError(f"job runner: {done} of {n} rows in {output}")
    return _run("runner", n, wall, cpu, server_counters(url) - before)


def _run(client: str, n: int, wall: float, cpu: float, server: Counter[str]) -> Run:
    return Run(
        client, n, wall, cpu, server["prompt_tokens"], server["generation_tokens"],
        server["requests"],
    )  # fmt: skip


def rates(small: Run, large: Run) -> dict[str, float]:
    """Rows/s and CPU per row from the difference of two counts (start-up cancelled)."""
    rows = large.rows - small.rows
    return {
        "rows_per_s": rows / (large.wall_s - small.wall_s),
        "cpu_ms_per_row": (large.cpu_s - small.cpu_s) / rows * 1e3,
        "startup_cpu_s": small.cpu_s - (large.cpu_s - small.cpu_s) / rows * small.rows,
        "prompt_tokens_per_row": large.prompt_tokens / large.rows,
        "output_tokens_per_row": large.generation_tokens / large.rows,
    }


def throughput(url: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Each client at both counts, alternately, `--reps` times; the median of each figure."""
    runs: dict[str, list[Run]] = {"smoke": [], "runner": []}
    figures: dict[str, list[dict[str, float]]] = {"smoke": [], "runner": []}
    for rep in range(args.reps):
        pairs: dict[str, list[Run]] = {"smoke": [], "runner": []}
        for n in args.counts:
            for name, client in (("smoke", smoke), ("runner", runner)):
                run = client(url, n, args, folder)
                pairs[name].append(run)
                runs[name].append(run)
                say(
                    f"  rep {rep + 1} {name:<6} {n:>5} rows: wall {run.wall_s:6.2f} s, "
                    f"cpu {run.cpu_s:6.2f} s, server: {run.requests} requests, "
                    f"{run.prompt_tokens} prompt + {run.generation_tokens} output tokens"
                )
        for name, (small, large) in pairs.items():
            figures[name].append(rates(small, large))
    summary = {name: _median(rows) for name, rows in figures.items()}
    summary["ratio"] = summary["runner"]["rows_per_s"] / summary["smoke"]["rows_per_s"]
    summary["runs"] = {name: [asdict(r) for r in found] for name, found in runs.items()}
    return summary


def _median(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


# --- the kill test --------------------------------------------------------------------------


def kill_test(
    url: str, args: argparse.Namespace, folder: Path, rows_per_s: float
) -> dict[str, Any]:
    """SIGKILL the runner at several instants, resume each time, then count every id."""
    n = args.counts[-1]
    made = job_rows(n, args.input_len)
    source, output = folder / "kill-rows.jsonl", folder / "kill-out.jsonl"
    write_rows(source, made)
    rng = random.Random(SEED)
    cmd = runner_cmd(url, source, output, args)
    kills: list[dict[str, Any]] = []
    before = server_counters(url)
    for number in range(args.kills):
        left = n - _rows_on_record(output)
        proc = subprocess.Popen(
            cmd, env=env_with_repo(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        started = time.monotonic()
        if number == 0:  # the instant the ledger is opened, before any row is sent
            when = "start"
            _wait_for_growth(Path(file_paths(str(output))["ledger"]), proc)
        elif number % 2:  # the instant the first row of this run is written
            when = "first write"
            _wait_for_growth(Path(file_paths(str(output))["output"]), proc)
        else:  # anywhere within the time the rows left need
            when = "random"
            time.sleep(rng.uniform(0.2, 0.2 + 0.9 * left / rows_per_s))
        instant = time.monotonic() - started
        killed = proc.poll() is None
        if killed:
            proc.send_signal(signal.SIGKILL)
        _, said = proc.communicate(timeout=CHILD_TIMEOUT_S)
        kills.append({
            "when": when, "after_s": round(instant, 3), "killed": killed,
            "rows_on_record": _rows_on_record(output),
            "opening": _opening(said.decode(errors="replace")),
        })  # fmt: skip
        say(f"  kill {number + 1} ({when}): {kills[-1]}")
    code, wall, _, said = run_child(cmd, env_with_repo())
    if code != 0:
        raise RuntimeError(f"the resumed run exited {code}: {said[-2000:]}")
    server = server_counters(url) - before
    say(f"  resumed to the end in {wall:.1f} s: {_opening(said)}")
    return {**count_ids(made, output, args.output_len), "kills": kills,
            "final_opening": _opening(said), "server_requests": server["requests"]}  # fmt: skip


def _wait_for_growth(path: Path, proc: subprocess.Popen[bytes]) -> None:
    """Until the file grows (a row's line is being written) or the process ends."""
    size = path.stat().st_size if path.exists() else 0
    while proc.poll() is None and (not path.exists() or path.stat().st_size == size):
        time.sleep(0.0005)


def _rows_on_record(output: Path) -> int:
    counts = read_counts(str(output))
    return sum(counts[f] for f in ("output", "error", "skipped")) if counts else 0


def _opening(said: str) -> str:
    """The runner's first line: rows already done and to run again, what it cut."""
    match = re.search(r"^job .*$", said, re.MULTILINE)
    return match.group(0) if match else said.strip()[-300:]


def count_ids(made: list[dict[str, Any]], output: Path, output_len: int) -> dict[str, Any]:
    """Every input id across output, error and skipped: lost, written twice, answered wrong."""
    paths = file_paths(str(output))
    seen: Counter[str] = Counter()
    by_file: dict[str, int] = {}
    wrong = 0
    source = {row["id"]: row for row in made}
    for name in FILES:
        lines = Path(paths[name]).read_text(encoding="utf-8").splitlines()
        by_file[name] = len(lines)
        for line in lines:
            row = json.loads(line)
            seen[row["id"]] += 1
            if name == "output":
                answer = row["conversations"][-1]["content"]
                wrong += answer != expected_answer(source[row["id"]], output_len)
    return {
        "rows": len(made),
        "by_file": by_file,
        "lost": sum(1 for row in made if not seen[row["id"]]),
        "written_twice": sum(count - 1 for count in seen.values() if count > 1),
        "not_in_input": sum(1 for key in seen if key not in source),
        "wrong_output": wrong,
    }


# --- the report -----------------------------------------------------------------------------


def say(text: str) -> None:
    print(text, flush=True)


def markdown(result: dict[str, Any]) -> str:
    speed, kill = result["throughput"], result["kill"]
    smoke_s, runner_s = speed["smoke"], speed["runner"]
    lines = [
        f"Server: gpusim double, decode step {result['decode_step_s']} s; concurrency "
        f"{result['concurrency']}, {result['input_len']} prompt + {result['output_len']} output "
        f"tokens, counts {result['counts']}, {result['reps']} rep(s), median.",
        "",
        "| | smoke benchmark | job runner | runner / smoke |",
        "| --- | --- | --- | --- |",
        f"| rows/s | {smoke_s['rows_per_s']:.2f} | {runner_s['rows_per_s']:.2f} "
        f"| {speed['ratio']:.3f} (target >= {TARGET_RATIO}) |",
        f"| controller CPU per row (ms) | {smoke_s['cpu_ms_per_row']:.2f} "
        f"| {runner_s['cpu_ms_per_row']:.2f} "
        f"| {runner_s['cpu_ms_per_row'] / smoke_s['cpu_ms_per_row']:.2f} |",
        f"| start-up CPU (s) | {smoke_s['startup_cpu_s']:.2f} "
        f"| {runner_s['startup_cpu_s']:.2f} | |",
        f"| server: prompt + output tokens per row | {smoke_s['prompt_tokens_per_row']:.1f} + "
        f"{smoke_s['output_tokens_per_row']:.1f} | {runner_s['prompt_tokens_per_row']:.1f} + "
        f"{runner_s['output_tokens_per_row']:.1f} | |",
        "",
        f"Kill test: {kill['rows']} rows, {sum(k['killed'] for k in kill['kills'])} SIGKILLs "
        f"({', '.join(f'{k["when"]} {k["after_s"]} s' for k in kill['kills'])} into successive "
        "runs), "
        f"each resumed, then run to the end.",
        "",
        "| lost | written twice | wrong output | output / error / skipped lines "
        "| requests the server answered (more than one per row: in flight at a kill) |",
        "| --- | --- | --- | --- | --- |",
        f"| {kill['lost']} | {kill['written_twice']} | {kill['wrong_output']} | "
        f"{kill['by_file']['output']} / {kill['by_file']['error']} / {kill['by_file']['skipped']} "
        f"| {kill['server_requests']} ({kill['server_requests'] - kill['rows']:+d}) |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=int, nargs=2, default=(128, 384), metavar=("N1", "N2"))
    parser.add_argument("--reps", type=int, default=2, help="pairs of runs per client (median)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--decode-step", type=float, default=0.05, help="seconds (0: unpaced)")
    parser.add_argument("--smoke-backend", choices=("sglang", "sglang-oai"), default="sglang")
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs in the kill test")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    if args.input_len < 5 or args.counts[0] >= args.counts[1]:
        parser.error("--input-len at least 5 (the chat template's 4 tokens), N1 < N2")

    folder = Path(tempfile.mkdtemp(prefix="job-bench-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_double(port, folder / "gpusim", args.decode_step)
    try:
        wait_ready(url, server)
        say(f"double on {url}, decode step {args.decode_step} s; throughput:")
        speed = throughput(url, args, folder)
        say("kill test:")
        kill = kill_test(url, args, folder, speed["runner"]["rows_per_s"])
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(folder, ignore_errors=True)
    result = {
        "decode_step_s": args.decode_step, "concurrency": args.concurrency,
        "input_len": args.input_len, "output_len": args.output_len, "counts": list(args.counts),
        "reps": args.reps, "smoke_backend": args.smoke_backend, "throughput": speed, "kill": kill,
    }  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    say("\n" + markdown(result))
    met = speed["ratio"] >= TARGET_RATIO and kill["lost"] == 0 and kill["written_twice"] == 0
    met = met and kill["wrong_output"] == 0 and kill["not_in_input"] == 0
    say(f"\ntargets {'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
