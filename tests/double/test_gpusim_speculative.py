"""Speculative decoding in the double (gpusim/README.md, "Speculative decoding").

Expected numbers are worked out here from SGLang 0.5.23's own placement code (named at each
step), never from gpusim's or the planner's helpers. The resolution of the flags is also held to
the real SGLang in test_contract_speculative.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from gpusim.engine import Request, Scheduler
from gpusim.flags import parse_server_args
from gpusim.logs import METRICS_REPORTER, SPECULATIVE_HOOK
from gpusim.memory import GIB, MemoryArgs, StartupFailure, draft_kv_oom, plan_memory
from gpusim.model import load_model
from gpusim.speculative import SpecDecode, decode_model, resolve
from gpusim.state import Hardware, HardwareFileError, Timing
from gpusim_helpers import FIXTURES, KIMI, LLAMA, Server, init_root, start_server, stop_server
from prometheus_client.parser import text_string_to_metric_families
from test_gpusim_placement import kimi_weights_per_gpu

from gpusim import state

GPU_MIB = 97887
HOST_RAM = 400 * GIB
PRE_GIB = (97887 - 768) / 1024  # free GiB per GPU before weights (CUDA context 768 MiB)
MM_RESERVE_GIB = 100 / 1024  # SGLANG_VLM_CACHE_SIZE_MB: Kimi-K2.5 is multimodal
EAGLE3 = str(FIXTURES / "kimi-k2.5-eagle3")
RESET = (
    "Max running requests is reset to 48 for speculative decoding. You can override this by "
    "explicitly setting --max-running-requests."
)
SCHED_LABELS = {"engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank"}


def resolved(*flags: str, model: str = LLAMA):
    args = parse_server_args(["--model-path", model, *flags])
    return args, resolve(args, load_model(model))


def kimi_eagle3_plan(**kwargs: Any):
    _, spec = resolved(
        "--tp-size",
        "8",
        *("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", EAGLE3),
        *("--speculative-num-steps", "3", "--speculative-eagle-topk", "1"),
        *("--speculative-num-draft-tokens", "4"),
        model=KIMI,
    )
    assert spec is not None
    mem = MemoryArgs(tp_size=8, **kwargs)
    plan = plan_memory(
        load_model(KIMI), mem, GPU_MIB, [GPU_MIB] * 8, HOST_RAM, draft=spec.placement
    )
    return spec, plan


# ------------------------------------------------------------------------------ resolution


def test_unset_max_running_requests_is_reset_to_48_with_sglangs_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=SPECULATIVE_HOOK.name):
        _, spec = resolved("--speculative-algorithm", "NGRAM")
    assert spec is not None and spec.max_running_requests == 48
    assert spec.resolved["max_running_requests"] == 48
    lines = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert (SPECULATIVE_HOOK.name, "WARNING", RESET) in lines


def test_a_given_max_running_requests_stays(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=SPECULATIVE_HOOK.name):
        _, spec = resolved("--speculative-algorithm", "NGRAM", "--max-running-requests", "150")
    assert spec is not None and spec.max_running_requests == 150
    assert "max_running_requests" not in spec.resolved
    assert RESET not in caplog.text


def test_nextn_is_eagle_and_unset_params_follow_the_target() -> None:
    # _auto_choose_speculative_params: Llama (5, 4, 8); STANDALONE and most others (3, 1, 4).
    _, llama = resolved(
        "--speculative-algorithm", "nextn", "--speculative-draft-model-path", EAGLE3
    )
    assert llama is not None
    assert (llama.algorithm, llama.num_steps, llama.eagle_topk, llama.num_draft_tokens) == (
        "EAGLE",
        5,
        4,
        8,
    )
    _, kimi = resolved(
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", EAGLE3, model=KIMI
    )
    assert kimi is not None and (kimi.num_steps, kimi.eagle_topk, kimi.num_draft_tokens) == (
        3,
        1,
        4,
    )
    _, alone = resolved(
        "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", LLAMA
    )
    assert alone is not None and (alone.num_steps, alone.num_draft_tokens) == (3, 4)


def test_top_k_one_makes_draft_tokens_steps_plus_one() -> None:
    _, spec = resolved(
        *("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", EAGLE3),
        *("--speculative-num-steps", "3", "--speculative-eagle-topk", "1"),
        *("--speculative-num-draft-tokens", "8"),
    )
    assert spec is not None and spec.num_draft_tokens == 4


def test_ngram_defaults() -> None:
    # _handle_ngram: top-k = --speculative-ngram-max-bfs-breadth (10), draft tokens 12,
    # steps = 12 // 10.
    _, spec = resolved("--speculative-algorithm", "NGRAM")
    assert spec is not None
    assert (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens) == (1, 10, 12)
    assert spec.draft is None and spec.placement.draft_weight_bytes_per_rank == 0


@pytest.mark.parametrize(
    ("flags", "exc_type", "message"),
    [
        (
            ["--speculative-algorithm", "medusa"],
            "ValueError",
            "Unknown speculative algorithm name: MEDUSA",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--tp-size", "2", "--attn-dp-size", "2"],
            "ValueError",
            "Currently ngram speculative decoding does not support dp attention.",
        ),
        (
            [
                *("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path"),
                *(LLAMA, "--tp-size", "2", "--attn-dp-size", "2"),
            ],
            "ValueError",
            "Currently standalone speculative decoding does not support dp attention.",
        ),
        (
            [
                *("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", EAGLE3),
                *("--speculative-num-draft-tokens", "4"),
            ],
            "AssertionError",
            "",
        ),
        (
            ["--speculative-algorithm", "EAGLE3"],
            "ValueError",
            "gpusim: --speculative-algorithm EAGLE3 without --speculative-draft-model-path",
        ),
        (
            ["--speculative-algorithm", "DFLASH"],
            "ValueError",
            "gpusim: --speculative-algorithm DFLASH is accepted by SGLang 0.5.23 but not",
        ),
    ],
)
def test_flag_sets_sglang_refuses(flags: list[str], exc_type: str, message: str) -> None:
    with pytest.raises(StartupFailure) as caught:
        resolved(*flags)
    assert caught.value.exc_type == exc_type
    assert caught.value.message.startswith(message)
    assert caught.value.phase == "args"


def test_an_mtp_target_is_its_own_draft(tmp_path: Path) -> None:
    """DeepseekV3ForCausalLM without a draft path: the draft is the target's MTP layer
    (num_nextn_predict_layers), loaded from the target's directory."""
    config = json.loads((Path(KIMI) / "config.json").read_text())["text_config"]
    config |= {"architectures": ["DeepseekV3ForCausalLM"], "num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    index = {"metadata": {"total_size": 62 * 10**9}, "weight_map": {}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _, spec = resolved("--speculative-algorithm", "EAGLE", "--tp-size", "8", model=str(tmp_path))
    assert spec is not None
    assert spec.resolved["speculative_draft_model_path"] == str(tmp_path)
    assert spec.draft_kv_layers == 1
    # The MTP layer priced as its share of the checkpoint's 61 + 1 layers, split over TP 8.
    assert spec.placement.draft_weight_bytes_per_rank == pytest.approx(62 * 10**9 / 62 / 8)


# ------------------------------------------------------------------------------ placement


def test_eagle3_draft_of_kimi_worked_example() -> None:
    """Kimi-K2.5 int4 TP8 at 0.85 with the EAGLE-3 draft fixture (one Llama-style MHA layer,
    64 KV heads of 128, bf16), from 0.5.23's code:
    - scheduler.py init_model_worker: the draft's weights load before the target's KV budget is
      profiled: 2382317568 B / 8 per GPU come out of `rest` with the target's.
    - pool_configurator.py DefaultPoolConfigurator (EAGLE family): the target's bytes per
      token grow by int(70272 x 1 draft layer / 61 layers) = 1152.
    - kv_cache_configurator.py (draft worker): the draft pool has the target's token count and
      its own cell: max(1, 64 // 8) heads x (128 + 128) x 1 layer x 2 B = 4096 B, of which
      4096 - 1152 = 2944 B per token were never priced.
    The target's weights per GPU as SGLang places them: 71.0939 GiB (test_gpusim_placement)."""
    _, plan = kimi_eagle3_plan(mem_fraction_static=0.85)
    target_w = kimi_weights_per_gpu(8) / GIB
    draft_w = 2382317568 / 8 / GIB
    rest = PRE_GIB - target_w - draft_w - PRE_GIB * 0.15 - MM_RESERVE_GIB
    tokens = math.floor(rest * GIB / (70272 + 1152))
    assert plan.max_total_num_tokens == tokens == 137517  # gpusim/README.md's figure
    assert plan.draft_weight_gib == pytest.approx(draft_w)
    assert plan.draft_budget_cell_size == 1152
    assert plan.draft_cell_size == 8 * 256 * 2 == 4096
    assert plan.draft_kv_gib == pytest.approx(tokens * 4096 / GIB)
    assert plan.draft_kv_overrun_mib == pytest.approx(tokens * 2944 / 2**20)
    assert plan.kv_gib == pytest.approx(tokens * 70272 / GIB)
    assert plan.max_running_requests == 48
    # Without speculation: 144009 tokens (test_gpusim_memory); the draft costs the difference.
    plain = plan_memory(
        load_model(KIMI), MemoryArgs(tp_size=8, mem_fraction_static=0.85), GPU_MIB,
        [GPU_MIB] * 8, HOST_RAM,
    )  # fmt: skip
    assert plain.max_total_num_tokens == 144009 > tokens
    # nvidia-smi shows the draft's weights and pool too.
    extra = (draft_w + tokens * 4096 / GIB) * 1024
    assert plan.rank_used_mib - plain.rank_used_mib == pytest.approx(
        extra + (tokens - 144009) * 70272 / 2**20 + plan.graph_total_mib - plain.graph_total_mib,
        abs=1,
    )


def test_the_reset_leaves_the_default_fraction_and_graph_size_chosen_before_it() -> None:
    # memory_hook.py runs before speculative_hook.py: mem_fraction_static and the decode graph
    # max bs are those of an unset --max-running-requests; only the graphs captured shrink to
    # the 48 request slots (get_batch_sizes_to_capture clamps to req_to_token_pool.size).
    _, spec_plan = kimi_eagle3_plan()
    plain = plan_memory(load_model(KIMI), MemoryArgs(tp_size=8), GPU_MIB, [GPU_MIB] * 8, HOST_RAM)
    assert spec_plan.mem_fraction_static == plain.mem_fraction_static
    assert spec_plan.decode_graph_max_bs == plain.decode_graph_max_bs == 512
    assert spec_plan.captured_decode_bs == 48
    # 23 speculative capture sizes up to 48 (1..8, 10..32 by 2, 40, 44, 48) x 8 MiB, the fp32
    # logits of 48 x 4 verified tokens x 163840, 16 live bf16 activations of 192 x 7168.
    assert spec_plan.graph_mib["decode"] == pytest.approx(
        23 * 8 + 192 * 163840 * 4 / 2**20 + 16 * 192 * 7168 * 2 / 2**20
    )
    assert spec_plan.decode_graph_phase == "target_verify"


def test_ngram_places_no_draft() -> None:
    _, spec = resolved("--speculative-algorithm", "NGRAM", "--tp-size", "8", model=KIMI)
    assert spec is not None
    args = MemoryArgs(tp_size=8, mem_fraction_static=0.85)
    plan = plan_memory(
        load_model(KIMI), args, GPU_MIB, [GPU_MIB] * 8, HOST_RAM, draft=spec.placement
    )
    assert plan.max_total_num_tokens == 144009  # the plain plan's
    assert (plan.draft_weight_gib, plan.draft_kv_gib, plan.draft_kv_overrun_mib) == (0, 0, 0)
    assert plan.max_running_requests == 48


def test_a_draft_pool_larger_than_the_headroom_runs_out_of_memory(tmp_path: Path) -> None:
    """The priced share is the target's per-layer size; a draft whose own cell is much larger
    takes the rest from outside the static pool, and can run out of it."""
    config = json.loads((Path(EAGLE3) / "config.json").read_text())
    # 24 MHA layers of 128 KV heads: 16 heads per GPU x 256 x 24 x 2 = 196608 B/token/GPU.
    config |= {"num_hidden_layers": 24, "num_key_value_heads": 128, "num_attention_heads": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors.index.json").write_text(
        (Path(EAGLE3) / "model.safetensors.index.json").read_text()
    )
    _, spec = resolved(
        *("--tp-size", "8", "--speculative-algorithm", "EAGLE3"),
        *("--speculative-draft-model-path", str(tmp_path)),
        model=KIMI,
    )
    assert spec is not None
    mem = MemoryArgs(tp_size=8, mem_fraction_static=0.85)
    plan = plan_memory(
        load_model(KIMI), mem, GPU_MIB, [GPU_MIB] * 8, HOST_RAM, draft=spec.placement
    )
    # Priced: int(70272 x 24 / 61) = 27648 B/token; held: 196608 B/token.
    assert plan.draft_budget_cell_size == 27648
    assert plan.draft_cell_size == 196608
    assert plan.draft_kv_overrun_mib > plan.headroom_mib
    failure = draft_kv_oom(plan)
    assert failure is not None and failure.exc_type == "torch.OutOfMemoryError"
    assert draft_kv_oom(kimi_eagle3_plan(mem_fraction_static=0.85)[1]) is None


# ------------------------------------------------------------------------------ speed


def spec_decode(accept: float, draft_tokens: int = 4, steps: int = 3, cost: float = 0.0):
    return SpecDecode("EAGLE3", accept, steps, draft_tokens, cost)


def test_speculation_pays_at_small_batches_and_costs_at_large_ones() -> None:
    s = 0.01  # Timing.batch_slowdown default
    spec = spec_decode(2.5)
    # Verify of B x 4 rows: B = 1 costs 1.03 steps for 2.5 tokens; B = 200 costs 8.99 steps for
    # 2.5 tokens where plain decoding costs 2.99 for 1.
    assert spec.speedup(1, s) == pytest.approx(2.5 / 1.03)
    assert spec.speedup(200, s) == pytest.approx(2.5 * 2.99 / 8.99)
    assert spec.speedup(200, s) < 1 < spec.speedup(1, s)
    # B* = (1 - s)(L - 1) / (s (D - L)) = 0.99 x 1.5 / (0.01 x 1.5) = 99.
    assert spec.breakeven_batch(s) == pytest.approx(99)
    assert spec.speedup(99, s) == pytest.approx(1)


def test_the_crossover_follows_the_accept_length_and_the_draft_cost() -> None:
    s = 0.01
    crossovers = [spec_decode(accept).breakeven_batch(s) for accept in (1.5, 2.5, 3.5)]
    assert crossovers == sorted(crossovers) and crossovers[0] < 99 < crossovers[2]
    assert spec_decode(1.0).breakeven_batch(s) == 0  # accepting nothing never pays
    assert spec_decode(2.5, cost=0.1).breakeven_batch(s) < 99  # a draft that costs lowers it


def test_decode_model_takes_the_knob_capped_by_what_a_step_can_accept() -> None:
    _, spec = resolved(
        *("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", EAGLE3),
        *("--speculative-num-steps", "3", "--speculative-eagle-topk", "1"),
        *("--speculative-num-draft-tokens", "4"),
        model=KIMI,
    )
    assert spec is not None
    kimi = load_model(KIMI)
    assert decode_model(spec, Timing(spec_accept_length=2.5), kimi).accept_length == 2.5
    assert decode_model(spec, Timing(spec_accept_length=9.0), kimi).accept_length == 4.0
    # A draft forward costs its weights' share of the target's.
    assert decode_model(spec, Timing(), kimi).draft_cost == pytest.approx(2382317568 / 594231324672)


def test_hardware_file_refuses_an_accept_length_below_one() -> None:
    with pytest.raises(HardwareFileError, match=r"timing\.spec_accept_length must be"):
        Hardware.from_dict({"timing": {"spec_accept_length": 0.5}})
    assert Hardware.from_dict({"timing": {"spec_accept_length": 3}}).timing.spec_accept_length == 3


def run_batch(spec: SpecDecode | None, batch: int, steps: int = 60) -> tuple[float, Scheduler]:
    """Tokens per simulated second of `batch` long requests, and the scheduler."""
    args = MemoryArgs(tp_size=1, mem_fraction_static=0.85, max_running_requests=512)
    plan = plan_memory(load_model(LLAMA), args, GPU_MIB, [GPU_MIB], HOST_RAM)
    timing = Timing(decode_step_s=0.05, batch_slowdown=0.01, prefill_token_s=0.0)
    scheduler = Scheduler(plan, timing, decode_log_interval=10, realtime=False, spec=spec)

    async def go() -> float:
        task = asyncio.create_task(scheduler.run())
        for i in range(batch):
            scheduler.submit(Request(rid=f"r{i}", prompt_tokens=16, max_new_tokens=2000))
        while scheduler.forward_ct_decode < steps:
            await asyncio.sleep(0)
        start_tokens, start_time = scheduler.stats.generation_tokens_total, scheduler.sim_time
        while scheduler.forward_ct_decode < 2 * steps:
            await asyncio.sleep(0)
        task.cancel()
        made = scheduler.stats.generation_tokens_total - start_tokens
        return made / (scheduler.sim_time - start_time)

    return asyncio.run(asyncio.wait_for(go(), 60)), scheduler


def test_the_scheduler_runs_the_speed_model() -> None:
    spec = spec_decode(2.5)
    for batch in (4, 200):
        with_spec, _ = run_batch(spec, batch)
        plain, _ = run_batch(None, batch)
        assert with_spec / plain == pytest.approx(spec.speedup(batch, 0.01), rel=1e-6)
    assert run_batch(spec, 4)[0] > run_batch(None, 4)[0]
    assert run_batch(spec, 200)[0] < run_batch(None, 200)[0]


def test_decode_lines_carry_accept_len_and_rate(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=METRICS_REPORTER.name):
        _, scheduler = run_batch(spec_decode(2.5), 8, steps=20)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch")]
    assert lines
    # Every 10-step interval pays out 2,3,2,3,...: 25 tokens per request = 2.50; rate
    # = (accepted - one bonus token per step) / (steps x (draft tokens - 1)) = 1.5 / 3.
    pattern = re.compile(
        r"^Decode batch, #running-req: 8, #token: \d+, token usage: \d\.\d\d, "
        r"accept len: 2\.50, accept rate: 0\.50, cuda graph: (True|False), "
        r"gen throughput \(token/s\): [\d.]+, #queue-req: 0$"
    )
    assert all(pattern.match(line) for line in lines), lines
    stats = scheduler.spec_stats
    assert (stats.accept_length, stats.accept_rate) == (2.5, 0.5)
    assert (stats.num_steps, stats.num_draft_tokens) == (3, 4)


def test_plain_decode_lines_have_no_accept_len(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=METRICS_REPORTER.name):
        _, scheduler = run_batch(None, 4, steps=10)
    assert "Decode batch" in caplog.text and "accept len" not in caplog.text
    assert scheduler.spec_stats.accept_length == 0


# ------------------------------------------------------------------------------ the server


def _get(server: Server, path: str) -> bytes:
    with urllib.request.urlopen(server.url + path, timeout=30) as response:
        return response.read()


def _generate(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        server.url + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _spec_gauges(text: str) -> dict[str, Any]:
    return {
        family.name: family
        for family in text_string_to_metric_families(text)
        if family.name.startswith("sglang:spec_")
    }


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One speculative server (NGRAM, accept length 3) and one plain, same model."""
    tmp = tmp_path_factory.mktemp("spec-servers")
    started = []
    try:
        for name, extra in (
            ("spec", ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4")),
            ("plain", ()),
        ):
            root = init_root(tmp / name)
            hardware = state.load_hardware(root)
            hardware.timing.spec_accept_length = 3.0
            state.save_hardware(hardware, root)
            flags = ("--model-path", LLAMA, "--enable-metrics", "--decode-log-interval", "4")
            started.append(start_server(root, tmp, *flags, *extra))
        for server in started:
            server.wait_ready(60)
        yield {"spec": started[0], "plain": started[1]}
    finally:
        for server in started:
            stop_server(server)


def test_server_start_up_states_the_reset_before_server_args(servers: Any) -> None:
    log = servers["spec"].log()
    assert f"] {RESET}\n" in log
    assert log.index(RESET) < log.index("server_args=")
    info = json.loads(_get(servers["spec"], "/server_info"))
    assert info["max_running_requests"] == 48
    assert (info["speculative_algorithm"], info["speculative_num_draft_tokens"]) == ("NGRAM", 4)
    assert "max_running_requests=48," in log
    assert RESET not in servers["plain"].log()


def test_speculation_changes_speed_not_text(servers: Any) -> None:
    body = {
        "text": "tell me about the weather",
        "sampling_params": {"max_new_tokens": 30, "temperature": 0.7},
    }
    answers = {name: _generate(server, body) for name, server in servers.items()}
    assert answers["spec"]["text"] == answers["plain"]["text"]
    assert answers["spec"]["output_ids"] == answers["plain"]["output_ids"]
    assert answers["spec"]["meta_info"]["completion_tokens"] == 30
    # Streamed, the speculative server's tokens come 3 per verify step (the last step, 2): every
    # chunk ends on a step (a slow reader may see several steps in one chunk).
    request = urllib.request.Request(
        servers["spec"].url + "/generate",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        events = [e for e in response.read().decode().split("\n\n") if e]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e != "data: [DONE]"]
    assert chunks[-1]["text"] == answers["plain"]["text"]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert set(lengths) <= {1, *range(4, 29, 3), 30} and lengths[-1] == 30


def test_spec_metrics_are_published_like_sglangs(servers: Any) -> None:
    plain = _spec_gauges(_get(servers["plain"], "/metrics").decode())
    for family in plain.values():
        assert family.type == "gauge"
        assert all(sample.value == 0 for sample in family.samples)
    _generate(servers["spec"], {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 40}})
    gauges = _spec_gauges(_get(servers["spec"], "/metrics").decode())
    values = {}
    for name in (
        "sglang:spec_accept_length",
        "sglang:spec_accept_rate",
        "sglang:spec_num_steps",
        "sglang:spec_num_draft_tokens",
    ):
        family = gauges[name]
        assert family.type == "gauge"
        (sample,) = family.samples
        assert set(sample.labels) == SCHED_LABELS
        values[name] = sample.value
    # Accept length 3 of at most 4 draft tokens: rate (3 - 1) / (4 - 1); NGRAM's steps 4 // 10.
    assert values == {
        "sglang:spec_accept_length": 3.0,
        "sglang:spec_accept_rate": pytest.approx(2 / 3),
        "sglang:spec_num_steps": 0,
        "sglang:spec_num_draft_tokens": 4,
    }
    # Decode lines every 4 steps; the last interval is the 40-token request's alone (its
    # 39 decode tokens are 13 steps of 3: the warm-up's capped last step is in the first line).
    decode = [line for line in servers["spec"].log().splitlines() if "Decode batch" in line]
    assert all(
        re.search(r"accept len: \d\.\d\d, accept rate: \d\.\d\d, cuda graph: ", d) for d in decode
    )
    assert "token usage: 0.00, accept len: 3.00, accept rate: 0.67, cuda graph: " in decode[-1]


def test_a_draft_that_does_not_fit_fails_start_up_like_an_oom(
    tmp_path: Path,
) -> None:
    config = json.loads((Path(EAGLE3) / "config.json").read_text())
    config |= {"num_hidden_layers": 24, "num_key_value_heads": 128, "num_attention_heads": 128}
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(config))
    (draft / "model.safetensors.index.json").write_text(
        (Path(EAGLE3) / "model.safetensors.index.json").read_text()
    )
    root = init_root(tmp_path / "state")
    server = start_server(
        root,
        tmp_path,
        *("--model-path", KIMI, "--tp-size", "8", "--mem-fraction-static", "0.85"),
        *("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft)),
    )
    try:
        server.proc.wait(60)
        log = server.log()
        assert "Scheduler hit an exception" in log and "torch.OutOfMemoryError" in log
        # The draft's weights loaded, the target's pool was allocated, the draft's was not.
        assert "type=LlamaForCausalLMEagle3" in log
        assert log.count("] KV Cache is allocated") == 8
    finally:
        stop_server(server)
