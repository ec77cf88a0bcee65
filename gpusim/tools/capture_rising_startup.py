"""Capture a real SGLang CPU-engine start-up whose free memory rises across the weight load.

SGLang reads the free memory before and after loading weights; on the CPU engine that is the
host's RAM, which any other process moves. On a busy host (three test scenarios at once, CI)
another process sometimes frees memory during the load, and SGLang logs a negative
"mem usage". This script makes that happen on purpose, so the line can be captured as SGLang
prints it (tests/fixtures/real-sglang-0.5.23-cpu/startup-free-memory-rose.log): a helper
process holds `--release-mib` of RAM and frees it as soon as the log shows
"Load weight begin.", while SGLang loads the tiny Llama of make_tiny_llama.py.

    python gpusim/tools/capture_rising_startup.py --python .cache/sglang-ref/venv/bin/python \
        --model .cache/tiny-llama/<hash> --out startup.log

Bounded: at most --attempts starts, each at most --timeout seconds; the server is stopped
after the start-up lines are in. Exit status 0 when a start logged a negative mem usage.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

FLAGS = (
    *("--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule"),
    *("--max-total-tokens", "4096", "--context-length", "2048", "--enable-metrics"),
    "--sleep-on-idle",
)
LOAD_END = re.compile(r"Load weight end\..*mem usage=(-?\d+\.\d+) GB")
READY = "The server is fired up and ready to roll!"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _hold_then_release(log: Path, mib: int, deadline: float) -> None:
    """Child process: hold `mib` of touched RAM until the load begins, then free it."""
    block = bytearray(mib << 20)
    for offset in range(0, len(block), 4096):
        block[offset] = 1
    while time.monotonic() < deadline:
        if log.exists() and "Load weight begin." in log.read_text(errors="replace"):
            del block
            return
        time.sleep(0.002)


def _attempt(args: argparse.Namespace, out: Path) -> float | None:
    """One start; the logged weight-load mem usage (None if the start did not get that far)."""
    out.unlink(missing_ok=True)
    deadline = time.monotonic() + args.timeout
    holder = os.fork()
    if holder == 0:  # the child holds memory and frees it when the load begins
        try:
            _hold_then_release(out, args.release_mib, deadline)
        finally:
            os._exit(0)
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [args.python, "-m", "sglang.launch_server", "--model-path", args.model, *FLAGS]
    with out.open("w") as log:
        proc = subprocess.Popen(
            [*cmd, "--port", str(_free_port())],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if READY in out.read_text(errors="replace"):
                break
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    found = LOAD_END.search(out.read_text(errors="replace"))
    return float(found[1]) if found else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the SGLang venv's python")
    parser.add_argument("--model", required=True, help="the tiny Llama's directory")
    parser.add_argument("--out", required=True, type=Path, help="where the log goes")
    parser.add_argument("--release-mib", type=int, default=256)
    parser.add_argument("--attempts", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    for attempt in range(1, args.attempts + 1):
        usage = _attempt(args, args.out)
        print(f"attempt {attempt}: weight-load mem usage {usage} GB", flush=True)
        if usage is not None and usage < 0:
            return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
