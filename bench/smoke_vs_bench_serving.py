#!/usr/bin/env python3
"""CPU cost and request ceiling of the smoke client beside SGLang's own benchmark client.

    .venv/bin/python bench/smoke_vs_bench_serving.py [--counts 200 1000] [--output-len 64]

Both clients run as child processes against the same zero-latency server, with the same
workload (random token ids over /generate, fixed lengths, same concurrency). The CPU time of a
client is the child's user+system time (os.wait4), so other load on the shared cores does not
blur it. Each client runs at two request counts; the differences cancel start-up costs (SGLang's
client spends about 10 CPU-seconds importing torch and friends before its first request):

    CPU per streamed token = (cpu(N2) - cpu(N1)) / (tokens(N2) - tokens(N1))   (--output-len)
    CPU per request        = (cpu(N2) - cpu(N1)) / (N2 - N1)                  (one-token answers)
    requests/s ceiling     = 1 / CPU per request   (what one core lets the client sustain)

Targets: smoke's CPU per token at most half of SGLang's (issue 44; a third in issue 7, before
the smoke client took on its bounds), its ceiling at least SGLang's. Each figure is the median
of --rounds rounds (3), the clients taking turns within a round (in reverse order every other
round), so that a slow minute of the shared machine weighs on all of them.

`--smoke-program NAME=PATH` measures another build of the smoke client in the same rounds, with
the same harness: a zipapp or a standalone script (e.g. the client of an older commit), run
with the same arguments by the same interpreter. Its ratios to SGLang's client are printed as
smoke's are, so a change can be compared with its base in one run:

    git show BASE:sglang_fleet/smoke.py > /tmp/base-smoke.py      # before the package split
    .venv/bin/python bench/smoke_vs_bench_serving.py --server double \
        --smoke-program base=/tmp/base-smoke.py
The server is gpusim's SGLang double with all timings zero (gpusim/ in the repo);
`--server builtin` uses a minimal aiohttp streaming server in this file instead. SGLang's client
comes from the reference venv (scripts/sglang-reference-env.sh -> .cache/sglang-ref/venv);
without it only the smoke client is measured. Not part of `make test`: it burns CPU for a
minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPUSIM = REPO / "gpusim"
FIXTURE = GPUSIM / "gpusim" / "fixtures" / "llama-3.1-8b-instruct"
REFERENCE_PYTHON = REPO / ".cache" / "sglang-ref" / "venv" / "bin" / "python"
CLIENT_TIMEOUT_S = 600


@dataclass
class Run:
    """One client process: what it did and what it cost."""

    client: str
    requests: int
    output_tokens: int
    cpu_s: float
    wall_s: float
    request_throughput: float


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
                if b" 200 " in sock.recv(64):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become ready")


# ------------------------------------------------------------------------------------------
# Servers
# ------------------------------------------------------------------------------------------


def start_double(port: int, state_dir: Path) -> subprocess.Popen[bytes]:
    """gpusim's SGLang double with every simulated duration zero."""
    sys.path.insert(0, str(GPUSIM))
    from gpusim.state import Hardware, Timing  # noqa: PLC0415

    from gpusim import state  # noqa: PLC0415 (only this server mode needs gpusim)

    zero = Timing(
        load_weights_s=0, kv_alloc_s=0, graph_capture_s=0, decode_step_s=0, prefill_token_s=0
    )
    state.init_state(Hardware(timing=zero), state_dir)
    env = {
        **os.environ,
        "GPUSIM_STATE_DIR": str(state_dir),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(GPUSIM), os.environ.get("PYTHONPATH")])),
    }
    cmd = [
        sys.executable,
        "-m",
        "gpusim.sglang_server",
        "--model-path",
        str(FIXTURE),
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--skip-server-warmup",
        # a batch far larger than the concurrency, so the double never queues
        "--max-running-requests",
        "1024",
    ]
    return subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)


def start_burst(port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, __file__, "--serve", str(port)]
    return subprocess.Popen(cmd, stderr=subprocess.DEVNULL)


def _render_generate(prompt_tokens: int, max_new: int) -> bytes:
    """A whole /generate stream as SGLang sends it: one chunk per token, cumulative text."""
    parts = [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    ]
    text = ""
    for n in range(1, max_new + 1):
        text += " tok"
        meta = {
            "id": "0123456789abcdef0123456789abcdef",
            "finish_reason": {"type": "length", "length": n} if n == max_new else None,
            "prompt_tokens": prompt_tokens,
            "weight_version": "default",
            "completion_tokens": n,
            "cached_tokens": 0,
            "e2e_latency": 0.001 * n,
        }
        chunk = {"text": text, "output_ids": [1000 + i for i in range(n)], "meta_info": meta}
        event = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        parts.append(b"%x\r\n%s\r\n" % (len(event), event))
    done = b"data: [DONE]\n\n"
    parts.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
    return b"".join(parts)


def serve_burst(port: int) -> None:
    """A server that never makes a client wait: each /generate answer is rendered once (per
    length) and written at once, so the client's reads carry as many tokens as it can take."""
    import asyncio  # noqa: PLC0415 (only the server process needs it)

    rendered: dict[tuple[int, int], bytes] = {}
    models = json.dumps({"object": "list", "data": [{"id": str(FIXTURE)}]}).encode()
    # the smoke client draws its random ids below the vocabulary of the model named here
    model_info = json.dumps({"model_path": str(FIXTURE)}).encode()

    def plain(status: str, body: bytes) -> bytes:
        head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        return head.encode() + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length) if length else b""
                path = head.split(b" ", 2)[1]
                if path == b"/generate":
                    request = json.loads(body)
                    # SGLang's client may send its random ids decoded to text
                    prompt = request.get("input_ids") or str(request.get("text", "")).split()
                    key = (len(prompt), request["sampling_params"]["max_new_tokens"])
                    if key not in rendered:
                        rendered[key] = _render_generate(*key)
                    writer.write(rendered[key])
                elif path == b"/v1/models":
                    writer.write(plain("200 OK", models))
                elif path == b"/model_info":
                    writer.write(plain("200 OK", model_info))
                else:
                    writer.write(plain("404 Not Found", b"{}"))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
        await server.serve_forever()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------
# Clients
# ------------------------------------------------------------------------------------------


def run_child(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """CPU seconds (user + system) and wall seconds of one child process."""
    tic = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"client timed out: {' '.join(cmd)}")
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - tic
    if proc.returncode != 0:
        assert proc.stderr is not None
        what = " ".join(cmd[1:3])
        raise RuntimeError(f"{what} exited {proc.returncode}: {proc.stderr.read()[-2000:]!r}")
    return usage.ru_utime + usage.ru_stime, wall


def smoke_archive(folder: Path) -> Path:
    """The smoke client as a GPU host runs it: one zipapp built from this checkout's sources
    (sglang_fleet/host_zipapp.py), which any interpreter runs without sglang_fleet installed
    (the reference venv's has none, and the package's module_utils is a mapped folder)."""
    from sglang_fleet.host_zipapp import build  # noqa: PLC0415 (this venv's package)

    archive = folder / "smoke.pyz"
    if not archive.exists():
        archive.write_bytes(build("sglang_fleet.smoke.smoke_client.command_line"))
    return archive


def run_smoke(
    python: str, url: str, n: int, args: argparse.Namespace, out: Path, *, program: str = ""
) -> Run:
    """One run of the smoke client: this checkout's zipapp, or ``program`` (a file) if given."""
    cmd = [
        python,
        program or str(smoke_archive(out.parent)),
        "--url",
        url,
        "--backend",
        "sglang",
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(args.concurrency),
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--warmup-requests",
        "1",
        "--json",
        str(out),
    ]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    cpu, wall = run_child(cmd, env)
    result = json.loads(out.read_text())
    return _checked(f"smoke@{program}" if program else "smoke", n, result, cpu, wall)


def run_bench_serving(url: str, n: int, args: argparse.Namespace, out: Path) -> Run:
    out.unlink(missing_ok=True)  # it appends JSON lines
    cmd = [
        str(REFERENCE_PYTHON),
        "-m",
        "sglang.benchmark.serving",
        "--backend",
        "sglang",
        "--base-url",
        url,
        "--dataset-name",
        "random-ids",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",
        "1.0",
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(args.concurrency),
        "--tokenizer",
        str(FIXTURE),
        "--warmup-requests",
        "1",
        "--disable-tqdm",
        "--output-file",
        str(out),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    cpu, wall = run_child(cmd, env)
    result = json.loads(out.read_text().strip().splitlines()[-1])
    return _checked("bench_serving", n, result, cpu, wall)


def _checked(client: str, n: int, result: dict, cpu: float, wall: float) -> Run:
    if result["completed"] != n:
        why = result.get("errors") or result.get("failure_reasons") or "no reason given"
        raise RuntimeError(f"{client}: {result['completed']} of {n} requests completed: {why}")
    return Run(client, n, result["total_output_tokens"], cpu, wall, result["request_throughput"])


# ------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------


def measure(client: str, url: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    """Per-token and per-request CPU of one client, from two request counts each."""
    low, high = args.counts

    def runs(output_len: int, counts: tuple[int, int]) -> tuple[Run, Run]:
        settings = argparse.Namespace(**{**vars(args), "output_len": output_len})
        pair = []
        for n in counts:
            out = tmp / f"{client}-{output_len}-{n}.json"
            if client == "bench_serving":
                pair.append(run_bench_serving(url, n, settings, out))
            else:
                program = args.programs.get(client, "")
                pair.append(run_smoke(args.smoke_python, url, n, settings, out, program=program))
            last = pair[-1]
            print(
                f"  {client:<14} {n:>6} req x {output_len:>3} tok: cpu {last.cpu_s:6.2f} s, "
                f"wall {last.wall_s:6.2f} s, {last.request_throughput:8.1f} req/s (its own count)",
                flush=True,
            )
        return pair[0], pair[1]

    small, large = runs(args.output_len, (low, high))
    per_token = (large.cpu_s - small.cpu_s) / (large.output_tokens - small.output_tokens)
    one_small, one_large = runs(1, (low * args.request_factor, high * args.request_factor))
    per_request = (one_large.cpu_s - one_small.cpu_s) / (one_large.requests - one_small.requests)
    return {
        "cpu_us_per_token": per_token * 1e6,
        "cpu_us_per_request": per_request * 1e6,
        "ceiling_req_s": 1.0 / per_request if per_request > 0 else float("inf"),
        "measured_req_s": one_large.request_throughput,
        "startup_cpu_s": small.cpu_s - per_token * small.output_tokens,
    }


def start_server(kind: str, port: int, state_dir: Path) -> subprocess.Popen[bytes]:
    if kind == "double":
        return start_double(port, state_dir)
    return start_burst(port)


def run_server(kind: str, clients: list[str], args: argparse.Namespace) -> list[dict[str, dict]]:
    """One result per round: {client: its figures}."""
    tmp = Path(tempfile.mkdtemp(prefix="smoke-bench-"))
    port = free_port()
    server = start_server(kind, port, tmp / "gpusim")
    rounds = []
    try:
        wait_ready(port, server)
        url = f"http://127.0.0.1:{port}"
        print(f"\nserver: {kind} on {url}; smoke runs on {args.smoke_python}", flush=True)
        for number in range(args.rounds):
            print(f"round {number + 1} of {args.rounds}", flush=True)
            # turns in reverse every other round: no client always runs first (or last)
            order = clients if number % 2 == 0 else clients[::-1]
            figures = {client: measure(client, url, args, tmp) for client in order}
            rounds.append({client: figures[client] for client in clients})
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    return rounds


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def print_table(kind: str, rounds: list[dict[str, dict]]) -> dict[str, float]:
    """The median of each figure over the rounds, and the ratios (each round's, then their
    median); returns the ratios."""
    print(f"\n{kind}: {'client':<14} {'us/token':>9} {'us/request':>11} {'ceiling req/s':>14} "
          f"{'measured req/s':>15} {'start-up cpu s':>15}  (medians of {len(rounds)})")  # fmt: skip
    for client in rounds[0]:
        r = {key: _median([one[client][key] for one in rounds]) for key in rounds[0][client]}
        print(
            f"{kind}: {client:<14} {r['cpu_us_per_token']:>9.2f} {r['cpu_us_per_request']:>11.1f} "
            f"{r['ceiling_req_s']:>14.0f} {r['measured_req_s']:>15.1f} {r['startup_cpu_s']:>15.2f}"
        )
    if "bench_serving" not in rounds[0]:
        return {}
    ratios = {}
    for client in (name for name in rounds[0] if name != "bench_serving"):
        token = [one[client]["cpu_us_per_token"] / one["bench_serving"]["cpu_us_per_token"]
                 for one in rounds]  # fmt: skip
        ceiling = [one[client]["ceiling_req_s"] / one["bench_serving"]["ceiling_req_s"]
                   for one in rounds]  # fmt: skip
        shown = ", ".join(f"{r:.3f}" for r in token)
        print(f"{kind}: CPU per token, {client} / bench_serving: {_median(token):.3f} "
              f"(rounds: {shown}; target <= 0.5)")  # fmt: skip
        print(f"{kind}: requests/s ceiling, {client} / bench_serving: {_median(ceiling):.2f} "
              "(target >= 1)")  # fmt: skip
        if client == "smoke":
            ratios = {"token_ratio": _median(token), "ceiling_ratio": _median(ceiling)}
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    have_double = (GPUSIM / "gpusim" / "sglang_server.py").exists()
    parser.add_argument(
        "--server",
        nargs="+",
        choices=("double", "burst"),
        default=["double", "burst"] if have_double else ["burst"],
        help="double: gpusim at zero latency; burst: each answer written at once (default: both)",
    )
    parser.add_argument("--counts", type=int, nargs=2, default=(100, 500))
    parser.add_argument("--rounds", type=int, default=3, help="figures are medians over these")
    parser.add_argument("--request-factor", type=int, default=4, help="counts x this, 1 token")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--smoke-python",
        default=str(REFERENCE_PYTHON) if REFERENCE_PYTHON.exists() else sys.executable,
        help="interpreter for the smoke client (default: the reference venv's, so both clients "
        "run on the same Python)",
    )
    parser.add_argument("--skip-reference", action="store_true", help="measure smoke only")
    parser.add_argument(
        "--smoke-program",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="another smoke client (a zipapp or standalone script) measured in the same rounds "
        "as client NAME; repeatable",
    )
    args = parser.parse_args(argv)
    args.programs = {}
    for spec in args.smoke_program:
        name, sep, path = spec.partition("=")
        if not sep or not name or name in ("smoke", "bench_serving") or name in args.programs:
            parser.error(f"--smoke-program {spec!r}: give NAME=PATH, each NAME once, not smoke")
        if not Path(path).is_file():
            parser.error(f"--smoke-program {spec!r}: {path} is not a file")
        args.programs[name] = str(Path(path).resolve())
    if args.serve:
        serve_burst(args.serve)
        return 0

    clients = ["smoke", *args.programs]
    if args.skip_reference:
        print("measuring the smoke client only")
    elif REFERENCE_PYTHON.exists():
        clients.append("bench_serving")
    else:
        print(f"no {REFERENCE_PYTHON} (scripts/sglang-reference-env.sh): smoke client only")
    tables = {kind: run_server(kind, clients, args) for kind in args.server}
    for kind, results in tables.items():
        print_table(kind, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
