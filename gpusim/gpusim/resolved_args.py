"""The server arguments as SGLang 0.5.23 logs them: after `ServerArgs.__post_init__` resolved
its defaults (`server_args={...}`, srt/entrypoints/engine.py), not as the parser left them.

What the double resolves itself: the memory settings (srt/arg_groups/memory_hook.py, through
gpusim/memory.py's `resolve_defaults`: mem_fraction_static, chunked_prefill_size, the
attention-DP adjustments), the attention-DP spelling, the tokenizer path and served name (the
model path), page_size 1, hicache_ratio 2.0 and a random seed. The rest of what post-init fills
does not depend on anything the double models: `POST_INIT_CONSTANTS` holds those values as the
real CPU engine logs them for the contract test's flags (tests/fixtures/real-sglang-0.5.23-cpu/
startup.log), and tests/double/test_contract_real.py holds them to the live engine.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from gpusim.memory import MemoryArgs, resolve_attn_dp, resolve_defaults
from gpusim.model import ModelShape

REDACTED = "<redacted>"
# Defaults post-init sets from None (or from "auto") whatever the model and hardware.
POST_INIT_CONSTANTS: dict[str, Any] = {
    "enable_tf32_matmul": False,
    "prefill_decode_interval": 0,
    "swa_full_tokens_ratio": 0.8,
    "load_balance_method": "round_robin",
    "dcp_comm_backend": "ag_rs",
    "enable_tp_lm_head_all_to_all": False,
    "sampling_backend": "pytorch",
    "grammar_backend": "xgrammar",
    "boundary_reduction": "rs+rsv",
    "speculative_moe_runner_backend": "auto",
    "expert_distribution_recorder_buffer_size": 1000,
    "mamba_full_memory_ratio": 0.9,
    "mm_enable_dp_encoder": False,
    "mm_process_config": {},
    "mm_feature_transport": "cpu",
    "encoder_transfer_backend": "zmq_to_scheduler",
    "custom_weight_loader": [],
    "watermark_config": REDACTED,
}
# ServerArgs fields no flag sets (the parser's table has no entry for them), as logged.
UNFLAGGED_FIELDS: dict[str, Any] = {
    "uses_mamba_radix_cache": False,
    "stat_loggers": None,
    "grpc_worker_threads": 4,
    "enable_cp_tp_group_sharing": False,
    "_radix_eviction_policy_explicitly_set": False,
    "_swa_full_tokens_ratio_explicitly_set": False,
    "_speculative_draft_quantization_explicitly_set": False,
    "speculative_boundary_reduction": "rs+rsv",
    "custom_sigquit_handler": None,
    "aux_hidden_state_capture": None,
    "watermark_key": REDACTED,
    "watermark_key_b": REDACTED,
    "watermark_context_window": 4,
    "watermark_mixing_probability": 0.5,
    "watermark_max_probability": 1.0,
    "watermark_default_enabled": False,
    "watermark_enforce_all": False,
}


def resolve(
    parsed: dict[str, Any], model: ModelShape | None, mem_args: MemoryArgs, gpu_mib: int
) -> dict[str, Any]:
    """`parsed` (the parser's namespace as a dict) with post-init's defaults filled in.
    model None: the model directory does not load (start-up fails right after the line)."""
    out = dict(parsed)
    for key, value in POST_INIT_CONSTANTS.items():
        if out.get(key) in (None, "auto"):
            out[key] = copy.deepcopy(value)
    for key, value in UNFLAGGED_FIELDS.items():
        out.setdefault(key, value)
    model_path = out.get("model_path")
    out["tokenizer_path"] = out.get("tokenizer_path") or model_path
    out["served_model_name"] = out.get("served_model_name") or model_path
    out["page_size"] = out.get("page_size") or 1
    if out.get("hicache_ratio") is None:
        out["hicache_ratio"] = 2.0
    if out.get("random_seed") is None:
        out["random_seed"] = random.randint(0, 1 << 30)
    memory = copy.deepcopy(mem_args)
    resolve_attn_dp(memory)
    if memory.attn_dp_size > 1:
        # resolved_dict reports enable_dp_attention true whenever attention DP runs.
        out |= {"attn_dp_size": memory.attn_dp_size, "dp_size": 1, "enable_dp_attention": True}
    if model is not None:
        chunk, _ = resolve_defaults(memory, model, gpu_mib)
        out["mem_fraction_static"] = memory.mem_fraction_static
        out["chunked_prefill_size"] = chunk
        out["schedule_conservativeness"] = memory.schedule_conservativeness
    return out
