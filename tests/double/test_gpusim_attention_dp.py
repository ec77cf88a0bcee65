"""The double's attention-DP layout (gpusim/README.md, "Attention DP") against SGLang 0.5.23's
rules and against the planner (sglang_fleet), which must size each rank's pool the same way."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from gpusim.memory import GIB, MemoryArgs, StartupFailure, check_args, plan_memory
from gpusim.model import load_model
from gpusim_helpers import KIMI, Server, init_root, start_server
from test_gpusim_matches_planner import KIMI_TOKEN_GAP_FP8

from sglang_fleet.capacity.model_config import read_model_dir
from sglang_fleet.capacity.planner import plan as fleet_plan

GPU_MIB = 97887
HOST = {"gpu_memory_mib": GPU_MIB, "host_ram_gib": 400, "gpu_count": 8}
# Kimi-K2.5: q_b + kv_b + o per layer, 61 layers, plus the embedding, in bf16.
SPLIT = (1536 * 64 * 192 + 512 * 64 * 256 + 64 * 128 * 7168) * 61 * 2 + 163840 * 7168 * 2
KV_B_COPY = 512 * 64 * 256 * 61 * 2  # w_kc + w_vc, cut from kv_b_proj after loading


def double_plan(**flags: object):
    args = MemoryArgs(**({"tp_size": 8, "mem_fraction_static": 0.90} | flags))
    return plan_memory(load_model(KIMI), args, GPU_MIB, [GPU_MIB] * 8, 400 * GIB), args


@pytest.mark.parametrize("attn_dp", [1, 2, 4, 8])
def test_weights_per_gpu_and_pool_per_rank_match_the_planner(attn_dp: int) -> None:
    plan, _ = double_plan(attn_dp_size=attn_dp, kv_cache_dtype="fp8_e4m3", cuda_graph_max_bs=32)
    plain, _ = double_plan(kv_cache_dtype="fp8_e4m3", cuda_graph_max_bs=32)
    # Attention DP moves the attention-TP parts (and MLA's w_kc/w_vc copy of kv_b_proj) from
    # 1/8 of them to attn_dp/8 on each GPU; everything else stays where plain TP put it.
    extra = (SPLIT + KV_B_COPY) * (attn_dp / 8 - 1 / 8) / GIB
    assert plan.weight_gib == pytest.approx(plain.weight_gib + extra, abs=1e-6)
    config, weights = read_model_dir(KIMI)
    planned = fleet_plan(
        config,
        weights,
        {
            "tp_size": 8,
            "attn_dp_size": attn_dp,
            "mem_fraction_static": 0.90,
            "kv_cache_dtype": "fp8_e4m3",
            "cuda_graph_max_bs_decode": 32,
            "plan_layouts": False,
        },
        HOST,
    )
    # The planner splits over tp the bytes config.json leaves undescribed and the norms, which
    # the double keeps whole on every GPU (test_gpusim_matches_planner.py, PLANNER_SPLITS).
    assert 0 <= planned["kv_tokens_per_rank"] - plan.max_total_num_tokens <= KIMI_TOKEN_GAP_FP8


def test_sglangs_silent_adjustments() -> None:
    plan, args = double_plan(
        attn_dp_size=4, chunked_prefill_size=8192, max_running_requests=160, cuda_graph_max_bs=64
    )
    assert plan.chunked_prefill_size == 2048  # divided by the attention-DP size
    assert plan.max_running_requests == 40  # per rank
    assert args.schedule_conservativeness == pytest.approx(0.3)
    # Decode graphs, as the double allocates them: 12 captured sizes (1, 2, 4, 8, 12, 16..64
    # by 8) x 8 MiB, the fp32 logits buffer (64 rows x 163840), 16 live hidden-sized bf16
    # activations per token, and the attention-DP gather and combine buffers of 64 x 4 rows.
    rows_mib = 64 * 7168 * 2 / 2**20
    expected = 12 * 8 + 64 * 163840 * 4 / 2**20 + 16 * rows_mib + 2 * 4 * rows_mib
    assert plan.graph_mib["decode"] == pytest.approx(expected)


def test_deprecated_spelling_is_the_same_layout() -> None:
    new, _ = double_plan(attn_dp_size=4, cuda_graph_max_bs=64)
    old, args = double_plan(dp_size=4, enable_dp_attention=True, cuda_graph_max_bs=64)
    assert (args.attn_dp_size, args.dp_size) == (4, 1)
    assert old.max_total_num_tokens == new.max_total_num_tokens


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"attn_dp_size": 3}, "tp_size must be divisible by attn_dp_size * attn_cp_size"),
        ({"attn_dp_size": 2, "dp_size": 2}, "are not supported"),
    ],
)
def test_layouts_sglang_refuses(flags: dict, message: str) -> None:
    with pytest.raises(StartupFailure, match=re.escape(message)):
        check_args(MemoryArgs(tp_size=8, **flags))


def _metrics(server: Server) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        return response.read().decode()


def _series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


@pytest.mark.slow
def test_server_runs_one_scheduler_and_pool_per_rank(tmp_path: Path, servers: list[Server]) -> None:
    root = init_root(tmp_path / "gpusim")
    flags = (
        *("--model-path", KIMI, "--tp-size", "8", "--mem-fraction-static", "0.90"),
        *("--kv-cache-dtype", "fp8_e4m3", "--cuda-graph-max-bs-decode", "32"),
        *("--enable-metrics", "--decode-log-interval", "2"),
    )
    server = start_server(root, tmp_path, *flags, "--attn-dp-size", "4")
    servers.append(server)
    server.wait_ready(60)
    plan, _ = double_plan(attn_dp_size=4, kv_cache_dtype="fp8_e4m3", cuda_graph_max_bs=32)
    log = server.log()
    assert " DP3 TP6] Load weight end." in log
    assert f"#tokens: {plan.max_total_num_tokens}," in log
    for _ in range(4):  # round-robin: one request per rank
        body = json.dumps({"text": "one two three", "sampling_params": {"max_new_tokens": 8}})
        request = urllib.request.Request(
            server.url + "/generate",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.loads(response.read())["meta_info"]["completion_tokens"] == 8
    assert " DP3 TP6] Decode batch, #running-req: 1," in server.log()
    leaders = _series(_metrics(server), "sglang:max_total_num_tokens")
    assert len(leaders) == 4  # one per attention-DP rank (its first scheduler)
    for dp_rank, tp_rank in enumerate((0, 2, 4, 6)):
        assert any(f'dp_rank="{dp_rank}"' in s and f'tp_rank="{tp_rank}"' in s for s in leaders)
        assert all(s.endswith(f" {float(plan.max_total_num_tokens)}") for s in leaders)
    old = start_server(
        init_root(tmp_path / "gpusim-old"),  # its own GPUs: the first server holds these
        tmp_path,
        *flags,
        "--enable-metrics-for-all-schedulers",
        "--dp-size",
        "2",
        "--enable-dp-attention",
    )
    servers.append(old)
    old.wait_ready(60)
    assert (
        "'--enable-dp-attention' is deprecated and will be removed in a future release. "
        "Use '--attn-dp-size <dp-size>' instead."
    ) in old.log()
    assert " DP1 TP4] " in old.log()
    with urllib.request.urlopen(old.url + "/server_info", timeout=10) as response:
        info = json.loads(response.read())
    # Resolved as SGLang reports it: the deprecated spelling is attention DP 2, no replicas.
    assert (info["attn_dp_size"], info["dp_size"], info["enable_dp_attention"]) == (2, 1, True)
    every = _series(_metrics(old), "sglang:max_total_num_tokens")
    assert len(every) == 8  # all schedulers report, two attention-DP ranks
