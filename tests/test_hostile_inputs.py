"""Every hostile input gets a clear outcome: one table, one small runner per target.

A row is (id, target, input, outcome, text, absent):
- outcome "refused": the input is rejected the way an operator sees it (ServerConfigError or a
  validate problem at pre-flight, PlanInputError/ModelConfigError, the CLI's exit 2, a failed
  sglang_flags_check), never a traceback, and the message contains `text` (the variable or
  argument to fix, and often the rule).
- outcome "handled": the input is accepted and the whole path works (a server resolves,
  validates and renders to an ExecStart= line and EnvironmentFile lines; a plan returns finite
  numbers; the CLI exits 0 or 1; the flag check passes), and the output contains `text`.
`absent` must appear in neither the message nor the output (secrets, dropped flags).

Targets: server (resolve + validate + render, as the role's pre-flight and templates do),
plan (plan() as the Ansible filter calls it), model_dir (a model directory on disk, read and
planned), plan_cli (`python -m sglang_fleet.capacity.planner` argv), flags_check (the Ansible
module, run
as Ansible runs it), smoke (the smoke client, `python -m sglang_fleet.smoke.smoke_client` in its
own process,
against a loopback server that writes the row's bytes and closes the connection: "refused" is
exit 2 before any request; "handled" is a result whose keys have the row's values; every request
asks for 8 tokens and two are sent; SMOKE_PYTHON=python3.9 runs them with the oldest python a
GPU host may have).

The second wave's targets (issue 19), each with its own runner below: live
(sglang_fleet.diagnosis.live_metrics
in its own process against a loopback peer), router (plugins/modules/sglang_router_workers.py
against a loopback peer), lock (plugins/modules/fleet_lock.py on a lock file, and the action
plugin's lease_s), autotune (`python -m sglang_fleet.tuning.autotune` commands in order),
calibration (the host's calibration.json as pre-flight and the record step read it), nodes
(multi-node layouts), diagnose (smoke results and live samples with NaN and Infinity). `counts()`
gives the table's tried / refused / handled per target.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from ansible.errors import AnsibleActionFail
from conftest import load_plugin
from kimi_job import GPU as KIMI_GPU
from kimi_job import KIMI_LOG, KIMI_RUN_FLAGS

from sglang_fleet.capacity import calibration, calibration_record, calibration_store, planner
from sglang_fleet.capacity.model_config import ModelConfigError, read_model_dir
from sglang_fleet.capacity.planner import plan
from sglang_fleet.capacity.planner_inputs import PlanInputError
from sglang_fleet.diagnosis.live_diagnosis import diagnose_live
from sglang_fleet.diagnosis.run_diagnosis import diagnose
from sglang_fleet.rollout import preflight_inputs as preflight
from sglang_fleet.servers import host_checks as validate
from sglang_fleet.servers import launch_line, nodes
from sglang_fleet.servers.describe import resolve_servers
from sglang_fleet.servers.server_values import ServerConfigError
from sglang_fleet.tuning import autotune

ROOT = Path(__file__).resolve().parent.parent
LLAMA_DIR = ROOT / "tests" / "fixtures" / "models" / "llama-3.1-8b"
LLAMA_CONFIG, LLAMA_WEIGHTS = read_model_dir(LLAMA_DIR)
HOST = {"gpu_memory_mib": 97887, "host_ram_gib": 400, "gpu_count": 8}
VALIDATE_HOST = {"gpu_count": 8, "ram_mib": 400 * 1024}
NAN, INF = math.nan, math.inf
KIMI = "sglang_server_instances[kimi]"
LONG_KEY = "k" * 4096


@dataclass(frozen=True)
class Row:
    id: str
    target: str
    input: Any
    outcome: str  # "refused" or "handled"
    text: str = ""
    absent: str = ""


def srv(**changes: Any) -> dict[str, Any]:
    """Input of a server row: changes to one valid server (kimi, 8 GPUs, port 8000)."""
    return {"server": changes}


def flag(key: Any, value: Any) -> dict[str, Any]:
    return srv(flags={key: value})


def env(key: Any, value: Any) -> dict[str, Any]:
    return srv(env={key: value})


def second(**changes: Any) -> dict[str, Any]:
    """Input with a second server beside kimi (shares nothing unless changes say so)."""
    other = {"name": "llama", "model_path": "/m/llama", "port": 8001, "gpus": [7]}
    return {"server": {"gpus": [0, 1, 2, 3], "flags": {"tp_size": 4}}, "more": [other | changes]}


SERVER_ROWS = [
    # --- server names: the unit is sglang@<name>.service
    Row("name-trailing-newline", "server", srv(name="kimi\n"), "refused", "[0].name"),
    Row("name-uppercase", "server", srv(name="Kimi"), "refused", "[0].name"),
    Row("name-42-chars", "server", srv(name="a" * 42), "refused", "1 to 41"),
    Row("name-41-chars", "server", srv(name="a" * 41), "handled", f"sglang@{'a' * 41}.service"),
    Row("name-empty", "server", srv(name=""), "refused", "[0].name"),
    Row("name-dots", "server", srv(name="kimi.v2"), "refused", "[0].name"),
    Row("name-slash", "server", srv(name="kimi/v2"), "refused", "[0].name"),
    Row("name-unicode", "server", srv(name="kimí"), "refused", "[0].name"),
    Row("name-fullwidth", "server", srv(name="\uff4b\uff49\uff4d\uff49"), "refused", "[0].name"),
    Row("name-leading-dash", "server", srv(name="-kimi"), "refused", "[0].name"),
    Row("name-space", "server", srv(name="kimi v2"), "refused", "[0].name"),
    Row("name-nul", "server", srv(name="kimi\0"), "refused", "[0].name"),
    Row("name-null", "server", srv(name=None), "refused", "[0].name"),
    Row("name-integer", "server", srv(name=7), "refused", "[0].name"),
    Row("name-digits", "server", srv(name="8000"), "handled", "sglang@8000.service"),
    Row("name-twice", "server", second(name="kimi"), "refused", "two servers have this name"),
    # --- environment names
    Row("env-key-newline", "server", env("NCCL_PROTO\n", "LL"), "refused", f"{KIMI}.env"),
    Row("env-key-leading-digit", "server", env("1NCCL", "LL"), "refused", f"{KIMI}.env.1NCCL"),
    Row("env-key-dash", "server", env("NCCL-PROTO", "LL"), "refused", "environment variable"),
    Row("env-key-equals", "server", env("A=B", "1"), "refused", f"{KIMI}.env.A=B"),
    Row("env-key-unicode", "server", env("NÇCL", "1"), "refused", f"{KIMI}.env"),
    Row("env-key-empty", "server", env("", "1"), "refused", f"{KIMI}.env"),
    Row("env-key-integer", "server", env(5, "1"), "refused", f"{KIMI}.env.5"),
    Row("env-key-managed", "server", env("CUDA_VISIBLE_DEVICES", "0"), "refused", "gpus"),
    Row("env-key-lowercase", "server", env("nccl_debug", "INFO"), "handled", 'nccl_debug="INFO"'),
    # --- environment values: one EnvironmentFile line each, TAB the only control allowed
    Row(
        "env-value-newline-injection",
        "server",
        env("NCCL_PROTO", "LL\nLD_PRELOAD=/tmp/x.so"),
        "refused",
        f"{KIMI}.env.NCCL_PROTO",
    ),
    Row("env-value-cr", "server", env("X", "a\rb"), "refused", "control character"),
    Row("env-value-escape", "server", env("X", "\x1b[31m"), "refused", f"{KIMI}.env.X"),
    Row("env-value-nul", "server", env("X", "a\0b"), "refused", f"{KIMI}.env.X"),
    Row("env-value-c1-control", "server", env("X", "\x85"), "refused", f"{KIMI}.env.X"),
    Row("env-value-del", "server", env("X", "a\x7fb"), "refused", f"{KIMI}.env.X"),
    Row("env-value-tab", "server", env("X", "a\tb"), "handled", 'X="a\tb"'),
    Row(
        "env-value-shell-chars", "server", env("X", 'a"b$c`d\\'), "handled", 'X="a\\"b\\$c\\`d\\\\"'
    ),
    Row("env-value-bool", "server", env("X", True), "refused", "quoted string"),
    Row("env-value-list", "server", env("X", ["a"]), "refused", f"{KIMI}.env.X"),
    Row("env-value-mapping", "server", env("X", {"a": 1}), "refused", f"{KIMI}.env.X"),
    Row("env-value-nan", "server", env("X", NAN), "refused", "finite"),
    Row("env-value-integer", "server", env("NCCL_NTHREADS", 512), "handled", 'NCCL_NTHREADS="512"'),
    Row("env-value-unicode", "server", env("X", "ünï ✓"), "handled", 'X="ünï ✓"'),
    Row("env-value-surrogate", "server", env("X", "\udc80"), "refused", "UTF-8"),
    Row(
        "env-value-null-removes",
        "server",
        {"defaults": {"env": {"NCCL_PROTO": "LL"}}, "server": {"env": {"NCCL_PROTO": None}}},
        "handled",
        "CUDA_VISIBLE_DEVICES=",
        "NCCL_PROTO",
    ),
    Row(
        "env-value-override-newline",
        "server",
        {"overrides": {"kimi": {"env": {"X": "a\nb"}}}},
        "refused",
        "sglang_server_overrides.kimi.env.X",
    ),
    Row(
        "env-value-defaults-newline",
        "server",
        {"defaults": {"env": {"X": "a\nb"}}},
        "refused",
        "sglang_server_defaults.env.X",
    ),
    Row("env-not-a-mapping", "server", srv(env="A=1"), "refused", "mapping"),
    # --- flag keys
    Row("flag-key-newline", "server", flag("tp_size\n", 8), "refused", f"{KIMI}.flags"),
    Row("flag-key-uppercase", "server", flag("TP_SIZE", 8), "refused", f"{KIMI}.flags.TP_SIZE"),
    Row("flag-key-dashes", "server", flag("--tp-size", 8), "refused", "SGLang flag name"),
    Row("flag-key-space", "server", flag("tp size", 8), "refused", f"{KIMI}.flags.tp size"),
    Row("flag-key-semicolon", "server", flag("x;rm", 1), "refused", f"{KIMI}.flags"),
    Row("flag-key-unicode", "server", flag("tp_sïze", 8), "refused", f"{KIMI}.flags"),
    Row("flag-key-empty", "server", flag("", 1), "refused", f"{KIMI}.flags"),
    Row("flag-key-integer", "server", flag(8, 1), "refused", f"{KIMI}.flags.8"),
    Row(
        "flag-key-dashed",
        "server",
        flag("mem-fraction-static", 0.8),
        "handled",
        "--mem-fraction-static 0.8",
    ),
    Row(
        "flag-key-twins",
        "server",
        srv(flags={"mem_fraction_static": 0.8, "mem-fraction-static": 0.7}),
        "refused",
        "same flag",
    ),
    Row("flag-key-managed-port", "server", flag("port", 9000), "refused", "use port"),
    Row("flag-key-api-key", "server", flag("api_key", "sk-1"), "refused", "secret"),
    Row("flag-key-config", "server", flag("config", "/x.yaml"), "refused", f"{KIMI}.flags.config"),
    # --- flag values
    Row("flag-value-nul", "server", flag("chat_template", "a\0b"), "refused", "NUL"),
    Row(
        "flag-value-nul-in-list",
        "server",
        flag("cuda_graph_bs", ["1\0"]),
        "refused",
        "cuda_graph_bs",
    ),
    Row("flag-value-newline", "server", flag("chat_template", "a\nb"), "handled", '"a\\nb"'),
    Row(
        "flag-value-shell-and-specifiers",
        "server",
        flag("chat_template", "a; rm -rf / $HOME %h"),
        "handled",
        '"a; rm -rf / $$HOME %%h"',
    ),
    Row(
        "flag-value-looks-like-a-flag",
        "server",
        flag("chat_template", "--port"),
        "handled",
        "--chat-template --port",
    ),
    Row("flag-value-unicode", "server", flag("chat_template", "模板"), "handled", '"模板"'),
    Row("flag-value-surrogate", "server", flag("chat_template", "\udc80"), "refused", "UTF-8"),
    Row(
        "flag-value-empty-string",
        "server",
        flag("chat_template", ""),
        "handled",
        '--chat-template ""',
    ),
    Row("flag-value-int-1e30", "server", flag("random_seed", 10**30), "refused", "out of range"),
    Row(
        "flag-value-int-5000-digits",
        "server",
        flag("random_seed", 10**5000),
        "refused",
        "random_seed",
    ),
    Row(
        "flag-value-int-64-bit", "server", flag("random_seed", 2**63 - 1), "handled", str(2**63 - 1)
    ),
    Row("flag-value-nan", "server", flag("mem_fraction_static", NAN), "refused", "finite"),
    Row("flag-value-inf", "server", flag("max_total_tokens", INF), "refused", "finite"),
    Row("flag-value-true", "server", flag("enable_metrics", True), "handled", "--enable-metrics"),
    Row(
        "flag-value-false",
        "server",
        flag("enable_metrics", False),
        "handled",
        "--port",
        "--enable-metrics",
    ),
    Row("flag-value-nested-list", "server", flag("cuda_graph_bs", [[1, 2]]), "refused", "nested"),
    Row(
        "flag-value-list-with-null", "server", flag("cuda_graph_bs", [1, None]), "refused", "nested"
    ),
    Row(
        "flag-value-list",
        "server",
        flag("cuda_graph_bs", [1, 2, 4]),
        "handled",
        "--cuda-graph-bs 1 2 4",
    ),
    Row(
        "flag-value-empty-list",
        "server",
        flag("cuda_graph_bs", []),
        "handled",
        "--port",
        "--cuda-graph-bs",
    ),
    Row(
        "flag-value-mapping",
        "server",
        flag("json_model_override_args", {"rope_scaling": {"factor": 2}}),
        "handled",
        'rope_scaling\\":{\\"factor\\":2}',
    ),
    Row(
        "flag-value-mapping-int-key",
        "server",
        flag("json_model_override_args", {1: "a"}),
        "refused",
        "JSON keys",
    ),
    Row(
        "flag-value-mapping-nan",
        "server",
        flag("json_model_override_args", {"a": NAN}),
        "refused",
        "finite",
    ),
    Row(
        "flag-value-set",
        "server",
        flag("cuda_graph_bs", {1, 2}),
        "refused",
        "set is not a flag value",
    ),
    Row(
        "flag-value-bytes",
        "server",
        flag("chat_template", b"x"),
        "refused",
        "bytes is not a flag value",
    ),
    Row("flags-not-a-mapping", "server", srv(flags=["tp_size"]), "refused", f"{KIMI}.flags"),
    Row(
        "flag-mem-fraction-1.5",
        "server",
        flag("mem_fraction_static", 1.5),
        "refused",
        "strictly between 0 and 1",
    ),
    Row(
        "flag-mem-fraction-text",
        "server",
        flag("mem_fraction_static", "0.88"),
        "handled",
        "--mem-fraction-static 0.88",
    ),
    Row("flag-tp-size-zero", "server", flag("tp_size", 0), "refused", f"{KIMI}.flags.tp_size"),
    Row(
        "profile-flag-key-newline",
        "server",
        {"profiles": {"fast": {"tp_size\n": 8}}, "server": {"profile": "fast"}},
        "refused",
        "sglang_server_profiles.fast",
    ),
    Row(
        "defaults-flag-nul",
        "server",
        {"defaults": {"flags": {"chat_template": "\0"}}},
        "refused",
        "sglang_server_defaults.flags.chat_template",
    ),
    Row(
        "override-flag-nan",
        "server",
        {"overrides": {"kimi": {"flags": {"mem_fraction_static": NAN}}}},
        "refused",
        "sglang_server_overrides.kimi.flags.mem_fraction_static",
    ),
    # --- ports
    Row("port-zero", "server", srv(port=0), "refused", f"{KIMI}.port"),
    Row("port-negative", "server", srv(port=-1), "refused", "1..65535"),
    Row("port-65536", "server", srv(port=65536), "refused", "1..65535"),
    Row("port-huge", "server", srv(port=10**20), "refused", "1..65535"),
    Row("port-text", "server", srv(port="8000"), "handled", "--port 8000"),
    Row("port-arabic-indic-digits", "server", srv(port="٨٠٠٠"), "refused", f"{KIMI}.port"),
    Row("port-superscript", "server", srv(port="²"), "refused", f"{KIMI}.port"),
    Row("port-float", "server", srv(port=8000.0), "refused", f"{KIMI}.port"),
    Row("port-bool", "server", srv(port=True), "refused", f"{KIMI}.port"),
    Row("port-missing", "server", srv(port=None), "refused", f"{KIMI}.port"),
    Row("port-shared", "server", second(port=8000), "refused", "port 8000 is also used"),
    # --- GPUs
    Row("gpus-empty", "server", srv(gpus=[]), "refused", f"{KIMI}.gpus"),
    Row("gpus-twice", "server", srv(gpus=[0, 0]), "refused", "twice"),
    Row("gpus-negative", "server", srv(gpus=[-1]), "refused", f"{KIMI}.gpus"),
    Row("gpus-bool", "server", srv(gpus=[True]), "refused", f"{KIMI}.gpus"),
    Row("gpus-text", "server", srv(gpus="0,1"), "refused", "list"),
    Row("gpus-float", "server", srv(gpus=[0.0]), "refused", f"{KIMI}.gpus"),
    Row(
        "gpus-not-on-host",
        "server",
        srv(gpus=[0, 1, 2, 3, 4, 5, 6, 9]),
        "refused",
        "does not exist",
    ),
    Row("gpus-huge-index", "server", srv(gpus=[10**20]), "refused", "does not exist"),
    Row("gpus-tp-mismatch", "server", srv(gpus=[0, 1], flags={"tp_size": 8}), "refused", "tp_size"),
    Row("gpus-shared", "server", second(gpus=[0]), "refused", "GPU 0 is also used"),
    # --- profiles, overrides, defaults, shape
    Row("profile-unknown", "server", srv(profile="fast"), "refused", f"{KIMI}.profile"),
    Row("profile-list", "server", srv(profile=["fast"]), "refused", f"{KIMI}.profile"),
    Row(
        "profile-newline",
        "server",
        {"profiles": {"fast": {}}, "server": {"profile": "fast\n"}},
        "refused",
        "profile",
    ),
    Row(
        "profile-not-a-mapping",
        "server",
        {"profiles": {"fast": "x"}, "server": {"profile": "fast"}},
        "refused",
        "mapping",
    ),
    Row(
        "profile-known",
        "server",
        {"profiles": {"fast": {"kv_cache_dtype": "fp8_e4m3"}}, "server": {"profile": "fast"}},
        "handled",
        "--kv-cache-dtype fp8_e4m3",
    ),
    Row(
        "override-unknown-server",
        "server",
        {"overrides": {"kmi": {"flags": {}}}},
        "refused",
        "sglang_server_overrides.kmi",
    ),
    Row(
        "override-unknown-key",
        "server",
        {"overrides": {"kimi": {"flag": {}}}},
        "refused",
        "sglang_server_overrides.kimi.flag",
    ),
    Row("override-not-a-mapping", "server", {"overrides": {"kimi": "x"}}, "refused", "mapping"),
    Row(
        "defaults-unknown-key",
        "server",
        {"defaults": {"flagz": {}}},
        "refused",
        "sglang_server_defaults.flagz",
    ),
    Row("server-unknown-key", "server", srv(gpu=[0]), "refused", f"{KIMI}.gpu"),
    Row(
        "server-not-a-mapping",
        "server",
        {"servers": ["kimi"]},
        "refused",
        "sglang_server_instances[0]",
    ),
    Row("servers-not-a-list", "server", {"servers": "kimi"}, "refused", "must be a list"),
    # --- text fields that become argv words
    Row(
        "model-path-newline",
        "server",
        srv(model_path="/m\nExecStartPre=/bin/sh"),
        "refused",
        f"{KIMI}.model_path",
    ),
    Row("model-path-empty", "server", srv(model_path=""), "refused", f"{KIMI}.model_path"),
    Row(
        "model-path-space",
        "server",
        srv(model_path="/shared/my model"),
        "handled",
        '"/shared/my model"',
    ),
    Row("host-newline", "server", srv(host="0.0.0.0\n"), "refused", f"{KIMI}.host"),
    Row(
        "served-name-bell",
        "server",
        srv(served_model_name="kimi\x07"),
        "refused",
        f"{KIMI}.served_model_name",
    ),
    Row(
        "served-name-unicode", "server", srv(served_model_name="kimi-模型"), "handled", "kimi-模型"
    ),
    # --- API keys: checked at pre-flight, never quoted back, never in the description
    Row("api-key-empty", "server", srv(api_key=""), "refused", "leave api_key out"),
    Row("api-key-null", "server", srv(api_key=None), "refused", f"{KIMI}.api_key"),
    Row("api-key-spaces-only", "server", srv(api_key="   "), "refused", f"{KIMI}.api_key"),
    Row(
        "api-key-surrounding-space",
        "server",
        srv(api_key=" sk-abc123 "),
        "refused",
        "whitespace",
        "sk-abc123",
    ),
    Row(
        "api-key-trailing-newline",
        "server",
        srv(api_key="sk-abc123\n"),
        "refused",
        f"{KIMI}.api_key",
        "sk-abc123",
    ),
    Row(
        "api-key-leading-dash",
        "server",
        srv(api_key="-sk-abc123"),
        "refused",
        "leading '-'",
        "sk-abc123",
    ),
    Row("api-key-tab", "server", srv(api_key="sk\tabc123"), "refused", "control", "abc123"),
    Row("api-key-nul", "server", srv(api_key="sk\0abc123"), "refused", f"{KIMI}.api_key", "abc123"),
    Row(
        "api-key-escape",
        "server",
        srv(api_key="sk\x1babc123"),
        "refused",
        f"{KIMI}.api_key",
        "abc123",
    ),
    Row("api-key-non-ascii", "server", srv(api_key="sk-ключ123"), "refused", "ASCII", "ключ"),
    Row("api-key-too-long", "server", srv(api_key="k" * 4097), "refused", "4096", "kkkkkkkk"),
    Row("api-key-integer", "server", srv(api_key=12345678), "refused", "string", "12345678"),
    Row("api-key-list", "server", srv(api_key=["sk-abc123"]), "refused", "string", "sk-abc123"),
    Row(
        "api-key-good",
        "server",
        srv(api_key="sk-Abc_123.xyz~"),
        "handled",
        "api_key_set=True",
        "sk-Abc_123",
    ),
    Row(
        "api-key-inner-space",
        "server",
        srv(api_key="two words"),
        "handled",
        "api_key_set=True",
        "two words",
    ),
    Row(
        "api-key-4096-chars",
        "server",
        srv(api_key=LONG_KEY),
        "handled",
        "api_key_set=True",
        LONG_KEY,
    ),
    Row("api-key-left-out", "server", srv(), "handled", "api_key_set=False"),
]

PLAN_ROWS = [
    # --- host facts
    Row("gpu-memory-nan", "plan", {"host": {"gpu_memory_mib": NAN}}, "refused", "gpu_memory_mib"),
    Row("gpu-memory-inf", "plan", {"host": {"gpu_memory_mib": INF}}, "refused", "gpu_memory_mib"),
    Row(
        "gpu-memory-minus-inf",
        "plan",
        {"host": {"gpu_memory_mib": -INF}},
        "refused",
        "gpu_memory_mib",
    ),
    Row(
        "gpu-memory-negative", "plan", {"host": {"gpu_memory_mib": -1}}, "refused", "gpu_memory_mib"
    ),
    Row("gpu-memory-zero", "plan", {"host": {"gpu_memory_mib": 0}}, "refused", "gpu_memory_mib"),
    Row("gpu-memory-cuda-context", "plan", {"host": {"gpu_memory_mib": 768}}, "refused", "> 768"),
    Row(
        "gpu-memory-text-nan",
        "plan",
        {"host": {"gpu_memory_mib": "nan"}},
        "refused",
        "gpu_memory_mib",
    ),
    Row("gpu-memory-bool", "plan", {"host": {"gpu_memory_mib": True}}, "refused", "gpu_memory_mib"),
    Row(
        "gpu-memory-1e300", "plan", {"host": {"gpu_memory_mib": 1e300}}, "refused", "gpu_memory_mib"
    ),
    Row(
        "gpu-memory-missing",
        "plan",
        {"host": {"gpu_memory_mib": None}},
        "refused",
        "gpu_memory_mib: is required",
    ),
    Row(
        "gpu-memory-text", "plan", {"host": {"gpu_memory_mib": "97887"}}, "handled", '"errors": []'
    ),
    Row(
        "gpu-memory-small",
        "plan",
        {"host": {"gpu_memory_mib": 1024}},
        "handled",
        "not_enough_memory",
    ),
    Row("host-ram-nan", "plan", {"host": {"host_ram_gib": NAN}}, "refused", "host_ram_gib"),
    Row("host-ram-inf", "plan", {"host": {"host_ram_gib": INF}}, "refused", "host_ram_gib"),
    Row("host-ram-negative", "plan", {"host": {"host_ram_gib": -5}}, "refused", "host_ram_gib"),
    Row("host-ram-text", "plan", {"host": {"host_ram_gib": "lots"}}, "refused", "host_ram_gib"),
    Row(
        "host-ram-zero-with-hicache",
        "plan",
        {
            "host": {"host_ram_gib": 0},
            "args": {"enable_hierarchical_cache": True, "hicache_size": 1},
        },
        "handled",
        "hicache_host_ram",
    ),
    Row("gpu-count-negative", "plan", {"host": {"gpu_count": -1}}, "refused", "gpu_count"),
    Row("gpu-count-fraction", "plan", {"host": {"gpu_count": 8.5}}, "refused", "gpu_count"),
    Row("gpu-count-zero", "plan", {"host": {"gpu_count": 0}}, "handled", "not_enough_gpus"),
    Row(
        "host-unknown-fact", "plan", {"host": {"gpus": 8}}, "refused", "unknown host fact(s): gpus"
    ),
    Row(
        "host-not-a-mapping",
        "plan",
        {"host_raw": [97887]},
        "refused",
        "host facts must be a mapping",
    ),
    # --- planner arguments
    Row("tp-size-zero", "plan", {"args": {"tp_size": 0}}, "refused", "tp_size"),
    Row("tp-size-negative", "plan", {"args": {"tp_size": -8}}, "refused", "tp_size"),
    Row("tp-size-fraction", "plan", {"args": {"tp_size": 8.5}}, "refused", "tp_size"),
    Row("tp-size-bool", "plan", {"args": {"tp_size": True}}, "refused", "tp_size"),
    Row("tp-size-1e20", "plan", {"args": {"tp_size": 10**20}}, "refused", "tp_size"),
    Row("tp-size-word", "plan", {"args": {"tp_size": "eight"}}, "refused", "tp_size"),
    Row("tp-size-text", "plan", {"args": {"tp_size": "8"}}, "handled", '"errors": []'),
    Row("tp-size-integral-float", "plan", {"args": {"tp_size": 8.0}}, "handled", '"errors": []'),
    Row("tp-size-more-than-gpus", "plan", {"args": {"tp_size": 16}}, "handled", "not_enough_gpus"),
    Row("dp-size-zero", "plan", {"args": {"dp_size": 0}}, "refused", "dp_size"),
    Row("page-size-zero", "plan", {"args": {"page_size": 0}}, "refused", "page_size"),
    Row(
        "mem-fraction-nan",
        "plan",
        {"args": {"mem_fraction_static": NAN}},
        "refused",
        "mem_fraction_static",
    ),
    Row(
        "mem-fraction-zero",
        "plan",
        {"args": {"mem_fraction_static": 0}},
        "refused",
        "between 0 and 1",
    ),
    Row(
        "mem-fraction-one",
        "plan",
        {"args": {"mem_fraction_static": 1}},
        "refused",
        "between 0 and 1",
    ),
    Row(
        "mem-fraction-negative",
        "plan",
        {"args": {"mem_fraction_static": -0.1}},
        "refused",
        "mem_fraction_static",
    ),
    Row(
        "mem-fraction-0.88",
        "plan",
        {"args": {"mem_fraction_static": 0.88}},
        "handled",
        '"mem_fraction_static": 0.88',
    ),
    Row(
        "context-length-zero", "plan", {"args": {"context_length": 0}}, "refused", "context_length"
    ),
    Row(
        "context-length-negative",
        "plan",
        {"args": {"context_length": -1}},
        "refused",
        "context_length",
    ),
    Row(
        "context-length-short",
        "plan",
        {"args": {"context_length": 1024}},
        "handled",
        "exceeds_context_length",
    ),
    Row(
        "max-running-zero",
        "plan",
        {"args": {"max_running_requests": 0}},
        "refused",
        "max_running_requests",
    ),
    Row(
        "max-running-negative",
        "plan",
        {"args": {"max_running_requests": -3}},
        "refused",
        "max_running_requests",
    ),
    Row(
        "max-running-64",
        "plan",
        {"args": {"max_running_requests": 64}},
        "handled",
        '"max_concurrent_requests": 64',
    ),
    Row("tok-s-zero", "plan", {"args": {"per_request_tok_s": 0}}, "refused", "per_request_tok_s"),
    Row(
        "tok-s-negative",
        "plan",
        {"args": {"per_request_tok_s": -1}},
        "refused",
        "per_request_tok_s",
    ),
    Row("tok-s-nan", "plan", {"args": {"per_request_tok_s": NAN}}, "refused", "per_request_tok_s"),
    Row("tok-s-inf", "plan", {"args": {"per_request_tok_s": INF}}, "refused", "per_request_tok_s"),
    Row(
        "tok-s-30",
        "plan",
        {"args": {"per_request_tok_s": 30}},
        "handled",
        '"per_request_tok_s_source": "argument"',
    ),
    Row(
        "chunked-prefill-disabled",
        "plan",
        {"args": {"chunked_prefill_size": -1}},
        "handled",
        '"errors": []',
    ),
    Row(
        "chunked-prefill-minus-2",
        "plan",
        {"args": {"chunked_prefill_size": -2}},
        "refused",
        "chunked_prefill_size",
    ),
    Row("hicache-size-nan", "plan", {"args": {"hicache_size": NAN}}, "refused", "hicache_size"),
    Row("hicache-size-inf", "plan", {"args": {"hicache_size": INF}}, "refused", "hicache_size"),
    Row("hicache-size-negative", "plan", {"args": {"hicache_size": -1}}, "refused", "hicache_size"),
    Row("hicache-ratio-zero", "plan", {"args": {"hicache_ratio": 0}}, "refused", "hicache_ratio"),
    Row("avg-input-negative", "plan", {"args": {"avg_input_len": -1}}, "refused", "avg_input_len"),
    Row(
        "avg-lengths-zero",
        "plan",
        {"args": {"avg_input_len": 0, "avg_output_len": 0}},
        "refused",
        "positive",
    ),
    Row(
        "min-free-nan",
        "plan",
        {"args": {"min_free_after_graph_gib": NAN}},
        "refused",
        "min_free_after_graph_gib",
    ),
    Row(
        "kv-dtype-unknown", "plan", {"args": {"kv_cache_dtype": "fp8"}}, "refused", "kv-cache-dtype"
    ),
    Row(
        "kv-dtype-list",
        "plan",
        {"args": {"kv_cache_dtype": ["fp8_e4m3"]}},
        "refused",
        "kv_cache_dtype",
    ),
    Row(
        "hicache-flag-maybe",
        "plan",
        {"args": {"enable_hierarchical_cache": "maybe"}},
        "refused",
        "enable_hierarchical_cache",
    ),
    Row(
        "hicache-flag-yes",
        "plan",
        {"args": {"enable_hierarchical_cache": "yes"}},
        "handled",
        "hicache_no_decode_slots",
    ),
    Row(
        "calibration-log-number",
        "plan",
        {"args": {"calibration_log": 5}},
        "refused",
        "calibration_log",
    ),
    Row(
        "calibration-log-garbage",
        "plan",
        {"args": {"calibration_log": "\0\xff garbage"}},
        "handled",
        "calibration_incomplete",
    ),
    Row(
        "argument-unknown",
        "plan",
        {"args": {"tp": 2}},
        "refused",
        "unknown planner argument(s): tp",
    ),
    Row(
        "arguments-not-a-mapping", "plan", {"args_raw": ["tp_size"]}, "refused", "must be a mapping"
    ),
    Row("weights-zero", "plan", {"weights": 0}, "refused", "weight_bytes"),
    Row("weights-negative", "plan", {"weights": -1}, "refused", "weight_bytes"),
    Row("weights-bool", "plan", {"weights": True}, "refused", "weight_bytes"),
    Row("weights-float", "plan", {"weights": 1.5e10}, "refused", "weight_bytes"),
    Row("weights-petabyte", "plan", {"weights": 10**15}, "handled", "not_enough_memory"),
    # --- model config (as the filter gets it, parsed)
    Row(
        "config-zero-heads",
        "plan",
        {"config": {"num_attention_heads": 0}},
        "refused",
        "num_attention_heads",
    ),
    Row(
        "config-zero-layers",
        "plan",
        {"config": {"num_hidden_layers": 0}},
        "refused",
        "num_hidden_layers",
    ),
    Row(
        "config-missing-layers",
        "plan",
        {"config": {"num_hidden_layers": None}},
        "refused",
        "num_hidden_layers",
    ),
    Row(
        "config-layers-float",
        "plan",
        {"config": {"num_hidden_layers": 32.0}},
        "refused",
        "num_hidden_layers",
    ),
    Row(
        "config-layers-1e30",
        "plan",
        {"config": {"num_hidden_layers": 10**30}},
        "refused",
        "num_hidden_layers",
    ),
    Row(
        "config-kv-heads-text",
        "plan",
        {"config": {"num_key_value_heads": "8"}},
        "refused",
        "num_key_value_heads",
    ),
    Row("config-head-dim-negative", "plan", {"config": {"head_dim": -1}}, "refused", "head_dim"),
    Row(
        "config-hidden-zero-no-head-dim",
        "plan",
        {"config": {"hidden_size": 0, "head_dim": None}},
        "refused",
        "hidden_size",
    ),
    Row(
        "config-context-zero",
        "plan",
        {"config": {"max_position_embeddings": 0}},
        "handled",
        '"errors": []',
    ),
    Row(
        "config-context-text",
        "plan",
        {"config": {"max_position_embeddings": "x"}},
        "refused",
        "max_position_embeddings",
    ),
    Row(
        "config-architectures-text",
        "plan",
        {"config": {"architectures": "LlamaForCausalLM"}},
        "refused",
        "architectures",
    ),
    Row(
        "config-architectures-empty",
        "plan",
        {"config": {"architectures": []}},
        "refused",
        "architectures",
    ),
    Row(
        "config-architectures-number",
        "plan",
        {"config": {"architectures": [5]}},
        "refused",
        "architectures",
    ),
    Row(
        "config-mla-without-rank",
        "plan",
        {"config": {"architectures": ["DeepseekV3ForCausalLM"]}},
        "refused",
        "kv_lora_rank",
    ),
    Row(
        "config-text-config-zero-layers",
        "plan",
        {"config": {"text_config": {"num_hidden_layers": 0, "num_attention_heads": 8}}},
        "refused",
        "text_config.num_hidden_layers",
    ),
    Row(
        "config-vision-layers-text",
        "plan",
        {"config": {"vision_config": {"num_hidden_layers": "x"}}},
        "refused",
        "vision_config.num_hidden_layers",
    ),
    Row("config-a-list", "plan", {"config_raw": []}, "refused", "JSON object"),
]

MODEL_DIR_ROWS = [
    Row(
        "dir-config-not-utf8",
        "model_dir",
        {"config": b'{"architectures": ["\xff\xfe"]}'},
        "refused",
        "UTF-8",
    ),
    Row("dir-config-not-json", "model_dir", {"config": b"not json"}, "refused", "not valid JSON"),
    Row("dir-config-empty-file", "model_dir", {"config": b""}, "refused", "not valid JSON"),
    Row("dir-config-a-list", "model_dir", {"config": b"[]"}, "refused", "JSON object"),
    Row(
        "dir-config-deep-nesting", "model_dir", {"config": b"[" * 100_000}, "refused", "config.json"
    ),
    Row(
        "dir-config-5000-digit-number",
        "model_dir",
        {"config": b'{"num_hidden_layers": 1' + b"0" * 5000 + b"}"},
        "refused",
        "config.json",
    ),
    Row(
        "dir-config-nan-literal",
        "model_dir",
        {"config": {"num_hidden_layers": NAN}},
        "refused",
        "num_hidden_layers",
    ),
    Row(
        "dir-config-missing-keys",
        "model_dir",
        {"config": b'{"architectures": ["LlamaForCausalLM"]}'},
        "refused",
        "num_hidden_layers",
    ),
    Row("dir-config-absent", "model_dir", {"config": None}, "refused", "cannot read"),
    Row("dir-config-a-directory", "model_dir", {"config": "dir"}, "refused", "cannot read"),
    Row("dir-index-not-json", "model_dir", {"index": b"{"}, "refused", "not valid JSON"),
    Row(
        "dir-index-size-bool",
        "model_dir",
        {"index": {"metadata": {"total_size": True}}},
        "refused",
        "total_size",
    ),
    Row(
        "dir-index-metadata-list", "model_dir", {"index": {"metadata": []}}, "refused", "total_size"
    ),
    Row("dir-no-weights", "model_dir", {"index": None}, "refused", "neither"),
    Row(
        "dir-empty-safetensors",
        "model_dir",
        {"index": None, "safetensors": b""},
        "refused",
        "empty",
    ),
    Row(
        "dir-single-safetensors",
        "model_dir",
        {"index": None, "safetensors": b"x" * 4096},
        "handled",
        "LlamaForCausalLM",
    ),
    Row("dir-llama", "model_dir", {}, "handled", "LlamaForCausalLM"),
]

GPU = ["--gpu-memory-mib", "97887"]
LLAMA = ["--model-path", "@llama"]
PLAN_CLI_ROWS = [
    Row("cli-good", "plan_cli", [*LLAMA, *GPU], "handled", "LlamaForCausalLM"),
    Row(
        "cli-plan-error-exit-1",
        "plan_cli",
        [*LLAMA, *GPU, "--gpu-count", "0"],
        "handled",
        "ERROR not_enough_gpus",
    ),
    Row(
        "cli-gpu-memory-nan",
        "plan_cli",
        [*LLAMA, "--gpu-memory-mib", "nan"],
        "refused",
        "argument --gpu-memory-mib",
    ),
    Row(
        "cli-gpu-memory-inf",
        "plan_cli",
        [*LLAMA, "--gpu-memory-mib", "inf"],
        "refused",
        "argument --gpu-memory-mib",
    ),
    Row(
        "cli-gpu-memory-1e400",
        "plan_cli",
        [*LLAMA, "--gpu-memory-mib", "1e400"],
        "refused",
        "argument --gpu-memory-mib",
    ),
    Row(
        "cli-gpu-memory-negative",
        "plan_cli",
        [*LLAMA, "--gpu-memory-mib=-5"],
        "refused",
        "argument --gpu-memory-mib",
    ),
    Row(
        "cli-gpu-memory-missing",
        "plan_cli",
        LLAMA,
        "refused",
        "argument --gpu-memory-mib: is required",
    ),
    Row(
        "cli-host-ram-nan",
        "plan_cli",
        [*LLAMA, *GPU, "--host-ram-gib", "nan"],
        "refused",
        "argument --host-ram-gib",
    ),
    Row(
        "cli-context-length-zero",
        "plan_cli",
        [*LLAMA, *GPU, "--context-length", "0"],
        "refused",
        "argument --context-length",
    ),
    Row(
        "cli-max-running-zero",
        "plan_cli",
        [*LLAMA, *GPU, "--max-running-requests", "0"],
        "refused",
        "argument --max-running-requests",
    ),
    Row(
        "cli-tok-s-zero",
        "plan_cli",
        [*LLAMA, *GPU, "--per-request-tok-s", "0"],
        "refused",
        "argument --per-request-tok-s",
    ),
    Row(
        "cli-tp-size-zero",
        "plan_cli",
        [*LLAMA, *GPU, "--tp-size", "0"],
        "refused",
        "argument --tp-size",
    ),
    Row(
        "cli-tp-size-word",
        "plan_cli",
        [*LLAMA, *GPU, "--tp-size", "x"],
        "refused",
        "argument --tp-size: must be an integer, got 'x'",
    ),
    Row(
        "cli-kv-dtype-unknown",
        "plan_cli",
        [*LLAMA, *GPU, "--kv-cache-dtype", "fp8"],
        "refused",
        "argument --kv-cache-dtype",
    ),
    Row(
        "cli-unknown-option",
        "plan_cli",
        [*LLAMA, *GPU, "--tp", "8"],
        "refused",
        "unrecognized arguments",
    ),
    Row("cli-model-path-missing", "plan_cli", GPU, "refused", "--model-path"),
    Row(
        "cli-model-path-not-a-dir",
        "plan_cli",
        ["--model-path", "@tmp/none", *GPU],
        "refused",
        "argument --model-path",
    ),
    Row(
        "cli-model-not-utf8",
        "plan_cli",
        ["--model-path", "@model:not-utf8", *GPU],
        "refused",
        "UTF-8",
    ),
    Row(
        "cli-model-zero-heads",
        "plan_cli",
        ["--model-path", "@model:zero-heads", *GPU],
        "refused",
        "num_attention_heads",
    ),
    Row(
        "cli-calibration-missing",
        "plan_cli",
        [*LLAMA, *GPU, "--calibrate-from", "@tmp/none.log"],
        "refused",
        "argument --calibrate-from",
    ),
    Row(
        "cli-calibration-a-directory",
        "plan_cli",
        [*LLAMA, *GPU, "--calibrate-from", "@llama"],
        "refused",
        "argument --calibrate-from",
    ),
    Row(
        "cli-calibration-not-utf8",
        "plan_cli",
        [*LLAMA, *GPU, "--calibrate-from", "@binary-log"],
        "handled",
        "calibration_incomplete",
    ),
]

SECRET = "sglang_server_instances[kimi].flags"
FLAGS_CHECK_ROWS = [
    Row(
        "check-good",
        "flags_check",
        ["--model-path", "/m", "--tp-size", "8"],
        "handled",
        '"problems": []',
    ),
    Row(
        "check-nul-in-value",
        "flags_check",
        ["--model-path", "/m\0x"],
        "refused",
        f"{SECRET}.model_path: a value of --model-path holds a NUL",
    ),
    Row(
        "check-nul-in-flag",
        "flags_check",
        ["--model-path", "/m", "--tp\0-size", "8"],
        "refused",
        f"{SECRET}: a flag name holds a NUL",
    ),
    Row(
        "check-nul-before-flags",
        "flags_check",
        ["\0", "--model-path", "/m"],
        "refused",
        "before any flag holds a NUL",
    ),
    Row(
        "check-lone-surrogate",
        "flags_check",
        ["--model-path", "\ud800"],
        "refused",
        "cannot be encoded",
    ),
    Row(
        "check-word-over-128k",
        "flags_check",
        ["--model-path", "x" * 200_000],
        "refused",
        f"{SECRET}.model_path",
    ),
    Row(
        "check-newline-value",
        "flags_check",
        ["--model-path", "/m\n/x"],
        "handled",
        '"problems": []',
    ),
    Row(
        "check-unicode-value",
        "flags_check",
        ["--model-path", "/模型/ü"],
        "handled",
        '"problems": []',
    ),
    Row(
        "check-value-looks-like-flag",
        "flags_check",
        ["--model-path", "/m", "--kv-cache-dtype", "--tp-size", "8"],
        "refused",
        f"{SECRET}.kv_cache_dtype",
    ),
    Row(
        "check-switch-given-true",
        "flags_check",
        ["--model-path", "/m", "--trust-remote-code", "true"],
        "refused",
        "switch",
    ),
    Row(
        "check-5000-digit-int",
        "flags_check",
        ["--model-path", "/m", "--tp-size", "9" * 5000],
        "refused",
        f"{SECRET}.tp_size",
    ),
    Row(
        "check-bad-choice",
        "flags_check",
        ["--model-path", "/m", "--kv-cache-dtype", "fp8"],
        "refused",
        "allowed: auto, fp8_e4m3",
    ),
    Row(
        "check-timeout-zero",
        "flags_check",
        {"argv": ["--model-path", "/m"], "timeout": 0},
        "refused",
        "timeout: must be at least 1",
    ),
    Row(
        "check-python-nul",
        "flags_check",
        {"argv": ["--model-path", "/m"], "python": "/usr/bin/python3\0"},
        "refused",
        "embedded null character",  # AnsibleModule refuses it before the module's code runs
    ),
    Row(
        "check-python-a-directory",
        "flags_check",
        {"argv": ["--model-path", "/m"], "python": "/"},
        "refused",
        "cannot run '/'",
    ),
    Row(
        "check-python-missing",
        "flags_check",
        {"argv": ["--model-path", "/m"], "python": "/nonexistent/python"},
        "refused",
        "exited 127",
    ),
]

# --------------------------------------------------------------------------- smoke client
SMOKE_PYTHON = os.environ.get("SMOKE_PYTHON", sys.executable)
SMOKE_KEY = "s3cret-k\u00e9y-\u4e2d"  # not Latin-1: no HTTP header can carry it
PASSWORD = "hunter2"

_SMOKE_TABLE: list[tuple[str, dict[str, Any], str, Any]] = [
    # ---- the API key ---------------------------------------------------------------------
    (
        "api-key-not-latin1-env",
        {"env": {"SGLANG_API_KEY": SMOKE_KEY}, "secret": SMOKE_KEY},
        "refused",
        "the API key from SGLANG_API_KEY has a character at position 12",
    ),
    (
        "api-key-not-latin1-flag",
        {"argv": ["--api-key", SMOKE_KEY], "secret": SMOKE_KEY},
        "refused",
        "the API key from --api-key has a character at position 12",
    ),
    (
        "api-key-header-injection",
        {"env": {"SGLANG_API_KEY": "k\r\nX-Evil: 1"}, "secret": "X-Evil"},
        "refused",
        "the API key from SGLANG_API_KEY has a character at position 2",
    ),
    (
        "api-key-trailing-space",
        {"env": {"SGLANG_API_KEY": "k3y "}, "secret": "k3y"},
        "refused",
        "begins or ends with white space",
    ),
    ("api-key-latin1", {"env": {"SGLANG_API_KEY": "cl\u00e9"}}, "handled", {"completed": 2}),
    # ---- the URL -------------------------------------------------------------------------
    (
        "url-not-ascii",
        {"argv": ["--url", "http://h\u00f6st\u4e2d:8000"]},
        "refused",
        "--url must be printable ASCII",
    ),
    (
        "url-control-char",
        {"argv": ["--url", "http://host\x1b[31m:8000"]},
        "refused",
        "--url must be printable ASCII",
    ),
    (
        "url-port-out-of-range",
        {"argv": ["--url", "http://127.0.0.1:99999"]},
        "refused",
        "--url 'http://127.0.0.1:99999' has a bad port (1..65535)",
    ),
    # The project's one URL rule (fleet_http.check_url) reads the smoke client's --url too.
    ("url-unclosed-ipv6", {"argv": ["--url", "http://[::1:8000"]}, "refused", "--url 'http://[::1"),
    (
        "url-other-scheme-with-password",
        {"argv": ["--url", f"ftp://u:{PASSWORD}@host/"], "secret": PASSWORD},
        "refused",
        "--url must look like http://HOST:PORT, got 'ftp://***@host/'",
    ),
    # ---- numbers -------------------------------------------------------------------------
    (
        "timeout-inf",
        {"argv": ["--timeout", "inf"]},
        "refused",
        "argument --timeout: must be a positive finite number",
    ),
    (
        "timeout-nan",
        {"argv": ["--timeout", "nan"]},
        "refused",
        "argument --timeout: must be a positive finite number",
    ),
    (
        "num-prompts-word",
        {"argv": ["--num-prompts", "all"]},
        "refused",
        "argument --num-prompts: must be a positive integer, got 'all'",
    ),
    (
        "output-len-absurd",
        {"argv": ["--random-output-len", "10000000000"]},
        "refused",
        "argument --random-output-len: must be at most",
    ),
    (
        "seed-not-whole",
        {"argv": ["--seed", "1.5"]},
        "refused",
        "argument --seed: must be a whole number, got '1.5'",
    ),
    (
        "duration-unbounded",
        {"argv": ["--duration", "5"]},
        "refused",
        "--duration needs --max-concurrency or a finite --request-rate",
    ),
    # ---- the result file -----------------------------------------------------------------
    ("json-in-missing-folder", {"json": "missing-folder/r.json"}, "refused", "does not exist"),
    ("json-is-a-folder", {"json": "."}, "refused", "is a directory"),
    # ---- what the server sends back (8 tokens asked for, 2 requests) ---------------------
    (
        "server-right",
        {"server": "exact"},
        "handled",
        {"completed": 2, "failed": 0, "total_output_tokens": 16, "failure_reasons": {}},
    ),
    (
        "server-1-of-8",
        {"server": "one"},
        "handled",
        {"completed": 0, "output_throughput": 0.0, "failure_reasons": {"short_output": 2}},
    ),
    (
        "server-0-of-8",
        {"server": "zero"},
        "handled",
        {"completed": 0, "failure_reasons": {"short_output": 2}},
    ),
    (
        "server-9-of-8",
        {"server": "nine"},
        "handled",
        {"completed": 0, "failure_reasons": {"long_output": 2}},
    ),
    (
        "server-no-meta",
        {"server": "no_meta"},
        "handled",
        {"completed": 0, "failure_reasons": {"no_final_record": 2}},
    ),
    (
        "server-only-done",
        {"server": "only_done"},
        "handled",
        {"completed": 0, "failure_reasons": {"no_final_record": 2}},
    ),
    # With --timeout 60: a client that waited for it would make this row take two minutes.
    (
        "server-close-after-non-json-event",
        {"server": "cut_json", "argv": ["--timeout", "60"]},
        "handled",
        {"completed": 0, "failure_reasons": {"no_final_record": 2}},
    ),
    (
        "server-html-instead-of-events",
        {"server": "html"},
        "handled",
        {"completed": 0, "failure_reasons": {"malformed_response": 2}},
    ),
    (
        "server-deeply-nested-json",
        {"server": "deep"},
        "handled",
        {"completed": 0, "failure_reasons": {"no_final_record": 2}},
    ),
    (
        "server-one-4mib-event",
        {"server": "huge"},
        "handled",
        {"completed": 2, "total_output_tokens": 16},
    ),
    (
        "server-500",
        {"server": "http_500"},
        "handled",
        {"completed": 0, "failure_reasons": {"http_500": 2}},
    ),
    # ---- the second wave: counts that go back, errors beside counts, framing -------------
    (
        "server-count-goes-back-1-to-20-then-8",
        {"server": "backwards"},
        "handled",
        {"completed": 0, "failure_reasons": {"malformed_response": 2}},
    ),
    (
        "server-error-beside-the-final-count",
        {"server": "error_and_count"},
        "handled",
        {"completed": 0, "failure_reasons": {"server_error": 2}},
    ),
    (
        "server-100-continue-first",
        {"server": "continue"},
        "handled",
        {"completed": 2, "total_output_tokens": 16, "failure_reasons": {}},
    ),
    (
        "server-bare-cr-line-endings",
        {"server": "bare_cr"},
        "handled",
        {"completed": 2, "total_output_tokens": 16, "failure_reasons": {}},
    ),
]

SMOKE_ROWS = [
    Row(
        row_id,
        "smoke",
        {"given": given, "expect": expect},
        outcome,
        expect if outcome == "refused" else "",
        given.get("secret", ""),
    )
    for row_id, given, outcome, expect in _SMOKE_TABLE
]

ROWS = SERVER_ROWS + PLAN_ROWS + MODEL_DIR_ROWS + PLAN_CLI_ROWS + FLAGS_CHECK_ROWS + SMOKE_ROWS


# --------------------------------------------------------------------------- runners
# Each returns (outcome, text): "refused" with the operator's message, or "handled" with the
# output. Anything else (a traceback) propagates and fails the row.
Outcome = tuple[str, str]
BASE_SERVER = {"name": "kimi", "model_path": "/shared/kimi", "port": 8000, "gpus": list(range(8))}
PYTHON = "/opt/ml-env/bin/python"


def _render(server: dict[str, Any]) -> str:
    """What the templates write: the unit's ExecStart= value and the EnvironmentFile lines."""
    argv = [PYTHON, "-m", "sglang.launch_server", *launch_line.to_argv(server["flags"])]
    lines = [server["unit"], f"api_key_set={server['api_key_set']}", launch_line.exec_start(argv)]
    lines += [launch_line.env_file_line(key, value) for key, value in server["environment"].items()]
    return "\n".join(lines)


def run_server(data: dict[str, Any], _tmp: Path) -> Outcome:
    servers = data.get("servers", [BASE_SERVER | data.get("server", {}), *data.get("more", [])])
    try:
        resolved = resolve_servers(
            servers, data.get("profiles", {}), data.get("overrides", {}), data.get("defaults", {})
        )
    except ServerConfigError as exc:
        return "refused", str(exc)
    problems = validate.host_errors(resolved, VALIDATE_HOST)
    for server in resolved:
        problems += validate.server_errors(server, VALIDATE_HOST)
    if problems:
        return "refused", "\n".join(problem["message"] for problem in problems)
    return "handled", "\n".join(map(_render, resolved)) + "\n" + json.dumps(resolved)


def _planned(config: Any, weights: Any, args: Any, host: Any) -> Outcome:
    try:
        result = plan(config, weights, args, host)
    except (PlanInputError, ModelConfigError) as exc:
        return "refused", str(exc)
    return "handled", json.dumps(result, allow_nan=False)  # NaN or infinity would raise here


def run_plan(data: dict[str, Any], _tmp: Path) -> Outcome:
    config = data.get("config_raw", {**LLAMA_CONFIG, **data.get("config", {})})
    if isinstance(config, dict):
        config = {key: value for key, value in config.items() if value is not None}
    host = data.get(
        "host_raw", {k: v for k, v in (HOST | data.get("host", {})).items() if v is not None}
    )
    return _planned(
        config, data.get("weights", LLAMA_WEIGHTS), data.get("args_raw", data.get("args", {})), host
    )


def _as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else json.dumps(value).encode()


def make_model_dir(path: Path, spec: dict[str, Any]) -> Path:
    """A copy of the llama fixture with config.json / index / a safetensors file replaced."""
    path.mkdir(parents=True)
    config = spec.get("config", (LLAMA_DIR / "config.json").read_bytes())
    if config == "dir":
        (path / "config.json").mkdir()
    elif config is not None:
        if isinstance(config, dict):
            config = {**LLAMA_CONFIG, **config}
        (path / "config.json").write_bytes(_as_bytes(config))
    index = spec.get("index", (LLAMA_DIR / "model.safetensors.index.json").read_bytes())
    if index is not None:
        (path / "model.safetensors.index.json").write_bytes(_as_bytes(index))
    if "safetensors" in spec:
        (path / "model.safetensors").write_bytes(spec["safetensors"])
    return path


def run_model_dir(data: dict[str, Any], tmp: Path) -> Outcome:
    try:
        config, weights = read_model_dir(make_model_dir(tmp / "model", data))
    except ModelConfigError as exc:
        return "refused", str(exc)
    return _planned(config, weights, {}, HOST)


CLI_MODELS = {
    "not-utf8": {"config": b'{"architectures": ["\xff"]}'},
    "zero-heads": {"config": {"num_attention_heads": 0}},
}


def _cli_word(word: str, tmp: Path) -> str:
    if word == "@llama":
        return str(LLAMA_DIR)
    if word.startswith("@tmp/"):
        return str(tmp / word[5:])
    if word.startswith("@model:"):
        return str(make_model_dir(tmp / word[7:], CLI_MODELS[word[7:]]))
    if word == "@binary-log":
        (tmp / "binary.log").write_bytes(b"\xff\xfe\x00 not a log \x80")
        return str(tmp / "binary.log")
    return word


def run_plan_cli(argv: list[str], tmp: Path, capsys: pytest.CaptureFixture[str]) -> Outcome:
    words = [_cli_word(word, tmp) for word in argv]
    capsys.readouterr()
    try:
        status = planner.main(words)
    except SystemExit as exc:  # argparse's own usage errors
        status = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert status in (0, 1, 2), status
    if status == 2:
        assert not out, out
        return "refused", err
    assert not err, err
    return "handled", out


FAKE_LAUNCH = """
import argparse
parser = argparse.ArgumentParser(prog="serve")
parser.add_argument("--model-path", required=True)
parser.add_argument("--tp-size", type=int, default=1)
parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto")
parser.add_argument("--trust-remote-code", action="store_true")
parser.parse_args()
"""


def run_flags_check(data: list[str] | dict[str, Any], tmp: Path) -> Outcome:
    """The module file run as Ansible runs it (an arguments file), against a tiny parser."""
    params = data if isinstance(data, dict) else {"argv": data}
    (tmp / "fakelaunch.py").write_text(FAKE_LAUNCH)
    args = {
        "python": sys.executable,
        "launch_module": "fakelaunch",
        "variable_prefix": SECRET,
        "timeout": 60,
        "_ansible_check_mode": True,
    } | params
    (tmp / "args.json").write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "plugins" / "modules" / "sglang_flags_check.py"),
            str(tmp / "args.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(tmp)},
    )
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert bool(result.get("failed")) == (proc.returncode != 0)
    if result.get("failed"):
        return "refused", result["msg"]
    return "handled", json.dumps(result)


# The smoke rows' loopback server: one response per connection, framed by closing it.
def _event(tokens: int) -> bytes:
    meta = {"prompt_tokens": 3, "completion_tokens": tokens, "finish_reason": None}
    return b"data: " + json.dumps({"text": "w " * tokens, "meta_info": meta}).encode() + b"\n\n"


def _events(tokens: int) -> bytes:
    return b"".join(_event(n) for n in range(1, tokens + 1)) + b"data: [DONE]\n\n"


_SSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
BODIES = {
    "exact": _SSE + _events(8),
    "one": _SSE + _events(1),
    "zero": _SSE + _event(0) + b"data: [DONE]\n\n",
    "nine": _SSE + _events(9),
    "no_meta": _SSE + b'data: {"text": "w"}\n\ndata: [DONE]\n\n',
    "only_done": _SSE + b"data: [DONE]\n\n",
    "cut_json": _SSE + _events(7)[:-14] + b'data: {"meta_info": {"completion_tokens": 8, "pro\n\n',
    "html": _SSE + b"data: <html>502 Bad Gateway</html>\n\n",
    "huge": _SSE + _event(8).replace(b'"w ', b'"' + b"w " * (2 << 20), 1) + b"data: [DONE]\n\n",
    "deep": _SSE
    + b'data: {"x": '
    + b"[" * 100_000
    + b"]" * 100_000
    + b', "meta_info": {"completion_tokens": 8}}\n\ndata: [DONE]\n\n',
    "http_500": b"HTTP/1.1 500 Internal Server Error\r\nConnection: close\r\n\r\nboom",
    "backwards": _SSE + _events(20)[: -len(b"data: [DONE]\n\n")] + _event(8) + b"data: [DONE]\n\n",
    "error_and_count": _SSE
    + _events(7)[: -len(b"data: [DONE]\n\n")]
    + _event(8).replace(b'{"text"', b'{"error": {"message": "boom"}, "text"', 1)
    + b"data: [DONE]\n\n",
    "continue": b"HTTP/1.1 100 Continue\r\n\r\n" + _SSE + _events(8),
    "bare_cr": _SSE + _events(8).replace(b"\n", b"\r"),
}
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = self.request.recv(65536)
            if not data:
                return
            head += data
        self.server.requests.append(head.split(b"\r\n", 1)[0])  # type: ignore[attr-defined]
        path = head.split(b" ", 2)[1]
        body = BODIES[self.server.behaviour] if path == b"/generate" else NOT_FOUND  # type: ignore[attr-defined]
        self.request.sendall(body)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, behaviour: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.behaviour = behaviour
        self.requests: list[bytes] = []


def run_smoke(data: dict[str, Any], tmp_path: Path) -> Outcome:
    """The smoke client on one row: its own process, against the loopback server above."""
    given, expect = data["given"], data["expect"]
    server = _Server(given.get("server", "exact"))
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    out = tmp_path / given.get("json", "result.json")
    argv = [
        *("--url", f"http://127.0.0.1:{server.server_address[1]}"),
        *("--num-prompts", "2", "--random-output-len", "8", "--warmup-requests", "0"),
        *("--json", str(out), "--timeout", "20"),
        # This loopback server has no model (no /model_info): the vocabulary is given.
        *("--vocab-size", "32000"),
        *given.get("argv", []),
    ]
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_API_KEY"}
    env.update(given.get("env", {}))
    try:
        proc = subprocess.run(
            [SMOKE_PYTHON, "-m", "sglang_fleet.smoke.smoke_client", *argv],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        server.shutdown()
        server.server_close()
    shown = proc.stdout + proc.stderr
    assert "Traceback" not in shown, shown
    if proc.returncode == 2:
        assert "error: " in proc.stderr, proc.stderr
        assert server.requests == [], "a refused input must stop before any request"
        return "refused", proc.stderr
    assert proc.returncode == 0, shown
    result = json.loads(out.read_text())
    assert {key: result[key] for key in expect} == expect, result["errors"]
    return "handled", json.dumps(result)


# =========================================================================== the second wave
# The surfaces added since the first table: live sampling, the router module, the fleet lock,
# the autotune state and inputs, the calibration store, multi-node layouts, the diagnosis of
# non-finite numbers (issue 19). Outcomes as above: "refused" is the clear error an operator
# (or a hostile peer) gets, never a traceback, and `absent` (a key, a password) is in neither
# the message nor the output; "handled" is the path working on the input.
LIVE_KEY = "live-k3y-never-elsewhere"
METRICS_OK = "\n".join(
    [
        'sglang:num_running_reqs{tp_rank="0"} 3',
        'sglang:num_queue_reqs{tp_rank="0"} 0',
        'sglang:token_usage{tp_rank="0"} 0.1',
        'sglang:gen_throughput{tp_rank="0"} 100',
        'sglang:max_total_num_tokens{tp_rank="0"} 100000',
        "sglang:generation_tokens_total 100",
    ]
)
METRICS_INF = "\n".join(
    [
        'sglang:num_running_reqs{tp_rank="0"} 3',
        'sglang:num_queue_reqs{tp_rank="0"} 0',
        'sglang:token_usage{tp_rank="0"} NaN',
        'sglang:gen_throughput{tp_rank="0"} +Inf',
        'sglang:max_total_num_tokens{tp_rank="0"} +Inf',
        "sglang:generation_tokens_total +Inf",
    ]
)


def _reply(handler: Any, status: int, body: bytes, **headers: str) -> None:
    handler.send_response(status)
    for name, value in {"Content-Length": str(len(body)), **headers}.items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)


def _trickle(handler: Any) -> None:
    """Headers at once, then one byte every 0.2 s for at most a minute."""
    handler.send_response(200)
    handler.send_header("Content-Length", "100000")
    handler.end_headers()
    deadline = time.monotonic() + 60
    with contextlib.suppress(OSError):
        while time.monotonic() < deadline:
            handler.wfile.write(b"#")
            handler.wfile.flush()
            time.sleep(0.2)


def _endless(handler: Any) -> None:
    """A chunked body that never ends (bounded here at 64 MiB)."""
    handler.send_response(200)
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    chunk = b"# " + b"x" * (1 << 20) + b"\n"
    with contextlib.suppress(OSError):
        for _ in range(64):
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))


def _page(body: str) -> Callable[[Any], None]:
    return lambda handler: _reply(handler, 200, body.encode())


def _redirect(to: str) -> Callable[[Any], None]:
    return lambda handler: _reply(handler, 302, b"", Location=to)


INFO = json.dumps({"version": "0.5.23", "served_model_name": "kimi", "api_key": LIVE_KEY})
WORKERS = json.dumps({"workers": [{"id": "w1", "url": "http://10.0.0.1:8000", "is_healthy": True}]})
# {behaviour: {path: page}}; "/elsewhere" is where redirects point: never to be asked for.
PEER_PAGES: dict[str, dict[str, Callable[[Any], None]]] = {
    "ok": {"/metrics": _page(METRICS_OK), "/server_info": _page(INFO)},
    "inf": {"/metrics": _page(METRICS_INF), "/server_info": _page(INFO)},
    "redirect_metrics": {"/metrics": _redirect("/elsewhere"), "/server_info": _page(INFO)},
    "redirect_info": {"/metrics": _page(METRICS_OK), "/server_info": _redirect("/elsewhere")},
    "redirect_off_host": {
        "/metrics": _page(METRICS_OK),
        "/server_info": _redirect("http://u:hunter2@192.0.2.1/elsewhere"),
    },
    "trickle": {"/metrics": _trickle, "/workers": _trickle},
    "endless": {"/metrics": _endless},
    "queued_minus_one": {
        "/metrics": _page(
            'sglang:num_running_reqs{tp_rank="0"} 1\nsglang:num_queue_reqs 1\n'
            'sglang:num_queue_reqs{tp_rank="1"} -2\n'
        )
    },
    "router_redirect": {"/workers": _redirect("/elsewhere")},
    "router_ok": {"/workers": _page(WORKERS)},
}


class _PeerHandler(BaseHTTPRequestHandler):
    def log_message(self, *_args: object) -> None:
        pass

    def do_GET(self) -> None:
        peer = self.server
        peer.seen.append((self.path, self.headers.get("Authorization")))  # type: ignore[attr-defined]
        page = PEER_PAGES[peer.behaviour].get(self.path)  # type: ignore[attr-defined]
        if page is None:
            _reply(self, 404, b"")
        else:
            page(self)


@contextlib.contextmanager
def peer(behaviour: str) -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    """A loopback HTTP peer: (its base URL, the (path, Authorization) of every request)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PeerHandler)
    server.daemon_threads = True
    server.behaviour, server.seen = behaviour, []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.seen  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()


def _no_key_elsewhere(seen: list[tuple[str, str | None]]) -> None:
    assert all(path != "/elsewhere" for path, _ in seen), seen


def run_live(data: dict[str, Any], tmp: Path) -> Outcome:
    """sglang_fleet.diagnosis.live_metrics in its own process (as the diagnose role runs it)
    against a peer."""
    with peer(data.get("peer", "ok")) as (url, seen):
        given_url = data.get("url", "{peer}").replace("{peer}", url)
        argv = ["--url", given_url, *data.get("argv", ["--window", "0.3", "--interval", "0.1"])]
        proc = subprocess.run(
            [sys.executable, "-m", "sglang_fleet.diagnosis.live_metrics", *argv],
            env={**os.environ, "SGLANG_API_KEY": LIVE_KEY},
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
    shown = proc.stdout + proc.stderr
    assert "Traceback" not in shown, shown
    _no_key_elsewhere(seen)
    assert LIVE_KEY not in shown, shown
    if proc.returncode == 2:
        assert seen == [], "a refused input must stop before any request"
        return "refused", proc.stderr
    if proc.returncode == 1:  # the peer's answer refused cleanly: a coded error, no sample
        assert json.loads(proc.stdout)["error"]["code"], proc.stdout
        return "refused", shown
    assert proc.returncode == 0, shown
    json.loads(proc.stdout, parse_constant=lambda name: pytest.fail(f"{name} in the sample"))
    return "handled", proc.stdout


ROUTER = load_plugin("plugins/modules/sglang_router_workers.py")
ROUTER_KEY = "router-k3y-never-elsewhere"


def run_router(data: dict[str, Any], _tmp: Path) -> Outcome:
    """The router module's run() (or its drain) as the module calls it, against a peer."""
    with peer(data.get("peer", "router_ok")) as (url, seen):
        fill = {key: str(value).replace("{peer}", url) for key, value in data.items()}
        client = ROUTER.RouterClient(fill.get("router", url), ROUTER_KEY, timeout=2.0)
        req = ROUTER.Request(
            state=data.get("state", "list"),
            worker_url=fill.get("worker", ""),
            drain_metrics_url=fill.get("drain"),
            drain_timeout=1.0,
            poll_interval=0.05,
            request_timeout=2.0,
        )
        try:
            if data.get("call") == "drain":
                result = ROUTER.drain(req, ROUTER.Clock())
            else:
                result = ROUTER.run(client, req)
        except ROUTER.RouterError as err:
            _no_key_elsewhere(seen)
            assert ROUTER_KEY not in str(err)
            return "refused", str(err)
    _no_key_elsewhere(seen)
    return "handled", json.dumps(result)


LOCK = load_plugin("plugins/modules/fleet_lock.py")
LOCK_ACTION = load_plugin("plugins/action/fleet_lock.py")
LOCK_OWNER = {
    "user": "alice",
    "uid": 1000,
    "controller": "ctl-1",
    "controller_boot_id": "cccccccc-0000-0000-0000-000000000001",
    "controller_pidns": "pid:[4026531836]",
    "pid": 4242,
    "pid_starttime": 5000,
    "cmdline_sha256": "0" * 64,
    "playbook": "deploy.yml",
}


def _lock_text(changes: dict[str, str]) -> bytes:
    """A lock record of another run, taken now on this host's clock, with text replaced."""
    record = LOCK.new_record(LOCK_OWNER, "run-a", 900, LOCK.read_host_clock())
    text = json.dumps(record, sort_keys=True)
    for old, new in changes.items():
        assert old in text, old
        text = text.replace(old, new)
    return text.encode()


def run_lock(data: dict[str, Any], tmp: Path) -> Outcome:
    """The fleet_lock module's run() on a lock file the row writes (or the action plugin's
    check of lease_s); a row with fail_replace makes the takeover's rename fail."""
    if "lease_s" in data:
        try:
            return "handled", str(LOCK_ACTION._lease(data["lease_s"]))
        except AnsibleActionFail as exc:
            return "refused", str(exc)
    path = tmp / "rollout.lock"
    raw = data["file"](data) if callable(data["file"]) else data["file"]
    path.write_bytes(raw)
    params = {
        "path": str(path),
        "state": "acquired",
        "owner": LOCK_OWNER,
        "run_id": "run-b",
        "token": "",
        "lease_s": 900,
        "replace_sha256": hashlib.sha256(raw).hexdigest() if data.get("take_over") else None,
    }
    try:
        if data.get("fail_replace"):
            with mock.patch.object(LOCK.os, "replace", side_effect=OSError(5, "I/O error")):
                outcome = LOCK.run(params, False)
        else:
            outcome = LOCK.run(params, False)
    except (LOCK.LockError, OSError) as exc:
        outcome = {"failed": True, "msg": f"fleet_lock {path}: {exc}"}
    assert not [p.name for p in tmp.iterdir() if p.name.endswith(".tmp")], "a temp file is left"
    text = json.dumps(outcome, allow_nan=False)
    return ("refused" if outcome.get("failed") else "handled"), text


KIMI_DIR = ROOT / "tests" / "fixtures" / "models" / "kimi-k2.5-int4"
KIMI_CONFIG, KIMI_WEIGHTS = read_model_dir(KIMI_DIR)
TUNE_HOST = {"gpu_memory_mib": 97887, "host_ram_gib": 400, "gpu_count": 8, "gpu_name": KIMI_GPU}
TUNE_SPEC = {
    "server": "kimi",
    "base_flags": KIMI_RUN_FLAGS,
    "space": {"mem_fraction_static": [0.85, 0.88], "max_running_requests": [64, 160]},
    "workload": {"input_len": 2000, "output_len": 2000, "concurrency": 150},
}


def _tune_context(**changes: Any) -> dict[str, Any]:
    key = {
        "model_config": KIMI_CONFIG,
        "weight_bytes": KIMI_WEIGHTS,
        "gpu_name": KIMI_GPU,
        "gpu_memory_mib": 97887,
        "sglang_version": "0.5.23",
        "flags": KIMI_RUN_FLAGS,
    }
    record = calibration_record.build_record(KIMI_LOG, None, key)
    context = {
        "model_config": KIMI_CONFIG,
        "weight_bytes": KIMI_WEIGHTS,
        "host": TUNE_HOST,
        "sglang_version": "0.5.23",
        "calibration": [record],
    }
    return {key: value for key, value in (context | changes).items() if value is not None}


def _tune_step(step: tuple[str, Any], tmp: Path, capsys: pytest.CaptureFixture[str]) -> Outcome:
    command, given = step
    state = tmp / "state.json"
    if command == "edit":  # by hand: the given function changes the state file's JSON text
        state.write_text(given(state.read_text()))
        return "handled", ""
    argv = [command, "--state", str(state)]
    if command == "init":
        spec, context = given
        (tmp / "spec.json").write_text(json.dumps(TUNE_SPEC | spec))
        (tmp / "context.json").write_text(json.dumps(context))
        argv += ["--spec", str(tmp / "spec.json"), "--context", str(tmp / "context.json")]
    if command == "record":
        (tmp / "result.json").write_text(given)
        argv += ["--result", str(tmp / "result.json")]
    capsys.readouterr()
    status = autotune.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert status in (0, 2), status
    return ("refused", err) if status == 2 else ("handled", out)


def run_autotune(steps: list[tuple[str, Any]], tmp: Path, capsys: Any) -> Outcome:
    """`python -m sglang_fleet.tuning.autotune` commands in order; the last one's outcome counts and
    every earlier one must be handled."""
    for step in steps[:-1]:
        outcome, text = _tune_step(step, tmp, capsys)
        assert outcome == "handled", text
    return _tune_step(steps[-1], tmp, capsys)


STORE_FILE = "/var/lib/sglang-fleet/kimi/calibration.json"


def _kimi_store(**measured: Any) -> str:
    record = _tune_context()["calibration"][0]
    record["measured"] |= measured
    return json.dumps({"schema": calibration.STORE_SCHEMA, "records": [record]})


def run_calibration(data: dict[str, Any], _tmp: Path) -> Outcome:
    """The host's calibration.json as pre-flight reads it (sglang_fleet.rollout.preflight_inputs's
    calibration
    arguments), or as the record step of a healthy start updates it ("record": true)."""
    store = data["store"]() if callable(data["store"]) else data["store"]
    if data.get("record"):
        record = _tune_context()["calibration"][0]
        update = calibration_store.store_update(store, record, STORE_FILE, "kimi")
        return "handled", json.dumps(update, allow_nan=False)
    server = {"name": "kimi", "paths": {"calibration_file": STORE_FILE}, "flags": {}}
    try:
        given = {"store": store, "mode": "enforce"} | data.get("keys", {})
        args = preflight.calibration_args(given, server)
    except ValueError as exc:
        return "refused", str(exc)
    read = calibration_store.read_store(args["calibration"])
    return "handled", f"set aside: {read.problems()}; kept: " + json.dumps(
        read.records, allow_nan=False
    )


def _node_facts(address: str, interface: str = "eth0") -> dict[str, Any]:
    return {
        "interfaces": ["lo", interface],
        "lo": {"ipv4": {"address": "127.0.0.1"}},
        interface: {"ipv4": {"address": address}},
        "default_ipv4": {"interface": interface, "address": address},
    }


def _spanning(**changes: Any) -> dict[str, Any]:
    return {"name": "kimi", "model_path": "/shared/kimi", "port": 8000, "gpus": [0, 1, 2, 3],
            "nodes": ["gpu-a", "gpu-b"], "flags": {"tp_size": 8}} | changes  # fmt: skip


def run_nodes(data: dict[str, Any], _tmp: Path) -> Outcome:
    """Servers across gpu-a and gpu-b (10.0.0.1, 10.0.0.2 unless told), resolved on gpu-a."""
    servers = data.get("servers", [_spanning(**data.get("server", {}))])
    addresses = data.get("addresses", {"gpu-a": "10.0.0.1", "gpu-b": "10.0.0.2"})
    place = {
        "host": "gpu-a",
        "hosts": {h: nodes.host_facts(_node_facts(a), servers) for h, a in addresses.items()},
    }
    try:
        resolved = resolve_servers(servers, {}, {}, {}, cluster=place)
    except ServerConfigError as exc:
        return "refused", str(exc)
    return "handled", json.dumps(resolved)


def run_diagnose(data: dict[str, Any], _tmp: Path) -> Outcome:
    """The diagnosis of a smoke result (the smoke role runs it before the gate) or of a live
    sample, each as JSON text that may hold NaN and Infinity."""
    if "sample" in data:
        result = diagnose_live(data["sample"])
    else:
        result = diagnose(json.loads(data["smoke"]))
    return "handled", json.dumps(result, allow_nan=False)


def _future_lock() -> bytes:
    """A lock another run renewed in an earlier boot, its wall times an hour ahead of now."""
    ahead = round(time.time() + 3600, 3)
    record = json.loads(_lock_text({}))
    record["host_clock"].update(boot_id="an-earlier-boot", taken_wall=ahead, renewed_wall=ahead)
    return json.dumps(record).encode()


SECOND_WAVE_ROWS = [
    # ---- live sampling (diagnose --url): the key, redirects, deadlines, sizes, numbers ----
    Row(
        "live-metrics-redirect-not-followed",
        "live",
        {"peer": "redirect_metrics"},
        "refused",
        "redirects are not followed",
        LIVE_KEY,
    ),
    Row(
        "live-server-info-redirect-keeps-the-key",
        "live",
        {"peer": "redirect_info"},
        "refused",
        "redirects are not followed",
        LIVE_KEY,
    ),
    Row(
        "live-redirect-off-host-printed-without-password",
        "live",
        {"peer": "redirect_off_host"},
        "refused",
        "http://***@192.0.2.1/elsewhere",
        PASSWORD,
    ),
    Row(
        "live-url-with-password",
        "live",
        {"url": "http://u:hunter2@127.0.0.1:1"},
        "refused",
        "'http://***@127.0.0.1:1' carries user:password@",
        PASSWORD,
    ),
    Row(
        "live-metrics-trickle-bounded",
        "live",
        {"peer": "trickle"},
        "refused",
        "did not answer in full within 10 s",
    ),
    Row(
        "live-metrics-endless-chunked-capped",
        "live",
        {"peer": "endless"},
        "refused",
        "answered more than 16777216 bytes",
    ),
    Row("live-metrics-inf-and-nan", "live", {"peer": "inf"}, "handled", '"schedulers": 1'),
    Row(
        "live-interval-tiny",
        "live",
        {"argv": ["--window", "0.5", "--interval", "0.00002"]},
        "refused",
        "--interval 2e-05 is below 0.1 s",
    ),
    Row("live-url-port-zero", "live", {"url": "http://127.0.0.1:0"}, "refused", "bad port"),
    # ---- the resolver: a server's router URLs, checked before any host is touched -------
    Row(
        "resolver-router-url-port-zero",
        "server",
        srv(router={"url": "http://gw:0", "worker_url": "http://gpu-01:8000"}),
        "refused",
        f"{KIMI}.router.url: 'http://gw:0' has a bad port",
    ),
    Row(
        "resolver-router-url-port-99999",
        "server",
        srv(router={"url": "http://gw:99999", "worker_url": "http://gpu-01:8000"}),
        "refused",
        f"{KIMI}.router.url: 'http://gw:99999' has a bad port",
    ),
    Row(
        "resolver-router-url-host-dotdot",
        "server",
        srv(router={"url": "http://..:8080", "worker_url": "http://gpu-01:8000"}),
        "refused",
        "host '..' is not a host name or an IP address",
    ),
    Row(
        "resolver-worker-port-leading-zero",
        "server",
        srv(router={"url": "http://gw:8080", "worker_url": "http://gpu-01:08000"}),
        "refused",
        f"{KIMI}.router.worker_url: 'http://gpu-01:08000' has a bad port",
    ),
    Row(
        "resolver-server-routed-through-itself",
        "server",
        srv(router={"url": "http://gpu-01:8000", "worker_url": "http://gpu-01:8000"}),
        "refused",
        "a server cannot be routed through itself",
    ),
    Row(
        "resolver-router-url-with-password",
        "server",
        srv(router={"url": "http://admin:hunter2@gw:8080", "worker_url": "http://gpu-01:8000"}),
        "refused",
        "'http://***@gw:8080' must be the router's URL",
        PASSWORD,
    ),
    # ---- the router module: URLs, redirects, a slow router, the drain ---------------------
    Row(
        "router-url-port-zero",
        "router",
        {"router": "http://127.0.0.1:0"},
        "refused",
        "router_url 'http://127.0.0.1:0' has a bad port",
    ),
    Row(
        "router-url-port-99999",
        "router",
        {"router": "http://127.0.0.1:99999"},
        "refused",
        "router_url 'http://127.0.0.1:99999' has a bad port",
    ),
    Row(
        "router-url-host-dotdot",
        "router",
        {"router": "http://..:8080"},
        "refused",
        "host '..' is not a host name or an IP address",
    ),
    Row(
        "router-url-with-password",
        "router",
        {"router": "http://admin:hunter2@127.0.0.1:9"},
        "refused",
        "http://***@127.0.0.1:9",
        PASSWORD,
    ),
    Row(
        "router-worker-port-leading-zero",
        "router",
        {"state": "present", "worker": "http://10.0.0.1:08000"},
        "refused",
        "no leading zero",
    ),
    Row(
        "router-worker-is-the-router",
        "router",
        {
            "state": "present",
            "router": "http://127.0.0.1:30000",
            "worker": "http://127.0.0.1:30000",
        },
        "refused",
        "is the router itself",
    ),
    Row(
        "router-redirect-not-followed",
        "router",
        {"peer": "router_redirect"},
        "refused",
        "redirects are not followed",
        ROUTER_KEY,
    ),
    Row(
        "router-trickle-bounded",
        "router",
        {"peer": "trickle"},
        "refused",
        "did not answer in full within 2 s",
    ),
    Row("router-list", "router", {}, "handled", "http://10.0.0.1:8000"),
    Row(
        "drain-running-1-queued-minus-1",
        "router",
        {"call": "drain", "peer": "queued_minus_one", "drain": "{peer}/metrics"},
        "refused",
        "sglang:num_queue_reqs reads -2, not a count of requests",
    ),
    # ---- the fleet lock ------------------------------------------------------------------
    Row(
        "lock-file-lease-nan",
        "lock",
        {"file": lambda _: _lock_text({'"lease_s": 900': '"lease_s": NaN'})},
        "handled",
        "not a lock record (missing or bad: lease_s)",
    ),
    Row(
        "lock-file-lease-infinity",
        "lock",
        {"file": lambda _: _lock_text({'"lease_s": 900': '"lease_s": Infinity'})},
        "handled",
        "not a lock record (missing or bad: lease_s)",
    ),
    Row(
        "lock-file-boottime-nan",
        "lock",
        {"file": lambda _: _lock_text({'"renewed_boottime": ': '"renewed_boottime": NaN, "x": '})},
        "handled",
        "host_clock.renewed_boottime",
    ),
    Row(
        "lock-earlier-boot-renewal-in-the-future",
        "lock",
        {"file": lambda _: _future_lock()},
        "handled",
        "this boot's start",
    ),
    Row(
        "lock-failed-takeover-leaves-no-temp-file",
        "lock",
        {"file": lambda _: _lock_text({}), "take_over": True, "fail_replace": True},
        "refused",
        "I/O error",
    ),
    Row(
        "lock-lease-s-nan", "lock", {"lease_s": "nan"}, "refused", "lease_s must be a whole number"
    ),
    Row(
        "lock-lease-s-inf",
        "lock",
        {"lease_s": math.inf},
        "refused",
        "lease_s must be a whole number",
    ),
    # ---- the autotune state and inputs ---------------------------------------------------
    Row(
        "autotune-gpu-swap-is-a-new-search",
        "autotune",
        [
            ("init", ({}, _tune_context())),
            ("init", ({}, _tune_context(host=TUNE_HOST | {"gpu_name": "NVIDIA H200"}))),
        ],
        "handled",
        '"resumed": false',
    ),
    Row(
        "autotune-sglang-upgrade-is-a-new-search",
        "autotune",
        [("init", ({}, _tune_context())), ("init", ({}, _tune_context(sglang_version="0.5.24")))],
        "handled",
        '"resumed": false',
    ),
    Row(
        "autotune-other-checkpoint-is-a-new-search",
        "autotune",
        [
            ("init", ({}, _tune_context())),
            ("init", ({}, _tune_context(weight_bytes=KIMI_WEIGHTS + 1))),
        ],
        "handled",
        '"resumed": false',
    ),
    Row(
        "autotune-same-inputs-resume",
        "autotune",
        [("init", ({}, _tune_context())), ("init", ({}, _tune_context()))],
        "handled",
        '"resumed": true',
    ),
    Row(
        "autotune-state-edited-by-hand",
        "autotune",
        [
            ("init", ({}, _tune_context())),
            ("edit", lambda text: text.replace('"concurrency": 150', '"concurrency": 15')),
            ("next", None),
        ],
        "refused",
        "(server kimi): its inputs do not match its spec_digest",
    ),
    Row(
        "autotune-init-never-resumes-a-state-edited-by-hand",
        "autotune",
        [
            ("init", ({}, _tune_context())),
            ("edit", lambda text: text.replace('"concurrency": 150', '"concurrency": 15')),
            ("init", ({}, _tune_context())),
        ],
        "handled",
        '"resumed": false',
    ),
    Row(
        "autotune-state-junk",
        "autotune",
        [("init", ({}, _tune_context())), ("edit", lambda _: "[1, 2]"), ("next", None)],
        "refused",
        "not an autotune state (JSON list)",
    ),
    Row(
        "autotune-state-nan",
        "autotune",
        [
            ("init", ({}, _tune_context())),
            ("edit", lambda text: text.replace('"tolerance": 0.05', '"tolerance": NaN')),
            ("next", None),
        ],
        "refused",
        "NaN is not a number JSON allows",
    ),
    Row(
        "autotune-output-len-1e10",
        "autotune",
        [
            (
                "init",
                (
                    {"workload": {"input_len": 2000, "output_len": 10**10, "concurrency": 150}},
                    _tune_context(),
                ),
            )
        ],
        "refused",
        "autotune_workload.output_len",
    ),
    Row(
        "autotune-negative-margin",
        "autotune",
        [("init", ({"margin_gib": -5}, _tune_context()))],
        "refused",
        "margin_gib: -5 is not a number >= 0",
    ),
    Row(
        "autotune-host-without-gpu-memory",
        "autotune",
        [("init", ({}, _tune_context(host={"gpu_count": 8, "gpu_name": KIMI_GPU})))],
        "refused",
        "host.gpu_memory_mib: None is not a positive number",
    ),
    Row(
        "autotune-misspelt-num-prompts",
        "autotune",
        [
            (
                "init",
                (
                    {
                        "workload": {
                            "input_len": 2000,
                            "output_len": 2000,
                            "concurrency": 150,
                            "num_prompt": 600,
                        }
                    },
                    _tune_context(),
                ),
            )
        ],
        "refused",
        "autotune_workload: unknown key(s) num_prompt",
    ),
    Row(
        "autotune-record-nan-throughput",
        "autotune",
        [
            ("init", ({}, _tune_context())),
            ("next", None),
            ("record", '{"smoke": {"completed": 150, "failed": 0, "output_throughput": NaN}}'),
        ],
        "handled",
        "output_throughput is not a finite number",
    ),
    # ---- the calibration store -------------------------------------------------------------
    Row(
        "calibration-store-not-json",
        "calibration",
        {"store": '{"records": ['},
        "handled",
        "set aside: the whole file: not JSON",
    ),
    Row(
        "calibration-store-junk",
        "calibration",
        {"store": "[1, 2]"},
        "handled",
        "set aside: record 0: not a record (JSON int)",
    ),
    Row(
        "calibration-store-string",
        "calibration",
        {"store": '"calibration"'},
        "handled",
        "set aside: the whole file: a calibration store holds {schema, records: [...]}",
    ),
    Row(
        "calibration-store-list-of-strings",
        "calibration",
        {"store": '["a", "b"]'},
        "handled",
        "set aside: record 0: not a record (JSON str)",
    ),
    Row(
        "calibration-store-deep-nesting",
        "calibration",
        {"store": "[" * 100_000 + "]" * 100_000},
        "handled",
        "set aside: the whole file: not JSON",
    ),
    Row(
        "calibration-record-other-schema",
        "calibration",
        {"store": lambda: _kimi_store().replace('"schema": 1', '"schema": 2')},
        "handled",
        "): record schema 2, not 1",
    ),
    Row(
        "calibration-store-other-schema",
        "calibration",
        {"store": lambda: _kimi_store().replace("calibrations/1", "calibrations/9")},
        "handled",
        "set aside: the whole file: store schema 'sglang-fleet/calibrations/9'",
    ),
    Row(
        "calibration-free-after-graph-1e6-gib",
        "calibration",
        {"store": lambda: _kimi_store(free_after_graph_gib=1e6)},
        "handled",
        "): measured.free_after_graph_gib 1e+06 is outside",
    ),
    Row(
        "calibration-negative-pre-load",
        "calibration",
        {"store": lambda: _kimi_store(pre_gib=-3.0)},
        "handled",
        "): measured.pre_gib -3 is outside",
    ),
    Row(
        "calibration-1e30-tokens",
        "calibration",
        {"store": lambda: _kimi_store(max_total_num_tokens=1e30)},
        "handled",
        "): measured.max_total_num_tokens 1e+30 is outside",
    ),
    Row(
        "calibration-nan-figure",
        "calibration",
        {"store": lambda: _kimi_store().replace('"post_gib": ', '"post_gib": NaN, "x": ')},
        "handled",
        "set aside: the whole file: not JSON (NaN is not a number JSON allows)",
    ),
    Row(
        "calibration-infinity-figure",
        "calibration",
        {"store": lambda: _kimi_store().replace('"pre_gib": ', '"pre_gib": Infinity, "x": ')},
        "handled",
        "set aside: the whole file: not JSON (Infinity is not a number JSON allows)",
    ),
    Row(
        "calibration-misspelt-store-key",
        "calibration",
        {"store": "", "keys": {"stroe": "{}"}},
        "refused",
        "unknown calibration key(s) stroe; allowed: mode, sglang_version, store",
    ),
    Row(
        "calibration-store-right",
        "calibration",
        {"store": _kimi_store},
        "handled",
        '"max_total_num_tokens"',
    ),
    Row(
        "calibration-record-step-keeps-a-healthy-start",
        "calibration",
        {"store": '{"records": [', "record": True},
        "handled",
        f"{STORE_FILE} (calibrations of server kimi): the whole file: not JSON",
    ),
    # ---- multi-node layouts --------------------------------------------------------------
    Row(
        "nodes-two-servers-one-rendezvous",
        "nodes",
        {"servers": [_spanning(), _spanning(name="big2", port=8001)]},
        "refused",
        "meets its nodes on port 50000",
    ),
    Row(
        "nodes-rendezvous-on-another-servers-port",
        "nodes",
        {"servers": [_spanning(), _spanning(name="big2", port=8001, dist_init_port=8000)]},
        "refused",
        "server kimi on gpu-a (node 0) serves on port 8000",
    ),
    Row(
        "nodes-rendezvous-port-22",
        "nodes",
        {"server": {"dist_init_port": 22}},
        "refused",
        "22 is a system service's port",
    ),
    Row(
        "nodes-interface-lo",
        "nodes",
        {"server": {"interface": "lo"}},
        "refused",
        "gpu-a (node 0) has 127.0.0.1 there, which no other host can reach",
    ),
    Row(
        "nodes-two-names-one-address",
        "nodes",
        {"addresses": {"gpu-a": "10.0.0.1", "gpu-b": "10.0.0.1"}},
        "refused",
        "gpu-a and gpu-b both have 10.0.0.1",
    ),
    Row(
        "nodes-two-servers-own-rendezvous",
        "nodes",
        {"servers": [_spanning(), _spanning(name="big2", port=8001, dist_init_port=50001)]},
        "handled",
        "10.0.0.1:50001",
    ),
    # ---- the diagnosis of non-finite numbers ------------------------------------------------
    Row(
        "diagnose-smoke-result-infinity",
        "diagnose",
        {
            "smoke": '{"completed": 2, "failed": 0, "output_throughput": Infinity, '
            '"server_metrics": {"max_total_num_tokens": Infinity, "samples": '
            '[{"num_running_reqs": Infinity, "num_queue_reqs": 0, "token_usage": NaN}]}}'
        },
        "handled",
        "left out: smoke result.output_throughput",
    ),
    Row(
        "diagnose-live-sample-infinity",
        "diagnose",
        {
            "sample": {
                "url": "http://127.0.0.1:30000",
                "server_info": {},
                "server_metrics": {
                    "max_total_num_tokens": math.inf,
                    "window_s": 1,
                    "samples": [{"num_running_reqs": math.inf}],
                },
            }
        },
        "handled",
        "live sample.server_metrics.max_total_num_tokens",
    ),
]


ROWS += SECOND_WAVE_ROWS
RUNNERS: dict[str, Callable[..., Outcome]] = {
    "server": run_server,
    "plan": run_plan,
    "model_dir": run_model_dir,
    "flags_check": run_flags_check,
    "smoke": run_smoke,
    "live": run_live,
    "router": run_router,
    "lock": run_lock,
    "calibration": run_calibration,
    "nodes": run_nodes,
    "diagnose": run_diagnose,
}
WITH_CAPSYS = {"plan_cli": run_plan_cli, "autotune": run_autotune}


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_hostile_input(row: Row, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if row.target in WITH_CAPSYS:
        outcome, text = WITH_CAPSYS[row.target](row.input, tmp_path, capsys)
    else:
        outcome, text = RUNNERS[row.target](row.input, tmp_path)
    assert outcome == row.outcome, text
    assert row.text in text, text
    if row.absent:
        assert row.absent not in text, text


def test_the_table_is_large_and_its_ids_unique() -> None:
    ids = [row.id for row in ROWS]
    assert len(set(ids)) == len(ids)
    assert {row.outcome for row in ROWS} == {"refused", "handled"}
    assert {row.target for row in ROWS} == {*RUNNERS, *WITH_CAPSYS}
    assert len(ROWS) >= 100


def counts(rows: list[Row]) -> dict[str, dict[str, int]]:
    """Per target: rows tried, refused cleanly, handled (each row's test checks its outcome)."""
    table: dict[str, dict[str, int]] = {}
    for row in rows:
        entry = table.setdefault(row.target, {"tried": 0, "refused": 0, "handled": 0})
        entry["tried"] += 1
        entry[row.outcome] += 1
    return table


SECOND_WAVE_SMOKE = {"server-count-goes-back-1-to-20-then-8", "server-error-beside-the-final-count",
                     "server-100-continue-first", "server-bare-cr-line-endings"}  # fmt: skip


def test_the_second_wave_has_its_own_rows_and_counts() -> None:
    """Issue 19: every surface it names is a target with rows, each refusing something."""
    wave = SECOND_WAVE_ROWS + [row for row in ROWS if row.id in SECOND_WAVE_SMOKE]
    table = counts(wave)
    assert set(table) == {"live", "router", "lock", "autotune", "calibration", "nodes",
                          "diagnose", "smoke", "server"}  # fmt: skip
    assert sum(entry["tried"] for entry in table.values()) == len(wave) >= 60
    assert all(entry["refused"] for name, entry in table.items() if name not in
               ("diagnose", "smoke"))  # fmt: skip
