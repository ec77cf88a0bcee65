"""The SGLang-shaped server as real processes: HTTP API, clients, process tree, failures."""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from gpusim.nvidia_smi import run as smi
from gpusim_helpers import (
    KIMI,
    LLAMA,
    Server,
    init_root,
    port_is_bound,
    start_server,
    stop_server,
)

from gpusim import sglang_server, state

pytestmark = pytest.mark.slow


API_KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def post(server: Server, path: str, body: dict) -> bytes:
    request = urllib.request.Request(
        server.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **AUTH},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


def get_json(server: Server, path: str) -> dict:
    request = urllib.request.Request(server.url + path, headers=AUTH)
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def used_mib(root: Path) -> list[int]:
    os.environ["GPUSIM_STATE_DIR"] = str(root)
    _, out, _ = smi(["--query-gpu=memory.used", "--format=csv,noheader,nounits"])
    return [int(line) for line in out]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One Llama-shaped TP2 server shared by the API tests (start-up is the slow part)."""
    tmp = tmp_path_factory.mktemp("llama")
    server = start_server(
        init_root(tmp / "gpusim"),
        tmp,
        *("--model-path", LLAMA, "--tp-size", "2", "--enable-metrics"),
        *("--served-model-name", "llama", "--decode-log-interval", "4", "--api-key", API_KEY),
    )
    try:
        server.wait_ready()
        yield server
    finally:
        stop_server(server)


def test_openai_client_non_streaming_and_streaming(llama: Server) -> None:
    client = openai.OpenAI(base_url=llama.url + "/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == ["llama"]

    completion = client.completions.create(model="llama", prompt="hello there", max_tokens=7)
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (2, 7)
    assert len(completion.choices[0].text.split()) == 7
    assert completion.choices[0].finish_reason == "length"

    chat = client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert chat.choices[0].message.role == "assistant"
    assert len((chat.choices[0].message.content or "").split()) == 5

    stream = client.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": "tell me"}],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 9
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9

    pieces = client.completions.create(model="llama", prompt="a b c", max_tokens=6, stream=True)
    streamed = "".join(p.choices[0].text for p in pieces)
    assert len(streamed.split()) == 6


def test_generate_streams_cumulative_text_and_meta_info(llama: Server) -> None:
    raw = post(
        llama,
        "/generate",
        {
            "input_ids": list(range(20, 120)),
            "sampling_params": {"max_new_tokens": 5},
            "stream": True,
        },
    ).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    last = chunks[-1]["meta_info"]
    assert last["completion_tokens"] == 5 and len(texts[-1].split()) == 5
    assert last["prompt_tokens"] == 100 and last["finish_reason"]["type"] == "length"
    # The same prompt again hits the prefix cache (64-token blocks).
    again = json.loads(
        post(
            llama,
            "/generate",
            {"input_ids": list(range(20, 120)), "sampling_params": {"max_new_tokens": 1}},
        )
    )
    assert again["meta_info"]["cached_tokens"] == 64


def test_server_info_metrics_and_log_lines(llama: Server) -> None:
    info = get_json(llama, "/server_info")
    assert info["version"] == "0.5.23" and info["tp_size"] == 2
    usage = info["internal_states"][0]["memory_usage"]
    assert usage["token_capacity"] == info["max_total_num_tokens"] > 0
    assert usage["weight"] == pytest.approx(16060522496 / 2 / 2**30, abs=1e-3)
    assert get_json(llama, "/get_server_info")["max_total_num_tokens"] == usage["token_capacity"]
    assert get_json(llama, "/model_info")["architectures"] == ["LlamaForCausalLM"]
    post(llama, "/generate", {"text": "one two three", "sampling_params": {"max_new_tokens": 8}})
    with urllib.request.urlopen(llama.url + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'sglang:max_total_num_tokens{engine_type="unified",model_name="llama"' in metrics
    assert "sglang:generation_tokens_total" in metrics
    assert "sglang:time_to_first_token_seconds_bucket" in metrics
    log = llama.log()
    assert "[TP1] " not in log and " TP1] Load weight end. elapsed=" in log
    assert " TP0] max_total_num_tokens=" in log
    assert "The server is fired up and ready to roll!" in log
    assert " TP0] Prefill batch, #new-seq: 1, #new-token: 3, #cached-token: 0" in log
    assert " TP0] Decode batch, #running-req: 1, #token: " in log


def test_api_key_guards_everything_but_health_and_metrics(llama: Server) -> None:
    assert llama.status("/v1/models") == 401
    assert llama.status("/server_info", {"Authorization": "Bearer wrong"}) == 401
    assert llama.status("/v1/models", AUTH) == 200
    assert llama.status("/health_generate") == 200
    assert llama.status("/metrics") == 200


def test_health_is_503_while_starting(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    hardware = state.load_hardware(state_dir)
    hardware.timing.load_weights_s = 1.5
    state.save_hardware(hardware, state_dir)
    server = start_server(state_dir, tmp_path, "--model-path", LLAMA)
    servers.append(server)
    deadline = time.monotonic() + 10
    while not port_is_bound(server.port) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.status("/health") == 503
    server.wait_ready()
    assert server.status("/health") == 200


def test_sigkill_orphans_ranks_holding_memory_and_port(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    # The Kimi job's fraction (docs/THE-JOB.md); SGLang's default for this model is 0.758.
    flags = ("--model-path", KIMI, "--tp-size", "8", "--mem-fraction-static", "0.85")
    server = start_server(state_dir, tmp_path, *flags)
    servers.append(server)
    server.wait_ready()
    ranks = server.rank_pids()
    assert len(ranks) == 8
    held = used_mib(state_dir)
    assert all(mib > 80000 for mib in held)  # weights ~70 GB + KV + graphs per GPU

    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    # The zombie problem: every scheduler survives its launcher, with memory and port.
    assert used_mib(state_dir) == held
    assert port_is_bound(server.port)
    titles = {Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in ranks}
    assert titles == {f"sglang::scheduler_TP{i}".encode() for i in range(8)}

    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    for pid in ranks:
        while Path(f"/proc/{pid}").exists() and b"Z" not in _state_of(pid):
            time.sleep(0.02)
    assert used_mib(state_dir) == [0] * 8
    assert not port_is_bound(server.port)


def _state_of(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1][:3]
    except FileNotFoundError:
        return b"Z"


def test_sigterm_drains_running_requests_then_frees_everything(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    hardware = state.load_hardware(state_dir)
    hardware.timing.decode_step_s = 0.01
    state.save_hardware(hardware, state_dir)
    server = start_server(state_dir, tmp_path, "--model-path", LLAMA, "--tp-size", "2")
    servers.append(server)
    server.wait_ready()
    started = threading.Event()
    last_chunk: dict[str, object] = {}

    def long_request() -> None:
        body = {"text": "go", "sampling_params": {"max_new_tokens": 100}, "stream": True}
        request = urllib.request.Request(
            server.url + "/generate", data=json.dumps(body).encode(), headers=AUTH
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    last_chunk.update(json.loads(line[6:]))
                    started.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    assert started.wait(20)  # decoding: 100 steps x 10 ms still to go
    server.proc.send_signal(signal.SIGTERM)
    worker.join(30)
    assert server.proc.wait(20) == 0
    meta = last_chunk["meta_info"]
    assert isinstance(meta, dict) and meta["completion_tokens"] == 100
    assert "Gracefully exiting... Remaining number of requests 1." in server.log()
    assert used_mib(state_dir) == [0] * 8
    assert not port_is_bound(server.port)


def test_not_enough_host_memory_for_hicache_kills_the_tree(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    server = start_server(
        state_dir,
        tmp_path,
        "--model-path",
        KIMI,
        "--tp-size",
        "8",
        "--mem-fraction-static",
        "0.88",
        "--enable-hierarchical-cache",
        "--hicache-size",
        "300",
    )
    servers.append(server)
    assert server.proc.wait(20) == -signal.SIGKILL  # SGLang's kill_process_tree on itself
    log = server.log()
    assert "Scheduler hit an exception" in log
    assert "ValueError: Not enough host memory available. Requesting 300.00 GB" in log
    assert "Received sigquit from a child process. It usually means the child failed." in log
    assert used_mib(state_dir) == [0] * 8


def test_large_prefill_ooms_when_fraction_too_high(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    server = start_server(
        state_dir,
        tmp_path,
        "--model-path",
        KIMI,
        "--tp-size",
        "8",
        "--mem-fraction-static",
        "0.93",
        "--kv-cache-dtype",
        "fp8_e4m3",
    )
    servers.append(server)
    server.wait_ready()  # graph capture and small requests work
    with pytest.raises(OSError):
        post(
            server, "/generate", {"input_ids": [5] * 8192, "sampling_params": {"max_new_tokens": 4}}
        )
    assert server.proc.wait(20) == -signal.SIGKILL
    assert "torch.OutOfMemoryError: CUDA out of memory." in server.log()
    assert used_mib(state_dir) == [0] * 8


def test_flag_errors_exit_before_any_gpu_work(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        sglang_server.main(["--model-path", LLAMA, "--kv-cache-dtype", "x"])
    assert info.value.code == 2
    assert "invalid choice: 'x'" in capsys.readouterr().err
    root_logger = logging.getLogger()
    saved = root_logger.handlers[:], root_logger.level
    try:
        argv = ["--model-path", LLAMA, "--enable-hierarchical-cache", "--disable-radix-cache"]
        assert sglang_server.main(argv) == 1
    finally:
        root_logger.handlers[:], root_logger.level = saved
    assert "ValueError: The arguments enable-hierarchical-cache and disable-radix-cache are " in (
        capsys.readouterr().err
    )
    assert state.live_procs(state_dir) == []
