"""The planner's speculative flag rules against the real SGLang 0.5.23's own resolution.

With the reference venv (scripts/sglang-reference-env.sh; path from SGLANG_REF_VENV), each flag
set below is resolved by the real `ServerArgs.resolve_once()` on the CPU engine with the tiny
Llama of gpusim/tools/make_tiny_llama.py as the target (nothing is started, no weight is
loaded), and sglang_fleet.capacity.speculative must say the same: the settings SGLang picks and
its 48 reset where it resolves, a refusal naming the flag where it raises or silently changes
what the operator asked for. Without the venv the test skips, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from gpusim_helpers import tiny_model

from sglang_fleet.capacity import speculative

REPO = Path(__file__).resolve().parent.parent
# The real resolution of each case: its settings, or the exception it raised.
PROBE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
from sglang.srt.arg_groups.overrides import resolved_view
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    try:
        args = prepare_server_args(argv)
        args.resolve_once()
        view = resolved_view(args)
        out[name] = {k: getattr(view, k) for k in (
            "speculative_algorithm", "max_running_requests", "speculative_num_steps",
            "speculative_eagle_topk", "speculative_num_draft_tokens")}
    except Exception as exc:
        out[name] = {"error": f"{type(exc).__name__}: {exc}"}
print("PROBE " + json.dumps(out))
"""


def reference_python() -> Path:
    venv = Path(os.environ.get("SGLANG_REF_VENV", REPO / ".cache" / "sglang-ref" / "venv"))
    venv = venv if venv.is_absolute() else REPO / venv
    if not (venv / ".stamp").is_file():
        pytest.skip(
            f"no complete SGLang reference venv at {venv}: build it with "
            "scripts/sglang-reference-env.sh, or set SGLANG_REF_VENV"
        )
    return venv / "bin" / "python"


def eagle3_draft(folder: Path) -> Path:
    """An EAGLE-3 draft's config.json for the tiny Llama (the resolution reads only that)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def cases(model: Path, draft: Path) -> dict[str, dict[str, Any]]:
    """name -> the flags, as the planner takes them."""
    eagle3 = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(draft)}
    steps3 = {"speculative_num_steps": 3, "speculative_eagle_topk": 1}
    return {
        "ngram": {"speculative_algorithm": "NGRAM"},
        "ngram given": {"speculative_algorithm": "NGRAM", "max_running_requests": 150},
        "eagle3 chosen by SGLang": eagle3,
        "nextn is eagle": eagle3 | {"speculative_algorithm": "NEXTN"},
        "eagle3 top-k 1": eagle3 | steps3 | {"speculative_num_draft_tokens": 4},
        "eagle3 top-k 1, draft tokens changed": eagle3
        | steps3
        | {"speculative_num_draft_tokens": 6},
        "eagle3 steps alone": eagle3 | {"speculative_num_steps": 3},
        "standalone with attention DP": {
            "speculative_algorithm": "STANDALONE",
            "speculative_draft_model_path": str(model),
            "tp_size": 2,
            "attn_dp_size": 2,
        },
        "ngram with attention DP": {
            "speculative_algorithm": "NGRAM",
            "tp_size": 2,
            "attn_dp_size": 2,
        },
    }


def argv(model: Path, flags: dict[str, Any]) -> list[str]:
    out = ["--model-path", str(model), "--device", "cpu"]
    for name, value in flags.items():
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out


@pytest.mark.slow
def test_the_flag_rules_say_what_the_real_resolution_does(tmp_path: Path):
    python = reference_python()
    model = tiny_model(python)
    draft = eagle3_draft(tmp_path / "draft")
    flag_sets = cases(model, draft)
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [str(python), "-c", PROBE, json.dumps({k: argv(model, v) for k, v in flag_sets.items()})],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    line = next((x for x in done.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line is not None, done.stderr[-3000:]
    real = json.loads(line.removeprefix("PROBE "))
    target = "LlamaForCausalLM"
    for name, flags in flag_sets.items():
        found = real[name]
        try:
            ours = speculative.settings(flags, target)
        except speculative.SpeculationError as exc:
            # SGLang raises, or resolves something else than was asked: refused, named.
            changed = "error" not in found and (
                found["speculative_num_draft_tokens"] != flags.get("speculative_num_draft_tokens")
            )
            assert "error" in found or changed, (name, found, exc.message)
            continue
        assert "error" not in found, (name, found)
        assert (found["speculative_algorithm"], found["speculative_num_steps"],
                found["speculative_eagle_topk"], found["speculative_num_draft_tokens"]) == (
            ours.algorithm, ours.num_steps, ours.eagle_topk, ours.num_draft_tokens
        ), name  # fmt: skip
        wanted = flags.get("max_running_requests") or speculative.RESET_MAX_RUNNING_REQUESTS
        assert found["max_running_requests"] == wanted, name
        assert speculative.reset_applies(flags) is (found["max_running_requests"] == 48), name
    # The refusals above are the ones SGLang itself raises, or silently changes.
    assert real["eagle3 top-k 1, draft tokens changed"]["speculative_num_draft_tokens"] == 4
    assert "does not support dp attention" in real["standalone with attention DP"]["error"]
    assert "does not support dp attention" in real["ngram with attention DP"]["error"]
    assert real["eagle3 steps alone"]["error"].startswith("TypeError")
