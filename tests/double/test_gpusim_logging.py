"""The double logs like SGLang 0.5.23: same logger names, default format, and
SGLANG_LOGGING_CONFIG_PATH (a JSON dictConfig replacing the default set-up), so a deployment
can keep `--api-key` (printed in the `server_args=` line) out of the journal; and its
start-up failures carry a line the deployment's fail-fast probe knows.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_plugin
from gpusim_helpers import LLAMA, Server, child_env, start_server

pytestmark = pytest.mark.slow

API_KEY = "sk-do-not-log-4711"
ENGINE_LOGGER = "sglang.srt.entrypoints.engine"  # logs server_args= in 0.5.23
# Start-up lines an operator greps, each from its own SGLang logger.
STARTUP_LINES = (
    "Load weight end.",
    "KV Cache is allocated.",
    "Memory pool end.",
    "Capture target decode CUDA graph end.",
    "max_total_num_tokens=",
    "The server is fired up and ready to roll!",
)


def logging_config(path: Path, *, keep_other_loggers: bool = True) -> Path:
    """What a deployment would write: SGLang's format, the engine's logger at WARNING."""
    config = {
        "version": 1,
        "formatters": {"sglang": {"format": "[%(asctime)s] %(message)s"}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "sglang",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"level": "INFO", "handlers": ["stderr"]},
        "loggers": {ENGINE_LOGGER: {"level": "WARNING"}},
    }
    if keep_other_loggers:
        config["disable_existing_loggers"] = False
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def ready_log(server: Server, servers: list[Server]) -> str:
    servers.append(server)
    server.wait_ready()
    return server.log()


def start(state_dir: Path, tmp_path: Path, **env: str) -> Server:
    flags = ("--model-path", LLAMA, "--tp-size", "2", "--api-key", API_KEY)
    return start_server(state_dir, tmp_path, *flags, "--skip-server-warmup", **env)


def test_default_logging_prints_the_key_like_sglang(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    log = ready_log(start(state_dir, tmp_path), servers)
    server_args = [line for line in log.splitlines() if "server_args={" in line]
    assert len(server_args) == 1 and f"'api_key': '{API_KEY}'" in server_args[0]
    # SGLang's default format: launcher lines bare, scheduler lines with the rank.
    stamp = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    assert re.search(stamp + r"\] server_args=\{", log)
    assert re.search(stamp + r" TP0\] Load weight end\.", log)
    assert re.search(stamp + r" TP1\] KV Cache is allocated\.", log)
    assert re.search(stamp + r"\] The server is fired up and ready to roll!", log)


def test_logging_config_keeps_the_key_out_and_the_rest_in(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    config = logging_config(tmp_path / "logging.json")
    log = ready_log(start(state_dir, tmp_path, SGLANG_LOGGING_CONFIG_PATH=str(config)), servers)
    assert API_KEY not in log
    assert "server_args=" not in log
    for line in STARTUP_LINES:
        assert line in log, line
    # The file replaces SGLang's format entirely: no rank prefix.
    assert re.search(r"\] Load weight end\.", log) and " TP0]" not in log


def test_config_without_disable_existing_loggers_false_silences_sglang(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    """dictConfig's default disables every existing logger it does not name, as in SGLang."""
    config = logging_config(tmp_path / "logging.json", keep_other_loggers=False)
    log = ready_log(start(state_dir, tmp_path, SGLANG_LOGGING_CONFIG_PATH=str(config)), servers)
    assert API_KEY not in log
    assert not any(line in log for line in STARTUP_LINES)


def test_missing_logging_config_fails_like_sglang(state_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    result = subprocess.run(
        [sys.executable, "-m", "gpusim.sglang_server", "--model-path", LLAMA],
        env=child_env(state_dir, SGLANG_LOGGING_CONFIG_PATH=str(missing)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "Traceback (most recent call last):" in result.stderr
    assert (
        f"Exception: Setting SGLANG_LOGGING_CONFIG_PATH from env with {missing} "
        "but it does not exist!"
    ) in result.stderr


def probe_patterns() -> list[re.Pattern[str]]:
    """The deployment's fail-fast patterns (plugins/modules/sglang_health_probe.py
    DEFAULT_FATAL)."""
    module = load_plugin("plugins/modules/sglang_health_probe.py")
    return [re.compile(pattern) for pattern in module.DEFAULT_FATAL]


@pytest.mark.parametrize(
    ("fraction", "cause"),
    [
        # 0.5.23's wording for weights that leave no KV room (a ValueError in a scheduler).
        ("0.10", "ValueError: Loaded weights leave no GPU memory for the KV cache"),
        # The memory left outside the static pool cannot hold the CUDA graphs.
        ("0.995", "torch.OutOfMemoryError: CUDA out of memory."),
    ],
    ids=["no-kv-room", "graph-capture-oom"],
)
def test_start_up_failures_match_the_probes_fatal_patterns(
    fraction: str, cause: str, state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    flags = ("--model-path", LLAMA, "--mem-fraction-static", fraction)
    server = start_server(state_dir, tmp_path, *flags)
    servers.append(server)
    assert server.proc.wait(20) == -signal.SIGKILL
    lines = server.log().splitlines()
    fatal = [line for line in lines if any(p.search(line) for p in probe_patterns())]
    assert fatal and "Scheduler hit an exception: Traceback (most recent call last):" in fatal[0]
    assert any(cause in line for line in lines)
