"""Live diagnosis of a running server: the sampler (sglang_fleet/diagnosis/live_metrics.py) and
diagnose_live().

The sampler is tested against a scripted standard-library HTTP server (exact readings, a fake
clock), as a single file outside the repository (how the playbook runs it on a GPU host), and
end to end against the GPU-less double under a KV-bound load (docs/DIAGNOSIS.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from gpusim_helpers import (
    KIMI,
    LLAMA,
    Hardware,
    Server,
    Timing,
    collect_servers,
    free_port,
    start_server,
    state,
    stop_server,
)

from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.diagnosis import diagnose as diagnose_mod
from sglang_fleet.diagnosis import live_metrics as live
from sglang_fleet.diagnosis.live_diagnosis import diagnose_live, table_lines
from sglang_fleet.host_zipapp import build as build_zipapp
from sglang_fleet.smoke.smoke_client import prometheus_text

ROOT = Path(__file__).resolve().parent.parent
LIVE_PY = ROOT / "sglang_fleet" / "diagnosis" / "live_metrics.py"
SAMPLER = "sglang_fleet.diagnosis.live_metrics"
KIMI_DIR = ROOT / "tests" / "fixtures" / "models" / "kimi-k2.5-int4"
API_KEY = "s3cret-live"


# ------------------------------------------------------------------------------------------
# A scripted SGLang: /metrics readings in order, /server_info as given
# ------------------------------------------------------------------------------------------


def metrics_text(
    running: float,
    queue: float,
    usage: float,
    gen_tokens: float,
    *,
    prompt_tokens: float = 0.0,
    max_tokens: float = 173289,
    gen_tok_s: float = 0.0,
    decoded: float | None = None,
) -> str:
    """/metrics as SGLang 0.5.23 writes it: gauges and the realtime token counter per
    scheduler, finished-request counters per is_streaming."""
    sched = 'model_name="kimi",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
    lines = [
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        f"sglang:num_running_reqs{{{sched}}} {running}",
        f"sglang:num_queue_reqs{{{sched}}} {queue}",
        f"sglang:token_usage{{{sched}}} {usage}",
        f"sglang:gen_throughput{{{sched}}} {gen_tok_s}",
        f"sglang:max_total_num_tokens{{{sched}}} {max_tokens}",
        f"sglang:cache_hit_rate{{{sched}}} NaN",
        f'sglang:generation_tokens_total{{model_name="kimi",is_streaming="true"}} {gen_tokens}',
        'sglang:generation_tokens_total{model_name="kimi",is_streaming="false"} 0.0',
        'sglang:generation_tokens_created{model_name="kimi",is_streaming="true"} 1.7e9',
        f'sglang:prompt_tokens_total{{model_name="kimi",is_streaming="true"}} {prompt_tokens}',
    ]
    if decoded is not None:
        lines += [
            f'sglang:realtime_tokens_total{{{sched},mode="decode"}} {decoded}',
            f'sglang:realtime_tokens_total{{{sched},mode="prefill_compute"}} {prompt_tokens}',
            f'sglang:realtime_tokens_total{{{sched},mode="prefill_cache"}} 64',
        ]
    return "\n".join(lines) + "\n"


SERVER_INFO = {
    "model_path": "/shared/kimi-k2.5-int4",
    "served_model_name": "kimi",
    "tp_size": 8,
    "dp_size": 1,
    "mem_fraction_static": 0.85,
    "kv_cache_dtype": "auto",
    "enable_hierarchical_cache": True,
    "hicache_size": 48,
    "hicache_ratio": 2.0,
    "max_total_num_tokens": 173289,
    "api_key": API_KEY,  # SGLang reports every argument: the sampler must drop this one
    "internal_states": [{"memory_usage": {"weight": 69.18, "kvcache": 11.34, "token_capacity": 1}}],
    "version": "0.5.23",
}


@dataclass
class Script:
    metrics: list[tuple[int, str]] = field(default_factory=list)
    server_info: tuple[int, dict] = (200, SERVER_INFO)
    get_server_info: tuple[int, dict] | None = None
    api_key: str | None = None
    seen: list[tuple[str, str | None]] = field(default_factory=list)


class _Handler(BaseHTTPRequestHandler):
    script: Script

    def do_GET(self) -> None:
        script = self.server.script  # type: ignore[attr-defined]
        script.seen.append((self.path, self.headers.get("Authorization")))
        if self.path == "/metrics":
            status, body = script.metrics.pop(0) if len(script.metrics) > 1 else script.metrics[0]
            self._reply(status, body.encode())
            return
        wanted = {"/server_info": script.server_info, "/get_server_info": script.get_server_info}
        answer = wanted.get(self.path) or (404, {"detail": "Not Found"})
        if script.api_key and self.headers.get("Authorization") != f"Bearer {script.api_key}":
            answer = (401, {"error": "Unauthorized"})
        self._reply(answer[0], json.dumps(answer[1]).encode())

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # quiet
        pass


@pytest.fixture
def scripted() -> Iterator[tuple[str, Script]]:
    script = Script()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.script = script  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", script
    finally:
        httpd.shutdown()
        httpd.server_close()


class FakeTime:
    """clock() and sleep() for sample_server: sleeping moves the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 100.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def sample(url: str, window: float = 3.0, interval: float = 1.0, **kw: Any) -> dict[str, Any]:
    fake = FakeTime()
    return live.sample_server(url, window, interval, clock=fake.clock, sleep=fake.sleep, **kw)


# ------------------------------------------------------------------------------------------
# Parsing and aggregation
# ------------------------------------------------------------------------------------------


def test_parse_series_reads_labels_and_skips_comments_and_nan():
    series = live.parse_series(metrics_text(57, 93, 0.99, 1000))
    by_name = {(n, lb.get("is_streaming")): v for n, lb, v in series}
    assert by_name[("sglang:num_running_reqs", None)] == 57
    assert by_name[("sglang:generation_tokens_total", "true")] == 1000
    assert not any(n == "sglang:cache_hit_rate" for n, _, _ in series)  # NaN
    labels = next(lb for n, lb, _ in series if n == "sglang:token_usage")
    assert labels["tp_rank"] == "0"
    assert live.parse_series('m{a="x,\\"y}"} 2\n')[0] == ("m", {"a": 'x,\\"y}'}, 2.0)


def test_the_sampler_reads_metrics_with_the_smoke_clients_parser():
    """One Prometheus text parser in the project: the smoke client's, which the sampler imports."""
    assert live.parse_series is prometheus_text.parse_series


def test_aggregate_sums_data_parallel_groups_and_drops_duplicates():
    text = "\n".join(
        [
            # dp group 0: every tp rank reports (--enable-metrics-for-all-schedulers)
            *(f'sglang:num_running_reqs{{tp_rank="{r}",dp_rank="0"}} 40' for r in range(4)),
            *(f'sglang:token_usage{{tp_rank="{r}",dp_rank="0"}} 0.9' for r in range(4)),
            'sglang:num_running_reqs{tp_rank="4",dp_rank="1"} 30',
            'sglang:token_usage{tp_rank="4",dp_rank="1"} 0.6',
            # priority scheduling: priority="" is the total, the others a breakdown of it
            'sglang:num_queue_reqs{tp_rank="0",dp_rank="0",priority=""} 12',
            'sglang:num_queue_reqs{tp_rank="0",dp_rank="0",priority="1"} 5',
            'sglang:num_queue_reqs{tp_rank="0",dp_rank="0",priority="2"} 7',
            'sglang:generation_tokens_total{is_streaming="true"} 100',
            'sglang:generation_tokens_total{is_streaming="false"} 20',
            # per scheduler and mode: duplicates de-duplicated, groups and prefill modes added
            *(f'sglang:realtime_tokens_total{{tp_rank="{r}",dp_rank="0",mode="decode"}} 500'
              for r in range(4)),
            'sglang:realtime_tokens_total{tp_rank="4",dp_rank="1",mode="decode"} 300',
            'sglang:realtime_tokens_total{tp_rank="4",dp_rank="1",mode="prefill_compute"} 900',
            'sglang:realtime_tokens_total{tp_rank="4",dp_rank="1",mode="prefill_cache"} 100',
        ]
    )  # fmt: skip
    values = live.aggregate(live.parse_series(text))
    assert values[live.M_RUNNING] == 70  # 40 (once, not 4 x 40) + 30
    assert values[live.M_TOKEN_USAGE] == 0.9  # the fullest replica
    assert values[live.M_QUEUE] == 12
    assert values[live.M_GEN_TOKENS] == 120
    assert (values[live.DECODE_TOKENS], values[live.PREFILL_TOKENS]) == (800, 1000)
    assert values["schedulers"] == 2


# ------------------------------------------------------------------------------------------
# Sampling a scripted server
# ------------------------------------------------------------------------------------------


def test_sample_reads_a_window_in_the_smoke_results_shape(scripted):
    url, script = scripted
    script.metrics = [
        (200, metrics_text(57, 93, 0.97, 1000, prompt_tokens=5000, decoded=10000)),
        (200, metrics_text(55, 95, 0.99, 1700, prompt_tokens=6000, decoded=10690)),
        (200, metrics_text(57, 93, 0.98, 2400, prompt_tokens=6000, decoded=11390)),
        (200, metrics_text(56, 94, 0.99, 3100, prompt_tokens=7000, decoded=12080)),
    ]
    result = sample(url + "/", window=3.0, interval=1.0, api_key=API_KEY)
    m = result["server_metrics"]
    assert [s["t"] for s in m["samples"]] == [0.0, 1.0, 2.0, 3.0]
    assert [s["num_running_reqs"] for s in m["samples"]] == [57, 55, 57, 56]
    assert [s["num_queue_reqs"] for s in m["samples"]] == [93, 95, 93, 94]
    assert m["generation_tokens_delta"] == 2100  # 3100 - 1000
    assert m["prompt_tokens_delta"] == 2000
    assert (m["decode_tokens_delta"], m["prefill_tokens_delta"]) == (2080, 2000)
    assert m["retracted_requests_delta"] is None  # not exported by this server
    assert (m["peak_num_running_reqs"], m["peak_num_queue_reqs"]) == (57, 95)
    assert m["peak_token_usage"] == 0.99
    assert m["max_total_num_tokens"] == 173289
    assert isinstance(m["max_total_num_tokens"], int)
    assert (m["window_s"], m["schedulers"]) == (3.0, 1)
    assert result["url"] == url and result["error"] is None and result["warnings"] == []
    # the whitelisted flags, never the key; the key went to /server_info only as a header
    info = result["server_info"]
    assert info["kv_cache_dtype"] == "auto" and info["hicache_size"] == 48
    assert info["memory_usage"]["kvcache"] == 11.34
    assert "api_key" not in info and API_KEY not in json.dumps(result)
    assert ("/server_info", f"Bearer {API_KEY}") in script.seen


def test_missing_no_metrics_and_refused_key(scripted):
    url, script = scripted
    script.metrics = [(404, "Not Found")]
    with pytest.raises(live.SampleError, match="--enable-metrics") as err:
        sample(url)
    assert err.value.code == "no_metrics"

    script.metrics = [(200, metrics_text(0, 0, 0.0, 0))]
    script.api_key = API_KEY
    with pytest.raises(live.SampleError, match="give it with --api-key-file") as err:
        sample(url)
    assert err.value.code == "unauthorized"
    with pytest.raises(live.SampleError, match="the API key given was refused"):
        sample(url, api_key="wrong")

    with pytest.raises(live.SampleError, match="cannot reach") as err:
        sample(f"http://127.0.0.1:{free_port()}")
    assert err.value.code == "unreachable"


def test_server_info_falls_back_to_the_old_path_then_to_a_warning(scripted):
    url, script = scripted
    script.metrics = [(200, metrics_text(1, 0, 0.1, 10))]
    script.server_info = (404, {})
    script.get_server_info = (200, SERVER_INFO)
    assert sample(url)["server_info"]["tp_size"] == 8
    script.get_server_info = None
    result = sample(url)
    assert result["server_info"] is None
    assert result["warnings"] == [
        "the server has no /server_info: levers without the server's flags"
    ]


def test_restart_inside_the_window_and_failed_readings_are_said(scripted):
    url, script = scripted
    script.metrics = [
        (200, metrics_text(5, 0, 0.2, 9000)),
        (503, "starting"),
        (200, metrics_text(0, 0, 0.0, 10)),
    ]
    result = sample(url, window=2.0, interval=1.0)
    m = result["server_metrics"]
    assert len(m["samples"]) == 2
    assert m["generation_tokens_delta"] is None
    assert any("went backwards" in w for w in result["warnings"])
    assert any(w.startswith("1 of 3 readings failed") for w in result["warnings"])


# ------------------------------------------------------------------------------------------
# The sampler as one file (a zipapp) on a GPU host
# ------------------------------------------------------------------------------------------


def test_the_sampler_zipapp_holds_the_sampler_its_reader_and_its_parser_only():
    """What the diagnosis role puts on a host: the sampler, its HTTP reader, its number reader,
    its Prometheus parser and the secret rule that keeps a key off its command line, with their
    packages, all standard library (host_zipapp refuses anything else)."""
    names = set(zipfile.ZipFile(io.BytesIO(build_zipapp(SAMPLER))).namelist())
    assert names == {
        "__main__.py",
        "sglang_fleet/__init__.py",
        "sglang_fleet/server_secrets.py",
        "sglang_fleet/smoke/__init__.py",
        "sglang_fleet/smoke/smoke_client/__init__.py",
        "sglang_fleet/smoke/smoke_client/prometheus_text.py",
        "sglang_fleet/diagnosis/__init__.py",
        "sglang_fleet/diagnosis/live_metrics.py",
        "sglang_fleet/module_utils/__init__.py",
        "sglang_fleet/module_utils/bounded_json.py",
        "sglang_fleet/module_utils/fleet_http.py",
        "sglang_fleet/module_utils/typed_number.py",
    }


def _host_pythons() -> list[str]:
    """This interpreter, and the oldest one the hosts may have (3.9) when it is installed."""
    found = [sys.executable]
    old = shutil.which("python3.9")
    if old and subprocess.run([old, "-c", ""], check=False, capture_output=True).returncode == 0:
        found.append(old)
    return found


@pytest.mark.parametrize("python", _host_pythons())
def test_the_sampler_zipapp_runs_alone_with_the_key_from_stdin(python, scripted, tmp_path):
    url, script = scripted
    script.metrics = [(200, metrics_text(3, 0, 0.1, 100)), (200, metrics_text(3, 0, 0.1, 160))]
    script.api_key = API_KEY
    alone = tmp_path / "live.pyz"  # as the diagnosis role puts it on the host
    alone.write_bytes(build_zipapp(SAMPLER))
    out = tmp_path / "sample.json"
    # -S: no site-packages, so no sglang_fleet either, as on a GPU host
    argv = [python, "-I", "-S", str(alone), "--url", url, "--window", "0.2", "--interval", "0.1"]
    done = subprocess.run(
        [*argv, "--api-key-file", "/dev/stdin", "--json", str(out)],
        input=API_KEY + "\n",
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    written = json.loads(out.read_text())
    assert json.loads(done.stdout) == written
    assert written["server_info"]["served_model_name"] == "kimi"
    assert written["server_metrics"]["generation_tokens_delta"] == 60


def run_live(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(LIVE_PY), *argv],
        check=False,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], **(env or {})},
        timeout=60,
    )


def test_live_py_exit_statuses(scripted, tmp_path):
    url, script = scripted
    script.metrics = [(404, "Not Found")]
    usage = [
        ("--window", "1"),  # no --url
        ("--url", "localhost:30000"),
        ("--url", url, "--window", "1", "--interval", "2"),
        ("--url", url, "--window", "0"),
        ("--url", url, "--api-key-file", str(tmp_path / "missing")),
    ]
    for argv in usage:
        assert run_live(*argv).returncode == 2, argv
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert run_live("--url", url, "--api-key-file", str(empty)).returncode == 2
    # A key on the command line is refused without being echoed.
    refused = run_live("--url", url, "--api-key", API_KEY)
    assert refused.returncode == 2 and API_KEY not in refused.stderr + refused.stdout
    assert "--api-key is not accepted" in refused.stderr

    failed = run_live("--url", url, "--window", "1")
    assert failed.returncode == 1
    assert json.loads(failed.stdout)["error"]["code"] == "no_metrics"
    assert "--enable-metrics" in failed.stderr


# ------------------------------------------------------------------------------------------
# diagnose_live on samples
# ------------------------------------------------------------------------------------------


def live_sample(
    rows: list[tuple[int, int, float]],
    *,
    gen_delta: float | None = 2100.0,
    decoded: float | None = None,
    info: dict[str, Any] | None = None,
    max_tokens: int = 173289,
) -> dict[str, Any]:
    samples = [
        {"t": float(i), "num_running_reqs": r, "num_queue_reqs": q, "token_usage": u}
        | {"gen_throughput": 0.0}
        for i, (r, q, u) in enumerate(rows)
    ]
    return {
        "url": "http://127.0.0.1:8000",
        "interval_s": 1.0,
        "server_info": live.pick_server_info(SERVER_INFO if info is None else info),
        "server_metrics": {
            "generation_tokens_delta": gen_delta,
            "prompt_tokens_delta": 0.0,
            "decode_tokens_delta": decoded,
            "prefill_tokens_delta": None if decoded is None else 0.0,
            "retracted_requests_delta": None,
            "peak_num_running_reqs": max(r for r, _, _ in rows),
            "peak_num_queue_reqs": max(q for _, q, _ in rows),
            "peak_token_usage": max(u for _, _, u in rows),
            "max_total_num_tokens": max_tokens,
            "schedulers": 1,
            "window_s": float(len(rows) - 1),
            "samples": samples,
        },
        "warnings": [],
        "error": None,
    }


KV_BOUND_ROWS = [(57, 93, 0.99), (56, 94, 0.98), (57, 93, 0.99), (55, 95, 0.97)]


def codes(result: dict[str, Any]) -> list[str]:
    return [lever["code"] for lever in result["levers"]]


def assert_no_hicache_lever(result: dict[str, Any]) -> None:
    for lever in result["levers"]:
        text = (lever["code"] + " " + lever["message"]).lower()
        assert "hicache" not in text and "hierarchical" not in text, lever


def test_kv_bound_live_gives_fp8_and_fraction_levers_and_never_hicache():
    result = diagnose_live(json.dumps(live_sample(KV_BOUND_ROWS)))  # JSON text, as slurped
    assert result["verdict"] == "kv_cache_bound"
    assert codes(result) == ["kv_cache_dtype_fp8", "mem_fraction_static", "more_gpus"]
    assert_no_hicache_lever(result)
    assert any("Not a lever for decode slots" in n for n in result["notes"])
    ev = result["evidence"]
    # running 55 56 57 57 -> 56.5; queued 93 93 94 95 -> 93.5; 2100 tokens in 3 s
    assert (ev["median_running_reqs"], ev["median_queue_reqs"]) == (56.5, 93.5)
    assert (ev["generation_tok_s"], ev["output_throughput"], ev["window_s"]) == (700.0, 700.0, 3.0)
    assert ev["client_concurrency_asked"] is None
    # the server's own flags show in the levers without any model at hand
    levers = {lv["code"]: lv["message"] for lv in result["levers"]}
    assert "(now auto: the model's dtype" in levers["kv_cache_dtype_fp8"]
    assert "max_total_num_tokens now 173289" in levers["kv_cache_dtype_fp8"]
    assert "(now 0.85)" in levers["mem_fraction_static"]
    assert result["row"] == {
        "running": 56.5,
        "queued": 93.5,
        "token_usage": 0.985,
        "gen_tok_s": 700.0,
        "verdict": "kv_cache_bound",
        "first_lever": "kv_cache_dtype_fp8",
        "first_lever_message": levers["kv_cache_dtype_fp8"],
    }
    assert result["summary"] == (
        "kv_cache_bound: running 56.5, queued 93.5, token usage 0.98, 700.0 gen tok/s over "
        "3 s; first lever: kv_cache_dtype_fp8"
    )
    assert result["server"]["kv_cache_dtype"] == "auto"


def test_a_server_already_on_fp8_is_not_told_to_use_fp8():
    info = SERVER_INFO | {"kv_cache_dtype": "fp8_e4m3"}
    result = diagnose_live(live_sample(KV_BOUND_ROWS, info=info))
    assert result["verdict"] == "kv_cache_bound"
    assert codes(result) == ["mem_fraction_static", "more_gpus"]


def test_live_levers_carry_the_planners_capacity_for_the_running_flags():
    config, weights = read_model_dir(KIMI_DIR)
    ctx = {
        "model_config": config,
        "weight_bytes": weights,
        # what the inventory says now; the running server's flags (0.85, auto) win
        "args": {"mem_fraction_static": 0.9, "kv_cache_dtype": "fp8_e4m3"},
        "host": {"gpu_memory_mib": 97887, "host_ram_gib": 400, "gpu_count": 8},
    }
    result = diagnose_live(live_sample([(57, 93, 0.99)] * 4), ctx)
    levers = {lv["code"]: lv["message"] for lv in result["levers"]}
    # 0.99 * 173289 / 57 = 3010 tokens held per running request
    assert result["evidence"]["kv_tokens_per_running_req"] == 3010
    # Without a log the planner estimates the pool with SGLang's placement (the replicated
    # fused_qkv_a_proj_with_mqa and router whole on each GPU: tests/test_plan.py): 142736
    # tokens now (the sampled server reports 173289), 285472 with fp8; // 3010 per request =
    # 47 and 94 requests.
    assert "max_total_num_tokens 285472 (now 142736)" in levers["kv_cache_dtype_fp8"]
    assert "about 94 concurrent requests (now 47)" in levers["kv_cache_dtype_fp8"]
    # 0.85 (the server's, not the inventory's 0.9) is above SGLang's own choice, 0.758, which
    # is the planner's limit until a log calibrates it.
    # An MLA model: attention DP comes right after fp8 (docs/ATTENTION-DP.md).
    assert codes(result) == [
        "kv_cache_dtype_fp8",
        "attention_dp",
        "mem_fraction_static_at_limit",
        "more_gpus",
    ]
    assert "--mem-fraction-static 0.85 is already at" in levers["mem_fraction_static_at_limit"]
    assert_no_hicache_lever(result)


def test_idle_window_is_idle_not_kv_bound():
    # A pool still full of finished requests' prefixes while nothing runs: not a bottleneck.
    result = diagnose_live(live_sample([(0, 0, 0.0)] * 4 + [(0, 0, 0.4)], gen_delta=0.0))
    assert result["verdict"] == "idle"
    assert codes(result) == ["sample_under_load"]
    assert result["row"]["running"] == 0 and result["row"]["queued"] == 0
    assert result["row"]["token_usage"] == 0.4
    assert result["summary"].startswith("idle: running 0, queued 0, token usage 0.40, 0.0 gen")


def test_light_load_is_healthy_and_a_queue_with_room_is_compute_bound():
    light = diagnose_live(live_sample([(8, 0, 0.2), (9, 0, 0.22), (8, 0, 0.21)]))
    assert light["verdict"] == "healthy" and codes(light) == ["raise_load"]
    batch_capped = [(128, 22, 0.42), (128, 22, 0.45), (128, 21, 0.47)]
    assert diagnose_live(live_sample(batch_capped))["verdict"] == "compute_bound"


def test_the_realtime_counter_measures_the_window_when_the_server_has_it():
    # SGLang counts generation_tokens_total when a request finishes: long requests that all
    # run through a window add nothing there, while realtime_tokens_total counts each pass.
    result = diagnose_live(live_sample(KV_BOUND_ROWS, gen_delta=0.0, decoded=2040.0))
    assert result["evidence"]["generation_tok_s"] == 680.0
    assert result["evidence"]["tok_s_source"] == "realtime_tokens_total"
    assert not any("no token was decoded" in n for n in result["notes"])
    fallback = diagnose_live(live_sample(KV_BOUND_ROWS, gen_delta=2100.0))
    assert fallback["evidence"]["tok_s_source"].startswith("finished requests")


def test_requests_without_tokens_are_noted():
    result = diagnose_live(live_sample(KV_BOUND_ROWS, gen_delta=0.0, decoded=0.0))
    assert any("no token was decoded" in n for n in result["notes"])
    # A finished-request counter that stood still proves nothing: no note.
    assert not any(
        "decoded" in n for n in diagnose_live(live_sample(KV_BOUND_ROWS, gen_delta=0.0))["notes"]
    )


@pytest.mark.parametrize(
    ("code", "lever"),
    [
        ("no_metrics", "enable_metrics"),
        ("unauthorized", "api_key"),
        ("unreachable", "check_server"),
        ("http_error", "check_server"),
    ],
)
def test_a_failed_sample_says_what_to_fix(code, lever):
    failed = live.error_sample("http://127.0.0.1:8000", code, f"it failed: {code}")
    result = diagnose_live(failed)
    assert result["verdict"] == "unknown"
    assert codes(result) == [lever]
    assert result["error"]["code"] == code
    assert result["row"]["running"] is None
    assert result["summary"] == f"not sampled ({code}): it failed: {code}"


def test_fleet_table():
    ok = diagnose_live(live_sample(KV_BOUND_ROWS))
    idle = diagnose_live(live_sample([(0, 0, 0.0)] * 3, gen_delta=0.0))
    down = diagnose_live(live.error_sample("http://127.0.0.1:8001", "no_metrics", "no /metrics"))
    lines = table_lines(
        [
            {"host": "gpu-node-01", "server": "kimi", "diagnosis": ok},
            {"host": "gpu-node-01", "server": "small", "diagnosis": idle},
            {"host": "gpu-node-02", "server": "kimi", "diagnosis": down},
        ]
    )
    assert [re.split(r"\s{2,}", line) for line in lines[:4]] == [
        ["HOST", "SERVER", "RUNNING", "QUEUED", "TOKEN USAGE", "GEN TOK/S", "VERDICT",
         "FIRST LEVER"],
        ["gpu-node-01", "kimi", "56.5", "93.5", "0.98", "700.0", "kv_cache_bound",
         "kv_cache_dtype_fp8"],
        ["gpu-node-01", "small", "0", "0", "0.00", "0.0", "idle", "sample_under_load"],
        ["gpu-node-02", "kimi", "-", "-", "-", "-", "unknown", "enable_metrics"],
    ]  # fmt: skip
    assert lines[4] == "gpu-node-02 kimi: not sampled (no_metrics): no /metrics"
    assert len(lines) == 5


# ------------------------------------------------------------------------------------------
# The diagnose command line, live
# ------------------------------------------------------------------------------------------


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = diagnose_mod.main(list(argv))
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_reads_a_sample_taken_on_the_host(tmp_path, capsys):
    path = tmp_path / "sample.json"
    path.write_text(json.dumps(live_sample(KV_BOUND_ROWS)))
    rc, out, _ = run_cli(capsys, "--sample", str(path), "--json")
    assert rc == 0 and json.loads(out)["verdict"] == "kv_cache_bound"
    rc, out, _ = run_cli(capsys, "--sample", str(path), "--table")
    assert rc == 0
    assert out.splitlines()[1].split() == [
        "127.0.0.1:8000", "kimi", "56.5", "93.5", "0.98", "700.0", "kv_cache_bound",
        "kv_cache_dtype_fp8",
    ]  # fmt: skip
    rc, out, _ = run_cli(capsys, "--sample", str(path))
    assert rc == 0 and out.startswith("kv_cache_bound: running 56.5")
    assert "lever kv_cache_dtype_fp8:" in out

    path.write_text(json.dumps(live.error_sample("http://h:1", "unauthorized", "401 here")))
    rc, out, err = run_cli(capsys, "--sample", str(path), "--json")
    assert rc == 1 and json.loads(out)["levers"][0]["code"] == "api_key"
    assert "401 here" in err


def test_cli_samples_a_url(scripted, capsys, tmp_path, monkeypatch):
    url, script = scripted
    script.metrics = [
        (200, metrics_text(57, 93, 0.99, 1000)),
        (200, metrics_text(57, 93, 0.99, 1100)),
    ]
    script.api_key = API_KEY
    monkeypatch.setenv("SGLANG_API_KEY", API_KEY)
    rc, out, _ = run_cli(capsys, "--url", url, "--window", "0.2", "--interval", "0.1", "--json")
    assert rc == 0
    assert json.loads(out)["verdict"] == "kv_cache_bound"
    monkeypatch.delenv("SGLANG_API_KEY")
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY + "\n")
    argv = ("--url", url, "--window", "0.2", "--interval", "0.1", "--json")
    assert run_cli(capsys, *argv, "--api-key-file", str(key_file))[0] == 0
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 1 and json.loads(out)["error"]["code"] == "unauthorized"
    assert "SGLANG_API_KEY" in err


def test_cli_live_usage_errors(tmp_path, capsys):
    sample_file = tmp_path / "s.json"
    sample_file.write_text(json.dumps(live_sample(KV_BOUND_ROWS)))
    bad = [
        ("--url", "http://h:1", "--sample", str(sample_file)),
        ("--url", "http://h:1", "--smoke-result", str(sample_file)),
        ("--url", "http://h:1", "--concurrency", "150"),
        ("--log", str(sample_file), "--table"),
        ("--url", "h:1"),
        ("--url", "http://h:1", "--window", "-3"),
        ("--url", "http://h:1", "--window", "1", "--interval", "5"),
        ("--url", "http://h:1", "--api-key-file", str(tmp_path / "missing")),
        ("--sample", str(tmp_path / "missing.json")),
        ("--url", "http://h:1", "--json", "--table"),
    ]
    for argv in bad:
        assert run_cli(capsys, *argv)[0] == 2, argv
    rc, out, err = run_cli(capsys, "--url", "http://h:1", "--api-key", API_KEY)
    assert rc == 2 and API_KEY not in out + err
    (tmp_path / "list.json").write_text("[]")
    assert run_cli(capsys, "--sample", str(tmp_path / "list.json"))[0] == 2


# ------------------------------------------------------------------------------------------
# End to end against the GPU-less double
# ------------------------------------------------------------------------------------------


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    yield from collect_servers()


def timed_root(where: Path) -> Path:
    """A simulated 8 x 96 GB host that starts at once but decodes at the double's default
    speed (0.05 s a step), so a load stays in flight for the whole window."""
    root = where / "gpusim"
    state.init_state(
        Hardware(timing=Timing(load_weights_s=0, kv_alloc_s=0, graph_capture_s=0)), root
    )
    return root


def gauge(server: Server, name: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        values = live.aggregate(live.parse_series(response.read().decode()))
    return values.get(name, 0.0)


def start_load(server: Server, requests: int, prompt: int, output: int) -> list[threading.Thread]:
    """`requests` generations at once (non-streaming); they end when the server is stopped."""

    def one(i: int) -> None:
        body = {"input_ids": [100 + i] * prompt, "sampling_params": {"max_new_tokens": output}}
        request = urllib.request.Request(
            server.url + "/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with contextlib.suppress(OSError):  # the test stops the server under its requests
            urllib.request.urlopen(request, timeout=120).read()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(requests)]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.slow
def test_kv_bound_load_on_the_double(tmp_path, servers, capsys):
    """Kimi-K2.5 TP8 at 0.85 with bf16 KV and HiCache on, under 150 concurrent requests of
    1000 + 2000 tokens: 57 fit in the 173289-token pool, 93 wait (gpusim/README.md). The
    sampler runs alone as on a GPU host, the diagnosis reads the file it writes."""
    flags = ("--model-path", KIMI, "--tp-size", "8", "--mem-fraction-static", "0.85")
    hicache = ("--enable-hierarchical-cache", "--hicache-size", "48")
    server = start_server(
        timed_root(tmp_path), tmp_path, *flags, *hicache, "--enable-metrics", "--skip-server-warmup"
    )
    servers.append(server)
    server.wait_ready(60)
    load = start_load(server, 150, 1000, 2000)
    try:
        deadline = time.monotonic() + 30
        while gauge(server, live.M_RUNNING) + gauge(server, live.M_QUEUE) < 150:
            assert time.monotonic() < deadline, "the load never reached the server"
            time.sleep(0.1)
        sample_file = tmp_path / "sample.json"
        sampler = subprocess.run(
            [
                *(sys.executable, "-I", str(LIVE_PY), "--url", server.url),
                *("--window", "2", "--interval", "0.25", "--json", str(sample_file)),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        stop_server(server)
        for thread in load:
            thread.join(10)
    assert sampler.returncode == 0, sampler.stderr

    rc, out, err = run_cli(capsys, "--sample", str(sample_file), "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert result["verdict"] == "kv_cache_bound"
    ev = result["evidence"]
    assert (ev["median_running_reqs"], ev["median_queue_reqs"]) == (48, 102)
    assert ev["median_token_usage"] > 0.9
    assert ev["max_total_num_tokens"] == 144009  # the double's Kimi at 0.85 (test_gpusim_memory)
    assert ev["generation_tok_s"] > 0
    assert codes(result)[:2] == ["kv_cache_dtype_fp8", "mem_fraction_static"]
    assert_no_hicache_lever(result)
    assert result["server"]["enable_hierarchical_cache"] is True

    # With the model and the server's log, the levers carry the planner's numbers, which
    # match what the double does with fp8 (96 requests of 3000 tokens, README).
    rc, out, err = run_cli(
        capsys,
        *("--sample", str(sample_file), "--json", "--model-path", KIMI),
        *("--gpu-memory-mib", "97887", "--log", str(server.log_path)),
    )
    assert rc == 0, err
    sized = json.loads(out)
    levers = {lv["code"]: lv["message"] for lv in sized["levers"]}
    assert "about 96 concurrent requests (now 48)" in levers["kv_cache_dtype_fp8"]
    assert "from 0.85 to" in levers["mem_fraction_static"]
    assert_no_hicache_lever(sized)


@pytest.mark.slow
def test_idle_key_guarded_and_metricless_servers_on_the_double(tmp_path, servers, capsys):
    guarded = start_server(
        timed_root(tmp_path / "a"),
        tmp_path,
        *("--model-path", LLAMA, "--enable-metrics", "--api-key", API_KEY),
    )
    plain = start_server(timed_root(tmp_path / "b"), tmp_path, "--model-path", LLAMA)
    servers.extend([guarded, plain])
    guarded.wait_ready(60)
    plain.wait_ready(60)
    quick = ("--window", "0.5", "--interval", "0.25")

    key_file = tmp_path / "key"
    key_file.write_text(API_KEY)
    rc, out, _ = run_cli(
        capsys, "--url", guarded.url, *quick, "--api-key-file", str(key_file), "--json"
    )
    assert rc == 0
    idle = json.loads(out)
    assert idle["verdict"] == "idle"
    assert idle["evidence"]["samples"] == 3 and idle["evidence"]["busy_samples"] == 0
    assert idle["server"]["tp_size"] == 1

    rc, out, err = run_cli(capsys, "--url", guarded.url, *quick)
    assert rc == 1 and "--api-key-file or SGLANG_API_KEY" in err
    rc, out, err = run_cli(capsys, "--url", plain.url, *quick, "--json")
    assert rc == 1 and json.loads(out)["error"]["code"] == "no_metrics"
    rc, out, err = run_cli(capsys, "--url", f"http://127.0.0.1:{free_port()}", *quick)
    assert rc == 1 and "cannot reach" in err
