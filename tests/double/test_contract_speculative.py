"""Contract: the double's speculative decoding against the real SGLang 0.5.23.

What the real engine on these CPUs can show, and this module holds the double to:
- Flag resolution: the real `ServerArgs` resolution (the one the real launcher runs before it
  logs server_args=) is run once, in one process of the reference venv, for a set of flag sets
  (tests/double/real_spec_resolution.py, a few seconds); the double's resolution of the same
  flags must give the same algorithm, steps / top-k / draft tokens, max_running_requests (the
  reset to 48), the same warnings of `sglang.srt.arg_groups.speculative_hook` in the same
  order, and the same exception type and message where SGLang refuses.
- Metrics: the four speculative gauges are Gauges with the scheduler's labels in the wheel's
  metrics collector and on the real server's /metrics (fixture scraped from it), as in the
  double's.
- The decode line's `accept len` part is the wheel's own format string.

What the real engine cannot show here: a speculative server serving. Started with
`--speculative-algorithm NGRAM` (no draft model needed) the real CPU server resolves the flags
(the reset to 48 is logged) and then dies building the draft worker: the NGRAM worker imports
`sgl_kernel.speculative`, which the CPU env's sgl_kernel stand-in does not have (PyPI has no CPU
sgl-kernel build); with that import satisfied, the target's KV pool (which speculation makes
warm up its KV-copy kernel) calls `sgl_kernel.copy_all_layer_kv_cache_cpu`, a stand-in op. So
accept-length values, the decode line as printed, the draft's memory and the speed model are
checked against the wheel's code only (gpusim/README.md, "Speculative decoding").
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from gpusim.flags import parse_server_args
from gpusim.logs import SPECULATIVE_HOOK
from gpusim.memory import StartupFailure
from gpusim.model import load_model
from gpusim.sglang_metrics import SPEC_GAUGES
from gpusim.speculative import resolve
from gpusim_helpers import tiny_model
from prometheus_client.parser import text_string_to_metric_families
from test_contract_real import REF_VENV

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("real_spec_resolution.py")
WHEEL = REF_VENV / "lib" / "python3.11" / "site-packages" / "sglang"
REAL_METRICS = REPO / "tests" / "fixtures" / "real-sglang-0.5.23-cpu" / "metrics.txt"
CPU = ("--device", "cpu", "--attention-backend", "torch_native")
SYNC = ("--disable-overlap-schedule",)
SCHED_LABELS = {"engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank"}
pytestmark = pytest.mark.timeout(600)


def _cases(model: Path, draft: Path) -> dict[str, list[str]]:
    base = ["--model-path", str(model), *CPU]
    eagle3 = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft)]
    attn_dp = ["--tp-size", "2", "--attn-dp-size", "2"]
    return {
        "plain": [*base, *SYNC],
        "ngram": [*base, *SYNC, "--speculative-algorithm", "ngram"],
        "ngram_given": [
            *base,
            *SYNC,
            *("--speculative-algorithm", "NGRAM", "--max-running-requests", "150"),
            *("--speculative-num-draft-tokens", "8", "--speculative-ngram-max-bfs-breadth", "4"),
        ],
        "ngram_overlap": [*base, "--speculative-algorithm", "NGRAM"],
        "eagle3_auto": [*base, *SYNC, *eagle3],
        "eagle3_overlap": [*base, *eagle3],
        "nextn_chain": [
            *base,
            *SYNC,
            *("--speculative-algorithm", "NEXTN", "--speculative-draft-model-path", str(draft)),
            *("--speculative-num-steps", "2", "--speculative-eagle-topk", "1"),
            *("--speculative-num-draft-tokens", "5"),
        ],
        "standalone": [
            *base,
            *SYNC,
            *("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path"),
            *(str(model), "--max-running-requests", "150", "--enable-mixed-chunk"),
        ],
        "bogus": [*base, *SYNC, "--speculative-algorithm", "bogus"],
        "ngram_attn_dp": [*base, *SYNC, *attn_dp, "--speculative-algorithm", "NGRAM"],
        "standalone_attn_dp": [
            *base,
            *SYNC,
            *attn_dp,
            *("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path"),
            str(model),
        ],
        "topk_without_steps": [*base, *SYNC, *eagle3, "--speculative-eagle-topk", "2"],
    }


def _tiny_draft(folder: Path) -> Path:
    """A one-layer EAGLE-3 draft for the tiny Llama: a config (all SGLang's resolution reads)
    and the index the double reads its size from."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 1,
        "vocab_size": 32000,
        "draft_vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-06,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    index = {"metadata": {"total_size": 200000}, "weight_map": {}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python = REF_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(
            f"no SGLang reference venv at {REF_VENV}: build it with "
            "scripts/sglang-reference-env.sh (make pytest does), or set SGLANG_REF_VENV"
        )
    tmp = tmp_path_factory.mktemp("spec")
    model = tiny_model(python)
    cases = _cases(model, _tiny_draft(tmp / "draft"))
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [str(python), str(PROBE), str(tmp / "cases.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {"model": model, "cases": cases, "real": json.loads(done.stdout.splitlines()[-1])}


def _double(argv: list[str], model: Path, caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    """The double's resolution of the same flags, in the probe's shape."""
    caplog.clear()
    args = parse_server_args(argv)
    with caplog.at_level(logging.WARNING, logger=SPECULATIVE_HOOK.name):
        try:
            spec = resolve(args, load_model(str(model)))
            failure = None
        except StartupFailure as exc:
            spec, failure = None, exc
    out: dict[str, Any]
    if failure is not None:
        out = {"error": failure.exc_type, "message": failure.message}
    else:
        resolved = spec.resolved if spec is not None else {}
        out = {
            "speculative_algorithm": spec.algorithm if spec else None,
            "speculative_draft_model_path": resolved.get("speculative_draft_model_path"),
            "speculative_num_steps": spec.num_steps if spec else None,
            "speculative_eagle_topk": spec.eagle_topk if spec else None,
            "speculative_num_draft_tokens": spec.num_draft_tokens if spec else None,
            "max_running_requests": resolved.get("max_running_requests", args.max_running_requests),
            "enable_mixed_chunk": resolved.get("enable_mixed_chunk", args.enable_mixed_chunk),
        }
    out["warnings"] = [
        [r.name, r.levelname, r.getMessage()]
        for r in caplog.records
        if r.name == SPECULATIVE_HOOK.name
    ]
    return out


COMPARED = (
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "max_running_requests",
    "enable_mixed_chunk",
    "error",
    "message",
    "warnings",
)


@pytest.mark.parametrize(
    "case",
    [
        "plain",
        "ngram",
        "ngram_given",
        "ngram_overlap",
        "eagle3_auto",
        "eagle3_overlap",
        "nextn_chain",
        "standalone",
        "bogus",
        "ngram_attn_dp",
        "standalone_attn_dp",
        "topk_without_steps",
    ],
)
def test_the_double_resolves_speculative_flags_as_sglang(
    setup: dict[str, Any], case: str, caplog: pytest.LogCaptureFixture
) -> None:
    real = setup["real"][case]
    double = _double(setup["cases"][case], setup["model"], caplog)
    if real.get("speculative_algorithm") is None and "error" not in real:
        # No speculation: SGLang leaves the speculative fields unset.
        assert double["speculative_algorithm"] is None
        assert real["max_running_requests"] is None
        return
    mine = {key: double.get(key) for key in COMPARED}
    theirs = {key: real.get(key) for key in COMPARED}
    assert mine == theirs


def test_the_reset_is_the_real_servers_own_line(setup: dict[str, Any]) -> None:
    """The fact the planner warns about, as the real engine states it."""
    warnings = setup["real"]["ngram"]["warnings"]
    assert [SPECULATIVE_HOOK.name, "WARNING", (
        "Max running requests is reset to 48 for speculative decoding. You can override this by "
        "explicitly setting --max-running-requests."
    )] in warnings  # fmt: skip
    assert setup["real"]["ngram"]["max_running_requests"] == 48
    assert setup["real"]["ngram_given"]["max_running_requests"] == 150


def test_the_reset_leaves_the_default_fraction_alone(setup: dict[str, Any]) -> None:
    """memory_hook runs before speculative_hook: the default mem_fraction_static is chosen with
    max_running_requests unset, so speculation does not change it (the double's plan_memory
    applies the reset after the defaults for the same reason)."""
    real = setup["real"]
    fractions = {real[c]["mem_fraction_static"] for c in ("plain", "ngram", "eagle3_auto")}
    assert len(fractions) == 1


# ------------------------------------------------------------------------------ metrics


def _wheel(relative: str) -> str:
    path = WHEEL / relative
    if not path.exists():
        pytest.skip(f"no SGLang 0.5.23 wheel at {WHEEL}")
    return path.read_text()


def test_spec_gauges_are_the_wheels() -> None:
    source = _wheel("srt/observability/metrics_collector.py")
    for name in SPEC_GAUGES:
        block = re.search(
            rf"Gauge\(\s*name=\"{re.escape(name)}\",(?P<body>.*?)\n\s*\)", source, re.DOTALL
        )
        assert block is not None, name
        assert "labelnames=labels.keys()" in block["body"], name
        assert 'multiprocess_mode="mostrecent"' in block["body"], name


def test_spec_gauges_match_the_real_servers_metrics() -> None:
    real = {f.name: f for f in text_string_to_metric_families(REAL_METRICS.read_text())}
    for name in SPEC_GAUGES:
        family = real[name]
        assert family.type == "gauge", name
        keys = set().union(*(set(s.labels) for s in family.samples))
        assert keys == SCHED_LABELS, name


def test_accept_len_is_the_wheels_format() -> None:
    source = _wheel("srt/managers/scheduler_components/metrics_reporter.py")
    part = 'msg += f"accept len: {spec_accept_length:.2f}, accept rate: {spec_accept_rate:.2f}, "'
    assert part in source
    # After the token usage part, before the graph label (the decode line's order).
    head = source.index('msg = f"Decode batch{iter_msg}, #running-req: {num_running_reqs}, ')
    graph = source.index('f"{self._graph_backend_label}: {can_run_cuda_graph}, "', head)
    assert head < source.index(part, head) < graph
    # Rate: accepted drafts over (forward count x (draft tokens - 1)).
    assert "draft_per_round = get_spec().speculative_num_draft_tokens - 1" in source
