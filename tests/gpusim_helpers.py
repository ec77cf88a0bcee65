"""Helpers for tests that run the GPU-less double: a private state directory and real server
processes. gpusim is installed (editable) in the venv, so child processes find it too."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gpusim.state import Hardware, Timing

from gpusim import state

GPUSIM_SRC = Path(__file__).resolve().parents[1] / "gpusim"

FIXTURES = GPUSIM_SRC / "gpusim" / "fixtures"
LLAMA = str(FIXTURES / "llama-3.1-8b-instruct")
KIMI = str(FIXTURES / "kimi-k2.5-int4")
# The tiny Llama the real CPU engine serves in the contract tests, built by the double's tool.
MAKE_TINY_LLAMA = GPUSIM_SRC / "tools" / "make_tiny_llama.py"
TINY_LLAMA_CACHE = GPUSIM_SRC.parent / ".cache" / "tiny-llama"
ZERO_TIMING = Timing(
    load_weights_s=0, kv_alloc_s=0, graph_capture_s=0, decode_step_s=0, prefill_token_s=0
)


def init_root(root: Path) -> Path:
    """A fresh simulated host (8 x 96 GB, 400 GiB RAM) with zero timings."""
    state.init_state(Hardware(timing=Timing(**vars(ZERO_TIMING))), root)
    return root


def make_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = init_root(tmp_path / "gpusim")
    monkeypatch.setenv("GPUSIM_STATE_DIR", str(root))
    return root


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_bound(port: int) -> bool:
    """Whether a live listener holds the port (SO_REUSEADDR as servers do: TIME_WAIT is fine)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def child_env(root: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["GPUSIM_STATE_DIR"] = str(root)
    # `python -m` puts the working directory first on the child's path, where the repository's
    # gpusim/ folder (the project, not the package) would shadow the installed package.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(GPUSIM_SRC), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@dataclass
class Server:
    """A running gpusim.sglang_server launcher process."""

    proc: subprocess.Popen[str]
    port: int
    root: Path
    log_path: Path
    extra_pids: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def status(self, path: str, headers: dict[str, str] | None = None) -> int:
        request = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError):
                if self.status("/health") == 200:
                    return
            time.sleep(0.05)
        raise AssertionError(f"server not ready in {timeout}s:\n{self.log()}")

    def rank_pids(self) -> list[int]:
        with_env = os.environ.get("GPUSIM_STATE_DIR")
        os.environ["GPUSIM_STATE_DIR"] = str(self.root)
        try:
            return sorted({p.pid for p in state.live_procs(self.root)})
        finally:
            if with_env is not None:
                os.environ["GPUSIM_STATE_DIR"] = with_env


def start_server(root: Path, tmp_path: Path, *flags: str, **env: str) -> Server:
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    cmd = [sys.executable, "-m", "gpusim.sglang_server", "--port", str(port), *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(root, **env), text=True
        )
    return Server(proc, port, root, log_path)


def stop_server(server: Server) -> None:
    """Kill the launcher and every rank it registered (by PID, never by name)."""
    pids = server.rank_pids()
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(10)
    for pid in pids + server.extra_pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def collect_servers() -> Iterator[list[Server]]:
    """Collects servers a test starts and makes sure none outlives it."""
    started: list[Server] = []
    yield started
    for server in started:
        stop_server(server)


def tiny_model(python: Path) -> Path:
    """The tiny Llama, built once per version of its script (.cache/tiny-llama/<hash>) with the
    reference venv's ``python``."""
    key = hashlib.sha256(MAKE_TINY_LLAMA.read_bytes()).hexdigest()[:12]
    folder = TINY_LLAMA_CACHE / key
    if not (folder / "model.safetensors.index.json").exists():
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        subprocess.run(
            [str(python), str(MAKE_TINY_LLAMA), str(folder)], check=True, env=env, timeout=600
        )
    return folder
