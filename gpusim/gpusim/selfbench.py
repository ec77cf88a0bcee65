"""How fast the double itself streams, so a benchmark of a client is never bound by it.

    python -m gpusim.selfbench [--requests 400] [--concurrency 64] [--output-len 64]

Starts a zero-latency server (simulated time 0) pinned to one CPU core when `taskset` is
available, drives it with an aiohttp streaming client on another core through /generate,
and prints streamed tokens/s and requests/s. Bounded in requests and in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from gpusim import state
from gpusim.state import Hardware, Timing

FIXTURE = Path(__file__).parent / "fixtures" / "llama-3.1-8b-instruct"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _one(session: aiohttp.ClientSession, url: str, output_len: int) -> int:
    body = {
        "input_ids": list(range(10, 138)),
        "stream": True,
        "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True},
    }
    tokens = 0
    async with session.post(url, json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {"):
                tokens = json.loads(line[6:])["meta_info"]["completion_tokens"]
    return tokens


async def _drive(url: str, requests: int, concurrency: int, output_len: int) -> tuple[int, float]:
    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def bounded() -> int:
            async with semaphore:
                return await _one(session, url, output_len)

        tic = time.perf_counter()
        tokens = await asyncio.gather(*(bounded() for _ in range(requests)))
        return sum(tokens), time.perf_counter() - tic


def _wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
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
        time.sleep(0.1)
    raise RuntimeError("server did not become ready")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpusim.selfbench")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="gpusim-bench-"))
    zero = Timing(
        load_weights_s=0, kv_alloc_s=0, graph_capture_s=0, decode_step_s=0, prefill_token_s=0
    )
    state.init_state(Hardware(timing=zero), root)
    port = _free_port()
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    cmd = [
        *pin,
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
    ]
    env = {**os.environ, "GPUSIM_STATE_DIR": str(root)}
    server = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(port, server)
        if pin:
            os.sched_setaffinity(0, {1 % (os.cpu_count() or 1)})
        url = f"http://127.0.0.1:{port}/generate"
        tokens, elapsed = asyncio.run(_drive(url, args.requests, args.concurrency, args.output_len))
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"server on one core{'' if pin else ' (unpinned: no taskset)'}: "
        f"{args.requests} streamed requests x {args.output_len} tokens, "
        f"concurrency {args.concurrency}: {tokens / elapsed:.0f} tokens/s, "
        f"{args.requests / elapsed:.1f} requests/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
